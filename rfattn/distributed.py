"""Context parallelism: one sequence split across the processes of a ``torch.distributed`` group.

``rf_attention(q, k, v, rf, ..., group=g)`` with q, k, v (and ``key_padding_mask``) holding this
rank's contiguous shard of the sequence, shards in rank order (any lengths, an empty or
all-padding shard included), returns this rank's shard of the attention over the whole sequence.
Random-feature attention needs no ring of key/value blocks: a shard's keys enter every later
position only through their state ``(S, z, offset)``, ``F E + F + 1`` numbers per (batch, head)
whatever the shard's length.

* causal (LASP-2's scheme for linear attention): each rank sums its keys into a state, one
  ``all_gather`` shares the states, each rank combines those of the ranks before it (offsets
  rescaled to their max, log-sum-exp style) into the prefix state it starts from, then runs the
  usual chunked pass (either backend) with that prefix as ``initial_state``. ``initial_state``
  is the state before the whole sequence (give the same on every rank); the returned state is
  the one after the last rank's shard, on every rank. Running statistics (oprf/saderf/...
  in training) are read as they stand on every rank, then moved by the whole sequence's
  moments (one more ``all_reduce``), so every rank's buffers stay those of one process.
* non-causal: the per-feature key offsets are reduced with one ``all_reduce`` (max), then
  ``S = sum phi_k v^T`` and ``z`` with one ``all_reduce`` (sum); queries read the total. The
  global statistics of oprf/saderf/poisrf/geomrf (``stats="global"``) are reduced too, so they
  are those of the whole sequence; running statistics are updated per module from them.
  Cross-attention with sharded keys works alike (queries and keys sharded independently). The
  fused kernel runs it where the call would run it (``backend``): the states are combined
  between its key and query passes, the state cotangents summed between its backward passes.

Before any other collective, every sharded call checks that the ranks' calls agree
(:func:`check_calls_agree`: one ``all_gather`` of a fixed-size signature, 19 int64 per rank):
calls that would run different collectives (causal or not, dtype, feature, num_features, F, D,
E, B, H, key/value heads, an initial state given or not, statistics reduced or not, the
non-causal fused kernel or the torch path, window and sinks) or a call its own checks reject
raise on every rank,
naming the field and each rank's value, instead of hanging or aborting inside the backend.

* the hybrid (``window``/``sinks``, causal, :mod:`rfattn.hybrid`): a shard starts from the
  :class:`~rfattn.hybrid.HybridState` after the ranks before it, the keys that left the window
  in the random-feature state, the last ``window`` positions and the sinks as they are. One
  ``all_gather`` of 1 + B counts (shard lengths, valid keys: which keys are sinks), then one of
  each rank's last ``window`` positions (keys, values, kinds), its sinks and the state of its
  keys before those positions: each rank takes the last ``window`` positions before its shard
  from the ranks before it, sums the earlier ones of those tails into its state with theirs,
  and runs the hybrid on its shard from there (:func:`hybrid_sharded`).

* packed sequences (``cu_seqlens``): the offsets are the whole row's and each rank
  holds its contiguous shard of the row, so a sequence may straddle ranks; each rank gathers
  the shards' lengths and the state of every rank's last sequence's tokens, starts the sequence
  it begins inside from the states of the ranks before it that end in it, and runs its other
  sequences as one process's packed call; non-causal, each rank runs its pieces of every
  sequence as one padded batch of N rows through the sharded non-causal path
  (:func:`packed_sharded`).

Backward: each collective's gradient takes the mirror collective (an all-gather's gradients are
summed over the ranks and each rank keeps its own state's; an all-reduce's are all-reduced), so
every gradient equals the single-process one; every rank must run the backward. Offsets are
stabilisers (detached). gloo on CPU, NCCL on GPU; the group is any ``ProcessGroup`` (for a
``DeviceMesh`` dimension: ``mesh.get_group("cp")``).
"""

from __future__ import annotations

import bisect
import zlib

import torch
import torch.distributed as dist

from rfattn import backends
from rfattn.blocked import no_autocast
from rfattn.call import Call, RFState, no_kernel_reason, query_rows, runs_fused, state_rows
from rfattn.features import FEATURES, compute_dtype, prescale
from rfattn.fused import kernel_form
from rfattn.reference import linear_attention
from rfattn.stats import Moments, sequence_moments, update_running
from rfattn.torch_path import causal_keys, causal_scan, torch_inputs

__all__ = [
    "check_calls_agree",
    "check_group",
    "combine_states",
    "hybrid_sharded",
    "packed_sharded",
    "raise_together",
    "runs_causal",
    "shard_offsets",
    "sharded_attention",
]

_FALSE = torch.tensor(False)


def check_group(group) -> None:
    """Raise unless ``group`` is a usable ``torch.distributed`` process group."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("group= needs torch.distributed initialised (dist.init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}"
        )


def runs_causal(causal: bool, tq: int, group) -> bool:
    """Whether a call asked to be causal runs causal. With at most one query, causal and
    non-causal attention read the same keys, so one process runs it non-causal (a decoding
    step: the last query sees every cached key); a sharded call (``group`` set) stays causal,
    since the other ranks run the causal path and its collectives must match theirs (a
    one-token or empty shard of a causal sequence). The rule of :mod:`rfattn.hf` and of
    :class:`rfattn.RFMultiheadAttention`'s masks."""
    return bool(causal) and (tq > 1 or group is not None)


