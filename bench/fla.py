"""The causal benchmark on flash-linear-attention's shape set (issue "causal attention").

``python -m bench.fla`` runs ``python -m bench`` once per shape (B-T-H-D below, E = D), causal,
bf16, M = 256, forward and forward+backward, for rfattn (the fused chunked kernel on CUDA), its
unfused torch path and SDPA with each backend forced, and merges the runs into one JSON
(``--out``/fla.json; ``--save-results`` writes it under ``bench/results/<device>/``).
GPU only: these shapes are far beyond what the CPU path can time in minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from bench.__main__ import main as bench_main
from bench.env import REPO, results_slug

#: (B, T, H, D) of flash-linear-attention's benchmark shapes
SHAPES = [
    (1, 8192, 96, 128),
    (2, 16384, 16, 128),
    (4, 2048, 16, 128),
    (4, 4096, 64, 128),
    (8, 2048, 32, 256),
    (8, 1024, 8, 64),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.fla", description=__doc__)
    p.add_argument("--M", type=int, default=256)
    p.add_argument("--features", nargs="+", default=["posrf"])
    p.add_argument("--out", default="plots/out/fla")
    p.add_argument("--save-results", action="store_true")
    p.add_argument("--jsonl", help="passed to each bench run (rows appended as measured)")
    p.add_argument("--shapes", type=int, help="run only the first N shapes")
    p.add_argument("--providers", nargs="+", help="subset of providers (default: all available)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("# bench.fla needs a CUDA device (these shapes are GPU-sized); nothing run")
        return 0
    out = Path(args.out)
    if args.save_results:
        out = REPO / "bench" / "results" / results_slug(torch.device("cuda"))
    merged: dict = {"shapes": [], "results": [], "summary": []}
    status = 0
    for B, T, H, D in SHAPES[: args.shapes]:
        tag = f"B{B}-T{T}-H{H}-D{D}"
        sub = out / "fla" / tag
        argv_one = [
            "--device", "cuda", "--dtype", "bfloat16", "--B", str(B), "--H", str(H),
            "--D", str(D), "--E", str(D), "--M", str(args.M), "--T", str(T),
            "--causal", "1", "--modes", "fwd", "fwd+bwd", "--features", *args.features,
            "--max-T-bwd", str(T), "--out", str(sub),
            # accuracy is not what these shapes are for: one M, one draw
            "--error-M", str(args.M), "--seeds", "1",
        ]  # fmt: skip
        if args.providers:
            argv_one += ["--providers", *args.providers]
        if args.jsonl:
            argv_one += ["--jsonl", args.jsonl]
        print(f"# {tag}", flush=True)
        status |= bench_main(argv_one)
        doc = json.loads((sub / "bench.json").read_text())
        merged.setdefault("env", doc.get("env"))
        merged["shapes"].append(tag)
        merged["results"] += [dict(r, shape=tag) for r in doc.get("results", [])]
        merged["summary"] += [dict(s, shape=tag) for s in doc.get("summary", [])]
    out.mkdir(parents=True, exist_ok=True)
    (out / "fla.json").write_text(json.dumps(merged, indent=1))
    print(f"# wrote {out / 'fla.json'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
