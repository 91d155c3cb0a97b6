"""The README's and docs/'s Python examples run as written (a user copies them first), and the
pages hold together.

Each ```python block of README.md and docs/*.md is either run here, with the few names its
surrounding prose leaves to the reader defined beforehand, or listed in ``SKETCHES`` with the
reason it cannot run alone; a new block that is neither fails :func:`test_every_block_is_run`.
After a block runs, the claims it states in its comments are checked on what it computed.

The pages themselves: every relative link (and image) resolves to a file of the repository, with
its ``#anchor`` a heading of that page; no page refers to a path outside the repository; the
README reaches its first link into docs/ within :data:`FIRST_SCREEN` lines. Each check has a
test that feeds it a broken page, so it can fail.
"""

from __future__ import annotations

import inspect
import re
import subprocess
from pathlib import Path

import pytest
import torch

import rfattn

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the pages checked: the README and every page of docs/
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: the most README lines up to and including its first link into docs/ (issue 35)
FIRST_SCREEN = 120

#: blocks that are outlines, not programs, by a line they contain -> why
SKETCHES = {
    "logits, states = model(prompt)": "outline of bench/decode.py's loop (its model and prompt)",
}


def _name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)


def _block(page: str, line: str) -> str:
    """The one block of ``page`` (e.g. "docs/usage.md") containing ``line``."""
    found = [b for b in _blocks(ROOT / page) if line in b]
    assert len(found) == 1, f"{len(found)} blocks of {page} contain {line!r}"
    return found[0]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip


def _run(page: str, line: str, **names) -> dict:
    """Run the block of ``page`` containing ``line`` with ``names`` defined, and torch and rfattn
    (the first block's imports, which the later ones take as read); its namespace afterwards."""
    ns = dict(torch=torch, rfattn=rfattn, **names)
    exec(compile(_block(page, line), f"{page} block <{line}>", "exec"), ns)  # noqa: S102
    return ns


#: the line each run block is found by, per page (tests below)
RUN = {
    "README.md": ("layer = rfattn.RFAttention(512, 8, num_features=256",),
    "docs/usage.md": (
        "out = rfattn.rf_attention(q, k, v, rf)",
        "mha = rfattn.RFMultiheadAttention(",
        "rpe = rfattn.FourierRPE(8, 32",
        "out = rfattn.rf_attention(q, k, v, rf, causal=True, cu_seqlens=cu)",
    ),
    "docs/transformers.md": ("model = transformers.LlamaForCausalLM(config)",),
    "docs/calibration.md": ("report = rfattn.calibrate(model, batches",),
    "docs/hybrid.md": ("out = hybrid_attention(q, k, v, rf, window=16, sinks=4)",),
}


def test_every_block_is_run():
    for page in PAGES:
        for block in _blocks(page):
            run = [line for line in RUN.get(_name(page), ()) if line in block]
            sketch = [line for line in SKETCHES if line in block]
            assert len(run) + len(sketch) == 1, (
                f"{_name(page)}: block neither run nor a sketch:\n{block}"
            )


def test_hybrid_page():
    ns = _run("docs/hybrid.md", "out = hybrid_attention(q, k, v, rf, window=16, sinks=4)")
    assert ns["out"].shape == ns["v"].shape and torch.isfinite(ns["out"]).all()
    # the block's own check: split/resume equals one call
    assert ns["state"].keys.shape[2] == 16 and ns["state"].sink_keys.shape[2] == 4


def test_quick_start():
    ns = _run("README.md", "layer = rfattn.RFAttention(512, 8, num_features=256")
    q, v, out, y = ns["q"], ns["v"], ns["out"], ns["y"]
    assert out.shape == v.shape == q.shape and torch.isfinite(out).all()
    # "causal, O(T) memory": out is the causal call by then; its first row reads key 0 alone
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], rtol=1e-5, atol=1e-5)
    assert y.shape == (2, 1024, 512) and torch.isfinite(y).all()


def test_use_it():
    ns = _run("docs/usage.md", "out = rfattn.rf_attention(q, k, v, rf)")
    q, v, out = ns["q"], ns["v"], ns["out"]
    assert out.shape == v.shape and torch.isfinite(out).all()
    # "streaming: split/resume equals one shot" (out is the causal one-shot call by then)
    resumed = torch.cat([ns["out1"], ns["out2"]], dim=2)
    torch.testing.assert_close(resumed, out, rtol=1e-4, atol=1e-5)
    assert isinstance(ns["state"], rfattn.RFState)
    assert ns["est"].shape == ns["exact"].shape == (*q.shape[:2], 256, 256)


