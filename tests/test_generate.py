"""Issue 16: generation on a fixed-size state (rfattn.hf.RFCache); tiny random Llamas."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
rfhf = pytest.importorskip("rfattn.hf")

V = 64


def _llama(kv_heads, seed=0, num_features=64, feature="posrf"):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads,
                                   max_position_embeddings=256)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    rfhf.attach_random_features(model, num_features=num_features, feature=feature, seed=0)
    model.set_attn_implementation("rfattn")
    return model


def _ids(b, t, seed=0):
    return torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(seed))


CACHE = rfhf.CACHE_KWARG  # the cache's keyword and output attribute in this transformers


def _gen(model, ids, **kw):
    kw = {"max_new_tokens": 64, "do_sample": False, "pad_token_id": 0, **kw}
    with torch.no_grad():
        return model.generate(ids, **kw)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_greedy_generation_on_the_state_equals_full_recompute(kv_heads):
    """64 greedy tokens on an RFCache (made by generate itself) are exactly those of recomputing
    the whole sequence at every step (use_cache=False) with the same features; the cache holds
    states, not keys, one per key/value head, and its size does not grow with the context."""
    model = _llama(kv_heads)
    ids = _ids(1, 12)
    cache = rfhf.RFCache()
    gen = _gen(model, ids, **{CACHE: cache}, return_dict_in_generate=True)
    ref = _gen(model, ids, use_cache=False)
    assert torch.equal(gen.sequences, ref)
    assert getattr(gen, CACHE) is cache and cache.get_seq_length() == 12 + 63
    size = cache.nbytes()
    # per layer S, z, offset: [1, Hkv, F, E] ..., one state per key/value head (grouped-query:
    # the group factor less than repeating the heads), fp64
    assert size == 2 * kv_heads * (64 * 8 + 64 + 1) * 8
    assert cache.layers[0].state.s.shape == (1, kv_heads, 64, 8)
    # the automatic cache is an RFCache too, and the same tokens come out
    auto = _gen(model, ids, return_dict_in_generate=True)
    assert isinstance(getattr(auto, CACHE), rfhf.RFCache)
    assert torch.equal(auto.sequences, ref)


def test_batched_left_padded_generation_equals_one_at_a_time():
    model = _llama(2)
    a, b = _ids(1, 12, seed=1), _ids(1, 7, seed=2)
    batch = torch.zeros(2, 12, dtype=torch.long)
    batch[0], batch[1, 5:] = a[0], b[0]
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    together = _gen(model, batch, attention_mask=mask, max_new_tokens=32)
    assert torch.equal(together[0], _gen(model, a, max_new_tokens=32)[0])
    assert torch.equal(together[1, 5:], _gen(model, b, max_new_tokens=32)[0])


def test_sampling_on_the_state_equals_sampling_on_recompute():
    """Sampling draws the same tokens from the RFCache as from full recomputes (same seed, the
    same distributions to fp64 rounding), on a grouped-query model."""
    model = _llama(2)
    ids = _ids(2, 8, seed=5)
    kw = dict(do_sample=True, top_k=0, temperature=1.0, max_new_tokens=24)
    torch.manual_seed(7)
    cached = _gen(model, ids, **kw)
    torch.manual_seed(7)
    recomputed = _gen(model, ids, use_cache=False, **kw)
    assert torch.equal(cached, recomputed)
    torch.manual_seed(8)
    assert not torch.equal(_gen(model, ids, **kw), cached)  # the draws do depend on the seed


def test_beam_search_reorders_states_and_scores_match_recompute():
    model = _llama(4)
    ids = _ids(1, 10, seed=3)
    out = _gen(model, ids, num_beams=3, max_new_tokens=12, output_scores=True,
               return_dict_in_generate=True, length_penalty=0.0)  # fmt: skip
    best = out.sequences[0]
    # the best beam's score is its sum of log-probabilities under a full recompute
    with torch.no_grad():
        logp = model(best[None]).logits.log_softmax(-1)[0, 9:-1]
    score = logp.gather(-1, best[10:, None]).sum()
    # (generate keeps its beam scores in float32)
    torch.testing.assert_close(out.sequences_scores[0].double(), score, rtol=1e-6, atol=1e-6)


def test_cache_to_state_dict_reset_and_crop(tmp_path):
    model = _llama(2)
    ids = _ids(1, 9, seed=4)
    cache = rfhf.RFCache()
    first = _gen(model, ids, **{CACHE: cache}, max_new_tokens=5)
    path = tmp_path / "cache.pt"
    torch.save(cache.state_dict(), path)
    restored = rfhf.RFCache.from_state_dict(torch.load(path)).to(torch.float64)
    assert restored.get_seq_length() == cache.get_seq_length() == 13
    # continuing from the restored cache equals continuing from the original
    nxt = first[:, -1:]
    with torch.no_grad():
        a = model(nxt, **{CACHE: cache}).logits
        b = model(nxt, **{CACHE: restored}).logits
    assert torch.equal(a, b)
    with pytest.raises(NotImplementedError, match="cannot crop"):
        cache.crop(-1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0


def test_a_preallocated_cache_is_refused():
    """transformers' StaticCache holds keys past the last query (unfilled slots): the attention
    function cannot place the queries there, so generation says so (before: wrong tokens from
    the first step on, silently)."""
    model = _llama(2)
    with pytest.raises(NotImplementedError, match="static"):
        model.generate(_ids(1, 6), max_new_tokens=3, do_sample=False,
                       cache_implementation="static")  # fmt: skip
