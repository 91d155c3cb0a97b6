"""Random Maclaurin features (rmf; Macformer Definition 3, Kar & Karnick 2012;
``macformer-hrf.md`` A.1-A.2) for dot-product kernels ``K(t) = sum_n a_n t^n``, ``t = x . y``.

Feature i has a random degree N_i and N_i Rademacher projections ``omega_{i,1..N_i}``:

    phi_i(x) = c_i prod_{s < N_i} (omega_{i,s} . x),   c_i = sqrt(a_{N_i} / (q_{N_i} M'))

which is unbiased, ``E phi_i(x) phi_i(y) M' = sum_n a_n t^n``, because
``E[(omega . x)(omega . y)] = x . y`` for iid ±1 entries. ``q`` is the degree pmf:
``q_n ∝ (p-1)/p^(n+1)`` (the paper's ``1/p^(n+1)`` is normalised only at p = 2; spec C.1),
restricted to the degrees that are sampled (``a_n > 0``, ``n <= max_degree``) and renormalised,
so it is importance sampling of the truncated series. Two modes (spec A.1):

* ``mode="h0"`` (default, the authors' code): feature 0 is the constant ``sqrt(a_0)`` (not
  divided by anything, so it contributes exactly ``a_0``); the other ``M' = M - 1`` features take
  degrees >= 1.
* ``mode="paper"``: all ``M' = M`` features random, degree 0 included (constants
  ``sqrt(a_0 / (q_0 M))``).

Truncation: degrees above ``max_degree`` (default 20) are never drawn, so the estimator is unbiased
for the truncated series ``sum_{n <= max_degree} a_n t^n`` (:meth:`RMF.target_kernel`); the
truncation error is at most ``sum_{n > max_degree} a_n |t|^n`` (about ``|t|^21`` for inverse,
``|t|^21 / 21!`` for exp), negligible inside the domains below. Nothing is resampled or clipped.

Dot kernels (``dot_kernel``) with the spec's corrected Maclaurin coefficients (A.2):

========== ======================= ============================================ ==========
name        K(t)                    a_n                                          domain
========== ======================= ============================================ ==========
exp         exp(t)                  1/n!                                         all t
trigh       sinh(t) + cosh(t)       1/n! (the same kernel as exp)                all t
inverse     1/(1 - t)               1                                            |t| < 1
log         1 - log(1 - t)          a_0 = 1, a_n = 1/n                           |t| < 1
sqrt        2 - sqrt(1 - t)         a_0 = 1, a_n = (2n-3)!!/(2^n n!)             |t| <= 1
poly        (c + t)^P               C(P, n) c^(P-n) (n <= P)                     all t
========== ======================= ============================================ ==========

(Macformer's Table 1 prints 1/min(1, N) for log and max(1, 2N-3)/(2^N N!) for sqrt: both typos.)
Use :class:`rfattn.PPSBN` (or small inputs) to stay inside the domain of inverse/log/sqrt.

Plain (non-exponential) feature: ``values`` computes the stage projections ``x W_s^T``
(stage 0 is W, a ``rademacher`` matrix; stages 1.. are the drawn buffer ``rmf_proj``) and the
product over the stages below each feature's degree. Signed: the attention denominator can
vanish (policy: :func:`rfattn.reference.safe_denominator`); in h0 mode the constant feature keeps
it near the number of keys.
"""

from __future__ import annotations

import math

import torch

from rfattn.features.base import (
    FeatureMap,
    check_choice,
    check_number,
    component_weights,
    project,
)
from rfattn.features.form import KernelForm

__all__ = ["RMF", "DOT_KERNELS", "maclaurin_coefficients", "dot_kernel_fn"]

DOT_KERNELS = ("exp", "inverse", "log", "trigh", "sqrt", "poly")
RMF_MODES = ("h0", "paper")
#: the largest max_degree accepted
MAX_DEGREE = 64


def maclaurin_coefficients(kernel: str, max_degree: int, poly_degree=2, poly_c=1.0) -> list:
    """``[a_0, ..., a_max_degree]`` of the dot kernel (spec A.2, corrected values)."""
    a = []
    for n in range(max_degree + 1):
        if kernel in ("exp", "trigh"):
            a.append(1.0 / math.factorial(n) if n <= 170 else 0.0)  # 171! is beyond a float
        elif kernel == "inverse":
            a.append(1.0)
        elif kernel == "log":
            a.append(1.0 / max(1, n))
        elif kernel == "sqrt":
            # a_1 = 1/2, a_{n+1} = a_n (2n - 1) / (2 (n + 1)): (2n-3)!!/(2^n n!) without overflow
            a.append(1.0 if n == 0 else 0.5 if n == 1 else a[-1] * (2 * n - 3) / (2 * n))
        elif kernel == "poly":
            a.append(_poly_coefficient(poly_degree, poly_c, n))
        else:
            raise ValueError(f"unknown dot_kernel={kernel!r}; valid: {list(DOT_KERNELS)}")
    return a


