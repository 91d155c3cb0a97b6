"""Issue 8: RFAttention and RFMultiheadAttention (drop-in for nn.MultiheadAttention)."""

import inspect

import pytest
import torch
from torch import nn

import rfattn
from rfattn.reference import softmax_attention

E, H, L, N = 32, 2, 20, 3


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def _mha(seed=0, **kw):
    torch.manual_seed(seed)
    return nn.MultiheadAttention(E, H, **kw)


def test_call_signature_matches_torch():
    for name in ("__init__", "forward"):
        ours = inspect.signature(getattr(rfattn.RFMultiheadAttention, name)).parameters
        theirs = inspect.signature(getattr(nn.MultiheadAttention, name)).parameters
        shared = list(theirs)
        assert list(ours)[: len(shared)] == shared, name  # same names, same order
        for p in shared:
            assert ours[p].kind == theirs[p].kind, (name, p)
            if p != "need_weights":  # documented difference: default False
                assert ours[p].default == theirs[p].default, (name, p)
    assert (
        inspect.signature(rfattn.RFMultiheadAttention.forward).parameters["need_weights"].default
        is False
    )


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_output_approaches_torch_as_m_grows(batch_first):
    mha = _mha(batch_first=batch_first)
    x = 0.7 * torch.randn(N, L, E, generator=torch.Generator().manual_seed(1))
    x = x if batch_first else x.transpose(0, 1)
    ref, _ = mha(x, x, x, need_weights=False)
    err = {}
    for m in (32, 1024):
        layer = rfattn.RFMultiheadAttention.from_torch(mha, num_features=m, seed=3)
        out, w = layer(x, x, x)
        assert w is None and out.shape == ref.shape
        err[m] = _rel(out, ref)
    assert err[1024] < 0.4 * err[32], err


def test_load_torch_state_dict_and_causal_padding_paths():
    mha = _mha(batch_first=True)
    layer = rfattn.RFMultiheadAttention(E, H, batch_first=True, num_features=2048, seed=1)
    missing, unexpected = layer.load_state_dict(mha.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("rf.") or "redraw" in k or k in layer._buffers
                                  for k in missing)  # fmt: skip
    x = 0.7 * torch.randn(N, L, E, generator=torch.Generator().manual_seed(2))
    causal = nn.Transformer.generate_square_subsequent_mask(L)
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[1, -6:] = True
    for kw in (dict(attn_mask=causal, is_causal=True), dict(key_padding_mask=kpm)):
        ref, _ = mha(x, x, x, need_weights=False, **kw)
        out, _ = layer(x, x, x, **kw)
        rows = ~kw.get("key_padding_mask", torch.zeros_like(kpm))  # padded queries: not compared
        assert _rel(out[rows], ref[rows]) < 0.25
    out_hint, _ = layer(x, x, x, is_causal=True)  # the hint alone means causal too
    out_mask, _ = layer(x, x, x, attn_mask=causal)
    torch.testing.assert_close(out_hint, out_mask)
    # float key padding (torch's canonical form) equals the bool one
    fkpm = torch.zeros(N, L).masked_fill(kpm, float("-inf"))
    torch.testing.assert_close(layer(x, x, x, key_padding_mask=fkpm)[0],
                               layer(x, x, x, key_padding_mask=kpm)[0])  # fmt: skip


def test_bias_kv_zero_attn_kdim_vdim_unbatched():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, add_bias_kv=True, add_zero_attn=True, kdim=24, vdim=16)
    layer = rfattn.RFMultiheadAttention.from_torch(mha, num_features=4096, seed=0)
    g = torch.Generator().manual_seed(4)
    q, k, v = 0.5 * torch.randn(L, E, generator=g), torch.randn(9, 24, generator=g) * 0.5, \
        torch.randn(9, 16, generator=g)  # fmt: skip
    ref, _ = mha(q, k, v, need_weights=False)
    out, _ = layer(q, k, v)
    assert out.shape == ref.shape == (L, E)
    assert _rel(out, ref) < 0.2


