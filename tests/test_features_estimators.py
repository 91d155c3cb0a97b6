"""Every component function is unbiased for its kernel; the variance claims the papers prove hold.

Redraws are vectorised: R independent weight matrices stacked on the batch axis ``[R, 1, M, D]``
broadcast against inputs ``[R, 1, T, D]`` (the feature maps accept leading dims on W), so 2000+
redraws cost one call. Tolerances are standard errors of the Monte Carlo means (4 SE), so every
test can fail: each also checks that a 10 % biased target would be rejected where it has power.
"""

import functools
import math

import pytest
import torch

from rfattn.features import make_feature_map
from rfattn.features.maclaurin import DOT_KERNELS, dot_kernel_fn, maclaurin_coefficients
from rfattn.weights import WEIGHTS

f64 = torch.float64


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=f64) * scale


@functools.lru_cache(maxsize=8)
def stacked_weights(name, R, M, D, seed=0):
    """R independent draws of the weight matrix ``name``, ``[R, 1, M, D]``."""
    g = torch.Generator().manual_seed(seed)
    # one tall draw: its blocks of D rows are independent, so R stacked [M, D] slices with
    # D | M are R independent matrices
    assert M % D == 0
    return WEIGHTS[name](R * M, D, generator=g, dtype=f64).reshape(R, 1, M, D)


def redraw_estimates(fm, xq, xk, w):
    """Kernel estimates ``[R, 1, Tq, Tk]`` for stacked weights w ``[R, 1, M, D]``."""
    R = w.shape[0]
    params = fm.params(xq, xk, update=False)  # [1, 1, ...]: broadcast over the redraws
    xq, xk = xq.expand(R, *xq.shape[1:]), xk.expand(R, *xk.shape[1:])
    extra = fm.draw(torch.Generator().manual_seed(123), batch_shape=(R, 1))
    params.update({k: v for k, v in extra.items()})
    return fm.estimate_kernel(xq, xk, w, params)


def assert_unbiased(est, target, power=True):
    R = est.shape[0]
    mean, se = est.mean(0), est.std(0) / math.sqrt(R)
    z = (mean - target) / se
    assert z.abs().max() <= 4, f"max |z| = {z.abs().max():.2f}"
    if power:
        assert ((mean - 1.1 * target) / se).abs().max() > 4, "test has no power"


# (feature, options, input scale); inputs small enough for the trig-type variances
CASES = [
    ("trigrf", {}, 0.5),
    ("posrf", {}, 0.5),
    ("hyprf", {}, 0.5),
    ("gerf", {"A": -0.1}, 0.5),
    ("gerf", {"A": 0.0, "s": -1}, 0.5),
    ("gerf", {"A": 0.02 + 0.05j, "s": -1}, 0.5),
    ("gerf", {"A": -0.2 + 0.1j, "s": 1}, 0.5),
    ("oprf", {}, 0.5),
    ("saderf", {}, 0.5),
    ("poisrf", {}, 0.5),
    ("poisrf", {"plus": True}, 0.5),
    ("geomrf", {}, 0.5),
    ("geomrf", {"plus": True}, 0.5),
    ("hrf", {"lambda_features": 4}, 0.5),
    ("hrf", {"lambda_features": 4, "share_base_projection": True}, 0.5),
]


def case_id(case):
    name, opts, _ = case
    return name + "".join(f"-{k}={v}" for k, v in opts.items())


@pytest.mark.parametrize("weights", ["gaussian", "orf"])
@pytest.mark.parametrize("case", CASES, ids=[case_id(c) for c in CASES])
def test_unbiased_for_softmax_kernel(case, weights):
    """Mean of estimate_kernel over 3000 redraws = exp(x . y) within 4 standard errors."""
    name, opts, s = case
    D, M, R = 4, 8, 3000
    xq, xk = rand(1, 1, 3, D, seed=1, scale=s), rand(1, 1, 3, D, seed=2, scale=s)
    xk[..., 0] *= 2.0  # different per-dimension scales (saderf's psi != 1)
    fm = make_feature_map(name, weights, num_rows=M, head_dim=D, **opts).double()
    est = redraw_estimates(fm, xq, xk, stacked_weights(weights, R, M, D, seed=7))
    target = fm.target_kernel(xq, xk)
    assert torch.allclose(target, torch.exp(xq @ xk.transpose(-1, -2)), rtol=1e-14, atol=0)
    assert_unbiased(est, target)


