"""Property-based tests of bad data (issue 15), both backends (Triton under the interpreter on
CPU): random shapes, masks and junk (NaN, inf, 1e30) in padded positions; padding invariance,
NaN locality in causal calls, split/resume at random cuts, backend agreement, determinism.
float64 throughout, so the tolerances are rounding-level; fixed seeds (derandomized). About three
minutes under the interpreter on 2 cores: marker ``slow`` (make test-slow, CI)."""

import pytest
import torch

import rfattn

hypothesis = pytest.importorskip("hypothesis")
pytestmark = pytest.mark.slow
st = hypothesis.strategies
settings = hypothesis.settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=list(hypothesis.HealthCheck),
)

f64 = torch.float64
JUNK = [float("nan"), float("inf"), float("-inf"), 1e30]
FEATURES = [
    ("posrf", "orf", {}),
    ("trigrf", "orf", {}),
    ("rmf", "rademacher", {}),
    ("oprf", "orf", {"stats": "fixed", "A": -0.05}),
    ("hrf", "gaussian", {"lambda_features": 1}),
]


@st.composite
def calls(draw, causal=None):
    """(q, k, v, mask, rf, causal, backend) of a random call."""
    B, H = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    T = draw(st.integers(1, 40))
    D, E = draw(st.sampled_from([4, 8])), draw(st.sampled_from([2, 5]))
    feature, weights, opts = draw(st.sampled_from(FEATURES))
    causal = draw(st.booleans()) if causal is None else causal
    backend = draw(st.sampled_from(["torch", "triton"]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    q, k = (0.6 * torch.randn(B, H, T, D, generator=g, dtype=f64) for _ in range(2))
    v = torch.randn(B, H, T, E, generator=g, dtype=f64)
    mask = torch.rand(B, T, generator=g) < draw(st.sampled_from([0.0, 0.3, 0.7]))
    rf = rfattn.RandomFeatures(D, 12, feature, weights=weights, seed=seed, **opts).double()
    return q, k, v, mask, rf.eval(), causal, backend


def run(q, k, v, mask, rf, causal, backend, **kw):
    return rfattn.rf_attention(
        q, k, v, rf, causal=causal, key_padding_mask=mask, backend=backend, **kw
    )


@settings
@hypothesis.given(calls(), st.sampled_from(JUNK))
def test_junk_in_padded_positions_changes_nothing(call, junk):
    q, k, v, mask, rf, causal, backend = call
    clean = run(q, k, v, mask, rf, causal, backend)
    pad = mask[:, None, :, None]
    out = run(q, k.masked_fill(pad, junk), v.masked_fill(pad, junk), mask, rf, causal, backend)
    torch.testing.assert_close(out, clean, rtol=1e-12, atol=1e-12)


@settings
@hypothesis.given(calls(causal=True), st.data())
def test_causal_nan_is_local(call, data):
    q, k, v, mask, rf, causal, backend = call
    T = q.shape[2]
    j = data.draw(st.integers(0, T - 1))
    which = data.draw(st.sampled_from(["q", "k", "v"]))
    x = {"q": q, "k": k, "v": v}
    x[which] = x[which].clone()
    x[which][:, :, j, 0] = float("nan")
    clean = run(q, k, v, mask, rf, True, backend)
    out = run(x["q"], x["k"], x["v"], mask, rf, True, backend)
    torch.testing.assert_close(out[:, :, :j], clean[:, :, :j], rtol=1e-12, atol=1e-12)


@settings
@hypothesis.given(calls(causal=True), st.data())
def test_split_resume_equals_one_shot(call, data):
    q, k, v, mask, rf, causal, backend = call
    T = q.shape[2]
    cut = data.draw(st.integers(0, T))
    full = run(q, k, v, mask, rf, True, backend)
    a, s = run(
        q[:, :, :cut],
        k[:, :, :cut],
        v[:, :, :cut],
        mask[:, :cut],
        rf,
        True,
        backend,
        return_state=True,
    )
    b = run(
        q[:, :, cut:],
        k[:, :, cut:],
        v[:, :, cut:],
        mask[:, cut:],
        rf,
        True,
        backend,
        initial_state=s,
    )
    torch.testing.assert_close(torch.cat((a, b), dim=2), full, rtol=1e-9, atol=1e-11)


@settings
@hypothesis.given(calls())
def test_backends_agree_and_are_deterministic(call):
    q, k, v, mask, rf, causal, _ = call
    ref = run(q, k, v, mask, rf, causal, "torch")
    out = run(q, k, v, mask, rf, causal, "triton")
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-11)
    assert torch.equal(out, run(q, k, v, mask, rf, causal, "triton"))
    assert torch.equal(ref, run(q, k, v, mask, rf, causal, "torch"))
