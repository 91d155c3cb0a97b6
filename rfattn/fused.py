"""The fused path of one process's call: the feature's kernel form for the call (statistics from
the fused stats pass), then the custom operators of :mod:`rfattn.ops` (non-causal, chunked causal,
or the decode step). Importing the operators imports Triton, so they are imported on the first
fused call only."""

from __future__ import annotations

import dataclasses

import torch

from rfattn.call import Call, RFState, learns_gerf_a, mapped, no_kernel_reason, query_rows
from rfattn.features import compute_dtype, prescale
from rfattn.stats import Moments

__all__ = ["attend", "kernel_form"]


def attend(call: Call, gpu_tiles=None):
    """``out`` (or ``(out, state)`` with ``return_state``) of a call on the fused kernels: one
    process (no group), a non-causal grouped-query call as rows (:meth:`Call.as_rows`). Causal
    calls of at most ``rf_recurrent.MAX_TOKENS`` tokens without gradient run the decode step,
    others the chunked form; states keep the torch path's conventions (the kernel forms' offsets
    are the torch path's). Head maps are applied by the forward kernels as they load q and k; a
    call that needs gradients (of anything, the maps included) maps q and k first (the backward
    kernels take no maps). ``gpu_tiles``: as the launchers' (``bench.compile`` records a GPU's
    launches)."""
    from rfattn import ops

    rf, causal = call.rf, call.causal
    reason = no_kernel_reason(rf, causal)
    if reason is not None:
        raise NotImplementedError(f"{reason}; use backend='torch'")
    if learns_gerf_a(rf):
        raise NotImplementedError(
            "the fused kernels hold GERF's A constant: a call that needs the gradient of a "
            "learnable gerf_A runs backend='torch' (or run this one under torch.no_grad())"
        )
    grad = False  # whether autograd records the call (blocked.backward_follows, inlined)
    if torch.is_grad_enabled():
        given = (call.q, call.k, call.v, rf.weight, *(call.initial_state or ()),
                 *(call.maps or ()))  # fmt: skip
        for x in given:
            grad = grad or x is not None and x.requires_grad
    if grad and call.maps is not None:
        call = call.with_maps_applied()
    q, k, v, mask, scale = call.q, call.k, call.v, call.key_padding_mask, call.scale
    form = kernel_form(rf, q, k, mask, scale, causal, call.query_padding_mask, maps=call.maps)
    kw = dict(key_padding_mask=mask, gpu_tiles=gpu_tiles)
    if not causal:
        return ops.rf_parallel(q, k, v, form, scale, **kw)
    from rfattn.kernels.rf_recurrent import MAX_TOKENS

    # decoding (few tokens, no gradient): one launch, O(M (D + E)) per token
    run = ops.rf_decode if not grad and q.shape[2] <= MAX_TOKENS else ops.rf_chunk
    out, s, z, off = run(q, k, v, form, scale, initial_state=call.initial_state, **kw)
    return (out, RFState(s, z, off)) if call.return_state else out


def kernel_form(rf, q, k, key_padding_mask, scale: float, causal: bool,
                 query_padding_mask=None, moments=None, maps=None):  # fmt: skip
    """The feature's kernel form for this call: its per-call parameters, with the statistics of
    oprf/saderf from the fused stats pass (``rfattn.kernels.stats``; in torch where the operators
    run their torch kernels) where the call needs them (held constant: ``stats_grad=False``),
    or from ``moments`` when the caller has them (a sharded call's, over every shard).
    ``maps``: head maps ``(query_map, key_map)`` (either may be None) the kernels apply (the
    form's ``qmap``, ``kmap``); statistics are then those of the mapped q and k."""
    from rfattn import ops

    fm = rf.feature_map
    # empty stand-ins give the parameters dtype, device and D, never a copy of q, k
    xq = xk = q.new_empty((1, 1, 0, q.shape[-1]), dtype=compute_dtype(q.dtype))
    needs = getattr(fm, "uses_batch_moments", None) and fm.uses_batch_moments(causal)
    if moments is None and needs:
        if maps is not None:  # the moments are the only reader of the mapped q, k
            q, k = mapped(q, maps[0]), mapped(k, maps[1], key_padding_mask)
        # a key/value head's statistics take its group's queries (a view of contiguous q)
        q, query_padding_mask = query_rows(q, k, query_padding_mask)
        if ops.on_torch(q):
            xq, xk = prescale(q, scale), prescale(k, scale)
        else:
            from rfattn.kernels.stats import sequence_moments_fused

            moments = Moments(*sequence_moments_fused(q, k, scale, key_padding_mask,
                                                      query_padding_mask))  # fmt: skip
    with torch.no_grad():
        params = rf.feature_params(xq, xk, key_padding_mask, causal=causal, moments=moments,
                                   query_padding_mask=query_padding_mask)  # fmt: skip
    form = fm.kernel_form(rf.weight.to(q.device), params)
    if maps is None:
        return form
    qmap, kmap = (None if m is None else m.detach() for m in maps)
    return dataclasses.replace(form, qmap=qmap, kmap=kmap)
