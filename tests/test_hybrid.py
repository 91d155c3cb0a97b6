"""Hybrid attention (rfattn/hybrid.py): exact sinks and window, random features for the rest,
one normaliser; the blocked torch path against the [T, T] reference in float64."""

import pytest
import torch

import rfattn
from rfattn.hybrid import hybrid_attention, hybrid_reference, local_sets
from rfattn.reference import softmax_attention

FEATURES = [
    ("posrf", "orf", {}),
    ("trigrf", "orf", {}),
    ("hrf", "orf", {}),
    ("gerf", "orf", {"A": -0.1}),
    ("oprf", "orf", {"stats": "running"}),
    ("rmf", "rademacher", {}),
]


def inputs(B=2, H=4, Hk=2, T=37, D=8, E=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = 0.6 * torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = 0.6 * torch.randn(B, Hk, T, D, generator=g, dtype=dtype)
    v = torch.randn(B, Hk, T, E, generator=g, dtype=dtype)
    return q, k, v


def features(name="posrf", weights="orf", D=8, M=16, **options):
    return rfattn.RandomFeatures(D, M, feature=name, weights=weights, seed=3, **options).eval()


def padding(B, T, junk_into=()):
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :5] = True  # left padding
    mask[1, 11:13] = True  # a hole
    for x in junk_into:
        x.data[mask[:, None, :, None].expand(*x.shape[:1], x.shape[1], T, x.shape[-1])] = float(
            "nan")  # fmt: skip
    return mask


#: window and sinks at the edges (0, 1, a block, past T) for posrf; two cases for the others
CASES = [(FEATURES[0], w, s) for w, s in [(0, 0), (1, 0), (0, 1), (3, 2), (16, 4), (100, 3)]]
CASES += [(f, w, s) for f in FEATURES[1:] for w, s in [(0, 1), (16, 4)]]


def check_against_reference(form, window, sinks, causal, seed, block):
    """hybrid_attention equals hybrid_reference in float64 (outputs and gradients) on padded
    grouped-query inputs with NaN junk in the padding."""
    feature, weights, options = form
    q, k, v = inputs(seed=seed)
    rf = features(feature, weights, **options)
    mask = padding(2, 37, junk_into=(k, v))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = hybrid_attention(*leaves, rf, window=window, sinks=sinks, key_padding_mask=mask,
                           block=block, causal=causal)  # fmt: skip
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = hybrid_reference(*ref_leaves, rf, window=window, sinks=sinks, key_padding_mask=mask,
                           causal=causal)  # fmt: skip
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    grads = torch.autograd.grad(out, leaves, cot)
    ref_grads = torch.autograd.grad(ref, ref_leaves, cot)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert not g.isnan().any(), name
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("form,window,sinks", CASES, ids=lambda x: x[0] if isinstance(x, tuple)
                         else str(x))  # fmt: skip
def test_matches_reference(form, window, sinks):
    check_against_reference(form, window, sinks, causal=True, seed=0, block=16)


#: the non-causal form: posrf at the edges (0, 1, a block, past T), a signed and a statistics form
#: (past T and a short window in test-slow: test_non_causal_edges has a window past T)
BIDIRECTIONAL = [(FEATURES[0], w, s) for w, s in [(0, 1), (1, 0), (16, 4)]]
BIDIRECTIONAL += [pytest.param(FEATURES[0], w, s, marks=pytest.mark.slow)
                  for w, s in [(3, 2), (40, 3)]]  # fmt: skip
BIDIRECTIONAL += [(FEATURES[1], 5, 2), (FEATURES[4], 16, 1)]


@pytest.mark.parametrize("form,window,sinks", BIDIRECTIONAL, ids=lambda x: x[0]
                         if isinstance(x, tuple) else str(x))  # fmt: skip
def test_non_causal_matches_reference(form, window, sinks):
    """|i - j| < window and the sinks exact, every other valid key estimated (blocks of 8 cut
    the window)."""
    check_against_reference(form, window, sinks, causal=False, seed=21, block=8)


def test_non_causal_edges():
    """A window past the sequence is softmax attention; none is plain random features; the
    sinks are the first valid keys for every row, before or after it."""
    q, k, v = inputs(H=2, Hk=2, seed=22)
    rf = features()
    out = hybrid_attention(q, k, v, rf, window=37, causal=False, block=8)
    torch.testing.assert_close(out, softmax_attention(q, k, v, causal=False), rtol=1e-12,
                               atol=1e-12)  # fmt: skip
    out = hybrid_attention(q, k, v, rf, window=0, causal=False, block=8)
    want = rfattn.rf_attention(q, k, v, rf, causal=False, backend="torch")
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    exact, estimated = local_sets(10, 2, 1, None, causal=False)
    assert exact[0, 0, 5].nonzero().flatten().tolist() == [0, 4, 5, 6]
    assert torch.equal(exact | estimated, torch.ones(1, 1, 10, 10, dtype=torch.bool))


