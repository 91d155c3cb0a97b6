"""Hybrid random features (HRF, Choromanski et al.; ``macformer-hrf.md`` B): the bipolar
angular hybrid of the positive (FAVOR+, antithetic) and trigonometric estimators.

    SM_hyb(x, y) = lam(x, y) SM_++(x, y) + (1 - lam(x, y)) SM_trig(x, y),
    lam(x, y) = 1/2 - (1/2n) sum_r sgn(tau_r . x) sgn(tau_r . y)      (E lam = theta_xy / pi)

with tau_r ~ N(0, I) (n of them, drawn independently of W) so lam is independent of both bases
and the hybrid is unbiased for ``exp(x . y)``. lam weights the POSITIVE estimator (the slides and
Theorem 3.1; one notebook of the official code swaps them). It is exact at theta = 0 (trig is)
and, for equal norms, at theta = pi (++ is).

Real feature map (B.3, the imaginary units collected on the query side), with
``P(u) = exp(-|u|^2/2)/sqrt(2 m_p) [exp(Wp u), exp(-Wp u)]`` and
``T(u) = exp(|u|^2/2)/sqrt(m_t) [sin(Wt u), cos(Wt u)]``, ``s(u) = sgn(tau . u)`` (sgn(0) = +1),
``c = 1/sqrt(2n)``:

    keys    Psi_2(y) = [ sqrt(1/2) P(y), sqrt(1/2) T(y),  c s(y) (x) P(y), c s(y) (x) T(y) ]
    queries Psi_1(x) = [ sqrt(1/2) P(x), sqrt(1/2) T(x), -c s(x) (x) P(x), c s(x) (x) T(x) ]

F = 2 (m_p + m_t)(n + 1). Signed exponential form, all constants folded in (num_samples = 1):
P blocks ``u = [z_p, -z_p] - |x|^2/2 + log c``, amplitude ±s_r (1 in the first block); T blocks
``u = |x|^2/2 + log c``, amplitude ``s_r [sin z_t, cos z_t]``; ``z = x W^T``. One offset covers the
whole Psi (a per-block offset would bias the ++/trig weighting; spec C.29).

Projections: by default W's rows are split, the first ``ceil(M/2)`` for the ++ base and the rest
for the trig base (independent for ``gaussian`` rows, as Theorem 3.1 assumes; orthogonal blocks
couple them, which changes the MSE, not the mean). ``share_base_projection=True`` uses all M rows
for both (as the official code does), F = 4M(n + 1).
"""

from __future__ import annotations

import math

import torch

from rfattn.features.base import FeatureMap, check_number, project, sq_norm
from rfattn.features.form import KernelForm, coefficient_table

__all__ = ["HRF"]


