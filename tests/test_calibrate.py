"""Issue 19: rfattn.calibrate (attention transfer) and the head maps it trains; tiny models."""

from collections.abc import Mapping

import pytest
import torch

import rfattn
from rfattn.reference import linear_attention

transformers = pytest.importorskip("transformers")
rfhf = pytest.importorskip("rfattn.hf")

f64 = torch.float64
V, T = 64, 20


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def _bert(feature="posrf", seed=0, sharp=4.0, **opts):
    """A tiny BERT whose attention is sharp (query/key weights scaled), with M = 16 features."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=2,
                                  max_position_embeddings=64)  # fmt: skip
    model = transformers.BertModel(cfg).eval()
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(sharp)
            layer.attention.self.key.weight.mul_(sharp)
    rfhf.attach_random_features(model, num_features=16, feature=feature, seed=0, **opts)
    model.set_attn_implementation("rfattn")
    return model


def _batches(n=3, seed=0, junk=0):
    """Padded batches: row 1 ends in padding whose token ids depend on ``junk``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, V, (2, T), generator=g)
        mask = torch.ones(2, T, dtype=torch.long)
        mask[1, -7:] = 0
        ids[1, -7:] = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(junk))
        out.append({"input_ids": ids, "attention_mask": mask})
    return out


def _maps(model):
    return [t.detach().clone() for n, t in model.named_parameters() if n.endswith("_map")]


def test_head_maps_map_q_and_k_before_the_features():
    """rf_attention with maps = the fp64 reference on the mapped q, k (grouped heads too), at
    the identity the plain estimator; gradients reach both maps."""
    D, M = 8, 16
    rf = rfattn.RandomFeatures(D, M, seed=1, head_maps=(4, 2)).double()
    assert rf.head_maps == (4, 2) and torch.equal(rf.query_map[0], torch.eye(D, dtype=f64))
    q, k, v = _rand(2, 4, 9, D, seed=1), _rand(2, 2, 9, D, seed=2), _rand(2, 2, 9, 5, seed=3)
    plain = rfattn.RandomFeatures(D, M, seed=1).double()
    for causal in (False, True):
        same = rfattn.rf_attention(q, k, v, plain, causal=causal)
        assert torch.allclose(rfattn.rf_attention(q, k, v, rf, causal=causal), same, atol=1e-12)
    with torch.no_grad():
        rf.query_map.add_(0.3 * _rand(4, D, D, seed=4))
        rf.key_map.add_(0.3 * _rand(2, D, D, seed=5))
    for causal in (False, True):
        out = rfattn.rf_attention(q, k, v, rf, causal=causal)
        mq = q @ rf.query_map.detach().transpose(-1, -2)
        mk = (k @ rf.key_map.detach().transpose(-1, -2)).repeat_interleave(2, dim=1)
        phi_q, phi_k = plain.features(mq, mk)
        ref = linear_attention(phi_q, phi_k, v.repeat_interleave(2, dim=1), causal=causal)
        assert torch.allclose(out, ref, rtol=1e-10, atol=1e-10), causal
        out.square().sum().backward()
        assert rf.query_map.grad.abs().sum() > 0 and rf.key_map.grad.abs().sum() > 0
        rf.zero_grad()
    with pytest.raises(ValueError, match="head maps were made for 4"):
        rfattn.rf_attention(q[:, :2], k, v, rf)


def _mapped_pair(feature, D=8, M=16, heads=(4, 2), seed=1, **options):
    """(rf with random head maps, the same features without maps, a leaf copy of the maps)."""
    weights = "rademacher" if feature == "rmf" else "orf"
    opts = dict(feature=feature, seed=seed, weights=weights, **options)
    rf = rfattn.RandomFeatures(D, M, head_maps=heads, **opts).double()
    with torch.no_grad():
        rf.query_map.add_(0.3 * _rand(heads[0], D, D, seed=4))
        rf.key_map.add_(0.3 * _rand(heads[1], D, D, seed=5))
    plain = rfattn.RandomFeatures(D, M, **opts).double()
    maps = [m.detach().clone().requires_grad_() for m in (rf.query_map, rf.key_map)]
    return rf, plain, maps


# oprf's global statistics are non-causal only
_MAPPED = [(f, False) for f in ("posrf", "oprf", "trigrf", "rmf")] + [
    (f, True) for f in ("posrf", "trigrf", "rmf")
]


