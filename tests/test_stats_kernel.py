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
    from rfattn.kernels.stats import token_moments

    x = rand(2, 2, 0, 8, device=kernel_device)
    assert all(torch.equal(t, torch.zeros(2, 2, 8, device=t.device)) for t in token_moments(x, 0.5))


@pytest.mark.parametrize("feature", ["oprf", "saderf"])
@pytest.mark.parametrize("stats", ["global", "running"])
def test_feature_parameters_from_the_stats_pass(feature, stats, kernel_device):
    """The triton path's A, B, psi (stats kernel + the closed forms of rfattn.stats) equal the
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
