"""Fused non-causal random-feature attention, forward and backward, per (b, h):

    x = sqrt(scale) * q (or k)                                   [T, D]
    u = x W^T - |x|^2 / 2                                        [T, M]   (posrf logits; the
                                                                 general form is below)
    a_i = exp(u_q(i) - m_i)      (m_i: per-row max over features)
    b_j = exp(u_k(j) - m_K)      (m_K: one offset per (b, h), over valid keys and features)
    S = sum_j b_j v_j^T   z = sum_j b_j                          [M, E], [M]   (accumulator dtype)
    out_i = a_i S / a_i z                                        [T, E]

Forward, three launches (phi never touches HBM):

1. key pass ``_fwd_kv_kernel``, grid (M tiles, T splits, B*H): projection on ``tl.dot``, running
   max ``m`` of the logits over the program's keys and features with flash-style rescaling of the
   partial (S, z); writes the partial (m, S, z);
2. merge ``_fwd_merge_kernel``, grid (M tiles, B*H): ``m_K`` = max of the partial maxima of the
   (b, h); partials rescaled by ``exp(m - m_K)`` and summed in a fixed order (deterministic);
3. query pass ``_fwd_q_kernel``, grid (Tq tiles, B*H): features per M tile with an online
   per-row max, ``out = num / den`` with the denominator policy of
   ``rfattn.reference.safe_denominator``; saves the row max m_i and den_i for the backward.

Backward (features recomputed, never stored; same offsets m_i, m_K as the forward). With
``g_i = do_i / den_i`` and ``c_i = -(do_i . out_i) / den_i``:

    da_i = S g_i + c_i z          dS = sum_i a_i g_i^T          dz = sum_i c_i a_i
    db_j = dS v_j + dz            dv_j = dS^T b_j
    du = a * da (queries), b * db (keys);  dx = du W - rowsum(du) x;  dq = sqrt(scale) dx
    dW = sum_i du_q(i) x_i^T + sum_j du_k(j) y_j^T    (only when W needs a gradient)

4. ``_bwd_ds_kernel``, grid (M tiles, Tq splits, B*H): partial dS, dz (and dW from queries);
5. ``_bwd_dq_kernel``, grid (Tq tiles, B*H): dq;
6. ``_bwd_dkv_kernel``, grid (Tk tiles, B*H): dk, dv;
7. ``_bwd_dwk_kernel``, grid (M tiles, Tk splits, B*H): dW from keys (only when needed).
Partials over splits are summed in a fixed order (torch ``sum``): no atomics.

Padded keys (``key_padding_mask`` True) and rows past T are excluded from m_K, S, z and get zero
gradients; their contents are never used. A (b, h) without valid keys gives zeros.
Reference: ``rfattn.reference.linear_attention`` on ``RandomFeatures.features`` (float64, same W).

Layout: q, k ``[B, H, T, D]``, v ``[B, H, T, E]`` with arbitrary strides; W ``[M, D]``.
Limits: inputs fp32/fp16/bf16/fp64, one dtype; W is cast to it for the projection. Accumulation is
fp32 (fp64 for fp64 inputs). Any D, E, M (tiles padded to powers of two >= 16; register pressure
grows with D and E, meant for <= 256), any T >= 0, Tq != Tk.
Feature kinds (constexpr ``FEATURE``): 0 = the real positive GERF family
``u = A |w|^2 + B w . x~ - |x~|^2 / 2`` with per-(b, h) A, B (``gerf``) and input scales psi
(``x~ = sqrt(scale) psi x`` for queries, ``sqrt(scale) x / psi`` for keys): posrf (A = 0, B = 1,
psi = 1), hyprf (posrf on the rows [W; -W]), real gerf, oprf (A, B from statistics) and saderf
(A, B and psi from statistics). The per-(b, h) constant log D cancels with the offsets and is
dropped. A, B, psi are inputs held constant: no gradient flows to them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["rf_parallel_fwd", "rf_parallel_bwd", "FEATURE_IDS", "INTERPRET"]

#: Whether kernels were decorated under the Triton interpreter (read once, at import).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: feature name -> constexpr id understood by the kernels
FEATURE_IDS = {"gerf": 0}
#: running-max sentinel: finite so that exp(sentinel - sentinel) = 1, not NaN
_NEG = tl.constexpr(-1.0e30)
_PRECISIONS = ("ieee", "tf32", "tf32x3")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: tokens handled by one split program: a multiple of every BT in the configs
_SPLIT_QUANTUM = 128


def _configs(bts=(32, 64, 128), warps=(4, 8)):
    """Autotune configs (BT, num_warps); a single config under the interpreter."""
    if INTERPRET:
        return [triton.Config({"BT": 64}, num_warps=1)]
    return [triton.Config({"BT": bt}, num_warps=w) for bt in bts for w in warps]


# Autotune keys: sizes and feature kind, never T (STYLE.md).
_KEY = ["D", "M", "E", "FEATURE", "ACC"]


@triton.jit
def _gerf_coeffs(ab_ptr, i_bh, HAS_AB: tl.constexpr, ACC: tl.constexpr):
    """(A, B) of the (b, h) in ``u = A |w|^2 + B w . x~ - |x~|^2 / 2`` (posrf: A = 0, B = 1)."""
    if HAS_AB:
        b_ca = tl.load(ab_ptr + i_bh * 2).to(ACC)
        b_cb = tl.load(ab_ptr + i_bh * 2 + 1).to(ACC)
    else:
        b_ca = tl.zeros([], dtype=ACC)
        b_cb = tl.full([], 1.0, dtype=ACC)
    return b_ca, b_cb


@triton.jit
def _input_scale(
    scale_ptr, psi_ptr, i_bh, o_d, m_d,
    D: tl.constexpr, BD: tl.constexpr, HAS_PSI: tl.constexpr, IS_KEY: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """[BD] multiplier of raw rows giving x~: sqrt(scale) psi (queries), / psi (keys)."""
    b_sc = tl.load(scale_ptr).to(ACC) * tl.full([BD], 1.0, dtype=ACC)
    if HAS_PSI:
        b_psi = tl.load(psi_ptr + i_bh * D + o_d, mask=m_d, other=1.0).to(ACC)
        if IS_KEY:
            b_sc = b_sc / b_psi
        else:
            b_sc = b_sc * b_psi
    return b_sc


@triton.jit
def _logits_tile(b_xs, b_w, b_ca, b_cb, FEATURE: tl.constexpr, PRECISION: tl.constexpr):
    """Logits u [BT, BM] of inputs x~ b_xs [BT, BD] (acc dtype) against rows b_w [BM, BD]."""
    # [BT, BD] @ [BD, BM] -> [BT, BM]
    b_u = tl.dot(b_xs.to(b_w.dtype), tl.trans(b_w), input_precision=PRECISION, out_dtype=b_xs.dtype)
    if FEATURE == 0:  # real positive GERF: A |w|^2 + B w . x~ - |x~|^2 / 2
        b_wf = b_w.to(b_xs.dtype)
        b_nw = tl.sum(b_wf * b_wf, axis=1)  # [BM]
        b_u = b_ca * b_nw[None, :] + b_cb * b_u - 0.5 * tl.sum(b_xs * b_xs, axis=1)[:, None]
    return b_u


@triton.jit
def _dlogits_dx_tile(b_du, b_xs, b_w, b_cb, FEATURE: tl.constexpr, PRECISION: tl.constexpr):
    """d(sum du * u)/dx~ [BT, BD] for one M tile: du [BT, BM], x~ [BT, BD], w [BM, BD]."""
    # [BT, BM] @ [BM, BD] -> [BT, BD]
    b_dx = tl.dot(b_du, b_w.to(b_du.dtype), input_precision=PRECISION, out_dtype=b_du.dtype)
    if FEATURE == 0:  # du/dx~ = B w_f - x~
        b_dx = b_cb * b_dx - tl.sum(b_du, axis=1)[:, None] * b_xs
    return b_dx


@triton.jit
def _dlogits_dw_tile(b_du, b_xs, b_w, b_ca, b_cb, FEATURE: tl.constexpr, PRECISION: tl.constexpr):
    """d(sum du * u)/dW [BM, BD] for one token tile: du [BT, BM], x~ [BT, BD], w [BM, BD]."""
    # [BM, BT] @ [BT, BD] -> [BM, BD]
    b_dw = tl.dot(tl.trans(b_du), b_xs, input_precision=PRECISION, out_dtype=b_du.dtype)
    if FEATURE == 0:  # du/dw_f = B x~ + 2 A w_f
        b_dw = b_cb * b_dw + 2.0 * b_ca * tl.sum(b_du, axis=0)[:, None] * b_w.to(b_du.dtype)
    return b_dw


@triton.jit
def _load_rows(base, o_t, o_c, stride_t, stride_c, m_t, m_c, ACC: tl.constexpr):
    """A [BT, BC] tile of a [T, C] matrix (zeros outside), upcast to ACC."""
    p = base + o_t[:, None] * stride_t + o_c[None, :] * stride_c
    return tl.load(p, mask=m_t[:, None] & m_c[None, :], other=0.0).to(ACC)


@triton.jit
def _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD: tl.constexpr):
    """[BT] bool: key rows inside T and not padded."""
    m_t = o_t < T
    if HAS_PAD:
        b_pad = tl.load(pad_ptr + i_b * stride_pb + o_t * stride_pt, mask=m_t, other=1)
        m_t = m_t & (b_pad == 0)
    return m_t


@triton.autotune(configs=_configs(), key=_KEY)
@triton.jit
def _fwd_kv_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, sp_ptr, zp_ptr, mp_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr,
):  # fmt: skip
    """Partial (m, S, z) of one M tile over one T split of one (b, h)."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
    b_w = tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh

    b_s = tl.zeros([BM, BE], dtype=ACC)
    b_z = tl.zeros([BM], dtype=ACC)
    b_mx = tl.full([], _NEG, dtype=ACC)
    t0 = i_s.to(tl.int64) * t_per_split
    for t in range(0, t_per_split, BT):
        o_t = t0 + t + tl.arange(0, BT)
        m_t = _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
        b_xs = _load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, ACC) * b_sc[None, :]
        b_u = _logits_tile(b_xs, b_w, b_ca, b_cb, FEATURE, PRECISION)  # [BT, BM]
        b_u = tl.where(m_t[:, None] & m_f[None, :], b_u, float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(tl.max(b_u, axis=1), axis=0))
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_p = tl.exp(b_u - b_mx_new)  # [BT, BM], 0 on invalid rows / features
        p_v = v_base + o_t[:, None] * stride_vt + o_e[None, :] * stride_ve
        b_v = tl.load(p_v, mask=m_t[:, None] & m_e[None, :], other=0.0)  # padded values unread
        # [BM, BT] @ [BT, BE] -> [BM, BE]
        b_pv = tl.dot(tl.trans(b_p).to(b_v.dtype), b_v, input_precision=PRECISION, out_dtype=ACC)
        b_s = b_s * b_alpha + b_pv
        b_z = b_z * b_alpha + tl.sum(b_p, axis=0)
        b_mx = b_mx_new

    i_part = i_bh * NUM_SPLITS + i_s  # partial index: [B*H, NUM_SPLITS]
    p_s = sp_ptr + i_part * M * E + o_f[:, None] * E + o_e[None, :]
    tl.store(p_s, b_s, mask=m_f[:, None] & m_e[None, :])
    tl.store(zp_ptr + i_part * M + o_f, b_z, mask=m_f)
    tl.store(mp_ptr + i_part * NMT + i_m, b_mx)


