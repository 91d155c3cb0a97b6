"""python -m bench.host: a fused call's host cost, through Triton's launch path on a fake H100.

No GPU needed: the kernels are real, their launches do nothing.

Each call runs ``rfattn.rf_attention(..., backend="triton")`` on CPU tensors with Triton's CUDA
driver active against a fake sm_90 device (``bench/fake_gpu.py``): the kernels are compiled for
the H100 by Triton's compiler and ptxas, and every launch goes through Triton's whole host path
(JIT binding and cache, autotuner cache, grid, launcher, the C launcher module) down to
``cuLaunchKernelEx``, which does nothing. The call's torch ops run on the CPU tensors. Reported
per call:

* host µs: p10 (also p90, min) of ``--reps`` calls (default 300), each timed alone by the
  wall clock after ``--warmup`` calls (the first compiles and autotunes), in ``--rounds`` rounds
  (default 5) that each time every case in turn; p50 is the median of the case's quietest round
  (the lowest of its rounds' medians: a slow spell of a shared host, which only adds time, lands
  in some rounds of a case, not in all of them; every round's median is kept too); and the
  thread's CPU time (p10, p50: less sensitive to other jobs on a shared host); a
  forward+backward call is ``rf_attention`` and ``out.backward(cotangent)`` (the inputs'
  gradients are dropped between calls, outside the timing);
* Triton launches (counted by the fake ``cuLaunchKernelEx``, in the counted calls and over the
  timed ones alike), by kernel;
* GPU-side torch ops (``bench.opcount``: fills, copies, casts, reductions, arithmetic; not views
  or other metadata, not uninitialised allocations), by name: each would be one more GPU kernel;
  ``gpu_operations`` = launches + GPU-side torch ops;
* tensors made from host data (``aten.lift_fresh``) and syncs (``_local_scalar_dense``,
  ``nonzero``, ...), by name;
* ``gpu_ops_cpu_us``: the time spent inside the GPU-side torch ops (their dispatch below the
  counting mode and their CPU kernels, as they ran in the call; the median of 5 counted calls).
  It is part of host µs here, while on a GPU those ops cost the host only their dispatch and
  launch: where it is large, host µs overstates a GPU's host time by most of it (the split
  partials' sums of a non-causal backward read 8 MB for posrf, 151 MB for hrf, whose F is 18 M,
  at the large shape). Host µs less it would understate (it takes the ops' dispatch off too)
  and mixes two medians of different calls, so it is not reported.

Beside the rows, ``torch_floor_us``: torch's own cost of a differentiable call of the same size
on this host, no rfattn in it (:func:`torch_floor`), the floor under every host µs here.

The measuring process (a child of ``python -m bench.host``) runs with one torch thread, the
interpreter off, glibc's heap kept (:data:`MALLOC_ENV`: freed buffers are reused as the CUDA
caching allocator reuses its blocks, instead of being mapped and faulted in afresh at every
call) and denormals flushed (outputs are never written, so the GPU-side ops read junk).

Cases: non-causal and causal, forward (inference: ``torch.no_grad()``, features in eval mode)
and forward+backward (training: grad, features in training mode, so oprf/saderf move their
running statistics in a causal call), and the decode step (causal, one token, the state of the
whole sequence given, ``return_state=True`` as a generation loop does, no grad, eval); the
hybrid's forward, forward+backward and decode step (:data:`HYBRID`: 4 exact sinks and a window of
64 inside the features; posrf only by default; no ceiling of issue 35's); features
posrf, oprf, saderf, hrf (orf weights) and rmf (rademacher); bf16; shapes ``large`` (B4 H16
T1024 D64 M256 E64, the GPU benchmark's) and ``small`` (B2 H4 T128, same head sizes, so the same
compiled kernels).

rfattn runs the fused operators' torch kernels on CPU tensors and its launchers refuse CPU
tensors without the interpreter; :func:`route_cpu_tensors_to_triton` turns both off (two
module attributes, the only private names this tool touches).

    python -m bench.host                      # every case; ~10 min on 2 cores, most of it
                                              # compiling (Triton's cache keeps the kernels)
    python -m bench.host --save-results       # write bench/results/<this cpu>/host.json
    python -m bench.host --quick --out DIR    # posrf non-causal forward, small shape, 20 calls
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

FEATURES = ("posrf", "oprf", "saderf", "hrf", "rmf")
WEIGHTS = {"rmf": "rademacher"}  # else orf
CASES = ("noncausal fwd", "noncausal fwd+bwd", "causal fwd", "causal fwd+bwd", "decode",
         "hybrid fwd", "hybrid fwd+bwd", "hybrid decode")
#: the hybrid's cases (causal, exact sinks and window inside the features: ``HYBRID``'s), run
#: for these features only unless ``--features`` names others with ``--cases``
HYBRID = dict(window=64, sinks=4)
HYBRID_FEATURES = ("posrf",)
SHAPES = {
    "large": dict(B=4, H=16, T=1024, D=64, M=256, E=64),
    "small": dict(B=2, H=4, T=128, D=64, M=256, E=64),
}
#: --quick: a smoke run (tests/test_bench.py): one case, three kernels to compile
QUICK = dict(features=("posrf",), shapes=("small",), cases=("noncausal fwd",), reps=20, warmup=2,
             rounds=2)  # fmt: skip
#: glibc settings of the measuring process (bench.allocator's "glibc-tuned", and no mmap at all):
#: freed memory stays in the heap and is handed out again, as torch's CUDA caching allocator
#: hands out its blocks; with glibc's defaults every large buffer of a call is mapped afresh and
#: faulted in page by page (posrf non-causal forward+backward at the large shape: 4.2 ms p50
#: against 2.7 ms). The mmap threshold stops at 32 MiB, so buffers above it (hrf's S and its
#: partials at the large shape, F = 18 M: 75 and 151 MB) were still mapped and unmapped at every
#: call, ~20 µs each that a caching allocator does not spend: MALLOC_MMAP_MAX_=0 serves them from
#: the heap too (1.3 µs for an empty 226 MB buffer, 21 µs mapped)
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "4294967296",
              "MALLOC_MMAP_MAX_": "0"}  # fmt: skip
#: issue 35's ceilings: GPU operations (launches + GPU-side torch ops) per call, every feature
GPU_OPS_CEILING = {"noncausal fwd": 2, "noncausal fwd+bwd": 4, "causal fwd": 2,
                   "causal fwd+bwd": 5}  # fmt: skip
#: and host µs (p50) of a posrf call at the large shape; oprf and hrf within 2x posrf's
POSRF_US_CEILING = {"fwd": 50, "fwd+bwd": 120}


def route_cpu_tensors_to_triton() -> dict:
    """Make rfattn's fused operators launch their Triton kernels on CPU tensors with the
    interpreter off (what they do on CUDA tensors): ``rfattn.kernels.common.FAKE_DEVICE``, the
    one switch the operators and the launchers read. Returns what was changed."""
    from rfattn.kernels import common

    if common.INTERPRET:
        raise RuntimeError("bench.host needs the Triton interpreter off: unset TRITON_INTERPRET")
    common.FAKE_DEVICE = True
    return {"rfattn.kernels.common.FAKE_DEVICE": True}


def _percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    x = (len(sorted_values) - 1) * p / 100
    lo = int(x)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (x - lo)


def _case(feature: str, case: str, shape: dict, dtype):
    """``(call, reset, training)``: one call of the case, what to undo between calls (outside
    the timing), and whether the features are in training mode."""
    import torch

    import rfattn

    B, H, T, D, M, E = (shape[k] for k in ("B", "H", "T", "D", "M", "E"))
    weights = WEIGHTS.get(feature, "orf")
    training = "bwd" in case
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=0).train(training)
    g = torch.Generator().manual_seed(0)
    q, k = ((0.5 * torch.randn(B, H, T, D, generator=g)).to(dtype) for _ in range(2))
    v = torch.randn(B, H, T, E, generator=g).to(dtype)
    causal = not case.startswith("noncausal")
    kw = dict(causal=causal, backend="triton", **(HYBRID if case.startswith("hybrid") else {}))
    if case.endswith("decode"):
        with torch.no_grad():
            _, state = rfattn.rf_attention(q, k, v, rf, return_state=True, **kw)
        q1, k1, v1 = (x[:, :, -1:].clone() for x in (q, k, v))

        def call():
            with torch.no_grad():
                return rfattn.rf_attention(q1, k1, v1, rf, initial_state=state,
                                           return_state=True, **kw)  # fmt: skip

        return call, lambda: None, training
    if not training:

        def call():
            with torch.no_grad():
                return rfattn.rf_attention(q, k, v, rf, **kw)

        return call, lambda: None, training
    leaves = [x.requires_grad_() for x in (q, k, v)]
    cotangent = torch.randn(B, H, T, E, generator=g).to(dtype)

    def call():
        out = rfattn.rf_attention(*leaves, rf, **kw)
        out.backward(cotangent)

    def reset():
        for x in leaves:
            x.grad = None

    return call, reset, training


def prepare(feature: str, case: str, shape_name: str, dtype, warmup: int,
            count_reps: int = 5) -> dict:  # fmt: skip
    """One case made ready to time: its call warmed up, then counted ``count_reps`` times (the
    op counts of the first; the CPU time in the GPU-side ops, their median). Returns the row
    without its timings and, under ``"_case"``, ``(call, reset)`` for :func:`time_round`."""
    from bench import fake_gpu
    from bench.opcount import OpCounter

    shape = SHAPES[shape_name]
    call, reset, training = _case(feature, case, shape, dtype)
    for _ in range(warmup):  # the first compiles and autotunes, the next fill per-draw caches
        reset()
        call()
    passes = []  # counted calls: the first gives the counts, all of them the ops' CPU time
    for _ in range(count_reps):
        reset()
        before = fake_gpu.launches()
        with fake_gpu.launch_names() as names, OpCounter(timed=("gpu",)) as mode:
            call()
        passes.append((fake_gpu.launches() - before, names, mode))
    launches, names, mode = passes[0]
    counted = {}
    for n in names:
        counted[n] = counted.get(n, 0) + 1
    same = all(p[0] == launches and p[2].ops == mode.ops for p in passes)
    op_seconds = {n: statistics.median(p[2].seconds[n] for p in passes) for n in mode.seconds}
    reset()
    gpu = mode.of_kind("gpu")
    gpu_ops = sum(gpu.values())
    return {
        "feature": feature,
        "weights": WEIGHTS.get(feature, "orf"),
        "case": case,
        "causal": not case.startswith("noncausal"),
        "mode": "decode" if case.endswith("decode") else case.split()[1],
        "training": training,
        "shape": shape_name,
        **shape,
        "T_call": 1 if case.endswith("decode") else shape["T"],
        "dtype": str(dtype).removeprefix("torch."),
        "triton_launches": launches,
        "launched_kernels": counted,
        "gpu_ops": gpu_ops,
        "gpu_ops_by_name": gpu,
        "gpu_ops_cpu_us": 1e6 * sum(op_seconds.values()),
        "gpu_ops_cpu_us_by_name": {n: 1e6 * t for n, t in op_seconds.items()},
        "counts_stable": same,
        "gpu_operations": launches + gpu_ops,
        "host_copies": mode.of_kind("copy"),
        "syncs": mode.of_kind("sync"),
        "operators": mode.of_kind("operator"),
        "views": sum(mode.of_kind("view").values()),
        "allocations": sum(mode.of_kind("alloc").values()),
        "torch_ops": sum(mode.ops.values()),
        "_case": (call, reset),
        "_times": [],
        "_cpu": [],
        "_launches": 0,
        "_faults": 0,
    }


def time_round(row: dict, reps: int) -> None:
    """Time ``reps`` calls of a prepared case (:func:`prepare`), each alone, adding them to its
    samples."""
    from bench import fake_gpu

    call, reset = row["_case"]
    reset()
    gc.collect()
    before, faults = fake_gpu.launches(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    times, cpu = [], []
    for _ in range(reps):
        reset()
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        result = call()
        stop_cpu, stop = time.thread_time_ns(), time.perf_counter_ns()
        del result
        times.append((stop - start) / 1e3)
        cpu.append((stop_cpu - start_cpu) / 1e3)
    row["_launches"] += fake_gpu.launches() - before
    row["_faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    row["_times"].append(times)
    row["_cpu"].extend(cpu)


def finish(row: dict) -> dict:
    """The row of a timed case: host µs over all its rounds (p10, p90, min over every call; p50
    the lowest of the rounds' own medians: other work on a shared host only adds time, and a
    slow spell of it lands in some rounds, not all), the rounds' medians, launches and page
    faults per timed call."""
    rounds = row.pop("_times")
    cpu = sorted(row.pop("_cpu"))
    launches, faults = row.pop("_launches"), row.pop("_faults")
    del row["_case"]
    times = sorted(t for r in rounds for t in r)
    medians = [_percentile(sorted(r), 50) for r in rounds]
    row.update({
        "reps": len(times),
        "rounds": len(rounds),
        "host_us": {
            "p10": _percentile(times, 10),
            "p50": min(medians),
            "p90": _percentile(times, 90),
            "min": times[0],
        },
        "host_us_round_p50": medians,
        "thread_cpu_us": {"p10": _percentile(cpu, 10), "p50": _percentile(cpu, 50)},
        "page_faults_per_call": faults / len(times),
        "triton_launches_timed": launches / len(times),
    })  # fmt: skip
    return row


def torch_floor(shape_name: str, dtype, reps: int, rounds: int = 1) -> dict:
    """What torch itself costs this host for a differentiable call of the case's size, with no
    rfattn in it: p50 µs of a bare ``torch.autograd.Function`` on q, k, v (leaves that require
    grad) whose forward returns ``torch.empty_like(v)`` and whose backward returns three
    ``torch.empty_like`` (``fwd``: the forward alone, grad enabled; ``fwd+bwd``: it and
    ``out.backward(cotangent)``, the inputs' gradients dropped between calls outside the timing).
    The floor under rfattn's host µs that no change inside rfattn can go below (autograd's graph,
    its engine, ``Tensor.backward``'s checks of the cotangent, the gradients' accumulation).
    Measured as the rows are: ``reps`` calls in ``rounds`` rounds, p50 the quietest round's
    median (a slow spell of a shared host lands in some rounds, not all)."""
    import torch

    shape = SHAPES[shape_name]
    B, H, T, D, E = (shape[k] for k in ("B", "H", "T", "D", "E"))

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            return torch.empty_like(v)

        @staticmethod
        def backward(ctx, g):
            return torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)

    q, k = (torch.zeros(B, H, T, D, dtype=dtype).requires_grad_() for _ in range(2))
    v = torch.zeros(B, H, T, E, dtype=dtype).requires_grad_()
    cotangent = torch.zeros(B, H, T, E, dtype=dtype)
    medians = {"fwd": [], "fwd+bwd": []}
    for _ in range(rounds):
        for mode, kept in medians.items():
            times = []
            for i in range(max(reps // rounds, 1) + 10):
                start = time.perf_counter_ns()
                y = Bare.apply(q, k, v)
                if mode == "fwd+bwd":
                    y.backward(cotangent)
                stop = time.perf_counter_ns()
                del y
                for x in (q, k, v):
                    x.grad = None
                if i >= 10:
                    times.append((stop - start) / 1e3)
            kept.append(_percentile(sorted(times), 50))
    return {mode: min(kept) for mode, kept in medians.items()}


def targets(rows: list[dict]) -> list[dict]:
    """Issue 35's ceilings, each with the measured value and whether it is met."""
    out = []
    for r in rows:
        if "error" in r:
            continue
        name = f"{r['feature']} {r['case']} {r['shape']}"
        copies_syncs = sum(r["host_copies"].values()) + sum(r["syncs"].values())
        out.append({"what": f"{name}: host copies + syncs", "value": copies_syncs, "ceiling": 0})
        if r["case"] in GPU_OPS_CEILING:
            out.append({"what": f"{name}: GPU operations", "value": r["gpu_operations"],
                        "ceiling": GPU_OPS_CEILING[r["case"]]})  # fmt: skip
    by = {(r["feature"], r["case"], r["shape"]): r for r in rows if "error" not in r}
    for case in GPU_OPS_CEILING:
        posrf = by.get(("posrf", case, "large"))
        if posrf is None:
            continue
        mode = case.split()[1]
        out.append({"what": f"posrf {case} large: host us p50", "value": posrf["host_us"]["p50"],
                    "ceiling": POSRF_US_CEILING[mode]})  # fmt: skip
        for other in ("oprf", "hrf"):
            r = by.get((other, case, "large"))
            if r is not None:
                out.append({"what": f"{other} {case} large: host us p50 / posrf's",
                            "value": r["host_us"]["p50"] / posrf["host_us"]["p50"],
                            "ceiling": 2.0})  # fmt: skip
    for t in out:
        t["met"] = t["value"] <= t["ceiling"]
    return out


