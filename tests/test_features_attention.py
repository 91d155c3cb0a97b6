"""Every feature x valid weights pair through rf_attention(backend="torch"), causal and not;
the causal torch path on signed and plain features; ppSBN."""

import pytest
import torch

import rfattn
from rfattn.features import FEATURES, VALID_WEIGHTS
from rfattn.reference import linear_attention
from rfattn.testing import rel_rms
from rfattn.weights import WEIGHTS

f64 = torch.float64


def rand(*shape, seed=0, scale=1.0, dtype=f64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=f64) * scale).to(dtype)


#: iterated at test time, so weights added to the registry are covered automatically
PAIRS = [(f, w) for f in FEATURES for w in VALID_WEIGHTS[f] if w in WEIGHTS]


def make_rf(feature, weights, D=8, M=16, **opts):
    if feature == "rmf":
        opts.setdefault("max_degree", 6)
    return rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=0, **opts)


@pytest.mark.parametrize("feature, weights", PAIRS, ids=[f"{f}-{w}" for f, w in PAIRS])
def test_every_pair_runs_finite(feature, weights):
    D = 8
    rf = make_rf(feature, weights, D, M=2 * D + 1 if weights == "sgq" else 16)  # sgq: M = 2D+1
    q, k, v = rand(2, 2, 11, D, scale=0.3), rand(2, 2, 11, D, seed=1, scale=0.3), rand(2, 2, 11, 5)
    q, k, v = q.float(), k.float(), v.float()
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, 7:] = True
    for causal in (False, True):
        out = rfattn.rf_attention(
            q, k, v, rf, causal=causal, key_padding_mask=mask, backend="torch"
        )
        assert out.shape == (2, 2, 11, 5) and out.dtype == torch.float32
        assert out.isfinite().all(), (feature, weights, causal)
    if rf.feature_map.positive:  # large-norm inputs (|q| ~ 30) stay finite
        big_q = 30 * q / q.norm(dim=-1, keepdim=True)
        big_k = 30 * k / k.norm(dim=-1, keepdim=True)
        for causal in (False, True):
            out = rfattn.rf_attention(big_q, big_k, v, rf, causal=causal, backend="torch")
            assert out.isfinite().all(), (feature, weights, causal, "large norm")


FIXED = {
    "oprf": {"stats": "fixed", "A": -0.2},
    "saderf": {"stats": "fixed", "psi": [1.5, 1.0, 0.7, 1.2, 1.0, 0.9, 1.1, 2.0], "A": -0.1},
    "poisrf": {"stats": "fixed", "lam": 0.4},
    "geomrf": {"stats": "fixed", "p": 0.6, "plus": True, "shift": [-2.0] * 8},
    "gerf": {"A": -0.05 + 0.1j, "s": -1},
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_causal_torch_path_matches_masked_reference(feature):
    """Chunked causal path (running key max for exponential features, none for plain ones) =
    the masked quadratic reference on the same features, fp64; split/resume = one shot."""
    D, T = 8, 300  # > one chunk of 128
    weights = "rademacher" if feature == "rmf" else "gaussian"
    if weights not in WEIGHTS:
        pytest.skip(f"weights={weights!r} not implemented")
    rf = make_rf(feature, weights, D, **FIXED.get(feature, {})).double()
    q, k, v = (
        rand(1, 2, T, D, scale=0.3),
        rand(1, 2, T, D, seed=1, scale=0.3),
        rand(1, 2, T, 4, seed=2),
    )
    mask = torch.zeros(1, T, dtype=torch.bool)
    mask[0, 50:60] = True
    out = rfattn.rf_attention(q, k, v, rf, causal=True, key_padding_mask=mask)
    phi_q, phi_k = rf.features(q, k, mask)
    ref = linear_attention(phi_q, phi_k, v, causal=True, key_padding_mask=mask)
    ref = ref.masked_fill(mask[:, None, :, None], 0.0)  # self-attention: padded queries give 0
    assert rel_rms(out, ref) <= 1e-10
    a, st = rfattn.rf_attention(
        q[:, :, :170],
        k[:, :, :170],
        v[:, :, :170],
        rf,
        causal=True,
        return_state=True,
        key_padding_mask=mask[:, :170],
    )
    b = rfattn.rf_attention(
        q[:, :, 170:],
        k[:, :, 170:],
        v[:, :, 170:],
        rf,
        causal=True,
        initial_state=st,
        key_padding_mask=mask[:, 170:],
    )
    assert rel_rms(torch.cat((a, b), dim=2), out) <= 1e-10
    if not rf.feature_map.exponential:
        assert torch.equal(st.offset, torch.zeros_like(st.offset))


def test_non_causal_matches_reference_with_global_stats():
    """The torch path computes the statistics once and uses the same ones as rf.features."""
    D = 8
    q, k, v = rand(2, 2, 9, D, scale=0.4), rand(2, 2, 13, D, seed=1, scale=0.4), rand(2, 2, 13, 3)
    for feature in ("oprf", "saderf", "poisrf", "geomrf"):
        rf = make_rf(feature, "gaussian", D, M=32).double()
        out = rfattn.rf_attention(q, k, v, rf)
        phi_q, phi_k = rf.features(q, k)
        assert rel_rms(out, linear_attention(phi_q, phi_k, v)) <= 1e-12


def test_ppsbn_pre_post_and_wrapping():
    D, E = 8, 5
    x = rand(2, 3, 6, D, scale=3.0) + 1.0
    x[0, 0, 0] = 2.5  # a constant row: 0, not NaN
    pre = rfattn.PPSBN.pre(x)
    c = x - x.mean(-1, keepdim=True)
    assert torch.equal(pre[0, 0, 0], torch.zeros(D, dtype=f64))
    assert torch.allclose(pre[1], c[1] / c[1].norm(dim=-1, keepdim=True), rtol=1e-12)
    assert torch.allclose(pre[1].norm(dim=-1), torch.ones(3, 6, dtype=f64))
    assert pre[1].mean(-1).abs().max() < 1e-12
    sbn = rfattn.ppSBN(E).double()
    with torch.no_grad():
        sbn.gamma.copy_(torch.arange(1.0, E + 1))
    rf = make_rf("rmf", "rademacher", D, M=64, dot_kernel="inverse").double()
    q, k, v = rand(1, 2, 7, D, seed=3), rand(1, 2, 7, D, seed=4), rand(1, 2, 7, E, seed=5)
    out = sbn(q, k, v, rf)
    inner = rfattn.rf_attention(sbn.pre(q), sbn.pre(k), v, rf)
    assert torch.allclose(out, inner * torch.arange(1.0, E + 1, dtype=f64), rtol=1e-12)
    signed = rfattn.PPSBN(E, power="signed").double()
    with torch.no_grad():
        signed.beta.fill_(0.5)
    y = torch.tensor([-4.0, 0.0, 9.0], dtype=f64)
    assert torch.allclose(
        signed.post(torch.stack([y] * E, -1))[:, 0], torch.tensor([-2.0, 0.0, 3.0], dtype=f64)
    )
    with pytest.raises(ValueError, match="power"):
        rfattn.PPSBN(E, power="square")
