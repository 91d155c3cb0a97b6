"""Causal chunked kernel (kernels/rf_chunk.py) against the float64 torch path on the same W.

The torch path is itself checked against ``rfattn.reference.linear_attention(causal=True)`` in
test_attention.py. On CPU these run under the Triton interpreter with 16-token chunks.
"""

import copy
import math
import re

import pytest
import torch
from rfattn.kernels.common import forget_plans
from rfattn.kernels.rf_chunk import rf_chunk_fwd
from rfattn.kernels.rf_recurrent import rf_recurrent_fwd

import rfattn
from rfattn.features.form import KernelForm
from rfattn.fused import kernel_form
from rfattn.ops import rf_chunk, rf_decode
from rfattn.testing import rel_rms, tolerance

f32, f64 = torch.float32, torch.float64


@pytest.fixture
def fresh_plans():
    """The launchers' plans forgotten after the test (it made them with a kernel or a segment
    policy of its own)."""
    yield
    forget_plans()


def rand(*shape, seed=0, scale=1.0, dtype=f32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=f64) * scale).to(device, dtype)


def at_offset(state, offset):
    """S and z of ``state`` brought to ``offset`` (states are equal up to their offsets)."""
    f = torch.exp(state.offset - offset)
    return state.s * f[..., None, None], state.z * f[..., None]


def compare(q, k, v, rf, mask=None, initial_state=None, seed=0):
    """Relative RMS errors of the kernel (input dtype) against the float64 torch path: output,
    final state, and gradients from random cotangents on the output and the final state."""
    rf64 = copy.deepcopy(rf).double()
    args = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref_args = [x.detach().double().requires_grad_() for x in (q, k, v)]
    kw = dict(causal=True, key_padding_mask=mask, return_state=True)
    init64 = None if initial_state is None else rfattn.RFState(*(x.double() for x in initial_state))
    out, st = rfattn.rf_attention(*args, rf, backend="triton", initial_state=initial_state, **kw)
    ref, rst = rfattn.rf_attention(*ref_args, rf64, backend="torch", initial_state=init64, **kw)
    g = torch.Generator().manual_seed(seed)
    do, ds, dz = (
        torch.randn(x.shape, generator=g, dtype=f64).to(x.device) for x in (ref, rst.s, rst.z)
    )
    # the state's cotangents act on the offset-invariant S e^offset (offsets are stabilisers)
    e, e64 = torch.exp(st.offset.detach()), torch.exp(rst.offset.detach())
    loss = (out * do.to(out.dtype)).sum() + (st.s * e[..., None, None] * ds.to(st.s.dtype)).sum()
    loss = loss + (st.z * e[..., None] * dz.to(st.z.dtype)).sum()
    loss64 = (ref * do).sum() + (rst.s * e64[..., None, None] * ds).sum()
    loss64 = loss64 + (rst.z * e64[..., None] * dz).sum()
    loss.backward()
    loss64.backward()
    s, z = at_offset(st, rst.offset)
    errs = {"out": rel_rms(out, ref), "S": rel_rms(s, rst.s), "z": rel_rms(z, rst.z)}
    errs.update(
        {"d" + n: rel_rms(a.grad, b.grad) for n, a, b in zip("qkv", args, ref_args, strict=True)}
    )
    return errs


