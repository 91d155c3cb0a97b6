"""Exponential component functions: posrf (FAVOR+), hyprf, gerf, oprf (FAVOR++), saderf (FAVOR#).

All estimate the softmax kernel ``exp(x . y)`` of pre-scaled inputs, with rows omega ~ N(0, I_D)
(any weight matrix whose rows are marginally standard Gaussian). The real positive members are one
formula, GERF with s = +1 (spec ``spectraformer.md`` §0.2, §1.8; ``crt-flt.md`` A.1):

    u_f(x) = A |omega_f|^2 + B omega_f . x~ - |x~|^2 / 2 + log D,   B = sqrt(1 - 4A),
    D = (1 - 4A)^(D/4),   phi_f = exp(u_f)

with A = 0 for posrf, A = A*(Phi) for oprf and, for saderf, ``x~ = psi * q`` (queries),
``x~ = k / psi`` (keys). ``E[phi(x) phi(y)] = exp(x~ . y~) = exp(x . y)`` for any real
A < 1/4 shared by the queries and keys of a (b, h) (finite variance needs A < 1/8).
"""

from __future__ import annotations

import cmath
import math

import torch

from rfattn.features.base import (
    FeatureMap,
    StatsFeature,
    check_choice,
    check_number,
    component_weights,
    project,
    python_scalar,
    row_sq_norms,
    sq_norm,
)
from rfattn.features.form import KernelForm, coefficient_table
from rfattn.stats import gerf_real_constants, oprf_A, pair_sq_norm, saderf_psi

__all__ = [
    "PosRF", "HypRF", "GERF", "OPRF", "SADERF", "gerf_real_logits", "gerf_real_parts", "GERF_A_MAX",
    "coefficient_form",
]  # fmt: skip

#: the cap on a learnable GERF A (``RandomFeatures.learn_gerf_A``): the estimator's variance is
#: finite only for A < 1/8
GERF_A_MAX = 0.12


def gerf_real_logits(x, w, a, b, log_d) -> torch.Tensor:
    """``A |omega|^2 + B omega . x - |x|^2 / 2 + log D`` ``[..., T, M]``.

    ``a``, ``b``, ``log_d``: floats or tensors broadcasting against ``[B, H, T, M]`` (per (b, h):
    ``[B, H, 1, 1]``).
    """
    u, r = gerf_real_parts(x, w, a, b, log_d)
    return u + r


def gerf_real_parts(x, w, a, b, log_d, row: bool = True) -> tuple:
    """:func:`gerf_real_logits` as ``(A |omega|^2 + B omega . x, log D - |x|^2 / 2)``: the
    per-row part ``[..., T, 1]`` apart (:meth:`FeatureMap.logit_parts`; ``row=False``: None in
    its place)."""
    return a * row_sq_norms(w, x.dtype) + b * project(x, w), _row_term(x, log_d, row)


def _row_term(x, log_d, row: bool):
    """``log D - |x|^2 / 2`` ``[..., T, 1]`` (``log_d`` None: 0), or None when ``row`` is False
    (not computed)."""
    if not row:
        return None
    r = -0.5 * (x * x).sum(dim=-1, keepdim=True)
    return r if log_d is None else log_d + r


def real_gerf_form(rows: torch.Tensor, a: float, params: dict | None) -> KernelForm:
    """The kernel form of :func:`gerf_real_logits` with one real A for every (b, h) on the
    projection rows ``rows`` ``[F, D]``: the "gerf" kind, or the "table" kind when the owner
    gives per-row weights (``params["component_weight"]``, sgq's; they scale the key side)."""
    d = rows.shape[-1]
    b, log_d = math.sqrt(1.0 - 4.0 * a), 0.25 * d * math.log(1.0 - 4.0 * a)
    c = component_weights(params, rows.shape[0])
    if c is None:
        coeffs = None if a == 0.0 else torch.tensor([a, b, log_d], dtype=torch.float64)
        return KernelForm("gerf", rows, coeffs=coeffs)
    c = c.to(rows.device, torch.float64)
    table = coefficient_table(
        rows.shape[0], rows.device, cu=b, ch=-0.5, cw=a, bias=log_d, ga=(1.0, c)
    )
    return KernelForm("table", rows, table=table)


def stats_form(w: torch.Tensor, params: dict, name: str) -> KernelForm:
    """The "gerf" kind with the per-(b, h) ``A, B, log D`` (and saderf's ``psi``) of
    :meth:`OPRF.params` / :meth:`SADERF.params` (held constant: no gradient)."""
    coeffs = torch.cat((params["A"], params["B"], params["log_D"]), dim=-1).flatten(-2)
    psi = params.get("psi")
    psi = None if psi is None else psi.squeeze(-2)
    return coefficient_form(w, coeffs, psi, params, name)


