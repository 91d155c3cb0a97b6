"""Issue 8: FourierRPE (FLT, spec crt-flt.md part B, checks B.4)."""

import math

import pytest
import torch

import rfattn
from rfattn.reference import linear_attention, softmax_attention

F64 = torch.float64


def _rpe(par, R, ell=1, **kw):
    kw.setdefault("num_components", 2)
    kw.setdefault("init_scale", 1.0)
    return rfattn.FourierRPE(2, R, ell, par, **kw).double()


# (parameterisation, pos_dim, options, grid nodes per axis, grid half-width, tolerance / max|f|)
GRID_CASES = [
    ("gaussian_mixture", 1, dict(init_range=(0.3, 0.8)), 801, 4.0, 1e-5),
    ("gaussian_mixture", 3, dict(init_range=(0.3, 0.5)), 36, 3.0, 1e-4),
    ("local", 1, dict(init_range=(3.5, 6.5)), 3200, 40.0, 6e-3),  # box: truncation ~1/(X dist)
    ("local", 1, dict(power=2, init_range=(2.0, 3.0)), 3200, 40.0, 2e-3),
    ("local", 1, dict(power=3, init_range=(1.5, 2.5)), 1600, 20.0, 1e-3),
    ("local", 3, dict(power=2, init_range=(0.8, 1.0)), 48, 6.0, 5e-2),
    ("gaussian_basis", 3, dict(init_range=(0.5, 1.0)), 32, 2.0, 1e-4),
]


