"""The stats pass of the data-dependent features (oprf, saderf): per-(b, h) token moments of q and
k and the feature parameters formed from them, in ONE launch: its own (:func:`stats_pass`:
causal calls and the decode step, which take the parameters of running statistics, and callers
that want the moments), or inside the key pass of a non-causal forward, whose launch then forms
the parameters before its key tiles use them (:class:`KeyPassStats`, ``rfattn.kernels.
rf_parallel``).

For one side (queries or keys) of one (b, h), over the valid tokens (inside T, not padded):

    n = #valid     sum_t x~_t     sum_t x~_t^2     sum_t |x~_t|     min_t x~_t          [D] each

with ``x~ = sqrt(scale) * x`` in the accumulation dtype (fp32; fp64 for fp64 inputs). Work items
(:func:`stats_item`) ``i_bh * (SQ + SK) + i_s``: items ``i_s < SQ`` reduce contiguous ranges
of the (b, h)'s query rows, the others of its keys, and write their partials. Each then counts
itself in with a ``tl.atomic_add`` on the (b, h)'s arrival counter; the last to arrive (it sees
``SQ + SK - 1``) adds the partials in a fixed order (deterministic whichever item is last: the
atomics only elect it), divides by ``max(n, 1)``, writes the moments
(``rfattn.stats.sequence_moments``: mean, mean square, mean absolute value, minimum with 0 where
no token is valid), forms the feature's parameters from them (``FORM``) and sets the counter
back to 0. The counters are zeroed once when their buffer is made and left at 0 by every
launch, so a call fills nothing. The launch of :func:`stats_pass` has one program per item,
grid (SQ + SK, B*H).

``FORM`` 1 (oprf) and 2 (saderf) are the closed forms of ``rfattn.stats``
(:func:`~rfattn.stats.pair_sq_norm`, :func:`~rfattn.stats.oprf_A`,
:func:`~rfattn.stats.gerf_real_constants`, :func:`~rfattn.stats.saderf_psi`), written once more
here in Triton: per (b, h) the coefficients ``(A, B, log D)`` ``[3]`` and saderf's ``psi`` ``[D]``.

``RUNNING``: the running-statistics mode of a training call. The parameters come from the
running buffers as they are before this call (not from its moments; :func:`running_params`),
and the buffers take this call's moments afterwards (:func:`running_update`,
``rfattn.stats.update_running``: pooled over batch and heads, the first update copies, later
ones mix with ``momentum``; ``num_batches_tracked`` counts up). In :func:`stats_pass` both
happen in the last program of the whole grid, elected by a second counter after the per-(b, h)
ones (the update needs every (b, h)'s moments), which stores the parameters for every (b, h):
per-(b, h) rows, as the kernels read them, so their launches copy nothing.

Grouped-query attention: q ``[B, G*Hkv, Tq, D]``, k ``[B, Hkv, Tk, D]``; the query rows of
key/value head h are the ``G * Tq`` rows of its query heads ``h*G .. h*G + G - 1`` (as
``rfattn.call.query_rows`` groups them), read in place, whatever q's strides.

Scalars (sqrt(scale), momentum, the closed forms' constants) are fp64 kernel arguments: no
tensor is made for them, and fp64 inputs get them exactly.

Layout: q, k any strides; masks ``[B, T]`` bool (True = padding).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (
    DTYPES,
    INTERPRET,
    arrival_counters,
    last_to_arrive,
    launch,
    next_pow2,
    split_counts,
)

__all__ = ["StatsPass", "stats_pass", "KeyPassStats", "ChunkStats"]

#: the closed forms the kernel can form (``FORM``)
FORMS = {None: 0, "oprf": 1, "saderf": 2}
#: saderf's clamp of ``sq_k / sq_q`` (``rfattn.stats.saderf_psi``)
PSI_RATIO_RANGE = (1e-6, 1e6)


def autotune_configs():
    if INTERPRET:
        return [triton.Config({"BT": 64}, num_warps=1)]
    return [triton.Config({"BT": bt}, num_warps=w) for bt in (32, 64, 128) for w in (2, 4)]


@triton.jit
def _side_sums(x_ptr, pad_ptr, i_b, i_h, r0, r_per, R, TX, G, stride_xb, stride_xh, stride_xt,
               stride_xd, stride_pb, stride_pt, sc, o_d, m_d, BD: tl.constexpr,
               BT: tl.constexpr, HAS_PAD: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """(sum, sum of squares, sum of |.|, min) ``[BD]`` and count of rows ``r0 .. r0 + r_per - 1``
    (of ``R``); row r is token ``r % TX`` of head ``i_h * G + r // TX``."""
    b_sum = tl.zeros([BD], dtype=ACC)
    b_sq = tl.zeros([BD], dtype=ACC)
    b_abs = tl.zeros([BD], dtype=ACC)
    b_min = tl.full([BD], float("inf"), dtype=ACC)
    b_cnt = tl.zeros([BT], dtype=ACC)
    for r in range(0, r_per, BT):
        o_r = r0 + r + tl.arange(0, BT)
        m_r = o_r < R
        o_g = o_r // TX
        o_t = o_r - o_g * TX
        if HAS_PAD:
            b_pad = tl.load(pad_ptr + i_b * stride_pb + o_t * stride_pt, mask=m_r, other=1)
            m_r = m_r & (b_pad == 0)
        p_x = (x_ptr + i_b * stride_xb + (i_h * G + o_g)[:, None] * stride_xh
               + o_t[:, None] * stride_xt + o_d[None, :] * stride_xd)  # fmt: skip
        m_x = m_r[:, None] & m_d[None, :]
        b_x = tl.load(p_x, mask=m_x, other=0.0).to(ACC) * sc  # [BT, BD], 0 where invalid
        b_sum += tl.sum(b_x, axis=0)
        b_sq += tl.sum(b_x * b_x, axis=0)
        b_abs += tl.sum(tl.abs(b_x), axis=0)
        b_min = tl.minimum(b_min, tl.min(tl.where(m_x, b_x, float("inf")), axis=0))
        b_cnt += m_r.to(ACC)
    return b_sum, b_sq, b_abs, b_min, tl.sum(b_cnt, axis=0)


