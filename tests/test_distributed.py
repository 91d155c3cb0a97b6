"""Context parallelism (issue 17): a sequence split over 2 and 4 gloo processes on CPU gives the
single-process outputs, final state and gradients (q, k, v, initial state) in float64; ranks whose
calls disagree all raise, none hangs (issue 34). Every spawn has a deadline: a hang fails."""

import datetime
import os
import sys
import time
from typing import NoReturn

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
    if "hybrid" in case:  # the cotangents of the final state's window keys and sink values
        window, sinks = case["hybrid"]
        x["ck"], x["cv"] = rand(B, hk, window, D, seed=9), rand(B, hk, sinks, E, seed=10)
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
    if "hybrid" in case and case.get("state"):  # window and sinks after a state, and the state
        window, sinks = case["hybrid"]
        init = _leaf_state(_hybrid_prefix(case, rf, window, sinks))
        leaves += [x for x in init if x.requires_grad]
        out, st = rfattn.rf_attention(*leaves[:3], rf, window=window, sinks=sinks,
                                      initial_state=init, return_state=True, **kw)  # fmt: skip
        loss = (out * do).sum()
        if rank == 0:  # the final state's cotangent enters once
            loss = loss + (st.s * x["cs"]).sum() + (st.z * x["cz"]).sum() + \
                (st.keys.nan_to_num() * x["ck"]).sum() + (st.sink_values * x["cv"]).sum()
    elif "hybrid" in case:  # window and sinks (no initial or returned state)
        window, sinks = case["hybrid"]
        out = rfattn.rf_attention(*leaves, rf, window=window, sinks=sinks, **kw)
        loss = (out * do).sum()
    elif not case["causal"]:
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
    if case["causal"] and ("hybrid" not in case or case.get("state")):
        res["state"] = [t.detach() for t in st]
    return res


def _hybrid_prefix(case, rf, window, sinks):
    """The hybrid state after 7 tokens before the sequence (one process, the same on every
    rank; batch 1's first token padded, so a sink is left for the sequence)."""
    hk = case.get("kv_heads", H)
    mask = torch.zeros(B, 7, dtype=torch.bool)
    mask[1, :1] = True
    return rfattn.rf_attention(rand(B, H, 7, D, seed=60), rand(B, hk, 7, D, seed=61),
                               rand(B, hk, 7, E, seed=62), rf, causal=True, window=window,
                               sinks=sinks, key_padding_mask=mask, return_state=True,
                               backend="torch")[1]  # fmt: skip


def _leaf_state(st):
    """A hybrid state whose floating tensors (but the offset) are new leaves needing grad."""
    return type(st)(*(x.detach().clone().requires_grad_(x.is_floating_point() and i != 2)
                      for i, x in enumerate(st)))  # fmt: skip


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


