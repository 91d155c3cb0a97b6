"""Grouped-query attention: what sharing each key/value head saves against repeating it.

For 8 query heads and 8, 4, 2 or 1 key/value heads, one causal prefill call (``return_state``,
no gradient, as ``generate()``'s prompt) and one causal forward+backward, each run two ways on
the same inputs:

* ``grouped``: ``rf_attention(q, k, v, ...)`` with k, v of Hkv heads (key features, chunk states
  and the returned state once per key/value head);
* ``repeated``: k and v repeated to every query head first (transformers' ``repeat_kv``, what
  rfattn's Hugging Face path did before), inside the measured call.

Reported per case: the returned state's bytes, the peak memory of the call above its inputs
(``bench.memory``'s CPU method: a fresh worker process per measurement, glibc's mmap threshold
lowered so freed tensors leave the resident set, peak RSS mark reset before the call) and the
median time of 3 calls after a warm-up (``bench.timing``: torch path on CPU; the fused kernels
and ``do_bench`` on a GPU).

    python -m bench.gqa                       # T = 4096, CPU, about 2 minutes
    python -m bench.gqa --T 1024 --out plots/out
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["measure", "main"]

HQ, D, E, M = 8, 64, 64, 256
KV_HEADS = (8, 4, 2, 1)


def _call(q, k, v, rf, way: str, backward: bool):
    import rfattn

    G = q.shape[1] // k.shape[1]

    def run():
        kk, vv = (k, v) if way == "grouped" else (k.repeat_interleave(G, 1),
                                                   v.repeat_interleave(G, 1))  # fmt: skip
        with torch.set_grad_enabled(backward):
            out, state = rfattn.rf_attention(q, kk, vv, rf, causal=True, return_state=True)
            if backward:
                out.square().sum().backward()
        return state

    return run


def measure(spec: dict) -> dict:
    """One case (worker side): state bytes, peak bytes above the inputs, median seconds."""
    import rfattn
    from bench.memory import configure_malloc, cpu_peak_bytes, gpu_peak_bytes
    from bench.timing import time_fn

    device = torch.device(spec["device"])
    if device.type == "cpu":
        configure_malloc()
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).to(device)
    gen = torch.Generator().manual_seed(0)
    backward = spec["mode"] == "fwd+bwd"

    def inputs(T):
        q = torch.randn(1, HQ, T, D, generator=gen).to(device)
        k = torch.randn(1, spec["kv_heads"], T, D, generator=gen).to(device)
        v = torch.randn(1, spec["kv_heads"], T, E, generator=gen).to(device)
        return [x.requires_grad_(backward) for x in (q, k, v)]

    _call(*inputs(64), rf, spec["way"], backward)()  # warm-up: lazy initialisation
    x = inputs(spec["T"])
    run = _call(*x, rf, spec["way"], backward)
    peak = (gpu_peak_bytes if device.type == "cuda" else cpu_peak_bytes)(run, x)
    state = run()
    # CPU: the median of 3 (the calls above were the warm-up); GPU: triton's do_bench
    ms = time_fn(run, device, grad_to_none=x, warmup=0, min_reps=3, max_reps=3)[0]
    return dict(spec, state_bytes=sum(t.numel() * t.element_size() for t in state),
                peak_bytes=peak, ms_median=ms)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gqa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--out", default="plots/out")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))))
        return 0
    doc = dict(
        title=(f"grouped-query causal rf_attention, B=1, {HQ} query heads, D=E={D}, M={M} posrf, "
               f"T={args.T}, fp32, {args.device}"),
        device=args.device, machine=platform.machine(), threads=torch.get_num_threads(),
        torch=torch.__version__, method=("one worker process per case; peak: bench.memory's "
        "method above the inputs; time: median of 3 after a warm-up"), results=[],
    )  # fmt: skip
    print(f"# {doc['title']}")
    print(f"{'mode':8} {'Hkv':>3} {'way':9} {'state KiB':>10} {'peak MiB':>9} {'ms':>8}")
    for mode in ("prefill", "fwd+bwd"):
        for kv in KV_HEADS:
            for way in ("grouped", "repeated"):
                spec = dict(device=args.device, T=args.T, kv_heads=kv, way=way, mode=mode)
                res = subprocess.run([sys.executable, "-m", "bench.gqa", "--worker",
                                      json.dumps(spec)], capture_output=True, text=True,
                                     check=True)  # fmt: skip
                row = json.loads(res.stdout.strip().splitlines()[-1])
                doc["results"].append(row)
                peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.1f}"
                print(f"{mode:8} {kv:>3} {way:9} {row['state_bytes'] / 1024:10.1f} {peak:>9} "
                      f"{row['ms_median']:8.1f}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gqa.json").write_text(json.dumps(doc, indent=1))
    print(f"# wrote {out / 'gqa.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
