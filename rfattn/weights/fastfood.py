"""FastFood (Le et al. 2013) and its learnable version FastFood_L (Yang et al. 2015).

One block, with P = D rounded up to a power of two (spec §3.6 with the paper's typos fixed,
pitfall 13):

    W_block = (1 / sqrt(P)) diag(S) H diag(G) Pi H diag(B)        [P, P]

H is the *unnormalised* P x P Walsh-Hadamard matrix (±1), Pi a random permutation, B iid ±1,
G iid N(0, 1) and ``S_i = s_i / ||G||_2`` with ``s_i ~ chi(P)``. Then row i has norm exactly
``s_i`` (``H diag(B)`` is sqrt(P) times orthogonal and ``||h_i * G|| = ||G||``), and every row
has ``E[w] = 0`` and ``E[w w^T] = I`` (B randomises the column signs). Rows are not Gaussian and
rows of one block are correlated through G and B, so estimators on FastFood are not exactly
unbiased for finite M (spec pitfall 22). ``ceil(M / P)`` independent blocks are stacked and
truncated to M rows; columns are truncated to the first D (zero-padding the inputs to P).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rfattn.weights._common import check_generator, check_sizes, finish, fwht, next_pow2

__all__ = ["fastfood", "fastfoodl", "FastFoodL", "fastfood_matrix"]


def _init_params(num_blocks: int, p: int, generator: torch.Generator):
    """Draw FastFood's diagonals in float64 on the CPU.

    Returns:
        ``(S, G, B, perm)``, each ``[num_blocks, P]`` (perm int64: Pi as column indices).
    """
    g = torch.randn(num_blocks, p, generator=generator, dtype=torch.float64)
    b = torch.randint(0, 2, (num_blocks, p), generator=generator, dtype=torch.int64)
    b = 2.0 * b.to(torch.float64) - 1.0
    perm = torch.stack([torch.randperm(p, generator=generator) for _ in range(num_blocks)])
    s = torch.randn(num_blocks, p, p, generator=generator, dtype=torch.float64).norm(dim=-1)
    return s / g.norm(dim=-1, keepdim=True), g, b, perm


def fastfood_matrix(
    S: torch.Tensor,
    G: torch.Tensor,
    B: torch.Tensor,
    perm: torch.Tensor,
    num_rows: int,
    head_dim: int,
) -> torch.Tensor:
    """Materialise ``(1/sqrt P) diag(S) H diag(G) Pi H diag(B)`` per block, differentiably.

    Args:
        S, G, B: ``[num_blocks, P]`` diagonals (P a power of two), one dtype and device.
        perm: ``[num_blocks, P]`` int64, the permutation Pi: ``(X Pi)[:, j] = X[:, perm[j]]``.
        num_rows: M <= num_blocks * P rows kept.
        head_dim: D <= P columns kept.

    Returns:
        ``[M, D]`` in the dtype and device of S; autograd reaches S, G and B. Cost
        ``O(M P log P)`` (two fast transforms of the identity per block).
    """
    nb, p = S.shape
    x = torch.eye(p, dtype=S.dtype, device=S.device).expand(nb, p, p)
    # Right-multiplying by H transforms every row, so build the product left to right from I.
    x = fwht(x, normalized=False) * G[:, None, :]
    x = torch.gather(x, 2, perm[:, None, :].expand(nb, p, p))
    x = fwht(x, normalized=False) * B[:, None, :]
    x = x * (S[:, :, None] / math.sqrt(p))
    return x.reshape(nb * p, p)[:num_rows, :head_dim]


def fastfood(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """FastFood_F (spec §3.6): fixed random S, G, Pi, B; see the module docstring.

    Arguments as in :func:`rfattn.weights.draw_weights`.
    """
    check_sizes(num_rows, head_dim)
    check_generator(generator)
    p = next_pow2(head_dim)
    params = _init_params(-(-num_rows // p), p, generator)
    return finish(fastfood_matrix(*params, num_rows, head_dim), device, dtype)


def fastfoodl(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The initial matrix of :class:`FastFoodL` (equal to :func:`fastfood` for the same seed).

    A plain tensor, without the learnable parameters; ``RandomFeatures(weights="fastfoodl")``
    holds a :class:`FastFoodL` module instead. Args and Returns as in :func:`fastfood`.
    """
    return fastfood(num_rows, head_dim, generator=generator, device=device, dtype=dtype)


class FastFoodL(nn.Module):
    """Learnable FastFood (spec §3.13, paper-math mode): S, G, B are ``nn.Parameter``s.

    ``ceil(M / P)`` blocks, each with its own learnable diagonals ``S, G, B [P]`` and a fixed
    permutation (buffer ``perm``); H is fixed. Initialised as FastFood_F (``S = chi(P)/||G||``,
    ``G ~ N(0, 1)``, ``B = ±1``) from an explicit generator, drawn in float64 on the CPU and
    then cast to the default dtype. Every call rebuilds ``W [M, D]`` from the parameters
    (``O(M P log P)``), so gradients of anything computed from W reach S, G and B.

    Args:
        num_rows: M, the number of rows of W.
        head_dim: D, the number of columns (P = D rounded up to a power of two).
        generator: a CPU ``torch.Generator`` for the initial draw.
    """

    perm: torch.Tensor

    def __init__(self, num_rows: int, head_dim: int, *, generator: torch.Generator) -> None:
        super().__init__()
        check_sizes(num_rows, head_dim)
        self.num_rows = num_rows
        self.head_dim = head_dim
        p = next_pow2(head_dim)
        num_blocks = -(-num_rows // p)
        self.S = nn.Parameter(torch.empty(num_blocks, p))
        self.G = nn.Parameter(torch.empty(num_blocks, p))
        self.B = nn.Parameter(torch.empty(num_blocks, p))
        self.register_buffer("perm", torch.empty(num_blocks, p, dtype=torch.int64))
        self.reset_parameters(generator)

    def extra_repr(self) -> str:
        return f"num_rows={self.num_rows}, head_dim={self.head_dim}, blocks={tuple(self.S.shape)}"

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator) -> None:
        """Redraw S, G, B and Pi as FastFood_F (device and dtype kept)."""
        check_generator(generator)
        params = (self.S, self.G, self.B, self.perm)
        for dst, src in zip(params, _init_params(*self.S.shape, generator), strict=True):
            dst.copy_(src)

    def forward(self) -> torch.Tensor:
        """``W [M, D]`` in the parameters' dtype and device, differentiable in S, G, B."""
        return fastfood_matrix(self.S, self.G, self.B, self.perm, self.num_rows, self.head_dim)
