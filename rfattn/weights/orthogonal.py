"""Geometric (ROM) matrices: orthogonal random features and their structured version."""

from __future__ import annotations

import math

import torch

from rfattn.weights._common import check_generator, check_sizes, finish, fwht, next_pow2

__all__ = ["orf", "sorf"]


def orf(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Orthogonal random features (spec §3.2): block-orthogonal rows with chi(D) norms.

    ``ceil(M / D)`` independent D x D blocks, each the transpose of the Q factor of a Gaussian
    matrix with the sign fix ``Q * sign(diag(R))`` (so Q is Haar distributed), stacked and
    truncated to M rows; each row is then rescaled to an independent chi(D) norm (the norm of a
    fresh N(0, I_D) vector). Every row is therefore marginally N(0, I_D), and rows inside one block
    are exactly orthogonal.

    Arguments as in :func:`rfattn.weights.draw_weights`.
    """
    check_sizes(num_rows, head_dim)
    check_generator(generator)
    num_blocks = -(-num_rows // head_dim)
    # Draw block by block (torch's fill order depends on the tensor size, and this keeps the
    # stream of the one-block-at-a-time version), then one batched QR: fewer LAPACK calls.
    g = torch.stack(
        [
            torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
            for _ in range(num_blocks)
        ]
    )
    q, r = torch.linalg.qr(g)
    # Haar fix: without it the distribution of Q depends on the QR implementation's signs.
    sign = torch.where(torch.diagonal(r, dim1=-2, dim2=-1) >= 0, 1.0, -1.0).to(torch.float64)
    directions = (q * sign[:, None, :]).transpose(1, 2).reshape(-1, head_dim)[:num_rows]
    norms = torch.randn(num_rows, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return finish(directions * norms[:, None], device, dtype)


def sorf(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Structured orthogonal random features (spec §3.3, Eq 22).

    Each block is ``sqrt(P) H D1 H D2 H D3`` with P = D rounded up to a power of two, H the
    *normalised* P x P Walsh-Hadamard matrix (entries ``±1/sqrt(P)``, so each block is
    ``sqrt(P)`` times an orthogonal matrix) and D1, D2, D3 independent Rademacher diagonals.
    ``ceil(M / P)`` independent blocks are stacked and truncated to M rows; the columns are
    truncated to the first D, which is what zero-padding the inputs to P does.

    Properties: ``E[w] = 0`` and ``E[w w^T] = I_D`` exactly for every row (the last Rademacher
    diagonal randomises each column's sign); for a power-of-two D each block has
    ``W W^T = D I`` exactly (row norms exactly ``sqrt(D)``, not chi(D)). Rows are not Gaussian,
    so the estimators built on SORF are unbiased only as D grows (spec pitfall 22).

    Why normalised H: the reference code's unnormalised H makes rows about 700x too long
    (spec pitfall 15). The blocks are materialised with 3 fast transforms of the identity,
    ``O(P^2 log P)`` per block.

    Arguments as in :func:`rfattn.weights.draw_weights`.
    """
    check_sizes(num_rows, head_dim)
    check_generator(generator)
    p = next_pow2(head_dim)
    num_blocks = -(-num_rows // p)
    signs = torch.randint(0, 2, (3, num_blocks, 1, p), generator=generator, dtype=torch.int64)
    signs = 2.0 * signs.to(torch.float64) - 1.0
    # Right-multiplying by H is a transform of every row, so start from I and apply
    # H, D1, H, D2, H, D3 left to right: rows of sqrt(P) H D1 H D2 H D3.
    x = torch.eye(p, dtype=torch.float64).expand(num_blocks, p, p)
    for d in signs:
        x = fwht(x) * d
    w = math.sqrt(p) * x.reshape(num_blocks * p, p)
    return finish(w[:num_rows, :head_dim], device, dtype)