@triton.jit
def _fwd_merge_kernel(
    sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr, mk_ptr,
    NUM_SPLITS,
    M: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """S, z of one M tile of one (b, h): partials rescaled to the common key offset, summed."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NMT: tl.constexpr = (M + BM - 1) // BM
    # the (b, h) offset m_K: max over every partial (all splits, all M tiles)
    b_off = tl.full([], _NEG, dtype=ACC)
    n_part = NUM_SPLITS * NMT
    for i_p in range(0, n_part, BP):
        o_p = i_p + tl.arange(0, BP)
        b_mp = tl.load(mp_ptr + i_bh * n_part + o_p, mask=o_p < n_part, other=_NEG)
        b_off = tl.maximum(b_off, tl.max(b_mp, axis=0))
    o_f, o_e = i_m * BM + tl.arange(0, BM), tl.arange(0, BE)
    m_f, m_e = o_f < M, o_e < E
    b_s = tl.zeros([BM, BE], dtype=ACC)
    b_z = tl.zeros([BM], dtype=ACC)
    for i_s in range(0, NUM_SPLITS):
        i_part = i_bh * NUM_SPLITS + i_s
        b_alpha = tl.exp(tl.load(mp_ptr + i_part * NMT + i_m) - b_off)
        p_s = sp_ptr + i_part * M * E + o_f[:, None] * E + o_e[None, :]
        b_s += b_alpha * tl.load(p_s, mask=m_f[:, None] & m_e[None, :], other=0.0)
        b_z += b_alpha * tl.load(zp_ptr + i_part * M + o_f, mask=m_f, other=0.0)
    p_s = s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :]
    tl.store(p_s, b_s, mask=m_f[:, None] & m_e[None, :])
    tl.store(z_ptr + i_bh * M + o_f, b_z, mask=m_f)
    if i_m == 0:
        tl.store(mk_ptr + i_bh, b_off)


@triton.autotune(configs=_configs(), key=_KEY)
@triton.jit
def _fwd_q_kernel(
    q_ptr, w_ptr, scale_ptr, ab_ptr, psi_ptr, s_ptr, z_ptr, o_ptr, mq_ptr, den_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """out [BT, E] of one query tile of one (b, h): online per-row max over M tiles."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_t, m_d, m_e = o_t < T, o_d < D, o_e < E
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)  # [BD]
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh
    b_xs = _load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_t, m_d, ACC) * b_sc[None, :]
    b_mx = tl.full([BT], _NEG, dtype=ACC)
    b_num = tl.zeros([BT, BE], dtype=ACC)
    b_den = tl.zeros([BT], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
        b_w = tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
        b_u = _logits_tile(b_xs, b_w, b_ca, b_cb, FEATURE, PRECISION)  # [BT, BM]
        b_u = tl.where(m_f[None, :], b_u, float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(b_u, axis=1))  # [BT]
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_p = tl.exp(b_u - b_mx_new[:, None])  # [BT, BM]
        p_s = s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :]
        b_s = tl.load(p_s, mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]
        b_z = tl.load(z_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        # [BT, BM] @ [BM, BE] -> [BT, BE]
        b_num = b_num * b_alpha[:, None] + tl.dot(
            b_p, b_s, input_precision=PRECISION, out_dtype=ACC
        )
        b_den = b_den * b_alpha + tl.sum(b_p * b_z[None, :], axis=1)
        b_mx = b_mx_new
    # denominator policy (rfattn.reference.safe_denominator): |den| < tiny -> sign(den) * tiny
    eps = tl.full([], TINY, ACC)
    b_den = tl.where(tl.abs(b_den) < eps, tl.where(b_den < 0, -eps, eps), b_den)
    b_o = b_num / b_den[:, None]
    p_o = (
        o_ptr
        + i_b * stride_ob
        + i_h * stride_oh
        + o_t[:, None] * stride_ot
        + o_e[None, :] * stride_oe
    )
    tl.store(p_o, b_o.to(o_ptr.dtype.element_ty), mask=m_t[:, None] & m_e[None, :])
    tl.store(mq_ptr + i_bh * T + o_t, b_mx, mask=m_t)
    tl.store(den_ptr + i_bh * T + o_t, b_den, mask=m_t)


@triton.jit
def _query_cotangents(
    do_base, o_base, den_ptr, i_bh, o_t, o_e, T, m_t, m_e,
    stride_dot, stride_doe, stride_ot, stride_oe, ACC: tl.constexpr,
):  # fmt: skip
    """g = do / den [BT, BE] and c = -(do . out) / den [BT] of one query tile."""
    b_do = _load_rows(do_base, o_t, o_e, stride_dot, stride_doe, m_t, m_e, ACC)
    b_o = _load_rows(o_base, o_t, o_e, stride_ot, stride_oe, m_t, m_e, ACC)
    b_den = tl.load(den_ptr + i_bh * T + o_t, mask=m_t, other=1.0)
    return b_do / b_den[:, None], -tl.sum(b_do * b_o, axis=1) / b_den


@triton.autotune(configs=_configs(), key=_KEY + ["W_GRAD"])
@triton.jit
def _bwd_ds_kernel(
    q_ptr, w_ptr, scale_ptr, ab_ptr, psi_ptr, s_ptr, z_ptr, o_ptr, do_ptr, mq_ptr, den_ptr,
    dsp_ptr, dzp_ptr, dwp_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, W_GRAD: tl.constexpr,
):  # fmt: skip
    """Partial dS [BM, E], dz [BM] (and dW from queries [BM, D]) over one Tq split."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)  # [BD]
    p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
    b_w = tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    b_s = tl.load(s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                  mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
    b_z = tl.load(z_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh
    o_base = o_ptr + i_b * stride_ob + i_h * stride_oh
    do_base = do_ptr + i_b * stride_dob + i_h * stride_doh

    b_ds = tl.zeros([BM, BE], dtype=ACC)
    b_dz = tl.zeros([BM], dtype=ACC)
    b_dw = tl.zeros([BM, BD], dtype=ACC)
    t0 = i_s.to(tl.int64) * t_per_split
    for t in range(0, t_per_split, BT):
        o_t = t0 + t + tl.arange(0, BT)
        m_t = o_t < T
        b_xs = _load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_t, m_d, ACC) * b_sc[None, :]
        b_mq = tl.load(mq_ptr + i_bh * T + o_t, mask=m_t, other=0.0)
        b_u = _logits_tile(b_xs, b_w, b_ca, b_cb, FEATURE, PRECISION)  # [BT, BM]
        b_a = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mq[:, None]), 0.0)
        b_g, b_c = _query_cotangents(do_base, o_base, den_ptr, i_bh, o_t, o_e, T, m_t, m_e,
                                     stride_dot, stride_doe, stride_ot, stride_oe, ACC)  # fmt: skip
        # [BM, BT] @ [BT, BE] -> [BM, BE]
        b_ds += tl.dot(tl.trans(b_a), b_g, input_precision=PRECISION, out_dtype=ACC)
        b_dz += tl.sum(b_a * b_c[:, None], axis=0)
        if W_GRAD:
            # da = g S^T + c z: [BT, BE] @ [BE, BM] -> [BT, BM]
            b_da = (
                tl.dot(b_g, tl.trans(b_s), input_precision=PRECISION, out_dtype=ACC)
                + b_c[:, None] * b_z[None, :]
            )
            # dW_f += sum_t du(t, f) x_t: [BM, BT] @ [BT, BD] -> [BM, BD]
            b_dw += _dlogits_dw_tile(b_a * b_da, b_xs, b_w, b_ca, b_cb, FEATURE, PRECISION)

    i_part = i_bh * NUM_SPLITS + i_s
    tl.store(dsp_ptr + i_part * M * E + o_f[:, None] * E + o_e[None, :], b_ds,
             mask=m_f[:, None] & m_e[None, :])  # fmt: skip
    tl.store(dzp_ptr + i_part * M + o_f, b_dz, mask=m_f)
    if W_GRAD:
        tl.store(dwp_ptr + i_part * M * D + o_f[:, None] * D + o_d[None, :], b_dw,
                 mask=m_f[:, None] & m_d[None, :])  # fmt: skip


@triton.autotune(configs=_configs(), key=_KEY)
@triton.jit
def _bwd_dq_kernel(
    q_ptr, w_ptr, scale_ptr, ab_ptr, psi_ptr, s_ptr, z_ptr, o_ptr, do_ptr, mq_ptr, den_ptr, dq_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr,
):  # fmt: skip
    """dq [BT, D] of one query tile: du_q = a * (g S^T + c z), dq = sqrt(scale) dx."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_t, m_d, m_e = o_t < T, o_d < D, o_e < E
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)  # [BD]
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh
    b_xs = _load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_t, m_d, ACC) * b_sc[None, :]
    b_mq = tl.load(mq_ptr + i_bh * T + o_t, mask=m_t, other=0.0)
    b_g, b_c = _query_cotangents(do_ptr + i_b * stride_dob + i_h * stride_doh,
                                 o_ptr + i_b * stride_ob + i_h * stride_oh, den_ptr, i_bh, o_t,
                                 o_e, T, m_t, m_e, stride_dot, stride_doe, stride_ot, stride_oe,
                                 ACC)  # fmt: skip
    b_dx = tl.zeros([BT, BD], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
        b_w = tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
        b_s = tl.load(s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                      mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
        b_z = tl.load(z_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        b_u = _logits_tile(b_xs, b_w, b_ca, b_cb, FEATURE, PRECISION)  # [BT, BM]
        b_a = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mq[:, None]), 0.0)
        # da = g S^T + c z: [BT, BE] @ [BE, BM] -> [BT, BM]
        b_da = (
            tl.dot(b_g, tl.trans(b_s), input_precision=PRECISION, out_dtype=ACC)
            + b_c[:, None] * b_z[None, :]
        )
        b_dx += _dlogits_dx_tile(b_a * b_da, b_xs, b_w, b_cb, FEATURE, PRECISION)
    p_dq = (
        dq_ptr
        + i_b * stride_dqb
        + i_h * stride_dqh
        + o_t[:, None] * stride_dqt
        + o_d[None, :] * stride_dqd
    )
    tl.store(
        p_dq, (b_dx * b_sc[None, :]).to(dq_ptr.dtype.element_ty), mask=m_t[:, None] & m_d[None, :]
    )


@triton.autotune(configs=_configs(), key=_KEY)
@triton.jit
def _bwd_dkv_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr,
    ds_ptr, dz_ptr, mk_ptr, dk_ptr, dv_ptr,
    T, H,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dve,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr,
):  # fmt: skip
    """dk [BT, D], dv [BT, E] of one key tile: db = v dS^T + dz, du_k = b * db, dv = b dS."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_in, m_d, m_e = o_t < T, o_d < D, o_e < E
    m_t = _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    b_mk = tl.load(mk_ptr + i_bh)
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    b_xs = _load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, ACC) * b_sc[None, :]
    b_v = _load_rows(v_ptr + i_b * stride_vb + i_h * stride_vh, o_t, o_e, stride_vt, stride_ve,
                     m_t, m_e, ACC)  # [BT, BE]  # fmt: skip
    b_dx = tl.zeros([BT, BD], dtype=ACC)
    b_dv = tl.zeros([BT, BE], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
        b_w = tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
        b_ds = tl.load(ds_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                       mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
        b_dz = tl.load(dz_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        b_u = _logits_tile(b_xs, b_w, b_ca, b_cb, FEATURE, PRECISION)  # [BT, BM]
        b_b = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mk), 0.0)
        # db = v dS^T + dz: [BT, BE] @ [BE, BM] -> [BT, BM]
        b_db = tl.dot(b_v, tl.trans(b_ds), input_precision=PRECISION, out_dtype=ACC) + b_dz[None, :]
        b_dx += _dlogits_dx_tile(b_b * b_db, b_xs, b_w, b_cb, FEATURE, PRECISION)
        # [BT, BM] @ [BM, BE] -> [BT, BE]
        b_dv += tl.dot(b_b, b_ds, input_precision=PRECISION, out_dtype=ACC)
    p_dk = (
        dk_ptr
        + i_b * stride_dkb
        + i_h * stride_dkh
        + o_t[:, None] * stride_dkt
        + o_d[None, :] * stride_dkd
    )
    tl.store(
        p_dk, (b_dx * b_sc[None, :]).to(dk_ptr.dtype.element_ty), mask=m_in[:, None] & m_d[None, :]
    )
    p_dv = (
        dv_ptr
        + i_b * stride_dvb
        + i_h * stride_dvh
        + o_t[:, None] * stride_dvt
        + o_e[None, :] * stride_dve
    )
    tl.store(p_dv, b_dv.to(dv_ptr.dtype.element_ty), mask=m_in[:, None] & m_e[None, :])


@triton.autotune(configs=_configs(), key=_KEY)
@triton.jit
def _bwd_dwk_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, ds_ptr, dz_ptr, mk_ptr, dwp_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr,
):  # fmt: skip
    """Partial dW [BM, D] from the keys of one Tk split: sum_j du_k(j, f) y_j."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    b_mk = tl.load(mk_ptr + i_bh)
    p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
    b_w = tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    b_ds = tl.load(ds_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                   mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
    b_dz = tl.load(dz_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh
    b_dw = tl.zeros([BM, BD], dtype=ACC)
    t0 = i_s.to(tl.int64) * t_per_split
    for t in range(0, t_per_split, BT):
        o_t = t0 + t + tl.arange(0, BT)
        m_t = _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
        b_xs = _load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, ACC) * b_sc[None, :]
        b_v = _load_rows(v_base, o_t, o_e, stride_vt, stride_ve, m_t, m_e, ACC)
        b_u = _logits_tile(b_xs, b_w, b_ca, b_cb, FEATURE, PRECISION)  # [BT, BM]
        b_b = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mk), 0.0)
        b_db = tl.dot(b_v, tl.trans(b_ds), input_precision=PRECISION, out_dtype=ACC) + b_dz[None, :]
        # [BM, BT] @ [BT, BD] -> [BM, BD]
        b_dw += _dlogits_dw_tile(b_b * b_db, b_xs, b_w, b_ca, b_cb, FEATURE, PRECISION)
    i_part = i_bh * NUM_SPLITS + i_s
    tl.store(dwp_ptr + i_part * M * D + o_f[:, None] * D + o_d[None, :], b_dw,
             mask=m_f[:, None] & m_d[None, :])  # fmt: skip


