"""Sparse grid quadrature (SGQ, spec §3.12; Dao et al. 2017): Smolyak on Gauss-Hermite rules.

The rule approximates ``E_{w ~ N(0, I_D)}[f(w)] ~ sum_r a_r f(w_r)`` with nodes w_r (the rows
of W) and signed weights a_r summing to 1. Random-feature estimators then read
``K(x, y) ~ sum_r a_r phi_r(x) phi_r(y)`` instead of the Monte Carlo ``(1/M) sum_r``.

Construction (level L >= 0). 1-D rules: ``U_e`` is the (2e+1)-point Gauss-Hermite rule for
N(0, 1) (probabilists' Hermite, weights normalised to sum 1), exact for degree 4e+1 and always
holding the node 0. Smolyak's combination technique over excess vectors e in N^D:

    A(L, D) = sum_{max(0, L-D+1) <= |e| <= L} (-1)^(L-|e|) C(D-1, L-|e|) U_e1 (x) ... (x) U_eD

with equal nodes merged (weights added). A(L, D) integrates every polynomial of total degree
<= 2L+1 exactly (Novak & Ritter; the 1-D rules are exact to degree 2e+1 or more), and every
node has at most L non-zero coordinates, so ``prod_{j<=L+1} w_j^2`` (degree 2L+2, expectation 1)
integrates to 0: the degree is sharp for D > L. Level 1 is the paper's third-degree rule:
the origin with weight ``1 - D/3`` and the 2D nodes ``±sqrt(3) e_j`` with weight 1/6, so
M = 2D + 1. The centre weight is **negative for D >= 4** (zero for D = 3): the weights cannot be
split as real ``sqrt(a_r)`` on both sides, positivity of the estimate is lost, and a feature map
must carry them signed (e.g. multiply the key features only).

M policy: the level fixes M, so a requested M must be one of the achievable sizes
(``sgq_sizes``: for D >= L+1, ``sum_k C(D, k) sum_{e in N+^k, |e| <= L} prod_j 2 e_j``, i.e.
1, 2D+1, 2D^2+4D+1, ... ); any other M raises ValueError listing them. No truncation (it would
break exactness) and no silent change of M (the module's buffers are ``[M, D]``).
The rule is deterministic: the generator is accepted for a uniform signature but not used.
"""

from __future__ import annotations

import functools
import itertools
import math

import numpy as np
import torch
from numpy.polynomial.hermite_e import hermegauss

from rfattn.weights._common import check_generator, check_sizes, finish

__all__ = ["sgq", "sgq_rule", "sgq_level_rule", "sgq_size", "sgq_sizes", "SGQ_MAX_LEVEL"]

#: the highest Smolyak level searched for a requested M
SGQ_MAX_LEVEL = 10


@functools.cache
def _gauss_hermite(excess: int) -> tuple[np.ndarray, np.ndarray]:
    """The (2e+1)-point Gauss-Hermite rule for N(0, 1): nodes (middle one exactly 0), weights."""
    nodes, weights = hermegauss(2 * excess + 1)
    nodes[excess] = 0.0
    return nodes, weights / weights.sum()


