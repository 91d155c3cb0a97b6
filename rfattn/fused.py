"""The fused path of one process's call: the feature's kernel form for the call (kept across
calls where it does not depend on the call's data; oprf/saderf's statistics and parameters from
the fused stats pass: inside a non-causal forward's key pass, else one launch of its own), then
the custom operators of :mod:`rfattn.ops` (non-causal, chunked causal, or the decode step).
Importing the operators imports Triton, so they are imported on the first fused call only."""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import NamedTuple

import torch

from rfattn.call import Call, RFState, learns_gerf_a, mapped, no_kernel_reason, query_rows
from rfattn.features import compute_dtype, prescale
from rfattn.features.base import symbolic
from rfattn.features.exponential import coefficient_form
from rfattn.stats import Moments, running_moments
from rfattn.weights import WEIGHTED_WEIGHTS

__all__ = ["attend", "hybrid", "hybrid_in_torch", "hybrid_reason", "kernel_form", "constant_form",
           "kept_form", "Kept", "packed", "packed_reason"]


def attend(call: Call, gpu_tiles=None):
    """``out`` (or ``(out, state)`` with ``return_state``) of a call on the fused kernels: one
    process (no group), a non-causal grouped-query call as rows (:meth:`Call.as_rows`). Causal
    calls of at most ``rf_recurrent.MAX_TOKENS`` tokens without gradient run the decode step,
    others (and symbolic lengths under ``torch.compile``) the chunked form; states keep the torch
    path's conventions (the kernel forms' offsets are the torch path's). Head maps are applied
    by the forward kernels as they load q and k; a call that needs gradients (of anything, the
    maps included) maps q and k first (the backward kernels take no maps). ``gpu_tiles``: as
    the launchers' (``bench.compile`` records a GPU's launches).

    A call whose form is kept (:func:`constant_form`) for a RandomFeatures the fused kernels take
    as it is (no head maps, no learnable GERF A; checked when the form was kept) goes straight
    to the operator."""
    from rfattn import ops

    rf, causal, q = call.rf, call.causal, call.q
    # few enough tokens for the decode step. A symbolic length (torch.compile, dynamic shapes)
    # runs the chunked form, which takes any length: a branch on it would guard on T <=
    # DECODE_TOKENS (a second graph once a length crosses it)
    short = causal and not symbolic(q.shape[2]) and q.shape[2] <= ops.DECODE_TOKENS
    kept = kept_form(rf, q.device, q.dtype, causal)
    if kept is not None and kept.plain_call and call.maps is None and \
            not (causal and kept.w.requires_grad):  # fmt: skip
        form, st, stats = kept.form, call.initial_state, None
        grad = torch.is_grad_enabled() and (
            q.requires_grad or call.k.requires_grad or call.v.requires_grad or
            kept.w.requires_grad or st is not None and (st[0].requires_grad or
                                                        st[1].requires_grad or
                                                        st[2].requires_grad))  # fmt: skip
    else:
        reason = no_kernel_reason(rf, causal)
        if reason is not None:
            raise NotImplementedError(f"{reason}; use backend='torch'")
        if learns_gerf_a(rf):
            raise NotImplementedError(
                "the fused kernels hold GERF's A constant: a call that needs the gradient of a "
                "learnable gerf_A runs backend='torch' (or run this one under torch.no_grad())"
            )
        grad = False  # whether autograd records the call
        if torch.is_grad_enabled():
            given = (call.q, call.k, call.v, rf.weight, *(call.initial_state or ()),
                     *(call.maps or ()))  # fmt: skip
            for x in given:
                grad = grad or x is not None and x.requires_grad
        if grad and call.maps is not None:
            call = call.with_maps_applied()
        # the forward's first launch forms the statistics: the key pass (non-causal), the walk
        # over the key chunks (causal, not the decode step)
        chunked = causal and (grad or not short)
        defer = not causal or chunked
        form = kernel_form(rf, call.q, call.k, call.key_padding_mask, call.scale, causal,
                           call.query_padding_mask, maps=call.maps, defer=defer,
                           update=call.update_stats)  # fmt: skip
        form, stats = form if defer else (form, None)
    q, k, v, mask, scale = call.q, call.k, call.v, call.key_padding_mask, call.scale
    if not causal:
        return ops.rf_parallel(q, k, v, form, scale, mask, gpu_tiles=gpu_tiles, stats=stats)
    # decoding (few tokens, no gradient): one launch, O(M (D + E)) per token
    if not grad and short:
        out, s, z, off = ops.rf_decode(q, k, v, form, scale, mask, call.initial_state,
                                       gpu_tiles=gpu_tiles)  # fmt: skip
    else:
        out, s, z, off = ops.rf_chunk(q, k, v, form, scale, mask, call.initial_state,
                                      gpu_tiles=gpu_tiles,
                                      return_state=call.return_state)  # fmt: skip
    return (out, RFState(s, z, off)) if call.return_state else out