@pytest.mark.parametrize(
    "par,ell,kw,n,X,tol",
    GRID_CASES,
    ids=[f"{c[0]}-l{c[1]}-k{c[2].get('power', 1)}" for c in GRID_CASES],
)
def test_realised_mask_equals_closed_form_inverse_transform(par, ell, kw, n, X, tol):
    """Deterministic midpoint quadrature of the inverse FT through the module's own a . b,
    against the closed-form f (no Monte Carlo: LRPE has infinite variance, B.1.7)."""
    rpe = _rpe(par, n**ell, ell, proposal="grid", proposal_scale=X, **kw)
    if ell == 1:
        pos = torch.arange(16, dtype=F64)
    elif par == "local":
        pos = torch.randint(-1, 2, (12, 3), generator=torch.Generator().manual_seed(0)).double()
    else:
        pos = 0.5 * torch.randn(10, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    d = pos[:, None] - pos[None]
    exact = rpe.closed_form(d)
    realised = rpe.mask(pos)
    assert exact.abs().max() > 0.1  # a non-trivial mask
    assert (realised - exact).abs().max() <= tol * exact.abs().max()


def test_fourier_pairs_in_closed_form():
    rpe = _rpe("local", 4, init_range=(1.5, 3.0))
    v = torch.nn.functional.softplus(rpe.raw_radius.detach())[..., 0]  # [H, T]
    g0 = rpe.spectral(torch.zeros(1, 1, dtype=F64))  # g(0) = sum_t 2 v_t C_t, no NaN
    torch.testing.assert_close(g0[:, 0], (2 * v * rpe.weight.detach()).sum(-1))
    xi = torch.tensor([[0.3]], dtype=F64)
    expected = (rpe.weight.detach() * torch.sin(2 * math.pi * v * 0.3) / (math.pi * 0.3)).sum(-1)
    torch.testing.assert_close(rpe.spectral(xi)[:, 0], expected)  # FLT (13)
    # f of LRPE is the indicator sum (14), away from the jumps
    d = torch.tensor([0.0, 1.0, 2.0, 4.0, 10.0], dtype=F64)
    ind = (d.abs()[None, None] <= v[..., None]).double()  # [H, T, 5]
    torch.testing.assert_close(rpe.closed_form(d), (rpe.weight.detach()[..., None] * ind).sum(1))
    # triangle of spec Fig. 1: k = 2, half-width v/2 box -> f = (v - |d|)_+
    tri = _rpe("local", 4, power=2, num_components=1)
    vt = torch.nn.functional.softplus(tri.raw_radius.detach())[:, 0, 0]
    d = torch.linspace(-4, 4, 33, dtype=F64)
    box2 = (2 * vt[:, None] - d.abs()).clamp_min(0)  # box of half-width v, self-convolved
    torch.testing.assert_close(tri.closed_form(d), tri.weight.detach() * box2)


def test_gaussian_mixture_unbiased_monte_carlo():
    """E[N^] = Re f for the finite-variance Gaussian mixture (B.4 item 3), within 5 SE."""
    rpe = _rpe("gaussian_mixture", 20000, init_range=(0.4, 0.6), seed=3)
    with torch.no_grad():
        rpe.mean.copy_(torch.tensor([[[0.0], [0.3]], [[0.1], [-0.2]]]))
    d = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    w = rpe.sample_weights().detach()  # [H, R]
    terms = w[:, :, None] * torch.cos(2 * math.pi * rpe.xi * d)  # [H, R, 3]
    est, se = terms.mean(1), terms.std(1) / math.sqrt(terms.shape[1])
    exact = rpe.closed_form(d)
    assert ((est - exact).abs() <= 5 * se + 1e-12).all()
    # and the module's own a . b is exactly that estimate (B.4 item 1)
    pos = torch.tensor([0.0, 1.0, 2.0], dtype=F64)
    torch.testing.assert_close(rpe.mask(pos)[:, 0, :], est, rtol=1e-9, atol=1e-12)


def test_translation_invariance_and_phase_precision():
    rpe = rfattn.FourierRPE(2, 64, proposal_scale=4.0, init_scale=1.0, seed=0)
    pos = torch.arange(8, dtype=F64)
    m0 = rpe.mask(pos)
    torch.testing.assert_close(rpe.mask(pos + 12345.0), m0, rtol=0, atol=1e-12)
    torch.testing.assert_close(rpe.mask(pos, center=3.0), m0, rtol=0, atol=1e-12)
    # long sequence, |r xi| ~ 2.6e5: fp32 positions times xi would be off by ~0.1 rad
    far = torch.arange(65536 - 8, 65536, dtype=torch.float32)
    a, b = rpe.features(far, center=0.0, dtype=torch.float32)
    torch.testing.assert_close((a.double() @ b.double().mT), m0, rtol=0, atol=1e-5)
    # the naive float32 phase errs by > 1e-2 rad there, the float64-reduced one by < 1e-5
    xi = rpe.xi[:, :, 0]  # [H, R]
    exact = 2 * math.pi * torch.frac(far.double()[:, None, None] * xi.double())
    naive = 2 * math.pi * (far[:, None, None] * xi.float())
    ours = rpe._phases(far[:, None], torch.zeros(1)).permute(1, 0, 2)
    wrap = lambda x: torch.remainder(x + math.pi, 2 * math.pi) - math.pi  # noqa: E731
    assert wrap(naive.double() - exact).abs().max() > 1e-2
    assert wrap(ours.float().double() - exact).abs().max() < 1e-5


def test_augmented_identity_and_exact_kernel_limit():
    """q^ . k^ = q.k/sqrt(d) + N^ exactly; exact softmax on q^, k^ = softmax(QK^T/sqrt d + N^)V,
    and with more samples R it approaches softmax(QK^T/sqrt d + N)V for the closed-form N."""
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 2, 12, 8
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=F64) for _ in range(3))
    pos = torch.arange(T, dtype=F64)
    exact_n = None
    err = {}
    for R in (8, 20000):
        rpe = rfattn.FourierRPE(H, R, init_scale=1.0, init_range=(0.2, 0.4), seed=1).double()
        qa, ka = rpe.augment(q, k, pos)
        assert qa.shape == (B, H, T, D + 2 * R)
        n_hat = rpe.mask(pos)
        torch.testing.assert_close(qa @ ka.mT, q @ k.mT / math.sqrt(D) + n_hat)
        flt = softmax_attention(qa, ka, v, scale=1.0)
        logits = q @ k.mT / math.sqrt(D) + n_hat
        torch.testing.assert_close(flt, torch.softmax(logits, -1) @ v)
        exact_n = rpe.closed_form(pos[:, None] - pos[None])
        target = torch.softmax(q @ k.mT / math.sqrt(D) + exact_n, -1) @ v
        err[R] = ((flt - target).norm() / target.norm()).item()
    assert exact_n.abs().max() > 0.3
    assert err[20000] < 0.1 * err[8], err


@pytest.mark.parametrize("feature", ["posrf", "oprf"])
def test_flt_rf_attention_approaches_rpe_softmax(feature):
    g = torch.Generator().manual_seed(2)
    B, H, T, D, R = 1, 2, 16, 8, 4
    q, k, v = (0.5 * torch.randn(B, H, T, D, generator=g, dtype=F64) for _ in range(3))
    rpe = rfattn.FourierRPE(H, R, parameterisation="local", init_range=(2.0, 4.0), seed=0).double()
    target = softmax_attention(*rpe.augment(q, k), v, scale=1.0)
    err = {}
    for M in (16, 4096):
        rf = rfattn.RandomFeatures(rpe.augmented_dim(D), M, feature, seed=0).double()
        out = rpe(q, k, v, rf, backend="torch")
        err[M] = ((out - target).norm() / target.norm()).item()
    assert err[4096] < 0.3 * err[16], err


