"""python -m bench.gpu: the GPU bring-up runbook, one command inside a short GPU window.

Runs time-boxed stages in order; a stage that fails, raises or runs out of time is recorded
with its text and the next one runs. Each stage runs in its own process (killed at its time box,
keeping what it recorded so far), so one hung compile cannot eat the window.

Stages (``--stages`` picks some; ``--profile`` adds the last):

1. ``env``: GPU, SM count, versions; measured ceilings (bf16 and tf32 matmul, device copy).
2. ``smoke``: one small awkward shape (T not a multiple of any tile, D != M != E, a key padding
   mask) per fused path (non-causal, causal chunk, decode step, stats pass) x feature form (the
   real GERF family, the signed table form, rmf) x dtype (fp32, bf16, fp16 on CUDA; fp32 under the
   interpreter), outputs and gradients against float64, with every uninitialised buffer poisoned
   with NaN; autotuning off (``RFATTN_AUTOTUNE=0``: one config per launch, for fp16/bf16 the
   half policy's own) so compiling stays short.
3. ``sync``: each fused form once (bf16, posrf / oprf / hrf / rmf, non-causal and causal
   forward+backward, decode step; GQA, a key padding mask, packed sequences) under
   ``torch.cuda.set_sync_debug_mode("error")`` after a warm-up call (``bench.sync_check``).
4. ``pytest``: ``pytest -m gpu`` (autotuning off, in parallel when pytest-xdist is there).
5. ``compile``: ``torch.compile(fullgraph=True)`` over ``rf_attention`` on CUDA, non-causal and
   causal, forward and backward: graph breaks counted, compiled against eager.
6. ``bench``: ``python -m bench`` on the issue's grid (rows kept as they are measured).
7. ``fla``: ``python -m bench.fla``, the causal shapes of flash-linear-attention.
8. ``decode``: ``python -m bench.decode``, the time per token by position.
9. ``packed``: ``python -m bench.packed``, packed sequences (``cu_seqlens``) against the same
   documents padded, one length mix at a time (rows kept per mix).
10. ``probe``: ``python -m bench.probe_rmf``, rmf's fused operators at each kernel precision
   (why its bf16 half form erred on an H100).
11. ``profile`` (``--profile``): Nsight Compute on the fused kernels at one large shape.

Writes ``gpu_report.json`` and ``gpu_report.md`` (plus ``bench.json``/``fla.json``/
``decode.json``/``packed.json`` and ``gpu_log.txt``, the stages' output) to ``--out``, and
prints the report's table last. ``--dry-run`` prints the plan with each stage's time box and
estimate. Without CUDA the smoke stage runs under the Triton interpreter at tiny shapes (how CI
tests this harness) and the CUDA-only stages are recorded as skipped.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bench.__main__ import _finite

SCHEMA = "rfattn-gpu-report/1"
STATUSES = ("ok", "failed", "error", "timeout", "skipped", "not run")


@dataclass(frozen=True)
class Stage:
    name: str
    box_s: float  # share of the default 540 s budget
    est_s: float  # expected seconds on an H100 (the dry run prints it)
    cuda_only: bool
    what: str


STAGES = [
    Stage("env", 30, 20, False, "GPU, versions, bf16/tf32 matmul and copy ceilings"),
    Stage(
        "smoke", 100, 250, False, "fused paths x feature forms x dtypes vs float64, NaN-poisoned"
    ),
    Stage("sync", 40, 200, True, "each fused form once under set_sync_debug_mode('error')"),
    Stage("pytest", 100, 60, True, "pytest -m gpu, RFATTN_AUTOTUNE=0"),
    Stage(
        "compile", 80, 110, True, "torch.compile(fullgraph=True): graph breaks, compiled == eager, "
        "a decoding step under CUDA graphs"
    ),
    Stage(
        "bench", 170, 400, True, "python -m bench: posrf/oprf/rmf, T 512..32768 (rows as measured)"
    ),
    Stage("fla", 50, 200, True, "python -m bench.fla: flash-linear-attention's causal shapes"),
    Stage("decode", 30, 20, True, "python -m bench.decode: ms per token by position"),
    Stage("packed", 40, 60, True, "python -m bench.packed: packed (cu_seqlens) vs padded"),
    Stage("probe", 30, 60, True, "python -m bench.probe_rmf: rmf's error at each precision"),
    Stage("profile", 90, 90, True, "ncu on the key/query passes and the chunk kernels"),
]
BY_NAME = {s.name: s for s in STAGES}
DEFAULT_STAGES = [s.name for s in STAGES if s.name != "profile"]
DEFAULT_BUDGET_S = 540.0

#: the benchmark grid of issue 13
# fmt: off
BENCH_ARGS = [
    "--dtype", "bfloat16", "--B", "4", "--H", "16", "--D", "64", "--E", "64", "--M", "256",
    "--T", "512", "1024", "2048", "4096", "8192", "16384", "32768",
    "--features", "posrf", "oprf", "rmf",
    "--providers", "rfattn", "rfattn-torch", "rfattn-compiled", "fla-chunk", "sdpa-flash",
    "sdpa-cudnn", "sdpa-efficient", "performer", "rfattn-hybrid",
    "--error-M", "256", "--seeds", "1",
]
# fmt: on


# ----------------------------------------------------------------------------------------------
# the stage process: records into a JSON file rewritten on every update (survives a kill)


class Recorder:
    """The stage's result: ``status``, ``summary``, ``rows``; written to ``path`` on each call."""

    def __init__(self, path: Path):
        self.path = path
        self.doc: dict = {"status": "ok", "summary": "", "rows": []}
        self.flush()

    def set(self, **kw) -> None:
        self.doc.update(kw)
        self.flush()

    def row(self, **row) -> None:
        self.doc["rows"].append(row)
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(_finite(self.doc), indent=1, allow_nan=False))
        tmp.replace(self.path)


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def stage_env(rec: Recorder, work: Path, args) -> None:
    import torch

    from bench import roofline
    from bench.env import environment

    dev = _device()
    info = environment(dev)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(
            sm_count=p.multi_processor_count,
            memory_bytes=p.total_memory,
            l2_bytes=getattr(p, "L2_cache_size", None),
            capability=f"{p.major}.{p.minor}",
        )
    n, mib = (8192, 1024) if dev.type == "cuda" else (512, 64)
    bf16 = roofline.measure_ceilings(dev, torch.bfloat16, n, mib)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        tf32 = roofline.measure_ceilings(dev, torch.float32, n, 16)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    ceilings = dict(
        bf16_matmul_flop_per_s=bf16["matmul_flop_per_s"],
        tf32_matmul_flop_per_s=tf32["matmul_flop_per_s"],
        copy_bytes_per_s=bf16["copy_bytes_per_s"],
        matmul_n=n,
    )
    rec.set(
        env=info,
        ceilings=ceilings,
        summary=(
            f"{info['device']}; torch {info['torch']}, triton {info['triton']}; bf16 "
            f"{ceilings['bf16_matmul_flop_per_s'] / 1e12:.0f} TFLOP/s, tf32 "
            f"{ceilings['tf32_matmul_flop_per_s'] / 1e12:.0f} TFLOP/s, copy "
            f"{ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s"
        ),
    )


