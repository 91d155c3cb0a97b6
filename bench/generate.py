"""Generation cost per token against the position: rfattn's RFCache vs sdpa's KV cache.

A Llama-style decoder with random weights (no downloads) generates greedily, one token per
forward, through transformers' own model code: ``attn_implementation="rfattn"`` with
:class:`rfattn.hf.RFCache` (a fixed-size state per layer), the same with the hybrid
(``rfattn-hybrid``: exact sinks and a window inside the features, :data:`HYBRID`; its state
keeps the window and the sinks too), against ``"sdpa"`` with transformers' default
``DynamicCache`` (keys and values of every past token). Every step is timed
(``time.perf_counter`` around the forward; ``torch.cuda.synchronize`` on a GPU); the cache's bytes
are read at powers of two.

    python -m bench.generate                         # 8192 positions, CPU, about 3 minutes
    python -m bench.generate --positions 2048 --out plots/out

Reports, per provider, the median ms per token by position bucket, the last/first bucket ratio
(flat = 1), the cache bytes by position, and the first bucket from which rfattn stays faster than
sdpa. Writes ``generate.json`` and ``generate.png`` under ``--out``.

``--loop`` measures the hand-written loop instead (no ``generate()``, no cache made by the
caller)::

    out = model(ids, use_cache=True)           # transformers makes the cache
    for _ in range(n):
        out = model(tok, cache=out.cache, use_cache=True)   # past_key_values= before 5.24

after a context of ``--contexts`` tokens each (default 128 and 2048): per provider and context,
the median ms per decoded token and the cache bytes after the context and after decoding, and
the per-token ratio of the longest context to the shortest (flat = 1). Writes
``generate_loop.json``.

    python -m bench.generate --loop                  # about 1 minute on the CPU
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from bench.env import environment, write_json

__all__ = ["build", "compiled_decode", "decode_times", "loop_times", "main"]

PROVIDERS = ("rfattn", "rfattn-hybrid", "sdpa")
#: the hybrid provider's exact part: sinks and window
HYBRID = dict(window=64, sinks=4)


def build(impl: str, kv_heads: int, device, num_features: int, positions: int, seed: int = 0):
    """The random-weight decoder (hidden 256, 4 heads of 64, 2 layers) on ``impl``."""
    import transformers

    import rfattn.hf

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=kv_heads,
                                   max_position_embeddings=positions + 64)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    if impl.startswith("rfattn"):
        kw = HYBRID if impl == "rfattn-hybrid" else {}
        rfattn.hf.attach_random_features(model, num_features=num_features, seed=seed, **kw)
        impl = "rfattn"
    model.set_attn_implementation(impl)
    return model.to(device)


def _cache(impl: str, config):
    import transformers

    import rfattn.hf

    if impl.startswith("rfattn"):
        return rfattn.hf.RFCache()
    return transformers.DynamicCache(config=config)


@torch.no_grad()
def decode_times(model, impl: str, positions: int, prompt: int = 16):
    """Seconds per generated token for positions ``prompt + 1 .. positions`` and the cache bytes
    at each power of two."""
    import rfattn.hf

    device = next(model.parameters()).device
    cache = _cache(impl, model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)  # fmt: skip
    logits = model(ids, **{rfattn.hf.CACHE_KWARG: cache}, use_cache=True).logits
    tok = logits[:, -1:].argmax(-1)
    times, sizes = [], {}
    for pos in range(prompt + 1, positions + 1):
        _, tok, seconds = _timed_step(model, tok, cache, device)
        times.append(seconds)
        if pos & (pos - 1) == 0:
            sizes[pos] = rfattn.hf.cache_nbytes(cache)
    return times, sizes


def _timed_step(model, tok, cache, device):
    """``(output, next greedy token, seconds)`` of one cached forward of ``tok``."""
    import rfattn.hf

    t0 = time.perf_counter()
    out = model(tok, **{rfattn.hf.CACHE_KWARG: cache}, use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, tok, time.perf_counter() - t0


@torch.no_grad()
def compiled_decode(model, steps: int = 16, prompt: int = 16, **compile_kw) -> dict:
    """One cached decoding step (the hand-written loop's forward on an ``RFCache``) run eagerly
    and through ``torch.compile(step, fullgraph=True, **compile_kw)`` (``mode="reduce-overhead"``:
    CUDA graphs on a GPU), ``steps`` greedy tokens each after the same prompt: the largest
    relative error of the compiled logits, whether the tokens agree, how many steps kept the
    state tensors' addresses, and inductor's count of CUDA-graph skips (0: every compiled step
    replayed a graph)."""
    from torch._dynamo.utils import counters

    import rfattn.hf

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, prompt),
                        generator=torch.Generator().manual_seed(0)).to(device)  # fmt: skip

    def step(tok, cache):
        return model(tok, use_cache=True, **{rfattn.hf.CACHE_KWARG: cache}).logits

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, **compile_kw)
    runs = []
    for run in (step, compiled):
        cache = rfattn.hf.RFCache()
        logits = [step(ids, cache)[:, -1]]
        where = [[x.data_ptr() for x in layer.state] for layer in cache.layers]
        kept = 0
        for _ in range(steps):
            logits.append(run(logits[-1].argmax(-1, keepdim=True), cache)[:, -1].clone())
            kept += where == [[x.data_ptr() for x in layer.state] for layer in cache.layers]
        runs.append((torch.stack(logits[1:], 1).float(), kept))
    (eager, _), (got, kept) = runs
    err = ((got - eager).norm() / eager.norm()).item()
    return dict(steps=steps, rel_error=err, tokens_equal=bool(torch.equal(got.argmax(-1),
                eager.argmax(-1))), steps_at_fixed_addresses=kept,
                cudagraph_skips=int(counters["inductor"]["cudagraph_skips"]))  # fmt: skip


@torch.no_grad()
def loop_times(model, context: int, steps: int, seed: int = 0):
    """``(seconds per token, bytes after the context, bytes after decoding)`` of the hand-written
    loop: ``model(ids, use_cache=True)`` on ``context`` tokens, then ``steps`` greedy tokens, each
    one forward on the cache the previous forward returned (the caller never builds one)."""
    import rfattn.hf

    device = next(model.parameters()).device
    ids = torch.randint(0, model.config.vocab_size, (1, context),
                        generator=torch.Generator().manual_seed(seed)).to(device)  # fmt: skip
    out = model(ids, use_cache=True)
    cache = getattr(out, rfattn.hf.CACHE_KWARG)
    before = rfattn.hf.cache_nbytes(cache)
    tok = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps):
        out, tok, seconds = _timed_step(model, tok, cache, device)
        times.append(seconds)
        cache = getattr(out, rfattn.hf.CACHE_KWARG)
    return times, before, rfattn.hf.cache_nbytes(cache)


def _loop_main(args, device, doc: dict, out: Path) -> int:
    doc["title"] = doc["title"].replace("greedy generation", "hand-written decoding loop")
    doc.update(contexts=args.contexts, steps=args.steps, loadavg_before=os.getloadavg())
    for impl in PROVIDERS:
        positions = max(args.contexts) + args.steps
        model = build(impl, args.kv_heads, device, args.num_features, positions)
        loop_times(model, min(args.contexts), 4)  # warm-up
        rows = {}
        for context in args.contexts:
            times, before, after = loop_times(model, context, args.steps)
            rows[str(context)] = dict(ms_median=statistics.median(times) * 1e3,
                                      ms_p10=sorted(times)[len(times) // 10] * 1e3,
                                      cache_bytes_after_context=before,
                                      cache_bytes_after_decoding=after)  # fmt: skip
        lo, hi = rows[str(min(args.contexts))], rows[str(max(args.contexts))]
        ratio = hi["ms_median"] / lo["ms_median"]
        doc["results"][impl] = dict(contexts=rows, ratio_longest_shortest=ratio)
        print(f"# {impl}: context -> ms per token (median, p10), cache bytes after the context / "
              f"after {args.steps} tokens; longest/shortest {ratio:.2f}")
        for context, r in rows.items():
            print(f"  {context:>6} {r['ms_median']:8.3f} {r['ms_p10']:8.3f}"
                  f"  {r['cache_bytes_after_context']:>10} {r['cache_bytes_after_decoding']:>10}")
    doc["loadavg_after"] = os.getloadavg()
    write_json(doc, "generate_loop", out)
    return 0


def _buckets(times: list[float], first: int, n: int) -> list[dict]:
    size = max(1, len(times) // n)
    rows = []
    for b0 in range(0, len(times) - size + 1, size):
        chunk = times[b0 : b0 + size]
        rows.append(dict(first=first + b0, last=first + b0 + size - 1,
                         ms_median=statistics.median(chunk) * 1e3))  # fmt: skip
    return rows


def _plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10.4, 3.9))
    for name, res in doc["results"].items():
        rows = res["buckets"]
        a.plot([(r["first"] + r["last"]) / 2 for r in rows], [r["ms_median"] for r in rows],
               marker="o", label=name)  # fmt: skip
        pos = sorted(int(p) for p in res["cache_bytes"])
        b.plot(pos, [res["cache_bytes"][str(p)] / 2**20 for p in pos], marker="o", label=name)
    a.set(xlabel="position", ylabel="ms per token (median of bucket)", title="time per token")
    b.set(xscale="log", yscale="log", xlabel="position", ylabel="MiB", title="cache size")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(doc["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--positions", type=int, default=8192)
    p.add_argument("--buckets", type=int, default=16)
    p.add_argument("--num-features", type=int, default=256)
    p.add_argument("--kv-heads", type=int, default=4, help="4 = MHA, 2 or 1 = grouped")
    p.add_argument("--out", default="plots/out")
    p.add_argument("--loop", action="store_true",
                   help="time the hand-written loop (model(ids, use_cache=True), then out.cache)")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 2048],
                   help="--loop: context lengths before decoding")
    p.add_argument("--steps", type=int, default=64, help="--loop: tokens decoded per context")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    prompt = 16
    doc = dict(
        title=(f"greedy generation, Llama-style random weights (hidden 256, 4 heads x 64, "
               f"{args.kv_heads} kv heads, 2 layers), M={args.num_features}, fp32, {device}"),
        device=str(device), machine=platform.machine(), threads=torch.get_num_threads(),
        torch=torch.__version__, kv_heads=args.kv_heads, env=environment(device), results={},
    )  # fmt: skip
    if args.loop:
        return _loop_main(args, device, doc, Path(args.out))
    for impl in PROVIDERS:
        model = build(impl, args.kv_heads, device, args.num_features, args.positions)
        times, sizes = decode_times(model, impl, args.positions, prompt)
        rows = _buckets(times, prompt + 1, args.buckets)
        ratio = rows[-1]["ms_median"] / rows[0]["ms_median"]
        doc["results"][impl] = dict(buckets=rows, ratio_last_first=ratio,
                                    cache_bytes={str(k): v for k, v in sizes.items()})  # fmt: skip
        print(f"# {impl}: ms per token by position (median of bucket); last/first {ratio:.2f}")
        for r in rows:
            print(f"  {r['first']:>6}-{r['last']:<6} {r['ms_median']:8.3f}")
        print("  cache bytes:", ", ".join(f"{k}: {v}" for k, v in sizes.items()))
    rf, sd = (doc["results"][n]["buckets"] for n in ("rfattn", "sdpa"))
    faster = [a["ms_median"] < b["ms_median"] for a, b in zip(rf, sd, strict=True)]
    # the first bucket from which rfattn stays faster (None: never)
    start = next((i for i in range(len(faster)) if all(faster[i:])), None)
    doc["rfattn_faster_from"] = None if start is None else rf[start]["first"]
    if start is None:
        print("# rfattn not faster per token than sdpa from any position measured on")
    else:
        print(f"# rfattn faster per token than sdpa from position {doc['rfattn_faster_from']} on")
    path = write_json(doc, "generate", args.out)
    _plot(doc, path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
