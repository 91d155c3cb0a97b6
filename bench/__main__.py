"""python -m bench: rfattn against softmax attention on the best device here (``make demo``).

Sweeps the sequence length T at fixed B, H, D, E, M over providers (rfattn, its unfused torch
path, SDPA with each backend forced, flash-attn and performer-pytorch when installed), feature
kinds, causal and non-causal, forward and forward+backward. Prints a table and the crossover, and
writes one JSON file (``--out``/bench.json) that ``python -m plots`` turns into figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import rfattn
from bench import accuracy, memory, roofline
from bench.env import REPO, environment, pick_device, results_slug
from bench.providers import (
    CAUSAL_ONLY,
    available_providers,
    forward_output,
    is_softmax,
    make_call,
    make_inputs,
    reference_output,
)
from bench.summary import describe, summarize
from bench.timing import time_fn
from rfattn.testing import rel_rms, tolerance

SCHEMA = "rfattn-bench/1"
TIMING_CPU = (
    "synchronising wall-clock loop (time.perf_counter around each call) after 1 warm-up call: "
    "at least --min-reps calls, then more until --budget-s seconds or --max-reps calls"
)
TIMING_CUDA = "triton.testing.do_bench (warmup=25 ms, rep=100 ms) after one untimed call"

DEFAULTS = {
    "cpu": dict(
        dtype="float32",
        B=1,
        H=8,
        D=64,
        E=64,
        M=256,
        T=[256, 512, 1024, 2048, 4096, 8192],
        max_T_bwd=4096,
        ceiling_n=2048,
        ceiling_mib=256,
    ),
    "cuda": dict(
        dtype="bfloat16",
        B=4,
        H=16,
        D=128,
        E=128,
        M=256,
        T=[256, 512, 1024, 2048, 4096, 8192, 16384, 32768],
        max_T_bwd=None,
        ceiling_n=8192,
        ceiling_mib=1024,
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU) | cpu | cuda")
    p.add_argument("--T", type=int, nargs="+", help="sequence lengths (default: per device)")
    for dim in ("B", "H", "D", "E", "M"):
        p.add_argument(f"--{dim}", type=int, help=f"{dim} (default: per device)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default per device")
    p.add_argument("--features", nargs="+", default=["posrf", "oprf", "rmf"])
    p.add_argument(
        "--weights",
        default="orf",
        help="weight matrix (a feature's first valid one is used where it does not accept this)",
    )
    p.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    p.add_argument("--providers", nargs="+", help="subset of providers (default: all available)")
    p.add_argument("--max-T-bwd", type=int, help="largest T timed fwd+bwd (CPU default 4096)")
    p.add_argument(
        "--mem-fraction",
        type=float,
        default=0.5,
        help="CPU: skip a call whose "
        "estimated memory exceeds this fraction of the available memory",
    )
    p.add_argument("--min-reps", type=int, default=3, help="CPU: timed calls at least")
    p.add_argument("--max-reps", type=int, default=50, help="CPU: timed calls at most")
    p.add_argument("--budget-s", type=float, default=1.0, help="CPU: timing budget per point")
    p.add_argument("--no-memory", action="store_true", help="skip peak-memory measurement")
    p.add_argument(
        "--check-max-T",
        type=int,
        default=1024,
        help="correctness asserted against a float64 reference for T up to this",
    )
    p.add_argument("--acc-T", type=int, default=512, help="T of the accuracy measurements")
    p.add_argument("--acc-std", type=float, default=0.5, help="q, k ~ N(0, std^2) for accuracy")
    p.add_argument(
        "--error-M",
        type=int,
        nargs="+",
        default=[16, 32, 64, 128, 256, 512, 1024],
        help="M values of the error-vs-M sweep",
    )
    p.add_argument("--seeds", type=int, default=3, help="random-feature draws per M")
    p.add_argument("--ceiling-n", type=int, help="matmul size of the FLOP/s ceiling")
    p.add_argument("--ceiling-mib", type=int, help="buffer size of the copy-bandwidth ceiling")
    p.add_argument("--out", default="plots/out", help="folder of bench.json")
    p.add_argument(
        "--save-results",
        action="store_true",
        help="write to bench/results/<device>/ instead of --out",
    )
    p.add_argument("--notes", default="", help="free text stored in the JSON")
    p.add_argument(
        "--jsonl",
        help="also append every row and failure to this file as it is measured (one JSON object "
        "per line), so a run cut off by a time limit keeps what it measured",
    )
    args = p.parse_args(argv)
    return args


def _resolve(args, device: torch.device) -> dict:
    d = dict(DEFAULTS["cuda" if device.type == "cuda" else "cpu"])
    for key in ("dtype", "B", "H", "D", "E", "M", "T", "max_T_bwd", "ceiling_n", "ceiling_mib"):
        if getattr(args, key) is not None:
            d[key] = getattr(args, key)
    d["T"] = sorted(set(d["T"]))
    return d


def _build_rfs(features, weights, D, M, device) -> tuple[dict, dict, dict]:
    """{feature: RandomFeatures}, {feature: weights used}, {feature: why skipped}."""
    rfs, used, skipped = {}, {}, {}
    for f in features:
        w = weights
        valid = getattr(getattr(rfattn, "features", None), "VALID_WEIGHTS", {}).get(f)
        if valid and w not in valid:
            w = valid[0]
        try:
            rfs[f] = rfattn.RandomFeatures(D, M, feature=f, weights=w, seed=0).to(device)
            used[f] = w
        except (NotImplementedError, ValueError) as exc:
            skipped[f] = f"{type(exc).__name__}: {exc}"
    return rfs, used, skipped


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _estimated_bytes(provider: str, B, H, T, elem_bytes: int, backward: bool) -> float:
    """A rough upper estimate of the T^2 buffers of the math backend (others are ~linear)."""
    if provider != "sdpa-math":
        return 0.0
    return B * H * T * T * max(elem_bytes, 4) * (6 if backward else 3)


def _rf_path(provider, rf, device, causal, backward) -> str | None:
    """Which rfattn implementation ran (the documented rule of backend='auto')."""
    if provider == "rfattn":
        fused = rfattn.attention.fused_kernel_available(rf, causal)
        return "triton" if device.type == "cuda" and fused else "torch"
    if provider in ("rfattn-torch", "rfattn-compiled"):
        return "torch"
    if provider == "fla-chunk":
        return "torch features + fla chunk_linear_attn"
    return None


def _fmt_bytes(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


HEADER = (
    f"{'provider':<22}{'causal':>6}{'mode':>8}{'T':>7}{'ms p50':>10}{'p20':>9}{'p80':>9}"
    f"{'tok/s':>10}{'peak MiB':>10}{'GFLOP/s':>9}{'roof%':>7}"
)


def _name(r: dict) -> str:
    return r["provider"] + (f"[{r['feature']}]" if r.get("feature") else "")


def _row_line(r: dict) -> str:
    name = _name(r)
    return (
        f"{name:<22}{int(r['causal']):>6}{r['mode']:>8}{r['T']:>7}{r['ms_p50']:>10.3f}"
        f"{r['ms_p20']:>9.3f}{r['ms_p80']:>9.3f}{r['tokens_per_s']:>10.3g}"
        f"{_fmt_bytes(r['peak_bytes']):>10}{r['flop_per_s'] / 1e9:>9.1f}"
        f"{100 * r['roofline_fraction']:>7.1f}"
    )


def run(args) -> tuple[dict, int]:
    """Measure everything; returns (the JSON document, number of failed correctness checks)."""
    device = pick_device(args.device)
    cfg = _resolve(args, device)
    dtype = getattr(torch, cfg["dtype"])
    elem = torch.empty((), dtype=dtype).element_size()
    B, H, D, E, M = (cfg[k] for k in "BHDEM")
    env = environment(device)
    rfs, weights_used, skipped_features = _build_rfs(args.features, args.weights, D, M, device)
    providers, skipped = available_providers(device, dtype, D, E, args.providers)
    if "performer" in providers and "posrf" not in rfs:
        providers.remove("performer")
        skipped["performer"] = "performer's FAVOR+ is posrf: add posrf to --features"

    print(
        f"# rfattn benchmark on {env['device']} | torch {env['torch']} | triton {env['triton']} "
        f"| {cfg['dtype']} B={B} H={H} D={D} E={E} M={M} | commit {env['git_commit']}"
    )
    for name, why in {**skipped, **skipped_features}.items():
        print(f"# skipped {name}: {why}")

    ceilings = roofline.measure_ceilings(device, dtype, cfg["ceiling_n"], cfg["ceiling_mib"])
    avail = _available_bytes() if device.type == "cpu" else None
    worker = memory.CpuMemoryWorker() if device.type == "cpu" and not args.no_memory else None

    ctx = _Context(cfg, args, device, dtype, worker)
    results, failures, n_failed_checks = [], [], 0
    try:
        for mode in args.modes:
            backward = mode == "fwd+bwd"
            for causal in (bool(c) for c in args.causal):
                dead: dict = {}  # (provider, feature) -> why larger T are skipped
                for T in cfg["T"]:
                    if backward and cfg["max_T_bwd"] is not None and T > cfg["max_T_bwd"]:
                        continue
                    x = make_inputs(B, H, T, D, E, dtype, device, backward)
                    for provider in providers:
                        if causal is False and provider in CAUSAL_ONLY:
                            continue
                        kinds = [None] if is_softmax(provider) else list(rfs)
                        if provider == "performer":
                            kinds = ["posrf"]
                        for feature in kinds:
                            key = (provider, feature)
                            est = _estimated_bytes(provider, B, H, T, elem, backward)
                            if key not in dead and avail and est > args.mem_fraction * avail:
                                dead[key] = (
                                    f"needs ~{est / 2**30:.1f} GiB > {args.mem_fraction} x "
                                    f"{avail / 2**30:.1f} GiB available from T={T}"
                                )
                            if key in dead:
                                continue
                            rf = rfs.get(feature) or next(iter(rfs.values()), None)
                            row, err = _measure_one(ctx, provider, feature, rf, x, causal, mode)
                            if err is not None:
                                dead[key] = f"failed at T={T}: {err}"
                                failures.append(
                                    dict(
                                        provider=provider,
                                        feature=feature,
                                        causal=causal,
                                        mode=mode,
                                        T=T,
                                        error=err,
                                    )
                                )
                                _emit(args.jsonl, "failure", failures[-1])
                                print(f"# {provider} [{feature}] T={T}: {err}"[:240])
                                if device.type == "cuda":
                                    torch.cuda.empty_cache()
                                continue
                            row["weights"] = weights_used.get(feature)
                            results.append(row)
                            _emit(args.jsonl, "row", row)
                            print(
                                f"# measured {_name(row)} causal={int(causal)} {mode} T={T}: "
                                f"{row['ms_p50']:.3f} ms",
                                flush=True,
                            )
                            if row.get("check_ok") is False:
                                n_failed_checks += 1
                                print(
                                    f"# CHECK FAILED: {provider}[{feature}] T={T}: rel_rms "
                                    f"{row['check_rel_rms']:.2e} > {row['check_tol']:.0e}"
                                )
                    del x
                for (provider, feature), why in dead.items():
                    if why.startswith("needs"):
                        failures.append(
                            dict(
                                provider=provider,
                                feature=feature,
                                causal=causal,
                                mode=mode,
                                error=f"skipped: {why}",
                            )
                        )
    finally:
        if worker is not None:
            worker.close()

    # ceilings measured again after the sweep and the better kept: on a shared machine one
    # measurement can land on a busy moment
    again = roofline.measure_ceilings(device, dtype, cfg["ceiling_n"], cfg["ceiling_mib"])
    for key in ("matmul_flop_per_s", "copy_bytes_per_s"):
        ceilings[key] = max(ceilings[key], again[key])
    for row in results:
        row["roofline_fraction"] = roofline.roofline_fraction(
            row["ms_p50"], row["flops"], row["bytes"], ceilings
        )
    print(
        f"# ceilings: matmul {ceilings['matmul_flop_per_s'] / 1e9:.1f} GFLOP/s "
        f"({cfg['ceiling_n']}^3 {cfg['dtype']}), copy {ceilings['copy_bytes_per_s'] / 1e9:.1f} GB/s"
    )
    print(HEADER)
    for row in results:
        print(_row_line(row))
    acc_providers = [p for p in providers if p != "rfattn-torch"]
    acc = accuracy.accuracy_at_m(
        rfs,
        acc_providers,
        1,
        H,
        args.acc_T,
        D,
        E,
        args.acc_std,
        [bool(c) for c in args.causal],
        dtype,
        device,
    )
    err_m = accuracy.error_vs_m(
        weights_used,
        args.error_M,
        args.seeds,
        1,
        H,
        args.acc_T // 2,
        D,
        E,
        args.acc_std,
        [bool(c) for c in args.causal],
        dtype,
        device,
    )
    summary = summarize(results)
    doc = dict(
        schema=SCHEMA,
        env=env,
        config=dict(
            cfg,
            features=args.features,
            features_run=list(rfs),
            weights=weights_used,
            modes=args.modes,
            causal=[bool(c) for c in args.causal],
            providers=providers,
            acc_T=args.acc_T,
            acc_std=args.acc_std,
            error_M=args.error_M,
            error_T=args.acc_T // 2,
            seeds=args.seeds,
            check_max_T=args.check_max_T,
            min_reps=args.min_reps,
            max_reps=args.max_reps,
            budget_s=args.budget_s,
            argv=sys.argv[1:],
        ),
        methods=dict(
            timing=TIMING_CUDA if device.type == "cuda" else TIMING_CPU,
            memory=memory.METHOD_CUDA if device.type == "cuda" else memory.METHOD_CPU,
            peak_bytes="bytes a call needs on top of its inputs (None: not measured)",
            roofline=roofline.__doc__.strip(),
            accuracy=accuracy.__doc__.strip(),
        ),
        notes=args.notes,
        ceilings=ceilings,
        skipped=[{"provider": p, "reason": why} for p, why in skipped.items()]
        + [{"feature": f, "reason": why} for f, why in skipped_features.items()],
        failures=failures,
        results=results,
        accuracy=acc,
        error_vs_M=err_m,
        summary=summary,
    )
    return doc, n_failed_checks


@dataclass
class _Context:
    """What every measurement of a run shares."""

    cfg: dict
    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    worker: memory.CpuMemoryWorker | None


def _measure_one(ctx: _Context, provider, feature, rf, x, causal: bool, mode: str):
    """Time, then measure memory, then check one configuration: (row, None) or (None, error)."""
    cfg, args, device, dtype = ctx.cfg, ctx.args, ctx.device, ctx.dtype
    backward = mode == "fwd+bwd"
    elem = torch.empty((), dtype=dtype).element_size()
    B, H, T, D = x.q.shape
    E, M = x.v.shape[-1], cfg["M"]
    try:
        call, leaves = make_call(provider, x, rf, causal, backward)
        p50, p20, p80, n = time_fn(
            call,
            device,
            grad_to_none=leaves or None,
            min_reps=args.min_reps,
            max_reps=args.max_reps,
            budget_s=args.budget_s,
        )
    except (RuntimeError, NotImplementedError, ValueError) as exc:  # OOM, unsupported shape
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    peak, mem_error = None, None
    if device.type == "cuda":
        peak = memory.gpu_peak_bytes(call, leaves)
    elif ctx.worker is not None:
        spec = dict(
            provider=provider,
            feature=feature,
            weights=rf.weights if feature else None,
            B=B,
            H=H,
            T=T,
            D=D,
            E=E,
            M=M,
            dtype=cfg["dtype"],
            causal=causal,
            mode=mode,
        )
        answer = ctx.worker.measure(spec)
        peak, mem_error = answer.get("peak_bytes"), answer.get("error")
    del call
    F = rf.num_outputs if (rf is not None and feature) else M
    n_flops = roofline.flops(is_softmax(provider), B, H, T, D, E, M, F, causal, backward)
    n_bytes = roofline.compulsory_bytes(B, H, T, D, E, elem, backward)
    row = dict(
        provider=provider,
        feature=feature,
        path=_rf_path(provider, rf, device, causal, backward),
        causal=causal,
        mode=mode,
        B=B,
        H=H,
        T=T,
        D=D,
        E=E,
        M=M if feature else None,
        F=F if feature else None,
        dtype=cfg["dtype"],
        ms_p50=p50,
        ms_p20=p20,
        ms_p80=p80,
        n_timed=n,
        tokens_per_s=B * T / (p50 * 1e-3),
        peak_bytes=peak,
        flops=n_flops,
        flop_per_s=n_flops / (p50 * 1e-3),
        bytes=n_bytes,
        roofline_fraction=None,  # set once the ceilings are final
    )
    if mem_error:
        row["memory_error"] = mem_error
    # correctness, asserted once after timing, on the same inputs
    if T <= args.check_max_T:
        rf_before = copy.deepcopy(rf)  # the state the checked call sees (running statistics)
        out = forward_output(provider, x, rf, causal)
        ref = reference_output(provider, x, rf_before, causal)
        finite = bool(torch.isfinite(out).all())
        err = rel_rms(out, ref) if ref is not None else None
        tol = tolerance(dtype, "out")
        if err is not None and rf is not None and feature and not rf.feature_map.positive:
            # signed features: the denominator can cancel, so rounding is amplified by the
            # problem itself; hold the provider to the flash-attention rule instead (at most
            # 2x the torch path's own error in this dtype)
            own = rfattn.rf_attention(*(t.detach() for t in (x.q, x.k, x.v)), rf_before,
                                      causal=causal, backend="torch")  # fmt: skip
            tol = max(tol, 2.0 * rel_rms(own, ref))
        row.update(
            check_rel_rms=err,
            check_tol=tol,
            check_ok=finite and (err is None or err <= tol),
        )
    return row, None


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.save_results:
        args.out = str(REPO / "bench" / "results" / results_slug(pick_device(args.device)))
    doc, n_failed = run(args)
    print("# speed-up of rfattn over the fastest exact-softmax provider at each T:")
    for entry in doc["summary"]:
        print("#   " + describe(entry))
    for row in doc["accuracy"]:
        if "rel_err" in row:
            name = _name(row)
            print(
                f"# accuracy: {name:<22} causal={int(row['causal'])} T={row['T']} "
                f"q,k~N(0,{row['std']}^2): rel. RMS error vs exact softmax {row['rel_err']:.3g}"
            )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench.json"
    path.write_text(json.dumps(_finite(doc), indent=1, allow_nan=False) + "\n")
    print(f"# wrote {path}")
    if n_failed:
        print(f"# {n_failed} correctness check(s) FAILED: see check_ok in the JSON")
        return 1
    return 0


def _emit(path: str | None, kind: str, obj: dict) -> None:
    """Append ``{"kind": kind, **obj}`` as one line to ``path`` (``--jsonl``), if given."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(_finite(dict(kind=kind, **obj)), allow_nan=False) + "\n")


def _finite(x):
    """The document with non-finite floats as null (strict JSON)."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


if __name__ == "__main__":
    raise SystemExit(main())
