"""Statistics closed forms against the specs' anchors; running/fixed modes; the papers' orderings;
option errors."""

import math

import pytest
import torch

import rfattn
from rfattn import stats as S
from rfattn.features import make_feature_map
from rfattn.weights import WEIGHTS

f64 = torch.float64


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=f64) * scale


# ---- closed forms -------------------------------------------------------------------------


def test_rho_star_exact_anchor_and_limits():
    """crt-flt.md A.1.4: d = 4, S = 2 gives rho* = sqrt(2) - 1, A* = -sqrt(2)/8; rho*(0) = 1."""
    rho = S.oprf_rho(torch.tensor(2.0, dtype=f64), 4)
    assert abs(float(rho) - (math.sqrt(2) - 1)) < 1e-15
    assert abs(float(S.oprf_A(torch.tensor(2.0, dtype=f64), 4)) + math.sqrt(2) / 8) < 1e-15
    assert float(S.oprf_rho(torch.tensor(0.0, dtype=f64), 64)) == 1.0
    # the printed CRT (7) agrees with the stable form for S > 0
    s = torch.tensor([0.01, 1.0, 16.0, 1e3], dtype=f64)
    d = 32
    printed = (torch.sqrt((2 * s + d) ** 2 + 8 * d * s) - 2 * s - d) / (4 * s)
    assert torch.allclose(S.oprf_rho(s, d), printed, rtol=1e-9)


@pytest.mark.parametrize(
    "phi, rho, a, b",
    [  # spectraformer.md §2.5, d = 32
        (0.1, 0.9877291, -0.0015529, 1.0031010),
        (1, 0.8941471, -0.0147980, 1.0291706),
        (4, 0.7015621, -0.0531738, 1.1012244),
        (10, 0.5138357, -0.1182684, 1.2137025),
        (100, 0.1245566, -0.8785598, 2.1246739),
    ],
)
def test_oprf_table_d32(phi, rho, a, b):
    t = torch.tensor(float(phi), dtype=f64)
    assert float(S.oprf_rho(t, 32)) == pytest.approx(rho, abs=1e-7)
    A = S.oprf_A(t, 32)
    assert float(A) == pytest.approx(a, abs=1e-7)
    assert float(S.gerf_real_constants(A, 32)[0]) == pytest.approx(b, abs=1e-7)


@pytest.mark.parametrize(
    "d, s, logd, mu",
    [
        (64, 1, 0.47846501, -0.029449),
        (64, 16, 5.27332786, -4.387426),
        (64, 100, 16.97709815, -61.221180),
        (4, 2, 0.53480000, -0.795120),
    ],
)
def test_oprf_log_d_and_second_moment_ratio(d, s, logd, mu):
    """crt-flt.md A.1.4 table: log D and mu = log(M2_OPRF / M2_PosRF) (Fig. 1: e^-60 at S=100)."""
    t = torch.tensor(float(s), dtype=f64)
    rho = float(S.oprf_rho(t, d))
    assert float(S.gerf_real_constants(S.oprf_A(t, d), d)[1]) == pytest.approx(logd, abs=1e-6)
    assert d / 2 * math.log((rho + 1) ** 2 / (4 * rho)) + (rho - 1) * s == pytest.approx(
        mu, abs=1e-5
    )


def oprf_log_m2(a, d, x, y):
    """log of the single-sample second moment of softmax GERF (real A, s = +1), crt A.1.3."""
    s = float(((x + y) ** 2).sum())
    nx, ny = float((x * x).sum()), float((y * y).sum())
    return (
        d / 2 * math.log((1 - 4 * a) ** 2 / (1 - 8 * a))
        + 2 * (1 - 4 * a) / (1 - 8 * a) * s
        - nx
        - ny
    )


def test_oprf_A_minimises_the_variance():
    """A grid argmin of the real-A second moment equals A* = (1 - 1/rho*)/8 (CRT Theorem 3.3)."""
    d = 8
    x, y = rand(d, seed=1, scale=0.7), rand(d, seed=2, scale=0.7)
    a_star = float(S.oprf_A(((x + y) ** 2).sum(), d))
    grid = torch.linspace(-2.0, 0.12, 200001, dtype=f64)
    vals = [oprf_log_m2(float(a), d, x, y) for a in grid[::100]]
    coarse = float(grid[::100][int(torch.tensor(vals).argmin())])
    fine = grid[(grid - coarse).abs() < 2e-3]
    best = float(fine[int(torch.tensor([oprf_log_m2(float(a), d, x, y) for a in fine]).argmin())])
    assert abs(best - a_star) < 1e-5


