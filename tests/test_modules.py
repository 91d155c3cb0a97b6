"""RandomFeatures: the pinned module API (docs/usage.md)."""

import pytest
import torch

import rfattn
from rfattn.weights import orf


def test_weight_redraw_and_determinism():
    rf = rfattn.RandomFeatures(head_dim=8, num_features=20, feature="posrf", weights="orf", seed=3)
    assert rf.weight.shape == (20, 8) and rf.weight.dtype == torch.float32
    assert rf.num_outputs == 20
    expected = orf(20, 8, generator=torch.Generator().manual_seed(3))
    assert torch.equal(rf.weight, expected)
    same = rfattn.RandomFeatures(8, 20, seed=3)
    assert torch.equal(same.weight, rf.weight)
    w0 = rf.weight.clone()
    rf.redraw()  # continues the stream: new, but reproducible from the construction seed
    w1 = rf.weight.clone()
    assert not torch.equal(w0, w1)
    same.redraw()
    assert torch.equal(same.weight, w1)
    rf.redraw(seed=3)
    assert torch.equal(rf.weight, w0)
    a, b = rfattn.RandomFeatures(8, 20, seed=None), rfattn.RandomFeatures(8, 20, seed=None)
    assert not torch.equal(a.weight, b.weight)


@pytest.mark.parametrize("feature, backend", [("oprf", "torch"), ("oprf", "triton"),
                                              ("gerf", "torch")])  # fmt: skip
def test_what_inference_mode_makes_stays_trainable(feature, backend, kernel_device):
    """Head maps, a learnt W or GERF A made under torch.inference_mode() are normal tensors: a
    later training call runs its backward and they get gradients (before: inference tensors
    for good, "Inference tensors cannot be saved for backward"). Buffers made before and
    updated in place under inference mode (running statistics in training, a redraw) stay
    normal too."""
    rf = rfattn.RandomFeatures(8, 16, feature, seed=0).to(kernel_device).train()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 11, 8, generator=g).to(kernel_device) for _ in range(3))
    with torch.inference_mode():
        rfattn.rf_attention(q, k, v, rf, causal=True, backend=backend)  # statistics move
        rf.redraw()
        rf.add_head_maps(2)
        learnt = []  # (the fused causal kernels take neither a learnt W nor a learnt A)
        if backend == "torch":
            learnt.append(rf.learn_gerf_A(2) if feature == "gerf" else rf.learn_weight())
    tensors = {**dict(rf.named_parameters()), **dict(rf.named_buffers())}
    assert not [n for n, t in tensors.items() if t.is_inference()]
    q = q.clone().requires_grad_()
    out = rfattn.rf_attention(q, k, v, rf, causal=True, backend=backend)
    out.square().sum().backward()
    for t in (q, rf.query_map, rf.key_map, *learnt):
        assert t.grad is not None and t.grad.isfinite().all() and t.grad.abs().sum() > 0


def test_state_dict_round_trip_and_to():
    rf = rfattn.RandomFeatures(8, 12, weights="gaussian", seed=1)
    other = rfattn.RandomFeatures(8, 12, weights="gaussian", seed=2)
    other.load_state_dict(rf.state_dict())
    assert torch.equal(other.weight, rf.weight)
    rf64 = rfattn.RandomFeatures(8, 12, weights="gaussian", seed=1).double()
    assert rf64.weight.dtype == torch.float64
    assert torch.equal(rf64.weight, rf.weight.double())
    rf64.redraw(seed=1)  # redraw keeps dtype
    assert rf64.weight.dtype == torch.float64


def test_features_shapes_and_dtype():
    rf = rfattn.RandomFeatures(8, 12, seed=0)
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8)
    phi_q, phi_k = rf.features(q, k)
    assert phi_q.shape == (2, 3, 5, 12) and phi_k.shape == (2, 3, 7, 12)
    assert phi_q.dtype == torch.float32
    phi_q, _ = rf.features(q.half(), k.half())
    assert phi_q.dtype == torch.float32  # features accumulate in fp32
    assert rf.estimate_kernel(q, k).shape == (2, 3, 5, 7)
    assert rf.target_kernel(q, k).shape == (2, 3, 5, 7)


def test_constructor_errors():
    with pytest.raises(ValueError, match="unknown feature"):
        rfattn.RandomFeatures(8, 8, feature="softmax")
    with pytest.raises(ValueError, match="unknown weights"):
        rfattn.RandomFeatures(8, 8, weights="uniform")
    with pytest.raises(ValueError, match="cannot use weights='rademacher'"):
        rfattn.RandomFeatures(8, 8, feature="posrf", weights="rademacher")
    with pytest.raises(ValueError, match="valid weights for it: \\['rademacher'\\]"):
        rfattn.RandomFeatures(8, 8, feature="rmf", weights="orf")
    with pytest.raises(ValueError, match="head_dim"):
        rfattn.RandomFeatures(0, 8)
    with pytest.raises(ValueError, match="num_features"):
        rfattn.RandomFeatures(8, 0)
    with pytest.raises(ValueError, match="num_features"):
        rfattn.RandomFeatures(8, 2.5)
    with pytest.raises(ValueError, match="stats"):
        rfattn.RandomFeatures(8, 8, feature="posrf", stats="global")
    with pytest.raises(TypeError, match="seed"):
        rfattn.RandomFeatures(8, 8).redraw(seed="x")


def test_method_input_errors():
    rf = rfattn.RandomFeatures(8, 8)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="head_dim=8"):
        rf.features(torch.randn(1, 2, 3, 4), q)
    with pytest.raises(ValueError, match="B, H, T, D"):
        rf.features(q[0], q)
    with pytest.raises(TypeError, match="floating"):
        rf.estimate_kernel(q.long(), q.long())
    with pytest.raises(ValueError, match="key_padding_mask"):
        rf.features(q, q, torch.zeros(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="scale"):
        rf.target_kernel(q, q, scale=-1.0)