def coefficient_form(w: torch.Tensor, coeffs: torch.Tensor, psi: torch.Tensor | None,
                     params: dict | None = None, name: str = "oprf") -> KernelForm:  # fmt: skip
    """The "gerf" kind from per-(b, h) coefficients ``(A, B, log D)`` ``[..., 3]`` and input
    scales ``psi`` ``[..., D]`` (or None) as they are: :func:`stats_form`'s, or those the fused
    stats pass forms in its own launch (``rfattn.kernels.stats``), with no op of its own."""
    if params is not None and params.get("component_weight") is not None:
        raise NotImplementedError(
            f"feature={name!r}: the fused kernels do not apply per-row weights (sgq) together "
            "with per-(b, h) parameters"
        )
    return KernelForm("gerf", w, coeffs=coeffs.detach(), psi=None if psi is None else psi.detach())


class PosRF(FeatureMap):
    """FAVOR+ positive random features (spec §2.4, PosRF-B, Eq 32).

    ``phi_f(x) = exp(omega_f . x - |x|^2 / 2)``; ``E[phi(x) . phi(y)] / M = exp(x . y)`` for
    rows omega ~ N(0, I). With ``x = sqrt(scale) q`` the target is the softmax kernel
    ``exp(scale * q . k)``. Logits: ``u = x W^T - |x|^2/2``.
    """

    name = "posrf"

    def logits(self, x, w, side, params=None):
        u, r = self.logit_parts(x, w, side, params)
        return u + r

    def logit_parts(self, x, w, side, params=None, row=True):
        return project(x, w), _row_term(x, None, row)

    def kernel_form(self, w, params=None):
        return real_gerf_form(w, 0.0, params)


class HypRF(FeatureMap):
    """Hyperbolic positive features (PosRF-Hyp, spec §2.4 corrected; Performer), F = 2M.

    ``phi(x) = exp(-|x|^2/2) / sqrt(2M) [exp(omega_f . x), exp(-omega_f . x)]_f``: the antithetic
    pair estimates ``exp(x . y)`` through ``E cosh(omega . (x + y)) = exp(|x + y|^2 / 2)``.
    Logits: ``u = [x W^T, -x W^T] - |x|^2/2``; :meth:`num_samples` = 2M.
    """

    name = "hyprf"
    width_factor = 2

    def logits(self, x, w, side, params=None):
        u, r = self.logit_parts(x, w, side, params)
        return u + r

    def logit_parts(self, x, w, side, params=None, row=True):
        z = project(x, w)
        return torch.cat((z, -z), dim=-1), _row_term(x, None, row)

    def num_samples(self, w):
        return 2 * w.shape[-2]

    def kernel_form(self, w, params=None):  # [exp(w.x), exp(-w.x)]: posrf on the rows [W; -W]
        return real_gerf_form(torch.cat((w, -w), dim=0), 0.0, params)