def test_sets_partition_the_causal_pairs():
    mask = padding(2, 20)
    exact, estimated = local_sets(20, 4, 2, mask)
    assert not (exact & estimated).any()
    allowed = torch.ones(20, 20, dtype=torch.bool).tril() & ~mask[:, None, None, :]
    assert torch.equal(exact | estimated, allowed.expand_as(exact))
    # row 19 of batch 0 (keys 0-4 padded): sinks 5, 6 and the window 16..19 exact
    assert exact[0, 0, 19].nonzero().flatten().tolist() == [5, 6, 16, 17, 18, 19]


def test_window_past_the_sequence_is_softmax():
    q, k, v = inputs(H=2, Hk=2)
    out = hybrid_attention(q, k, v, features(), window=37, sinks=0, block=8)
    torch.testing.assert_close(out, softmax_attention(q, k, v, causal=True), rtol=1e-12,
                               atol=1e-12)  # fmt: skip


def test_no_window_no_sinks_is_random_feature_attention():
    q, k, v = inputs(H=2, Hk=2)
    rf = features()
    out = hybrid_attention(q, k, v, rf, window=0, sinks=0, block=8)
    want = rfattn.rf_attention(q, k, v, rf, causal=True, backend="torch")
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


def test_blocks_change_rounding_only():
    q, k, v = inputs(seed=4)
    rf = features("hrf")
    one = hybrid_attention(q, k, v, rf, window=5, sinks=2, block=64)
    for block in (3, 16):
        other = hybrid_attention(q, k, v, rf, window=5, sinks=2, block=block)
        torch.testing.assert_close(other, one, rtol=1e-12, atol=1e-13)


def test_no_output_depends_on_a_later_token():
    """Not even through underflow: a later key with a huge logit (which would dominate any
    stabiliser it reached) leaves every earlier row bit for bit unchanged; a NaN value reaches
    its own and later rows only."""
    q, k, v = inputs(seed=5, H=2, Hk=2)
    rf = features()
    base = hybrid_attention(q, k, v, rf, window=4, sinks=1, block=8)
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    t = 30
    k2[:, :, t:] = 40.0 * torch.randn_like(k2[:, :, t:])
    v2[:, :, t:] = 1e6
    q2[:, :, t:] = -q2[:, :, t:]
    other = hybrid_attention(q2, k2, v2, rf, window=4, sinks=1, block=8)
    assert torch.equal(other[:, :, :t], base[:, :, :t])
    assert not torch.equal(other[:, :, t:], base[:, :, t:])
    v3 = v.clone()
    v3[:, :, t - 3, 0] = float("nan")  # inside a block of 8: its earlier rows stay clean
    nan = hybrid_attention(q, k, v3, rf, window=4, sinks=1, block=8)
    assert torch.equal(nan[:, :, : t - 3], base[:, :, : t - 3])
    assert nan[:, :, t - 3 :].isnan().any(-1).all()


@pytest.mark.parametrize("bad,match", [
    (dict(window=-1), "window must be an int >= 0"),
    (dict(window=True), "window must be an int >= 0"),
    (dict(window=2, sinks=1.5), "sinks must be an int >= 0"),
])  # fmt: skip
def test_bad_arguments(bad, match):
    q, k, v = inputs(T=8)
    with pytest.raises(ValueError, match=match):
        hybrid_attention(q, k, v, features(), **bad)


@pytest.mark.parametrize("feature,window,sinks,cuts", [
    ("posrf", 4, 2, [1, 3, 20]),  # the sinks filled across calls, a cut inside the window
    ("posrf", 16, 3, [5, 30]),  # the window longer than the first call
    ("posrf", 0, 0, [10]),  # plain random features
    ("posrf", 40, 1, [7]),  # window past T: exact softmax, carried
    ("hrf", 4, 2, [1, 3, 20]),  # signed features
    ("rmf", 16, 3, [5, 30]),  # plain features
])  # fmt: skip
def test_split_and_resume_equal_one_call(feature, window, sinks, cuts):
    q, k, v = inputs(seed=6)
    rf = features(feature, "rademacher" if feature == "rmf" else "orf")
    mask = padding(2, 37, junk_into=(k, v))
    mask[1, 0] = True  # batch 1 starts with padding too: its sinks come later
    whole = hybrid_attention(q, k, v, rf, window=window, sinks=sinks, key_padding_mask=mask,
                             block=8)  # fmt: skip
    parts, state = [], None
    for lo, hi in zip([0, *cuts], [*cuts, 37], strict=True):
        out, state = hybrid_attention(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], rf,
                                      window=window, sinks=sinks,
                                      key_padding_mask=mask[:, lo:hi], initial_state=state,
                                      return_state=True, block=8)  # fmt: skip
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts, 2), whole, rtol=1e-11, atol=1e-12)


