"""Correct under bad data (issue 15): junk in padded positions, NaN locality, queries with no valid
key, empty sequences, bad states and options. Each test failed before its fix; both backends where
the case applies (the Triton kernels under the interpreter on CPU)."""

import copy

import pytest
import torch

import rfattn
from rfattn.attention import fused_kernel_available

f32, f64 = torch.float32, torch.float64
NAN = float("nan")


def rand(*shape, seed=0, dtype=f32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64).to(dtype)


def backends(rf, causal=False):
    return ["torch"] + (["triton"] if fused_kernel_available(rf, causal) else [])


@pytest.mark.parametrize("feature", ["oprf", "saderf", "poisrf", "geomrf"])
def test_junk_in_padded_keys_never_reaches_statistics(feature, kernel_device):
    """NaN/inf in padded keys and values: the same output as clean padding, finite running
    buffers after a training call (before: NaN outputs, a ValueError, or a silent change)."""
    rf = rfattn.RandomFeatures(8, 16, feature, seed=0).to(kernel_device)
    q, k, v = rand(2, 2, 6, 8, seed=1), rand(2, 2, 6, 8, seed=2), rand(2, 2, 6, 4, seed=3)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 5], mask[1, :2] = True, True
    q, k, v, mask = (x.to(kernel_device) for x in (q, k, v, mask))
    junk_k, junk_v = k.clone(), v.clone()
    junk_k[0, :, 5], junk_k[1, :, 0], junk_k[1, :, 1] = NAN, float("inf"), 1e30
    junk_v[0, :, 5], junk_v[1, :, :2] = NAN, float("-inf")
    for backend in backends(rf):
        rf.eval()
        clean = rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask, backend=backend)
        out = rfattn.rf_attention(q, junk_k, junk_v, rf, key_padding_mask=mask, backend=backend)
        torch.testing.assert_close(out, clean, msg=backend)
        rf.train()
        if feature in ("oprf", "saderf"):  # running statistics: a causal training call
            rfattn.rf_attention(
                junk_k, junk_k, junk_v, rf, causal=True, key_padding_mask=mask, backend=backend
            )
            assert all(b.isfinite().all() for b in rf.feature_map.buffers()), backend


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "feature,weights", [("posrf", "orf"), ("trigrf", "orf"), ("rmf", "rademacher")]
)
def test_queries_without_a_valid_key_have_zero_gradient(causal, feature, weights, kernel_device):
    """A query with no valid key outputs the constant 0: its gradient is 0 whatever the cotangent
    (before: do / tiny overflowed and met a 0, NaN in dq and, with causal left padding, in the dv
    of valid tokens)."""
    rf = rfattn.RandomFeatures(8, 16, feature, weights=weights, seed=0).to(kernel_device)
    q, k, v = rand(2, 2, 6, 8, seed=1), rand(2, 2, 6, 8, seed=2), rand(2, 2, 6, 4, seed=3)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    if causal:
        mask[1, :3] = True  # left padding: queries 0..2 of batch 1 see no valid key
        empty = torch.zeros(2, 1, 6, 1, dtype=torch.bool)
        empty[1, :, :3] = True
    else:
        mask[1] = True  # every key of batch 1 padded
        empty = torch.tensor([False, True])[:, None, None, None].expand(2, 1, 6, 1)
    do = 100.0 * rand(2, 2, 6, 4, seed=4)
    q, k, v, mask, empty, do = (x.to(kernel_device) for x in (q, k, v, mask, empty, do))
    for backend in backends(rf, causal):
        grads = []
        for cot in (do, do.masked_fill(empty, 0.0)):
            args = [x.clone().requires_grad_() for x in (q, k, v)]
            out = rfattn.rf_attention(
                *args, rf, causal=causal, key_padding_mask=mask, backend=backend
            )
            out.backward(cot)
            assert torch.equal(out.masked_select(empty), torch.zeros_like(out.masked_select(empty)))
            grads.append([x.grad for x in args])
        for a, b in zip(*grads, strict=True):
            assert a.isfinite().all(), backend
            torch.testing.assert_close(a, b, msg=backend)