@triton.jit
def _side_moments(part_ptr, cnt_ptr, i_p0, NSPLIT, D, o_d, m_d, BD: tl.constexpr,
                  ACC: tl.constexpr):  # fmt: skip
    """One side's (mean, mean square, mean |.|, min) ``[BD]`` from its partials ``i_p0 ..
    i_p0 + NSPLIT - 1``, added in split order."""
    b_sum = tl.zeros([BD], dtype=ACC)
    b_sq = tl.zeros([BD], dtype=ACC)
    b_abs = tl.zeros([BD], dtype=ACC)
    b_min = tl.full([BD], float("inf"), dtype=ACC)
    b_n = tl.zeros([BD], dtype=ACC)
    for s in range(0, NSPLIT):
        p_part = part_ptr + (i_p0 + s) * 4 * D + o_d
        # .cg: straight from L2, where the other programs' partials are (not a stale L1 line)
        b_sum += tl.load(p_part, mask=m_d, other=0.0, cache_modifier=".cg")
        b_sq += tl.load(p_part + D, mask=m_d, other=0.0, cache_modifier=".cg")
        b_abs += tl.load(p_part + 2 * D, mask=m_d, other=0.0, cache_modifier=".cg")
        b_min = tl.minimum(b_min, tl.load(p_part + 3 * D, mask=m_d, other=0.0,
                                          cache_modifier=".cg"))  # fmt: skip
        b_n += tl.load(cnt_ptr + i_p0 + s, cache_modifier=".cg")
    b_den = tl.maximum(b_n, 1.0)
    b_min = tl.where(b_n > 0, b_min, 0.0)
    return b_sum / b_den, b_sq / b_den, b_abs / b_den, b_min


@triton.jit
def _gerf_params(b_mq, b_sq_q, b_mk, b_sq_k, m_d, D, tiny, psi_lo, psi_hi,
                 FORM: tl.constexpr):  # fmt: skip
    """``(A, B, log D, psi)`` of oprf (FORM 1; psi = 1) or saderf (FORM 2) from the moments of
    queries and keys ``[BD]``: ``rfattn.stats``' closed forms, in the moments' dtype."""
    if FORM == 2:  # psi_l = clamp((sq_k + tiny) / (sq_q + tiny))^(1/4)
        b_ratio = (b_sq_k + tiny) / (b_sq_q + tiny)
        b_ratio = tl.minimum(tl.maximum(b_ratio, psi_lo), psi_hi)
        b_psi = tl.where(m_d, tl.sqrt(tl.sqrt(b_ratio)), 1.0)
        b_p2 = b_psi * b_psi
        phi = tl.sum(b_p2 * b_sq_q, axis=0) + tl.sum(b_sq_k / b_p2, axis=0)
    else:
        b_psi = tl.zeros_like(b_sq_q) + 1.0
        phi = tl.sum(b_sq_q, axis=0) + tl.sum(b_sq_k, axis=0)
    phi += 2.0 * tl.sum(b_mq * b_mk, axis=0)
    # rho* = 2d / ((2S + d) + sqrt((2S + d)^2 + 8 d S)), S = max(phi, 0); A = (1 - 1/rho*) / 8
    s = tl.maximum(phi, 0.0)
    b = 2.0 * s + D
    rho = 2.0 * D / (b + tl.sqrt(b * b + 8.0 * D * s))
    a = (1.0 - 1.0 / rho) / 8.0
    one_m = 1.0 - 4.0 * a
    return a, tl.sqrt(one_m), 0.25 * D * tl.log(one_m), b_psi


