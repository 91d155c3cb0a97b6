"""autograd.Functions around the fused kernels (``rfattn.kernels``)."""

from __future__ import annotations

import torch

__all__ = ["RFParallelFunction", "rf_parallel"]


class RFParallelFunction(torch.autograd.Function):
    """Non-causal fused random-feature attention (``rfattn.kernels.rf_parallel``).

    Forward saves q, k, v, W, the output, S, z and the stabiliser offsets (``O(B H (F E + T))``
    extra memory, no feature maps); backward recomputes the features in Triton and returns
    dq, dk, dv and, when W requires grad (learnable weights), dW.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, scale, key_padding_mask, gerf, psi, precision, feature="gerf",
                table=None, extra_rows=None, index=None):  # fmt: skip
        from rfattn.kernels.rf_parallel import rf_parallel_fwd

        form = dict(feature=feature, gerf=gerf, psi=psi, table=table, extra_rows=extra_rows,
                    index=index)  # fmt: skip
        out, aux = rf_parallel_fwd(
            q, k, v, w, scale, key_padding_mask=key_padding_mask, precision=precision,
            return_aux=True, **form,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, w, out, key_padding_mask, gerf, psi, table, extra_rows,
                              index, *aux)  # fmt: skip
        ctx.scale, ctx.precision, ctx.feature = scale, precision, feature
        ctx.mark_non_differentiable(*[x for x in aux if x is not None])
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from rfattn.kernels.rf_parallel import rf_parallel_bwd

        q, k, v, w, out, key_padding_mask, gerf, psi, table, extra_rows, index, *aux = (
            ctx.saved_tensors
        )
        dq, dk, dv, dw = rf_parallel_bwd(
            grad_out, q, k, v, w, ctx.scale, out, tuple(aux), key_padding_mask=key_padding_mask,
            feature=ctx.feature, precision=ctx.precision, need_dw=ctx.needs_input_grad[3],
            gerf=gerf, psi=psi, table=table, extra_rows=extra_rows, index=index,
        )  # fmt: skip
        return dq, dk, dv, dw, *([None] * 9)


def rf_parallel(q, k, v, w, scale, key_padding_mask=None, gerf=None, psi=None, precision=None,
                feature="gerf", table=None, extra_rows=None, index=None):  # fmt: skip
    """Fused non-causal attention in one of the kernel's feature forms (default: real positive
    GERF, posrf when ``gerf`` and ``psi`` are None); see
    ``rfattn.kernels.rf_parallel.rf_parallel_fwd`` for the arguments. Gradients reach q, k, v
    and W (not the per-(b, h) parameters, the table or the extra rows)."""
    return RFParallelFunction.apply(q, k, v, w, scale, key_padding_mask, gerf, psi, precision,
                                    feature, table, extra_rows, index)  # fmt: skip
