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

Time: rfattn and SDPA flash side by side (``bench.timing.time_cpu_rounds``: one warm-up call
each, then alternating rounds of one call each, at least ``--reps`` rounds and up to 4 s or 20
rounds), each one's median and 20/80 % quantiles and SDPA's time over rfattn's per round
(``over_rfattn``, its median and quantiles: a ratio of calls moments apart, which a shared host's
drift over minutes does not move); at ``--compile-T`` likewise rfattn eager with both compiled
providers (6 s). The previous path alone (``bench.timing.time_cpu``, up to 2 s or 20 calls).
Peak memory: ``bench.memory``'s worker process (above the inputs).
Contention: causal forward at the largest T, quiet and then with another process spinning on one
core (``while True: pass``), both providers, back to back.
``exp_paths``: ``exp(u - shift)`` formed with torch's CPU ``exp`` (as the torch path did) and
with ``exp2`` (``rfattn.features.base.exp_diff``, as it does now), each including a copy of the
2^20 fp32 arguments, whose results are normal, subnormal, 0 or come from -inf (median of 20).

    python -m bench.cpu_backend --save-results    # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import rfattn
from bench.env import environment, write_results
from bench.memory import CpuMemoryWorker
from bench.providers import make_call, make_inputs
from bench.timing import paired_ratio, summary, time_cpu, time_cpu_rounds

__all__ = ["main"]

B, H, D, E, M = 1, 8, 64, 64, 256
FEATURE, WEIGHTS = "posrf", "orf"
#: timed side by side, in alternating rounds (the targets' ratios); then the previous path alone
PAIRED = ("rfattn", "sdpa-flash")
PREVIOUS = "rfattn-previous"
COMPILED = ("rfattn-previous-compiled", "rfattn-compiled")


def _build(provider, T, causal, mode, rf):
    """``(call, first_call_s)``: ``provider``'s call on its own inputs, called once (the warm-up
    and, compiled, the compilation)."""
    x = make_inputs(B, H, T, D, E, torch.float32, "cpu", mode == "fwd+bwd")
    call, _ = make_call(provider, x, rf, causal, mode == "fwd+bwd")
    t0 = time.perf_counter()
    call()
    return call, time.perf_counter() - t0


def _time(provider, T, causal, mode, rf, reps):
    """One provider timed alone."""
    call, first = _build(provider, T, causal, mode, rf)
    p50, p20, p80, n = time_cpu(call, warmup=0, min_reps=reps, budget_s=2.0, max_reps=20)
    return dict(ms_p50=p50, ms_p20=p20, ms_p80=p80, n=n, first_call_s=first)


def _side_by_side(providers, T, causal, mode, rf, reps, budget_s) -> dict:
    """Providers timed in alternating rounds (:func:`bench.timing.time_cpu_rounds`): each one's
    time and, but for the first (rfattn), its ratio to the first's time round by round
    (``over_rfattn``: > 1 where rfattn is faster). A provider that fails to build (a compile
    error) is recorded with its error."""
    calls, res = {}, {}
    for p in providers:
        try:
            calls[p], first = _build(p, T, causal, mode, rf)
            res[p] = dict(first_call_s=first)
        except Exception as exc:  # noqa: BLE001 - recorded: a compile that fails is a result
            res[p] = dict(error=f"{type(exc).__name__}: {exc}"[:300])
    times = time_cpu_rounds(calls, min_rounds=reps, max_rounds=20, budget_s=budget_s)
    base = providers[0]
    for p, ts in times.items():
        p50, p20, p80, n = summary(ts)
        res[p].update(ms_p50=p50, ms_p20=p20, ms_p80=p80, n=n)
        if p != base and base in times:
            r50, r20, r80 = paired_ratio(ts, times[base])
            res[p]["over_rfattn"] = dict(p50=r50, p20=r20, p80=r80)
    return res


def _row(provider, T, causal, mode, **kw):
    return dict(provider=provider, T=T, causal=causal, mode=mode, **kw)


def _ratio_note(row) -> str:
    r = row.get("over_rfattn")
    return "" if r is None else f" ({r['p50']:.2f}x rfattn's, side by side)"


def _busy_core():
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


#: arguments of exp, by what the result is: (name, value)
EXP_ARGUMENTS = (("normal", -5.0), ("subnormal", -95.0), ("zero", -200.0), ("-inf", float("-inf")))


