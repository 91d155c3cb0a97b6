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


def _calls(feature, training, dtype=torch.float32):
    w = "rademacher" if feature == "rmf" else VALID_WEIGHTS[feature][0]
    rf = rfattn.RandomFeatures(16, 32, feature, weights=w, seed=0).train(training)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=g).to(dtype) for _ in range(3))
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


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_packed_max_seqlen_reads_nothing_on_the_host(causal, no_launches, monkeypatch):
    """Packed sequences with ``max_seqlen``, forward and backward on the fused kernels (those
    with the offsets): no copy from the host and no sync (the offsets' values are
    checked on the device), where the host-offsets path reads them (the counter sees it: the
    test can fail)."""
    rf = rfattn.RandomFeatures(16, 32, "posrf", seed=0)
    g = torch.Generator().manual_seed(0)
    lengths = [0, 7, 1, 19, 13]
    q, k, v = (torch.randn(1, 4, sum(lengths), 16, generator=g) for _ in range(3))
    cu = torch.tensor([0, *lengths]).cumsum(0)

    def call(**kw):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = rfattn.rf_attention(*xs, rf, causal=causal, cu_seqlens=cu, backend="triton", **kw)
        out.backward(torch.ones_like(out))

    from rfattn import fused

    native = []  # the kernels with the offsets (rfattn.fused.packed)
    monkeypatch.setattr(fused, "packed", lambda c, real=fused.packed: native.append(c) or real(c))
    for kw, expect_syncs in ((dict(), True), (dict(max_seqlen=19), False)):
        call(**kw)  # first call: caches
        no_launches[0] = 0
        with _Count() as mode:
            call(**kw)
        assert no_launches[0] > 0
        bad = {op: n for op, n in mode.ops.items() if op in COPIES | SYNCS}
        assert bool(bad) == expect_syncs, (kw, bad)
    assert len(native) == 4


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


@pytest.mark.parametrize("feature,dtype", [("posrf", torch.float32), ("rmf", torch.bfloat16)],
                         ids=["posrf-fp32", "rmf-bf16"])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_unused_outputs_get_no_zero_fill(causal, feature, dtype, no_launches):
    """The operators' auxiliary outputs (offsets, row statistics) are non-differentiable and
    unused cotangents stay None: a forward+backward fills no zero tensor (before: autograd made
    one for each auxiliary output, 5 non-causal and 6 causal, each a GPU op). rmf's bf16 inputs
    take three tf32 products, not the half policy: the causal output walk still writes the
    output's rounding residual for the backward (before: a zero fill in its place)."""
    call = _calls(feature, False, dtype)[("causal" if causal else "noncausal") + " fwd+bwd"]
    call()
    with _Count() as mode:
        call()
    fills = {op: n for op, n in mode.ops.items() if op in ("zeros", "zeros_like", "zero_")}
    assert not fills, fills


@pytest.mark.parametrize("return_state", [False, True], ids=["out", "out+state"])
def test_a_causal_call_without_gradient_allocates_what_it_returns(return_state, no_launches):
    """A warm causal posrf call without gradient allocates its output, one scratch buffer (the
    segments' carries, the row statistics the kernels write for a backward, and the final state
    where it is not returned) and the returned state (before: the three row statistics and the
    final state allocated on every call, 8 allocations with or without return_state)."""
    rf = rfattn.RandomFeatures(16, 32, "posrf", seed=0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 40, 16, generator=g) for _ in range(3))

    def call():
        with torch.no_grad():
            return rfattn.rf_attention(q, k, v, rf, causal=True, return_state=return_state,
                                       backend="triton")  # fmt: skip

    call()
    with _Count() as mode:
        call()
    allocations = sum(mode.of_kind("alloc").values())
    assert allocations == (5 if return_state else 2), mode.of_kind("alloc")


def _form_inputs(feature, stats=None, **opts):
    w = "rademacher" if feature == "rmf" else VALID_WEIGHTS[feature][0]
    rf = rfattn.RandomFeatures(16, 32, feature, weights=w, seed=0, **opts)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, 40, 16, generator=g) for _ in range(2))
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, :5] = True
    return rf, q, k, mask


#: (feature, causal, training, launches every call): the stats pass's one launch where the
#: parameters come from this call's data (global statistics; a training call's running ones)
FORM_CASES = [
    ("oprf", False, False, 1),
    ("saderf", False, True, 1),
    ("oprf", True, True, 1),
    ("saderf", True, True, 1),
    ("oprf", True, False, 0),
    ("saderf", True, False, 0),
    ("posrf", False, False, 0),
    ("hyprf", True, True, 0),
    ("trigrf", False, False, 0),
    ("hrf", False, False, 0),
    ("hrf", True, True, 0),
    ("rmf", False, False, 0),
    ("rmf", True, False, 0),
]