class GERF(FeatureMap):
    """Generalised exponential random features (CRT (4)-(5); spec §2.2), softmax target.

    ``f1(omega, x) = D exp(A|omega|^2 + B omega.x - s|x|^2/2)``,
    ``f2(omega, y) = D exp(A|omega|^2 + s B omega.y - s|y|^2/2)``, ``B = sqrt(s(1 - 4A))``,
    ``D = ((1 - 4A)^(1/4))^d`` (principal roots), ``E Re(f1 f2) = exp(x . y)`` for Re(1-4A) > 0.

    * A real and s = +1: real positive features, ``u`` of :func:`gerf_real_logits`, F = M.
    * otherwise (complex A or s = -1): complex features in real arithmetic, F = 2M:
      queries ``[Re f1, Im f1]``, keys ``[Re f2, -Im f2]`` (so the inner product is
      ``Re(f1 f2)``; ``[Re, Im]`` on both sides would give ``Re(f1 conj f2)``, wrong for s = -1).
      With ``z = log f`` (complex): ``u = [Re z, Re z]``, amplitude
      ``g_q = [cos Im z1, sin Im z1]``, ``g_k = [cos Im z2, -sin Im z2]``. Signed.
      A = 0, s = -1 is TrigRF.

    Options:
        A: float or complex with Re(1 - 4A) > 0 (default 0.0; finite variance needs Re A < 1/8).
        s: +1 or -1 (default +1).

    A real A may instead come per call as per-(b, h) tensors ``params["A"], ["B"], ["log_D"]``
    (a learnable A, ``RandomFeatures.learn_gerf_A``), used in place of the option.
    """

    name = "gerf"

    def __init__(self, num_rows=None, head_dim=None, A=0.0, s=1):
        super().__init__(num_rows, head_dim)
        A = python_scalar(A)
        if isinstance(A, bool) or not isinstance(A, (int, float, complex)):
            raise ValueError(
                f"feature='gerf': option A must be a real or complex number, got {A!r}"
            )
        A = complex(A)
        if not (cmath.isfinite(A) and (1.0 - 4.0 * A).real > 0):
            raise ValueError(f"feature='gerf': option A must satisfy Re(1 - 4A) > 0, got {A!r}")
        check_choice(self.name, "s", s, (1, -1))
        self.A, self.s = A, int(s)
        self.complex_form = A.imag != 0 or self.s == -1
        self.positive = not self.complex_form
        self.width_factor = 2 if self.complex_form else 1

    def extra_repr(self) -> str:
        return f"name='gerf', A={self.A}, s={self.s}"

    def coefficients(self, d: int, side: str) -> tuple[complex, complex]:
        """``(B, log D)`` of ``side`` for head dim d: ``B = sqrt(s(1 - 4A))`` (times s for
        keys), ``log D = (d/4) log(1 - 4A)`` (principal branches; the fused kernels use them)."""
        one_m = 1.0 - 4.0 * self.A
        b = cmath.sqrt(self.s * one_m)
        return (self.s * b if side == "key" else b), 0.25 * d * cmath.log(one_m)

    def _z(self, x, w, side):
        """(Re z, Im z) of ``log f`` on ``side``, each ``[..., T, M]``."""
        b, log_d = self.coefficients(x.shape[-1], side)
        proj, nw = project(x, w), row_sq_norms(w, x.dtype)
        re = log_d.real + self.A.real * nw + b.real * proj - 0.5 * self.s * sq_norm(x)
        im = log_d.imag + self.A.imag * nw + b.imag * proj
        return re, im

    def logits(self, x, w, side, params=None):
        if not self.complex_form:
            u, r = self.logit_parts(x, w, side, params)
            return u + r
        re, _ = self._z(x, w, side)
        return torch.cat((re, re), dim=-1)

    def logit_parts(self, x, w, side, params=None, row=True):
        if self.complex_form:
            return super().logit_parts(x, w, side, params, row)
        if params is not None and "A" in params:  # a learnable A, per (b, h)
            return gerf_real_parts(x, w, params["A"], params["B"], params["log_D"], row)
        a = self.A.real
        return gerf_real_parts(x, w, a, math.sqrt(1.0 - 4.0 * a),
                               0.25 * x.shape[-1] * math.log(1.0 - 4.0 * a), row)  # fmt: skip

    def amplitude(self, x, w, side, params=None):
        if not self.complex_form:
            return None
        _, im = self._z(x, w, side)
        sin = torch.sin(im)
        return torch.cat((torch.cos(im), sin if side == "query" else -sin), dim=-1)

    def kernel_form(self, w, params=None):
        if not self.complex_form:
            if params is not None and "A" in params:  # a learnable A (held constant here)
                return stats_form(w, params, self.name)
            return real_gerf_form(w, self.A.real, params)
        # u = [Re z, Re z]; g = [cos Im z, +-sin Im z] (keys: -sin), sin = cos(. - pi/2)
        m, d, dev = w.shape[0], w.shape[1], w.device
        (bq, log_d), (bk, _) = self.coefficients(d, "query"), self.coefficients(d, "key")
        half = torch.ones(m, dtype=torch.float64, device=dev)
        shift = torch.cat((0.0 * half, -0.5 * math.pi * half))
        c = component_weights(params, 2 * m)
        ck = 1.0 if c is None else c.to(dev, torch.float64)
        table = coefficient_table(
            2 * m,
            dev,
            cu=(bq.real, bk.real),
            ch=-0.5 * self.s,
            cw=self.A.real,
            bias=log_d.real,
            ct=(bq.imag, bk.imag),
            tw=self.A.imag,
            tb=log_d.imag + shift,
            gb=(1.0, torch.cat((half, -half)) * ck),
        )
        return KernelForm("table", torch.cat((w, w), dim=0), table=table)


