"""Discretely induced random features (DIRF; CRT §3.2, ``crt-flt.md`` A.2): poisrf, geomrf.

Integer frequencies ``omega in {0, 1, 2, ...}^D`` with iid coordinates ``P(omega_l = k) = p_k``
and, from the Taylor series of ``exp(x . y) = prod_l sum_k (x_l y_l)^k / k!``, the softmax-target
feature (CRT (10) without its Gaussian factor ``exp(-|x|^2/2)``):

    f(omega, x) = prod_l x_l^omega_l (omega_l!)^(-1/2) p_{omega_l}^(-1/2),  E f(x) f(y) = exp(x.y)

* PoisRF (p_k Poisson(lambda)):
  ``f = exp(lambda D / 2) prod_l x_l^omega_l lambda^(-omega_l/2)``.
* GeomRF (p_k = p (1-p)^k):
  ``f = p^(-D/2) prod_l x_l^omega_l (1-p)^(-omega_l/2) (omega_l!)^(-1/2)``.

Signed exponential form (A.2.5): ``u = sum_l omega_l log|x_l| + kappa(omega)`` (a GEMM of
``log|X|`` with the integer rows, plus a per-feature constant) and amplitude
``g = (-1)^(sum_l omega_l [x_l < 0])`` (a GEMM of the 0/1 sign indicator, mod 2; exact in floating
point for these small integers). ``|x_l|`` is floored at the dtype's ``tiny`` so that
``0^0 = 1`` and ``0^k ~ 0`` without NaN.

Where the integer rows come from: W itself. Each entry of a weight matrix with standard Gaussian
entries is mapped to a uniform ``U = Phi_N(w)`` and then through the inverse CDF of the count
distribution, so the randomness stays in ``rf.weight`` (redraws, seeds and ``state_dict`` as for
every other feature) and the data-dependent rate (lambda or p, per (b, h)) needs no new draw. A
row of ``gaussian`` or ``orf`` is exactly N(0, I), so its integer row has exactly the right law
(rows of orf are dependent, which keeps each row's estimate unbiased); ``qmc`` maps to
randomised quasi-Monte Carlo integer rows.

Statistics (:mod:`rfattn.stats`): lambda* = sqrt(S2/D) (closed form, CRT (11)-(12)); p* minimises
CRT (13) with the pair averages (14). The + variants (option ``plus=True``, CRT §3.2.3) shift the
inputs by ``c = min over tokens - margin`` so every ``x - c > 0`` (positive features under global
statistics) and multiply by ``exp(c . x - |c|^2/2)`` to keep the softmax target:
``exp(x . y) = exp(x^ . y^) exp(c . x - |c|^2/2) exp(c . y - |c|^2/2)`` with ``x^ = x - c``.
Any shift keeps the estimator unbiased; with running or fixed statistics a token below the shift
simply gets a signed feature.
"""

from __future__ import annotations

import math

import torch

from rfattn.features.base import StatsFeature, check_number, sq_norm
from rfattn.stats import (
    geometric_p,
    poisson_lambda,
    shift_from_min,
    shifted_moments,
)

__all__ = ["PoisRF", "GeomRF", "gaussian_to_uniform_tail", "poisson_rows", "geometric_rows"]


def gaussian_to_uniform_tail(w: torch.Tensor) -> torch.Tensor:
    """``1 - Phi_N(w)`` in float64 (the upper tail, accurate where Phi_N(w) is close to 1)."""
    return 0.5 * torch.special.erfc(w.to(torch.float64) / math.sqrt(2.0))


def _broadcast_rows(w: torch.Tensor, rate: torch.Tensor):
    lead = torch.broadcast_shapes(w.shape[:-2], rate.shape[:-2])
    return lead, w.expand(*lead, *w.shape[-2:]), rate.expand(*lead, 1, 1)


