"""rf_attention under autocast (issue 34): the inputs are cast to the autocast dtype, as autocast
casts SDPA's, and the call then computes with rfattn's own dtypes (fp32 accumulation), forward
and backward, on both backends; the same result as the call on the cast inputs outside autocast.
CPU autocast covers CUDA's dtypes (fp16, bf16); the device type is q's."""

import pytest
import torch

import rfattn
from rfattn.attention import fused_kernel_available

B, H, T, D, E = 2, 2, 21, 8, 5
DTYPES = [torch.bfloat16, torch.float16]


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def backends(rf, causal):
    return ["torch"] + (["triton"] if fused_kernel_available(rf, causal) else [])


def grads_of(q, k, v, rf, dtype, autocast: bool, backward_inside: bool, **kw):
    """Output and (q, k, v) gradients of sum(out * do) from fp32 leaves; with ``autocast`` the
    call (and, with ``backward_inside``, the backward) runs in an autocast region, otherwise
    on the leaves cast to ``dtype`` by hand."""
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    do = rand(B, H, T, E, seed=9).to(dtype)
    with torch.autocast("cpu", dtype=dtype, enabled=autocast):
        args = xs if autocast else [x.to(dtype) for x in xs]
        out = rfattn.rf_attention(*args, rf, **kw)
        if backward_inside:
            return out, torch.autograd.grad(out, xs, do)
    return out, torch.autograd.grad(out, xs, do)


# fp16 in make test-slow (~5 s per causal case): the same path as bf16 with another dtype
@pytest.mark.parametrize("dtype", [DTYPES[0], pytest.param(DTYPES[1], marks=pytest.mark.slow)],
                         ids=["bf16", "fp16"])  # fmt: skip
# causal: ~20 s under the interpreter (the half policy's emulated products), in `make test-slow`
# (make test runs the causal bf16 kernels in tests/test_precision.py)
@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["noncausal", "causal"])  # fmt: skip
# oprf (its statistics pass adds 10-13 s per case under the interpreter) in `make test-slow`
@pytest.mark.parametrize("feature", ["posrf", pytest.param("oprf", marks=pytest.mark.slow)])
def test_autocast_computes_as_the_cast_inputs(feature, causal, dtype, kernel_device):
    """Under autocast the output and gradients equal the call on the inputs cast by hand, bit for
    bit, with the backward outside or inside the autocast region (before: causal calls raised
    'Bad in-place call' on the torch path, non-causal ones ran their products in bf16)."""
    rf = rfattn.RandomFeatures(D, 16, feature, seed=0).to(kernel_device).eval()
    mask = torch.zeros(B, T, dtype=torch.bool, device=kernel_device)
    mask[1, :4] = True
    q, k, v = (rand(B, H, T, d, seed=i).to(kernel_device) for i, d in enumerate((D, D, E)))
    for backend in backends(rf, causal):
        kw = dict(causal=causal, key_padding_mask=mask, backend=backend)
        ref, ref_grads = grads_of(q, k, v, rf, dtype, False, False, **kw)
        for inside in (False, True):
            out, grads = grads_of(q, k, v, rf, dtype, True, inside, **kw)
            assert out.dtype == dtype
            msg = f"{backend}, backward {'inside' if inside else 'outside'} autocast"
            torch.testing.assert_close(out, ref, rtol=0, atol=0, msg=msg)
            for name, a, b in zip("qkv", grads, ref_grads, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{msg}: d{name}")


def test_autocast_casts_mixed_inputs_and_leaves_float64():
    """Inputs of different float dtypes are cast to the autocast dtype (as autocast does for
    SDPA); float64 inputs are not autocast's to cast and run in float64."""
    rf = rfattn.RandomFeatures(D, 16, "posrf", seed=0)
    q, k, v = (rand(B, H, T, d, seed=i) for i, d in enumerate((D, D, E)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = rfattn.rf_attention(q, k.bfloat16(), v.half(), rf, causal=True)
        out64 = rfattn.rf_attention(q.double(), k.double(), v.double(), rf, causal=True)
    ref = rfattn.rf_attention(q.bfloat16(), k.bfloat16(), v.half().bfloat16(), rf, causal=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    ref64 = rfattn.rf_attention(q.double(), k.double(), v.double(), rf, causal=True)
    assert out64.dtype == torch.float64
    torch.testing.assert_close(out64, ref64, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_layer_trains_under_autocast(causal):
    """RFAttention in a bf16 autocast training step (the issue's reproduction): the output is
    bf16 and every parameter gets a finite gradient."""
    layer = rfattn.RFAttention(32, 4, num_features=16, causal=causal)
    x = rand(2, 40, 32, seed=3).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    for name, p in layer.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert torch.isfinite(x.grad).all()