# ------------------------------------------------------------------------------------------------
# launchers


def _next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


def _check_inputs(q, k, v, w, key_padding_mask) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, H, T, dim], got shape {tuple(x.shape)}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"{name}: the Triton kernel takes {_DTYPES}, got {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, q has {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    if k.shape[:2] != q.shape[:2] or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"batch/heads differ: q {q.shape}, k {k.shape}, v {v.shape}")
    if k.shape[3] != q.shape[3] or v.shape[2] != k.shape[2]:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if w.dim() != 2 or w.shape[1] != q.shape[3]:
        raise ValueError(f"w must be [M, {q.shape[3]}], got {tuple(w.shape)}")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (k.shape[0], k.shape[2])
    ):
        raise ValueError(f"key_padding_mask must be bool [B, Tk], got {key_padding_mask.shape}")
    if q.device.type == "cpu" and not INTERPRET:
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before "
            "rfattn.kernels is first imported (or use backend='torch')"
        )


def _splits(T: int, programs_per_split: int, device: torch.device, num_splits: int | None):
    """(number of splits, tokens per split) for reductions over T: fill the device twice."""
    quanta = triton.cdiv(T, _SPLIT_QUANTUM)
    if quanta <= 1:
        return 1, _SPLIT_QUANTUM
    if num_splits is None:
        if INTERPRET or device.type != "cuda":
            num_splits = 2  # exercises the merge without slowing the interpreter
        else:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            num_splits = triton.cdiv(2 * sms, programs_per_split)
    per = triton.cdiv(quanta, max(1, min(num_splits, quanta))) * _SPLIT_QUANTUM
    return triton.cdiv(T, per), per