SLOW = pytest.mark.slow  # make test-slow (CI); the fast cases cover every kernel and form
SHAPES = [  # B, H, T, D, M, E
    (1, 2, 1, 16, 24, 8),
    pytest.param((2, 3, 63, 16, 40, 24), marks=SLOW),  # ~9 s; T = 40 crosses chunks too
    pytest.param((1, 2, 257, 32, 72, 20), marks=SLOW),
    (2, 1, 40, 24, 17, 33),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-T{}-D{}-M{}-E{}".format(*s))
def test_parity_fp32(shape, kernel_device):
    B, H, T, D, M, E = shape
    q = rand(B, H, T, D, seed=1, scale=0.7, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.7, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device)
    errs = compare(q, k, v, rf)
    if T == 1:  # one key: out = v whatever q and k are; their gradients vanish (checked below)
        del errs["dq"], errs["dk"]
    assert max(errs.values()) <= tolerance(f32, "grad"), errs
    if T == 1:
        q1, k1 = q.clone().requires_grad_(), k.clone().requires_grad_()
        rfattn.rf_attention(q1, k1, v, rf, causal=True, backend="triton").sum().backward()
        assert q1.grad.abs().max() <= 1e-6 and k1.grad.abs().max() <= 1e-6


GERF_FAMILY = [
    ("hyprf", {}),
    ("gerf", {"A": -0.1}),
    ("oprf", {"stats": "fixed", "A": -0.05}),
    ("oprf", {}),  # running statistics, the causal default
    ("saderf", {"stats": "fixed", "psi": [1.5] * 8 + [0.7] * 8}),
]


@pytest.mark.parametrize("feature,opts", GERF_FAMILY, ids=str)
def test_gerf_family_with_left_padding_and_strides(feature, opts, kernel_device):
    B, H, T, D, M, E = 2, 2, 45, 16, 24, 16
    q = rand(B, T, H, D, seed=1, scale=0.7, device=kernel_device).transpose(1, 2)
    k = rand(B, H, T, D, seed=2, scale=0.7, device=kernel_device)
    v = rand(B, H, T, 2 * E, seed=3, device=kernel_device)[..., ::2]
    mask = torch.zeros(B, T, dtype=torch.bool, device=kernel_device)
    mask[0, :19] = True  # left padding (batched generation), across a chunk boundary
    k[:, :, :19][mask[:, None, :19, None].expand(B, H, 19, D)] = float("nan")
    rf = rfattn.RandomFeatures(D, M, feature=feature, seed=4, **opts).to(kernel_device)
    if feature == "oprf" and not opts:  # give the running statistics something to hold
        rf.feature_map.running_sq.fill_(0.3)
        rf.feature_map.num_batches_tracked.fill_(1)
        rf.eval()
    errs = compare(q, k, v, rf, mask=mask)
    assert max(errs.values()) <= tolerance(f32, "grad"), errs


def test_initial_state_and_split_resume(kernel_device):
    B, H, T, D, M, E = 1, 2, 70, 16, 20, 16
    q = rand(B, H, T, D, seed=1, scale=0.7, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.7, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device)
    kw = dict(causal=True, backend="triton", return_state=True)
    full, st_full = rfattn.rf_attention(q, k, v, rf, **kw)
    for cuts in ([0, 30, 70], [0, 5] + list(range(6, 20)) + [70]):
        outs, st = [], None
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            sl = slice(a, b)
            o, st = rfattn.rf_attention(
                q[:, :, sl], k[:, :, sl], v[:, :, sl], rf, initial_state=st, **kw
            )
            outs.append(o)
        assert rel_rms(torch.cat(outs, 2), full) <= 1e-6
        s, z = at_offset(st, st_full.offset)
        assert rel_rms(s, st_full.s) <= 1e-6 and rel_rms(z, st_full.z) <= 1e-6
    # gradients through an initial state (and states across backends)
    _, st_torch = rfattn.rf_attention(
        q[:, :, :30],
        k[:, :, :30],
        v[:, :, :30],
        rf,
        causal=True,
        backend="torch",
        return_state=True,
    )
    init = rfattn.RFState(*(x.detach() for x in st_torch))
    errs = compare(q[:, :, 30:], k[:, :, 30:], v[:, :, 30:], rf, initial_state=init)
    assert max(errs.values()) <= tolerance(f32, "grad"), errs


@SLOW  # the segments case below covers the same tiles in make test
def test_feature_tiles_far_apart(kernel_device):
    """The states pass keeps each feature tile at its own running offset; the output, the final
    state and the backward bring them to the common one (the largest): two tiles (64 + 16
    features on CPU) whose largest key logits lie 80-95 apart, in float64 against the torch
    path."""
    B, H, T, D, M, E = 1, 2, 40, 16, 80, 8
    q = rand(B, H, T, D, seed=1, scale=3.0, dtype=f64, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=3.0, dtype=f64, device=kernel_device)
    v = rand(B, H, T, E, seed=3, dtype=f64, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device).double()
    with torch.no_grad():
        rf.weight[64:] *= 6.0  # the second tile's logits: ~6x the first's spread
    errs = compare(q, k, v, rf)
    assert max(errs.values()) <= tolerance(f64, "grad"), errs


def test_segments_carry_the_state_and_its_cotangent(monkeypatch, kernel_device, fresh_plans):
    """Walks split into segments (on CPU three, of 2, 2 and 1 chunks) carry the state forward
    and its cotangent back between them: outputs, final state and the gradients of q, k, v and
    the initial state as the torch path's, in float64, with two feature tiles far apart."""
    from rfattn.kernels import rf_chunk as kernels

    monkeypatch.setattr(kernels, "HOST_SEGMENTS", 3)
    forget_plans()  # none made with two segments (fresh_plans forgets these after the test)
    B, H, T, D, M, E = 1, 2, 90, 16, 80, 8
    q, k = (rand(B, H, T, D, seed=s, scale=3.0, dtype=f64, device=kernel_device) for s in (1, 2))
    v = rand(B, H, T, E, seed=3, dtype=f64, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device).double()
    with torch.no_grad():
        rf.weight[64:] *= 6.0
    kw = dict(causal=True, return_state=True)
    _, st = rfattn.rf_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], rf, backend="torch",
                                **kw)  # fmt: skip
    g = torch.Generator().manual_seed(5)
    do, ds, dz = (torch.randn(x.shape, generator=g, dtype=f64).to(kernel_device)
                  for x in (v[:, :, 20:], st.s, st.z))  # fmt: skip
    res = []
    for backend in ("triton", "torch"):
        x = [t[:, :, 20:].clone().requires_grad_() for t in (q, k, v)]
        s0, z0 = st.s.detach().clone().requires_grad_(), st.z.detach().clone().requires_grad_()
        out, st1 = rfattn.rf_attention(*x, rf, backend=backend,
                                       initial_state=rfattn.RFState(s0, z0, st.offset), **kw)
        e = torch.exp(st1.offset.detach())  # the offset-invariant state
        s1, z1 = st1.s * e[..., None, None], st1.z * e[..., None]
        loss = (out * do).sum() + (s1 * ds).sum() + (z1 * dz).sum()
        res.append([out, s1, z1, *torch.autograd.grad(loss, [*x, s0, z0])])
    errs = {n: rel_rms(a, b) for n, a, b in zip(("out", "S", "z", "dq", "dk", "dv", "dS0", "dz0"),
                                                *res, strict=True)}  # fmt: skip
    assert max(errs.values()) <= tolerance(f64, "grad"), errs


