"""Train a small random-feature Transformer on generated ListOps (CPU, a few minutes).

ListOps (Nangia & Bowman 2018; the LRA long-sequence task): nested prefix expressions such as
``[MAX 2 9 [MIN 4 7 ] 0 ]`` over digits 0-9 whose value (0-9) is the label. This script
generates them, trains the same encoder with two feature kinds (``posrf`` and ``oprf`` by
default) and an FLT local RPE, and prints the test accuracy of each (chance is about 0.1-0.2).

    python -m bench.listops --features posrf oprf --steps 300 --length 128
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch import nn

import rfattn

OPS = ("MAX", "MIN", "MED", "SM")  # SM = sum modulo 10
VOCAB = [str(d) for d in range(10)] + [f"[{op}" for op in OPS] + ["]", "<pad>", "<cls>"]
TOK = {t: i for i, t in enumerate(VOCAB)}


def _expr(rng: random.Random, depth: int, max_args: int):
    if depth == 0 or rng.random() < 0.3:
        d = rng.randrange(10)
        return [str(d)], d
    op = rng.choice(OPS)
    toks, vals = [f"[{op}"], []
    for _ in range(rng.randint(2, max_args)):
        t, v = _expr(rng, depth - 1, max_args)
        toks += t
        vals.append(v)
    val = {"MAX": max, "MIN": min}.get(op, None)
    if op == "MED":
        value = sorted(vals)[len(vals) // 2]
    elif op == "SM":
        value = sum(vals) % 10
    else:
        value = val(vals)
    return toks + ["]"], value


def make_listops(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` expressions of at most ``length - 1`` tokens: ids ``[n, length]``, labels ``[n]``."""
    rng = random.Random(seed)
    ids, labels = [], []
    while len(ids) < n:
        toks, val = _expr(rng, depth=4, max_args=5)
        if len(toks) >= length or len(toks) < 3:
            continue
        row = [TOK["<cls>"]] + [TOK[t] for t in toks]
        ids.append(row + [TOK["<pad>"]] * (length - len(row)))
        labels.append(val)
    return torch.tensor(ids), torch.tensor(labels)


class Encoder(nn.Module):
    """Pre-norm Transformer encoder with RFAttention layers and one shared FLT local RPE."""

    def __init__(self, feature: str, dim=64, heads=4, layers=2, num_features=64, rpe=True):
        super().__init__()
        self.embed = nn.Embedding(len(VOCAB), dim)
        shared = rfattn.FourierRPE(heads, 16, parameterisation="local", seed=0) if rpe else None
        self.attn = nn.ModuleList(
            rfattn.RFAttention(
                dim,
                heads,
                num_features,
                feature,
                seed=rfattn.layer_seed(0, i),
                rpe=shared,
                feature_redraw_interval=100,
            )  # fmt: skip
            for i in range(layers)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(2 * layers))
        self.ffn = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == TOK["<pad>"]
        x = self.embed(ids)
        for i, (attn, ffn) in enumerate(zip(self.attn, self.ffn, strict=True)):
            x = x + attn(self.norms[2 * i](x), key_padding_mask=pad)
            x = x + ffn(self.norms[2 * i + 1](x))
        return self.head(x[:, 0])


def run(feature: str, args) -> float:
    torch.manual_seed(0)
    xtr, ytr = make_listops(args.train, args.length, seed=1)
    xte, yte = make_listops(args.test, args.length, seed=2)
    model = Encoder(feature, rpe=not args.no_rpe)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    t0 = time.time()
    for step in range(args.steps):
        idx = torch.randint(0, len(xtr), (args.batch,))
        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0:
            print(f"  {feature} step {step:4d} loss {loss.item():.3f} ({time.time() - t0:.0f} s)")
    model.eval()
    with torch.no_grad():
        acc = (model(xte).argmax(-1) == yte).float().mean().item()
    print(f"{feature}: test accuracy {acc:.3f} after {args.steps} steps ({time.time() - t0:.0f} s)")
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--features", nargs="+", default=["posrf", "oprf"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--no-rpe", action="store_true", help="drop the FLT local RPE")
    args = p.parse_args()
    for feature in args.features:
        run(feature, args)


if __name__ == "__main__":
    main()
