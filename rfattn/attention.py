"""``rf_attention``: the public entry. It validates the call once, builds its record
(:class:`rfattn.call.Call`) and runs it on one backend: the sharded path (:mod:`rfattn.distributed`,
``group=``), the fused Triton kernels (:mod:`rfattn.fused`) or the torch path
(:mod:`rfattn.torch_path`, the CPU backend and the reference for streaming: blocks of T, features
of one block at a time, hand-written backwards, the causal state ``(S, z, offset)`` with the
running key max of docs/numerics.md, so a sequence can be split and resumed).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from rfattn import backends, fused, torch_path
from rfattn.call import (
    BACKENDS,
    INTERCEPTS,
    Call,
    RFState,
    autocast_inputs,
    fused_kernel_available,
    learned_scale,
    packed_offsets,
    padded_rows,
    returned_state,
    runs_fused,
    state_rows,
    validate,
)
from rfattn.features import compute_dtype, python_scalar
from rfattn.features.base import symbolic

__all__ = ["rf_attention", "RFState", "BACKENDS", "fused_kernel_available"]


def rf_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rf,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    initial_state: RFState | None = None,
    return_state: bool = False,
    query_padding_mask: torch.Tensor | None = None,
    group=None,
    *,
    window: int | None = None,
    sinks: int | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen: int | None = None,
):
    """Random-feature linear attention, a drop-in for softmax attention in SDPA's layout.

    Approximates ``softmax(scale * Q K^T) V`` by ``phi(Q) (phi(K)^T V) / phi(Q) (phi(K)^T 1)``
    with the feature map and weights of ``rf``. Under ``torch.autocast`` for q's device type,
    q, k and v are first cast to the autocast dtype (as autocast casts SDPA's inputs; fp64 stays),
    and the call computes in rfattn's own dtypes, its backward too.

    Args:
        q: ``[B, H, Tq, D]`` queries (any strides, e.g. a transposed ``[B, T, H, D]`` view).
        k: ``[B, Hkv, Tk, D]`` keys; v: ``[B, Hkv, Tk, E]`` values. One floating dtype and
            device. ``Hkv = H`` or, for grouped-query attention, a divisor of H: query head h
            reads key/value head ``h // (H // Hkv)`` (transformers' ``repeat_kv`` order) without
            repeating k and v: key features and states are computed once per key/value head, and
            states are ``[B, Hkv, ...]``. The data statistics of oprf/saderf/poisrf/geomrf
            (``stats="global"``) are then per key/value head, over the queries of its group.
        rf: an :class:`rfattn.RandomFeatures` built for ``head_dim=D``; with head maps
            (:meth:`~rfattn.RandomFeatures.add_head_maps`, what :func:`rfattn.calibrate` trains)
            the features are taken of the mapped q and k.
        causal: query i attends to keys j <= i (needs Tq == Tk).
        key_padding_mask: ``[B, Tk]`` bool, True = padding: removed from numerator and
            denominator. A query with no valid key gets output 0.
        scale: softmax temperature, default ``D ** -0.5``: a number, or a one-element tensor;
            one that requires grad (a learnable temperature) gets its gradient, on every
            backend (q and k are multiplied by its square root, in q's dtype, and the call runs
            with scale 1).
        backend: "auto" (Triton on CUDA where a fused kernel exists, else torch), "torch",
            or "triton" (the fused operators; CPU tensors run the Triton kernels under
            ``TRITON_INTERPRET=1``, else the operators' torch kernels; float64 runs too).
        initial_state: causal only: the :class:`RFState` returned by a previous call, to continue
            that sequence (split/resume equals one shot).
        return_state: causal only: also return the final :class:`RFState`.
        query_padding_mask: ``[B, Tq]`` bool, True = padded queries: left out of the data
            statistics (oprf, saderf, poisrf, geomrf), read as 0 and given output 0, so junk
            there (NaN, inf) reaches no output, statistic or gradient (their cotangents are
            dropped). Default: ``key_padding_mask`` when causal (self-attention), else none
            (every query counts; pass it for non-causal self-attention with padding, as the
            layers and the Hugging Face integration do).
        group: a ``torch.distributed`` process group over which the sequence is split (context
            parallelism, :mod:`rfattn.distributed`): q, k, v and the masks hold this rank's
            contiguous shard (shards in rank order, any lengths) and the output is this rank's
            shard of the attention over the whole sequence; one all-gather of states (causal)
            or all-reduce (non-causal) per call, gradients equal to one process's. Causal:
            ``initial_state`` is the state before the whole sequence (the same on every rank),
            the returned state the one after it (on every rank). Every rank's call must
            agree on causal, dtype, feature, num_features, D, E, B, H and key/value heads,
            initial_state given or not, statistics and path: one all-gather of the calls'
            signatures checks it first, and every rank raises naming what differs
            (:func:`rfattn.distributed.check_calls_agree`). None: one process.
        window, sinks: exact attention inside the random features (:mod:`rfattn.hybrid`;
            Tq == Tk): each query attends exactly to the first ``sinks`` valid keys and to the
            keys at positions ``i - window < j <= i`` (non-causal: ``|i - j| < window``), and
            through the features to every other key, in one normaliser; ``initial_state`` /
            the returned state are then a :class:`rfattn.hybrid.HybridState` (constant size).
            None (default): ``rf``'s own (``RandomFeatures(window=, sinks=)``, 0 unless given);
            0 turns it off for this call. Fused on the GPU where causal
            (``docs/hybrid.md``), else the torch path.
        cu_seqlens: packed sequences (flash-attention's convention): q, k and v hold N
            sequences concatenated along T with batch size 1 (``[1, H, total, D]``), and
            ``cu_seqlens`` (int32 or int64, ``[N + 1]``, on q's device or the CPU) their offsets
            ``0 = c_0 <= c_1 <= ... <= c_N = total``; sequence i is tokens ``c_i:c_(i+1)``,
            attended on its own (causal or not; empty sequences allowed), as N separate calls
            would: its own statistics (``stats="global"``: per sequence and head), its own
            ``initial_state`` and returned state (``[N, Hkv, ...]``, row i sequence i). A
            training call with running statistics reads them as they stand for every sequence
            and moves them once, from the valid tokens of the whole row (as an unpacked call on
            the row would). The masks, if given, are ``[1, total]``. Without ``max_seqlen``
            the offsets are read on the host once per call (one device-to-host copy when they
            lie on the GPU): each
            sequence runs as a call of its own on views of the row, on the backend chosen as
            for any call (sequences of similar length batched, zero-padded and masked). With
            ``window`` / ``sinks`` each sequence has its own sinks and window (with
            ``initial_state``, a HybridState of N rows, or ``return_state`` each sequence runs
            alone). With ``group`` (for now without window or
            sinks): the offsets are the whole row's,
            the same on every rank, and q, k, v each rank's contiguous shard of the row (in
            rank order, any lengths); a sequence may straddle ranks
            (:func:`rfattn.distributed.packed_sharded`).
        cu_seqlens_q, cu_seqlens_k: non-causal cross-attention of packed sequences: the
            offsets of the queries and of the keys/values, ``[N + 1]`` each, in place of
            ``cu_seqlens``.
        max_seqlen: with packed sequences, at least the longest one's length (queries and
            keys; flash-attention's hint): the offsets are then never read on the host (their
            values are checked on the device, ``torch._assert_async``) and the sequences run as
            one batch of N rows padded to ``max_seqlen`` (no host synchronisation, nothing
            shaped by the offsets' values: ``torch.compile`` traces it without a graph break;
            the padding is its cost where lengths differ widely). Not with ``group``, nor with
            ``window``/``sinks`` and a state.

    Returns:
        ``out`` ``[B, H, Tq, E]`` in the input dtype, or ``(out, state)`` with ``return_state``.
    """
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        # autocast's lower precision for the inputs (as SDPA gets them), then rfattn's own
        # compute dtypes inside: autocast would cast its products, not its fp32 buffers
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = autocast_inputs(q, k, v, torch.get_autocast_dtype(q.device.type))
            return rf_attention(q, k, v, rf, causal, key_padding_mask, scale, backend,
                                initial_state, return_state, query_padding_mask, group,
                                window=window, sinks=sinks, cu_seqlens=cu_seqlens,
                                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                max_seqlen=max_seqlen)  # fmt: skip
    if window is None:  # the module's own (RandomFeatures(window=, sinks=)), or none
        window = getattr(rf, "window", 0)
    if sinks is None:
        sinks = getattr(rf, "sinks", 0)
    learned = learned_scale(scale) if torch.is_tensor(scale) else None
    if learned is not None:  # applied to q and k (below); checked without a host sync
        torch._assert_async((learned.detach() > 0) & learned.detach().isfinite(),
                            "scale must be a finite number > 0")  # fmt: skip
        scale = 1.0
    if type(causal) is not bool:  # numpy scalars, 0-d tensors
        causal = python_scalar(causal)
    if scale is not None and type(scale) is not float:
        scale = python_scalar(scale)
    packed = None
    is_packed = cu_seqlens is not None or cu_seqlens_q is not None or cu_seqlens_k is not None
    checked = (q, k, v, rf, causal, key_padding_mask, scale, backend, initial_state,
               return_state, query_padding_mask, window, sinks, group)  # fmt: skip
    if group is None:
        if is_packed or max_seqlen is not None:
            packed = packed_offsets(q, k, causal, cu_seqlens, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen=max_seqlen)  # fmt: skip
        validate(*checked, packed=packed, max_seqlen=max_seqlen)
    else:  # every rank's call checked against the others' before any other collective
        from rfattn import distributed

        def checks():  # (the packing too: a rank raising alone would leave the others waiting)
            offsets = None if not is_packed and max_seqlen is None else packed_offsets(
                q, k, causal, cu_seqlens, cu_seqlens_q, cu_seqlens_k, group, max_seqlen)
            validate(*checked, packed=offsets, max_seqlen=max_seqlen)
            return offsets

        distributed.check_group(group)
        packed = distributed.check_calls_agree(group, checks, q, k, v, rf, causal, backend,
                                               initial_state, window, sinks,
                                               return_state)  # fmt: skip
    if query_padding_mask is None and causal:
        query_padding_mask = key_padding_mask
    if learned is not None:  # scale (q kᵀ) = (√scale q)(√scale k)ᵀ, on every path
        root = learned.reshape(()).to(device=q.device, dtype=compute_dtype(q.dtype)).sqrt()
        q = (padded_rows(q, query_padding_mask) * root).to(q.dtype)
        k = (padded_rows(k, key_padding_mask) * root).to(k.dtype)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    elif symbolic(scale) and runs_fused(q, rf, causal, backend):
        # a scale computed from symbolic sizes (torch.compile, dynamic shapes): the operators
        # take a float, which would specialise it (a recompile per length), so it goes into q
        # and k, as a learned scale does (the torch path takes it as it is)
        root = math.sqrt(scale)
        q, k = ((x.to(compute_dtype(x.dtype)) * root).to(x.dtype) for x in (q, k))
        scale = 1.0
    elif type(scale) is not float:  # an int (a symbolic one stays symbolic)
        scale = torch.sym_float(scale)
    call = Call(q, k, v, rf, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
                backend=backend, query_padding_mask=query_padding_mask,
                initial_state=initial_state, return_state=return_state, group=group,
                window=window, sinks=sinks, packed=packed,
                max_seqlen=max_seqlen)  # fmt: skip
    if packed is None and 0 in (q.shape[0], q.shape[1], k.shape[1]):  # nothing to run
        res = torch_path.empty_result(call)
    elif INTERCEPTS:  # rfattn.calibrate records calls
        res = INTERCEPTS[-1](call, run)
    elif group is None and packed is None and query_padding_mask is None and \
            (causal or q.shape[1] == k.shape[1]) and rf.query_map is None and \
            rf.gerf_A is None and window == sinks == 0 and \
            runs_fused(q, rf, causal, backend):  # fmt: skip
        # the common case straight to the fused kernels: what run and _attend would do with no
        # padded queries, no head maps, no grouped rows, no process group and no packing
        res = fused.attend(call)
    else:
        res = run(call)
    if return_state:
        return returned_state(*res, rf, True)
    return res


def run(call: Call):
    """``out`` (or ``(out, state)`` with ``return_state``) of a validated call: padded queries
    read as 0 and given output 0 (their cotangents dropped), the head maps of ``call.rf``
    (:meth:`RandomFeatures.map_tensors`) applied where q and k are read, then the backend; a
    packed call one sequence at a time (:func:`_packed`)."""
    if call.packed is not None:
        if call.group is not None:
            from rfattn import distributed

            return distributed.packed_sharded(call, run)
        if runs_fused(call.q, call.rf, call.causal, call.backend) and \
                fused.packed_reason(call) is None:  # fmt: skip
            return _packed_fused(call)
        if call.max_seqlen is not None:
            return _packed_padded(call)
        return _packed(call)
    qpm = call.query_padding_mask
    q = call.q if qpm is None else padded_rows(call.q, qpm)
    if call.window or call.sinks:  # exact sinks and window inside the features (torch path)
        if call.group is not None:
            from rfattn import distributed

            res = distributed.hybrid_sharded(dataclasses.replace(call, q=q))
        else:
            res = backends.hybrid(dataclasses.replace(call, q=q))
    else:
        res = _attend(dataclasses.replace(call, q=q, maps=call.rf.map_tensors(q, call.k)))
    if qpm is None:
        return res
    return (padded_rows(res[0], qpm), res[1]) if call.return_state else padded_rows(res, qpm)


def _attend(call: Call):
    """The backend's result for a call with its head maps attached: a non-causal grouped-query
    call runs as one call per key/value head (:meth:`Call.as_rows`); a sharded call maps q and k
    first; otherwise the fused kernels or the torch path (:func:`rfattn.backends.attend`, here
    without the hop)."""
    grouped = not call.causal and call.q.shape[1] != call.k.shape[1]  # as_rows's own test
    rows = call.as_rows() if grouped else call
    if call.group is not None:
        from rfattn import distributed

        res = distributed.sharded_attention(rows.with_maps_applied())
    elif runs_fused(rows.q, rows.rf, rows.causal, rows.backend):
        res = fused.attend(rows)
    else:
        res = torch_path.attend(rows)
    return res if rows is call else call.ungroup(res)


def _packed(call: Call):
    """A packed call's result: its sequences in batches of similar length (:func:`buckets`),
    each batch one call (:meth:`Call.batch_of`: the sequences as rows, zero-padded and masked
    to the longest; a batch of one sequence is :meth:`Call.sequence`'s views of the row, no
    copy), so a row of many short documents costs a few calls, not one per document; outputs
    back in the row's order and states along the batch. A sequence without queries or keys runs
    nothing (:func:`rfattn.torch_path.empty_result`: outputs 0, the state passed on; no heads:
    nothing at all). Running statistics then move once, from the whole row
    (:func:`rfattn.torch_path.move_statistics`)."""
    oq, ok = call.packed
    N = len(oq) - 1
    heads = call.q.shape[1] > 0 and call.k.shape[1] > 0
    lengths = [(oq[i + 1] - oq[i], ok[i + 1] - ok[i]) for i in range(N)]
    runs = [i for i in range(N) if heads and min(lengths[i]) > 0]
    states = [None] * N
    parts = []  # (query slots of a result's rows, their positions in the row, the result)
    for i in (i for i in range(N) if not heads or min(lengths[i]) == 0):
        seq = call.sequence(i)
        res = torch_path.empty_result(seq)
        parts.append((None, i, res[0] if call.return_state else res))
        states[i] = res[1] if call.return_state else None
    # a hybrid with states runs each sequence alone: a batch's padding would move its window
    stateful_hybrid = (call.window or call.sinks) and \
        (call.initial_state is not None or call.return_state)  # fmt: skip
    groups = [[j] for j in range(len(runs))] if stateful_hybrid else \
        buckets([lengths[i] for i in runs])  # fmt: skip
    for group in groups:
        indices = [runs[j] for j in group]
        if len(indices) == 1:
            res = run(call.sequence(indices[0]))
            parts.append((None, indices[0], res[0] if call.return_state else res))
        else:
            batch, slots, pos = call.batch_of(indices)
            res = run(batch)
            parts.append((slots, pos, res[0] if call.return_state else res))
        if call.return_state:
            for j, i in enumerate(indices):
                states[i] = state_rows(res[1], slice(j, j + 1))
    if heads:
        torch_path.move_statistics(call)
    out = call.packed_output(parts)
    if not call.return_state:
        return out
    return out, type(states[0])(*(torch.cat(p, dim=0) for p in zip(*states, strict=True)))


def _packed_fused(call: Call):
    """A packed call on the kernels with its offsets (:func:`rfattn.fused.packed`): one launch
    per pass for every sequence, no padding, no copy; padded queries read as 0 and given output
    0 (as :func:`run` gives them); running statistics then move once, from the whole row."""
    qpm = call.query_padding_mask
    q = call.q if qpm is None else padded_rows(call.q, qpm)
    res = fused.packed(dataclasses.replace(call, q=q, maps=call.rf.map_tensors(q, call.k)))
    torch_path.move_statistics(call)
    if qpm is None:
        return res
    return (padded_rows(res[0], qpm), res[1]) if call.return_state else padded_rows(res, qpm)


def _packed_padded(call: Call):
    """A packed call with ``max_seqlen``: its sequences as one batch of N rows padded to
    ``max_seqlen`` (:meth:`Call.padded_batch`, indices made on the device), one call, the rows
    back in the row's order; states along the batch (a row of padding only passes its initial
    state on). Running statistics then move once, from the whole row."""
    batch, slots = call.padded_batch()
    res = run(batch)
    torch_path.move_statistics(call)
    out = call.padded_output(slots, res[0] if call.return_state else res)
    return (out, res[1]) if call.return_state else out


#: the most padding a batch of packed sequences carries (:func:`buckets`): a quarter of its
#: tokens
PACKED_PADDING = 0.25
#: a packed sequence with this many queries or keys runs alone, on views of the row: a call's
#: fixed cost is small beside its work, and batching would only add the copies and the padding
#: (``python -m bench.packed`` on the CPU, 8 documents of ~2k tokens and 9 % padding: alone
#: 0.99-1.19x of padding them, packed.json; batched, in a trial run, 0.77-0.88x)
PACKED_ALONE = 1024


def buckets(lengths: list[tuple[int, int]]) -> list[list[int]]:
    """The sequences of lengths ``(queries, keys)`` grouped into batches, shortest first, each
    padded to its longest with at most :data:`PACKED_PADDING` of its tokens in padding (a
    sequence longer than every other alone, and one of :data:`PACKED_ALONE` tokens or more), as
    indices into ``lengths``."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i][1], lengths[i][0]))
    groups, group, tokens, lq, lk = [], [], 0, 0, 0
    for i in order:
        q, k = lengths[i]
        if max(q, k) >= PACKED_ALONE:
            groups.append([i])
            continue
        mq, mk = max(lq, q), max(lk, k)
        if group and (len(group) + 1) * (mq + mk) > (1 + PACKED_PADDING) * (tokens + q + k):
            groups.append(group)
            group, tokens, mq, mk = [], 0, q, k
        group.append(i)
        tokens, lq, lk = tokens + q + k, mq, mk
    if group:
        groups.append(group)
    return groups