def test_decoding_token_by_token_is_one_call_and_constant_size():
    q, k, v = inputs(seed=7, T=30)
    rf = features()
    whole = hybrid_attention(q, k, v, rf, window=6, sinks=2)
    state, outs, sizes = None, [], set()
    for t in range(30):
        out, state = hybrid_attention(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], rf,
                                      window=6, sinks=2, initial_state=state,
                                      return_state=True)  # fmt: skip
        outs.append(out)
        sizes.add(sum(x.numel() * x.element_size() for x in state))
    torch.testing.assert_close(torch.cat(outs, 2), whole, rtol=1e-11, atol=1e-12)
    assert len(sizes) == 1  # the state's bytes do not grow with the context


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_an_empty_sequence_attends_nothing(causal):
    """T = 0 (an empty document of a packed row run on its own, a resumed call with no new
    token): an empty output, and a causal call's state passed on as it was (or the empty
    state); it used to fail gathering the sinks of no token."""
    q, k, v = inputs(seed=3, T=12)
    rf = features()
    empty = (x[:, :, :0] for x in (q, k, v))
    if not causal:
        out = rfattn.rf_attention(*empty, rf, window=4, sinks=2, backend="torch")
        assert out.shape == (*q.shape[:2], 0, v.shape[-1])
        return
    _, state = hybrid_attention(q, k, v, rf, window=4, sinks=2, return_state=True)
    q0, k0, v0 = empty
    out, after = hybrid_attention(q0, k0, v0, rf, window=4, sinks=2, initial_state=state,
                                  return_state=True)  # fmt: skip
    assert out.shape == (*q.shape[:2], 0, v.shape[-1])
    for a, b in zip(after, state, strict=True):
        assert torch.equal(a, b)
    out, fresh = hybrid_attention(q0, k0, v0, rf, window=4, sinks=2, return_state=True)
    whole, st = hybrid_attention(q, k, v, rf, window=4, sinks=2, initial_state=fresh,
                                 return_state=True)  # fmt: skip
    torch.testing.assert_close(whole, hybrid_attention(q, k, v, rf, window=4, sinks=2))


def test_gradients_reach_the_initial_state():
    q, k, v = inputs(seed=8, T=20)
    rf = features()
    _, state = hybrid_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], rf, window=3, sinks=1,
                                return_state=True)  # fmt: skip
    leaves = {n: getattr(state, n).clone().requires_grad_()
              for n in ("s", "z", "keys", "values", "sink_keys", "sink_values")}  # fmt: skip
    st = state._replace(**leaves)
    out = hybrid_attention(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], rf, window=3, sinks=1,
                           initial_state=st)  # fmt: skip
    grads = torch.autograd.grad(out.square().sum(), list(leaves.values()))
    for name, g in zip(leaves, grads, strict=True):
        assert g.abs().sum() > 0, name

    # and they are the one-shot call's: d out / d v through the state equals the direct one
    v_leaf = v.clone().requires_grad_()
    whole = hybrid_attention(q, k, v_leaf, rf, window=3, sinks=1)
    (gv,) = torch.autograd.grad(whole[:, :, 12:].square().sum(), v_leaf)
    v1 = v_leaf.detach().clone().requires_grad_()
    _, st1 = hybrid_attention(q[:, :, :12], k[:, :, :12], v1[:, :, :12], rf, window=3, sinks=1,
                              return_state=True)  # fmt: skip
    out1 = hybrid_attention(q[:, :, 12:], k[:, :, 12:], v1[:, :, 12:], rf, window=3, sinks=1,
                            initial_state=st1)  # fmt: skip
    (gv1,) = torch.autograd.grad(out1.square().sum(), v1)
    torch.testing.assert_close(gv1, gv, rtol=1e-10, atol=1e-12)


