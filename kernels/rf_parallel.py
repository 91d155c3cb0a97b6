"""Fused non-causal random-feature attention (forward), per (b, h):

    x = sqrt(scale) * q (or k)                                   [T, D]
    u = x W^T - |x|^2 / 2                                        [T, M]   (posrf logits)
    S = sum_j exp(u_k(j) - m_K) v_j^T   z = sum_j exp(u_k(j) - m_K)   [M, E], [M]  (fp32)
    out_i = exp(u_q(i) - m_i) S / exp(u_q(i) - m_i) z           [T, E]

Three launches, phi never touches HBM:

1. key pass ``_rf_parallel_fwd_kv_kernel``, grid (M tiles, T splits, B*H): each program projects
   its key tiles on ``tl.dot``, keeps a running max ``m`` of the logits over its keys and features
   (flash-style rescaling of its partial S, z when m rises) and writes the partial (m, S, z);
2. merge ``_rf_parallel_merge_kernel``, grid (M tiles, B*H): the key offset m_K is the max of the
   partial maxima of the (b, h); partial sums are rescaled by exp(m - m_K) and summed in a fixed
   order (deterministic, no atomics);
3. query pass ``_rf_parallel_fwd_q_kernel``, grid (Tq tiles, B*H): features per M tile with an
   online per-row max (rescaling the running numerator and denominator), then
   ``out = num / den`` with the denominator policy of ``rfattn.reference.safe_denominator``.

Stabilisers are those of DESIGN §3: per query row over features, one offset per (b, h) over valid
keys and features (never per key, never across the batch). Padded keys (``key_padding_mask``
True) and rows past T are excluded from the offset, S and z; their values are never used.
A (b, h) without valid keys gives zeros. Reference: ``rfattn.reference.linear_attention`` on
``RandomFeatures.features`` (float64, same W).

Layout: q, k ``[B, H, T, D]``, v ``[B, H, T, E]`` with arbitrary strides; W ``[M, D]``.
Limits: inputs fp32/fp16/bf16 (W is cast to the input dtype for the projection; accumulation is
fp32); any D, E, M (tiles are padded to powers of two >= 16; register pressure grows with
D and E, tuned for <= 256); any T >= 0.
Feature kinds (constexpr ``FEATURE``): 0 = posrf.
Backward: not fused yet (the autograd Function raises; see ``rfattn.autograd``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["rf_parallel_fwd", "FEATURE_IDS", "INTERPRET"]

#: Whether kernels were decorated under the Triton interpreter (read once, at import).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: feature name -> constexpr id understood by the kernels
FEATURE_IDS = {"posrf": 0}
#: running-max sentinel: finite so that exp(sentinel - sentinel) = 1, not NaN
_NEG = tl.constexpr(-1.0e30)
_PRECISIONS = ("ieee", "tf32", "tf32x3")


def _next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(n, 1)))


def _num_warps(bd: int, be: int) -> int:
    return 1 if INTERPRET else (8 if max(bd, be) >= 128 else 4)


@triton.jit
def _logits_tile(b_x, b_w, sqrt_scale, FEATURE: tl.constexpr, PRECISION: tl.constexpr):
    """Feature logits u [BT, BM] of raw inputs b_x [BT, BD] (fp32) against rows b_w [BM, BD]."""
    b_xs = b_x * sqrt_scale  # [BT, BD]
    # [BT, BD] @ [BD, BM] -> [BT, BM]
    b_u = tl.dot(b_xs.to(b_w.dtype), tl.trans(b_w), input_precision=PRECISION)
    if FEATURE == 0:  # posrf: omega . x - |x|^2 / 2
        b_u = b_u - 0.5 * tl.sum(b_xs * b_xs, axis=1)[:, None]
    return b_u


@triton.jit
def _rf_parallel_fwd_kv_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, s_ptr, z_ptr, m_ptr,
    T, H, NUM_SPLITS, tiles_per_split, sqrt_scale,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd,
    stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Partial (m, S, z) of one M tile over one T split of one (b, h)."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d = tl.arange(0, BD)
    o_e = tl.arange(0, BE)
    o_f = i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M

    p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
    b_w = tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh

    b_s = tl.zeros([BM, BE], dtype=tl.float32)
    b_z = tl.zeros([BM], dtype=tl.float32)
    b_mx = tl.full([], _NEG, dtype=tl.float32)
    t0 = i_s.to(tl.int64) * tiles_per_split * BT
    for i_t in range(0, tiles_per_split):
        o_t = t0 + i_t * BT + tl.arange(0, BT)
        m_in = o_t < T
        m_t = m_in
        if HAS_PAD:
            b_pad = tl.load(pad_ptr + i_b * stride_pb + o_t * stride_pt, mask=m_in, other=1)
            m_t = m_in & (b_pad == 0)
        p_k = k_base + o_t[:, None] * stride_kt + o_d[None, :] * stride_kd
        b_k = tl.load(p_k, mask=m_in[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_u = _logits_tile(b_k, b_w, sqrt_scale, FEATURE, PRECISION)  # [BT, BM]
        b_u = tl.where(m_t[:, None] & m_f[None, :], b_u, float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(tl.max(b_u, axis=1), axis=0))
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_p = tl.exp(b_u - b_mx_new)  # [BT, BM], 0 on invalid rows / features
        p_v = v_base + o_t[:, None] * stride_vt + o_e[None, :] * stride_ve
        b_v = tl.load(p_v, mask=m_in[:, None] & m_e[None, :], other=0.0)
        b_v = tl.where(m_t[:, None], b_v, 0.0).to(b_v.dtype)  # padded values never reach S
        # [BM, BT] @ [BT, BE] -> [BM, BE]
        b_s = b_s * b_alpha + tl.dot(tl.trans(b_p).to(b_v.dtype), b_v, input_precision=PRECISION)
        b_z = b_z * b_alpha + tl.sum(b_p, axis=0)
        b_mx = b_mx_new

    i_part = i_bh * NUM_SPLITS + i_s  # partial index: [B*H, NUM_SPLITS]
    p_s = s_ptr + i_part * M * E + o_f[:, None] * E + o_e[None, :]
    tl.store(p_s, b_s, mask=m_f[:, None] & m_e[None, :])
    tl.store(z_ptr + i_part * M + o_f, b_z, mask=m_f)
    tl.store(m_ptr + i_part * NMT + i_m, b_mx)


@triton.jit
def _rf_parallel_merge_kernel(
    sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr,
    NUM_SPLITS,
    M: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    """S, z of one M tile of one (b, h): partials rescaled to the common key offset, summed."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NMT: tl.constexpr = (M + BM - 1) // BM
    # the (b, h) offset: max over every partial (all splits, all M tiles)
    b_off = tl.full([], _NEG, dtype=tl.float32)
    n_part = NUM_SPLITS * NMT
    for i_p in range(0, n_part, BP):
        o_p = i_p + tl.arange(0, BP)
        b_mp = tl.load(mp_ptr + i_bh * n_part + o_p, mask=o_p < n_part, other=_NEG)
        b_off = tl.maximum(b_off, tl.max(b_mp, axis=0))
    o_f = i_m * BM + tl.arange(0, BM)
    o_e = tl.arange(0, BE)
    m_f, m_e = o_f < M, o_e < E
    b_s = tl.zeros([BM, BE], dtype=tl.float32)
    b_z = tl.zeros([BM], dtype=tl.float32)
    for i_s in range(0, NUM_SPLITS):
        i_part = i_bh * NUM_SPLITS + i_s
        b_alpha = tl.exp(tl.load(mp_ptr + i_part * NMT + i_m) - b_off)
        p_s = sp_ptr + i_part * M * E + o_f[:, None] * E + o_e[None, :]
        b_s += b_alpha * tl.load(p_s, mask=m_f[:, None] & m_e[None, :], other=0.0)
        b_z += b_alpha * tl.load(zp_ptr + i_part * M + o_f, mask=m_f, other=0.0)
    tl.store(s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :], b_s,
             mask=m_f[:, None] & m_e[None, :])  # fmt: skip
    tl.store(z_ptr + i_bh * M + o_f, b_z, mask=m_f)