def packed_reason(call: Call) -> str | None:
    """Why a packed call (``cu_seqlens``) does not run on the kernels with its offsets
    themselves (:func:`packed`), or None. Those that do not run as batches of sequences
    (``rfattn.attention``)."""
    from rfattn import ops

    rf, q, causal = call.rf, call.q, call.causal
    if call.window or call.sinks or call.group is not None:
        return "the offsets in the kernels: calls of one process without window or sinks"
    if q.shape[1] == 0 or not causal and q.shape[1] != call.k.shape[1]:
        return "no heads, or non-causal grouped-query heads"
    if ops.on_torch(q) or torch.compiler.is_compiling():
        return "eager calls on the Triton kernels only"
    reason = no_kernel_reason(rf, causal)
    if reason is not None:
        return reason
    fm = rf.feature_map
    if learns_gerf_a(rf) or getattr(fm, "uses_batch_moments", None) and \
            fm.uses_batch_moments(causal, False):  # fmt: skip
        return "statistics per sequence, or a learnable gerf_A"
    return None


def packed(call: Call, gpu_tiles=None):
    """The output (causal with ``return_state``: ``(out, RFState)``, a state per sequence) of a
    packed call (:func:`packed_reason` None) on the kernels with its offsets: every sequence in
    one launch of each pass, sequence i a batch row of the kernels (its queries and keys found
    by the offsets; causal, its chunks from its first token, never across a boundary; programs
    past its end return at once or walk nothing), no padding and no copy. Offsets read on the
    host (no ``max_seqlen``) go to the device once for the kernels; with ``max_seqlen`` they
    are already there and it sizes the grids. Head maps as :func:`attend` applies them;
    running statistics are read as they stand (the caller moves them once, from the whole
    row)."""
    from rfattn import ops

    rf, causal = call.rf, call.causal
    grad = False
    if torch.is_grad_enabled():
        for x in (call.q, call.k, call.v, rf.weight, *(call.maps or ()),
                  *(call.initial_state or ())):  # fmt: skip
            grad = grad or x is not None and x.requires_grad
    oq, ok = call.packed
    on_device = isinstance(oq, torch.Tensor)  # (with max_seqlen, a bound on every length)
    if on_device:
        lq = lk = call.max_seqlen
    else:
        lq, lk = (max(o[i + 1] - o[i] for i in range(len(o) - 1)) for o in (oq, ok))
    if causal and not grad and lq == 1 and call.q.shape[2] == len(oq) - 1:
        # one token per sequence (N tokens, none longer than 1; generation, a state per
        # sequence): the row is a batch of N one-token rows ([1, H, N, .] viewed as
        # [N, H, 1, .]), the decode step's
        return _one_token_each(call, gpu_tiles)
    if grad and call.maps is not None:
        call = call.with_maps_applied()
    q, k = call.q, call.k
    form = kernel_form(rf, q, k, call.key_padding_mask, call.scale, causal,
                       call.query_padding_mask, maps=call.maps, update=False)  # fmt: skip
    if on_device:
        cu_q, cu_k = oq, ok
    else:
        cu_q = torch.tensor(oq, device=q.device)
        cu_k = cu_q if ok is oq else torch.tensor(ok, device=q.device)
    if not causal:
        return ops.rf_parallel(q, k, call.v, form, call.scale, call.key_padding_mask,
                               gpu_tiles=gpu_tiles, packed=(cu_q, cu_k, lq, lk))  # fmt: skip
    out, s, z, off = ops.rf_chunk(q, k, call.v, form, call.scale, call.key_padding_mask,
                                  call.initial_state, gpu_tiles=gpu_tiles,
                                  return_state=call.return_state,
                                  packed=(cu_q, cu_k, lq, lk))  # fmt: skip
    return (out, RFState(s, z, off)) if call.return_state else out