# -- smoke ---------------------------------------------------------------------------------------

#: feature kind per kernel form: the real GERF family, the signed coefficient table, rmf
FORMS = {"gerf": "posrf", "table": "trigrf", "rmf": "rmf"}
PATHS = ("parallel", "chunk", "decode", "stats")


def smoke_cases(cuda: bool) -> list[dict]:
    """The smoke grid: path x form (the stats pass with oprf) x dtype."""
    dtypes = ["float32", "bfloat16", "float16"] if cuda else ["float32"]
    cases = []
    for path in PATHS:
        forms = {"gerf": "oprf"} if path == "stats" else FORMS
        for form, feature in forms.items():
            for dtype in dtypes:
                cases.append(dict(path=path, form=form, feature=feature, dtype=dtype))
    return cases


def smoke_shape(cuda: bool) -> dict:
    """T a multiple of no tile, D != M != E (none a power of two), batch 1 padded at the end."""
    if cuda:
        return dict(B=2, H=3, T=203, D=48, M=72, E=40, pad=29, steps=3)
    return dict(B=2, H=2, T=37, D=12, M=20, E=10, pad=6, steps=2)


def _rf(feature: str, D: int, M: int, device):
    import rfattn

    weights = "rademacher" if feature == "rmf" else "orf"
    return rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=0).to(device)


def run_smoke_case(case: dict, shape: dict, device) -> dict:
    """One case: errors of outputs and gradients against float64, and the verdict."""
    import torch

    import rfattn
    from rfattn.reference import linear_attention
    from rfattn.testing import rel_rms, tolerance

    dtype = getattr(torch, case["dtype"])
    B, H, T, D, M, E = (shape[k] for k in ("B", "H", "T", "D", "M", "E"))
    causal = case["path"] in ("chunk", "decode")
    rf = _rf(case["feature"], D, M, device)
    if not rfattn.attention.fused_kernel_available(rf, causal):
        return dict(verdict="skipped", why="no fused kernel for this case")
    g = torch.Generator().manual_seed(1)

    def rand(*s, scale=1.0):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(device)

    q64, k64 = rand(B, H, T, D, scale=0.6), rand(B, H, T, D, scale=0.6)
    v64, do64 = rand(B, H, T, E), rand(B, H, T, E)
    mask = None
    if case["path"] in ("parallel", "stats"):
        mask = torch.zeros(B, T, dtype=torch.bool, device=device)
        mask[1, T - shape["pad"] :] = True
    rf64 = copy.deepcopy(rf).double()

    # float64 reference: features on the same W, then rfattn.reference.linear_attention
    leaves64 = [x.clone().requires_grad_() for x in (q64, k64, v64)]
    phi_q, phi_k = rf64.features(leaves64[0], leaves64[1], mask)
    ref = linear_attention(phi_q, phi_k, leaves64[2], causal=causal, key_padding_mask=mask)
    if case["path"] == "decode":
        return _decode_case(rf, rf64, q64, k64, v64, ref.detach(), dtype, shape["steps"])
    # gradients: the float64 torch path (statistics treated as constants, as in the kernel)
    g64 = [x.clone().requires_grad_() for x in (q64, k64, v64)]
    rfattn.rf_attention(
        *g64, copy.deepcopy(rf64), causal=causal, key_padding_mask=mask, backend="torch"
    ).backward(do64)
    ref_grads = [x.grad for x in g64]

    def run(backend):
        xs = [x.to(dtype).requires_grad_() for x in (q64, k64, v64)]
        out = rfattn.rf_attention(
            *xs, copy.deepcopy(rf), causal=causal, key_padding_mask=mask, backend=backend
        )
        out.backward(do64.to(dtype))
        return out, [x.grad for x in xs]

    out, grads = run("triton")
    errs = {"out": rel_rms(out, ref)}
    errs.update(
        {n: rel_rms(gk, gr) for n, gk, gr in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True)}
    )
    finite = bool(torch.isfinite(out).all()) and all(bool(torch.isfinite(x).all()) for x in grads)
    if dtype in (torch.float32, torch.float64):
        limits = {n: tolerance(dtype, "out" if n == "out" else "grad") for n in errs}
        rule = "tolerance"
    else:  # the flash-attention rule: 2x (outputs) / 3x (gradients) the torch path's own error
        own_out, own_grads = run("torch")
        own = {"out": rel_rms(own_out, ref)}
        own.update(
            {
                n: rel_rms(a, b)
                for n, a, b in zip(("dq", "dk", "dv"), own_grads, ref_grads, strict=True)
            }
        )
        limits = {n: max((2.0 if n == "out" else 3.0) * own[n], tolerance(dtype) / 10) for n in own}
        rule = "flash-attention rule"
    ok = finite and all(errs[n] <= limits[n] for n in errs)
    return dict(
        verdict="ok" if ok else "failed", finite=finite, errors=errs, limits=limits, rule=rule
    )


