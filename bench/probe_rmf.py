"""Why rmf's half form erred on an H100 (2026-11-27): one shape, each precision, both paths.

On that run rmf in bf16 at B4 H16 T1024 D64 M256 (q, k ~ N(0, 1)) erred 0.27 non-causal and
0.059 causal against float64 under the half policy, where the torch path in bf16 erred 0.027
and the interpreter's emulation of the same products 0.0018; rmf has taken tf32x3 since. This
probe calls the fused operators (``rfattn.ops.rf_parallel``, ``rfattn.ops.rf_chunk``) with each
kernel precision on the same inputs and the same W, and prints each one's relative RMS error
against the float64 torch path: if ``ieee`` (exact fp32 products) errs too, the fault is in
the compiled kernel or its config (BT 64 at 8 warps, three stages, for half inputs), not in
the rounding; if only ``half`` errs, in a rounding the emulation does not model.

    python -m bench.probe_rmf [--T 1024] [--out FILE]     # CUDA; the interpreter at tiny T
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

import rfattn
from rfattn import ops
from rfattn.testing import rel_rms

PRECISIONS = ("half", "tf32x3", "tf32", "ieee")


def probe(B=4, H=16, T=1024, D=64, M=256, dtype=torch.bfloat16, device=None, seed=0):
    """Rows ``{path, precision, error}``, plus the torch path's own error in ``dtype``."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(3))
    rf = rfattn.RandomFeatures(D, M, feature="rmf", weights="rademacher", seed=seed).to(device)
    scale = D**-0.5
    rows = []
    for causal in (False, True):
        ref = rfattn.rf_attention(*(x.double() for x in (q, k, v)), copy.deepcopy(rf).double(),
                                  causal=causal, backend="torch")  # fmt: skip
        own = rfattn.rf_attention(q, k, v, rf, causal=causal, backend="torch")
        path = "chunk" if causal else "parallel"
        rows.append(dict(path=path, precision="torch path", error=rel_rms(own, ref)))
        form = rf.feature_map.kernel_form(rf.weight)
        for precision in PRECISIONS:
            try:
                with torch.no_grad():
                    if causal:
                        out = ops.rf_chunk(q, k, v, form, scale, precision=precision)[0]
                    else:
                        out = ops.rf_parallel(q, k, v, form, scale, precision=precision)
                row = dict(path=path, precision=precision, error=rel_rms(out, ref))
            except Exception as exc:  # noqa: BLE001 (a precision the kernels refuse is a row)
                row = dict(path=path, precision=precision, error=None, why=str(exc)[:300])
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.probe_rmf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--T", type=int, default=1024)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--out", help="JSON file of the rows")
    a = p.parse_args(argv)
    rows = probe(B=a.B, H=a.H, T=a.T)
    for r in rows:
        err = "-" if r["error"] is None else f"{r['error']:.3e}"
        print(f"{r['path']:9} {r['precision']:11} {err}  {r.get('why', '')}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(T=a.T, B=a.B, H=a.H, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
