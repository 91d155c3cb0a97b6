"""The README's Python examples run as written (a user copies them first).

Each ```python block of README.md is either run here, with the few names its surrounding prose
leaves to the reader defined beforehand (``PRELUDES``), or listed in ``SKETCHES`` with the
reason it cannot run alone; a new block that is neither fails :func:`test_every_block_is_run`.
After a block runs, the claims it states in its comments are checked on what it computed.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import rfattn

README = Path(__file__).resolve().parents[1] / "README.md"

#: blocks that are outlines, not programs, by a line they contain -> why
SKETCHES = {
    "logits, states = model(prompt)": "outline of bench/decode.py's loop (its model and prompt)",
}


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)


def _block(line: str) -> str:
    """The one README block containing ``line``."""
    found = [b for b in _blocks() if line in b]
    assert len(found) == 1, f"{len(found)} README blocks contain {line!r}"
    return found[0]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def _run(line: str, **names) -> dict:
    """Run the block containing ``line`` with ``names`` defined, and torch and rfattn (the
    first block's imports, which the later ones take as read); its namespace afterwards."""
    ns = dict(torch=torch, rfattn=rfattn, **names)
    exec(compile(_block(line), f"README.md block <{line}>", "exec"), ns)  # noqa: S102
    return ns


#: the line each run block is found by (test below)
RUN = (
    "out = rfattn.rf_attention(q, k, v, rf)",
    "mha = rfattn.RFMultiheadAttention(",
    "rpe = rfattn.FourierRPE(8, 32",
    "model = transformers.LlamaForCausalLM(config)",
    "report = rfattn.calibrate(model, batches",
)


def test_every_block_is_run():
    for block in _blocks():
        run = [line for line in RUN if line in block]
        sketch = [line for line in SKETCHES if line in block]
        assert len(run) + len(sketch) == 1, f"README block neither run nor a sketch:\n{block}"


def test_use_it():
    ns = _run("out = rfattn.rf_attention(q, k, v, rf)")
    q, v, out = ns["q"], ns["v"], ns["out"]
    assert out.shape == v.shape and torch.isfinite(out).all()
    # "streaming: split/resume equals one shot" (out is the causal one-shot call by then)
    resumed = torch.cat([ns["out1"], ns["out2"]], dim=2)
    torch.testing.assert_close(resumed, out, rtol=1e-4, atol=1e-5)
    assert isinstance(ns["state"], rfattn.RFState)
    assert ns["est"].shape == ns["exact"].shape == (*q.shape[:2], 256, 256)


def test_multihead_attention():
    x = torch.randn(2, 10, 512)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 7:] = True
    x[1, 7:] = float("nan")  # junk in the padded positions
    ns = _run("mha = rfattn.RFMultiheadAttention(", x=x, pad=pad)
    out = ns["out"]
    assert out.shape == x.shape
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :7]).all()


def test_fourier_rpe():
    x = torch.randn(2, 12, 512)
    ns = _run("rpe = rfattn.FourierRPE(8, 32", x=x, times=torch.arange(12.0))
    # the explicit positions are the default arange(T): the same result
    y_default = ns["layer"](x)
    torch.testing.assert_close(ns["y"], y_default)
    assert ns["y"].shape == x.shape


def test_hugging_face():
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ns = _run("model = transformers.LlamaForCausalLM(config)", transformers=transformers,
              config=_tiny_llama(), ids=ids)  # fmt: skip
    model, logits = ns["model"], ns["logits"]
    assert model.config._attn_implementation == "rfattn"
    assert logits.shape == (2, 16, 64) and torch.isfinite(logits).all()
    # "the same logits every time in eval mode" (oprf's running statistics stay put)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, rtol=0, atol=0)


def _word_tokenizer(texts):
    """A real tokenizer (word level, built offline, pad token 0) over the words of ``texts``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    transformers = pytest.importorskip("transformers")
    words = sorted({w for t in texts for w in t.split()})
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]",
                                                unk_token="[UNK]")  # fmt: skip


def test_calibrate(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(_tiny_llama()).eval()
    g = torch.Generator().manual_seed(0)
    words = [f"w{i}" for i in range(40)]
    texts = [" ".join(words[j] for j in torch.randint(0, 40, (n,), generator=g).tolist())
             for n in torch.randint(3, 15, (40,), generator=g).tolist()]  # fmt: skip
    tok = _word_tokenizer(texts)
    ns = _run("report = rfattn.calibrate(model, batches", model=model, tok=tok, texts=texts,
              path=tmp_path)  # fmt: skip
    report = ns["report"]
    assert isinstance(report, rfattn.CalibrationReport)
    assert type(ns["batches"][0]).__name__ == "BatchEncoding"  # "the tokenizer's own output"
    # "defaults: ..." as the comment says them, and what the call ran
    defaults = inspect.signature(rfattn.calibrate).parameters
    params, steps, lr = (defaults[k].default for k in ("params", "steps", "lr"))
    assert f"params={params}, {steps} steps, lr {lr}" in _block("report = rfattn.calibrate(")
    assert report.params == params and report.steps == steps
    assert all(report.after[n] < report.before[n] for n in report.before), str(report)
    # "loads back with attn_implementation="rfattn"": the same logits
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="rfattn")
    ids = ns["batches"][0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits)
