"""Fused causal random-feature attention, chunkwise, forward and backward, per (b, h).

Tokens are cut into chunks of C = BT. Features are ``phi = g exp(u - offset)`` in every form
of ``rf_parallel`` (``common.feature_tile``'s epilogue: the real positive GERF family, the signed
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
token, not even through underflow, and where chunks fall changes only rounding (docs/numerics.md).

Forward, three launches (features never touch HBM; chunk states do, transiently):

1. ``_chunk_local_kernel``, grid (M tiles, chunks, B*H): each chunk's own sum h_c = sum_j
   exp(u_k(j) - l_c) v_j^T with its local max l_c (fully parallel over chunks);
2. ``_chunk_scan_kernel``, grid (M tiles, B*H): the running offset and the prefix states,
   rescaled flash-style (sequential over chunks), plus the final state; each chunk's prefix is
   stored at R_{c-1};
3. ``_chunk_out_kernel``, grid (chunks, B*H): a pass over the key features for m_j, then the
   inter-chunk ``a S'`` plus the masked intra-chunk ``(a b^T ⊙ decay ⊙ tril) V`` on ``tl.dot``,
   online per-row max over M tiles, ``out = num / den`` with ``rfattn.reference.attention_ratio``'s
   policy; saves mq_i, den_i (at r_i) and m_j. A non-finite value poisons its own and later rows
   only.

Backward (states recomputed by 1-2, never kept from the forward; no reverse-subtraction of
prefix sums), every row and key at the forward's own offsets, so its gradients underflow only
where the forward's terms do. With g_i = do_i / den_i, c_i = -(do_i . out_i) / den_i, w_i =
exp(R_{c-1} - r_i), decay_ij = exp(m_j - r_i), kf_j = exp(m_j - R_c) (all <= 1) and
dK_ij = (v_j . g_i + c_i) decay_ij:

4. ``_chunk_local_grad_kernel``, grid (M tiles, chunks, B*H): L_c = sum_{i in c} w_i a_i g_i^T,
   l_c = sum_{i in c} w_i c_i a_i;
5. ``_chunk_rscan_kernel``, grid (M tiles, B*H): D_c = L_{c+1} + exp(R_c - R_{c+1}) D_{c+1},
   the cotangent of the state after chunk c at R_c (from the final state's), the reverse scan,
   and the initial state's gradient one step further;
6. ``_chunk_bwd_kernel``, grid (chunks, B*H):
   du_q = a ⊙ (w (g S'_c^T + c z'_c) + (dK ⊙ tril) b),
   du_k = b ⊙ ((dK ⊙ tril)^T a + kf (v D_c^T + dz_c)),
   dv = (a b^T ⊙ decay ⊙ tril)^T g + kf b D_c; dq, dk through ``common.feature_dx``
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
    NEG,
    Setup,
    cdiv,
    check_forward_only,
    feature_dx,
    feature_tile,
    gerf_coeffs,
    input_scale,
    launch,
    launch_setup,
    load_mapped,
    load_offset,
    load_rows,
    load_w,
    next_pow2,
    query_cotangents,
    ratio,
    store_offset,
    store_tile,
    valid_keys,
)

__all__ = ["rf_chunk_fwd", "rf_chunk_bwd"]


@triton.jit
def _row_offsets(b_rp, b_mk, m_tril):
    """Each row's offset r_i = max(R_{c-1}, m_j for j <= i in the chunk) [BT]: no later key's."""
    return tl.maximum(b_rp, tl.max(tl.where(m_tril, b_mk[None, :], NEG), axis=1))


@triton.jit
def _intra_decay(b_mk, b_ri):
    """exp(m_j - r_i) [BT(i), BT(j)], <= 1 where j <= i (callers select the causal part)."""
    return tl.exp(tl.minimum(b_mk[None, :] - b_ri[:, None], 0.0))


@triton.jit
def _chunk_local_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    kmap_ptr, h_ptr, hz_ptr, hm_ptr,
    T, H, NC,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_MAP: tl.constexpr,
):  # fmt: skip
    """Chunk c's own (h_c [BM, E], hz_c [BM], l_c) for one M tile, at its local max l_c."""
    i_m, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    o_t = i_c.to(tl.int64) * BT + tl.arange(0, BT)
    m_t = valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    b_xs = load_mapped(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, kmap_ptr, i_h, D, BT, BD,
                        HAS_MAP, PRECISION, ACC) * b_sc[None, :]  # fmt: skip
    b_u, b_g, b_g1, b_g2 = feature_tile(
        b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
        M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
    b_u = tl.where(m_t[:, None] & m_f[None, :], b_u, float("-inf"))
    b_l = tl.maximum(tl.max(tl.max(b_u, axis=1), axis=0), NEG)
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
    HAS_INIT: tl.constexpr, PLAIN: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Prefix states S_c, z_c for one M tile (the keys of chunks < c) at R_{c-1}, the offset
    before chunk c, where the rows' own offsets start; and the final state."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_f, o_e, o_p = i_m * BM + tl.arange(0, BM), tl.arange(0, BE), tl.arange(0, BP)
    m_f, m_fe = o_f < M, (o_f < M)[:, None] & (o_e < E)[None, :]
    o_fe = o_f[:, None] * E + o_e[None, :]
    b_r = load_offset(r0_ptr + i_bh, PLAIN, HAS_INIT, ACC)
    if HAS_INIT:
        b_s = tl.load(s0_ptr + i_bh * M * E + o_fe, mask=m_fe, other=0.0).to(ACC)
        b_z = tl.load(z0_ptr + i_bh * M + o_f, mask=m_f, other=0.0).to(ACC)
    else:
        b_s = tl.zeros([BM, BE], dtype=ACC)
        b_z = tl.zeros([BM], dtype=ACC)
    for i_c in range(0, NC):
        i_blk = i_bh * NC + i_c
        b_lall = tl.load(hm_ptr + i_blk * NMT + o_p, mask=o_p < NMT, other=NEG)  # [BP]
        b_rn = tl.maximum(b_r, tl.max(b_lall, axis=0))
        b_alpha = tl.exp(b_r - b_rn)
        tl.store(s_ptr + i_blk * M * E + o_fe, b_s, mask=m_fe)
        tl.store(z_ptr + i_blk * M + o_f, b_z, mask=m_f)
        if i_m == 0:
            tl.store(r_ptr + i_blk, b_r)
        b_s, b_z = b_s * b_alpha, b_z * b_alpha
        b_beta = tl.exp(tl.load(hm_ptr + i_blk * NMT + i_m) - b_rn)
        b_s += b_beta * tl.load(h_ptr + i_blk * M * E + o_fe, mask=m_fe, other=0.0)
        b_z += b_beta * tl.load(hz_ptr + i_blk * M + o_f, mask=m_f, other=0.0)
        b_r = b_rn
    tl.store(sT_ptr + i_bh * M * E + o_fe, b_s, mask=m_fe)
    tl.store(zT_ptr + i_bh * M + o_f, b_z, mask=m_f)
    if i_m == 0:
        store_offset(rT_ptr + i_bh, b_r)


@triton.jit
def _chunk_out_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr,
    xi_ptr, qmap_ptr, kmap_ptr, s_ptr, z_ptr, r_ptr, o_ptr, mq_ptr, den_ptr, mk_ptr,
    T, H, NC, G,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_ob, stride_oh, stride_ot, stride_oe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_MAP: tl.constexpr,
):  # fmt: skip
    """out [BT, E] of chunk c for each of the G query heads of key/value head (b, h): a S_c
    plus the masked intra-chunk term, normalised."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    i_blk = i_bh * NC + i_c
    o_t = i_c.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_q, m_d, m_e = o_t < T, o_d < D, o_e < E
    m_k = valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_scq = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_sck = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    b_xk = load_mapped(k_base, o_t, o_d, stride_kt, stride_kd, m_k, m_d, kmap_ptr, i_h, D, BT, BD,
                        HAS_MAP, PRECISION, ACC) * b_sck[None, :]  # fmt: skip
    b_rp = tl.load(r_ptr + i_blk)  # R_{c-1}: the prefix state's offset
    # per-row offsets: key j's own max logit m_j over features, then r_i = max(R_{c-1}, m_j for
    # j <= i), so no row reads a later key's offset (one more pass over the key features)
    b_mk = tl.full([BT], NEG, dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_uk, b_gk, b_g1, b_g2 = feature_tile(
            b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # fmt: skip
        b_uk = tl.where(m_k[:, None] & m_f[None, :], b_uk, NEG)
        b_mk = tl.maximum(b_mk, tl.max(b_uk, axis=1))
    tl.store(mk_ptr + i_bh * T + o_t, b_mk, mask=m_q)
    m_tril = o_t[:, None] >= o_t[None, :]  # [BT(i), BT(j)]
    b_ri = _row_offsets(b_rp, b_mk, m_tril)
    b_inter = tl.exp(b_rp - b_ri)
    b_decay = _intra_decay(b_mk, b_ri)
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
    b_vc = tl.where(b_bad, 0.0, b_v)
    for g in range(0, G):  # the query heads that read this key/value head
        i_hq = i_h * G + g
        q_base = q_ptr + i_b * stride_qb + i_hq * stride_qh
        b_xq = load_mapped(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, qmap_ptr, i_hq, D, BT,
                            BD, HAS_MAP, PRECISION, ACC) * b_scq[None, :]  # fmt: skip
        b_mx = tl.full([BT], NEG, dtype=ACC)
        b_num = tl.zeros([BT, BE], dtype=ACC)
        b_den = tl.zeros([BT], dtype=ACC)
        b_A = tl.zeros([BT, BT], dtype=ACC)
        for i_m in range(0, NMT):
            o_f = i_m * BM + tl.arange(0, BM)
            m_f = o_f < M
            b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
            b_uq, b_gq, b_g1, b_g2 = feature_tile(
                b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
            b_uq = tl.where(m_f[None, :], b_uq, float("-inf"))
            b_mx_new = tl.maximum(b_mx, tl.max(b_uq, axis=1))
            b_alpha = tl.exp(b_mx - b_mx_new)
            b_a = b_gq * tl.exp(b_uq - b_mx_new[:, None])  # [BT, BM]
            b_uk, b_gk, b_g1, b_g2 = feature_tile(
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
        b_num, b_den = b_num * b_inter[:, None], b_den * b_inter
        b_A = tl.where(m_tril & m_k[None, :], b_A * b_decay, 0.0)  # causal inside the chunk
        b_num += tl.dot(b_A, b_vc, input_precision=PRECISION, out_dtype=ACC)
        b_num = tl.where(b_poison, float("nan"), b_num)
        b_den += tl.sum(b_A, axis=1)
        b_o, b_den = ratio(b_num, b_den, TINY)
        store_tile(o_ptr, i_b, i_hq, o_t, o_e, stride_ob, stride_oh, stride_ot, stride_oe,
                    b_o, m_q, m_e)  # fmt: skip
        i_row = (i_bh * G + g) * T  # the query head's rows of m_q and den
        tl.store(mq_ptr + i_row + o_t, b_mx, mask=m_q)
        tl.store(den_ptr + i_row + o_t, b_den, mask=m_q)


@triton.jit
def _chunk_local_grad_kernel(
    q_ptr, w_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    o_ptr, do_ptr, mq_ptr, den_ptr, mk_ptr, r_ptr, L_ptr, l_ptr,
    T, H, NC, G,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """Chunk c's L_c = sum_i w_i a_i g_i^T [BM, E] and l_c = sum_i w_i c_i a_i [BM] for one M
    tile, with w_i = exp(R_{c-1} - r_i) <= 1 the factor row i read the prefix state with; the
    rows of the G query heads of key/value head (b, h) together."""
    i_m, i_c, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    o_t = i_c.to(tl.int64) * BT + tl.arange(0, BT)
    m_q = o_t < T
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    i_blk = i_bh * NC + i_c
    b_rp = tl.load(r_ptr + i_blk)
    b_mk = tl.load(mk_ptr + i_bh * T + o_t, mask=m_q, other=NEG)
    b_wr = tl.exp(b_rp - _row_offsets(b_rp, b_mk, o_t[:, None] >= o_t[None, :]))
    b_L = tl.zeros([BM, BE], dtype=ACC)
    b_l = tl.zeros([BM], dtype=ACC)
    for g in range(0, G):
        i_hq = i_h * G + g
        i_row = (i_bh * G + g) * T
        q_base = q_ptr + i_b * stride_qb + i_hq * stride_qh
        b_xq = load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, ACC) * b_sc[None, :]
        b_mq = tl.load(mq_ptr + i_row + o_t, mask=m_q, other=0.0)
        b_u, b_g, b_g1, b_g2 = feature_tile(
            b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # fmt: skip
        b_a = b_g * tl.where(m_q[:, None] & m_f[None, :], tl.exp(b_u - b_mq[:, None]), 0.0)
        b_g, b_c = query_cotangents(do_ptr + i_b * stride_dob + i_hq * stride_doh,
                                     o_ptr + i_b * stride_ob + i_hq * stride_oh, den_ptr,
                                     i_bh * G + g, o_t, o_e, T, m_q, m_e, stride_dot, stride_doe,
                                     stride_ot, stride_oe, ACC)  # fmt: skip
        b_g, b_c = b_g * b_wr[:, None], b_c * b_wr
        # [BM, BT] @ [BT, BE] -> [BM, BE]
        b_L += tl.dot(tl.trans(b_a), b_g, input_precision=PRECISION, out_dtype=ACC)
        b_l += tl.sum(b_a * b_c[:, None], axis=0)
    tl.store(L_ptr + i_blk * M * E + o_f[:, None] * E + o_e[None, :], b_L,
             mask=m_f[:, None] & m_e[None, :])  # fmt: skip
    tl.store(l_ptr + i_blk * M + o_f, b_l, mask=m_f)


@triton.jit
def _chunk_rscan_kernel(
    L_ptr, l_ptr, r_ptr, rT_ptr, dsT_ptr, dzT_ptr, ds_ptr, dz_ptr, ds0_ptr, dz0_ptr,
    NC,
    M: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr,
    HAS_DFINAL: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The reverse scan: D_c, the cotangent of the state after chunk c at its offset R_c,
    D_c = L_{c+1} + exp(R_c - R_{c+1}) D_{c+1} from the final state's cotangent D_{NC-1}; the
    initial state's (at R_{-1}, its own offset) continues the same recursion one step.
    ``r_ptr`` holds R_{c-1} per chunk (the forward's prefix offsets), ``rT_ptr`` R_{NC-1}."""
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
    b_rc = load_offset(rT_ptr + i_bh, False, True, ACC)  # R_c, from c = NC - 1 down
    for i_r in range(0, NC):
        i_c = NC - 1 - i_r
        i_blk = i_bh * NC + i_c
        tl.store(ds_ptr + i_blk * M * E + o_fe, b_ds, mask=m_fe)
        tl.store(dz_ptr + i_blk * M + o_f, b_dz, mask=m_f)
        b_rp = tl.load(r_ptr + i_blk)  # R_{c-1}
        b_f = tl.exp(b_rp - b_rc)
        b_ds = b_ds * b_f + tl.load(L_ptr + i_blk * M * E + o_fe, mask=m_fe, other=0.0)
        b_dz = b_dz * b_f + tl.load(l_ptr + i_blk * M + o_f, mask=m_f, other=0.0)
        b_rc = b_rp
    if HAS_INIT:  # at R_{-1}, the initial state's offset
        tl.store(ds0_ptr + i_bh * M * E + o_fe, b_ds, mask=m_fe)
        tl.store(dz0_ptr + i_bh * M + o_f, b_dz, mask=m_f)