def test_drop_in_transformer_encoder_layer_uses_rf_attention():
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(N, L, E)
    with torch.no_grad():
        ref = enc(x)
        enc.self_attn = rfattn.RFMultiheadAttention.from_torch(enc.self_attn, num_features=8)
        out = enc(x)  # eval + no grad: torch's fused fast path must not bypass the module
        layer_only = enc.self_attn(x, x, x)[0]
    assert not torch.allclose(out, ref, atol=1e-4)  # M = 8 is visibly different...
    manual = enc.norm2(enc.norm1(x + layer_only) + enc._ff_block(enc.norm1(x + layer_only)))
    torch.testing.assert_close(out, manual)  # ...and it is our attention


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_swapped_into_a_built_encoder_with_padding():
    """nn.TransformerEncoder built around nn.MultiheadAttention decides at construction to
    hand its layers nested batches in eval mode when there is padding: the swapped-in layer
    takes them (before: a nested tensor error), giving the padded layer-by-layer result."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True)
    stack = nn.TransformerEncoder(layer, 2)
    for enc in stack.layers:
        enc.self_attn = rfattn.RFMultiheadAttention.from_torch(enc.self_attn, num_features=16)
    stack.eval()
    x = torch.randn(N, L, E)
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[1, 12:] = True
    pad[2, 5:] = True
    x[pad] = float("nan")  # junk where padded
    with torch.no_grad():
        out = stack(x, src_key_padding_mask=pad)
        ref = x
        for enc in stack.layers:  # one layer at a time: no nested batch
            ref = enc(ref, src_key_padding_mask=pad)
    torch.testing.assert_close(out[~pad], ref[~pad])
    assert (out[pad] == 0).all()  # the encoder pads its nested output with 0


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_self_attention_equals_padded(layout):
    layer = rfattn.RFMultiheadAttention(E, H, batch_first=True, num_features=16)
    lengths = (7, 3, 11)
    rows = [torch.randn(n, E) for n in lengths]
    x = torch.nested.nested_tensor(rows, layout=layout)
    padded = torch.zeros(len(rows), max(lengths), E)
    pad = torch.ones(len(rows), max(lengths), dtype=torch.bool)
    for i, r in enumerate(rows):
        padded[i, : len(r)], pad[i, : len(r)] = r, False
    for causal in (False, True):
        out, _ = layer(x, x, x, is_causal=causal)
        ref, _ = layer(padded, padded, padded, key_padding_mask=pad, is_causal=causal)
        assert out.is_nested and out.layout == layout
        for o, r, n in zip(out.unbind(), ref, lengths, strict=True):
            torch.testing.assert_close(o, r[:n])
    with pytest.raises(ValueError, match="self-attention"):
        layer(x, x.clone(), x)
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(x, x, x, key_padding_mask=pad)


def test_bad_arguments_name_the_argument():
    layer = rfattn.RFMultiheadAttention(E, H, num_features=16)
    x = torch.randn(L, N, E)
    with pytest.raises(ValueError, match="need_weights"):
        layer(x, x, x, need_weights=True)
    band = torch.ones(L, L, dtype=torch.bool).triu(3)
    with pytest.raises(ValueError, match="attn_mask"):
        layer(x, x, x, attn_mask=band)
    with pytest.raises(ValueError, match="attn_mask"):
        layer(x, x, x, attn_mask=torch.randn(L, L))  # additive bias
    with pytest.raises(ValueError, match="key_padding_mask"):
        layer(x, x, x, key_padding_mask=torch.zeros(N, L + 1, dtype=torch.bool))
    for kw, name in (
        (dict(embed_dim=30, num_heads=4), "embed_dim"),
        (dict(embed_dim=E, num_heads=0), "num_heads"),
        (dict(embed_dim=E, num_heads=H, dropout=1.5), "dropout"),
        (dict(embed_dim=E, num_heads=H, feature_redraw_interval=0), "feature_redraw_interval"),
        (dict(embed_dim=E, num_heads=H, num_features=0), "num_features"),
        (dict(embed_dim=E, num_heads=H, feature="nope"), "feature"),
    ):
        with pytest.raises(ValueError, match=name):
            rfattn.RFMultiheadAttention(**kw)
    with pytest.raises(ValueError, match="rpe"):
        rfattn.RFAttention(E, H, rpe=rfattn.FourierRPE(H + 1, 4))
    mb = rfattn.RFMultiheadAttention(E, H, add_bias_kv=True, num_features=8)
    with pytest.raises(ValueError, match="causal"):
        mb(x, x, x, is_causal=True)


def test_redraw_interval_honoured_and_fix_projection():
    layer = rfattn.RFAttention(E, H, num_features=16, seed=5, feature_redraw_interval=3)
    x = torch.randn(2, 8, E)
    draws = []
    for _ in range(7):
        layer(x)
        draws.append(layer.rf.weight.clone())
    changed = [not torch.equal(a, b) for a, b in zip(draws[:-1], draws[1:], strict=True)]
    assert changed == [False, False, True, False, False, True]  # redraw on calls 4 and 7
    layer.eval()
    w = layer.rf.weight.clone()
    for _ in range(5):
        layer(x)
    assert torch.equal(w, layer.rf.weight)  # eval never redraws
    layer.train()
    layer.fix_projection()
    for _ in range(5):
        layer(x)
    assert torch.equal(w, layer.rf.weight)
    # same seed, same schedule: deterministic
    twin = rfattn.RFAttention(E, H, num_features=16, seed=5, feature_redraw_interval=3)
    for _ in range(7):
        twin(x)
    assert torch.equal(twin.rf.weight, draws[-1])
    assert rfattn.layer_seed(0, 1) != rfattn.layer_seed(0, 2) == rfattn.layer_seed(0, 2)


def test_state_dict_round_trip_exact_and_continues_identically():
    kw = dict(num_features=16, feature="oprf", stats="running", feature_redraw_interval=2)
    a = rfattn.RFAttention(E, H, seed=1, causal=True, **kw)
    x = torch.randn(2, 8, E)
    for _ in range(3):
        a(x)
    b = rfattn.RFAttention(E, H, seed=99, causal=True, **kw)
    b.load_state_dict(a.state_dict())
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    a.eval(), b.eval()
    assert torch.equal(a(x), b(x))
    a.train(), b.train()
    for _ in range(3):  # the redraw schedule and seeds continue from the loaded counters
        assert torch.equal(a(x), b(x))


def test_rfattention_cross_causal_dtype_device_and_softmax_limit():
    torch.manual_seed(0)
    layer = rfattn.RFAttention(E, H, num_features=4096, seed=0, kdim=24, vdim=16)
    g = torch.Generator().manual_seed(0)
    q, k, v = 0.5 * torch.randn(2, 7, E, generator=g), 0.5 * torch.randn(2, 11, 24, generator=g), \
        torch.randn(2, 11, 16, generator=g)  # fmt: skip
    out = layer(q, k, v)
    qh = layer._heads(layer.q_proj(q))
    kh, vh = layer._heads(layer.k_proj(k)), layer._heads(layer.v_proj(v))
    ref = softmax_attention(qh, kh, vh).transpose(1, 2).reshape(2, 7, E)
    assert _rel(out, layer.out_proj(ref)) < 0.1
    layer64 = layer.to(torch.float64)
    assert layer64.rf.weight.dtype == torch.float64
    assert layer64(q.double(), k.double(), v.double()).dtype == torch.float64
    # causal: a change in the future leaves the past alone
    c = rfattn.RFAttention(E, H, num_features=32, causal=True)
    x = torch.randn(1, 12, E)
    y = x.clone()
    y[:, 8:] += 1.0
    torch.testing.assert_close(c(x)[:, :8], c(y)[:, :8], rtol=0, atol=1e-6)
    st = c(x[:, :5], return_state=True)[1]  # split/resume through the layer
    torch.testing.assert_close(c(x[:, 5:], initial_state=st, return_state=True)[0], c(x)[:, 5:])


def test_dropout_only_in_training():
    layer = rfattn.RFAttention(E, H, num_features=16, dropout=0.5)
    x = torch.randn(2, 6, E)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def test_layer_decodes_token_by_token_on_its_state():
    """Issue 16: prefill then one token at a time through RFAttention equals one call on the whole
    sequence; after a redraw the old state is refused."""
    E, H = 16, 4
    layer = rfattn.RFAttention(E, H, num_features=32, causal=True, seed=3).double().eval()
    x = torch.randn(2, 11, E, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    full = layer(x)
    out, state = layer(x[:, :4], return_state=True)
    outs = [out]
    for t in range(4, 11):
        y, state = layer(x[:, t : t + 1], initial_state=state, return_state=True)
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-12, atol=1e-12)
    layer.redraw_features()
    with pytest.raises(ValueError, match="another RandomFeatures"):
        layer(x[:, :1], initial_state=state)


def test_encoder_layer_compiles_whole_with_a_padding_mask():
    """nn.TransformerEncoderLayer hands its padding mask on as an additive float mask, whose
    values the layer checks: under torch.compile(fullgraph=True) the check runs in the graph
    (before: a data-dependent branch, no full graph), a bad mask still raising."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoderLayer(E, H, 64, dropout=0.0, batch_first=True)
    enc.self_attn = rfattn.RFMultiheadAttention.from_torch(enc.self_attn, num_features=8)
    x = torch.randn(N, L, E)
    pad = torch.zeros(N, L, dtype=torch.bool)
    pad[1, 14:] = True
    ref = enc(x, src_key_padding_mask=pad)
    torch._dynamo.reset()
    compiled = torch.compile(enc, fullgraph=True, backend="aot_eager")
    out = compiled(x, src_key_padding_mask=pad)
    torch.testing.assert_close(out[~pad], ref[~pad])
    layer = torch.compile(enc.self_attn, fullgraph=True, backend="aot_eager")
    bias = torch.zeros(N, L)
    bias[0, 3] = 0.5  # an additive bias, not padding
    with pytest.raises(RuntimeError, match="only 0 and -inf"):
        layer(x, x, x, key_padding_mask=bias)
