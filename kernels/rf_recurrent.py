"""Fused causal decode step: a few tokens against a carried state, per (b, h), in one launch.

For each new token t in order (the state (S [M, E], z [M], R) in the accumulation dtype):

    R' = max(R, max_f u_k(t))                              (valid keys only; running offset)
    S <- S exp(R - R') + b_t v_t^T,  z <- z exp(R - R') + b_t,   b_t = g_k exp(u_k(t) - R')
    out_t = a_t S / a_t z,  a_t = g_q exp(u_q(t) - max_f u_q(t))   (safe_denominator policy)

This is exactly the chunked form (``rf_chunk``) with chunks of one token: the same features
(``common._feature_tile``), offsets and denominator policy, so a state from either
continues in the other. Cost O(M (D + E)) per token and (b, h), whatever the position: the
generation path. One program per (b, h) walks the tokens and the M tiles of its state, which it
updates in place in the output state buffers (the caller's initial state is copied first
unless ``inplace=True``).

Forward only (generation runs without gradients); ``rfattn.rf_attention`` uses it for causal
calls of at most :data:`MAX_TOKENS` tokens that need no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    _NEG,
    _check_inputs,
    _feature_tile,
    _gerf_coeffs,
    _input_scale,
    _load_rows,
    _load_w,
    _offsets_in,
    _offsets_out,
    _safe_den,
    _Setup,
    _valid_keys,
)

__all__ = ["rf_recurrent_fwd", "MAX_TOKENS"]

#: the most tokens a call sends through the recurrent step (longer ones use rf_chunk)
MAX_TOKENS = 16


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    s_ptr, z_ptr, r_ptr, o_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_ob, stride_oh, stride_ot, stride_oe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """T tokens of one (b, h) against its state (S, z, R), updated in place."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    # one token per step, as a 16-row tile (row 0 live): tl.dot needs >= 16 rows
    o_r = tl.arange(0, 16)
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_scq = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_sck = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh
    b_r = tl.load(r_ptr + i_bh)
    for t in range(0, T):
        o_t = t + o_r * 0  # [16], all rows point at token t
        m_row = o_r == 0
        m_k = _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD) & m_row
        b_xq = _load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_row, m_d, ACC) * b_scq[None, :]
        b_xk = _load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_k, m_d, ACC) * b_sck[None, :]
        b_v = _load_rows(v_base, o_t, o_e, stride_vt, stride_ve, m_k, m_e, ACC)  # [16, BE]
        # pass 1: the key's max logit over all features -> the new running offset
        b_rn = b_r
        for i_m in range(0, NMT):
            o_f = i_m * BM + tl.arange(0, BM)
            m_f = o_f < M
            b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)
            b_uk, b_gk, b_g1, b_g2 = _feature_tile(
                b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # fmt: skip
            b_uk = tl.where(m_k[:, None] & m_f[None, :], b_uk, float("-inf"))
            b_rn = tl.maximum(b_rn, tl.max(tl.max(b_uk, axis=1), axis=0))
        b_alpha = tl.exp(b_r - b_rn)
        # pass 2: rescale and update the state tiles, and read the query against them
        b_mx = tl.full([16], _NEG, dtype=ACC)
        b_num = tl.zeros([16, BE], dtype=ACC)
        b_den = tl.zeros([16], dtype=ACC)
        for i_m in range(0, NMT):
            o_f = i_m * BM + tl.arange(0, BM)
            m_f = o_f < M
            m_fe = m_f[:, None] & m_e[None, :]
            p_s = s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :]
            p_z = z_ptr + i_bh * M + o_f
            b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)
            b_uk, b_gk, b_g1, b_g2 = _feature_tile(
                b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # fmt: skip
            b_b = b_gk * tl.where(m_k[:, None] & m_f[None, :], tl.exp(b_uk - b_rn), 0.0)
            # [BM, 16] @ [16, BE] -> [BM, BE]
            b_s = tl.load(p_s, mask=m_fe, other=0.0) * b_alpha + tl.dot(
                tl.trans(b_b), b_v, input_precision=PRECISION, out_dtype=ACC
            )
            b_z = tl.load(p_z, mask=m_f, other=0.0) * b_alpha + tl.sum(b_b, axis=0)
            tl.store(p_s, b_s, mask=m_fe)
            tl.store(p_z, b_z, mask=m_f)
            b_uq, b_gq, b_g1, b_g2 = _feature_tile(
                b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # fmt: skip
            b_uq = tl.where(m_f[None, :], b_uq, float("-inf"))
            b_mx_new = tl.maximum(b_mx, tl.max(b_uq, axis=1))
            b_beta = tl.exp(b_mx - b_mx_new)
            b_a = b_gq * tl.exp(b_uq - b_mx_new[:, None])  # [16, BM]
            # [16, BM] @ [BM, BE] -> [16, BE]
            b_num = b_num * b_beta[:, None] + tl.dot(b_a, b_s, input_precision=PRECISION,
                                                     out_dtype=ACC)  # fmt: skip
            b_den = b_den * b_beta + tl.sum(b_a * b_z[None, :], axis=1)
            b_mx = b_mx_new
        b_den = _safe_den(b_den, TINY)
        b_o = b_num / b_den[:, None]
        p_o = o_ptr + i_b * stride_ob + i_h * stride_oh + t * stride_ot + o_e[None, :] * stride_oe
        tl.store(p_o + o_r[:, None] * 0, b_o.to(o_ptr.dtype.element_ty),
                 mask=m_row[:, None] & m_e[None, :])  # fmt: skip
        b_r = b_rn
    tl.store(r_ptr + i_bh, b_r)


def rf_recurrent_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: tuple | None = None,
    precision: str | None = None,
    feature: str = "gerf",
    gerf: torch.Tensor | None = None,
    psi: torch.Tensor | None = None,
    table: torch.Tensor | None = None,
    extra_rows: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
    inplace: bool = False,
):
    """Causal decode step over ``T <= MAX_TOKENS`` tokens (no gradient).

    Args:
        q, k: ``[B, H, T, D]``; v: ``[B, H, T, E]``; the feature arguments as
            ``rf_parallel.rf_parallel_fwd``.
        initial_state: ``(S [B, H, M, E], z [B, H, M], offset [B, H])`` (None: empty).
        inplace: update ``initial_state``'s tensors themselves (contiguous, accumulation dtype)
            instead of copies.

    Returns:
        ``(out [B, H, T, E], (S, z, offset))``.
    """
    _check_inputs(q, k, v, w, key_padding_mask)
    if q.shape[2] != k.shape[2] or q.shape[2] > MAX_TOKENS:
        raise ValueError(f"the decode step takes Tq == Tk <= {MAX_TOKENS} tokens, got "
                         f"{q.shape[2]} and {k.shape[2]}")  # fmt: skip
    c = _Setup(q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi, table,
               extra_rows, index)  # fmt: skip
    B, H, T, M, E, dev = c.B, c.H, c.Tq, c.M, c.E, q.device
    if initial_state is None:
        s = torch.zeros(B, H, M, E, device=dev, dtype=c.acc)
        z = torch.zeros(B, H, M, device=dev, dtype=c.acc)
        r = torch.full((B, H), _NEG.value, device=dev, dtype=c.acc)
    else:
        s0, z0, r0 = initial_state
        ok = all(x.dtype == c.acc and x.is_contiguous() for x in (s0, z0, r0))
        if inplace and not ok:
            raise ValueError("inplace=True needs a contiguous state in the accumulation dtype")
        s, z = (s0, z0) if inplace else (s0.to(c.acc).clone(), z0.to(c.acc).clone())
        finite = _offsets_in(r0)
        if inplace:
            r0.copy_(finite)
            r = r0
        else:
            r = finite.to(c.acc).clone()
    out = torch.empty(B, H, T, E, device=dev, dtype=q.dtype)
    if B * H and T:
        _recurrent_kernel[(B * H,)](
            q, k, v, c.w, c.pad[0], c.scale, c.ab, c.psi, c.tab, c.xr, c.xi, s, z, r, out,
            T, H, *q.stride(), *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
            *out.stride(), HAS_PAD=c.has_pad, **c.launch_options(num_warps=4), **c.meta,
        )  # fmt: skip
    r.copy_(_offsets_out(r))
    return out, (s, z, r)
