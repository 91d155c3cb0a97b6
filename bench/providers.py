"""Attention providers benchmarked against each other, each a factory of a zero-argument call."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import rfattn

SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def available_providers(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """Providers to run on ``device`` and, for the ones left out, why."""
    names = ["rfattn", "rfattn-torch"]
    skipped = {}
    if device.type == "cpu":
        names.append("sdpa-math")
        for b in ("flash", "efficient", "cudnn"):
            skipped[f"sdpa-{b}"] = "CUDA-only backend"
    else:
        names += [f"sdpa-{b}" for b in SDPA_BACKENDS]
    return names, skipped


def make_call(
    provider: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rf: rfattn.RandomFeatures,
    causal: bool,
    backward: bool,
) -> Callable[[], object]:
    """A call running ``provider`` forward (and backward with a fixed random cotangent)."""
    if provider == "rfattn":

        def fwd():
            return rfattn.rf_attention(q, k, v, rf, causal=causal)
    elif provider == "rfattn-torch":

        def fwd():
            return rfattn.rf_attention(q, k, v, rf, causal=causal, backend="torch")
    elif provider.startswith("sdpa-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, SDPA_BACKENDS[provider[5:]])

        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        raise ValueError(f"unknown provider {provider!r}")
    if not backward:
        return fwd
    grad = torch.randn(*q.shape[:3], v.shape[-1], device=q.device, dtype=q.dtype)

    def fwd_bwd():
        for x in (q, k, v):
            x.grad = None
        fwd().backward(grad)

    return fwd_bwd
