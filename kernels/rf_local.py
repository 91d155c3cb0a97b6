"""The hybrid's exact part (``rfattn.hybrid``): softmax terms over the sinks and a sliding window,
per causal row, forward and backward (the chunk kernels add them to the features' terms).

A call's keys come after its state (``rfattn.hybrid.extend``): ``L = P + T`` extended positions,
the state's last P (= the window) first, then the call's T; row ``t`` sits at extended position
``e = P + t`` and reads, exactly,

* the window keys at ``e - window < j <= e`` whose kind is a window key (``kinds``: 0 nothing,
  1 a window key, 2 a sink; a sink inside the window counts once, as a sink),
* the sink slots (``[2 S]``: the state's, then the call's first new sinks; ``[S]``, the call's
  own, for a first call that keeps no state) that are present and sit at or before ``e`` (the
  state's at position -1).

Forward, ``_local_rows_kernel``, grid (row blocks, B * H): each block of BT rows of a query head
walks the key tiles of its window span (BT + window - 1 positions) and one tile of sink slots with
an online softmax, and stores ``num`` ``[E]``, ``den`` at the row's largest exact logit ``off``
(-inf, 0 and 0 for a row with no exact key): the inputs of the chunk kernels' ``exact`` terms.
A non-finite value is 0 in the products, and the (row, column) entries of ``num`` that read one
are NaN (a 0/1 product of the selection with the bad entries), so NaN stays in the rows that see
it (a new sink's from its position on; a state's sink is seen by every row).

Backward (the cotangents ``dnum``, ``dden``; ``off`` held constant, as the torch path detaches
it), with ``p_ij = exp(s q_i . k_j - off_i)`` and ``dl_ij = p_ij (dnum_i . v_j + dden_i)``:

* ``_local_rows_kernel`` with DQ, the forward's grid: ``dq_i = s sum_j dl_ij k_j``;
* ``_local_dkv_kernel``, grid (key blocks, B * Hk): the rows that read a block of window keys
  (``j <= e < j + window``), every query head of the key/value head: ``dk_j = s sum_i dl_ij
  q_i``, ``dv_j = sum_i p_ij dnum_i`` (0 for other kinds);
* ``_local_dsink_kernel``, grid (B * Hk): the sink slots, read by every later row: the same
  sums over all rows.

The decode step (``rf_recurrent``'s HYBRID: one token after a state) joins its rows' exact terms
to the features' with ``decode_exact`` (the same tile helpers: the window slots, the sink slots
and the token itself) and moves the state's window and sinks one token on with
``decode_shift``.

Products under the kernels' precision policy (``common.product``): fp16/bf16 inputs as one half
product each, the logits of the inputs as they are (exact products, fp32 accumulation) times the
scale, as flash-attention does, but ``dnum . v`` of the backward as two (its fp32 cotangents
split: dq 1.57x -> 1.37x the torch path's bf16 error on the test's inputs); fp32/fp64 exact.
Reference: ``rfattn.hybrid.exact_terms`` (torch, blocked), which tests hold these to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, NEG, next_pow2, precision_policy, product

__all__ = ["local_fwd", "local_bwd", "decode_exact", "decode_shift"]


@triton.jit
def _selection(b_kj, o_j, m_j, e, m_t, WIN, IS_SINK: tl.constexpr):
    """Which of keys ``o_j`` [BK] rows at extended positions ``e`` [BT] read exactly: window keys
    (``b_kj`` their kinds) in ``e - WIN < j <= e``, or, IS_SINK, present sink slots (``b_kj``
    their positions, ``m_j`` their presence) at or before ``e``."""
    if IS_SINK:
        return (b_kj[None, :] <= e[:, None]) & m_j[None, :] & m_t[:, None]
    return (o_j[None, :] <= e[:, None]) & (o_j[None, :] > e[:, None] - WIN) & \
        (b_kj == 1)[None, :] & m_t[:, None]  # fmt: skip


@triton.jit
def _scores(b_q, k_base, kind_ptr, o_j, m_j, o_d, m_d, e, m_t, stride_kl, stride_kd, stride_nl,
            WIN, scale, IS_SINK: tl.constexpr, PRECISION: tl.constexpr,
            ACC: tl.constexpr):  # fmt: skip
    """``(logits [BT, BK] at NEG off the selection, selection, keys [BK, BD], keys read)`` of
    rows at extended positions ``e`` against keys ``o_j``: window keys (``kind_ptr`` their
    kinds) or, IS_SINK, sink slots (``kind_ptr`` their positions, ``m_j`` their presence)."""
    b_kj = tl.load(kind_ptr + o_j * stride_nl, mask=m_j, other=0)
    sel = _selection(b_kj, o_j, m_j, e, m_t, WIN, IS_SINK)
    m_read = m_j if IS_SINK else m_j & (b_kj != 0)  # positions of nothing hold junk: never read
    b_k = tl.load(k_base + o_j[:, None] * stride_kl + o_d[None, :] * stride_kd,
                  mask=m_read[:, None] & m_d[None, :], other=0.0)  # fmt: skip
    b_s = product(b_q, tl.trans(b_k), PRECISION, ACC) * tl.full([], scale, ACC)  # (an fp64 arg)
    return tl.where(sel, b_s, NEG), sel, b_k, m_read


@triton.jit
def _values(v_base, o_j, m_read, o_e, m_e, stride_vl, stride_ve, ZERO_BAD):
    """``(values [BK, BE] with non-finite entries 0 where ZERO_BAD [BK], their bad entries)``."""
    b_v = tl.load(v_base + o_j[:, None] * stride_vl + o_e[None, :] * stride_ve,
                  mask=m_read[:, None] & m_e[None, :], other=0.0)  # fmt: skip
    b_w = b_v.to(tl.float32) if b_v.dtype.primitive_bitwidth < 32 else b_v  # (the interpreter
    # keeps bf16 as bits)
    b_bad = ((b_w != b_w) | (tl.abs(b_w) == float("inf"))) & ZERO_BAD[:, None]
    return tl.where(b_bad, 0.0, b_w).to(b_v.dtype), b_bad


@triton.jit
def _sink_slots(spos_ptr, spres_ptr, NSK, stride_ps, BS: tl.constexpr):
    """``(slots, present, new)`` [BS] of a (b)'s sink slots (``new``: the call's own, whose
    non-finite values count from their position)."""
    o_j = tl.arange(0, BS)
    m_j = o_j < NSK
    m_j &= tl.load(spres_ptr + o_j * stride_ps, mask=m_j, other=0) != 0
    return o_j, m_j, tl.load(spos_ptr + o_j * stride_ps, mask=m_j, other=-1) >= 0


@triton.jit
def _row_grads(b_s, sel, b_v, b_dn, b_dd, b_off, PRECISION: tl.constexpr, ACC: tl.constexpr):
    """``(p, dl)`` [BT, BK] of rows whose cotangents are ``b_dn`` [BT, BE], ``b_dd`` [BT] at
    offsets ``b_off``."""
    b_p = tl.where(sel, tl.exp(b_s - b_off[:, None]), 0.0)
    # the cotangents are fp32 (not an input's rows): split in two half products (SPLIT_A)
    b_dp = product(b_dn, tl.trans(b_v), PRECISION, ACC, True) + b_dd[:, None]
    return b_p, b_p * b_dp


@triton.jit
def _visit(b_s, sel, b_k, b_v, b_vb, b_m, b_l, b_acc, b_bad, b_dn, b_dd, b_off,
           DQ: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """One tile of keys for a block of rows: the forward's online softmax (``b_m``, ``b_l``,
    ``b_acc``, ``b_bad``) or, DQ, dq's sum (in ``b_acc``)."""
    if DQ:
        b_p, b_dl = _row_grads(b_s, sel, b_v, b_dn, b_dd, b_off, PRECISION, ACC)
        b_acc += product(b_dl, b_k, PRECISION, ACC)
    else:
        b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_p = tl.where(sel, tl.exp(b_s - b_mn[:, None]), 0.0)
        b_al = tl.exp(b_m - b_mn)
        b_acc = b_acc * b_al[:, None] + product(b_p, b_v, PRECISION, ACC)
        b_l = b_l * b_al + tl.sum(b_p, axis=1)
        b_m = b_mn
        b_bad += tl.dot(sel.to(ACC), b_vb.to(ACC), input_precision="ieee", out_dtype=ACC)
    return b_m, b_l, b_acc, b_bad