class HRF(FeatureMap):
    """Angular hybrid random features. Options: ``lambda_features`` (n, default 8) and
    ``share_base_projection`` (default False). Draws ``hrf_tau`` ``[n, D]`` ~ N(0, I)."""

    name = "hrf"
    positive = False

    def __init__(
        self, num_rows=None, head_dim=None, lambda_features=8, share_base_projection=False
    ):
        super().__init__(num_rows, head_dim)
        self.n = check_number(self.name, "lambda_features", lambda_features, integer=True, low=1)
        if not isinstance(share_base_projection, bool):
            raise ValueError("feature='hrf': option share_base_projection must be a bool")
        self.share = share_base_projection
        self._rows_cache = {}  # (device, mp, mt) -> kernel_form's (table, lam)
        if not isinstance(head_dim, int) or not isinstance(num_rows, int):
            raise ValueError("feature='hrf' needs num_rows and head_dim")
        if not self.share and num_rows < 2:
            raise ValueError(
                "feature='hrf' splits W between its two bases and needs num_features >= 2 "
                "(or share_base_projection=True)"
            )
        self._register_draws()

    def extra_repr(self) -> str:
        return f"name='hrf', lambda_features={self.n}, share_base_projection={self.share}"

    def draw(self, generator, batch_shape=()):
        shape = (*batch_shape, self.n, self.head_dim)
        return {"hrf_tau": torch.randn(shape, generator=generator, dtype=torch.float64)}

    def _split(self, w):
        if self.share:
            return w, w
        mp = -(-w.shape[-2] // 2)
        return w[..., :mp, :], w[..., mp:, :]

    def width(self, num_rows):
        base = 4 * num_rows if self.share else 2 * num_rows
        return base * (self.n + 1)

    def num_samples(self, w):
        return 1

    def log_constants(self, mp: int, mt: int) -> tuple[float, float, float]:
        """Logit constants ``(lp, lt, lr)``: log of the P and T blocks' factors and of the
        lambda blocks' extra factor (the fused kernels use them)."""
        lp = math.log(math.sqrt(0.5) / math.sqrt(2 * mp))
        lt = math.log(math.sqrt(0.5) / math.sqrt(mt))
        lr = math.log(1.0 / math.sqrt(2 * self.n)) - math.log(math.sqrt(0.5))
        return lp, lt, lr

    def _blocks(self, x, w, side, params):
        """(u, g) of the four blocks, concatenated: each ``[B, H, T, F]``."""
        wp, wt = self._split(w)
        mp, mt, n = wp.shape[-2], wt.shape[-2], self.n
        half = 0.5 * sq_norm(x)  # [..., T, 1]
        zp, zt = project(x, wp), project(x, wt)
        u_p = torch.cat((zp, -zp), dim=-1) - half  # [..., T, 2mp]
        u_t = half.expand(*half.shape[:-1], 2 * mt)
        g_t = torch.cat((torch.sin(zt), torch.cos(zt)), dim=-1)
        s = torch.where(project(x, params["hrf_tau"]) >= 0, 1.0, -1.0).to(x.dtype)  # [..., T, n]
        lp, lt, lr = self.log_constants(mp, mt)
        sign_p = -1.0 if side == "query" else 1.0
        lead = u_p.shape[:-1]  # explicit widths below: -1 cannot be inferred when T = 0
        u = torch.cat(
            (
                u_p + lp,
                u_t + lt,
                (u_p + lp + lr).unsqueeze(-2).expand(*lead, n, 2 * mp).reshape(*lead, 2 * n * mp),
                (u_t + lt + lr).unsqueeze(-2).expand(*lead, n, 2 * mt).reshape(*lead, 2 * n * mt),
            ),
            dim=-1,
        )
        g = torch.cat(
            (
                torch.ones_like(u_p),
                g_t,
                (sign_p * s).unsqueeze(-1).expand(*lead, n, 2 * mp).reshape(*lead, 2 * n * mp),
                (s.unsqueeze(-1) * g_t.unsqueeze(-2)).reshape(*lead, 2 * n * mt),
            ),
            dim=-1,
        )
        return u, g

    def logits(self, x, w, side, params=None):
        return self._blocks(x, w, side, params)[0]

    def amplitude(self, x, w, side, params=None):
        return self._blocks(x, w, side, params)[1]

    def kernel_form(self, w, params=None):
        """The "table" kind over the blocks of :meth:`_blocks`, in their order: P blocks
        ``u = +-z_p - |x|^2/2 + log``, T blocks ``u = |x|^2/2 + log``, ``g = [sin z_t, cos z_t]``;
        the lambda blocks add ``lr`` to the logits and the sign ``s_r`` (``lam_f = r``; queries
        carry ``-s_r`` on the P blocks); the first two blocks have no sign (``lam_f = -1``)."""
        wp, wt = self._split(w)
        n = self.n
        rows = [wp, wp, wt, wt] + [wp, wp] * n + [wt, wt] * n
        table, lam = self._constant_rows(wp.shape[0], wt.shape[0], w.device)
        tau = (params or self.drawn())["hrf_tau"]
        return KernelForm("table", torch.cat(rows, dim=0), table=table, tau=tau.detach(), lam=lam)

    def _constant_rows(self, mp: int, mt: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
        """``(table, lam)`` of :meth:`kernel_form`: they depend only on the block sizes (and
        the options, fixed at construction), so they are built once per device and sizes, not
        at every call (some 60 small device ops)."""
        key = (str(dev), mp, mt)
        if key not in self._rows_cache:
            self._rows_cache[key] = self._build_rows(mp, mt, dev)
        return self._rows_cache[key]

    def _build_rows(self, mp: int, mt: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.n
        lp, lt, lr = self.log_constants(mp, mt)
        f64 = dict(dtype=torch.float64, device=dev)
        pm = torch.cat((torch.ones(mp, **f64), -torch.ones(mp, **f64)))  # [exp(z_p), exp(-z_p)]
        sc = torch.cat((torch.full((mt,), -0.5 * math.pi, **f64), torch.zeros(mt, **f64)))
        p_blk, t_blk = dict(cu=pm, ch=-0.5), dict(ch=0.5, ct=1.0, tb=sc, gb=1.0)
        tables = [
            coefficient_table(2 * mp, dev, bias=lp, ga=1.0, **p_blk),
            coefficient_table(2 * mt, dev, bias=lt, **t_blk),
        ]
        tables += [coefficient_table(2 * mp, dev, bias=lp + lr, ga=(-1.0, 1.0), **p_blk)] * n
        tables += [coefficient_table(2 * mt, dev, bias=lt + lr, **t_blk)] * n
        idx = dict(dtype=torch.long, device=dev)  # made on the device: no host copy
        lam = [torch.full((2 * mp + 2 * mt,), -1, **idx)]
        lam += [torch.full((2 * mp,), r, **idx) for r in range(n)]
        lam += [torch.full((2 * mt,), r, **idx) for r in range(n)]
        return torch.cat(tables, dim=-1), torch.cat(lam)
