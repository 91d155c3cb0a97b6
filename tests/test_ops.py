"""The fused forms as PyTorch operators (rfattn/ops.py): schema, fake (meta) implementations
and autograd registration checked by ``torch.library.opcheck``, and ``torch.compile`` with
``fullgraph=True`` seeing one operator per call (no graph break into the launchers).

On CPU the kernels run under the Triton interpreter; shapes are tiny."""

import dataclasses

import pytest
import torch

import rfattn
from rfattn.fused import kernel_form
from rfattn.ops import flat_form

f64 = torch.float64
B, H, T, D, E, M = 1, 2, 5, 4, 3, 6
CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def _inputs(device, feature="posrf", weights="orf", **opts):
    g = torch.Generator().manual_seed(0)
    q, k = (0.5 * torch.randn(B, H, T, D, generator=g, dtype=f64) for _ in range(2))
    v = torch.randn(B, H, T, E, generator=g, dtype=f64)
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=0, **opts).double()
    q, k, v, rf = q.to(device), k.to(device), v.to(device), rf.to(device)
    return q, k, v, kernel_form(rf, q, k, None, D**-0.5, causal=False)


@pytest.mark.parametrize("feature,weights", [("posrf", "orf"), ("hrf", "gaussian")])
def test_opcheck_parallel(feature, weights, kernel_device):
    opts = {"lambda_features": 1} if feature == "hrf" else {}
    q, k, v, form = _inputs(kernel_device, feature, weights, **opts)
    args = (q.requires_grad_(), k.requires_grad_(), v, *flat_form(form), D**-0.5, None, None, None)
    torch.library.opcheck(torch.ops.rfattn.parallel.default, args, test_utils=CHECKS)


def test_opcheck_chunk_and_decode(kernel_device):
    q, k, v, form = _inputs(kernel_device)
    s0 = torch.rand(B, H, M, E, dtype=f64, device=kernel_device).requires_grad_()
    z0 = (torch.rand(B, H, M, dtype=f64, device=kernel_device) + 0.5).requires_grad_()
    off0 = torch.zeros(B, H, dtype=f64, device=kernel_device)
    args = (q.requires_grad_(), k, v, *flat_form(form), D**-0.5, None, s0, z0, off0, None, None)
    torch.library.opcheck(torch.ops.rfattn.chunk.default, args, test_utils=CHECKS)
    one = (q[:, :, :1].detach(), k[:, :, :1], v[:, :, :1])
    state = (s0.detach(), z0.detach(), off0)
    args = (*one, *flat_form(form), D**-0.5, None, *state, None, None, None)
    torch.library.opcheck(torch.ops.rfattn.decode.default, args, test_utils=CHECKS)
    state = tuple(x.clone() for x in state)
    args = (*one, *flat_form(form), D**-0.5, None, *state, None, None, None)
    torch.library.opcheck(torch.ops.rfattn.decode_.default, args, test_utils=CHECKS)
    # a pool of states, rows picked by index (B rows of a pool of B + 1)
    pool = tuple(torch.cat([x, x[:1] + 1]).clone() for x in state)
    index = torch.arange(B, device=kernel_device).flip(0) + 1
    args = (*one, *flat_form(form), D**-0.5, None, *pool, index, None, None)
    torch.library.opcheck(torch.ops.rfattn.decode.default, args, test_utils=CHECKS)
    torch.library.opcheck(torch.ops.rfattn.decode_.default, args, test_utils=CHECKS)


