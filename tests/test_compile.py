"""The fused kernels compile for a Hopper GPU (sm_90), checked here without one (bench/compile.py).

The interpreter runs the kernels' semantics but accepts code that compiled Triton rejects (a
helper whose constexpr-dead branches return other types, a module global that is not a
``tl.constexpr``, a tile needing more shared memory than the GPU has). This test records the
launches of every fused path, feature form and flag on D = 64 in fp32 and bf16 and on D = 256 in
fp32 (the widest tiles: they need the unpipelined fallback configs), and compiles for sm_90 the
smallest config each autotuner tries, with Triton's own ptxas (no driver needed). On a CUDA
machine the GPU tests compile every kernel for real, so it is skipped there.

``torch.compile(dynamic=True)`` over ``rf_attention`` on the CPU (the torch path, and the fused
operators: Triton kernels under the interpreter) is checked here too: one graph for every
sequence length, outputs and gradients equal to eager calls.
"""

import copy

import pytest
import torch

import rfattn
from bench import compile as aot

pytestmark = [
    pytest.mark.compile,  # make check-compile (half an hour on 2 cores): not part of make test
    pytest.mark.skipif(
        torch.cuda.is_available(), reason="CUDA present: the GPU tests compile the kernels for real"
    ),
]


@pytest.fixture(scope="module")
def launches():
    recorded = aot.record(aot.scenarios(quick=True))
    names = {r["name"] for r in recorded}
    # every kernel of every module is launched by some scenario
    assert names == {
        "_fwd_kv_kernel", "_fwd_q_kernel", "_bwd_ds_kernel", "_bwd_dqkv_kernel", "_bwd_dwk_kernel",
        "_chunk_states_kernel", "_chunk_out_kernel", "_chunk_dstates_kernel", "_chunk_bwd_kernel",
        "_recurrent_kernel", "_stats_kernel", "_fwd_kv_stats_kernel", "_local_rows_kernel",
        "_local_dkv_kernel", "_local_dsink_kernel",
    }  # fmt: skip
    return recorded


def test_every_launch_compiles_for_sm90(launches):
    rows = aot.compile_in_child(launches, arch=90, configs="smallest")
    assert len(rows) == len(launches)
    assert aot.failures(rows) == []
    assert all(r["shared_bytes"] <= aot.SMEM_LIMIT[90] for r in rows)


def test_no_half_policy_config_spills(launches):
    """bf16 inputs at D = E = 64, M = 256 (the compile report's scenarios, every feature form and
    flag): no config any fused kernel offers spills on sm_90 (``bench.compile.NO_SPILL``), but
    for the rows still known to spill (``bench.compile.KNOWN_SPILLS``: signed tables, rmf,
    three decode cases, the causal backward walk and a few causal forms), none of those has
    stopped spilling unnoticed, and none spills more than in the committed compile report
    (where this Triton compiled it: ``bench.compile.spill_ceilings``). Only launches of the half
    policy (rmf's bf16 inputs run tf32x3 now, ``kernels.common.precision_policy``)."""
    half = [r for r in launches if "-bfloat16-D64" in r["tag"] and r["name"] in aot.NO_SPILL
            and r["args"]["PRECISION"][1] == "bf16"]  # rmf's bf16 inputs take tf32x3  # fmt: skip
    assert {r["name"] for r in half} >= {"_fwd_kv_kernel", "_fwd_q_kernel", "_bwd_dqkv_kernel",
                                         "_chunk_out_kernel", "_chunk_bwd_kernel"}  # fmt: skip
    rows = aot.compile_in_child(half, arch=90, configs="all")
    assert aot.failures(rows) == []
    assert aot.unexpected_spills(rows, ceilings=aot.spill_ceilings()) == []


def test_spills_are_reported():
    """The check can fail: a spilling row of a held kernel is named, one of a kernel outside
    ``NO_SPILL`` (the stats pass) is not."""
    row = {"kernel": "_fwd_q_kernel", "tag": "t", "config": {}, "stack_bytes": 8, "registers": 255}
    assert len(aot.spills([row, {**row, "stack_bytes": 0}])) == 1
    assert len(aot.spills([{**row, "kernel": "_chunk_out_kernel"}])) == 1
    assert aot.spills([{**row, "kernel": "_stats_kernel"}]) == []


