"""autograd.Functions around the fused kernels (``rfattn.kernels``)."""

from __future__ import annotations

import torch

__all__ = ["RFParallelFunction", "rf_parallel"]


class RFParallelFunction(torch.autograd.Function):
    """Non-causal fused random-feature attention. Forward only for now.

    The fused backward (dq, dk, dv recomputing features) lands with the non-causal kernels
    issue; until then calling ``backward`` raises NotImplementedError, and
    ``rf_attention(backend="auto")`` routes inputs that require grad to the torch path.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, scale, key_padding_mask, feature, precision):
        from rfattn.kernels.rf_parallel import rf_parallel_fwd

        return rf_parallel_fwd(
            q,
            k,
            v,
            w,
            scale,
            key_padding_mask=key_padding_mask,
            feature=feature,
            precision=precision,
        )

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError(
            "the fused Triton backward of rf_attention is not implemented yet; "
            "use backend='torch' (or backend='auto') for training"
        )


def rf_parallel(q, k, v, w, scale, key_padding_mask=None, feature="posrf", precision="ieee"):
    """Apply :class:`RFParallelFunction` (see ``rfattn.kernels.rf_parallel.rf_parallel_fwd``)."""
    return RFParallelFunction.apply(q, k, v, w, scale, key_padding_mask, feature, precision)