def _decode_case(rf, rf64, q64, k64, v64, ref, dtype, steps: int) -> dict:
    """Prefill T - steps tokens (chunk kernel, state returned), then one launch per token."""
    import torch

    import rfattn
    from rfattn.testing import rel_rms, tolerance

    T = q64.shape[2]
    t0 = T - steps
    q, k, v = (x.to(dtype) for x in (q64, k64, v64))
    with torch.no_grad():
        _, state = rfattn.rf_attention(
            q[:, :, :t0],
            k[:, :, :t0],
            v[:, :, :t0],
            rf,
            causal=True,
            return_state=True,
            backend="triton",
        )
        outs = []
        for t in range(t0, T):
            o, state = rfattn.rf_attention(
                q[:, :, t : t + 1],
                k[:, :, t : t + 1],
                v[:, :, t : t + 1],
                rf,
                causal=True,
                initial_state=state,
                return_state=True,
                backend="triton",
            )
            outs.append(o)
        out = torch.cat(outs, dim=2)
        err = rel_rms(out, ref[:, :, t0:])
        limit = tolerance(dtype)
        if dtype not in (torch.float32, torch.float64):
            own = rfattn.rf_attention(q, k, v, copy.deepcopy(rf), causal=True, backend="torch")
            limit = max(2.0 * rel_rms(own[:, :, t0:], ref[:, :, t0:]), tolerance(dtype) / 10)
    finite = bool(torch.isfinite(out).all())
    ok = finite and err <= limit
    return dict(
        verdict="ok" if ok else "failed",
        finite=finite,
        errors={"out": err},
        limits={"out": limit},
        rule="tolerance / flash-attention rule",
    )


def stage_smoke(rec: Recorder, work: Path, args) -> None:
    import torch

    dev = _device()
    # poison: every uninitialised float buffer (torch.empty: outputs, partial states) is NaN,
    # so an element a kernel leaves unwritten shows up as NaN in the result
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    shape = smoke_shape(dev.type == "cuda")
    cases = smoke_cases(dev.type == "cuda")
    if args.smoke_cases:
        cases = [c for c in cases if any(s in _case_id(c) for s in args.smoke_cases)]
    cases += [json.loads(c) for c in args.smoke_extra or []]
    rec.set(shape=shape, n_cases=len(cases))
    for case in cases:
        t0 = time.perf_counter()
        try:
            res = run_smoke_case(case, shape, dev)
        except Exception as exc:  # noqa: BLE001 - one case's failure is a result, not the end
            res = dict(
                verdict="error",
                error=f"{type(exc).__name__}: {exc}"[:2000],
                traceback=traceback.format_exc()[-4000:],
            )
        res.update(case=_case_id(case), seconds=round(time.perf_counter() - t0, 2))
        rec.row(**res)
        print(f"# smoke {res['case']}: {res['verdict']}", flush=True)
    rows = rec.doc["rows"]
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("ok", "failed", "error", "skipped")}
    bad = [r["case"] for r in rows if r["verdict"] in ("failed", "error")]
    rec.set(
        status="failed" if bad else "ok",
        counts=counts,
        summary=", ".join(f"{n} {v}" for v, n in counts.items() if n)
        + (f"; not ok: {', '.join(bad[:6])}" + (" ..." if len(bad) > 6 else "") if bad else ""),
    )


def _case_id(case: dict) -> str:
    return f"{case.get('path')}/{case.get('feature')}/{case.get('dtype')}"


# -- pytest, compile -----------------------------------------------------------------------------


def stage_pytest(rec: Recorder, work: Path, args) -> None:
    import importlib.util

    junit = work / "junit_gpu.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rfE",
        "--tb=short",
        f"--junitxml={junit}",
    ]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(min(8, os.cpu_count() or 1))]
    env = dict(os.environ, RFATTN_AUTOTUNE="0")
    rec.set(command=" ".join(cmd[1:]))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    print(proc.stdout[-20000:], proc.stderr[-5000:], sep="\n", flush=True)
    counts, failures = _junit(junit)
    for f in failures:
        rec.row(**f)
    status = "ok" if proc.returncode == 0 else "failed"
    rec.set(
        status=status,
        counts=counts,
        returncode=proc.returncode,
        summary=", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no tests ran",
    )