@pytest.mark.parametrize("feature,causal", _MAPPED)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_head_maps_inside_the_blocks_equal_mapping_first(feature, causal, kv_heads):
    """The torch path applies the maps block by block (never to the whole sequence): outputs,
    the final state and the gradients of q, k, v and both maps equal mapping q and k first;
    junk in padded keys and values reaches nothing."""
    rf, plain, maps = _mapped_pair(feature, heads=(4, kv_heads))
    B, Tn, D, E = 2, 150, 8, 5  # crosses the 64-token chunks
    q = _rand(B, 4, Tn, D, seed=1).requires_grad_()
    k = _rand(B, kv_heads, Tn, D, seed=2)
    v = _rand(B, kv_heads, Tn, E, seed=3)
    mask = torch.zeros(B, Tn, dtype=torch.bool)
    mask[1, -40:] = True
    k[1, :, -40:] = float("nan")
    v[1, :, -40:] = float("inf")
    k, v = k.requires_grad_(), v.requires_grad_()
    kw = dict(causal=causal, key_padding_mask=mask, return_state=causal, backend="torch")
    got = rfattn.rf_attention(q, k, v, rf, **kw)
    clean = k.masked_fill(mask[:, None, :, None], 0.0)  # mapped junk would poison dB here
    want = rfattn.rf_attention(q @ maps[0].transpose(-1, -2), clean @ maps[1].transpose(-1, -2),
                               v, plain, **kw)  # fmt: skip
    got, want = (got, want) if causal else ((got,), (want,))
    assert torch.allclose(got[0], want[0], rtol=1e-10, atol=1e-12)
    if causal:
        assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-12) for a, b in
                   zip(got[1], want[1], strict=True))  # fmt: skip
    cot = _rand(*got[0].shape, seed=9)
    inputs = (q, k, v)
    g_got = torch.autograd.grad(got[0], (*inputs, rf.query_map, rf.key_map), cot)
    g_want = torch.autograd.grad(want[0], (*inputs, *maps), cot)
    for name, a, b in zip(("q", "k", "v", "query_map", "key_map"), g_got, g_want, strict=True):
        assert torch.isfinite(a).all(), name
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-11), name
    assert g_got[3].abs().sum() > 0 and g_got[4].abs().sum() > 0


def test_head_maps_are_never_applied_to_the_whole_sequence_on_the_torch_path(monkeypatch):
    """Outside grouped non-causal queries and the sharded path, the torch path takes the maps
    into its blocks: the whole-sequence mapping is never called."""
    from rfattn import call

    rf, _, _ = _mapped_pair("posrf", heads=(4, 2))

    def boom(x, head_map):
        if head_map is not None:
            raise AssertionError("head map applied to the whole sequence")
        return x

    monkeypatch.setattr(call, "mapped", boom)
    q, k, v = _rand(1, 4, 70, 8, seed=1), _rand(1, 2, 70, 8, seed=2), _rand(1, 2, 70, 3, seed=3)
    rfattn.rf_attention(q, k, v, rf, causal=True, backend="torch")
    k4, v4 = k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1)
    rf4, _, _ = _mapped_pair("posrf", heads=(4, 4))
    rfattn.rf_attention(q, k4, v4, rf4, causal=False, backend="torch")


