"""Shared pieces of the fused kernels: the per-tile feature epilogues, loads, and launch setup.

``rf_parallel`` (non-causal), ``rf_chunk`` (causal) and ``rf_recurrent`` (decode) compute the same
features ``phi = g exp(u - offset)`` of pre-scaled inputs ``x~`` through :func:`_feature_tile`
(forward) and :func:`_feature_dx` / :func:`_feature_dw` (backward), and launch through
:class:`_Setup`, so one feature form is written once for every algorithmic form.

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
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: Whether kernels were decorated under the Triton interpreter (read once, at import).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why the Triton interpreter cannot run these kernels with these versions, or None.

    Triton's interpreter before 3.7 converts arrays to scalars in a way numpy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars", at the first kernel);
    seen with triton 3.6.0 + numpy 2.4.6, while 3.6.0 + numpy 2.3 and 3.7/3.8 + numpy 2.4 run."""

    def major_minor(v: str) -> tuple[int, int]:
        parts = (v.split("+")[0].split(".") + ["0"])[:2]
        return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (
            f"the Triton interpreter (TRITON_INTERPRET=1) of triton {triton_version} fails with "
            f"numpy {numpy_version}: install numpy<2.4 (pip install 'numpy<2.4') or triton>=3.7"
        )
    return None


if INTERPRET:
    import numpy

    _why = interpreter_numpy_problem(triton.__version__, numpy.__version__)
    if _why is not None:
        raise ImportError(_why)
#: ``RFATTN_AUTOTUNE=0``: every autotuned kernel gets one config that fits at every dtype and
#: head size (BT 32, 4 warps, unpipelined), so a test run compiles each kernel once instead of
#: once per config (read once, at import; slower kernels: not for timing)
AUTOTUNE = os.environ.get("RFATTN_AUTOTUNE", "1") != "0"
#: Whether the launchers pick a GPU's tiles and launch options (the interpreter's are small, to
#: keep tests fast); ``bench.compile`` sets it to record a GPU's launches on CPU.
GPU_TILES = not INTERPRET
#: feature form -> constexpr id understood by the kernels
FEATURE_IDS = {"gerf": 0, "table": 1, "rmf": 2}
#: rows of the per-side coefficient table of the "table" form, in order
TABLE_ROWS = ("cu", "ch", "cw", "bias", "ct", "tw", "tb", "ga", "gb")
_NP = tl.constexpr(len(TABLE_ROWS))
#: running-max sentinel: finite so that exp(sentinel - sentinel) = 1, not NaN
_NEG = tl.constexpr(-1.0e30)
_PRECISIONS = ("ieee", "tf32", "tf32x3")
#: ``tl.dot`` input precision of the fp32 products for fp16/bf16 inputs (see _Setup)
LOW_PRECISION = "tf32x3"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: tokens handled by one split program: a multiple of every BT in the configs
_SPLIT_QUANTUM = 128
#: stacked rmf projection rows per inner step (constexpr: kernels read it)
_BR = tl.constexpr(32)


def _configs(bts=(32, 64, 128), warps=(4, 8)):
    """Autotune configs (BT, num_warps), software-pipelined (Triton's default 3 stages), plus two
    unpipelined fallbacks (BT 32 and 16, 4 warps, 1 stage) that fit the shared memory of an SM
    where the pipelined ones do not (fp32 at D = 256, fp64 at D >= 128; the autotuner drops
    configs that run out of resources). A single config under the interpreter.
    :data:`PRUNE` picks the ones a launch tries."""
    if INTERPRET:
        return [triton.Config({"BT": 64}, num_warps=1)]
    if not AUTOTUNE:
        return [triton.Config({"BT": 32}, num_warps=4, num_stages=1)]  # fits at every size
    return [triton.Config({"BT": bt}, num_warps=w) for bt in bts for w in warps] + [
        triton.Config({"BT": bt}, num_warps=4, num_stages=1) for bt in (32, 16)
    ]


def _prune_configs(configs, nargs, **kwargs):
    """``early_config_prune``: float64 (a checking dtype, twice the bytes per tile) tries only
    the unpipelined fallbacks; the other dtypes every config with BT >= 32. (The autotuner
    calls it only when it has several configs, i.e. not under the interpreter.)"""
    if kwargs.get("ACC") == tl.float64:
        return [c for c in configs if c.num_stages == 1]
    return [c for c in configs if c.kwargs["BT"] >= 32]


