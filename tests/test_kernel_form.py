"""Each feature's kernel form (``FeatureMap.kernel_form``), evaluated in torch the way the kernels
compute it, equals the feature map's own formula: the same logits (so the same key offsets) and
the same amplitudes, per side, for every fused feature, option and weight family it takes."""

import math

import pytest
import torch

import rfattn
from rfattn.features.form import KINDS, TABLE_ROWS, KernelForm, coefficient_table

f64 = torch.float64
D, M = 6, 10

CASES = [
    ("posrf", "orf", {}),
    ("posrf", "sgq", {}),
    ("hyprf", "gaussian", {}),
    ("hyprf", "sgq", {}),
    ("gerf", "orf", {"A": -0.2}),
    ("gerf", "sgq", {"A": -0.1}),
    ("gerf", "gaussian", {"A": 0.05 + 0.1j}),
    ("gerf", "gaussian", {"A": -0.1, "s": -1}),
    ("oprf", "orf", {}),
    ("saderf", "gaussian", {}),
    ("trigrf", "orf", {}),
    ("trigrf", "sgq", {}),
    ("hrf", "gaussian", {"lambda_features": 3}),
    ("hrf", "orf", {"lambda_features": 2, "share_base_projection": True}),
    ("rmf", "rademacher", {}),
    ("rmf", "rademacher", {"dot_kernel": "inverse", "mode": "paper"}),
]


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    xq = 0.4 * torch.randn(2, 3, 5, D, generator=g, dtype=f64)
    xk = 0.4 * torch.randn(2, 3, 7, D, generator=g, dtype=f64)
    return xq, xk


@pytest.mark.parametrize("feature,weights,opts", CASES)
def test_kernel_form_equals_feature_map(feature, weights, opts):
    m = 2 * D + 1 if weights == "sgq" else M
    rf = rfattn.RandomFeatures(D, m, feature=feature, weights=weights, seed=3, **opts).double()
    fm, w = rf.feature_map, rf.weight
    xq, xk = _inputs(1)
    params = rf.feature_params(xq, xk)
    form = fm.kernel_form(w, params)
    assert isinstance(form, KernelForm) and form.w.shape[0] == fm.width(w.shape[0])
    for side, x in (("query", xq), ("key", xk)):
        u, g = form.evaluate(x, side)
        if fm.exponential:
            u_ref = fm.logits(x, w, side, params)
            amp = (
                fm.amplitude
                if side == "query"
                else (lambda x_, w_, _s, p: fm.key_amplitude(x_, w_, p))
            )
            g_ref = amp(x, w, side, params)
            torch.testing.assert_close(u, u_ref, rtol=1e-12, atol=1e-12)  # same offsets
        else:
            assert form.plain and torch.equal(u, torch.zeros_like(u))
            g_ref = fm.values(x, w, side, params)
            c = fm.key_amplitude(x, w, params) if side == "key" else None
            g_ref = g_ref if c is None else g_ref * c
        one = torch.ones_like(u)
        torch.testing.assert_close(
            one if g is None else g, one if g_ref is None else g_ref, rtol=1e-12, atol=1e-12
        )


def test_kernel_form_gradient_reaches_weight():
    rf = rfattn.RandomFeatures(D, M, feature="hyprf", weights="fastfoodl", seed=0).double()
    w = rf.weight.detach().clone().requires_grad_()
    xq, _ = _inputs(2)
    u, _ = rf.feature_map.kernel_form(w).evaluate(xq, "query")
    u.exp().sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_features_without_kernel_form():
    rf = rfattn.RandomFeatures(D, M, feature="poisrf", weights="gaussian", seed=0)
    assert not rf.feature_map.has_kernel_form
    with pytest.raises(NotImplementedError, match="poisrf"):
        rf.feature_map.kernel_form(rf.weight)
    rf = rfattn.RandomFeatures(D, 2 * D + 1, feature="oprf", weights="sgq", seed=0)
    xq, xk = _inputs(3)
    with pytest.raises(NotImplementedError, match="per-row weights"):
        rf.feature_map.kernel_form(rf.weight, rf.feature_params(xq.float(), xk.float()))


def test_kernel_form_checks_its_fields():
    w = torch.randn(4, 3)
    with pytest.raises(ValueError, match="kind"):
        KernelForm("posrf", w)
    with pytest.raises(ValueError, match="takes no table"):
        KernelForm("gerf", w, table=torch.zeros(2, 9, 4))
    with pytest.raises(ValueError, match=r"table \[2, 9, 4\]"):
        KernelForm("table", w, table=torch.zeros(2, 9, 5))
    with pytest.raises(ValueError, match="coeffs"):
        KernelForm("gerf", w, coeffs=torch.zeros(2))
    with pytest.raises(ValueError, match="unknown table rows"):
        coefficient_table(4, "cpu", nope=1.0)
    # a hand-built table: u = |x|^2 / 2 + 1, g = cos(z): the formula, term by term
    t = coefficient_table(4, "cpu", ch=0.5, bias=1.0, ct=1.0, gb=1.0)
    x = torch.randn(1, 1, 2, 3, dtype=f64)
    u, g = KernelForm("table", w.double(), table=t).evaluate(x, "key")
    torch.testing.assert_close(u, (0.5 * (x * x).sum(-1, keepdim=True) + 1.0).expand_as(u))
    torch.testing.assert_close(g, torch.cos(x @ w.double().T))
    assert math.isfinite(float(g.sum()))


def test_kinds_and_table_rows_match_the_kernels():
    from rfattn.kernels import common

    assert tuple(common.FEATURE_IDS) == KINDS
    assert common.NP.value == len(TABLE_ROWS)