def _one_token_each(call: Call, gpu_tiles=None):
    """A causal packed call of one token per sequence, without gradient (:func:`packed`): the
    row ``[1, H, N, .]`` viewed as N rows of one token ``[N, H, 1, .]`` (no copy) and run as
    one call of the decode step, sequence i with row i of the states; the output viewed back."""

    def rows(x):
        return None if x is None else x.transpose(0, 2) if x.dim() == 4 else x.transpose(0, 1)

    batch = call.replace(q=rows(call.q), k=rows(call.k), v=rows(call.v), packed=None,
                         max_seqlen=None, key_padding_mask=rows(call.key_padding_mask),
                         query_padding_mask=rows(call.query_padding_mask),
                         update_stats=False)  # fmt: skip
    res = attend(batch, gpu_tiles)
    if call.return_state:
        return res[0].transpose(0, 2), res[1]
    return res.transpose(0, 2)


def hybrid_reason(call: Call) -> str | None:
    """Why the fused hybrid (:func:`hybrid`) cannot run a call with window or sinks, or None."""
    reason = no_kernel_reason(call.rf, True)
    if reason is not None:
        return reason
    if not call.causal:
        return "a non-causal window and sinks run the torch path"
    if learns_gerf_a(call.rf):
        return "a learnable gerf_A runs the torch path"
    return None


def hybrid_in_torch(call: Call) -> bool:
    """Whether a hybrid call the fused path would take runs the torch path's hybrid instead, as
    the operators run their torch kernels: on a CPU without Triton (``rfattn.ops.on_torch``).
    Traced (``torch.compile``), the fused hybrid is the operators ``rfattn::local``,
    ``rfattn::chunk_hybrid`` and ``rfattn::hybrid_decode``."""
    from rfattn import ops

    return ops.on_torch(call.q)


