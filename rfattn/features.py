"""Component functions phi: the pure-torch maths of record.

A feature map turns pre-scaled queries/keys ``x = sqrt(scale) * q`` ``[B, H, T, D]`` and the
weight matrix ``W [M, D]`` into features ``[B, H, T, F]`` whose inner products estimate a kernel.
Spec: ``spectraformer.md`` §1.8 and §2.

Exponential features (posrf, and later hyprf, gerf, oprf, saderf) are handled through their
*logits* u, with ``phi = exp(u - offset)``. The offsets are the numerics contract of DESIGN §3 and
are applied identically by the torch path, the references and the kernels:

* queries: per row, the max over features (it cancels exactly in the attention ratio);
* keys: one offset per (b, h), the max over all valid keys and all features (a per-key max would
  re-weight keys and bias the kernel; a max across the batch would couple batch elements).
  Padded keys get ``phi = 0``; a (b, h) with no valid key gets offset 0 and all-zero features.

Implemented here: ``posrf``. The other DESIGN §2 names are registered as planned.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FeatureMap",
    "PosRF",
    "FEATURES",
    "PLANNED_FEATURES",
    "ALL_FEATURES",
    "check_feature_name",
    "make_feature_map",
    "query_features",
    "key_offset",
    "key_features",
    "compute_dtype",
    "prescale",
]


def query_features(u_q: torch.Tensor) -> torch.Tensor:
    """Stabilised query features ``exp(u - max_f u)`` (per-row max, exact in the ratio)."""
    return torch.exp(u_q - u_q.amax(dim=-1, keepdim=True).detach())


def key_offset(u_k: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The key stabiliser: max of ``u_k`` over valid keys and all features, per (b, h).

    Args:
        u_k: key logits ``[B, H, T, F]``.
        key_padding_mask: ``[B, T]`` bool, True = padding.

    Returns:
        ``[B, H]`` offsets (detached: they cancel exactly); 0 where a (b, h) has no valid key.
    """
    if key_padding_mask is not None:
        u_k = u_k.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))
    if u_k.shape[-2] == 0 or u_k.shape[-1] == 0:
        return u_k.new_zeros(u_k.shape[:2])
    off = u_k.detach().amax(dim=(-2, -1))
    return torch.where(off == float("-inf"), torch.zeros_like(off), off)


