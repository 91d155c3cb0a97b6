"""Issue 8: transformers integration (attn_implementation="rfattn"); tiny random configs only."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
rfhf = pytest.importorskip("rfattn.hf")

V, T = 64, 24


#: the tiny configuration both architectures share
SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4)  # fmt: skip


def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg)


def _bert(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(**SMALL, max_position_embeddings=64)
    return transformers.BertModel(cfg)


def _ids(seed=0):
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def _run(model, impl, ids, mask, num_features=None):
    if num_features is not None:
        rfhf.attach_random_features(model, num_features=num_features, seed=0)
    model.set_attn_implementation(impl)
    out = model(ids, attention_mask=mask)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_outputs_approach_sdpa_as_m_grows(arch):
    model = (_llama() if arch == "llama" else _bert()).eval()
    ids = _ids()
    mask = torch.ones(2, T, dtype=torch.long)
    if arch == "llama":
        mask[1, :5] = 0  # left padding
    else:
        mask[1, -6:] = 0  # right padding
    valid = mask.bool()
    with torch.no_grad():
        ref = _run(model, "sdpa", ids, mask)[valid]
        err = {}
        for m in (16, 2048):
            out = _run(model, "rfattn", ids, mask, num_features=m)[valid]
            err[m] = ((out - ref).norm() / ref.norm()).item()
    assert err[2048] < 0.3 * err[16], err
    # the layers really ran rfattn: each holds its own, distinctly seeded features
    feats = [m.rfattn_features for m in model.modules() if hasattr(m, "rfattn_features")]
    assert len(feats) == 2 and not torch.equal(feats[0].weight, feats[1].weight)
    assert any(k.endswith("rfattn_features.weight") for k in model.state_dict())


def test_padding_invariance_and_causality_llama():
    model = _llama().eval()
    rfhf.attach_random_features(model, num_features=64)
    model.set_attn_implementation("rfattn")
    ids = _ids(1)
    with torch.no_grad():
        full = model(ids).logits
        changed = ids.clone()
        changed[:, 15:] = (changed[:, 15:] + 1) % V
        torch.testing.assert_close(model(changed).logits[:, :15], full[:, :15])
        # right padding: the valid prefix is unchanged by what sits in the padded slots
        mask = torch.ones(2, T, dtype=torch.long)
        mask[:, 18:] = 0
        a = model(ids, attention_mask=mask).logits[:, :18]
        b = model(changed, attention_mask=mask).logits[:, :18]
        torch.testing.assert_close(a[:, :15], full[:, :15])
        torch.testing.assert_close(a[:, :15], b[:, :15])


def test_generate_with_cache_matches_full_forward():
    model = _llama().eval()
    rfhf.attach_random_features(model, num_features=64)
    model.set_attn_implementation("rfattn")
    ids = _ids(2)[:1, :10]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
        full = model(gen).logits[:, 9:-1].argmax(-1)
    assert torch.equal(gen[:, 10:], full)


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_backward_and_training_reduces_loss(arch):
    model = _llama(1) if arch == "llama" else _bert(1)
    rfhf.attach_random_features(model, num_features=32, feature="posrf")
    model.set_attn_implementation("rfattn")
    model.train()
    # synthetic task: predict the token one step back (llama) / a fixed token map (bert)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (8, 16), generator=g)
    head = None if arch == "llama" else torch.nn.Linear(32, V)
    params = list(model.parameters()) + ([] if head is None else list(head.parameters()))
    opt = torch.optim.Adam(params, lr=3e-3)
    losses = []
    for _ in range(25):
        if arch == "llama":
            loss = model(ids, labels=ids).loss
        else:
            h = model(ids).last_hidden_state
            loss = torch.nn.functional.cross_entropy(
                head(h).flatten(0, 1), ((ids * 7) % V).flatten()
            )
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    grads = {n: p.grad for n, p in model.named_parameters() if "pooler" not in n}  # unused head
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert any(("q_proj" in n or "query" in n) and g.abs().sum() > 0 for n, g in grads.items())
    assert losses[-1] < 0.8 * losses[0], losses


def test_unsupported_mask_pattern_raises():
    model = _bert().eval()
    rfhf.attach_random_features(model, num_features=16)
    model.set_attn_implementation("rfattn")
    band = torch.ones(T, T, dtype=torch.bool).triu(-3).tril(3)
    with pytest.raises(NotImplementedError, match="mask"):
        model(_ids(), attention_mask=band[None, None].expand(2, 1, T, T))


def test_lazy_features_from_config_and_register_idempotent():
    rfhf.register()
    rfhf.register()
    model = _bert().eval()
    model.config.rfattn = {"num_features": 24, "feature": "oprf", "seed": 5}
    model.set_attn_implementation("rfattn")
    with torch.no_grad():
        model(_ids())
    feats = [m.rfattn_features for m in model.modules() if hasattr(m, "rfattn_features")]
    assert [f.num_features for f in feats] == [24, 24] and feats[0].feature == "oprf"
    rf = rfhf.random_features_from_config(model.config, 1, 8)
    assert torch.equal(rf.weight, feats[1].weight)


@pytest.mark.parametrize("drop_features", [False, True])
def test_save_and_load_keep_trained_features(tmp_path, drop_features):
    """save_pretrained -> from_pretrained(attn_implementation="rfattn") keeps trained fastfoodl
    parameters and running statistics (before: reported as unexpected keys and rebuilt fresh from
    config.rfattn, outputs off by ~1); a checkpoint without them draws them from config.rfattn."""
    from safetensors.torch import load_file, save_file

    model = _bert()
    rfhf.attach_random_features(
        model, num_features=16, feature="oprf", weights="fastfoodl", stats="running", seed=0
    )
    model.set_attn_implementation("rfattn")
    ids = _ids()
    model.train()
    model(ids)  # running statistics move off their initial values
    with torch.no_grad():
        for mod in model.modules():
            for p in getattr(mod, "rfattn_features", torch.nn.Module()).parameters():
                p.add_(0.1)  # "trained"
    model.eval()
    with torch.no_grad():
        ref = model(ids).last_hidden_state
    model.save_pretrained(tmp_path)
    if drop_features:  # a checkpoint that holds config.rfattn but not the features
        for f in tmp_path.glob("*.safetensors"):
            sd = {k: v for k, v in load_file(f).items() if "rfattn_features" not in k}
            save_file(sd, f, metadata={"format": "pt"})
    loaded = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="rfattn").eval()
    with torch.no_grad():
        out = loaded(ids).last_hidden_state
    if drop_features:
        fresh = _bert()
        fresh.load_state_dict(loaded.state_dict(), strict=False)
        rfhf.attach_random_features(fresh, **loaded.config.rfattn)
        fresh.set_attn_implementation("rfattn")
        with torch.no_grad():
            expected = fresh.eval()(ids).last_hidden_state
        assert out.isfinite().all()
        torch.testing.assert_close(out, expected)
    else:
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_output_attentions_warns():
    model = _bert()
    model.set_attn_implementation("rfattn")
    rfhf._WARNED.clear()
    with pytest.warns(UserWarning, match="output_attentions"):
        out = model(_ids(), output_attentions=True)
    assert all(a is None for a in (out.attentions or ()))


def test_attach_again_starts_the_new_feature_without_the_old_ones_options():
    model = _llama()
    rfhf.attach_random_features(model, num_features=16, feature="oprf", stats="running")
    model.config.rfattn["head_maps"] = True  # as rfattn.calibrate notes it
    assert rfhf.attach_random_features(model, feature="posrf") == 2
    assert model.config.rfattn == dict(rfhf.DEFAULT_OPTIONS, num_features=16)
    rf = model.model.layers[0].self_attn.rfattn_features
    assert rf.feature == "posrf" and rf.num_features == 16 and rf.query_map is None
    # the same feature again keeps its options; what is given replaces
    rfhf.attach_random_features(model, feature="oprf", stats="running")
    rfhf.attach_random_features(model, seed=3)
    assert model.config.rfattn["stats"] == "running" and model.config.rfattn["seed"] == 3


@pytest.mark.parametrize("attached", [False, True])
def test_a_rejected_attach_changes_nothing(attached):
    model = _llama()
    if attached:
        rfhf.attach_random_features(model, num_features=16)
    before = dict(model.config.rfattn) if attached else None
    layers = [m.self_attn.rfattn_features if attached else None for m in model.model.layers]
    with pytest.raises(ValueError, match="num_featuers"):
        rfhf.attach_random_features(model, num_featuers=8)
    assert getattr(model.config, "rfattn", None) == before
    assert [getattr(m.self_attn, "rfattn_features", None) for m in model.model.layers] == layers
    # the config still builds models, and a corrected call works
    transformers.LlamaForCausalLM(model.config)
    assert rfhf.attach_random_features(model, num_features=8) == 2
    assert model.model.layers[1].self_attn.rfattn_features.num_features == 8


def test_attach_leaves_a_shared_config_alone(tmp_path):
    """Two models built from one config object: attaching to one changes neither the other
    nor the config (before: the second attach rewrote the first model's config.rfattn, whose
    checkpoint then failed to load, and every later model got features uninvited)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMALL, num_key_value_heads=2, max_position_embeddings=128)
    a, b = transformers.LlamaForCausalLM(cfg), transformers.LlamaForCausalLM(cfg)
    rfhf.attach_random_features(a, num_features=16)
    rfhf.attach_random_features(b, num_features=8)
    assert a.config.rfattn["num_features"] == 16 and b.config.rfattn["num_features"] == 8
    assert not hasattr(cfg, "rfattn")
    assert a.model.layers[0].self_attn.config is a.config  # every holder has the model's copy
    assert not hasattr(transformers.LlamaForCausalLM(cfg).model.layers[0].self_attn,
                       "rfattn_features")  # fmt: skip
    config_id = id(a.config)
    rfhf.attach_random_features(a, seed=1)  # a model's own config is kept
    assert id(a.config) == config_id
    a.set_attn_implementation("rfattn")
    a.save_pretrained(tmp_path)
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="rfattn")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, a(ids).logits)


