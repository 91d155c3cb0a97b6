"""Data statistics for the data-dependent component functions (oprf, saderf, poisrf, geomrf).

Three modes (docs/numerics.md; ``crt-flt.md`` A.1.5 and A.3.6):

* ``"global"``: per (b, h), over the valid tokens of this call (padded keys excluded; when
  ``Tq == Tk`` the key padding mask also marks the padded queries, as in self-attention).
  Non-causal only: a statistic of the whole sequence leaks future tokens into every output, so
  ``causal=True`` with ``stats="global"`` raises ValueError.
* ``"running"``: EMA buffers on the feature map (so saved and moved with the owning
  :class:`rfattn.RandomFeatures`), like BatchNorm: a call uses the buffers as they are and, in
  training mode, updates them *after* computing its parameters from them (so the parameters never
  depend on the current sequence; no causal leak). Pooled over batch and heads (CRT: pooling is
  equally unbiased). The first update copies the batch statistics; later ones do
  ``running = (1 - momentum) * running + momentum * batch``. Before any update the buffers are
  zero, which every feature maps to its neutral parameters (oprf: A = 0, i.e. posrf; saderf:
  psi = 1). The default for causal calls.
* ``"fixed"``: the user gives the parameters themselves as feature options (oprf ``A``, saderf
  ``psi`` and ``A``, poisrf ``lam``, geomrf ``p``, ``shift`` for the + variants).

Every estimator stays unbiased for any value of its parameter (A < 1/4, lambda > 0, 0 < p < 1, any
shift): the statistics only tune the variance, so stale, pooled or user values are correct.
Gradients do not flow through statistics unless ``stats_grad=True``.

The moments reduced over the sequence are the same for every feature (O(T D) per (b, h)):
per dimension, the mean, the mean square, the mean absolute value and the minimum, for queries
and keys. The closed forms below turn them into parameters; they are the one place each is
written in torch. The fused stats pass (``rfattn.kernels.stats``) writes oprf's and saderf's
(:func:`pair_sq_norm`, :func:`oprf_A`, :func:`gerf_real_constants`, :func:`saderf_psi`) and the
running update (:func:`update_running`) once more in Triton, inside its one launch; tests hold
them to these in float64.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = [
    "STATS_MODES",
    "Moments",
    "sequence_moments",
    "pool_moments",
    "register_running",
    "running_moments",
    "update_running",
    "pair_sq_norm",
    "oprf_rho",
    "oprf_A",
    "gerf_real_constants",
    "saderf_psi",
    "shift_from_min",
    "shifted_moments",
    "poisson_lambda",
    "geometric_objective",
    "geometric_p",
]

STATS_MODES = ("global", "running", "fixed")


class Moments(NamedTuple):
    """Per-dimension token moments; each field ``[..., 2, D]`` (row 0 queries, row 1 keys).

    Attributes:
        mean: mean of ``x_l``.
        sq: mean of ``x_l ** 2``.
        abs: mean of ``|x_l|``.
        min: minimum of ``x_l`` (0 where there is no valid token).
    """

    mean: torch.Tensor
    sq: torch.Tensor
    abs: torch.Tensor
    min: torch.Tensor


def _side_moments(x: torch.Tensor, valid: torch.Tensor | None):
    """Moments of ``x`` ``[B, H, T, D]`` over its valid tokens (``valid`` ``[B, T]`` bool)."""
    if valid is None:
        valid = torch.ones(x.shape[0], x.shape[2], dtype=torch.bool, device=x.device)
    pad = ~valid[:, None, :, None]  # [B, 1, T, 1]
    count = valid.sum(dim=-1).to(x.dtype).clamp_min(1.0)[:, None, None]  # [B, 1, 1]
    # padded tokens replaced, not multiplied by 0: junk there (NaN, inf) never reaches a moment
    x0 = x.masked_fill(pad, 0.0)
    mean = x0.sum(dim=-2) / count
    sq = (x0 * x0).sum(dim=-2) / count
    ab = x0.abs().sum(dim=-2) / count
    mn = x.masked_fill(pad, float("inf"))
    mn = mn.amin(dim=-2) if x.shape[-2] > 0 else x.new_full(x.shape[:2] + x.shape[3:], math.inf)
    mn = torch.where(torch.isinf(mn) & (mn > 0), torch.zeros_like(mn), mn)
    return mean, sq, ab, mn


def sequence_moments(
    xq: torch.Tensor,
    xk: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    query_padding_mask: torch.Tensor | None = None,
) -> Moments:
    """Per-(b, h) moments over valid tokens (``global`` mode).

    Args:
        xq: pre-scaled queries ``[B, H, Tq, D]``; xk: keys ``[B, H, Tk, D]``.
        key_padding_mask: ``[B, Tk]`` bool, True = padding (keys).
        query_padding_mask: ``[B, Tq]`` bool, True = padding (queries; None: every query counts).

    Returns:
        :class:`Moments` with fields ``[B, H, 2, D]``.
    """
    valid_k = None if key_padding_mask is None else ~key_padding_mask
    valid_q = None if query_padding_mask is None else ~query_padding_mask
    q = _side_moments(xq, valid_q)
    k = _side_moments(xk, valid_k)
    return Moments(*(torch.stack((a, b), dim=-2) for a, b in zip(q, k, strict=True)))


def pool_moments(m: Moments) -> Moments:
    """Pool per-(b, h) moments ``[..., 2, D]`` into ``[2, D]`` (means averaged, min of mins)."""
    lead = tuple(range(m.mean.dim() - 2))
    return Moments(
        m.mean.mean(dim=lead), m.sq.mean(dim=lead), m.abs.mean(dim=lead), m.min.amin(dim=lead)
    )


def register_running(module: torch.nn.Module, head_dim: int) -> None:
    """Register the running-moment buffers ``running_{mean,sq,abs,min}`` ``[2, D]`` (zeros)."""
    for name in Moments._fields:
        module.register_buffer(f"running_{name}", torch.zeros(2, head_dim))
    module.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))


def running_moments(module: torch.nn.Module) -> Moments:
    """The running moments of ``module`` as :class:`Moments` of ``[2, D]`` tensors."""
    return Moments(*(getattr(module, f"running_{name}") for name in Moments._fields))


@torch.no_grad()
def update_running(module: torch.nn.Module, batch: Moments, momentum: float) -> None:
    """EMA update of the running buffers with per-(b, h) ``batch`` moments (first call copies)."""
    pooled = pool_moments(batch)
    first = module.num_batches_tracked == 0  # selected on the device: reading it would sync
    for name, val in zip(Moments._fields, pooled, strict=True):
        buf = getattr(module, f"running_{name}")
        val = val.to(buf.dtype)
        buf.copy_(torch.where(first, val, (1.0 - momentum) * buf + momentum * val))
    module.num_batches_tracked += 1


def pair_sq_norm(m: Moments, psi: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over all (query, key) pairs of ``|psi*x_i + y_j/psi|^2`` (CRT (8); spec §1.8).

    ``Phi = sum_l psi_l^2 sq_q,l + sum_l psi_l^-2 sq_k,l + 2 mean_q . mean_k`` (psi = 1 if None);
    exact for the pair average, with separate query/key counts. Shape ``[...]``.
    """
    sq_q, sq_k = m.sq[..., 0, :], m.sq[..., 1, :]
    cross = 2.0 * (m.mean[..., 0, :] * m.mean[..., 1, :]).sum(dim=-1)
    if psi is None:
        return sq_q.sum(dim=-1) + sq_k.sum(dim=-1) + cross
    return (psi * psi * sq_q).sum(dim=-1) + (sq_k / (psi * psi)).sum(dim=-1) + cross