def _init(rank, world, init_file, seconds=60):
    """This process's gloo group: rank of world, one thread."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=seconds)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timeout)  # fmt: skip


def _finish(results, out_dir, rank) -> NoReturn:
    """Save this rank's results, wait for every rank, and end the process at once.

    Tearing gloo down in an ordinary exit (``destroy_process_group``, then the interpreter's
    finalisation of its threads and pairs) aborted one rank now and then on a loaded host
    (SIGABRT, "terminate called without an active exception", after its results were saved);
    a barrier before ``destroy_process_group`` did not stop it. ``os._exit(0)`` after the barrier
    skips every destructor: the results are on disk, the peers are past the barrier, and the
    exit closes the sockets. A rank that raised instead tears its group down in its worker's
    ``finally`` and reports the error as before."""
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn, args, world, timeout=300):
    """``mp.spawn(fn, args, world)`` with a deadline: ranks still running after ``timeout``
    seconds (a rank waiting on a collective the others never run) fail the test and are
    killed."""
    ctx = mp.spawn(fn, args=args, nprocs=world, join=False)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise AssertionError(f"{world} processes still running after {timeout} s: hung")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()


def _worker(rank, world, init_file, out_dir, cases):
    _init(rank, world, init_file, seconds=120)
    try:
        results = []
        for i, case in enumerate(cases):
            x = make_inputs(case)
            ck, cq = case_shards(case, i, world)
            results.append(run(case, x, ck[rank], cq[rank], group=dist.group.WORLD, rank=rank))
        _finish(results, out_dir, rank)
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
    # the hybrid: a shard starts from the window, sinks and state of the ranks before it (a
    # shard shorter than the window, one without a valid key, tails that span several ranks)
    "hybrid-maps-gqa": dict(feature="posrf", causal=True, kv_heads=1, maps=True, hybrid=(5, 2)),
    # the hybrid after a state (sinks left to fill), returning the state after the sequence
    "hybrid-state-gqa": dict(feature="posrf", causal=True, kv_heads=1, hybrid=(5, 3), state=True),
    "hybrid-padded-rank": dict(
        feature="trigrf", causal=True, pad=[(6, 12)], hybrid=(7, 4),
        shards={2: [slice(0, 3), slice(3, T)],
                4: [slice(0, 2), slice(2, 4), slice(4, 14), slice(14, T)]},
    ),
    # the hybrid with an empty shard (its output reads no state: tied to the gather all the
    # same, or the other ranks would wait in the backward's collective; before: a hang)
    "hybrid-state-empty-rank": dict(
        feature="posrf", causal=True, hybrid=(5, 3), state=True,
        shards={2: [slice(0, T), slice(T, T)],
                4: [slice(0, 7), slice(7, 7), slice(7, 20), slice(20, T)]},
    ),
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
    stateful = case["causal"] and ("hybrid" not in case or case.get("state"))
    names = ["q", "k", "v"]
    if stateful and "hybrid" in case:
        names += ["s", "z", "keys", "values", "sink_keys", "sink_values"]
    elif stateful:
        names += ["s0", "z0"]
    names += ["query_map", "key_map"] if case.get("maps") else []
    for i, g_full in enumerate(full["grads"]):
        if i == 0:
            got = torch.cat([p["grads"][0] for p in parts], dim=2)
        elif i < 3:
            got = torch.cat([p["grads"][i] for p in parts], dim=2)
        else:  # the initial state (and maps) are used on every rank: the gradient is the sum
            got = sum(p["grads"][i] for p in parts)
        torch.testing.assert_close(got, g_full, rtol=RTOL, atol=1e-12, msg=names[i])
    if stateful:
        for p in parts:  # every rank returns the state after the whole sequence
            for a, b in zip(p["state"], full["state"], strict=True):
                if not a.is_floating_point():
                    assert torch.equal(a, b)
                    continue
                # (junk where the window holds nothing: the same junk, compared as 0)
                torch.testing.assert_close(a.nan_to_num(), b.nan_to_num(), rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sharded_sequence_equals_one_process(world, tmp_path):
    """Every case in one spawn of ``world`` processes (4: make test-slow, to keep make test
    within its budget on 2 cores)."""
    _check_cases(CASES, world, tmp_path)


@pytest.mark.slow
def test_sharded_calls_on_the_fused_kernels(tmp_path):
    """The Triton kernels (the interpreter on CPU): causal, the chunk kernel's local pass with
    the prefix state as its initial_state; non-causal, the parallel kernel with the states
    combined between its passes (global oprf statistics, cross-attention, padding); the hybrid,
    the fused hybrid from the state of the ranks before (head maps, grouped-query heads, a
    shard shorter than the window, a rank of padding)."""
    cases = {
        "causal-posrf-triton": dict(feature="posrf", causal=True, backend="triton"),
        "noncausal-oprf-triton": dict(feature="oprf", causal=False, backend="triton"),
        "noncausal-cross-padded-triton": dict(feature="posrf", causal=False, backend="triton",
                                              tq=17, pad=[(6, 12)]),
        # the hybrid: each shard's local pass the fused hybrid from the ranks' state before it
        "hybrid-maps-gqa-triton": dict(feature="posrf", causal=True, kv_heads=1, maps=True,
                                       hybrid=(5, 2), backend="triton"),
        "hybrid-state-maps-triton": dict(feature="posrf", causal=True, maps=True, hybrid=(5, 3),
                                         state=True, backend="triton"),
        "hybrid-padded-rank-triton": dict(
            feature="posrf", causal=True, pad=[(6, 12)], hybrid=(7, 4), backend="triton",
            shards={2: [slice(0, 3), slice(3, T)]},
        ),
    }  # fmt: skip
    _check_cases(cases, 2, tmp_path)


def _check_cases(CASES, world, tmp_path):
    cases = list(CASES.values())
    _spawn(_worker, (world, str(tmp_path / "init"), str(tmp_path), cases), world, timeout=900)
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
    _init(rank, world, init_file, seconds=120)
    try:
        layer, model = _layer_and_model()
        res = _model_outputs(layer, model, shards[rank], dist.group.WORLD)
        _finish(res, out_dir, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # ~14-16 s per case (two processes)
@pytest.mark.parametrize("one_token", [False, True], ids=["uneven", "one-token shard"])
def test_layers_and_hugging_face_take_the_group(tmp_path, one_token):
    """RFAttention (``layer.group``) and a Llama (``set_context_parallel_group``, shards fed
    with their global position_ids) over 2 processes: outputs, input gradients and the layer's
    parameter gradients summed over the ranks equal one process's. A one-token shard stays
    causal (before: the Llama's rank with one token ran non-causal, and the ranks hung)."""
    world = 2
    shards = [slice(0, 1), slice(1, T)] if one_token else cuts(T, world, seed=50)
    _spawn(_model_worker, (world, str(tmp_path / "init"), str(tmp_path), shards), world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    full = _model_outputs(*_layer_and_model())
    for key, dim in (("y", 1), ("dx", 1), ("logits", 1)):
        got = torch.cat([r[key] for r in ranks], dim=dim)
        torch.testing.assert_close(got, full[key], rtol=RTOL, atol=1e-12, msg=key)
    for name, g in full["grads"].items():
        got = sum(r["grads"][name] for r in ranks)
        torch.testing.assert_close(got, g, rtol=RTOL, atol=1e-12, msg=name)


def _training_calls(rf, x, sl=slice(None), group=None, backend="torch", hybrid=False):
    """Three causal training-mode calls (running statistics moving) on the shard ``sl``: each
    call's output and the running buffers after them (``hybrid``: window 3, sinks 2, and head
    maps: the statistics are of the mapped q and k)."""
    outs = []
    kw = dict(window=3, sinks=2) if hybrid else {}
    if hybrid and rf.query_map is None:
        rf.add_head_maps(H, x["k"][0].shape[1])
        rf.double()
        with torch.no_grad():
            rf.query_map.add_(0.3 * rand(*rf.query_map.shape, seed=52))
            rf.key_map.add_(0.3 * rand(*rf.key_map.shape, seed=53))
    for i in range(3):
        q, k, v = (x[n][i][:, :, sl] for n in ("q", "k", "v"))
        outs.append(rfattn.rf_attention(q, k, v, rf, causal=True, group=group, backend=backend,
                                        key_padding_mask=x["mask"][:, sl], **kw))  # fmt: skip
    buffers = {n: b.clone() for n, b in rf.feature_map.named_buffers()}
    return dict(outs=outs, buffers=buffers)


def _training_inputs(kv_heads=H):
    shapes = (("q", H, D), ("k", kv_heads, D), ("v", kv_heads, E))
    x = {n: [rand(B, h, T, d, seed=60 + 3 * i + j) for i in range(3)]
         for j, (n, h, d) in enumerate(shapes)}  # fmt: skip
    x["mask"] = torch.zeros(B, T, dtype=torch.bool)
    x["mask"][1, :4] = True
    return x


def _training_worker(rank, world, init_file, out_dir, kv_heads, backend, hybrid):
    _init(rank, world, init_file, seconds=120)
    try:
        rf = rfattn.RandomFeatures(D, 16, "oprf", seed=0).double().train()
        res = _training_calls(rf, _training_inputs(kv_heads), cuts(T, world, seed=61)[rank],
                              dist.group.WORLD, backend, hybrid)  # fmt: skip
        _finish(res, out_dir, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kv_heads,backend,hybrid",
    [(H, "torch", False), pytest.param(1, "torch", False, marks=pytest.mark.slow),  # ~7 s each
     pytest.param(1, "triton", False, marks=pytest.mark.slow),
     pytest.param(1, "torch", True, marks=pytest.mark.slow),
     pytest.param(1, "triton", True, marks=pytest.mark.slow)],
    ids=["mha-torch", "gqa-torch", "gqa-triton", "hybrid-maps-gqa-torch",
         "hybrid-maps-gqa-triton"],
)  # fmt: skip
def test_running_statistics_move_by_the_whole_sequence(tmp_path, kv_heads, backend, hybrid):
    """Causal oprf in training mode (running statistics) over 2 processes, three calls: every
    rank's buffers are one process's, and so are the later calls' outputs (before: each rank
    moved them by its own shard's moments, and outputs drifted from the second call on; with
    grouped-query heads every sharded call raised, stacking query moments [B, H, D] with key
    moments [B, Hkv, D]). The hybrid (window, sinks, head maps) too."""
    world = 2
    _spawn(_training_worker, (world, str(tmp_path / "init"), str(tmp_path), kv_heads, backend,
                              hybrid), world)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    full = _training_calls(rfattn.RandomFeatures(D, 16, "oprf", seed=0).double().train(),
                           _training_inputs(kv_heads), backend=backend, hybrid=hybrid)  # fmt: skip
    for i, out in enumerate(full["outs"]):
        got = torch.cat([r["outs"][i] for r in ranks], dim=2)
        torch.testing.assert_close(got, out, rtol=RTOL, atol=1e-12, msg=f"call {i}")
    for r in ranks:
        for name, b in full["buffers"].items():
            torch.testing.assert_close(r["buffers"][name], b, rtol=RTOL, atol=1e-12, msg=name)


def _mha_outputs(sl=slice(None), group=None):
    """RFMultiheadAttention (causal through ``attn_mask``) on the shard ``sl``, each shard with
    its own square causal mask, float (``nn.Transformer.generate_square_subsequent_mask``) and
    bool: the outputs and the input gradient."""
    torch.manual_seed(0)
    mha = rfattn.RFMultiheadAttention(16, 2, batch_first=True, num_features=16, seed=0).double()
    mha.group = group
    x = rand(2, T, 16, seed=33)[:, sl].clone().requires_grad_()
    L = x.shape[1]
    masks = (torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=f64),
             torch.ones(L, L, dtype=torch.bool).triu(1))  # fmt: skip
    outs = [mha(x, x, x, attn_mask=m, need_weights=False)[0] for m in masks]
    sum((o * rand(2, T, 16, seed=34 + i)[:, sl]).sum() for i, o in enumerate(outs)).backward()
    dx = torch.zeros_like(x) if x.grad is None else x.grad
    return dict(outs=[o.detach() for o in outs], dx=dx)


def test_multihead_one_token_mask_in_one_process():
    """One process reads a one-token causal mask (``[[0.]]``, masking nothing) as ``is_causal``
    says, as before: non-causal by default (``add_bias_kv``'s extra key is then allowed), causal
    with ``is_causal=True`` (where the extra key is refused)."""
    mha = rfattn.RFMultiheadAttention(8, 2, num_features=8, add_bias_kv=True).double()
    x, mask = rand(1, 1, 8), torch.zeros(1, 1, dtype=f64)
    assert mha(x, x, x, attn_mask=mask)[0].shape == (1, 1, 8)
    with pytest.raises(ValueError, match="causal"):
        mha(x, x, x, attn_mask=mask, is_causal=True)


#: calls that disagree across the ranks: (what the last rank's call changes, the field the error
#: must name, how it prints the last rank's value, what every rank's call changes)
DISAGREEMENTS = {
    "causal": (dict(causal=False), "causal", "False", {}),
    "num_features": (dict(M=8), "num_features", "8", {}),
    "value-width": (dict(E=3), "value width E", "3", {}),
    "head-dim": (dict(D=4), "head dim D", "4", {}),
    "dtype": (dict(dtype=torch.float32), "dtype", "torch.float32", {}),
    "feature": (dict(feature="gerf"), "feature", "gerf", {}),
    "batch": (dict(B=1), "batch B", "1", {}),
    "empty-batch": (dict(B=0), "batch B", "0", {}),
    "query-heads": (dict(H=4), "query heads H", "4", {}),
    "kv-heads": (dict(Hkv=1), "key/value heads Hkv", "1", {}),
    "initial-state": (dict(initial_state=True), "initial_state", "True", dict(causal=True)),
    "running-stats": (dict(train=True), "statistics", "reduced", dict(feature="oprf")),
    "fused-path": (dict(backend="triton"), "non-causal fused kernel", "True", dict(causal=False)),
    "window": (dict(window=3), "window", "3", {}),
    "rejected": (dict(scale=-1.0), "rejected", "scale", {}),
}  # fmt: skip
_AGREED = dict(causal=True, M=16, feature="posrf", D=8, E=5, dtype=f64, B=2, H=2, Hkv=2, T=4,
               initial_state=False, train=False, backend="torch", scale=None,
               window=0)  # fmt: skip


def _disagreeing_call(spec, group):
    s = dict(_AGREED, **spec)
    rf = rfattn.RandomFeatures(s["D"], s["M"], s["feature"], seed=0).to(s["dtype"])
    rf.train(s["train"])
    B, H, Hkv, T_, D_, E_ = (s[n] for n in ("B", "H", "Hkv", "T", "D", "E"))
    q, k, v = (torch.randn(B, h, T_, d, dtype=s["dtype"])
               for h, d in ((H, D_), (Hkv, D_), (Hkv, E_)))  # fmt: skip
    kw = dict(causal=s["causal"], backend=s["backend"], scale=s["scale"], group=group,
              window=s["window"])  # fmt: skip
    if s["initial_state"]:
        F = rf.feature_map.width(s["M"])
        kw["initial_state"] = rfattn.RFState(torch.zeros(B, Hkv, F, E_, dtype=s["dtype"]),
                                             torch.zeros(B, Hkv, F, dtype=s["dtype"]),
                                             torch.zeros(B, Hkv, dtype=s["dtype"]))  # fmt: skip
    return rfattn.rf_attention(q, k, v, rf, **kw)


def _disagreements(rank, world) -> dict:
    """Each disagreement's error on this rank (type name and message), None where it ran."""
    errors = {}
    for name, (odd, _, _, every) in DISAGREEMENTS.items():
        spec = dict(every, **(odd if rank == world - 1 else {}))
        try:
            _disagreeing_call(spec, dist.group.WORLD)
            errors[name] = None
        except Exception as exc:
            errors[name] = (type(exc).__name__, str(exc))
    _disagreeing_call({}, dist.group.WORLD)  # the group is still in step: a call that agrees runs
    return errors


def _in_step_worker(rank, world, init_file, out_dir, shards):
    """The multi-head layer on this rank's shard (:func:`_mha_outputs`), then the calls of
    :data:`DISAGREEMENTS`."""
    _init(rank, world, init_file)
    try:
        res = dict(mha=_mha_outputs(shards[rank], dist.group.WORLD),
                   errors=_disagreements(rank, world))  # fmt: skip
        _finish(res, out_dir, rank)
    finally:
        dist.destroy_process_group()


_ONE_TOKEN_SHARDS = {2: [slice(0, 1), slice(1, T)], 3: [slice(0, 1), slice(1, 1), slice(1, T)]}


@pytest.fixture(scope="module")
def in_step(tmp_path_factory):
    """``run(world)``: every rank's results of :func:`_in_step_worker`, one spawn per world size
    for the two tests that read them (spawning dominates their time)."""
    runs = {}

    def run(world):
        if world not in runs:
            tmp = tmp_path_factory.mktemp(f"in-step-{world}")
            args = (world, str(tmp / "init"), str(tmp), _ONE_TOKEN_SHARDS[world])
            _spawn(_in_step_worker, args, world, timeout=180)
            runs[world] = [torch.load(tmp / f"rank{r}.pt") for r in range(world)]
        return runs[world]

    return run


@pytest.mark.slow  # ~10-12 s per world (processes spawned)
@pytest.mark.parametrize("world", [2, 3])
def test_multihead_one_token_shard_stays_causal(world, in_step):
    """RFMultiheadAttention with ``mha.group`` and each shard's own causal mask: the one-token
    shard's mask is ``[[0.]]`` (``[[False]]``), the empty shard's ``[0, 0]``; they mask nothing
    but are the causal mask of their length, so those ranks run causal like the others (before:
    they ran non-causal and every rank hung). Outputs and input gradients equal one
    process's."""
    ranks = [r["mha"] for r in in_step(world)]
    full = _mha_outputs()
    for i, out in enumerate(full["outs"]):
        got = torch.cat([r["outs"][i] for r in ranks], dim=1)
        torch.testing.assert_close(got, out, rtol=RTOL, atol=1e-12, msg=f"mask form {i}")
    got = torch.cat([r["dx"] for r in ranks], dim=1)
    torch.testing.assert_close(got, full["dx"], rtol=RTOL, atol=1e-12, msg="dx")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # 3: ~13 s
def test_disagreeing_ranks_all_raise(world, in_step):
    """The last rank's call differs from the others' in one field (causal, num_features, value
    width, head dim, dtype, feature, batch size, an empty batch, query heads, key/value heads,
    initial_state, running statistics in training, the non-causal fused path, or a call its own
    checks reject): every rank raises, naming the field and each rank's value, and the group
    runs the next call (before: the ranks hung, died inside gloo, or gave wrong results)."""
    ranks = [r["errors"] for r in in_step(world)]
    for name in DISAGREEMENTS:
        _, field, value, _ = DISAGREEMENTS[name]
        for r, errors in enumerate(ranks):
            assert errors[name] is not None, f"{name}: rank {r} did not raise"
            kind, msg = errors[name]
            if name == "rejected" and r == world - 1:  # its own check's error
                assert kind == "ValueError" and "scale" in msg, (name, r, msg)
                continue
            assert kind == "ValueError", (name, r, kind, msg)
            assert field in msg, (name, r, msg)
            assert f"rank {world - 1}: {value}" in msg or name == "rejected", (name, r, msg)
            assert "rank 0" in msg and f"rank {world - 1}" in msg, (name, r, msg)


# ------------------------------------------------------------------------------------------------
# packed sequences (cu_seqlens) over a process group (issue 39)

#: the packed row: sequence lengths (an empty one; sequence 2 straddles three ranks at world 3)
PACKED_LENGTHS = [5, 0, 30, 1, 9, 13]
PACKED_T = sum(PACKED_LENGTHS)
#: contiguous shards of the row: world 2 cuts sequence 2; world 3 has it begin on rank 0, fill
#: rank 1 and end on rank 2, and an empty rank
PACKED_SHARDS = {2: [slice(0, 20), slice(20, PACKED_T)],
                 3: [slice(0, 10), slice(10, 25), slice(25, PACKED_T)]}
#: pieces of a sequence that goes on past their rank shorter than another piece there (rank 0:
#: sequence 2's first 3 tokens beside sequence 0's 5; rank 1: sequence 4's first 2 beside
#: sequence 2's last 27), so the hybrid's rows place them after their padding
PACKED_SHARDS_HYBRID = [slice(0, 8), slice(8, 38), slice(38, PACKED_T)]
PACKED_SHARDS_EMPTY = [slice(0, 10), slice(10, 10), slice(10, 36), slice(36, PACKED_T)]
#: cross-attention's queries: other lengths (an empty sequence where the keys have tokens, and
#: the reverse), sharded apart from the keys
PACKED_Q_LENGTHS = [3, 2, 20, 0, 9, 4]
PACKED_TQ = sum(PACKED_Q_LENGTHS)
PACKED_Q_SHARDS = {2: [slice(0, 11), slice(11, PACKED_TQ)],
                   3: [slice(0, 4), slice(4, 4), slice(4, PACKED_TQ)]}
PACKED_CASES = {
    "posrf": dict(feature="posrf"),
    "rmf": dict(feature="rmf", opts=dict(weights="rademacher")),
    "trigrf-gqa-padded": dict(feature="trigrf", kv_heads=1, pad=(12, 17)),
    "posrf-maps-gqa": dict(feature="posrf", kv_heads=1, maps=True),
    "oprf-training": dict(feature="oprf", train=True),
    # a state before each sequence and each one's state after it (gradients of both)
    "posrf-states": dict(feature="posrf", state=True),
    "rmf-states": dict(feature="rmf", opts=dict(weights="rademacher"), state=True),
    "rmf-returns": dict(feature="rmf", opts=dict(weights="rademacher"), state="return"),
    "trigrf-gqa-padded-states": dict(feature="trigrf", kv_heads=1, pad=(12, 17), state=True),
    # non-causal: each sequence's queries read all its keys, on every rank
    "noncausal-posrf-maps": dict(feature="posrf", causal=False, maps=True),
    "noncausal-trigrf-gqa-padded": dict(feature="trigrf", causal=False, kv_heads=1,
                                        pad=(12, 17)),
    "noncausal-oprf-global": dict(feature="oprf", causal=False, train=True),  # per sequence
    "noncausal-oprf-running": dict(feature="oprf", causal=False, train=True,
                                   opts=dict(stats="running")),
    "cross-saderf": dict(feature="saderf", causal=False, cross=True),
    # exact sinks and window inside the features, each sequence its own (rfattn.hybrid)
    "posrf-hybrid": dict(feature="posrf", local=dict(window=3, sinks=2)),
    "oprf-hybrid-training-gqa-padded": dict(feature="oprf", train=True, kv_heads=1,
                                            pad=(12, 17), local=dict(window=2, sinks=1)),
    "trigrf-hybrid-maps": dict(feature="trigrf", maps=True, local=dict(window=4, sinks=3)),
    # with states: one sharded hybrid call per sequence (no row padding for a window to cross)
    "posrf-hybrid-states": dict(feature="posrf", state=True, local=dict(window=3, sinks=2)),
    "trigrf-hybrid-gqa-returns": dict(feature="trigrf", kv_heads=1, pad=(12, 17),
                                      state="return", local=dict(window=4, sinks=3)),
}  # fmt: skip


def _packed_inputs(case):
    hk, tq = case.get("kv_heads", H), PACKED_TQ if case.get("cross") else PACKED_T
    x = dict(q=rand(1, H, tq, D, seed=31), k=rand(1, hk, PACKED_T, D, seed=32),
             v=rand(1, hk, PACKED_T, E, seed=33), do=rand(1, H, tq, E, seed=34))
    x["mask"] = torch.zeros(1, PACKED_T, dtype=torch.bool)
    if "pad" in case:  # padded positions hold junk: it must reach nothing
        a, b = case["pad"]
        x["mask"][:, a:b] = True
        for n in ("q", "k", "v"):
            x[n][:, :, a:b] = float("nan")
    return x


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _packed_calls(case, sl=slice(None), group=None, backend="torch", rank=0, slq=None):
    """Outputs, gradients (q, k, v; the initial states') and the statistics' buffers of two
    packed calls (causal unless the case says not; the second after the first moved running
    statistics, in training) on shard ``sl`` of the row (``slq`` of cross-attention's
    queries); with ``state``, from a state before each sequence, returning the states after
    them (their cotangent in the loss of rank 0 only)."""
    rf = make_rf(case).double().train(case.get("train", False))
    x = _packed_inputs(case)
    slq = sl if slq is None or not case.get("cross") else slq
    leaves = [x["q"][:, :, slq].clone().requires_grad_(),
              *(x[n][:, :, sl].clone().requires_grad_() for n in ("k", "v"))]  # fmt: skip
    kw = dict(causal=case.get("causal", True), group=group, key_padding_mask=x["mask"][:, sl],
              backend=backend, **case.get("local", {}))  # fmt: skip
    if not kw["causal"] and "pad" in case:  # (causal: the keys' mask pads the queries too)
        kw.update(query_padding_mask=x["mask"][:, slq])
    if case.get("cross"):
        kw.update(cu_seqlens_q=_cu(PACKED_Q_LENGTHS), cu_seqlens_k=_cu(PACKED_LENGTHS))
    else:
        kw.update(cu_seqlens=_cu(PACKED_LENGTHS))
    if case.get("state"):
        n, hk, F = len(PACKED_LENGTHS), case.get("kv_heads", H), rf.feature_map.width(16)
        kw.update(return_state=True)
        cs, cz = rand(n, hk, F, E, seed=37), rand(n, hk, F, seed=38)
    if case.get("state") is True and "local" in case:  # a HybridState per sequence: a prefix's
        pre = _cu([3, 0, 5, 1, 2, 4])  # (sequence 1 without a token before it)
        with torch.no_grad():
            _, init = rfattn.rf_attention(*(rand(1, case.get("kv_heads", H) if n != "q" else H,
                                                 int(pre[-1]), E if n == "v" else D, seed=s)
                                            for n, s in (("q", 80), ("k", 81), ("v", 82))),
                                          rf, causal=True, cu_seqlens=pre, return_state=True,
                                          **case["local"])  # fmt: skip
        kw.update(initial_state=init)
    elif case.get("state") is True:  # (else only the states after)
        leaves += [rand(n, hk, F, E, seed=35).abs().requires_grad_(),
                   rand(n, hk, F, seed=36).abs().requires_grad_()]  # fmt: skip
        off0 = torch.full((n, hk), 0.5, dtype=f64)
        off0[2] = float("-inf")  # (no key before sequence 2: S and z must be 0 there)
        with torch.no_grad():
            leaves[3][2], leaves[4][2] = 0.0, 0.0
        kw.update(initial_state=rfattn.RFState(leaves[3], leaves[4], off0))
    outs, grads, states = [], [], []
    for _ in range(2):
        res = rfattn.rf_attention(*leaves[:3], rf, **kw)
        out = res[0] if case.get("state") else res
        loss = (out * x["do"][:, :, slq]).sum()
        if case.get("state"):
            states.append([t.detach() for t in res[1]])
            if rank == 0:
                loss = loss + (res[1].s * cs).sum() + (res[1].z * cz).sum()
        g = torch.autograd.grad(loss, leaves, allow_unused=True)
        outs.append(out.detach())
        grads.append([torch.zeros_like(t) if d is None else d
                      for t, d in zip(leaves, g, strict=True)])  # fmt: skip
    buffers = {n: b.clone() for n, b in rf.feature_map.named_buffers()}
    return dict(outs=outs, grads=grads, buffers=buffers, states=states)


def _packed_errors(world, group) -> dict:
    """Each bad packed call's error on this rank (type name and message)."""
    rank, rf = dist.get_rank(group), rfattn.RandomFeatures(D, 16, "posrf", seed=0).double()
    q, k, v = (rand(1, H, 4, d) for d in (D, D, E))
    calls = {
        "disagree": dict(cu_seqlens=torch.tensor([0, 2 + (rank == world - 1), 4 * world])),
        "total": dict(cu_seqlens=torch.tensor([0, 3, 4 * world + 1])),
        # the last rank alone returns states: its call would run two more collectives
        "return_state": dict(cu_seqlens=torch.tensor([0, 4 * world]),
                             return_state=rank == world - 1),
    }
    errors = {}
    for name, kw in calls.items():
        try:
            rfattn.rf_attention(q, k, v, rf, **dict(dict(causal=True, group=group), **kw))
            errors[name] = None
        except Exception as exc:
            errors[name] = (type(exc).__name__, str(exc))
    rfattn.rf_attention(q, k, v, rf, causal=True, group=group,
                        cu_seqlens=torch.tensor([0, 1, 4 * world]))  # still in step: it runs
    return errors


def _packed_worker(rank, world, init_file, out_dir, shards, cases, backend):
    _init(rank, world, init_file, seconds=120)
    try:
        qshards = PACKED_Q_SHARDS.get(world, [None] * world)
        res = {name: _packed_calls(PACKED_CASES[name], shards[rank], dist.group.WORLD, backend,
                                   rank, qshards[rank])
               for name in cases}  # fmt: skip
        res["errors"] = _packed_errors(world, dist.group.WORLD)
        _finish(res, out_dir, rank)
    finally:
        dist.destroy_process_group()


def _unjunked(state: list) -> list:
    """A state's fields with a HybridState's junk zeroed (window slots that hold nothing, sink
    slots past the sinks seen: never read, so any value)."""
    if len(state) != 9:
        return state
    s, z, off, keys, values, kinds, sk, sv, seen = state
    empty = (kinds == 0)[:, None, :, None]
    absent = (torch.arange(sk.shape[2]) >= seen[:, None])[:, None, :, None]
    return [s, z, off, keys.masked_fill(empty, 0), values.masked_fill(empty, 0), kinds,
            sk.masked_fill(absent, 0), sv.masked_fill(absent, 0), seen]


def _check_packed(tmp_path, shards, cases, backend="torch"):
    world = len(shards)
    _spawn(_packed_worker, (world, str(tmp_path / "init"), str(tmp_path), shards, cases,
                            backend), world)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for name in cases:
        full = _packed_calls(PACKED_CASES[name], backend=backend)
        for i in range(2):
            got = torch.cat([r[name]["outs"][i] for r in ranks], dim=2)
            torch.testing.assert_close(got, full["outs"][i], rtol=RTOL, atol=1e-12,
                                       msg=f"{name}: call {i}")  # fmt: skip
            for j, n in enumerate("qkv"):
                got = torch.cat([r[name]["grads"][i][j] for r in ranks], dim=2)
                torch.testing.assert_close(got, full["grads"][i][j], rtol=RTOL, atol=1e-12,
                                           msg=f"{name}: call {i} d{n}")  # fmt: skip
            for j, n in enumerate(("s0", "z0"), start=3):  # every rank's share, summed
                if j < len(full["grads"][i]):
                    got = sum(r[name]["grads"][i][j] for r in ranks)
                    torch.testing.assert_close(got, full["grads"][i][j], rtol=RTOL, atol=1e-12,
                                               msg=f"{name}: call {i} d{n}")  # fmt: skip
            for r, res in enumerate(ranks):  # the states after every sequence, on every rank
                for got, want in zip(_unjunked(res[name]["states"][i]) if full["states"] else (),
                                     _unjunked(full["states"][i]) if full["states"] else (),
                                     strict=True):  # fmt: skip
                    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-12,
                                               msg=f"{name}: call {i} state on rank {r}")
        for r in ranks:
            for b, value in full["buffers"].items():
                torch.testing.assert_close(r[name]["buffers"][b], value, rtol=RTOL, atol=1e-12,
                                           msg=f"{name}: {b}")  # fmt: skip
    return ranks


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_packed_row_sharded_equals_one_process(world, tmp_path):
    """A packed row (an empty sequence, one of a single token, one straddling every rank at
    world 3) split over the ranks: outputs and gradients of q, k, v equal one process's packed
    call in float64, for exponential and plain features, grouped-query heads with junk (NaN) in
    padded positions, head maps, and oprf's running statistics in training (moved once by the
    whole row, two calls), and from a state before each sequence (one of them empty) returning
    each one's state after it on every rank (gradients of the initial states: the ranks'
    shares summed). Non-causal too: head maps, grouped heads with junk, oprf's global
    statistics per sequence and its running ones moved once, cross-attention with queries
    packed and sharded apart from the keys. With exact sinks and a window (each sequence its
    own, a sequence's window and sinks reaching into earlier ranks): plain, grouped heads with
    junk and oprf's running statistics, head maps, from a HybridState per sequence and
    returning each one's. Bad packings raise on every rank, naming the cause: offsets that
    differ between ranks, offsets that do not end at the shards' total, one rank returning
    states (more collectives); the group then runs the next call."""
    ranks = _check_packed(tmp_path, PACKED_SHARDS[world], list(PACKED_CASES))
    for r, res in enumerate(ranks):
        errors = res["errors"]
        kind, msg = errors["disagree"]
        assert kind == "ValueError" and "packed offsets" in msg and f"rank {world - 1}" in msg, \
            (r, msg)  # fmt: skip
        kind, msg = errors["total"]
        assert kind == "ValueError" and "cu_seqlens must end" in msg and \
            str(4 * world) in msg, (r, msg)  # fmt: skip
        kind, msg = errors["return_state"]
        assert kind == "ValueError" and "return_state of packed sequences" in msg, (r, msg)