def _code(name: str) -> int:
    """A name as a number that every process computes alike (CRC-32)."""
    return zlib.crc32(name.encode())


_DTYPE_NAMES = {_code(str(d)): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
_FEATURE_NAMES = {_code(n): n for n in FEATURES}
_STATISTICS = {0: "none", 1: "reduced over the ranks", 2: "stats_grad (not supported)"}
_BOOL = {0: "False", 1: "True"}
#: a sharded call's signature: (label, how its values print), in order; every rank's must match
_SIGNATURE = (
    ("call rejected by the rank's own checks (that rank raises why)", _BOOL),
    ("causal", _BOOL),
    ("dtype", _DTYPE_NAMES),
    ("feature", _FEATURE_NAMES),
    ("num_features", None),
    ("feature width F", None),
    ("head dim D", None),
    ("value width E", None),
    ("batch B", None),
    ("query heads H", None),
    ("key/value heads Hkv", None),
    ("initial_state given", _BOOL),
    ("statistics", _STATISTICS),
    ("non-causal fused kernel", _BOOL),
    ("window", None),
    ("sinks", None),
    ("packed sequences (cu_seqlens: N)", None),
    ("packed offsets (cu_seqlens, CRC-32)", None),
    ("return_state of packed sequences", _BOOL),
)


def _signature(q, k, v, rf, causal: bool, backend: str, initial_state, window: int = 0,
               sinks: int = 0, packed=None, return_state: bool = False) -> list[int]:  # fmt: skip
    """What a validated call's collectives depend on (see :data:`_SIGNATURE`). ``packed``: the
    offsets of packed sequences (the whole row's; -1 for both fields where the call is not
    packed). ``return_state`` counts for packed calls only (their final states take one more
    all_reduce; an unpacked call's take no collective)."""
    fm = rf.feature_map
    stats = int(bool(getattr(fm, "uses_batch_moments", None) and fm.uses_batch_moments(causal)))
    if not causal and getattr(fm, "stats_grad", False):
        stats = 2  # refused (NotImplementedError) before any collective: on every rank alike
    fused = int(not causal and _fused_noncausal(q, rf, backend))
    return [0, int(causal), _code(str(q.dtype)), _code(rf.feature), rf.num_features,
            fm.width(rf.num_features), q.shape[3], v.shape[3], q.shape[0], q.shape[1],
            k.shape[1], int(initial_state is not None), stats, fused, window, sinks,
            -1 if packed is None else len(packed[0]) - 1,
            -1 if packed is None else zlib.crc32(repr(packed).encode()),
            int(packed is not None and bool(return_state))]  # fmt: skip


def _signature_device(group, like) -> torch.device:
    """Where the signature is gathered: on the CPU for gloo, else on the inputs' device (NCCL
    gathers only CUDA tensors)."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    if isinstance(like, torch.Tensor):
        return like.device
    return torch.device("cuda", torch.cuda.current_device())


def check_calls_agree(group, validate, q, k, v, rf, causal, backend, initial_state, window=0,
                      sinks=0, return_state=False):  # fmt: skip
    """Run this rank's checks of an ``rf_attention(..., group=group)`` call (``validate()``,
    raising on bad arguments, returning the offsets of packed sequences or None, which this
    returns) and check that every rank's call agrees with it, before any
    other collective of the call: one ``all_gather`` of a fixed-size int64 signature
    (:data:`_SIGNATURE`), the same size whatever the calls, so the check itself cannot hang or
    abort when they differ. A rank whose own checks failed raises its error; every other rank
    raises ValueError naming that rank, and where the calls disagree every rank raises
    ValueError naming each field that differs with every rank's value. Either way the ranks
    stay in step: their next call runs.

    On CUDA the signature goes to the device without waiting on it, and reading the gathered
    result is the one host synchronisation (it waits for the GPU work queued before it). Cost
    on gloo: see the README (``python -m bench.context_parallel --check``)."""
    try:
        packed = validate()
        signature = _signature(q, k, v, rf, causal, backend, initial_state, window, sinks,
                               packed, return_state)  # fmt: skip
        rejected = None
    except Exception as exc:  # still gathered: the other ranks must not wait for this one
        signature, rejected = [1] + [0] * (len(_SIGNATURE) - 1), exc
    device = _signature_device(group, q)
    mine = torch.tensor(signature, dtype=torch.int64)
    if device.type == "cuda":  # pinned and non-blocking: no host synchronisation here
        mine = mine.pin_memory().to(device, non_blocking=True)
    seen = mine.new_empty(dist.get_world_size(group), len(signature))
    dist.all_gather(list(seen.unbind(0)), mine, group=group)
    seen = seen.tolist()
    if rejected is not None:
        raise rejected
    fields = range(1) if any(row[0] for row in seen) else range(1, len(_SIGNATURE))
    differ = []
    for i in fields:
        values = [row[i] for row in seen]
        if len(set(values)) > 1:
            label, names = _SIGNATURE[i]
            shown = ", ".join(f"rank {r}: {names.get(x, x) if names else x}"
                              for r, x in enumerate(values))  # fmt: skip
            differ.append(f"{label}: {shown}")
    if differ:
        raise ValueError(
            "rf_attention(group=...): the ranks' calls disagree, so their collectives would not "
            "match (every rank raises this): " + "; ".join(differ)
        )
    return packed


def combine_states(states, plain: bool = False) -> RFState | None:
    """The state of consecutive segments from theirs, in order (None for none): each S, z
    rescaled from its offset to the largest, then summed (a segment with no valid key, offset
    -inf, adds nothing); ``plain`` features (rmf: offsets carry no scale) are summed and keep
    the first offset. Exact: what one call over the segments together returns, up to
    rounding."""
    states = [s for s in states if s is not None]
    if not states:
        return None
    if len(states) == 1:
        return RFState(*states[0])
    if plain:
        return RFState(sum(st.s for st in states), sum(st.z for st in states), states[0].offset)
    offs = torch.stack([st.offset for st in states])  # [n, B, H]
    off = offs.amax(dim=0)
    safe = torch.where(off == float("-inf"), torch.zeros_like(off), off)
    scale = torch.where(offs == float("-inf"), torch.zeros_like(offs), torch.exp(offs - safe))
    s = sum(a[..., None, None] * st.s for a, st in zip(scale, states, strict=True))
    z = sum(a[..., None] * st.z for a, st in zip(scale, states, strict=True))
    return RFState(s, z, off)


class _AllGather(torch.autograd.Function):
    """``[world, *x.shape]``: every rank's ``x``; backward: the gradients of rank r's slice,
    summed over all ranks, reach rank r (an all-reduce of the stacked gradients: gloo has no
    reduce-scatter, and states are small)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group), *x.shape)
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


