"""Reference attention, dtype-generic (run it in float64 to check everything else against it).

Three references, each the plainest correct form (quadratic memory where that is simplest):

* :func:`softmax_attention`: ``softmax(scale * Q K^T) V``.
* :func:`kernel_attention`: ``K(Q, K) V / K(Q, K) 1`` for any kernel function of (q, k).
* :func:`linear_attention`: ``phi_q (phi_k^T V) / phi_q (phi_k^T 1)`` from feature maps.

Conventions shared with the torch path and the kernels (docs/usage.md, docs/numerics.md):

* layout ``[B, H, T, D]`` (values ``[B, H, T, E]``);
* ``key_padding_mask`` ``[B, Tk]`` bool, True = padding: padded keys are removed from numerator
  and denominator (their values are never read, so NaN padding is harmless);
* ``causal=True`` needs ``Tq == Tk``; query i sees keys j <= i;
* denominator policy (:func:`safe_denominator`): ``|den| < tiny`` becomes ``sign(den) * tiny``
  (``tiny = torch.finfo(dtype).tiny``, sign of 0 taken as +). A query with no valid key therefore
  gets output 0 (numerator 0), in every reference, the torch path and the kernels alike, with zero
  gradient (:func:`attention_ratio`). NaN in the denominator stays NaN.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = [
    "softmax_attention",
    "kernel_attention",
    "linear_attention",
    "safe_denominator",
    "attention_ratio",
]


def safe_denominator(den: torch.Tensor) -> torch.Tensor:
    """Clamp ``|den|`` to at least ``tiny`` keeping its sign (0 counts as positive); NaN stays."""
    tiny = torch.finfo(den.dtype).tiny
    return torch.where(den < 0, den.clamp(max=-tiny), den.clamp(min=tiny))


def attention_ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` per query row (``num`` ``[..., T, E]``, ``den`` ``[..., T]``) with the
    denominator policy of :func:`safe_denominator`. A row with ``den == 0`` and ``num == 0``
    exactly, a query with no valid key, gives exactly 0 with zero gradient (dividing by tiny
    would overflow ``do / tiny`` and meet a 0 in the backward: NaN)."""
    empty = (den == 0) & (num == 0).all(dim=-1)
    den = torch.where(empty, torch.ones_like(den), safe_denominator(den))
    return torch.where(empty[..., None], torch.zeros_like(num), num / den[..., None])


def _allowed(
    tq: int,
    tk: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Bool ``[B, 1, Tq, Tk]`` (or broadcastable) of allowed (query, key) pairs, None = all."""
    allowed = None
    if causal:
        if tq != tk:
            raise ValueError(f"causal attention needs Tq == Tk, got Tq={tq}, Tk={tk}")
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=device).tril()[None, None]
    if key_padding_mask is not None:
        valid = ~key_padding_mask[:, None, None, :]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def _masked_values(v: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    if key_padding_mask is None:
        return v
    return v.masked_fill(key_padding_mask[:, None, :, None], 0.0)


def softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact softmax attention ``softmax(scale * Q K^T) V``.

    Args:
        q: ``[B, H, Tq, D]``; k: ``[B, H, Tk, D]``; v: ``[B, H, Tk, E]``.
        causal: mask keys after the query position (needs Tq == Tk).
        scale: softmax temperature, default ``D ** -0.5``.
        key_padding_mask: ``[B, Tk]`` bool, True = padding.

    Returns:
        ``[B, H, Tq, E]`` in the dtype of ``q``; 0 for a query with no valid key.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    allowed = _allowed(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if scores.shape[-1] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max == float("-inf"), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    return attention_ratio(p @ _masked_values(v, key_padding_mask), p.sum(-1))


def kernel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact (quadratic) attention for any kernel: ``out_i = sum_j K_ij v_j / sum_j K_ij``.

    Args:
        q: ``[B, H, Tq, D]``; k: ``[B, H, Tk, D]``; v: ``[B, H, Tk, E]``.
        kernel_fn: maps ``(q, k)`` to the kernel matrix ``[B, H, Tq, Tk]``, e.g.
            ``lambda q, k: torch.exp(q @ k.transpose(-1, -2) * scale)``.
        causal, key_padding_mask: as in :func:`softmax_attention`.

    Returns:
        ``[B, H, Tq, E]``.
    """
    kmat = kernel_fn(q, k)
    allowed = _allowed(q.shape[-2], k.shape[-2], causal, key_padding_mask, q.device)
    if allowed is not None:
        kmat = kmat.masked_fill(~allowed, 0.0)
    return attention_ratio(kmat @ _masked_values(v, key_padding_mask), kmat.sum(-1))


def linear_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    reduce=None,
) -> torch.Tensor:
    """Linear attention from features: ``phi_q S / phi_q z``, ``S = phi_k^T V``, ``z = phi_k^T 1``.

    Non-causal uses the linear form; causal uses the masked quadratic form
    ``(phi_q phi_k^T ⊙ tril) V / (phi_q phi_k^T ⊙ tril) 1`` (plain and obviously right; the
    torch path and kernels compute it chunkwise).

    Args:
        phi_q: ``[B, H, Tq, F]``; phi_k: ``[B, H, Tk, F]``; v: ``[B, H, Tk, E]``.
        causal: prefix sums (needs Tq == Tk).
        key_padding_mask: ``[B, Tk]`` bool, True = padding (removed from S and z).
        reduce: non-causal, keys sharded over processes (``rfattn.distributed``): ``(S, z) ->
            (S, z)`` summed over them.

    Returns:
        ``[B, H, Tq, E]``.
    """
    if key_padding_mask is not None:
        phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
        v = _masked_values(v, key_padding_mask)
    if causal:
        return kernel_attention(phi_q, phi_k, v, lambda a, b: a @ b.transpose(-1, -2), causal=True)
    s = phi_k.transpose(-1, -2) @ v  # [B, H, F, E]
    z = phi_k.sum(dim=-2)  # [B, H, F]
    if reduce is not None:
        s, z = reduce(s, z)
    return attention_ratio(phi_q @ s, (phi_q @ z[..., None]).squeeze(-1))
