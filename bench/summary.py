"""Speed-ups and crossovers from result rows (plain Python, no torch: ``plots/`` may use it)."""

from __future__ import annotations

from collections import defaultdict


def _softmax(row: dict) -> bool:
    return row.get("feature") is None


def best_softmax(results: list[dict], causal: bool, mode: str) -> dict[int, tuple[float, str]]:
    """``{T: (ms, provider)}`` of the fastest exact-softmax provider at each T."""
    best: dict[int, tuple[float, str]] = {}
    for r in results:
        if _softmax(r) and r["causal"] == causal and r["mode"] == mode:
            if r["T"] not in best or r["ms_p50"] < best[r["T"]][0]:
                best[r["T"]] = (r["ms_p50"], r["provider"])
    return best


def crossover(points: list[tuple[int, float]]) -> int | None:
    """The first T from which the speed-up stays above 1 (through the largest T), or None.

    Args:
        points: ``(T, speed-up)`` pairs, speed-up = softmax ms / rfattn ms.
    """
    cross = None
    for t, ratio in sorted(points):
        if ratio > 1.0:
            cross = t if cross is None else cross
        else:
            cross = None
    return cross


def summarize(results: list[dict], provider: str = "rfattn") -> list[dict]:
    """One entry per (feature, causal, mode) of ``provider``: its speed-up over the best softmax
    provider at each T where both ran, the crossover T and the ratio at the largest such T."""
    series: dict = defaultdict(dict)
    for r in results:
        if r["provider"] == provider:
            series[(r["feature"], r["causal"], r["mode"])][r["T"]] = r["ms_p50"]
    out = []
    for (feature, causal, mode), ms_by_t in sorted(series.items(), key=str):
        best = best_softmax(results, causal, mode)
        pts = [(t, best[t][0] / ms) for t, ms in sorted(ms_by_t.items()) if t in best]
        out.append(
            {
                "provider": provider,
                "feature": feature,
                "causal": causal,
                "mode": mode,
                "speedup": {str(t): r for t, r in pts},
                "baseline": {str(t): best[t][1] for t, _ in pts},
                "crossover_T": crossover(pts),
                "max_T": pts[-1][0] if pts else None,
                "ratio_at_max_T": pts[-1][1] if pts else None,
            }
        )
    return out


def describe(entry: dict) -> str:
    """One line for the printed summary."""
    head = f"{entry['provider']}[{entry['feature']}] causal={int(entry['causal'])} {entry['mode']}"
    if entry["max_T"] is None:
        return f"{head}: no T where both it and a softmax provider ran"
    t, r = entry["max_T"], entry["ratio_at_max_T"]
    at = (
        f"at T={t} {r:.2f}x faster than {entry['baseline'][str(t)]}"
        if r >= 1
        else f"at T={t} {1 / r:.2f}x slower than {entry['baseline'][str(t)]}"
    )
    cross = entry["crossover_T"]
    return f"{head}: crossover T={cross if cross is not None else 'none'}; {at}"
