"""CLI: ``python -m bench [--T 256 512 ...] [--out plots/out]`` (see ``--help``)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

import rfattn
from bench.providers import available_providers, make_call
from bench.timing import time_fn
from rfattn.testing import rel_rms

ACC_T, ACC_STD = 512, 0.5


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cpus)"


def _env(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": _device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": sys.version.split()[0],
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _attention_flops(B, H, T, D, E, M, provider, causal) -> float:
    """Useful FLOPs of one forward: the matmuls of the algorithm the provider runs."""
    if provider.startswith("rfattn"):
        # projections of q and k (2 T M D each), phi_k^T V, phi_q S (2 T M E each)
        return B * H * (4.0 * T * M * D + 4.0 * T * M * E)
    flops = B * H * 2.0 * T * T * (D + E)
    return flops / 2 if causal else flops


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--T", type=int, nargs="+", default=None, help="sequence lengths")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--E", type=int, default=64)
    p.add_argument("--M", type=int, default=256)
    p.add_argument("--feature", default="posrf")
    p.add_argument("--weights", default="orf")
    p.add_argument("--modes", nargs="+", default=["fwd"], choices=["fwd", "fwd+bwd"])
    p.add_argument("--causal", nargs="+", type=int, default=[0, 1], choices=[0, 1])
    p.add_argument("--providers", nargs="+", default=None)
    p.add_argument("--reps", type=int, default=5, help="CPU timing repetitions")
    p.add_argument("--out", default="plots/out", help="folder of bench.json")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = _device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    Ts = args.T or (
        [2**i for i in range(8, 15)] if device.type == "cuda" else [256, 512, 1024, 2048, 4096]
    )
    providers, skipped = available_providers(device)
    if args.providers:
        providers = [p for p in providers if p in args.providers]
    B, H, D, E, M = args.B, args.H, args.D, args.E, args.M
    rf = rfattn.RandomFeatures(D, M, feature=args.feature, weights=args.weights, seed=0).to(device)
    env = _env(device)
    print(
        f"# rfattn benchmark on {env['device']} | torch {env['torch']} | {dtype} | "
        f"B={B} H={H} D={D} E={E} M={M} feature={args.feature} weights={args.weights}"
    )
    for name, why in skipped.items():
        print(f"# skipped {name}: {why}")

    # accuracy alongside speed: relative error of the output against exact softmax attention, on
    # q, k ~ N(0, ACC_STD^2) (random features degrade fast as |q||k| * scale grows)
    g = torch.Generator().manual_seed(0)
    qa, ka, va = (
        torch.randn(B, H, ACC_T, n, generator=g).to(device) * s
        for n, s in ((D, ACC_STD), (D, ACC_STD), (E, 1.0))
    )
    accuracy = {}
    for causal in sorted(set(args.causal)):
        exact = rfattn.reference.softmax_attention(qa, ka, va, causal=bool(causal))
        approx = rfattn.rf_attention(qa, ka, va, rf, causal=bool(causal))
        accuracy[str(causal)] = rel_rms(approx, exact)

    results = []
    header = (
        f"{'provider':<14}{'causal':>7}{'mode':>9}{'T':>7}{'ms p50':>10}{'p20':>9}{'p80':>9}"
        f"{'tok/s':>11}{'GFLOP/s':>9}"
    )
    print(header)
    for mode in args.modes:
        backward = mode == "fwd+bwd"
        for causal in args.causal:
            for T in Ts:
                q = torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=backward)
                k = torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=backward)
                v = torch.randn(B, H, T, E, device=device, dtype=dtype, requires_grad=backward)
                for provider in providers:
                    call = make_call(provider, q, k, v, rf, bool(causal), backward)
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    try:
                        p50, p20, p80 = time_fn(call, device, reps=args.reps)
                    except (RuntimeError, NotImplementedError) as exc:  # e.g. out of memory
                        print(f"# {provider} T={T} failed: {type(exc).__name__}: {exc}"[:200])
                        continue
                    peak = (
                        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
                    )
                    flops = _attention_flops(B, H, T, D, E, M, provider, bool(causal))
                    flops *= 3.0 if backward else 1.0
                    row = dict(
                        provider=provider,
                        causal=bool(causal),
                        mode=mode,
                        B=B,
                        H=H,
                        T=T,
                        D=D,
                        E=E,
                        M=M,
                        dtype=str(dtype).removeprefix("torch."),
                        ms_p50=p50,
                        ms_p20=p20,
                        ms_p80=p80,
                        tokens_per_s=B * T / (p50 * 1e-3),
                        peak_bytes=peak,
                        flop_per_s=flops / (p50 * 1e-3),
                    )
                    results.append(row)
                    print(
                        f"{provider:<14}{causal:>7}{mode:>9}{T:>7}{p50:>10.3f}{p20:>9.3f}"
                        f"{p80:>9.3f}{row['tokens_per_s']:>11.3g}"
                        f"{row['flop_per_s'] / 1e9:>9.1f}"
                    )
    print(
        f"# relative error of rfattn vs exact softmax attention (T={ACC_T}, q, k ~ N(0, "
        f"{ACC_STD}^2)): " + ", ".join(f"causal={c}: {e:.3f}" for c, e in accuracy.items())
    )
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = dict(
        env=env,
        config=dict(vars(args), dtype=str(dtype).removeprefix("torch.")),
        skipped=skipped,
        accuracy=accuracy,
        results=results,
    )
    path = out_dir / "bench.json"
    path.write_text(json.dumps(doc, indent=1))
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