@pytest.mark.parametrize("causal", [False, True])
def test_learnable_gerf_A_per_key_value_head(causal):
    """``learn_gerf_A``: head h uses its own A (each head equals a fixed-A GERF on it alone);
    the gradient of A passes gradcheck on the torch path; without gradients the fused kernels
    take the per-head A as constants and agree; a fused call that needs A's gradient raises."""
    D, M, Hq, Hk = 8, 16, 4, 2
    rf = rfattn.RandomFeatures(D, M, feature="gerf", seed=1, A=-0.05).double()
    assert rf.learn_gerf_A(Hk) is rf.gerf_A
    assert torch.equal(rf.gerf_A, torch.full((Hk,), -0.05, dtype=f64))
    with torch.no_grad():
        rf.gerf_A.copy_(torch.tensor([-0.2, 0.05], dtype=f64))
    q, k, v = _rand(2, Hq, 11, D, seed=1), _rand(2, Hk, 11, D, seed=2), _rand(2, Hk, 11, 3, seed=3)
    out = rfattn.rf_attention(q, k, v, rf, causal=causal)
    for h, a in enumerate((-0.2, 0.05)):
        fixed = rfattn.RandomFeatures(D, M, feature="gerf", seed=1, A=a).double()
        heads = slice(2 * h, 2 * h + 2)  # the query heads of key/value head h
        ref = rfattn.rf_attention(q[:, heads], k[:, h : h + 1], v[:, h : h + 1], fixed,
                                  causal=causal)  # fmt: skip
        assert torch.allclose(out[:, heads], ref, rtol=1e-10, atol=1e-12)

    # the gradient of A against central differences (a loss with a fixed random cotangent)
    cot = _rand(*out.shape, seed=7)
    (grad,) = torch.autograd.grad((out * cot).sum(), rf.gerf_A)
    for h in range(Hk):
        losses = []
        for step in (1e-6, -2e-6, 1e-6):
            with torch.no_grad():
                rf.gerf_A[h] += step
                losses.append((rfattn.rf_attention(q, k, v, rf, causal=causal) * cot).sum())
        diff = (losses[0] - losses[1]) / 2e-6
        assert abs(grad[h] - diff) <= 1e-6 * max(1.0, abs(diff)), (h, grad[h], diff)
    assert torch.all(grad != 0)
    with torch.no_grad():
        fused = rfattn.rf_attention(q, k, v, rf, causal=causal, backend="triton")
    assert torch.allclose(fused, out, rtol=1e-10, atol=1e-12)
    with pytest.raises(NotImplementedError, match="GERF's A constant"):
        rfattn.rf_attention(q, k, v, rf, causal=causal, backend="triton")


def test_calibrating_gerf_A_lowers_the_error_and_round_trips(tmp_path):
    model = _bert(feature="gerf", A=-0.05)
    report = rfattn.calibrate(model, _batches(), steps=20, lr=0.05, params="A", progress=False)
    assert model.config.rfattn["gerf_A"] is True
    assert all(report.after[n] < report.before[n] for n in report.before), str(report)
    a = [m.attention.self.rfattn_features.gerf_A.detach().clone() for m in model.encoder.layer]
    assert all(x.shape == (2,) and not torch.equal(x, torch.full((2,), -0.05)) for x in a)
    batch = _batches(1, seed=9)[0]
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
    model.save_pretrained(tmp_path)
    loaded = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="rfattn").eval()
    got = [m.attention.self.rfattn_features.gerf_A for m in loaded.encoder.layer]
    assert all(torch.equal(x, y) for x, y in zip(a, got, strict=True))
    with torch.no_grad():
        assert torch.allclose(loaded(**batch).last_hidden_state, ref, atol=1e-5)
    with pytest.raises(ValueError, match="params='A' calibrates GERF's A"):
        rfattn.calibrate(_bert(), _batches(), steps=1, params="A", progress=False)


@pytest.mark.parametrize("causal", [pytest.param(False, marks=pytest.mark.slow), True])  # ~7 s
def test_head_maps_and_gerf_A_under_fullgraph_compile(causal):
    """A calibrated RandomFeatures (head maps, a learnt GERF A) traces in one graph: outputs and
    the gradients of q, k and both maps and A equal eager."""
    torch._dynamo.reset()
    rf, _, _ = _mapped_pair("gerf", heads=(4, 2), A=-0.05)
    rf.learn_gerf_A(2)
    q, k, v = _rand(2, 4, 70, 8, seed=1), _rand(2, 2, 70, 8, seed=2), _rand(2, 2, 70, 3, seed=3)
    q, k = q.requires_grad_(), k.requires_grad_()
    mask = torch.zeros(2, 70, dtype=torch.bool)
    mask[1, -9:] = True

    def fn(q, k, v):
        return rfattn.rf_attention(q, k, v, rf, causal=causal, key_padding_mask=mask)

    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    want = fn(q, k, v)
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12)
    wrt = (q, k, rf.query_map, rf.key_map, rf.gerf_A)
    for a, b in zip(torch.autograd.grad(got.sum(), wrt), torch.autograd.grad(want.sum(), wrt),
                    strict=True):  # fmt: skip
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-11)


def test_calibration_lowers_the_attention_error():
    model = _bert()
    report = rfattn.calibrate(model, _batches(), steps=40, lr=0.05, progress=False)
    assert set(report.before) == {f"encoder.layer.{i}.attention.self.rfattn_features"
                                  for i in range(2)}  # fmt: skip
    for name in report.before:
        assert report.after[name] < report.before[name] / 2, str(report)
    assert model.config.rfattn["head_maps"] is True
    # the model's own weights are untouched and keep their requires_grad
    ref = dict(_bert().named_parameters())
    for n, p in model.named_parameters():
        if "rfattn" not in n:
            assert torch.equal(p, ref[n]) and p.requires_grad, n


