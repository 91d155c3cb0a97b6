"""Fused causal random-feature attention, chunkwise, forward and backward, per (b, h).

Tokens are cut into chunks of C = BT. Features are ``phi = g exp(u - offset)`` in every form
of ``rf_parallel`` (``common._feature_tile``'s epilogue: the real positive GERF family, the signed
table form -- trigrf, hrf, complex gerf, sgq row weights -- and rmf's plain products, u = 0).
R_c is the running key offset after chunk c (the max of the key logits u over all valid keys of
chunks <= c and all features); the forward reads every row at its own offset
``r_i = max(R_{c-1}, m_j for j <= i in chunk c)``, with m_j key j's max logit over features:

    a_i = g_q(i) exp(u_q(i) - mq_i)         (mq_i: per-row max of u over features, exact)
    b_j = g_k(j) exp(u_k(j) - m_j)          (key j at its own max)
    S'_c = sum_{j in chunks < c} phi_j v_j^T at offset R_{c-1}, z'_c likewise
    out_i = (exp(R_{c-1} - r_i) a_i S'_c + sum_{j in c, j <= i} exp(m_j - r_i) (a_i . b_j) v_j)
            / (exp(R_{c-1} - r_i) a_i z'_c + sum_{j in c, j <= i} exp(m_j - r_i) a_i . b_j)

Every factor is <= 1 and no row reads a later key's offset, so no output depends on a later
token, not even through underflow, and where chunks fall changes only rounding (DESIGN §3).

Forward, three launches (features never touch HBM; chunk states do, transiently):

1. ``_chunk_local_kernel``, grid (M tiles, chunks, B*H): each chunk's own sum h_c = sum_j
   exp(u_k(j) - l_c) v_j^T with its local max l_c (fully parallel over chunks);
2. ``_chunk_scan_kernel``, grid (M tiles, B*H): the running offset and the prefix states,
   rescaled flash-style (sequential over chunks), plus the final state; the forward stores each
   chunk's prefix at R_{c-1}, the backward at R_c (``PREFIX``);
3. ``_chunk_out_kernel``, grid (chunks, B*H): a pass over the key features for m_j, then the
   inter-chunk ``a S'`` plus the masked intra-chunk ``(a b^T ⊙ decay ⊙ tril) V`` on ``tl.dot``,
   online per-row max over M tiles, ``out = num / den`` with ``rfattn.reference.attention_ratio``'s
   policy; saves mq_i and den_i at the backward's chunk offset R_c. A non-finite value poisons
   its own and later rows only.

Backward (states recomputed by 1-2, never kept from the forward; no reverse-subtraction of
prefix sums), with keys and prefix states at the chunk offset R_c (mathematically the same
function: offsets cancel; with logits spread far beyond the accumulator's exponent range inside a
chunk, these gradients can still underflow where the forward does not). With g_i = do_i / den_i,
c_i = -(do_i . out_i) / den_i, dK_ij = v_j . g_i + c_i:

4. ``_chunk_local_grad_kernel``, grid (M tiles, chunks, B*H): L_c = sum_{i in c} a_i g_i^T,
   l_c = sum_{i in c} c_i a_i;
5. ``_chunk_rscan_kernel``, grid (M tiles, B*H): dS_c = sum_{c' > c} exp(R_c - R_c') L_c'
   (+ the final state's cotangent), the reverse scan, and the initial state's gradient;
6. ``_chunk_bwd_kernel``, grid (chunks, B*H):
   du_q = a ⊙ (g S_c^T + c z_c + (dK ⊙ tril) b),  du_k = b ⊙ ((dK ⊙ tril)^T a + v dS_c^T + dz_c),
   dv = (a b^T ⊙ tril)^T g + b dS_c; dq, dk through ``common._feature_dx``
   (``phi = g e``: du = phi * dphi, dg = e * dphi).

State (``rfattn.RFState``): S [B, H, M, E], z [B, H, M] in the accumulation dtype and the offset
[B, H] (-inf before any valid key). ``initial_state`` continues a sequence; gradients flow to
the initial S, z and from cotangents of the returned S, z (the offset is not differentiable).
Key padding mask: padded keys get b = 0 everywhere (left padding for batched generation works).
Limits as ``rf_parallel`` (fp32/fp16/bf16/fp64, any D, E, M, T); Tq == Tk; learnable W (dW) is
not supported here (``rf_attention`` routes it to the torch path). Chunk states take
``B H ceil(T / C) M E`` accumulator floats while a call runs.
Reference: ``rfattn.reference.linear_attention(causal=True)`` on ``RandomFeatures.features``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    _NEG,
    _feature_dx,
    _feature_tile,
    _gerf_coeffs,
    _input_scale,
    _load_offset,
    _load_rows,
    _load_w,
    _next_pow2,
    _query_cotangents,
    _ratio,
    _Setup,
    _setup,
    _store_offset,
    _store_tile,
    _valid_keys,
)

__all__ = ["rf_chunk_fwd", "rf_chunk_bwd"]


@triton.jit
def _chunk_local_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    h_ptr, hz_ptr, hm_ptr,
    T, H, NC,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """Chunk c's own (h_c [BM, E], hz_c [BM], l_c) for one M tile, at its local max l_c."""
    i_m, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    o_t = i_c.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    b_ca, b_cb, b_cd = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    b_xs = _load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, ACC) * b_sc[None, :]
    b_u, b_g, b_g1, b_g2 = _feature_tile(
        b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
        M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
    b_u = tl.where(m_t[:, None] & m_f[None, :], b_u, float("-inf"))
    b_l = tl.maximum(tl.max(tl.max(b_u, axis=1), axis=0), _NEG)
    b_p = b_g * tl.exp(b_u - b_l)  # [BT, BM], 0 on invalid rows / features
    p_v = (
        v_ptr
        + i_b * stride_vb
        + i_h * stride_vh
        + o_t[:, None] * stride_vt
        + o_e[None, :] * stride_ve
    )
    b_v = tl.load(p_v, mask=m_t[:, None] & m_e[None, :], other=0.0)  # padded values unread
    # [BM, BT] @ [BT, BE] -> [BM, BE]
    b_h = tl.dot(tl.trans(b_p), b_v.to(ACC), input_precision=PRECISION, out_dtype=ACC)
    i_blk = i_bh * NC + i_c
    tl.store(h_ptr + i_blk * M * E + o_f[:, None] * E + o_e[None, :], b_h,
             mask=m_f[:, None] & m_e[None, :])  # fmt: skip
    tl.store(hz_ptr + i_blk * M + o_f, tl.sum(b_p, axis=0), mask=m_f)
    tl.store(hm_ptr + i_blk * NMT + i_m, b_l)


@triton.jit
def _chunk_scan_kernel(
    h_ptr, hz_ptr, hm_ptr, s0_ptr, z0_ptr, r0_ptr, s_ptr, z_ptr, r_ptr, sT_ptr, zT_ptr, rT_ptr,
    NC,
    M: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr,
    HAS_INIT: tl.constexpr, PLAIN: tl.constexpr, ACC: tl.constexpr, PREFIX: tl.constexpr,
):  # fmt: skip
    """Prefix states S_c, z_c for one M tile, and the final state: at the running offset R_c
    (chunk c's keys included; the backward's convention), or with PREFIX at R_{c-1}, the offset
    before chunk c (the forward's per-row offsets start there)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_f, o_e, o_p = i_m * BM + tl.arange(0, BM), tl.arange(0, BE), tl.arange(0, BP)
    m_f, m_fe = o_f < M, (o_f < M)[:, None] & (o_e < E)[None, :]
    o_fe = o_f[:, None] * E + o_e[None, :]
    b_r = _load_offset(r0_ptr + i_bh, PLAIN, HAS_INIT, ACC)
    if HAS_INIT:
        b_s = tl.load(s0_ptr + i_bh * M * E + o_fe, mask=m_fe, other=0.0).to(ACC)
        b_z = tl.load(z0_ptr + i_bh * M + o_f, mask=m_f, other=0.0).to(ACC)
    else:
        b_s = tl.zeros([BM, BE], dtype=ACC)
        b_z = tl.zeros([BM], dtype=ACC)
    for i_c in range(0, NC):
        i_blk = i_bh * NC + i_c
        b_lall = tl.load(hm_ptr + i_blk * NMT + o_p, mask=o_p < NMT, other=_NEG)  # [BP]
        b_rn = tl.maximum(b_r, tl.max(b_lall, axis=0))
        b_alpha = tl.exp(b_r - b_rn)
        if PREFIX:
            tl.store(s_ptr + i_blk * M * E + o_fe, b_s, mask=m_fe)
            tl.store(z_ptr + i_blk * M + o_f, b_z, mask=m_f)
            if i_m == 0:
                tl.store(r_ptr + i_blk, b_r)
        b_s, b_z = b_s * b_alpha, b_z * b_alpha
        if not PREFIX:
            tl.store(s_ptr + i_blk * M * E + o_fe, b_s, mask=m_fe)
            tl.store(z_ptr + i_blk * M + o_f, b_z, mask=m_f)
            if i_m == 0:
                tl.store(r_ptr + i_blk, b_rn)
        b_beta = tl.exp(tl.load(hm_ptr + i_blk * NMT + i_m) - b_rn)
        b_s += b_beta * tl.load(h_ptr + i_blk * M * E + o_fe, mask=m_fe, other=0.0)
        b_z += b_beta * tl.load(hz_ptr + i_blk * M + o_f, mask=m_f, other=0.0)
        b_r = b_rn
    tl.store(sT_ptr + i_bh * M * E + o_fe, b_s, mask=m_fe)
    tl.store(zT_ptr + i_bh * M + o_f, b_z, mask=m_f)
    if i_m == 0:
        _store_offset(rT_ptr + i_bh, b_r)


@triton.jit
def _chunk_out_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    s_ptr, z_ptr, r_ptr, o_ptr, mq_ptr, den_ptr,
    T, H, NC,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_ob, stride_oh, stride_ot, stride_oe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """out [BT, E] of chunk c: a S_c plus the masked intra-chunk term, normalised."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    i_blk = i_bh * NC + i_c
    o_t = i_c.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_q, m_d, m_e = o_t < T, o_d < D, o_e < E
    m_k = _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    b_ca, b_cb, b_cd = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_scq = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_sck = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    b_xq = _load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, ACC) * b_scq[None, :]
    b_xk = _load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_k, m_d, ACC) * b_sck[None, :]
    b_rp = tl.load(r_ptr + i_blk)  # R_{c-1}: the prefix state's offset
    # per-row offsets: key j's own max logit m_j over features, then r_i = max(R_{c-1}, m_j for
    # j <= i), so no row reads a later key's offset (one more pass over the key features)
    b_mk = tl.full([BT], _NEG, dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_uk, b_gk, b_g1, b_g2 = _feature_tile(
            b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # fmt: skip
        b_uk = tl.where(m_k[:, None] & m_f[None, :], b_uk, _NEG)
        b_mk = tl.maximum(b_mk, tl.max(b_uk, axis=1))
    m_tril = o_t[:, None] >= o_t[None, :]  # [BT(i), BT(j)]
    b_ri = tl.maximum(b_rp, tl.max(tl.where(m_tril, b_mk[None, :], _NEG), axis=1))  # [BT]
    b_rc = tl.maximum(b_rp, tl.max(b_mk, axis=0))  # R_c, the backward's chunk offset

    b_mx = tl.full([BT], _NEG, dtype=ACC)
    b_num = tl.zeros([BT, BE], dtype=ACC)
    b_den = tl.zeros([BT], dtype=ACC)
    b_A = tl.zeros([BT, BT], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_uq, b_gq, b_g1, b_g2 = _feature_tile(
            b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
        b_uq = tl.where(m_f[None, :], b_uq, float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(b_uq, axis=1))
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_a = b_gq * tl.exp(b_uq - b_mx_new[:, None])  # [BT, BM]
        b_uk, b_gk, b_g1, b_g2 = _feature_tile(
            b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # fmt: skip
        b_b = b_gk * tl.where(m_k[:, None] & m_f[None, :], tl.exp(b_uk - b_mk[:, None]), 0.0)
        b_s = tl.load(s_ptr + i_blk * M * E + o_f[:, None] * E + o_e[None, :],
                      mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
        b_z = tl.load(z_ptr + i_blk * M + o_f, mask=m_f, other=0.0)  # [BM]
        # [BT, BM] @ [BM, BE] -> [BT, BE]; [BT, BM] @ [BM, BT] -> [BT, BT]
        b_num = b_num * b_alpha[:, None] + tl.dot(
            b_a, b_s, input_precision=PRECISION, out_dtype=ACC
        )
        b_den = b_den * b_alpha + tl.sum(b_a * b_z[None, :], axis=1)
        b_A = b_A * b_alpha[:, None] + tl.dot(
            b_a, tl.trans(b_b), input_precision=PRECISION, out_dtype=ACC
        )
        b_mx = b_mx_new
    # rows at their own offsets: the prefix times exp(R_{c-1} - r_i), key j <= i times
    # exp(m_j - r_i) (both <= 1); later keys never enter (selection, not a product with 0)
    b_inter = tl.exp(b_rp - b_ri)
    b_num, b_den = b_num * b_inter[:, None], b_den * b_inter
    b_decay = tl.exp(tl.minimum(b_mk[None, :] - b_ri[:, None], 0.0))
    b_A = tl.where(m_tril & m_k[None, :], b_A * b_decay, 0.0)  # causal inside the chunk
    p_v = (
        v_ptr
        + i_b * stride_vb
        + i_h * stride_vh
        + o_t[:, None] * stride_vt
        + o_e[None, :] * stride_ve
    )
    b_v = tl.load(p_v, mask=m_k[:, None] & m_e[None, :], other=0.0).to(ACC)  # [BT, BE]
    # a non-finite value poisons its own and later rows, never earlier ones: zero in the
    # product (0 * NaN would reach every row), NaN from its position on (0/1 counts: exact)
    b_bad = (b_v != b_v) | (tl.abs(b_v) == float("inf"))
    b_tril = (o_t[:, None] >= o_t[None, :]).to(ACC)
    b_poison = tl.dot(b_tril, b_bad.to(ACC), input_precision="ieee", out_dtype=ACC) > 0
    b_num += tl.dot(b_A, tl.where(b_bad, 0.0, b_v), input_precision=PRECISION, out_dtype=ACC)
    b_num = tl.where(b_poison, float("nan"), b_num)
    b_den += tl.sum(b_A, axis=1)
    b_o, b_den = _ratio(b_num, b_den, TINY)
    _store_tile(o_ptr, i_b, i_h, o_t, o_e, stride_ob, stride_oh, stride_ot, stride_oe,
                b_o, m_q, m_e)  # fmt: skip
    tl.store(mq_ptr + i_bh * T + o_t, b_mx, mask=m_q)
    # the backward recomputes keys at the chunk offset R_c: its denominator is this one times
    # exp(r_i - R_c) (an empty row keeps inf: zero cotangents)
    b_den = tl.where(b_den == float("inf"), b_den, b_den * tl.exp(b_ri - b_rc))
    tl.store(den_ptr + i_bh * T + o_t, b_den, mask=m_q)


@triton.jit
def _chunk_local_grad_kernel(
    q_ptr, w_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    o_ptr, do_ptr, mq_ptr, den_ptr, L_ptr, l_ptr,
    T, H, NC,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """Chunk c's L_c = sum_i a_i g_i^T [BM, E] and l_c = sum_i c_i a_i [BM] for one M tile."""
    i_m, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    o_t = i_c.to(tl.int64) * BT + tl.arange(0, BT)
    m_q = o_t < T
    b_ca, b_cb, b_cd = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh
    b_xq = _load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, ACC) * b_sc[None, :]
    b_mq = tl.load(mq_ptr + i_bh * T + o_t, mask=m_q, other=0.0)
    b_u, b_g, b_g1, b_g2 = _feature_tile(
        b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
        M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # fmt: skip
    b_a = b_g * tl.where(m_q[:, None] & m_f[None, :], tl.exp(b_u - b_mq[:, None]), 0.0)
    b_g, b_c = _query_cotangents(do_ptr + i_b * stride_dob + i_h * stride_doh,
                                 o_ptr + i_b * stride_ob + i_h * stride_oh, den_ptr, i_bh, o_t,
                                 o_e, T, m_q, m_e, stride_dot, stride_doe, stride_ot, stride_oe,
                                 ACC)  # fmt: skip
    i_blk = i_bh * NC + i_c
    # [BM, BT] @ [BT, BE] -> [BM, BE]
    b_L = tl.dot(tl.trans(b_a), b_g, input_precision=PRECISION, out_dtype=ACC)
    tl.store(L_ptr + i_blk * M * E + o_f[:, None] * E + o_e[None, :], b_L,
             mask=m_f[:, None] & m_e[None, :])  # fmt: skip
    tl.store(l_ptr + i_blk * M + o_f, tl.sum(b_a * b_c[:, None], axis=0), mask=m_f)


@triton.jit
def _chunk_rscan_kernel(
    L_ptr, l_ptr, r_ptr, dsT_ptr, dzT_ptr, r0_ptr, ds_ptr, dz_ptr, ds0_ptr, dz0_ptr,
    NC,
    M: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr,
    HAS_DFINAL: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """dS_c = sum_{c' > c} exp(R_c - R_c') L_c' (+ final cotangent), and the initial state's."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    o_f, o_e = i_m * BM + tl.arange(0, BM), tl.arange(0, BE)
    m_f, m_fe = o_f < M, (o_f < M)[:, None] & (o_e < E)[None, :]
    o_fe = o_f[:, None] * E + o_e[None, :]
    if HAS_DFINAL:  # the returned state sits at offset R_{NC-1}
        b_ds = tl.load(dsT_ptr + i_bh * M * E + o_fe, mask=m_fe, other=0.0).to(ACC)
        b_dz = tl.load(dzT_ptr + i_bh * M + o_f, mask=m_f, other=0.0).to(ACC)
    else:
        b_ds = tl.zeros([BM, BE], dtype=ACC)
        b_dz = tl.zeros([BM], dtype=ACC)
    for i_r in range(0, NC):
        i_c = NC - 1 - i_r
        i_blk = i_bh * NC + i_c
        tl.store(ds_ptr + i_blk * M * E + o_fe, b_ds, mask=m_fe)
        tl.store(dz_ptr + i_blk * M + o_f, b_dz, mask=m_f)
        b_ds += tl.load(L_ptr + i_blk * M * E + o_fe, mask=m_fe, other=0.0)
        b_dz += tl.load(l_ptr + i_blk * M + o_f, mask=m_f, other=0.0)
        if i_c > 0:
            b_f = tl.exp(tl.load(r_ptr + i_blk - 1) - tl.load(r_ptr + i_blk))
            b_ds, b_dz = b_ds * b_f, b_dz * b_f
    if HAS_INIT:  # the initial state entered chunk 0 rescaled by exp(R_init - R_0)
        b_f = tl.exp(_load_offset(r0_ptr + i_bh, False, True, ACC) - tl.load(r_ptr + i_bh * NC))
        tl.store(ds0_ptr + i_bh * M * E + o_fe, b_ds * b_f, mask=m_fe)
        tl.store(dz0_ptr + i_bh * M + o_f, b_dz * b_f, mask=m_f)


@triton.jit
def _chunk_bwd_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    s_ptr, z_ptr, r_ptr, ds_ptr, dz_ptr, o_ptr, do_ptr, mq_ptr, den_ptr,
    dq_ptr, dk_ptr, dv_ptr,
    T, H, NC,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dve,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """dq, dk [BT, D] and dv [BT, E] of chunk c (inter-chunk states + masked intra terms)."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    i_blk = i_bh * NC + i_c
    o_t = i_c.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_q, m_d, m_e = o_t < T, o_d < D, o_e < E
    m_k = _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    m_tril = o_t[:, None] >= o_t[None, :]  # [BT(i), BT(j)]
    b_ca, b_cb, b_cd = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_scq = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_sck = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh
    b_xq = _load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, ACC) * b_scq[None, :]
    b_xk = _load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_k, m_d, ACC) * b_sck[None, :]
    b_v = _load_rows(v_base, o_t, o_e, stride_vt, stride_ve, m_k, m_e, ACC)  # [BT, BE]
    b_mq = tl.load(mq_ptr + i_bh * T + o_t, mask=m_q, other=0.0)
    b_r = tl.load(r_ptr + i_blk)
    b_g, b_c = _query_cotangents(do_ptr + i_b * stride_dob + i_h * stride_doh,
                                 o_ptr + i_b * stride_ob + i_h * stride_oh, den_ptr, i_bh, o_t,
                                 o_e, T, m_q, m_e, stride_dot, stride_doe, stride_ot, stride_oe,
                                 ACC)  # fmt: skip
    # dK_ij = v_j . g_i + c_i, causal inside the chunk: [BT, BE] @ [BE, BT] -> [BT, BT]
    b_dK = tl.dot(b_g, tl.trans(b_v), input_precision=PRECISION, out_dtype=ACC) + b_c[:, None]
    b_dK = tl.where(m_tril, b_dK, 0.0)

    b_dxq = tl.zeros([BT, BD], dtype=ACC)
    b_dxk = tl.zeros([BT, BD], dtype=ACC)
    b_dv = tl.zeros([BT, BE], dtype=ACC)
    b_A = tl.zeros([BT, BT], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        m_fe = m_f[:, None] & m_e[None, :]
        o_fe = o_f[:, None] * E + o_e[None, :]
        b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_uq, b_gq, b_g1q, b_g2q = _feature_tile(
            b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # fmt: skip
        b_eq = tl.where(m_q[:, None] & m_f[None, :], tl.exp(b_uq - b_mq[:, None]), 0.0)
        b_a = b_gq * b_eq  # [BT, BM]
        b_uk, b_gk, b_g1k, b_g2k = _feature_tile(
            b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # fmt: skip
        b_ek = tl.where(m_k[:, None] & m_f[None, :], tl.exp(b_uk - b_r), 0.0)
        b_b = b_gk * b_ek  # [BT, BM]
        b_s = tl.load(s_ptr + i_blk * M * E + o_fe, mask=m_fe, other=0.0)  # [BM, BE]
        b_z = tl.load(z_ptr + i_blk * M + o_f, mask=m_f, other=0.0)
        b_ds = tl.load(ds_ptr + i_blk * M * E + o_fe, mask=m_fe, other=0.0)
        b_dz = tl.load(dz_ptr + i_blk * M + o_f, mask=m_f, other=0.0)
        # da = g S^T + c z + dK b:  [BT, BE] @ [BE, BM] and [BT, BT] @ [BT, BM] -> [BT, BM]
        b_da = tl.dot(b_g, tl.trans(b_s), input_precision=PRECISION, out_dtype=ACC)
        b_da += b_c[:, None] * b_z[None, :]
        b_da += tl.dot(b_dK, b_b, input_precision=PRECISION, out_dtype=ACC)
        b_dxq += _feature_dx(b_a * b_da, b_eq * b_da, b_g1q, b_g2q, b_xq, b_w, o_f, m_f, o_d,
                             m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM, FEATURE, False,
                             PRECISION, TINY)  # fmt: skip
        # db = dK^T a + v dS^T + dz:  [BT, BT] @ [BT, BM] and [BT, BE] @ [BE, BM] -> [BT, BM]
        b_db = tl.dot(tl.trans(b_dK), b_a, input_precision=PRECISION, out_dtype=ACC)
        b_db += tl.dot(b_v, tl.trans(b_ds), input_precision=PRECISION, out_dtype=ACC)
        b_db += b_dz[None, :]
        b_dxk += _feature_dx(b_b * b_db, b_ek * b_db, b_g1k, b_g2k, b_xk, b_w, o_f, m_f, o_d,
                             m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM, FEATURE, True,
                             PRECISION, TINY)  # fmt: skip
        # inter-chunk dv = b dS: [BT, BM] @ [BM, BE]; intra needs A = a b^T over all features
        b_dv += tl.dot(b_b, b_ds, input_precision=PRECISION, out_dtype=ACC)
        b_A += tl.dot(b_a, tl.trans(b_b), input_precision=PRECISION, out_dtype=ACC)
    b_A = tl.where(m_tril, b_A, 0.0)
    b_dv += tl.dot(tl.trans(b_A), b_g, input_precision=PRECISION, out_dtype=ACC)  # [BT, BE]
    _store_tile(dq_ptr, i_b, i_h, o_t, o_d, stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                b_dxq * b_scq[None, :], m_q, m_d)  # fmt: skip
    _store_tile(dk_ptr, i_b, i_h, o_t, o_d, stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                b_dxk * b_sck[None, :], m_q, m_d)  # fmt: skip
    _store_tile(dv_ptr, i_b, i_h, o_t, o_e, stride_dvb, stride_dvh, stride_dvt, stride_dve,
                b_dv, m_q, m_e)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# launchers


def _states(c: _Setup, k, v, initial_state, prefix: bool):
    """Launch the local and scan kernels: prefix states per chunk (at R_{c-1} with ``prefix``,
    for the forward; else at R_c, for the backward) and the final state."""
    B, H, T, M, E, NMT, bt = c.B, c.H, c.Tk, c.M, c.E, c.NMT, c.BT
    NC = max(triton.cdiv(T, bt), 1)
    h = c.acc_empty(B * H * NC, M, E)
    hz = c.acc_empty(B * H * NC, M)
    hm = c.acc_empty(B * H * NC, NMT)
    meta = dict(**c.launch_options(), **c.meta)
    _chunk_local_kernel[(NMT, NC, B * H)](
        k, v, c.w, c.pad[0], *c.form_ptrs, h, hz, hm,
        T, H, NC, *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
        BT=bt, HAS_PAD=c.has_pad, **meta,
    )  # fmt: skip
    s = c.acc_empty(B * H * NC, M, E)
    z = c.acc_empty(B * H * NC, M)
    r = c.acc_empty(B * H * NC)
    sT, zT, rT = c.acc_empty(B, H, M, E), c.acc_empty(B, H, M), c.acc_empty(B, H)
    if initial_state is not None:
        s0, z0, r0 = (x.to(c.acc).contiguous() for x in initial_state)
    else:
        s0 = z0 = r0 = sT  # never read
    _chunk_scan_kernel[(NMT, B * H)](
        h, hz, hm, s0, z0, r0, s, z, r, sT, zT, rT, NC,
        M=M, E=E, BM=c.BM, BE=c.BE, BP=_next_pow2(NMT), HAS_INIT=initial_state is not None,
        PLAIN=c.plain, ACC=c.ACC, PREFIX=prefix, **c.launch_options(),
    )  # fmt: skip
    return NC, (s, z, r), (sT, zT, rT)


def rf_chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: tuple | None = None,
    precision: str | None = None,
    return_aux: bool = False,
    gpu_tiles: bool | None = None,
):
    """Causal fused random-feature attention forward (chunkwise).

    Args:
        q, k: ``[B, H, T, D]``; v: ``[B, H, T, E]`` (any strides, one dtype).
        form, scale, key_padding_mask, precision, gpu_tiles: as ``rf_parallel.rf_parallel_fwd``
            (every kernel form).
        initial_state: optional ``(S [B, H, M, E], z [B, H, M], offset [B, H])`` to continue, in
            ``rfattn.RFState``'s convention (offset -inf before any valid key).
        return_aux: also return what the backward needs.

    Returns:
        ``(out [B, H, T, E], (S, z, offset))`` with the final state in the accumulation dtype and
        ``rfattn.RFState``'s convention; with ``return_aux`` also ``(m_q [B*H, T], den [B*H, T])``.
    """
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs Tq == Tk, got {q.shape[2]} and {k.shape[2]}")
    c = _setup(q, k, v, form, scale, key_padding_mask, precision, causal=True,
               gpu_tiles=gpu_tiles)  # fmt: skip
    B, H, T, E, bt = c.B, c.H, c.Tq, c.E, c.BT
    out = torch.empty(B, H, T, E, device=q.device, dtype=q.dtype)
    mq, den = c.acc_empty(B * H, T), c.acc_empty(B * H, T)
    if B * H == 0:
        state = (c.acc_empty(B, H, c.M, E), c.acc_empty(B, H, c.M),
                 c.acc_empty(B, H))  # fmt: skip
        return (out, state, (mq, den)) if return_aux else (out, state)
    NC, (s, z, r), state = _states(c, k, v, initial_state, prefix=True)
    if T:
        _chunk_out_kernel[(NC, B * H)](
            q, k, v, c.w, c.pad[0], *c.form_ptrs, s, z, r, out, mq, den,
            T, H, NC, *q.stride(), *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
            *out.stride(), BT=bt, HAS_PAD=c.has_pad, **c.launch_options(), **c.meta,
        )  # fmt: skip
    return (out, state, (mq, den)) if return_aux else (out, state)


def rf_chunk_bwd(
    do: torch.Tensor,
    dstate: tuple | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form,
    scale: float,
    out: torch.Tensor,
    aux: tuple,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: tuple | None = None,
    precision: str | None = None,
    gpu_tiles: bool | None = None,
):
    """Backward of :func:`rf_chunk_fwd` (chunk states recomputed).

    Args:
        do: ``[B, H, T, E]`` cotangent of the output.
        dstate: None or ``(dS [B, H, M, E], dz [B, H, M])``, cotangents of the final state.
        out, aux: the forward's output and ``(m_q, den)``; the rest as given to the forward.

    Returns:
        ``(dq, dk, dv, dS0, dz0)``; the last two are None without ``initial_state``.
    """
    c = _setup(q, k, v, form, scale, key_padding_mask, precision, causal=True,
               gpu_tiles=gpu_tiles)  # fmt: skip
    B, H, T, M, E, NMT, bt = c.B, c.H, c.Tq, c.M, c.E, c.NMT, c.BT
    mq, den = aux
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    has_init = initial_state is not None
    ds0 = c.acc_empty(B, H, M, E) if has_init else None
    dz0 = c.acc_empty(B, H, M) if has_init else None
    if B * H == 0:
        return dq, dk, dv, ds0, dz0
    NC, (s, z, r), _ = _states(c, k, v, initial_state, prefix=False)
    meta = dict(**c.launch_options(), BT=bt, **c.meta)
    L = c.acc_empty(B * H * NC, M, E)
    l_ = c.acc_empty(B * H * NC, M)
    if T:
        _chunk_local_grad_kernel[(NMT, NC, B * H)](
            q, c.w, *c.form_ptrs, out, do, mq, den, L, l_,
            T, H, NC, *q.stride(), *c.w.stride(), *out.stride(), *do.stride(), **meta,
        )  # fmt: skip
    else:
        L.zero_()
        l_.zero_()
    ds = c.acc_empty(B * H * NC, M, E)
    dz = c.acc_empty(B * H * NC, M)
    if dstate is not None:
        dsT, dzT = (x.to(c.acc).contiguous() for x in dstate)
    else:
        dsT = dzT = ds  # never read
    r0 = initial_state[2].to(c.acc).contiguous() if has_init else r
    _chunk_rscan_kernel[(NMT, B * H)](
        L, l_, r, dsT, dzT, r0, ds, dz, ds0 if has_init else ds, dz0 if has_init else dz, NC,
        M=M, E=E, BM=c.BM, BE=c.BE, HAS_DFINAL=dstate is not None, HAS_INIT=has_init,
        ACC=c.ACC, **c.launch_options(),
    )  # fmt: skip
    if T:
        _chunk_bwd_kernel[(NC, B * H)](
            q, k, v, c.w, c.pad[0], *c.form_ptrs,
            s, z, r, ds, dz, out, do, mq, den, dq, dk, dv, T, H, NC,
            *q.stride(), *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
            *out.stride(), *do.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
            HAS_PAD=c.has_pad, **meta,
        )  # fmt: skip
    return dq, dk, dv, ds0, dz0
