"""``rfattn.autograd.apply``: a Function applied without ``Function.apply``'s Python wrapper
gives the same outputs, graph and gradients, and under a functorch transform takes
``Function.apply``'s own path (its refusal of Functions without ``setup_context`` included)."""

import pytest
import torch

from rfattn.autograd import apply


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor, unused):
        ctx.factor = factor
        return x * factor

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None, None


def test_apply_equals_function_apply():
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = apply(_Scaled, x, 3.0, None)
    assert type(y.grad_fn).__name__ == "_ScaledBackward"
    (gx,) = torch.autograd.grad(y.square().sum(), x)
    want = _Scaled.apply(x, 3.0, None)
    (want_gx,) = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(gx, want_gx, rtol=0, atol=0)
    torch.testing.assert_close(gx, 18.0 * x.detach(), rtol=1e-15, atol=0)


def test_under_a_transform_apply_is_function_apply():
    x = torch.randn(5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: _Scaled.apply(t, 2.0, None).sum())(x)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: apply(_Scaled, t, 2.0, None).sum())(x)