def test_a_state_of_other_sizes_is_refused():
    q, k, v = inputs(T=8)
    rf = features()
    _, state = hybrid_attention(q, k, v, rf, window=4, sinks=1, return_state=True)
    with pytest.raises(ValueError, match=r"initial_state.keys must have shape"):
        hybrid_attention(q, k, v, rf, window=5, sinks=1, initial_state=state)
    with pytest.raises(TypeError, match="initial_state must be a HybridState"):
        hybrid_attention(q, k, v, rf, window=4, sinks=1, initial_state=tuple(state))


def test_head_maps_map_the_features_only():
    q, k, v = inputs(seed=10)
    rf = features()
    rf.add_head_maps(4, 2)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for m in (rf.query_map, rf.key_map):
            m.add_(0.3 * torch.randn(m.shape, generator=g, dtype=m.dtype))
    out = hybrid_attention(q, k, v, rf, window=5, sinks=2, block=16)
    grads = torch.autograd.grad(out.square().sum(), [rf.query_map, rf.key_map])
    ref = hybrid_reference(q, k, v, rf, window=5, sinks=2)
    ref_grads = torch.autograd.grad(ref.square().sum(), [rf.query_map, rf.key_map])
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    for gr, r in zip(grads, ref_grads, strict=True):
        assert gr.abs().sum() > 0
        torch.testing.assert_close(gr, r, rtol=1e-8, atol=1e-10)
    # a window past T is softmax whatever the maps: they reach only the features
    torch.testing.assert_close(hybrid_attention(q, k, v, rf, window=37),
                               hybrid_attention(q, k, v, features(), window=37))  # fmt: skip


def test_the_conversion_benchmarks_local_mask_is_the_exact_part():
    """bench.convert's "local S+W" (softmax on a 4-D mask) is the hybrid's exact set."""
    from bench.convert import local_mask

    for window, sinks in ((0, 0), (1, 4), (64, 4), (5, 0)):
        exact, _ = local_sets(70, window, sinks, None)
        assert torch.equal(local_mask(70, window, sinks), exact)


def test_rf_attention_runs_the_hybrid():
    q, k, v = inputs(seed=12)
    rf = features()
    mask = padding(2, 37, junk_into=(k, v))
    out, state = rfattn.rf_attention(q, k, v, rf, causal=True, key_padding_mask=mask, window=5,
                                     sinks=2, return_state=True)  # fmt: skip
    want = hybrid_attention(q, k, v, rf, window=5, sinks=2, key_padding_mask=mask)
    torch.testing.assert_close(out, want.masked_fill(mask[:, None, :, None], 0.0), rtol=1e-12,
                               atol=1e-12)  # fmt: skip (padded queries: output 0)
    assert type(state).__name__ == "HybridState"
    more = rfattn.rf_attention(*inputs(seed=13, T=3), rf, causal=True, window=5, sinks=2,
                               initial_state=state)  # fmt: skip
    assert more.shape == (2, 4, 3, 5) and torch.isfinite(more).all()
    out = rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask, window=5, sinks=2)
    want = hybrid_attention(q, k, v, rf, window=5, sinks=2, key_padding_mask=mask, causal=False)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="need Tq == Tk"):
        rfattn.rf_attention(q[:, :, :5], k, v, rf, window=5)
    with pytest.raises(NotImplementedError, match="non-causal window and sinks"):
        rfattn.rf_attention(q, k, v, rf, window=5, backend="triton")
    with pytest.raises(ValueError, match="sinks must be an int >= 0"):
        rfattn.rf_attention(q, k, v, rf, causal=True, sinks=-2)


def test_calibrating_a_hybrid_model_trains_its_maps():
    """rfattn.calibrate records the hybrid's calls (window and sinks kept) and lowers the
    hybrid's own error against softmax."""
    transformers = pytest.importorskip("transformers")
    import rfattn.hf
    from rfattn.calibration import attention_errors

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    rfattn.hf.attach_random_features(model, num_features=16, window=24)
    model.set_attn_implementation("rfattn")
    batches = [torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(i))
               for i in range(2)]  # fmt: skip
    # the recorded calls run the hybrid: a window over the whole sequence is softmax itself
    assert max(attention_errors(model, batches).values()) < 1e-10
    rfattn.hf.attach_random_features(model, window=8, sinks=1)
    hybrid_errors = attention_errors(model, batches)
    rfattn.hf.attach_random_features(model, window=0, sinks=0)
    plain_errors = attention_errors(model, batches)
    # and a short window is closer to softmax than the same features alone
    assert all(hybrid_errors[n] < 0.5 * plain_errors[n] for n in plain_errors)
    rfattn.hf.attach_random_features(model, window=8, sinks=1)
    report = rfattn.calibrate(model, batches, params=("map",), steps=20, lr=0.02)
    assert report.after and all(report.after[n] < report.before[n] for n in report.before)
    assert report.before == pytest.approx(hybrid_errors, rel=1e-4)