class _Setup:
    """Sizes, tiles and dtypes shared by the forward and backward launchers."""

    def __init__(self, q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi):
        if feature not in FEATURE_IDS:
            raise ValueError(f"feature={feature!r} has no fused kernel; have {sorted(FEATURE_IDS)}")
        self.B, self.H, self.Tq, self.D = q.shape
        self.Tk, self.E, self.M = k.shape[2], v.shape[3], w.shape[0]
        self.BD, self.BE = _next_pow2(self.D), _next_pow2(self.E)
        self.BM = min(64 if max(self.BD, self.BE) <= 128 else 32, _next_pow2(self.M))
        self.NMT = triton.cdiv(self.M, self.BM)
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.ACC = tl.float64 if self.acc == torch.float64 else tl.float32
        if precision is None:
            # fp32 inputs: exact fp32 products unless tf32 is asked for; fp16/bf16 inputs: their
            # fp32 internal products (p @ S, gradients) are rounded far below the input precision.
            precision = "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32"
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.fid = FEATURE_IDS[feature]
        self.w = w.to(device=q.device, dtype=q.dtype)
        self.scale = torch.tensor([float(scale) ** 0.5], device=q.device, dtype=self.acc)
        self.tiny = torch.finfo(self.acc).tiny
        if key_padding_mask is not None:
            pad = key_padding_mask.view(torch.uint8)
            self.pad = (pad, pad.stride(0), pad.stride(1))
        else:
            self.pad = (self.scale, 0, 0)  # never read
        self.has_pad = key_padding_mask is not None
        # per-(b, h) parameters, broadcast from [B, H, ...] or [1, 1, ...]; fp32/fp64 contiguous
        self.ab = self.scale if gerf is None else self._per_head(gerf, (2,), "gerf", q.device)
        self.psi = self.scale if psi is None else self._per_head(psi, (self.D,), "psi", q.device)
        self.meta = dict(D=self.D, M=self.M, E=self.E, BD=self.BD, BM=self.BM, BE=self.BE,
                         FEATURE=self.fid, PRECISION=precision, ACC=self.ACC,
                         HAS_AB=gerf is not None, HAS_PSI=psi is not None)  # fmt: skip

    def _per_head(self, x: torch.Tensor, tail: tuple, name: str, device) -> torch.Tensor:
        """``x`` broadcast to ``[B*H, *tail]`` in the accumulation dtype (the kernels index it)."""
        try:
            x = x.detach().to(device=device, dtype=self.acc).expand(self.B, self.H, *tail)
        except RuntimeError:
            raise ValueError(
                f"{name} must broadcast to [B, H, {', '.join(map(str, tail))}], "
                f"got {tuple(x.shape)}"
            ) from None
        return x.reshape(self.B * self.H, *tail).contiguous()

    def acc_empty(self, *shape, device):
        return torch.empty(*shape, device=device, dtype=self.acc)