def test_calibration_is_deterministic_and_ignores_padded_positions():
    """The same seed gives the same maps; junk token ids in padded positions change nothing."""
    maps = []
    for junk in (0, 0, 1):
        model = _bert()
        rfattn.calibrate(model, _batches(junk=junk), steps=5, lr=0.05, seed=3, progress=False)
        maps.append(_maps(model))
    assert all(torch.equal(a, b) for a, b in zip(maps[0], maps[1], strict=True))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(maps[0], maps[2], strict=True))
    assert not torch.equal(maps[0][0], torch.eye(16))  # and it did train


def test_calibrated_model_saves_and_loads(tmp_path):
    model = _bert(feature="oprf")
    drawn = model.encoder.layer[0].attention.self.rfattn_features.weight.clone()
    report = rfattn.calibrate(model, _batches(), steps=10, lr=0.05,
                              params=("map", "stats", "projection"), progress=False)  # fmt: skip
    assert model.config.rfattn["stats"] == "running"
    trained = model.encoder.layer[0].attention.self.rfattn_features.weight
    assert isinstance(trained, torch.nn.Parameter) and not torch.equal(trained, drawn)
    assert all(report.after[n] < report.before[n] for n in report.before)
    batch = _batches(1, seed=9)[0]
    with torch.no_grad():
        ref = model(**batch).last_hidden_state
    model.save_pretrained(tmp_path)
    loaded = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="rfattn").eval()
    with torch.no_grad():
        out = loaded(**batch).last_hidden_state
    assert all(torch.equal(a, b) for a, b in zip(_maps(model), _maps(loaded), strict=True))
    assert torch.allclose(out, ref, atol=1e-5)
    # a plain torch round trip rebuilds the maps from the state dict
    fresh = _bert(feature="oprf", stats="running")
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.allclose(fresh(**batch).last_hidden_state, ref, atol=1e-5)