def hybrid(call: Call, gpu_tiles=None):
    """The hybrid (:mod:`rfattn.hybrid`: exact sinks and window inside the features, one
    normaliser) of a causal call on the chunk kernels: ``out``, or ``(out, HybridState)`` with
    ``return_state``. The call's keys after its state (:func:`rfattn.hybrid.extend`; the
    empty state without one) give the features' stream (:func:`rfattn.hybrid.estimated_stream`:
    extended position ``t`` at position ``t``, so row ``t`` estimates exactly the stream's keys
    ``<= t``; sinks, padding and empty positions left out) and each row's exact terms
    (``rfattn.ops.rf_local``: their own kernels, as :func:`rfattn.hybrid.exact_terms` computes
    them), which join its numerator and denominator inside the output walk
    (``rfattn.ops.rf_chunk_hybrid``). The state's features are the kernels' over N (the
    feature map's sample count: the torch path's units). The form and its statistics are the
    call's own (its valid keys', as the torch path's). Check :func:`hybrid_reason` first."""
    from rfattn import hybrid as hybrid_path
    from rfattn import ops

    q, k, v, rf, mask, scale = call.q, call.k, call.v, call.rf, call.key_padding_mask, call.scale
    # (a symbolic length, torch.compile's dynamic shapes, takes the chunks: no guard on it)
    if not symbolic(q.shape[2]) and q.shape[2] == 1 and call.initial_state is not None and \
            not _hybrid_grad(call):  # fmt: skip
        return _hybrid_step(call, gpu_tiles)
    st = None  # a first call that returns no state: no empty state made
    if call.initial_state is not None or call.return_state:
        st = hybrid_path.empty_state(k, v, rf, call.window, call.sinks, call.initial_state)
    ext = hybrid_path.extend(st, k, v, mask, call.sinks, call.window)
    ks, vs, ms = hybrid_path.estimated_stream(ext, q.shape[2])
    ks, vs = ks.to(q.dtype), vs.to(q.dtype)
    # head maps map the features' q and k (applied here, differentiably: the maps' gradients
    # for calibration); the exact part is the model's own attention on q and k as they are
    maps = rf.map_tensors(q, k)
    fq = q
    if maps is not None:
        fq, ks = mapped(q, maps[0]), mapped(ks, maps[1], ms)
    # the form's statistics, if any, of the mapped q and keys (kernel_form maps the keys only
    # where its moments read them); the kernels take the inputs mapped here, the form no maps
    form = kernel_form(rf, fq, k, mask, scale, True, call.query_padding_mask,
                       maps=None if maps is None else (None, maps[1]),
                       update=call.update_stats)  # fmt: skip
    if maps is not None:
        form = dataclasses.replace(form, kmap=None)
    num, den, off = ops.rf_local(q, ext, call.window, scale)
    # the kernels' features sum to N times the estimate (N: the feature map's sample count)
    n = rf.feature_map.num_samples(rf.weight)
    off = off + math.log(n)
    init = None if call.initial_state is None else (st.s * n, st.z * n, st.offset)
    out, state = ops.rf_chunk_hybrid(fq, ks, vs, form, scale, ms, (num, den, off), init,
                                     gpu_tiles=gpu_tiles,
                                     return_state=call.return_state)  # fmt: skip
    if not call.return_state:
        return out
    s, z, offset = state
    return out, hybrid_path.next_state(st, ext, s / n, z / n, offset)


def _hybrid_grad(call: Call) -> bool:
    """Whether autograd records a hybrid call (of anything it reads: q, k, v, W, the head maps,
    the state)."""
    if not torch.is_grad_enabled():
        return False
    rf = call.rf
    given = (call.q, call.k, call.v, rf.weight, *call.initial_state,
             *(rf.map_tensors(call.q, call.k) or ()))  # fmt: skip
    return any(x is not None and x.requires_grad for x in given)


def _hybrid_step(call: Call, gpu_tiles=None):
    """A hybrid generation step (one token after a state, no gradient) in one launch
    (``rfattn.ops.rf_hybrid_decode``: the key leaving the window joins the features' state, the
    row adds the exact window and sinks, the state's window and sinks move one token on): what
    :func:`hybrid` computes, O(window + sinks + F E) per token."""
    from rfattn import hybrid as hybrid_path
    from rfattn import ops

    q, k, v, rf, mask = call.q, call.k, call.v, call.rf, call.key_padding_mask
    st = hybrid_path.empty_state(k, v, rf, call.window, call.sinks, call.initial_state)
    form = kernel_form(rf, q, k, mask, call.scale, True, call.query_padding_mask,
                       maps=rf.map_tensors(q, k), update=call.update_stats)  # fmt: skip
    n = rf.feature_map.num_samples(rf.weight)
    out, new = ops.rf_hybrid_decode(q, k, v, form, call.scale, mask, st, call.window, call.sinks,
                                    1.0 / float(n), gpu_tiles=gpu_tiles)  # fmt: skip
    return (out, hybrid_path.HybridState(*new)) if call.return_state else out


