"""The fused stats pass (kernels/stats.py) against ``rfattn.stats.sequence_moments``, and the
oprf/saderf parameters the triton path derives from it."""

import copy

import pytest
import torch

import rfattn
from rfattn.stats import Moments, sequence_moments
from rfattn.testing import rel_rms, tolerance


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


CASES = [  # B, H, Tq, Tk, D, masked
    (1, 1, 1, 1, 16, False),
    (2, 3, 63, 63, 24, True),
    (2, 1, 40, 300, 16, True),  # Tq != Tk: the mask is the keys' only; two key splits
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-H{}-Tq{}-Tk{}-D{}-mask{}".format(*c))
def test_moments_match_sequence_moments(case, dtype, kernel_device):
    from rfattn.kernels.stats import sequence_moments_fused

    B, H, Tq, Tk, D, masked = case
    scale = 0.3
    q = rand(B, Tq, H, D, seed=1, dtype=dtype, device=kernel_device).transpose(1, 2)  # strided
    k = rand(B, H, Tk, D, seed=2, scale=2.0, dtype=dtype, device=kernel_device) + 0.5
    mask = None
    if masked:
        mask = torch.rand(B, Tk, generator=torch.Generator().manual_seed(3)) < 0.3
        mask[-1] = True  # a batch element with no valid token: means 0, min 0
        mask = mask.to(kernel_device)
        k[mask[:, None, :, None].expand_as(k)] = float("nan")  # padded content is never read
    got = sequence_moments_fused(q, k, scale, mask)
    x64 = [x.double() * scale**0.5 for x in (q, k)]
    if mask is not None:
        x64[1] = x64[1].masked_fill(mask[:, None, :, None], 0.0)
    want = sequence_moments(*x64, mask)
    tol = tolerance(dtype)
    for name, a, b in zip(Moments._fields, got, want, strict=True):
        assert a.dtype == dtype and a.shape == (B, H, 2, D), name
        assert rel_rms(a, b) <= tol, (name, rel_rms(a, b))


def test_empty_sequences(kernel_device):
    from rfattn.kernels.stats import sequence_moments_fused

    x = rand(2, 2, 0, 8, device=kernel_device)
    zeros = torch.zeros(2, 2, 2, 8, device=x.device)
    assert all(torch.equal(t, zeros) for t in sequence_moments_fused(x, x, 0.5))


@pytest.mark.parametrize("feature", ["oprf", "saderf"])
@pytest.mark.parametrize("stats", ["global", "running"])
def test_feature_parameters_from_the_stats_pass(feature, stats, kernel_device):
    """The triton path's A, B, psi (formed by the stats pass in its launch) equal the
    torch path's, and a running-mode call in training updates the buffers identically."""
    from rfattn.fused import kernel_form

    B, H, T, D = 2, 2, 50, 16
    q = rand(B, H, T, D, seed=1, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.5, device=kernel_device)
    k[..., :3] *= 4.0
    mask = (torch.rand(B, T, generator=torch.Generator().manual_seed(2)) < 0.3).to(kernel_device)
    rf = rfattn.RandomFeatures(D, 16, feature=feature, stats=stats, seed=0).to(kernel_device)
    rf_torch = copy.deepcopy(rf)
    if stats == "running":  # one training step each, then the eval parameters from the buffers
        rf.train(), rf_torch.train()
        kernel_form(rf, q, k, mask, 0.25, causal=False)
        rf_torch.feature_params(q * 0.5, k * 0.5, mask)
        for name in Moments._fields:
            a = getattr(rf.feature_map, f"running_{name}")
            b = getattr(rf_torch.feature_map, f"running_{name}")
            assert rel_rms(a, b) <= 1e-6, name
        rf.eval(), rf_torch.eval()
    form = kernel_form(rf, q, k, mask, 0.25, causal=False)
    ab, psi = form.coeffs, form.psi
    p = rf_torch.feature_params(q * 0.5, k * 0.5, mask)
    assert rel_rms(ab, torch.cat((p["A"], p["B"], p["log_D"]), dim=-1).flatten(-2)) <= 1e-6
    if feature == "saderf":
        assert rel_rms(psi, p["psi"].squeeze(-2)) <= 1e-6
    assert float(p["A"].abs().max()) > 1e-3  # the statistics are not trivial


def _torch_coeffs(rf, q, k, mask, scale, causal=False, qmask=None, maps=None):
    """``(coeffs [.., 3], psi or None)`` of the torch path's parameters for the call."""
    from rfattn.torch_path import torch_inputs

    *_, p = torch_inputs(q, k, rf, mask, scale, causal, qmask, maps=maps)
    psi = p.get("psi")
    coeffs = torch.cat((p["A"], p["B"], p["log_D"]), dim=-1).flatten(-2)
    return coeffs, None if psi is None else psi.squeeze(-2)


def _assert_form_params(form, want, feature, tol=1e-13):
    coeffs, psi = want
    assert form.coeffs.dtype == torch.float64
    assert rel_rms(form.coeffs, coeffs.expand_as(form.coeffs)) <= tol
    if feature == "saderf":
        assert rel_rms(form.psi, psi.expand_as(form.psi)) <= tol
    else:
        assert form.psi is None


def _gqa_inputs(device, B=2, Hq=4, H=2, Tq=37, Tk=300, D=8):
    """Strided grouped-query q, shifted keys, key and query masks with one batch element whose
    keys are all padded (an empty (b, h) row on the key side)."""
    q = rand(B, Tq, Hq, D, seed=1, dtype=torch.float64, device=device).transpose(1, 2)
    k = rand(B, H, Tk, D, seed=2, scale=0.7, dtype=torch.float64, device=device) + 0.3
    g = torch.Generator().manual_seed(4)
    kmask = torch.rand(B, Tk, generator=g) < 0.3
    kmask[1] = True
    qmask = torch.rand(B, Tq, generator=g) < 0.2
    return q, k, kmask.to(device), qmask.to(device)


@pytest.mark.parametrize("feature", ["oprf", "saderf"])
@pytest.mark.parametrize("maps", [False, True], ids=["plain", "head_maps"])
def test_stats_pass_parameters_equal_the_torch_paths_float64(feature, maps, kernel_device):
    """The parameters the stats pass forms in its own launch (global statistics) equal the torch
    path's ``feature_params`` in float64: padded keys and queries left out, grouped-query query
    rows (q strided: read in place), a (b, h) without a valid key, head maps' mapped q and k."""
    from rfattn.fused import kernel_form

    q, k, kmask, qmask = _gqa_inputs(kernel_device)
    D = q.shape[-1]
    rf = rfattn.RandomFeatures(D, 16, feature=feature, seed=0).double().to(kernel_device)
    mt = None
    if maps:
        rf.add_head_maps(q.shape[1], k.shape[1])
        with torch.no_grad():
            for m, s in ((rf.query_map, 5), (rf.key_map, 6)):
                m.add_(0.3 * rand(*m.shape, seed=s, dtype=m.dtype, device=kernel_device))
        mt = rf.map_tensors(q, k)
    form = kernel_form(rf, q, k, kmask, 0.3, False, qmask, maps=mt)
    assert form.coeffs.shape == (2, 2, 3)
    _assert_form_params(form, _torch_coeffs(rf, q, k, kmask, 0.3, qmask=qmask, maps=mt), feature)
    assert form.coeffs[0, :, 0].abs().min() > 1e-3  # not trivial: A != 0 (batch 0 has keys)


@pytest.mark.parametrize("feature", ["oprf", "saderf"])
def test_running_statistics_in_the_stats_pass_float64(feature, kernel_device):
    """Causal, running statistics: in training the stats pass forms the parameters from the
    buffers as they were and then moves them (the first update copies, later ones mix), as the
    torch path does; in eval the kept form takes the moved buffers. float64 throughout."""
    from rfattn.fused import kernel_form

    q, k, kmask, _ = _gqa_inputs(kernel_device, Tq=300)
    D = q.shape[-1]
    rf = rfattn.RandomFeatures(D, 16, feature=feature, seed=0).double().to(kernel_device)
    rf_torch = copy.deepcopy(rf)
    fm, fm_torch = rf.feature_map, rf_torch.feature_map
    for step in range(3):
        rf.train(), rf_torch.train()
        qs, ks = q * (1 + step), k - 0.2 * step
        want = _torch_coeffs(rf_torch, qs, ks, kmask, 0.3, causal=True, qmask=kmask)
        _assert_form_params(kernel_form(rf, qs, ks, kmask, 0.3, True, kmask), want, feature)
        for name in Moments._fields:
            a, b = getattr(fm, f"running_{name}"), getattr(fm_torch, f"running_{name}")
            assert rel_rms(a, b) <= 1e-13, (step, name)
        assert int(fm.num_batches_tracked) == int(fm_torch.num_batches_tracked) == step + 1
        rf.eval(), rf_torch.eval()
        want = _torch_coeffs(rf_torch, q, k, kmask, 0.3, causal=True, qmask=kmask)
        _assert_form_params(kernel_form(rf, q, k, kmask, 0.3, True, kmask), want, feature)
    assert float(want[0][..., 0].abs().min()) > 1e-3