#: ``prune_configs_by`` of every autotuned feature kernel
PRUNE = {"early_config_prune": _prune_configs}


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
def _safe_den(b_den, TINY: tl.constexpr):
    """The denominator policy of ``rfattn.reference.safe_denominator``: ``|den| < tiny`` becomes
    ``sign(den) * tiny`` (0 -> +tiny), so a query with no valid key gets 0, never NaN."""
    eps = tl.full([], TINY, b_den.dtype)
    return tl.where(tl.abs(b_den) < eps, tl.where(b_den < 0, -eps, eps), b_den)


@triton.jit
def _store_tile(ptr, i_b, i_h, o_r, o_c, stride_b, stride_h, stride_r, stride_c, b_x, m_r, m_c):
    """Store the tile ``b_x`` [rows, cols] at ``ptr[i_b, i_h, o_r, o_c]`` in ``ptr``'s dtype."""
    p = ptr + i_b * stride_b + i_h * stride_h + o_r[:, None] * stride_r + o_c[None, :] * stride_c
    tl.store(p, b_x.to(ptr.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


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
    # one return statement: compiled Triton checks every return's type, constexpr-dead or not
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
        b_g1 = b_c[None, :] * (1.0 - 2.0 * (b_n - 2.0 * tl.floor(0.5 * b_n)))
        b_u, b_g, b_g2 = tl.zeros([BT, BM], dtype=ACC), b_g1 * tl.exp(b_l), b_l
    else:
        # [BT, BD] @ [BD, BM] -> [BT, BM]
        b_z = tl.dot(b_xs.to(b_w.dtype), tl.trans(b_w), input_precision=PRECISION, out_dtype=ACC)
        b_wf = b_w.to(ACC)
        b_nw = tl.sum(b_wf * b_wf, axis=1)  # [BM]
        b_nx = tl.sum(b_xs * b_xs, axis=1)  # [BT]
        b_g2 = one
        if FEATURE == 0:  # real positive GERF: A |w|^2 + B w . x~ - |x~|^2 / 2
            b_u = b_ca * b_nw[None, :] + b_cb * b_z - 0.5 * b_nx[:, None]
            b_g, b_g1 = one, one
        else:  # FEATURE == 1: the table form
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
                b_tau = tl.load(p_tau, mask=(b_lam[:, None] >= 0) & m_d[None, :],
                                other=0.0)  # [BM, BD]  # fmt: skip
                b_pt = tl.dot(b_xs.to(b_tau.dtype), tl.trans(b_tau), input_precision=PRECISION,
                              out_dtype=ACC)  # [BT, BM]  # fmt: skip
                b_s = tl.where((b_lam[None, :] < 0) | (b_pt >= 0), 1.0, -1.0)
                b_g = b_g * b_s
                b_g1 = b_g1 * b_s
    return b_u, b_g, b_g1, b_g2


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
def _load_rows(base, o_t, o_c, stride_t, stride_c, m_t, m_c, ACC: tl.constexpr):
    """A [BT, BC] tile of a [T, C] matrix (zeros outside), upcast to ACC."""
    p = base + o_t[:, None] * stride_t + o_c[None, :] * stride_c
    return tl.load(p, mask=m_t[:, None] & m_c[None, :], other=0.0).to(ACC)


@triton.jit
def _load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d):
    """Feature rows [BM, BD] in the accumulation dtype (zeros outside)."""
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


# ------------------------------------------------------------------------------------------------
# launch setup (shared by every launcher)


def _offsets_in(r: torch.Tensor) -> torch.Tensor:
    """Causal state offsets (-inf = no valid key seen) to the kernels' finite sentinel."""
    return torch.where(torch.isinf(r) & (r < 0), torch.full_like(r, _NEG.value), r)


def _offsets_out(r: torch.Tensor) -> torch.Tensor:
    """The kernels' sentinel offsets back to -inf (the state convention of ``rfattn.RFState``)."""
    return torch.where(r <= 0.5 * _NEG.value, torch.full_like(r, float("-inf")), r)


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


def _feature_rows(big: int, itemsize: int) -> int:
    """Feature tile BM (rows of W per step) for padded head sizes up to ``big`` and inputs of
    ``itemsize`` bytes, before capping at M (the causal kernels pick their own: rf_chunk)."""
    if itemsize == 8:
        return 32 if big <= 64 else 16
    return 64 if big <= 128 else 32


class _Setup:
    """Sizes, tiles and dtypes shared by the forward and backward launchers."""

    def __init__(self, q, k, v, w, scale, key_padding_mask, feature, precision, gerf, psi,
                 table=None, extra_rows=None, index=None):  # fmt: skip
        if feature not in FEATURE_IDS:
            raise ValueError(f"feature={feature!r} has no fused kernel; have {sorted(FEATURE_IDS)}")
        self.B, self.H, self.Tq, self.D = q.shape
        self.Tk, self.E, self.M = k.shape[2], v.shape[3], w.shape[0]
        self.BD, self.BE = _next_pow2(self.D), _next_pow2(self.E)
        self.itemsize, self.gpu_tiles = q.element_size(), GPU_TILES
        # the interpreter keeps the big 16-bit tiles whatever the dtype: fewer steps, faster tests
        rows = _feature_rows(max(self.BD, self.BE), self.itemsize if self.gpu_tiles else 2)
        self.BM = min(rows, _next_pow2(self.M))
        self.NMT = triton.cdiv(self.M, self.BM)
        self.acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        self.ACC = tl.float64 if self.acc == torch.float64 else tl.float32
        if precision is None:
            # fp32 inputs: exact fp32 products unless tf32 is asked for. fp16/bf16 inputs: the
            # products run on fp32 operands (W, features, states) as three tf32 products, about
            # fp32's accuracy. Measured on an H100 (bench/results/nvidia-h100-80gb-hbm3): W and
            # the features rounded to the input dtype gave 3-4x the torch path's error in that
            # dtype, fp32 operands with one tf32 product still 1.1-2.2x too much under bf16 (the
            # exponent amplifies the projection's rounding); three tf32 products pass the
            # flash-attention rule, at ~2.7x the time of the first at T = 8192.
            precision = "ieee" if q.dtype in (torch.float32, torch.float64) else LOW_PRECISION
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        self.precision = precision
        self.fid = FEATURE_IDS[feature]
        # W in the accumulation dtype: rounded to bf16 it would move each logit by ~|u| 2^-9
        self.w = w.to(device=q.device, dtype=self.acc)
        self.scale = torch.tensor([float(scale) ** 0.5], device=q.device, dtype=self.acc)
        self.tiny = torch.finfo(self.acc).tiny
        if key_padding_mask is not None:
            # int32, not a uint8 view: Triton 3.6 fails to compile fp64 tl.dot kernels that mask
            # with an 8-bit load (found ahead of time by bench/compile.py); B*T ints are cheap
            pad = key_padding_mask.to(torch.int32)
            self.pad = (pad, pad.stride(0), pad.stride(1))
        else:
            self.pad = (self.scale, 0, 0)  # never read
        self.has_pad = key_padding_mask is not None
        # per-(b, h) parameters, broadcast from [B, H, ...] or [1, 1, ...]; fp32/fp64 contiguous
        self.ab = self.scale if gerf is None else self._per_head(gerf, (2,), "gerf", q.device)
        self.psi = self.scale if psi is None else self._per_head(psi, (self.D,), "psi", q.device)
        self.tab, self.xr, self.xi = self._form(feature, table, extra_rows, index, q)
        # the constexprs every feature kernel takes
        self.meta = dict(D=self.D, M=self.M, E=self.E, BD=self.BD, BM=self.BM, BE=self.BE,
                         FEATURE=self.fid, PRECISION=precision, ACC=self.ACC,
                         HAS_AB=gerf is not None, HAS_PSI=psi is not None,
                         HAS_LAM=feature == "table" and extra_rows is not None,
                         TINY=self.tiny)  # fmt: skip

    def launch_options(self, num_warps: int | None = None) -> dict:
        """num_warps (unless given) and num_stages of the kernels launched without autotuning
        (causal, decode), sized so that every launch fits a Hopper SM's shared memory (checked by
        ``python -m bench.compile``): 8 warps for 128-wide tiles, else 4; two pipeline stages
        for 256-wide tiles, else Triton's default three. float64, a checking dtype, runs
        unpipelined, and with 2 warps at 256-wide tiles (rmf's causal backward needs 262 KiB
        at 4 or 8 warps, 214 KiB at 2)."""
        if not self.gpu_tiles:
            return dict(num_warps=1)
        big, fp64 = max(self.BD, self.BE), self.itemsize == 8
        warps = 2 if fp64 and big >= 256 else (8 if big >= 128 else 4)
        stages = 1 if fp64 else (2 if big >= 256 else 3)
        return dict(num_warps=num_warps or warps, num_stages=stages)

    def set_feature_tile(self, bm: int) -> None:
        """Use feature tiles of ``bm`` rows (a power of two >= 16) in every launch from here on."""
        self.BM = min(bm, _next_pow2(self.M))
        self.NMT = triton.cdiv(self.M, self.BM)
        self.meta["BM"] = self.BM

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
        xr = extra_rows.detach().to(device=dev, dtype=self.acc).contiguous()
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
