"""The three references agree with each other in float64."""

import pytest
import torch

from rfattn.reference import kernel_attention, linear_attention, safe_denominator, softmax_attention

f64 = torch.float64


def rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=f64) * scale


def exp_kernel(scale):
    return lambda a, b: torch.exp(a @ b.transpose(-1, -2) * scale)


def naive_softmax(q, k, v, scale, allowed):
    """Loop form, independent of the vectorised references."""
    B, H, Tq, _ = q.shape
    out = torch.zeros(B, H, Tq, v.shape[-1], dtype=f64)
    for b in range(B):
        for h in range(H):
            for i in range(Tq):
                js = [j for j in range(k.shape[2]) if allowed(b, i, j)]
                if not js:
                    continue
                s = torch.stack([q[b, h, i] @ k[b, h, j] * scale for j in js])
                p = torch.softmax(s, 0)
                out[b, h, i] = sum(p[n] * v[b, h, j] for n, j in enumerate(js))
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_matches_loop_and_kernel_attention(causal, masked):
    B, H, T, D, E = 2, 2, 7, 5, 3
    q, k, v = rand(B, H, T, D, seed=1), rand(B, H, T, D, seed=2), rand(B, H, T, E, seed=3)
    mask = torch.zeros(B, T, dtype=torch.bool)
    if masked:
        mask[0, [1, 4]] = True
        mask[1, 0] = True
    kpm = mask if masked else None
    scale = 0.37
    ref = softmax_attention(q, k, v, causal=causal, scale=scale, key_padding_mask=kpm)
    loop = naive_softmax(q, k, v, scale, lambda b, i, j: (not causal or j <= i) and not mask[b, j])
    # the loop gives 0 for a query without valid keys (causal row 0 of batch 1): same policy
    assert torch.allclose(ref, loop, atol=1e-13, rtol=0)
    ka = kernel_attention(q, k, v, exp_kernel(scale), causal=causal, key_padding_mask=kpm)
    assert (ka - ref).abs().max() <= 1e-12


def test_softmax_default_scale_and_cross_attention():
    q, k, v = rand(1, 3, 4, 16, seed=1), rand(1, 3, 9, 16, seed=2), rand(1, 3, 9, 2, seed=3)
    a = softmax_attention(q, k, v)
    b = softmax_attention(q, k, v, scale=0.25)
    assert torch.equal(a, b)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert (a - sdpa).abs().max() <= 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_linear_attention_equals_kernel_attention_with_feature_kernel(causal):
    B, H, T, F, E = 2, 3, 11, 6, 4
    pq = rand(B, H, T, F, seed=4).exp()
    pk = rand(B, H, T, F, seed=5).exp()
    v = rand(B, H, T, E, seed=6)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, 3:6] = True
    lin = linear_attention(pq, pk, v, causal=causal, key_padding_mask=mask)
    ker = kernel_attention(
        pq, pk, v, lambda a, b: a @ b.transpose(-1, -2), causal=causal, key_padding_mask=mask
    )
    assert (lin - ker).abs().max() <= 1e-12


def test_padding_removes_keys_from_numerator_and_denominator():
    """Padded keys (with NaN values even) give the same result as deleting them."""
    B, H, T, D, E = 1, 2, 8, 4, 3
    q, k, v = rand(B, H, 5, D, seed=1), rand(B, H, T, D, seed=2), rand(B, H, T, E, seed=3)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, [2, 5, 6]] = True
    keep = ~mask[0]
    k_nan, v_nan = k.clone(), v.clone()
    k_nan[:, :, mask[0]] = float("nan")
    v_nan[:, :, mask[0]] = float("nan")
    ref = softmax_attention(q, k[:, :, keep], v[:, :, keep])
    out = softmax_attention(q, k_nan, v_nan, key_padding_mask=mask)
    assert (out - ref).abs().max() <= 1e-14
    pq, pk = q.exp(), k.exp()
    pk_nan = pk.clone()
    pk_nan[:, :, mask[0]] = float("nan")
    lin = linear_attention(pq, pk_nan, v_nan, key_padding_mask=mask)
    assert (lin - linear_attention(pq, pk[:, :, keep], v[:, :, keep])).abs().max() <= 1e-14


def test_no_valid_key_gives_zero_and_nan_propagates():
    q, k, v = rand(1, 1, 3, 4, seed=1), rand(1, 1, 5, 4, seed=2), rand(1, 1, 5, 2, seed=3)
    all_pad = torch.ones(1, 5, dtype=torch.bool)
    assert torch.equal(
        softmax_attention(q, k, v, key_padding_mask=all_pad), torch.zeros(1, 1, 3, 2)
    )
    assert torch.equal(softmax_attention(q, k[:, :, :0], v[:, :, :0]), torch.zeros(1, 1, 3, 2))
    pq = q.exp()
    out = linear_attention(pq, k.exp(), v, key_padding_mask=all_pad)
    assert torch.equal(out, torch.zeros(1, 1, 3, 2))
    q_nan = q.clone()
    q_nan[0, 0, 1, 0] = float("nan")
    out = softmax_attention(q_nan, k, v)
    assert out[0, 0, 1].isnan().all() and out[0, 0, [0, 2]].isfinite().all()
    out = linear_attention(q_nan.exp(), k.exp(), v)
    assert out[0, 0, 1].isnan().all() and out[0, 0, [0, 2]].isfinite().all()


def test_safe_denominator_policy():
    tiny = torch.finfo(f64).tiny
    den = torch.tensor([0.0, -0.0, 1e-320, -1e-320, 2.0, -3.0, float("nan")], dtype=f64)
    out = safe_denominator(den)
    assert out[:6].tolist() == [tiny, tiny, tiny, -tiny, 2.0, -3.0]
    assert out[6].isnan()


def test_references_reject_causal_cross_attention():
    q, k, v = rand(1, 1, 3, 4), rand(1, 1, 5, 4), rand(1, 1, 5, 2)
    with pytest.raises(ValueError, match="Tq == Tk"):
        softmax_attention(q, k, v, causal=True)