def oprf_rho(phi: torch.Tensor, d: int) -> torch.Tensor:
    """OPRF's rho* (CRT (7)) in the cancellation-free form ``2d / ((2S+d) + sqrt((2S+d)^2+8dS))``.

    rho* is in (0, 1], = 1 at S = 0; ``phi`` (S) is clamped at 0 against rounding.
    """
    s = phi.clamp_min(0.0)
    b = 2.0 * s + d
    return 2.0 * d / (b + torch.sqrt(b * b + 8.0 * d * s))


def oprf_A(phi: torch.Tensor, d: int) -> torch.Tensor:
    """The variance-optimal real A for s = +1: ``A* = (1 - 1/rho*) / 8`` (<= 0)."""
    return (1.0 - 1.0 / oprf_rho(phi, d)) / 8.0


def gerf_real_constants(a: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``B = sqrt(1 - 4A)`` and ``log D = (d/4) log(1 - 4A)`` for real A < 1/4, s = +1."""
    one_m = 1.0 - 4.0 * a
    return torch.sqrt(one_m), 0.25 * d * torch.log(one_m)


def saderf_psi(m: Moments) -> torch.Tensor:
    """SADERF's per-dimension scale ``psi_l = (sq_k,l / sq_q,l)^(1/4)`` (spec §2.7), ``[..., D]``.

    Means rather than sums (so unequal query/key counts are right). The ratio is clamped to
    [1e-6, 1e6] and is 1 where both moments are 0 (the neutral value).
    """
    tiny = torch.finfo(m.sq.dtype).tiny
    ratio = (m.sq[..., 1, :] + tiny) / (m.sq[..., 0, :] + tiny)
    return ratio.clamp(1e-6, 1e6).pow(0.25)


#: margin below the coordinate-wise minimum used by the + variants (x_hat = x - shift > 0)
SHIFT_MARGIN = 1e-4


def shift_from_min(m: Moments) -> torch.Tensor:
    """The + variants' shift ``c_l = min(min_i x_il, min_j y_jl) - margin`` ``[..., D]``."""
    return m.min.amin(dim=-2) - SHIFT_MARGIN


def shifted_moments(m: Moments, shift: torch.Tensor) -> Moments:
    """Moments of ``x - shift`` from the raw ones (one reduction pass suffices; CRT A.2.4)."""
    c = shift.unsqueeze(-2)
    return Moments(m.mean - c, m.sq - 2.0 * c * m.mean + c * c, (m.mean - c).abs(), m.min - c)


#: lambda of poisrf is clamped here (tiny lambda: nearly constant features; huge: deep tails)
LAMBDA_RANGE = (1e-3, 100.0)


def poisson_lambda(m: Moments) -> torch.Tensor:
    """PoisRF's variance-optimal rate ``lambda* = sqrt(S2 / d)``, ``S2 = sum_l sq_q,l sq_k,l``.

    CRT Theorem 3.4 with the pair average (12); clamped to :data:`LAMBDA_RANGE`. Shape ``[...]``.
    """
    d = m.sq.shape[-1]
    s2 = (m.sq[..., 0, :] * m.sq[..., 1, :]).sum(dim=-1)
    return torch.sqrt(s2 / d).clamp(*LAMBDA_RANGE)


def geometric_objective(p: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """GeomRF's log second moment in p (CRT (13)): ``-d log p + sum_l log I0(2 a_l / sqrt(1-p))``.

    Args:
        p: ``[...]`` in (0, 1); a: ``[..., D]`` pair averages of ``|x_l y_l|`` (CRT (14)).
    """
    z = 2.0 * a / torch.sqrt(1.0 - p).unsqueeze(-1)
    log_i0 = torch.log(torch.special.i0e(z)) + z.abs()  # stable log I0
    return -a.shape[-1] * torch.log(p) + log_i0.sum(dim=-1)


#: the search interval of geomrf's p (it has no closed form)
P_RANGE = (1e-4, 1.0 - 1e-4)


def geometric_p(m: Moments, iters: int = 80) -> torch.Tensor:
    """GeomRF's p*: golden-section minimisation of :func:`geometric_objective` on ``P_RANGE``.

    The objective is taken to be unimodal on the interval (the tests check the CRT anchor);
    80 golden steps shrink the interval by 0.618^80 ~ 2e-17. ``a_l = abs_q,l * abs_k,l``.
    Shape ``[...]``.
    """
    a = m.abs[..., 0, :] * m.abs[..., 1, :]
    lo = torch.full(a.shape[:-1], P_RANGE[0], dtype=a.dtype, device=a.device)
    hi = torch.full_like(lo, P_RANGE[1])
    r = (math.sqrt(5.0) - 1.0) / 2.0
    x1, x2 = hi - r * (hi - lo), lo + r * (hi - lo)
    f1, f2 = geometric_objective(x1, a), geometric_objective(x2, a)
    for _ in range(iters):
        left = f1 < f2  # the minimum lies in [lo, x2]
        hi = torch.where(left, x2, hi)
        lo = torch.where(left, lo, x1)
        x1n = hi - r * (hi - lo)
        x2n = lo + r * (hi - lo)
        x1, x2 = x1n, x2n
        f1, f2 = geometric_objective(x1, a), geometric_objective(x2, a)
    return 0.5 * (lo + hi)
