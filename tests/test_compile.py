"""The fused kernels compile for a Hopper GPU (sm_90), checked here without one (bench/compile.py).

The interpreter runs the kernels' semantics but accepts code that compiled Triton rejects (a
helper whose constexpr-dead branches return other types, a module global that is not a
``tl.constexpr``, a tile needing more shared memory than the GPU has). This test records the
launches of every fused path, feature form and flag on D = 64 in fp32 and bf16 and on D = 256 in
fp32 (the widest tiles: they need the unpipelined fallback configs), and compiles for sm_90 the
smallest config each autotuner tries, with Triton's own ptxas (no driver needed). On a CUDA
machine the GPU tests compile every kernel for real, so it is skipped there.
"""

import copy

import pytest
import torch

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
        "_recurrent_kernel", "_stats_kernel", "_fwd_kv_stats_kernel",
    }  # fmt: skip
    return recorded


def test_every_launch_compiles_for_sm90(launches):
    rows = aot.compile_in_child(launches, arch=90, configs="smallest")
    assert len(rows) == len(launches)
    assert aot.failures(rows) == []
    assert all(r["shared_bytes"] <= aot.SMEM_LIMIT[90] for r in rows)


def test_no_half_policy_config_spills(launches):
    """bf16 inputs at D = E = 64, M = 256 (the compile report's scenarios, every feature form and
    flag): no autotune config the non-causal kernels (and the decode step) offer spills on sm_90
    (``bench.compile.NO_SPILL``), but for the rows still known to spill
    (``bench.compile.KNOWN_SPILLS``: signed tables, rmf, three decode cases), and none of those
    has stopped spilling unnoticed. The causal kernels are reported (``python -m bench.compile
    --save-results``), not held to it here: their tiles follow in their own change."""
    half = [r for r in launches if "-bfloat16-D64" in r["tag"] and r["name"] in aot.NO_SPILL]
    assert {r["name"] for r in half} >= {"_fwd_kv_kernel", "_fwd_q_kernel", "_bwd_dqkv_kernel"}
    rows = aot.compile_in_child(half, arch=90, configs="all")
    assert aot.failures(rows) == []
    assert aot.unexpected_spills(rows) == []


def test_spills_are_reported():
    """The check can fail: a spilling row of a held kernel is named, a causal one is not."""
    row = {"kernel": "_fwd_q_kernel", "tag": "t", "config": {}, "stack_bytes": 8, "registers": 255}
    assert len(aot.spills([row, {**row, "stack_bytes": 0}])) == 1
    assert aot.spills([{**row, "kernel": "_chunk_bwd_kernel"}]) == []


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
