"""Issue 16: generation on a fixed-size state (rfattn.hf.RFCache); tiny random Llamas."""

import copy

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
    # the automatic cache (transformers' DynamicCache) holds the same states, and the same
    # tokens come out
    auto = _gen(model, ids, return_dict_in_generate=True)
    assert all(isinstance(layer, rfhf.RFCacheLayer) for layer in getattr(auto, CACHE).layers)
    assert rfhf.cache_nbytes(getattr(auto, CACHE)) == size
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
    with pytest.raises(RuntimeError, match="cannot crop.*activate_past_recording"):
        cache.crop(-1)
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes() == 0


def _addresses(cache):
    return [[x.data_ptr() for x in layer.state] for layer in cache.layers]


@pytest.mark.parametrize("local", [{}, dict(window=4, sinks=2)], ids=["plain", "hybrid"])
def test_decoding_writes_the_states_in_place(local):
    """From the first forward on, every later forward and a beam reorder write each layer's
    state into the same tensors, marked static for torch.compile (the addresses CUDA graphs
    need); the logits stay those of recomputing; a snapshot (state_dict) stays as taken; while
    recording for crop each forward's state is new and the cache is not compileable."""
    model = _llama(2, num_features=16)
    rfhf.attach_random_features(model, **local)
    ids = _ids(2, 8, seed=3)
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True, **{CACHE: rfhf.RFCache()}), CACHE)
    assert cache.is_compileable
    first = _addresses(cache)
    assert all(hasattr(x, "_dynamo_static_input_type") for layer in cache.layers
               for x in layer.state)  # fmt: skip
    snap = cache.state_dict()
    toks, logits, cache = _loop(model, ids[:, -1:].clone().fill_(5), 4, cache=cache)
    assert _addresses(cache) == first
    assert not all(torch.equal(v, cache.state_dict()[k]) for k, v in snap.items())
    cache.reorder_cache(torch.tensor([1, 0]))
    assert _addresses(cache) == first
    with torch.no_grad():
        full = model(torch.cat([ids, ids[:, -1:].clone().fill_(5), toks], 1)).logits[:, -1]
    torch.testing.assert_close(logits[:, -1], full, rtol=1e-10, atol=1e-12)
    cache.activate_past_recording()
    assert not cache.is_compileable
    kept = _states(cache)
    _loop(model, toks[:, -1:], 0, cache=cache)
    assert [[x.data_ptr() for x in s] for s in kept] == first  # the recorded one untouched
    assert _addresses(cache) != first


def test_a_text_generation_pipeline_decodes_on_the_states(monkeypatch):
    """transformers.pipeline("text-generation") over an rfattn model (a word-level tokenizer
    made here): every forward keeps a fixed-size state in each layer (one per layer per token
    generated), and the tokens are those of greedy full recomputes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    model = _llama(2, num_features=16)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0",
                                                     pad_token="w0")  # fmt: skip
    kept, keep = [], rfhf.RFCacheLayer.keep
    monkeypatch.setattr(rfhf.RFCacheLayer, "keep",
                        lambda layer, state: kept.append(type(state)) or keep(layer, state))
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    got = pipe("w3 w5 w7 w9", max_new_tokens=8, do_sample=False, return_tensors=True)
    want = _gen(model, torch.tensor([[3, 5, 7, 9]]), max_new_tokens=8, use_cache=False)
    assert got[0]["generated_token_ids"] == want[0].tolist()
    assert kept == [rfhf.RFState] * 2 * 8


@pytest.mark.parametrize("local", [{}, dict(window=4, sinks=2)], ids=["plain", "hybrid"])
def test_an_eager_decoding_step_copies_nothing_from_the_host_and_never_syncs(local):
    """One cached forward of a token without an attention mask, eager (the torch path here),
    counted through a dispatch mode: no tensor made from host data, nothing read on the host
    (before: the blocked path's kept value buffer was filled by item assignments of numbers, a
    copy from the host each). With a padding mask eager mode reads once whether any key is
    padding, as transformers' own SDPA mask does; a compiled step does not (the fullgraph
    test)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/ at the root
    from bench.opcount import OpCounter

    model = _llama(2, num_features=16)
    rfhf.attach_random_features(model, **local)
    _, _, cache = _loop(model, _ids(2, 8, seed=2), 1)
    with torch.no_grad(), OpCounter() as counter:
        model(_ids(2, 1, seed=3), use_cache=True, **{CACHE: cache})
    assert counter.of_kind("copy", "sync") == {}