def test_gerf_special_cases_reduce_to_posrf_and_trigrf():
    """GERF (A=0, s=+1) is PosRF and (A=0, s=-1) is TrigRF, feature for feature."""
    D, M = 5, 7
    x, w = rand(2, 1, 4, D, seed=3, scale=0.7), rand(M, D, seed=4)
    pos = make_feature_map("posrf", "gaussian").logits(x, w, "query")
    g_pos = make_feature_map("gerf", "gaussian", A=0.0, s=1)
    assert torch.allclose(g_pos.logits(x, w, "query"), pos, rtol=1e-13, atol=1e-13)
    trig = make_feature_map("trigrf", "gaussian")
    g_trig = make_feature_map("gerf", "gaussian", A=0.0, s=-1)
    for side in ("query", "key"):
        a = torch.exp(g_trig.logits(x, w, side)) * g_trig.amplitude(x, w, side)
        b = torch.exp(trig.logits(x, w, side)) * trig.amplitude(x, w, side)
        # keys: [Re f2, -Im f2] with f2 = exp(-i w.y + |y|^2/2) is TrigRF's [cos, +sin] too
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), side


def test_complex_gerf_uses_re_minus_im_on_keys():
    """[Re, Im] on both sides would estimate Re(f1 conj f2) = exp(|x|^2/2+|y|^2/2) cos(w.(x+y)):
    biased for s = -1. The implemented [Re, Im] / [Re, -Im] pairing is unbiased (checked above);
    here: flipping the key's Im sign changes the estimate, i.e. the sign is load-bearing."""
    D, M = 4, 64
    x, y, w = rand(1, 1, 2, D, seed=5, scale=0.5), rand(1, 1, 2, D, seed=6, scale=0.5), rand(M, D)
    fm = make_feature_map("gerf", "gaussian", A=0.0, s=-1)
    est = fm.estimate_kernel(x, y, w)
    u_q, u_k = fm.logits(x, w, "query"), fm.logits(y, w, "key")
    g_q, g_k = fm.amplitude(x, w, "query"), fm.amplitude(y, w, "key")
    g_k_wrong = torch.cat((g_k[..., :M], -g_k[..., M:]), dim=-1)
    wrong = (torch.exp(u_q) * g_q) @ (torch.exp(u_k) * g_k_wrong).transpose(-1, -2) / M
    direct = torch.exp((x**2).sum(-1, keepdim=True) / 2 + (y**2).sum(-1).unsqueeze(-2) / 2)
    direct = direct * torch.cos((x @ w.T)[..., :, None, :] - (y @ w.T)[..., None, :, :]).mean(-1)
    assert torch.allclose(est, direct, rtol=1e-12)
    assert not torch.allclose(wrong, direct, rtol=1e-3)


# ---- rmf ----------------------------------------------------------------------------------


def test_maclaurin_coefficients_match_corrected_table():
    """Spec A.2: exact values to order 8, incl. the corrected log and sqrt rows."""
    exp8 = [1 / math.factorial(n) for n in range(9)]
    assert maclaurin_coefficients("exp", 8) == pytest.approx(exp8, rel=1e-15)
    assert maclaurin_coefficients("trigh", 8) == pytest.approx(exp8, rel=1e-15)
    assert maclaurin_coefficients("inverse", 8) == [1.0] * 9
    assert maclaurin_coefficients("log", 8) == pytest.approx(
        [1, 1, 1 / 2, 1 / 3, 1 / 4, 1 / 5, 1 / 6, 1 / 7, 1 / 8]
    )
    sqrt8 = [1, 1 / 2, 1 / 8, 1 / 16, 5 / 128, 7 / 256, 21 / 1024, 33 / 2048, 429 / 32768]
    assert maclaurin_coefficients("sqrt", 8) == pytest.approx(sqrt8, rel=1e-14)
    assert maclaurin_coefficients("poly", 5, poly_degree=3, poly_c=2.0) == [8, 12, 6, 1, 0, 0]
    t = torch.linspace(-0.6, 0.6, 13, dtype=f64)
    for k in DOT_KERNELS:
        a = maclaurin_coefficients(k, 60)
        series = sum(c * t**n for n, c in enumerate(a))
        assert torch.allclose(series, dot_kernel_fn(k, t), rtol=1e-10), k


