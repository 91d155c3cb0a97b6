"""autograd.Functions around the fused kernels (``rfattn.kernels``)."""

from __future__ import annotations

import torch

__all__ = ["RFParallelFunction", "rf_parallel", "RFChunkFunction", "rf_chunk"]


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


class RFChunkFunction(torch.autograd.Function):
    """Causal fused random-feature attention, chunkwise (``rfattn.kernels.rf_chunk``), for every
    feature form of the non-causal kernel.

    Inputs q, k, v, W and an optional initial state (S0, z0, offset0); outputs the attention
    output and the final state (S, z, offset). Gradients reach q, k, v and the initial S0, z0,
    from cotangents of the output and of the final S, z, taken with the offsets held fixed --
    i.e. the gradients of the offset-invariant ``S exp(offset)`` (offsets are stabilisers, not
    differentiable). W gets no gradient here (``rf_attention`` sends learnable W to the torch
    path). Chunk states are recomputed in the backward, not saved.
    """

    @staticmethod
    def forward(ctx, q, k, v, w, s0, z0, off0, scale, key_padding_mask, precision, form):
        from rfattn.kernels.rf_chunk import rf_chunk_fwd

        init = None if s0 is None else (s0, z0, off0)
        out, (s, z, off), aux = rf_chunk_fwd(
            q, k, v, w, scale, key_padding_mask=key_padding_mask, initial_state=init,
            precision=precision, return_aux=True, **form,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, w, out, key_padding_mask, s0, z0, off0, *aux)
        ctx.scale, ctx.precision, ctx.form = scale, precision, form
        ctx.mark_non_differentiable(off)
        return out, s, z, off

    @staticmethod
    def backward(ctx, d_out, d_s, d_z, d_off):
        from rfattn.kernels.rf_chunk import rf_chunk_bwd

        q, k, v, w, out, kpm, s0, z0, off0, *aux = ctx.saved_tensors
        if d_out is None:
            d_out = torch.zeros_like(out)
        dstate = None
        if d_s is not None or d_z is not None:
            B, H, M, E = q.shape[0], q.shape[1], w.shape[0], v.shape[-1]
            acc = torch.float64 if q.dtype == torch.float64 else torch.float32
            d_s = d_s if d_s is not None else q.new_zeros(B, H, M, E, dtype=acc)
            d_z = d_z if d_z is not None else q.new_zeros(B, H, M, dtype=acc)
            dstate = (d_s, d_z)
        init = None if s0 is None else (s0, z0, off0)
        dq, dk, dv, ds0, dz0 = rf_chunk_bwd(
            d_out, dstate, q, k, v, w, ctx.scale, out, tuple(aux), key_padding_mask=kpm,
            initial_state=init, precision=ctx.precision, **ctx.form,
        )  # fmt: skip
        if ds0 is not None:
            ds0, dz0 = ds0.to(s0.dtype), dz0.to(z0.dtype)
        return dq, dk, dv, None, ds0, dz0, None, None, None, None, None


def rf_chunk(q, k, v, w, scale, key_padding_mask=None, initial_state=None, precision=None,
             feature="gerf", gerf=None, psi=None, table=None, extra_rows=None,
             index=None):  # fmt: skip
    """Causal fused attention (any feature form; arguments as ``rf_parallel``); see
    ``rfattn.kernels.rf_chunk.rf_chunk_fwd``. Returns ``(out, S, z, offset)``."""
    s0, z0, off0 = (None, None, None) if initial_state is None else initial_state
    form = dict(feature=feature, gerf=gerf, psi=psi, table=table, extra_rows=extra_rows,
                index=index)  # fmt: skip
    return RFChunkFunction.apply(q, k, v, w, s0, z0, off0, scale, key_padding_mask, precision, form)