def rf_parallel_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    feature: str = "gerf",
    precision: str | None = None,
    num_splits: int | None = None,
    return_aux: bool = False,
    gerf: torch.Tensor | None = None,
    psi: torch.Tensor | None = None,
):
    """Non-causal fused random-feature attention forward.

    Args:
        q: ``[B, H, Tq, D]``; k: ``[B, H, Tk, D]``; v: ``[B, H, Tk, E]`` (any strides, one dtype).
        w: ``[M, D]`` feature rows (cast to the input dtype).
        scale: softmax temperature; inputs are multiplied by ``sqrt(scale)`` before projection.
        key_padding_mask: optional ``[B, Tk]`` bool, True = padding.
        feature: a key of :data:`FEATURE_IDS`.
        precision: ``tl.dot`` input precision for fp32 products ("ieee", "tf32", "tf32x3");
            default "ieee" for fp32/fp64 inputs, "tf32" for fp16/bf16 inputs.
        num_splits: programs sharing one (b, h)'s keys (default: fill the device).
        return_aux: also return what the backward needs.
        gerf: optional ``(A, B)`` per (b, h), broadcastable to ``[B, H, 2]``: logits
            ``A |w|^2 + B w . x~ - |x~|^2 / 2`` (default posrf: A = 0, B = 1). Held constant
            (no gradient).
        psi: optional per-(b, h) input scales, broadcastable to ``[B, H, D]``:
            ``x~ = psi * x`` for queries, ``x~ = x / psi`` for keys (saderf). No gradient.

    Returns:
        ``out [B, H, Tq, E]`` in the input dtype; with ``return_aux`` also
        ``(S [B*H, M, E], z [B*H, M], m_K [B*H], m_q [B*H, Tq], den [B*H, Tq])``.
    """
    _check_inputs(q, k, v, w, key_padding_mask)
    c = _Setup(q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi)
    B, H, Tq, Tk, M, E, NMT, dev = c.B, c.H, c.Tq, c.Tk, c.M, c.E, c.NMT, q.device
    out = torch.empty(B, H, Tq, E, device=dev, dtype=q.dtype)
    s, z, mk = c.acc_empty(B * H, M, E, device=dev), c.acc_empty(B * H, M, device=dev), None
    mq, den = c.acc_empty(B * H, Tq, device=dev), c.acc_empty(B * H, Tq, device=dev)
    if B * H == 0:
        return (out, (s, z, c.acc_empty(0, device=dev), mq, den)) if return_aux else out
    splits, per = _splits(Tk, B * H * NMT, dev, num_splits)
    s_part = c.acc_empty(B * H * splits, M, E, device=dev)
    z_part = c.acc_empty(B * H * splits, M, device=dev)
    m_part = c.acc_empty(B * H * splits, NMT, device=dev)
    _fwd_kv_kernel[(NMT, splits, B * H)](
        k, v, c.w, c.pad[0], c.scale, c.ab, c.psi, s_part, z_part, m_part,
        Tk, H, splits, per if Tk else 0,
        *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
        HAS_PAD=c.has_pad, **c.meta,
    )  # fmt: skip
    mk = c.acc_empty(B * H, device=dev)
    _fwd_merge_kernel[(NMT, B * H)](
        s_part, z_part, m_part, s, z, mk, splits,
        M=M, E=E, BM=c.BM, BE=c.BE, BP=_next_pow2(min(splits * NMT, 1024)), ACC=c.ACC,
    )  # fmt: skip
    if Tq:
        _fwd_q_kernel[lambda meta: (triton.cdiv(Tq, meta["BT"]), B * H)](
            q, c.w, c.scale, c.ab, c.psi, s, z, out, mq, den,
            Tq, H, *q.stride(), *c.w.stride(), *out.stride(),
            TINY=c.tiny, **c.meta,
        )  # fmt: skip
    return (out, (s, z, mk, mq, den)) if return_aux else out


