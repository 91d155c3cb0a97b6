"""Accuracy alongside speed: relative RMS error of the output against exact softmax attention.

Inputs: q, k ~ N(0, std^2), v ~ N(0, 1) in the benchmark dtype on the benchmark device; the
exact answer is :func:`rfattn.reference.softmax_attention` in float64. Random-feature error grows
with ``|q| |k| scale`` (the estimator's variance is ``exp(|x + y|^2)``-like), so ``std`` is stated
with every number.
"""

from __future__ import annotations

import statistics

import torch

import rfattn
from bench.providers import forward_output, is_softmax
from rfattn.testing import rel_rms


def _inputs(B, H, T, D, E, std, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g) * std
    k = torch.randn(B, H, T, D, generator=g) * std
    v = torch.randn(B, H, T, E, generator=g)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v))


def _exact(q, k, v, causal):
    return rfattn.reference.softmax_attention(q.double(), k.double(), v.double(), causal=causal)


def _calibrate(rf, q, k, v) -> None:
    """Fill causal running statistics (oprf, saderf, ...) from these inputs, as training would:
    one training-mode causal call (the first EMA update copies the batch moments). Without it a
    fresh module's zero buffers give the neutral parameters (oprf = posrf)."""
    rf.train()
    with torch.no_grad():
        rfattn.rf_attention(q, k, v, rf, causal=True)


def accuracy_at_m(rfs: dict, providers, B, H, T, D, E, std, causals, dtype, device) -> list[dict]:
    """Error of each provider (each feature kind for rfattn's) at the benchmarked M."""
    from bench.providers import Inputs

    q, k, v = _inputs(B, H, T, D, E, std, dtype, device)
    x = Inputs(q, k, v, None)
    rows = []
    for causal in causals:
        exact = _exact(q, k, v, causal)
        for provider in providers:
            kinds = [None] if is_softmax(provider) else list(rfs)
            if provider == "performer":
                kinds = [f for f in kinds if f == "posrf"]
            for feature in kinds:
                rf = rfs.get(feature) if feature else next(iter(rfs.values()), None)
                if causal and feature:
                    _calibrate(rf, q, k, v)
                try:
                    out = forward_output(provider, x, rf, causal)
                except (RuntimeError, NotImplementedError) as exc:
                    rows.append(
                        dict(provider=provider, feature=feature, causal=causal, error=str(exc))
                    )
                    continue
                rows.append(
                    dict(
                        provider=provider,
                        feature=feature,
                        causal=causal,
                        T=T,
                        M=rf.num_features if feature else None,
                        std=std,
                        rel_err=rel_rms(out, exact),
                    )
                )
    return rows


def error_vs_m(features: dict, Ms, seeds, B, H, T, D, E, std, causals, dtype, device):
    """rfattn's error against M (feature kind -> weights name in ``features``), mean and range
    over ``seeds`` draws of the random features on the same inputs."""
    q, k, v = _inputs(B, H, T, D, E, std, dtype, device)
    rows = []
    for causal in causals:
        exact = _exact(q, k, v, causal)
        for feature, weights in features.items():
            for M in Ms:
                errs = []
                for seed in range(seeds):
                    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=seed)
                    rf = rf.to(device)
                    if causal:
                        _calibrate(rf, q, k, v)
                    with torch.no_grad():
                        out = rfattn.rf_attention(q, k, v, rf, causal=causal)
                    errs.append(rel_rms(out, exact))
                rows.append(
                    dict(
                        feature=feature,
                        weights=weights,
                        causal=causal,
                        T=T,
                        M=M,
                        std=std,
                        seeds=seeds,
                        rel_err_mean=statistics.fmean(errs),
                        rel_err_min=min(errs),
                        rel_err_max=max(errs),
                    )
                )
    return rows
