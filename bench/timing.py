"""Timers: ``triton.testing.do_bench`` on GPU, a synchronising wall-clock loop on CPU.

Both report the median and the 20% / 80% quantiles in milliseconds, warm-up excluded.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

QUANTILES = (0.5, 0.2, 0.8)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_cpu(fn: Callable[[], object], warmup: int = 1, reps: int = 5, budget_s: float = 5.0):
    """(p50, p20, p80) ms of ``fn`` by wall clock; stops early once ``budget_s`` is spent."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 2 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), _quantile(times, 0.2), _quantile(times, 0.8)


def time_gpu(fn: Callable[[], object]):
    """(p50, p20, p80) ms of ``fn`` by ``triton.testing.do_bench`` (warm-up and flush inside)."""
    import triton.testing

    fn()  # compile / autotune outside the timed region
    torch.cuda.synchronize()
    return tuple(triton.testing.do_bench(fn, quantiles=list(QUANTILES)))


def time_fn(fn: Callable[[], object], device: torch.device, **cpu_kwargs):
    return time_gpu(fn) if device.type == "cuda" else time_cpu(fn, **cpu_kwargs)