def test_pair_average_identity_and_padding():
    """CRT (8): the O(L d) pair average equals the brute-force mean over (i, j), Lq != Lk,
    padded keys excluded; and psi equalises the transformed mean squares (spec §6)."""
    xq, xk = rand(2, 3, 5, 4, seed=3), rand(2, 3, 7, 4, seed=4, scale=2.0)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 4:] = True
    m = S.sequence_moments(xq, xk, mask)
    for b, valid in ((0, 7), (1, 4)):
        pairs = ((xq[b][:, :, None] + xk[b][:, None, :valid]) ** 2).sum(-1).mean(dim=(-2, -1))
        assert torch.allclose(S.pair_sq_norm(m)[b], pairs, rtol=1e-12)
    psi = S.saderf_psi(m)
    assert torch.allclose(psi**2 * m.sq[..., 0, :], m.sq[..., 1, :] / psi**2, rtol=1e-10)
    brute = (
        xq[0][:, :, None] * psi[0, :, None, None] + xk[0][:, None] / psi[0, :, None, None]
    ) ** 2
    assert torch.allclose(S.pair_sq_norm(m, psi)[0], brute.sum(-1).mean(dim=(-2, -1)), rtol=1e-12)


def test_poisson_lambda_is_the_argmin_and_geometric_anchor():
    """lambda* = sqrt(S2/d) minimises lambda d + S2/lambda; p*(a = [.1, .5, 1, 2]) = 0.494487."""
    sq = torch.tensor([[0.2, 1.0, 0.5], [0.4, 0.3, 2.0]], dtype=f64)
    m = S.Moments(torch.zeros_like(sq), sq, sq.sqrt(), torch.zeros_like(sq))
    lam = float(S.poisson_lambda(m))
    s2 = float((sq[0] * sq[1]).sum())
    grid = torch.linspace(0.01, 5, 100000, dtype=f64)
    assert abs(float(grid[(grid * 3 + s2 / grid).argmin()]) - lam) < 1e-4
    a = torch.tensor([0.1, 0.5, 1.0, 2.0], dtype=f64)
    m = S.Moments(
        torch.zeros(2, 4, dtype=f64),
        torch.zeros(2, 4, dtype=f64),
        torch.stack((a, torch.ones_like(a))),
        torch.zeros(2, 4, dtype=f64),
    )
    assert float(S.geometric_p(m)) == pytest.approx(0.494487, abs=2e-6)


# ---- modes --------------------------------------------------------------------------------


def test_running_stats_ema_semantics_and_buffers():
    D = 4
    rf = rfattn.RandomFeatures(
        D, 8, feature="oprf", weights="gaussian", stats="running", momentum=0.5
    ).double()
    fm = rf.feature_map
    q1, k1 = rand(2, 3, 6, D, seed=5), rand(2, 3, 6, D, seed=6)
    q2, k2 = rand(2, 3, 6, D, seed=7, scale=2.0), rand(2, 3, 6, D, seed=8)
    assert int(fm.num_batches_tracked) == 0 and float(fm.running_sq.abs().sum()) == 0
    # first call uses the zero buffers (A = 0: posrf), then copies the batch moments
    pos = rfattn.RandomFeatures(D, 8, feature="posrf", weights="gaussian").double()
    pos.weight.copy_(rf.weight)
    out = rfattn.rf_attention(q1, k1, k1, rf, scale=1.0)
    assert torch.allclose(out, rfattn.rf_attention(q1, k1, k1, pos, scale=1.0), rtol=1e-12)
    m1 = S.pool_moments(S.sequence_moments(q1, k1))
    assert torch.allclose(fm.running_sq, m1.sq) and int(fm.num_batches_tracked) == 1
    # second call uses m1 (not its own data), then EMA with momentum 0.5
    p = fm.params(q2, k2, update=False)
    assert torch.allclose(p["A"].flatten(), S.oprf_A(S.pair_sq_norm(m1), D).flatten())
    rfattn.rf_attention(q2, k2, k2, rf, scale=1.0)
    m2 = S.pool_moments(S.sequence_moments(q2, k2))
    assert torch.allclose(fm.running_mean, 0.5 * m1.mean + 0.5 * m2.mean)
    assert torch.allclose(fm.running_min, 0.5 * m1.min + 0.5 * m2.min)
    # eval mode: no update; buffers are in the state_dict and move with .to
    rf.eval()
    before = fm.running_sq.clone()
    rfattn.rf_attention(q1, k1, k1, rf, causal=True)
    assert torch.equal(fm.running_sq, before)
    assert "feature_map.running_sq" in rf.state_dict()
    assert rf.float().feature_map.running_sq.dtype == torch.float32