def test_unexpected_spills_are_reported():
    """Known spilling rows pass, any other spilling row is named, and so is a known row whose
    configs all stopped spilling."""
    kernel, tag = sorted(aot.KNOWN_SPILLS)[0]
    row = {"kernel": kernel, "tag": tag, "config": {}, "stack_bytes": 16, "registers": 255}
    assert aot.unexpected_spills([row]) == []
    assert len(aot.unexpected_spills([{**row, "tag": "posrf/orf-bfloat16-D64-noncausal"}])) == 1
    fixed = aot.unexpected_spills([{**row, "stack_bytes": 0}])
    assert len(fixed) == 1 and "no longer spills" in fixed[0]
    assert aot.unexpected_spills([row, {**row, "stack_bytes": 0}]) == []
    # a known spill may not grow past the committed report's
    ceilings = {(kernel, tag): 16}
    assert aot.unexpected_spills([row], ceilings=ceilings) == []
    grown = aot.unexpected_spills([{**row, "stack_bytes": 24}], ceilings=ceilings)
    assert len(grown) == 1 and "more than the committed report's 16" in grown[0]


def test_spill_ceilings_are_the_committed_reports(tmp_path):
    """Read from the committed report (the most any config of a row spilled), and none where the
    report was compiled by another Triton."""
    import json

    import triton

    doc = json.loads(aot.REPORT.read_text())
    ceilings = aot.spill_ceilings()
    if doc["env"]["triton"] == triton.__version__:
        bwd = [r["stack_bytes"] for r in doc["rows"]
               if (r["kernel"], r["tag"]) == ("_chunk_bwd_kernel", "posrf/orf-bfloat16-D64-causal")]
        assert bwd and ceilings["_chunk_bwd_kernel", "posrf/orf-bfloat16-D64-causal"] == max(bwd)
        assert all(k in ceilings for k in aot.KNOWN_SPILLS)  # the report compiles every one
    else:
        assert ceilings is None
    other = tmp_path / "report.json"
    other.write_text(json.dumps({**doc, "env": {**doc["env"], "triton": "0.0"}}))
    assert aot.spill_ceilings(other) is None
    assert aot.spill_ceilings(tmp_path / "absent.json") is None


def test_a_broken_launch_is_reported(launches):
    """The check can fail: an unknown tl.dot precision does not compile."""
    bad = copy.deepcopy(next(r for r in launches if r["name"] == "_fwd_q_kernel"))
    bad["args"]["PRECISION"] = ["str", "not-a-precision"]
    rows = aot.compile_in_child([bad], arch=90, configs="smallest")
    assert rows[0]["status"].startswith("error")
    assert aot.failures(rows) and "_fwd_q_kernel" in aot.failures(rows)[0]


def test_tensor_instructions_are_counted_by_kind():
    """The report tells one bf16 product (k = 16 per HGMMA: 4 for k = 64) from TF32 (k = 8: 8)
    and from three TF32 products (24); the kernels' ``half_dot`` is one bf16 product."""
    assert aot.product_kinds_in_child() == {
        "bf16/ieee": {"HGMMA.64x64x16.F32.BF16": 4},
        "fp32/tf32": {"HGMMA.64x64x8.F32.TF32": 8},
        "fp32/tf32x3": {"HGMMA.64x64x8.F32.TF32": 24},
        "fp32/half_dot": {"HGMMA.64x64x16.F32.BF16": 4},  # kernels.common.half_dot
    }


def test_ctas_per_sm():
    # 255 registers at 4 warps: 8192 per warp, 2 CTAs by registers; 96 KiB + 1 KiB reserve: 2
    assert aot.ctas_per_sm(255, 4, 96 * 1024) == 2
    # 168 registers: 5376 per warp, 3 CTAs; 110 KiB shared memory caps it at 2
    assert aot.ctas_per_sm(168, 4, 40 * 1024) == 3
    assert aot.ctas_per_sm(168, 4, 110 * 1024) == 2
    # tiny kernels: the 2048-thread limit (16 CTAs of 4 warps) and the 32-CTA limit
    assert aot.ctas_per_sm(32, 4, 0) == 16
    assert aot.ctas_per_sm(32, 1, 0) == 32


# torch.compile with dynamic shapes (issue 40): validation, branches and loops on the length must
# not need its value, so the first dynamic compile serves every later length. Lengths above 64
# give the torch path's causal blocks more than one chunk (its scan over them, blocked.py).
LENGTHS = (16, 24, 40, 100)


