import math

import pytest
import torch
from scipy import stats

from rfattn import weights as W


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("name", sorted(W.WEIGHTS))
def test_deterministic_per_seed_and_seeds_differ(name):
    a = W.draw_weights(name, 20, 8, generator=gen(3))
    b = W.draw_weights(name, 20, 8, generator=gen(3))
    c = W.draw_weights(name, 20, 8, generator=gen(4))
    assert a.shape == (20, 8)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


@pytest.mark.parametrize("name", sorted(W.WEIGHTS))
def test_dtype_and_device_honoured(name):
    a = W.draw_weights(name, 10, 6, generator=gen(0), dtype=torch.float64, device="cpu")
    b = W.draw_weights(name, 10, 6, generator=gen(0), dtype=torch.float32)
    assert a.dtype == torch.float64 and b.dtype == torch.float32
    # same draw, only the final rounding differs
    assert torch.equal(a.to(torch.float32), b)


@pytest.mark.parametrize("name", sorted(W.WEIGHTS))
def test_rows_are_marginally_standard_normal(name):
    """Per-draw row mean and second moment (iid across draws) match N(0, I) within 4 SE."""
    D, M, R = 4, 10, 3000
    means, seconds = [], []
    g = gen(11)
    for _ in range(R):
        w = W.draw_weights(name, M, D, generator=g, dtype=torch.float64)
        means.append(w.mean(0))
        seconds.append(w.T @ w / M)
    means, seconds = torch.stack(means), torch.stack(seconds)
    for sample, target in ((means, torch.zeros(D)), (seconds, torch.eye(D))):
        est = sample.mean(0)
        se = sample.std(0) / math.sqrt(R)
        assert torch.all((est - target.double()).abs() <= 4 * se), (est, se)


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


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="unknown weights"):
        W.draw_weights("nope", 4, 4, generator=gen(0))
    with pytest.raises(NotImplementedError, match="planned"):
        W.draw_weights("sorf", 4, 4, generator=gen(0))
    for m, d, what in ((0, 4, "num_features"), (4, 0, "head_dim"), (-1, 4, "num_features")):
        with pytest.raises(ValueError, match=what):
            W.orf(m, d, generator=gen(0))
        with pytest.raises(ValueError, match=what):
            W.gaussian(m, d, generator=gen(0))