@pytest.mark.slow  # three processes
def test_packed_hybrid_pieces_that_go_on_end_their_rows(tmp_path):
    """Window and sinks over three ranks where a sequence's piece that goes on to the next rank
    is shorter than another piece on its rank: equal to one process (outputs, gradients,
    running statistics). Placed before its padding instead, a window would see padding
    positions inside the sequence (checked by mutation)."""
    _check_packed(tmp_path, PACKED_SHARDS_HYBRID, ["posrf-hybrid",
                                                   "oprf-hybrid-training-gqa-padded",
                                                   "posrf-hybrid-states"])


@pytest.mark.slow  # ~20 s (four processes)
def test_packed_row_with_an_empty_shard(tmp_path):
    """Four ranks, one holding no token, a sequence straddling it (states before and after
    each sequence too): equal to one process."""
    _check_packed(tmp_path, PACKED_SHARDS_EMPTY, ["posrf", "trigrf-gqa-padded-states",
                                                  "noncausal-trigrf-gqa-padded"])


@pytest.mark.slow  # the interpreter in three processes
def test_packed_row_sharded_on_the_fused_kernels(tmp_path):
    """The same on the fused kernels (the Triton interpreter), states too: equal to one
    process's."""
    _check_packed(tmp_path, PACKED_SHARDS[3], ["posrf-states", "trigrf-gqa-padded",
                                               "noncausal-posrf-maps", "cross-saderf"],
                  backend="triton")  # fmt: skip