def kernel_form(rf, q, k, key_padding_mask, scale: float, causal: bool,
                 query_padding_mask=None, moments=None, maps=None, defer=False,
                 update=True):  # fmt: skip
    """The feature's kernel form for this call. ``maps``: head maps ``(query_map, key_map)``
    (either may be None) the kernels apply (the form's ``qmap``, ``kmap``); statistics are then
    those of the mapped q and k. A call's own statistics are ``[B, H, ...]`` (B of q, H of k's
    heads) as the kernels read them; a kept form's broadcast ones are laid out once per call
    shape (``kernels.common.form_args``), so a launch copies nothing.

    * Parameters that do not depend on the call's data (no statistics; running statistics
      outside training; fixed ones): the form is built once per RandomFeatures, device, input
      dtype and causality, and kept while the module's revision, its feature map's mode and the
      version of every tensor it was built from (W, the component weights, GERF's A, the
      feature map's buffers: draws and running statistics) are unchanged
      (:func:`constant_form`, :func:`kept_form`). Such a call issues no GPU operation of its
      own.
    * oprf/saderf with this call's statistics (global mode, or a running-mode call in training):
      ONE launch of the fused stats pass (``rfattn.kernels.stats``) reduces the moments of q and
      k and forms the parameters, and in training moves the running buffers; in torch where the
      operators run their torch kernels, or from ``moments`` when the caller has them (a sharded
      call's, over every shard). Held constant (``stats_grad=False``).
    * ``defer`` (a call whose forward takes the form next, once: :func:`attend`): returns
      ``(form, stats)``. Where the form's parameters can be left to that forward's first launch
      (no head maps, not traced; non-causal: q as rows of its key/value head), no launch here:
      the form's coefficients are left unwritten for that launch to form. Non-causal, ``stats``
      (``rfattn.kernels.stats.KeyPassStats``) is what the key pass takes to form them
      (``rf_parallel_fwd``'s ``stats``); causal, the form carries them to the chunked forward's
      walk over the key chunks (its ``stats``, ``rfattn.kernels.stats.ChunkStats``) and
      ``stats`` is None, as it is wherever nothing is left.
    * ``update`` False (a sequence of a packed call): running statistics are read as they stand
      and not moved, as outside training.
    """
    from rfattn import ops

    fm = rf.feature_map
    needs = getattr(fm, "uses_batch_moments", None) and fm.uses_batch_moments(causal, update)
    stats = None
    if moments is None and needs:
        if maps is not None:  # the moments are the only reader of the mapped q, k
            q, k = mapped(q, maps[0]), mapped(k, maps[1], key_padding_mask)
        form = None
        if not ops.on_torch(q):
            later = defer and maps is None and (causal or q.shape[1] == k.shape[1]) and \
                not torch.compiler.is_compiling()  # fmt: skip
            form, stats = _stats_pass_form(rf, q, k, key_padding_mask, query_padding_mask, scale,
                                           causal, later)  # fmt: skip
        if form is None:
            form = _moments_form(rf, q, k, key_padding_mask, query_padding_mask, scale, causal)
    elif moments is not None:
        form = _params_form(rf, q, key_padding_mask, causal, query_padding_mask, moments)
    else:
        form = constant_form(rf, q.device, compute_dtype(q.dtype), causal, q.dtype)
    if maps is not None:
        qmap, kmap = (None if m is None else m.detach() for m in maps)
        form = dataclasses.replace(form, qmap=qmap, kmap=kmap)
    return (form, stats) if defer else form


def _params_form(rf, q, key_padding_mask, causal, query_padding_mask=None, moments=None,
                 xq=None, xk=None, update=True):  # fmt: skip
    """The form from ``rf.feature_params`` (the torch closed forms) on ``moments`` or on the
    pre-scaled ``xq``, ``xk`` (``update``: running statistics may move)."""
    if xq is None:  # empty stand-ins give the parameters dtype, device and D, never a copy
        xq = xk = q.new_empty((1, 1, 0, q.shape[-1]), dtype=compute_dtype(q.dtype))
    with torch.no_grad():
        params = rf.feature_params(xq, xk, key_padding_mask, causal=causal, moments=moments,
                                   query_padding_mask=query_padding_mask,
                                   update=update)  # fmt: skip
    return rf.feature_map.kernel_form(rf.weight.to(q.device), params)