@triton.jit
def _local_rows_kernel(
    q_ptr, k_ptr, v_ptr, kind_ptr, sk_ptr, sv_ptr, spos_ptr, spres_ptr, a_ptr, b_ptr, off_ptr,
    dq_ptr, scale: tl.float64,
    T, L, H, G, NSK, WIN,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_ve,
    stride_nb, stride_nl,
    stride_sb, stride_sh, stride_ss, stride_sd,
    stride_ub, stride_uh, stride_us, stride_ue,
    stride_pb, stride_ps,
    D: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BS: tl.constexpr, HAS_WIN: tl.constexpr, HAS_SINK: tl.constexpr,
    DQ: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """A block of BT rows of query head (b, h) over its window's key tiles and its sink slots:
    the forward (``a``, ``b``, ``off``: num, den, off) or, DQ, dq (``a``, ``b``: the cotangents
    of num and den, ``off`` the forward's) (module docstring)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_hq = i_bh // H, i_bh % H
    i_hk = i_hq // G
    P = L - T
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    e = o_t + P
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    q_base = q_ptr + i_b * stride_qb + i_hq * stride_qh
    b_q = tl.load(q_base + o_t[:, None] * stride_qt + o_d[None, :] * stride_qd,
                  mask=m_t[:, None] & m_d[None, :], other=0.0)  # fmt: skip
    i_row = i_bh * T + o_t
    b_m = tl.full([BT], NEG, dtype=ACC)
    b_l = tl.zeros([BT], dtype=ACC)
    b_bad = tl.zeros([BT, BE], dtype=ACC)  # > 0: the row read a non-finite value there
    if DQ:
        b_dn, b_dd, b_off = _load_rows(a_ptr, b_ptr, off_ptr, i_row, m_t, o_e, m_e, E)
        b_acc = tl.zeros([BT, BD], dtype=ACC)
    else:
        b_dn, b_dd, b_off = b_bad, b_l, b_l  # (unread)
        b_acc = tl.zeros([BT, BE], dtype=ACC)
    if HAS_WIN:
        lo = tl.maximum(i_t * BT + P - WIN + 1, 0)
        hi = tl.minimum(i_t * BT + BT + P, L)
        k_base = k_ptr + i_b * stride_kb + i_hk * stride_kh
        v_base = v_ptr + i_b * stride_vb + i_hk * stride_vh
        for j0 in range(lo, hi, BK):
            o_j = j0 + tl.arange(0, BK)
            b_s, sel, b_k, m_read = _scores(b_q, k_base, kind_ptr + i_b * stride_nb, o_j,
                                            o_j < hi, o_d, m_d, e, m_t, stride_kl, stride_kd,
                                            stride_nl, WIN, scale, False, PRECISION,
                                            ACC)  # fmt: skip
            b_v, b_vb = _values(v_base, o_j, m_read, o_e, m_e, stride_vl, stride_ve, m_read)
            b_m, b_l, b_acc, b_bad = _visit(b_s, sel, b_k, b_v, b_vb, b_m, b_l, b_acc, b_bad,
                                            b_dn, b_dd, b_off, DQ, PRECISION, ACC)  # fmt: skip
    if HAS_SINK:
        o_j, m_j, b_new = _sink_slots(spos_ptr + i_b * stride_pb, spres_ptr + i_b * stride_pb,
                                      NSK, stride_ps, BS)  # fmt: skip
        b_s, sel, b_k, m_read = _scores(b_q, sk_ptr + i_b * stride_sb + i_hk * stride_sh,
                                        spos_ptr + i_b * stride_pb, o_j, m_j, o_d, m_d, e, m_t,
                                        stride_ss, stride_sd, stride_ps, WIN, scale, True,
                                        PRECISION, ACC)  # fmt: skip
        b_v, b_vb = _values(sv_ptr + i_b * stride_ub + i_hk * stride_uh, o_j, m_read, o_e, m_e,
                            stride_us, stride_ue, b_new)  # fmt: skip
        b_m, b_l, b_acc, b_bad = _visit(b_s, sel, b_k, b_v, b_vb, b_m, b_l, b_acc, b_bad, b_dn,
                                        b_dd, b_off, DQ, PRECISION, ACC)  # fmt: skip
    if DQ:
        tl.store(dq_ptr + i_row[:, None] * D + o_d[None, :], b_acc * scale,
                 mask=m_t[:, None] & m_d[None, :])  # fmt: skip
    else:
        b_acc = tl.where(b_bad > 0, float("nan"), b_acc)
        tl.store(a_ptr + i_row[:, None] * E + o_e[None, :], b_acc,
                 mask=m_t[:, None] & m_e[None, :])  # fmt: skip
        tl.store(b_ptr + i_row, b_l, mask=m_t)
        tl.store(off_ptr + i_row, tl.where(b_m > 0.5 * NEG, b_m, float("-inf")), mask=m_t)


@triton.jit
def _load_rows(num_ptr, den_ptr, off_ptr, i_row, m_t, o_e, m_e, E: tl.constexpr):
    """The cotangents ``dnum`` [BT, BE], ``dden`` [BT] and the offsets [BT] (NEG for none) of a
    block of rows."""
    b_dn = tl.load(num_ptr + i_row[:, None] * E + o_e[None, :], mask=m_t[:, None] & m_e[None, :],
                   other=0.0)  # fmt: skip
    b_dd = tl.load(den_ptr + i_row, mask=m_t, other=0.0)
    b_off = tl.load(off_ptr + i_row, mask=m_t, other=float("-inf"))
    return b_dn, b_dd, tl.where(b_off == float("-inf"), NEG, b_off)


@triton.jit
def _key_grads(q_ptr, dn_ptr, dd_ptr, off_ptr, b_k, b_v, kind_ptr, o_j, m_j, i_b, i_hk, t0, t1,
               T, H, G, P, WIN, scale, stride_qb, stride_qh, stride_qt, stride_qd, stride_nl,
               o_d, m_d, o_e, m_e, b_dk, b_dv, E: tl.constexpr, BT: tl.constexpr,
               IS_SINK: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """``(dk, dv)`` [BK, BD], [BK, BE] of keys ``o_j`` plus the rows ``t0 <= t < t1`` of every
    query head of key/value head (b, hk) that read them."""
    b_kj = tl.load(kind_ptr + o_j * stride_nl, mask=m_j, other=0)  # kinds, or sink positions
    for g in range(0, G):
        i_hq = i_hk * G + g
        q_base = q_ptr + i_b * stride_qb + i_hq * stride_qh
        for r0 in range(t0, t1, BT):
            o_t = r0 + tl.arange(0, BT)
            m_t = o_t < t1
            e = o_t + P
            b_q = tl.load(q_base + o_t[:, None] * stride_qt + o_d[None, :] * stride_qd,
                          mask=m_t[:, None] & m_d[None, :], other=0.0)  # fmt: skip
            b_s = product(b_q, tl.trans(b_k), PRECISION, ACC) * tl.full([], scale, ACC)
            sel = _selection(b_kj, o_j, m_j, e, m_t, WIN, IS_SINK)
            i_row = (i_b * H + i_hq) * T + o_t
            b_dn, b_dd, b_off = _load_rows(dn_ptr, dd_ptr, off_ptr, i_row, m_t, o_e, m_e, E)
            b_p, b_dl = _row_grads(b_s, sel, b_v, b_dn, b_dd, b_off, PRECISION, ACC)
            b_dk += product(tl.trans(b_dl), b_q, PRECISION, ACC)
            b_dv += product(tl.trans(b_p), b_dn, PRECISION, ACC)
    return b_dk, b_dv


@triton.jit
def _local_dkv_kernel(
    q_ptr, k_ptr, v_ptr, kind_ptr, dn_ptr, dd_ptr, off_ptr, dk_ptr, dv_ptr, scale: tl.float64,
    T, L, H, G, WIN,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kl, stride_kd,
    stride_vb, stride_vh, stride_vl, stride_ve,
    stride_nb, stride_nl,
    D: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """dk, dv of a block of BK window keys of key/value head (b, hk) (module docstring)."""
    i_j, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    Hk = H // G
    i_b, i_hk = i_bh // Hk, i_bh % Hk
    P = L - T
    o_j = i_j * BK + tl.arange(0, BK)
    m_j = o_j < L
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    b_kind = tl.load(kind_ptr + i_b * stride_nb + o_j * stride_nl, mask=m_j, other=0)
    m_read = m_j & (b_kind != 0)
    k_base = k_ptr + i_b * stride_kb + i_hk * stride_kh
    b_k = tl.load(k_base + o_j[:, None] * stride_kl + o_d[None, :] * stride_kd,
                  mask=m_read[:, None] & m_d[None, :], other=0.0)  # fmt: skip
    b_v, _ = _values(v_ptr + i_b * stride_vb + i_hk * stride_vh, o_j, m_read, o_e, m_e,
                     stride_vl, stride_ve, m_read)  # fmt: skip
    # the rows that read them: e = P + t with j <= e < j + WIN
    t0 = tl.maximum(i_j * BK - P, 0)
    t1 = tl.minimum(i_j * BK + BK - 1 + WIN - P, T)
    b_dk = tl.zeros([BK, BD], dtype=ACC)
    b_dv = tl.zeros([BK, BE], dtype=ACC)
    b_dk, b_dv = _key_grads(q_ptr, dn_ptr, dd_ptr, off_ptr, b_k, b_v, kind_ptr + i_b * stride_nb,
                            o_j, m_j, i_b, i_hk, t0, t1, T, H, G, P, WIN, scale, stride_qb,
                            stride_qh, stride_qt, stride_qd, stride_nl, o_d, m_d, o_e, m_e, b_dk,
                            b_dv, E, BT, False, PRECISION, ACC)  # fmt: skip
    i_key = i_bh * L + o_j
    m_w = m_j & (b_kind == 1)
    tl.store(dk_ptr + i_key[:, None] * D + o_d[None, :], tl.where(m_w[:, None], b_dk * scale, 0.0),
             mask=m_j[:, None] & m_d[None, :])  # fmt: skip
    tl.store(dv_ptr + i_key[:, None] * E + o_e[None, :], tl.where(m_w[:, None], b_dv, 0.0),
             mask=m_j[:, None] & m_e[None, :])  # fmt: skip


@triton.jit
def _local_dsink_kernel(
    q_ptr, sk_ptr, sv_ptr, spos_ptr, spres_ptr, dn_ptr, dd_ptr, off_ptr, dsk_ptr, dsv_ptr,
    scale: tl.float64,
    T, L, H, G, NSK,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_sb, stride_sh, stride_ss, stride_sd,
    stride_ub, stride_uh, stride_us, stride_ue,
    stride_pb, stride_ps,
    D: tl.constexpr, E: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    BS: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """dk, dv of the sink slots of key/value head (b, hk), read by every later row."""
    i_bh = tl.program_id(0).to(tl.int64)
    Hk = H // G
    i_b, i_hk = i_bh // Hk, i_bh % Hk
    o_j, m_j, b_new = _sink_slots(spos_ptr + i_b * stride_pb, spres_ptr + i_b * stride_pb, NSK,
                                  stride_ps, BS)  # fmt: skip
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    sk_base = sk_ptr + i_b * stride_sb + i_hk * stride_sh
    b_k = tl.load(sk_base + o_j[:, None] * stride_ss + o_d[None, :] * stride_sd,
                  mask=m_j[:, None] & m_d[None, :], other=0.0)  # fmt: skip
    b_v, _ = _values(sv_ptr + i_b * stride_ub + i_hk * stride_uh, o_j, m_j, o_e, m_e, stride_us,
                     stride_ue, b_new)  # fmt: skip
    b_dk = tl.zeros([BS, BD], dtype=ACC)
    b_dv = tl.zeros([BS, BE], dtype=ACC)
    b_dk, b_dv = _key_grads(q_ptr, dn_ptr, dd_ptr, off_ptr, b_k, b_v, spos_ptr + i_b * stride_pb,
                            o_j, m_j, i_b, i_hk, 0, T, T, H, G, L - T, 0, scale, stride_qb,
                            stride_qh, stride_qt, stride_qd, stride_ps, o_d, m_d, o_e, m_e, b_dk,
                            b_dv, E, BT, True, PRECISION, ACC)  # fmt: skip
    i_key = i_bh * NSK + o_j
    tl.store(dsk_ptr + i_key[:, None] * D + o_d[None, :], b_dk * scale,
             mask=(o_j < NSK)[:, None] & m_d[None, :])  # fmt: skip
    tl.store(dsv_ptr + i_key[:, None] * E + o_e[None, :], b_dv,
             mask=(o_j < NSK)[:, None] & m_e[None, :])  # fmt: skip


@triton.jit
def decode_exact(b_q, b_num, b_den, b_off, k_tok, v_tok, stride_kd, stride_ve, new_exact, wk_base,
                 wv_base, kind_base, sk_base, sv_base, seen, WIN, scale, o_r, m_r, o_d, m_d, o_e,
                 m_e, D: tl.constexpr, E: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
                 HAS_WIN: tl.constexpr, HAS_SINK: tl.constexpr, PRECISION: tl.constexpr,
                 ACC: tl.constexpr):  # fmt: skip
    """The exact terms of the hybrid's decode step (``rf_recurrent``, one token) joined to the
    features' ``b_num`` [GP, BE], ``b_den`` [GP] at the rows' offsets ``b_off`` [GP]: rows
    ``o_r`` (``m_r``) are the token's query heads ``b_q`` (as given) at extended position WIN,
    which read exactly the window slots ``1 <= j < WIN`` of a window key's kind (the state's
    keys ``[WIN, D]`` at ``wk_base``, kinds at ``kind_base``), the state's ``seen`` sink slots
    and the token itself where ``new_exact`` ([GP], all alike: it is a sink, or a window key
    when there is a window). ``(num, den)`` at one offset per row; NaN in the columns of a row
    that read a non-finite value."""
    b_m, b_acc, b_l = b_off, b_num, b_den
    b_bad = tl.zeros(b_num.shape, dtype=ACC)
    e = WIN + o_r * 0  # every row at the token's extended position
    if HAS_WIN:
        for j0 in range(1, WIN, BK):
            o_j = j0 + tl.arange(0, BK)
            b_s, sel, b_k, m_read = _scores(b_q, wk_base, kind_base, o_j, o_j < WIN, o_d, m_d, e,
                                            m_r, D, 1, 1, WIN, scale, False, PRECISION,
                                            ACC)  # fmt: skip
            b_v, b_vb = _values(wv_base, o_j, m_read, o_e, m_e, E, 1, m_read)
            b_m, b_l, b_acc, b_bad = _visit(b_s, sel, b_k, b_v, b_vb, b_m, b_l, b_acc, b_bad,
                                            b_bad, b_l, b_l, False, PRECISION, ACC)  # fmt: skip
    if HAS_SINK:
        o_j = tl.arange(0, BS)
        m_j = o_j < seen
        b_k = tl.load(sk_base + o_j[:, None] * D + o_d[None, :], mask=m_j[:, None] & m_d[None, :],
                      other=0.0)  # fmt: skip
        sel = m_r[:, None] & m_j[None, :]
        b_s = product(b_q, tl.trans(b_k), PRECISION, ACC) * tl.full([], scale, ACC)
        b_v, b_vb = _values(sv_base, o_j, m_j, o_e, m_e, E, 1, m_j)
        b_m, b_l, b_acc, b_bad = _visit(tl.where(sel, b_s, NEG), sel, b_k, b_v, b_vb, b_m, b_l,
                                        b_acc, b_bad, b_bad, b_l, b_l, False, PRECISION,
                                        ACC)  # fmt: skip
    # the token itself: row 0 of a [GP, .] tile
    m_n = (o_r == 0) & new_exact
    b_k = tl.load(k_tok + o_r[:, None] * 0 + o_d[None, :] * stride_kd,
                  mask=m_n[:, None] & m_d[None, :], other=0.0)  # fmt: skip
    sel = m_r[:, None] & m_n[None, :]
    b_s = product(b_q, tl.trans(b_k), PRECISION, ACC) * tl.full([], scale, ACC)
    b_v, b_vb = _values(v_tok, o_r * 0, m_n, o_e, m_e, 0, stride_ve, m_n)
    b_m, b_l, b_acc, b_bad = _visit(tl.where(sel, b_s, NEG), sel, b_k, b_v, b_vb, b_m, b_l, b_acc,
                                    b_bad, b_bad, b_l, b_l, False, PRECISION, ACC)  # fmt: skip
    return tl.where(b_bad > 0, float("nan"), b_acc), b_l


@triton.jit
def decode_shift(wk_base, wv_base, kind_base, nwk_base, nwv_base, nkind_base, sk_base, sv_base,
                 nsk_base, nsv_base, k_tok, v_tok, stride_kd, stride_ve, new_kind, seen, i_h,
                 WIN, NSK, o_d, m_d, o_e, m_e, D: tl.constexpr, E: tl.constexpr,
                 BK: tl.constexpr, BS: tl.constexpr, HAS_WIN: tl.constexpr,
                 HAS_SINK: tl.constexpr):  # fmt: skip
    """The hybrid state after a decode step's token (``new_kind`` its kind, scalar): the window
    slots one on (slot j takes slot j + 1, the last the token, as given), the token in sink
    slot ``seen`` if it is a sink; the kinds (per batch row: written by the program of the
    first key/value head, ``i_h`` 0). (Scalars enter masks as vectors: the interpreter makes a
    scalar bool and'ed with a vector an int32 mask.)"""
    b_kn = tl.load(k_tok + o_d * stride_kd, mask=m_d, other=0.0)  # the token, as given
    b_vn = tl.load(v_tok + o_e * stride_ve, mask=m_e, other=0.0)
    if HAS_WIN:
        for j0 in range(0, WIN, BK):
            o_j = j0 + tl.arange(0, BK)
            m_j = o_j < WIN
            src = o_j + 1
            m_old, last = src < WIN, src == WIN
            b_k = tl.load(wk_base + src[:, None] * D + o_d[None, :],
                          mask=m_old[:, None] & m_d[None, :], other=0.0)  # fmt: skip
            b_v = tl.load(wv_base + src[:, None] * E + o_e[None, :],
                          mask=m_old[:, None] & m_e[None, :], other=0.0)  # fmt: skip
            tl.store(nwk_base + o_j[:, None] * D + o_d[None, :],
                     tl.where(last[:, None], b_kn[None, :], b_k), mask=m_j[:, None] & m_d[None, :])
            tl.store(nwv_base + o_j[:, None] * E + o_e[None, :],
                     tl.where(last[:, None], b_vn[None, :], b_v), mask=m_j[:, None] & m_e[None, :])
            b_n = tl.load(kind_base + src, mask=m_old, other=0)
            tl.store(nkind_base + o_j, tl.where(last, new_kind, b_n).to(tl.int8),
                     mask=m_j & (o_j * 0 + i_h == 0))  # fmt: skip
    if HAS_SINK:
        o_s = tl.arange(0, BS)
        m_s = o_s < NSK
        put = (o_s == seen) & (o_s * 0 + new_kind == 2)
        b_k = tl.load(sk_base + o_s[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                      other=0.0)  # fmt: skip
        b_v = tl.load(sv_base + o_s[:, None] * E + o_e[None, :], mask=m_s[:, None] & m_e[None, :],
                      other=0.0)  # fmt: skip
        tl.store(nsk_base + o_s[:, None] * D + o_d[None, :],
                 tl.where(put[:, None], b_kn[None, :], b_k), mask=m_s[:, None] & m_d[None, :])
        tl.store(nsv_base + o_s[:, None] * E + o_e[None, :],
                 tl.where(put[:, None], b_vn[None, :], b_v), mask=m_s[:, None] & m_e[None, :])


def _setup(q, keys, values, sink_keys, sink_values, window: int):
    B, H, T, D = q.shape
    Hk, L, E = keys.shape[1], keys.shape[2], values.shape[-1]
    NSK = sink_keys.shape[2]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    tiles = 16 if INTERPRET else 64
    meta = dict(D=D, E=E, BD=max(next_pow2(D), 16), BE=max(next_pow2(E), 16), BT=tiles,
                PRECISION=precision_policy(q.dtype, None), ACC=tl.float64 if acc == torch.float64
                else tl.float32)  # fmt: skip
    return B, H, T, D, Hk, L, E, NSK, acc, meta


def _strides(q, keys, values, kinds, sink_keys, sink_values, sink_pos):
    return (*q.stride(), *keys.stride(), *values.stride(), *kinds.stride(), *sink_keys.stride(),
            *sink_values.stride(), *sink_pos.stride())  # fmt: skip


def local_fwd(q, keys, values, kinds, sink_keys, sink_values, sink_pos, sink_present,
              window: int, scale: float):  # fmt: skip
    """``(num [B, H, T, E], den [B, H, T], off [B, H, T])`` in the accumulation dtype: each
    causal row's exact terms (module docstring) of ``q`` ``[B, H, T, D]`` against the extended
    ``keys`` ``[B, Hk, L, D]``, ``values`` (``kinds`` ``[B, L]`` int8) and the sink slots
    ``sink_keys`` ``[B, Hk, 2S, D]``, ``sink_values``, ``sink_pos`` ``[B, 2S]`` int64,
    ``sink_present`` ``[B, 2S]`` int8 (both contiguous: they share strides). One dtype for q,
    keys, values and the sinks'."""
    B, H, T, D, Hk, L, E, NSK, acc, meta = _setup(q, keys, values, sink_keys, sink_values, window)
    num = torch.empty(B, H, T, E, device=q.device, dtype=acc)
    den = torch.empty(B, H, T, device=q.device, dtype=acc)
    off = torch.empty(B, H, T, device=q.device, dtype=acc)
    if num.numel() == 0 or den.numel() == 0:
        return num.zero_(), den.zero_(), off.fill_(float("-inf"))
    grid = (triton.cdiv(T, meta["BT"]), B * H)
    _local_rows_kernel[grid](
        q, keys, values, kinds, sink_keys, sink_values, sink_pos, sink_present, num, den, off,
        num, scale, T, L, H, H // Hk, NSK, window,
        *_strides(q, keys, values, kinds, sink_keys, sink_values, sink_pos), BK=meta["BT"],
        BS=max(next_pow2(NSK), 16), HAS_WIN=window > 0, HAS_SINK=NSK > 0, DQ=False, **meta,
    )  # fmt: skip
    return num, den, off


def local_bwd(dnum, dden, off, q, keys, values, kinds, sink_keys, sink_values, sink_pos,
              sink_present, window: int, scale: float):  # fmt: skip
    """``(dq, dkeys, dvalues, dsink_keys, dsink_values)`` of :func:`local_fwd`'s ``num`` and
    ``den`` (cotangents ``dnum``, ``dden`` contiguous, ``off`` the forward's, held constant), in
    the accumulation dtype; 0 for keys of other kinds and absent sink slots."""
    B, H, T, D, Hk, L, E, NSK, acc, meta = _setup(q, keys, values, sink_keys, sink_values, window)
    dev = q.device
    if B * H * T == 0:
        return (torch.zeros(B, H, T, D, device=dev, dtype=acc),
                torch.zeros(B, Hk, L, D, device=dev, dtype=acc),
                torch.zeros(B, Hk, L, E, device=dev, dtype=acc),
                torch.zeros(B, Hk, NSK, D, device=dev, dtype=acc),
                torch.zeros(B, Hk, NSK, E, device=dev, dtype=acc))  # fmt: skip
    # every element is written by the launches below (the keys' without a window: zeros)
    dq = torch.empty(B, H, T, D, device=dev, dtype=acc)
    keys_out = torch.empty if window else torch.zeros
    dk = keys_out(B, Hk, L, D, device=dev, dtype=acc)
    dv = keys_out(B, Hk, L, E, device=dev, dtype=acc)
    dsk = torch.empty(B, Hk, NSK, D, device=dev, dtype=acc)
    dsv = torch.empty(B, Hk, NSK, E, device=dev, dtype=acc)
    G, BS = H // Hk, max(next_pow2(NSK), 16)
    strides = _strides(q, keys, values, kinds, sink_keys, sink_values, sink_pos)
    _local_rows_kernel[(triton.cdiv(T, meta["BT"]), B * H)](
        q, keys, values, kinds, sink_keys, sink_values, sink_pos, sink_present, dnum, dden, off,
        dq, scale, T, L, H, G, NSK, window, *strides, BK=meta["BT"], BS=BS,
        HAS_WIN=window > 0, HAS_SINK=NSK > 0, DQ=True, **meta,
    )  # fmt: skip
    if window:
        _local_dkv_kernel[(triton.cdiv(L, meta["BT"]), B * Hk)](
            q, keys, values, kinds, dnum, dden, off, dk, dv, scale, T, L, H, G, window,
            *strides[:14], BK=meta["BT"], **meta,
        )  # fmt: skip
    if NSK:
        _local_dsink_kernel[(B * Hk,)](
            q, sink_keys, sink_values, sink_pos, sink_present, dnum, dden, off, dsk, dsv, scale,
            T, L, H, G, NSK, *q.stride(), *sink_keys.stride(), *sink_values.stride(),
            *sink_present.stride(), BS=BS, **meta,
        )  # fmt: skip
    return dq, dk, dv, dsk, dsv