def key_features(u_k: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Stabilised key features ``exp(u - offset(b, h))``, zero for padded keys."""
    off = key_offset(u_k, key_padding_mask)
    phi = torch.exp(u_k - off[:, :, None, None])
    if key_padding_mask is not None:
        phi = phi.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    return phi


class FeatureMap:
    """One component function. Subclasses define the logits and the kernel they estimate.

    Inputs ``x`` are already pre-scaled by ``sqrt(scale)`` and in the compute dtype (fp32, or fp64
    for fp64 inputs).
    """

    #: registry name
    name: str = ""
    #: F / M: how many features each row of W yields
    width_factor: int = 1
    #: True when every feature is > 0 (the denominator cannot vanish)
    positive: bool = True
    #: True when phi = exp(logits) (stabilised by offsets)
    exponential: bool = True
    #: the id the fused kernels know this feature by, or None when no kernel exists yet
    kernel_id: int | None = None

    def __init__(self, **options) -> None:
        if options:
            raise ValueError(f"feature={self.name!r} takes no options, got {sorted(options)}")

    def width(self, num_rows: int) -> int:
        """F, the feature width for M = ``num_rows``."""
        return self.width_factor * num_rows

    def logits(self, x: torch.Tensor, w: torch.Tensor, side: str) -> torch.Tensor:
        """``u`` with ``phi = exp(u)`` up to the offsets; ``side`` is "query" or "key"."""
        raise NotImplementedError

    def features(
        self,
        xq: torch.Tensor,
        xk: torch.Tensor,
        w: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stabilised ``(phi_q, phi_k)``, each ``[B, H, T, F]``."""
        u_q = self.logits(xq, w, "query")
        u_k = self.logits(xk, w, "key")
        return query_features(u_q), key_features(u_k, key_padding_mask)

    def estimate_kernel(self, xq: torch.Tensor, xk: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The unbiased estimate ``[B, H, Tq, Tk]`` of :meth:`target_kernel` (no offsets)."""
        u_q = self.logits(xq, w, "query")
        u_k = self.logits(xk, w, "key")
        # exp(u_q + u_k) summed over f without overflow: factor out each side's row max.
        m_q = u_q.amax(dim=-1, keepdim=True)
        m_k = u_k.amax(dim=-1, keepdim=True)
        inner = torch.exp(u_q - m_q) @ torch.exp(u_k - m_k).transpose(-1, -2)
        return inner * torch.exp(m_q + m_k.transpose(-1, -2)) / self.num_samples(w)

    def num_samples(self, w: torch.Tensor) -> int:
        """The Monte Carlo sample count the estimate averages over (M by default)."""
        return w.shape[0]

    def target_kernel(self, xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor:
        """The exact kernel ``[B, H, Tq, Tk]`` this feature map estimates."""
        raise NotImplementedError


class PosRF(FeatureMap):
    """FAVOR+ positive random features (spec §2.4, PosRF-B, Eq 32).

    ``phi_f(x) = exp(omega_f . x - |x|^2 / 2)``; ``E[phi(x) . phi(y)] / M = exp(x . y)`` for
    rows omega ~ N(0, I). With ``x = sqrt(scale) q`` the target is the softmax kernel
    ``exp(scale * q . k)``.
    """

    name = "posrf"
    kernel_id = 0

    def logits(self, x, w, side):
        return x @ w.transpose(0, 1).to(x.dtype) - 0.5 * (x * x).sum(dim=-1, keepdim=True)

    def target_kernel(self, xq, xk):
        return torch.exp(xq @ xk.transpose(-1, -2))


#: name -> FeatureMap class, for every component function implemented so far.
FEATURES: dict[str, type[FeatureMap]] = {"posrf": PosRF}
#: names pinned by DESIGN §2 whose maths lands in a later issue (component functions).
PLANNED_FEATURES = ("trigrf", "hyprf", "gerf", "oprf", "saderf", "poisrf", "geomrf", "hrf", "rmf")
ALL_FEATURES = tuple(FEATURES) + PLANNED_FEATURES

#: weight matrices each feature accepts (rows must be real Gaussian-like frequencies).
VALID_WEIGHTS: dict[str, tuple[str, ...]] = {
    "posrf": ("gaussian", "orf", "sorf", "qmc", "mm", "sgq", "fastfood", "fastfoodl"),
}


def check_feature_name(name: str) -> None:
    """Raise ValueError for an unknown name, NotImplementedError for a planned one."""
    if name in FEATURES:
        return
    if name in PLANNED_FEATURES:
        raise NotImplementedError(
            f"feature={name!r} is planned but not implemented yet; implemented: {sorted(FEATURES)}"
        )
    raise ValueError(f"unknown feature={name!r}; valid choices: {list(ALL_FEATURES)}")


def make_feature_map(name: str, weights: str, **options) -> FeatureMap:
    """Build the feature map ``name`` for weight matrices ``weights``, validating the pair."""
    check_feature_name(name)
    valid = VALID_WEIGHTS[name]
    if weights not in valid:
        raise ValueError(
            f"feature={name!r} cannot use weights={weights!r}; valid weights for it: {list(valid)}"
        )
    return FEATURES[name](**options)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Features, S and z accumulate in fp32, or fp64 for fp64 inputs (DESIGN §3)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def prescale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``sqrt(scale) * x`` in the compute dtype: ``exp(x_q . x_k) = exp(scale * q . k)``."""
    return x.to(compute_dtype(x.dtype)) * math.sqrt(scale)
