"""The torch path as a CPU backend: rfattn against SDPA's CPU flash kernel, against the previous
torch path (eager and under ``torch.compile``), its peak memory, and its time with one core busy.

Shape: B=1, H=8, D=E=64, M=256, posrf with orf weights, fp32, on the CPU (all its threads).
Providers (``bench.providers``):

* ``rfattn``: ``rf_attention`` on the CPU, i.e. the blocked torch path (``rfattn.blocked``);
* ``sdpa-flash``: ``scaled_dot_product_attention`` with the flash backend forced;
* ``rfattn-previous``: the torch path before the blocked forms (features of the whole sequence,
  then ``linear_attention`` or the 128-token chunk loop, autograd over every op);
* ``...-compiled`` (T = 4096 only): ``torch.compile`` of the previous path and of ``rf_attention``
  (default inductor; compile time reported apart, excluded from the timing).

Time: ``bench.timing.time_cpu`` (one warm-up call, then at least ``--reps`` calls and up to 2 s),
median and 20/80 % quantiles. Peak memory: ``bench.memory``'s worker process (above the inputs).
Contention: causal forward at the largest T, quiet and then with another process spinning on one
core (``while True: pass``), both providers, back to back.

    python -m bench.cpu_backend --save-results    # about 7 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

import rfattn
from bench.env import environment, write_results
from bench.memory import CpuMemoryWorker
from bench.providers import make_call, make_inputs
from bench.timing import time_cpu

__all__ = ["main"]

B, H, D, E, M = 1, 8, 64, 64, 256
FEATURE, WEIGHTS = "posrf", "orf"
PROVIDERS = ("rfattn", "sdpa-flash", "rfattn-previous")
COMPILED = ("rfattn-previous-compiled", "rfattn-compiled")


def _time(provider, T, causal, mode, rf, reps):
    x = make_inputs(B, H, T, D, E, torch.float32, "cpu", mode == "fwd+bwd")
    call, _ = make_call(provider, x, rf, causal, mode == "fwd+bwd")
    t0 = time.perf_counter()
    call()  # warm-up (and, compiled, the compilation)
    first = time.perf_counter() - t0
    p50, p20, p80, n = time_cpu(call, warmup=0, min_reps=reps, budget_s=2.0, max_reps=20)
    return dict(ms_p50=p50, ms_p20=p20, ms_p80=p80, n=n, first_call_s=first)


def _row(provider, T, causal, mode, **kw):
    return dict(provider=provider, T=T, causal=causal, mode=mode, **kw)


def _busy_core():
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run(args) -> dict:
    rf = rfattn.RandomFeatures(D, M, feature=FEATURE, weights=WEIGHTS, seed=0)
    doc = dict(
        title=f"torch path on the CPU: B={B} H={H} D=E={D} M={M} {FEATURE}/{WEIGHTS} fp32",
        env=environment(torch.device("cpu")), config=vars(args), notes=args.notes,
        method=__doc__, results=[], memory=[], compiled=[], contention=[],
    )  # fmt: skip
    worker = CpuMemoryWorker()
    for causal in (True, False):
        for mode in ("fwd", "fwd+bwd"):
            for T in args.T:
                for provider in PROVIDERS:
                    if provider == "rfattn-previous" and T > args.previous_max_T:
                        continue
                    row = _row(provider, T, causal, mode, **_time(provider, T, causal, mode, rf,
                                                                  args.reps))  # fmt: skip
                    doc["results"].append(row)
                    print(f"{provider:18} causal={int(causal)} {mode:8} T={T:6} "
                          f"{row['ms_p50']:9.1f} ms", flush=True)  # fmt: skip
                    if provider == "rfattn-previous" or args.no_memory:
                        continue
                    spec = dict(provider=provider, feature=FEATURE if provider != "sdpa-flash"
                                else None, weights=WEIGHTS, D=D, M=M, dtype="float32", mode=mode,
                                causal=causal, B=B, H=H, T=T, E=E)  # fmt: skip
                    got = worker.measure(spec)
                    doc["memory"].append(_row(provider, T, causal, mode, **got))
                    print(f"{'':18} peak {got.get('peak_bytes', 0) / 2**20:.1f} MiB", flush=True)
    worker.close()
    for causal in (True, False):
        for mode in ("fwd", "fwd+bwd"):
            for provider in COMPILED if args.compile_T else ():
                try:
                    res = _time(provider, args.compile_T, causal, mode, rf, args.reps)
                except Exception as exc:  # noqa: BLE001 - recorded: a compile that fails is a result
                    res = dict(error=f"{type(exc).__name__}: {exc}"[:300])
                doc["compiled"].append(_row(provider, args.compile_T, causal, mode, **res))
                print(
                    f"{provider:26} causal={int(causal)} {mode:8} T={args.compile_T} "
                    f"{res.get('ms_p50', float('nan')):9.1f} ms "
                    f"(first call {res.get('first_call_s', float('nan')):.0f} s)",
                    flush=True,
                )
    T = max(args.T)
    for provider in ("rfattn", "sdpa-flash"):
        quiet = _time(provider, T, True, "fwd", rf, args.reps)
        spinner = _busy_core()
        try:
            time.sleep(1.0)
            busy = _time(provider, T, True, "fwd", rf, args.reps)
        finally:
            spinner.kill()
            spinner.wait()
        doc["contention"].append(dict(provider=provider, T=T, causal=True, mode="fwd",
                                      quiet=quiet, one_core_busy=busy,
                                      slowdown=busy["ms_p50"] / quiet["ms_p50"]))  # fmt: skip
        print(f"{provider:18} causal fwd T={T}: quiet {quiet['ms_p50']:.1f} ms, one core busy "
              f"{busy['ms_p50']:.1f} ms", flush=True)  # fmt: skip
    return doc


def _get(doc, key, provider, causal, mode):
    rows = [r for r in doc[key] if (r["provider"], r["causal"], r["mode"]) == (provider, causal,
                                                                             mode)]  # fmt: skip
    return [r["T"] for r in rows], rows


def _t_axis(ax, doc) -> None:
    Ts = sorted({r["T"] for r in doc["results"]})
    from matplotlib.ticker import NullLocator

    ax.set_xticks(Ts, [str(t) for t in Ts])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(alpha=0.3)


def plot(doc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    styles = {"rfattn": "C0", "sdpa-flash": "C3", "rfattn-previous": "C7"}
    for ax, causal in zip(axes[:2], (True, False), strict=True):
        for provider, color in styles.items():
            for mode, ls in (("fwd", "--"), ("fwd+bwd", "-")):
                Ts, rows = _get(doc, "results", provider, causal, mode)
                if Ts:
                    ax.plot(Ts, [r["ms_p50"] for r in rows], ls, color=color, marker="o",
                            ms=3, label=f"{provider} {mode}")  # fmt: skip
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="T",
            ylabel="ms (median)",
            title=("causal" if causal else "non-causal") + " time (-- fwd, — fwd+bwd)",
        )
        _t_axis(ax, doc)
        ax.legend(fontsize=7, handlelength=3)
    ax = axes[2]
    for provider, color in styles.items():
        for causal, ls in ((True, "-"), (False, ":")):
            Ts, rows = _get(doc, "memory", provider, causal, "fwd")
            if Ts:
                ax.plot(
                    Ts,
                    [(r.get("peak_bytes") or 0) / 2**20 for r in rows],
                    ls,
                    color=color,
                    marker="o",
                    ms=3,
                    label=f"{provider} {'causal' if causal else 'non-c.'}",
                )
    ax.set(xscale="log", yscale="log", xlabel="T", ylabel="MiB above the inputs",
           title="forward peak memory")  # fmt: skip
    _t_axis(ax, doc)
    ax.legend(fontsize=7, handlelength=3)
    fig.suptitle(doc["title"] + f" ({doc['env'].get('device', 'cpu')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_backend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--T", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--reps", type=int, default=5, help="timed calls at least")
    p.add_argument("--previous-max-T", type=int, default=8192)
    p.add_argument("--compile-T", type=int, default=4096, help="0: skip torch.compile")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--out", default="plots/out")
    p.add_argument("--save-results", action="store_true", help="write to bench/results/<device>/")
    p.add_argument("--notes", default="")
    args = p.parse_args(argv)
    write_results(run(args), "cpu_backend", args.out, args.save_results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