class _AllReduce(torch.autograd.Function):
    """The sum of ``x`` over the ranks; backward: the gradients' sum (every rank used it)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _pack(s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """S ``[..., F, E]`` and z ``[..., F]`` as one ``[..., F, E + 1]`` tensor: one collective
    (and one in the backward: separate ones could meet in different orders on different
    ranks)."""
    return torch.cat((s, z[..., None]), dim=-1)


def _unpack(sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return sz[..., :-1], sz[..., -1]


def _shard_state(q, k, v, rf, key_padding_mask, scale, query_padding_mask) -> RFState:
    """This shard's own causal state (the torch path's, differentiable in k and v)."""
    fm = rf.feature_map
    # the local call updates running statistics; this one only reads them
    w, _, xk, params = torch_inputs(q, k, rf, key_padding_mask, scale, True, query_padding_mask,
                                     update=False)  # fmt: skip
    u_k, g_k = causal_keys(fm, xk, w, params)
    B, H, T = k.shape[:3]
    no_queries = xk.new_zeros(B, H, 0, T, fm.width(rf.num_features))
    return causal_scan(no_queries, u_k, g_k, v.to(w.dtype), key_padding_mask, None)[1]


def _all_gather_states(state: RFState, group) -> list[RFState]:
    """Every rank's state, in rank order (S and z packed: :func:`_pack`)."""
    sz = _AllGather.apply(_pack(state.s, state.z), group)
    offs = state.offset.new_empty(dist.get_world_size(group), *state.offset.shape)
    dist.all_gather(list(offs.unbind(0)), state.offset.detach().contiguous(), group=group)
    return [RFState(*_unpack(x), off) for x, off in zip(sz, offs, strict=True)]


def _moving_statistics(call: Call, run, maps=None):
    """``run(call)`` of a sharded call; with running statistics in training (oprf, saderf;
    causal, or a packed non-causal call, whose sequences read them as they stand), every rank
    reads them as they stand and then moves them by the whole sequence's (row's) moments, as
    one process's call does (a shard's own would set each rank's apart). ``maps``: the
    features' head maps, where q and k are not mapped yet."""
    fm = call.rf.feature_map
    if not (getattr(fm, "uses_batch_moments", None) and fm.uses_batch_moments(call.causal)
            and (call.causal or fm.mode(False) == "running")):  # fmt: skip
        return run(call)
    qmap, kmap = (None, None) if maps is None else maps
    mask = call.key_padding_mask
    xq, qmask = query_rows(prescale(call.q, call.scale, None, qmap), call.k,
                           call.query_padding_mask)  # fmt: skip
    xk = prescale(call.k, call.scale, mask, kmap)
    moments = _global_moments(xq, xk, mask, qmask, call.group)
    fm.train(False)
    try:
        res = run(call)
    finally:
        fm.train(True)
    update_running(fm, moments, fm.momentum)
    return res


def _causal(call: Call):
    return _moving_statistics(call, _causal_shard)