@triton.jit
def store_params(coef_ptr, psi_ptr, i_row, a, b, log_d, b_psi, D, o_d, m_d,
                  FORM: tl.constexpr):  # fmt: skip
    tl.store(coef_ptr + i_row * 3, a)
    tl.store(coef_ptr + i_row * 3 + 1, b)
    tl.store(coef_ptr + i_row * 3 + 2, log_d)
    if FORM == 2:
        tl.store(psi_ptr + i_row * D + o_d, b_psi, mask=m_d)


@triton.jit
def ready_params(coef_ptr, psi_ptr, i_bh, D, o_d, m_d, BD: tl.constexpr, FORM: tl.constexpr,
                 ACC: tl.constexpr):  # fmt: skip
    """``(A, B, log D, psi [BD])`` of (b, h) ``i_bh`` as a stats role of this launch stored them
    (``.cg``: from L2, where the stats role's stores are, not a stale L1 line)."""
    a = tl.load(coef_ptr + i_bh * 3, cache_modifier=".cg").to(ACC)
    b = tl.load(coef_ptr + i_bh * 3 + 1, cache_modifier=".cg").to(ACC)
    log_d = tl.load(coef_ptr + i_bh * 3 + 2, cache_modifier=".cg").to(ACC)
    if FORM == 2:
        b_psi = tl.load(psi_ptr + i_bh * D + o_d, mask=m_d, other=1.0,
                        cache_modifier=".cg").to(ACC)  # fmt: skip
    else:
        b_psi = tl.full([BD], 1.0, ACC)
    return a, b, log_d, b_psi


@triton.jit
def _mix_store(p_run, m_run, b_new, first, keep, momentum, RACC: tl.constexpr):
    """``run = new`` on the first update, else ``keep * run + momentum * new`` (``new`` in the
    buffer's dtype first, as ``rfattn.stats.update_running`` casts it)."""
    ty = p_run.dtype.element_ty
    b_old = tl.load(p_run, mask=m_run, other=0.0).to(RACC)
    b_val = b_new.to(ty).to(RACC)
    b_mix = tl.full([], keep, RACC) * b_old + tl.full([], momentum, RACC) * b_val
    tl.store(p_run, tl.where(first, b_val, b_mix).to(ty), mask=m_run)


@triton.jit
def _pool_side(mom_ptr, side, BH, D, o_d, m_d, BD: tl.constexpr, BB: tl.constexpr,
               ACC: tl.constexpr):  # fmt: skip
    """One side's moments ``[BD]`` pooled over every (b, h) (``rfattn.stats.pool_moments``:
    means averaged, min of mins), ``BB`` (b, h) rows a step."""
    field = BH.to(tl.int64) * 2 * D  # mom [4, BH, 2, D]
    b_sum = tl.zeros([BB, BD], dtype=ACC)
    b_sq = tl.zeros([BB, BD], dtype=ACC)
    b_abs = tl.zeros([BB, BD], dtype=ACC)
    b_min = tl.full([BB, BD], float("inf"), dtype=ACC)
    for i0 in range(0, BH, BB):
        o_b = i0 + tl.arange(0, BB)
        m_m = (o_b < BH)[:, None] & m_d[None, :]
        p_m = mom_ptr + o_b[:, None] * 2 * D + side * D + o_d[None, :]  # [BB, BD]
        b_sum += tl.load(p_m, mask=m_m, other=0.0, cache_modifier=".cg")
        b_sq += tl.load(p_m + field, mask=m_m, other=0.0, cache_modifier=".cg")
        b_abs += tl.load(p_m + 2 * field, mask=m_m, other=0.0, cache_modifier=".cg")
        b_min = tl.minimum(b_min, tl.load(p_m + 3 * field, mask=m_m, other=float("inf"),
                                          cache_modifier=".cg"))  # fmt: skip
    return (tl.sum(b_sum, axis=0) / BH, tl.sum(b_sq, axis=0) / BH, tl.sum(b_abs, axis=0) / BH,
            tl.min(b_min, axis=0))  # fmt: skip


