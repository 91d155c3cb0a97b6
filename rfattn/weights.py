"""Weight matrices W [M, D] whose rows omega_i are the random-feature frequencies.

Every generator draws on the CPU in float64 from an explicit ``torch.Generator`` and only then
moves the result to the requested device and dtype, so the same seed gives the same matrix on
any device and in any dtype (up to the final rounding).

Target distribution: rows marginally N(0, I_D) (spec ``spectraformer.md`` §3; sigma = 1 because
queries and keys are pre-scaled by sqrt(scale) before the projection).

Implemented here: ``gaussian`` and ``orf``. The other names of DESIGN §2 are registered as
planned so that ``RandomFeatures`` can tell "unknown" from "not implemented yet".
"""

from __future__ import annotations

import torch

__all__ = [
    "gaussian",
    "orf",
    "draw_weights",
    "check_weights_name",
    "WEIGHTS",
    "PLANNED_WEIGHTS",
    "ALL_WEIGHTS",
]


def _check_sizes(num_rows: int, head_dim: int) -> None:
    if not isinstance(num_rows, int) or isinstance(num_rows, bool) or num_rows < 1:
        raise ValueError(f"num_features (M) must be an int >= 1, got {num_rows!r}")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise ValueError(f"head_dim (D) must be an int >= 1, got {head_dim!r}")


def _finish(w: torch.Tensor, device, dtype) -> torch.Tensor:
    return w.to(device=device or "cpu", dtype=dtype or torch.get_default_dtype())


def gaussian(
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Base Monte Carlo matrix: iid N(0, 1) entries (spec §3.1).

    Args:
        num_rows: M, the number of random features (rows).
        head_dim: D, the query/key head dimension (columns).
        generator: a CPU ``torch.Generator``; the draw is a pure function of its state.
        device, dtype: where the result lives (default CPU, the default dtype).

    Returns:
        Tensor ``[M, D]``.
    """
    _check_sizes(num_rows, head_dim)
    w = torch.randn(num_rows, head_dim, generator=generator, dtype=torch.float64)
    return _finish(w, device, dtype)


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

    Args and Returns as in :func:`gaussian`.
    """
    _check_sizes(num_rows, head_dim)
    num_blocks = -(-num_rows // head_dim)
    blocks = []
    for _ in range(num_blocks):
        g = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        # Haar fix: without it the distribution of Q depends on the QR implementation's signs.
        sign = torch.where(torch.diagonal(r) >= 0, 1.0, -1.0).to(torch.float64)
        blocks.append((q * sign[None, :]).T)
    directions = torch.cat(blocks, dim=0)[:num_rows]
    norms = torch.randn(num_rows, head_dim, generator=generator, dtype=torch.float64).norm(dim=1)
    return _finish(directions * norms[:, None], device, dtype)


#: name -> generator, for every matrix implemented so far.
WEIGHTS = {"gaussian": gaussian, "orf": orf}
#: names pinned by DESIGN §2 whose generators land in a later issue (weights catalogue).
PLANNED_WEIGHTS = ("sorf", "qmc", "mm", "sgq", "fastfood", "fastfoodl", "rademacher")
ALL_WEIGHTS = tuple(WEIGHTS) + PLANNED_WEIGHTS


def check_weights_name(name: str) -> None:
    """Raise ValueError for an unknown name, NotImplementedError for a planned one."""
    if name in WEIGHTS:
        return
    if name in PLANNED_WEIGHTS:
        raise NotImplementedError(
            f"weights={name!r} is planned but not implemented yet; implemented: {sorted(WEIGHTS)}"
        )
    raise ValueError(f"unknown weights={name!r}; valid choices: {list(ALL_WEIGHTS)}")


def draw_weights(
    name: str,
    num_rows: int,
    head_dim: int,
    *,
    generator: torch.Generator,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Draw the matrix ``name`` (see :data:`WEIGHTS`), ``[M, D]``."""
    check_weights_name(name)
    return WEIGHTS[name](num_rows, head_dim, generator=generator, device=device, dtype=dtype)
