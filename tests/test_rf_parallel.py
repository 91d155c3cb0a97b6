"""Fused non-causal kernel (kernels/rf_parallel.py) against the float64 reference on the same W.

On CPU these run under the Triton interpreter (conftest sets TRITON_INTERPRET=1): shapes are small.
"""

import copy
import dataclasses

import pytest
import torch

import rfattn
from rfattn.features.form import KernelForm
from rfattn.ops import rf_parallel
from rfattn.reference import linear_attention
from rfattn.testing import rel_rms, tolerance

f32 = torch.float32


def rand(*shape, seed=0, scale=1.0, dtype=f32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


def reference(q, k, v, rf, mask=None, scale=None):
    rf64 = rfattn.RandomFeatures(rf.head_dim, rf.num_features).double()
    rf64.weight.copy_(rf.weight.double())  # the SAME W, in float64
    m = None if mask is None else mask.cpu()
    phi_q, phi_k = rf64.features(q.cpu().double(), k.cpu().double(), m, scale=scale)
    return linear_attention(phi_q, phi_k, v.cpu().double(), key_padding_mask=m)


def run(q, k, v, rf, **kw):
    return rfattn.rf_attention(q, k, v, rf, backend="triton", **kw)


SHAPES = [  # B, H, Tq, Tk, D, M, E
    (1, 2, 1, 1, 16, 24, 8),
    (2, 3, 63, 63, 16, 40, 24),
    (1, 2, 257, 257, 32, 72, 20),
    (2, 1, 63, 257, 24, 17, 33),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-Tq{}-Tk{}-D{}-M{}-E{}".format(*s))
def test_parity_fp32(shape, kernel_device):
    B, H, Tq, Tk, D, M, E = shape
    q = rand(B, H, Tq, D, seed=1, scale=0.7, device=kernel_device)
    k = rand(B, H, Tk, D, seed=2, scale=0.7, device=kernel_device)
    v = rand(B, H, Tk, E, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device)
    out = run(q, k, v, rf)
    assert out.dtype == f32 and out.shape == (B, H, Tq, E)
    assert rel_rms(out, reference(q, k, v, rf)) <= tolerance(f32)


def test_parity_key_padding_mask_and_scale(kernel_device):
    B, H, T, D, M, E = 2, 2, 130, 16, 48, 16
    q = rand(B, H, T, D, seed=1, device=kernel_device)
    k = rand(B, H, T, D, seed=2, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    mask = torch.rand(B, T, generator=torch.Generator().manual_seed(0)) < 0.4
    mask[1, :70] = True  # a whole key tile padded, a split with no valid key
    mask = mask.to(kernel_device)
    k[mask[:, None, :, None].expand_as(k)] = float("nan")  # padding content is never read
    v[mask[:, None, :, None].expand_as(v)] = float("nan")
    rf = rfattn.RandomFeatures(D, M, seed=5).to(kernel_device)
    out = run(q, k, v, rf, key_padding_mask=mask, scale=0.1)
    assert rel_rms(out, reference(q, k, v, rf, mask, scale=0.1)) <= tolerance(f32)


def test_parity_strided_inputs(kernel_device):
    """[B, T, H, D] tensors passed as transposed views, and a non-unit last stride."""
    B, H, T, D, M, E = 2, 3, 70, 16, 32, 16
    q = rand(B, T, H, D, seed=1, device=kernel_device).transpose(1, 2)
    k = rand(B, T, H, D, seed=2, device=kernel_device).transpose(1, 2)
    v = rand(B, H, T, 2 * E, seed=3, device=kernel_device)[..., ::2]
    assert not q.is_contiguous() and v.stride(-1) == 2
    rf = rfattn.RandomFeatures(D, M, seed=6).to(kernel_device)
    out = run(q, k, v, rf)
    assert rel_rms(out, reference(q, k, v, rf)) <= tolerance(f32)
    assert torch.equal(out, run(q.contiguous(), k.contiguous(), v.contiguous(), rf))


@pytest.mark.parametrize("splits", [1, 2, 3, 5])
def test_split_merge_is_exact(splits, kernel_device):
    from rfattn.kernels.rf_parallel import rf_parallel_fwd

    B, H, T, D, M, E = 1, 2, 300, 16, 80, 16
    q = rand(B, H, 20, D, seed=1, device=kernel_device)
    k = rand(B, H, T, D, seed=2, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=7).to(kernel_device)
    form = rf.feature_map.kernel_form(rf.weight)
    out = rf_parallel_fwd(q, k, v, form, D**-0.5, num_splits=splits)
    assert rel_rms(out, reference(q, k, v, rf)) <= tolerance(f32)


@pytest.mark.parametrize("splits", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_split_merges_in_kernel_match_one_split_and_reset_counters(splits, kernel_device):
    """The key pass and the dS pass merge their splits' partials themselves (the last split of
    each feature tile to arrive): out, dq, dk, dv and dW (both sides' partials) as with one
    split, in float64, and every arrival counter back at 0 afterwards (zeroed once, never per
    call)."""
    from rfattn.kernels.common import arrival_counters
    from rfattn.kernels.rf_parallel import rf_parallel_bwd, rf_parallel_fwd

    B, H, T, D, M, E = 1, 2, 300, 16, 80, 16
    f64 = torch.float64
    q, k = (rand(B, H, T, D, seed=i, dtype=f64, device=kernel_device) for i in (1, 2))
    v, do = (rand(B, H, T, E, seed=i, dtype=f64, device=kernel_device) for i in (3, 4))
    rf = rfattn.RandomFeatures(D, M, seed=7).to(kernel_device, f64)
    form = rf.feature_map.kernel_form(rf.weight)
    results = []
    for n in (1, splits):
        out, aux = rf_parallel_fwd(q, k, v, form, D**-0.5, num_splits=n, return_aux=True)
        grads = rf_parallel_bwd(do, q, k, v, form, D**-0.5, out, aux, need_dw=True, num_splits=n)
        results.append((out, *grads))
    for one, split in zip(*results, strict=True):
        assert rel_rms(split, one) <= tolerance(f64)
    assert not arrival_counters(q.device, B * H * M).any()


def test_large_norm_inputs_finite(kernel_device):
    B, H, T, D, M, E = 1, 2, 40, 64, 64, 16
    q = rand(B, H, T, D, seed=1, device=kernel_device)
    k = rand(B, H, T, D, seed=2, device=kernel_device)
    q, k = 30 * q / q.norm(dim=-1, keepdim=True), 30 * k / k.norm(dim=-1, keepdim=True)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    out = run(q, k, v, rfattn.RandomFeatures(D, M, seed=0).to(kernel_device))
    assert out.isfinite().all()


def test_nan_propagates_and_empty_keys_give_zero(kernel_device):
    B, H, T, D, M, E = 2, 1, 20, 16, 16, 16
    q = rand(B, H, T, D, seed=1, device=kernel_device)
    k = rand(B, H, T, D, seed=2, device=kernel_device)
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=0).to(kernel_device)
    q_nan = q.clone()
    q_nan[0, 0, 5, 3] = float("nan")
    out = run(q_nan, k, v, rf)
    assert out[0, 0, 5].isnan().all() and out[1].isfinite().all()
    k_nan = k.clone()
    k_nan[1, 0, 7, 0] = float("nan")  # a valid key: poisons its (b, h)
    out = run(q, k_nan, v, rf)
    assert out[1].isnan().all() and out[0].isfinite().all()
    mask = torch.zeros(B, T, dtype=torch.bool, device=kernel_device)
    mask[0] = True
    out = run(q, k, v, rf, key_padding_mask=mask)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].abs().sum() > 0
    out = run(q, k[:, :, :0], v[:, :, :0], rf)
    assert torch.equal(out, torch.zeros_like(out))
    assert run(q[:, :, :0], k, v, rf).shape == (B, H, 0, E)


def test_deterministic(kernel_device):
    q = rand(2, 2, 150, 16, seed=1, device=kernel_device)
    k = rand(2, 2, 150, 16, seed=2, device=kernel_device)
    v = rand(2, 2, 150, 16, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(16, 48, seed=0).to(kernel_device)
    assert torch.equal(run(q, k, v, rf), run(q, k, v, rf))


def grad_parity(q, k, v, rf, mask=None, scale=None, learn_w=False, seed=0, zero=()):
    """Relative RMS errors of the kernel's output and gradients vs the float64 reference (same W,
    same cotangent). Gradients named in ``zero`` vanish mathematically: their absolute RMS is
    reported instead."""
    w = rf.weight.detach().clone().requires_grad_(learn_w)
    args = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = rf_parallel(*args, rf.feature_map.kernel_form(w), scale or q.shape[-1] ** -0.5, mask)
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(do.to(out.device, out.dtype))
    ref_args = [x.detach().cpu().double().requires_grad_() for x in (*args, w)]
    m = None if mask is None else mask.cpu()
    xs = (scale or q.shape[-1] ** -0.5) ** 0.5
    phi_q, phi_k = rf.feature_map.features(ref_args[0] * xs, ref_args[1] * xs, ref_args[3], m)
    ref = linear_attention(phi_q, phi_k, ref_args[2], key_padding_mask=m)
    ref.backward(do)
    errs = {"out": rel_rms(out, ref)}
    for name, a, b in zip("qkvw", (*args, w), ref_args, strict=True):
        if "d" + name in zero:
            errs["d" + name] = a.grad.double().pow(2).mean().sqrt().item()
        elif name != "w" or learn_w:
            errs["d" + name] = rel_rms(a.grad, b.grad)
    return errs


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-H{}-Tq{}-Tk{}-D{}-M{}-E{}".format(*s))
def test_gradient_parity_fp32(shape, kernel_device):
    B, H, Tq, Tk, D, M, E = shape
    q = rand(B, H, Tq, D, seed=1, scale=0.7, device=kernel_device)
    k = rand(B, H, Tk, D, seed=2, scale=0.7, device=kernel_device)
    v = rand(B, H, Tk, E, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device)
    # one key: out = v whatever q, k and W are, so their gradients vanish
    zero = ("dq", "dk", "dw") if Tk == 1 else ()
    errs = grad_parity(q, k, v, rf, learn_w=True, zero=zero)
    assert max(errs.values()) <= tolerance(f32, "grad"), errs


def test_gradient_parity_mask_strided_fp64(kernel_device):
    """float64 through the kernel: parity to rounding; padded keys get exactly zero gradient."""
    B, H, T, D, M, E = 2, 2, 140, 16, 24, 16
    f64 = torch.float64
    q = rand(B, T, H, D, seed=1, dtype=f64, device=kernel_device).transpose(1, 2)
    k = rand(B, H, T, D, seed=2, dtype=f64, device=kernel_device)
    v = rand(B, H, T, E, seed=3, dtype=f64, device=kernel_device)
    mask = (torch.rand(B, T, generator=torch.Generator().manual_seed(1)) < 0.3).to(kernel_device)
    k[mask[:, None, :, None].expand_as(k)] = float("nan")
    rf = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device).double()
    errs = grad_parity(q, k, v, rf, mask=mask, scale=0.2, learn_w=True)
    assert max(errs.values()) <= tolerance(f64, "grad"), errs
    kk = k.detach().clone().requires_grad_()
    vv = v.detach().clone().requires_grad_()
    run(q, kk, vv, rf, key_padding_mask=mask).sum().backward()
    pad = mask[:, None, :].expand(B, H, T)
    assert torch.equal(kk.grad[pad], torch.zeros_like(kk.grad[pad]))
    assert torch.equal(vv.grad[pad], torch.zeros_like(vv.grad[pad]))


@pytest.mark.slow
def test_gradcheck_float64_tiny(kernel_device):
    f64 = torch.float64
    q = rand(1, 1, 3, 5, seed=1, dtype=f64, device=kernel_device).requires_grad_()
    k = rand(1, 1, 4, 5, seed=2, dtype=f64, device=kernel_device).requires_grad_()
    v = rand(1, 1, 4, 2, seed=3, dtype=f64, device=kernel_device).requires_grad_()
    w = rfattn.RandomFeatures(5, 3, seed=0).weight.to(kernel_device, f64).requires_grad_()
    mask = torch.tensor([[False, True, False, False]], device=kernel_device)

    def fn(a, b, c, d):  # dW through the form's rows
        return rf_parallel(a, b, c, KernelForm("gerf", d), 0.3, mask)

    assert torch.autograd.gradcheck(fn, (q, k, v, w))


def test_gradients_deterministic(kernel_device):
    q = rand(1, 2, 300, 16, seed=1, device=kernel_device).requires_grad_()
    k = rand(1, 2, 300, 16, seed=2, device=kernel_device).requires_grad_()
    v = rand(1, 2, 300, 16, seed=3, device=kernel_device).requires_grad_()
    rf = rfattn.RandomFeatures(16, 48, seed=0).to(kernel_device)
    grads = []
    for _ in range(2):
        for x in (q, k, v):
            x.grad = None
        run(q, k, v, rf).pow(2).sum().backward()
        grads.append([x.grad.clone() for x in (q, k, v)])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_triton_backend_rejects_what_it_cannot_run(kernel_device):
    q = rand(1, 1, 8, 16, seed=1, device=kernel_device)
    rf = rfattn.RandomFeatures(16, 16, seed=0).to(kernel_device)
    pois = rfattn.RandomFeatures(16, 16, feature="poisrf", seed=0).to(kernel_device)
    with pytest.raises(NotImplementedError, match="poisrf"):
        run(q, q, q, pois, causal=True)
    from rfattn.kernels.rf_parallel import rf_parallel_fwd

    with pytest.raises(ValueError, match="precision"):
        rf_parallel_fwd(q, q, q, rf.feature_map.kernel_form(rf.weight), 0.25, precision="fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_parity_low_precision_gpu(dtype):
    """flash-attention rule: at most 2x the torch path's own error in that dtype."""
    B, H, T, D, M, E = 2, 4, 1000, 64, 256, 64
    q = rand(B, H, T, D, seed=1, scale=0.7, dtype=dtype, device="cuda")
    k = rand(B, H, T, D, seed=2, scale=0.7, dtype=dtype, device="cuda")
    v = rand(B, H, T, E, seed=3, dtype=dtype, device="cuda")
    rf = rfattn.RandomFeatures(D, M, seed=0).cuda()
    ref = reference(q, k, v, rf)
    # the torch path in the same dtype, rounding its inputs and output like the kernel
    torch_err = rel_rms(rfattn.rf_attention(q, k, v, rf, backend="torch"), ref)
    err = rel_rms(run(q, k, v, rf).cpu(), ref)
    assert err <= max(2 * torch_err, tolerance(dtype) / 10), (err, torch_err)
    assert err <= tolerance(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradient_parity_low_precision_gpu(dtype):
    """flash-attention rule for gradients: at most 3x the torch path's own error in that dtype."""
    B, H, T, D, M, E = 2, 4, 1000, 64, 256, 64
    q = rand(B, H, T, D, seed=1, scale=0.7, dtype=dtype, device="cuda")
    k = rand(B, H, T, D, seed=2, scale=0.7, dtype=dtype, device="cuda")
    v = rand(B, H, T, E, seed=3, dtype=dtype, device="cuda")
    rf = rfattn.RandomFeatures(D, M, seed=0).cuda()
    kernel = grad_parity(q, k, v, rf)
    # the torch path in the same dtype, same inputs and cotangent
    grads = {}
    args = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*args, rf, backend="torch")
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    out.backward(do.to(out.device, out.dtype))
    ref_args = [x.detach().cpu().double().requires_grad_() for x in args]
    ref = reference(*ref_args, rf)
    ref.backward(do)
    for name, a, b in zip("qkv", args, ref_args, strict=True):
        grads["d" + name] = rel_rms(a.grad.cpu(), b.grad)
    for name, err in grads.items():
        assert kernel[name] <= max(3 * err, tolerance(dtype, "grad") / 10), (name, kernel, grads)


@pytest.mark.gpu
def test_parity_fp32_gpu_large():
    B, H, T, D, M, E = 2, 4, 3000, 128, 256, 128
    q = rand(B, H, T, D, seed=1, scale=0.5, device="cuda")
    k = rand(B, H, T, D, seed=2, scale=0.5, device="cuda")
    v = rand(B, H, T, E, seed=3, device="cuda")
    rf = rfattn.RandomFeatures(D, M, seed=0).cuda()
    assert rel_rms(run(q, k, v, rf).cpu(), reference(q, k, v, rf)) <= tolerance(f32)


def test_learnable_weights_get_kernel_gradients(kernel_device):
    """fastfoodl: dW from the kernel reaches S, G, B exactly as through the torch path."""
    q = rand(1, 2, 70, 16, seed=1, device=kernel_device)
    k = rand(1, 2, 70, 16, seed=2, device=kernel_device)
    v = rand(1, 2, 70, 16, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(16, 32, weights="fastfoodl", seed=0).to(kernel_device)
    grads = {}
    for backend in ("triton", "torch"):
        rf.zero_grad()
        rfattn.rf_attention(q, k, v, rf, backend=backend).pow(2).sum().backward()
        grads[backend] = [p.grad.clone() for p in rf.parameters()]
    assert len(grads["torch"]) >= 3
    for a, b in zip(grads["triton"], grads["torch"], strict=True):
        assert b.abs().sum() > 0
        assert rel_rms(a, b) <= tolerance(f32, "grad")


def test_sgq_weights_with_statistics_not_fused_yet(kernel_device):
    rf = rfattn.RandomFeatures(4, 9, feature="oprf", weights="sgq").to(kernel_device)
    q = rand(1, 1, 8, 4, seed=1, device=kernel_device)
    with pytest.raises(NotImplementedError, match="sgq"):
        run(q, q, q, rf)


GERF_FAMILY = [
    ("hyprf", {}),
    ("gerf", {"A": -0.1}),
    ("oprf", {}),
    ("oprf", {"stats": "fixed", "A": -0.05}),
    ("saderf", {}),
]


@pytest.mark.parametrize("feature,opts", GERF_FAMILY, ids=lambda x: str(x))
def test_gerf_family_parity_outputs_and_gradients(feature, opts, kernel_device):
    """Every real positive GERF feature through the kernel vs the float64 torch path (same W,
    same statistics rule), with a padding mask, different query / key scales and dW."""
    B, H, T, D, M, E = 2, 2, 90, 16, 24, 16
    q = rand(B, H, T, D, seed=1, scale=0.8, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.4, device=kernel_device)
    k[..., :4] *= 3.0  # per-dimension scales differ: saderf's psi is not 1
    v = rand(B, H, T, E, seed=3, device=kernel_device)
    mask = (torch.rand(B, T, generator=torch.Generator().manual_seed(2)) < 0.25).to(kernel_device)
    rf = rfattn.RandomFeatures(D, M, feature=feature, seed=4, **opts).to(kernel_device)
    rf64 = copy.deepcopy(rf).double()
    args = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*args, rf, key_padding_mask=mask, backend="triton")
    ref_args = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = rfattn.rf_attention(*ref_args, rf64, key_padding_mask=mask, backend="torch")
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out.backward(do.to(kernel_device, f32))
    ref.backward(do.to(kernel_device))
    assert rel_rms(out, ref) <= tolerance(f32)
    for a, b in zip(args, ref_args, strict=True):
        assert rel_rms(a.grad, b.grad) <= tolerance(f32, "grad")
    # the fused result is not the posrf one: the feature's parameters reach the kernel
    plain = rfattn.RandomFeatures(D, M, seed=4).to(kernel_device)
    assert rel_rms(rfattn.rf_attention(q, k, v, plain, key_padding_mask=mask), ref) > 1e-3


def test_features_without_kernel_are_refused(kernel_device):
    q = rand(1, 1, 8, 16, seed=1, device=kernel_device)
    for feature, opts, match in (("poisrf", {}, "poisrf"), ("geomrf", {}, "geomrf"),
                                 ("oprf", {"stats_grad": True}, "stats_grad")):  # fmt: skip
        rf = rfattn.RandomFeatures(16, 16, feature=feature, **opts).to(kernel_device)
        with pytest.raises(NotImplementedError, match=match):
            run(q, q, q, rf)


# ------------------------------------------------------------------------------------------------
# signed features: trigrf, complex gerf, hrf (the kernel's table form) and rmf (its rmf form)

SIGNED = [  # feature, options, weights
    ("trigrf", {}, "gaussian"),
    ("gerf", {"A": 0.1j}, "orf"),
    ("gerf", {"A": -0.05 + 0.05j, "s": -1}, "gaussian"),
    ("hrf", {"lambda_features": 2}, "gaussian"),
    ("hrf", {"lambda_features": 1, "share_base_projection": True}, "orf"),
    ("rmf", {}, "rademacher"),
    ("rmf", {"mode": "paper", "dot_kernel": "inverse", "max_degree": 6}, "rademacher"),
    ("rmf", {"dot_kernel": "poly", "poly_degree": 3}, "rademacher"),
    ("posrf", {}, "sgq"),  # sgq's signed row weights: the table form
    ("trigrf", {}, "sgq"),
]


def _signed_ids(case):
    feature, opts, weights = case
    return "-".join([feature, weights, *(f"{k}{v}" for k, v in opts.items())])


def backend_parity(rf, q, k, v, mask=None, seed=5):
    """Relative RMS errors of the fused output and dq, dk, dv (and dW for learnable weights)
    against the float64 torch path, i.e. ``linear_attention`` on the feature map of record, on a
    float64 copy of ``rf`` (the same W and draws) with the same cotangent."""
    rf64 = copy.deepcopy(rf).double()
    args = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*args, rf, key_padding_mask=mask, backend="triton")
    ref_args = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = rfattn.rf_attention(*ref_args, rf64, key_padding_mask=mask, backend="torch")
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    out.backward(do.to(out.device, out.dtype))
    ref.backward(do.to(ref.device))
    errs = {"out": rel_rms(out, ref)}
    errs.update(
        {"d" + n: rel_rms(a.grad, b.grad) for n, a, b in zip("qkv", args, ref_args, strict=True)}
    )
    for (name, p), p64 in zip(rf.named_parameters(), rf64.parameters(), strict=True):
        errs["d" + name] = rel_rms(p.grad, p64.grad)
    return errs, out


@pytest.mark.parametrize("case", SIGNED, ids=_signed_ids)
def test_signed_parity_outputs_and_gradients(case, kernel_device):
    """Every signed feature through the fused kernel vs the float64 torch path: cross-attention
    (Tq != Tk), D != M != E, a key padding mask with NaN in the padded rows, a transposed q."""
    feature, opts, weights = case
    B, H, Tq, Tk, D, M, E = 2, 2, 37, 70, 16, 24, 12
    if weights == "sgq":
        D, M = 4, 9  # sgq: M = (2 D + 1)-point rules
    q = rand(B, Tq, H, D, seed=1, scale=0.6, device=kernel_device).transpose(1, 2)
    k = rand(B, H, Tk, D, seed=2, scale=0.6, device=kernel_device)
    v = rand(B, H, Tk, E, seed=3, device=kernel_device)
    mask = (torch.rand(B, Tk, generator=torch.Generator().manual_seed(2)) < 0.25).to(kernel_device)
    k[mask[:, None, :, None].expand_as(k)] = float("nan")  # padded content is never read
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=4, **opts)
    errs, out = backend_parity(rf.to(kernel_device), q, k, v, mask)
    assert errs.pop("out") <= tolerance(f32), errs
    assert max(errs.values()) <= tolerance(f32, "grad"), errs
    if feature == "posrf":
        return
    # not the posrf result: the feature's form reaches the kernel
    plain_w = "gaussian" if weights == "rademacher" else weights
    plain = rfattn.RandomFeatures(D, M, weights=plain_w, seed=4).to(kernel_device)
    k0 = k.masked_fill(mask[:, None, :, None], 0.0)
    assert rel_rms(run(q, k0, v, plain, key_padding_mask=mask), out) > 1e-3


@pytest.mark.parametrize("feature,opts", [("trigrf", {}), ("hrf", {"lambda_features": 2})])
def test_signed_learnable_weights_dw(feature, opts, kernel_device):
    """fastfoodl: dW of the per-feature rows (W repeated per block) reaches S, G, B exactly."""
    q = rand(1, 2, 40, 16, seed=1, scale=0.6, device=kernel_device)
    k = rand(1, 2, 50, 16, seed=2, scale=0.6, device=kernel_device)
    v = rand(1, 2, 50, 8, seed=3, device=kernel_device)
    rf = rfattn.RandomFeatures(16, 16, feature=feature, weights="fastfoodl", seed=0, **opts)
    errs, _ = backend_parity(rf.to(kernel_device), q, k, v)
    assert len(errs) >= 7 and max(errs.values()) <= tolerance(f32, "grad"), errs


SIGNED_SHAPES = [  # B, H, Tq, Tk, D, M, E
    (1, 1, 1, 1, 16, 12, 8),
    (2, 1, 63, 63, 24, 20, 40),
    (1, 2, 257, 257, 16, 12, 20),
]


@pytest.mark.parametrize("feature", ["trigrf", "hrf", "rmf"])
@pytest.mark.parametrize(
    "shape", SIGNED_SHAPES, ids=lambda s: "B{}-H{}-Tq{}-Tk{}-D{}-M{}-E{}".format(*s)
)
def test_signed_awkward_shapes(feature, shape, kernel_device):
    B, H, Tq, Tk, D, M, E = shape
    opts = {"lambda_features": 2} if feature == "hrf" else {}
    # orf rows: trigrf's denominators stay away from 0 on these draws (with gaussian rows the
    # float32 torch path itself errs 5e-6 on one of them: conditioning, not the kernel)
    weights = "rademacher" if feature == "rmf" else "orf"
    q = rand(B, H, Tq, D, seed=1, scale=0.5, device=kernel_device)
    k = rand(B, H, Tk, D, seed=2, scale=0.5, device=kernel_device)
    v = rand(B, H, Tk, 2 * E, seed=3, device=kernel_device)[..., ::2]  # non-unit last stride
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=4, **opts)
    errs, _ = backend_parity(rf.to(kernel_device), q, k, v)
    if Tk == 1:  # one key: out = v whatever q and k are, their gradients vanish
        errs = {n: e for n, e in errs.items() if n not in ("dq", "dk")}
    assert errs.pop("out") <= tolerance(f32), errs
    assert max(errs.values()) <= tolerance(f32, "grad"), errs


