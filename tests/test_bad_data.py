"""Correct under bad data (issue 15): junk in padded positions, NaN locality, queries with no valid
key, empty sequences, bad states and options. Each test failed before its fix; both backends where
the case applies (the Triton kernels under the interpreter on CPU)."""

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
            rfattn.rf_attention(junk_k, junk_k, junk_v, rf, causal=True, key_padding_mask=mask,
                                backend=backend)  # fmt: skip
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
            out = rfattn.rf_attention(*args, rf, causal=causal, key_padding_mask=mask,
                                      backend=backend)  # fmt: skip
            out.backward(cot)
            assert torch.equal(out.masked_select(empty), torch.zeros_like(out.masked_select(empty)))
            grads.append([x.grad for x in args])
        for a, b in zip(*grads, strict=True):
            assert a.isfinite().all(), backend
            torch.testing.assert_close(a, b, msg=backend)
