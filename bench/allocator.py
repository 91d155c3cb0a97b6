"""The CPU allocator's share of the torch path's time: glibc's defaults against a tuned glibc.

The torch path (``rfattn.blocked``) allocates a block's features, states and products afresh for
every block (a few MiB each at the default block size). With glibc's default malloc such buffers
come from ``mmap`` or from a heap top that is trimmed back to the kernel when they are freed, so
each call touches them again as new pages: a minor page fault, and a zeroed page, per 4 KiB.
This measures how much of the time that costs, by running the same calls in two worker
processes that differ only in the environment glibc reads at start-up:

* ``default``: glibc's own settings;
* ``glibc-tuned``: ``MALLOC_MMAP_THRESHOLD_=33554432`` (32 MiB, glibc's maximum: buffers below
  it come from the heap) and ``MALLOC_TRIM_THRESHOLD_=4294967296`` (freed memory stays in the
  process), the per-process equivalent of an allocator that caches (jemalloc, tcmalloc, which
  PyTorch's CPU performance guide recommends).

Per call: median time (``bench.timing.time_cpu``) and minor page faults (``getrusage``), for
rfattn and SDPA's CPU flash kernel (which allocates little) at B=1, H=8, D=E=64, M=256,
posrf/orf, fp32, all threads. The two workers run one after the other on a quiet machine.

    python -m bench.allocator --save-results    # about 4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import torch

from bench.env import environment, write_results

__all__ = ["main", "ENVIRONMENTS"]

B, H, D, E, M = 1, 8, 64, 64, 256
#: the worker environments compared
ENVIRONMENTS = {
    "default": {},
    "glibc-tuned": {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296"},
}
#: (causal, mode, T) measured
CASES = [(True, "fwd", T) for T in (1024, 2048, 4096, 8192)] + [
    (True, "fwd+bwd", T) for T in (1024, 2048, 4096)
] + [(False, "fwd", 4096), (False, "fwd+bwd", 4096)]  # fmt: skip
PROVIDERS = ("rfattn", "sdpa-flash")


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def worker(reps: int) -> list[dict]:
    """Every case in this process (its allocator as the environment set it up)."""
    import rfattn
    from bench.providers import make_call, make_inputs
    from bench.timing import time_cpu

    rf = rfattn.RandomFeatures(D, M, feature="posrf", weights="orf", seed=0)
    rows = []
    for causal, mode, T in CASES:
        for provider in PROVIDERS:
            x = make_inputs(B, H, T, D, E, torch.float32, "cpu", mode == "fwd+bwd")
            call, _ = make_call(provider, x, rf, causal, mode == "fwd+bwd")
            call()
            f0 = _faults()
            for _ in range(3):
                call()
            faults = (_faults() - f0) / 3
            p50, p20, p80, n = time_cpu(call, warmup=0, min_reps=reps, budget_s=2.0, max_reps=20)
            rows.append(dict(provider=provider, causal=causal, mode=mode, T=T, ms_p50=p50,
                             ms_p20=p20, ms_p80=p80, n=n, faults_per_call=faults))  # fmt: skip
    return rows


def run(args) -> dict:
    doc = dict(
        title=f"allocator: torch path on the CPU, B={B} H={H} D=E={D} M={M} posrf/orf fp32",
        env=environment(torch.device("cpu")), config=vars(args), notes=args.notes,
        method=__doc__, environments=ENVIRONMENTS, results=[],
    )  # fmt: skip
    for name, extra in ENVIRONMENTS.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env.update(extra)
        cmd = [sys.executable, "-m", "bench.allocator", "--worker", "--reps", str(args.reps)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"the {name} worker failed:\n{proc.stderr[-3000:]}")
        for row in json.loads(proc.stdout.strip().splitlines()[-1]):
            doc["results"].append(dict(allocator=name, **row))
            print(f"{name:12} {row['provider']:10} causal={int(row['causal'])} {row['mode']:8} "
                  f"T={row['T']:5} {row['ms_p50']:8.1f} ms {row['faults_per_call']:8.0f} faults",
                  flush=True)  # fmt: skip
    return doc


def plot(doc, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(c, m, T) for c, m, T in CASES]
    labels = [f"{'c' if c else 'nc'} {m}\nT={T}" for c, m, T in cases]
    fig, ax = plt.subplots(figsize=(12, 4))
    width = 0.2
    for i, (alloc, provider) in enumerate(
        (a, p) for a in doc["environments"] for p in PROVIDERS
    ):  # fmt: skip
        ms = []
        for c, m, T in cases:
            row = next(r for r in doc["results"] if (r["allocator"], r["provider"], r["causal"],
                                                     r["mode"], r["T"]) == (alloc, provider, c,
                                                                            m, T))  # fmt: skip
            ms.append(row["ms_p50"])
        ax.bar([j + (i - 1.5) * width for j in range(len(cases))], ms, width,
               label=f"{provider}, {alloc}")  # fmt: skip
    ax.set_xticks(range(len(cases)), labels, fontsize=7)
    ax.set(yscale="log", ylabel="ms (median)", title=doc["title"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.allocator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--reps", type=int, default=5, help="timed calls at least")
    p.add_argument("--out", default="plots/out")
    p.add_argument("--save-results", action="store_true", help="write to bench/results/<device>/")
    p.add_argument("--notes", default="")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.reps)))
        return 0
    write_results(run(args), "allocator", args.out, args.save_results, plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
