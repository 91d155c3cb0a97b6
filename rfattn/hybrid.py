"""Exact local attention inside random-feature attention: sinks, a sliding window, one normaliser.

A pretrained decoder's attention is too sharp for a random-feature estimate alone, but most of
its mass sits on a few first tokens ("sinks") and on the last few. The hybrid computes those
terms exactly and estimates only the rest, inside one ratio:

    y_i = [sum_{j in E_i} exp(s q_i . k_j) v_j + sum_{j in R_i} phi(q_i) . phi(k_j) v_j / N]
          / [the same without v]

* ``E_i`` (exact): the sinks, the first ``sinks`` valid keys of the sequence, and the window,
  the valid keys at positions ``i - window < j <= i``;
* ``R_i`` (random features): every other valid key ``j <= i - window``;
* ``phi(q) . phi(k) / N`` is the feature map's unbiased estimate of ``exp(s q . k)``
  (:meth:`rfattn.RandomFeatures.estimate_kernel`, N its sample count), so both parts are terms of
  one kernel sum and the ratio needs no mixing weight. Plain features (rmf) estimate a truncated
  series of the same exponential.

``window = 0`` and ``sinks = 0`` leave plain random-feature attention; ``window >= T`` is exact
softmax attention. Positions count padded keys (a left-padded row's window is its last
``window`` positions), sinks count only valid keys (a left-padded row's sinks are its first real
tokens).

Stabilisation, the same ideas as docs/numerics.md, in absolute units (the estimate's scale is
the exact part's, so no offset may be dropped): queries at their row max over features mq_i,
``a_i = g exp(u_q - mq_i)``; a key either in the running state, at the state's running offset
R (the max over its keys and features), or in the current block's band at its own max m_j; every
row then shares one stabiliser with the exact logits,

    c_i = max(mq_i + R, mq_i + m_j for band keys j in R_i, s q_i . k_j for j in E_i)

and every term is ``exp(. - c_i) <= 1`` times bounded factors. c_i and R read only keys a row
may see (R only keys ``<= i - window``), so no output depends on a later token, not even through
underflow.

Blocked, causal: query blocks ``c0 <= i < c1`` walk the sequence; the state (S ``[F, E]``, z
``[F]`` at R) holds the estimated keys ``j < c0 - window``, which every row of the block sees;
the block's band, keys ``c0 - window <= j < c1 - window``, is seen row by row, then joins the
state. Memory O(C (C + window + sinks) + F E) per (b, h) besides
what autograd keeps (this path is differentiated by autograd: it keeps one state per block).

Non-causal (``causal=False``): the window is ``|i - j| < window``, the sinks are exact for every
row, every other valid key is estimated; one offset R over all estimated keys serves every row
(nothing is later), and a query block reads its band of key blocks row by row and every other
estimated key through block sums before and after the band (no state).

Split/resume and generation: a call with ``return_state=True`` leaves a :class:`HybridState` of
constant size (the random-feature state, the last ``window`` positions' keys and values, the
sinks); the next call runs on its window positions followed by its own tokens (rows only for its
own), so a decode step costs O(window + sinks + F E) whatever the position, and split calls equal
one call up to rounding (gradients reach the state).

Reference: :func:`hybrid_reference` (quadratic, the plainest form).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from rfattn.features.base import compute_dtype, prescale, symbolic
from rfattn.reference import attention_ratio

__all__ = ["HybridState", "check_local", "hybrid_attention", "hybrid_reference", "key_state",
           "local_sets", "first_true", "gather_positions", "estimated_stream", "exact_terms",
           "finite_values", "extend", "next_state", "empty_state", "Extended", "sink_values"]

#: query rows per block of the torch path
BLOCK = 64


def check_local(window, sinks) -> None:
    """Raise naming it unless ``window`` and ``sinks`` are ints >= 0 (plain ints: no bool)."""
    for name, value in (("window", window), ("sinks", sinks)):
        if type(value) is not int or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _check(q, k, v, window, sinks, key_padding_mask) -> None:
    check_local(window, sinks)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, T, D] / [B, H, T, E]")
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"the hybrid needs Tq == Tk, got {q.shape[-2]} and {k.shape[-2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key heads {k.shape[1]}")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (k.shape[0], k.shape[2])
    ):
        want = (k.shape[0], k.shape[2])
        got = f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        raise ValueError(f"key_padding_mask must be bool [B, T] = {want}, got {got}")


def local_sets(T: int, window: int, sinks: int, key_padding_mask: torch.Tensor | None,
               device=None, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(exact, estimated)``: bool ``[B or 1, 1, T, T]`` of the (query, key) pairs each part
    holds (:mod:`rfattn.hybrid`'s E_i and R_i; disjoint, their union the valid pairs: causal, or
    every valid key with ``causal=False``, where the window is ``|i - j| < window``)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    if key_padding_mask is None:
        valid = torch.ones(1, T, dtype=torch.bool, device=device)
    else:
        valid = ~key_padding_mask
    rank = valid.long().cumsum(-1) - 1  # among valid keys
    sink = (valid & (rank < sinks))[:, None, None, :]
    seen = ((j <= i) if causal else torch.ones_like(j <= i)) & valid[:, None, None, :]
    in_window = (j > i - window) & (j < i + window)
    exact = seen & (in_window | sink)
    return exact, seen & ~exact


def hybrid_reference(q, k, v, rf, *, window: int, sinks: int = 0, scale: float | None = None,
                     key_padding_mask: torch.Tensor | None = None,
                     causal: bool = True) -> torch.Tensor:  # fmt: skip
    """The hybrid as ``[T, T]`` kernel matrices (run it in float64): ``exp(s q . k)`` on the
    exact pairs, :meth:`rfattn.RandomFeatures.estimate_kernel` on the estimated ones (of the
    head-mapped q and k where ``rf`` has head maps), then
    :func:`rfattn.reference.kernel_attention`'s ratio (:func:`local_sets`' pairs, causal or
    not); grouped-query heads repeated."""
    _check(q, k, v, window, sinks, key_padding_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    if key_padding_mask is not None:  # junk in padded keys reaches no kernel value or gradient
        pad = key_padding_mask[:, None, :, None]
        k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    exact, estimated = local_sets(q.shape[-2], window, sinks, key_padding_mask, q.device, causal)
    maps = rf.map_tensors(q, k)
    kq, kk = (q, k) if maps is None else (q @ maps[0].to(q.dtype).transpose(-1, -2),
                                          k @ maps[1].to(k.dtype).transpose(-1, -2))  # fmt: skip
    est = rf.estimate_kernel(kq, kk.repeat_interleave(group, dim=1), scale=scale)
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    kmat = torch.exp((q @ k.transpose(-1, -2)) * scale)
    kmat = torch.where(exact, kmat, torch.where(estimated, est, torch.zeros_like(est)))
    return attention_ratio(kmat @ v.to(kmat.dtype), kmat.sum(-1)).to(q.dtype)


class HybridState(NamedTuple):
    """What a causal hybrid call leaves for the next one (split/resume, generation), of constant
    size whatever the length: the random-feature state of the estimated keys, the last ``window``
    positions' keys and values, and the sinks.

    Attributes:
        s: ``[B, Hk, F, E]``, z: ``[B, Hk, F]``, offset: ``[B, Hk]``: as :class:`rfattn.RFState`,
            over the valid keys that are neither sinks nor inside the window.
        keys: ``[B, Hk, W, D]``, values: ``[B, Hk, W, E]``: the last W positions as given
            (padding and positions before the sequence hold junk, never read).
        kinds: ``[B, W]`` int8: 0 nothing (padding, before the sequence), 1 a window key, 2 a sink.
        sink_keys: ``[B, Hk, S, D]``, sink_values: ``[B, Hk, S, E]``: the sinks as given.
        sinks_seen: ``[B]`` int64: how many of the S sink slots hold a sink.
    """

    s: torch.Tensor
    z: torch.Tensor
    offset: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    kinds: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    sinks_seen: torch.Tensor


#: HybridState.kinds
NOTHING, WINDOW, SINK = 0, 1, 2


def _state_shapes(k, v, rf, window: int, sinks: int) -> tuple:
    """The shapes of a :class:`HybridState` for these inputs, window and sinks."""
    B, Hk, _, D = k.shape
    E = v.shape[-1]
    F = rf.feature_map.width(rf.weight.shape[-2])
    return ((B, Hk, F, E), (B, Hk, F), (B, Hk), (B, Hk, window, D), (B, Hk, window, E),
            (B, window), (B, Hk, sinks, D), (B, Hk, sinks, E), (B,))  # fmt: skip


def _empty_state(k, v, rf, window: int, sinks: int) -> HybridState:
    s, z, offset, keys, values, kinds, sink_k, sink_v, seen = _state_shapes(k, v, rf, window, sinks)
    cd, dev = compute_dtype(k.dtype), k.device
    return HybridState(
        k.new_zeros(s, dtype=cd), k.new_zeros(z, dtype=cd), k.new_full(offset, -math.inf, dtype=cd),
        k.new_zeros(keys), v.new_zeros(values), torch.zeros(kinds, dtype=torch.int8, device=dev),
        k.new_zeros(sink_k), v.new_zeros(sink_v), torch.zeros(seen, dtype=torch.long, device=dev),
    )  # fmt: skip


def _check_state(state, shapes: tuple) -> None:
    if not isinstance(state, HybridState):
        raise TypeError(f"initial_state must be a HybridState, got {type(state).__name__}")
    for name, got, want in zip(HybridState._fields, state, shapes, strict=True):
        if tuple(got.shape) != want:
            raise ValueError(f"initial_state.{name} must have shape {want} for these inputs, "
                             f"window and sinks, got {tuple(got.shape)}")  # fmt: skip


def first_true(flags: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [B, n], present [B, n])``: the positions of the first ``n`` True entries of each
    row of ``flags`` [B, L] (``present`` False where a row has fewer), on the device."""
    L = flags.shape[-1]
    pos = torch.arange(L, device=flags.device).expand_as(flags)
    order = torch.argsort(torch.where(flags, pos, pos + L), dim=-1)[:, :n]
    present = flags.gather(1, order)
    if L < n:  # fewer positions than slots: the rest point at 0 and are absent
        order = torch.cat([order, order.new_zeros(flags.shape[0], n - L)], -1)
        present = torch.cat([present, present.new_zeros(flags.shape[0], n - L)], -1)
    return order, present