def _moments_form(rf, q, k, key_padding_mask, query_padding_mask, scale, causal):
    """This call's statistics reduced apart (in torch on the operators' torch path, else by the
    stats pass), its parameters formed in torch."""
    from rfattn import ops

    # a key/value head's statistics take its group's queries (a view of contiguous q)
    q, query_padding_mask = query_rows(q, k, query_padding_mask)
    if ops.on_torch(q):
        return _params_form(rf, q, key_padding_mask, causal, query_padding_mask,
                            xq=prescale(q, scale), xk=prescale(k, scale))  # fmt: skip
    from rfattn.kernels.stats import stats_pass

    moments = Moments(*stats_pass(q, k, scale, key_padding_mask, query_padding_mask).moments)
    return _params_form(rf, q, key_padding_mask, causal, query_padding_mask, moments)


def _stats_pass_form(rf, q, k, key_padding_mask, query_padding_mask, scale, causal, defer):
    """``(form, stats)``: the form of oprf/saderf with the parameters formed by the stats pass
    in its one launch (in training with running statistics, from the buffers, which it then
    moves; stats None), or with ``defer`` left to the key pass of the forward that takes the
    form and ``stats``; ``(None, None)`` where the pass cannot form them (another feature;
    buffers not on q's device as the pass writes them)."""
    fm = rf.feature_map
    if fm.kernel_stats is None or q.shape[0] * k.shape[1] == 0:
        return None, None
    running = None
    if fm.mode(causal) == "running":  # a training call: uses_batch_moments
        bufs = (*running_moments(fm), fm.num_batches_tracked)
        if not all(b.device == q.device and b.is_contiguous() for b in bufs) or \
                len({b.dtype for b in bufs[:-1]}) != 1:  # fmt: skip
            return None, None
        running = (*bufs, fm.momentum)
    from rfattn.kernels import stats

    if defer:  # written by the key pass: [B, H, ...] in the accumulation dtype
        B, H, D, acc = q.shape[0], k.shape[1], q.shape[3], compute_dtype(q.dtype)
        coeffs = q.new_empty(B, H, 3, dtype=acc)
        psi = q.new_empty(B, H, D, dtype=acc) if fm.kernel_stats == "saderf" else None
    else:
        coeffs, psi = stats.stats_pass(q, k, scale, key_padding_mask, query_padding_mask,
                                       form=fm.kernel_stats, running=running)[1:]  # fmt: skip
    if running is not None:  # moved in the kernel, where no version counter saw it
        _FORMS.pop(rf, None)
    params = {"component_weight": rf.component_weight} if rf.weights in WEIGHTED_WEIGHTS else None
    form = coefficient_form(rf.weight.to(q.device), coeffs, psi, params, fm.name)
    if defer and causal:  # handed over in the form, to the forward's first launch
        chunk = stats.ChunkStats(fm.kernel_stats, running, query_padding_mask)
        return dataclasses.replace(form, stats=chunk), None
    if defer:
        return form, stats.KeyPassStats(fm.kernel_stats, query_padding_mask, running)
    return form, None


class Kept(NamedTuple):
    """A kept data-independent form (:func:`constant_form`) and what says it is still valid."""

    revision: int  # the RandomFeatures' revision it was built at
    feature_map: torch.nn.Module
    training: bool  # the feature map's mode then
    versions: tuple  # (tensor, its _version) of each tensor the form was built from
    w: torch.Tensor  # W then (its requires_grad is read at each call)
    form: object  # the KernelForm, its tensors as the kernels read them
    plain_call: bool  # a fused kernel takes the module as it is: no head maps, no learnable A


#: per RandomFeatures (held weakly): {(device, input dtype, causal): Kept}
_FORMS = weakref.WeakKeyDictionary()