def test_no_chunk_state_in_memory(kernel_device):
    """What a causal forward and backward allocate: no per-chunk state ``[NC, F, E]`` (the walks
    keep the state and its cotangent on chip; only the segments' carries are in memory).
    Every allocation of the calls is seen (a dispatch mode on ``aten.empty`` and kin), the
    launchers' scratch included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    sizes = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] in ("empty", "empty_strided", "empty_like",
                                               "new_empty", "zeros", "zeros_like"):  # fmt: skip
                sizes.append(out.numel())
            return out

    chunk = 16 if kernel_device.type == "cpu" else 64
    B, H, D, M, E = 1, 2, 16, 64, 32
    T = 8 * chunk - 14  # eight chunks (CPU: two segments of four)
    q, k = (rand(B, H, T, D, seed=s, device=kernel_device).requires_grad_() for s in (1, 2))
    v = rand(B, H, T, E, seed=3, device=kernel_device).requires_grad_()
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device)
    states = B * H * 8 * M * E  # the per-chunk states there are not
    with Allocations():
        out = rfattn.rf_attention(q, k, v, rf, causal=True, backend="triton")
    assert sizes and [n for n in sizes if n >= states] == []
    sizes.clear()
    with Allocations():
        out.sum().backward()
    assert sizes and [n for n in sizes if n >= states] == []


#: the benchmark shape of the causal memory and parallelism targets: B, H, D, E, M (bf16)
PLAN_SHAPE = (4, 16, 64, 64, 256)


def _plan(monkeypatch, T: int):
    """(launches as (kernel, grid), bytes of every buffer the launchers allocate beyond their
    outputs, the forward's row statistics that the backward takes and the returned state: the
    scratch) of a bf16 causal forward and backward at :data:`PLAN_SHAPE` on an H100's 132 SMs,
    from the launchers' own plans (:func:`rf_chunk.plans`: made without launching)."""
    from rfattn.kernels import rf_chunk as kernels

    monkeypatch.setattr(kernels, "sm_count", lambda device: 132)
    B, H, D, E, M = PLAN_SHAPE
    q, k = (torch.empty(B, H, T, D, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(B, H, T, E, dtype=torch.bfloat16)
    w = torch.randn(M, D, generator=torch.Generator().manual_seed(0))
    fwd, bwd = kernels.plans(q, k, v, KernelForm("gerf", w), D**-0.5, gpu_tiles=True)
    launches = [(x.kernel.fn.__name__, x.grid)
                for x in (fwd.states, fwd.out, bwd.states, bwd.dstates, bwd.bwd)]  # fmt: skip
    scratch = (fwd.scratch, bwd.scratch)
    return launches, sum(x.total * x.dtype.itemsize for x in scratch)


def test_plan_memory_and_parallelism_at_the_benchmark_shape(monkeypatch):
    """Causal forward and backward at B4 H16 D64 E64 M256 bf16 on 132 SMs: 2 + 3 launches,
    each with at least two programs per SM; no walk longer than 32 chunks; at T = 8192 the
    intermediate buffers of both (the segments' carries and the cotangents', the backward's
    chunk offsets) within 64 MiB (per-chunk states took 532 MiB in the forward and 1 GiB more
    in the backward)."""
    from rfattn.kernels.rf_chunk import segments

    B, H = PLAN_SHAPE[:2]
    for T in (1024, 8192, 16384):
        launches, nbytes = _plan(monkeypatch, T)
        assert [n for n, _ in launches] == ["_chunk_states_kernel", "_chunk_out_kernel",
                                            "_chunk_states_kernel", "_chunk_dstates_kernel",
                                            "_chunk_bwd_kernel"]  # fmt: skip
        assert all(math.prod(grid) >= 2 * 132 for _, grid in launches), launches
        NS, per = segments(T // 64, B * H, 132)
        assert launches[1][1] == (NS, B * H) and launches[4][1] == (2 * NS, B * H)
        assert per <= 32
        if T == 8192:
            assert nbytes <= 64 * 2**20, nbytes / 2**20


@SLOW
def test_gradcheck_float64_with_state(kernel_device):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g, dtype=f64).to(kernel_device)

    w = r(4, 3)
    q, k, v = (
        (0.5 * r(1, 1, 5, 3)).requires_grad_(),
        (0.5 * r(1, 1, 5, 3)).requires_grad_(),
        r(1, 1, 5, 2).requires_grad_(),
    )
    s0 = r(1, 1, 4, 2).abs().requires_grad_()
    z0 = (r(1, 1, 4).abs() + 0.5).requires_grad_()
    off0 = torch.full((1, 1), 0.3, dtype=f64, device=kernel_device)
    mask = torch.tensor([[True, False, False, True, False]], device=kernel_device)

    def fn(a, b, c, s, z):
        out, s1, z1, off = rf_chunk(a, b, c, KernelForm("gerf", w), 0.5, mask, (s, z, off0))
        e = torch.exp(off)  # offset-invariant state
        return out, s1 * e[..., None, None], z1 * e[..., None]

    assert torch.autograd.gradcheck(fn, (q, k, v, s0, z0))


def test_causality(kernel_device):
    B, H, T, D, M, E = 1, 2, 64, 16, 24, 16
    q = rand(B, H, T, D, seed=1, scale=0.7, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.7, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device)
    out = rfattn.rf_attention(q, k, v, rf, causal=True, backend="triton")
    t = 37  # inside the third 16-token chunk (on CPU)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1 :] *= 3.0  # larger keys: moves the running max of t's chunk
    v2[:, :, t + 1 :] = 100.0
    out2 = rfattn.rf_attention(q, k2, v2, rf, causal=True, backend="triton")
    # within t's chunk the shared offset may move (fp32 rounding); earlier chunks: bitwise
    assert rel_rms(out2[:, :, : t + 1], out[:, :, : t + 1]) <= 1e-6
    chunk_start = 32 if kernel_device.type == "cpu" else 0
    assert torch.equal(out2[:, :, :chunk_start], out[:, :, :chunk_start])
    assert (out2[:, :, t + 1 :] - out[:, :, t + 1 :]).abs().max() > 1.0


def test_deterministic_and_empty(kernel_device):
    q = rand(1, 2, 50, 16, seed=1, device=kernel_device).requires_grad_()
    k = rand(1, 2, 50, 16, seed=2, device=kernel_device).requires_grad_()
    v = rand(1, 2, 50, 16, seed=3, device=kernel_device).requires_grad_()
    rf = rfattn.RandomFeatures(16, 24, seed=0).to(kernel_device)
    res = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        out = rfattn.rf_attention(q, k, v, rf, causal=True, backend="triton")
        out.pow(2).sum().backward()
        res.append([out.detach().clone()] + [x.grad.clone() for x in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*res, strict=True))
    out, st = rfattn.rf_attention(
        q[:, :, :0], k[:, :, :0], v[:, :, :0], rf, causal=True, backend="triton", return_state=True
    )
    assert out.shape == (1, 2, 0, 16) and torch.equal(st.s, torch.zeros_like(st.s))
    assert torch.isinf(st.offset).all()


@pytest.mark.parametrize("dtype", [f32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_the_gpu_tiles_compute_what_the_interpreters_tiles_do(dtype):
    """The causal launchers at a GPU's tiles (64-token chunks, 32 features a tile: for 16-bit
    inputs at 8 warps, ``kernels.common._chunk_tiles``), run by the interpreter: fp32 equal to
    the interpreter's own tiles (16-token chunks) to 1e-5; bf16 (the half policy) as far from
    float64 as they are, within 1.25x, outputs and gradients. A partial last chunk, 2 heads."""
    from rfattn.kernels.rf_chunk import rf_chunk_bwd

    B, H, T, D, M = 1, 2, 70, 64, 64
    rf = rfattn.RandomFeatures(D, M, seed=0)
    q, k = (rand(B, H, T, D, seed=s, scale=0.5) for s in (1, 2))
    v, do = rand(B, H, T, D, seed=3), rand(B, H, T, D, seed=4)

    def run(dt, tiles):
        x = [t.to(dt) for t in (q, k, v)]
        form = kernel_form(rf, x[0], x[1], None, D**-0.5, True)
        out, _, aux = rf_chunk_fwd(*x, form, D**-0.5, return_aux=True, gpu_tiles=tiles)
        grads = rf_chunk_bwd(do.to(dt), None, *x, form, D**-0.5, out, aux, gpu_tiles=tiles)[:3]
        return (out, *grads)

    gpu, own = run(dtype, True), run(dtype, False)
    if dtype == f32:
        for a, b in zip(gpu, own, strict=True):
            assert rel_rms(a, b) <= 1e-5
        return
    ref = run(torch.float64, False)
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), gpu, own, ref, strict=True):
        assert rel_rms(a, r) <= 1.25 * rel_rms(b, r), name


def test_learnable_weights_go_to_torch(kernel_device):
    q = rand(1, 1, 20, 16, seed=1, device=kernel_device)
    rf = rfattn.RandomFeatures(16, 16, weights="fastfoodl").to(kernel_device)
    with pytest.raises(NotImplementedError, match="learnable"):
        rfattn.rf_attention(q, q, q, rf, causal=True, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_parity_low_precision_gpu(dtype):
    """flash-attention rule: kernel error <= 2x (outputs) / 3x (grads) the torch path's own
    error in the same dtype, both against float64."""
    B, H, T, D, M, E = 2, 4, 1000, 64, 256, 64
    q = rand(B, H, T, D, seed=1, scale=0.7, dtype=dtype, device="cuda")
    k = rand(B, H, T, D, seed=2, scale=0.7, dtype=dtype, device="cuda")
    v = rand(B, H, T, E, seed=3, dtype=dtype, device="cuda")
    rf = rfattn.RandomFeatures(D, M, seed=0).cuda()
    kernel = compare(q, k, v, rf)
    rf64 = copy.deepcopy(rf).double()
    ref_args = [x.detach().double().requires_grad_() for x in (q, k, v)]
    args = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    ref = rfattn.rf_attention(*ref_args, rf64, causal=True, backend="torch")
    out = rfattn.rf_attention(*args, rf, causal=True, backend="torch")
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0), dtype=f64).cuda()
    (out * do.to(dtype)).sum().backward()
    (ref * do).sum().backward()
    assert kernel["out"] <= max(2 * rel_rms(out, ref), tolerance(dtype) / 10), kernel
    for n, a, b in zip("qkv", args, ref_args, strict=True):
        assert kernel["d" + n] <= max(3 * rel_rms(a.grad, b.grad), tolerance(dtype, "grad") / 10)


SIGNED = [
    ("trigrf", "orf", {}),
    pytest.param("hrf", "orf", {"lambda_features": 2}, marks=SLOW),  # ~6 s; test_bad_data's hrf
    pytest.param("hrf", "orf", {}, marks=SLOW),
    pytest.param("gerf", "orf", {"A": 0.1j}, marks=SLOW),  # ~6 s; trigrf's table form covers it
    ("rmf", "rademacher", {}),
    ("rmf", "rademacher", {"dot_kernel": "inverse", "mode": "paper"}),
    pytest.param("posrf", "sgq", {}, marks=SLOW),
]


@pytest.mark.parametrize("feature,weights,opts", SIGNED, ids=str)
def test_signed_and_plain_features(feature, weights, opts, kernel_device):
    """Signed (table form) and plain (rmf) features in the causal kernel, with left padding."""
    B, H, T, D, E = 2, 2, 40, 8, 16
    M = 2 * D * D + 4 * D + 1 if weights == "sgq" else 20
    q = rand(B, H, T, D, seed=1, scale=0.4, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.4, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=kernel_device)
    mask[1, :9] = True
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=4, **opts)
    errs = compare(q, k, v, rf.to(kernel_device), mask=mask)
    assert max(errs.values()) <= tolerance(f32, "grad"), errs