@pytest.mark.skipif(tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24),
                    reason="before 5.24 the state layer reaches the attention function through "
                    "a weak dictionary, where dynamo breaks the graph")  # fmt: skip
def test_generate_compiles_its_decoding_steps_on_an_rfcache():
    """An RFCache is compileable, so generate() compiles its decoding steps by itself where
    transformers compiles (here asked to on the CPU through compile_config): whole graphs
    (fullgraph), and the greedy tokens of recomputing the whole sequence each step (fp64)."""
    from transformers import CompileConfig

    model = _llama(2, num_features=16)
    ids = _ids(1, 8, seed=11)
    want = _gen(model, ids, max_new_tokens=12, use_cache=False)
    torch._dynamo.reset()
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    cache = rfhf.RFCache()
    assert cache.is_compileable
    got = _gen(model, ids, max_new_tokens=12, compile_config=config, **{CACHE: cache})
    assert hasattr(model, "_compiled_call")  # the decoding steps ran compiled
    assert torch.equal(got, want)


def test_a_preallocated_cache_is_refused():
    """transformers' StaticCache holds keys past the last query (unfilled slots): the attention
    function cannot place the queries there, so generation says so (before: wrong tokens from
    the first step on, silently)."""
    model = _llama(2)
    with pytest.raises(NotImplementedError, match="static"):
        model.generate(_ids(1, 6), max_new_tokens=3, do_sample=False,
                       cache_implementation="static")  # fmt: skip


def _loop(model, ids, steps, cache=None, tokens=None):
    """The hand-written decoding loop: ``ids`` in one forward (transformers makes the cache
    unless one is given), then ``steps`` forwards of one token each (greedy, or ``tokens``);
    returns the tokens, each forward's last logits and the cache."""
    kw = {} if cache is None else {CACHE: cache}
    with torch.no_grad():
        out = model(ids, use_cache=True, **kw)
        logits, toks = [out.logits[:, -1]], []
        for i in range(steps):
            tok = logits[-1].argmax(-1, keepdim=True) if tokens is None else tokens[:, i : i + 1]
            toks.append(tok)
            out = model(tok, use_cache=True, **{CACHE: getattr(out, CACHE)})
            logits.append(out.logits[:, -1])
    return torch.cat([ids[:, :0], *toks], 1), torch.stack(logits, 1), getattr(out, CACHE)


def test_a_hand_written_loop_keeps_states_not_keys():
    """model(ids, use_cache=True), then one token per forward on out.cache: the cache
    transformers makes keeps the fixed-size states (its bytes the same at 16 and 64 tokens of
    context and after decoding; before: every key and value) and the greedy tokens and logits
    are those of recomputing the whole sequence at every step."""
    model = _llama(2, num_features=16)
    sizes = []
    for t in (16, 64):
        with torch.no_grad():
            cache = getattr(model(_ids(1, t, seed=t), use_cache=True), CACHE)
        assert type(cache) is transformers.DynamicCache
        assert all(isinstance(layer, rfhf.RFCacheLayer) for layer in cache.layers)
        sizes.append(rfhf.cache_nbytes(cache))
    ids = _ids(1, 16, seed=16)
    toks, logits, cache = _loop(model, ids, 8)
    sizes.append(rfhf.cache_nbytes(cache))
    assert sizes[0] == sizes[1] == sizes[2] == 2 * 2 * (16 * 8 + 16 + 1) * 8
    assert cache.get_seq_length() == 16 + 8
    assert torch.equal(toks, _gen(model, ids, use_cache=False, max_new_tokens=8)[:, 16:])
    with torch.no_grad():
        full = model(torch.cat([ids, toks], 1), use_cache=False).logits[:, 15:]
    torch.testing.assert_close(logits, full, rtol=1e-10, atol=1e-12)



def test_which_models_and_caches_get_states():
    """The hook that gives caches states is on a model built with attn_implementation="rfattn"
    (no attach_random_features: features drawn in the first forward) from its first forward,
    and reaches a DynamicCache built without a config (its layers added as they come); a model
    switched to rfattn without attach_random_features gets it in its first forward, whose own
    cache keeps keys; a model in training mode keeps transformers' cache."""
    cfg = copy.deepcopy(_llama(2).config)
    del cfg.rfattn
    ids = _ids(1, 5)

    def layers(model, **kw):
        with torch.no_grad():
            cache = getattr(model(ids, use_cache=True, **kw), CACHE)
        return {type(layer).__name__ for layer in cache.layers}

    cfg._attn_implementation = "rfattn"
    built = transformers.LlamaForCausalLM(cfg).double().eval()
    assert layers(built) == {"RFCacheLayer"}
    assert layers(built, **{CACHE: transformers.DynamicCache()}) == {"RFCacheLayer"}
    cfg._attn_implementation = "sdpa"
    switched = transformers.LlamaForCausalLM(copy.deepcopy(cfg)).double().eval()
    switched.set_attn_implementation("rfattn")
    assert [layers(switched), layers(switched)] == [{"DynamicLayer"}, {"RFCacheLayer"}]
    assert layers(switched.train()) == {"DynamicLayer"}