def _features(model):
    return [m.rfattn_features for m in model.modules() if hasattr(m, "rfattn_features")]


@pytest.mark.parametrize("feature", ["posrf", "oprf"])
def test_features_drawn_under_inference_mode_leave_the_model_trainable(feature):
    """A model switched to "rfattn" without attach_random_features draws its features in its
    first forward; under torch.inference_mode() (an evaluation pass before fine-tuning) they were
    inference tensors for good, and training raised ("Inference tensors cannot be saved for
    backward"; oprf's running statistics: "Inplace update to inference tensor outside
    InferenceMode"). Training-mode forwards (statistics moved in place) and a redraw under
    inference mode leave them normal too."""
    model = _llama()
    model.config.rfattn = {"num_features": 16, "feature": feature}
    model.set_attn_implementation("rfattn")
    ids = _ids()
    with torch.inference_mode():
        model.eval()(ids)  # the features are drawn here
        model.train()(ids)
        for rf in _features(model):
            rf.redraw()
    assert len(_features(model)) == 2
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert not [n for n, t in tensors.items() if t.is_inference()]
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def _statistics(model):
    return [b.clone() for rf in _features(model) for b in rf.feature_map.buffers()]


@pytest.mark.parametrize("lazy", [False, True], ids=["attached", "lazy"])
def test_features_follow_the_models_mode(lazy):
    """oprf attached to an eval model (or drawn in its first forward): two identical no_grad
    forwards give identical logits and the running statistics stay put (before: the features
    started in training mode, so every forward moved them, and a perplexity depended on what ran
    before); model.train() lets them move, model.eval() stops them again."""
    model = _llama().eval()
    if lazy:
        model.config.rfattn = {"num_features": 16, "feature": "oprf"}
    else:
        rfhf.attach_random_features(model, num_features=16, feature="oprf")
    model.set_attn_implementation("rfattn")
    ids = _ids()
    with torch.no_grad():
        first = model(ids).logits
        stats = _statistics(model)
        torch.testing.assert_close(model(ids).logits, first, rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(_statistics(model), stats, strict=True))
        assert len(_features(model)) == 2 and not any(rf.training for rf in _features(model))
        model.train()
        model(ids)
        moved = _statistics(model)
        assert not all(torch.equal(a, b) for a, b in zip(moved, stats, strict=True))
        model.eval()
        model(ids)
        assert all(torch.equal(a, b) for a, b in zip(_statistics(model), moved, strict=True))


