"""Argument checks, the final device/dtype move and the fast Walsh-Hadamard transform."""

from __future__ import annotations

import math

import torch

__all__ = ["check_sizes", "check_generator", "finish", "fwht", "next_pow2"]


def check_sizes(num_rows: int, head_dim: int) -> None:
    """Raise ValueError naming the argument unless M and D are ints >= 1."""
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 1:
        raise ValueError(f"num_features (M) must be an int >= 1, got {num_rows!r}")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise ValueError(f"head_dim (D) must be an int >= 1, got {head_dim!r}")


def check_generator(generator) -> None:
    """Raise TypeError unless ``generator`` is a CPU ``torch.Generator``.

    Why: ``torch.randn(..., generator=None)`` silently falls back to the global RNG, which would
    break "same seed, same matrix".
    """
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        raise TypeError(f"generator must be a CPU torch.Generator, got {generator!r}")


def finish(w: torch.Tensor, device, dtype) -> torch.Tensor:
    """Move a float64 CPU draw to ``device`` / ``dtype`` (defaults: CPU, the default dtype)."""
    dtype = dtype or torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return w.to(device=device or "cpu", dtype=dtype)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def fwht(x: torch.Tensor, *, normalized: bool = True) -> torch.Tensor:
    """Fast Walsh-Hadamard transform along the last dimension, O(n log n) per vector.

    Computes ``x @ H`` (H symmetric, Sylvester order: ``H_2n = [[H_n, H_n], [H_n, -H_n]]``) with
    ``log2(n)`` butterfly stages of plain torch ops, so it runs on any device and is
    differentiable.

    Args:
        x: ``[..., n]`` with n a power of two.
        normalized: divide by ``sqrt(n)`` (H orthogonal, entries ``±1/sqrt(n)``); False gives
            the ``±1`` matrix.

    Returns:
        ``[..., n]``, same dtype and device.
    """
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"fwht needs a power-of-two last dimension, got {n}")
    shape = x.shape
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)  # pair entry j with j + h inside blocks of 2h
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    y = y.reshape(shape)
    return y / math.sqrt(n) if normalized else y