def test_compile_fullgraph_sees_the_operators(kernel_device):
    """``torch.compile(fullgraph=True)`` over rf_attention on the fused path: no graph break, one
    rfattn operator in the graph, the same output and gradients as eager."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v, _ = _inputs(kernel_device)
    rf = rfattn.RandomFeatures(D, M, feature="posrf", weights="orf", seed=0).double()
    rf = rf.to(kernel_device)
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    counter = CompileCounterWithBackend(backend)

    def fn(a, b, c):
        return rfattn.rf_attention(a, b, c, rf, backend="triton")

    args = [x.clone().requires_grad_() for x in (q, k, v)]
    out = torch.compile(fn, fullgraph=True, backend=counter)(*args)
    out.square().sum().backward()
    ref_args = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = fn(*ref_args)
    ref.square().sum().backward()
    assert counter.frame_count == 1
    assert any("rfattn.parallel" in o for o in ops), ops
    torch.testing.assert_close(out, ref)
    for a, b in zip(args, ref_args, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


FORMS = [
    ("posrf", "orf", {}),
    ("gerf", "orf", {"A": -0.1}),
    ("hrf", "gaussian", {"lambda_features": 1}),
    ("rmf", "rademacher", {}),
]


@pytest.mark.parametrize("feature,weights,opts", FORMS)
def test_torch_kernels_equal_the_triton_kernels(feature, weights, opts, kernel_device, monkeypatch):
    """The operators' torch kernels (CPU without the interpreter) against the Triton kernels on
    the same inputs: outputs, final states and gradients of every form, decode in place too."""
    import rfattn.ops as ops

    q, k, v, form = _inputs(kernel_device, feature, weights, **opts)
    mask = torch.tensor([[True, False, False, True, False]], device=kernel_device)
    s0 = torch.rand(B, H, form.w.shape[0], E, dtype=f64, device=kernel_device)
    z0 = torch.rand(B, H, form.w.shape[0], dtype=f64, device=kernel_device) + 0.5
    off0 = torch.zeros(B, H, dtype=f64, device=kernel_device) + (0.0 if form.plain else 0.3)
    do = torch.randn(B, H, T, E, dtype=f64, generator=torch.Generator().manual_seed(1))

    def run(device):
        moved = [x.detach().to(device).requires_grad_() for x in (q, k, v, s0, z0)]
        a, b, c, s, z = moved
        fields = ("w", "coeffs", "table", "tau", "lam", "rows", "segments")
        moved_form = {
            n: getattr(form, n).to(device) for n in fields if getattr(form, n) is not None
        }
        f = dataclasses.replace(form, **moved_form)
        m, o = mask.to(device), off0.to(device)
        out_p = ops.rf_parallel(a, b, c, f, D**-0.5, m)
        out_c, s1, z1, off1 = ops.rf_chunk(a, b, c, f, D**-0.5, m, (s, z, o))
        loss = (out_p * do.to(device)).sum() + (out_c * do.to(device)).sum()
        (loss + (s1 * o.exp()[..., None, None]).sum() + z1.sum()).backward()
        with torch.no_grad():
            st = (s.detach().clone(), z.detach().clone(), o.clone())
            dec = ops.rf_decode(a[:, :, :2], b[:, :, :2], c[:, :, :2], f, D**-0.5, None, st)
            dec_ = ops.rf_decode(a[:, :, :2], b[:, :, :2], c[:, :, :2], f, D**-0.5, None, st,
                                 inplace=True)  # fmt: skip
            assert all(x is y for x, y in zip(dec_[1:], st, strict=True))
        results = [out_p, out_c, s1, z1, off1, *dec, *dec_, *(x.grad for x in moved)]
        return [x.detach().cpu() for x in results]

    monkeypatch.setattr(ops, "TORCH_ON_CPU", False)
    triton_results = run(kernel_device)
    monkeypatch.setattr(ops, "TORCH_ON_CPU", True)
    torch_results = run("cpu")
    for i, (a, b) in enumerate(zip(triton_results, torch_results, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m, i=i: f"#{i}: {m}")


@pytest.mark.parametrize("feature,weights", [
    ("posrf", "orf"), ("oprf", "orf"),
    # slow: 12-13 s each interpreted (posrf and oprf cover the maps' loads in make test)
    pytest.param("trigrf", "orf", marks=pytest.mark.slow),
    pytest.param("rmf", "rademacher", marks=pytest.mark.slow),
])  # fmt: skip
def test_head_maps_run_inside_the_forward_kernels(feature, weights, kernel_device, monkeypatch):
    _check_head_maps_in_kernels(feature, weights, kernel_device, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("feature,weights", [("posrf", "orf"), ("oprf", "orf")])
def test_head_maps_in_the_compiled_kernels(feature, weights, monkeypatch):
    """The same on a GPU (the runbook's ``pytest -m gpu``): the compiled prologue."""
    _check_head_maps_in_kernels(feature, weights, torch.device("cuda"), monkeypatch)


def _check_head_maps_in_kernels(feature, weights, kernel_device, monkeypatch):
    """Calibrated head maps ride in the kernel form (qmap, kmap): the forward kernels (and the
    operators' torch kernels) map q and k as they load them. Without gradients every fused
    form (non-causal, grouped non-causal, chunked, decode with a state) equals the torch path
    with the same maps, junk in padded keys included; posrf never maps the whole sequence.
    With gradients the call maps q, k first and gets the same values and gradients; the
    Triton backward of a form with maps raises."""
    import rfattn.call as call_record
    import rfattn.ops as ops

    Hq, Hk, Tn, Dm, Mm = 4, 2, 20, 8, 16
    opts = dict(feature=feature, weights=weights, seed=0)
    rf = rfattn.RandomFeatures(Dm, Mm, head_maps=(Hq, Hk), **opts).double().to(kernel_device)
    rf4 = rfattn.RandomFeatures(Dm, Mm, head_maps=(Hq, Hq), **opts).double().to(kernel_device)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in (rf.query_map, rf.key_map, rf4.query_map, rf4.key_map):
            m.add_(0.3 * torch.randn(m.shape, generator=g, dtype=f64).to(kernel_device))
    q = 0.5 * torch.randn(2, Hq, Tn, Dm, generator=g, dtype=f64).to(kernel_device)
    k = 0.5 * torch.randn(2, Hq, Tn, Dm, generator=g, dtype=f64).to(kernel_device)
    v = torch.randn(2, Hq, Tn, 3, generator=g, dtype=f64).to(kernel_device)
    mask = torch.zeros(2, Tn, dtype=torch.bool, device=kernel_device)
    mask[1, -6:] = True
    k[1, :, -6:], v[1, :, -6:] = float("nan"), float("inf")
    state = rfattn.rf_attention(q[:, :, :5], k[:, :Hk, :5], v[:, :Hk, :5], rf, causal=True,
                                return_state=True)[1]  # fmt: skip
    cases = [  # (rf, k and v heads, causal, tokens, initial state)
        (rf4, Hq, False, Tn, None), (rf, Hk, False, Tn, None), (rf, Hk, True, Tn, None),
        (rf, Hk, True, 3, state),
    ]  # fmt: skip
    if feature == "oprf":  # global statistics are non-causal only
        cases = cases[:2]

    def whole_sequence(x, head_map):
        if head_map is not None and not grouped:
            raise AssertionError("head map applied to the whole sequence")
        return x @ head_map.transpose(-1, -2) if head_map is not None else x

    for r, h, causal, t, st in cases:
        grouped = h < Hq and not causal
        args = (q[:, :, :t], k[:, :h, :t], v[:, :h, :t], r)
        kw = dict(causal=causal, key_padding_mask=mask[:, :t], initial_state=st)
        want = rfattn.rf_attention(*args, backend="torch", **kw)
        for on_torch in (False, True):
            monkeypatch.setattr(ops, "TORCH_ON_CPU", on_torch)
            if feature == "posrf":
                monkeypatch.setattr(call_record, "mapped", whole_sequence)
            with torch.no_grad():
                got = rfattn.rf_attention(*args, backend="triton", **kw)
            monkeypatch.undo()
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # gradients: mapped first, the maps' gradients included
    qg, kg = q[:, :, :Tn].clone().requires_grad_(), k[:, :Hk].clone().requires_grad_()
    cot = torch.randn(2, Hq, Tn, 3, generator=g, dtype=f64).to(kernel_device)
    causal = feature != "oprf"
    grads = []
    for backend in ("triton", "torch"):
        out = rfattn.rf_attention(qg, kg, v[:, :Hk], rf, causal=causal, key_padding_mask=mask,
                                  backend=backend)  # fmt: skip
        grads.append(torch.autograd.grad(out, (qg, kg, rf.query_map, rf.key_map), cot))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    monkeypatch.setattr(ops, "TORCH_ON_CPU", False)
    form = kernel_form(rf4, q, k, None, Dm**-0.5, causal=False,
                        maps=(rf4.query_map, rf4.key_map))  # fmt: skip
    out = ops.rf_parallel(q.clone().requires_grad_(), k, v, form, Dm**-0.5, mask)
    with pytest.raises(NotImplementedError, match="take no head maps"):
        out.sum().backward()


def test_head_maps_of_the_wrong_shape_raise():
    """A form's qmap/kmap must be [heads, D, D], and the launchers check the heads."""
    from rfattn.kernels.common import launch_setup

    from rfattn.features.form import KernelForm

    w = torch.randn(M, D, dtype=f64)
    with pytest.raises(ValueError, match=r"qmap must be \[heads, 4, 4\]"):
        KernelForm("gerf", w, qmap=torch.zeros(H, 3, 3, dtype=f64))
    with pytest.raises(ValueError, match=r"kmap must be \[heads, 4, 4\]"):
        KernelForm("gerf", w, kmap=torch.zeros(D, D, dtype=f64))
    q, k, v, form = _inputs("cpu")
    bad = dataclasses.replace(form, qmap=torch.zeros(H + 1, D, D, dtype=f64))
    with pytest.raises(ValueError, match=rf"qmap must be \[{H}, {D}, {D}\]"):
        launch_setup(q, k, v, bad, D**-0.5, None)


def test_opcheck_hybrid(kernel_device):
    """The hybrid's operators (what torch.compile traces of a call with window and sinks): the
    exact part, the output walk with the exact terms, the decode step."""
    from rfattn.kernels.rf_local import local_fwd

    from rfattn.hybrid import estimated_stream, extend

    q, k, v, _ = _inputs(kernel_device)
    rf = rfattn.RandomFeatures(D, M, feature="posrf", weights="orf", seed=0).double()
    rf = rf.to(kernel_device)
    form = kernel_form(rf, q, k, None, D**-0.5, causal=True)
    window, sinks, scale = 2, 1, D**-0.5
    ext = extend(None, k, v, None, sinks, window)
    present = ext.sink_present.to(torch.int8)
    local = (ext.keys, ext.values, ext.sink_keys, ext.sink_values, ext.kinds, ext.sink_pos,
             present)  # fmt: skip
    args = (q.clone().requires_grad_(), *(x.clone().requires_grad_() for x in local[:4]),
            *local[4:], window, scale)  # fmt: skip
    torch.library.opcheck(torch.ops.rfattn.local.default, args, test_utils=CHECKS)
    nex, dex, eex = local_fwd(q, *local[:2], ext.kinds, *local[2:4], ext.sink_pos, present,
                              window, scale)  # fmt: skip
    ks, vs, ms = estimated_stream(ext, T)
    args = (q.clone().requires_grad_(), ks.clone().requires_grad_(), vs, *flat_form(form), scale,
            ms, None, None, None, nex.requires_grad_(), dex.requires_grad_(), eex, None, None)
    torch.library.opcheck(torch.ops.rfattn.chunk_hybrid.default, args, test_utils=CHECKS)
    _, st = rfattn.rf_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], rf, causal=True,
                                window=window, sinks=sinks, return_state=True,
                                backend="triton")  # fmt: skip
    one = (q[:, :, 4:], k[:, :, 4:], v[:, :, 4:])
    args = (*one, *flat_form(form), scale, None, *st, None, window, sinks, 1.0 / M, None, None)
    torch.library.opcheck(torch.ops.rfattn.hybrid_decode.default, args, test_utils=CHECKS)
    pooled = [x.repeat_interleave(2, dim=0) for x in st]  # a pool of 2 B states, rows by index
    index = torch.arange(q.shape[0], device=q.device) * 2 + 1
    args = (*one, *flat_form(form), scale, None, *pooled, index, window, sinks, 1.0 / M, None,
            None)  # fmt: skip
    torch.library.opcheck(torch.ops.rfattn.hybrid_decode.default, args, test_utils=CHECKS)