def kept_form(rf, device: torch.device, dtype: torch.dtype, causal: bool) -> Kept | None:
    """The kept form of a call on ``device`` with inputs of ``dtype`` (:func:`constant_form`), if
    there is one and it is valid: the module's revision, its feature map's mode and the versions
    of the tensors it was built from are those it was built with, W takes no gradient now and
    nothing is being traced. A dictionary lookup and a few integer comparisons."""
    kept = _FORMS.get(rf)
    kept = None if kept is None else kept.get((device, dtype, causal))
    if kept is None or kept.revision != rf.revision or \
            kept.feature_map.training is not kept.training or \
            torch.compiler.is_compiling():  # fmt: skip
        return None
    for t, version in kept.versions:
        if t._version != version:
            return None
    if kept.w.requires_grad and torch.is_grad_enabled():
        return None
    return kept


def _sources(rf) -> tuple | None:
    """The tensors a data-independent form is built from, or None where it is not to be kept:
    W rebuilt at each access (fastfoodl) or differentiated now (the form carries its graph),
    inference tensors (no version counter), traced calls."""
    if torch.compiler.is_compiling() or rf.learner is not None:
        return None
    w = rf.weight
    if w.requires_grad and torch.is_grad_enabled():
        return None
    fm = rf.feature_map
    out = (w, rf.component_weight, rf.gerf_A, *fm.buffers(recurse=False))
    out = tuple(t for t in out if t is not None)
    return None if any(t.is_inference() for t in out) else out


def constant_form(rf, device: torch.device, dtype: torch.dtype, causal: bool,
                  input_dtype: torch.dtype | None = None):  # fmt: skip
    """The form of a call whose parameters do not depend on its data (:func:`kernel_form`),
    kept per RandomFeatures, ``device``, input dtype (``input_dtype``, default ``dtype``;
    ``dtype`` is its compute dtype) and causality (:func:`kept_form`): rebuilt when W, the
    component weights, GERF's A or a buffer of the feature map (draws, running statistics) is
    changed in place (its ``_version``: an optimiser step, ``load_state_dict``), or when the
    module's revision moves (:attr:`RandomFeatures.revision`: a redraw, ``.to()``, a train/eval
    switch, ``load_state_dict``, W made learnable)."""
    from rfattn import ops

    key = (device, dtype if input_dtype is None else input_dtype, causal)
    kept = kept_form(rf, *key)
    if kept is not None:
        return kept.form
    sources = _sources(rf)
    with torch.inference_mode(False):  # a kept form is used outside inference mode too
        q = torch.empty(0, device=device, dtype=dtype).view(1, 1, 0, rf.head_dim)
        form = _params_form(rf, q, None, causal, update=False)
        if sources is not None and not ops.on_torch(q):  # kept as the kernels read it
            form = _kernel_layout(form, dtype)
    if sources is not None:
        fm = rf.feature_map
        plain_call = no_kernel_reason(rf, causal) is None and rf.query_map is None and \
            rf.gerf_A is None  # fmt: skip
        kept = Kept(rf.revision, fm, fm.training, tuple((t, t._version) for t in sources),
                    sources[0], form, plain_call)  # fmt: skip
        _FORMS.setdefault(rf, {})[key] = kept
    return form


def _kernel_layout(form, dtype: torch.dtype):
    """``form`` with its tensors as the launchers take them (``kernels.common.launch_setup``):
    W, tables, tau and rows contiguous in the accumulation ``dtype``, lam and rmf's segment
    indices int32; the same values, so a kept form costs no cast at each launch."""

    def cast(x, to):
        return None if x is None else x.detach().to(dtype=to).contiguous()

    return dataclasses.replace(
        form, w=cast(form.w, dtype), table=cast(form.table, dtype), tau=cast(form.tau, dtype),
        rows=cast(form.rows, dtype), lam=cast(form.lam, torch.int32),
        segments=cast(form.segments, torch.int32),
    )  # fmt: skip