# ------------------------------------------------------------------------------------------------
# the decode step (kernels/rf_recurrent.py)

DECODE = [
    # ~8 s under the interpreter: make test-slow (in make test tests/test_ops.py holds the
    # decode kernel against the operators' torch kernels, the chunked form)
    pytest.param("posrf", "orf", {}, marks=SLOW),
    pytest.param("trigrf", "orf", {}, marks=SLOW),
    pytest.param("rmf", "rademacher", {}, marks=SLOW),
    pytest.param("oprf", "orf", {"stats": "fixed", "A": -0.05}, marks=SLOW),
]


@pytest.mark.parametrize("feature,weights,opts", DECODE, ids=str)
def test_decode_step_equals_chunked(feature, weights, opts, kernel_device):
    """Token by token through the decode step == one chunked call (outputs and final state);
    a few-token step from a state == the chunked kernel from the same state."""
    B, H, T, D, M, E = 2, 2, 24, 16, 20, 12
    q = rand(B, H, T, D, seed=1, scale=0.6, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.6, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    mask = torch.zeros(B, T, dtype=torch.bool, device=kernel_device)
    mask[1, :7] = True
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=1, **opts)
    rf = rf.to(kernel_device)
    kw = dict(causal=True, backend="triton", return_state=True)
    with torch.no_grad():
        full, st = rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask, **kw)
        outs, s = [], None
        for t in range(T):  # one token per call: the decode step
            sl = slice(t, t + 1)
            o, s = rfattn.rf_attention(
                q[:, :, sl],
                k[:, :, sl],
                v[:, :, sl],
                rf,
                initial_state=s,
                key_padding_mask=mask[:, sl],
                **kw,
            )
            outs.append(o)
    assert rel_rms(torch.cat(outs, 2), full) <= 1e-6
    s_at, z_at = at_offset(s, st.offset)
    assert rel_rms(s_at, st.s) <= 1e-6 and rel_rms(z_at, st.z) <= 1e-6
    # the step itself against the chunked kernel, 5 tokens from a mid-sequence state
    form = kernel_form(rf, q, k, None, D**-0.5, causal=True)
    _, init = rf_chunk_fwd(q[:, :, :10], k[:, :, :10], v[:, :, :10], form, D**-0.5)
    init_copy = tuple(x.clone() for x in init)
    sl = slice(10, 15)
    step, st1 = rf_recurrent_fwd(
        q[:, :, sl], k[:, :, sl], v[:, :, sl], form, D**-0.5, initial_state=init
    )
    ref, st2 = rf_chunk_fwd(
        q[:, :, sl], k[:, :, sl], v[:, :, sl], form, D**-0.5, initial_state=init
    )
    assert rel_rms(step, ref) <= 1e-6
    assert all(torch.equal(a, b) for a, b in zip(init, init_copy, strict=True))  # not mutated
    assert torch.allclose(st1[2], st2[2]) and rel_rms(st1[0], st2[0]) <= 1e-6
    # in place (the decode operator a generation cache uses): the same state, in init's tensors
    out, *new = rf_decode(
        q[:, :, sl], k[:, :, sl], v[:, :, sl], form, D**-0.5, initial_state=init, inplace=True
    )
    assert all(a is b for a, b in zip(new, init, strict=True)) and torch.equal(out, step)
    assert all(torch.equal(a, b) for a, b in zip(init, st1, strict=True))


