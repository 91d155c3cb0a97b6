"""Error metrics and the one tolerance table shared by ``tests/`` and ``bench/``.

Parity is measured as the relative RMS error of an output against a float64 reference computed
on the same weights and inputs (flash-linear-attention's ``assert_close`` convention):
``rms(actual - expected) / rms(expected)``.
"""

from __future__ import annotations

import torch

__all__ = ["rel_rms", "TOLERANCES", "tolerance", "assert_rel_rms"]

#: (dtype, quantity) -> max relative RMS error against a float64 reference on the same weights.
#: fp32 with ``tl.dot(input_precision="ieee")`` must match to 1e-5. The low-precision rows are
#: upper bounds; the flash-attention rule (at most 2x / 3x the torch path's own error in that
#: dtype) is applied on top where a GPU is present.
TOLERANCES: dict[tuple[torch.dtype, str], float] = {
    (torch.float64, "out"): 1e-12,
    (torch.float64, "grad"): 1e-10,
    (torch.float32, "out"): 1e-5,
    (torch.float32, "grad"): 1e-5,
    (torch.float16, "out"): 5e-3,
    (torch.float16, "grad"): 1e-2,
    (torch.bfloat16, "out"): 3e-2,
    (torch.bfloat16, "grad"): 6e-2,
}


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative RMS error ``||a - e||_2 / ||e||_2`` computed in float64.

    NaN anywhere in ``actual`` or ``expected`` gives NaN (so a comparison with it fails).
    An all-zero ``expected`` gives the absolute RMS of ``actual``.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"shape mismatch: actual {tuple(actual.shape)} vs {tuple(expected.shape)}")
    # on the CPU: the two may live on different devices (a CUDA result, a CPU reference)
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    if a.numel() == 0:
        return 0.0
    diff = (a - e).pow(2).mean().sqrt()
    ref = e.pow(2).mean().sqrt()
    return float(diff / ref) if float(ref) > 0 else float(diff)


def tolerance(dtype: torch.dtype, quantity: str = "out") -> float:
    """The relative RMS tolerance for ``quantity`` ("out" or "grad") computed in ``dtype``."""
    try:
        return TOLERANCES[(dtype, quantity)]
    except KeyError:
        raise ValueError(f"no tolerance for dtype={dtype}, quantity={quantity!r}") from None


def assert_rel_rms(
    actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = "output"
) -> None:
    """Assert ``rel_rms(actual, expected) <= tol`` with a readable message (NaN fails)."""
    err = rel_rms(actual, expected)
    if not err <= tol:
        raise AssertionError(f"{name}: relative RMS error {err:.3e} > tolerance {tol:.1e}")