@pytest.mark.slow
@pytest.mark.parametrize("feature,opts", [("rmf", {}), ("hrf", {"lambda_features": 1})])
def test_gradcheck_float64_tiny_signed(feature, opts, kernel_device):
    from rfattn.fused import kernel_form

    f64 = torch.float64
    weights = "rademacher" if feature == "rmf" else "gaussian"
    rf = rfattn.RandomFeatures(3, 4, feature=feature, weights=weights, seed=1, **opts)
    rf = rf.to(kernel_device).double()
    q = rand(1, 1, 2, 3, seed=1, dtype=f64, device=kernel_device).requires_grad_()
    k = rand(1, 1, 3, 3, seed=2, dtype=f64, device=kernel_device).requires_grad_()
    v = rand(1, 1, 3, 2, seed=3, dtype=f64, device=kernel_device).requires_grad_()
    mask = torch.tensor([[False, True, False]], device=kernel_device)
    form = kernel_form(rf, q, k, mask, 0.5, causal=False)
    form = dataclasses.replace(form, w=form.w.detach())

    def fn(a, b, c):
        return rf_parallel(a, b, c, form, 0.5, key_padding_mask=mask)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_signed_deterministic_and_padding(kernel_device):
    """Bitwise-equal outputs and gradients over two calls (two key splits and the merge), and a
    (b, h) whose keys are all padded gives 0 (the denominator policy) without NaN."""
    q = rand(2, 1, 20, 16, seed=1, scale=0.5, device=kernel_device)
    k = rand(2, 1, 130, 16, seed=2, scale=0.5, device=kernel_device)
    v = rand(2, 1, 130, 16, seed=3, device=kernel_device)
    mask = torch.zeros(2, 130, dtype=torch.bool, device=kernel_device)
    mask[1] = True
    for feature, weights in (("rmf", "rademacher"), ("hrf", "gaussian")):
        opts = {"lambda_features": 1} if feature == "hrf" else {}
        rf = rfattn.RandomFeatures(16, 6, feature=feature, weights=weights, seed=0, **opts)
        rf = rf.to(kernel_device)
        results = []
        for _ in range(2):
            args = [x.clone().requires_grad_() for x in (q, k, v)]
            out = run(*args, rf, key_padding_mask=mask)
            out.pow(2).sum().backward()
            results.append([out.detach(), *(x.grad for x in args)])
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), feature
        assert torch.equal(results[0][0][1], torch.zeros_like(results[0][0][1]))
        assert all(x.isfinite().all() for x in results[0])