def test_attached_features_take_their_layers_mode():
    model = _llama().train()
    model.model.layers[1].eval()
    rfhf.attach_random_features(model, num_features=16, feature="oprf")
    assert [rf.training for rf in _features(model)] == [True, False]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_calibrate_leaves_the_features_in_the_models_mode(training):
    import rfattn

    model = _llama().train(training)
    rfhf.attach_random_features(model, num_features=16, feature="oprf")
    model.set_attn_implementation("rfattn")
    rfattn.calibrate(model, [_ids()], steps=2, params=("map", "stats"))
    assert all(m.training == training for m in model.modules())


def _windowed(arch="mistral", **window):
    torch.manual_seed(0)
    config = transformers.Qwen2Config if arch == "qwen2" else transformers.MistralConfig
    cfg = config(**SMALL, num_key_value_heads=2, max_position_embeddings=128, **window)
    model = (transformers.Qwen2ForCausalLM if arch == "qwen2" else
             transformers.MistralForCausalLM)(cfg).eval()  # fmt: skip
    rfhf.attach_random_features(model, num_features=16)
    model.set_attn_implementation("rfattn")
    return model


def _decode(model, ids, prompt: int, cache):
    """Last logits of a manual decoding loop: ``prompt`` tokens, then one token per forward."""
    kw = {} if cache is None else {rfhf.CACHE_KWARG: cache}
    out = model(ids[:, :prompt], use_cache=True, **kw)
    for i in range(prompt, ids.shape[1]):
        cache = getattr(out, rfhf.CACHE_KWARG)
        out = model(ids[:, i : i + 1], use_cache=True, **{rfhf.CACHE_KWARG: cache})
    return out.logits[:, -1]