@pytest.mark.parametrize("feature,causal,training,launches", FORM_CASES,
                         ids=["-".join(map(str, c[:3])) for c in FORM_CASES])  # fmt: skip
def test_form_building_issues_no_gpu_op_beyond_the_stats_launch(
    feature, causal, training, launches, no_launches
):
    """A fused call's kernel form, statistics included, costs the GPU at most the stats pass's
    one launch: oprf/saderf's moments of q and k and their parameters (and a training call's
    running update) come from that launch, and every other form (no statistics, running ones
    outside training, hrf's tables, rmf's rows) is kept from the first call and costs nothing.
    Before: oprf 2 launches + 54 torch ops (saderf 63) with global statistics, 32 (41) in eval
    with running ones, 85 (94) in a training step; hrf 1 (the rows' cat), rmf 6."""
    from rfattn.fused import kernel_form

    rf, q, k, mask = _form_inputs(feature)
    rf.train(training)
    kernel_form(rf, q, k, mask, 0.25, causal, mask if causal else None)  # first call: kept forms
    for _ in range(2):
        no_launches[0] = 0
        with _Count() as mode:
            kernel_form(rf, q, k, mask, 0.25, causal, mask if causal else None)
        gpu = mode.of_kind("gpu", "copy", "sync")
        assert (no_launches[0], gpu) == (launches, {}), f"{feature}: {no_launches[0]}, {gpu}"


def test_kept_forms_follow_their_sources():
    """A kept form is rebuilt when what it was built from changes: a redraw, an in-place change
    of W or of a statistics buffer (an optimiser step, ``load_state_dict``), a new W (made
    learnable); it equals the form built afresh. (The training mode, and the running buffers
    moved by the stats pass itself: tests/test_stats_kernel.py.)"""
    from rfattn.fused import kernel_form

    def form(rf, causal=False):
        return kernel_form(rf, q, k, mask, 0.25, causal, mask if causal else None)

    def fresh(rf, causal=False):
        x = q.new_empty(1, 1, 0, 16)
        with torch.no_grad():
            p = rf.feature_params(x, x, causal=causal)
        return rf.feature_map.kernel_form(rf.weight, p)

    def same(a, b):  # b's values as a (a kept form holds them as the kernels read them: in
        # their dtype, per-(b, h) parameters per (b, h))
        return all(
            (x is None and y is None) or torch.equal(x, y.to(x.dtype).expand_as(x))
            for x, y in ((a.w, b.w), (a.coeffs, b.coeffs), (a.psi, b.psi), (a.table, b.table),
                         (a.tau, b.tau), (a.rows, b.rows))  # fmt: skip
        )

    rf, q, k, mask = _form_inputs("hrf")
    first = form(rf)
    assert form(rf) is first  # kept
    rf.redraw(seed=5)
    assert form(rf) is not first and same(form(rf), fresh(rf)) and not same(first, fresh(rf))
    kept = form(rf)
    rf.feature_map.hrf_tau.mul_(-1.0)  # in place: the sign rows
    assert form(rf) is not kept and same(form(rf), fresh(rf))
    kept = form(rf)
    rf.weight.mul_(2.0)  # in place: W
    assert form(rf) is not kept and same(form(rf), fresh(rf)) and not same(kept, fresh(rf))
    kept = form(rf)
    rf.learn_weight()  # a new tensor for W
    with torch.no_grad():
        assert form(rf) is not kept and same(form(rf), fresh(rf))

    rf, q, k, mask = _form_inputs("saderf")
    rf.eval()
    kept = form(rf, causal=True)
    assert form(rf, causal=True) is kept
    rf.feature_map.running_sq.add_(torch.rand(2, 16))  # in place: a running statistic
    assert form(rf, causal=True) is not kept and same(form(rf, causal=True), fresh(rf, True))
    assert not same(kept, fresh(rf, causal=True))
    sd = {n: t + 1.0 if t.is_floating_point() else t for n, t in rf.state_dict().items()}
    kept = form(rf, causal=True)
    rf.load_state_dict(sd)
    assert form(rf, causal=True) is not kept and same(form(rf, causal=True), fresh(rf, True))
    assert not same(kept, fresh(rf, causal=True))
