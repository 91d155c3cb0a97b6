"""Unit-cube matrices: quasi-Monte Carlo (QMC) and moment matching (MM), spec §3.8-3.9.

Both map points ``t_i`` of ``[0, 1)^D`` through the inverse normal CDF, ``w = Phi^-1(t)``.

Seeding (spec pitfall 17, paper-math orientation: M points in D dimensions): one draw
``torch.randint(0, 2**62, (1,), generator=generator)`` seeds ``numpy.random.default_rng``,
which scrambles ``scipy.stats.qmc.Sobol(d=D, scramble=True)``; ``engine.random(M)`` gives the M
points. So the matrix is a pure function of the torch generator's state, and the generator
advances by exactly one draw. Sobol's balance properties (one point per ``1/M`` interval in each
coordinate) hold when M is a power of two; other M are allowed (scipy's warning is silenced).
Scrambled points lie on the ``2^-30`` grid and may be exactly 0, so they are clamped to
``[1e-10, 1 - 1e-10]`` before ``Phi^-1`` (finite: ``|w| <= 6.4``).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from scipy.stats import qmc as scipy_qmc

from rfattn.weights._common import check_generator, check_sizes, finish

__all__ = ["qmc", "mm", "sobol_points", "QMC_EPS", "SOBOL_MAX_DIM"]

#: clamp applied to the unit-cube points before the inverse normal CDF
QMC_EPS = 1e-10
#: the largest dimension scipy's Sobol direction numbers support
SOBOL_MAX_DIM = 21201


def sobol_points(num_rows: int, head_dim: int, *, generator: torch.Generator) -> torch.Tensor:
    """M scrambled Sobol points in ``[0, 1)^D``, seeded from ``generator`` (module docstring).

    Returns:
        float64 CPU tensor ``[M, D]``, unclamped.
    """
    check_sizes(num_rows, head_dim)
    check_generator(generator)
    if head_dim > SOBOL_MAX_DIM:
        raise ValueError(
            f"head_dim (D) must be <= {SOBOL_MAX_DIM} for Sobol points, got {head_dim}"
        )
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    engine = scipy_qmc.Sobol(d=head_dim, scramble=True, rng=np.random.default_rng(seed))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*balance properties.*")
        t = engine.random(num_rows)
    return torch.from_numpy(t)


def _inverse_normal(t: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtri(t.clamp(QMC_EPS, 1.0 - QMC_EPS))


def qmc(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Quasi-Monte Carlo matrix (spec §3.8, Eq 28): ``w_i = Phi^-1(t_i)``, scrambled Sobol t_i.

    Each scrambled point is marginally uniform (on scipy's 2^-30 grid), so each row is
    marginally N(0, I) up to that grid and the clamp; the rows of one draw are strongly
    dependent (stratified), which is the point of QMC. No unbiasedness is promised for the
    estimators built on it (spec pitfall 22).

    Args:
        num_rows: M, the number of random features (rows); a power of two keeps Sobol balanced.
        head_dim: D, the query/key head dimension (columns), at most ``SOBOL_MAX_DIM``.
        generator: a CPU ``torch.Generator``; consumed by exactly one draw (the scipy seed).
        device, dtype: where the result lives (default CPU, the default dtype).

    Returns:
        Tensor ``[M, D]``, finite.
    """
    t = sobol_points(num_rows, head_dim, generator=generator)
    return finish(_inverse_normal(t), device, dtype)


def mm(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Moment matching (spec §3.9): QMC rows whitened to sample mean 0 and covariance I exactly.

    ``w0 = Phi^-1(t)`` from the scrambled Sobol points of :func:`qmc` (the paper's
    low-discrepancy inputs; the reference code uses iid uniforms), then

        mu = mean_i w0_i,   C = (1/M) sum_i (w0_i - mu)(w0_i - mu)^T,   W = (w0 - mu) C^(-1/2)

    with the 1/M (biased) covariance convention and the symmetric square root (ZCA). Hence
    ``W.mean(0) = 0`` and ``W^T W / M = I`` exactly (to rounding). Why symmetric: it is the
    whitening that moves the points least and does not depend on the coordinate order, unlike
    Cholesky; either is allowed (spec pitfall 18). Needs M > D (M - 1 >= D centred points for a
    full-rank C). Not marginally N(0, I) and not unbiased for finite M (spec pitfall 22).

    Args and Returns as in :func:`qmc`.

    Raises:
        ValueError: if M <= D.
    """
    check_sizes(num_rows, head_dim)
    if num_rows <= head_dim:
        raise ValueError(
            f"mm needs num_features (M) > head_dim (D) for a full-rank covariance, got "
            f"M={num_rows}, D={head_dim}"
        )
    w0 = _inverse_normal(sobol_points(num_rows, head_dim, generator=generator))
    centred = w0 - w0.mean(dim=0, keepdim=True)
    cov = centred.T @ centred / num_rows
    evals, evecs = torch.linalg.eigh(cov)
    inv_sqrt = evecs @ torch.diag(evals.rsqrt()) @ evecs.T
    return finish(centred @ inv_sqrt, device, dtype)