class OPRF(StatsFeature):
    """FAVOR++ optimal positive random features (CRT Theorem 3.3; spec §2.5, §1.8).

    GERF with s = +1 and one real ``A = (1 - 1/rho*)/8 <= 0`` per (b, h), from the pair average
    ``Phi = mean|x|^2 + mean|y|^2 + 2 xbar . ybar`` (CRT (8)) through the cancellation-free
    ``rho* = 2d / ((2 Phi + d) + sqrt((2 Phi + d)^2 + 8 d Phi))``. Logits
    ``u = A |omega|^2 + B x W^T - |x|^2/2 + log D`` with per-(b, h) ``A, B = sqrt(1-4A),
    log D = (d/4) log(1-4A)``. Positive and bounded.

    Options: ``stats``, ``stats_grad``, ``momentum`` (see :class:`StatsFeature`); ``A`` (real,
    < 1/8, for ``stats="fixed"``).
    """

    name = "oprf"
    fixed_options = ("A",)
    kernel_stats = "oprf"

    def __init__(
        self, num_rows=None, head_dim=None, stats=None, stats_grad=False, momentum=0.1, A=None
    ):
        super().__init__(num_rows, head_dim)
        self._init_stats(head_dim, stats, stats_grad, momentum, {"A": A})
        self.fixed_A = (
            None if A is None else check_number(self.name, "A", A, high=0.125, high_open=True)
        )

    def params(self, xq, xk, key_padding_mask=None, causal=False, update=True, moments=None,
               query_padding_mask=None):  # fmt: skip
        d = xq.shape[-1]
        m = self.moments(xq, xk, key_padding_mask, causal, update, moments, query_padding_mask)
        if m is None:
            a = xq.new_full((1, 1), self.fixed_A)
        else:
            a = oprf_A(pair_sq_norm(m), d)
        b, log_d = gerf_real_constants(a, d)
        return {"A": a[..., None, None], "B": b[..., None, None], "log_D": log_d[..., None, None]}

    def logits(self, x, w, side, params=None):
        p = params
        return gerf_real_logits(x, w, p["A"], p["B"], p["log_D"])

    def logit_parts(self, x, w, side, params=None, row=True):
        p = params
        return gerf_real_parts(x, w, p["A"], p["B"], p["log_D"], row)

    def kernel_form(self, w, params=None):
        return stats_form(w, params, self.name)


class SADERF(StatsFeature):
    """FAVOR# simplified asymmetric dense-exponential features (spec §2.7, §1.8).

    GERF (s = +1) on ``x~ = psi * q`` for queries and ``y~ = k / psi`` for keys (so
    ``x~ . y~ = q . k``), with per-(b, h) ``psi_l = (mean k_l^2 / mean q_l^2)^(1/4)`` and A by the
    DERF recipe: the OPRF formula on the transformed statistics ``Phi(psi)``. Logits
    ``u = A |omega|^2 + B x~ W^T - |x~|^2/2 + log D``. Positive and bounded.

    Options: ``stats``, ``stats_grad``, ``momentum``; for ``stats="fixed"``: ``psi`` (D positive
    numbers) and ``A`` (real, < 1/8; default 0).
    """

    name = "saderf"
    fixed_options = ("psi", "A")
    optional_fixed = ("A",)
    kernel_stats = "saderf"

    def __init__(
        self,
        num_rows=None,
        head_dim=None,
        stats=None,
        stats_grad=False,
        momentum=0.1,
        psi=None,
        A=None,
    ):
        super().__init__(num_rows, head_dim)
        self._init_stats(head_dim, stats, stats_grad, momentum, {"psi": psi, "A": A})
        self.fixed_A = (
            0.0 if A is None else check_number(self.name, "A", A, high=0.125, high_open=True)
        )
        self.fixed_psi = None
        if psi is not None:
            t = torch.as_tensor(psi, dtype=torch.float64)
            if t.shape != (head_dim,) or not bool((t > 0).all() & t.isfinite().all()):
                raise ValueError(
                    f"feature='saderf': option psi must be {head_dim} finite positive numbers"
                )
            self.fixed_psi = t

    def params(self, xq, xk, key_padding_mask=None, causal=False, update=True, moments=None,
               query_padding_mask=None):  # fmt: skip
        d = xq.shape[-1]
        m = self.moments(xq, xk, key_padding_mask, causal, update, moments, query_padding_mask)
        if m is None:
            psi = self.fixed_psi.to(device=xq.device, dtype=xq.dtype)[None, None]
            a = xq.new_full((1, 1), self.fixed_A)
        else:
            psi = saderf_psi(m)
            a = oprf_A(pair_sq_norm(m, psi), d)
        b, log_d = gerf_real_constants(a, d)
        return {
            "psi": psi[..., None, :],
            "A": a[..., None, None],
            "B": b[..., None, None],
            "log_D": log_d[..., None, None],
        }

    def logits(self, x, w, side, params=None):
        u, r = self.logit_parts(x, w, side, params)
        return u + r

    def logit_parts(self, x, w, side, params=None, row=True):
        p = params
        x = x * p["psi"] if side == "query" else x / p["psi"]
        return gerf_real_parts(x, w, p["A"], p["B"], p["log_D"], row)

    def kernel_form(self, w, params=None):
        return stats_form(w, params, self.name)
