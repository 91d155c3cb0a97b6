"""The greedy-decoding example (bench/decode.py): streaming with states equals recomputation."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ lives at the root

from bench.decode import TinyLM, greedy_decode  # noqa: E402


def test_streaming_decode_equals_full_recompute():
    torch.manual_seed(0)
    model = TinyLM(vocab=32, dim=32, heads=2, layers=2, num_features=32).double().eval()
    prompt = torch.randint(0, 32, (2, 7))
    tokens = greedy_decode(model, prompt, steps=20)
    assert tokens.shape == (2, 27)
    assert torch.equal(tokens[:, :7], prompt)
    # every generated token is the argmax of the full causal pass over what precedes it
    with torch.no_grad():
        logits, _ = model(tokens[:, :-1])
    assert torch.equal(logits[:, 6:].argmax(-1), tokens[:, 7:])
    # and the streamed logits equal the one-shot ones (split/resume through every layer)
    with torch.no_grad():
        _, states = model(tokens[:, :10])
        step_logits, _ = model(tokens[:, 10:11], states)
    assert torch.allclose(step_logits[:, 0], logits[:, 10], rtol=1e-10, atol=1e-12)
