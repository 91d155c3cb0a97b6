"""Timers: ``triton.testing.do_bench`` on GPU, a synchronising wall-clock loop on CPU.

Both return ``(p50, p20, p80, n)``: the median and the 20% / 80% quantiles in milliseconds over
``n`` timed calls, warm-up (compilation, autotuning, first-touch allocation) excluded.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

QUANTILES = (0.5, 0.2, 0.8)


def quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile (numpy's default method)."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_cpu(
    fn: Callable[[], object],
    warmup: int = 1,
    min_reps: int = 3,
    max_reps: int = 50,
    budget_s: float = 1.0,
) -> tuple[float, float, float, int]:
    """Wall-clock ``fn`` after ``warmup`` calls: at least ``min_reps`` calls, then more until
    ``budget_s`` seconds of timed calls or ``max_reps`` calls."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < min_reps or (len(times) < max_reps and spent < budget_s):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        spent += dt
        times.append(dt * 1e3)
    return summary(times)


def time_cpu_rounds(
    fns: dict[str, Callable[[], object]],
    min_rounds: int = 3,
    max_rounds: int = 50,
    budget_s: float = 2.0,
) -> dict[str, list[float]]:
    """Wall-clock several calls side by side: rounds of one call each (in the given order, then
    reversed, alternately, so neither goes first more often), at least ``min_rounds`` and then
    more until ``budget_s`` seconds or ``max_rounds``. Returns each name's times in ms, one per
    round: the i-th times of two names were taken moments apart, so their ratio is robust to a
    host whose speed drifts (a shared machine's), which separate timings minutes apart are not.
    No warm-up: call each once before."""
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    spent, rounds = 0.0, 0
    while rounds < min_rounds or (rounds < max_rounds and spent < budget_s):
        for n in names if rounds % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            fns[n]()
            dt = time.perf_counter() - t0
            spent += dt
            times[n].append(dt * 1e3)
        rounds += 1
    return times


def summary(times: list[float]) -> tuple[float, float, float, int]:
    """``(p50, p20, p80, n)`` of times in ms (:data:`QUANTILES`)."""
    return tuple(quantile(times, q) for q in QUANTILES) + (len(times),)


def paired_ratio(num: list[float], den: list[float]) -> tuple[float, float, float]:
    """``(p50, p20, p80)`` of the per-round ratios ``num[i] / den[i]`` of two names' times from
    :func:`time_cpu_rounds` (e.g. softmax / rfattn: the speed-up, measured moments apart)."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return tuple(quantile(ratios, q) for q in QUANTILES)


def time_gpu(
    fn: Callable[[], object], grad_to_none=None, rep_ms: int = 100
) -> tuple[float, float, float, int]:
    """``triton.testing.do_bench`` (its own warm-up and L2 flush) after one untimed call that
    compiles and autotunes; ``n`` is not reported by do_bench and returned as -1."""
    import triton.testing

    fn()
    torch.cuda.synchronize()
    p50, p20, p80 = triton.testing.do_bench(
        fn, warmup=25, rep=rep_ms, grad_to_none=grad_to_none, quantiles=list(QUANTILES)
    )
    return p50, p20, p80, -1


def time_fn(fn, device: torch.device, grad_to_none=None, **cpu_kwargs):
    if device.type == "cuda":
        return time_gpu(fn, grad_to_none=grad_to_none)
    return time_cpu(fn, **cpu_kwargs)