def _causal_shard(call: Call):
    q, k, v, rf, scale, group = call.q, call.k, call.v, call.rf, call.scale, call.group
    key_padding_mask, initial_state = call.key_padding_mask, call.initial_state
    rank = dist.get_rank(group)
    local = _shard_state(q, k, v, rf, key_padding_mask, scale, call.query_padding_mask)
    states = _all_gather_states(local, group)
    before = [] if initial_state is None else [initial_state]
    exp = rf.feature_map.exponential
    prefix = combine_states(before + _selected(states, [r < rank for r in range(len(states))],
                                               exp), plain=not exp)  # fmt: skip
    # the local pass: q and k are already mapped (head maps)
    out = backends.attend(call.replace(initial_state=prefix, return_state=False, group=None))
    if not call.return_state:
        return out
    return out, combine_states(before + states, plain=not exp)


def _selected(states: list[RFState], keep: list[bool], exponential: bool) -> list[RFState]:
    """The gathered ``states`` with those not kept as empty ones, selected (not multiplied)
    away: every rank's output then depends on the gathered tensor, so every rank runs its
    backward collective (one rank skipping it would leave the others waiting), and a NaN in a
    state not kept stays out; exponential features' empty states have offset -inf (they set no
    offset of a combination), plain ones keep theirs (:func:`combine_states` keeps the first)."""
    return [st if k else RFState(torch.where(_FALSE, st.s, 0.0), torch.where(_FALSE, st.z, 0.0),
                                 torch.full_like(st.offset, float("-inf")) if exponential
                                 else st.offset)
            for st, k in zip(states, keep, strict=True)]  # fmt: skip


def packed_sharded(call: Call, run):
    """``rf_attention(..., cu_seqlens=c, group=g)``: this rank's shard of a packed row
    (the offsets ``c`` the whole row's, the same on every rank; q, k, v this rank's contiguous
    shard, shards in rank order, any lengths, empty ones included), each sequence attended on
    its own over the whole row, so a sequence may straddle ranks; ``run`` is
    :func:`rfattn.attention.run` (a call of one process). ``initial_state`` ``[N, Hkv, ...]``
    (every rank's the same) enters each sequence before its first token; with
    ``return_state`` every rank returns each sequence's state after it.

    One ``all_gather`` of the shards' lengths places each shard in the row (the offsets must
    end at their total: every rank raises alike where not); one of each rank's state of its
    last sequence's tokens (``F E + F + 1`` numbers per head, however long the shard) gives
    the prefix of the sequence this shard begins inside: the states of the ranks before whose
    shards end in that sequence, combined in order. This shard's first sequence then runs
    from that prefix, its others as a packed call of one process; each sequence's final state
    comes from the rank holding its last token (one ``all_reduce`` of ``[N, Hkv, F, E + 1]``
    where only that rank's row is not zero, and one of the offsets). Running statistics in
    training are read as they stand and moved once by the whole row's moments, as one
    process's packed call moves them. Non-causal calls (``cu_seqlens``, or ``cu_seqlens_q``
    and ``cu_seqlens_k`` with queries and keys sharded apart): :func:`_packed_noncausal`.
    Every rank must run it (and its backward)."""
    shard = _packed_noncausal if not call.causal else \
        _packed_hybrid if call.window or call.sinks else _packed_shard  # fmt: skip
    return _moving_statistics(call, lambda c: shard(c, run), call.rf.map_tensors(call.q, call.k))


def _shard_lengths(call: Call) -> list[list[int]]:
    """``[query lengths, key lengths]`` of every rank's shard of a packed call, in rank order
    (one all_gather); raise on every rank where the offsets do not end at their totals."""
    q, k = call.q, call.k
    lengths = _gather_ints(torch.tensor([q.shape[2], k.shape[2]], device=q.device),
                           call.group).t().tolist()  # fmt: skip
    names = ("cu_seqlens",) * 2 if call.packed[0] is call.packed[1] else \
        ("cu_seqlens_q", "cu_seqlens_k")  # fmt: skip
    for name, offsets, ls in zip(names, call.packed, lengths, strict=True):
        if offsets[-1] != sum(ls):
            raise ValueError(f"{name} must end at the packed row's length over the ranks, "
                             f"{sum(ls)} (the shards' lengths in rank order: {ls}), got "
                             f"{offsets[-1]}")  # fmt: skip
    return lengths


def _packed_noncausal(call: Call, run):
    """A non-causal packed call's shard: every sequence's piece on this rank (queries and
    keys each by its own offsets; absent ones empty) as one batch of N rows, padded and masked
    (:meth:`Call.batch_of`), run as a sharded non-causal call (one all_reduce of the key
    offsets, one of S and z per row: per sequence; its global statistics per sequence too),
    the rows back in the shard's order."""
    rank = dist.get_rank(call.group)
    local = [_clipped(offsets, sum(ls[:rank]), ls[rank])
             for offsets, ls in zip(call.packed, _shard_lengths(call), strict=True)]
    mine = call.replace(packed=tuple(local), group=None)
    batch, slots, pos = mine.batch_of(list(range(len(local[0]) - 1)))
    return mine.packed_output([(slots, pos, run(batch.replace(group=call.group)))])