def test_calibrate_rfattn_layers():
    """rfattn's own layers: the same transfer, softmax targets from their q, k, v."""
    torch.manual_seed(0)
    layer = rfattn.RFAttention(32, 2, num_features=16, seed=0).eval()
    with torch.no_grad():
        layer.q_proj.weight.mul_(4.0)
        layer.k_proj.weight.mul_(4.0)
    xs = [torch.randn(2, T, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    report = rfattn.calibrate(layer, xs, steps=150, lr=0.05, progress=False)
    (name,) = report.before
    assert report.after[name] < report.before[name] / 2, str(report)


class _Inputs(Mapping):
    """A Mapping of keyword arguments that is no dict (as a tokenizer's BatchEncoding is not)."""

    def __init__(self, **kwargs):
        self._kwargs = kwargs

    def __getitem__(self, key):
        return self._kwargs[key]

    def __iter__(self):
        return iter(self._kwargs)

    def __len__(self):
        return len(self._kwargs)


def _padded_rows(batches):
    """The rows of ``batches`` one by one, each a dict of [T] tensors (a DataLoader's dataset)."""
    return [{k: t[i] for k, t in b.items()} for b in batches for i in range(len(b["input_ids"]))]


def test_any_mapping_of_keyword_arguments_is_a_batch():
    """A tokenizer's BatchEncoding, another Mapping, and DataLoaders yielding dicts or
    BatchEncodings (transformers' collators return one) calibrate as the same dicts do; the
    reports, maps and losses are equal. Before: BatchEncoding, a Mapping but no dict, was passed
    to the model as its input_ids (AttributeError deep inside the embeddings)."""
    from torch.utils.data import DataLoader

    def run(batches):
        model = _bert()
        rep = rfattn.calibrate(model, batches, steps=4, lr=0.05, progress=False)
        return rep, _maps(model)

    ref, ref_maps = run(_batches())
    encodings = [transformers.BatchEncoding(b) for b in _batches()]
    assert not isinstance(encodings[0], dict)
    rows = _padded_rows(_batches())

    def to_encoding(items):
        return transformers.BatchEncoding(torch.utils.data.default_collate(items))

    for batches in (encodings, [_Inputs(**b) for b in _batches()], DataLoader(rows, batch_size=2),
                    DataLoader(rows, batch_size=2, collate_fn=to_encoding)):  # fmt: skip
        rep, maps = run(batches)
        assert rep.before == ref.before and rep.after == ref.after and rep.losses == ref.losses
        assert all(torch.equal(a, b) for a, b in zip(maps, ref_maps, strict=True))
    errs = rfattn.calibration.attention_errors(_bert(), encodings)
    assert errs == rfattn.calibration.attention_errors(_bert(), _batches())
    with pytest.raises(ValueError, match="got one BatchEncoding: wrap a single batch in a list"):
        rfattn.calibrate(_bert(), encodings[0])  # before: its keys, as input_ids


def test_rfattn_layers_calibrate_from_a_data_loader():
    """rfattn's own layers from a DataLoader of a TensorDataset (batches of [x]) and of plain
    tensors: the same as the list of tensors."""
    from torch.utils.data import DataLoader, TensorDataset

    xs = torch.randn(6, T, 32, generator=torch.Generator().manual_seed(0))
    reports = []
    for batches in (list(xs.split(2)), DataLoader(TensorDataset(xs), batch_size=2),
                    DataLoader(xs, batch_size=2)):  # fmt: skip
        torch.manual_seed(0)
        layer = rfattn.RFAttention(32, 2, num_features=16, seed=0).eval()
        reports.append(rfattn.calibrate(layer, batches, steps=3, lr=0.05, progress=False))
    assert all(r.losses == reports[0].losses and r.after == reports[0].after for r in reports)


def test_bad_arguments_name_themselves():
    """Every argument of calibrate of the wrong type or value raises naming it (before:
    params=None a bare "'NoneType' object is not iterable", seed='a' an int() message,
    lr=True, seed=1.5 and progress='no' accepted)."""
    model = _bert()
    one = _batches(1)
    bad = [
        (dict(params=None), TypeError, "params must be a str or a tuple"),
        (dict(params=3), TypeError, "params must be a str or a tuple"),
        (dict(params=()), ValueError, "params must be a non-empty subset"),
        (dict(seed="a"), ValueError, "seed must be an int"),
        (dict(seed=1.5), ValueError, "seed must be an int"),
        (dict(seed=True), ValueError, "seed must be an int"),
        (dict(seed=2**64), ValueError, "seed must be an int"),
        (dict(lr=True), ValueError, "lr must be"),
        (dict(lr="0.1"), ValueError, "lr must be"),
        (dict(lr=float("inf")), ValueError, "lr must be"),
        (dict(steps="5"), ValueError, "steps must be"),
        (dict(progress="no"), TypeError, "progress must be a bool"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            rfattn.calibrate(model, one, **{"steps": 1, "progress": False, **kwargs})
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        rfattn.calibrate("bert", one)
    with pytest.raises(TypeError, match="batches must be an iterable"):
        rfattn.calibrate(model, 3)
    with pytest.raises(ValueError, match="got one str: wrap"):
        rfattn.calibrate(model, "some text")
    with pytest.raises(TypeError, match=r"batches\[1\] is str, not model inputs"):
        rfattn.calibrate(model, [one[0], "some text"])  # untokenised text
    with pytest.raises(TypeError, match=r"batches\[0\] is NoneType"):
        rfattn.calibration.attention_errors(model, [None])
    # the calls above changed nothing: the model is still plain
    assert not any(n.endswith("_map") for n, _ in model.named_parameters())
    assert rfattn.calibrate(model, one, steps=1, seed=2**63, progress=False).steps == 1


def _llama():
    """A tiny grouped-query Llama (4 query heads, 2 key/value heads), M = 16 features."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).eval()
    rfhf.attach_random_features(model, num_features=16, seed=0)
    model.set_attn_implementation("rfattn")
    return model


@pytest.mark.parametrize("arch", ["bert-right-padded", "llama-left-padded"])
def test_steps_run_on_the_rows_without_their_padding(arch, monkeypatch):
    """The steps take each batch row's valid tokens only, the rows regrouped by length into as
    many groups as batches: an epoch of steps costs the valid tokens plus the groups' own
    padding, not the batches' padded length (before: every padded position, half of
    bench.calibrate's tokens); the error after, computed on the groups, is the error on the
    batches, non-causal and causal with left padding."""
    from rfattn import calibration

    lengths = [(20, 5), (20, 6), (6, 20), (5, 20)]  # sorted: groups (5, 5) (6, 6) (20, 20) x 2
    g = torch.Generator().manual_seed(0)
    batches = []
    for row_lengths in lengths:
        mask = torch.zeros(2, T, dtype=torch.long)
        for r, n in enumerate(row_lengths):
            mask[r, :n] = 1
        if arch == "llama-left-padded":
            mask = mask.flip(-1)
        batches.append({"input_ids": torch.randint(0, V, (2, T), generator=g),
                        "attention_mask": mask})  # fmt: skip
    sizes = []
    run = calibration.rf_output

    def counting(call, rf):
        sizes.append(call.q.shape[0] * call.q.shape[2])
        return run(call, rf)

    monkeypatch.setattr(calibration, "rf_output", counting)
    model = _bert() if arch == "bert-right-padded" else _llama()
    report = rfattn.calibrate(model, batches, steps=4, lr=0.05, progress=False)
    n = 2 * len(batches)  # the report's before and after: every layer on every batch or group
    assert sum(sizes[:n]) == 2 * 8 * T
    assert sum(sizes[n:-n]) == sum(sizes[-n:]) == 2 * (10 + 12 + 40 + 40)
    after = calibration.attention_errors(model, batches)
    assert after.keys() == report.after.keys()
    for name, err in after.items():
        assert report.after[name] == pytest.approx(err, rel=1e-5), name


def test_bad_calls_raise_clear_errors():
    model = _bert()
    with pytest.raises(ValueError, match="params must be"):
        rfattn.calibrate(model, _batches(), params=("B",))
    with pytest.raises(ValueError, match="batches is empty"):
        rfattn.calibrate(model, [])
    ids = torch.randint(0, V, (2, T))
    with pytest.raises(ValueError, match="wrap a single batch in a list"):
        rfattn.calibrate(model, ids)  # before: "not enough values to unpack"
    with pytest.raises(ValueError, match="params='stats'.*'posrf'"):
        rfattn.calibrate(model, [ids], params="stats")  # before: silently nothing
    with pytest.raises(ValueError, match="fastfoodl"):
        rfattn.calibrate(model, _batches(1), steps=1, params="weights", progress=False)
    with pytest.raises(ValueError, match="no RandomFeatures"):
        rfattn.calibrate(torch.nn.Linear(2, 2), [torch.zeros(1, 2)])
    for steps in (-1, 1.5, True):
        with pytest.raises(ValueError, match="steps must be"):
            rfattn.calibrate(model, _batches(1), steps=steps)
    for lr in (0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match="lr must be"):
            rfattn.calibrate(model, _batches(1), lr=lr)
    with pytest.raises(ValueError, match="'fastfoodl' learns"):
        rfattn.RandomFeatures(8, 16, weights="fastfoodl").learn_weight()
    rf = rfattn.RandomFeatures(8, 16)
    with pytest.raises(ValueError, match="heads must be"):
        rf.add_head_maps(0)
    with pytest.raises(ValueError, match="must divide"):
        rf.add_head_maps(4, 3)
    with pytest.raises(ValueError, match="learn_gerf_A needs feature='gerf'"):
        rfattn.RandomFeatures(8, 16).learn_gerf_A(2)
    with pytest.raises(ValueError, match="learn_gerf_A needs feature='gerf'"):
        rfattn.RandomFeatures(8, 16, feature="gerf", A=0.05j).learn_gerf_A(2)
    ga = rfattn.RandomFeatures(8, 16, feature="gerf")
    with pytest.raises(ValueError, match="kv_heads must be"):
        ga.learn_gerf_A(0)
    ga.learn_gerf_A(2)
    with pytest.raises(ValueError, match="gerf_A exists with 2 heads"):
        ga.learn_gerf_A(3)
    with pytest.raises(ValueError, match="gerf_A was made for 2"):
        rfattn.rf_attention(*(torch.randn(1, 3, 4, 8) for _ in range(3)), ga)
    with pytest.raises(ValueError, match="head_maps must be"):
        rfattn.RandomFeatures(8, 16, head_maps=4)
    rf.add_head_maps(4, 2)
    with pytest.raises(ValueError, match="exists with 4 heads"):
        rf.add_head_maps(2, 2)
    model.set_attn_implementation("sdpa")
    with pytest.raises(RuntimeError, match="attn_implementation='rfattn'"):
        rfattn.calibrate(model, _batches(1), steps=1, progress=False)


def test_the_benchmark_never_calibrates_on_its_evaluation_text():
    from bench.calibrate import texts

    cal, ev = texts()
    assert len(cal) > 100 and len(ev) > 100
    assert not set(cal) & set(ev)
