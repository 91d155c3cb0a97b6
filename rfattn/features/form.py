"""The kernel form of a feature map: what the fused kernels need to compute it, in one object.

Each fused feature restates its formula (``rfattn.features.*``) as a :class:`KernelForm` through
its own :meth:`~rfattn.features.FeatureMap.kernel_form`, beside the torch formula; the launchers
and operators (``rfattn.ops``, ``rfattn.kernels``) take that one object. The kernels compute, for
pre-scaled inputs ``x`` (``sqrt(scale) q``) and one projection row ``w_f`` per feature,
``z_f = w_f . x~`` and ``phi_f = g_f exp(u_f - offset)`` in one of three kinds
(``kernels/common.py`` has the Triton side, :meth:`KernelForm.evaluate` the same in torch):

* ``"gerf"``: the real positive GERF family, ``u = A |w|^2 + B z - |x~|^2 / 2 + log D``, ``g = 1``,
  with per-(b, h) ``coeffs = (A, B, log D)`` (None: posrf's 0, 1, 0) and input scales ``psi``
  (``x~ = psi x`` for queries, ``x / psi`` for keys; None: 1). posrf, hyprf (rows [W; -W]), real
  gerf, oprf, saderf.
* ``"table"``: signed exponential features from a per-feature, per-side coefficient table
  ``[2, 9, F]`` (side 0 queries, 1 keys; rows :data:`TABLE_ROWS`):
  ``u = cu z + ch |x|^2 + cw |w|^2 + bias``, ``th = ct z + tw |w|^2 + tb``,
  ``g = (ga + gb cos th) s`` with ``s = sgn(tau_l . x)`` (sgn 0 = +1) for the features whose index
  ``l = lam_f >= 0`` picks a sign row of ``tau`` ``[n, D]``, else 1 (sin th is ``cos(th - pi/2)``:
  ``tb`` carries the shift). trigrf, hrf, complex gerf, and any positive feature with
  per-row weights (sgq).
* ``"rmf"``: plain products (no exponential; u = 0, offsets stay 0):
  ``phi_f = c_f prod_{r in seg(f)} (rho_r . x)`` over stacked projection rows ``rows`` ``[R, D]``,
  feature-major; ``segments`` ``[F + 1 + R]`` holds the segment starts (``start_0 = 0`` ..
  ``start_F = R``) then the owning feature of each row; ``table`` ``[2, 1, F]`` the scales c
  (query side, key side).

Every kind takes optional per-head input maps ``qmap`` ``[Hq, D, D]`` and ``kmap`` ``[Hk, D, D]``
(a :class:`rfattn.RandomFeatures`' calibrated head maps): the kernels' rows are then
``x A_h^T`` (before psi), computed in their prologue from the q and k they load, so the mapped
inputs are never written out. The forward kernels take them (inference); a call that needs
gradients maps q and k first (``rfattn.attention``).

The key offsets of a kind are those of the torch path (log D included, 0 for "rmf"), so a causal
state moves between the torch path and the kernels unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["KernelForm", "KINDS", "TABLE_ROWS", "coefficient_table"]

#: the kernels' feature kinds
KINDS = ("gerf", "table", "rmf")
#: rows of the per-side coefficient table of the "table" kind, in order
TABLE_ROWS = ("cu", "ch", "cw", "bias", "ct", "tw", "tb", "ga", "gb")


def coefficient_table(width: int, device, **rows) -> torch.Tensor:
    """Coefficients ``[2, 9, width]`` of the "table" kind (float64; rows named as in
    :data:`TABLE_ROWS`): each a number, a ``[width]`` tensor or a (query, key) pair of those;
    rows not given are 0."""
    unknown = sorted(set(rows) - set(TABLE_ROWS))
    if unknown:
        raise ValueError(f"unknown table rows {unknown}; rows: {list(TABLE_ROWS)}")
    t = torch.zeros(2, len(TABLE_ROWS), width, dtype=torch.float64, device=device)
    for name, val in rows.items():
        for side, x in enumerate(val if isinstance(val, tuple) else (val, val)):
            row = t[side, TABLE_ROWS.index(name)]
            if torch.is_tensor(x):
                row.copy_(x.detach())
            else:  # fill_, not an item assignment (which copies the number from the host)
                row.fill_(x)
    return t


@dataclasses.dataclass(frozen=True)
class KernelForm:
    """One feature map as the fused kernels compute it (module docstring).

    Attributes:
        kind: one of :data:`KINDS`.
        w: ``[F, D]`` one projection row per feature (for "rmf": W itself, its rows are
            ``rows``). The only differentiable field: built from ``RandomFeatures.weight`` with
            differentiable ops, so learnable weights get their gradient through it.
        coeffs: "gerf": per-(b, h) ``(A, B, log D)``, broadcastable to ``[B, H, 3]``; None = posrf.
        psi: "gerf": per-(b, h) input scales broadcastable to ``[B, H, D]``; None = 1.
        table: "table": ``[2, 9, F]``; "rmf": ``[2, 1, F]`` (the scales c per side).
        tau, lam: "table": sign rows ``[n, D]`` and the row of each feature ``[F]`` (-1: none).
        rows, segments: "rmf": stacked projection rows ``[R, D]`` and ``[F + 1 + R]`` indices.
        qmap, kmap: per-head input maps ``[Hq, D, D]`` and ``[Hk, D, D]`` (module docstring),
            held constant, or None. :meth:`evaluate` takes inputs already mapped.
        stats: "gerf": statistics whose parameters the first launch of the forward that takes
            the form writes into ``coeffs`` and ``psi`` before reading them
            (``rfattn.kernels.stats.ChunkStats``: a causal training call's running statistics),
            or None (the parameters are there). Not a tensor: the operators' traced schema
            drops it, so only eager calls hand statistics over this way.
    """

    kind: str
    w: torch.Tensor
    coeffs: torch.Tensor | None = None
    psi: torch.Tensor | None = None
    table: torch.Tensor | None = None
    tau: torch.Tensor | None = None
    lam: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    segments: torch.Tensor | None = None
    qmap: torch.Tensor | None = None
    kmap: torch.Tensor | None = None
    stats: object | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if not torch.is_tensor(self.w) or self.w.dim() != 2:
            raise ValueError(f"w must be a [F, D] tensor, got {getattr(self.w, 'shape', self.w)}")
        F, D = self.w.shape
        allowed = {
            "gerf": ("coeffs", "psi"),
            "table": ("table", "tau", "lam"),
            "rmf": ("table", "rows", "segments"),
        }[self.kind]
        for field in ("coeffs", "psi", "table", "tau", "lam", "rows", "segments"):
            if getattr(self, field) is not None and field not in allowed:
                raise ValueError(f"kind={self.kind!r} takes no {field}")
        if self.coeffs is not None and self.coeffs.shape[-1] != 3:
            got = tuple(self.coeffs.shape)
            raise ValueError(f"coeffs must be [..., 3] (A, B, log D), got {got}")
        if self.psi is not None and self.psi.shape[-1] != D:
            raise ValueError(f"psi must be [..., {D}], got {tuple(self.psi.shape)}")
        if self.kind != "gerf":
            rows = 1 if self.kind == "rmf" else len(TABLE_ROWS)
            if self.table is None or tuple(self.table.shape) != (2, rows, F):
                got = None if self.table is None else tuple(self.table.shape)
                raise ValueError(f"kind={self.kind!r} needs table [2, {rows}, {F}], got {got}")
        for name in ("qmap", "kmap"):
            m = getattr(self, name)
            if m is not None and (m.dim() != 3 or tuple(m.shape[1:]) != (D, D)):
                raise ValueError(f"{name} must be [heads, {D}, {D}], got {tuple(m.shape)}")
        if (self.tau is None) != (self.lam is None):
            raise ValueError("tau and lam come together")
        if self.tau is not None and (self.tau.shape[-1] != D or tuple(self.lam.shape) != (F,)):
            raise ValueError(f"tau must be [n, {D}] and lam [{F}]")
        if self.kind == "rmf":
            if self.rows is None or self.segments is None or self.rows.shape[-1] != D:
                raise ValueError(f"kind='rmf' needs rows [R, {D}] and segments")
            if tuple(self.segments.shape) != (F + 1 + self.rows.shape[0],):
                raise ValueError(f"segments must be [{F} + 1 + R] for rows [R, {D}]")

    @property
    def plain(self) -> bool:
        """True for features without exponential (their offsets stay 0)."""
        return self.kind == "rmf"

    def evaluate(self, x: torch.Tensor, side: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(u, g)`` ``[B, H, T, F]`` with ``phi = g exp(u)`` (g None = 1), in torch, for
        pre-scaled (and mapped, ``qmap``/``kmap``) inputs ``x`` ``[B, H, T, D]``: the kernels'
        formula (``kernels/common.py`` ``_feature_tile``), against which the feature maps are
        tested."""
        if side not in ("query", "key"):
            raise ValueError(f"side must be 'query' or 'key', got {side!r}")
        key = side == "key"
        w = self.w.to(x.dtype)
        z = x @ w.transpose(-1, -2)
        nw = (w * w).sum(-1)  # [F]
        if self.kind == "gerf":
            if self.psi is not None:
                psi = self.psi.to(x.dtype).expand(*x.shape[:2], x.shape[-1])[..., None, :]
                x = x / psi if key else x * psi
                z = x @ w.transpose(-1, -2)
            a, b, log_d = (
                (0.0, 1.0, 0.0)
                if self.coeffs is None
                else (
                    c.to(x.dtype).expand(x.shape[:2])[..., None, None]
                    for c in self.coeffs.unbind(-1)
                )
            )
            return a * nw + b * z - 0.5 * (x * x).sum(-1, keepdim=True) + log_d, None
        if self.kind == "rmf":
            owner = self.segments[self.w.shape[0] + 1 :].long()
            zr = x @ self.rows.to(x.dtype).transpose(-1, -2)  # [..., T, R]
            prod = torch.ones(*z.shape, dtype=x.dtype, device=x.device)
            prod = prod.scatter_reduce(-1, owner.expand(zr.shape), zr, "prod")
            return torch.zeros_like(prod), self.table[int(key), 0].to(x.dtype) * prod
        t = dict(zip(TABLE_ROWS, self.table[int(key)].to(x.dtype).unbind(0), strict=True))
        u = t["cu"] * z + t["ch"] * (x * x).sum(-1, keepdim=True) + t["cw"] * nw + t["bias"]
        g = t["ga"] + t["gb"] * torch.cos(t["ct"] * z + t["tw"] * nw + t["tb"])
        if self.tau is not None:
            lam = self.lam.long()
            s = torch.where(x @ self.tau.to(x.dtype).transpose(-1, -2) >= 0, 1.0, -1.0)
            g = g * torch.where(lam >= 0, s[..., lam.clamp(min=0)], 1.0).to(x.dtype)
        return u, g
