"""Packed variable-length sequences against the same documents padded to the longest (issue 39).

The same documents two ways, timed side by side in one run:

* ``packed``: one row ``q, k, v: [1, H, total, D]`` with ``cu_seqlens`` (offsets);
* ``padded``: ``[N, H, max_len, D]``, right-padded, with ``key_padding_mask`` (True = padding).

Four seeded length mixes: ``longtail`` (lognormal lengths, median ``--median``, clipped to
``[1, --max-len]``, drawn until the total reaches ``--total``; the last one cut to fit),
``onelong`` (one ``--max-len`` document and seven of ``--short``: the issue's example),
``uniform`` (``--uniform-n`` documents within 10 % of ``--total / --uniform-n``: padding wastes
little) and ``manyshort`` (the same with ``--many-n`` documents: little padding, and many
sequences, which the packed path runs as a few batches of similar length,
``rfattn.attention.buckets``). Each mix runs causal and non-causal,
forward and forward+backward (``torch.autograd.grad`` of the outputs weighted on the valid
positions), posrf features, fp32, the default backend (the torch path on the CPU, the fused
kernels on CUDA).

Before anything is timed, each mix and causality checks that packed and padded agree on the
valid positions, outputs and the gradients of q, k and v (relative RMS within the fp32
tolerance of ``rfattn.testing``), so a wrong computation is never timed; on the CPU those calls
are the warm-up, on CUDA each case is also called once first (compilation, autotuning). Then each
case is timed in rounds of one packed and one padded call, the order alternating
(``bench.timing.time_cpu_rounds``; on CUDA each call synchronises), so noise on a shared host
hits both. Reported: the median and 10 % quantile of each way's times and the median
(20 / 80 % quantiles) of the per-round ratio padded / packed (> 1: packing pays).

    python -m bench.packed                          # 16384 tokens, CPU, 4 to 10 minutes
    python -m bench.packed --total 4096 --max-len 2048 --heads 2 --out plots/out
    python -m bench.packed --device cuda            # the fused kernels on a GPU
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import torch

__all__ = ["mixes", "Case", "main"]

MIXES = ("longtail", "onelong", "uniform", "manyshort")
MODES = ("fwd", "fwd+bwd")


def mixes(total: int, max_len: int, median: float, sigma: float, short: int, uniform_n: int,
          many_n: int, seed: int = 0) -> dict[str, list[int]]:  # fmt: skip
    """Each mix's document lengths (seeded)."""
    g = torch.Generator().manual_seed(seed)
    tail: list[int] = []
    while sum(tail) < total:
        x = math.exp(math.log(median) + sigma * float(torch.randn((), generator=g)))
        tail.append(min(max(1, round(x)), max_len, total - sum(tail)))

    def near_uniform(n: int) -> list[int]:
        return [max(1, round(total / n * (0.9 + 0.2 * float(torch.rand((), generator=g)))))
                for _ in range(n)]  # fmt: skip

    return dict(longtail=tail, onelong=[max_len] + [short] * 7, uniform=near_uniform(uniform_n),
                manyshort=near_uniform(many_n))  # fmt: skip


class Case:
    """One mix's data both ways: the packed row and the padded batch (same values), the
    output weights that are zero on padding, and the calls."""

    def __init__(self, lengths: list[int], heads: int, dim: int, rf, device, seed: int = 0):
        self.lengths, self.rf = lengths, rf
        N, L, total = len(lengths), max(lengths), sum(lengths)
        g = torch.Generator().manual_seed(seed)
        cu = torch.tensor([0, *lengths]).cumsum(0)
        self.cu = cu.to(torch.int32)
        # (row, position) of each packed token in the padded batch
        self.row = torch.repeat_interleave(torch.arange(N), torch.tensor(lengths))
        self.pos = torch.arange(total) - cu[:-1][self.row]
        self.mask = torch.ones(N, L, dtype=torch.bool)
        self.mask[self.row, self.pos] = False
        packed = [torch.randn(1, heads, total, dim, generator=g) for _ in range(4)]  # q k v w
        self.packed = [x.to(device) for x in packed]
        self.padded = [self.pad(x) for x in self.packed]
        self.mask = self.mask.to(device)
        self.padding_fraction = 1 - total / (N * L)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, H, total, .]`` -> ``[N, H, L, .]``, zero on padding."""
        N, L = self.mask.shape
        out = x.new_zeros(N, L, x.shape[1], x.shape[3])
        out[self.row.to(x.device), self.pos.to(x.device)] = x[0].transpose(0, 1)
        return out.transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, H, L, .]`` -> ``[1, H, total, .]``: the valid positions."""
        return x.transpose(1, 2)[self.row.to(x.device), self.pos.to(x.device)].transpose(0, 1)[None]

    def call(self, way: str, causal: bool, backward: bool):
        """The measured call: outputs, and with ``backward`` the gradients of q, k, v."""
        import rfattn

        q, k, v, w = self.packed if way == "packed" else self.padded
        kw = dict(cu_seqlens=self.cu) if way == "packed" else dict(key_padding_mask=self.mask)
        leaves = [x.detach().requires_grad_(backward) for x in (q, k, v)]

        def run():
            with torch.set_grad_enabled(backward):
                out = rfattn.rf_attention(*leaves, self.rf, causal=causal, **kw)
                if not backward:
                    return out, ()
                return out, torch.autograd.grad((out * w).sum(), leaves)

        return run

    def check(self, causal: bool) -> dict:
        """Packed and padded agree on the valid positions (outputs, q/k/v gradients); the
        relative RMS errors between the two."""
        from rfattn.testing import assert_rel_rms, rel_rms, tolerance

        pout, pgrads = self.call("packed", causal, True)()
        dout, dgrads = self.call("padded", causal, True)()
        errs = {"out": rel_rms(self.unpad(dout), pout)}
        assert_rel_rms(self.unpad(dout), pout, tolerance(torch.float32, "out"), "padded output")
        for name, a, b in zip("qkv", dgrads, pgrads, strict=True):
            errs[f"d{name}"] = rel_rms(self.unpad(a), b)
            assert_rel_rms(self.unpad(a), b, tolerance(torch.float32, "grad"), f"padded d{name}")
        return errs


