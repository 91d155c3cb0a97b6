"""python -m plots bench.json [--out DIR]: one PNG per question from a ``python -m bench`` JSON.

* ``time_vs_T.png``: median time per call against T (20-80% band), every provider.
* ``memory_vs_T.png``: peak memory above the inputs against T, with the fitted log-log slope
  (1 = linear in T, 2 = quadratic) in the legend.
* ``speedup_vs_T.png``: rfattn's speed-up over the fastest exact-softmax provider at each T,
  crossover marked.
* ``error_vs_M.png``: rfattn's relative error against exact softmax attention as M grows.

Reads the JSON only (no torch), Agg backend.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODES = ("fwd", "fwd+bwd")


def label(row: dict) -> str:
    return row["provider"] + (f"[{row['feature']}]" if row.get("feature") else "")


def _style(name: str, names: list[str]) -> dict:
    """Solid lines for random-feature providers, dashed for exact softmax; stable colours."""
    cmap = plt.get_cmap("tab10")
    colour = cmap(names.index(name) % 10)
    softmax = "[" not in name
    return dict(color=colour, ls="--" if softmax else "-", marker="s" if softmax else "o", ms=4)


def _panels(results) -> list[tuple[str, bool]]:
    found = {(r["mode"], r["causal"]) for r in results}
    return [(m, c) for m in MODES for c in (False, True) if (m, c) in found]


def _grid(panels, width=5.2, height=3.9):
    modes = sorted({m for m, _ in panels}, key=MODES.index)
    causals = sorted({c for _, c in panels})
    fig, axes = plt.subplots(
        len(modes),
        len(causals),
        figsize=(width * len(causals), height * len(modes)),
        squeeze=False,
    )
    where = {(m, c): axes[i][j] for i, m in enumerate(modes) for j, c in enumerate(causals)}
    for key, ax in where.items():
        if key not in panels:
            ax.set_visible(False)
    return fig, where


def _subtitle(doc) -> str:
    cfg, env = doc["config"], doc["env"]
    commit = (env.get("git_commit") or "?")[:8]
    return (
        f"{env['device']} | {cfg['dtype']} B={cfg['B']} H={cfg['H']} D={cfg['D']} E={cfg['E']} "
        f"M={cfg['M']} | torch {env['torch']} | commit {commit}"
    )


def _finish(fig, doc, title, path) -> Path:
    fig.suptitle(f"{title}\n{_subtitle(doc)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _log_axes(ax, xlabel, ylabel, title):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def loglog_slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(y) on log(x) over the larger half of the x (at least 2)."""
    pts = [(x, y) for x, y in sorted(points) if x > 0 and y and y > 0]
    pts = pts[-max(2, math.ceil(len(pts) / 2)) :]
    if len(pts) < 2:
        return None
    xs = [math.log(x) for x, _ in pts]
    ys = [math.log(y) for _, y in pts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else None


def plot_vs_T(doc, key, ylabel, path, title, scale=1.0, slope=False, band=None):
    results = [r for r in doc["results"] if r.get(key) is not None]
    panels = _panels(results)
    if not panels:
        return None
    names = sorted({label(r) for r in doc["results"]})
    fig, where = _grid(panels)
    for (mode, causal), ax in where.items():
        series = defaultdict(list)
        for r in results:
            if r["mode"] == mode and r["causal"] == causal:
                series[label(r)].append(r)
        for name in names:
            rows = sorted(series.get(name, []), key=lambda r: r["T"])
            rows = [r for r in rows if r[key] * scale > 0]
            if not rows:
                continue
            ts = [r["T"] for r in rows]
            ys = [r[key] * scale for r in rows]
            text = name
            if slope:
                s = loglog_slope(list(zip(ts, ys, strict=True)))
                text += f" (slope {s:.2f})" if s is not None else ""
            ax.plot(ts, ys, label=text, **_style(name, names))
            if band:
                lo = [r[band[0]] * scale for r in rows]
                hi = [r[band[1]] * scale for r in rows]
                ax.fill_between(ts, lo, hi, color=_style(name, names)["color"], alpha=0.15)
        _log_axes(
            ax, "sequence length T", ylabel, f"{'causal' if causal else 'non-causal'}, {mode}"
        )
        ax.legend(fontsize=7)
    return _finish(fig, doc, title, path)


def plot_speedup(doc, path):
    """rfattn's speed-up over the best softmax provider, one line per feature kind."""
    entries = [e for e in doc.get("summary", []) if e["speedup"]]
    panels = [
        p
        for p in _panels(doc["results"])
        if any(e["mode"] == p[0] and e["causal"] == p[1] for e in entries)
    ]
    if not panels:
        return None
    names = sorted({label(r) for r in doc["results"]})
    fig, where = _grid(panels)
    for (mode, causal), ax in where.items():
        for e in entries:
            if e["mode"] != mode or e["causal"] != causal:
                continue
            name = f"{e['provider']}[{e['feature']}]"
            pts = sorted((int(t), r) for t, r in e["speedup"].items())
            ts, ys = zip(*pts, strict=True)
            style = _style(name, names) if name in names else {}
            ax.plot(ts, ys, label=f"{name} vs best softmax", **style)
            if e["crossover_T"] is not None:
                ax.axvline(e["crossover_T"], color=style.get("color"), lw=1, ls=":")
                ax.annotate(
                    f"crossover\nT={e['crossover_T']}",
                    (e["crossover_T"], 1.0),
                    textcoords="offset points",
                    xytext=(3, 8),
                    fontsize=7,
                    color=style.get("color"),
                )
            ax.annotate(
                f"{ys[-1]:.2g}x",
                (ts[-1], ys[-1]),
                textcoords="offset points",
                xytext=(4, 0),
                fontsize=7,
                color=style.get("color"),
                va="center",
            )
        ax.axhline(1.0, color="black", lw=1, ls="--")
        _log_axes(
            ax,
            "sequence length T",
            "speed-up (softmax ms / rfattn ms)",
            f"{'causal' if causal else 'non-causal'}, {mode}  (>1: rfattn faster)",
        )
        ax.legend(fontsize=7, loc="upper left")
    return _finish(fig, doc, "rfattn speed-up over the fastest exact-softmax provider", path)


def plot_error_vs_m(doc, path):
    rows = doc.get("error_vs_M") or []
    causals = sorted({r["causal"] for r in rows})
    if not causals:
        return None
    fig, axes = plt.subplots(1, len(causals), figsize=(5.2 * len(causals), 3.9), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, causal in zip(axes[0], causals, strict=True):
        feats = sorted({r["feature"] for r in rows if r["causal"] == causal})
        first = None
        for i, f in enumerate(feats):
            pts = sorted((r["M"], r) for r in rows if r["causal"] == causal and r["feature"] == f)
            ms = [m for m, _ in pts]
            ax.plot(
                ms,
                [r["rel_err_mean"] for _, r in pts],
                marker="o",
                ms=4,
                color=cmap(i),
                label=f"rfattn[{f}] ({pts[0][1]['weights']})",
            )
            ax.fill_between(
                ms,
                [r["rel_err_min"] for _, r in pts],
                [r["rel_err_max"] for _, r in pts],
                color=cmap(i),
                alpha=0.15,
            )
            first = first or pts
        if first:
            m0, e0 = first[0][0], first[0][1]["rel_err_mean"]
            ms = [m for m, _ in first]
            ax.plot(
                ms,
                [e0 * math.sqrt(m0 / m) for m in ms],
                color="grey",
                ls="--",
                lw=1,
                label="~ M^-1/2",
            )
        r0 = rows[0]
        _log_axes(
            ax,
            "random features M",
            "rel. RMS error vs exact softmax",
            f"{'causal' if causal else 'non-causal'}, T={r0['T']}, q,k~N(0,{r0['std']}^2)",
        )
        ax.legend(fontsize=7)
    return _finish(
        fig, doc, f"rfattn error against M (mean and range of {rows[0]['seeds']} draws)", path
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m plots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("json", help="bench.json written by python -m bench")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: beside the JSON)")
    args = p.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    keys = ("B", "H", "D", "E", "M", "dtype")
    if not (isinstance(doc, dict) and isinstance(doc.get("results"), list)
            and all(k in doc.get("config", {}) for k in keys)):  # fmt: skip
        p.error(f"{args.json} is not a JSON of python -m bench (bench.json), the only kind "
                "python -m plots draws")  # fmt: skip
    out = Path(args.out) if args.out else Path(args.json).parent
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_vs_T(
            doc,
            "ms_p50",
            "time per call (ms, median; band 20-80%)",
            out / "time_vs_T.png",
            "Attention time against sequence length",
            band=("ms_p20", "ms_p80"),
        ),
        plot_vs_T(
            doc,
            "peak_bytes",
            "peak memory above inputs (MiB)",
            out / "memory_vs_T.png",
            "Peak memory against sequence length",
            scale=2**-20,
            slope=True,
        ),
        plot_speedup(doc, out / "speedup_vs_T.png"),
        plot_error_vs_m(doc, out / "error_vs_M.png"),
    ]
    written = [path for path in written if path is not None]
    for path in written:
        print(f"# wrote {path}")
    if not written:
        p.error(f"{args.json} holds no results to plot")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