def _junit(path: Path) -> tuple[dict, list[dict]]:
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures: list[dict] = []
    if not path.exists():
        return counts, failures
    for tc in ET.parse(path).getroot().iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        kind = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "error", "skipped": "skipped", None: "passed"}[kind]
        counts[key] += 1
        if key in ("failed", "error"):
            node = next(c for c in tc if c.tag == kind)
            failures.append(dict(test=name, message=(node.get("message") or "")[:500]))
    return counts, failures


def stage_compile(rec: Recorder, work: Path, args) -> None:
    import torch

    import rfattn
    from rfattn.testing import rel_rms, tolerance

    dev = _device()
    rf = _rf("posrf", 64, 256, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    bad = []
    for causal in (False, True):
        q, k, v, do = (
            torch.randn(2, 4, 1000, 64, device=dev, generator=g, dtype=torch.bfloat16)
            for _ in range(4)
        )

        def f(q, k, v, causal=causal):
            return rfattn.rf_attention(q, k, v, rf, causal=causal)

        def fwd_bwd(fn, q=q, k=k, v=v, do=do):
            xs = [x.clone().requires_grad_() for x in (q, k, v)]
            out = fn(*xs)
            out.backward(do)
            return [out] + [x.grad for x in xs]

        torch._dynamo.reset()
        explain = torch._dynamo.explain(f)(q, k, v)
        breaks = int(explain.graph_break_count)
        reasons = [str(getattr(r, "reason", r))[:300] for r in explain.break_reasons][:5]
        torch._dynamo.reset()
        eager = fwd_bwd(f)
        row = dict(causal=causal, graph_breaks=breaks, break_reasons=reasons)
        try:
            compiled = fwd_bwd(torch.compile(f, fullgraph=True))
            errs = {
                n: rel_rms(a, b)
                for n, a, b in zip(("out", "dq", "dk", "dv"), compiled, eager, strict=True)
            }
            row.update(errors=errs, limit=tolerance(torch.bfloat16) / 10)
            row["ok"] = breaks == 0 and all(e <= row["limit"] for e in errs.values())
        except Exception as exc:  # noqa: BLE001 - fullgraph refusing is the finding
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:1500])
        rec.row(**row)
        if not row["ok"]:
            bad.append(f"causal={int(causal)}")
    total = sum(r.get("graph_breaks", 0) for r in rec.doc["rows"])
    # a transformers decoding step on an RFCache under CUDA graphs (the states keep their
    # addresses; issue 40): every compiled step a replay, logits those of the eager steps
    from bench.generate import build, compiled_decode

    try:
        row = compiled_decode(build("rfattn", 2, dev, 256, 128), steps=32, mode="reduce-overhead")
        row["ok"] = (row["cudagraph_skips"] == 0 and row["rel_error"] <= 1e-3
                     and row["steps_at_fixed_addresses"] == row["steps"])  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a refusal is the finding
        row = dict(ok=False, error=f"{type(exc).__name__}: {exc}"[:1500])
    rec.row(case="decode step, mode=reduce-overhead", **row)
    if not row["ok"]:
        bad.append("decode step under CUDA graphs")
    rec.set(
        status="failed" if bad else "ok",
        summary=f"{total} graph break(s); compiled == eager: "
        + ("yes" if not bad else f"no ({', '.join(bad)})"),
    )


# -- bench, fla, decode -------------------------------------------------------------------------


def _bench_rows(path: Path) -> tuple[list[dict], list[dict]]:
    rows, failures = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                (rows if d.pop("kind") == "row" else failures).append(d)
    return rows, failures


def _bench_split() -> tuple[list[str], list[str]]:
    """:data:`BENCH_ARGS` as (its features, the arguments without ``--features ...``)."""
    i, j = BENCH_ARGS.index("--features"), BENCH_ARGS.index("--providers")
    return BENCH_ARGS[i + 1 : j], BENCH_ARGS[:i] + BENCH_ARGS[j:]


def stage_bench(rec: Recorder, work: Path, args) -> None:
    """One bench run per feature, posrf (the targets' feature) first: a run cut off by its box
    keeps whole features rather than the forward rows of all three."""
    from bench.__main__ import main as bench_main

    jsonl = work / "bench_rows.jsonl"
    features, base = _bench_split()
    rc = 0
    for n, feature in enumerate(features):
        # performer draws its own posrf features: timed once, in the first run
        argv = [
            "--device",
            "cuda",
            *[a for a in base if n == 0 or a != "performer"],
            "--features",
            feature,
            *(args.bench_args or []),
            "--out",
            str(work / "bench" / feature),
            "--jsonl",
            str(jsonl),
        ]
        rec.set(argv=argv, running=feature)
        rc |= bench_main(argv)
    _merge_bench(work / "bench", features)
    rows, failures = _bench_rows(jsonl)
    rec.set(
        status="ok" if rc == 0 else "failed",
        n_rows=len(rows),
        n_failures=len(failures),
        summary=f"{len(rows)} rows, {len(failures)} failed points"
        + ("; a correctness check failed" if rc else ""),
    )


def _merge_bench(folder: Path, features: list[str]) -> None:
    """``folder/bench.json``: the per-feature runs' documents as one (rows, summaries, accuracy
    concatenated; env, config and ceilings of the first)."""
    docs = [
        json.loads((folder / f / "bench.json").read_text())
        for f in features
        if (folder / f / "bench.json").exists()
    ]
    if not docs:
        return
    merged = dict(docs[0])
    for key in ("results", "summary", "accuracy", "error_vs_M", "failures", "skipped"):
        merged[key] = [x for d in docs for x in d.get(key, [])]
    merged["config"] = dict(
        docs[0]["config"],
        features=features,
        features_run=[f for d in docs for f in d["config"]["features_run"]],
    )
    (folder / "bench.json").write_text(json.dumps(merged, indent=1))


