"""rfattn: random-feature linear attention with fused Triton kernels.

Public API (docs/usage.md)::

    rf = rfattn.RandomFeatures(head_dim=64, num_features=256, feature="posrf", weights="orf")
    out = rfattn.rf_attention(q, k, v, rf)          # q, k: [B, H, T, D]; v: [B, H, T, E]

``import rfattn`` never imports Triton or touches a GPU driver: kernels load on first use.
"""

from rfattn import modules, reference, testing
from rfattn.attention import RFState, rf_attention
from rfattn.calibration import CalibrationReport, calibrate
from rfattn.features import ALL_FEATURES
from rfattn.modules import *  # noqa: F403 (the modules' public names: modules.__all__)
from rfattn.weights import ALL_WEIGHTS

__all__ = [
    *modules.__all__,
    "rf_attention",
    "RFState",
    "calibrate",
    "CalibrationReport",
    "reference",
    "testing",
    "ALL_FEATURES",
    "ALL_WEIGHTS",
]
__version__ = "0.1.0"