@pytest.mark.parametrize("how", ["beam", "left-padded"])
def test_generate_turns_a_given_dynamic_cache_into_states(how):
    """An empty DynamicCache(config=...) handed to generate keeps states too (before: the keys
    and values of every token), for beam search (states reordered) and a left-padded batch;
    the tokens are those of full recomputes."""
    model = _llama(2, num_features=16)
    if how == "beam":
        ids, kw = _ids(1, 10, seed=3), dict(num_beams=3, length_penalty=0.0)
    else:
        ids, mask = _ids(2, 10, seed=4), torch.ones(2, 10, dtype=torch.long)
        ids[1, :4], mask[1, :4] = 0, 0
        kw = dict(attention_mask=mask)
    cache = transformers.DynamicCache(config=model.config)
    got = _gen(model, ids, max_new_tokens=8, **{CACHE: cache}, **kw)
    assert all(isinstance(layer, rfhf.RFCacheLayer) for layer in cache.layers)
    rows = 3 if how == "beam" else 2  # beams or sequences; per row 2 layers of S, z, offset
    assert rfhf.cache_nbytes(cache) == rows * 2 * 2 * (16 * 8 + 16 + 1) * 8
    assert torch.equal(got, _gen(model, ids, max_new_tokens=8, use_cache=False, **kw))


def _states(cache):
    return [layer.state for layer in cache.layers]


