"""GPU operations per fused call (issue 35): Triton launches plus the GPU-side torch ops
(``bench.opcount``'s kind ``gpu``, and ``copy``), counted on CPU with the launches replaced by
no-ops (only the launchers' Python runs, as on a GPU). Targets: a non-causal forward is at most
2 (the key pass, the query pass), a forward+backward at most 4 (the dS pass, one dq/dk/dv pass);
a causal forward at most 2, a forward+backward at most 5, oprf/saderf in training included
(their running statistics formed in the forward's first launch, not a stats launch before it).

oprf and saderf form their statistics in the key pass's launch (a stats launch before it made
them 3 / 5).

Before: the forward launched the key pass, a merge of the split partials and the query pass and
filled sqrt(scale) on the device (4); the backward three kernels, a fill and two torch sums of
the split partials (10 in all)."""

import collections
import sys
from pathlib import Path

import pytest
import torch
from rfattn.kernels.common import INTERPRET

import rfattn
from rfattn import ops
from rfattn.features import VALID_WEIGHTS
from rfattn.fused import kernel_form

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/ lives at the root

from bench.opcount import OpCounter  # noqa: E402

pytestmark = pytest.mark.skipif(not INTERPRET, reason="counts the launchers' host side under "
                                "the interpreter (launches replaced by no-ops)")  # fmt: skip

# T = 300 > 128 tokens: two key splits and two query splits under the interpreter
B, H, T, D, M = 2, 3, 300, 16, 32


@pytest.fixture
def launches(monkeypatch):
    """Triton launches as no-ops, counted by kernel name."""
    from triton.runtime import interpreter

    seen = collections.Counter()

    def launch(self, *args, grid, warmup, **kwargs):
        seen[self.fn.__name__] += 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", launch)
    return seen


def _inputs(grad: bool):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, D, generator=g).requires_grad_(grad) for _ in range(3)]


def _rf(feature):
    w = "rademacher" if feature == "rmf" else VALID_WEIGHTS[feature][0]
    return rfattn.RandomFeatures(D, M, feature, weights=w, seed=0).eval()


def _count(call, launches) -> tuple[int, dict]:
    """(GPU operations of one call after a first one, what they were)."""
    call()  # first call: per-device caches
    launches.clear()
    with OpCounter() as mode:
        call()
    torch_ops = mode.of_kind("gpu", "copy")
    return sum(launches.values()) + sum(torch_ops.values()), {**launches, **torch_ops}


def _grads(call, xs):
    """The call's forward and backward (the gradients returned, not accumulated: no add_)."""
    do = torch.ones(B, H, T, D)
    return lambda: torch.autograd.grad(call(*xs), xs, do)


def test_posrf_call_forward_2_forward_backward_4(launches):
    """The whole call, ``rf_attention`` to the kernels."""
    rf = _rf("posrf")
    q, k, v = _inputs(False)
    with torch.no_grad():
        n, ops_ = _count(lambda: rfattn.rf_attention(q, k, v, rf, backend="triton"), launches)
    assert n <= 2, str(ops_)
    call = _grads(lambda q, k, v: rfattn.rf_attention(q, k, v, rf, backend="triton"), _inputs(True))
    n, ops_ = _count(call, launches)
    assert n <= 4, str(ops_)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("stats", ["global", "running"])
@pytest.mark.parametrize("feature", ["oprf", "saderf"])
def test_statistics_call_forward_2_forward_backward_4(feature, stats, training, launches):
    """oprf/saderf, the whole call: the statistics (global, or running in training, which moves
    the buffers) come from the key pass's own launch, not a launch before it."""
    rf = rfattn.RandomFeatures(D, M, feature, stats=stats, seed=0).train(training)
    q, k, v = _inputs(False)
    with torch.no_grad():
        n, ops_ = _count(lambda: rfattn.rf_attention(q, k, v, rf, backend="triton"), launches)
    assert n <= 2, str(ops_)
    assert "_stats_kernel" not in ops_
    call = _grads(lambda q, k, v: rfattn.rf_attention(q, k, v, rf, backend="triton"), _inputs(True))
    n, ops_ = _count(call, launches)
    assert n <= 4, str(ops_)
    if stats == "global" or training:
        assert ops_["_fwd_kv_stats_kernel"] == 1, str(ops_)


@pytest.mark.parametrize("case", ["causal", "causal-train", "decode"])
@pytest.mark.parametrize("feature", ["oprf", "saderf"])
def test_running_statistics_causal_and_decode_copy_nothing(feature, case, launches):
    """Causal calls and the decode step with running statistics (the kept form in eval, the
    stats pass in training) issue no torch op: their per-(b, h) parameters are ``[B, H, ...]``
    as the kernels read them (broadcast ones were copied at each launch, one ``clone`` each)."""
    rf = rfattn.RandomFeatures(D, M, feature, seed=0).train(case == "causal-train")
    q, k, v = _inputs(False)
    if case == "decode":
        q, k, v = q[:, :, :1], k[:, :, :1], v[:, :, :1]
    with torch.no_grad():
        _count(lambda: rfattn.rf_attention(q, k, v, rf, causal=True, backend="triton"), launches)
    with OpCounter() as mode:
        with torch.no_grad():
            rfattn.rf_attention(q, k, v, rf, causal=True, backend="triton")
    assert mode.of_kind("gpu", "copy") == {}


