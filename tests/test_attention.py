"""rf_attention through the torch path: parity with the references, causal streaming, errors."""

import pytest
import torch

import rfattn
from rfattn.reference import linear_attention, softmax_attention
from rfattn.testing import rel_rms

f64 = torch.float64


def rand(*shape, seed=0, scale=1.0, dtype=f64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=f64) * scale).to(dtype)


def qkv(B=2, H=3, T=37, D=16, E=8, seed=0, scale=0.5, dtype=f64, Tk=None):
    Tk = T if Tk is None else Tk
    return (
        rand(B, H, T, D, seed=seed, scale=scale, dtype=dtype),
        rand(B, H, Tk, D, seed=seed + 1, scale=scale, dtype=dtype),
        rand(B, H, Tk, E, seed=seed + 2, dtype=dtype),
    )


def ref_linear(q, k, v, rf, causal=False, mask=None, scale=None):
    phi_q, phi_k = rf.features(q.double(), k.double(), mask, scale=scale)
    return linear_attention(phi_q, phi_k, v.double(), causal=causal, key_padding_mask=mask)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T", [1, 37, 300])
def test_torch_path_matches_reference(causal, T):
    q, k, v = qkv(T=T)
    rf = rfattn.RandomFeatures(16, 40, seed=3).double()
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[1, T // 3 :: 2] = True
    for kpm in (None, mask):
        out = rfattn.rf_attention(q, k, v, rf, causal=causal, key_padding_mask=kpm, scale=0.3)
        ref = ref_linear(q, k, v, rf, causal, kpm, scale=0.3)
        if causal and kpm is not None:  # self-attention: padded queries output 0
            ref = ref.masked_fill(kpm[:, None, :, None], 0.0)
        assert rel_rms(out, ref) <= 1e-12


def test_torch_path_fp32_against_float64_reference():
    q, k, v = qkv(dtype=torch.float32)
    rf = rfattn.RandomFeatures(16, 64, seed=1)
    for causal in (False, True):
        out = rfattn.rf_attention(q, k, v, rf, causal=causal)
        assert out.dtype == torch.float32
        assert rel_rms(out, ref_linear(q, k, v, rf, causal)) <= 1e-5


def test_cross_attention_and_tiny_lengths():
    rf = rfattn.RandomFeatures(16, 24, seed=0).double()
    q, k, v = qkv(T=5, Tk=11)
    assert rel_rms(rfattn.rf_attention(q, k, v, rf), ref_linear(q, k, v, rf)) <= 1e-12
    for T in (0, 1):
        q, k, v = qkv(T=T)
        for causal in (False, True):
            out = rfattn.rf_attention(q, k, v, rf, causal=causal)
            assert out.shape == (2, 3, T, 8)
            if T == 1:  # one key: attention returns its value exactly
                assert torch.allclose(out, v, rtol=1e-12, atol=1e-12)


def test_error_against_softmax_shrinks_with_M():
    q, k, v = qkv(B=1, H=4, T=64, D=16, scale=0.4)
    ref = softmax_attention(q, k, v)
    errs = {}
    for M in (16, 1024):
        errs[M] = (
            sum(
                rel_rms(
                    rfattn.rf_attention(q, k, v, rfattn.RandomFeatures(16, M, seed=s).double()), ref
                )
                for s in range(3)
            )
            / 3
        )
    # Monte Carlo error ~ M^-1/2: a factor 8 expected between M=16 and M=1024 (about 6 seen,
    # the ratio-of-estimates bias shrinks like 1/M)
    assert errs[1024] < errs[16] / 4, errs
    assert errs[1024] < 0.06, errs


def test_causal_split_resume_equals_one_shot():
    T = 300
    q, k, v = qkv(T=T)
    mask = torch.zeros(2, T, dtype=torch.bool)
    mask[0, :17] = True  # left padding, as in batched generation
    rf = rfattn.RandomFeatures(16, 32, seed=2).double()
    full, st_full = rfattn.rf_attention(
        q, k, v, rf, causal=True, key_padding_mask=mask, return_state=True
    )
    for cuts in ([0, 100, 129, 300], list(range(0, 40)) + [300]):
        outs, st = [], None
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            o, st = rfattn.rf_attention(
                q[:, :, a:b],
                k[:, :, a:b],
                v[:, :, a:b],
                rf,
                causal=True,
                key_padding_mask=mask[:, a:b],
                initial_state=st,
                return_state=True,
            )
            outs.append(o)
        assert rel_rms(torch.cat(outs, 2), full) <= 1e-12
        # states agree once brought to a common offset
        for x, y in ((st.s, st_full.s), (st.z, st_full.z)):
            scale = torch.exp(st.offset - st_full.offset)
            scale = scale[..., None, None] if x.dim() == 4 else scale[..., None]
            assert rel_rms(x * scale, y) <= 1e-12


def test_causal_no_leak():
    T = 200
    q, k, v = qkv(T=T)
    rf = rfattn.RandomFeatures(16, 32, seed=2).double()
    out = rfattn.rf_attention(q, k, v, rf, causal=True)
    t = 150
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1 :] *= 3  # larger keys: moves the running max of the chunk of t
    v2[:, :, t + 1 :] = 100.0
    out2 = rfattn.rf_attention(q, k2, v2, rf, causal=True)
    # within the chunk of t the shared stabiliser may move: equal to rounding, not bitwise
    assert (out2[:, :, : t + 1] - out[:, :, : t + 1]).abs().max() <= 1e-12
    assert (out2[:, :, t + 1 :] - out[:, :, t + 1 :]).abs().max() > 1.0
    # earlier chunks are bitwise unchanged
    assert torch.equal(out2[:, :, :128], out[:, :, :128])