def poisson_rows(w: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """Integer rows ``omega ~ Poisson(lambda)^D`` by inverse CDF of ``U = Phi_N(w)``.

    Args:
        w: ``[..., M, D]`` standard Gaussian entries.
        lam: ``[..., 1, 1]`` rates (broadcast against w's leading dims).

    Returns:
        ``[lead..., M, D]`` float64 counts (lead = broadcast of the leading dims). The support is
        cut at ``lambda_max + 12 sqrt(lambda_max) + 25`` (tail mass < 1e-30 for lambda <= 100).
    """
    lead, w, lam = _broadcast_rows(w, lam)
    m, d = w.shape[-2:]
    lam = lam.to(torch.float64).reshape(-1, 1)
    # a non-finite rate (NaN statistics from NaN inputs) gives NaN rows, never an exception
    ok = torch.isfinite(lam) & (lam >= 0)
    lmax = float(lam[ok].max()) if bool(ok.any()) else 1.0
    lam = torch.where(ok, lam, torch.ones_like(lam))
    kmax = int(math.ceil(lmax + 12.0 * math.sqrt(lmax) + 25.0))
    k = torch.arange(kmax + 1, dtype=torch.float64, device=w.device)
    logpmf = -lam + k * torch.log(lam) - torch.lgamma(k + 1.0)
    cdf = torch.cumsum(torch.exp(logpmf), dim=-1)  # [N, K]
    u = 1.0 - gaussian_to_uniform_tail(w).reshape(-1, m * d)
    omega = torch.searchsorted(cdf.contiguous(), u.contiguous())  # #{k : cdf(k) < u}
    omega = torch.where(ok, omega.clamp_max(kmax).to(torch.float64), float("nan"))
    return omega.reshape(*lead, m, d)


def geometric_rows(w: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Integer rows ``omega_l ~ Geometric(p)`` on {0, 1, ...}: ``floor(log(1-U) / log(1-p))``.

    Args and Returns as in :func:`poisson_rows` (``p`` in (0, 1) replaces lambda).
    """
    lead, w, p = _broadcast_rows(w, p)
    tail = gaussian_to_uniform_tail(w).clamp_min(torch.finfo(torch.float64).tiny)
    return torch.floor(torch.log(tail) / torch.log1p(-p.to(torch.float64)))


class _DIRF(StatsFeature):
    """Shared DIRF plumbing: parameters, shift and the log-domain GEMMs."""

    positive = False
    rate_option = ""

    def __init__(self, num_rows, head_dim, stats, stats_grad, momentum, rate, plus, shift) -> None:
        super().__init__(num_rows, head_dim)
        if not isinstance(plus, bool):
            raise ValueError(f"feature={self.name!r}: option plus must be a bool, got {plus!r}")
        self.plus = plus
        fixed = {self.rate_option: rate, "shift": shift}
        if not plus and shift is not None:
            raise ValueError(f"feature={self.name!r}: option shift needs plus=True")
        self.fixed_options = (self.rate_option, "shift") if plus else (self.rate_option,)
        self._init_stats(head_dim, stats, stats_grad, momentum, fixed)
        self.fixed_rate = None if rate is None else self._check_rate(rate)
        self.fixed_shift = None
        if shift is not None:
            t = torch.as_tensor(shift, dtype=torch.float64)
            if t.shape != (head_dim,) or not bool(t.isfinite().all()):
                raise ValueError(f"feature={self.name!r}: option shift must be {head_dim} numbers")
            self.fixed_shift = t
        # positive exactly when every token lies above the shift: guaranteed by global stats only
        self.positive = plus and stats in (None, "global")

    def _check_rate(self, rate) -> float:
        raise NotImplementedError

    def _rate_from_moments(self, m):
        raise NotImplementedError

    def params(self, xq, xk, key_padding_mask=None, causal=False, update=True, moments=None,
               query_padding_mask=None):  # fmt: skip
        m = self.moments(xq, xk, key_padding_mask, causal, update, moments, query_padding_mask)
        out = {}
        if m is None:
            rate = xq.new_full((1, 1), self.fixed_rate)
            if self.plus:
                out["shift"] = self.fixed_shift.to(device=xq.device, dtype=xq.dtype)[None, None]
        else:
            if self.plus:
                shift = shift_from_min(m)
                m = shifted_moments(m, shift)
                out["shift"] = shift
            rate = self._rate_from_moments(m)
        out["rate"] = rate[..., None, None]
        if "shift" in out:
            out["shift"] = out["shift"][..., None, :]  # [B, H, 1, D]
        return out

    def rows(self, w, params) -> torch.Tensor:
        """The integer rows ``omega`` ``[..., M, D]`` for these parameters (from W)."""
        raise NotImplementedError

    def _kappa(self, omega, rate, d) -> torch.Tensor:
        """The per-feature log constant ``[..., 1, M]``."""
        raise NotImplementedError

    def _prepare(self, x, w, params):
        omega = self.rows(w, params).to(x.dtype)  # [..., M, D]
        shift = params.get("shift")
        xh = x - shift if shift is not None else x
        return omega, xh, shift

    def logits(self, x, w, side, params=None):
        omega, xh, shift = self._prepare(x, w, params)
        tiny = torch.finfo(x.dtype).tiny
        log_abs = torch.log(xh.abs().clamp_min(tiny))
        u = log_abs @ omega.transpose(-1, -2) + self._kappa(omega, params["rate"], x.shape[-1])
        if shift is not None:
            u = u + (x * shift).sum(dim=-1, keepdim=True) - 0.5 * sq_norm(shift)
        return u

    def amplitude(self, x, w, side, params=None):
        omega, xh, _ = self._prepare(x, w, params)
        parity = torch.remainder((xh < 0).to(x.dtype) @ omega.transpose(-1, -2), 2.0)
        return 1.0 - 2.0 * parity


class PoisRF(_DIRF):
    """Poisson-induced features (CRT Theorem 3.4). Logits
    ``u = log|x^| Omega^T + lambda D/2 - (log lambda / 2) sum_l omega_l`` (+ the shift term),
    amplitude the sign parity. Options: ``stats``, ``stats_grad``, ``momentum``, ``plus``;
    fixed mode: ``lam`` (> 0) and, with ``plus``, ``shift`` (D numbers)."""

    name = "poisrf"
    rate_option = "lam"

    def __init__(
        self,
        num_rows=None,
        head_dim=None,
        stats=None,
        stats_grad=False,
        momentum=0.1,
        lam=None,
        plus=False,
        shift=None,
    ):
        super().__init__(num_rows, head_dim, stats, stats_grad, momentum, lam, plus, shift)

    def _check_rate(self, rate):
        return check_number(self.name, "lam", rate, low=0.0, low_open=True, high=100.0)

    def _rate_from_moments(self, m):
        return poisson_lambda(m)

    def rows(self, w, params):
        return poisson_rows(w, params["rate"])

    def _kappa(self, omega, rate, d):
        lam = rate.to(omega.dtype)
        return 0.5 * lam * d - 0.5 * torch.log(lam) * omega.sum(dim=-1).unsqueeze(-2)


class GeomRF(_DIRF):
    """Geometric-induced features (CRT Theorem 3.5). Logits
    ``u = log|x^| Omega^T - (D/2) log p - (log(1-p)/2) sum_l omega_l - (1/2) sum_l log omega_l!``
    (+ the shift term), amplitude the sign parity. Options: ``stats``, ``stats_grad``,
    ``momentum``, ``plus``; fixed mode: ``p`` (in (0, 1)) and, with ``plus``, ``shift``."""

    name = "geomrf"
    rate_option = "p"

    def __init__(
        self,
        num_rows=None,
        head_dim=None,
        stats=None,
        stats_grad=False,
        momentum=0.1,
        p=None,
        plus=False,
        shift=None,
    ):
        super().__init__(num_rows, head_dim, stats, stats_grad, momentum, p, plus, shift)

    def _check_rate(self, rate):
        return check_number(self.name, "p", rate, low=0.0, high=1.0, low_open=True, high_open=True)

    def _rate_from_moments(self, m):
        return geometric_p(m)

    def rows(self, w, params):
        return geometric_rows(w, params["rate"])

    def _kappa(self, omega, rate, d):
        p = rate.to(omega.dtype)
        count = omega.sum(dim=-1).unsqueeze(-2)  # [..., 1, M]
        log_fact = torch.lgamma(omega + 1.0).sum(dim=-1).unsqueeze(-2)
        return -0.5 * d * torch.log(p) - 0.5 * torch.log1p(-p) * count - 0.5 * log_fact