def _synced(fn, device):
    if device.type != "cuda":
        return fn

    def run():
        fn()
        torch.cuda.synchronize()

    return run


def measure(case: Case, causal: bool, backward: bool, device, rounds: int, budget_s: float):
    """Times of the two ways, side by side: each way's p50 / p10 and the padded / packed ratio.
    On the CPU :meth:`Case.check`, just before, was the warm-up."""
    from bench.timing import paired_ratio, quantile, time_cpu_rounds

    fns = {w: _synced(case.call(w, causal, backward), device) for w in ("packed", "padded")}
    if device.type == "cuda":  # compilation and autotuning of this case's kernels
        for fn in fns.values():
            fn()
    t = time_cpu_rounds(fns, min_rounds=rounds, max_rounds=max(rounds, 50), budget_s=budget_s)
    row = {f"{w}_ms_{n}": quantile(t[w], q) for w in fns for n, q in (("p50", 0.5), ("p10", 0.1))}
    r50, r20, r80 = paired_ratio(t["padded"], t["packed"])
    return dict(row, ratio_p50=r50, ratio_p20=r20, ratio_p80=r80, rounds=len(t["packed"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.packed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--total", type=int, default=16384, help="tokens of the longtail mix")
    p.add_argument("--max-len", type=int, default=8192, help="clip; onelong's long document")
    p.add_argument("--median", type=float, default=300.0, help="longtail's median length")
    p.add_argument("--sigma", type=float, default=1.2, help="longtail's lognormal sigma")
    p.add_argument("--short", type=int, default=500, help="onelong's seven short documents")
    p.add_argument("--uniform-n", type=int, default=8, help="uniform's document count")
    p.add_argument("--many-n", type=int, default=256, help="manyshort's document count")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64, help="D = E")
    p.add_argument("--num-features", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3, help="the fewest rounds per case")
    p.add_argument("--budget-s", type=float, default=2.0, help="more rounds up to this, per case")
    p.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="plots/out")
    args = p.parse_args(argv)

    import rfattn
    from bench.env import environment, write_json

    device = torch.device(args.device)
    rf = rfattn.RandomFeatures(args.dim, args.num_features, "posrf", seed=args.seed).to(device)
    lengths = mixes(args.total, args.max_len, args.median, args.sigma, args.short,
                    args.uniform_n, args.many_n, args.seed)  # fmt: skip
    doc = dict(
        title=(f"packed (cu_seqlens) vs padded (key_padding_mask) rf_attention, H={args.heads}, "
               f"D=E={args.dim}, M={args.num_features} posrf, fp32, {device}"),
        device=str(device), machine=platform.machine(), threads=torch.get_num_threads(),
        torch=torch.__version__, env=environment(device), loadavg_before=os.getloadavg(),
        config={k: v for k, v in vars(args).items() if k != "out"},
        method=("outputs and q/k/v gradients of packed and padded checked equal on the valid "
                "positions first (on the CPU, the warm-up; on CUDA one more call each); then "
                "rounds of one packed and one padded call, order alternating "
                "(bench.timing.time_cpu_rounds; on CUDA each call synchronises), at least "
                "`rounds`, more up to `budget_s` s per case; "
                "ms: median (p50) and 10 % quantile (p10); ratio: padded / packed per round, "
                "median and 20 / 80 % quantiles"),
        mixes={}, results=[],
    )  # fmt: skip
    started = time.time()
    print(f"# {doc['title']}")
    print(f"{'mix':8} {'N':>4} {'total':>6} {'max':>5} {'pad%':>5} {'causal':6} {'mode':7} "
          f"{'packed ms':>10} {'padded ms':>10} {'padded/packed':>14}")  # fmt: skip
    for name in args.mixes:
        case = Case(lengths[name], args.heads, args.dim, rf, device, args.seed)
        facts = dict(N=len(case.lengths), total=sum(case.lengths), max_len=max(case.lengths),
                     padding_fraction=case.padding_fraction, lengths=case.lengths)  # fmt: skip
        doc["mixes"][name] = facts
        for causal in (False, True):
            check = case.check(causal)
            for mode in MODES:
                row = dict(mix=name, causal=causal, mode=mode, check_rel_rms=check,
                           **measure(case, causal, mode == "fwd+bwd", device, args.rounds,
                                     args.budget_s))  # fmt: skip
                doc["results"].append(row)
                print(f"{name:8} {facts['N']:>4} {facts['total']:>6} {facts['max_len']:>5} "
                      f"{100 * facts['padding_fraction']:5.1f} {causal!s:6} {mode:7} "
                      f"{row['packed_ms_p50']:10.1f} {row['padded_ms_p50']:10.1f} "
                      f"{row['ratio_p50']:13.2f}x", flush=True)  # fmt: skip
    doc["checked_equal"] = True  # every case.check above passed
    doc["loadavg_after"] = os.getloadavg()  # a shared host: other work inflates every time
    doc["seconds"] = round(time.time() - started, 1)
    write_json(doc, "packed", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