def _poly_coefficient(degree: int, c: float, n: int) -> float:
    """``C(P, n) c^(P - n)`` (0 for n > P), or ValueError when it overflows a float."""
    if n > degree:
        return 0.0
    try:
        a = math.comb(degree, n) * c ** (degree - n)
    except OverflowError:
        a = math.inf
    if math.isinf(a):
        raise ValueError(
            f"feature='rmf': dot_kernel='poly' with poly_degree={degree}, poly_c={c} has a "
            f"coefficient C({degree}, {n}) c^{degree - n} beyond float range"
        )
    return a


def dot_kernel_fn(kernel: str, t: torch.Tensor, poly_degree=2, poly_c=1.0) -> torch.Tensor:
    """The closed form ``K(t)`` (the untruncated series) of a dot kernel."""
    if kernel in ("exp", "trigh"):
        return torch.exp(t)
    if kernel == "inverse":
        return 1.0 / (1.0 - t)
    if kernel == "log":
        return 1.0 - torch.log1p(-t)
    if kernel == "sqrt":
        return 2.0 - torch.sqrt(1.0 - t)
    if kernel == "poly":
        return (poly_c + t) ** poly_degree
    raise ValueError(f"unknown dot_kernel={kernel!r}; valid: {list(DOT_KERNELS)}")