@triton.jit
def _rf_parallel_fwd_q_kernel(
    q_ptr, w_ptr, s_ptr, z_ptr, o_ptr,
    T, H, sqrt_scale, eps,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out [BT, E] for one query tile of one (b, h): online per-row max over M tiles."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    o_e = tl.arange(0, BE)
    m_t, m_d, m_e = o_t < T, o_d < D, o_e < E

    p_q = (
        q_ptr
        + i_b * stride_qb
        + i_h * stride_qh
        + o_t[:, None] * stride_qt
        + o_d[None, :] * stride_qd
    )
    b_q = tl.load(p_q, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)  # [BT, BD]
    b_mx = tl.full([BT], _NEG, dtype=tl.float32)
    b_num = tl.zeros([BT, BE], dtype=tl.float32)
    b_den = tl.zeros([BT], dtype=tl.float32)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
        b_w = tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)  # [BM, BD]
        b_u = _logits_tile(b_q, b_w, sqrt_scale, FEATURE, PRECISION)  # [BT, BM]
        b_u = tl.where(m_f[None, :], b_u, float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(b_u, axis=1))  # [BT]
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_p = tl.exp(b_u - b_mx_new[:, None])  # [BT, BM]
        p_s = s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :]
        b_s = tl.load(p_s, mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]
        b_z = tl.load(z_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        # [BT, BM] @ [BM, BE] -> [BT, BE]
        b_num = b_num * b_alpha[:, None] + tl.dot(b_p, b_s, input_precision=PRECISION)
        b_den = b_den * b_alpha + tl.sum(b_p * b_z[None, :], axis=1)
        b_mx = b_mx_new
    # denominator policy (rfattn.reference.safe_denominator): |den| < eps -> sign(den) * eps
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


def _check_inputs(q, k, v, w, key_padding_mask) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, H, T, dim], got shape {tuple(x.shape)}")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name}: the Triton kernel takes fp32/fp16/bf16, got {x.dtype}")
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