@pytest.mark.parametrize("causal", [False, True])
def test_empty_sequences_keep_shape_and_graph(causal):
    """T = 0 (and Tk = 0) on the torch path: every feature returns [B, H, Tq, E] with a grad_fn
    when the inputs require grad (before: hrf raised on a reshape, causal T = 0 lost the graph)."""
    from rfattn.features import ALL_FEATURES, VALID_WEIGHTS

    shapes = [(0, 0)] if causal else [(0, 0), (3, 0), (0, 4)]
    for feature in ALL_FEATURES:
        weights = "rademacher" if feature == "rmf" else VALID_WEIGHTS[feature][0]
        rf = rfattn.RandomFeatures(8, 12, feature, weights=weights, seed=0).eval()
        for tq, tk in shapes:
            q = torch.randn(1, 2, tq, 8, requires_grad=True)
            k, v = torch.randn(1, 2, tk, 8), torch.randn(1, 2, tk, 4)
            out = rfattn.rf_attention(q, k, v, rf, causal=causal, backend="torch")
            assert out.shape == (1, 2, tq, 4) and out.grad_fn is not None, (feature, tq, tk)


def test_fused_hrf_is_float64_accurate(kernel_device):
    """Every coefficient of hrf's kernel form in float64 (before: its phase constant was built in
    float32, 1e-7 against 1e-15 for the other features)."""
    from rfattn.testing import rel_rms

    q, k, v = (0.5 * rand(1, 2, 20, 8, seed=s, dtype=f64).to(kernel_device) for s in (1, 2, 3))
    rf = rfattn.RandomFeatures(8, 12, "hrf", weights="gaussian", seed=0).double().to(kernel_device)
    for causal in (False, True):
        ref = rfattn.rf_attention(q, k, v, rf, causal=causal, backend="torch")
        out = rfattn.rf_attention(q, k, v, rf, causal=causal, backend="triton")
        assert rel_rms(out, ref) <= 1e-12


def test_initial_state_dtype():
    """An integer state is a TypeError naming the field; other float dtypes are cast to the
    accumulation dtype on both backends (before: fp16 crashed the Triton path)."""
    rf = rfattn.RandomFeatures(8, 16, "posrf", seed=0)
    q = rand(1, 1, 6, 8, seed=1)
    for backend in backends(rf, causal=True):
        _, st = rfattn.rf_attention(q, q, q, rf, causal=True, return_state=True, backend=backend)
        ref = rfattn.rf_attention(q, q, q, rf, causal=True, initial_state=st, backend=backend)
        half = rfattn.RFState(*(x.half() for x in st))
        out = rfattn.rf_attention(q, q, q, rf, causal=True, initial_state=half, backend=backend)
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
        bad = rfattn.RFState(st.s.long(), st.z, st.offset)
        with pytest.raises(TypeError, match=r"initial_state\.s must be floating point"):
            rfattn.rf_attention(q, q, q, rf, causal=True, initial_state=bad, backend=backend)


def test_a_state_continues_only_the_features_that_made_it(kernel_device):
    """A state from another RandomFeatures of the same width, or from this one before a redraw,
    is a ValueError (before: accepted, silently mixing two feature maps); the maker itself and
    a copy of it (same draw) continue it, on both backends."""
    rf = rfattn.RandomFeatures(8, 16, "posrf", seed=0).to(kernel_device)
    other = rfattn.RandomFeatures(8, 16, "posrf", seed=1).to(kernel_device)
    q = rand(1, 1, 6, 8, seed=1).to(kernel_device)
    for backend in backends(rf, causal=True):
        kw = dict(causal=True, backend=backend)
        _, st = rfattn.rf_attention(q, q, q, rf, return_state=True, **kw)
        _, st2 = rfattn.rf_attention(q, q, q, rf, initial_state=st, return_state=True, **kw)
        rfattn.rf_attention(q, q, q, copy.deepcopy(rf), initial_state=st2, **kw)
        with pytest.raises(ValueError, match="another RandomFeatures"):
            rfattn.rf_attention(q, q, q, other, initial_state=st2, **kw)
        _, st = rfattn.rf_attention(q, q, q, rf, return_state=True, **kw)
        rf.redraw(5)
        with pytest.raises(ValueError, match=r"before rf\.redraw"):
            rfattn.rf_attention(q, q, q, rf, initial_state=st, **kw)