def gather_positions(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, H, L, C]`` at positions ``index [B, n]`` -> ``[B, H, n, C]`` (zeros where x has
    no position: ``first_true``'s absent entries point at 0)."""
    if x.shape[2] == 0:
        return x.new_zeros(*x.shape[:2], index.shape[-1], x.shape[-1])
    return x.gather(2, index[:, None, :, None].expand(*x.shape[:2], index.shape[-1], x.shape[-1]))


class Extended(NamedTuple):
    """A causal call's keys after a state (:func:`extend`): the state's last W positions, then
    the call's T (the call's row t sits at extended position ``W + t``)."""

    keys: torch.Tensor  # [B, Hk, W + T, D] as given (junk where kinds is NOTHING)
    values: torch.Tensor  # [B, Hk, W + T, E]
    kinds: torch.Tensor  # [B, W + T] int8: NOTHING, WINDOW (a valid key, not a sink), SINK
    new_kinds: torch.Tensor  # [B, T]: the call's own
    sink_keys: torch.Tensor  # [B, Hk, 2 S, D]: the state's sink slots, then the call's first S
    # (S slots, the call's own, for a first call without a state: extend(None, ...))
    sink_values: torch.Tensor  # [B, Hk, 2 S, E]
    sink_pos: torch.Tensor  # [B, 2 S]: their extended positions (-1: the state's)
    sink_present: torch.Tensor  # [B, 2 S] bool


class _Layout(NamedTuple):
    """What :func:`extend` derives for a first call without padding: it depends on the sizes
    only."""

    new: torch.Tensor  # [B, T] int8: the first S tokens sinks, the rest window keys
    kinds: torch.Tensor  # [B, W + T] int8: W positions of nothing, then ``new``
    sink_pos: torch.Tensor  # [B, S]: the sinks' extended positions
    present: torch.Tensor  # [B, S] bool: the slots a token fills (T < S leaves some empty)


#: :class:`_Layout` per (B, T, sinks, window, device), made once (never written to: every user
#: reads them or copies)
_LAYOUTS: dict = {}


def _first_layout(B: int, T: int, sinks: int, window: int, device) -> _Layout:
    key = (B, T, sinks, window, device)
    traced = torch.compiler.is_compiling()
    layout = None if traced else _LAYOUTS.get(key)
    if layout is None:
        pos = torch.arange(T, device=device)
        new = torch.where(pos < sinks, SINK, WINDOW).to(torch.int8).expand(B, T)
        slots = torch.arange(sinks, device=device)
        layout = _Layout(*(x.contiguous() for x in (
            new, torch.nn.functional.pad(new, (window, 0)),
            (slots.clamp(max=max(T - 1, 0)) + window).expand(B, sinks),
            (slots < T).expand(B, sinks))))  # fmt: skip
        if not traced:
            if len(_LAYOUTS) >= 256:  # ever new sizes: start over rather than grow
                _LAYOUTS.clear()
            _LAYOUTS[key] = layout
    return layout


def extend(st: HybridState | None, k, v, key_padding_mask, sinks: int,
           window: int = 0) -> Extended:  # fmt: skip
    """The call's keys after the state ``st`` (:class:`Extended`): which are sinks (the first
    ``sinks`` valid keys of the whole sequence, counting the state's), which window keys.
    ``st`` None: a first call (``window`` positions of nothing before it, no sink slot but the
    call's own S), without making the empty state; without padding too, its kinds and sink
    slots depend on the sizes only and are made once (:func:`_first_layout`), its sinks are
    the first S keys (a view)."""
    B, T, dev = k.shape[0], k.shape[2], k.device
    if st is None and key_padding_mask is None and not symbolic(T):
        lay = _first_layout(B, T, sinks, window, dev)
        pad = torch.nn.functional.pad
        if T >= sinks:
            sk, sv = k[:, :, :sinks], v[:, :, :sinks]
        else:  # fewer tokens than slots: the rest absent (the last token again, never read)
            slot = lay.sink_pos - window
            sk, sv = gather_positions(k, slot), gather_positions(v, slot)
        return Extended(pad(k, (0, 0, window, 0)), pad(v, (0, 0, window, 0)), lay.kinds, lay.new,
                        sk, sv, lay.sink_pos, lay.present)  # fmt: skip
    valid = torch.ones(B, T, dtype=torch.bool, device=dev)
    if key_padding_mask is not None:
        valid = ~key_padding_mask
    seen = 0 if st is None else st.sinks_seen[:, None]
    sink = valid & (valid.cumsum(-1) + seen <= sinks)
    new = valid.to(torch.int8) + sink.to(torch.int8)  # NOTHING, WINDOW, SINK
    slot, present = first_true(sink, sinks)
    if st is None:
        pad = torch.nn.functional.pad
        return Extended(pad(k, (0, 0, window, 0)), pad(v, (0, 0, window, 0)),
                        pad(new, (window, 0)), new, gather_positions(k, slot),
                        gather_positions(v, slot), slot + window, present)  # fmt: skip
    W = st.kinds.shape[-1]
    old_present = torch.arange(sinks, device=dev)[None, :] < st.sinks_seen[:, None]
    return Extended(
        torch.cat([st.keys, k.to(st.keys.dtype)], 2), torch.cat([st.values, v], 2),
        torch.cat([st.kinds, new], -1), new,
        torch.cat([st.sink_keys, gather_positions(k, slot).to(st.sink_keys.dtype)], 2),
        torch.cat([st.sink_values, gather_positions(v, slot)], 2),
        torch.cat([torch.full_like(slot, -1), slot + W], -1),
        torch.cat([old_present, present], -1),
    )  # fmt: skip


def next_state(st: HybridState, ext: Extended, s, z, offset) -> HybridState:
    """The state after a call (:func:`extend`'s ``ext`` of it): the features' state of its
    estimated keys ``(s, z, offset)``, the last W positions, the sink slots (the state's first,
    then the call's new sinks in order)."""
    B, S, T = ext.keys.shape[0], st.sink_keys.shape[2], ext.new_kinds.shape[-1]
    n = st.sinks_seen[:, None]
    r = torch.arange(S, device=n.device)[None, :]
    pick = (torch.where(r < n, r, S + r - n).clamp(max=2 * S - 1) if S else r).expand(B, S)
    return HybridState(  # the window its own and contiguous, as the decode step reads it
        s, z, offset, ext.keys[:, :, T:].contiguous(), ext.values[:, :, T:].contiguous(),
        ext.kinds[:, T:].clone(memory_format=torch.contiguous_format),
        gather_positions(ext.sink_keys, pick), gather_positions(ext.sink_values, pick),
        torch.clamp(st.sinks_seen + (ext.new_kinds == SINK).sum(-1), max=S),
    )  # fmt: skip


def empty_state(k, v, rf, window: int, sinks: int, initial_state=None) -> HybridState:
    """``initial_state`` (checked against these inputs, window and sinks), or the empty state a
    first call starts from (W positions of nothing, no sink, no estimated key)."""
    if initial_state is None:
        return _empty_state(k, v, rf, window, sinks)
    _check_state(initial_state, _state_shapes(k, v, rf, window, sinks))
    return initial_state


def finite_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v with non-finite entries 0, poison)``: ``poison [B, H, T, E]`` True from a
    non-finite value's position on (in its column), where a row's output becomes NaN. A block's
    product with its values then never carries a later key's NaN into an earlier row (0 x NaN),
    as the kernels' prefix count does not."""
    bad = ~torch.isfinite(v)
    return v.masked_fill(bad, 0.0), bad.cumsum(-2) > 0