def environment(threads: int) -> dict:
    import torch

    from bench.env import environment as bench_env

    env = bench_env(torch.device("cpu"))
    env["torch_threads"] = threads
    env["gc"] = "enabled (collected before each timed round)"
    env["malloc"] = {k: os.environ.get(k) for k in MALLOC_ENV}
    return env


def _short(d: dict, width: int = 46) -> str:
    s = " ".join(f"{k}x{v}" if v > 1 else k for k, v in d.items()) or "-"
    return s if len(s) <= width else s[: width - 3] + "..."


HEADER = (f"{'feature':<7} {'case':<18} {'shape':<6} {'p10 us':>7} {'p50 us':>7} {'op cpu':>6} "
          f"{'launch':>6} {'gpu op':>6} {'copies':>6} {'syncs':>5}  gpu ops by name")


def row_line(r: dict) -> str:
    """One row of the printed table (``op cpu``: µs the CPU spends in the GPU-side torch ops)."""
    if "error" in r:
        return f"{r['feature']:<7} {r['case']:<18} {r['shape']:<6} ERROR {r['error']}"
    return (
        f"{r['feature']:<7} {r['case']:<18} {r['shape']:<6} {r['host_us']['p10']:>7.0f} "
        f"{r['host_us']['p50']:>7.0f} {r['gpu_ops_cpu_us']:>6.0f} "
        f"{r['triton_launches']:>6} {r['gpu_ops']:>6} "
        f"{sum(r['host_copies'].values()):>6} {sum(r['syncs'].values()):>5}  "
        f"{_short(r['gpu_ops_by_name'])}"
    )