def test_rmf_options_do_not_overflow():
    """rmf's degree distribution in log space and 1/n! through lgamma (before: p=1e300 and
    max_degree=1000 raised OverflowError); max_degree is capped, overflowing poly coefficients
    are a ValueError naming the options."""
    q = 0.3 * rand(1, 1, 4, 8, seed=1)
    rf = rfattn.RandomFeatures(8, 16, "rmf", weights="rademacher", seed=0, p=1e300)
    assert rfattn.rf_attention(q, q, q, rf, backend="torch").isfinite().all()
    assert abs(sum(rf.feature_map.pmf) - 1.0) < 1e-12
    with pytest.raises(ValueError, match="max_degree"):
        rfattn.RandomFeatures(8, 16, "rmf", weights="rademacher", max_degree=1000)
    with pytest.raises(ValueError, match="poly_degree=500"):
        rfattn.RandomFeatures(
            8, 16, "rmf", weights="rademacher", dot_kernel="poly", poly_degree=500, poly_c=10.0
        )
    rf = rfattn.RandomFeatures(8, 16, "rmf", weights="rademacher", seed=0, max_degree=64)
    assert rf.feature_map.coef[64] == pytest.approx(1.0 / __import__("math").factorial(64))


def test_numpy_scalars_and_0d_tensors_are_numbers():
    """What PyTorch users pass for a number (before: rejected, 'got bool' for np.bool_)."""
    import numpy as np

    rf = rfattn.RandomFeatures(np.int64(8), np.int64(16), "posrf", seed=np.int64(3))
    assert rf.weight.shape == (16, 8)
    q = rand(1, 1, 4, 8, seed=1)
    ref = rfattn.rf_attention(q, q, q, rf, causal=True, scale=0.125)
    for causal, scale in ((np.bool_(True), np.float32(0.125)), (True, torch.tensor(0.125))):
        out = rfattn.rf_attention(q, q, q, rf, causal=causal, scale=scale)
        assert torch.equal(out, ref)
    with pytest.raises(TypeError, match="causal must be a bool, got float"):
        rfattn.rf_attention(q, q, q, rf, causal=np.float32(1.0))
    opt = rfattn.RandomFeatures(8, 16, "gerf", A=np.float32(-0.1), seed=0)
    assert opt.feature_map.A == complex(np.float32(-0.1))


@pytest.mark.parametrize(
    "feature,weights",
    [("posrf", "orf"), ("trigrf", "orf"), ("rmf", "rademacher"),
     pytest.param("hrf", "gaussian", marks=pytest.mark.slow)],  # slow: ~15 s interpreted
)  # fmt: skip
def test_causal_nan_stays_at_and_after_its_position(feature, weights, kernel_device):
    """A NaN in k or v at position j (inside a chunk, not at its start) leaves every output before
    j unchanged and finite; outputs from j on are NaN (before: the whole torch chunk of 128
    tokens, and in the Triton chunk kernel the chunk before j for a NaN in v)."""
    rf = rfattn.RandomFeatures(8, 16, feature, weights=weights, seed=0).to(kernel_device)
    q, k, v = (0.5 * rand(1, 2, 40, 8, seed=s).to(kernel_device) for s in (1, 2, 3))
    for backend in backends(rf, causal=True):
        clean = rfattn.rf_attention(q, k, v, rf, causal=True, backend=backend)
        for j in (17, 33):
            for which in ("k", "v"):
                kk, vv = k.clone(), v.clone()
                (kk if which == "k" else vv)[:, :, j, 1] = NAN
                out = rfattn.rf_attention(q, kk, vv, rf, causal=True, backend=backend)
                torch.testing.assert_close(out[:, :, :j], clean[:, :, :j], msg=(backend, which, j))
                assert out[:, :, j:].isnan().any(dim=-1).all(), (backend, which, j)


