"""posrf: unbiased for the softmax kernel; stabilisers exactly as docs/numerics.md."""

import math

import pytest
import torch

import rfattn
from rfattn.features import key_features, key_offset, query_features

f64 = torch.float64


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=f64) * scale


@pytest.mark.parametrize("weights", ["gaussian", "orf"])
def test_posrf_is_unbiased_for_softmax_kernel(weights):
    """Mean of estimate_kernel over 2000 redraws = exp(scale q.k) within 4 standard errors."""
    D, M, R = 4, 8, 2000
    q, k = rand(1, 1, 3, D, seed=1, scale=0.6), rand(1, 1, 3, D, seed=2, scale=0.6)
    rf = rfattn.RandomFeatures(D, M, feature="posrf", weights=weights, seed=0).double()
    ests = []
    for r in range(R):
        rf.redraw(seed=r)
        ests.append(rf.estimate_kernel(q, k, scale=0.5))
    ests = torch.stack(ests)
    target = rf.target_kernel(q, k, scale=0.5)
    assert torch.allclose(target, torch.exp(0.5 * q @ k.transpose(-1, -2)), rtol=1e-14, atol=0)
    se = ests.std(0) / math.sqrt(R)
    z = (ests.mean(0) - target) / se
    assert z.abs().max() <= 4, z
    # and the test has power: a 10% biased kernel is rejected
    assert ((ests.mean(0) - 1.1 * target) / se).abs().max() > 4


def test_estimate_kernel_matches_feature_inner_products():
    """estimate = phi_q . phi_k / M undone of its offsets (per query row and per (b, h))."""
    D, M = 6, 32
    q, k = rand(2, 2, 5, D, seed=3), rand(2, 2, 7, D, seed=4)
    rf = rfattn.RandomFeatures(D, M, seed=1).double()
    est = rf.estimate_kernel(q, k)
    x_q, x_k = q * D**-0.25, k * D**-0.25
    w = rf.weight.double()
    u_q = x_q @ w.T - (x_q**2).sum(-1, keepdim=True) / 2
    u_k = x_k @ w.T - (x_k**2).sum(-1, keepdim=True) / 2
    direct = torch.exp(u_q[..., :, None, :] + u_k[..., None, :, :]).mean(-1)
    assert torch.allclose(est, direct, rtol=1e-12, atol=0)
    phi_q, phi_k = rf.features(q, k)
    off_k = u_k.amax(dim=-2, keepdim=True)  # per (b, h) and feature, over keys
    off_q = (u_q + off_k).amax(-1, keepdim=True)  # per row, with the key offsets moved over
    assert torch.allclose(phi_q, torch.exp(u_q + off_k - off_q), rtol=1e-12, atol=0)
    assert torch.allclose(phi_k, torch.exp(u_k - off_k), rtol=1e-12, atol=0)
    # the products are the estimate's terms up to one factor per query row
    prod = (phi_q[..., :, None, :] * phi_k[..., None, :, :]).mean(-1)
    assert torch.allclose(prod * torch.exp(off_q), est, rtol=1e-12, atol=0)
    # query max is per row: each row has a feature equal to 1
    assert torch.allclose(phi_q.amax(-1), torch.ones(2, 2, 5, dtype=f64))
    # key max is one per (b, h, feature): each feature column has a 1, not each key
    assert torch.allclose(phi_k.amax(dim=-2), torch.ones(2, 2, M, dtype=f64))


def test_key_offset_ignores_padding_and_empty_heads():
    u = rand(2, 3, 4, 5, seed=5)
    u[0, :, 2] += 100.0  # a huge padded key must not set the offset
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 2] = True
    mask[1, :] = True  # no valid key at all
    off = key_offset(u, mask)
    assert torch.equal(off[0], u[0, :, [0, 1, 3]].amax(dim=-2))
    assert torch.equal(off[1], torch.zeros(3, 5, dtype=f64))
    phi = key_features(u, mask)
    assert torch.equal(phi[0, :, 2], torch.zeros(3, 5, dtype=f64))
    assert torch.equal(phi[1], torch.zeros(3, 4, 5, dtype=f64))
    assert query_features(u).isfinite().all()