@pytest.mark.parametrize("path", ["forward", "generate", "loop-RFCache"])
def test_a_sliding_window_is_the_hybrids_exact_part(path):
    """Mistral with sliding_window=4 runs the hybrid with the model's own window exact: while
    the sequence fits in the window it is the model's softmax self; beyond it, what
    attach_random_features(window=4) gives a model without a window (the features reading every
    older key), on every path (before: NotImplementedError)."""
    model = _windowed(sliding_window=4)
    ids = _ids()[:, :7]
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        own = model(ids[:, :4]).logits
        model.set_attn_implementation("rfattn")
        plain = copy.deepcopy(model)
        plain.config.sliding_window = None
        rfhf.attach_random_features(plain, window=4)
        want = plain(ids).logits
        if path == "forward":
            torch.testing.assert_close(model(ids[:, :4]).logits, own, rtol=1e-5, atol=1e-5)
            got = model(ids).logits[:, -1]
        elif path == "generate":
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                 do_sample=False, pad_token_id=0)  # fmt: skip
            want = plain(gen).logits
            assert torch.equal(gen[:, 7:], want[:, 6:-1].argmax(-1))
            got = model(gen).logits[:, -1]
        else:
            got = _decode(model, ids, 2, rfhf.RFCache())
        torch.testing.assert_close(got, want[:, -1], rtol=1e-5, atol=1e-5)
        assert (got - want[:, -1]).abs().max() < 1e-3 * (got - own[:, -1]).abs().max()


def test_the_hybrids_exact_pairs_are_the_models_window():
    """transformers' sliding-window masks (causal j > i - W; bidirectional |i - j| <= W) select
    exactly the pairs the hybrid computes exactly from the layer's sliding_window."""
    from transformers.masking_utils import (
        sdpa_mask,
        sliding_window_bidirectional_mask_function,
        sliding_window_causal_mask_function,
    )

    from rfattn.hybrid import local_sets

    for causal, fn in ((True, sliding_window_causal_mask_function),
                       (False, sliding_window_bidirectional_mask_function)):  # fmt: skip
        own = sdpa_mask(1, 10, 10, mask_function=fn(3), allow_is_causal_skip=False,
                        allow_is_bidirectional_skip=False)  # fmt: skip
        window, _ = rfhf.local_attention_of(None, 3, causal)
        exact, _ = local_sets(10, window, 0, None, causal=causal)
        assert torch.equal(own, exact)