class RMF(FeatureMap):
    """Random Maclaurin features. Options (validated): ``dot_kernel`` (default "exp"),
    ``poly_degree`` (int >= 0, default 2), ``poly_c`` (>= 0, default 1.0), ``p`` (> 1, default 2),
    ``max_degree`` (int >= 1, default 20), ``mode`` ("h0" | "paper").

    Draws (buffers, refilled by ``redraw``): ``rmf_degree`` ``[M]`` (long; 0 for the h0 constant),
    ``rmf_scale`` ``[M]`` (``c_i``), ``rmf_proj`` ``[max_degree - 1, M, D]`` (±1; stage s >= 1).
    """

    name = "rmf"
    positive = False
    exponential = False

    def __init__(
        self,
        num_rows=None,
        head_dim=None,
        dot_kernel="exp",
        poly_degree=2,
        poly_c=1.0,
        p=2.0,
        max_degree=20,
        mode="h0",
    ):
        super().__init__(num_rows, head_dim)
        check_choice(self.name, "dot_kernel", dot_kernel, DOT_KERNELS)
        check_choice(self.name, "mode", mode, RMF_MODES)
        self.poly_degree = check_number(self.name, "poly_degree", poly_degree, integer=True, low=0)
        self.poly_c = check_number(self.name, "poly_c", poly_c, low=0.0)
        self.p = check_number(self.name, "p", p, low=1.0, low_open=True)
        # the drawn projections are [max_degree - 1, M, D]; degree 64 has probability below
        # 2^-64 at p = 2 already
        self.max_degree = check_number(
            self.name, "max_degree", max_degree, integer=True, low=1, high=MAX_DEGREE
        )
        self.dot_kernel, self.mode = dot_kernel, mode
        if not isinstance(head_dim, int) or not isinstance(num_rows, int):
            raise ValueError("feature='rmf' needs num_rows and head_dim")
        if mode == "h0" and num_rows < 2:
            raise ValueError("feature='rmf' with mode='h0' needs num_features >= 2")
        self.coef = maclaurin_coefficients(dot_kernel, self.max_degree, self.poly_degree, poly_c)
        low = 1 if mode == "h0" else 0
        support = [n for n in range(low, self.max_degree + 1) if self.coef[n] > 0]
        if not support:
            raise ValueError(
                f"feature='rmf': dot_kernel={dot_kernel!r} has no positive coefficient in degrees "
                f"{low}..{self.max_degree} (check poly_degree, poly_c, max_degree, mode)"
            )
        # q_n ∝ (p - 1) / p^(n + 1), normalised in log space: no overflow for any p > 1
        logw = [-(n + 1) * math.log(self.p) for n in support]
        top = max(logw)
        weights = [math.exp(lw - top) for lw in logw]
        total = sum(weights)
        #: the sampled degrees and their probabilities q_n
        self.support = support
        self.pmf = [wt / total for wt in weights]
        self._register_draws()
        self._row_cache = None  # (degrees, their version, _row_index's result)

    def extra_repr(self) -> str:
        return (
            f"name='rmf', dot_kernel={self.dot_kernel!r}, mode={self.mode!r}, p={self.p}, "
            f"max_degree={self.max_degree}"
        )

    def draw(self, generator, batch_shape=()):
        m, d = self.num_rows, self.head_dim
        pmf = torch.tensor(self.pmf, dtype=torch.float64)
        idx = torch.multinomial(
            pmf, math.prod(batch_shape) * m, replacement=True, generator=generator
        ).reshape(*batch_shape, m)
        support = torch.tensor(self.support, dtype=torch.long)
        degree = support[idx]
        coef = torch.tensor(self.coef, dtype=torch.float64)
        m_rand = m - 1 if self.mode == "h0" else m
        scale = torch.sqrt(coef[degree] / pmf[idx] / m_rand)
        if self.mode == "h0":
            degree[..., 0] = 0
            scale[..., 0] = math.sqrt(self.coef[0])
        bits = torch.randint(0, 2, (*batch_shape, self.max_degree - 1, m, d), generator=generator)
        proj = (2 * bits - 1).to(torch.float64)
        return {"rmf_degree": degree, "rmf_scale": scale, "rmf_proj": proj}

    def num_samples(self, w):
        return 1

    def values(self, x, w, side, params=None):
        degree = params["rmf_degree"].unsqueeze(-2)  # [..., 1, M]
        scale = params["rmf_scale"].to(x.dtype).unsqueeze(-2)
        proj = params["rmf_proj"]
        top = int(params["rmf_degree"].max()) if params["rmf_degree"].numel() else 0
        one = torch.ones((), dtype=x.dtype, device=x.device)
        prod = torch.where(degree > 0, project(x, w), one)
        for s in range(1, top):
            prod = prod * torch.where(degree > s, project(x, proj[..., s - 1, :, :]), one)
        return scale * prod

    def _row_index(self, deg: torch.Tensor) -> tuple:
        """``(starts, owner, stage)`` of the stacked projection rows for the degrees ``deg``
        ``[M]``: feature f owns rows ``starts[f] .. starts[f + 1] - 1``, row r is stage
        ``stage[r]`` of feature ``owner[r]``. Cached for this degrees tensor as it stands (the
        same object, unmodified): sizing ``owner`` from the data is a host sync on a GPU, so
        only the first call after a draw makes it."""
        hit = self._row_cache
        if hit is not None and hit[0] is deg and hit[1] == deg._version:
            return hit[2]
        starts = torch.cat((deg.new_zeros(1), deg.cumsum(0)))  # feature f: rows starts[f]..
        owner = torch.repeat_interleave(torch.arange(deg.shape[0], device=deg.device), deg)
        stage = torch.arange(owner.shape[0], device=deg.device) - starts[owner]
        self._row_cache = (deg, deg._version, (starts, owner, stage))
        return starts, owner, stage

    def kernel_form(self, w, params=None):
        """The "rmf" kind: feature f's projection rows (stage 0 = W's row, then the drawn
        stages) stacked feature-major, so one projection covers every stage."""
        p = params or self.drawn()
        m, dev = w.shape[0], w.device
        stages = torch.cat((w.detach()[None], p["rmf_proj"].to(dev, w.dtype)), dim=0)
        starts, owner, stage = self._row_index(p["rmf_degree"].to(dev))
        rows = stages[stage, owner]
        cq = p["rmf_scale"].to(dev, torch.float64)
        c = component_weights(p, m)
        ck = cq if c is None else cq * c.to(dev, torch.float64)
        return KernelForm(
            "rmf",
            w.detach(),
            table=torch.stack((cq, ck))[:, None],
            rows=rows,
            segments=torch.cat((starts, owner)),
        )

    def target_kernel(self, xq, xk):
        """The truncated series ``sum_{n <= max_degree} a_n t^n`` at ``t = x_q . x_k`` (Horner)."""
        t = xq @ xk.transpose(-1, -2)
        out = torch.zeros_like(t)
        for a in reversed(self.coef):
            out = out * t + a
        return out
