"""The stats pass of the data-dependent features (oprf, saderf): per-(b, h) token moments of q and
k and the feature parameters formed from them, in ONE launch.

For one side (queries or keys) of one (b, h), over the valid tokens (inside T, not padded):

    n = #valid     sum_t x~_t     sum_t x~_t^2     sum_t |x~_t|     min_t x~_t          [D] each

with ``x~ = sqrt(scale) * x`` in the accumulation dtype (fp32; fp64 for fp64 inputs). Grid
(SQ + SK, B*H): programs ``0 .. SQ-1`` reduce contiguous ranges of the (b, h)'s query rows,
``SQ .. SQ+SK-1`` of its keys, and write their partials. Each then counts itself in with a
``tl.atomic_add`` on the (b, h)'s arrival counter; the last to arrive (it sees ``SQ + SK - 1``)
adds the partials in a fixed order (deterministic whichever program is last: the atomics only
elect it), divides by ``max(n, 1)``, writes the moments (``rfattn.stats.sequence_moments``: mean,
mean square, mean absolute value, minimum with 0 where no token is valid), forms the feature's
parameters from them (``FORM``) and sets the counter back to 0. The counters are zeroed once
when their buffer is made and left at 0 by every launch, so a call fills nothing.

``FORM`` 1 (oprf) and 2 (saderf) are the closed forms of ``rfattn.stats``
(:func:`~rfattn.stats.pair_sq_norm`, :func:`~rfattn.stats.oprf_A`,
:func:`~rfattn.stats.gerf_real_constants`, :func:`~rfattn.stats.saderf_psi`), written once more
here in Triton: per (b, h) the coefficients ``(A, B, log D)`` ``[3]`` and saderf's ``psi`` ``[D]``.

``RUNNING``: the running-statistics mode of a training call. The parameters come from the
running buffers as they are before this call (not from its moments), and the buffers take this
call's moments afterwards (``rfattn.stats.update_running``: pooled over batch and heads, the
first update copies, later ones mix with ``momentum``; ``num_batches_tracked`` counts up). Both
happen in the last program of the whole grid, elected by a second counter after the per-(b, h)
ones: the update needs every (b, h)'s moments.

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

__all__ = ["StatsPass", "stats_pass", "sequence_moments_fused"]

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
def _store_params(coef_ptr, psi_ptr, i_row, a, b, log_d, b_psi, D, o_d, m_d,
                  FORM: tl.constexpr):  # fmt: skip
    tl.store(coef_ptr + i_row * 3, a)
    tl.store(coef_ptr + i_row * 3 + 1, b)
    tl.store(coef_ptr + i_row * 3 + 2, log_d)
    if FORM == 2:
        tl.store(psi_ptr + i_row * D + o_d, b_psi, mask=m_d)


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
def _running_update(mom_ptr, run_mean, run_sq, run_abs, run_min, nbt_ptr, coef_ptr, psi_ptr,
                    BH, D, keep, momentum, tiny, psi_lo, psi_hi, o_d, m_d, BD: tl.constexpr,
                    BB: tl.constexpr, FORM: tl.constexpr, ACC: tl.constexpr,
                    RACC: tl.constexpr):  # fmt: skip
    """The running mode's parameters from the buffers ``[2, D]`` as they are, then the buffers'
    update with the moments of every (b, h) pooled."""
    if FORM > 0:  # the parameters of this call: from the buffers before the update
        b_mq = tl.load(run_mean + o_d, mask=m_d, other=0.0).to(ACC)
        b_mk = tl.load(run_mean + D + o_d, mask=m_d, other=0.0).to(ACC)
        b_sq_q = tl.load(run_sq + o_d, mask=m_d, other=0.0).to(ACC)
        b_sq_k = tl.load(run_sq + D + o_d, mask=m_d, other=0.0).to(ACC)
        a, b, log_d, b_psi = _gerf_params(b_mq, b_sq_q, b_mk, b_sq_k, m_d, D, tiny, psi_lo,
                                          psi_hi, FORM)  # fmt: skip
        _store_params(coef_ptr, psi_ptr, 0, a, b, log_d, b_psi, D, o_d, m_d, FORM)
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
    """Partial moments of one split of one side; the last program of a (b, h) its moments and
    parameters; with RUNNING, the last of all the running update."""
    i_s, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # fp64 arguments as ACC (tl.full: the interpreter passes them as Python floats)
    b_sc = tl.full([], sc, ACC)
    tiny = tl.full([], tiny, ACC)
    psi_lo, psi_hi = tl.full([], psi_lo, ACC), tl.full([], psi_hi, ACC)
    NS = SQ + SK
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
    if last_to_arrive(arrive_ptr + i_bh, NS):  # the (b, h)'s last program
        b_mq, b_sq_q, b_aq, b_minq = _side_moments(part_ptr, cnt_ptr, i_bh * NS, SQ, D, o_d, m_d,
                                                 BD, ACC)  # fmt: skip
        b_mk, b_sq_k, b_ak, b_mink = _side_moments(part_ptr, cnt_ptr, i_bh * NS + SQ, SK, D, o_d,
                                                 m_d, BD, ACC)  # fmt: skip
        field = tl.num_programs(1).to(tl.int64) * 2 * D  # mom [4, BH, 2, D]
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
            _store_params(coef_ptr, psi_ptr, i_bh, a, b, log_d, b_psi, D, o_d, m_d, FORM)
        if RUNNING:
            BH = tl.num_programs(1)
            if last_to_arrive(arrive_ptr + BH, BH):  # the grid's last (b, h)
                _running_update(mom_ptr, run_mean, run_sq, run_abs, run_min, nbt_ptr, coef_ptr,
                                psi_ptr, BH, D, keep, momentum, tiny, psi_lo, psi_hi, o_d, m_d,
                                BD, BB, FORM, ACC, RACC)  # fmt: skip


class StatsPass(NamedTuple):
    """What :func:`stats_pass` returns.

    Attributes:
        moments: ``(mean, sq, abs, min)``, each ``[B, H, 2, D]`` (row 0 queries, row 1 keys):
            the fields of ``rfattn.stats.Moments``.
        coeffs: ``(A, B, log D)`` ``[B, H, 3]`` (``[1, 1, 3]`` in running mode), or None.
        psi: saderf's ``[B, H, D]`` (``[1, 1, D]`` in running mode), or None.
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
    dev = q.device
    sq_, q_per = split_counts(G * Tq, B * H, dev, num_splits)
    sk_, k_per = split_counts(Tk, B * H, dev, num_splits)
    part = torch.empty(B * H, sq_ + sk_, 4, D, device=dev, dtype=acc)
    cnt = torch.empty(B * H, sq_ + sk_, device=dev, dtype=acc)
    mom = torch.empty(4, B, H, 2, D, device=dev, dtype=acc)
    rows = (1, 1) if running is not None else (B, H)
    coeffs = torch.empty(*rows, 3, device=dev, dtype=acc) if form else None
    psi = torch.empty(*rows, D, device=dev, dtype=acc) if form == "saderf" else None
    arrive = arrival_counters(dev, B * H + 1)
    if running is not None:
        *bufs, nbt, momentum = running
        racc = tl.float64 if bufs[0].dtype == torch.float64 else tl.float32
    else:
        bufs, nbt, momentum, racc = (mom,) * 4, arrive, 0.0, tl.float32  # never read
    pads = []
    for m in (query_padding_mask, key_padding_mask):
        m = None if m is None else m.view(torch.uint8)
        pads.append((mom, 0, 0) if m is None else (m, m.stride(0), m.stride(1)))
    lo, hi = PSI_RATIO_RANGE
    launch(_stats_kernel, (sq_ + sk_, B * H),
        q, k, pads[0][0], pads[1][0], part, cnt, arrive, mom,
        mom if coeffs is None else coeffs, mom if psi is None else psi, *bufs, nbt,
        float(scale) ** 0.5, 1.0 - momentum, momentum, torch.finfo(acc).tiny, lo, hi,
        G * Tq, max(Tq, 1), G, Tk, max(Tk, 1), H, sq_, sk_, q_per, k_per, *q.stride(), *k.stride(),
        *pads[0][1:], *pads[1][1:],
        D=D, BD=next_pow2(D), BB=2 if INTERPRET else max(1, 2048 // next_pow2(D)),  # 2: loops
        HAS_QPAD=query_padding_mask is not None,
        HAS_KPAD=key_padding_mask is not None, FORM=FORMS[form], RUNNING=running is not None,
        ACC=tl.float64 if acc == torch.float64 else tl.float32, RACC=racc,
    )  # fmt: skip
    return StatsPass(tuple(mom.unbind(0)), coeffs, psi)


def sequence_moments_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused equivalent of ``rfattn.stats.sequence_moments(sqrt(scale) q, sqrt(scale) k,
    key_padding_mask, query_padding_mask)`` on raw q ``[B, H, Tq, D]``, k ``[B, H, Tk, D]``
    (:func:`stats_pass` without a form).

    Returns:
        ``(mean, sq, abs, min)``, each ``[B, H, 2, D]`` (row 0 queries, row 1 keys), the fields
        of ``rfattn.stats.Moments``.
    """
    return stats_pass(q, k, scale, key_padding_mask, query_padding_mask).moments