def test_a_sliding_window_behind_padding_or_on_other_layers():
    """Qwen2's layer_types put the window on some layers only: those run the hybrid (their
    generation state a HybridState of the window), the others plain random features, in an
    RFCache as in the cache transformers makes (its sliding-window layer becomes a state too;
    before: refused); a cache that dropped keys outside the window (a DynamicCache filled under
    another attention) is refused, naming RFCache."""
    ids = _ids()[:, :6]
    mixed = _windowed("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert mixed.config.layer_types == ["full_attention", "sliding_attention"]
    with torch.no_grad():
        cache = rfhf.RFCache()
        got = _decode(mixed, ids, 3, cache)
        assert [type(layer.state).__name__ for layer in cache.layers] == ["RFState", "HybridState"]
        assert cache.layers[1].state.keys.shape[2] == 4
        assert torch.equal(_decode(mixed, ids, 3, None), got)
        model = _windowed(sliding_window=4)
        model.set_attn_implementation("sdpa")
        cache = getattr(model(ids[:, :5], use_cache=True), rfhf.CACHE_KWARG)
        model.set_attn_implementation("rfattn")
        with pytest.raises(NotImplementedError, match="sliding_window=4.*RFCache"):
            model(ids[:, 5:], use_cache=True, **{rfhf.CACHE_KWARG: cache})


def _window_shard(rank, length, group=None):
    """Mistral (sliding_window=6) logits of ``length`` tokens, or the NotImplementedError's
    message; over a group, this rank's shard (2 tokens on rank 0, the rest on rank 1)."""
    model = _windowed(sliding_window=6)
    ids, pos = _ids()[:, :length], torch.arange(length)[None].expand(2, -1)
    if group is not None:
        rfhf.set_context_parallel_group(model, group)
        shard = slice(0, 2) if rank == 0 else slice(2, length)
        ids, pos = ids[:, shard], pos[:, shard]
    try:
        with torch.no_grad():
            return model(input_ids=ids, position_ids=pos).logits
    except NotImplementedError as exc:
        return str(exc)


def _window_worker(rank, world, init_file, out_dir):
    import datetime
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        res = [_window_shard(rank, length, dist.group.WORLD) for length in (6, 8)]
        torch.save(res, f"{out_dir}/rank{rank}.pt")
        dist.barrier()  # then end without tearing gloo down (test_distributed.py: _finish)
        os._exit(0)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # ~15 s: two processes
def test_a_sliding_window_over_a_process_group_is_the_single_process_hybrid(tmp_path):
    """set_context_parallel_group: a sliding window runs as the hybrid over the shards (each
    starting from the window, sinks and state of the ranks before it): the single process's
    logits, whether the sequence fits in the window (6 tokens) or not (8)."""
    import torch.multiprocessing as mp

    mp.spawn(_window_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, length in enumerate((6, 8)):
        got = torch.cat([r[i] for r in ranks], dim=1)
        torch.testing.assert_close(got, _window_shard(0, length), rtol=1e-5, atol=1e-5)


def test_a_hybrid_with_a_window_past_the_sequence_is_softmax():
    """window >= T: every key exact, the model is its softmax self (left padding too)."""
    model = _llama().eval()
    ids = _ids(3)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :5] = 0
    valid = mask.bool()
    with torch.no_grad():
        ref = _run(model, "sdpa", ids, mask)[valid]
        rfhf.attach_random_features(model, num_features=16, window=T, sinks=2)
        out = _run(model, "rfattn", ids, mask)[valid]
        rfhf.attach_random_features(model, window=0, sinks=0)  # kept until changed
        plain = _run(model, "rfattn", ids, mask)[valid]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # rounding apart, while random features alone are off (even on this near-uniform model)
    assert (plain - ref).abs().max() > 100 * (out - ref).abs().max()


def test_a_hybrid_generates_on_a_constant_size_cache():
    model = _llama().eval()
    rfhf.attach_random_features(model, num_features=32, window=4, sinks=2)
    assert model.config.rfattn["window"] == 4
    model.set_attn_implementation("rfattn")
    ids = _ids(4)[:, :10]
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0  # left padding: the second row's sinks are its first real tokens
    sizes = []
    with torch.no_grad():
        cache = rfhf.RFCache()
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             pad_token_id=0, **{rfhf.CACHE_KWARG: cache})  # fmt: skip
        sizes.append(cache.nbytes())
        full_mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1)
        full = model(gen, attention_mask=full_mask).logits[:, 9:-1].argmax(-1)
        cache2 = rfhf.RFCache()
        model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                       pad_token_id=0, **{rfhf.CACHE_KWARG: cache2})  # fmt: skip
        sizes.append(cache2.nbytes())
    assert torch.equal(gen[:, 10:], full)
    assert sizes[0] == sizes[1] > 0  # the window's keys and the sinks, not the context
    restored = rfhf.RFCache.from_state_dict(cache.state_dict())
    assert type(restored.layers[0].state).__name__ == "HybridState"
    assert restored.nbytes() == cache.nbytes()