def test_causal_global_raises_and_defaults():
    D = 4
    q, k, v = rand(1, 2, 5, D), rand(1, 2, 5, D, seed=1), rand(1, 2, 5, 3, seed=2)
    for name in ("oprf", "saderf", "poisrf", "geomrf"):
        rf = rfattn.RandomFeatures(D, 8, feature=name, weights="gaussian", stats="global").double()
        with pytest.raises(ValueError, match="stats='global'"):
            rfattn.rf_attention(q, k, v, rf, causal=True)
        auto = rfattn.RandomFeatures(D, 8, feature=name, weights="gaussian").double()
        assert auto.feature_map.mode(causal=True) == "running"
        assert auto.feature_map.mode(causal=False) == "global"
        assert rfattn.rf_attention(q, k, v, auto, causal=True).isfinite().all()


def test_stats_grad_flag():
    D = 4
    q = rand(1, 1, 5, D).requires_grad_()
    for flag in (False, True):
        fm = make_feature_map("oprf", "gaussian", num_rows=8, head_dim=D, stats_grad=flag)
        a = fm.params(q, q)["A"]
        assert a.requires_grad is flag


def test_fixed_mode_uses_the_given_values():
    D = 3
    q = rand(1, 1, 4, D)
    fm = make_feature_map("oprf", "gaussian", num_rows=8, head_dim=D, stats="fixed", A=-0.25)
    assert float(fm.params(q, q)["A"]) == -0.25
    fm = make_feature_map(
        "saderf", "gaussian", num_rows=8, head_dim=D, stats="fixed", psi=[1.0, 2.0, 0.5]
    )
    assert torch.equal(fm.params(q, q)["psi"].flatten().float(), torch.tensor([1.0, 2.0, 0.5]))
    fm = make_feature_map(
        "geomrf",
        "gaussian",
        num_rows=8,
        head_dim=D,
        stats="fixed",
        p=0.3,
        plus=True,
        shift=[-3.0] * 3,
    )
    assert float(fm.params(q, q)["rate"]) == pytest.approx(0.3)


# ---- the papers' orderings ----------------------------------------------------------------


def kernel_estimates(name, weights, x, y, R, M, seed=0, **opts):
    """R redraws of the estimate of K(x, y) for one pair (x, y ``[D]``): ``[R]``."""
    D = x.shape[-1]
    fm = make_feature_map(name, weights, num_rows=M, head_dim=D, **opts).double()
    xq, xk = x.reshape(1, 1, -1, D), y.reshape(1, 1, -1, D)
    params = fm.params(xq, xk, update=False)
    w = WEIGHTS[weights](R * M, D, generator=torch.Generator().manual_seed(seed), dtype=f64)
    w = w.reshape(R, 1, M, D)
    params.update(fm.draw(torch.Generator().manual_seed(seed + 1), batch_shape=(R, 1)))
    est = fm.estimate_kernel(xq.expand(R, 1, -1, D), xk.expand(R, 1, -1, D), w, params)
    return est, fm.target_kernel(xq, xk)


def test_oprf_variance_below_posrf_on_crt_setup():
    """crt-flt.md A.4.6: d = 16, x, y ~ N(0, 0.4^2 I), M = d iid: Var(OPRF) < Var(PosRF) (measured
    there: 0.0140 vs 0.0469, K = 0.1206... per pair); and each matches CRT (6) / M."""
    d, M, R = 16, 16, 6000
    x, y = rand(d, seed=21, scale=0.4), rand(d, seed=22, scale=0.4)
    var = {}
    for name in ("posrf", "oprf"):
        est, target = kernel_estimates(name, "gaussian", x, y, R, M)
        est = est.flatten()
        var[name] = float(est.var())
        a = 0.0 if name == "posrf" else float(S.oprf_A(((x + y) ** 2).sum(), d))
        pred = (math.exp(oprf_log_m2(a, d, x, y)) - float(target) ** 2) / M
        dev = est - est.mean()
        se = float(((dev**4).mean() - est.var() ** 2).sqrt()) / math.sqrt(R)
        assert abs(var[name] - pred) <= 4 * se, (name, var[name], pred)
    assert var["oprf"] < 0.5 * var["posrf"]


def test_saderf_no_worse_than_oprf_with_different_scales():
    """Queries and keys with different per-dimension scales: SADERF's mean squared kernel error
    over all pairs is no worse than OPRF's (the spec does not claim more)."""
    d, M, R = 4, 8, 3000
    scales = torch.tensor([2.0, 1.0, 0.5, 0.25], dtype=f64)
    xq = rand(1, 1, 6, d, seed=30, scale=0.5) * scales
    xk = rand(1, 1, 6, d, seed=31, scale=0.5) / scales
    mse = {}
    for name in ("oprf", "saderf"):
        fm = make_feature_map(name, "gaussian", num_rows=M, head_dim=d).double()
        params = fm.params(xq, xk, update=False)
        w = WEIGHTS["gaussian"](R * M, d, generator=torch.Generator().manual_seed(3), dtype=f64)
        est = fm.estimate_kernel(
            xq.expand(R, 1, 6, d), xk.expand(R, 1, 6, d), w.reshape(R, 1, M, d), params
        )
        err = ((est - fm.target_kernel(xq, xk)) ** 2).mean(dim=(1, 2, 3))  # [R]
        mse[name] = (float(err.mean()), float(err.std()) / math.sqrt(R))
    (m_o, se_o), (m_s, se_s) = mse["oprf"], mse["saderf"]
    assert m_s <= m_o + 4 * math.hypot(se_o, se_s), mse