@pytest.mark.parametrize("causal", [False, True])
def test_large_norm_inputs_finite(causal):
    q, k, v = qkv(B=1, H=2, T=50, D=64, dtype=torch.float32)
    q = 30 * q / q.norm(dim=-1, keepdim=True)
    k = 30 * k / k.norm(dim=-1, keepdim=True)
    rf = rfattn.RandomFeatures(64, 128, seed=0)
    out = rfattn.rf_attention(q, k, v, rf, causal=causal)
    assert out.isfinite().all()


def test_nan_inputs_propagate():
    q, k, v = qkv(T=9)
    q[0, 0, 3, 0] = float("nan")
    rf = rfattn.RandomFeatures(16, 8, seed=0).double()
    out = rfattn.rf_attention(q, k, v, rf)
    assert out[0, 0, 3].isnan().all()
    assert out[1].isfinite().all()


def test_gradients_flow_through_torch_path():
    q, k, v = (x.requires_grad_() for x in qkv(B=1, H=1, T=6, D=4, E=3))
    rf = rfattn.RandomFeatures(4, 5, seed=0).double()
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda a, b, c, cz=causal: rfattn.rf_attention(a, b, c, rf, causal=cz), (q, k, v)
        )


def bad_input_cases():
    q, k, v = qkv(B=2, H=3, T=5, D=16, E=4, dtype=torch.float32)
    rf = rfattn.RandomFeatures(16, 8)
    ok = dict(q=q, k=k, v=v, rf=rf)
    mask = torch.zeros(2, 5, dtype=torch.bool)
    yield "q rank", dict(ok, q=q[0]), ValueError, "q must have shape"
    yield "k rank", dict(ok, k=k[..., None]), ValueError, "k must have shape"
    yield "v not tensor", dict(ok, v=v.numpy()), TypeError, "v must be a torch.Tensor"
    yield "int q", dict(ok, q=q.long()), TypeError, "q must be floating"
    yield "mixed dtype", dict(ok, k=k.double()), TypeError, "k has dtype"
    yield "batch", dict(ok, k=k[:1], v=v[:1]), ValueError, "k has batch size 1, expected q's 2"
    yield "heads", dict(ok, v=v[:, :2]), ValueError, "v has 2 heads, expected k's 3"
    yield "groups", dict(ok, k=k[:, :2], v=v[:, :2]), ValueError, "multiple of k's and v's 2"
    yield "head_dim", dict(ok, k=k[..., :8]), ValueError, "k has head_dim"
    yield "v tokens", dict(ok, v=v[:, :, :4]), ValueError, "v has 4 tokens"
    yield "rf head_dim", dict(ok, rf=rfattn.RandomFeatures(8, 8)), ValueError, "head_dim=8"
    yield "rf type", dict(ok, rf="posrf"), TypeError, "rf must be"
    yield (
        "causal cross",
        dict(ok, k=k[:, :, :3], v=v[:, :, :3], causal=True),
        ValueError,
        "Tq == Tk",
    )
    yield "causal type", dict(ok, causal="yes"), TypeError, "causal must be a bool"
    yield "mask dtype", dict(ok, key_padding_mask=mask.float()), TypeError, "must be bool"
    yield "mask shape", dict(ok, key_padding_mask=mask[:, :4]), ValueError, "key_padding_mask must"
    yield "mask rank", dict(ok, key_padding_mask=mask[0]), ValueError, "key_padding_mask must"
    yield "scale <= 0", dict(ok, scale=0.0), ValueError, "scale must be"
    yield "scale nan", dict(ok, scale=float("nan")), ValueError, "scale must be"
    yield "scale type", dict(ok, scale="1"), TypeError, "scale must be"
    yield "backend", dict(ok, backend="cuda"), ValueError, "backend must be"
    yield "state non-causal", dict(ok, return_state=True), ValueError, "need causal=True"
    bad_state = rfattn.RFState(torch.zeros(2, 3, 8, 5), torch.zeros(2, 3, 8), torch.zeros(2, 3))
    yield (
        "state shape",
        dict(ok, causal=True, initial_state=bad_state),
        ValueError,
        "initial_state.s",
    )
    yield "state type", dict(ok, causal=True, initial_state=[1]), TypeError, "RFState"