def _packed_hybrid(call: Call, run):
    """A causal packed call with ``window``/``sinks``'s shard: every sequence's piece on this
    rank as one batch of N rows run as one sharded hybrid call (:func:`hybrid_sharded`: row i
    is sequence i over the ranks, its initial and final HybridState row i). A piece whose
    sequence goes on past this shard ends its row, the others begin theirs, so a row's padding
    lies only before its sequence's first token or after its last (a piece in the middle of a
    sequence is the whole shard, which then holds no other: no padding), where no window or
    sink of the hybrid's outputs sees it. The padding is the cost (N times the longest local
    piece). A state's window would slide over it (an initial state's before the first token,
    the returned one's after the last), so with ``initial_state`` or ``return_state`` each
    sequence runs as a sharded hybrid call of its own instead, every rank with its piece (an
    empty one where it holds none): no padding, N rounds of the hybrid's collectives."""
    rank = dist.get_rank(call.group)
    offsets, (lengths, _) = call.packed[0], _shard_lengths(call)
    start, T = sum(lengths[:rank]), lengths[rank]
    local = _clipped(offsets, start, T)
    mine = call.replace(packed=(local, local), group=None)
    if call.initial_state is not None or call.return_state:
        res = [run(mine.sequence(i).replace(group=call.group)) for i in range(len(local) - 1)]
        if not call.return_state:
            return torch.cat(res, dim=2)
        states = [r[1] for r in res]
        return torch.cat([r[0] for r in res], dim=2), \
            type(states[0])(*(torch.cat(f, dim=0) for f in zip(*states, strict=True)))
    on = [offsets[i + 1] > start + T for i in range(len(offsets) - 1)]
    batch, slots, pos = mine.batch_of(list(range(len(offsets) - 1)), last=on)
    res = run(batch.replace(group=call.group))
    if not call.return_state:
        return mine.packed_output([(slots, pos, res)])
    return mine.packed_output([(slots, pos, res[0])]), res[1]


def _packed_shard(call: Call, run):
    q, k, v, rf, group = call.q, call.k, call.v, call.rf, call.group
    offsets, T, rank = call.packed[0], q.shape[2], dist.get_rank(group)
    init, N = call.initial_state, len(offsets) - 1
    lengths = _shard_lengths(call)[0]
    ends = [sum(lengths[: r + 1]) for r in range(len(lengths))]
    start, end = ends[rank] - T, ends[rank]

    def sequence_of(t: int) -> int:  # the (non-empty) sequence holding token t of the row
        return bisect.bisect_right(offsets, t) - 1

    # the sequence each rank's shard ends in (-1: an empty shard); this shard's first and last
    last = [sequence_of(e - 1) if L else -1 for e, L in zip(ends, lengths, strict=True)]
    first = sequence_of(start) if T else -1
    cut = min(offsets[first + 1], end) - start if T else 0  # the first sequence's tokens here

    def piece(a: int, b: int, **changes) -> Call:
        def rows(x):
            return None if x is None else x[..., a:b] if x.dim() == 2 else x[:, :, a:b]

        return call.replace(q=rows(q), k=rows(k), v=rows(v),
                            key_padding_mask=rows(call.key_padding_mask),
                            query_padding_mask=rows(call.query_padding_mask), group=None,
                            **changes)  # fmt: skip

    # this shard's last sequence's own state (its keys only; head maps applied), gathered
    tail = piece(offsets[last[rank]] - start, T) if cut < T else piece(0, T)
    tail = tail.replace(maps=rf.map_tensors(tail.q, tail.k)).with_maps_applied()
    states = _all_gather_states(_shard_state(tail.q, tail.k, tail.v, rf, tail.key_padding_mask,
                                             call.scale, tail.query_padding_mask), group)
    exp = rf.feature_map.exponential
    keep = [r < rank and last[r] == first for r in range(len(states))]
    before = [] if init is None or not T else [state_rows(init, slice(first, first + 1))]
    prefix = combine_states(before + _selected(states, keep, exp), plain=not exp)
    # the first sequence (or an empty shard) from the prefix, the others that begin here as one
    # packed call of one process (empty ones between them included)
    ret = call.return_state
    res = [run(piece(0, cut, initial_state=prefix, packed=None))]
    if cut < T:
        ids = range(first + 1, last[rank] + 1)
        inner = tuple(offsets[i] - offsets[first + 1] for i in ids) + (end - offsets[first + 1],)
        res.append(run(piece(cut, T, packed=(inner, inner),
                             initial_state=None if init is None else
                             state_rows(init, slice(first + 1, last[rank] + 1)))))  # fmt: skip
    if not ret:
        return torch.cat(res, dim=2)
    out = torch.cat([r[0] for r in res], dim=2)
    # each sequence's final state from the rank that holds its last token (an empty sequence's,
    # its initial one, from rank 0): one all-reduce of [N, ...] where only the owner's row is
    # not zero, so the sum selects it (the offsets: a max, -inf where not owned)
    rows = [(first, res[0][1])] if T else []
    if cut < T:
        rows += [(i, state_rows(res[1][1], slice(j, j + 1)))
                 for j, i in enumerate(range(first + 1, last[rank] + 1))]  # fmt: skip
    owned = {i: st for i, st in rows if offsets[i + 1] <= end}
    empty = _selected([res[0][1]], [False], True)[0]  # zeros, offset -inf (shapes [1, ...])
    if rank == 0:  # sequences without tokens: their initial state, or the one before any key
        none = empty if exp else empty._replace(offset=torch.zeros_like(empty.offset))
        for i in range(N):
            if offsets[i + 1] == offsets[i]:
                owned[i] = none if init is None else state_rows(init, slice(i, i + 1))
    final = [empty if owned.get(i) is None else owned[i] for i in range(N)]
    acc = empty.s.dtype
    sz = _AllReduce.apply(torch.cat([_pack(st.s.to(acc), st.z.to(acc)) for st in final]), group)
    off = torch.cat([st.offset.detach().to(acc) for st in final])
    dist.all_reduce(off, op=dist.ReduceOp.MAX, group=group)
    # every rank's output depends on the reduced tensor, so every rank runs its backward
    out = out + torch.where(_FALSE, sz.sum(), 0.0).to(out.dtype)
    return out, RFState(*_unpack(sz), off)


