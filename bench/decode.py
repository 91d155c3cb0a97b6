"""Greedy decoding with rfattn's causal state: the per-token cost is flat in the position.

A tiny decoder-only language model with random weights (no downloads) whose attention layers are
``rfattn.rf_attention(..., causal=True)``. Prefill runs the prompt in one call and keeps each
layer's :class:`rfattn.RFState`; every generated token then costs one call on a single token
with that state fed back: O(M E) per layer and token, whatever the position (softmax attention
with a KV cache grows O(position)).

``python -m bench.decode --steps 1024`` times each generated token and prints the time per token
by position bucket (median ms), and writes ``decode.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import rfattn

__all__ = ["TinyLM", "greedy_decode"]


class TinyLM(nn.Module):
    """Pre-norm decoder: embedding, ``layers`` x (RF causal self-attention + MLP), LM head.

    Args:
        vocab, dim, heads, layers: the usual sizes (head_dim = dim // heads).
        num_features, feature, weights: the random features of every layer (a seed per layer).
        seed: seeds the random weights.
    """

    def __init__(
        self,
        vocab=64,
        dim=64,
        heads=4,
        layers=2,
        num_features=64,
        feature="posrf",
        weights="orf",
        seed=0,
    ):
        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.head_dim = heads, dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * layers))
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
            for _ in range(layers)
        )
        self.rfs = nn.ModuleList(
            rfattn.RandomFeatures(
                self.head_dim, num_features, feature=feature, weights=weights, seed=seed + 1 + i
            )
            for i in range(layers)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, states: list | None = None):
        """Logits ``[B, T, vocab]`` of ``tokens`` ``[B, T]`` continuing from ``states`` (one
        :class:`rfattn.RFState` per layer, or None), and the new states."""
        x = self.embed(tokens)
        B, T, _ = x.shape
        new_states = []
        for i, (qkv, proj, mlp, rf) in enumerate(
            zip(self.qkv, self.proj, self.mlp, self.rfs, strict=True)
        ):
            h = qkv(self.norms[2 * i](x)).view(B, T, 3, self.heads, self.head_dim)
            q, k, v = (h[:, :, j].transpose(1, 2) for j in range(3))  # [B, H, T, hd] views
            out, st = rfattn.rf_attention(
                q,
                k,
                v,
                rf,
                causal=True,
                return_state=True,
                initial_state=None if states is None else states[i],
            )
            x = x + proj(out.transpose(1, 2).reshape(B, T, -1))
            x = x + mlp(self.norms[2 * i + 1](x))
            new_states.append(st)
        return self.head(x), new_states


@torch.no_grad()
def greedy_decode(model: TinyLM, prompt: torch.Tensor, steps: int, timer=None):
    """Prefill ``prompt`` ``[B, T0]`` then generate ``steps`` tokens greedily, one call each.

    Args:
        timer: optional callable ``timer(step, seconds)`` told each token's wall time.

    Returns:
        ``[B, T0 + steps]`` tokens.
    """
    logits, states = model(prompt)
    tokens = [prompt, logits[:, -1:].argmax(-1)]
    for step in range(steps - 1):
        t0 = time.perf_counter()
        logits, states = model(tokens[-1], states)
        nxt = logits[:, -1:].argmax(-1)
        if tokens[-1].is_cuda:
            torch.cuda.synchronize()
        if timer is not None:
            timer(step, time.perf_counter() - t0)
        tokens.append(nxt)
    return torch.cat(tokens, dim=1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="device to decode on")  # fmt: skip
    p.add_argument("--steps", type=int, default=1024, help="tokens to generate")
    p.add_argument("--buckets", type=int, default=8,
                   help="groups of positions, each reported by its median time per token "
                        "(the last steps %% buckets tokens are left out)")  # fmt: skip
    p.add_argument("--num-features", type=int, default=256, help="random features M per head")
    p.add_argument("--out", default="plots/out", help="folder for decode.json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model = TinyLM(num_features=args.num_features).to(device).eval()
    times: list[float] = []
    greedy_decode(
        model,
        torch.zeros(1, 1, dtype=torch.long, device=device),
        args.steps,
        timer=lambda step, s: times.append(s),
    )
    size = max(1, len(times) // args.buckets)
    rows = []
    print(f"# greedy decoding on {device}: ms per token by position (median of each bucket)")
    for b0 in range(0, len(times) - size + 1, size):
        ms = statistics.median(times[b0 : b0 + size]) * 1e3
        rows.append(dict(first=b0 + 1, last=b0 + size, ms_median=ms))
        print(f"  positions {b0 + 1:>6}-{b0 + size:<6} {ms:8.3f} ms")
    ratio = rows[-1]["ms_median"] / rows[0]["ms_median"]
    print(f"# last bucket / first bucket: {ratio:.2f} (flat = 1)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(
        json.dumps(dict(device=str(device), rows=rows, ratio_last_first=ratio), indent=1)
    )
    print(f"# wrote {out / 'decode.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
