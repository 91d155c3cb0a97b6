"""The torch path of one process's call: the feature parameters of a call, then the blocked
causal or non-causal attention of :mod:`rfattn.blocked` (the CPU backend, and the path every
feature and option can take). :func:`causal_scan` and :func:`causal_keys` also serve the
operators' torch kernels (:mod:`rfattn.ops`) and the sharded path's local states."""

from __future__ import annotations

import torch

from rfattn import blocked, hybrid
from rfattn.call import Call, RFState, padded_rows, query_rows
from rfattn.features import compute_dtype, prescale

__all__ = ["attend", "causal_keys", "causal_scan", "empty_result", "move_statistics",
           "torch_inputs"]


def attend(call: Call):
    """``out`` (or ``(out, state)`` with ``return_state``) of a call on the torch path: one
    process (no group), a non-causal grouped-query call as rows (:meth:`Call.as_rows`); head
    maps applied inside the blocks.

    The feature parameters are those of :func:`torch_inputs`, without pre-scaled copies of q and
    k where they do not need this sequence's moments (empty stand-ins give dtype, device and D;
    grouped-query queries are not regrouped: only their moments would be). The head maps join
    them as ``"query_map"`` and ``"key_map"``: the blocks apply them
    (:func:`rfattn.features.prescale`), so the mapped q and k are never materialised (except for
    the moments of data-dependent statistics)."""
    q, k, v, rf, mask = call.q, call.k, call.v, call.rf, call.key_padding_mask
    fm = rf.feature_map
    update = call.update_stats
    needs = getattr(fm, "uses_batch_moments", None) and fm.uses_batch_moments(call.causal, update)
    if needs or getattr(fm, "stats_grad", False):
        w, _, _, params = torch_inputs(q, k, rf, mask, call.scale, call.causal,
                                        call.query_padding_mask, update, call.maps)  # fmt: skip
    else:
        w = rf.weight.to(device=q.device, dtype=compute_dtype(q.dtype))
        x = q.new_empty((1, 1, 0, q.shape[-1]), dtype=w.dtype)
        params = rf.feature_params(x, x, None, causal=call.causal, update=update,
                                   query_padding_mask=None)  # fmt: skip
    if call.maps is not None:
        params = {**params, "query_map": call.maps[0], "key_map": call.maps[1]}
    if not call.causal:
        return blocked.noncausal_attention(fm, q, k, v, w, params, call.scale, mask).to(q.dtype)
    out, state = blocked.causal_attention(fm, q, k, v, w, params, call.scale, mask,
                                          call.initial_state, call.return_state)  # fmt: skip
    out = out.flatten(1, 2).to(q.dtype)
    return (out, RFState(*state)) if call.return_state else out


def causal_scan(
    phi_q: torch.Tensor,
    u_k: torch.Tensor | None,
    g_k: torch.Tensor | None,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    state: RFState | None,
) -> tuple[torch.Tensor, RFState]:
    """Causal linear attention from features (``rfattn.blocked.causal_scan``): ``(out [B, H, G,
    T, E], final state)`` for query features ``[B, H, G, T, F]``, key logits ``u_k`` (None for
    a plain feature) and amplitudes or plain features ``g_k`` ``[B, H, T, F]``; the operators'
    torch kernels and the sharded path's local states use it."""
    out, state = blocked.causal_scan(phi_q, u_k, g_k, v, key_padding_mask, state)
    return out, RFState(*state)


def causal_keys(fm, xk, w, params) -> tuple:
    """``(u_k, g_k)`` of :func:`causal_scan` for pre-scaled keys: an exponential feature's
    logits and amplitude, or (None, the plain features times any component weights)."""
    if fm.exponential:
        return fm.logits(xk, w, "key", params), fm.key_amplitude(xk, w, params)
    g_k = fm.values(xk, w, "key", params)
    c_k = fm.key_amplitude(xk, w, params)  # component weights, if any
    return None, g_k if c_k is None else g_k * c_k


def torch_inputs(q, k, rf, key_padding_mask, scale: float, causal: bool, query_padding_mask,
                  update: bool = True, maps=None) -> tuple:  # fmt: skip
    """``(w, xq, xk, params)`` of the torch path: W and the pre-scaled inputs in the compute
    dtype (grouped-query queries as rows of their key/value head, :func:`grouped`; with
    ``maps``, :meth:`RandomFeatures.map_tensors`, mapped per head first) and the call's feature
    parameters (statistics, the feature's own draws; ``update``: running statistics may be
    updated)."""
    qmap, kmap = (None, None) if maps is None else maps
    w = rf.weight.to(device=q.device, dtype=compute_dtype(q.dtype))
    xq, xk = prescale(q, scale, None, qmap), prescale(k, scale, key_padding_mask, kmap)
    xq, query_padding_mask = query_rows(xq, k, query_padding_mask)
    # statistics (global ones raise when causal) and the feature's own draws, once per call
    params = rf.feature_params(xq, xk, key_padding_mask, causal=causal, update=update,
                               query_padding_mask=query_padding_mask)  # fmt: skip
    return w, xq, xk, params


def move_statistics(call: Call) -> None:
    """Move the running statistics a training call moves (oprf/saderf/poisrf/geomrf with
    ``stats="running"``), from the moments of its valid tokens, as :func:`attend` would: for a
    packed call, whose sequences read the statistics as they stand and leave them
    (``update_stats=False``), the moments of the whole row, so they move once per call, not per
    sequence. Nothing for any other call."""
    fm = call.rf.feature_map
    if not (call.update_stats and getattr(fm, "uses_batch_moments", None) and
            fm.uses_batch_moments(call.causal) and fm.mode(call.causal) == "running"):  # fmt: skip
        return
    q = padded_rows(call.q, call.query_padding_mask)
    with torch.no_grad():
        torch_inputs(q, call.k, call.rf, call.key_padding_mask, call.scale, call.causal,
                     call.query_padding_mask, maps=call.rf.map_tensors(q, call.k))  # fmt: skip


def empty_result(call: Call):
    """What a call with no batch rows or no heads returns, and a packed call's sequence without
    queries or keys: the output, empty or (queries without keys) 0, its gradients reaching
    every input, and, causal with ``return_state``, the state given (or the empty one before
    any key). Nothing is computed: no statistic moves."""
    q, k, v, state = call.q, call.k, call.v, call.initial_state
    tie = sum(x.sum() for x in (q, k, v, *(state or ())) if x.is_floating_point())
    out = q.new_zeros(*q.shape[:3], v.shape[-1]) + (tie * 0).to(q.dtype)
    if not (call.causal and call.return_state):
        return out
    if call.window or call.sinks:  # the hybrid's state given, or the empty one
        return out, hybrid.empty_state(k, v, call.rf, call.window, call.sinks, state)
    if state is None:  # the torch path's state before any key
        fm, like = call.rf.feature_map, q.new_empty(0, dtype=compute_dtype(q.dtype))
        state = blocked.empty_state(q.shape[0], k.shape[1], fm.width(call.rf.num_features),
                                    v.shape[-1], fm.exponential, like)  # fmt: skip
    return out, RFState(*state)
