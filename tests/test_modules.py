"""RandomFeatures: the pinned module API (DESIGN §2)."""

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