def stage_fla(rec: Recorder, work: Path, args) -> None:
    from bench.fla import main as fla_main

    jsonl = work / "fla_rows.jsonl"
    rc = fla_main(
        [
            "--out",
            str(work / "fla"),
            "--jsonl",
            str(jsonl),
            "--providers",
            "rfattn",
            "rfattn-torch",
            "fla-chunk",
            "sdpa-flash",
            "sdpa-cudnn",
        ]
    )
    rows, failures = _bench_rows(jsonl)
    rec.set(
        status="ok" if rc == 0 else "failed",
        summary=f"{len(rows)} rows, {len(failures)} failed points",
    )


def stage_sync(rec: Recorder, work: Path, args) -> None:
    import torch

    from bench.sync_check import cases, check_case

    for name, fn in cases(torch.device("cuda")):
        row = check_case(fn)
        rec.row(case=name, **row)
        print(f"# sync {name}: {row['status']} {row.get('error', '')}"[:300], flush=True)
    bad = [r["case"] for r in rec.doc["rows"] if r["status"] != "ok"]
    rec.set(
        status="failed" if bad else "ok",
        summary=f"{len(rec.doc['rows']) - len(bad)} of {len(rec.doc['rows'])} cases copy and "
        "sync nothing" + (f"; synchronising: {', '.join(bad)}" if bad else ""),
    )


def stage_packed(rec: Recorder, work: Path, args) -> None:
    """One ``bench.packed`` run per length mix, so a run cut off by its box keeps the mixes it
    finished; ``packed.json`` merges them (:func:`merge_packed`)."""
    from bench.packed import MIXES
    from bench.packed import main as packed_main

    for mix in MIXES:
        packed_main(["--device", "cuda", "--mixes", mix, "--out", str(work / "packed" / mix)])
        doc = json.loads((work / "packed" / mix / "packed.json").read_text())
        for row in doc["results"]:
            rec.row(**row)
    rec.set(summary=_packed_summary(rec.doc["rows"]))


def _packed_summary(rows: list[dict]) -> str:
    """padded / packed time per mix, the range over causal x mode."""
    parts = []
    for mix in dict.fromkeys(r["mix"] for r in rows):
        ratios = [r["ratio_p50"] for r in rows if r["mix"] == mix]
        parts.append(f"{mix} {min(ratios):.2f}-{max(ratios):.2f}x")
    return "padded / packed: " + ", ".join(parts) if parts else "no rows"


def merge_packed(folder: Path) -> dict | None:
    """``folder/<mix>/packed.json`` as one document (the first's environment, every mix's rows),
    or None without any."""
    from bench.packed import MIXES

    paths = [folder / mix / "packed.json" for mix in MIXES]
    docs = [json.loads(p.read_text()) for p in paths if p.exists()]
    if not docs:
        return None
    merged = dict(docs[0])
    merged["mixes"] = {k: v for d in docs for k, v in d["mixes"].items()}
    merged["results"] = [r for d in docs for r in d["results"]]
    merged["seconds"] = round(sum(d.get("seconds", 0.0) for d in docs), 1)
    return merged


def stage_probe(rec: Recorder, work: Path, args) -> None:
    """rmf's fused operators at each kernel precision on the shape where its half form erred
    (:mod:`bench.probe_rmf`); ok while the default precision is within twice the torch path's
    error (the half form's row is what the probe is for)."""
    from rfattn.kernels.common import LOW_PRECISION

    from bench.probe_rmf import probe

    rows = probe()
    for row in rows:
        rec.row(**row)
    own = {r["path"]: r["error"] for r in rows if r["precision"] == "torch path"}
    bad = [r for r in rows if r["error"] is not None and r["precision"] != "torch path"
           and r["error"] > 2 * own[r["path"]]]  # fmt: skip
    listed = ", ".join(f"{r['path']} {r['precision']} {r['error']:.2e}" for r in bad)
    rec.set(  # rmf's fp16/bf16 default is LOW_PRECISION (kernels.common.precision_policy)
        status="failed" if any(r["precision"] == LOW_PRECISION for r in bad) else "ok",
        summary="over 2x the torch path's error: " + (listed or "none"),
    )


def stage_decode(rec: Recorder, work: Path, args) -> None:
    from bench.decode import main as decode_main

    decode_main(["--device", "cuda", "--steps", "1024", "--out", str(work / "decode")])
    doc = json.loads((work / "decode" / "decode.json").read_text())
    ratio = doc["ratio_last_first"]
    rec.set(
        decode=doc,
        status="ok" if ratio <= 1.2 else "failed",
        summary=f"last/first bucket {ratio:.2f} ms/token ratio (flat = 1); "
        f"{doc['rows'][0]['ms_median']:.3f} -> {doc['rows'][-1]['ms_median']:.3f} ms",
    )


# -- profile -------------------------------------------------------------------------------------

PROFILE_KERNELS = (
    "regex:_fwd_kv_kernel|_fwd_q_kernel|_chunk_states_kernel|_chunk_out_kernel|_chunk_bwd_kernel"
)