@pytest.mark.parametrize("backend", ["kernel", "torch"])
def test_decode_from_a_pool_of_states(backend, monkeypatch, kernel_device):
    """A batch whose rows continue rows of a pool of states (``state_index``, grouped-query
    heads) equals the same step from those states gathered: outputs and new states in float64;
    in place, the indexed rows of the pool become the new states and no other row changes; an
    index out of range, repeated for an in-place step, of the wrong type or length is refused.
    On the kernel (interpreter / GPU) and on the operators' torch kernels."""
    from rfattn import ops

    device = kernel_device if backend == "kernel" else torch.device("cpu")
    monkeypatch.setattr(ops, "TORCH_ON_CPU", backend == "torch")
    B, P, Hq, H, D, M, E = 3, 5, 4, 2, 8, 16, 5
    rf = rfattn.RandomFeatures(D, M, seed=4).double().to(device)
    q = rand(P, Hq, 9, D, seed=1, dtype=f64, device=device)
    k = rand(P, H, 9, D, seed=2, dtype=f64, device=device)
    v = rand(P, H, 9, E, seed=3, dtype=f64, device=device)
    form = kernel_form(rf, q[:, :2], k, None, D**-0.5, causal=True)
    pool = rf_chunk(q[:, :, :7], k[:, :, :7], v[:, :, :7], form, D**-0.5)[1:]  # P states
    index = torch.tensor([3, 0, 4], device=device)
    step = (q[:B, :, 7:], k[:B, :, 7:], v[:B, :, 7:])  # two new tokens per row
    gathered = tuple(x[index].clone() for x in pool)
    out_ref, *new_ref = rf_decode(*step, form, D**-0.5, initial_state=gathered)
    out, *new = rf_decode(*step, form, D**-0.5, initial_state=pool, state_index=index)
    assert rel_rms(out, out_ref) <= 1e-12
    for a, b in zip(new, new_ref, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-12, atol=0)
    before = tuple(x.clone() for x in pool)
    out2, *kept = rf_decode(*step, form, D**-0.5, initial_state=pool, inplace=True,
                            state_index=index)  # fmt: skip
    assert rel_rms(out2, out_ref) <= 1e-12 and all(a is b for a, b in zip(kept, pool, strict=True))
    others = torch.tensor([1, 2], device=device)
    for x, x0, ref in zip(pool, before, new_ref, strict=True):
        assert torch.allclose(x[index], ref, rtol=1e-12, atol=0)
        assert torch.equal(x[others], x0[others])
    for bad, error in ((torch.tensor([3, 0, 5]), "lie in"), (torch.tensor([3, 3, 4]), "repeat"),
                       (torch.tensor([3.0, 0.0, 4.0]), "integer"), (torch.tensor([3, 0]), "[B]")):
        with pytest.raises((RuntimeError, TypeError, ValueError), match=re.escape(error)):
            rf_decode(*step, form, D**-0.5, initial_state=pool, inplace=True,
                      state_index=bad.to(device))  # fmt: skip