@triton.jit
def stats_item(
    w, q_ptr, k_ptr, qpad_ptr, kpad_ptr, part_ptr, cnt_ptr, arrive_ptr, mom_ptr, coef_ptr,
    psi_ptr, b_sc, tiny, psi_lo, psi_hi,
    BH, RQ, TQ, G, Tk, TK, H, SQ, SK, q_per, k_per,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_qpb, stride_qpt, stride_kpb, stride_kpt,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HAS_QPAD: tl.constexpr,
    HAS_KPAD: tl.constexpr, FORM: tl.constexpr, RUNNING: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Work item ``w`` of the stats pass (item ``i_bh * (SQ + SK) + i_s``: split i_s of (b, h)
    i_bh, queries for i_s < SQ, keys after): its partial moments; the (b, h)'s last item to
    arrive its moments and, without RUNNING, its parameters. Returns whether this item was that
    last one (the (b, h) is then complete)."""
    NS = SQ + SK
    i_bh, i_s = w // NS, w % NS
    i_bh = i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    if i_s < SQ:
        b_sum, b_sq, b_abs, b_min, n = _side_sums(
            q_ptr, qpad_ptr, i_b, i_h, i_s.to(tl.int64) * q_per, q_per, RQ, TQ, G, stride_qb,
            stride_qh, stride_qt, stride_qd, stride_qpb, stride_qpt, b_sc, o_d, m_d, BD, BT,
            HAS_QPAD, ACC)  # fmt: skip
    else:
        b_sum, b_sq, b_abs, b_min, n = _side_sums(
            k_ptr, kpad_ptr, i_b, i_h, (i_s - SQ).to(tl.int64) * k_per, k_per, Tk, TK, 1,
            stride_kb, stride_kh, stride_kt, stride_kd, stride_kpb, stride_kpt, b_sc, o_d, m_d,
            BD, BT, HAS_KPAD, ACC)  # fmt: skip
    i_part = i_bh * NS + i_s
    p_part = part_ptr + i_part * 4 * D + o_d
    tl.store(p_part, b_sum, mask=m_d)
    tl.store(p_part + D, b_sq, mask=m_d)
    tl.store(p_part + 2 * D, b_abs, mask=m_d)
    tl.store(p_part + 3 * D, b_min, mask=m_d)
    tl.store(cnt_ptr + i_part, n)
    done = last_to_arrive(arrive_ptr + i_bh, NS)
    if done:  # the (b, h)'s last item
        b_mq, b_sq_q, b_aq, b_minq = _side_moments(part_ptr, cnt_ptr, i_bh * NS, SQ, D, o_d, m_d,
                                                 BD, ACC)  # fmt: skip
        b_mk, b_sq_k, b_ak, b_mink = _side_moments(part_ptr, cnt_ptr, i_bh * NS + SQ, SK, D, o_d,
                                                 m_d, BD, ACC)  # fmt: skip
        field = BH.to(tl.int64) * 2 * D  # mom [4, BH, 2, D]
        p_mom = mom_ptr + i_bh * 2 * D + o_d
        tl.store(p_mom, b_mq, mask=m_d)
        tl.store(p_mom + D, b_mk, mask=m_d)
        tl.store(p_mom + field, b_sq_q, mask=m_d)
        tl.store(p_mom + field + D, b_sq_k, mask=m_d)
        tl.store(p_mom + 2 * field, b_aq, mask=m_d)
        tl.store(p_mom + 2 * field + D, b_ak, mask=m_d)
        tl.store(p_mom + 3 * field, b_minq, mask=m_d)
        tl.store(p_mom + 3 * field + D, b_mink, mask=m_d)
        if FORM > 0 and not RUNNING:
            a, b, log_d, b_psi = _gerf_params(b_mq, b_sq_q, b_mk, b_sq_k, m_d, D, tiny, psi_lo,
                                              psi_hi, FORM)  # fmt: skip
            store_params(coef_ptr, psi_ptr, i_bh, a, b, log_d, b_psi, D, o_d, m_d, FORM)
    return done


@triton.jit
def running_params(run_mean, run_sq, D, tiny, psi_lo, psi_hi, o_d, m_d, FORM: tl.constexpr,
                   ACC: tl.constexpr):  # fmt: skip
    """The running mode's ``(A, B, log D, psi)`` from the buffers ``[2, D]`` as they are."""
    b_mq = tl.load(run_mean + o_d, mask=m_d, other=0.0).to(ACC)
    b_mk = tl.load(run_mean + D + o_d, mask=m_d, other=0.0).to(ACC)
    b_sq_q = tl.load(run_sq + o_d, mask=m_d, other=0.0).to(ACC)
    b_sq_k = tl.load(run_sq + D + o_d, mask=m_d, other=0.0).to(ACC)
    return _gerf_params(b_mq, b_sq_q, b_mk, b_sq_k, m_d, D, tiny, psi_lo, psi_hi, FORM)


@triton.jit
def running_update(mom_ptr, run_mean, run_sq, run_abs, run_min, nbt_ptr, BH, D, keep, momentum,
                   o_d, m_d, BD: tl.constexpr, BB: tl.constexpr, ACC: tl.constexpr,
                   RACC: tl.constexpr):  # fmt: skip
    """The running buffers' update with the moments of every (b, h) pooled (``mom`` complete:
    the caller is the last to arrive after every (b, h))."""
    n_seen = tl.load(nbt_ptr)
    first = n_seen == 0
    for side in tl.static_range(2):  # row 0 queries, 1 keys
        b_mean, b_sq, b_abs, b_min = _pool_side(mom_ptr, side, BH, D, o_d, m_d, BD, BB, ACC)
        o_run = side * D + o_d
        _mix_store(run_mean + o_run, m_d, b_mean, first, keep, momentum, RACC)
        _mix_store(run_sq + o_run, m_d, b_sq, first, keep, momentum, RACC)
        _mix_store(run_abs + o_run, m_d, b_abs, first, keep, momentum, RACC)
        _mix_store(run_min + o_run, m_d, b_min, first, keep, momentum, RACC)
    tl.store(nbt_ptr, n_seen + 1)


# restore_value: tuning runs the kernel once per config; the running buffers move only once
@triton.autotune(
    configs=autotune_configs(),
    key=["D", "ACC", "FORM", "RUNNING"],
    restore_value=["run_mean", "run_sq", "run_abs", "run_min", "nbt_ptr"],
)
@triton.jit
def _stats_kernel(
    q_ptr, k_ptr, qpad_ptr, kpad_ptr, part_ptr, cnt_ptr, arrive_ptr, mom_ptr, coef_ptr, psi_ptr,
    run_mean, run_sq, run_abs, run_min, nbt_ptr,
    sc: tl.float64, keep: tl.float64, momentum: tl.float64, tiny: tl.float64, psi_lo: tl.float64,
    psi_hi: tl.float64,
    RQ, TQ, G, Tk, TK, H, SQ, SK, q_per, k_per,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh, stride_kt, stride_kd,
    stride_qpb, stride_qpt, stride_kpb, stride_kpt,
    D: tl.constexpr, BD: tl.constexpr, BB: tl.constexpr, BT: tl.constexpr, HAS_QPAD: tl.constexpr,
    HAS_KPAD: tl.constexpr, FORM: tl.constexpr, RUNNING: tl.constexpr, ACC: tl.constexpr,
    RACC: tl.constexpr,
):  # fmt: skip
    """Work item (split i_s, (b, h) i_bh) of the stats pass (:func:`stats_item`); with
    RUNNING, the last (b, h) to complete the parameters from the buffers and their update."""
    i_s, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    BH = tl.num_programs(1)
    # fp64 arguments as ACC (tl.full: the interpreter passes them as Python floats)
    b_sc = tl.full([], sc, ACC)
    tiny = tl.full([], tiny, ACC)
    psi_lo, psi_hi = tl.full([], psi_lo, ACC), tl.full([], psi_hi, ACC)
    done = stats_item(
        i_bh * (SQ + SK) + i_s, q_ptr, k_ptr, qpad_ptr, kpad_ptr, part_ptr, cnt_ptr, arrive_ptr,
        mom_ptr, coef_ptr, psi_ptr, b_sc, tiny, psi_lo, psi_hi, BH, RQ, TQ, G, Tk, TK, H, SQ, SK,
        q_per, k_per, stride_qb, stride_qh, stride_qt, stride_qd, stride_kb, stride_kh,
        stride_kt, stride_kd, stride_qpb, stride_qpt, stride_kpb, stride_kpt,
        D, BD, BT, HAS_QPAD, HAS_KPAD, FORM, RUNNING, ACC)  # fmt: skip
    if RUNNING:
        if done:
            if last_to_arrive(arrive_ptr + BH, BH):  # the grid's last (b, h)
                o_d = tl.arange(0, BD)
                m_d = o_d < D
                if FORM > 0:  # this call's parameters: from the buffers before the update
                    a, b, log_d, b_psi = running_params(run_mean, run_sq, D, tiny, psi_lo,
                                                        psi_hi, o_d, m_d, FORM, ACC)  # fmt: skip
                    for r in range(0, BH):  # every (b, h) row: the launchers read them so
                        store_params(coef_ptr, psi_ptr, r, a, b, log_d, b_psi, D, o_d, m_d,
                                     FORM)  # fmt: skip
                running_update(mom_ptr, run_mean, run_sq, run_abs, run_min, nbt_ptr, BH, D, keep,
                               momentum, o_d, m_d, BD, BB, ACC, RACC)  # fmt: skip


class StatsPass(NamedTuple):
    """What :func:`stats_pass` returns.

    Attributes:
        moments: ``(mean, sq, abs, min)``, each ``[B, H, 2, D]`` (row 0 queries, row 1 keys):
            the fields of ``rfattn.stats.Moments``.
        coeffs: ``(A, B, log D)`` ``[B, H, 3]`` (in running mode every (b, h) the same), or None.
        psi: saderf's ``[B, H, D]``, or None.
    """

    moments: tuple
    coeffs: torch.Tensor | None
    psi: torch.Tensor | None


def stats_pass(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
    form: str | None = None,
    running: tuple | None = None,
    num_splits: int | None = None,
) -> StatsPass:
    """The moments of ``sqrt(scale) * q`` and ``sqrt(scale) * k`` over the valid tokens of each
    (b, h), and the parameters of ``form`` from them, in one launch (module docstring).

    Args:
        q: ``[B, G*H, Tq, D]``; k: ``[B, H, Tk, D]`` (fp32/fp16/bf16/fp64, any strides).
        scale: the softmax temperature (inputs are multiplied by ``sqrt(scale)``).
        key_padding_mask: ``[B, Tk]`` bool, True = padding (excluded).
        query_padding_mask: ``[B, Tq]`` bool, likewise for the queries.
        form: None (moments only), "oprf" or "saderf".
        running: ``(mean, sq, abs, min, num_batches_tracked, momentum)``: the running buffers
            (``[2, D]`` contiguous, one float dtype, on q's device) of a training call; the
            parameters then come from them and they take this call's moments.
        num_splits: programs sharing one side of a (b, h) (default: fill the device).

    Returns:
        :class:`StatsPass`, in fp32 (fp64 for fp64 inputs); means divide by ``max(n, 1)``, the
        min is 0 where no token is valid.
    """
    if q.dim() != 4 or q.dtype not in DTYPES or k.dim() != 4 or k.dtype != q.dtype:
        raise ValueError(f"q, k must be [B, H, T, D] in one of {DTYPES}, got "
                         f"{tuple(q.shape)} {q.dtype}, {tuple(k.shape)} {k.dtype}")  # fmt: skip
    B, Hq, Tq, D = q.shape
    H, Tk = k.shape[1], k.shape[2]
    if H == 0 or Hq % H or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    for name, m, T in (("key", key_padding_mask, Tk), ("query", query_padding_mask, Tq)):
        if m is not None and (m.dtype != torch.bool or tuple(m.shape) != (B, T)):
            raise ValueError(f"{name}_padding_mask must be bool [B, T] = {(B, T)}")
    if form not in FORMS:
        raise ValueError(f"form must be one of {list(FORMS)}, got {form!r}")
    if B * H == 0:
        raise ValueError("the stats pass needs at least one (b, h)")
    G = Hq // H
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    r = _reduction(q, Tk, B, H, G, D, acc, query_padding_mask, running, num_splits)
    coeffs = torch.empty(B, H, 3, device=q.device, dtype=acc) if form else None
    psi = torch.empty(B, H, D, device=q.device, dtype=acc) if form == "saderf" else None
    kpad = _mask_arg(key_padding_mask, r.mom)
    launch(_stats_kernel, (r.sq + r.sk, B * H),
        q, k, r.qpad[0], kpad[0], r.part, r.cnt, arrival_counters(q.device, B * H + 1), r.mom,
        r.mom if coeffs is None else coeffs, r.mom if psi is None else psi, *r.running,
        float(scale) ** 0.5, *r.scalars,
        G * Tq, max(Tq, 1), G, Tk, max(Tk, 1), H, r.sq, r.sk, r.q_per, r.k_per, *q.stride(),
        *k.stride(), *r.qpad[1:], *kpad[1:], D=D, BD=next_pow2(D),
        HAS_KPAD=key_padding_mask is not None,
        FORM=FORMS[form], ACC=tl.float64 if acc == torch.float64 else tl.float32, **r.meta,
    )  # fmt: skip
    return StatsPass(tuple(r.mom.unbind(0)), coeffs, psi)


class _Reduction(NamedTuple):
    """What a launch of the moments' reduction takes beside q and k (:func:`_reduction`)."""

    sq: int  # query splits per (b, h)
    sk: int  # key splits
    q_per: int  # rows per query split
    k_per: int
    part: torch.Tensor  # [BH, sq + sk, 4, D] the splits' partial sums
    cnt: torch.Tensor  # [BH, sq + sk] their counts
    mom: torch.Tensor  # [4, B, H, 2, D] the moments
    running: tuple  # (mean, sq, abs, min, num_batches_tracked) or placeholders
    scalars: tuple  # (1 - momentum, momentum, tiny, the psi ratio's range)
    qpad: tuple  # (query mask as uint8 or a placeholder, its strides or 0)
    meta: dict  # constexprs


def _mask_arg(mask, placeholder) -> tuple:
    """(a bool mask as uint8, stride_b, stride_t), or ``(placeholder, 0, 0)`` without one."""
    if mask is None:
        return placeholder, 0, 0
    m = mask.view(torch.uint8)
    return m, m.stride(0), m.stride(1)


def _reduction(q, Tk: int, B: int, H: int, G: int, D: int, acc, query_padding_mask, running,
               num_splits) -> _Reduction:  # fmt: skip
    """The splits, buffers and arguments of :func:`stats_pass`'s moments' reduction of a call
    (``G * Tq`` query rows and ``Tk`` keys per (b, h))."""
    dev = q.device
    sq_, q_per = split_counts(G * q.shape[2], B * H, dev, num_splits)
    sk_, k_per = split_counts(Tk, B * H, dev, num_splits)
    mom = torch.empty(4, B, H, 2, D, device=dev, dtype=acc)
    bufs, scalars = _running_args(running, mom, acc)
    return _Reduction(
        sq_, sk_, q_per, k_per,
        torch.empty(B * H, sq_ + sk_, 4, D, device=dev, dtype=acc),
        torch.empty(B * H, sq_ + sk_, device=dev, dtype=acc),
        mom, bufs, scalars, _mask_arg(query_padding_mask, mom),
        _reduction_meta(D, query_padding_mask, running),
    )  # fmt: skip


def _running_args(running, placeholder, acc) -> tuple:
    """``((mean, sq, abs, min, num_batches_tracked), (1 - momentum, momentum, tiny, the psi
    ratio's range))`` of a reduction: the running buffers, or placeholders never read."""
    if running is not None:
        *bufs, nbt, momentum = running
    else:
        bufs, nbt, momentum = (placeholder,) * 4, placeholder, 0.0
    return (*bufs, nbt), (1.0 - momentum, momentum, torch.finfo(acc).tiny, *PSI_RATIO_RANGE)


def _reduction_meta(D: int, query_padding_mask, running) -> dict:
    """The constexprs of a moments' reduction."""
    racc = tl.float64 if running is not None and running[0].dtype == torch.float64 else tl.float32
    return dict(BB=2 if INTERPRET else max(1, 2048 // next_pow2(D)),  # 2: loops in the interpreter
                HAS_QPAD=query_padding_mask is not None, RUNNING=running is not None, RACC=racc)


class KeyPassStats(NamedTuple):
    """The statistics of a non-causal call that its forward's key pass forms in its own launch
    (``rfattn.kernels.rf_parallel``): the form's parameters, left unwritten by the form and
    handed with it to that forward (``rf_parallel_fwd``'s ``stats``), which forms them.

    Attributes:
        form: "oprf" or "saderf".
        query_padding_mask: ``[B, Tq]`` bool of the operator's query rows, or None.
        running: as :func:`stats_pass`'s (a training call with running statistics), or None.
        programs: stats roles of the launch (default: one per work item, ``B*H`` times the
            splits of both sides).
        num_splits: as :func:`stats_pass`'s.
    """

    form: str
    query_padding_mask: torch.Tensor | None = None
    running: tuple | None = None
    programs: int | None = None
    num_splits: int | None = None


def key_pass_counters(BH: int) -> int:
    """The arrival counters a key pass with statistics takes after its own: per (b, h) the
    stats items' arrivals and a ready flag, then the ticket and the launch's arrivals."""
    return 2 * BH + 2


def key_pass_key(stats: KeyPassStats) -> tuple:
    """What a key pass's plan for ``stats`` (:func:`key_pass_plan`) derives from beside the
    forward's own plan: the form, the running buffers' dtype and 16-byte alignment, the query
    mask's size, strides and alignment, the roles and splits asked for (read without touching
    the data)."""
    m, run = stats.query_padding_mask, stats.running
    return (stats.form, stats.programs, stats.num_splits,
            None if m is None else (m.shape, m.stride(), m.dtype, m.data_ptr() % 16),
            None if run is None else (run[0].dtype, *(b.data_ptr() % 16 for b in run[:5])))


def key_pass_plan(stats: KeyPassStats, q, k, B: int, H: int, D: int, acc) -> dict:
    """What a key pass that forms ``stats`` (``rf_parallel._fwd_kv_stats_kernel``) for q
    ``[B, H, Tq, D]`` (query rows of one group: G = 1) and k ``[B, H, Tk, D]`` takes beside the
    key pass's own arguments, fixed per shape and :func:`key_pass_key`: ``roles`` (stats
    roles), ``buffers`` (the shapes of the moments' scratch: partial sums, counts, moments, in
    the accumulation dtype), ``ints`` (the integer arguments after the scalars) and ``meta``
    (constexprs). :func:`key_pass_arguments` adds a call's tensors."""
    m = stats.query_padding_mask
    Tq, Tk = q.shape[2], k.shape[2]
    if m is not None and (m.dtype != torch.bool or tuple(m.shape) != (B, Tq)):
        raise ValueError(f"query_padding_mask must be bool [B, Tq] = {(B, Tq)}")
    dev, BH = q.device, B * H
    sq, q_per = split_counts(Tq, BH, dev, stats.num_splits)
    sk, k_per = split_counts(Tk, BH, dev, stats.num_splits)
    roles = BH * (sq + sk) if stats.programs is None else stats.programs
    if roles < 1:
        raise ValueError(f"a key pass with statistics needs stats roles, got {roles}")
    qpad = (0, 0) if m is None else m.view(torch.uint8).stride()
    return dict(
        roles=roles, buffers=((BH, sq + sk, 4, D), (BH, sq + sk), (4, B, H, 2, D)), acc=acc,
        ints=(BH, Tq, max(Tq, 1), max(Tk, 1), roles, sq, sk, q_per, k_per, *q.stride(), *qpad),
        meta=dict(FORM=FORMS[stats.form], **_reduction_meta(D, m, stats.running)),
    )  # fmt: skip


def key_pass_arguments(stats: KeyPassStats, plan: dict, q, part, cnt, mom) -> tuple:
    """The arguments after the key pass's own of a key pass that forms ``stats`` with its
    :func:`key_pass_plan`, the moments' scratch ``part``, ``cnt``, ``mom`` (tensors, or
    device addresses for a replayed launch)."""
    m = stats.query_padding_mask
    bufs, scalars = _running_args(stats.running, mom, plan["acc"])
    return (q, mom if m is None else m.view(torch.uint8), part, cnt, mom, *bufs, *scalars,
            *plan["ints"])  # fmt: skip


class ChunkStats(NamedTuple):
    """The running statistics of a causal training call that its forward's first launch
    (``rfattn.kernels.rf_chunk``'s walk over the key chunks) reduces and moves in its own
    launch: handed over in the form (``KernelForm.stats``), whose ``coeffs`` (and saderf's
    ``psi``) ``[B, H, ...]`` that launch writes.

    Attributes:
        form: "oprf" or "saderf".
        running: as :func:`stats_pass`'s (the buffers and momentum; required: a causal call's
            statistics are running ones).
        query_padding_mask: ``[B, T]`` bool, or None.
        programs: stats roles of the launch (default: one per work item).
    """

    form: str
    running: tuple
    query_padding_mask: torch.Tensor | None = None
    programs: int | None = None


def chunk_stats_arguments(stats: ChunkStats | None, q, k, B: int, H: int, G: int, D: int,
                          acc) -> tuple[int, tuple, dict]:  # fmt: skip
    """``(stats roles, the arguments after the walk's own, constexprs)`` of the causal forward's
    first launch (``rf_chunk._chunk_sums_kernel``) forming ``stats`` for q ``[B, H * G, T, D]``
    (the G query heads of each key/value head: its query rows) and k ``[B, H, T, D]``; without
    ``stats`` no role and placeholders (never read: ``STATS`` is off)."""
    if stats is None:
        return 0, (k,) * 10 + (1.0, 0.0, 1.0, 1.0, 1.0) + (0, 1, 1, 0, 1, 1, 1, 1) + (0,) * 6, \
            dict(STATS=False, HAS_QPAD=False, FORM=0, BB=1, RACC=tl.float32)  # fmt: skip
    if stats.form not in ("oprf", "saderf") or stats.running is None:
        raise ValueError(f"a causal walk forms oprf's or saderf's running statistics, got "
                         f"{stats.form!r} (running: {stats.running is not None})")  # fmt: skip
    m, T = stats.query_padding_mask, q.shape[2]
    if m is not None and (m.dtype != torch.bool or tuple(m.shape) != (B, T)):
        raise ValueError(f"query_padding_mask must be bool [B, T] = {(B, T)}")
    r = _reduction(q, k.shape[2], B, H, G, D, acc, m, stats.running, None)
    roles = B * H * (r.sq + r.sk) if stats.programs is None else stats.programs
    if roles < 1:
        raise ValueError(f"a walk with statistics needs stats roles, got {roles}")
    args = (q, r.qpad[0], r.part, r.cnt, r.mom, *r.running, *r.scalars,
            G * T, max(T, 1), max(k.shape[2], 1), roles, r.sq, r.sk, r.q_per, r.k_per,
            *q.stride(), *r.qpad[1:])  # fmt: skip
    meta = {n: r.meta[n] for n in ("HAS_QPAD", "BB", "RACC")}
    return roles, args, dict(STATS=True, FORM=FORMS[stats.form], **meta)