def profile_target() -> None:
    """The profiled region: one non-causal and one causal forward+backward at B4 H16 T16384 D64
    M256 bf16, after warm-up calls (autotuning) outside the profiler's range."""
    import torch

    import rfattn

    dev = torch.device("cuda")
    rf = _rf("posrf", 64, 256, dev)
    q, k, v, do = (
        torch.randn(4, 16, 16384, 64, device=dev, dtype=torch.bfloat16) for _ in range(4)
    )

    def step(causal):
        xs = [x.detach().requires_grad_() for x in (q, k, v)]
        rfattn.rf_attention(*xs, rf, causal=causal).backward(do)

    for causal in (False, True):
        step(causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for causal in (False, True):
        step(causal)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def stage_profile(rec: Recorder, work: Path, args) -> None:
    import shutil

    ncu = shutil.which("ncu")
    if ncu is None:
        rec.set(status="skipped", summary="ncu (Nsight Compute) is not on PATH")
        return
    cmd = [
        ncu,
        "--profile-from-start",
        "off",
        "--kernel-name",
        PROFILE_KERNELS,
        "--csv",
        "--section",
        "SpeedOfLight",
        "--section",
        "LaunchStats",
        "--section",
        "Occupancy",
        "--section",
        "ComputeWorkloadAnalysis",
        sys.executable,
        "-m",
        "bench.gpu",
        "--profile-target",
    ]
    rec.set(command=" ".join(cmd))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    (work / "ncu.csv").write_text(proc.stdout)
    print(proc.stderr[-5000:], flush=True)
    rows = _ncu_rows(proc.stdout)
    for r in rows:
        rec.row(**r)
    rec.set(
        status="ok" if proc.returncode == 0 and rows else "failed",
        summary=f"{len(rows)} kernel launches profiled"
        + (f"; ncu exit {proc.returncode}" if proc.returncode else ""),
    )


#: the ncu metrics kept per launch (section metric names as ncu prints them)
NCU_KEEP = (
    "Duration",
    "DRAM Throughput",
    "Memory Throughput",
    "Compute (SM) Throughput",
    "Registers Per Thread",
    "Dynamic Shared Memory Per Block",
    "Achieved Occupancy",
    "Block Size",
    "Grid Size",
)


def _ncu_rows(csv_text: str) -> list[dict]:
    """One dict per profiled launch from ncu's ``--csv`` section output."""
    import csv
    import io

    lines = [ln for ln in csv_text.splitlines() if ln.startswith('"')]
    launches: dict = {}
    for rec in csv.DictReader(io.StringIO("\n".join(lines))):
        key = (rec.get("ID"), rec.get("Kernel Name"))
        name = rec.get("Metric Name")
        if name in NCU_KEEP:
            d = launches.setdefault(key, {"kernel": (key[1] or "")[:80], "id": key[0]})
            d[f"{name} [{rec.get('Metric Unit', '')}]"] = rec.get("Metric Value")
    return list(launches.values())


STAGE_FNS = {
    "env": stage_env,
    "smoke": stage_smoke,
    "sync": stage_sync,
    "pytest": stage_pytest,
    "compile": stage_compile,
    "bench": stage_bench,
    "fla": stage_fla,
    "decode": stage_decode,
    "packed": stage_packed,
    "probe": stage_probe,
    "profile": stage_profile,
}
REPO = Path(__file__).resolve().parent.parent
#: stage -> the JSONL file its rows stream to (a stage killed at its box keeps them)
STREAMED_ROWS = {"bench": "bench_rows.jsonl", "fla": "fla_rows.jsonl"}


# ----------------------------------------------------------------------------------------------
# the parent: plan, boxes, processes, report


def plan(stages: list[str], budget_s: float, cuda: bool) -> list[dict]:
    """Each stage's time box: its share of the default budget scaled to ``budget_s``."""
    share = sum(BY_NAME[s].box_s for s in stages)
    out = []
    for s in stages:
        st = BY_NAME[s]
        out.append(
            dict(
                name=s,
                box_s=round(budget_s * st.box_s / share, 1),
                est_s=st.est_s,
                what=st.what,
                runs=cuda or not st.cuda_only,
            )
        )
    return out


def run_stage(
    name: str, box_s: float, work: Path, out: Path, argv_extra: list[str], cuda: bool = True
) -> dict:
    """The stage in its own process group, killed at ``box_s``; its recorded result."""
    result_path = work / f"stage-{name}.json"
    result_path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "bench.gpu",
        "--stage-worker",
        name,
        "--work",
        str(work),
        *argv_extra,
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not cuda:
        env["TRITON_INTERPRET"] = "1"  # the kernels run on the CPU under Triton's interpreter
    if name in ("smoke", "sync"):
        env["RFATTN_AUTOTUNE"] = "0"
    t0 = time.perf_counter()
    with open(out / "gpu_log.txt", "a") as log:
        log.write(f"\n===== stage {name} (box {box_s:.0f} s) =====\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        timed_out = False
        try:
            rc = proc.wait(timeout=box_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    seconds = time.perf_counter() - t0
    doc = json.loads(result_path.read_text()) if result_path.exists() else {"rows": []}
    if timed_out:
        # the benchmarks stream their rows to a JSONL file, not to the stage's record
        streamed = STREAMED_ROWS.get(name)
        n_rows = (len(_bench_rows(work / streamed)[0]) if streamed
                  else len(doc.get("rows", [])))  # fmt: skip
        doc["status"] = "timeout"
        doc["summary"] = f"stopped at its {box_s:.0f} s box; kept: " + (
            doc.get("summary") or f"{n_rows} rows"
        )
    elif rc != 0 and doc.get("status") in (None, "ok"):
        doc["status"] = "error"
        doc["summary"] = doc.get("summary") or f"exit status {rc}"
    return dict(doc, name=name, seconds=round(seconds, 1), box_s=box_s)


def collect(work: Path, out: Path) -> dict:
    """Copy the stages' artefacts into ``out``; the benchmark rows measured (partial runs too)."""
    import shutil

    if not (work / "bench" / "bench.json").exists():  # cut off: the features it finished
        _merge_bench(work / "bench", _bench_split()[0])
    for src, dst in (
        ("bench/bench.json", "bench.json"),
        ("fla/fla.json", "fla.json"),
        ("decode/decode.json", "decode.json"),
    ):
        if (work / src).exists():
            shutil.copy(work / src, out / dst)
    packed = merge_packed(work / "packed")
    if packed is not None:
        (out / "packed.json").write_text(json.dumps(packed, indent=1))
    rows, _ = _bench_rows(work / "bench_rows.jsonl")
    fla_rows, _ = _bench_rows(work / "fla_rows.jsonl")
    return dict(bench_rows=rows, fla_rows=fla_rows)


def _ms(rows, provider, feature, causal, mode, T, key="ms_p50"):
    for r in rows:
        if (r["provider"], r.get("feature"), r["causal"], r["mode"], r["T"]) == (
            provider,
            feature,
            causal,
            mode,
            T,
        ):
            return r.get(key)
    return None


def targets(rows: list[dict], stages: dict) -> list[dict]:
    """Issue 13's targets from the benchmark rows (posrf) and the stages: measured, met?"""
    from bench.summary import best_softmax, crossover

    out = []

    def add(name, measured, goal, met):
        out.append(
            dict(
                target=name,
                measured=measured,
                goal=goal,
                met=None if measured is None else bool(met),
            )
        )

    f = "posrf"
    for causal, limit_T, at_goal in ((False, 1024, 10.0), (True, 2048, 5.0)):
        for mode in ("fwd", "fwd+bwd"):
            best = best_softmax(rows, causal, mode)
            pts = []
            for T, (ms, _) in sorted(best.items()):
                mine = _ms(rows, "rfattn", f, causal, mode, T)
                if mine:
                    pts.append((T, ms / mine))
            tag = f"{'causal' if causal else 'non-causal'} {mode}"
            cross = crossover(pts) if pts else None
            add(
                f"crossover T <= {limit_T}, {tag}",
                cross if pts else None,
                limit_T,
                cross is not None and cross <= limit_T,
            )
            at = dict(pts).get(16384)
            add(
                f">= {at_goal:g}x faster than the best SDPA at T=16384, {tag}",
                None if at is None else round(at, 2),
                at_goal,
                at is not None and at >= at_goal,
            )
    for causal in (False, True):
        for mode in ("fwd", "fwd+bwd"):
            tag = f"{'causal' if causal else 'non-causal'} {mode}, T=8192"
            mine = _ms(rows, "rfattn", f, causal, mode, 8192)
            mem = _ms(rows, "rfattn", f, causal, mode, 8192, "peak_bytes")
            for prov, goal, what in (
                ("rfattn-torch", 3.0, "faster than the unfused path"),
                ("rfattn-compiled", 2.0, "faster than the compiled unfused path"),
                ("fla-chunk", 1.5, "faster than fla chunk_linear_attn"),
            ):
                if prov == "fla-chunk" and not causal:
                    continue
                other = _ms(rows, prov, f, causal, mode, 8192)
                r = None if not (mine and other) else round(other / mine, 2)
                add(f">= {goal:g}x {what}, {tag}", r, goal, r is not None and r >= goal)
            other_mem = _ms(rows, "rfattn-torch", f, causal, mode, 8192, "peak_bytes")
            r = None if not (mem and other_mem) else round(other_mem / mem, 2)
            add(
                f">= 4x less peak memory than the unfused path, {tag}",
                r,
                4.0,
                r is not None and r >= 4.0,
            )
    fr = [r.get("roofline_fraction") for r in rows if r["provider"] == "rfattn"]
    fr = [x for x in fr if x is not None]
    add(
        ">= 50 % of the roofline floor (best rfattn row)",
        round(max(fr), 3) if fr else None,
        0.5,
        fr and max(fr) >= 0.5,
    )
    dec = stages.get("decode", {}).get("decode")
    ratio = None if not dec else round(dec["ratio_last_first"], 2)
    add(
        "decode time per token flat in position (last/first <= 1.2)",
        ratio,
        1.2,
        ratio is not None and ratio <= 1.2,
    )
    comp = stages.get("compile", {}).get("rows") or []
    breaks = sum(r.get("graph_breaks", 0) for r in comp) if comp else None
    add("zero graph breaks under torch.compile", breaks, 0, breaks == 0)
    return out


def _roofline(rows: list[dict], ceilings: dict | None) -> None:
    """Roofline fractions of partial rows (bench sets them only when it finishes)."""
    from bench import roofline

    if not ceilings:
        return
    c = dict(
        matmul_flop_per_s=ceilings["bf16_matmul_flop_per_s"],
        copy_bytes_per_s=ceilings["copy_bytes_per_s"],
    )
    for r in rows:
        if r.get("roofline_fraction") is None and r.get("flops"):
            r["roofline_fraction"] = roofline.roofline_fraction(
                r["ms_p50"], r["flops"], r["bytes"], c
            )


def markdown(report: dict) -> str:
    lines = ["| stage | status | s (box) | summary |", "|---|---|---:|---|"]
    for s in report["stages"]:
        summ = str(s.get("summary", "")).replace("|", "/").replace("\n", " ")
        lines.append(
            f"| {s['name']} | {s['status']} | {s['seconds']:.0f} ({s['box_s']:.0f}) | "
            f"{summ[:300]} |"
        )
    if report.get("targets"):
        lines += ["", "| target | measured | met |", "|---|---:|---|"]
        for t in report["targets"]:
            met = {True: "yes", False: "no", None: "not measured"}[t["met"]]
            m = "-" if t["measured"] is None else t["measured"]
            lines.append(f"| {t['target']} | {m} | {met} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out", default="plots/out/gpu", help="folder of the report (default %(default)s)"
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="seconds for all stages together (each stage's box is its share)",
    )
    p.add_argument("--stages", nargs="+", choices=list(BY_NAME), help="stages to run, in order")
    p.add_argument(
        "--box",
        action="append",
        default=[],
        metavar="STAGE=SECONDS",
        help="override one stage's time box",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    p.add_argument("--profile", action="store_true", help="add the ncu profile stage")
    p.add_argument("--smoke-cases", nargs="+", help="run only smoke cases containing one of these")
    p.add_argument("--smoke-extra", action="append", help="an extra smoke case as JSON")
    p.add_argument(
        "--bench-args",
        nargs=argparse.REMAINDER,
        help="appended to python -m bench's arguments (last option)",
    )
    p.add_argument("--stage-worker", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--profile-target", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _worker(args) -> int:
    work = Path(args.work)
    rec = Recorder(work / f"stage-{args.stage_worker}.json")
    try:
        STAGE_FNS[args.stage_worker](rec, work, args)
    except Exception as exc:  # noqa: BLE001 - recorded, and the parent goes on
        rec.set(
            status="error",
            summary=f"{type(exc).__name__}: {exc}"[:1000],
            traceback=traceback.format_exc()[-6000:],
        )
        traceback.print_exc()
        return 1
    return 0


def _not_importable() -> str | None:
    """Why this interpreter cannot import the kernels (``rfattn.kernels`` lives in ``kernels/``
    and exists only through the package's install), or None."""
    try:
        import rfattn.kernels  # noqa: F401
    except ImportError as exc:
        return (
            f"{exc}: install the package into this interpreter ({sys.executable}) first: "
            f"{sys.executable} -m pip install --no-deps --no-build-isolation -e ."
        )
    return None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.profile_target:
        profile_target()
        return 0
    if args.stage_worker:
        return _worker(args)
    why = _not_importable()
    if why:
        print(f"# bench.gpu: {why}", file=sys.stderr)
        return 2
    import torch

    cuda = torch.cuda.is_available()
    names = args.stages or DEFAULT_STAGES + (["profile"] if args.profile else [])
    steps = plan(names, args.budget_s, cuda)
    for item in args.box:
        name, _, sec = item.partition("=")
        for st in steps:
            if st["name"] == name:
                st["box_s"] = float(sec)
    if args.dry_run:
        print(
            f"# bench.gpu plan ({'CUDA' if cuda else 'no CUDA: CUDA-only stages skipped'}), "
            f"budget {args.budget_s:.0f} s"
        )
        for st in steps:
            run = "runs" if st["runs"] else "skipped"
            print(
                f"  {st['name']:<8} box {st['box_s']:>6.0f} s  est {st['est_s']:>4.0f} s  "
                f"{run:<8} {st['what']}"
            )
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_log.txt").write_text("")
    extra = ["--smoke-cases", *args.smoke_cases] if args.smoke_cases else []
    for c in args.smoke_extra or []:
        extra += ["--smoke-extra", c]
    if args.bench_args:
        extra += ["--bench-args", *args.bench_args]
    start = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="rfattn-gpu-") as tmp:
        work = Path(tmp)
        for st in steps:
            left = args.budget_s - (time.perf_counter() - start)
            if not st["runs"] or left < 5:
                why = (
                    ("skipped", "needs a CUDA device")
                    if not st["runs"]
                    else ("not run", "the budget was spent")
                )
                res = dict(
                    name=st["name"],
                    status=why[0],
                    seconds=0.0,
                    box_s=st["box_s"],
                    summary=why[1],
                    rows=[],
                )
            else:
                res = run_stage(st["name"], min(st["box_s"], left), work, out, extra, cuda)
            results.append(res)
            print(
                f"# stage {res['name']}: {res['status']} in {res['seconds']:.0f} s: "
                f"{str(res.get('summary', ''))[:200]}",
                flush=True,
            )
        extra_doc = collect(work, out)
    ceilings = next((s.get("ceilings") for s in results if s["name"] == "env"), None)
    _roofline(extra_doc["bench_rows"], ceilings)
    extra_doc["targets"] = targets(extra_doc["bench_rows"], {s["name"]: s for s in results})
    report = dict(
        schema=SCHEMA,
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        cuda=cuda,
        budget_s=args.budget_s,
        seconds=round(time.perf_counter() - start, 1),
        stages=results,
        **extra_doc,
    )
    (out / "gpu_report.json").write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
    md = markdown(report)
    (out / "gpu_report.md").write_text(f"# rfattn GPU report ({report['date']})\n\n" + md)
    print(md)
    return 0 if all(s["status"] in ("ok", "skipped") for s in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
