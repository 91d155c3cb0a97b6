"""Context parallelism (issue 17): a sequence split over 2 and 4 gloo processes on CPU gives the
single-process outputs, final state and gradients (q, k, v, initial state) in float64."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rfattn

f64 = torch.float64
B, H, D, E, T = 2, 2, 8, 5, 23
RTOL = 1e-10


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def make_rf(case):
    rf = rfattn.RandomFeatures(D, 16, case["feature"], seed=0, **case.get("opts", {}))
    if case.get("maps"):  # calibrated head maps (not the identity), float64 like the inputs
        rf.add_head_maps(H, case.get("kv_heads", H))
        rf.double()
        with torch.no_grad():
            rf.query_map.add_(0.3 * rand(*rf.query_map.shape, seed=50))
            rf.key_map.add_(0.3 * rand(*rf.key_map.shape, seed=51))
    if case.get("warm_stats"):  # running statistics from one training call, then fixed
        rf.train()
        rfattn.rf_attention(rand(B, H, 9, D, seed=40), rand(B, H, 9, D, seed=41),
                            rand(B, H, 9, E, seed=42), rf, causal=True)  # fmt: skip
    return rf.eval()


def make_inputs(case):
    """Full-sequence inputs and cotangents (the same on every process)."""
    tq = case.get("tq", T)
    hk = case.get("kv_heads", H)
    x = dict(q=rand(B, H, tq, D, seed=1), k=rand(B, hk, T, D, seed=2), v=rand(B, hk, T, E, seed=3))
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[1, :3] = True  # left padding
    for a, b in case.get("pad", ()):  # whole stretches of padding (a rank with only padding)
        mask[:, a:b] = True
    x["mask"] = mask
    x["do"] = rand(B, H, tq, E, seed=4)
    if case["causal"]:
        F = make_rf(case).feature_map.width(16)
        x["s0"], x["z0"] = rand(B, hk, F, E, seed=5).abs(), rand(B, hk, F, seed=6).abs()
        x["off0"] = torch.full((B, hk), 0.5, dtype=f64)
        x["cs"], x["cz"] = rand(B, hk, F, E, seed=7), rand(B, hk, F, seed=8)
    return x


def run(case, x, cut_k=None, cut_q=None, group=None, rank=0):
    """Outputs and gradients of the loss sum(out * do) (+ a final-state term on rank 0)."""
    rf = make_rf(case)
    q, k, v, mask, do = x["q"], x["k"], x["v"], x["mask"], x["do"]
    if cut_k is not None:
        k, v, mask = k[:, :, cut_k], v[:, :, cut_k], mask[:, cut_k]
        q, do = q[:, :, cut_q], do[:, :, cut_q]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(causal=case["causal"], key_padding_mask=mask, backend=case.get("backend", "torch"),
              group=group)  # fmt: skip
    if not case["causal"]:
        out = rfattn.rf_attention(*leaves, rf, **kw)
        loss = (out * do).sum()
    else:
        init = [x["s0"].clone().requires_grad_(), x["z0"].clone().requires_grad_(), x["off0"]]
        leaves += init[:2]
        out, st = rfattn.rf_attention(*leaves[:3], rf, initial_state=rfattn.RFState(*init),
                                      return_state=True, **kw)  # fmt: skip
        loss = (out * do).sum()
        if rank == 0:  # the final state's cotangent enters once
            loss = loss + (st.s * x["cs"]).sum() + (st.z * x["cz"]).sum()
    leaves += [rf.query_map, rf.key_map] if rf.head_maps else []  # summed over ranks, as s0
    # a rank's empty shard takes no part in the graph: its gradients are 0
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [
        torch.zeros_like(t) if g is None else g.detach() for t, g in zip(leaves, grads, strict=True)
    ]
    res = dict(out=out.detach(), grads=grads)
    if case["causal"]:
        res["state"] = [t.detach() for t in st]
    return res


def cuts(n, world, seed):
    """Uneven contiguous shards of n positions (one may be empty)."""
    g = torch.Generator().manual_seed(seed)
    inner = sorted(torch.randint(0, n + 1, (world - 1,), generator=g).tolist())
    bounds = [0, *inner, n]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def case_shards(case, i, world):
    """(key shards, query shards) of case number i: its own, or uneven random ones (queries cut
    apart from keys in cross-attention)."""
    if "shards" in case:
        return case["shards"][world], case["shards"][world]
    ck = cuts(T, world, seed=i)
    return ck, ck if "tq" not in case else cuts(case["tq"], world, seed=100 + i)


def _worker(rank, world, init_file, out_dir, cases):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        results = []
        for i, case in enumerate(cases):
            x = make_inputs(case)
            ck, cq = case_shards(case, i, world)
            results.append(run(case, x, ck[rank], cq[rank], group=dist.group.WORLD, rank=rank))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


CASES = {
    "causal-posrf": dict(feature="posrf", causal=True),
    "causal-rmf": dict(feature="rmf", causal=True, opts=dict(weights="rademacher")),
    "causal-oprf-running": dict(feature="oprf", causal=True, warm_stats=True),
    "causal-gqa-trigrf": dict(feature="trigrf", causal=True, kv_heads=1),
    "causal-padded-rank": dict(
        feature="posrf", causal=True, pad=[(6, 12)],
        shards={2: [slice(0, 12), slice(12, T)],
                4: [slice(0, 6), slice(6, 12), slice(12, 20), slice(20, T)]},
    ),
    "causal-maps-gqa": dict(feature="posrf", causal=True, kv_heads=1, maps=True),
    "noncausal-maps": dict(feature="posrf", causal=False, maps=True),
    "noncausal-oprf-global": dict(feature="oprf", causal=False),
    "noncausal-saderf-cross": dict(feature="saderf", causal=False, tq=17),
    "noncausal-padded-rank": dict(
        feature="posrf", causal=False, pad=[(6, 12)],
        shards={2: [slice(0, 12), slice(12, T)],
                4: [slice(0, 6), slice(6, 12), slice(12, 20), slice(20, T)]},
    ),
}  # fmt: skip


def _compare(case, full, parts, world):
    tq = case.get("tq", T)
    sq = [p["_cut_q"] for p in parts]
    out = torch.zeros_like(full["out"])
    for s, p in zip(sq, parts, strict=True):
        out[:, :, s] = p["out"]
    torch.testing.assert_close(out, full["out"], rtol=RTOL, atol=1e-12)
    assert sum(s.stop - s.start for s in sq) == tq
    names = ["q", "k", "v"] + (["s0", "z0"] if case["causal"] else [])
    names += ["query_map", "key_map"] if case.get("maps") else []
    for i, g_full in enumerate(full["grads"]):
        if i == 0:
            got = torch.cat([p["grads"][0] for p in parts], dim=2)
        elif i < 3:
            got = torch.cat([p["grads"][i] for p in parts], dim=2)
        else:  # the initial state (and maps) are used on every rank: the gradient is the sum
            got = sum(p["grads"][i] for p in parts)
        torch.testing.assert_close(got, g_full, rtol=RTOL, atol=1e-12, msg=names[i])
    if case["causal"]:
        for p in parts:  # every rank returns the state after the whole sequence
            for a, b in zip(p["state"], full["state"], strict=True):
                torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_sequence_equals_one_process(world, tmp_path):
    """Every case in one spawn of ``world`` processes (4: make test-slow, to keep make test
    within its budget on 2 cores)."""
    _check_cases(CASES, world, tmp_path)


@pytest.mark.slow
def test_sharded_calls_on_the_fused_kernels(tmp_path):
    """The Triton kernels (the interpreter on CPU): causal, the chunk kernel's local pass with
    the prefix state as its initial_state; non-causal, the parallel kernel with the states
    combined between its passes (global oprf statistics, cross-attention, padding)."""
    cases = {
        "causal-posrf-triton": dict(feature="posrf", causal=True, backend="triton"),
        "noncausal-oprf-triton": dict(feature="oprf", causal=False, backend="triton"),
        "noncausal-cross-padded-triton": dict(feature="posrf", causal=False, backend="triton",
                                              tq=17, pad=[(6, 12)]),
    }  # fmt: skip
    _check_cases(cases, 2, tmp_path)


def _check_cases(CASES, world, tmp_path):
    cases = list(CASES.values())
    mp.spawn(_worker, args=(world, str(tmp_path / "init"), str(tmp_path), cases), nprocs=world,
             join=True)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for i, (name, case) in enumerate(CASES.items()):
        x = make_inputs(case)
        full = run(case, x)
        _, cq = case_shards(case, i, world)
        parts = [dict(ranks[r][i], _cut_q=cq[r]) for r in range(world)]
        try:
            _compare(case, full, parts, world)
        except AssertionError as exc:
            raise AssertionError(f"{name}, {world} processes: {exc}") from exc


def test_group_is_checked():
    rf = rfattn.RandomFeatures(D, 16, seed=0)
    q = rand(1, 1, 4, D)
    with pytest.raises((RuntimeError, TypeError), match="group"):
        rfattn.rf_attention(q, q, q[..., :E], rf, group="world")


def _layer_and_model(seed=0):
    torch.manual_seed(seed)
    layer = rfattn.RFAttention(16, 2, num_features=16, causal=True, seed=seed).double()
    transformers = pytest.importorskip("transformers")
    import rfattn.hf as rfhf

    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg).double().eval()
    rfhf.attach_random_features(model, num_features=16, seed=0)
    model.set_attn_implementation("rfattn")
    return layer, model


def _model_outputs(layer, model, sl=slice(None), group=None):
    x = rand(2, T, 16, seed=30)[:, sl].clone().requires_grad_()
    layer.group = group
    y = layer(x)
    (y * rand(2, T, 16, seed=31)[:, sl]).sum().backward()
    ids = torch.randint(0, 40, (1, T), generator=torch.Generator().manual_seed(32))
    pos = torch.arange(T)[None, sl]
    import rfattn.hf as rfhf

    rfhf.set_context_parallel_group(model, group)
    with torch.no_grad():
        logits = model(input_ids=ids[:, sl], position_ids=pos).logits
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return dict(y=y.detach(), dx=x.grad, grads=grads, logits=logits)


def _model_worker(rank, world, init_file, out_dir, shards):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        layer, model = _layer_and_model()
        res = _model_outputs(layer, model, shards[rank], dist.group.WORLD)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("one_token", [False, True], ids=["uneven", "one-token shard"])
def test_layers_and_hugging_face_take_the_group(tmp_path, one_token):
    """RFAttention (``layer.group``) and a Llama (``set_context_parallel_group``, shards fed
    with their global position_ids) over 2 processes: outputs, input gradients and the layer's
    parameter gradients summed over the ranks equal one process's. A one-token shard stays
    causal (before: the Llama's rank with one token ran non-causal, and the ranks hung)."""
    world = 2
    shards = [slice(0, 1), slice(1, T)] if one_token else cuts(T, world, seed=50)
    mp.spawn(_model_worker, args=(world, str(tmp_path / "init"), str(tmp_path), shards),
             nprocs=world, join=True)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    full = _model_outputs(*_layer_and_model())
    for key, dim in (("y", 1), ("dx", 1), ("logits", 1)):
        got = torch.cat([r[key] for r in ranks], dim=dim)
        torch.testing.assert_close(got, full[key], rtol=RTOL, atol=1e-12, msg=key)
    for name, g in full["grads"].items():
        got = sum(r["grads"][name] for r in ranks)
        torch.testing.assert_close(got, g, rtol=RTOL, atol=1e-12, msg=name)


def _training_calls(rf, x, sl=slice(None), group=None, backend="torch"):
    """Three causal training-mode calls (running statistics moving) on the shard ``sl``: each
    call's output and the running buffers after them."""
    outs = []
    for i in range(3):
        q, k, v = (x[n][i][:, :, sl] for n in ("q", "k", "v"))
        outs.append(rfattn.rf_attention(q, k, v, rf, causal=True, group=group, backend=backend,
                                        key_padding_mask=x["mask"][:, sl]))  # fmt: skip
    buffers = {n: b.clone() for n, b in rf.feature_map.named_buffers()}
    return dict(outs=outs, buffers=buffers)


def _training_inputs(kv_heads=H):
    shapes = (("q", H, D), ("k", kv_heads, D), ("v", kv_heads, E))
    x = {n: [rand(B, h, T, d, seed=60 + 3 * i + j) for i in range(3)]
         for j, (n, h, d) in enumerate(shapes)}  # fmt: skip
    x["mask"] = torch.zeros(B, T, dtype=torch.bool)
    x["mask"][1, :4] = True
    return x


def _training_worker(rank, world, init_file, out_dir, kv_heads, backend):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))  # fmt: skip
    try:
        rf = rfattn.RandomFeatures(D, 16, "oprf", seed=0).double().train()
        res = _training_calls(rf, _training_inputs(kv_heads), cuts(T, world, seed=61)[rank],
                              dist.group.WORLD, backend)  # fmt: skip
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kv_heads,backend",
    [(H, "torch"), (1, "torch"), pytest.param(1, "triton", marks=pytest.mark.slow)],
    ids=["mha-torch", "gqa-torch", "gqa-triton"],
)
def test_running_statistics_move_by_the_whole_sequence(tmp_path, kv_heads, backend):
    """Causal oprf in training mode (running statistics) over 2 processes, three calls: every
    rank's buffers are one process's, and so are the later calls' outputs (before: each rank
    moved them by its own shard's moments, and outputs drifted from the second call on; with
    grouped-query heads every sharded call raised, stacking query moments [B, H, D] with key
    moments [B, Hkv, D])."""
    world = 2
    mp.spawn(_training_worker,
             args=(world, str(tmp_path / "init"), str(tmp_path), kv_heads, backend),
             nprocs=world, join=True)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    full = _training_calls(rfattn.RandomFeatures(D, 16, "oprf", seed=0).double().train(),
                           _training_inputs(kv_heads))  # fmt: skip
    for i, out in enumerate(full["outs"]):
        got = torch.cat([r["outs"][i] for r in ranks], dim=2)
        torch.testing.assert_close(got, out, rtol=RTOL, atol=1e-12, msg=f"call {i}")
    for r in ranks:
        for name, b in full["buffers"].items():
            torch.testing.assert_close(r["buffers"][name], b, rtol=RTOL, atol=1e-12, msg=name)