def _default_splits(n_tiles: int, programs_per_split: int, device: torch.device) -> int:
    """How many programs share one (b, h, M tile)'s keys: enough to fill the device twice."""
    if n_tiles <= 1:
        return 1
    if INTERPRET or device.type != "cuda":
        return min(n_tiles, 4)  # exercises the merge without slowing the interpreter
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(n_tiles, triton.cdiv(2 * sms, programs_per_split)))


def rf_parallel_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    feature: str = "posrf",
    precision: str = "ieee",
    num_splits: int | None = None,
) -> torch.Tensor:
    """Non-causal fused random-feature attention forward.

    Args:
        q: ``[B, H, Tq, D]``; k: ``[B, H, Tk, D]``; v: ``[B, H, Tk, E]`` (any strides, one dtype
            among fp32/fp16/bf16).
        w: ``[M, D]`` feature rows (cast to the input dtype).
        scale: softmax temperature; inputs are multiplied by ``sqrt(scale)`` before projection.
        key_padding_mask: optional ``[B, Tk]`` bool, True = padding.
        feature: a key of :data:`FEATURE_IDS`.
        precision: ``tl.dot`` input precision ("ieee", "tf32", "tf32x3"); fp32 inputs only.
        num_splits: programs sharing one (b, h)'s keys (default: fill the device).

    Returns:
        ``[B, H, Tq, E]`` in the input dtype.
    """
    _check_inputs(q, k, v, w, key_padding_mask)
    if feature not in FEATURE_IDS:
        raise ValueError(f"feature={feature!r} has no fused kernel; have {sorted(FEATURE_IDS)}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
    B, H, Tq, D = q.shape
    Tk, E, M = k.shape[2], v.shape[3], w.shape[0]
    out = torch.empty(B, H, Tq, E, device=q.device, dtype=q.dtype)
    if out.numel() == 0:
        return out
    w = w.to(device=q.device, dtype=q.dtype)
    BD, BE = _next_pow2(D), _next_pow2(E)
    BM = min(64, _next_pow2(M))
    BT = 64 if max(BD, BE) <= 128 else 32
    NMT = triton.cdiv(M, BM)
    n_tiles = triton.cdiv(Tk, BT)
    splits = num_splits or _default_splits(n_tiles, B * H * NMT, q.device)
    tiles_per_split = triton.cdiv(n_tiles, splits) if n_tiles else 0
    splits = triton.cdiv(n_tiles, tiles_per_split) if n_tiles else 1
    sqrt_scale = float(scale) ** 0.5
    fid = FEATURE_IDS[feature]
    num_warps = _num_warps(BD, BE)

    f32 = dict(device=q.device, dtype=torch.float32)
    s_part = torch.empty(B * H * splits, M, E, **f32)
    z_part = torch.empty(B * H * splits, M, **f32)
    m_part = torch.empty(B * H * splits, NMT, **f32)
    if key_padding_mask is not None:
        pad = key_padding_mask.view(torch.uint8)
        pad_args = (pad, pad.stride(0), pad.stride(1))
    else:
        pad_args = (k, 0, 0)  # never read
    _rf_parallel_fwd_kv_kernel[(NMT, splits, B * H)](
        k, v, w, pad_args[0], s_part, z_part, m_part,
        Tk, H, splits, tiles_per_split, sqrt_scale,
        *k.stride(), *v.stride(), *w.stride(), pad_args[1], pad_args[2],
        D=D, M=M, E=E, BT=BT, BD=BD, BM=BM, BE=BE,
        HAS_PAD=key_padding_mask is not None, FEATURE=fid, PRECISION=precision,
        num_warps=num_warps,
    )  # fmt: skip
    s = torch.empty(B * H, M, E, **f32)
    z = torch.empty(B * H, M, **f32)
    _rf_parallel_merge_kernel[(NMT, B * H)](
        s_part, z_part, m_part, s, z, splits,
        M=M, E=E, BM=BM, BE=BE, BP=_next_pow2(min(splits * NMT, 1024)), num_warps=num_warps,
    )  # fmt: skip
    eps = torch.finfo(torch.float32).tiny
    _rf_parallel_fwd_q_kernel[(triton.cdiv(Tq, BT), B * H)](
        q, w, s, z, out,
        Tq, H, sqrt_scale, eps,
        *q.stride(), *w.stride(), *out.stride(),
        D=D, M=M, E=E, BT=BT, BD=BD, BM=BM, BE=BE,
        FEATURE=fid, PRECISION=precision, num_warps=num_warps,
    )  # fmt: skip
    return out