@pytest.mark.parametrize("T", [1, 3, 9])
def test_a_first_call_without_padding_extends_as_one_with_a_mask(T):
    """extend's first call without padding (its kinds and sink slots made once per size, its
    sinks a view of the first keys) equals the general one's given a mask that pads nothing:
    every field, the sink slots where present (fewer tokens than slots at T = 1)."""
    from rfattn.hybrid import extend

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 2, T, 4, generator=g), torch.randn(2, 2, T, 3, generator=g)
    fast = extend(None, k, v, None, 3, 5)
    slow = extend(None, k, v, torch.zeros(2, T, dtype=torch.bool), 3, 5)
    assert fast.kinds.is_contiguous() and torch.equal(fast.sink_present, slow.sink_present)
    for name in ("keys", "values", "kinds", "new_kinds"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    present = slow.sink_present
    assert torch.equal(fast.sink_pos[present], slow.sink_pos[present])
    for name in ("sink_keys", "sink_values"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert torch.equal(a[present[:, None, :, None].expand_as(a)],
                           b[present[:, None, :, None].expand_as(b)]), name  # fmt: skip
    assert extend(None, k, v, None, 3, 5).kinds is fast.kinds  # made once


def test_layers_take_window_and_sinks():
    """RFAttention and RFMultiheadAttention with window and sinks run the hybrid: each layer's
    output is its projections around ``rf_attention(..., window=, sinks=)`` on the same
    weights (causal, padding, streaming state), and bad values are refused naming them."""
    torch.manual_seed(0)
    layer = rfattn.RFAttention(16, 2, num_features=8, causal=True, window=3, sinks=2).double()
    mha = rfattn.RFMultiheadAttention(16, 2, batch_first=True, num_features=8, window=3,
                                      sinks=2).double()  # fmt: skip
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, :2] = True

    def heads(t):
        return t.view(2, 11, 2, 8).transpose(1, 2)

    q, k, v = (heads(p(x)) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
    ref = rfattn.rf_attention(q, k, v, layer.rf, causal=True, window=3, sinks=2,
                              key_padding_mask=mask, query_padding_mask=mask)  # fmt: skip
    want = layer.out_proj(ref.transpose(1, 2).reshape(2, 11, 16))
    torch.testing.assert_close(layer(x, key_padding_mask=mask), want)
    out, st = layer(x[:, :7], causal=True, return_state=True)
    rest = layer(x[:, 7:], causal=True, initial_state=st)
    torch.testing.assert_close(torch.cat([out, rest], 1), layer(x))
    assert isinstance(st, rfattn.hybrid.HybridState)
    w, b = mha.in_proj_weight.chunk(3), mha.in_proj_bias.chunk(3)
    q, k, v = (heads(x @ wi.t() + bi) for wi, bi in zip(w, b, strict=True))
    ref = rfattn.rf_attention(q, k, v, mha.rf, causal=True, window=3, sinks=2)
    want = mha.out_proj(ref.transpose(1, 2).reshape(2, 11, 16))
    torch.testing.assert_close(mha(x, x, x, is_causal=True, need_weights=False)[0], want)
    for bad in (dict(window=-1), dict(sinks=1.5), dict(window=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            rfattn.RFAttention(16, 2, num_features=8, **bad)
    with pytest.raises(ValueError, match="rpe"):
        rfattn.RFAttention(16, 2, num_features=8, window=2, rpe=rfattn.FourierRPE(2, 8, 2))


def test_random_features_carry_window_and_sinks():
    """RandomFeatures(window=, sinks=) is every call's hybrid unless the call gives its own (0
    turns it off); bad values are refused naming them."""
    q, k, v = inputs(seed=21)
    plain = features()
    hyb = rfattn.RandomFeatures(8, 16, feature="posrf", weights="orf", seed=3, window=4,
                                sinks=2).double()  # fmt: skip
    assert "window=4, sinks=2" in repr(hyb)
    torch.testing.assert_close(rfattn.rf_attention(q, k, v, hyb, causal=True),
                               rfattn.rf_attention(q, k, v, plain, causal=True, window=4,
                                                   sinks=2))  # fmt: skip
    torch.testing.assert_close(rfattn.rf_attention(q, k, v, hyb, causal=True, window=0, sinks=0),
                               rfattn.rf_attention(q, k, v, plain, causal=True))  # fmt: skip
    for bad in (dict(window=-1), dict(sinks=2.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            rfattn.RandomFeatures(8, 16, **bad)