def test_rmf_nan_propagates(kernel_device):
    q = rand(1, 1, 10, 8, seed=1, scale=0.5, device=kernel_device)
    k = rand(1, 1, 10, 8, seed=2, scale=0.5, device=kernel_device)
    rf = rfattn.RandomFeatures(8, 8, feature="rmf", weights="rademacher", seed=0)
    q[0, 0, 3, 1] = float("nan")
    out = run(q, k, k, rf.to(kernel_device))
    assert out[0, 0, 3].isnan().all() and out[0, 0, :3].isfinite().all()


def test_fused_kernel_available():
    from rfattn.attention import fused_kernel_available

    def rf(feature, weights="gaussian", **opts):
        return rfattn.RandomFeatures(4, 9, feature=feature, weights=weights, **opts)

    for feature in ("posrf", "hyprf", "gerf", "oprf", "saderf", "trigrf", "hrf"):
        assert fused_kernel_available(rf(feature))
    assert fused_kernel_available(rf("rmf", "rademacher"))
    assert fused_kernel_available(rf("trigrf", "sgq")) and fused_kernel_available(rf("gerf", s=-1))
    assert not fused_kernel_available(rf("poisrf"))
    assert not fused_kernel_available(rf("oprf", "sgq"))
    assert fused_kernel_available(rf("trigrf"), causal=True)
    assert fused_kernel_available(rf("rmf", "rademacher"), causal=True)
    assert not fused_kernel_available(rf("poisrf"), causal=True)
    assert not fused_kernel_available(rf("posrf", "fastfoodl"), causal=True)  # dW: torch path


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", SIGNED[:1] + SIGNED[3:4] + SIGNED[5:6], ids=_signed_ids)
def test_signed_low_precision_gpu(case, dtype):
    """flash-attention rule: output error <= 2x, gradient errors <= 3x the torch path's own error
    in that dtype (both against the float64 torch path on the same features)."""
    feature, opts, weights = case
    B, H, T, D, M, E = 2, 4, 1000, 64, 64, 64
    q = rand(B, H, T, D, seed=1, scale=0.5, dtype=dtype, device="cuda")
    k = rand(B, H, T, D, seed=2, scale=0.5, dtype=dtype, device="cuda")
    v = rand(B, H, T, E, seed=3, dtype=dtype, device="cuda")
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=0, **opts).cuda()
    kernel, _ = backend_parity(rf, q, k, v)
    rf64 = copy.deepcopy(rf).double()
    args = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*args, rf, backend="torch")
    ref_args = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = rfattn.rf_attention(*ref_args, rf64, backend="torch")
    do = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out.backward(do.to(out.device, out.dtype))
    ref.backward(do.to(ref.device))
    torch_errs = {"out": rel_rms(out, ref)}
    torch_errs.update(
        {"d" + n: rel_rms(a.grad, b.grad) for n, a, b in zip("qkv", args, ref_args, strict=True)}
    )
    for name, err in torch_errs.items():
        factor, kind = (2, "out") if name == "out" else (3, "grad")
        assert kernel[name] <= max(factor * err, tolerance(dtype, kind) / 10), (name, kernel, err)


@pytest.mark.parametrize(
    "triton_version, numpy_version, refused",
    [("3.6.0", "2.4.6", True), ("3.2.0", "2.4.0", True), ("3.6.0", "2.3.5", False),
     ("3.7.0", "2.4.6", False), ("3.9.0+git1234", "2.4.6", False), ("3.6.0", "1.26.4", False)],
)  # fmt: skip
def test_interpreter_numpy_guard(triton_version, numpy_version, refused):
    """triton < 3.7 with numpy >= 2.4 fails inside the interpreter: refused with the fix named."""
    from rfattn.kernels.common import interpreter_numpy_problem

    why = interpreter_numpy_problem(triton_version, numpy_version)
    assert (why is not None) == refused
    if refused:
        assert "numpy<2.4" in why and triton_version in why