def rf_parallel_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    aux: tuple,
    key_padding_mask: torch.Tensor | None = None,
    feature: str = "gerf",
    precision: str | None = None,
    need_dw: bool = False,
    num_splits: int | None = None,
    gerf: torch.Tensor | None = None,
    psi: torch.Tensor | None = None,
):
    """Backward of :func:`rf_parallel_fwd`: features recomputed, offsets from the forward.

    Args:
        do: ``[B, H, Tq, E]`` cotangent of the output (any strides).
        q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi: as given to the
            forward.
        out, aux: the forward's output and auxiliaries (``return_aux=True``).
        need_dw: also compute the gradient of W.

    Returns:
        ``(dq, dk, dv, dw)``; ``dw`` is None unless ``need_dw`` (then ``[M, D]`` in w's dtype).
    """
    c = _Setup(q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi)
    B, H, Tq, Tk, M, D, E, NMT, dev = c.B, c.H, c.Tq, c.Tk, c.M, c.D, c.E, c.NMT, q.device
    s, z, mk, mq, den = aux
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dw = torch.zeros(M, D, device=dev, dtype=c.acc) if need_dw else None
    if B * H == 0:
        return dq, dk, dv, (dw.to(w.dtype) if need_dw else None)

    splits, per = _splits(Tq, B * H * NMT, dev, num_splits)
    ds_part = c.acc_empty(B * H * splits, M, E, device=dev)
    dz_part = c.acc_empty(B * H * splits, M, device=dev)
    dw_part = c.acc_empty(B * H * splits, M, D, device=dev) if need_dw else ds_part
    _bwd_ds_kernel[(NMT, splits, B * H)](
        q, c.w, c.scale, c.ab, c.psi, s, z, out, do, mq, den, ds_part, dz_part, dw_part,
        Tq, H, splits, per if Tq else 0,
        *q.stride(), *c.w.stride(), *out.stride(), *do.stride(),
        W_GRAD=need_dw, **c.meta,
    )  # fmt: skip
    # fixed-order sums over splits: deterministic
    ds = ds_part.view(B * H, splits, M, E).sum(1)
    dz = dz_part.view(B * H, splits, M).sum(1)
    if need_dw:
        dw += dw_part.view(B * H * splits, M, D).sum(0)
    if Tq:
        _bwd_dq_kernel[lambda meta: (triton.cdiv(Tq, meta["BT"]), B * H)](
            q, c.w, c.scale, c.ab, c.psi, s, z, out, do, mq, den, dq,
            Tq, H, *q.stride(), *c.w.stride(), *out.stride(), *do.stride(), *dq.stride(),
            **c.meta,
        )  # fmt: skip
    if Tk:
        _bwd_dkv_kernel[lambda meta: (triton.cdiv(Tk, meta["BT"]), B * H)](
            k, v, c.w, c.pad[0], c.scale, c.ab, c.psi, ds, dz, mk, dk, dv,
            Tk, H, *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
            *dk.stride(), *dv.stride(),
            HAS_PAD=c.has_pad, **c.meta,
        )  # fmt: skip
        if need_dw:
            ksplits, kper = _splits(Tk, B * H * NMT, dev, num_splits)
            dwk_part = c.acc_empty(B * H * ksplits, M, D, device=dev)
            _bwd_dwk_kernel[(NMT, ksplits, B * H)](
                k, v, c.w, c.pad[0], c.scale, c.ab, c.psi, ds, dz, mk, dwk_part,
                Tk, H, ksplits, kper,
                *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
                HAS_PAD=c.has_pad, **c.meta,
            )  # fmt: skip
            dw += dwk_part.sum(0)
    return dq, dk, dv, (dw.to(w.dtype) if need_dw else None)