def rmf_single_feature_products(fm, x, y, w, params):
    """Per-feature unbiased single-sample estimates ``[M']`` of K(x . y) (features are iid)."""
    phi_x = fm.values(x, w, "query", params)[0, 0, 0]
    phi_y = fm.values(y, w, "key", params)[0, 0, 0]
    prod = phi_x * phi_y
    if fm.mode == "h0":
        return prod[0] + prod[1:] * (prod.numel() - 1)
    return prod * prod.numel()


@pytest.mark.parametrize("mode", ["h0", "paper"])
@pytest.mark.parametrize("p", [2.0, 3.0])
@pytest.mark.parametrize("kernel", DOT_KERNELS)
def test_rmf_unbiased_and_variance_formula(kernel, p, mode):
    """Mean over 6000 iid features (= redraws of a one-feature map) hits the truncated series
    within 4 SE, and the empirical variance matches spec A.1's formula
    ``sum_n a_n^2/q_n mu^n - K^2`` within 4 standard errors of a variance."""
    D, M = 8, 6001
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 1, 1, D, generator=g, dtype=f64)
    y = torch.randn(1, 1, 1, D, generator=g, dtype=f64)
    x = x / x.norm() * D**-0.25
    y = y / y.norm() * D**-0.25
    opts = {"dot_kernel": kernel, "p": p, "mode": mode, "max_degree": 10}
    fm = make_feature_map("rmf", "rademacher", num_rows=M, head_dim=D, **opts).double()
    fm.redraw(g)
    w = WEIGHTS["rademacher"](M, D, generator=g, dtype=f64) if "rademacher" in WEIGHTS else None
    if w is None:
        w = (2 * torch.randint(0, 2, (M, D), generator=g) - 1).to(f64)
    est = rmf_single_feature_products(fm, x, y, w, fm.params(x, y))
    target = fm.target_kernel(x, y)[0, 0, 0, 0]
    n = est.numel()
    mean, var = est.mean(), est.var()
    assert abs(mean - target) <= 4 * (var / n).sqrt()
    # the variance formula (Rademacher mu) for the sampled part
    t = float((x * y).sum())
    xs, ys = x.flatten(), y.flatten()
    mu = float((xs @ xs) * (ys @ ys) + 2 * t**2 - 2 * (xs**2 * ys**2).sum())
    a0 = fm.coef[0]
    m2 = sum(fm.coef[k] ** 2 / q * mu**k for k, q in zip(fm.support, fm.pmf, strict=True))
    rand_part = float(target) - (a0 if mode == "h0" else 0.0)
    pred = m2 - rand_part**2
    dev = est - mean
    se_var = ((dev**4).mean() - var**2).clamp_min(0).sqrt() / math.sqrt(n)
    assert abs(var - pred) <= 4 * se_var + 1e-15, (float(var), pred)
    # truncation is negligible here
    full = float(dot_kernel_fn(kernel, torch.tensor(t, dtype=f64)))
    assert abs(float(target) - full) <= max(fm.coef[-1], 1e-300) * abs(t) ** 11 * 10 + 1e-15


def test_rmf_h0_constant_feature_and_degree_cap():
    D, M = 6, 64
    fm = make_feature_map("rmf", "rademacher", num_rows=M, head_dim=D, max_degree=5).double()
    fm.redraw(torch.Generator().manual_seed(0))
    assert int(fm.rmf_degree[0]) == 0 and float(fm.rmf_scale[0]) == 1.0  # sqrt(a_0) = 1
    assert int(fm.rmf_degree[1:].min()) >= 1 and int(fm.rmf_degree.max()) <= 5
    x = rand(1, 1, 3, D)
    w = (2 * torch.randint(0, 2, (M, D), generator=torch.Generator().manual_seed(1)) - 1).to(f64)
    phi = fm.values(x, w, "query", fm.params(x, x))
    assert torch.equal(phi[..., 0], torch.ones(1, 1, 3, dtype=f64))
    # a feature is its scale times the product of its first N projections
    i = int(torch.argmax(fm.rmf_degree))
    n = int(fm.rmf_degree[i])
    stages = [w[i]] + [fm.rmf_proj[s, i] for s in range(n - 1)]
    direct = fm.rmf_scale[i] * torch.stack([x[0, 0] @ st for st in stages]).prod(0)
    assert torch.allclose(phi[0, 0, :, i], direct, rtol=1e-12)