@pytest.mark.parametrize(
    "feature,weights",
    [("posrf", "orf"), ("trigrf", "orf"), pytest.param("hrf", "gaussian", marks=pytest.mark.slow)],
)
def test_causal_outputs_do_not_depend_on_later_keys(feature, weights, kernel_device):
    """Per-row key offsets (torch path and Triton chunk kernel): with the first 20 keys at norm
    50 (logits near -440) and the later ones of ordinary norm (logits near 0), the first 20
    outputs equal those of the first 20 tokens alone (before: the later keys' offset, shared
    within a chunk, made them underflow to 0 in fp32) and split/resume at any cut equals one
    shot."""
    rf = rfattn.RandomFeatures(8, 16, feature, weights=weights, seed=0).to(kernel_device)
    q, k, v = (rand(1, 1, 32, 8, seed=s).to(kernel_device) for s in (1, 2, 3))
    k[:, :, :20] = 50 * torch.nn.functional.normalize(k[:, :, :20], dim=-1)
    ref = rfattn.rf_attention(*(x.double() for x in (q, k, v)), copy.deepcopy(rf).double(),
                              causal=True, backend="torch")  # fmt: skip
    for backend in backends(rf, causal=True):
        kw = dict(causal=True, backend=backend)
        full = rfattn.rf_attention(q, k, v, rf, **kw)
        head = rfattn.rf_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], rf, **kw)
        assert head.abs().sum() > 1.0, backend  # not underflowed
        torch.testing.assert_close(full[:, :, :20], head, rtol=1e-4, atol=1e-4, msg=backend)
        # signed features (hrf): denominators that cancel put the one-shot fp32 output itself
        # ~0.035 from float64 at values ~50 (posrf: ~1e-6); a split may move it by rounding
        # only, i.e. by no more than that error
        atol = max(1e-4, float((full.double() - ref).abs().max()))
        for cut in (1, 7, 20, 31):
            a, s1 = rfattn.rf_attention(
                q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], rf, return_state=True, **kw
            )
            b = rfattn.rf_attention(
                q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], rf, initial_state=s1, **kw
            )
            # fp32 with logits near -440: the exponent's rounding is ~440 * 2^-24 relative
            torch.testing.assert_close(
                torch.cat((a, b), dim=2), full, rtol=1e-4, atol=atol, msg=(backend, cut)
            )


@pytest.mark.parametrize(
    "feature,weights",
    [("posrf", "orf"), ("trigrf", "orf"), pytest.param("hrf", "gaussian", marks=pytest.mark.slow)],
)
def test_causal_gradients_hold_where_the_forward_does(feature, weights, kernel_device):
    """The same keys as above (logits spread by ~440 inside one chunk): fp32 gradients equal fp64
    ones. Before, the Triton backward recomputed keys at its chunk's offset: the first 20 keys
    underflowed there and their rows' cotangents overflowed (NaN dq, dk, dv)."""
    rf = rfattn.RandomFeatures(8, 16, feature, weights=weights, seed=0).to(kernel_device)
    q, k, v = (rand(1, 1, 32, 8, seed=s, dtype=f64).to(kernel_device) for s in (1, 2, 3))
    k[:, :, :20] = 50 * torch.nn.functional.normalize(k[:, :, :20], dim=-1)
    do = rand(1, 1, 32, 8, seed=4, dtype=f64).to(kernel_device)
    for backend in backends(rf, causal=True):
        grads = []
        for dt in (f64, f32):
            x = [t.to(dt).requires_grad_() for t in (q, k, v)]
            out = rfattn.rf_attention(*x, rf, causal=True, backend=backend)
            grads.append(torch.autograd.grad(out, x, do.to(dt)))
        for name, g32, g64 in zip("qkv", grads[1], grads[0], strict=True):
            err = ((g32.double() - g64).norm() / g64.norm()).item()
            # fp32 logits near -440 carry ~440 * 2^-24 relative error into each exponent
            assert err <= 5e-3, (backend, name, err)


