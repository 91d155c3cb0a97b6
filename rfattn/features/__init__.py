"""Component functions phi: the pure-torch maths of record (docs/design.md).

One file per family, the registries here:

* :mod:`.base`: the :class:`FeatureMap` interface, stabilisers, option validation;
* :mod:`.exponential`: posrf (FAVOR+), hyprf, gerf, oprf (FAVOR++), saderf (FAVOR#);
* :mod:`.trigonometric`: trigrf;
* :mod:`.discrete`: poisrf, geomrf (DIRF, with their + variants);
* :mod:`.hybrid`: hrf (angular hybrid of ++ and trig);
* :mod:`.maclaurin`: rmf (random Maclaurin features for dot-product kernels).

Denominator policy for signed features (trigrf, complex gerf, poisrf, geomrf, hrf, rmf): the
attention denominator ``phi_q . z`` can be negative or 0; it goes through
:func:`rfattn.reference.safe_denominator` (``|den| < tiny`` becomes ``sign(den) * tiny``, sign of
0 taken as +), the same function in the references, the torch path and the kernels. Positive
features never reach it except for a query with no valid key (output 0).
"""

from __future__ import annotations

import difflib
import inspect

from rfattn.features.base import (
    FeatureMap,
    StatsFeature,
    compute_dtype,
    key_features,
    key_offset,
    prescale,
    python_scalar,
    query_features,
)
from rfattn.features.discrete import GeomRF, PoisRF
from rfattn.features.exponential import GERF, OPRF, SADERF, HypRF, PosRF
from rfattn.features.hybrid import HRF
from rfattn.features.maclaurin import DOT_KERNELS, RMF
from rfattn.features.trigonometric import TrigRF
from rfattn.weights import check_name

__all__ = [
    "FeatureMap",
    "StatsFeature",
    "PosRF",
    "HypRF",
    "GERF",
    "OPRF",
    "SADERF",
    "TrigRF",
    "PoisRF",
    "GeomRF",
    "HRF",
    "RMF",
    "DOT_KERNELS",
    "FEATURES",
    "ALL_FEATURES",
    "VALID_WEIGHTS",
    "check_feature_name",
    "make_feature_map",
    "query_features",
    "key_offset",
    "key_features",
    "compute_dtype",
    "prescale",
    "python_scalar",
]

#: name -> FeatureMap class, for every component function (the order of docs/usage.md).
FEATURES: dict[str, type[FeatureMap]] = {
    "trigrf": TrigRF,
    "posrf": PosRF,
    "hyprf": HypRF,
    "gerf": GERF,
    "oprf": OPRF,
    "saderf": SADERF,
    "poisrf": PoisRF,
    "geomrf": GeomRF,
    "hrf": HRF,
    "rmf": RMF,
}
#: public names (docs/usage.md) whose maths is not written yet (none left).
ALL_FEATURES = tuple(FEATURES)

#: rows marginally N(0, I_D): what the Gaussian-frequency features need.
_GAUSSIAN_ROWS = ("gaussian", "orf", "sorf", "qmc", "mm", "sgq", "fastfood", "fastfoodl")
#: weights whose entries are (quasi-)iid N(0, 1), mapped to integer rows by DIRF (discrete.py).
_GAUSSIAN_ENTRIES = ("gaussian", "orf", "qmc")

#: weight matrices each feature accepts.
VALID_WEIGHTS: dict[str, tuple[str, ...]] = {
    "trigrf": _GAUSSIAN_ROWS,
    "posrf": _GAUSSIAN_ROWS,
    "hyprf": _GAUSSIAN_ROWS,
    "gerf": _GAUSSIAN_ROWS,
    "oprf": _GAUSSIAN_ROWS,
    "saderf": _GAUSSIAN_ROWS,
    "poisrf": _GAUSSIAN_ENTRIES,
    "geomrf": _GAUSSIAN_ENTRIES,
    # hrf splits W between its two bases: sgq's per-row quadrature weights have no row-aligned
    # place in its features
    "hrf": tuple(w for w in _GAUSSIAN_ROWS if w != "sgq"),
    # Rademacher projections (Kar & Karnick; Macformer uses Rademacher only)
    "rmf": ("rademacher",),
}


def check_feature_name(name: str) -> None:
    """Raise ValueError for an unknown name."""
    check_name("feature", name, FEATURES)


def make_feature_map(
    name: str,
    weights: str,
    num_rows: int | None = None,
    head_dim: int | None = None,
    related: tuple[str, ...] = (),
    **options,
) -> FeatureMap:
    """Build the feature map ``name`` for weight matrices ``weights``, validating the pair.

    Args:
        name: a feature name (:data:`FEATURES`).
        weights: the weight-matrix name it will be used with.
        num_rows, head_dim: M and D (needed by features with buffers or statistics).
        related: the caller's own argument names, for the hint after a misspelled option.
        **options: the feature's options; invalid ones raise ValueError naming the option (and
            the nearest valid name).
    """
    check_feature_name(name)
    valid = VALID_WEIGHTS[name]
    if weights not in valid:
        raise ValueError(
            f"feature={name!r} cannot use weights={weights!r}; valid weights for it: {list(valid)}"
        )
    cls = FEATURES[name]
    known = [k for k in inspect.signature(cls.__init__).parameters if k not in _NOT_OPTIONS]
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = f"its options: {known}" if known else "it takes no options"
        near = [f"{u!r} -> {m[0]!r}?" for u in unknown
                if (m := difflib.get_close_matches(u, [*known, *related], n=1))]  # fmt: skip
        raise ValueError(
            f"feature={name!r} has no option(s) {unknown} ({takes})"
            + (f"; did you mean {', '.join(near)}" if near else "")
        )
    return cls(num_rows, head_dim, **options)


_NOT_OPTIONS = ("self", "num_rows", "head_dim", "options")
