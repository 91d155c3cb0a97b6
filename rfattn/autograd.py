"""autograd.Functions around the fused kernels (``rfattn.kernels``)."""

from __future__ import annotations

import torch

__all__ = ["RFParallelFunction", "rf_parallel"]


class RFParallelFunction(torch.autograd.Function):
    """Non-causal fused random-feature attention (``rfattn.kernels.rf_parallel``).

    Forward saves q, k, v, W, the output, S, z and the stabiliser offsets (``O(B H (M E + T))``
    extra memory, no feature maps); backward recomputes the features in Triton and returns
    dq, dk, dv and, when W requires grad (learnable weights), dW.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, scale, key_padding_mask, gerf, psi, precision):
        from rfattn.kernels.rf_parallel import rf_parallel_fwd

        out, aux = rf_parallel_fwd(
            q, k, v, w, scale, key_padding_mask=key_padding_mask, precision=precision,
            return_aux=True, gerf=gerf, psi=psi,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, w, out, key_padding_mask, gerf, psi, *aux)
        ctx.scale, ctx.precision = scale, precision
        ctx.mark_non_differentiable(*[x for x in aux if x is not None])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from rfattn.kernels.rf_parallel import rf_parallel_bwd

        q, k, v, w, out, key_padding_mask, gerf, psi, *aux = ctx.saved_tensors
        dq, dk, dv, dw = rf_parallel_bwd(
            grad_out, q, k, v, w, ctx.scale, out, tuple(aux), key_padding_mask=key_padding_mask,
            precision=ctx.precision, need_dw=ctx.needs_input_grad[3], gerf=gerf, psi=psi,
        )  # fmt: skip
        return dq, dk, dv, dw, None, None, None, None, None


def rf_parallel(q, k, v, w, scale, key_padding_mask=None, gerf=None, psi=None, precision=None):
    """Fused non-causal attention with real positive GERF features (posrf when ``gerf`` and
    ``psi`` are None); see ``rfattn.kernels.rf_parallel.rf_parallel_fwd`` for the arguments.
    Gradients reach q, k, v and W (not the per-(b, h) parameters ``gerf``, ``psi``)."""
    return RFParallelFunction.apply(q, k, v, w, scale, key_padding_mask, gerf, psi, precision)