class _FakeKernel:
    """Launched like a Triton kernel (``kernel[grid](*args, **kwargs)``); its compile needs more
    shared memory than the GPU has above ``fits`` bytes, taking ``tile * stages`` (the tile
    constexpr ``BM``, 64 when not given), or runs short of ``resource`` at any size."""

    def __init__(self, name: str, fits: int, resource: str = "shared memory"):
        self.fn = type(name, (), {})  # named as the kernel, like JITFunction.fn
        self.fits, self.resource, self.tried = fits, resource, []

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def run(*args, num_stages, **kwargs):
            need = kwargs.get("BM", 64) * num_stages
            self.tried.append((kwargs.get("BM"), num_stages))
            if need > self.fits or self.resource != "shared memory":
                raise OutOfResources(need, self.fits, self.resource)
            return grid, args, kwargs

        return run


def test_launch_falls_back_until_it_fits():
    """A launch whose asked config runs out of shared memory (another Triton version's layout)
    runs with the first fallback that fits, fewer pipeline stages and then (the causal backward's
    feature tile) a halved loop tile; what fitted is remembered per specialisation, and what
    falling back cannot fix is raised."""
    from rfattn.kernels.common import launch
    from triton.runtime.errors import OutOfResources

    x = torch.zeros(2)
    k = _FakeKernel("_chunk_states_kernel", fits=64)  # no loop tile to halve: stages only
    assert launch(k, (4, 2), x, 7, BT=64, num_stages=3) == ((4, 2), (x, 7), {"BT": 64})
    assert k.tried == [(None, 3), (None, 2), (None, 1)]
    launch(k, (1,), torch.ones(3), 8, BT=64, num_stages=3)  # same specialisation: straight there
    assert k.tried[3:] == [(None, 1)]
    launch(k, (1,), x.double(), 7, BT=64, num_stages=3)  # another dtype: asks again
    launch(k, (1,), x, 7, BT=32, num_stages=3)  # another constexpr: asks again
    assert k.tried[4:] == [(None, 3), (None, 2), (None, 1)] * 2

    bwd = _FakeKernel("_chunk_bwd_kernel", fits=48)  # BM 64 never fits; 32 at one stage; 16 at 3
    assert launch(bwd, (1,), x, BM=64, num_stages=2)[2] == {"BM": 32}
    assert bwd.tried == [(64, 2), (64, 1), (32, 2), (32, 1)]
    assert launch(bwd, (1,), x, BM=64, num_stages=2)[2] == {"BM": 32}
    assert bwd.tried[4:] == [(32, 1)]

    fits = _FakeKernel("_chunk_bwd_kernel", fits=10**6)
    launch(fits, (1,), x, BM=64, num_stages=3)
    launch(fits, (1,), x, BM=64, num_stages=3)
    assert fits.tried == [(64, 3), (64, 3)]

    never = _FakeKernel("_chunk_bwd_kernel", fits=8)
    with pytest.raises(OutOfResources, match="shared memory"):
        launch(never, (1,), x, BM=32, num_stages=2)
    assert never.tried == [(32, 2), (32, 1), (16, 2), (16, 1)]
    regs = _FakeKernel("_chunk_bwd_kernel", fits=10**6, resource="registers")
    with pytest.raises(OutOfResources, match="registers"):
        launch(regs, (1,), x, BM=64, num_stages=3)
    assert regs.tried == [(64, 3)]