def test_gradients_reach_g_parameters():
    for par, ell in (("gaussian_mixture", 1), ("local", 1), ("gaussian_basis", 3)):
        rpe = rfattn.FourierRPE(2, 8, ell, par, seed=0)
        layer = rfattn.RFAttention(16, 2, num_features=32, rpe=rpe)
        x = torch.randn(2, 6, 16)
        pos = torch.randn(2, 6, 3) if ell == 3 else None
        layer(x, positions=pos).square().sum().backward()
        for name, p in rpe.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, (par, name)
            assert torch.isfinite(p.grad).all()


def test_causal_flt_no_leak_and_prefix_equals_masked_quadratic():
    g = torch.Generator().manual_seed(3)
    B, H, T, D = 1, 2, 20, 8
    rpe = rfattn.FourierRPE(H, 6, seed=0, init_scale=1.0).double()
    rf = rfattn.RandomFeatures(rpe.augmented_dim(D), 32, "posrf", seed=0).double()
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=F64) for _ in range(3))
    pos = torch.arange(T, dtype=F64)
    out = rpe(q, k, v, rf, pos, causal=True, center=0.0)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for x in (q2, k2, v2):
        x[:, :, 12:] += 3.0
    out2 = rpe(q2, k2, v2, rf, pos, causal=True, center=0.0)
    torch.testing.assert_close(out[:, :, :12], out2[:, :, :12], rtol=0, atol=1e-12)
    assert not torch.allclose(out[:, :, 12:], out2[:, :, 12:])
    pq, pk = rf.features(*rpe.augment(q, k, pos, center=0.0), scale=1.0)
    torch.testing.assert_close(out, linear_attention(pq, pk, v, causal=True))
    # split/resume with a fixed centre equals one shot
    first, st = rpe(q[:, :, :9], k[:, :, :9], v[:, :, :9], rf, pos[:9], causal=True,
                    center=0.0, return_state=True)  # fmt: skip
    rest = rpe(q[:, :, 9:], k[:, :, 9:], v[:, :, 9:], rf, pos[9:], causal=True, center=0.0,
               initial_state=st)  # fmt: skip
    torch.testing.assert_close(torch.cat((first, rest), dim=2), out)


def test_3d_positions_rotation_invariant_basis_and_layer():
    rpe = rfattn.FourierRPE(2, 16, 3, "gaussian_basis", seed=0).double()
    pos = torch.randn(2, 9, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    rot, _ = torch.linalg.qr(torch.randn(3, 3, generator=torch.Generator().manual_seed(1),
                                         dtype=F64))  # fmt: skip
    d = pos[:, :, None] - pos[:, None]
    torch.testing.assert_close(rpe.closed_form(d), rpe.closed_form(d @ rot.T))
    assert rpe.mask(pos).shape == (2, 2, 9, 9)  # per-batch positions
    layer = rfattn.RFAttention(16, 2, num_features=32, rpe=rfattn.FourierRPE(2, 8, 3, seed=0))
    assert layer(torch.randn(2, 9, 16), positions=pos.float()).shape == (2, 9, 16)


def test_bad_arguments_and_redraw():
    for kw, name in (
        (dict(num_heads=0), "num_heads"),
        (dict(num_heads=2, num_samples=0), "num_samples"),
        (dict(num_heads=2, parameterisation="box"), "parameterisation"),
        (dict(num_heads=2, proposal="uniform"), "proposal"),
        (dict(num_heads=2, proposal="grid", num_samples=10, pos_dim=3), "num_samples"),
        (dict(num_heads=2, power=0), "power"),
        (dict(num_heads=2, proposal_scale=-1.0), "proposal_scale"),
    ):
        with pytest.raises(ValueError, match=name):
            rfattn.FourierRPE(**kw)
    rpe = rfattn.FourierRPE(2, 8, 3, seed=0)
    with pytest.raises(ValueError, match="positions"):
        rpe.mask(None, query_length=4)
    with pytest.raises(ValueError, match="positions"):
        rpe.mask(torch.randn(4, 2))
    q = torch.randn(1, 2, 4, 8)
    rf = rfattn.RandomFeatures(8, 16)
    with pytest.raises(ValueError, match="head_dim"):
        rfattn.FourierRPE(2, 8)(q, q, q, rf)
    xi = rpe.xi.clone()
    rpe.redraw(7)
    assert not torch.equal(xi, rpe.xi)
    rpe2 = rfattn.FourierRPE(2, 8, 3, seed=0)
    rpe2.redraw(7)
    assert torch.equal(rpe.xi, rpe2.xi)
