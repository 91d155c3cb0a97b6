"""Weight matrices W [M, D] whose rows omega_i are the random-feature frequencies.

Every generator draws on the CPU in float64 from an explicit ``torch.Generator`` and only then
moves the result to the requested device and dtype, so the same seed gives the same matrix on
any device and in any dtype (up to the final rounding).

Target distribution: rows marginally N(0, I_D) (spec ``spectraformer.md`` §3; sigma = 1 because
queries and keys are pre-scaled by sqrt(scale) before the projection). Exactly so for
``gaussian`` and ``orf``; ``sorf``, ``fastfood`` and ``rademacher`` match the first two moments
(``E[w] = 0``, ``E[w w^T] = I``) but are not Gaussian; ``qmc`` is marginally N(0, I) up to its
grid and clamp but its rows are dependent; ``mm`` and ``sgq`` are fitted or deterministic
point sets. Only ``gaussian`` and ``orf`` give exactly unbiased Monte Carlo estimators (spec
pitfall 22).

One file per family (registry here):

- ``monte_carlo``: ``gaussian`` (Base), ``rademacher`` (for random Maclaurin features)
- ``orthogonal``: ``orf``, ``sorf``
- ``fastfood``: ``fastfood``, ``fastfoodl`` and the learnable :class:`FastFoodL` module
- ``unit_cube``: ``qmc``, ``mm``
- ``quadrature``: ``sgq`` with :func:`sgq_rule` returning the quadrature weights

Component weights: :func:`draw_weighted` also returns ``c [M]`` such that a kernel estimate is
``(1/M) sum_r c_r phi_r(x) phi_r(y)``: ones for every matrix except ``sgq``, where
``c = M * a`` with a the (signed) quadrature weights.
"""

from __future__ import annotations

import torch

from rfattn.weights._common import fwht
from rfattn.weights.fastfood import FastFoodL, fastfood, fastfood_matrix, fastfoodl
from rfattn.weights.monte_carlo import gaussian, rademacher
from rfattn.weights.orthogonal import orf, sorf
from rfattn.weights.quadrature import sgq, sgq_level_rule, sgq_rule, sgq_size, sgq_sizes
from rfattn.weights.unit_cube import mm, qmc, sobol_points

__all__ = [
    "gaussian",
    "orf",
    "sorf",
    "qmc",
    "mm",
    "sgq",
    "fastfood",
    "fastfoodl",
    "rademacher",
    "FastFoodL",
    "fastfood_matrix",
    "fwht",
    "sobol_points",
    "sgq_rule",
    "sgq_level_rule",
    "sgq_size",
    "sgq_sizes",
    "draw_weights",
    "draw_weighted",
    "check_name",
    "check_weights_name",
    "WEIGHTS",
    "ALL_WEIGHTS",
    "LEARNABLE_WEIGHTS",
    "DETERMINISTIC_WEIGHTS",
    "WEIGHTED_WEIGHTS",
]

#: name -> generator ``f(M, D, *, generator, device, dtype) -> [M, D]``, every matrix.
WEIGHTS = {
    "gaussian": gaussian,
    "orf": orf,
    "sorf": sorf,
    "qmc": qmc,
    "mm": mm,
    "sgq": sgq,
    "fastfood": fastfood,
    "fastfoodl": fastfoodl,
    "rademacher": rademacher,
}
#: public names (docs/usage.md) that are not implemented yet (none left).
ALL_WEIGHTS = tuple(WEIGHTS)
#: name -> nn.Module class ``cls(M, D, *, generator)`` whose ``forward()`` rebuilds W.
LEARNABLE_WEIGHTS = {"fastfoodl": FastFoodL}
#: matrices that do not depend on the generator (the same W for every seed).
DETERMINISTIC_WEIGHTS = ("sgq",)
#: matrices whose rows carry weights (``draw_weighted``'s c is not all ones): quadrature rules.
WEIGHTED_WEIGHTS = ("sgq",)


def check_name(kind: str, name: str, registry: dict) -> None:
    """Raise ValueError for a ``name`` that ``registry`` does not hold (``kind``: the argument
    it came as, ``"weights"`` or ``"feature"``)."""
    if name not in registry:
        raise ValueError(f"unknown {kind}={name!r}; valid choices: {list(registry)}")


def check_weights_name(name: str) -> None:
    """Raise ValueError for an unknown name."""
    check_name("weights", name, WEIGHTS)


def draw_weights(
    name: str,
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Draw the matrix ``name`` (see :data:`WEIGHTS`).

    Args:
        name: one of :data:`ALL_WEIGHTS`.
        num_rows: M, the number of random features (rows).
        head_dim: D, the query/key head dimension (columns).
        generator: a CPU ``torch.Generator``; the draw is a pure function of its state.
        device, dtype: where the result lives (default CPU, the default dtype).

    Returns:
        Tensor ``[M, D]``.
    """
    check_weights_name(name)
    return WEIGHTS[name](num_rows, head_dim, generator=generator, device=device, dtype=dtype)


def draw_weighted(
    name: str, num_rows: int, head_dim: int, **draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`draw_weights` plus the component weights (module docstring).

    Args: as in :func:`draw_weights` (``draw``: its keyword arguments, ``generator`` and
    optionally ``device``, ``dtype``).

    Returns:
        ``(W [M, D], c [M])`` with ``mean(c) = 1``; ``c`` is all ones except for ``sgq``
        (``M`` times the signed quadrature weights; the centre one is negative for D >= 4).
    """
    w = draw_weights(name, num_rows, head_dim, **draw)
    if name == "sgq":
        _, a = sgq_rule(num_rows, head_dim, dtype=torch.float64)
        return w, (a * num_rows).to(device=w.device, dtype=w.dtype)
    return w, torch.ones(num_rows, device=w.device, dtype=w.dtype)
