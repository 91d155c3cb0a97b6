"""Grouped-query attention without repeating keys and values (issue 16): k, v with fewer heads
than q; key features and states once per key/value head, on both backends (the Triton kernels
under the interpreter on CPU)."""

import pytest
import torch

import rfattn
from rfattn.attention import fused_kernel_available

f64 = torch.float64
B, HQ, HK, D, E = 2, 6, 2, 8, 5
G = HQ // HK

FEATURES = [
    ("posrf", dict(weights="orf")),
    ("trigrf", dict(weights="orf")),
    ("hrf", dict(weights="gaussian")),
    ("rmf", dict(weights="rademacher")),
    ("oprf", dict(weights="orf", stats="running")),
]
# under the interpreter the causal kernels take 15-100 s per case: posrf in `make test`, the
# other forms in `make test-slow`
CASES = [
    pytest.param(f, o, c, id=f"{f}-{'causal' if c else 'noncausal'}",
                 marks=[pytest.mark.slow] if c and f != "posrf" or f == "hrf" else [])
    for f, o in FEATURES
    for c in (False, True)
]  # fmt: skip


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def backends(rf, causal):
    return ["torch"] + (["triton"] if fused_kernel_available(rf, causal) else [])


def inputs(T, device, seed=0):
    q = rand(B, HQ, T, D, seed=seed + 1).to(device)
    k = rand(B, HK, T, D, seed=seed + 2).to(device)
    v = rand(B, HK, T, E, seed=seed + 3).to(device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=device)
    mask[1, :3] = True  # left padding
    return q, k, v, mask


def repeated(x):
    """transformers' repeat_kv: key/value head j serves query heads j*G .. j*G + G-1."""
    return x.repeat_interleave(G, dim=1)


@pytest.mark.parametrize("feature,opts,causal", CASES)
def test_grouped_heads_equal_repeated_heads(feature, opts, causal, kernel_device):
    """Outputs and gradients (q, k, v) equal those of the same call with k and v repeated to
    every query head (float64; the key/value gradient sums its group's)."""
    rf = rfattn.RandomFeatures(D, 16, feature, seed=0, **opts).to(kernel_device).eval()
    q, k, v, mask = inputs(37, kernel_device)
    do = rand(B, HQ, 37, E, seed=9).to(kernel_device)
    for backend in backends(rf, causal):
        kw = dict(causal=causal, key_padding_mask=mask, backend=backend)
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = rfattn.rf_attention(*xs, rf, **kw)
        grads = torch.autograd.grad(out, xs, do)
        xr = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = rfattn.rf_attention(xr[0], repeated(xr[1]), repeated(xr[2]), rf, **kw)
        ref_grads = torch.autograd.grad(ref, xr, do)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11, msg=backend)
        for name, a, b in zip("qkv", grads, ref_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=(backend, name))


@pytest.mark.parametrize(
    "feature,opts",
    [pytest.param(f, o, id=f, marks=[pytest.mark.slow] if f != "posrf" else [])
     for f, o in FEATURES[:3]],
)  # fmt: skip
@pytest.mark.slow  # ~12 s interpreted; test_grouped_heads_equal_repeated_heads covers GQA here
def test_grouped_state_is_per_key_value_head(feature, opts, kernel_device):
    """The state is [B, Hkv, F, E]; split/resume and token-by-token decoding (the decode kernel:
    no gradient, few tokens) equal one shot; the initial state's gradient is the sum over its
    group of the repeated call's."""
    rf = rfattn.RandomFeatures(D, 16, feature, seed=0, **opts).to(kernel_device)
    F = rf.feature_map.width(rf.num_features)
    T = 24
    q, k, v, mask = inputs(T, kernel_device, seed=10)
    for backend in backends(rf, causal=True):
        kw = dict(causal=True, backend=backend)
        full, st = rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask, return_state=True,
                                       **kw)  # fmt: skip
        assert tuple(st.s.shape) == (B, HK, F, E) and tuple(st.offset.shape) == (B, HK)
        cut = 9
        a, s1 = rfattn.rf_attention(
            q[:, :, :cut],
            k[:, :, :cut],
            v[:, :, :cut],
            rf,
            key_padding_mask=mask[:, :cut],
            return_state=True,
            **kw,
        )
        parts = [a]
        with torch.no_grad():  # the decode step: one token at a time on the state
            for t in range(cut, T):
                o, s1 = rfattn.rf_attention(q[:, :, t : t + 1], k[:, :, t : t + 1],
                                            v[:, :, t : t + 1], rf, initial_state=s1,
                                            key_padding_mask=mask[:, t : t + 1],
                                            return_state=True, **kw)  # fmt: skip
                parts.append(o)
        torch.testing.assert_close(torch.cat(parts, dim=2), full, rtol=1e-9, atol=1e-11,
                                   msg=backend)  # fmt: skip
        for x, y in zip(s1, st, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-11, msg=backend)
        # gradients through the initial state: [B, Hkv, ...] against the repeated call's
        s0 = [x.clone().requires_grad_(i < 2) for i, x in enumerate(s1)]
        out = rfattn.rf_attention(q, k, v, rf, initial_state=rfattn.RFState(*s0), **kw)
        g = torch.autograd.grad(out.square().sum(), s0[:2])
        s0r = [repeated(x).detach().requires_grad_(i < 2) for i, x in enumerate(s1)]
        ref = rfattn.rf_attention(q, repeated(k), repeated(v), rf,
                                  initial_state=rfattn.RFState(*s0r), **kw)  # fmt: skip
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11, msg=backend)
        gr = torch.autograd.grad(ref.square().sum(), s0r[:2])
        for x, y in zip(g, gr, strict=True):
            summed = y.unflatten(1, (HK, G)).sum(2)
            torch.testing.assert_close(x, summed, rtol=1e-9, atol=1e-11, msg=backend)