@pytest.mark.slow
def test_a_hybrid_model_on_the_fused_kernels_is_the_torch_paths(monkeypatch):
    """What a GPU runs (backend 'auto' on the fused kernels; here Triton's interpreter, in
    float64): a hybrid model's logits and gradients, and generation on an RFCache (prefill,
    then one token a step, the HybridState carried), equal the torch path's."""
    model = _llama().double().eval()
    rfhf.attach_random_features(model, num_features=16, window=4, sinks=2)
    model.set_attn_implementation("rfattn")
    ids = _ids(4)[:, :10]
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :3] = 0
    from rfattn import fused as fused_path

    runs, calls = [], []
    hybrid = fused_path.hybrid
    monkeypatch.setattr("rfattn.fused.hybrid", lambda call: calls.append(call) or hybrid(call))
    for fused in (False, True):
        if fused:
            monkeypatch.setattr("rfattn.call.use_fused", lambda q, rf, causal: True)
        model.zero_grad()
        logits = model(ids, attention_mask=mask).logits
        logits[mask.bool()].square().sum().backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True,
                                 **{rfhf.CACHE_KWARG: rfhf.RFCache()})  # fmt: skip
        runs.append((logits.detach()[mask.bool()], grad, gen.sequences, torch.stack(gen.logits)))
        assert bool(calls) == fused
    for name, a, b in zip(("logits", "grad", "tokens", "generated logits"), *runs, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-10, msg=name)


def test_bad_window_options_are_refused():
    model = _llama()
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        rfhf.attach_random_features(model, window=-1)
    assert getattr(model.config, "rfattn", None) is None


@pytest.mark.parametrize("how,use_cache", [("flash_kwargs", None), ("flash_kwargs", False),
                                           ("position_ids", False)])  # fmt: skip
def test_packed_batches_equal_the_documents_one_by_one(how, use_cache):
    """Padding-free training (``DataCollatorWithFlattening``): over three SGD steps, a packed
    batch's loss and every parameter's gradient equal (float64) those of the documents run one
    by one on a copy of the model, with flash-attention's ``cu_seq_lens_q/k`` (mask or not, as
    the cache makes transformers build it) and with ``position_ids`` alone (its mask keeps the
    documents apart)."""
    packed_model = _llama().double().train()
    rfhf.attach_random_features(packed_model, num_features=16, seed=0)
    packed_model.set_attn_implementation("rfattn")
    alone_model = copy.deepcopy(packed_model)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, V, (n,), generator=g) for n in (5, 1, 9, 4)]
    collator = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=how == "flash_kwargs")
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    assert ("cu_seq_lens_q" in batch) == (how == "flash_kwargs")
    labels = batch.pop("labels")  # -100 at each document's first token
    kw = {} if use_cache is None else dict(use_cache=use_cache)
    n = sum(len(d) - 1 for d in docs)

    def summed_loss(logits, labels):  # in float64 (transformers' own loss casts to float32)
        return torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], reduction="sum")

    names = [name for name, p in packed_model.named_parameters() if p.requires_grad]
    for _ in range(3):
        packed = [p for p in packed_model.parameters() if p.requires_grad]
        alone = [p for p in alone_model.parameters() if p.requires_grad]
        loss = summed_loss(packed_model(**batch, **kw).logits, labels) / n
        grads = torch.autograd.grad(loss, packed, allow_unused=True)
        ref = sum(summed_loss(alone_model(d[None], **kw).logits, d[None]) for d in docs) / n
        ref_grads = torch.autograd.grad(ref, alone, allow_unused=True)
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        for name, a, b in zip(names, grads, ref_grads, strict=True):
            if a is None or b is None:
                assert a is None and b is None, name
                continue
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12,
                                       msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip
        with torch.no_grad():  # the same SGD step, each model from its own gradients
            for params, gs in ((packed, grads), (alone, ref_grads)):
                for p, d in zip(params, gs, strict=True):
                    if d is not None:
                        p.sub_(0.5 * d)


@pytest.mark.parametrize("window", [{"window": 3, "sinks": 1}, {"sliding_window": 3}],
                         ids=["hybrid", "sliding-window"])  # fmt: skip
