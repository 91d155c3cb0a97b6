"""Fused non-causal random-feature attention, forward and backward, per (b, h):

    x~ = sqrt(scale) * q (or k)                                  [T, D]
    phi_f(x~) = g_f(x~) exp(u_f(x~) - offset)                    [T, F]   (feature form below)
    a_i = phi(q~_i) with offset m_i (per-row max of u over features)
    b_j = phi(k~_j) with offset m_K (one per (b, h), over valid keys and features)
    S = sum_j b_j v_j^T   z = sum_j b_j                          [F, E], [F]   (accumulator dtype)
    out_i = a_i S / a_i z                                        [T, E]

Forward, three launches (phi never touches HBM):

1. key pass ``_fwd_kv_kernel``, grid (F tiles, T splits, B*H): projection on ``tl.dot``, feature
   epilogue, running max ``m`` of the logits over the program's keys and features with
   flash-style rescaling of the partial (S, z); writes the partial (m, S, z);
2. merge ``_fwd_merge_kernel``, grid (F tiles, B*H): ``m_K`` = max of the partial maxima of the
   (b, h); partials rescaled by ``exp(m - m_K)`` and summed in a fixed order (deterministic);
3. query pass ``_fwd_q_kernel``, grid (Tq tiles, B*H): features per F tile with an online
   per-row max, ``out = num / den`` with the denominator policy of
   ``rfattn.reference.safe_denominator`` (``|den| < tiny`` -> ``sign(den) tiny``, sign of 0 +);
   saves the row max m_i and den_i for the backward.

Backward (features recomputed, never stored; same offsets m_i, m_K as the forward). With
``g_i = do_i / den_i`` and ``c_i = -(do_i . out_i) / den_i``:

    da_i = S g_i + c_i z          dS = sum_i a_i g_i^T          dz = sum_i c_i a_i
    db_j = dS v_j + dz            dv_j = dS^T b_j
    phi = g e (e = exp(u - offset)):  du = phi * dphi,  dg = e * dphi   (dphi = da or db)
    dx~ = du du/dx~ + dg dg/dx~;  dq = sqrt(scale) psi dx~;  dW likewise (per feature row)

4. ``_bwd_ds_kernel``, grid (F tiles, Tq splits, B*H): partial dS, dz (and dW from queries);
5. ``_bwd_dq_kernel``, grid (Tq tiles, B*H): dq;
6. ``_bwd_dkv_kernel``, grid (Tk tiles, B*H): dk, dv;
7. ``_bwd_dwk_kernel``, grid (F tiles, Tk splits, B*H): dW from keys (only when needed).
Partials over splits are summed in a fixed order (torch ``sum``): no atomics.

Feature forms (constexpr ``FEATURE``; ``w`` ``[F, D]`` holds one projection row per feature,
``z_f = w_f . x~``, ``|w_f|^2`` computed in the kernel):

* 0, ``"gerf"``: the real positive GERF family ``u = A |w|^2 + B z - |x~|^2 / 2``, ``g = 1``, with
  per-(b, h) A, B and input scales psi (``x~ = sqrt(scale) psi x`` for queries,
  ``sqrt(scale) x / psi`` for keys): posrf (A = 0, B = 1, psi = 1), hyprf (rows [W; -W]), real
  gerf, oprf, saderf. The per-(b, h) constant log D cancels with the offsets and is dropped.
* 1, ``"table"``: signed exponential features (trigrf, hrf, complex gerf) from a per-feature,
  per-side coefficient table ``[2, 9, F]`` (side 0 queries, 1 keys):
  ``u = cu z + ch |x~|^2 + cw |w|^2 + bias``, ``th = ct z + tw |w|^2 + tb``,
  ``g = (ga + gb cos th) s``, where ``s = sgn(tau_l . x~)`` (sgn 0 = +1) for the features with an
  index ``l = lam_f >= 0`` into extra rows tau ``[n, D]`` (hrf's lambda projections), else 1.
  (sin th is ``cos(th - pi/2)``: ``tb`` carries the shift.) The sign has zero derivative.
* 2, ``"rmf"``: random Maclaurin features, plain (no exponential, no offsets: u = 0):
  ``phi_f = c_f prod_{r in seg(f)} (rho_r . x~)`` over the feature's stacked projection rows
  rho ``[R, D]`` (stage 0 = W's row, then the later stages, feature-major: feature f owns rows
  ``start_f .. start_{f+1} - 1``). In registers: ONE projection of a feature tile's row range,
  ``Z = x~ rho^T`` ``[BT, BR]``, then ``log|phi| = log|c| + (log|Z|) Seg`` and the sign parity
  ``(Z < 0) Seg mod 2`` through the 0/1 segment matrix ``Seg[r, f] = (owner(r) == f)`` on
  ``tl.dot`` (ieee: 0/1 times values is exact), so ``phi = c (-1)^parity exp(log|phi|)``.
  ``|Z|`` is floored at ``tiny`` inside the log so that the backward's exclusive products
  ``prod_{r' != r} = exp(log|phi| - log|Z_r|)`` stay finite when a projection is 0; a feature of
  degree 0 is the constant c. No dW (rmf's Rademacher rows are never learnable).

Padded keys (``key_padding_mask`` True) and rows past T are excluded from m_K, S, z and get zero
gradients; their contents are never used. A (b, h) without valid keys gives zeros.
Reference: ``rfattn.reference.linear_attention`` on ``RandomFeatures.features`` (float64, same W).

Layout: q, k ``[B, H, T, D]``, v ``[B, H, T, E]`` with arbitrary strides; w ``[F, D]``.
Limits: inputs fp32/fp16/bf16/fp64, one dtype; w and the extra rows are cast to it for the
projections. Accumulation is fp32 (fp64 for fp64 inputs). Any D, E, F (tiles padded to powers of
two >= 16; register pressure grows with D and E, meant for <= 256), any T >= 0, Tq != Tk.
The coefficient table, tau and the per-(b, h) parameters are held constant: no gradient.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["rf_parallel_fwd", "rf_parallel_bwd", "FEATURE_IDS", "TABLE_ROWS", "INTERPRET"]

#: Whether kernels were decorated under the Triton interpreter (read once, at import).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: feature form -> constexpr id understood by the kernels
FEATURE_IDS = {"gerf": 0, "table": 1, "rmf": 2}
#: rows of the per-side coefficient table of the "table" form, in order
TABLE_ROWS = ("cu", "ch", "cw", "bias", "ct", "tw", "tb", "ga", "gb")
_NP = tl.constexpr(len(TABLE_ROWS))
#: running-max sentinel: finite so that exp(sentinel - sentinel) = 1, not NaN
_NEG = tl.constexpr(-1.0e30)
_PRECISIONS = ("ieee", "tf32", "tf32x3")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: tokens handled by one split program: a multiple of every BT in the configs
_SPLIT_QUANTUM = 128
#: stacked rmf projection rows per inner step
_BR = 32


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
def _tab(tab_ptr, row: tl.constexpr, o_f, m_f, M: tl.constexpr, IS_KEY: tl.constexpr):
    """[BM] coefficients ``row`` of the table form on one side (see TABLE_ROWS)."""
    side: tl.constexpr = 1 if IS_KEY else 0
    return tl.load(tab_ptr + (side * _NP + row) * M + o_f, mask=m_f, other=0.0)


@triton.jit
def _rmf_rows(xr_ptr, xi_ptr, o_r, r1, o_d, m_d, M: tl.constexpr, D: tl.constexpr):
    """Owners [BR] (-1 past ``r1``) and stacked rows [BR, BD] of one rmf row step."""
    m_r = o_r < r1
    b_own = tl.load(xi_ptr + M + 1 + o_r, mask=m_r, other=-1)
    b_rho = tl.load(xr_ptr + o_r[:, None] * D + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                    other=0.0)  # fmt: skip
    return b_own, b_rho


@triton.jit
def _log_abs(b_z, TINY: tl.constexpr):
    """log max(|z|, tiny) (NaN kept)."""
    b_az = tl.abs(b_z)
    return tl.log(tl.where(b_az < TINY, TINY, b_az))


@triton.jit
def _feature_tile(
    b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
    M: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, FEATURE: tl.constexpr,
    IS_KEY: tl.constexpr, HAS_LAM: tl.constexpr, PRECISION: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """(u, g, g1, g2) of one feature tile: phi = g exp(u - offset) [BT, BM] for inputs x~
    b_xs [BT, BD] (acc dtype) against rows b_w [BM, BD]. g1, g2 feed the backward: table form
    g1 = dg/dth; rmf g1 = c (-1)^parity, g2 = log|prod|. Scalars where a term is absent."""
    ACC = b_xs.dtype
    one = tl.full([], 1.0, dtype=ACC)
    if FEATURE == 2:  # rmf: plain features, u = 0
        BT: tl.constexpr = b_xs.shape[0]
        BR: tl.constexpr = _BR
        r0 = tl.load(xi_ptr + i_m * BM)
        r1 = tl.load(xi_ptr + tl.minimum(i_m * BM + BM, M))
        b_l = tl.zeros([BT, BM], dtype=ACC)  # log |prod|
        b_n = tl.zeros([BT, BM], dtype=ACC)  # number of negative factors
        for r in range(r0, r1, BR):
            b_own, b_rho = _rmf_rows(xr_ptr, xi_ptr, r + tl.arange(0, BR), r1, o_d, m_d, M, D)
            # [BT, BD] @ [BD, BR] -> [BT, BR]
            b_z = tl.dot(b_xs.to(b_rho.dtype), tl.trans(b_rho), input_precision=PRECISION,
                         out_dtype=ACC)  # fmt: skip
            b_seg = (b_own[:, None] == o_f[None, :]).to(ACC)  # [BR, BM]
            # [BT, BR] @ [BR, BM] -> [BT, BM], exact: one nonzero per (row, feature)
            b_l += tl.dot(_log_abs(b_z, TINY), b_seg, input_precision="ieee", out_dtype=ACC)
            b_n += tl.dot((b_z < 0).to(ACC), b_seg, input_precision="ieee", out_dtype=ACC)
        side: tl.constexpr = 1 if IS_KEY else 0
        b_c = tl.load(tab_ptr + side * M + o_f, mask=m_f, other=0.0).to(ACC)  # [BM]: [2, 1, F]
        b_sg = b_c[None, :] * (1.0 - 2.0 * (b_n - 2.0 * tl.floor(0.5 * b_n)))
        return tl.zeros([BT, BM], dtype=ACC), b_sg * tl.exp(b_l), b_sg, b_l
    # [BT, BD] @ [BD, BM] -> [BT, BM]
    b_z = tl.dot(b_xs.to(b_w.dtype), tl.trans(b_w), input_precision=PRECISION, out_dtype=ACC)
    b_wf = b_w.to(ACC)
    b_nw = tl.sum(b_wf * b_wf, axis=1)  # [BM]
    b_nx = tl.sum(b_xs * b_xs, axis=1)  # [BT]
    if FEATURE == 0:  # real positive GERF: A |w|^2 + B w . x~ - |x~|^2 / 2
        b_u = b_ca * b_nw[None, :] + b_cb * b_z - 0.5 * b_nx[:, None]
        return b_u, one, one, one
    # FEATURE == 1: the table form
    b_u = (_tab(tab_ptr, 0, o_f, m_f, M, IS_KEY)[None, :] * b_z
           + _tab(tab_ptr, 1, o_f, m_f, M, IS_KEY)[None, :] * b_nx[:, None]
           + (_tab(tab_ptr, 2, o_f, m_f, M, IS_KEY) * b_nw
              + _tab(tab_ptr, 3, o_f, m_f, M, IS_KEY))[None, :])  # fmt: skip
    b_th = (_tab(tab_ptr, 4, o_f, m_f, M, IS_KEY)[None, :] * b_z
            + (_tab(tab_ptr, 5, o_f, m_f, M, IS_KEY) * b_nw
               + _tab(tab_ptr, 6, o_f, m_f, M, IS_KEY))[None, :])  # fmt: skip
    b_gb = _tab(tab_ptr, 8, o_f, m_f, M, IS_KEY)[None, :]
    b_g = _tab(tab_ptr, 7, o_f, m_f, M, IS_KEY)[None, :] + b_gb * tl.cos(b_th)
    b_g1 = -b_gb * tl.sin(b_th)
    if HAS_LAM:
        b_lam = tl.load(xi_ptr + o_f, mask=m_f, other=-1)  # [BM]
        p_tau = xr_ptr + b_lam[:, None] * D + o_d[None, :]
        b_tau = tl.load(p_tau, mask=(b_lam[:, None] >= 0) & m_d[None, :], other=0.0)  # [BM, BD]
        b_pt = tl.dot(b_xs.to(b_tau.dtype), tl.trans(b_tau), input_precision=PRECISION,
                      out_dtype=ACC)  # [BT, BM]  # fmt: skip
        b_s = tl.where((b_lam[None, :] < 0) | (b_pt >= 0), 1.0, -1.0)
        b_g = b_g * b_s
        b_g1 = b_g1 * b_s
    return b_u, b_g, b_g1, one


@triton.jit
def _feature_dx(
    b_du, b_dg, b_g1, b_g2, b_xs, b_w, o_f, m_f, o_d, m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
    M: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, FEATURE: tl.constexpr,
    IS_KEY: tl.constexpr, PRECISION: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """d(sum du u + dg g)/dx~ [BT, BD] of one feature tile (du, dg [BT, BM]; see _feature_tile)."""
    ACC = b_du.dtype
    if FEATURE == 2:  # rmf: dphi_f/dZ_r = c (-1)^parity sgn(Z_r) exp(log|prod| - log|Z_r|)
        BT: tl.constexpr = b_du.shape[0]
        BD: tl.constexpr = b_xs.shape[1]
        BR: tl.constexpr = _BR
        r0 = tl.load(xi_ptr + i_m * BM)
        r1 = tl.load(xi_ptr + tl.minimum(i_m * BM + BM, M))
        b_a = b_dg * b_g1  # [BT, BM]
        b_dx = tl.zeros([BT, BD], dtype=ACC)
        for r in range(r0, r1, BR):
            b_own, b_rho = _rmf_rows(xr_ptr, xi_ptr, r + tl.arange(0, BR), r1, o_d, m_d, M, D)
            b_z = tl.dot(b_xs.to(b_rho.dtype), tl.trans(b_rho), input_precision=PRECISION,
                         out_dtype=ACC)  # [BT, BR]  # fmt: skip
            b_seg = (o_f[:, None] == b_own[None, :]).to(ACC)  # [BM, BR]
            # owner's values on its rows: [BT, BM] @ [BM, BR] -> [BT, BR] (exact)
            b_ar = tl.dot(b_a, b_seg, input_precision="ieee", out_dtype=ACC)
            b_lr = tl.dot(b_g2, b_seg, input_precision="ieee", out_dtype=ACC)
            b_gz = tl.where(b_z < 0, -b_ar, b_ar) * tl.exp(b_lr - _log_abs(b_z, TINY))
            # [BT, BR] @ [BR, BD] -> [BT, BD]
            b_dx += tl.dot(b_gz.to(b_rho.dtype), b_rho, input_precision=PRECISION,
                           out_dtype=ACC)  # fmt: skip
        return b_dx
    if FEATURE == 0:  # du/dx~ = B w - x~
        b_dzc = b_cb * b_du
        b_dh = -tl.sum(b_du, axis=1)
    else:  # du/dx~ = cu w + 2 ch x~;  dg/dx~ = g1 ct w
        b_dzc = (b_du * _tab(tab_ptr, 0, o_f, m_f, M, IS_KEY)[None, :]
                 + b_dg * b_g1 * _tab(tab_ptr, 4, o_f, m_f, M, IS_KEY)[None, :])  # fmt: skip
        b_dh = 2.0 * tl.sum(b_du * _tab(tab_ptr, 1, o_f, m_f, M, IS_KEY)[None, :], axis=1)
    # [BT, BM] @ [BM, BD] -> [BT, BD]
    b_dx = tl.dot(b_dzc.to(b_w.dtype), b_w, input_precision=PRECISION, out_dtype=ACC)
    return b_dx + b_dh[:, None] * b_xs


@triton.jit
def _feature_dw(
    b_du, b_dg, b_g1, b_xs, b_w, o_f, m_f, b_ca, b_cb, tab_ptr,
    M: tl.constexpr, FEATURE: tl.constexpr, IS_KEY: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """d(sum du u + dg g)/dW [BM, BD] of one token tile (du, dg [BT, BM]; not rmf)."""
    ACC = b_du.dtype
    if FEATURE == 0:  # du/dw = B x~ + 2 A w
        b_dzc = b_cb * b_du
        b_dnw = b_ca * tl.sum(b_du, axis=0)
    else:  # du/dw = cu x~ + 2 cw w;  dg/dw = g1 (ct x~ + 2 tw w)
        b_dgt = b_dg * b_g1
        b_dzc = (b_du * _tab(tab_ptr, 0, o_f, m_f, M, IS_KEY)[None, :]
                 + b_dgt * _tab(tab_ptr, 4, o_f, m_f, M, IS_KEY)[None, :])  # fmt: skip
        b_dnw = (tl.sum(b_du, axis=0) * _tab(tab_ptr, 2, o_f, m_f, M, IS_KEY)
                 + tl.sum(b_dgt, axis=0) * _tab(tab_ptr, 5, o_f, m_f, M, IS_KEY))  # fmt: skip
    # [BM, BT] @ [BT, BD] -> [BM, BD]
    b_dw = tl.dot(tl.trans(b_dzc), b_xs, input_precision=PRECISION, out_dtype=ACC)
    return b_dw + 2.0 * b_dnw[:, None] * b_w.to(ACC)


@triton.jit
def _logits_tile(b_xs, b_w, b_ca, b_cb, FEATURE: tl.constexpr, PRECISION: tl.constexpr):
    """GERF-form logits u [BT, BM] of x~ b_xs [BT, BD] against rows b_w [BM, BD] (rf_chunk)."""
    b_u, b_g, b_g1, b_g2 = _feature_tile(
        b_xs,
        b_w,
        0,
        0,
        0,
        0,
        b_ca,
        b_cb,
        0,
        0,
        0,
        0,
        1,
        1,
        1,
        FEATURE,
        False,
        False,
        PRECISION,
        0.0,
    )
    return b_u


@triton.jit
def _dlogits_dx_tile(b_du, b_xs, b_w, b_cb, FEATURE: tl.constexpr, PRECISION: tl.constexpr):
    """GERF form: d(sum du * u)/dx~ [BT, BD] for one M tile (rf_chunk)."""
    return _feature_dx(b_du, b_du, b_du, b_du, b_xs, b_w, 0, 0, 0, 0, b_cb, 0, 0, 0, 0, 1, 1, 1,
                       FEATURE, False, PRECISION, 0.0)  # fmt: skip


@triton.jit
def _dlogits_dw_tile(b_du, b_xs, b_w, b_ca, b_cb, FEATURE: tl.constexpr, PRECISION: tl.constexpr):
    """GERF form: d(sum du * u)/dW [BM, BD] for one token tile."""
    return _feature_dw(
        b_du, b_du, b_du, b_xs, b_w, 0, 0, b_ca, b_cb, 0, 1, FEATURE, False, PRECISION
    )


@triton.jit
def _load_rows(base, o_t, o_c, stride_t, stride_c, m_t, m_c, ACC: tl.constexpr):
    """A [BT, BC] tile of a [T, C] matrix (zeros outside), upcast to ACC."""
    p = base + o_t[:, None] * stride_t + o_c[None, :] * stride_c
    return tl.load(p, mask=m_t[:, None] & m_c[None, :], other=0.0).to(ACC)


@triton.jit
def _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d):
    """Feature rows [BM, BD] in the input dtype (zeros outside)."""
    p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
    return tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD: tl.constexpr):
    """[BT] bool: key rows inside T and not padded."""
    m_t = o_t < T
    if HAS_PAD:
        b_pad = tl.load(pad_ptr + i_b * stride_pb + o_t * stride_pt, mask=m_t, other=1)
        m_t = m_t & (b_pad == 0)
    return m_t


# Arguments every feature kernel shares (after the pointers of its pass):
#   w_ptr [F, D] feature rows; scale_ptr sqrt(scale); ab_ptr (A, B) per (b, h); psi_ptr [B*H, D];
#   tab_ptr, xr_ptr, xi_ptr: the table form's coefficients / tau / lam, rmf's scales / stacked
#   rows / (segment starts, owners).


@triton.autotune(configs=_configs(), key=_KEY)
@triton.jit
def _fwd_kv_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    sp_ptr, zp_ptr, mp_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """Partial (m, S, z) of one feature tile over one T split of one (b, h)."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
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
        b_u, b_g, b_g1, b_g2 = _feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
        b_u = tl.where(m_t[:, None] & m_f[None, :], b_u, float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(tl.max(b_u, axis=1), axis=0))
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_p = b_g * tl.exp(b_u - b_mx_new)  # [BT, BM], 0 on invalid rows / features
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
    """S, z of one feature tile of one (b, h): partials rescaled to the common key offset."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NMT: tl.constexpr = (M + BM - 1) // BM
    # the (b, h) offset m_K: max over every partial (all splits, all feature tiles)
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
    q_ptr, w_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    s_ptr, z_ptr, o_ptr, mq_ptr, den_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """out [BT, E] of one query tile of one (b, h): online per-row max over feature tiles."""
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
        b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_u, b_g, b_g1, b_g2 = _feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
        b_u = tl.where(m_f[None, :], b_u, float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(b_u, axis=1))  # [BT]
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_p = b_g * tl.exp(b_u - b_mx_new[:, None])  # [BT, BM]
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
    q_ptr, w_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    s_ptr, z_ptr, o_ptr, do_ptr, mq_ptr, den_ptr, dsp_ptr, dzp_ptr, dwp_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    W_GRAD: tl.constexpr,
):  # fmt: skip
    """Partial dS [BM, E], dz [BM] (and dW from queries [BM, D]) over one Tq split."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)  # [BD]
    b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
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
        b_u, b_g, b_g1, b_g2 = _feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
        b_e = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mq[:, None]), 0.0)
        b_a = b_g * b_e
        b_gq, b_c = _query_cotangents(do_base, o_base, den_ptr, i_bh, o_t, o_e, T, m_t, m_e,
                                      stride_dot, stride_doe, stride_ot, stride_oe,
                                      ACC)  # fmt: skip
        # [BM, BT] @ [BT, BE] -> [BM, BE]
        b_ds += tl.dot(tl.trans(b_a), b_gq, input_precision=PRECISION, out_dtype=ACC)
        b_dz += tl.sum(b_a * b_c[:, None], axis=0)
        if W_GRAD:
            # da = g S^T + c z: [BT, BE] @ [BE, BM] -> [BT, BM]
            b_da = (
                tl.dot(b_gq, tl.trans(b_s), input_precision=PRECISION, out_dtype=ACC)
                + b_c[:, None] * b_z[None, :]
            )
            # [BM, BT] @ [BT, BD] -> [BM, BD]
            b_dw += _feature_dw(b_a * b_da, b_e * b_da, b_g1, b_xs, b_w, o_f, m_f, b_ca, b_cb,
                                tab_ptr, M, FEATURE, False, PRECISION)  # fmt: skip

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
    q_ptr, w_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    s_ptr, z_ptr, o_ptr, do_ptr, mq_ptr, den_ptr, dq_ptr,
    T, H,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """dq [BT, D] of one query tile: da = g S^T + c z, dq = sqrt(scale) psi dx~."""
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
    b_gq, b_c = _query_cotangents(do_ptr + i_b * stride_dob + i_h * stride_doh,
                                  o_ptr + i_b * stride_ob + i_h * stride_oh, den_ptr, i_bh, o_t,
                                  o_e, T, m_t, m_e, stride_dot, stride_doe, stride_ot, stride_oe,
                                  ACC)  # fmt: skip
    b_dx = tl.zeros([BT, BD], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_s = tl.load(s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                      mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
        b_z = tl.load(z_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        b_u, b_g, b_g1, b_g2 = _feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
        b_e = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mq[:, None]), 0.0)
        # da = g S^T + c z: [BT, BE] @ [BE, BM] -> [BT, BM]
        b_da = (
            tl.dot(b_gq, tl.trans(b_s), input_precision=PRECISION, out_dtype=ACC)
            + b_c[:, None] * b_z[None, :]
        )
        b_dx += _feature_dx(b_g * b_e * b_da, b_e * b_da, b_g1, b_g2, b_xs, b_w, o_f, m_f, o_d,
                            m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM, FEATURE, False,
                            PRECISION, TINY)  # fmt: skip
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
    k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
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
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """dk [BT, D], dv [BT, E] of one key tile: db = v dS^T + dz, dv = b dS."""
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
        b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_ds = tl.load(ds_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                       mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
        b_dz = tl.load(dz_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        b_u, b_g, b_g1, b_g2 = _feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
        b_e = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mk), 0.0)
        b_b = b_g * b_e
        # db = v dS^T + dz: [BT, BE] @ [BE, BM] -> [BT, BM]
        b_db = tl.dot(b_v, tl.trans(b_ds), input_precision=PRECISION, out_dtype=ACC) + b_dz[None, :]
        b_dx += _feature_dx(b_b * b_db, b_e * b_db, b_g1, b_g2, b_xs, b_w, o_f, m_f, o_d, m_d,
                            b_cb, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM, FEATURE, True,
                            PRECISION, TINY)  # fmt: skip
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
    k_ptr, v_ptr, w_ptr, pad_ptr, scale_ptr, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    ds_ptr, dz_ptr, mk_ptr, dwp_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """Partial dW [BM, D] from the keys of one Tk split."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_ca, b_cb = _gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = _input_scale(scale_ptr, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    b_mk = tl.load(mk_ptr + i_bh)
    b_w = _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
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
        b_u, b_g, b_g1, b_g2 = _feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY)  # [BT, BM]  # fmt: skip
        b_e = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mk), 0.0)
        b_db = tl.dot(b_v, tl.trans(b_ds), input_precision=PRECISION, out_dtype=ACC) + b_dz[None, :]
        # [BM, BT] @ [BT, BD] -> [BM, BD]
        b_dw += _feature_dw(b_g * b_e * b_db, b_e * b_db, b_g1, b_xs, b_w, o_f, m_f, b_ca, b_cb,
                            tab_ptr, M, FEATURE, True, PRECISION)  # fmt: skip
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

    def __init__(self, q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi,
                 table=None, extra_rows=None, index=None):  # fmt: skip
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
        self.tab, self.xr, self.xi = self._form(feature, table, extra_rows, index, q)
        self.meta = dict(D=self.D, M=self.M, E=self.E, BD=self.BD, BM=self.BM, BE=self.BE,
                         FEATURE=self.fid, PRECISION=precision, ACC=self.ACC,
                         HAS_AB=gerf is not None, HAS_PSI=psi is not None)  # fmt: skip
        # the feature kernels' extra constexprs (kept apart: rf_chunk's kernels take ``meta``)
        self.fmeta = dict(self.meta, HAS_LAM=feature == "table" and extra_rows is not None,
                          TINY=self.tiny)  # fmt: skip

    def _form(self, feature, table, extra_rows, index, q):
        """(table, extra rows, int32 index) of the table / rmf forms, checked and contiguous."""
        dev, M, D = q.device, self.M, self.D
        if feature == "gerf":
            return self.scale, self.scale, self.scale  # never read
        np_ = 1 if feature == "rmf" else len(TABLE_ROWS)
        if table is None or tuple(table.shape) != (2, np_, M):
            got = None if table is None else tuple(table.shape)
            raise ValueError(f"feature={feature!r} needs table [2, {np_}, {M}], got {got}")
        tab = table.detach().to(device=dev, dtype=self.acc).contiguous()
        if feature == "table":
            if extra_rows is None:
                return tab, self.scale, self.scale
            if index is None or tuple(index.shape) != (M,) or extra_rows.shape[-1] != D:
                raise ValueError(f"the table form's tau must be [n, {D}] with lam [{M}]")
        elif index is None or extra_rows is None or index.dim() != 1:
            raise ValueError("feature='rmf' needs extra_rows (stacked rows) and index")
        elif index.shape[0] != M + 1 + extra_rows.shape[0] or extra_rows.shape[-1] != D:
            raise ValueError(f"rmf index must be [{M} + 1 + R] for stacked rows [R, {D}]")
        xr = extra_rows.detach().to(device=dev, dtype=q.dtype).contiguous()
        xi = index.to(device=dev, dtype=torch.int32).contiguous()
        return tab, (xr if xr.numel() else self.scale), xi

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
    table: torch.Tensor | None = None,
    extra_rows: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
):
    """Non-causal fused random-feature attention forward.

    Args:
        q: ``[B, H, Tq, D]``; k: ``[B, H, Tk, D]``; v: ``[B, H, Tk, E]`` (any strides, one dtype).
        w: ``[F, D]`` feature rows, one per feature (cast to the input dtype; rmf: any
            ``[F, D]``, its rows are ``extra_rows``).
        scale: softmax temperature; inputs are multiplied by ``sqrt(scale)`` before projection.
        key_padding_mask: optional ``[B, Tk]`` bool, True = padding.
        feature: a form of :data:`FEATURE_IDS` ("gerf", "table", "rmf"; module docstring).
        precision: ``tl.dot`` input precision for fp32 products ("ieee", "tf32", "tf32x3");
            default "ieee" for fp32/fp64 inputs, "tf32" for fp16/bf16 inputs.
        num_splits: programs sharing one (b, h)'s keys (default: fill the device).
        return_aux: also return what the backward needs.
        gerf: optional ``(A, B)`` per (b, h), broadcastable to ``[B, H, 2]``: logits
            ``A |w|^2 + B w . x~ - |x~|^2 / 2`` (default posrf: A = 0, B = 1). Held constant
            (no gradient).
        psi: optional per-(b, h) input scales, broadcastable to ``[B, H, D]``:
            ``x~ = psi * x`` for queries, ``x~ = x / psi`` for keys (saderf). No gradient.
        table: "table" form: coefficients ``[2, 9, F]`` (sides query/key, rows
            :data:`TABLE_ROWS`); "rmf": ``[2, 1, F]`` the scales c (queries, keys). No gradient.
        extra_rows: "table": optional tau ``[n, D]`` (sign projections); "rmf": the stacked
            projection rows ``[R, D]``, feature-major. No gradient.
        index: "table": lam ``[F]`` (row of tau per feature, -1 none); "rmf": ``[F + 1 + R]``,
            the segment starts (``start_0 = 0 .. start_F = R``) then the owner of each row.

    Returns:
        ``out [B, H, Tq, E]`` in the input dtype; with ``return_aux`` also
        ``(S [B*H, M, E], z [B*H, M], m_K [B*H], m_q [B*H, Tq], den [B*H, Tq])``.
    """
    _check_inputs(q, k, v, w, key_padding_mask)
    c = _Setup(q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi, table,
               extra_rows, index)  # fmt: skip
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
        k, v, c.w, c.pad[0], c.scale, c.ab, c.psi, c.tab, c.xr, c.xi, s_part, z_part, m_part,
        Tk, H, splits, per if Tk else 0,
        *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
        HAS_PAD=c.has_pad, **c.fmeta,
    )  # fmt: skip
    mk = c.acc_empty(B * H, device=dev)
    _fwd_merge_kernel[(NMT, B * H)](
        s_part, z_part, m_part, s, z, mk, splits,
        M=M, E=E, BM=c.BM, BE=c.BE, BP=_next_pow2(min(splits * NMT, 1024)), ACC=c.ACC,
    )  # fmt: skip
    if Tq:
        _fwd_q_kernel[lambda meta: (triton.cdiv(Tq, meta["BT"]), B * H)](
            q, c.w, c.scale, c.ab, c.psi, c.tab, c.xr, c.xi, s, z, out, mq, den,
            Tq, H, *q.stride(), *c.w.stride(), *out.stride(),
            **c.fmeta,
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
    table: torch.Tensor | None = None,
    extra_rows: torch.Tensor | None = None,
    index: torch.Tensor | None = None,
):
    """Backward of :func:`rf_parallel_fwd`: features recomputed, offsets from the forward.

    Args:
        do: ``[B, H, Tq, E]`` cotangent of the output (any strides).
        q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi, table, extra_rows,
            index: as given to the forward.
        out, aux: the forward's output and auxiliaries (``return_aux=True``).
        need_dw: also compute the gradient of w (not for "rmf").

    Returns:
        ``(dq, dk, dv, dw)``; ``dw`` is None unless ``need_dw`` (then ``[F, D]`` in w's dtype).
    """
    if need_dw and feature == "rmf":
        raise NotImplementedError("feature='rmf': no gradient for its projection rows")
    c = _Setup(q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi, table,
               extra_rows, index)  # fmt: skip
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
        q, c.w, c.scale, c.ab, c.psi, c.tab, c.xr, c.xi, s, z, out, do, mq, den,
        ds_part, dz_part, dw_part,
        Tq, H, splits, per if Tq else 0,
        *q.stride(), *c.w.stride(), *out.stride(), *do.stride(),
        W_GRAD=need_dw, **c.fmeta,
    )  # fmt: skip
    # fixed-order sums over splits: deterministic
    ds = ds_part.view(B * H, splits, M, E).sum(1)
    dz = dz_part.view(B * H, splits, M).sum(1)
    if need_dw:
        dw += dw_part.view(B * H * splits, M, D).sum(0)
    if Tq:
        _bwd_dq_kernel[lambda meta: (triton.cdiv(Tq, meta["BT"]), B * H)](
            q, c.w, c.scale, c.ab, c.psi, c.tab, c.xr, c.xi, s, z, out, do, mq, den, dq,
            Tq, H, *q.stride(), *c.w.stride(), *out.stride(), *do.stride(), *dq.stride(),
            **c.fmeta,
        )  # fmt: skip
    if Tk:
        _bwd_dkv_kernel[lambda meta: (triton.cdiv(Tk, meta["BT"]), B * H)](
            k, v, c.w, c.pad[0], c.scale, c.ab, c.psi, c.tab, c.xr, c.xi, ds, dz, mk, dk, dv,
            Tk, H, *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
            *dk.stride(), *dv.stride(),
            HAS_PAD=c.has_pad, **c.fmeta,
        )  # fmt: skip
        if need_dw:
            ksplits, kper = _splits(Tk, B * H * NMT, dev, num_splits)
            dwk_part = c.acc_empty(B * H * ksplits, M, D, device=dev)
            _bwd_dwk_kernel[(NMT, ksplits, B * H)](
                k, v, c.w, c.pad[0], c.scale, c.ab, c.psi, c.tab, c.xr, c.xi, ds, dz, mk, dwk_part,
                Tk, H, ksplits, kper,
                *k.stride(), *v.stride(), *c.w.stride(), c.pad[1], c.pad[2],
                HAS_PAD=c.has_pad, **c.fmeta,
            )  # fmt: skip
            dw += dwk_part.sum(0)
    return dq, dk, dv, (dw.to(w.dtype) if need_dw else None)