@pytest.mark.parametrize("feature", ["poisrf", "geomrf"])
def test_discrete_features_propagate_nan(feature):
    """A NaN input gives NaN outputs (before: poisrf raised 'cannot convert float NaN to
    integer' while drawing its integer rows)."""
    rf = rfattn.RandomFeatures(8, 16, feature, seed=0)
    q = rand(1, 1, 6, 8, seed=1)
    k = q.clone()
    k[0, 0, 2, 3] = NAN
    assert rfattn.rf_attention(q, k, q, rf, backend="torch").isnan().any()


def test_nan_in_a_padded_key_gives_no_nan_gradient(kernel_device):
    """Learnable weights (fastfoodl) and the padded key's own dk stay finite, 0 for that key, on
    both backends (before: NaN on the torch path, 0 under Triton)."""
    rf = rfattn.RandomFeatures(8, 16, "posrf", weights="fastfoodl", seed=0).to(kernel_device)
    q, k, v = (rand(1, 1, 6, 8, seed=s).to(kernel_device) for s in (1, 2, 3))
    k[0, 0, 5] = NAN
    mask = torch.tensor([[False] * 5 + [True]], device=kernel_device)
    for backend in backends(rf):
        rf.zero_grad()
        kk = k.clone().requires_grad_()
        rfattn.rf_attention(q, kk, v, rf, key_padding_mask=mask, backend=backend).sum().backward()
        grads = [p.grad for p in rf.parameters() if p.grad is not None]
        assert grads and all(g.isfinite().all() for g in grads), backend
        assert kk.grad.isfinite().all() and not kk.grad[0, 0, 5].any(), backend


@pytest.mark.parametrize("feature", ["oprf", "saderf"])
def test_query_statistics_follow_the_query_mask(feature, kernel_device):
    """Equal-length cross-attention: the query statistics see every query, so permuting the keys
    (with their mask) changes nothing (before: Tq == Tk took the key mask as the queries' too).
    Self-attention passes query_padding_mask: junk in padded query rows changes no other row."""
    rf = rfattn.RandomFeatures(8, 16, feature, seed=0).to(kernel_device).eval()
    q, k, v = (rand(2, 2, 7, 8, seed=s).to(kernel_device) for s in (1, 2, 3))
    v = v[..., :4]
    mask = torch.zeros(2, 7, dtype=torch.bool, device=kernel_device)
    mask[0, 5:], mask[1, :2] = True, True
    perm = torch.tensor([3, 6, 0, 5, 1, 4, 2], device=kernel_device)
    for backend in backends(rf):
        out = rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask, backend=backend)
        shuffled = rfattn.rf_attention(
            q, k[:, :, perm], v[:, :, perm], rf, key_padding_mask=mask[:, perm], backend=backend
        )
        torch.testing.assert_close(shuffled, out, msg=backend)
        phi_q, phi_k = rf.features(q, k, mask)  # every query in the statistics
        ref = rfattn.reference.linear_attention(
            phi_q, phi_k, v.to(phi_q.dtype), key_padding_mask=mask
        )
        torch.testing.assert_close(out, ref.to(out.dtype), msg=backend)
        # self-attention with junk in the padded positions of q, k and v
        x = q.clone()
        clean = rfattn.rf_attention(
            x, x, v, rf, key_padding_mask=mask, query_padding_mask=mask, backend=backend
        )
        junk = x.masked_fill(mask[:, None, :, None], NAN)
        out = rfattn.rf_attention(
            junk, junk, v, rf, key_padding_mask=mask, query_padding_mask=mask, backend=backend
        )
        keep = ~mask[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out[keep], clean[keep], msg=backend)