def _packed_llama_batch():
    """A padding-free batch of four documents (flash-attention's keyword arguments), labels
    dropped."""
    transformers = pytest.importorskip("transformers")
    docs = [list(range(3, 9)), [7], list(range(1, 10)), [4, 2, 7, 5]]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs])
    batch.pop("labels")
    return batch


def _packed_llama_outputs(model, batch, sl=slice(None)):
    """Logits and parameter gradients of a training forward of the row's tokens ``sl`` (the
    whole row's offsets) and the backward of a weighted sum of their logits."""
    shard = dict(batch, input_ids=batch["input_ids"][:, sl],
                 position_ids=batch["position_ids"][:, sl])  # fmt: skip
    model.train().zero_grad()
    logits = model(**shard, use_cache=False).logits
    w = rand(*batch["input_ids"].shape, logits.shape[-1], seed=70)[:, sl]
    (logits * w).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return dict(logits=logits.detach(), grads=grads)


def _packed_llama_worker(rank, world, init_file, out_dir, shards):
    _init(rank, world, init_file, seconds=120)
    try:
        import rfattn.hf as rfhf

        _, model = _layer_and_model()
        rfhf.set_context_parallel_group(model, dist.group.WORLD)
        batch = _packed_llama_batch()
        res = _packed_llama_outputs(model, batch, shards[rank])
        errors = {}
        bad = {  # offsets that are not the mask's (on one rank's shard only); position ids alone
            "offsets": dict(batch, cu_seq_lens_q=torch.tensor([0, 6, 7, 20], dtype=torch.int32),
                            cu_seq_lens_k=torch.tensor([0, 6, 7, 20], dtype=torch.int32)),
            "position_ids": {k: batch[k] for k in ("input_ids", "position_ids")},
            "one_side": {k: v for k, v in batch.items() if k != "cu_seq_lens_k"},
        }  # fmt: skip
        plain = [slice(0, 16), slice(16, 20)]  # rank 1's shard inside one document: no restart
        for name, b in bad.items():
            try:
                _packed_llama_outputs(model, b, (plain if name == "position_ids" else shards)[rank])
                errors[name] = None
            except Exception as exc:
                errors[name] = (type(exc).__name__, str(exc))
        res["errors"] = errors
        res["after"] = _packed_llama_outputs(model, batch, shards[rank])["logits"]  # in step
        _finish(res, out_dir, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes, ~10 s
def test_a_padding_free_llama_batch_over_a_process_group(tmp_path):
    """A Llama on "rfattn" with set_context_parallel_group, fed each rank's contiguous shard of
    a padding-free row (DataCollatorWithFlattening's flash-attention offsets, the whole row's on
    every rank; a document straddling the ranks): logits equal one process's packed forward
    (which equals the documents one by one) and the parameters' gradients summed over the ranks
    equal its gradients (float64). Offsets that are not the mask of one rank's shard, a batch
    packed by position ids alone and offsets on one side raise on every rank (the rank that
    sees it its own error, the other naming it), and the group stays in step."""
    world, T = 2, 20
    shards = [slice(0, 9), slice(9, T)]  # the third document (tokens 7..15) straddles
    _spawn(_packed_llama_worker, (world, str(tmp_path / "init"), str(tmp_path), shards), world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    batch = _packed_llama_batch()
    assert batch["input_ids"].shape[1] == T
    full = _packed_llama_outputs(_layer_and_model()[1], batch)
    got = torch.cat([r["logits"] for r in ranks], dim=1)
    torch.testing.assert_close(got, full["logits"], rtol=RTOL, atol=1e-12)
    for r, sl in zip(ranks, shards, strict=True):
        torch.testing.assert_close(r["after"], got[:, sl], rtol=0, atol=0)
    for name, g in full["grads"].items():
        torch.testing.assert_close(sum(r["grads"][name] for r in ranks), g, rtol=RTOL,
                                   atol=1e-12, msg=name)  # fmt: skip
    for name in ("offsets", "position_ids", "one_side"):
        errors = [r["errors"][name] for r in ranks]
        assert all(e is not None for e in errors), (name, errors)
    assert any("not their sequences'" in e[1] for e in (r["errors"]["offsets"] for r in ranks))
    assert any("refused this call" in e[1] for e in (r["errors"]["offsets"] for r in ranks))
    # position ids alone: rank 0's shard restarts, rank 1's (one document) does not
    assert "packed sequences" in ranks[0]["errors"]["position_ids"][1]
    assert "rank(s) 0 of the process group refused" in ranks[1]["errors"]["position_ids"][1]
    assert all("go together" in r["errors"]["one_side"][1] for r in ranks)


def _windowed_model(kind):
    """The tiny Llama with exact sinks and window in its features (``hybrid``), or a Mistral
    whose own sliding window is that exact part (``mistral``), on "rfattn"."""
    transformers = pytest.importorskip("transformers")
    import rfattn.hf as rfhf

    if kind == "hybrid":
        model = _layer_and_model()[1]
        rfhf.attach_random_features(model, window=3, sinks=1)
        return model
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=3)  # fmt: skip
    model = transformers.MistralForCausalLM(cfg).double()
    rfhf.attach_random_features(model, num_features=16, seed=0)
    model.set_attn_implementation("rfattn")
    return model


def _windowed_packed_worker(rank, world, init_file, out_dir, shards, kind):
    _init(rank, world, init_file, seconds=120)
    try:
        import rfattn.hf as rfhf

        model = _windowed_model(kind)
        rfhf.set_context_parallel_group(model, dist.group.WORLD)
        _finish(_packed_llama_outputs(model, _packed_llama_batch(), shards[rank]), out_dir, rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes a case
@pytest.mark.parametrize("kind", ["hybrid", "mistral"])
def test_a_padding_free_windowed_model_over_a_process_group(kind, tmp_path):
    """Hybrid layers (attach_random_features' window and sinks, or a Mistral's own sliding
    window) train padding-free over 2 ranks, a document straddling them: logits and summed
    gradients equal one process's packed forward (float64)."""
    shards = [slice(0, 9), slice(9, 20)]
    _spawn(_windowed_packed_worker, (2, str(tmp_path / "init"), str(tmp_path), shards, kind), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    full = _packed_llama_outputs(_windowed_model(kind), _packed_llama_batch())
    torch.testing.assert_close(torch.cat([r["logits"] for r in ranks], dim=1), full["logits"],
                               rtol=RTOL, atol=1e-12)  # fmt: skip
    for name, g in full["grads"].items():
        torch.testing.assert_close(sum(r["grads"][name] for r in ranks), g, rtol=RTOL,
                                   atol=1e-12, msg=name)  # fmt: skip