def _compositions(total: int, parts: int):
    """All tuples of ``parts`` positive ints summing to ``total``."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def _excess_vectors(head_dim: int, level: int):
    """Sparse excess vectors ``(support, excesses)`` of A(L, D) with their Smolyak coefficients."""
    for total in range(max(0, level - head_dim + 1), level + 1):
        coef = (-1) ** (level - total) * math.comb(head_dim - 1, level - total)
        for k in range(0, min(head_dim, total) + 1):
            if (k == 0) != (total == 0):
                continue
            for support in itertools.combinations(range(head_dim), k):
                for excesses in _compositions(total, k) if k else [()]:
                    yield support, excesses, coef


@functools.lru_cache(maxsize=32)
def _build(head_dim: int, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    acc: dict[tuple, float] = {}
    for support, excesses, coef in _excess_vectors(head_dim, level):
        rules = [_gauss_hermite(e) for e in excesses]
        for idx in itertools.product(*(range(2 * e + 1) for e in excesses)):
            # key: the non-zero coordinates as (coordinate, rule, node); zeros are shared.
            key = tuple((j, e, i) for j, e, i in zip(support, excesses, idx, strict=True) if i != e)
            weight = coef * math.prod(r[1][i] for r, i in zip(rules, idx, strict=True))
            acc[key] = acc.get(key, 0.0) + weight
    nodes = torch.zeros(len(acc), head_dim, dtype=torch.float64)
    for row, key in enumerate(acc):
        for j, e, i in key:
            nodes[row, j] = float(_gauss_hermite(e)[0][i])
    return nodes, torch.tensor(list(acc.values()), dtype=torch.float64)


def sgq_level_rule(head_dim: int, level: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Smolyak rule A(L, D) of the module docstring.

    Args:
        head_dim: D >= 1.
        level: L >= 0 (0 gives the single node 0 with weight 1).

    Returns:
        ``(nodes [M, D], weights [M])`` in float64 on the CPU; weights are signed and sum to 1.
        The origin is the first node.
    """
    check_sizes(1, head_dim)
    if not isinstance(level, int) or isinstance(level, bool) or level < 0:
        raise ValueError(f"level must be an int >= 0, got {level!r}")
    nodes, weights = _build(head_dim, level)
    return nodes.clone(), weights.clone()


def sgq_size(head_dim: int, level: int) -> int:
    """M of the level-L rule in D dimensions (closed form for D > L, else built)."""
    if head_dim <= level:
        return sgq_level_rule(head_dim, level)[0].shape[0]
    # nodes = (support, excess per coordinate, one of its 2e non-zero Gauss-Hermite nodes)
    per_support = [0] * (level + 1)  # per_support[k]: sum over e in N+^k, |e| <= L, of prod 2e
    poly = [1] + [0] * level  # coefficients of (sum_e 2e x^e)^k, truncated at x^L
    for k in range(0, level + 1):
        per_support[k] = sum(poly)
        poly = [sum(poly[t - e] * 2 * e for e in range(1, t + 1)) for t in range(level + 1)]
    return sum(math.comb(head_dim, k) * per_support[k] for k in range(level + 1))


def sgq_sizes(head_dim: int, max_level: int = SGQ_MAX_LEVEL) -> list[int]:
    """The achievable M for D = ``head_dim``, levels 0 to ``max_level``."""
    return [sgq_size(head_dim, level) for level in range(max_level + 1)]


def _level_for(num_rows: int, head_dim: int) -> int:
    sizes = []
    for level in range(SGQ_MAX_LEVEL + 1):
        sizes.append(sgq_size(head_dim, level))
        if sizes[-1] == num_rows:
            return level
        if sizes[-1] > num_rows:
            break
    raise ValueError(
        f"sgq cannot give num_features (M) = {num_rows} for head_dim (D) = {head_dim}: the "
        f"Smolyak level fixes M; achievable M (levels 0..{len(sizes) - 1}): {sizes}"
    )


def sgq_rule(
    num_rows: int,
    head_dim: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse grid with exactly M nodes: nodes as rows and the quadrature weights.

    Args:
        num_rows: M, which must be one of ``sgq_sizes(D)`` (else ValueError listing them).
        head_dim: D, the query/key head dimension.
        device, dtype: where the results live (default CPU, the default dtype).

    Returns:
        ``(W [M, D], a [M])``: ``E[f(w)] ~ sum_r a_r f(W_r)``; a is signed and sums to 1.
    """
    check_sizes(num_rows, head_dim)
    nodes, weights = sgq_level_rule(head_dim, _level_for(num_rows, head_dim))
    return finish(nodes, device, dtype), finish(weights, device, dtype)


def sgq(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The SGQ nodes ``[M, D]`` (deterministic; see :func:`sgq_rule` for the weights), M one of
    ``sgq_sizes(D)``. Arguments as every registered matrix takes them
    (:func:`rfattn.weights.draw_weights`); the generator is validated but not used (the grid is
    not random)."""
    check_generator(generator)
    return sgq_rule(num_rows, head_dim, device=device, dtype=dtype)[0]