@pytest.mark.parametrize("feature", ["posrf", "hrf", "rmf", "oprf", "saderf"])
def test_parallel_operator_forward_2_forward_backward_4(feature, launches):
    """The operator on a kernel form built beforehand (hrf's and rmf's forms and the statistics
    pass of oprf/saderf are the feature's, outside the operator)."""
    rf, scale = _rf(feature), D**-0.5
    q, k, v = _inputs(False)
    with torch.no_grad():
        form = kernel_form(rf, q, k, None, scale, causal=False)
        n, ops_ = _count(lambda: ops.rf_parallel(q, k, v, form, scale), launches)
    assert n <= 2, str(ops_)
    assert set(ops_) == {"_fwd_kv_kernel", "_fwd_q_kernel"}
    n, ops_ = _count(_grads(lambda q, k, v: ops.rf_parallel(q, k, v, form, scale), _inputs(True)),
                     launches)  # fmt: skip
    assert n <= 4, str(ops_)


# causal: T = 300 is 19 chunks of 16 under the interpreter (two per program's walk at least)


def _rf_causal(feature, training):
    rf = _rf(feature).train(training)
    if feature in ("oprf", "saderf"):  # give the running statistics something to hold
        rf.feature_map.running_sq.fill_(0.3)
        rf.feature_map.num_batches_tracked.fill_(1)
    return rf


#: at most this many copies per launch setup of a running-statistics form's parameters, [1, 1,
#: ...] broadcast to [B*H, ...] (coefficients; saderf's psi too): the form's layout, not the
#: causal kernels' launches
LAYOUT_COPIES = {"oprf": 1, "saderf": 2}


@pytest.mark.parametrize("feature", ["posrf", "hrf", "rmf", "oprf", "saderf"])
def test_chunk_operator_forward_2_forward_backward_5(feature, launches):
    """The causal operator on a kernel form built beforehand: the states pass and the output
    pass forward; the states recomputed, the reverse scan and the dq/dk/dv pass backward."""
    rf, scale = _rf_causal(feature, training=False), D**-0.5
    q, k, v = _inputs(False)
    copies = LAYOUT_COPIES.get(feature, 0)
    with torch.no_grad():
        form = kernel_form(rf, q, k, None, scale, causal=True)
        n, ops_ = _count(lambda: ops.rf_chunk(q, k, v, form, scale), launches)
    clones = ops_.pop("clone", 0)
    assert clones <= copies and n - clones <= 2, str(ops_)
    assert set(ops_) == {"_chunk_states_kernel", "_chunk_out_kernel"}
    n, ops_ = _count(_grads(lambda q, k, v: ops.rf_chunk(q, k, v, form, scale)[0], _inputs(True)),
                     launches)  # fmt: skip
    clones = ops_.pop("clone", 0)
    assert clones <= 2 * copies and n - clones <= 5, str(ops_)
    assert set(ops_) == {"_chunk_states_kernel", "_chunk_out_kernel", "_chunk_dstates_kernel",
                         "_chunk_bwd_kernel"}  # fmt: skip


@pytest.mark.parametrize("feature,training", [("posrf", False), ("oprf", True), ("saderf", True)],
                         ids=["posrf", "oprf-train", "saderf-train"])  # fmt: skip
def test_causal_call_forward_2_forward_backward_5(feature, training, launches):
    """The whole causal call, ``rf_attention`` to the kernels: oprf/saderf in training (running
    statistics: the parameters from the buffers, which this call's moments then move) form
    them in the forward's first launch, the walk over the key chunks, not a stats pass before
    it; the backward reads the parameters that launch wrote."""
    rf = _rf_causal(feature, training)
    kw = dict(causal=True, backend="triton")
    q, k, v = _inputs(False)
    with torch.no_grad():
        n, ops_ = _count(lambda: rfattn.rf_attention(q, k, v, rf, **kw), launches)
    assert n <= 2, str(ops_)
    assert set(ops_) == {"_chunk_states_kernel", "_chunk_out_kernel"}, str(ops_)
    n, ops_ = _count(_grads(lambda q, k, v: rfattn.rf_attention(q, k, v, rf, **kw),
                            _inputs(True)), launches)  # fmt: skip
    assert n <= 5, str(ops_)
    assert "_stats_kernel" not in ops_, str(ops_)