def test_layers_and_hf_pass_the_query_mask():
    """RFMultiheadAttention in self-attention leaves its padded queries out of the statistics:
    NaN in padded input positions changes no valid output."""
    layer = rfattn.RFMultiheadAttention(
        16, 2, batch_first=True, feature="oprf", num_features=16, seed=0
    ).eval()
    x = rand(2, 6, 16, seed=1)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 4:] = True
    clean, _ = layer(x, x, x, key_padding_mask=mask, need_weights=False)
    junk = x.masked_fill(mask[..., None], NAN)
    out, _ = layer(junk, junk, junk, key_padding_mask=mask, need_weights=False)
    torch.testing.assert_close(out[~mask], clean[~mask])


def test_an_empty_call_passes_the_state_through(kernel_device):
    """T = 0 returns the given state (or the empty one) exactly, decode step and chunked form
    alike (before: the decode step returned uninitialised memory as S and z; found by
    tests/test_properties.py)."""
    rf = rfattn.RandomFeatures(8, 12, "posrf", seed=0).double().to(kernel_device)
    q, k, v = (
        rand(1, 2, 5, d, seed=s, dtype=f64).to(kernel_device) for s, d in ((1, 8), (2, 8), (3, 4))
    )
    empty = (q[:, :, :0], k[:, :, :0], v[:, :, :0])
    for backend in backends(rf, causal=True):
        kw = dict(causal=True, backend=backend, return_state=True)
        _, given = rfattn.rf_attention(q, k, v, rf, **kw)
        for grad in (False, True):  # decode step / chunked form
            with torch.set_grad_enabled(grad):
                args = [x.clone().requires_grad_(grad) for x in empty]
                _, none = rfattn.rf_attention(*args, rf, **kw)
                _, same = rfattn.rf_attention(*args, rf, initial_state=given, **kw)
            assert not none.s.any() and not none.z.any() and none.offset.isneginf().all(), backend
            for a, b in zip(same, given, strict=True):
                assert torch.equal(a.detach(), b), (backend, grad)


def test_query_padding_mask_is_checked():
    """The new argument gets the key mask's checks, each error naming it."""
    rf = rfattn.RandomFeatures(8, 16, "oprf", seed=0)
    q, k = rand(2, 1, 5, 8, seed=1), rand(2, 1, 7, 8, seed=2)
    v = rand(2, 1, 7, 4, seed=3)
    with pytest.raises(ValueError, match=r"query_padding_mask must have shape \[B, T\] = \(2, 5\)"):
        rfattn.rf_attention(q, k, v, rf, query_padding_mask=torch.zeros(2, 7, dtype=torch.bool))
    with pytest.raises(TypeError, match="query_padding_mask must be bool"):
        rfattn.rf_attention(q, k, v, rf, query_padding_mask=torch.zeros(2, 5))
    with pytest.raises(TypeError, match="query_padding_mask must be a torch.Tensor"):
        rfattn.rf_attention(q, k, v, rf, query_padding_mask=[[False] * 5] * 2)


