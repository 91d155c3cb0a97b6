"""Weight matrices: determinism, distributions, structure, exactness and argument errors."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import linalg, special, stats
from scipy.stats import qmc as scipy_qmc

import rfattn
from rfattn import weights as W

#: rows with E[w] = 0 and E[w w^T] = I (marginally); mm and sgq are fitted / deterministic.
MOMENT_MATCHED = ("gaussian", "orf", "sorf", "qmc", "fastfood", "fastfoodl", "rademacher")
#: rows marginally Gaussian (fourth moment 3), not just matched in two moments.
GAUSSIAN_MARGINALS = ("gaussian", "orf", "qmc")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rows_for(name, head_dim, wanted):
    """A valid M near ``wanted``: sgq only has its level sizes (level 1: 2D+1)."""
    return W.sgq_size(head_dim, 1) if name == "sgq" else wanted


def gaussian_moment(k):
    """E[z^k] for z ~ N(0, 1): (k-1)!! for even k, 0 for odd k."""
    return 0.0 if k % 2 else float(math.prod(range(k - 1, 0, -2)))


def test_registry_covers_the_design_names():
    names = "gaussian orf sorf qmc mm sgq fastfood fastfoodl rademacher".split()
    assert sorted(W.ALL_WEIGHTS) == sorted(names)
    assert set(W.LEARNABLE_WEIGHTS) == {"fastfoodl"}


@pytest.mark.parametrize("name", sorted(W.WEIGHTS))
def test_deterministic_per_seed_and_seeds_differ(name):
    m = rows_for(name, 8, 20)
    a = W.draw_weights(name, m, 8, generator=gen(3))
    b = W.draw_weights(name, m, 8, generator=gen(3))
    c = W.draw_weights(name, m, 8, generator=gen(4))
    assert a.shape == (m, 8)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b)
    if name in W.DETERMINISTIC_WEIGHTS:
        assert torch.equal(a, c)
    else:
        assert not torch.allclose(a, c)


@pytest.mark.parametrize("name", sorted(W.WEIGHTS))
def test_dtype_and_device_honoured(name):
    m = rows_for(name, 6, 10)
    a = W.draw_weights(name, m, 6, generator=gen(0), dtype=torch.float64, device="cpu")
    b = W.draw_weights(name, m, 6, generator=gen(0), dtype=torch.float32)
    c = W.draw_weights(name, m, 6, generator=gen(0), device="meta")
    assert a.dtype == torch.float64 and b.dtype == torch.float32
    assert c.device.type == "meta" and c.shape == (m, 6)
    # same draw, only the final rounding differs
    assert torch.equal(a.to(torch.float32), b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(W.WEIGHTS))
def test_same_matrix_on_cuda(name):
    m = rows_for(name, 6, 10)
    a = W.draw_weights(name, m, 6, generator=gen(0), dtype=torch.float64)
    b = W.draw_weights(name, m, 6, generator=gen(0), dtype=torch.float64, device="cuda")
    assert b.device.type == "cuda" and torch.equal(a, b.cpu())


@pytest.mark.parametrize("name", MOMENT_MATCHED)
def test_rows_match_standard_normal_first_two_moments(name):
    """Per-draw row mean and second moment (iid across draws) match N(0, I) within 4 SE.

    D = 6 is not a power of two, so sorf / fastfood also exercise the padding and truncation.
    """
    D, M, R = 6, 24, 400
    g = gen(11)
    ws = torch.stack(
        [W.draw_weights(name, M, D, generator=g, dtype=torch.float64) for _ in range(R)]
    )
    means, seconds = ws.mean(1), ws.transpose(1, 2) @ ws / M  # [R, D], [R, D, D]
    for sample, target in ((means, torch.zeros(D)), (seconds, torch.eye(D))):
        est = sample.mean(0)
        se = sample.std(0) / math.sqrt(R)
        assert torch.all((est - target.double()).abs() <= 4 * se + 1e-12), (est, se)


@pytest.mark.parametrize("name", GAUSSIAN_MARGINALS)
def test_gaussian_marginals_have_fourth_moment_three(name):
    w = torch.cat([W.draw_weights(name, 16, 4, generator=gen(s)).double() for s in range(200)])
    fourth = w.pow(4)  # 4800 rows; per-draw rows are dependent, so use a generous 6 SE
    se = fourth.std() / math.sqrt(fourth.numel() / 16)
    assert (fourth.mean() - 3).abs() <= 6 * se
    # rademacher matches two moments but not this one: the test can tell them apart
    r = W.rademacher(16, 4, generator=gen(0))
    assert (r.pow(4).mean() - 3).abs() > 1.5


@pytest.mark.parametrize("M,D", [(3, 8), (8, 8), (21, 8), (40, 16)])
def test_orf_blocks_orthogonal_with_chi_norms(M, D):
    w = W.orf(M, D, generator=gen(5), dtype=torch.float64)
    assert w.shape == (M, D)
    for b0 in range(0, M, D):
        blk = w[b0 : b0 + D]
        gram = blk @ blk.T
        off = gram - torch.diag(torch.diagonal(gram))
        assert off.abs().max() <= 1e-10 * gram.diagonal().max()
    # rows of different blocks are not orthogonal (independent blocks)
    if M > D:
        assert (w[:D] @ w[D:].T).abs().max() > 1e-3


def test_orf_norms_follow_chi_distribution():
    D = 16
    norms = torch.cat(
        [W.orf(64, D, generator=gen(s), dtype=torch.float64).norm(dim=1) for s in range(40)]
    )
    p = stats.kstest(norms.numpy(), stats.chi(D).cdf).pvalue
    assert p > 1e-3
    # and they are not the fixed sqrt(D) of the deterministic variant
    assert norms.std() > 0.3


@pytest.mark.parametrize("n", [1, 2, 8, 64])
def test_fwht_matches_dense_hadamard(n):
    x = torch.randn(3, 5, n, dtype=torch.float64, generator=gen(n))
    h = torch.from_numpy(linalg.hadamard(n).astype(np.float64))
    torch.testing.assert_close(W.fwht(x, normalized=False), x @ h, rtol=0, atol=1e-12)
    torch.testing.assert_close(W.fwht(x), x @ h / math.sqrt(n), rtol=0, atol=1e-12)


@pytest.mark.parametrize("M,D", [(8, 8), (20, 8), (64, 32), (5, 1)])
def test_sorf_blocks_are_scaled_orthogonal(M, D):
    w = W.sorf(M, D, generator=gen(1), dtype=torch.float64)
    assert w.shape == (M, D)
    torch.testing.assert_close(w.norm(dim=1), torch.full((M,), math.sqrt(D)).double())
    for b0 in range(0, M, D):
        blk = w[b0 : b0 + D]
        torch.testing.assert_close(
            blk @ blk.T, D * torch.eye(len(blk)).double(), atol=1e-10, rtol=0
        )
    if M > D:  # independent blocks
        assert (w[:D] @ w[D:].T).abs().max() > 1e-3


def test_sorf_pads_non_power_of_two_dims():
    """D = 12 uses P = 16 blocks truncated to 12 columns: squared norms average to D, not P."""
    w = torch.cat([W.sorf(16, 12, generator=gen(s), dtype=torch.float64) for s in range(200)])
    sq = w.pow(2).sum(1)
    assert sq.max() <= 16 + 1e-9  # each row is a truncated row of norm^2 = 16
    assert (sq.mean() - 12).abs() < 4 * sq.std() / math.sqrt(200)


def test_qmc_points_equal_scipys_for_the_same_seed():
    M, D, seed = 64, 5, 7
    w = W.qmc(M, D, generator=gen(seed), dtype=torch.float64)
    scipy_seed = int(torch.randint(0, 2**62, (1,), generator=gen(seed)))
    engine = scipy_qmc.Sobol(d=D, scramble=True, rng=np.random.default_rng(scipy_seed))
    t = np.clip(engine.random(M), 1e-10, 1 - 1e-10)
    np.testing.assert_allclose(w.numpy(), special.ndtri(t), rtol=0, atol=1e-12)


def test_qmc_is_stratified_and_finite():
    """Scrambled Sobol with M = 2^k: each column has one point in each [j/M, (j+1)/M)."""
    M = 128
    w = W.qmc(M, 6, generator=gen(2), dtype=torch.float64)
    assert torch.isfinite(w).all()
    cells = np.floor(stats.norm.cdf(w.numpy()) * M).astype(int)
    for col in cells.T:
        assert sorted(col) == list(range(M))
    # iid Gaussian rows are not stratified like this
    g = np.floor(stats.norm.cdf(W.gaussian(M, 6, generator=gen(2)).double().numpy()) * M)
    assert any(len(set(col)) < M for col in g.T)
    # any M works (scipy's balance warning is silenced)
    assert W.qmc(10, 3, generator=gen(0)).shape == (10, 3)


@pytest.mark.parametrize("M,D", [(5, 4), (20, 8), (128, 32), (300, 7)])
def test_mm_matches_first_two_moments_exactly(M, D):
    w = W.mm(M, D, generator=gen(4), dtype=torch.float64)
    assert w.shape == (M, D)
    torch.testing.assert_close(w.mean(0), torch.zeros(D).double(), atol=1e-10, rtol=0)
    torch.testing.assert_close(w.T @ w / M, torch.eye(D).double(), atol=1e-10, rtol=0)


def _monomial_exponents(dim, max_degree):
    for degree in range(max_degree + 1):
        for combo in itertools.combinations_with_replacement(range(dim), degree):
            yield np.bincount(np.array(combo, dtype=int), minlength=dim)


@pytest.mark.parametrize("D,level", [(1, 3), (3, 1), (4, 2), (4, 3), (6, 2)])
def test_sgq_is_exact_up_to_its_degree_and_fails_above(D, level):
    nodes, a = W.sgq_level_rule(D, level)
    x = nodes.numpy()
    for k in _monomial_exponents(D, 2 * level + 1):
        rule = float((a.numpy() * np.prod(x**k, axis=1)).sum())
        exact = math.prod(gaussian_moment(int(kj)) for kj in k)
        assert abs(rule - exact) <= 1e-10 * max(1.0, exact), (k, rule, exact)
    if D > level:
        # prod_{j <= L+1} w_j^2 has expectation 1, but every node has <= L non-zero coordinates
        bad = np.prod(x[:, : level + 1] ** 2, axis=1)
        assert abs(float((a.numpy() * bad).sum()) - 1.0) > 0.5


@pytest.mark.parametrize("D", [2, 3, 4, 16, 64])
def test_sgq_level_one_is_the_papers_rule(D):
    w, a = W.sgq_rule(2 * D + 1, D, dtype=torch.float64)
    assert w.shape == (2 * D + 1, D)
    assert torch.equal(w[0], torch.zeros(D).double())
    assert a[0].item() == pytest.approx(1 - D / 3, abs=1e-12)  # negative for D >= 4
    axis = w[1:]
    assert torch.equal((axis != 0).sum(1), torch.ones(2 * D, dtype=torch.long))
    torch.testing.assert_close(axis.abs().sum(1), torch.full((2 * D,), math.sqrt(3)).double())
    torch.testing.assert_close(a[1:], torch.full((2 * D,), 1 / 6).double())
    assert a.sum().item() == pytest.approx(1.0, abs=1e-12)


def test_sgq_sizes_and_m_policy():
    for D, level in itertools.product((4, 5, 9), range(4)):
        if D > level:  # the closed form agrees with the built rule
            assert W.sgq_size(D, level) == W.sgq_level_rule(D, level)[0].shape[0]
    assert W.sgq_sizes(64, 2) == [1, 129, 8449]
    assert W.sgq(1, 64, generator=gen(0)).abs().sum() == 0
    with pytest.raises(ValueError, match=r"num_features \(M\) = 128.*\[1, 129\]"):
        W.sgq(128, 64, generator=gen(0))
    with pytest.raises(ValueError, match="level"):
        W.sgq_level_rule(4, -1)


@pytest.mark.parametrize("name", sorted(W.WEIGHTS))
def test_component_weights(name):
    m = rows_for(name, 5, 12)
    w, c = W.draw_weighted(name, m, 5, generator=gen(0), dtype=torch.float64)
    assert torch.equal(w, W.draw_weights(name, m, 5, generator=gen(0), dtype=torch.float64))
    assert c.shape == (m,) and c.dtype == torch.float64
    assert c.mean().item() == pytest.approx(1.0, abs=1e-12)
    if name == "sgq":
        torch.testing.assert_close(c, m * W.sgq_rule(m, 5, dtype=torch.float64)[1])
        assert c[0] < 0  # 1 - 5/3 < 0: signed weights
    else:
        assert torch.equal(c, torch.ones(m).double())


def _dense_fastfood(S, G, B, perm):
    p = S.numel()
    h = torch.from_numpy(linalg.hadamard(p).astype(np.float64))
    pi = torch.zeros(p, p, dtype=torch.float64)
    pi[perm, torch.arange(p)] = 1.0  # (X Pi)[:, j] = X[:, perm[j]]
    return torch.diag(S) @ h @ torch.diag(G) @ pi @ h @ torch.diag(B) / math.sqrt(p)


def test_fastfood_matches_the_dense_product_and_norms():
    M, D = 20, 8
    ff = W.FastFoodL(M, D, generator=gen(6)).double()
    w = ff()
    dense = torch.cat(
        [_dense_fastfood(ff.S[b], ff.G[b], ff.B[b], ff.perm[b]) for b in range(ff.S.shape[0])]
    )[:M]
    torch.testing.assert_close(w, dense, atol=1e-12, rtol=0)
    # row norm = S_i ||G|| = s_i (spec §3.6), and the fixed version is the same draw
    s = (ff.S * ff.G.norm(dim=1, keepdim=True)).reshape(-1)[:M]
    torch.testing.assert_close(w.norm(dim=1), s, atol=1e-12, rtol=0)
    fixed = W.fastfood(M, D, generator=gen(6), dtype=torch.float64)
    torch.testing.assert_close(fixed, w.detach(), atol=1e-6, rtol=0)  # ff params passed fp32
    # H diag(G) breaks orthogonality inside a block
    gram = fixed[:D] @ fixed[:D].T
    assert (gram - torch.diag(gram.diagonal())).abs().max() > 1e-2


def test_fastfood_norms_follow_chi_distribution():
    D = 16
    norms = torch.cat(
        [W.fastfood(32, D, generator=gen(s), dtype=torch.float64).norm(dim=1) for s in range(40)]
    )
    assert stats.kstest(norms.numpy(), stats.chi(D).cdf).pvalue > 1e-3


def test_fastfood_matrix_gradcheck():
    ff = W.FastFoodL(6, 3, generator=gen(0)).double()
    params = tuple(p.detach().requires_grad_() for p in (ff.S, ff.G, ff.B))

    def fn(S, G, B):
        return W.fastfood_matrix(S, G, B, ff.perm, 6, 3)

    assert torch.autograd.gradcheck(fn, params)


def test_fastfoodl_gets_gradients_through_rf_attention():
    rf = rfattn.RandomFeatures(8, 16, feature="posrf", weights="fastfoodl", seed=2)
    ff = rf.learner
    assert {n for n, _ in rf.named_parameters()} == {"learner.S", "learner.G", "learner.B"}
    torch.testing.assert_close(
        rf.weight, W.draw_weights("fastfoodl", 16, 8, generator=gen(2)), atol=1e-5, rtol=1e-5
    )
    q, k, v = (torch.randn(2, 2, 5, 8, generator=gen(i)) for i in range(3))
    out = rfattn.rf_attention(q, k, v, rf, backend="torch")
    (out * torch.randn(out.shape, generator=gen(9))).sum().backward()
    for p in (ff.S, ff.G, ff.B):
        assert p.grad is not None and torch.isfinite(p.grad).all()
        assert p.grad.abs().max() > 1e-6
    # a step changes W; redraw re-initialises it
    w0 = rf.weight.detach().clone()
    with torch.no_grad():
        ff.G.add_(1.0)
    assert not torch.allclose(rf.weight, w0)
    rf.redraw(seed=2)
    torch.testing.assert_close(rf.weight.detach(), w0)
    assert "learner.S" in rf.state_dict() and "weight" not in rf.state_dict()


def test_random_features_component_weight_buffer():
    rf = rfattn.RandomFeatures(4, 9, feature="posrf", weights="sgq", seed=0)
    w, a = W.sgq_rule(9, 4)
    assert torch.equal(rf.weight, w)
    torch.testing.assert_close(rf.component_weight, 9 * a)
    assert "component_weight" in rf.state_dict()
    other = rfattn.RandomFeatures(4, 9, feature="posrf", weights="orf", seed=0)
    assert torch.equal(other.component_weight, torch.ones(9))


@pytest.mark.parametrize("name", sorted(W.WEIGHTS))
def test_bad_arguments_raise_naming_the_argument(name):
    fn = W.WEIGHTS[name]
    for m, d, what in ((0, 4, "num_features"), (4, 0, "head_dim"), (-1, 4, "num_features")):
        with pytest.raises(ValueError, match=what):
            fn(m, d, generator=gen(0))
    with pytest.raises(ValueError, match="num_features"):
        fn(2.5, 4, generator=gen(0))
    m = rows_for(name, 4, 8)
    with pytest.raises(TypeError, match="generator"):
        fn(m, 4, generator=None)
    with pytest.raises(ValueError, match="dtype"):
        fn(m, 4, generator=gen(0), dtype=torch.int64)


def test_bad_names_and_matrix_specific_limits():
    with pytest.raises(ValueError, match="unknown weights"):
        W.draw_weights("nope", 4, 4, generator=gen(0))
    with pytest.raises(ValueError, match="unknown weights"):
        W.check_weights_name("sorf ")
    with pytest.raises(ValueError, match=r"num_features \(M\) > head_dim"):
        W.mm(8, 8, generator=gen(0))
    with pytest.raises(ValueError, match="num_features"):
        W.draw_weights("sgq", 10, 4, generator=gen(0))
    with pytest.raises(ValueError, match="head_dim"):
        W.qmc(4, W.unit_cube.SOBOL_MAX_DIM + 1, generator=gen(0))
    with pytest.raises(ValueError, match="power-of-two"):
        W.fwht(torch.zeros(3, 6))
    with pytest.raises(ValueError, match="num_features"):
        rfattn.RandomFeatures(8, 20, weights="sgq")