def test_grouped_global_statistics_pool_the_group(kernel_device):
    """oprf's global statistics are per key/value head, over the queries of its group: with the
    group's query heads all equal to one head, the result equals the ungrouped call on that
    head with k, v (the pooled moments are that head's)."""
    rf = rfattn.RandomFeatures(D, 16, "oprf", seed=0).to(kernel_device)
    q, k, v, mask = inputs(20, kernel_device, seed=20)
    q_one = q[:, ::G]  # one query head per key/value head
    for backend in backends(rf, causal=False):
        kw = dict(key_padding_mask=mask, backend=backend)
        out = rfattn.rf_attention(repeated(q_one), k, v, rf, **kw)
        ref = rfattn.rf_attention(q_one, k, v, rf, **kw)
        torch.testing.assert_close(out, repeated(ref), rtol=1e-9, atol=1e-11, msg=backend)


@pytest.mark.parametrize("feature", ["oprf", "saderf", "poisrf", "geomrf"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_grouped_running_statistics_in_training(feature, causal, kernel_device):
    """Running statistics in training mode (the causal default) with grouped-query heads, every
    feature with statistics and a fused form: the output and the buffers moved by the call equal
    the call with k, v repeated to every query head, on both backends (the fused stats pass
    stacked query moments [B, H, D] with key moments [B, Hkv, D] and raised)."""
    import copy

    rf = rfattn.RandomFeatures(D, 16, feature, seed=0, stats="running").to(kernel_device).train()
    q, k, v, mask = inputs(19, kernel_device, seed=30)
    ref_rf = copy.deepcopy(rf)
    kw = dict(causal=causal, key_padding_mask=mask, query_padding_mask=mask)
    ref = rfattn.rf_attention(q, repeated(k), repeated(v), ref_rf, backend="torch", **kw)
    assert int(ref_rf.feature_map.num_batches_tracked) == 1
    for backend in backends(rf, causal):
        fm = copy.deepcopy(rf)
        out = rfattn.rf_attention(q, k, v, fm, backend=backend, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11, msg=backend)
        for (name, b), r in zip(fm.feature_map.named_buffers(), ref_rf.feature_map.buffers(),
                                strict=True):  # fmt: skip
            torch.testing.assert_close(b, r, rtol=1e-12, atol=1e-14, msg=(backend, name))


def test_grouped_heads_are_checked():
    rf = rfattn.RandomFeatures(D, 16, "posrf", seed=0)
    q, k, v = rand(1, 6, 4, D), rand(1, 4, 4, D), rand(1, 4, 4, E)
    with pytest.raises(ValueError, match="multiple of k's and v's 4"):
        rfattn.rf_attention(q, k, v, rf)
    with pytest.raises(ValueError, match="v has 2 heads, expected k's 4"):
        rfattn.rf_attention(q[:, :4], k, v[:, :2], rf)
    q, k, v = rand(1, 4, 4, D), rand(1, 2, 4, D), rand(1, 2, 4, E)
    _, st = rfattn.rf_attention(q, k, v, rf, causal=True, return_state=True)
    with pytest.raises(ValueError, match=r"initial_state.s must have shape \(1, 2, 16, 5\)"):
        rfattn.rf_attention(
            q, k, v, rf, causal=True, initial_state=rfattn.RFState(repeated(st.s), st.z, st.offset)
        )
