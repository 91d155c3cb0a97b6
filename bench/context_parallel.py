"""Context parallelism: bytes each rank communicates per layer, against ring attention, and the
time of one sharded call for 1, 2 and 4 gloo processes on CPU; a worked training example.

    python -m bench.context_parallel                     # T = 4096, about 3 minutes on 2 cores
    python -m bench.context_parallel --train             # the worked example (2 processes)
    python -m bench.context_parallel --check             # the ranks' agreement check's cost

Bytes: the collectives of one ``rf_attention(..., group=g)`` call are counted as they run (the
payload each rank hands to each collective), then turned into bytes sent per rank by the usual
ring algorithms: an all-gather of an x-byte payload sends ``(P - 1) x``, an all-reduce of y
bytes ``2 (P - 1) / P y``. Ring attention (each rank passes its K and V block around the ring,
P - 1 steps; the backward passes K, V and their gradients) is given by its formula for the same
shape: ``(P - 1) B H (T / P) (D + E) s`` forward and twice that in the backward, s the element
size. Times: the median of 5 calls after a warm-up, every rank timed between barriers, the
slowest rank reported; with 4 processes on a 2-core machine the ranks share cores, so the times
measure overhead and correctness of the scheme, not a speed-up.

``--train``: a one-layer causal RFAttention model with a linear read-out learns to predict the
next vector of a noisy linear recurrence, the sequence split over 2 processes; parameter
gradients are summed over the ranks (all_reduce, as data parallelism does). It checks the first
step's gradients against one process on the whole sequence and prints the loss curve.

``--check``: what the check that the ranks' calls agree (``rfattn.distributed.check_calls_agree``,
one all-gather of 14 int64 per rank before the call's other collectives) costs per call, 2 gloo
processes, one thread each, at a small and a medium shape, causal and not, forward only (the
backward has no check, so this is its largest share): the call as it runs, the same call with
the check replaced by the local validation it wraps, the check alone and nothing, timed side by
side in rounds (``bench.timing.time_cpu_rounds`` on every rank, each entry a barrier and then
its work, so the "nothing" entry times the barrier, taken off the others); rank 0's times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B, H, D, E, M = 1, 8, 64, 64, 256


class _Counter:
    """Wraps dist.all_gather / all_reduce to add up the payload bytes each rank hands over."""

    def __init__(self):
        self.gather = self.reduce = 0
        self._ag, self._ar = dist.all_gather, dist.all_reduce

    def __enter__(self):
        def all_gather(tensors, tensor, *a, **kw):
            self.gather += tensor.numel() * tensor.element_size()
            return self._ag(tensors, tensor, *a, **kw)

        def all_reduce(tensor, *a, **kw):
            self.reduce += tensor.numel() * tensor.element_size()
            return self._ar(tensor, *a, **kw)

        dist.all_gather, dist.all_reduce = all_gather, all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_gather, dist.all_reduce = self._ag, self._ar


def _shard(T: int, world: int, rank: int) -> slice:
    per = -(-T // world)
    return slice(min(T, rank * per), min(T, (rank + 1) * per))


def _bench_worker(rank, world, init_file, spec, out_file):
    import rfattn

    torch.set_num_threads(max(1, spec["threads"] // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))  # fmt: skip
    try:
        T, causal = spec["T"], spec["causal"]
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(B, H, T, d, generator=g) for d in (D, D, E)]
        sl = _shard(T, world, rank)
        q, k, v = (x[:, :, sl].contiguous().requires_grad_() for x in full)
        rf = rfattn.RandomFeatures(D, M, "posrf", seed=0)
        group = dist.group.WORLD if world > 1 else None
        rows = {}
        for mode in ("fwd", "fwd+bwd"):
            backward = mode == "fwd+bwd"

            def call(backward=backward):
                with torch.set_grad_enabled(backward):
                    out = rfattn.rf_attention(q, k, v, rf, causal=causal, group=group)
                    if backward:
                        out.sum().backward()

            call()  # warm-up
            with _Counter() as count:
                call()
            times = []
            for _ in range(5):
                if group is not None:
                    dist.barrier()
                t0 = time.perf_counter()
                call()
                if group is not None:
                    dist.barrier()
                times.append(time.perf_counter() - t0)
            rows[mode] = dict(ms=1e3 * statistics.median(times), gather_payload=count.gather,
                              reduce_payload=count.reduce)  # fmt: skip
        if rank == 0:
            Path(out_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _sent_per_rank(row: dict, world: int) -> int:
    """Bytes one rank sends under ring all-gather / all-reduce for the counted payloads."""
    if world == 1:
        return 0
    gather, reduce = row["gather_payload"], row["reduce_payload"]
    return int((world - 1) * gather + 2 * (world - 1) / world * reduce)


def _ring_attention_bytes(T: int, world: int, mode: str, itemsize: int = 4) -> int:
    if world == 1:
        return 0
    fwd = (world - 1) * B * H * (T // world) * (D + E) * itemsize
    return fwd if mode == "fwd" else 3 * fwd  # backward: K, V again and their gradients


def bench(args) -> dict:
    doc = dict(
        title=(f"context parallelism, rf_attention posrf M={M}, B={B} H={H} D=E={D}, "
               f"T={args.T}, fp32, gloo on {platform.machine()} CPU"),
        machine=platform.machine(), cpus=os.cpu_count(), threads=args.threads,
        torch=torch.__version__, results=[],
        method=("payload bytes counted per collective call, sent bytes by ring algorithms; "
                "time: median of 5 between barriers, slowest rank (rank 0 waits on the "
                "barrier), threads split over the processes"),
    )  # fmt: skip
    print(f"# {doc['title']}")
    print(f"{'causal':7} {'P':>2} {'mode':8} {'ms':>9} {'rfattn KiB/rank':>16} "
          f"{'ring attn KiB/rank':>19}")  # fmt: skip
    for causal in (True, False):
        for world in (1, 2, 4):
            spec = dict(T=args.T, causal=causal, threads=args.threads)
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "rows.json")
                mp.spawn(_bench_worker, args=(world, os.path.join(tmp, "init"), spec, out),
                         nprocs=world, join=True)  # fmt: skip
                rows = json.loads(Path(out).read_text())
            for mode, row in rows.items():
                row = dict(row, causal=causal, world=world, mode=mode,
                           rfattn_bytes_per_rank=_sent_per_rank(row, world),
                           ring_attention_bytes_per_rank=_ring_attention_bytes(args.T, world,
                                                                               mode))  # fmt: skip
                doc["results"].append(row)
                print(f"{causal!s:7} {world:>2} {mode:8} {row['ms']:9.1f} "
                      f"{row['rfattn_bytes_per_rank'] / 1024:16.1f} "
                      f"{row['ring_attention_bytes_per_rank'] / 1024:19.1f}")  # fmt: skip
    return doc


# ------------------------------------------------------------------------------------------------
# the cost of the agreement check

CHECK_SHAPES = {
    "small": dict(B=1, H=2, T=128, D=16, E=16, M=16, rounds=300),
    "medium": dict(B=1, H=8, T=2048, D=64, E=64, M=128, rounds=100),
}  # T: the whole sequence, half on each rank; rounds: the same on every rank (collectives)


def _check_worker(rank, world, init_file, spec, out_file):
    import rfattn
    from bench.timing import summary, time_cpu_rounds
    from rfattn import distributed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))  # fmt: skip
    try:
        s, group, checked = spec, dist.group.WORLD, distributed.check_calls_agree
        g = torch.Generator().manual_seed(0)
        sl = _shard(s["T"], world, rank)
        q, k, v = (torch.randn(s["B"], s["H"], s["T"], d, generator=g)[:, :, sl].contiguous()
                   for d in (s["D"], s["D"], s["E"]))  # fmt: skip
        rf = rfattn.RandomFeatures(s["D"], s["M"], "posrf", seed=0)

        def unchecked(group, validate, *args):  # the local validation it wraps, no gather
            validate()

        def call(check):
            distributed.check_calls_agree = check
            try:
                with torch.no_grad():
                    rfattn.rf_attention(q, k, v, rf, causal=s["causal"], backend="torch",
                                        group=group)  # fmt: skip
            finally:
                distributed.check_calls_agree = checked

        def check_alone():
            checked(group, lambda: None, q, k, v, rf, s["causal"], "torch", None)

        fns = {"call": lambda: call(checked), "call_unchecked": lambda: call(unchecked),
               "check": check_alone, "barrier": lambda: None}  # fmt: skip
        for fn in fns.values():  # warm-up
            fn()

        def synced(fn):  # every rank starts a round together
            def run():
                dist.barrier()
                fn()

            return run

        dist.barrier()
        times = time_cpu_rounds({n: synced(f) for n, f in fns.items()}, min_rounds=s["rounds"],
                                max_rounds=s["rounds"], budget_s=0.0)  # fmt: skip
        if rank == 0:
            Path(out_file).write_text(json.dumps(
                {n: dict(zip(("p50", "p20", "p80", "n"), summary(t), strict=True))
                 for n, t in times.items()}))  # fmt: skip
    finally:
        dist.destroy_process_group()


def check_cost() -> dict:
    from bench.env import environment

    doc = dict(
        title="cost of the ranks' agreement check per sharded call: rf_attention posrf fp32 "
              "forward, 2 gloo processes on CPU, 1 thread each",
        env=environment(torch.device("cpu")), shapes=CHECK_SHAPES, results=[],
        loadavg_before=os.getloadavg(),
        method=("rounds of (call, call with the check replaced by the validation it wraps, "
                "check alone, nothing), order alternating, a barrier before each, timed with "
                "it; times in ms on rank 0, medians and 20/80% quantiles; *_net: the median "
                "less the barrier's (the 'nothing' entry)"),
    )  # fmt: skip
    print(f"# {doc['title']}")
    print(f"{'shape':7} {'causal':7} {'call ms':>8} {'unchecked ms':>13} {'check us':>9} "
          f"{'check/call':>11}")  # fmt: skip
    for name, shape in CHECK_SHAPES.items():
        for causal in (True, False):
            spec = dict(shape, causal=causal)
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "rows.json")
                mp.spawn(_check_worker, args=(2, os.path.join(tmp, "init"), spec, out),
                         nprocs=2, join=True)  # fmt: skip
                rows = json.loads(Path(out).read_text())
            base = rows["barrier"]["p50"]
            call, bare, check = (rows[n]["p50"] - base for n in ("call", "call_unchecked",
                                                                  "check"))  # fmt: skip
            row = dict(shape=name, causal=causal, **{f"{n}_ms": r for n, r in rows.items()},
                       call_ms_net=call, call_unchecked_ms_net=bare, check_us_net=1e3 * check,
                       check_share_of_call=check / call,
                       call_minus_unchecked_us=1e3 * (call - bare))  # fmt: skip
            doc["results"].append(row)
            print(f"{name:7} {causal!s:7} {call:8.3f} {bare:13.3f} {1e3 * check:9.1f} "
                  f"{100 * check / call:10.1f}%")  # fmt: skip
    doc["loadavg_after"] = os.getloadavg()  # a shared host: other work inflates every time
    return doc


# ------------------------------------------------------------------------------------------------
# the worked example


def _data(T: int, seed: int = 0):
    """x_t = A x_{t-1} + noise, 16-dimensional; the target of step t is x_{t+1}."""
    g = torch.Generator().manual_seed(seed)
    A = torch.linalg.qr(torch.randn(16, 16, generator=g))[0] * 0.95
    xs = [torch.randn(2, 16, generator=g)]
    for _ in range(T):
        xs.append(xs[-1] @ A.T + 0.1 * torch.randn(2, 16, generator=g))
    x = torch.stack(xs, dim=1)  # [2, T + 1, 16]
    return x[:, :-1], x[:, 1:]


def _model():
    import rfattn

    torch.manual_seed(0)
    return torch.nn.ModuleDict(dict(
        attn=rfattn.RFAttention(16, 2, num_features=32, causal=True, seed=0),
        out=torch.nn.Linear(16, 16),
    ))  # fmt: skip


def _step(model, x, y, total_tokens):
    pred = model["out"](model["attn"](x) + x)
    loss = ((pred - y) ** 2).sum() / (total_tokens * 16)  # this shard's share of the mean
    loss.backward()
    return loss.detach()


def _train_worker(rank, world, init_file, steps, out_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=600))  # fmt: skip
    try:
        T = 256
        x, y = _data(T)
        sl = _shard(T, world, rank)
        model = _model()
        model["attn"].group = dist.group.WORLD
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, first_grads = [], None
        for step in range(steps):
            opt.zero_grad()
            loss = _step(model, x[:, sl], y[:, sl], x.shape[0] * T)
            for p in model.parameters():  # replicated parameters: sum the shards' gradients
                dist.all_reduce(p.grad)
            dist.all_reduce(loss)
            if step == 0:
                first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            losses.append(float(loss))
            opt.step()
        if rank == 0:
            torch.save(dict(losses=losses, first_grads=first_grads), out_file)
    finally:
        dist.destroy_process_group()


def train(steps: int = 60) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "train.pt")
        mp.spawn(_train_worker, args=(2, os.path.join(tmp, "init"), steps, out), nprocs=2,
                 join=True)  # fmt: skip
        res = torch.load(out)
    x, y = _data(256)
    model = _model()
    _step(model, x, y, x.shape[0] * 256)
    err = max(((res["first_grads"][n] - p.grad).abs().max() / p.grad.abs().max()).item()
              for n, p in model.named_parameters())  # fmt: skip
    print(f"# first-step gradients, 2 processes vs one: max relative difference {err:.1e}")
    for i in range(0, steps, 10):
        print(f"  step {i:3d}  loss {res['losses'][i]:.4f}")
    print(f"  step {steps - 1:3d}  loss {res['losses'][-1]:.4f}")
    return dict(steps=steps, losses=res["losses"], first_step_grad_rel_diff=err)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.context_parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--train", action="store_true", help="run the worked example instead")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--check", action="store_true",
                   help="measure the ranks' agreement check instead")  # fmt: skip
    p.add_argument("--out", default="plots/out")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.train:
        doc = train(args.steps)
        (out / "context_parallel_train.json").write_text(json.dumps(doc, indent=1))
        print(f"# wrote {out / 'context_parallel_train.json'}")
        return 0
    if args.check:
        doc = check_cost()
        (out / "context_parallel_check.json").write_text(json.dumps(doc, indent=1))
        print(f"# wrote {out / 'context_parallel_check.json'}")
        return 0
    doc = bench(args)
    (out / "context_parallel.json").write_text(json.dumps(doc, indent=1))
    print(f"# wrote {out / 'context_parallel.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