def test_hrf_max_relative_error_below_both_bases():
    """macformer-hrf.md B.3 (Lemma 3.4, Theorem 3.5): on the sphere r = 1 with m = 16, n = 8, the
    angular hybrid's max relative error over theta is below trig's and FAVOR+'s (table: 0.312 vs
    1.282). Pointwise the hybrid is NOT below both (trig is exact at theta = 0): not asserted."""
    d, m, R = 8, 16, 3000
    thetas = torch.linspace(0.0, math.pi, 9, dtype=f64)
    e1, e2 = torch.zeros(d, dtype=f64), torch.zeros(d, dtype=f64)
    e1[0], e2[1] = 1.0, 1.0
    x = e1.expand(9, d)
    y = torch.cos(thetas)[:, None] * e1 + torch.sin(thetas)[:, None] * e2
    rel = {}
    for name, M, opts in (
        ("trigrf", m, {}),
        ("hyprf", m, {}),
        ("hrf", 2 * m, {"lambda_features": 8}),
    ):
        est, target = kernel_estimates(name, "gaussian", x, y, R, M, seed=5, **opts)
        diag_est = torch.diagonal(est[:, 0], dim1=-2, dim2=-1)  # [R, 9] pairs (x_i, y_i)
        diag_t = torch.diagonal(target[0, 0])
        rel[name] = float(((diag_est - diag_t) ** 2).mean(0).sqrt().div(diag_t).max())
    # analytic maxima: trig = FAVOR+ = W(1)/sqrt(2m) = 1.282; hybrid about 0.31
    assert rel["trigrf"] == pytest.approx(1.282, rel=0.25)
    assert rel["hyprf"] == pytest.approx(1.282, rel=0.25)
    assert rel["hrf"] < 0.5 * min(rel["trigrf"], rel["hyprf"]), rel


# ---- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "feature, weights, opts, match",
    [
        ("posrf", "rademacher", {}, "valid weights for it.*gaussian"),
        ("rmf", "gaussian", {}, r"valid weights for it: \['rademacher'\]"),
        ("poisrf", "sorf", {}, "valid weights for it"),
        ("oprf", "orf", {"stats": "batch"}, "option stats="),
        ("oprf", "orf", {"momentum": 2.0}, "option momentum"),
        ("oprf", "orf", {"stats_grad": 1}, "option stats_grad"),
        ("oprf", "orf", {"stats": "fixed"}, r"needs option\(s\) \['A'\]"),
        ("oprf", "orf", {"A": -0.1}, "only used with stats='fixed'"),
        ("oprf", "orf", {"stats": "fixed", "A": 0.2}, "option A"),
        ("saderf", "orf", {"stats": "fixed", "psi": [1.0, -1.0]}, "option psi"),
        ("gerf", "orf", {"A": 0.3}, "option A"),
        ("gerf", "orf", {"s": 2}, "option s="),
        ("poisrf", "gaussian", {"shift": [0.0] * 4}, "option shift needs plus"),
        ("geomrf", "gaussian", {"stats": "fixed", "p": 1.5}, "option p"),
        ("hrf", "gaussian", {"lambda_features": 0}, "option lambda_features"),
        ("rmf", "rademacher", {"dot_kernel": "cos"}, "option dot_kernel="),
        ("rmf", "rademacher", {"p": 1.0}, "option p"),
        ("rmf", "rademacher", {"max_degree": 0}, "option max_degree"),
        ("rmf", "rademacher", {"mode": "lit"}, "option mode="),
        ("rmf", "rademacher", {"dot_kernel": "poly", "poly_degree": 0}, "no positive coefficient"),
        ("trigrf", "gaussian", {"A": 1}, r"no option\(s\) \[.A.\] \(it takes no options\)"),
        ("oprf", "gaussian", {"lam": 1}, r"has no option\(s\) \['lam'\]"),
    ],
)
def test_invalid_options_raise_naming_the_option(feature, weights, opts, match):
    with pytest.raises(ValueError, match=match):
        rfattn.RandomFeatures(4, 8, feature=feature, weights=weights, **opts)
