"""Plain Monte Carlo matrices: iid Gaussian (Spectraformer's Base) and iid Rademacher."""

from __future__ import annotations

import torch

from rfattn.weights._common import check_generator, check_sizes, finish

__all__ = ["gaussian", "rademacher"]


def gaussian(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Base Monte Carlo matrix: iid N(0, 1) entries ``[M, D]`` (spec §3.1). Arguments as every
    registered matrix takes them (:func:`rfattn.weights.draw_weights`): the draw is a pure
    function of the generator's state."""
    check_sizes(num_rows, head_dim)
    check_generator(generator)
    w = torch.randn(num_rows, head_dim, generator=generator, dtype=torch.float64)
    return finish(w, device, dtype)


def rademacher(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """iid Rademacher entries (±1 with probability 1/2 each), ``[M, D]``.

    The projections of random Maclaurin features (spec ``macformer-hrf.md``): mean 0 and
    ``E[w w^T] = I`` like N(0, I), with a smaller fourth moment. Not a spectral sample of the
    softmax kernel, so the exponential features do not accept it.

    Arguments as in :func:`rfattn.weights.draw_weights`.
    """
    check_sizes(num_rows, head_dim)
    check_generator(generator)
    bits = torch.randint(0, 2, (num_rows, head_dim), generator=generator, dtype=torch.int64)
    return finish(2.0 * bits.to(torch.float64) - 1.0, device, dtype)