@pytest.mark.parametrize("local", [{}, dict(window=4, sinks=2)], ids=["plain", "hybrid"])
def test_crop_puts_the_states_back(local):
    """decode 10 tokens, crop 4, decode again: the states and logits of a run that never went
    past (fp64), exactly where the crop lands at the start of a forward, to rounding where it
    lands inside one; plain random features and the hybrid (window keys and sinks in the
    state); without recording, crop says what to do."""
    model = _llama(2, num_features=16)
    rfhf.attach_random_features(model, **local)
    ids, more = _ids(1, 12, seed=6), _ids(1, 13, seed=7)
    # the run that never went past: 6 tokens, then 3
    _, want, ref = _loop(model, ids, 9, tokens=more[:, :9])
    # the cache transformers makes, recording from the second forward on
    with torch.no_grad():
        cache = getattr(model(ids, use_cache=True), CACHE)
    cache.activate_past_recording()
    assert cache.is_croppable
    _, _, cache = _loop(model, more[:, :1], 9, cache=cache, tokens=more[:, 1:10])
    cache.crop(-4)
    assert cache.get_seq_length() == 12 + 6
    _, got, cache = _loop(model, more[:, 6:7], 2, cache=cache, tokens=more[:, 7:9])
    assert torch.equal(got, want[:, 7:])
    for a, b in zip(_states(cache), _states(ref), strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    # an RFCache recording before its layers exist; ten tokens in one forward, crop inside it
    cache = rfhf.RFCache()
    cache.activate_past_recording()
    _, _, cache = _loop(model, torch.cat([ids, more[:, :10]], 1), 0, cache=cache)
    cache.crop(-4)
    with pytest.raises(ValueError, match="cannot crop 1 tokens"):  # what was undone stays so
        cache.crop(-1)
    _, got, cache = _loop(model, more[:, 6:7], 2, cache=cache, tokens=more[:, 7:9])
    torch.testing.assert_close(got, want[:, 7:], rtol=1e-10, atol=1e-12)
    for a, b in zip(_states(cache), _states(ref), strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    # nothing unrecorded
    _, _, plain = _loop(model, ids, 1)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        plain.crop(-1)


@pytest.mark.parametrize("draft_impl", ["sdpa", "rfattn"])
def test_assisted_decoding_rolls_the_states_back(draft_impl):
    """generate(assistant_model=draft): the target checks the draft's tokens in one forward on
    its states and crops what it rejects (the draft's own cache too when it runs rfattn): the
    tokens of greedy full recomputes (before: refused, the cache could not crop)."""
    model = _llama(2, num_features=16)
    torch.manual_seed(1)
    draft = transformers.LlamaForCausalLM(copy.deepcopy(model.config)).double().eval()
    if draft_impl == "rfattn":
        rfhf.attach_random_features(draft, num_features=16, seed=1)
    draft.set_attn_implementation(draft_impl)
    ids = _ids(1, 10, seed=8)
    want = _gen(model, ids, max_new_tokens=16, use_cache=False)
    assert not torch.equal(_gen(draft, ids, max_new_tokens=16), want)  # some tokens rejected
    got = _gen(model, ids, max_new_tokens=16, assistant_model=draft, return_dict_in_generate=True)
    assert torch.equal(got.sequences, want)
    assert all(isinstance(layer, rfhf.RFCacheLayer) for layer in getattr(got, CACHE).layers)


def test_rfattns_own_calls_raise_no_deprecation_warning():
    """Attaching features, generate (the cache transformers makes, an RFCache given under
    CACHE_KWARG, beam search, assisted decoding with its crops) and the generation benchmark's
    decoding loop: no deprecation while a frame of rfattn or bench is on the stack, whether
    transformers warns (a FutureWarning, every time here) or logs it (once per process: re-armed
    here)."""
    import logging
    import pathlib
    import sys
    import traceback
    import warnings

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # bench/ at the root
    import bench.generate
    import rfattn

    ours = tuple(str(pathlib.Path(m.__file__).parent) for m in (rfattn, bench))
    seen = []

    def note(message):
        if "deprecat" in str(message).lower() and \
                any(f.filename.startswith(ours) for f in traceback.extract_stack()):  # fmt: skip
            seen.append(str(message))

    class _Logged(logging.Handler):
        def emit(self, record):
            note(record.getMessage())

    logging.Logger.warning_once.cache_clear()  # transformers' once-per-process memory
    handler, logger = _Logged(), logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *args, **kwargs: note(message)
            model = _llama(2, num_features=16)
            draft = _llama(2, seed=1, num_features=16)
            ids = _ids(1, 6, seed=9)
            _gen(model, ids, max_new_tokens=3)
            _gen(model, ids, max_new_tokens=3, **{CACHE: rfhf.RFCache()})
            _gen(model, ids, max_new_tokens=3, num_beams=2)
            _gen(model, ids, max_new_tokens=3, assistant_model=draft)
            bench.generate.decode_times(model, "rfattn", positions=9, prompt=6)
    finally:
        logger.removeHandler(handler)
    assert seen == []


@pytest.mark.skipif(tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24),
                    reason="before 5.24 an attention layer gives the cache's update no dict it "
                    "shares with the attention function: the state layer goes through a weak "
                    "dictionary, where dynamo breaks the graph")  # fmt: skip
@pytest.mark.parametrize("padded", [False, True])
def test_a_decode_step_compiles_whole_once_for_every_later_position(padded):
    """torch.compile(fullgraph=True, dynamic=True) of one cached forward (the hand-written
    loop's step): no graph break (the cache layer reaches the attention function through the
    attention layer's own keyword arguments, not a module-level dict; with an attention mask,
    as generate() and padded batches pass one, the mask is read without a host sync), one
    compilation for 64 positions (the position, the cache's token count, is symbolic from the
    first step; without dynamic=True torch compiles the first position's step, then once more
    with it dynamic), and logits equal to the eager steps' (float64)."""
    from torch._dynamo.testing import CompileCounter

    model = _llama(2, num_features=16)
    B = 2 if padded else 1
    ids = _ids(B, 8, seed=5)
    counter = CompileCounter()

    def step(tok, mask, cache):
        return model(tok, attention_mask=mask, use_cache=True, **{CACHE: cache}).logits

    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    logits = []
    for run in (step, compiled):
        with torch.no_grad():
            mask = None
            if padded:  # the second row left-padded by 3
                mask = torch.ones(B, 8, dtype=torch.long)
                mask[1, :3] = 0
            out = model(ids, attention_mask=mask, use_cache=True)
            cache, tok, steps = getattr(out, CACHE), out.logits[:, -1:].argmax(-1), []
            for _ in range(64):
                if padded:
                    mask = torch.cat((mask, mask.new_ones(B, 1)), 1)
                steps.append(run(tok, mask, cache))
                tok = steps[-1][:, -1:].argmax(-1)
        assert all(isinstance(layer, rfhf.RFCacheLayer) for layer in cache.layers)
        logits.append(torch.cat(steps, 1))
    assert counter.frame_count == 1
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-12, atol=1e-12)
