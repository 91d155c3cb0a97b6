"""pytest-benchmark suite over the providers of ``python -m bench``, for those who prefer it.

    python -m pytest bench/ --benchmark-group-by=param:T   # not collected by ``make test``

Shapes are the CLI's device defaults at a few T (``RFATTN_BENCH_T="1024 4096"`` overrides).
Each case is timed with ``benchmark.pedantic`` (1 warm-up round; CUDA synchronised inside the
timed call), then its forward output is checked once against the float64 reference.
"""

from __future__ import annotations

import os

import pytest
import torch

import rfattn
from bench.__main__ import DEFAULTS
from bench.env import pick_device
from bench.providers import (
    available_providers,
    forward_output,
    is_softmax,
    make_call,
    make_inputs,
    reference_output,
)
from rfattn.testing import rel_rms, tolerance

DEVICE = pick_device("auto")
CFG = DEFAULTS["cuda" if DEVICE.type == "cuda" else "cpu"]
DTYPE = getattr(torch, CFG["dtype"])
TS = [int(t) for t in os.environ.get("RFATTN_BENCH_T", "512 2048").split()]
FEATURES = [f for f in ("posrf", "oprf", "rmf") if f in rfattn.features.FEATURES]
PROVIDERS, SKIPPED = available_providers(DEVICE, DTYPE, CFG["D"], CFG["E"])


def _cases():
    for provider in PROVIDERS:
        kinds = [None] if is_softmax(provider) else FEATURES
        if provider == "performer":
            kinds = ["posrf"]
        for feature in kinds:
            yield pytest.param(provider, feature, id=provider + (f"[{feature}]" if feature else ""))


_RFS: dict = {}


def _rf(feature):
    if feature not in _RFS:
        valid = rfattn.features.VALID_WEIGHTS.get(feature or "posrf", ("orf",))
        weights = "orf" if "orf" in valid else valid[0]
        rf = rfattn.RandomFeatures(CFG["D"], CFG["M"], feature=feature or "posrf", weights=weights)
        _RFS[feature] = rf.to(DEVICE)
    return _RFS[feature]


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("T", TS, ids=[f"T{t}" for t in TS])
@pytest.mark.parametrize("provider, feature", list(_cases()))
def test_attention(benchmark, provider, feature, T, causal, mode):
    backward = mode == "fwd+bwd"
    rf = _rf(feature)
    x = make_inputs(CFG["B"], CFG["H"], T, CFG["D"], CFG["E"], DTYPE, DEVICE, backward)
    call, _ = make_call(provider, x, rf, causal, backward)
    if DEVICE.type == "cuda":
        inner = call

        def call():
            inner()
            torch.cuda.synchronize()

    info = dict(provider=provider, feature=feature, T=T, causal=causal, mode=mode)
    benchmark.extra_info.update(info, dtype=CFG["dtype"], device=str(DEVICE))
    benchmark.pedantic(call, rounds=5, warmup_rounds=1, iterations=1)
    if T <= 2048:  # correctness, once, after timing
        ref = reference_output(provider, x, rf, causal)
        out = forward_output(provider, x, rf, causal)
        assert torch.isfinite(out).all()
        if ref is not None:
            assert rel_rms(out, ref) <= tolerance(DTYPE, "out")
