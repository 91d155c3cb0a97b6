"""Per-(b, h) token moments for the data-dependent features (oprf, saderf, ...): the stats pass.

For one side (queries or keys) of one (b, h), over the valid tokens (inside T, not padded):

    n = #valid     sum_t x~_t     sum_t x~_t^2     sum_t |x~_t|     min_t x~_t          [D] each

with ``x~ = sqrt(scale) * x`` in the accumulation dtype (fp32; fp64 for fp64 inputs). Grid
(T splits, B*H): each program reduces a contiguous range of tokens and writes its partial sums;
the launcher adds the partials in a fixed order (deterministic, no atomics) and divides by
``max(n, 1)``. The result is exactly what ``rfattn.stats.sequence_moments`` computes (mean, mean
square, mean absolute value, minimum with 0 where no token is valid) up to summation order; the
closed forms that turn moments into feature parameters stay in ``rfattn.stats``.

Layout: x ``[B, H, T, D]`` with any strides; ``key_padding_mask`` ``[B, T]`` bool (True = padding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import DTYPES, INTERPRET, next_pow2, split_counts

__all__ = ["token_moments", "sequence_moments_fused"]

#: fields of a partial, in order: sum x, sum x^2, sum |x|, min x
_FIELDS = tl.constexpr(4)


def autotune_configs():
    if INTERPRET:
        return [triton.Config({"BT": 64}, num_warps=1)]
    return [triton.Config({"BT": bt}, num_warps=w) for bt in (32, 64, 128) for w in (2, 4)]


@triton.autotune(configs=autotune_configs(), key=["D", "ACC"])
@triton.jit
def _moments_kernel(
    x_ptr,
    pad_ptr,
    scale_ptr,
    part_ptr,
    cnt_ptr,
    T,
    H,
    NUM_SPLITS,
    t_per_split,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    stride_pb,
    stride_pt,
    D: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
    HAS_PAD: tl.constexpr,
    ACC: tl.constexpr,
):
    """Partial (sum, sum of squares, sum of |.|, min) [4, D] and count of one T split."""
    i_s, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_sc = tl.load(scale_ptr).to(ACC)
    x_base = x_ptr + i_b * stride_xb + i_h * stride_xh
    b_sum = tl.zeros([BD], dtype=ACC)
    b_sq = tl.zeros([BD], dtype=ACC)
    b_abs = tl.zeros([BD], dtype=ACC)
    b_min = tl.full([BD], float("inf"), dtype=ACC)
    b_cnt = tl.zeros([BT], dtype=ACC)
    t0 = i_s.to(tl.int64) * t_per_split
    for t in range(0, t_per_split, BT):
        o_t = t0 + t + tl.arange(0, BT)
        m_t = o_t < T
        if HAS_PAD:
            b_pad = tl.load(pad_ptr + i_b * stride_pb + o_t * stride_pt, mask=m_t, other=1)
            m_t = m_t & (b_pad == 0)
        p_x = x_base + o_t[:, None] * stride_xt + o_d[None, :] * stride_xd
        m_x = m_t[:, None] & m_d[None, :]
        b_x = tl.load(p_x, mask=m_x, other=0.0).to(ACC) * b_sc  # [BT, BD], 0 where invalid
        b_sum += tl.sum(b_x, axis=0)
        b_sq += tl.sum(b_x * b_x, axis=0)
        b_abs += tl.sum(tl.abs(b_x), axis=0)
        b_min = tl.minimum(b_min, tl.min(tl.where(m_x, b_x, float("inf")), axis=0))
        b_cnt += m_t.to(ACC)
    i_part = i_bh * NUM_SPLITS + i_s
    p_part = part_ptr + i_part * _FIELDS * D + o_d
    tl.store(p_part, b_sum, mask=m_d)
    tl.store(p_part + D, b_sq, mask=m_d)
    tl.store(p_part + 2 * D, b_abs, mask=m_d)
    tl.store(p_part + 3 * D, b_min, mask=m_d)
    tl.store(cnt_ptr + i_part, tl.sum(b_cnt, axis=0))


def token_moments(
    x: torch.Tensor,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Moments of ``sqrt(scale) * x`` over the valid tokens of each (b, h).

    Args:
        x: ``[B, H, T, D]`` (fp32/fp16/bf16/fp64, any strides).
        scale: the softmax temperature (x is multiplied by ``sqrt(scale)``).
        key_padding_mask: optional ``[B, T]`` bool, True = padding (excluded).
        num_splits: programs sharing one (b, h)'s tokens (default: fill the device).

    Returns:
        ``(mean, mean square, mean |.|, min)``, each ``[B, H, D]`` in fp32 (fp64 for fp64
        inputs); means divide by ``max(n, 1)``, the min is 0 where no token is valid.
    """
    if x.dim() != 4 or x.dtype not in DTYPES:
        raise ValueError(f"x must be [B, H, T, D] in {DTYPES}, got {tuple(x.shape)} {x.dtype}")
    B, H, T, D = x.shape
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (B, T)
    ):
        raise ValueError(f"key_padding_mask must be bool [B, T] = {(B, T)}")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dev = x.device
    if B * H == 0 or T == 0:
        zeros = torch.zeros(B, H, D, device=dev, dtype=acc)
        return zeros, zeros.clone(), zeros.clone(), zeros.clone()
    splits, per = split_counts(T, B * H, dev, num_splits)
    part = torch.empty(B * H, splits, _FIELDS.value, D, device=dev, dtype=acc)
    cnt = torch.empty(B * H, splits, device=dev, dtype=acc)
    sc = torch.full((1,), float(scale) ** 0.5, device=dev, dtype=acc)  # a fill, no host copy
    if key_padding_mask is not None:
        pad = key_padding_mask.view(torch.uint8)
        pad_args = (pad, pad.stride(0), pad.stride(1))
    else:
        pad_args = (sc, 0, 0)  # never read
    _moments_kernel[(splits, B * H)](
        x,
        pad_args[0],
        sc,
        part,
        cnt,
        T,
        H,
        splits,
        per,
        *x.stride(),
        pad_args[1],
        pad_args[2],
        D=D,
        BD=next_pow2(D),
        HAS_PAD=key_padding_mask is not None,
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
    )
    # fixed-order reductions over the splits: deterministic
    sums = part.sum(dim=1)  # [B*H, 4, D]
    n = cnt.sum(dim=1)  # [B*H]
    denom = n.clamp_min(1.0)[:, None]
    mn = part[:, :, 3].amin(dim=1)
    mn = torch.where(n[:, None] > 0, mn, torch.zeros_like(mn))
    out = (sums[:, 0] / denom, sums[:, 1] / denom, sums[:, 2] / denom, mn)
    return tuple(t.view(B, H, D) for t in out)


def sequence_moments_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused equivalent of ``rfattn.stats.sequence_moments(sqrt(scale) q, sqrt(scale) k,
    key_padding_mask, query_padding_mask)`` on raw q ``[B, H, Tq, D]``, k ``[B, H, Tk, D]``.

    Returns:
        ``(mean, sq, abs, min)``, each ``[B, H, 2, D]`` (row 0 queries, row 1 keys), the fields
        of ``rfattn.stats.Moments``.
    """
    mq = token_moments(q, scale, query_padding_mask)
    mk = token_moments(k, scale, key_padding_mask)
    return tuple(torch.stack((a, b), dim=-2) for a, b in zip(mq, mk, strict=True))