def _global_moments(xq, xk, key_padding_mask, query_padding_mask, group) -> Moments:
    """Per-(b, h) moments over the valid tokens of every shard (sums and counts all-reduced;
    no gradient: statistics are held constant)."""
    local = sequence_moments(xq.detach(), xk.detach(), key_padding_mask, query_padding_mask)

    def count(x, mask):
        n = torch.full((x.shape[0],), x.shape[2], dtype=x.dtype, device=x.device)
        return n if mask is None else (~mask).sum(dim=-1).to(x.dtype)

    n = torch.stack((count(xq, query_padding_mask), count(xk, key_padding_mask)), dim=-1)
    n = n[:, None, :, None]  # [B, 1, 2, 1]
    sums = torch.stack([m * n for m in local[:3]])
    dist.all_reduce(sums, group=group)
    total = n.clone()
    dist.all_reduce(total, group=group)
    mn = torch.where(n > 0, local.min.detach(), torch.full_like(local.min, float("inf")))
    dist.all_reduce(mn, op=dist.ReduceOp.MIN, group=group)
    mn = torch.where(torch.isinf(mn) & (mn > 0), torch.zeros_like(mn), mn)
    return Moments(*(sums / total.clamp_min(1.0)).unbind(0), mn)


def _summed(s: torch.Tensor, z: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """S and z summed over the ranks, in one all-reduce (no autograd: the fused kernel's
    hooks)."""
    sz = _pack(s, z)
    dist.all_reduce(sz, group=group)
    return _unpack(sz)


class _FusedNoncausal(torch.autograd.Function):
    """The fused non-causal kernel (``rfattn.kernels.rf_parallel``) with the keys sharded: every
    shard's (S, z) rescaled to the all-reduced per-feature offsets and summed between the key
    and query passes; in the backward, the state cotangents summed before the key pass."""

    @staticmethod
    def forward(ctx, q, k, v, form, scale, mask, group):
        from rfattn.kernels import rf_parallel as kernels

        def combine(s, z, mk):
            top = mk.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            a = torch.exp(mk - top)
            s, z = _summed(s * a[..., None], z * a, group)
            return s, z, top

        out, aux = kernels.rf_parallel_fwd(q, k, v, form, scale, mask, return_aux=True,
                                           combine=combine)  # fmt: skip
        ctx.save_for_backward(q, k, v, out, *aux)
        ctx.form, ctx.scale, ctx.mask, ctx.group = form, scale, mask, group
        return out

    @staticmethod
    @no_autocast
    def backward(ctx, do):
        from rfattn.kernels import rf_parallel as kernels

        q, k, v, out, *aux = ctx.saved_tensors
        dq, dk, dv, _ = kernels.rf_parallel_bwd(
            do.contiguous(), q, k, v, ctx.form, ctx.scale, out, tuple(aux), ctx.mask,
            reduce_ds=lambda ds, dz: _summed(ds, dz, ctx.group),
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None


def _fused_noncausal(q, rf, backend: str) -> bool:
    """Whether a non-causal sharded call runs the fused kernel (its collectives differ from the
    torch path's)."""
    from rfattn.ops import on_torch

    return runs_fused(q, rf, False, backend) and not on_torch(q)


def _noncausal(call: Call):
    q, k, v, rf, scale, group = call.q, call.k, call.v, call.rf, call.scale, call.group
    key_padding_mask, query_padding_mask = call.key_padding_mask, call.query_padding_mask
    fm = rf.feature_map
    if getattr(fm, "stats_grad", False):
        raise NotImplementedError(
            "stats_grad=True (gradients through the statistics) with group= is not supported: "
            "sharded statistics are held constant"
        )
    cdt = compute_dtype(q.dtype)
    w = rf.weight.to(device=q.device, dtype=cdt)
    xq, xk = prescale(q, scale), prescale(k, scale, key_padding_mask)
    moments = None
    if getattr(fm, "uses_batch_moments", None) and fm.uses_batch_moments(False):
        moments = _global_moments(xq, xk, key_padding_mask, query_padding_mask, group)
    if _fused_noncausal(q, rf, call.backend):
        reason = no_kernel_reason(rf, False) or (
            "learnable weights need the torch path here" if rf.weight.requires_grad else None
        )
        if reason is not None:
            raise NotImplementedError(f"{reason}; use backend='torch'")
        form = kernel_form(rf, q, k, key_padding_mask, scale, False, query_padding_mask,
                           moments=moments)  # fmt: skip
        return _FusedNoncausal.apply(q, k, v, form, scale, key_padding_mask, group)
    params = rf.feature_params(xq, xk, key_padding_mask, moments=moments,
                               query_padding_mask=query_padding_mask)  # fmt: skip

    def max_offsets(off):
        dist.all_reduce(off, op=dist.ReduceOp.MAX, group=group)

    def sum_states(s, z):
        return _unpack(_AllReduce.apply(_pack(s, z), group))

    phi_q, phi_k = fm.features(xq, xk, w, key_padding_mask, params, reduce=max_offsets)
    return linear_attention(phi_q, phi_k, v.to(cdt), key_padding_mask=key_padding_mask,
                            reduce=sum_states).to(q.dtype)  # fmt: skip


def sharded_attention(call: Call):
    """:func:`rfattn.rf_attention` of a sharded call (``call.group`` set; validated, head maps
    applied, grouped queries as rows of their key/value head in non-causal calls): ``out``, or
    ``(out, state)`` with ``return_state``."""
    return _causal(call) if call.causal else _noncausal(call)


def raise_together(group, error: Exception | None) -> None:
    """Raise on every rank of ``group`` where any rank has an ``error``: its own where it has
    one, on the others ValueError naming the ranks that raised; nothing where none has. One
    ``all_gather`` of a flag, so a refusal that one rank makes from what only it sees (its
    shard's mask, say) cannot leave the others waiting in the call's next collective. Every
    rank must call it."""
    flags = _gather_ints(torch.tensor([int(error is not None)]), group).reshape(-1).tolist()
    if error is not None:
        raise error
    if any(flags):
        raised = ", ".join(str(r) for r, f in enumerate(flags) if f)
        raise ValueError(f"rfattn: rank(s) {raised} of the process group refused this call (see "
                         "their error); every rank raises")  # fmt: skip


def shard_offsets(group, lengths: tuple[int, ...], offsets: tuple) -> tuple:
    """Packed-row offsets (each the whole row's, the same on every rank) as offsets into this
    rank's shard: ``offsets[i]`` clipped to the shard's tokens of row ``i`` (its length
    ``lengths[i]`` here; shards contiguous, in rank order) and counted from its first, so
    sequences outside the shard are empty. One ``all_gather`` of the shards' lengths; every
    rank must call it."""
    every = _gather_ints(torch.tensor(lengths, dtype=torch.int64), group)
    starts = every[: dist.get_rank(group)].sum(0).tolist()
    return tuple(_clipped(o, a, n) for o, a, n in zip(offsets, starts, lengths, strict=True))


def _clipped(offsets, start: int, length: int):
    """A packed row's ``offsets`` (a tuple of ints, or a tensor) as offsets into the shard of
    its tokens ``start .. start + length``: clipped to the shard and counted from its first, so
    a sequence outside it is empty there."""
    if isinstance(offsets, torch.Tensor):
        return (offsets - start).clamp(0, length)
    return tuple(min(max(o - start, 0), length) for o in offsets)


def _gather_ints(x: torch.Tensor, group) -> torch.Tensor:
    """``[world, *x.shape]``: every rank's ``x`` (no gradient), on the CPU for gloo."""
    device = _signature_device(group, x)
    x = x.detach().to(device).contiguous()
    out = x.new_empty(dist.get_world_size(group), *x.shape)
    dist.all_gather(list(out.unbind(0)), x, group=group)
    return out.to(x.device)


def hybrid_sharded(call: Call):
    """``rf_attention(..., window=W, sinks=S, group=g)``: this rank's shard of the causal
    hybrid over the whole sequence (module docstring), from ``initial_state`` (every rank's the
    same: the state before the whole sequence) where given, with the state after the whole
    sequence on every rank where ``return_state``; running statistics in training moved by the
    whole sequence's moments. Every rank must run it (and its backward)."""
    return _moving_statistics(call, _hybrid_shard, call.rf.map_tensors(call.q, call.k))


def _hybrid_shard(call: Call):
    from rfattn import hybrid

    q, k, v, rf, group, scale = call.q, call.k, call.v, call.rf, call.group, call.scale
    W, S = call.window, call.sinks
    B, Hk, T, D = k.shape
    E, dev, rank = v.shape[-1], k.device, dist.get_rank(group)
    st0 = hybrid.empty_state(k, v, rf, W, S, call.initial_state)
    maps = rf.map_tensors(q, k)
    key_map = None if maps is None else maps[1]
    valid = torch.ones(B, T, dtype=torch.bool, device=dev)
    if call.key_padding_mask is not None:
        valid = ~call.key_padding_mask
    counts = _gather_ints(torch.cat([valid.new_tensor([T], dtype=torch.long),
                                     valid.sum(-1)]), group).to(dev)  # fmt: skip
    lengths = counts[:, 0].tolist()
    seen = st0.sinks_seen.to(dev)  # the initial state's sinks count first
    rank_in = seen[:, None] + counts[:rank, 1:].sum(0)[:, None] + valid.long().cumsum(-1) - 1
    kinds = torch.where(valid & (rank_in < S), hybrid.SINK,
                        torch.where(valid, hybrid.WINDOW, hybrid.NOTHING))  # fmt: skip
    # this shard's offer: its last W positions (front-filled), its sinks, its earlier keys' state
    n = min(W, T)
    pad = (0, 0, W - n, 0)
    tail = torch.cat([k[:, :, T - n :].to(v.dtype), v[:, :, T - n :]], -1)
    tail = torch.nn.functional.pad(tail, pad)
    tail_kinds = torch.nn.functional.pad(kinds[:, T - n :], (W - n, 0))
    slot, present = hybrid.first_true(kinds == hybrid.SINK, S)
    sink_kv = torch.cat([hybrid.gather_positions(k.to(v.dtype), slot),
                         hybrid.gather_positions(v, slot)], -1)  # fmt: skip
    head = torch.arange(T, device=dev)[None, :] < T - W
    s, z, off = hybrid.key_state(rf, k, v, (kinds == hybrid.WINDOW) & head, scale, key_map)
    sz = _pack(s, z).to(v.dtype)
    sizes = [tail.numel(), sink_kv.numel(), sz.numel()]
    flat = _AllGather.apply(torch.cat([tail.flatten(), sink_kv.flatten(), sz.flatten()]), group)
    ints = _gather_ints(torch.cat([tail_kinds, present.long()], -1), group).to(dev)
    offs = off.new_empty(dist.get_world_size(group), *off.shape)
    dist.all_gather(list(offs.unbind(0)), off.detach().contiguous(), group=group)
    parts = [x.split(sizes) for x in flat]
    # every rank's output depends on the gathered tensor (selected away where unused), so every
    # rank runs the backward collective
    anchor = torch.where(_FALSE, flat.sum(), 0.0)

    def after(r: int):
        """The HybridState after the initial one and the shards of ranks ``< r``."""
        # the positions its window may reach: the initial window, then the ranks' tails
        tails = [parts[i][0].view(B, Hk, W, D + E)[:, :, W - min(W, L) :]
                 for i, L in enumerate(lengths[:r])]  # fmt: skip
        tail_kinds = [ints[i, :, W - min(W, L) : W] for i, L in enumerate(lengths[:r])]
        first = torch.cat([st0.keys.to(v.dtype), st0.values], -1)
        prev = torch.cat([first] + tails, 2)
        prev_kinds = torch.cat([st0.kinds.long()] + tail_kinds, 1)
        L = prev.shape[2]
        # those more than W before its end have left the window: into the state
        early = (prev_kinds == hybrid.WINDOW) & (torch.arange(L, device=dev) < L - W)[None, :]
        s_t, z_t, off_t = hybrid.key_state(rf, prev[..., :D].to(k.dtype), prev[..., D:], early,
                                           scale, key_map)  # fmt: skip
        states = [RFState(*_unpack(p[2].view(B, Hk, -1, E + 1)), offs[i])
                  for i, p in enumerate(parts[:r])]  # fmt: skip
        state = combine_states([RFState(st0.s, st0.z, st0.offset)] + states +
                               [RFState(s_t, z_t, off_t)])  # fmt: skip
        first_sinks = torch.cat([st0.sink_keys.to(v.dtype), st0.sink_values], -1)
        sinks_kv = torch.cat([first_sinks] + [p[1].view(B, Hk, S, D + E) for p in parts[:r]], 2)
        old = torch.arange(S, device=dev)[None, :] < seen[:, None]
        sinks_present = torch.cat([old] + [ints[i, :, W:].bool() for i in range(r)], 1)
        pick, _ = hybrid.first_true(sinks_present, S)
        picked = hybrid.gather_positions(sinks_kv, pick)
        return hybrid.HybridState(
            state.s + anchor, state.z, state.offset, prev[:, :, L - W :, :D].to(k.dtype),
            prev[:, :, L - W :, D:], prev_kinds[:, L - W :].to(torch.int8),
            picked[..., :D].to(k.dtype), picked[..., D:],
            torch.clamp(seen + counts[:r, 1:].sum(0), max=S),
        )  # fmt: skip

    # the local pass: this shard from that state, fused where the backend runs the kernels
    out = backends.hybrid(call.replace(initial_state=after(rank), return_state=False, group=None))
    if T == 0:  # (an empty shard's output reads no state: tie it to the gathered tensor too)
        out = out + anchor.to(out.dtype)
    if not call.return_state:
        return out
    return out, after(dist.get_world_size(group))