def test_large_norm_inputs_give_finite_features():
    D = 64
    q = rand(1, 2, 9, D, seed=6)
    q = 30 * q / q.norm(dim=-1, keepdim=True)
    rf = rfattn.RandomFeatures(D, 128, seed=0)
    phi_q, phi_k = rf.features(q.float(), q.float())
    assert phi_q.isfinite().all() and phi_k.isfinite().all()
    assert (phi_q.amax(-1) == 1).all()


@pytest.mark.parametrize("feature", ["posrf", "hyprf", "trigrf", "oprf"])
def test_sgq_component_weights_make_the_quadrature(feature):
    """sgq rows are quadrature nodes: with their (signed) weights the estimate is the Smolyak
    quadrature of E_w[...] -- it converges with the level, unlike the unweighted sum."""
    D = 4
    q, k = rand(1, 1, 5, D, seed=7, scale=0.1), rand(1, 1, 6, D, seed=8, scale=0.1)
    errs = {}
    for level, M in ((1, 2 * D + 1), (2, 2 * D * D + 4 * D + 1)):
        rf = rfattn.RandomFeatures(D, M, feature=feature, weights="sgq").double()
        target = rf.target_kernel(q, k, scale=1.0)
        errs[level] = ((rf.estimate_kernel(q, k, scale=1.0) - target) / target).abs().max()
    assert (rf.component_weight < 0).any()  # the negative centre weight is applied, signed
    w = rf.weight.double()
    unweighted = rf.feature_map.estimate_kernel(q, k, w, rf.feature_map.params(q, k))
    err_unweighted = ((unweighted - target) / target).abs().max()
    assert errs[2] < 2e-4 and errs[2] < errs[1] / 10, errs
    assert err_unweighted > 100 * errs[2], (err_unweighted, errs)
    # attention with those features equals kernel attention with the weighted estimate
    v = rand(1, 1, 6, 3, seed=9)
    out = rfattn.rf_attention(q, k, v, rf, scale=1.0)
    ref = rfattn.reference.kernel_attention(
        q, k, v, lambda a, b: rf.estimate_kernel(a, b, scale=1.0)
    )
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)


def test_sgq_weights_in_the_causal_path():
    q, k, v = rand(2, 1, 40, 4, seed=1, scale=0.3), rand(2, 1, 40, 4, seed=2), rand(2, 1, 40, 3)
    rf = rfattn.RandomFeatures(4, 9, feature="posrf", weights="sgq").double()
    phi_q, phi_k = rf.features(q, k)
    ref = rfattn.reference.linear_attention(phi_q, phi_k, v, causal=True)
    out = rfattn.rf_attention(q, k, v, rf, causal=True)
    assert torch.allclose(out, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("feature", ["posrf", "hyprf", "gerf", "oprf", "saderf", "poisrf"])
def test_logit_parts_split_off_a_per_row_term(feature):
    """``logit_parts`` sums to ``logits`` and its second part is one number per row (not
    computed with ``row=False``); for posrf the parts are ``x W^T`` and ``-|x|^2/2`` themselves."""
    D, M = 6, 16
    rf = rfattn.RandomFeatures(D, M, feature=feature, seed=2).double()
    fm = rf.feature_map
    q, k = rand(2, 3, 5, D, seed=5), rand(2, 3, 7, D, seed=6)
    xq, xk, w = rf._inputs(q, k, None)
    params = rf.feature_params(xq, xk)
    for side, x in (("query", xq), ("key", xk)):
        u, r = fm.logit_parts(x, w, side, params)
        full = fm.logits(x, w, side, params)
        if r is None:
            assert torch.equal(u, full)
            continue
        assert r.shape == (*x.shape[:-1], 1)
        assert torch.allclose(u + r, full, rtol=1e-13, atol=1e-13)
        u_only, none = fm.logit_parts(x, w, side, params, row=False)  # the query sides' call
        assert none is None and torch.equal(u_only, u)
        if feature == "posrf":
            assert torch.allclose(u, x @ w.T, rtol=1e-13, atol=0)
            assert torch.allclose(r, -0.5 * (x**2).sum(-1, keepdim=True), rtol=1e-13, atol=0)