def test_packed_hybrid_batches_equal_the_documents_one_by_one(window):
    """A hybrid model (exact sinks and window inside the features: ``attach_random_features``'
    options, or a Mistral's own ``sliding_window``) trains padding-free too: a packed batch's
    loss and gradients equal (float64) the documents run one by one."""
    if "sliding_window" in window:
        model = _windowed(**window).double().train()
    else:
        model = _llama().double().train()
        rfhf.attach_random_features(model, num_features=16, seed=0, **window)
    model.set_attn_implementation("rfattn")
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, V, (n,), generator=g) for n in (6, 1, 9, 5)]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d.tolist()} for d in docs])
    batch.pop("labels")
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(**batch, use_cache=False).logits
    ref = torch.cat([model(d[None], use_cache=False).logits for d in docs], dim=1)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grads = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
    for a, b in zip(grads, ref_grads, strict=True):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_a_packed_eval_forward_with_its_cache_attends_each_document_alone():
    """In eval, ``model(**packed_batch)`` with flash-attention's offsets makes a cache
    (transformers' default use_cache): the logits still treat each document on its own (equal
    to use_cache=False), and the cache then refuses to continue (its states could not be per
    document) instead of mixing them. (``position_ids`` alone with a cache: transformers itself
    attends over the whole row, and so does rfattn.)"""
    model = _llama().double().eval()
    rfhf.attach_random_features(model, num_features=16, seed=0)
    model.set_attn_implementation("rfattn")
    docs = [list(range(3, 8)), list(range(1, 8))]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs])
    batch.pop("labels")
    with torch.no_grad():
        out = model(**batch)
        alone = torch.cat([model(torch.tensor([d]), use_cache=False).logits for d in docs], 1)
    torch.testing.assert_close(out.logits, alone, rtol=1e-12, atol=1e-12)
    cache = getattr(out, rfhf.CACHE_KWARG)
    with torch.no_grad(), pytest.raises(ValueError, match="packed"):
        model(torch.tensor([[4]]), **{rfhf.CACHE_KWARG: cache})
    cache.reset()  # a fresh cache again: it takes tokens
    with torch.no_grad():
        again = model(torch.tensor([docs[0]]), **{rfhf.CACHE_KWARG: cache})
    torch.testing.assert_close(again.logits, alone[:, : len(docs[0])], rtol=1e-12, atol=1e-12)


def test_packed_offsets_that_disagree_with_the_mask_raise():
    """cu_seq_lens that are not the sequences of the mask transformers built from the
    position_ids raise rather than attend to either; one side alone raises."""
    model = _llama().double().eval()
    rfhf.attach_random_features(model, num_features=16, seed=0)
    model.set_attn_implementation("rfattn")
    docs = [list(range(5)), list(range(7))]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs])
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 6, 12], dtype=torch.int32)
    with torch.no_grad(), pytest.raises(NotImplementedError, match="cu_seq_lens_q/k"):
        model(**batch, use_cache=False)
    del batch["cu_seq_lens_k"]
    with torch.no_grad(), pytest.raises(ValueError, match="cu_seq_lens_q and cu_seq_lens_k"):
        model(**batch, use_cache=False)


def _training_step(model, forward, batch):
    """(logits, every parameter's gradient) of ``forward(**batch)`` and the backward of a
    weighted sum of its logits."""
    model.zero_grad()
    out = forward(**batch)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).sum().backward()
    return out, [p.grad.clone() for p in model.parameters() if p.grad is not None]