@pytest.mark.parametrize("feature", ["oprf", "saderf", "posrf", "hyprf"])
@pytest.mark.parametrize("head_dim", [8, 16])
def test_large_norms_match_float64_in_float32(feature, head_dim, kernel_device):
    """|q| = |k| = 30 (docs/numerics.md's large-norm case), non-causal: fp32 equals fp64 of the same
    estimator to fp32 rounding, no zero row, finite gradients. Before: oprf/saderf logits spread
    by hundreds across features, and one key offset per (b, h) let whole rows underflow to 0 (up
    to 32 of 64) with NaN dq/dk; keys now sit at per-feature offsets moved to the queries."""
    rf = rfattn.RandomFeatures(head_dim, 64, feature, seed=0).to(kernel_device).eval()
    q, k = rand(1, 2, 64, head_dim, seed=1, dtype=f64), rand(1, 2, 64, head_dim, seed=2, dtype=f64)
    q, k = 30 * q / q.norm(dim=-1, keepdim=True), 30 * k / k.norm(dim=-1, keepdim=True)
    v = rand(1, 2, 64, 8, seed=3, dtype=f64)
    q, k, v = (x.to(kernel_device) for x in (q, k, v))
    for backend in backends(rf):
        ref = rfattn.rf_attention(q, k, v, rf, backend=backend)  # stats from the batch
        q32, k32, v32 = (x.float().requires_grad_() for x in (q, k, v))
        out = rfattn.rf_attention(q32, k32, v32, rf, backend=backend)
        out.square().sum().backward()
        assert (out.abs().sum(-1) > 0).all(), backend
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err <= 2e-5, (backend, err)
        for x in (q32, k32, v32):
            assert x.grad.isfinite().all(), backend


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(0, 2, 5, 8), (2, 0, 5, 8)])
def test_no_batch_rows_or_no_heads(causal, shape):
    """B = 0 or H = 0: the empty output with its graph, the state passed through, running
    statistics untouched, every feature and backend (before: causal calls raised on a reshape
    or an amax/amin over nothing, non-causal oprf/saderf too)."""
    from rfattn.features import ALL_FEATURES, VALID_WEIGHTS

    cases = [(f, {}) for f in ALL_FEATURES] + [("oprf", dict(stats="running"))]
    for feature, opts in cases:  # training mode: running statistics would move
        weights = "rademacher" if feature == "rmf" else VALID_WEIGHTS[feature][0]
        rf = rfattn.RandomFeatures(8, 12, feature, weights=weights, seed=0, **opts)
        buffers = copy.deepcopy(dict(rf.named_buffers()))
        for backend in backends(rf, causal):
            q, k = (torch.randn(shape, requires_grad=True) for _ in range(2))
            v = torch.randn(*shape[:3], 4, requires_grad=True)
            res = rfattn.rf_attention(q, k, v, rf, causal=causal, backend=backend,
                                      return_state=causal)  # fmt: skip
            out = res[0] if causal else res
            assert out.shape == (*shape[:3], 4), (feature, backend)
            out.sum().backward()
            assert all(x.grad is not None and x.grad.shape == x.shape for x in (q, k, v))
            if causal:
                F = rf.feature_map.width(12)
                assert res[1].s.shape == (*shape[:2], F, 4) and res[1].offset.shape == shape[:2]
                _, again = rfattn.rf_attention(q, k, v, rf, causal=True, backend=backend,
                                               initial_state=res[1], return_state=True)  # fmt: skip
                assert all(a is b for a, b in zip(again, res[1], strict=True))
        for name, b in rf.named_buffers():
            assert torch.equal(b, buffers[name]), (feature, name)


def test_layers_take_empty_batches_and_sequences():
    for causal in (False, True):
        layers = (rfattn.RFAttention(16, 2, num_features=8, causal=causal),
                  rfattn.RFMultiheadAttention(16, 2, num_features=8, batch_first=True))  # fmt: skip
        for shape in ((0, 5, 16), (2, 0, 16)):
            for layer in layers:
                x = torch.randn(shape, requires_grad=True)
                args = (x,) if isinstance(layer, rfattn.RFAttention) else (x, x, x)
                kw = {} if isinstance(layer, rfattn.RFAttention) else dict(is_causal=causal)
                out = layer(*args, **kw)
                out = out[0] if isinstance(out, tuple) else out
                assert out.shape == shape
                out.sum().backward()
                assert x.grad.shape == shape


