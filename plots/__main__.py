"""Turn a ``bench.json`` written by ``python -m bench`` into PNG figures, one question each."""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _series(results, key):
    """{(causal, mode): {provider: [(T, value), ...]}} sorted by T."""
    out: dict = defaultdict(lambda: defaultdict(list))
    for r in results:
        if r.get(key) is not None:
            out[(r["causal"], r["mode"])][r["provider"]].append((r["T"], r[key]))
    for panel in out.values():
        for pts in panel.values():
            pts.sort()
    return out


def _title(doc, what):
    cfg = doc["config"]
    return (
        f"{what} on {doc['env']['device']}\n{cfg['dtype']} B={cfg['B']} H={cfg['H']} "
        f"D={cfg['D']} E={cfg['E']} M={cfg['M']} {cfg['feature']}/{cfg['weights']}"
    )


def plot_metric(doc, key, ylabel, path, what):
    series = _series(doc["results"], key)
    if not series:
        return None
    panels = sorted(series)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        for provider, pts in sorted(series[panel].items()):
            ts, ys = zip(*pts, strict=True)
            ax.plot(ts, ys, marker="o", label=provider)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel(ylabel)
        ax.set_title(f"causal={panel[0]}, {panel[1]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(doc, what), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_speedup(doc, path, baseline_prefix="sdpa-"):
    """rfattn's speed-up over the fastest softmax provider, crossover (speed-up = 1) marked."""
    series = _series(doc["results"], "ms_p50")
    panels = sorted(series)
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        by = series[panel]
        best = {}
        for provider, pts in by.items():
            if provider.startswith(baseline_prefix):
                for t, ms in pts:
                    best[t] = min(best.get(t, float("inf")), ms)
        pts = [(t, best[t] / ms) for t, ms in by.get("rfattn", []) if t in best]
        if pts:
            ts, ys = zip(*pts, strict=True)
            ax.plot(ts, ys, marker="o", label="rfattn vs best softmax")
            ax.axhline(1.0, color="grey", lw=1, ls="--")
            cross = next((t for t, y in pts if y >= 1.0), None)
            if cross is not None:
                ax.axvline(cross, color="red", lw=1, ls=":", label=f"crossover T={cross}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_ylabel("speed-up (softmax ms / rfattn ms)")
        ax.set_title(f"causal={panel[0]}, {panel[1]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(doc, "rfattn speed-up over softmax attention"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m plots", description=__doc__)
    p.add_argument("json", help="bench.json written by python -m bench")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: beside the JSON)")
    args = p.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    out = Path(args.out) if args.out else Path(args.json).parent
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_metric(
            doc, "ms_p50", "time per call (ms, median)", out / "time_vs_T.png", "Attention time"
        ),
        plot_metric(
            doc, "peak_bytes", "peak memory (bytes)", out / "memory_vs_T.png", "Peak memory"
        ),
        plot_speedup(doc, out / "speedup_vs_T.png"),
    ]
    for path in written:
        if path is not None:
            print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