# Llama plain and with the flash-attention keyword arguments in make test (~8 s each), the
# rest in make test-slow
@pytest.mark.parametrize("arch,how", [
    ("llama", "plain"), pytest.param("llama", "padded", marks=pytest.mark.slow),
    ("llama", "flash_kwargs"), pytest.param("mistral", "plain", marks=pytest.mark.slow),
    pytest.param("mistral", "padded", marks=pytest.mark.slow),
    pytest.param("mistral", "flash_kwargs", marks=pytest.mark.slow),
])  # fmt: skip
def test_a_training_forward_compiles_whole(arch, how):
    """torch.compile(fullgraph=True) of a Llama's training forward and backward on "rfattn":
    no graph break (before: 11 for a plain batch, whose mask transformers builds as a packing
    pattern from the position ids and rfattn compared on the host; 8 with a padding mask, from
    the weak dictionary of older transformers' cache hand-over; 28 for a padding-free batch),
    with logits and gradients equal to eager (float64): a plain batch, a left-padded one and a
    padding-free one with flash-attention's offsets (checked against the mask on the device,
    run with transformers' max_length as the bound, no host read); and a Mistral whose own
    sliding window is the hybrid's exact part (its mask checked on the device against the
    window's pattern; before: host reads of the window's span and a dictionary of groups)."""
    if arch == "mistral":
        model = _windowed(sliding_window=4).double().train()
    else:
        model = _llama().double().train()
        rfhf.attach_random_features(model, num_features=16, seed=0)
        model.set_attn_implementation("rfattn")
    if how == "flash_kwargs":
        docs = [list(range(3, 8)), [9], list(range(1, 10)), [4, 2, 7]]
        batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
            [{"input_ids": d} for d in docs])
        batch.pop("labels")
    else:
        batch = dict(input_ids=_ids(5))
        if how == "padded":
            batch["attention_mask"] = torch.ones(2, T, dtype=torch.long)
            batch["attention_mask"][1, :5] = 0
    torch._dynamo.reset()

    def forward(**b):
        return model(**b, use_cache=False).logits

    want = _training_step(model, forward, batch)
    got = _training_step(model, torch.compile(forward, fullgraph=True, backend="aot_eager"),
                         batch)  # fmt: skip
    assert len(got[1]) == len(want[1]) > 0
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    if how == "padded":  # the padded queries' rows are junk either way
        got, want = (x[0][batch["attention_mask"].bool()] for x in (got, want))
    else:
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.slow  # ~11 s (a compile); make test compiles the packed forwards above
def test_compiled_packing_that_rfattn_cannot_see_raises_on_the_device():
    """Under torch.compile nothing is read on the host, so what eager mode decides by reading
    is checked on the device instead and raises when the step runs: a batch packed by its
    position ids alone (no offsets to attend by: the message names the collator's flash
    keyword arguments), and offsets that are not the sequences of the mask."""
    model = _llama().double().eval()
    rfhf.attach_random_features(model, num_features=16, seed=0)
    model.set_attn_implementation("rfattn")
    docs = [list(range(5)), list(range(7))]
    step = torch.compile(lambda **b: model(**b, use_cache=False).logits, fullgraph=True,
                         backend="aot_eager")  # fmt: skip
    by_position = transformers.DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    by_position.pop("labels")
    with torch.no_grad(), pytest.raises(RuntimeError, match="return_flash_attn_kwargs=True"):
        step(**by_position)
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs])
    batch.pop("labels")
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 6, 12], dtype=torch.int32)
    with torch.no_grad(), pytest.raises(RuntimeError, match="not their sequences'"):
        step(**batch)


def test_the_conversion_benchmarks_lora_stage():
    """bench.convert's LoRA stage on a tiny hybrid Llama: the adapters leave the model as it was
    (B = 0), the fine-tune moves them and none of the model's weights, and removing them puts
    the original projections back."""
    from bench.convert import add_lora, finetune, remove_lora

    model = _llama().double()
    rfhf.attach_random_features(model, num_features=16, window=4, sinks=2, seed=0)
    model.set_attn_implementation("rfattn")
    ids = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(0))
    before = model(ids[:1]).logits
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    originals = [layer.self_attn.q_proj for layer in model.model.layers]
    undo = add_lora(model, rank=2)
    torch.testing.assert_close(model(ids[:1]).logits, before)
    losses = finetune(model, ids, steps=3, lr=1e-2, also=lambda n: ".lora_" in n)
    assert len(losses) == 3
    moved = {n for n, p in model.named_parameters()
             if n in frozen and not torch.equal(p, frozen[n])}  # fmt: skip
    assert all(".rfattn_features." in n for n in moved), moved  # the model's weights frozen
    assert any(not torch.equal(layer.self_attn.o_proj.lora_b, torch.zeros_like(
        layer.self_attn.o_proj.lora_b)) for layer in model.model.layers)  # fmt: skip
    remove_lora(undo)
    assert [layer.self_attn.q_proj for layer in model.model.layers] == originals
    assert not any(".lora_" in n for n, _ in model.named_parameters())