def test_packed_sequences():
    ns = _run("docs/usage.md", "out = rfattn.rf_attention(q, k, v, rf, causal=True, cu_seqlens=cu)")
    q, k, v, rf, out, state = (ns[n] for n in ("q", "k", "v", "rf", "out", "state"))
    assert state.s.shape == (3, 8, 256, 64)
    # "each document on its own": the second document equals a call of its own
    alone, last = rfattn.rf_attention(q[:, :, 50:850], k[:, :, 50:850], v[:, :, 50:850], rf,
                                      causal=True, return_state=True)  # fmt: skip
    torch.testing.assert_close(out[:, :, 50:850], alone, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.s[1:2], last.s, rtol=1e-5, atol=1e-6)
    # cross-attention: query block 1 (queries 10:20) reads document 1's keys alone
    one = rfattn.rf_attention(q[:, :, 10:20], k[:, :, 50:850], v[:, :, 50:850], rf)
    torch.testing.assert_close(ns["out_x"][:, :, 10:20], one, rtol=1e-5, atol=1e-6)


def test_multihead_attention():
    x = torch.randn(2, 10, 512)
    pad = torch.zeros(2, 10, dtype=torch.bool)
    pad[1, 7:] = True
    x[1, 7:] = float("nan")  # junk in the padded positions
    ns = _run("docs/usage.md", "mha = rfattn.RFMultiheadAttention(", x=x, pad=pad)
    out = ns["out"]
    assert out.shape == x.shape
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[1, :7]).all()


def test_fourier_rpe():
    x = torch.randn(2, 12, 512)
    ns = _run("docs/usage.md", "rpe = rfattn.FourierRPE(8, 32", x=x, times=torch.arange(12.0))
    # the explicit positions are the default arange(T): the same result
    y_default = ns["layer"](x)
    torch.testing.assert_close(ns["y"], y_default)
    assert ns["y"].shape == x.shape


def test_hugging_face():
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ns = _run("docs/transformers.md", "model = transformers.LlamaForCausalLM(config)",
              transformers=transformers, config=_tiny_llama(), ids=ids)  # fmt: skip
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


@pytest.mark.slow  # ~17 s: the calibration example's steps
def test_calibrate(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(_tiny_llama()).eval()
    g = torch.Generator().manual_seed(0)
    words = [f"w{i}" for i in range(40)]
    texts = [" ".join(words[j] for j in torch.randint(0, 40, (n,), generator=g).tolist())
             for n in torch.randint(3, 15, (40,), generator=g).tolist()]  # fmt: skip
    tok = _word_tokenizer(texts)
    ns = _run("docs/calibration.md", "report = rfattn.calibrate(model, batches", model=model,
              tok=tok, texts=texts, path=tmp_path)  # fmt: skip
    report = ns["report"]
    assert isinstance(report, rfattn.CalibrationReport)
    assert type(ns["batches"][0]).__name__ == "BatchEncoding"  # "the tokenizer's own output"
    # "defaults: ..." as the comment says them, and what the call ran
    defaults = inspect.signature(rfattn.calibrate).parameters
    params, steps, lr = (defaults[k].default for k in ("params", "steps", "lr"))
    assert f"params={params}, {steps} steps, lr {lr}" in _block(
        "docs/calibration.md", "report = rfattn.calibrate("
    )
    assert report.params == params and report.steps == steps
    assert all(report.after[n] < report.before[n] for n in report.before), str(report)
    # "loads back with attn_implementation="rfattn"": the same logits
    back = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="rfattn")
    ids = ns["batches"][0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, model(ids).logits)


# --- the pages hold together ---------------------------------------------------------------------

#: references to paths outside the repository (a checkout of the project has nothing else)
OUTSIDE = re.compile(
    r"\.\./shared|(?<![\w.-])/(?:work|tmp|home|root|opt|mnt)/|\bDESIGN(?:\.md|\s*§)|\bspec\s*§"
    r"|(?<![\w.-])(?:spec|seeds)/|file://"
)  # fmt: skip


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code (links live in the prose)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _links(text: str) -> list[str]:
    """The targets of the markdown links and images of ``text``."""
    return re.findall(r"!?\[[^\]\n]*\]\(([^)\s]+)\)", _prose(text))