class _Refusing:
    """A real kernel that "runs out of shared memory" while its tile ``BM`` is above ``most``."""

    def __init__(self, kernel, most: int):
        self.kernel, self.fn, self.most, self.tiles = kernel, kernel.fn, most, []

    def __getitem__(self, grid):
        from triton.runtime.errors import OutOfResources

        def run(*args, **kwargs):
            self.tiles.append(kwargs["BM"])
            if kwargs["BM"] > self.most:
                raise OutOfResources(kwargs["BM"], self.most, "shared memory")
            return self.kernel[grid](*args, **kwargs)

        return run


@pytest.mark.parametrize(
    "feature,weights",
    # ~9 s each under the interpreter (make test stayed under 5 minutes by a few seconds)
    [pytest.param("posrf", "orf", marks=SLOW), pytest.param("rmf", "rademacher", marks=SLOW)],
)
def test_backward_with_the_feature_tile_halved(feature, weights, monkeypatch, kernel_device,
                                               fresh_plans):  # fmt: skip
    """The causal backward's fallback (its feature tile halved, :data:`LOOP_TILES`) gives the
    same gradients: the tile only loops inside the kernel."""
    from rfattn.kernels import rf_chunk

    refusing = _Refusing(rf_chunk._chunk_bwd_kernel, most=16)
    monkeypatch.setattr(rf_chunk, "_chunk_bwd_kernel", refusing)
    forget_plans()  # plans bind the kernel they were made with
    B, H, T, D, M, E = 2, 3, 63, 16, 40, 24
    q = rand(B, H, T, D, seed=1, scale=0.7, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.7, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=4).to(kernel_device)
    errs = compare(q, k, v, rf)
    assert refusing.tiles[0] > 16 and refusing.tiles[-1] == 16  # it fell back, to 16
    assert max(errs.values()) <= tolerance(f32, "grad"), errs
