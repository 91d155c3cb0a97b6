"""The fused path's host side makes no host-to-device copy and no host sync (issue 35): every
torch op a fused call issues is counted through a dispatch mode (the operators' bodies included),
with the Triton launches themselves replaced by no-ops (only the launchers' Python runs, as on a
GPU). Counted as a copy from the host: a tensor made from host data (``aten.lift_fresh``, what
``torch.tensor(...)`` and an item assignment of a number issue). Counted as a sync: reading a
tensor on the host (``_local_scalar_dense``: ``.item()``, ``int()``, ``bool()``), ops whose output
size depends on the data (``nonzero``, ``repeat_interleave`` without ``output_size``...), and
``equal``. On CUDA each of these would stall the host on the GPU or copy through it."""

import sys
from pathlib import Path

import pytest
import torch
from rfattn.kernels.common import INTERPRET

import rfattn
from rfattn.features import VALID_WEIGHTS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ lives at the root

from bench.opcount import COPIES, SYNCS  # noqa: E402
from bench.opcount import OpCounter as _Count  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="counts the launchers' host side under "
                                "the interpreter (launches replaced by no-ops)")  # fmt: skip

FUSED = ["trigrf", "posrf", "hyprf", "gerf", "oprf", "saderf", "hrf", "rmf"]


@pytest.fixture
def no_launches(monkeypatch):
    """Triton launches as no-ops, counted."""
    from triton.runtime import interpreter

    launches = [0]

    def launch(self, *args, grid, warmup, **kwargs):
        launches[0] += 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", launch)
    return launches


def _calls(feature, training):
    w = "rademacher" if feature == "rmf" else VALID_WEIGHTS[feature][0]
    rf = rfattn.RandomFeatures(16, 32, feature, weights=w, seed=0).train(training)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=g) for _ in range(3))
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, :5] = True
    kw = dict(key_padding_mask=mask, backend="triton")

    def grads(causal):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = rfattn.rf_attention(*xs, rf, causal=causal, **kw)
        out.backward(torch.ones_like(out))

    def decode():  # a prefix state, then one token through the decode kernel
        _, st = rfattn.rf_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], rf, causal=True,
                                    return_state=True, backend="triton")  # fmt: skip
        return lambda: rfattn.rf_attention(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], rf,
                                           causal=True, initial_state=st, backend="triton")

    return {
        "noncausal fwd": lambda: rfattn.rf_attention(q, k, v, rf, **kw),
        "noncausal fwd+bwd": lambda: grads(False),
        "causal fwd": lambda: rfattn.rf_attention(q, k, v, rf, causal=True, **kw),
        "causal fwd+bwd": lambda: grads(True),
        "decode": decode(),
    }


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("feature", FUSED)
def test_fused_calls_copy_nothing_from_the_host_and_never_sync(feature, training, no_launches):
    """Every fused form, non-causal and causal, forward and forward+backward, the decode step; in
    training mode oprf/saderf also update their running statistics. After a first call (which may
    fill per-draw caches), a call issues no copy from the host and no sync. Before: sqrt(scale)
    was copied from the host at every launch setup and in the stats pass, the coefficient tables
    of trigrf/hrf item by item, hrf's sign rows made on the host, rmf's rows sized by a sync,
    and a running-statistics update read num_batches_tracked."""
    for name, call in _calls(feature, training).items():
        call()  # first call: caches
        no_launches[0] = 0
        with torch.no_grad() if "bwd" not in name else torch.enable_grad(), _Count() as mode:
            call()
        assert no_launches[0] > 0, f"{name}: no fused launch was counted"
        bad = {op: n for op, n in mode.ops.items() if op in COPIES | SYNCS}
        assert not bad, f"{feature} {name}: copies from the host or syncs: {bad}"


def test_the_counter_sees_copies_and_syncs(no_launches):
    """The counter can fail: a tensor from host data, .item(), bool() and a data-sized
    repeat_interleave are all seen, inside an operator's body too."""
    with _Count() as mode:
        x = torch.tensor([1.0, 2.0])
        x.sum().item()
        bool(x.any())
        torch.repeat_interleave(torch.arange(2), torch.tensor([1, 2]))
    seen = set(mode.ops)
    assert {"lift_fresh", "_local_scalar_dense", "repeat_interleave (sized by the data)"} <= seen


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_unused_outputs_get_no_zero_fill(causal, no_launches):
    """The operators' auxiliary outputs (offsets, row statistics) are non-differentiable and
    unused cotangents stay None: a posrf forward+backward fills no zero tensor (before: autograd
    made one for each auxiliary output, 5 non-causal and 6 causal, each a GPU op)."""
    call = _calls("posrf", False)[("causal" if causal else "noncausal") + " fwd+bwd"]
    call()
    with _Count() as mode:
        call()
    fills = {op: n for op, n in mode.ops.items() if op in ("zeros", "zeros_like", "zero_")}
    assert not fills, fills
