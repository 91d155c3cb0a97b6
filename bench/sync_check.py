"""One call of each fused form under ``torch.cuda.set_sync_debug_mode("error")``: a call that
copies host data to the device or synchronises raises. Each form runs once first (compiling and,
with autotuning on, tuning: those sync by design), then once under the debug mode. Needs CUDA;
``python -m bench.gpu`` runs it as its ``sync`` stage (``bench.host`` counts the same copies and
syncs without a GPU, against a fake driver, but cannot see a sync torch makes on the device).

    python -m bench.sync_check [--out FILE] [--cases NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

import rfattn


def cases(dev, only: list[str] | None = None) -> list[tuple[str, object]]:
    """(name, call) of each fused form on ``dev``: posrf, oprf (its statistics pass), hrf and
    rmf non-causal and causal forward+backward and a decode step; GQA, a key padding mask and
    packed sequences with posrf (host offsets, and ``max_seqlen``). bf16, B2 H4 T200 D64
    M256. ``only``: names containing one of these."""
    B, H, T, D = 2, 4, 200, 64
    # inputs drawn on the device: a host tensor copied in would itself trip the debug mode
    g = torch.Generator(device=dev).manual_seed(0)

    def t(*shape, grad=False):
        x = torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)
        return x.requires_grad_(grad)

    def qkv(b=B, h=H):
        return t(b, h, T, D, grad=True), t(b, h, T, D, grad=True), t(b, h, T, D, grad=True)

    forms = {
        f: rfattn.RandomFeatures(
            D, 256, feature=f, seed=0, weights="rademacher" if f == "rmf" else "orf"
        ).to(dev)
        for f in ("posrf", "oprf", "hrf", "rmf")
    }
    found = []
    for name, rf in forms.items():
        for causal in (False, True):

            def fwd_bwd(rf=rf, causal=causal):
                q, k, v = qkv()
                out = rfattn.rf_attention(q, k, v, rf, causal=causal)
                out.float().sum().backward()
                return out

            found.append((f"{name} {'causal' if causal else 'non-causal'} fwd+bwd", fwd_bwd))

        def decode(rf=rf):
            q, k, v = t(B, H, T, D), t(B, H, T, D), t(B, H, T, D)
            with torch.no_grad():
                _, st = rfattn.rf_attention(q, k, v, rf, causal=True, return_state=True)
                q1, k1, v1 = t(B, H, 1, D), t(B, H, 1, D), t(B, H, 1, D)
                return rfattn.rf_attention(q1, k1, v1, rf, causal=True, initial_state=st)

        found.append((f"{name} decode step", decode))
    rf = forms["posrf"]

    def gqa():
        q = t(B, 8, T, D, grad=True)
        k, v = t(B, 2, T, D, grad=True), t(B, 2, T, D, grad=True)
        out = rfattn.rf_attention(q, k, v, rf, causal=True)
        out.float().sum().backward()

    found.append(("posrf GQA causal fwd+bwd", gqa))

    def padded():
        q, k, v = qkv()
        mask = torch.ones(B, T, dtype=torch.bool, device=dev)
        mask[1, 150:] = False
        out = rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask)
        out.float().sum().backward()

    found.append(("posrf key_padding_mask fwd+bwd", padded))

    cu = torch.tensor([0, 50, 50, 137, T], dtype=torch.int32, device=dev)

    def packed(max_seqlen=None):
        q, k, v = qkv(b=1)
        out = rfattn.rf_attention(q, k, v, rf, causal=True, cu_seqlens=cu, max_seqlen=max_seqlen)
        out.float().sum().backward()

    found.append(("posrf packed causal fwd+bwd", packed))
    # the offsets kept on the device (one padded batch): expected to copy and sync nothing
    found.append(("posrf packed max_seqlen causal fwd+bwd", lambda: packed(87)))
    return [c for c in found if not only or any(s in c[0] for s in only)]


def check_case(fn) -> dict:
    """One case: run once (compiling), then once under the sync debug mode; its row."""
    row = {}
    try:
        fn()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        row["status"] = "ok"
    except Exception as e:  # noqa: BLE001 (each case reports its own failure)
        row["status"] = "failed"
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["trace"] = traceback.format_exc()[-3000:]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sync_check", description=__doc__)
    p.add_argument("--out", help="JSON file of the results")
    p.add_argument("--cases", nargs="+", help="run only cases whose name contains one of these")
    args = p.parse_args(argv)
    rows = []
    for name, fn in cases(torch.device("cuda"), args.cases):
        row = {"case": name, **check_case(fn)}
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