def _block_masks(G: int, C: int, W: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(band, near)``: bool ``[G C, C + W]`` over a causal block's rows (G query heads x C
    positions e = c0 + r) and its keys ``c0 - W + t``: the band ``j <= e - W`` (t <= r) and the
    window ``e - W < j <= e`` (r < t <= r + W). The same for every block of C rows."""
    r = torch.arange(C, device=device).repeat(G)[:, None]
    t = torch.arange(C + W, device=device)[None, :]
    return t <= r, (t > r) & (t <= r + W)


def _factors(rf, fq, fk, w, params, estimated):
    """``(a, mq, b, mk)``: the query features ``a [B, Hk, Lq, F]`` at their row maxima ``mq``
    (``[B, Hk, Lq, 1]``) and the key features ``b [B, Hk, Lk, F]`` (amplitude and ``1 / N``
    included) at their own ``mk``, of the features' pre-scaled ``fq``, ``fk``; keys not
    ``estimated`` (``[B, 1, Lk, 1]``) get ``b = 0``, ``mk = -inf``. Plain features (rmf) sit at
    offset 0."""
    fm = rf.feature_map
    if fm.exponential:
        u_q, u_k = fm.logits(fq, w, "query", params), fm.logits(fk, w, "key", params)
        mq = u_q.amax(-1, keepdim=True).detach()
        mk = u_k.amax(-1, keepdim=True).detach()
        a, b = torch.exp(u_q - mq), torch.exp(u_k - mk)
        g_q = fm.amplitude(fq, w, "query", params)
        a = a if g_q is None else g_q * a
    else:
        a, b = fm.values(fq, w, "query", params), fm.values(fk, w, "key", params)
        mq, mk = fq.new_zeros(*fq.shape[:-1], 1), fk.new_zeros(*fk.shape[:-1], 1)
    g_k = fm.key_amplitude(fk, w, params)
    b = (b if g_k is None else g_k * b) / fm.num_samples(w)
    return a, mq, b.masked_fill(~estimated, 0.0), mk.masked_fill(~estimated, -math.inf)


def key_state(rf, k, v, estimated, scale: float, key_map=None):
    """``(s [B, Hk, F, E], z [B, Hk, F], offset [B, Hk])``: the random-feature state of the keys
    of ``k [B, Hk, L, D]``, ``v`` where ``estimated [B, L]``, at the offset the hybrid keeps
    (the largest key maximum; -inf for none): what :func:`hybrid_attention` would have summed
    into its state from them. ``key_map``: the features' head map of k. For features without
    data statistics (or with fixed ones)."""
    cd = compute_dtype(k.dtype)
    B, Hk, L = k.shape[:3]
    if L == 0:
        F = rf.feature_map.width(rf.weight.shape[-2])
        return (k.new_zeros(B, Hk, F, v.shape[-1], dtype=cd), k.new_zeros(B, Hk, F, dtype=cd),
                k.new_full((B, Hk), -math.inf, dtype=cd))  # fmt: skip
    absent = ~estimated
    fk = prescale(k, scale, absent, key_map)
    w = rf.weight.to(device=k.device, dtype=cd)
    params = rf.feature_params(fk[:, :, :0], fk, absent, causal=True)
    _, _, b, mk = _factors(rf, fk[:, :, :0], fk, w, params, estimated[:, None, :, None])
    R = mk.amax(-2)  # [B, Hk, 1]
    k_w = torch.exp(mk - R.masked_fill(R == -math.inf, 0.0)[..., None]) * b
    vv = v.to(cd).masked_fill(absent[:, None, :, None], 0.0)
    return k_w.transpose(-1, -2) @ vv, k_w.sum(-2), R[..., 0]


def hybrid_attention(q, k, v, rf, *, window: int, sinks: int = 0, scale: float | None = None,
                     key_padding_mask: torch.Tensor | None = None,
                     initial_state: HybridState | None = None, return_state: bool = False,
                     block: int = BLOCK, query_padding_mask: torch.Tensor | None = None,
                     causal: bool = True, update: bool = True):  # fmt: skip
    """Hybrid attention (module docstring): exact sinks and window, random features for the
    rest, one normaliser. The torch path, blocked, differentiated by autograd.

    Args:
        q: ``[B, H, T, D]``; k: ``[B, Hk, T, D]``; v: ``[B, Hk, T, E]`` (H a multiple of Hk:
            grouped-query heads share their key/value head's state, nothing repeated).
        rf: a :class:`rfattn.RandomFeatures` (its head maps, if any, map the features' q and k;
            the exact part takes q and k as they are: it is the model's own attention).
        window: exact keys per row, ``i - window < j <= i`` (0: none).
        sinks: exact first valid keys (0: none).
        scale: softmax temperature, default ``D ** -0.5``.
        key_padding_mask: ``[B, T]`` bool, True = padding (never read).
        initial_state: a :class:`HybridState` this call continues (the same window and sinks).
        return_state: also return the state after this call.
        block: query rows per block.
        query_padding_mask: ``[B, T]`` bool, True = queries left out of the data statistics
            (oprf, saderf, ...).
        causal: False: every valid key, the window ``|i - j| < window`` exact (no state).
        update: False: running statistics (oprf/saderf in training) are read as they stand and
            not moved (a batch of packed sequences, whose call moves them once, from the row).

    Returns:
        ``[B, H, T, E]`` in q's dtype (0 for a row with no valid key), and the
        :class:`HybridState` with ``return_state``. Split/resume equals one call up to rounding.
    """
    _check(q, k, v, window, sinks, key_padding_mask)
    if not causal:
        if initial_state is not None or return_state:
            raise ValueError("initial_state and return_state need causal=True")
        return _bidirectional(q, k, v, rf, window, sinks, scale, key_padding_mask,
                              query_padding_mask, block, update)  # fmt: skip
    maps = rf.map_tensors(q, k)  # the features' head maps (the exact part takes q, k as they are)
    B, H, T, D = q.shape
    Hk, E, W = k.shape[1], v.shape[-1], window
    G = H // Hk
    scale = D**-0.5 if scale is None else float(scale)
    st = empty_state(k, v, rf, window, sinks, initial_state)
    if T == 0:  # no token: nothing to attend, the state passed on as it was
        out = q.new_zeros(B, H, 0, E)
        return (out, st) if return_state else out
    dev, cd = q.device, compute_dtype(q.dtype)
    ext = extend(st, k, v, key_padding_mask, sinks)
    ks, vs, kinds = ext.keys, ext.values, ext.kinds
    absent = kinds == NOTHING
    xk = prescale(ks, scale, absent)
    xq = prescale(q, scale).reshape(B, Hk, G * T, D)  # a key/value head's queries: its rows
    fq, fk = xq, xk  # what the features see
    if maps is not None:
        fq = prescale(q, scale, None, maps[0]).reshape(B, Hk, G * T, D)
        fk = prescale(ks, scale, absent, maps[1])
    vv, poison = finite_values(vs.to(cd).masked_fill(absent[:, None, :, None], 0.0))
    w = rf.weight.to(device=dev, dtype=cd)
    qpm = query_padding_mask
    if qpm is not None and G > 1:  # the rows of a key/value head: its G query heads' tokens
        qpm = qpm.repeat(1, G)
    params = rf.feature_params(fq, fk[:, :, W:], key_padding_mask, causal=True,
                               query_padding_mask=qpm, update=update)  # fmt: skip
    estimated = (kinds == WINDOW)[:, None, :, None]  # valid, not a sink: leaves the window
    a, mq, b, mk = _factors(rf, fq, fk, w, params, estimated)
    a, mq, xq = (x.view(B, Hk, G, T, x.shape[-1]) for x in (a, mq, xq))
    sink_k, sink_pos, sink_present = ext.sink_keys, ext.sink_pos, ext.sink_present
    x_s = prescale(sink_k, scale, ~sink_present)
    v_s = sink_values(ext, cd)
    S, z, R = st.s, st.z, st.offset[:, :, None]
    nums, dens, masks = [], [], None
    for c0 in range(W, W + T, block):
        c1 = min(c0 + block, W + T)
        C = c1 - c0
        # the block's rows: G query heads x C positions per key/value head, as one matrix
        e = torch.arange(c0, c1, device=dev).repeat(G)[:, None]  # [G C, 1]
        rows = slice(c0 - W, c1 - W)
        a_i, xq_i = (x[:, :, :, rows].reshape(B, Hk, G * C, x.shape[-1]) for x in (a, xq))
        mq_i = mq[:, :, :, rows, 0].reshape(B, Hk, G * C)
        # keys c0 - W <= j < c1, one matrix: the band (estimated keys leaving the window inside
        # this block, j <= e - W; mk is -inf off them) and the window (exact, e - W < j <= e)
        lo = c0 - W
        if masks is None or masks[0].shape[0] != G * C:
            masks = _block_masks(G, C, W, dev)
        band, near = masks[0], masks[1] & (kinds[:, None, None, lo:c1] == WINDOW)
        lb = (mq_i[..., None] + mk[:, :, None, lo:c1, 0]).masked_fill(~band, -math.inf)
        logits = torch.where(near, xq_i @ xk[:, :, lo:c1].transpose(-1, -2), lb)
        # the sinks seen so far, exact
        sink_seen = (sink_pos[:, None, None, :] <= e) & sink_present[:, None, None, :]
        ls = (xq_i @ x_s.transpose(-1, -2)).masked_fill(~sink_seen, -math.inf)
        # one stabiliser per row for both parts, from the keys the row sees
        c = torch.maximum(mq_i + R, logits.amax(-1))
        if sinks:
            c = torch.maximum(c, ls.amax(-1))
        c = c.detach().masked_fill(c == -math.inf, 0.0)
        f_state = torch.exp(mq_i + R - c)
        # the band's terms times its features' product, the window's as they are
        p = torch.exp(logits - c[..., None])
        p = p * torch.where(band, a_i @ b[:, :, lo:c1].transpose(-1, -2), 1.0)
        ps = torch.exp(ls - c[..., None])
        nums.append(f_state[..., None] * (a_i @ S) + p @ vv[:, :, lo:c1] + ps @ v_s)
        dens.append(f_state * (a_i @ z[..., None])[..., 0] + p.sum(-1) + ps.sum(-1))
        if c1 < W + T or return_state:  # the band joins the state: estimated keys j < c1 - W
            hi = c1 - W
            R_new = torch.maximum(R, mk[:, :, lo:hi, 0].amax(-1, keepdim=True))
            R_safe = R_new.masked_fill(R_new == -math.inf, 0.0)
            k_w = torch.exp(mk[:, :, lo:hi] - R_safe[..., None]) * b[:, :, lo:hi]
            decay = torch.exp(R - R_safe)
            S = decay[..., None] * S + k_w.transpose(-1, -2) @ vv[:, :, lo:hi]
            z = decay * z + k_w.sum(-2)
            R = R_new
    num = torch.cat([x.view(B, Hk, G, -1, E) for x in nums], 3)
    num = num.masked_fill(poison[:, :, None, W:], math.nan)
    den = torch.cat([x.view(B, Hk, G, -1) for x in dens], 3)
    out = attention_ratio(num, den).reshape(B, H, T, E).to(q.dtype)
    if not return_state:
        return out
    state = next_state(st, ext, S, z, R[:, :, 0])
    return out, state


def _bidirectional(q, k, v, rf, window, sinks, scale, key_padding_mask, query_padding_mask,
                   block, update=True):  # fmt: skip
    """:func:`hybrid_attention` with ``causal=False``. Every row sees every valid key, so one
    offset R per (b, h) over the estimated keys serves all rows (as non-causal random-feature
    attention's); each query block ``c0 <= i < c1`` reads the keys of the aligned key blocks
    around it, ``c0 - window < j < c1 - 1 + window``, row by row (exact where ``|i - j| <
    window``, estimated elsewhere) and every other estimated key through block sums: those
    before the band and those after it, each summed (never differences)."""
    maps = rf.map_tensors(q, k)
    B, H, T, D = q.shape
    Hk, E, W, C = k.shape[1], v.shape[-1], window, block
    if T == 0:  # no token: nothing to attend
        return q.new_zeros(B, H, 0, E)
    G = H // Hk
    scale = D**-0.5 if scale is None else float(scale)
    dev, cd = q.device, compute_dtype(q.dtype)
    valid = torch.ones(B, T, dtype=torch.bool, device=dev)
    if key_padding_mask is not None:
        valid = ~key_padding_mask
    sink = valid & (valid.long().cumsum(-1) <= sinks)
    est = valid & ~sink  # the window's or the features' (by the row)
    xq = prescale(q, scale).reshape(B, Hk, G * T, D)
    xk = prescale(k, scale, ~valid)
    fq, fk = xq, xk
    if maps is not None:
        fq = prescale(q, scale, None, maps[0]).reshape(B, Hk, G * T, D)
        fk = prescale(k, scale, ~valid, maps[1])
    vv = v.to(cd).masked_fill(~valid[:, None, :, None], 0.0)
    w = rf.weight.to(device=dev, dtype=cd)
    qpm = query_padding_mask
    if qpm is not None and G > 1:
        qpm = qpm.repeat(1, G)
    params = rf.feature_params(fq, fk, key_padding_mask, causal=False, query_padding_mask=qpm,
                               update=update)  # fmt: skip
    a, mq, b, mk = _factors(rf, fq, fk, w, params, est[:, None, :, None])
    R = mk.amax(-2, keepdim=True)  # [B, Hk, 1, 1], -inf without estimated keys
    kw = torch.exp(mk - R.masked_fill(R == -math.inf, 0.0)) * b  # 0 off the estimated keys
    a, mq, xq = (x.view(B, Hk, G, T, x.shape[-1]) for x in (a, mq, xq))
    # block sums of the estimated keys, then the sums before block n and from block n on
    nb = -(-T // C)
    pad = nb * C - T
    kw_b = torch.nn.functional.pad(kw, (0, 0, 0, pad)).view(B, Hk, nb, C, -1)
    vv_b = torch.nn.functional.pad(vv, (0, 0, 0, pad)).view(B, Hk, nb, C, E)
    blocks_s = torch.cat([kw_b.transpose(-1, -2) @ vv_b, kw_b.sum(-2)[..., None]], -1)
    zero = torch.zeros_like(blocks_s[:, :, :1])
    before = torch.cat([zero, blocks_s.cumsum(2)], 2)  # [B, Hk, nb + 1, F, E + 1]
    after = torch.cat([blocks_s.flip(2).cumsum(2).flip(2), zero], 2)
    slot, present = first_true(sink, sinks)
    x_s = prescale(gather_positions(k, slot), scale, ~present)
    v_s = gather_positions(v, slot).to(cd).masked_fill(~present[:, None, :, None], 0.0)
    outs = []
    for c0 in range(0, T, C):
        c1 = min(c0 + C, T)
        n = c1 - c0
        i = torch.arange(c0, c1, device=dev).repeat(G)[:, None]  # [G n, 1]
        a_i, xq_i = (x[:, :, :, c0:c1].reshape(B, Hk, G * n, x.shape[-1]) for x in (a, xq))
        mq_i = mq[:, :, :, c0:c1, 0].reshape(B, Hk, G * n)
        # the band: whole key blocks around the rows' windows (none without a window)
        lo, hi = (max(c0 - W + 1, 0) // C, -(-min(c1 - 1 + W, T) // C)) if W else (0, 0)
        j = torch.arange(lo * C, min(hi * C, T), device=dev)[None, :]
        near = ((j - i).abs() < W) & est[:, None, None, lo * C : hi * C]
        far = ~near & est[:, None, None, lo * C : hi * C]
        le = (xq_i @ xk[:, :, lo * C : hi * C].transpose(-1, -2)).masked_fill(~near, -math.inf)
        ls = (xq_i @ x_s.transpose(-1, -2)).masked_fill(~present[:, None, None, :], -math.inf)
        c = mq_i + R[..., 0]
        for part in (le, ls):
            if part.shape[-1]:
                c = torch.maximum(c, part.amax(-1))
        c = c.detach().masked_fill(c == -math.inf, 0.0)
        f = torch.exp(mq_i + R[..., 0] - c)
        outside = a_i @ (before[:, :, lo] + after[:, :, hi])  # [B, Hk, G n, E + 1]
        pb = (a_i @ kw[:, :, lo * C : hi * C].transpose(-1, -2)).masked_fill(~far, 0.0)
        num = f[..., None] * (outside[..., :E] + pb @ vv[:, :, lo * C : hi * C])
        den = f * (outside[..., E] + pb.sum(-1))
        p = torch.exp(le - c[..., None])
        num, den = num + p @ vv[:, :, lo * C : hi * C], den + p.sum(-1)
        p = torch.exp(ls - c[..., None])
        num, den = num + p @ v_s, den + p.sum(-1)
        outs.append(attention_ratio(num, den).view(B, Hk, G, n, E))
    return torch.cat(outs, dim=3).reshape(B, H, T, E).to(q.dtype)


def estimated_stream(ext: Extended, T: int):
    """``(k', v', mask')``: the keys the features estimate, as a causal stream of the call's
    length for the chunk kernels (:func:`rfattn.fused.hybrid`): position ``t`` holds extended
    position ``t`` (key ``t - window`` of the call; row ``t`` estimates exactly the keys ``<=
    t`` of the stream), and ``mask'`` leaves out every position that is not a window key (the
    state's empty positions, padding, the sinks)."""
    return ext.keys[:, :, :T], ext.values[:, :, :T], ext.kinds[:, :T] != WINDOW


def sink_values(ext: Extended, dtype) -> torch.Tensor:
    """The sink slots' values in ``dtype``, absent slots 0 and a new sink's non-finite entries 0
    (a block's product with them reaches rows before the sink's position: the poison from its
    position, :func:`finite_values`, marks the rows that see it); a state's sinks as they are
    (every row sees them)."""
    sv = ext.sink_values.to(dtype).masked_fill(~ext.sink_present[:, None, :, None], 0.0)
    new = (ext.sink_pos >= 0)[:, None, :, None]
    return sv.masked_fill(new & ~torch.isfinite(sv), 0.0)


def exact_terms(q, ext: Extended, window: int, scale: float, block: int = BLOCK):
    """``(num [B, H, T, E], den [B, H, T], offset [B, H, T])``: each causal row's exact terms,
    ``sum_{j in E_i} exp(s q_i . k_j - offset_i) v_j`` and the same without v, at the row's
    largest exact logit (detached; -inf and zeros for a row with no exact key), in the compute
    dtype; differentiable in q and the extended keys and values (:func:`extend`: row ``t`` at
    extended position ``e = W + t`` sees the window keys ``e - window < j <= e`` and the sinks
    up to it). Blocked: a block of C rows reads ``[C, C + window]`` window logits and ``[C,
    2 sinks]`` sink logits. Grouped-query heads read their key/value head's keys, nothing
    repeated; positions of nothing and padded keys reach nothing; a non-finite value makes
    its own and later rows NaN, no earlier one."""
    B, H, T, D = q.shape
    Hk, W = ext.keys.shape[1], ext.kinds.shape[-1] - T
    G, dev, cd = H // Hk, q.device, compute_dtype(q.dtype)
    E = ext.values.shape[-1]
    absent = ext.kinds == NOTHING
    near_key = ext.kinds == WINDOW  # a sink inside the window counts once, as a sink
    xq = prescale(q, scale).view(B, Hk, G, T, D)
    xk = prescale(ext.keys, scale, absent)[:, :, None]  # [B, Hk, 1, W + T, D]
    vv, poison = finite_values(ext.values.to(cd).masked_fill(absent[:, None, :, None], 0.0))
    vv = vv[:, :, None]
    sk = prescale(ext.sink_keys, scale, ~ext.sink_present)[:, :, None]  # [B, Hk, 1, 2S, D]
    sv = sink_values(ext, cd)[:, :, None]
    nums, dens, offs = [], [], []
    for c0 in range(0, T, block):
        c1 = min(c0 + block, T)
        e = torch.arange(W + c0, W + c1, device=dev)[:, None]  # the rows' extended positions
        xq_b = xq[:, :, :, c0:c1]
        parts = []  # (logits [B, Hk, G, C, L] with -inf off the row's keys, values)
        if window:
            lo = max(0, W + c0 - window + 1)
            j = torch.arange(lo, W + c1, device=dev)[None, :]
            near = (j <= e) & (j > e - window) & near_key[:, None, lo : W + c1]  # [B, C, L]
            lg = (xq_b @ xk[:, :, :, lo : W + c1].transpose(-1, -2)).masked_fill(
                ~near[:, None, None], -math.inf)  # fmt: skip
            parts.append((lg, vv[:, :, :, lo : W + c1]))
        if ext.sink_pos.shape[-1]:
            seen = (ext.sink_pos[:, None, :] <= e) & ext.sink_present[:, None, :]  # [B, C, 2S]
            ls = (xq_b @ sk.transpose(-1, -2)).masked_fill(~seen[:, None, None], -math.inf)
            parts.append((ls, sv))
        top = functools.reduce(torch.maximum, [lg.amax(-1) for lg, _ in parts]).detach()
        safe = top.masked_fill(top == -math.inf, 0.0)
        ps = [torch.exp(lg - safe[..., None]) for lg, _ in parts]
        nums.append(sum(p @ x for p, (_, x) in zip(ps, parts, strict=True)))
        dens.append(sum(p.sum(-1) for p in ps))
        offs.append(top)
    num = torch.cat(nums, 3).masked_fill(poison[:, :, None, W:], math.nan).reshape(B, H, T, E)
    return num, torch.cat(dens, 3).reshape(B, H, T), torch.cat(offs, 3).reshape(B, H, T)


def attend(call):
    """``rf_attention``'s result for a validated call with ``window`` or ``sinks``
    (:class:`rfattn.call.Call`; padded query rows already read as 0) on the torch path above
    (:func:`rfattn.backends.hybrid` chooses between it and :func:`rfattn.fused.hybrid`, for one
    process and for :func:`rfattn.distributed.hybrid_sharded`'s local pass)."""
    return hybrid_attention(call.q, call.k, call.v, call.rf, window=call.window, sinks=call.sinks,
                            scale=call.scale, key_padding_mask=call.key_padding_mask,
                            query_padding_mask=call.query_padding_mask,
                            initial_state=call.initial_state,
                            return_state=call.return_state, causal=call.causal,
                            update=call.update_stats)  # fmt: skip