def _exp_paths(n: int = 1 << 20) -> list[dict]:
    """``exp(u - shift)`` as the torch path formed it before (``sub_``, ``exp_``) and as it does
    now (``rfattn.features.base.exp_diff``: ``sub``, ``mul_``, ``exp2_``), each from a copy of
    ``n`` fp32 arguments of one value: the time per call (median of 20)."""
    from rfattn.features.base import exp_diff

    rows, out, zero = [], torch.empty(n), torch.zeros(())
    for name, value in EXP_ARGUMENTS:
        x = torch.full((n,), value)
        row = dict(result=name, argument=value, n=n)
        forms = {
            "exp_ms": lambda x=x: out.copy_(x).sub_(zero).exp_(),
            "exp2_form_ms": lambda x=x: exp_diff(out.copy_(x), zero, out=out),
        }
        for key, fn in forms.items():
            row[key] = time_cpu(fn, warmup=0, min_reps=20, max_reps=20, budget_s=0.0)[0]
        rows.append(row)
    return rows


def run(args) -> dict:
    rf = rfattn.RandomFeatures(D, M, feature=FEATURE, weights=WEIGHTS, seed=0)
    doc = dict(
        title=f"torch path on the CPU: B={B} H={H} D=E={D} M={M} {FEATURE}/{WEIGHTS} fp32",
        env=environment(torch.device("cpu")), config=vars(args), notes=args.notes,
        method=__doc__, results=[], memory=[], compiled=[], contention=[],
        exp_paths=_exp_paths(),
    )  # fmt: skip
    for row in doc["exp_paths"]:
        print(f"exp, {row['result']:9} results: torch.exp {row['exp_ms']:.2f} ms, exp2 form "
              f"{row['exp2_form_ms']:.2f} ms ({row['n']} fp32)", flush=True)  # fmt: skip
    worker = CpuMemoryWorker()
    for causal in (True, False):
        for mode in ("fwd", "fwd+bwd"):
            for T in args.T:
                timed = _side_by_side(PAIRED, T, causal, mode, rf, args.reps, 4.0)
                if T <= args.previous_max_T:  # not a target: alone (8 s a call at 8192)
                    timed[PREVIOUS] = _time(PREVIOUS, T, causal, mode, rf, args.reps)
                for provider, res in timed.items():
                    row = _row(provider, T, causal, mode, **res)
                    doc["results"].append(row)
                    print(f"{provider:18} causal={int(causal)} {mode:8} T={T:6} "
                          f"{row['ms_p50']:9.1f} ms" + _ratio_note(row), flush=True)  # fmt: skip
                    if provider == PREVIOUS or args.no_memory:
                        continue
                    spec = dict(provider=provider, feature=FEATURE if provider != "sdpa-flash"
                                else None, weights=WEIGHTS, D=D, M=M, dtype="float32", mode=mode,
                                causal=causal, B=B, H=H, T=T, E=E)  # fmt: skip
                    got = worker.measure(spec)
                    doc["memory"].append(_row(provider, T, causal, mode, **got))
                    print(f"{'':18} peak {got.get('peak_bytes', 0) / 2**20:.1f} MiB", flush=True)
    worker.close()
    for causal in (True, False) if args.compile_T else ():
        for mode in ("fwd", "fwd+bwd"):
            timed = _side_by_side(("rfattn",) + COMPILED, args.compile_T, causal, mode, rf,
                                  args.reps, 6.0)  # fmt: skip
            for provider, res in timed.items():
                doc["compiled"].append(_row(provider, args.compile_T, causal, mode, **res))
                print(
                    f"{provider:26} causal={int(causal)} {mode:8} T={args.compile_T} "
                    f"{res.get('ms_p50', float('nan')):9.1f} ms "
                    f"(first call {res.get('first_call_s', float('nan')):.0f} s)"
                    + _ratio_note(res)
                    + (f" {res['error']}" if "error" in res else ""),
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
    # the adaptive thread count (opt-in in the library) in this process and its children, as
    # in every committed run
    os.environ["RFATTN_ADAPTIVE_THREADS"] = "1"
    rfattn.threads.ENABLED = True
    write_results(run(args), "cpu_backend", args.out, args.save_results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