@pytest.mark.parametrize("case", list(bad_input_cases()), ids=lambda c: c[0])
def test_bad_inputs_raise(case):
    _, kwargs, exc, match = case
    with pytest.raises(exc, match=match):
        rfattn.rf_attention(**kwargs)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_learnable_scale_gets_its_gradient(causal, kernel_device):
    """A scale tensor that requires grad (a learnable temperature) is differentiated, on both
    backends (before: silently detached): the output and the q, k, v gradients equal those of
    the same scale as a number; d scale passes gradcheck (torch path) and the fused call's
    equals it; padded junk reaches no gradient of the scale."""
    from rfattn.attention import fused_kernel_available

    rf = rfattn.RandomFeatures(16, 24, "posrf", seed=3).double().to(kernel_device)
    q, k, v = (x.to(kernel_device) for x in qkv(T=13))
    mask = torch.zeros(2, 13, dtype=torch.bool, device=kernel_device)
    mask[1, :3] = True
    k[1, :, 0], v[1, :, 1] = float("nan"), float("inf")  # junk in padded positions
    do = rand(*q.shape[:3], v.shape[-1], seed=7).to(kernel_device)
    kw = dict(causal=causal, key_padding_mask=mask, query_padding_mask=mask)
    d_scale = {}
    for backend in ["torch"] + (["triton"] if fused_kernel_available(rf, causal) else []):
        temp = torch.tensor(0.3, dtype=f64, device=kernel_device, requires_grad=True)
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = rfattn.rf_attention(*xs, rf, scale=temp, backend=backend, **kw)
        *grads, d_scale[backend] = torch.autograd.grad(out, [*xs, temp], do)
        xr = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = rfattn.rf_attention(*xr, rf, scale=0.3, backend=backend, **kw)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-14, msg=backend)
        for name, a, b in zip("qkv", grads, torch.autograd.grad(ref, xr, do), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-13, msg=(backend, name))
        assert torch.isfinite(d_scale[backend]) and d_scale[backend] != 0
    torch.testing.assert_close(d_scale.get("triton", d_scale["torch"]), d_scale["torch"],
                               rtol=1e-10, atol=0)  # fmt: skip

    def f(temp):
        return rfattn.rf_attention(q, k, v, rf, scale=temp, backend="torch", **kw)

    temp = torch.tensor(0.3, dtype=f64, device=kernel_device, requires_grad=True)
    assert torch.autograd.gradcheck(f, (temp,), fast_mode=True)


def test_learnable_scale_is_checked():
    rf = rfattn.RandomFeatures(16, 24, "posrf", seed=3).double()
    q, k, v = qkv(T=5)
    with pytest.raises(ValueError, match="scale must be a number or a one-element"):
        rfattn.rf_attention(q, k, v, rf, scale=torch.ones(2, dtype=f64, requires_grad=True))
    for bad in (-0.5, float("nan")):
        with pytest.raises(RuntimeError, match="scale must be a finite number > 0"):
            rfattn.rf_attention(q, k, v, rf, scale=torch.tensor(bad, requires_grad=True))
    # a one-element parameter of shape [1] serves too
    temp = torch.nn.Parameter(torch.full((1,), 0.25, dtype=f64))
    out = rfattn.rf_attention(q, k, v, rf, scale=temp)
    torch.testing.assert_close(out, rfattn.rf_attention(q, k, v, rf, scale=0.25))
    assert torch.autograd.grad(out.sum(), temp)[0].shape == (1,)