def test_a_state_of_non_tensors_is_named():
    rf = rfattn.RandomFeatures(8, 12, seed=0)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(TypeError, match="initial_state.s"):  # before: a weakref TypeError
        rfattn.rf_attention(q, q, q, rf, causal=True, initial_state=(1, 2, 3))


def test_layer_inputs_and_options_are_named():
    layer = rfattn.RFAttention(32, 2, num_features=8)
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match="embed_dim=32"):  # before: torch's mat1/mat2 message
        layer(torch.randn(2, 5, 33))
    with pytest.raises(ValueError, match="batch size"):
        layer(x, torch.randn(3, 5, 32))
    with pytest.raises(ValueError, match="same length"):
        layer(x, x, torch.randn(2, 6, 32))
    with pytest.raises(ValueError, match=r"'num_featuress' -> 'num_features'"):
        rfattn.RandomFeatures(8, 12, "posrf", num_featuress=4)
    with pytest.raises(ValueError, match=r"'stat' -> 'stats'"):
        rfattn.RFAttention(32, 2, num_features=8, feature="oprf", stat="running")


PADDED_QUERY_FEATURES = [
    ("trigrf", "orf"), ("posrf", "orf"), ("hyprf", "orf"), ("gerf", "orf"), ("oprf", "orf"),
    ("saderf", "orf"), ("hrf", "gaussian"), ("rmf", "rademacher"), ("poisrf", "gaussian"),
    ("geomrf", "gaussian"),
]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("feature,weights", [
    pytest.param(f, w, id=f, marks=[pytest.mark.slow] if f == "hrf" else [])  # 22 s: make test-slow
    for f, w in PADDED_QUERY_FEATURES
])  # fmt: skip
def test_junk_in_padded_queries_reaches_no_gradient(feature, weights, causal, kernel_device):
    """NaN, inf and 1e30 in the padded positions of q, k and v (left and right padding,
    grouped-query heads), a cotangent that is not 0 there: outputs and gradients are those of
    the same call with other, finite values there; padded rows output 0 and get gradient 0
    (before: NaN in k.grad and v.grad of every valid token, posrf and rmf on both backends; the
    padded rows' own output was computed from their junk). Every feature, both backends."""
    rf = rfattn.RandomFeatures(8, 16, feature, weights=weights, seed=0).double()
    rf = rf.to(kernel_device).eval()
    B, HQ, HK, T = 2, 4, 2, 9
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :3], mask[1, -2:] = True, True  # left padding, right padding
    pad = mask[:, None, :, None]
    clean = [rand(B, h, T, d, seed=i, dtype=f64) for i, (h, d) in enumerate(((HQ, 8), (HK, 8),
                                                                             (HK, 4)))]  # fmt: skip
    other = [torch.where(pad, rand(*x.shape, seed=10 + i, dtype=f64), x)
             for i, x in enumerate(clean)]  # fmt: skip
    junk = []
    for x in clean:
        x = x.clone()
        x[0, :, 0], x[0, :, 1], x[0, :, 2], x[1, :, -2:] = NAN, float("inf"), 1e30, -1e30
        junk.append(x)
    do = rand(B, HQ, T, 4, seed=20, dtype=f64).to(kernel_device)  # not 0 on padded rows
    for backend in backends(rf, causal):
        results = []
        for xs in (other, junk):
            leaves = [x.to(kernel_device).requires_grad_() for x in xs]
            out = rfattn.rf_attention(*leaves, rf, causal=causal, key_padding_mask=mask.to(
                kernel_device), query_padding_mask=mask.to(kernel_device), backend=backend)
            results.append((out, *torch.autograd.grad(out, leaves, do)))
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results, strict=True):
            assert torch.isfinite(b).all(), (backend, name)
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=(backend, name))
            padded = mask.to(kernel_device)[:, None, :, None].expand_as(b)
            assert (b[padded] == 0).all(), (backend, name)