def print_table(rows: list[dict]) -> None:
    print(HEADER)
    for r in rows:
        print(row_line(r))


def markdown(doc: dict, shape: str = "large") -> str:
    """The README's summary table of a host.json: one row per feature, one column per case,
    each cell ``p10 / p50 µs · launches + GPU-side torch ops``."""
    rows = [r for r in doc["results"] if r.get("shape") == shape]
    cases = [c for c in CASES if any(r["case"] == c for r in rows)]
    lines = ["| feature | " + " | ".join(cases) + " |", "|---" * (len(cases) + 1) + "|"]
    for feature in dict.fromkeys(r["feature"] for r in rows):
        cells = []
        for case in cases:
            r = next((r for r in rows if r["feature"] == feature and r["case"] == case), None)
            if r is None or "error" in r:
                cells.append("error" if r else "")
                continue
            us = r["host_us"]
            cells.append(f"{us['p10']:.0f} / {us['p50']:.0f} · "
                         f"{r['triton_launches']} + {r['gpu_ops']}")  # fmt: skip
        lines.append(f"| {feature} | " + " | ".join(cells) + " |")
    floor = doc.get("torch_floor_us", {}).get(shape)
    if floor is not None:
        lines.append(f"| torch alone (bare `autograd.Function`) | {floor['fwd']:.0f} µs forward "
                     f"with grad, {floor['fwd+bwd']:.0f} µs forward+backward | |")  # fmt: skip
    return "\n".join(lines)