def _dynamic(fn, fullgraph=True):
    """``(compiled fn, its compile counter)``: ``torch.compile(fn, dynamic=True)`` on aot_eager
    (autograd traced as inductor would take it, no C++ compile)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    return torch.compile(fn, dynamic=True, fullgraph=fullgraph, backend=counter), counter


def _qkv(T, dtype=torch.float32, kv_heads=2, grad=False):
    g = torch.Generator().manual_seed(T)
    shapes = ((1, 2, T, 64), (1, kv_heads, T, 64), (1, kv_heads, T, 64))
    return [(0.5 * torch.randn(*s, generator=g, dtype=dtype)).requires_grad_(grad) for s in shapes]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_dynamic_lengths_compile_once(backend, causal):
    """One graph for every length (it was one per length on the causal torch path, whose blocks
    and chunks were Python loops over T, and two on the fused path, whose decode step is taken
    for T <= 16), each output equal to the eager call's."""
    rf = rfattn.RandomFeatures(64, 32, feature="posrf", seed=0)

    def f(q, k, v):
        return rfattn.rf_attention(q, k, v, rf, causal=causal, backend=backend)

    compiled, counter = _dynamic(f)
    for T in LENGTHS:
        q, k, v = _qkv(T)
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dynamic_scale_of_the_length(backend):
    """A scale computed from the symbolic length (a length-dependent temperature): validated
    without its value (``math.isfinite`` of a SymFloat broke the trace) and never specialised
    (the operators take a float: it goes into q and k), equal to the eager call's; a scale that
    is not > 0 for some length still raises naming it."""
    rf = rfattn.RandomFeatures(64, 32, feature="posrf", seed=0)

    def f(q, k, v):
        return rfattn.rf_attention(q, k, v, rf, causal=True, backend=backend,
                                   scale=2.0 / q.shape[-2])  # fmt: skip

    compiled, counter = _dynamic(f)
    for T in LENGTHS[:3]:
        q, k, v = _qkv(T)
        torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1

    def g(q, k, v):
        return rfattn.rf_attention(q, k, v, rf, backend=backend, scale=(q.shape[-2] - 20) / 64)

    compiled, _ = _dynamic(g, fullgraph=False)  # (fullgraph: Dynamo reports any raise as its own)
    compiled(*_qkv(24))
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        compiled(*_qkv(16))


def test_dynamic_lengths_gradients_torch_path():
    """The causal torch path under dynamic shapes (blocks of a symbolic chunk count: the chunk
    states as one product, blocked._chunk_scan) with a key padding mask, grouped heads and the
    returned state: outputs, states and gradients equal to eager in float64, one graph."""
    rf = rfattn.RandomFeatures(64, 32, feature="posrf", seed=0).double()

    def f(q, k, v, mask):
        return rfattn.rf_attention(q, k, v, rf, causal=True, key_padding_mask=mask,
                                   backend="torch", return_state=True)  # fmt: skip

    compiled, counter = _dynamic(f)
    for T in (40, 100, 136, 3):
        mask = torch.zeros(1, T, dtype=torch.bool)
        mask[0, T // 2 :: 3] = True
        args = _qkv(T, torch.float64, kv_heads=1, grad=True)
        ref_args = [x.detach().clone().requires_grad_() for x in args]
        (out, state), (ref, ref_state) = compiled(*args, mask), f(*ref_args, mask)
        torch.testing.assert_close(out, ref)
        for a, b in zip(state, ref_state, strict=True):
            torch.testing.assert_close(a, b)
        (out.square().sum() + state.s.sum()).backward()
        (ref.square().sum() + ref_state.s.sum()).backward()
        for a, b in zip(args, ref_args, strict=True):
            torch.testing.assert_close(a.grad, b.grad)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_max_seqlen_compiles_once(backend, causal):
    """Packed sequences with ``max_seqlen``: no host read of the offsets, so one graph
    (``fullgraph``, static shapes) serves offsets of other values, outputs and gradients equal
    to the eager host-offsets call's (without max_seqlen the offsets' ``tolist`` breaks the
    graph)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    rf = rfattn.RandomFeatures(64, 32, feature="posrf", seed=0).double()

    def f(q, k, v, cu, max_seqlen=None):
        return rfattn.rf_attention(q, k, v, rf, causal=causal, backend=backend, cu_seqlens=cu,
                                   max_seqlen=max_seqlen)  # fmt: skip

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda *a: f(*a, max_seqlen=24), fullgraph=True, backend=counter)
    for lengths in ((5, 0, 24, 11), (24, 1, 1, 14), (10, 10, 10, 10)):
        cu = torch.tensor([0, *lengths]).cumsum(0)
        args = _qkv(40, torch.float64, kv_heads=1, grad=True)
        ref_args = [x.detach().clone().requires_grad_() for x in args]
        out, ref = compiled(*args, cu), f(*ref_args, cu)
        torch.testing.assert_close(out, ref)
        out.square().sum().backward()
        ref.square().sum().backward()
        for a, b in zip(args, ref_args, strict=True):
            torch.testing.assert_close(a.grad, b.grad)
    assert counter.frame_count == 1