@triton.jit
def _chunk_bwd_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr,
    xi_ptr, s_ptr, z_ptr, r_ptr, ds_ptr, dz_ptr, o_ptr, do_ptr, mq_ptr, den_ptr, mk_ptr,
    dq_ptr, dk_ptr, dv_ptr,
    T, H, NC, G,
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
    """dq [BT, D] of chunk c for each of the G query heads of key/value head (b, h), and dk
    [BT, D], dv [BT, E] summed over them (inter-chunk states + masked intra terms), every row
    and key at the forward's offsets: prefix S_c at R_{c-1} read by row i times w_i =
    exp(R_{c-1} - r_i), pair (i, j) times exp(m_j - r_i), key j's share of the later rows'
    cotangent D_c (at R_c) times exp(m_j - R_c); every factor <= 1."""
    i_c, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    i_blk = i_bh * NC + i_c
    o_t = i_c.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_q, m_d, m_e = o_t < T, o_d < D, o_e < E
    m_k = valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    m_tril = o_t[:, None] >= o_t[None, :]  # [BT(i), BT(j)]
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_scq = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_sck = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh
    b_xk = load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_k, m_d, ACC) * b_sck[None, :]
    b_v = load_rows(v_base, o_t, o_e, stride_vt, stride_ve, m_k, m_e, ACC)  # [BT, BE]
    b_mk = tl.load(mk_ptr + i_bh * T + o_t, mask=m_q, other=NEG)
    b_rp = tl.load(r_ptr + i_blk)  # R_{c-1}
    b_ri = _row_offsets(b_rp, b_mk, m_tril)
    b_wr = tl.exp(b_rp - b_ri)  # [BT] the prefix's factor per row
    b_kf = tl.exp(b_mk - tl.maximum(b_rp, tl.max(b_mk, axis=0)))  # [BT] exp(m_j - R_c)
    b_decay = tl.where(m_tril & m_k[None, :], _intra_decay(b_mk, b_ri), 0.0)
    b_dxk = tl.zeros([BT, BD], dtype=ACC)
    b_dv = tl.zeros([BT, BE], dtype=ACC)
    for g in range(0, G):  # each query head of the group: its dq, its share of dk and dv
        i_hq = i_h * G + g
        q_base = q_ptr + i_b * stride_qb + i_hq * stride_qh
        b_xq = load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, ACC) * b_scq[None, :]
        b_mq = tl.load(mq_ptr + (i_bh * G + g) * T + o_t, mask=m_q, other=0.0)
        b_g, b_c = query_cotangents(do_ptr + i_b * stride_dob + i_hq * stride_doh,
                                     o_ptr + i_b * stride_ob + i_hq * stride_oh, den_ptr,
                                     i_bh * G + g, o_t, o_e, T, m_q, m_e, stride_dot, stride_doe,
                                     stride_ot, stride_oe, ACC)  # fmt: skip
        # dK_ij = (v_j . g_i + c_i) exp(m_j - r_i), causal: [BT, BE] @ [BE, BT] -> [BT, BT]
        b_dK = tl.dot(b_g, tl.trans(b_v), input_precision=PRECISION, out_dtype=ACC)
        b_dK = tl.where(m_tril, (b_dK + b_c[:, None]) * b_decay, 0.0)
        b_dxq = tl.zeros([BT, BD], dtype=ACC)
        b_A = tl.zeros([BT, BT], dtype=ACC)
        for i_m in range(0, NMT):
            o_f = i_m * BM + tl.arange(0, BM)
            m_f = o_f < M
            m_fe = m_f[:, None] & m_e[None, :]
            o_fe = o_f[:, None] * E + o_e[None, :]
            b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
            b_uq, b_gq, b_g1q, b_g2q = feature_tile(
                b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # fmt: skip
            b_eq = tl.where(m_q[:, None] & m_f[None, :], tl.exp(b_uq - b_mq[:, None]), 0.0)
            b_a = b_gq * b_eq  # [BT, BM]
            b_uk, b_gk, b_g1k, b_g2k = feature_tile(
                b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # fmt: skip
            b_ek = tl.where(m_k[:, None] & m_f[None, :], tl.exp(b_uk - b_mk[:, None]), 0.0)
            b_b = b_gk * b_ek  # [BT, BM]
            b_s = tl.load(s_ptr + i_blk * M * E + o_fe, mask=m_fe, other=0.0)  # [BM, BE]
            b_z = tl.load(z_ptr + i_blk * M + o_f, mask=m_f, other=0.0)
            # da = w (g S^T + c z) + dK b:  [BT, BE] @ [BE, BM] and [BT, BT] @ [BT, BM]
            b_da = tl.dot(b_g, tl.trans(b_s), input_precision=PRECISION, out_dtype=ACC)
            b_da = (b_da + b_c[:, None] * b_z[None, :]) * b_wr[:, None]
            b_da += tl.dot(b_dK, b_b, input_precision=PRECISION, out_dtype=ACC)
            b_dxq += feature_dx(b_a * b_da, b_eq * b_da, b_g1q, b_g2q, b_xq, b_w, o_f, m_f,
                                 o_d, m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM, FEATURE,
                                 False, PRECISION, TINY)  # fmt: skip
            # db = dK^T a (+ kf (v D^T + dz), the later chunks' cotangent, once per key and not
            # once per query head): [BT, BT] @ [BT, BM] and [BT, BE] @ [BE, BM]
            b_db = tl.dot(tl.trans(b_dK), b_a, input_precision=PRECISION, out_dtype=ACC)
            if g == 0:
                b_ds = tl.load(ds_ptr + i_blk * M * E + o_fe, mask=m_fe, other=0.0)  # [BM, BE]
                b_dz = tl.load(dz_ptr + i_blk * M + o_f, mask=m_f, other=0.0)
                b_dbs = tl.dot(b_v, tl.trans(b_ds), input_precision=PRECISION, out_dtype=ACC)
                b_db += (b_dbs + b_dz[None, :]) * b_kf[:, None]
                # inter-chunk dv = kf b D: [BT, BM] @ [BM, BE]
                b_dv += tl.dot(b_b * b_kf[:, None], b_ds, input_precision=PRECISION,
                               out_dtype=ACC)  # fmt: skip
            b_dxk += feature_dx(b_b * b_db, b_ek * b_db, b_g1k, b_g2k, b_xk, b_w, o_f, m_f,
                                 o_d, m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM, FEATURE,
                                 True, PRECISION, TINY)  # fmt: skip
            # intra dv needs A = a b^T over all features
            b_A += tl.dot(b_a, tl.trans(b_b), input_precision=PRECISION, out_dtype=ACC)
        b_A = tl.where(m_tril & m_k[None, :], b_A * b_decay, 0.0)
        b_dv += tl.dot(tl.trans(b_A), b_g, input_precision=PRECISION, out_dtype=ACC)  # [BT, BE]
        store_tile(dq_ptr, i_b, i_hq, o_t, o_d, stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                    b_dxq * b_scq[None, :], m_q, m_d)  # fmt: skip
    store_tile(dk_ptr, i_b, i_h, o_t, o_d, stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                b_dxk * b_sck[None, :], m_q, m_d)  # fmt: skip
    store_tile(dv_ptr, i_b, i_h, o_t, o_e, stride_dvb, stride_dvh, stride_dvt, stride_dve,
                b_dv, m_q, m_e)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# launchers


def _states(c: Setup, k, v, initial_state):
    """Launch the local and scan kernels: prefix states per chunk at R_{c-1} with the offsets
    R_{c-1}, and the final state."""
    B, H, T, M, E, NMT, bt = c.B, c.H, c.Tk, c.M, c.E, c.NMT, c.BT
    NC = max(cdiv(T, bt), 1)
    h = c.acc_empty(B * H * NC, M, E)
    hz = c.acc_empty(B * H * NC, M)
    hm = c.acc_empty(B * H * NC, NMT)
    meta = dict(**c.launch_options(), **c.meta)
    launch(_chunk_local_kernel, (NMT, NC, B * H),
        k, v, c.w, c.pad[0], *c.form_ptrs, c.maps[1], h, hz, hm,
        T, H, NC, *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
        BT=bt, HAS_PAD=c.has_pad, HAS_MAP=c.has_map, **meta,
    )  # fmt: skip
    s = c.acc_empty(B * H * NC, M, E)
    z = c.acc_empty(B * H * NC, M)
    r = c.acc_empty(B * H * NC)
    sT, zT, rT = c.acc_empty(B, H, M, E), c.acc_empty(B, H, M), c.acc_empty(B, H)
    if initial_state is not None:
        s0, z0, r0 = (x.to(c.acc).contiguous() for x in initial_state)
    else:
        s0 = z0 = r0 = sT  # never read
    launch(_chunk_scan_kernel, (NMT, B * H),
        h, hz, hm, s0, z0, r0, s, z, r, sT, zT, rT, NC,
        M=M, E=E, BM=c.BM, BE=c.BE, BP=next_pow2(NMT), HAS_INIT=initial_state is not None,
        PLAIN=c.plain, ACC=c.ACC, **c.launch_options(),
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
        q: ``[B, H * G, T, D]``; k: ``[B, H, T, D]``; v: ``[B, H, T, E]`` (any strides, one
            dtype): G query heads per key/value head (grouped-query attention, query head
            ``h * G + g`` reads key/value head h; G = 1 otherwise). Key features, chunk states
            and the returned state are per key/value head.
        form, scale, key_padding_mask, precision, gpu_tiles: as ``rf_parallel.rf_parallel_fwd``
            (every kernel form).
        initial_state: optional ``(S [B, H, M, E], z [B, H, M], offset [B, H])`` to continue, in
            ``rfattn.RFState``'s convention (offset -inf before any valid key).
        return_aux: also return what the backward needs.

    Returns:
        ``(out [B, H * G, T, E], (S, z, offset))`` with the final state ``[B, H, ...]`` in the
        accumulation dtype and ``rfattn.RFState``'s convention; with ``return_aux`` also
        ``(m_q, den, m_k)``: the queries' offsets and the denominators at the rows' offsets r_i
        (``[B*H*G, T]``) and the keys' max logits m_j (``[B*H, T]``).
    """
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs Tq == Tk, got {q.shape[2]} and {k.shape[2]}")
    c = launch_setup(q, k, v, form, scale, key_padding_mask, precision, causal=True,
               gpu_tiles=gpu_tiles)  # fmt: skip
    B, H, G, T, E, bt = c.B, c.H, c.G, c.Tq, c.E, c.BT
    out = torch.empty(B, H * G, T, E, device=q.device, dtype=q.dtype)
    aux = mq, den, mk = c.acc_empty(B * H * G, T), c.acc_empty(B * H * G, T), c.acc_empty(B * H, T)
    if B * H == 0:
        state = (c.acc_empty(B, H, c.M, E), c.acc_empty(B, H, c.M),
                 c.acc_empty(B, H))  # fmt: skip
        return (out, state, aux) if return_aux else (out, state)
    NC, (s, z, r), state = _states(c, k, v, initial_state)
    if T:
        launch(_chunk_out_kernel, (NC, B * H),
            q, k, v, c.w, c.pad[0], *c.form_ptrs, *c.maps, s, z, r, out, mq, den, mk,
            T, H, NC, G, *q.stride(), *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
            *out.stride(), BT=bt, HAS_PAD=c.has_pad, HAS_MAP=c.has_map, **c.launch_options(),
            **c.meta,
        )  # fmt: skip
    return (out, state, aux) if return_aux else (out, state)


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
        out, aux: the forward's output and ``(m_q, den, m_k)``; the rest as given to the forward.

    Returns:
        ``(dq, dk, dv, dS0, dz0)``; the last two are None without ``initial_state``.
    """
    c = launch_setup(q, k, v, form, scale, key_padding_mask, precision, causal=True,
               gpu_tiles=gpu_tiles)  # fmt: skip
    check_forward_only(c)
    B, H, T, M, E, NMT, bt = c.B, c.H, c.Tq, c.M, c.E, c.NMT, c.BT
    mq, den, mk = aux
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    has_init = initial_state is not None
    ds0 = c.acc_empty(B, H, M, E) if has_init else None
    dz0 = c.acc_empty(B, H, M) if has_init else None
    if B * H == 0:
        return dq, dk, dv, ds0, dz0
    NC, (s, z, r), (_, _, rT) = _states(c, k, v, initial_state)
    meta = dict(**c.launch_options(), BT=bt, **c.meta)
    L = c.acc_empty(B * H * NC, M, E)
    l_ = c.acc_empty(B * H * NC, M)
    if T:
        launch(_chunk_local_grad_kernel, (NMT, NC, B * H),
            q, c.w, *c.form_ptrs, out, do, mq, den, mk, r, L, l_,
            T, H, NC, c.G, *q.stride(), *c.w.stride(), *out.stride(), *do.stride(), **meta,
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
    launch(_chunk_rscan_kernel, (NMT, B * H),
        L, l_, r, rT, dsT, dzT, ds, dz, ds0 if has_init else ds, dz0 if has_init else dz, NC,
        M=M, E=E, BM=c.BM, BE=c.BE, HAS_DFINAL=dstate is not None, HAS_INIT=has_init,
        ACC=c.ACC, **c.launch_options(),
    )  # fmt: skip
    if T:
        launch(_chunk_bwd_kernel, (NC, B * H),
            q, k, v, c.w, c.pad[0], *c.form_ptrs,
            s, z, r, ds, dz, out, do, mq, den, mk, dq, dk, dv, T, H, NC, c.G,
            *q.stride(), *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
            *out.stride(), *do.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
            HAS_PAD=c.has_pad, **meta,
        )  # fmt: skip
    return dq, dk, dv, ds0, dz0