def run(features, shapes, cases, reps: int, warmup: int, dtype_name: str, threads: int,
        rounds: int = 1) -> dict:  # fmt: skip
    import torch

    from bench import fake_gpu

    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")  # 3.9's notice
    # outputs are never written, so the GPU-side torch ops read junk: denormals in it would slow
    # the CPU's arithmetic, not a GPU's (flushed to zero; NaN and inf cost nothing extra)
    denormals_flushed = torch.set_flush_denormal(True)
    load_before = os.getloadavg()
    started = time.time()
    device = fake_gpu.activate()
    routed = route_cpu_tensors_to_triton()
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype_name])
    rows = []  # every case prepared first (compiled, counted), then timed round by round
    for shape in shapes:
        for feature in features:
            for case in cases:
                if case.startswith("hybrid") and feature not in HYBRID_FEATURES and \
                        cases == list(CASES):  # fmt: skip
                    continue
                try:
                    row = prepare(feature, case, shape, dtype, warmup)
                except Exception as e:  # noqa: BLE001 -- reported per row
                    row = {"feature": feature, "case": case, "shape": shape,
                           "error": f"{type(e).__name__}: {e}"[:500]}  # fmt: skip
                rows.append(row)
    # the cases interleaved: each round times every case once, so a slow spell of the host
    # (other tenants of a shared machine) lands in one round of several cases, not in all of
    # one case's calls; a case's p50 is its quietest round's median
    for _ in range(rounds):
        for row in rows:
            if "error" not in row:
                time_round(row, max(reps // rounds, 1))
    rows = [row if "error" in row else finish(row) for row in rows]
    floor = {shape: torch_floor(shape, dtype, reps, rounds) for shape in shapes}
    env = environment(threads)
    env["loadavg_before"] = load_before
    env["loadavg_after"] = os.getloadavg()  # a shared host: other work inflates every time
    env["seconds"] = round(time.time() - started, 1)
    env["flush_denormal"] = denormals_flushed
    return {
        "schema": "rfattn-bench-host/1",
        "env": env,
        "fake_device": device,
        "rfattn_switches": routed,
        "autotune_choices": fake_gpu.tunings(),
        "config": {"dtype": dtype_name, "shapes": {s: SHAPES[s] for s in shapes}, "reps": reps,
                   "rounds": rounds, "warmup": warmup, "features": list(features),
                   "cases": list(cases)},  # fmt: skip
        "results": rows,
        "torch_floor_us": floor,
        "targets": targets(rows),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--features", nargs="+", default=list(FEATURES), choices=FEATURES)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--reps", type=int, default=300, help="timed calls per case (default 300)")
    p.add_argument("--rounds", type=int, default=5,
                   help="timing rounds, every case once per round (default 5)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=3, help="calls before counting and timing")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--quick", action="store_true", help="posrf noncausal fwd, small, 20 calls")
    p.add_argument("--out", type=Path, default=Path("plots/out"), help="folder for host.json")
    p.add_argument("--save-results", action="store_true", help="write to bench/results/<cpu>/")
    p.add_argument("--markdown", type=Path, metavar="HOST_JSON",
                   help="print the README's table of a host.json and exit")  # fmt: skip
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal
    a = p.parse_args(argv)
    if a.markdown:
        doc = json.loads(a.markdown.read_text())
        for shape in doc["config"]["shapes"]:
            print(f"{shape}: {doc['config']['shapes'][shape]}\n\n{markdown(doc, shape)}\n")
        return 0
    if not a.worker:  # the measuring process: glibc's heap kept, the interpreter off
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(MALLOC_ENV)
        args = [sys.executable, "-m", "bench.host", *(sys.argv[1:] if argv is None else argv),
                "--worker"]  # fmt: skip
        return subprocess.run(args, env=env).returncode
    if a.quick:
        a.features, a.shapes, a.cases = QUICK["features"], QUICK["shapes"], QUICK["cases"]
        a.reps, a.warmup, a.rounds = QUICK["reps"], QUICK["warmup"], QUICK["rounds"]
    doc = run(a.features, a.shapes, a.cases, a.reps, a.warmup, a.dtype, a.threads, a.rounds)
    print()
    print_table(doc["results"])
    missed = [t for t in doc["targets"] if not t["met"]]
    for shape, floor in doc["torch_floor_us"].items():
        print(f"torch's own floor ({shape}: a bare autograd.Function, no rfattn): forward "
              f"{floor['fwd']:.0f} µs, forward+backward {floor['fwd+bwd']:.0f} µs p50")
    print(f"\nissue 35's ceilings: {len(doc['targets']) - len(missed)} met, {len(missed)} missed")
    for t in missed:
        print(f"  missed: {t['what']} = {t['value']:.3g} (ceiling {t['ceiling']})")
    env = doc["env"]
    print(f"load average before {env['loadavg_before']}, after {env['loadavg_after']}; "
          f"{env['seconds']} s")
    folder = a.out
    if a.save_results:
        folder = Path(__file__).parent / "results" / env["results_slug"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "host.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"# wrote {path}")
    return 1 if any("error" in r for r in doc["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
