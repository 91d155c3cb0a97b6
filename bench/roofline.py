"""Device ceilings (measured in every run) and the work model of each provider.

Ceilings are measured before and after the sweep (the better of the two kept). The roofline
floor of a call is ``max(flops / matmul FLOP/s, bytes / copy bandwidth)``; a result's
``roofline_fraction`` is that floor over its measured median time (1 = at the ceiling).

Work model (documented, deliberately simple):

* FLOPs count the matmuls of the algorithm the provider runs, one multiply-add = 2 FLOPs.
  Softmax: ``2 T^2 (D + E)`` per (batch, head), halved when causal. Random features:
  ``4 T M D`` (projections of q and k) + ``4 T F (E + 1)`` (``phi_k^T [V, 1]`` and
  ``phi_q [S, z]``), causal or not; F is the feature width (M, or 2M for two-sided features).
  Backward = 2.5x forward for softmax (flash-attention's convention: five matmuls for two) and 2x
  for random features (two matmuls per forward matmul).
* Bytes are the compulsory traffic: read q, k, v and write out (fwd); the backward reads q, k, v,
  out, dout and writes dq, dk, dv. Intermediates are free in the model, which is what makes the
  floor a floor.
"""

from __future__ import annotations

import time

import torch

from bench.timing import time_fn


def _best_ms(fn, device) -> float:
    """The fastest of several calls: a ceiling is what the device can do, and on a shared
    machine the median mostly measures the neighbours."""
    if device.type == "cuda":
        return time_fn(fn, device)[1]  # do_bench's 20% quantile
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        best = min(best, (time.perf_counter() - t0) * 1e3)
    return best


def measure_ceilings(device: torch.device, dtype: torch.dtype, n: int, copy_mib: int) -> dict:
    """Large-matmul FLOP/s (``[n, n] @ [n, n]`` in ``dtype``) and copy bandwidth (``copy_``
    of a ``copy_mib`` MiB fp32 buffer: read + write bytes per second); best of 5 calls on CPU,
    the 20% quantile of ``do_bench`` on GPU."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    mm_ms = _best_ms(lambda: a @ b, device)
    numel = copy_mib * 2**20 // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    copy_ms = _best_ms(lambda: dst.copy_(src), device)
    return {
        "matmul_flop_per_s": 2.0 * n**3 / (mm_ms * 1e-3),
        "matmul_shape": [n, n, n],
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "copy_bytes_per_s": 2.0 * numel * 4 / (copy_ms * 1e-3),
        "copy_bytes": numel * 4,
    }


def flops(provider_is_softmax: bool, B, H, T, D, E, M, F, causal: bool, backward: bool) -> float:
    """FLOPs of one call under the work model above."""
    if provider_is_softmax:
        fwd = 2.0 * T * T * (D + E) * (0.5 if causal else 1.0)
        total = fwd * (3.5 if backward else 1.0)
    else:
        fwd = 4.0 * T * M * D + 4.0 * T * F * (E + 1)
        total = fwd * (3.0 if backward else 1.0)
    return B * H * total


def compulsory_bytes(B, H, T, D, E, elem: int, backward: bool) -> float:
    """Bytes a call must move at least: its inputs and outputs."""
    fwd = 2 * D + 2 * E  # q, k, v in; out
    bwd = (2 * D + 3 * E) + (2 * D + E) if backward else 0  # q, k, v, out, dout in; dq, dk, dv
    return float(B * H * T * (fwd + bwd) * elem)


def roofline_fraction(ms: float, n_flops: float, n_bytes: float, ceilings: dict) -> float:
    floor_s = max(n_flops / ceilings["matmul_flop_per_s"], n_bytes / ceilings["copy_bytes_per_s"])
    return floor_s / (ms * 1e-3)