def _anchors(text: str) -> set[str]:
    """GitHub's anchors of the headings of a page: lower case, inline code and links reduced to
    their text, punctuation dropped, spaces as hyphens, repeats numbered."""
    out, seen = set(), {}
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *#* *$", text, re.M):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _tracked() -> set[str] | None:
    """The repository's files (tracked or not yet committed, not ignored), or None without git."""
    try:
        res = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return set(res.stdout.splitlines())


def _broken_links(page: Path, root: Path = ROOT, tracked: set[str] | None = None) -> list[str]:
    """Each relative link of ``page`` that does not resolve to a file of the repository at
    ``root`` (or, with ``tracked``, to one of those files), or to a heading of it."""
    bad = []
    for target in _links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page.resolve()
        if not dest.is_relative_to(root.resolve()):
            bad.append(f"{target}: outside the repository")
            continue
        rel = dest.relative_to(root.resolve()).as_posix()
        if not dest.is_file() or tracked is not None and rel not in tracked:
            bad.append(f"{target}: no file {rel} in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text("utf-8")):
            bad.append(f"{target}: no heading #{anchor} in {rel}")
    return bad


def _outside_refs(text: str) -> list[str]:
    return [m.group(0) for m in OUTSIDE.finditer(text)]


def _first_docs_link(text: str) -> int | None:
    """The line number (from 1) of the README's first link into docs/, or None."""
    for i, line in enumerate(text.splitlines(), 1):
        if any(t.startswith(("docs/", "./docs/")) for t in _links(line)):
            return i
    return None


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_links_resolve(page):
    assert not _broken_links(page, tracked=_tracked()), _broken_links(page, tracked=_tracked())


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_no_path_outside_the_repository(page):
    assert not _outside_refs(page.read_text(encoding="utf-8"))


def test_readme_first_screen():
    line = _first_docs_link(README.read_text(encoding="utf-8"))
    assert line is not None and line <= FIRST_SCREEN, f"first link into docs/ at line {line}"
    # the two commands of the first screen are the ones CI and the Makefile run
    first = "\n".join(README.read_text(encoding="utf-8").splitlines()[:line])
    assert "make demo" in first and "make test" in first


def test_every_page_is_in_the_index():
    index = set(_links((ROOT / "docs" / "README.md").read_text(encoding="utf-8")))
    readme = set(_links(README.read_text(encoding="utf-8")))
    for page in PAGES[1:]:
        assert page.name in index or page.name == "README.md", f"docs/README.md lacks {page.name}"
        assert _name(page) in readme, f"README.md lacks a link to {_name(page)}"


def test_the_checks_can_fail(tmp_path):
    """Each page check finds what it is for on a broken page."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## Some `code` here\n")
    page = tmp_path / "README.md"
    page.write_text(
        "[ok](docs/a.md) [ok](docs/a.md#some-code-here) [ok](https://example.com)\n"
        "[gone](docs/missing.md) [no heading](docs/a.md#nowhere) [out](../outside.md)\n"
        "`[in code](docs/missing.md)`\n"
    )  # fmt: skip
    bad = _broken_links(page, root=tmp_path)
    assert [b.split(":")[0] for b in bad] == ["docs/missing.md", "docs/a.md#nowhere",
                                              "../outside.md"]  # fmt: skip
    # a file that exists but is not part of the repository (ignored, not yet added) is no target
    assert _broken_links(page, root=tmp_path, tracked={"README.md"})[0].startswith("docs/a.md:")
    refs = ("see ../shared/DESIGN.md", "in /work/main", "DESIGN §3", "spec §3.6", "spec/x.md")
    assert all(_outside_refs(ref) for ref in (*refs, "seeds/paper.pdf"))
    assert not _outside_refs("rfattn/stats.py, bench/results/x.json, docs/design.md, 1/8")
    long = "\n" * FIRST_SCREEN + "[design](docs/design.md)\n"
    assert _first_docs_link(long) == FIRST_SCREEN + 1
    assert _first_docs_link("[x](bench/a.json)\n[y](docs/a.md)\n") == 2
