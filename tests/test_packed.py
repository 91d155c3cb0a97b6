"""Packed variable-length sequences (``cu_seqlens``): one row of N concatenated sequences equals N
separate calls in float64 (outputs, gradients, states), on the torch path and the fused backend
(the Triton kernels under the interpreter on CPU); junk in one sequence reaches no other; each
bad offset tensor raises naming it."""

import copy

import pytest
import torch

import rfattn

f64 = torch.float64
HQ, HK, D, E, M = 4, 2, 4, 3, 8
#: an empty sequence, one token, a few awkward lengths, and lengths close enough to be batched
#: (rfattn.attention.buckets: 5, 5, 6 and 16, 17, 18 run as two batches of three)
LENGTHS = (0, 1, 5, 17, 33, 6, 16, 5, 18)
CAUSAL = [pytest.param(c, id="causal" if c else "noncausal") for c in (False, True)]


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=f64)


def offsets(lengths, dtype=torch.int32):
    return torch.tensor([0, *lengths], dtype=dtype).cumsum(0).to(dtype)


def leaves(lengths, heads=HQ, kv_heads=HK, seed=0, kv_lengths=None):
    """q ``[1, heads, total, D]``, k, v ``[1, kv_heads, total_k, .]`` requiring grad."""
    T, Tk = sum(lengths), sum(lengths if kv_lengths is None else kv_lengths)
    q = rand(1, heads, T, D, seed=seed + 1).requires_grad_()
    k = rand(1, kv_heads, Tk, D, seed=seed + 2).requires_grad_()
    v = rand(1, kv_heads, Tk, E, seed=seed + 3).requires_grad_()
    return q, k, v


def states(n, rf, kv_heads=HK, seed=5):
    """N initial states ``[N, kv_heads, ...]`` requiring grad (offsets finite)."""
    F = rf.feature_map.width(M)
    s = rand(n, kv_heads, F, E, seed=seed).requires_grad_()
    z = rand(n, kv_heads, F, seed=seed + 1).abs().requires_grad_()
    return rfattn.RFState(s, z, rand(n, kv_heads, seed=seed + 2))


def grads(y, xs, seed=9):
    """Gradients of a fixed random projection of ``y`` (a tensor or (out, state)) w.r.t. xs."""
    ys = [y] if torch.is_tensor(y) else [y[0], y[1].s, y[1].z]
    loss = sum((t * rand(*t.shape, seed=seed + i).to(t.device)).sum() for i, t in enumerate(ys))
    return torch.autograd.grad(loss, xs, allow_unused=True)


def separate(q, k, v, rf, oq, ok, causal, state=None, **kw):
    """The existing path, one call per sequence: outputs joined along T, states along B."""
    outs, finals = [], []
    for i in range(len(oq) - 1):
        qs, ks = slice(oq[i], oq[i + 1]), slice(ok[i], ok[i + 1])
        st = None if state is None else rfattn.RFState(*(x[i : i + 1] for x in state))
        r = rfattn.rf_attention(q[:, :, qs], k[:, :, ks], v[:, :, ks], rf, causal=causal,
                                initial_state=st, return_state=causal, **kw)  # fmt: skip
        outs.append(r[0] if causal else r)
        if causal:
            finals.append(r[1])
    out = torch.cat(outs, dim=2)
    if not causal:
        return out
    return out, rfattn.RFState(*(torch.cat(x, dim=0) for x in zip(*finals, strict=True)))


def assert_same(packed, sep, xs, name=""):
    """Outputs, states and the gradients of ``xs`` equal (float64, to rounding)."""
    tol = 1e-12
    pout, sout = (packed, sep) if torch.is_tensor(packed) else (packed[0], sep[0])
    assert pout.shape == sout.shape
    torch.testing.assert_close(pout, sout, rtol=tol, atol=tol, msg=f"{name} output")
    if not torch.is_tensor(packed):
        for field, a, b in zip(("s", "z", "offset"), packed[1], sep[1], strict=True):
            assert a.shape == b.shape, field
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{name} state.{field}")
    for i, (a, b) in enumerate(zip(grads(packed, xs), grads(sep, xs), strict=True)):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{name} grad {i}")


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("kv_heads", [HQ, HK], ids=["mha", "gqa"])
@pytest.mark.parametrize("feature", ["posrf", "trigrf", "oprf"])
def test_packed_equals_separate_calls_torch(feature, kv_heads, causal):
    """Torch path: outputs, gradients (q, k, v) and returned states equal N separate calls, with
    MHA and grouped heads; oprf non-causal takes global statistics per sequence and head (the
    default), causal its running ones (eval mode)."""
    rf = rfattn.RandomFeatures(D, M, feature, seed=0).double().eval()
    q, k, v = leaves(LENGTHS, kv_heads=kv_heads)
    cu = offsets(LENGTHS)
    kw = dict(backend="torch")
    packed = rfattn.rf_attention(q, k, v, rf, causal=causal, return_state=causal,
                                 cu_seqlens=cu, **kw)  # fmt: skip
    sep = separate(q, k, v, rf, cu.tolist(), cu.tolist(), causal, **kw)
    assert_same(packed, sep, (q, k, v), feature)


@pytest.mark.parametrize("kv_heads", [HQ, HK], ids=["mha", "gqa"])
def test_packed_initial_states_torch(kv_heads):
    """Causal, torch path: one initial state per sequence (``[N, Hkv, F, E]``): the outputs,
    returned states and gradients (q, k, v and the given states) equal separate calls; an empty
    sequence returns its state unchanged."""
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double().eval()
    q, k, v = leaves(LENGTHS, kv_heads=kv_heads)
    cu = offsets(LENGTHS, torch.int64)
    st = states(len(LENGTHS), rf, kv_heads)
    packed = rfattn.rf_attention(q, k, v, rf, causal=True, initial_state=st, return_state=True,
                                 cu_seqlens=cu, backend="torch")  # fmt: skip
    sep = separate(q, k, v, rf, cu.tolist(), cu.tolist(), True, st, backend="torch")
    assert_same(packed, sep, (q, k, v, st.s, st.z))
    assert torch.equal(packed[1].s[0], st.s[0]) and torch.equal(packed[1].offset[0], st.offset[0])


def test_buckets_bound_the_padding():
    """Every sequence in exactly one batch; a batch of more than one pads at most a quarter of
    its tokens (queries and keys), shortest first; a long sequence runs alone."""
    from rfattn.attention import PACKED_ALONE, PACKED_PADDING, buckets

    g = torch.Generator().manual_seed(0)
    lengths = [(int(a), int(b)) for a, b in torch.randint(1, 300, (200, 2), generator=g)]
    lengths += [(PACKED_ALONE, PACKED_ALONE), (PACKED_ALONE + 7, 5), (3, PACKED_ALONE)]
    groups = buckets(lengths)
    assert sorted(i for grp in groups for i in grp) == list(range(203))
    assert [200] in groups and [201] in groups and [202] in groups  # long ones alone
    assert sum(len(grp) > 1 for grp in groups) >= 10  # it batches at all
    for grp in groups:
        tokens = sum(sum(lengths[i]) for i in grp)
        padded = len(grp) * (max(lengths[i][0] for i in grp) + max(lengths[i][1] for i in grp))
        assert len(grp) == 1 or padded <= (1 + PACKED_PADDING) * tokens


@pytest.mark.parametrize("causal", CAUSAL)
def test_many_short_sequences_run_as_few_calls(causal, monkeypatch):
    """64 documents of 7-9 tokens: two calls in all (one per batch), outputs, states and
    gradients equal to 64 separate calls (float64)."""
    from rfattn import attention

    ran = []
    real = attention.run
    monkeypatch.setattr(attention, "run", lambda call: ran.append(call) or real(call))
    rf = rfattn.RandomFeatures(D, M, "oprf", seed=0).double().eval()
    lengths = [7 + i % 3 for i in range(64)]
    q, k, v = leaves(lengths, kv_heads=HK)
    cu = offsets(lengths)
    packed = rfattn.rf_attention(q, k, v, rf, causal=causal, return_state=causal, cu_seqlens=cu,
                                 backend="torch")  # fmt: skip
    batches = [c for c in ran if c.packed is None]  # (the packed call itself enters run too)
    assert len(batches) <= 2 and sum(c.q.shape[0] for c in batches) == 64
    sep = separate(q, k, v, rf, cu.tolist(), cu.tolist(), causal, backend="torch")
    assert_same(packed, sep, (q, k, v))


def test_packed_head_maps_and_masks_torch():
    """Head maps (their gradients too) and ``[1, total]`` masks sliced per sequence, non-causal
    cross-attention with ``cu_seqlens_q`` / ``cu_seqlens_k`` (a sequence with queries and no keys
    gets output 0, one with keys and no queries nothing), equal to separate calls."""
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0, head_maps=(HQ, HK)).double()
    with torch.no_grad():
        rf.query_map.add_(0.1 * rand(*rf.query_map.shape, seed=11))
    lq, lk = (3, 0, 4, 9, 5), (5, 2, 0, 7, 6)  # the first and the last batched
    q, k, v = leaves(lq, kv_lengths=lk)
    cq, ck = offsets(lq), offsets(lk)
    kpm = torch.zeros(1, sum(lk), dtype=torch.bool)
    kpm[0, [1, 12, 16]] = True
    qpm = torch.zeros(1, sum(lq), dtype=torch.bool)
    qpm[0, [8, 17]] = True
    outs = []
    for packed in (True, False):
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck) if packed else {}
        if packed:
            out = rfattn.rf_attention(q, k, v, rf, key_padding_mask=kpm, query_padding_mask=qpm,
                                      backend="torch", **kw)  # fmt: skip
        else:
            parts = []
            for i in range(len(lq)):
                a, b, c, d = cq[i], cq[i + 1], ck[i], ck[i + 1]
                parts.append(rfattn.rf_attention(q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], rf,
                                                 key_padding_mask=kpm[:, c:d],
                                                 query_padding_mask=qpm[:, a:b],
                                                 backend="torch"))  # fmt: skip
            out = torch.cat(parts, dim=2)
        outs.append(out)
    assert torch.equal(outs[0][:, :, 3:7], torch.zeros_like(outs[0][:, :, 3:7]))  # no keys
    assert_same(outs[0], outs[1], (q, k, v, rf.query_map, rf.key_map))


@pytest.mark.parametrize("causal", CAUSAL)
def test_running_statistics_move_once_from_the_row(causal):
    """oprf with running statistics in training: every sequence reads them as they stand (the
    outputs of separate calls in eval mode with the same buffers), and the call moves them once,
    as an unpacked call on the whole row does (not once per sequence)."""
    rf = rfattn.RandomFeatures(D, M, "oprf", seed=0, stats="running").double()
    warm = leaves((40,), seed=20)
    rfattn.rf_attention(*warm, rf, causal=causal, backend="torch")  # buffers not at zero
    row, ev = copy.deepcopy(rf), copy.deepcopy(rf).eval()
    q, k, v = leaves(LENGTHS)
    cu = offsets(LENGTHS)
    packed = rfattn.rf_attention(q, k, v, rf, causal=causal, cu_seqlens=cu, backend="torch")
    sep = separate(q, k, v, ev, cu.tolist(), cu.tolist(), causal, backend="torch")
    sep = sep[0] if causal else sep
    assert_same(packed, sep, (q, k, v))
    with torch.no_grad():
        rfattn.rf_attention(q, k, v, row, causal=causal, backend="torch")  # the row unpacked
    for (name, a), (_, b) in zip(rf.feature_map.named_buffers(), row.feature_map.named_buffers(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    assert int(rf.feature_map.num_batches_tracked) == 2


# the fused case: three runs forward and backward under the interpreter, in `make test-slow`
JUNK = [("torch", False), ("torch", True), pytest.param("triton", True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("backend,causal", JUNK, ids=["torch-noncausal", "torch-causal",
                                                      "triton-causal"])  # fmt: skip
def test_junk_in_one_sequence_reaches_no_other(backend, causal, kernel_device):
    """NaN and 1e30 in one sequence's q, k and v: the other sequences' outputs, states and
    gradients are those of the clean row, bit for bit (the fused backend: its causal kernels)."""
    device = kernel_device if backend == "triton" else torch.device("cpu")
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double().to(device).eval()
    lengths = (6, 7, 5)  # one batch of three (rfattn.attention.buckets): junk shares it
    cu = offsets(lengths).to(device)
    res = []
    for junk in (None, float("nan"), 1e30):
        q, k, v = (x.detach().to(device).requires_grad_() for x in leaves(lengths))
        if junk is not None:
            with torch.no_grad():
                for x in (q, k, v):
                    x[:, :, 6:13:2] = junk
        out = rfattn.rf_attention(q, k, v, rf, causal=causal, return_state=causal,
                                  cu_seqlens=cu, backend=backend)  # fmt: skip
        res.append((out, grads(out, (q, k, v))))
    keep = torch.tensor([True] * 6 + [False] * 7 + [True] * 5, device=device)
    for out, gs in res[1:]:
        o, o0 = (out, res[0][0]) if not causal else (out[0], res[0][0][0])
        assert torch.equal(o[:, :, keep], o0[:, :, keep])
        for g, g0 in zip(gs, res[0][1], strict=True):
            assert torch.equal(g[:, :, keep], g0[:, :, keep])
        if causal:
            for a, b in zip(out[1], res[0][0][1], strict=True):
                assert torch.equal(a[[0, 2]], b[[0, 2]])


# the causal case (~9 s under the interpreter) in make test-slow, with the fused junk case
@pytest.mark.parametrize("max_seqlen", [None, 17], ids=["host-offsets", "max_seqlen"])
@pytest.mark.parametrize("causal", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["noncausal", "causal"])  # fmt: skip
def test_packed_equals_separate_calls_fused(causal, max_seqlen, kernel_device):
    """The fused backend (a fused call per batch of sequences; with ``max_seqlen`` one call of
    the padded batch): outputs, gradients and states equal separate fused calls, grouped heads,
    with initial states when causal (tiny shapes: the interpreter)."""
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double().to(kernel_device).eval()
    lengths = (0, 1, 5, 17, 6, 16)  # 5 and 6, 16 and 17: batches of two
    q, k, v = (x.detach().to(kernel_device).requires_grad_() for x in leaves(lengths))
    cu = offsets(lengths).to(kernel_device)
    st = None
    if causal:
        st = rfattn.RFState(*(x.detach().to(kernel_device).requires_grad_()
                              for x in states(len(lengths), rf)))  # fmt: skip
    kw = dict(backend="triton")
    packed = rfattn.rf_attention(q, k, v, rf, causal=causal, initial_state=st,
                                 return_state=causal, cu_seqlens=cu, max_seqlen=max_seqlen,
                                 **kw)  # fmt: skip
    sep = separate(q, k, v, rf, cu.tolist(), cu.tolist(), causal, st, **kw)
    assert_same(packed, sep, (q, k, v) + ((st.s, st.z) if causal else ()))


def test_fused_running_statistics_move_once(kernel_device):
    """Fused backend, oprf causal in training: the sequences leave the running statistics to the
    call, which moves them as the torch path's unpacked call on the row does; an unpacked fused
    call after it still moves them."""
    rf = rfattn.RandomFeatures(D, M, "oprf", seed=0, stats="running").double().to(kernel_device)
    ref = copy.deepcopy(rf)
    lengths = (0, 3, 6)
    q, k, v = (x.detach().to(kernel_device) for x in leaves(lengths))
    cu = offsets(lengths).to(kernel_device)
    with torch.no_grad():
        rfattn.rf_attention(q, k, v, rf, causal=True, cu_seqlens=cu, backend="triton")
        rfattn.rf_attention(q, k, v, ref, causal=True, backend="torch")
        for name, a in ref.feature_map.named_buffers():
            torch.testing.assert_close(dict(rf.feature_map.named_buffers())[name], a, msg=name)
        rfattn.rf_attention(q, k, v, rf, causal=True, backend="triton")
        rfattn.rf_attention(q, k, v, ref, causal=True, backend="torch")
    for name, a in ref.feature_map.named_buffers():
        torch.testing.assert_close(dict(rf.feature_map.named_buffers())[name], a, msg=name)


BAD = [
    ("not-a-tensor", dict(cu_seqlens=[0, 3, 7]), TypeError, "cu_seqlens must be a torch.Tensor"),
    ("float", dict(cu_seqlens=torch.tensor([0.0, 3.0, 7.0])), TypeError,
     "cu_seqlens must have dtype int32 or int64"),
    ("2d", dict(cu_seqlens=torch.tensor([[0, 3, 7]])), ValueError, r"cu_seqlens must have shape"),
    ("one-offset", dict(cu_seqlens=torch.tensor([0])), ValueError, r"cu_seqlens must have shape"),
    ("first-not-0", dict(cu_seqlens=torch.tensor([1, 3, 7])), ValueError,
     "cu_seqlens must start at 0"),
    ("decreasing", dict(cu_seqlens=torch.tensor([0, 5, 3, 7])), ValueError,
     "cu_seqlens must not decrease"),
    ("last-not-total", dict(cu_seqlens=torch.tensor([0, 3, 6])), ValueError,
     "cu_seqlens must end at the packed length 7"),
    ("with-q-offsets", dict(cu_seqlens=torch.tensor([0, 7]), cu_seqlens_q=torch.tensor([0, 7])),
     ValueError, "cu_seqlens gives the offsets of both"),
    ("q-without-k", dict(cu_seqlens_q=torch.tensor([0, 7])), ValueError,
     "cu_seqlens_q and cu_seqlens_k go together"),
    ("causal-q-k", dict(cu_seqlens_q=torch.tensor([0, 7]), cu_seqlens_k=torch.tensor([0, 7]),
                        causal=True), ValueError, "causal=True packs q and k alike"),
    ("k-last", dict(cu_seqlens_q=torch.tensor([0, 7]), cu_seqlens_k=torch.tensor([0, 6])),
     ValueError, "cu_seqlens_k must end at the packed length 7"),
    ("counts", dict(cu_seqlens_q=torch.tensor([0, 7]), cu_seqlens_k=torch.tensor([0, 2, 7])),
     ValueError, "cu_seqlens_q has 1 sequences, cu_seqlens_k 2"),
    ("mask-batch", dict(cu_seqlens=torch.tensor([0, 3, 7]),
                        key_padding_mask=torch.zeros(2, 7, dtype=torch.bool)),
     ValueError, r"key_padding_mask must have shape \[B, T\] = \(1, 7\)"),
    ("state-batch", dict(cu_seqlens=torch.tensor([0, 3, 7]), causal=True, initial_state="one"),
     ValueError, r"initial_state.s must have shape \(2, 2, 8, 3\)"),
    ("window-state", dict(cu_seqlens=torch.tensor([0, 3, 7]), window=2, causal=True,
                          initial_state="two"), ValueError, "must be a HybridState of 2 rows"),
    ("window-cross", dict(cu_seqlens_q=torch.tensor([0, 3, 7]), window=2,
                          cu_seqlens_k=torch.tensor([0, 4, 7])), ValueError,
     "window and sinks need each packed sequence's queries and keys"),
]  # fmt: skip


@pytest.mark.parametrize("case,kw,error,match", BAD, ids=[b[0] for b in BAD])
def test_bad_offsets_raise_naming_them(case, kw, error, match):
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double()
    q, k, v = (x.detach() for x in leaves((7,)))
    if kw.get("initial_state") == "one":  # a state of one sequence for two
        kw["initial_state"] = states(1, rf)
    if kw.get("initial_state") == "two":  # an RFState where the hybrid needs its own
        kw["initial_state"] = states(2, rf)
    with pytest.raises(error, match=match):
        rfattn.rf_attention(q, k, v, rf, backend="torch", **kw)


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("feature", ["posrf", "oprf"])
def test_packed_window_and_sinks_equal_separate_calls(feature, causal):
    """Exact sinks and a sliding window inside the features (rfattn.hybrid) on a packed row:
    outputs and gradients equal N separate hybrid calls (float64, grouped heads), the batched
    sequences padded and masked as any packed batch; oprf in training reads its running
    statistics as they stand for every sequence (separate calls in eval mode) and moves them
    once, as the unpacked row does."""
    stats = {"stats": "running"} if feature == "oprf" else {}
    rf = rfattn.RandomFeatures(D, M, feature, seed=0, **stats).double()
    if feature == "oprf":
        rfattn.rf_attention(*leaves((40,), seed=20), rf, causal=causal, backend="torch")
    else:
        rf.eval()
    row, ev = copy.deepcopy(rf), copy.deepcopy(rf).eval()
    q, k, v = leaves(LENGTHS)
    cu = offsets(LENGTHS)
    kw = dict(backend="torch", causal=causal, window=3, sinks=2)
    packed = rfattn.rf_attention(q, k, v, rf, cu_seqlens=cu, **kw)
    o = cu.tolist()
    sep = torch.cat([rfattn.rf_attention(q[:, :, o[i]:o[i + 1]], k[:, :, o[i]:o[i + 1]],
                                         v[:, :, o[i]:o[i + 1]], ev, **kw)
                     for i in range(len(LENGTHS))], dim=2)  # fmt: skip
    assert_same(packed, sep, (q, k, v), feature)
    if feature == "oprf":
        with torch.no_grad():
            rfattn.rf_attention(q, k, v, row, **kw)  # the row unpacked moves them once
        for (name, a), (_, b) in zip(rf.feature_map.named_buffers(),
                                     row.feature_map.named_buffers(), strict=True):  # fmt: skip
            assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_packed_window_and_sinks_with_states_equal_separate_calls(backend):
    """A packed row with window and sinks continuing one HybridState per sequence (after a
    prefix of its own; sinks left to fill in some) and returning them: outputs, every field of
    the returned states and the gradients of q, k, v and of the initial states' tensors equal N
    separate hybrid calls (float64, grouped heads, an empty sequence: its state passed on)."""
    from rfattn.hybrid import HybridState

    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double().eval()
    lengths = (0, 1, 5, 17, 6, 5)
    kw = dict(causal=True, window=3, sinks=2, return_state=True, backend=backend)
    pre = [rfattn.rf_attention(*(x.detach() for x in leaves((n,), seed=30 + i)), rf, **kw)[1]
           for i, n in enumerate((1, 4, 0, 9, 2, 3))]  # fmt: skip
    first = HybridState(*(torch.cat(f).detach() for f in zip(*pre, strict=True)))
    q, k, v = leaves(lengths)
    o = offsets(lengths).tolist()

    def run(packed):
        init = HybridState(*(x.clone().requires_grad_(x.is_floating_point() and i != 2)
                             for i, x in enumerate(first)))  # fmt: skip
        if packed:
            out, st = rfattn.rf_attention(q, k, v, rf, cu_seqlens=offsets(lengths),
                                          initial_state=init, **kw)  # fmt: skip
        else:
            res = [rfattn.rf_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], rf,
                                       initial_state=HybridState(*(x[i : i + 1] for x in init)),
                                       **kw)
                   for i, (a, b) in enumerate(zip(o[:-1], o[1:], strict=True))]  # fmt: skip
            out = torch.cat([r[0] for r in res], 2)
            st = HybridState(*(torch.cat(f) for f in zip(*(r[1] for r in res), strict=True)))
        leaves_ = [q, k, v, *(x for x in init if x.requires_grad)]
        loss = (out * rand(*out.shape, seed=9)).sum() + st.s.sum() + st.keys.square().sum()
        return out, st, torch.autograd.grad(loss, leaves_)

    packed, sep = run(True), run(False)
    torch.testing.assert_close(packed[0], sep[0], rtol=1e-12, atol=1e-12)
    for name, a, b in zip(HybridState._fields, packed[1], sep[1], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True, msg=name)
    for i, (a, b) in enumerate(zip(packed[2], sep[2], strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"grad {i}")


def test_offsets_need_batch_one_and_equal_lengths():
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double()
    q = rand(2, HQ, 7, D)
    with pytest.raises(ValueError, match="cu_seqlens.*batch size 1.*got batch size 2"):
        rfattn.rf_attention(q, q, q, rf, cu_seqlens=torch.tensor([0, 3, 7]))
    q, k = rand(1, HQ, 7, D), rand(1, HQ, 5, D)
    with pytest.raises(ValueError, match="cu_seqlens packs q and k alike and needs Tq == Tk"):
        rfattn.rf_attention(q, k, k, rf, cu_seqlens=torch.tensor([0, 3, 7]))


def test_packed_without_heads_runs_nothing():
    """No heads: outputs ``[1, 0, total, E]`` and states ``[N, 0, ...]``, running statistics
    left where they are (as for an unpacked call without heads)."""
    rf = rfattn.RandomFeatures(D, M, "oprf", seed=0, stats="running").double()
    before = [b.clone() for b in rf.feature_map.buffers()]
    q, k, v = (x.detach() for x in leaves(LENGTHS, heads=0, kv_heads=0))
    out, st = rfattn.rf_attention(q, k, v, rf, causal=True, return_state=True,
                                  cu_seqlens=offsets(LENGTHS), backend="torch")  # fmt: skip
    assert out.shape == (1, 0, sum(LENGTHS), E) and st.s.shape == (len(LENGTHS), 0, M, E)
    for a, b in zip(rf.feature_map.buffers(), before, strict=True):
        assert torch.equal(a, b)


def test_packed_over_a_one_process_group(tmp_path):
    """A sharded call (``group=``) of one process takes packing, causal or not, and equals
    the call without a group (more ranks: tests/test_distributed.py), window and sinks too,
    with the returned states."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double()
        q, k, v = (x.detach() for x in leaves((3, 4)))
        for causal in (True, False):
            got = rfattn.rf_attention(q, k, v, rf, causal=causal, cu_seqlens=offsets((3, 4)),
                                      group=dist.group.WORLD)  # fmt: skip
            want = rfattn.rf_attention(q, k, v, rf, causal=causal, cu_seqlens=offsets((3, 4)))
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        local = dict(causal=True, cu_seqlens=offsets((3, 4)), window=2, sinks=1)
        got = rfattn.rf_attention(q, k, v, rf, group=dist.group.WORLD, **local)
        torch.testing.assert_close(got, rfattn.rf_attention(q, k, v, rf, **local), rtol=1e-12,
                                   atol=1e-12)  # fmt: skip
        got = rfattn.rf_attention(q, k, v, rf, group=dist.group.WORLD, return_state=True,
                                  **local)  # fmt: skip
        want = rfattn.rf_attention(q, k, v, rf, return_state=True, **local)
        for a, b in zip((got[0], *got[1]), (want[0], *want[1]), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, equal_nan=True)
    finally:
        dist.destroy_process_group()


class _Documents(torch.nn.Module):
    """Causal self-attention of x ``[1, H, total, D]`` (q = k = v = x) on its own features:
    packed with ``cu_seqlens``, or one document at a time."""

    def __init__(self, lengths, packed: bool, max_seqlen=None):
        super().__init__()
        self.rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double()
        self.lengths, self.packed, self.max_seqlen = lengths, packed, max_seqlen

    def forward(self, x):
        cu = offsets(self.lengths)
        if self.packed:
            return rfattn.rf_attention(x, x, x, self.rf, causal=True, cu_seqlens=cu,
                                       max_seqlen=self.max_seqlen)  # fmt: skip
        outs = []
        for i in range(len(self.lengths)):
            doc = x[:, :, cu[i] : cu[i + 1]]
            outs.append(rfattn.rf_attention(doc, doc, doc, self.rf, causal=True))
        return torch.cat(outs, dim=2)


@pytest.mark.parametrize("max_seqlen", [None, 40], ids=["host-offsets", "max_seqlen"])
def test_calibration_records_each_packed_sequence(max_seqlen):
    """rfattn.calibrate on a packed call records each sequence with its own softmax target:
    the same errors as the documents called one by one (before: one target over the row,
    across the documents); with ``max_seqlen`` too (the recorder reads its offsets)."""
    x = rand(1, 2, sum(LENGTHS), D, seed=4)
    reports = [rfattn.calibrate(_Documents(LENGTHS, packed, max_seqlen), [x], steps=0,
                                progress=False) for packed in (True, False)]  # fmt: skip
    assert reports[0].before == pytest.approx(reports[1].before, rel=1e-12)
    assert reports[0].after == pytest.approx(reports[1].after, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# max_seqlen: the offsets never read on the host, the sequences one padded batch


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("kv_heads", [HQ, HK], ids=["mha", "gqa"])
@pytest.mark.parametrize("feature", ["posrf", "trigrf"])
def test_max_seqlen_equals_separate_calls_torch(feature, kv_heads, causal):
    """With ``max_seqlen`` (a bound above the longest sequence): outputs, gradients and, causal,
    initial and returned states equal the host-offsets path's (itself equal to separate calls,
    above) in float64, with key and query masks and NaN in their padded positions."""
    rf = rfattn.RandomFeatures(D, M, feature, seed=0).double()
    q, k, v = leaves(LENGTHS, kv_heads=kv_heads)
    mask = torch.zeros(1, sum(LENGTHS), dtype=torch.bool)
    mask[:, 10:14] = True
    with torch.no_grad():
        for x in (q, k, v):
            x[:, :, 10:14] = float("nan")
    cu = offsets(LENGTHS)
    st = states(len(LENGTHS), rf, kv_heads=kv_heads) if causal else None
    kw = dict(causal=causal, initial_state=st, return_state=causal, backend="torch",
              key_padding_mask=mask, query_padding_mask=mask)  # fmt: skip
    packed = rfattn.rf_attention(q, k, v, rf, cu_seqlens=cu, max_seqlen=40, **kw)
    ref = rfattn.rf_attention(q, k, v, rf, cu_seqlens=cu, **kw)  # the host-offsets path
    assert_same(packed, ref, (q, k, v) + ((st.s, st.z) if causal else ()))


def test_max_seqlen_cross_attention_and_statistics_torch():
    """Cross-attention (``cu_seqlens_q`` / ``cu_seqlens_k``, other lengths, an empty query
    sequence) and oprf's running statistics in training (moved once, from the whole row, as
    the host-offsets path moves them): equal to the host-offsets path."""
    qlen = (3, 0, 5, 9, 2, 6, 1, 4, 7)
    rf = rfattn.RandomFeatures(D, M, "oprf", seed=0, stats="running").double()
    rfattn.rf_attention(*leaves((40,), seed=20), rf, causal=False, backend="torch")
    ref_rf = copy.deepcopy(rf)
    q, k, v = leaves(qlen, kv_lengths=LENGTHS)
    kw = dict(cu_seqlens_q=offsets(qlen), cu_seqlens_k=offsets(LENGTHS), backend="torch")
    got = rfattn.rf_attention(q, k, v, rf, max_seqlen=33, **kw)
    want = rfattn.rf_attention(q, k, v, ref_rf, **kw)
    assert_same(got, want, (q, k, v))
    for (name, a), (_, b) in zip(rf.feature_map.named_buffers(),
                                 ref_rf.feature_map.named_buffers(), strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)


BAD_MAX = [
    ("decreasing", torch.tensor([0, 5, 3, 7]), 8, RuntimeError, "cu_seqlens must not decrease"),
    ("first-not-0", torch.tensor([1, 3, 7]), 8, RuntimeError, "cu_seqlens must start at 0"),
    ("last-not-total", torch.tensor([0, 3, 6]), 8, RuntimeError,
     "cu_seqlens must end at the packed length 7"),
    ("too-long", torch.tensor([0, 2, 7]), 4, RuntimeError,
     "cu_seqlens has a sequence longer than max_seqlen=4"),
    ("float", torch.tensor([0, 3, 7]), 4.0, TypeError, "max_seqlen must be an int"),
    ("negative", torch.tensor([0, 3, 7]), -1, ValueError, "max_seqlen must be >= 0"),
    ("no-offsets", None, 4, ValueError, "max_seqlen goes with packed sequences"),
]  # fmt: skip


@pytest.mark.parametrize("case,cu,max_seqlen,error,match", BAD_MAX, ids=[b[0] for b in BAD_MAX])
def test_max_seqlen_bad_offsets_raise_naming_them(case, cu, max_seqlen, error, match):
    """The offsets' values are checked on the device (``torch._assert_async``: on the CPU it
    raises at once), each error naming what is wrong."""
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double()
    q, k, v = (x.detach() for x in leaves((7,)))
    with pytest.raises(error, match=match):
        rfattn.rf_attention(q, k, v, rf, causal=True, cu_seqlens=cu, max_seqlen=max_seqlen,
                            backend="torch")  # fmt: skip


def test_max_seqlen_goes_along_under_autocast():
    """Under torch.autocast rf_attention calls itself again with the cast inputs: max_seqlen goes
    with them (before: dropped there, so the offsets were read on the host and a hint shorter
    than a sequence passed unnoticed)."""
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0)
    q, k, v = (x.detach().float() for x in leaves((7,)))
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(RuntimeError, match="longer than max_seqlen=4"):  # fmt: skip
        rfattn.rf_attention(q, k, v, rf, causal=True, cu_seqlens=torch.tensor([0, 2, 7]),
                            max_seqlen=4, backend="torch")  # fmt: skip


# ------------------------------------------------------------------------------------------------
# the non-causal kernels with the offsets themselves (rfattn.fused.packed): every sequence in
# one launch of each pass, no padding


def _kernel_rf(feature, device):
    """A RandomFeatures of ``feature`` on ``device`` in eval mode (oprf: running statistics that
    have moved once, so its parameters are per head and not the defaults)."""
    if feature == "oprf":
        rf = rfattn.RandomFeatures(D, M, "oprf", seed=0, stats="running").double()
        with torch.no_grad():
            rfattn.rf_attention(*leaves((40,), heads=HK, seed=20), rf, backend="torch")
        return rf.to(device).eval()
    weights = {"weights": "rademacher"} if feature == "rmf" else {}
    return rfattn.RandomFeatures(D, M, feature, seed=0, **weights).double().to(device).eval()


def _spy_packed(monkeypatch) -> list:
    """Record each call that runs on the kernels with its offsets."""
    from rfattn import fused

    calls, real = [], fused.packed
    monkeypatch.setattr(fused, "packed", lambda call, *a: calls.append(call) or real(call, *a))
    return calls


#: every feature form with each way of giving the offsets; one of each form in make test (the
#: interpreter: ~3 s a case), every pair in make test-slow
KERNEL_CASES = [
    pytest.param(f, o, id=f"{f}-{o}", marks=() if (f, o) in (
        ("posrf", "host"), ("trigrf", "cross"), ("rmf", "max_seqlen"), ("oprf", "host"))
        else pytest.mark.slow)
    for f in ("posrf", "trigrf", "rmf", "oprf") for o in ("host", "max_seqlen", "cross")
]  # fmt: skip


@pytest.mark.parametrize("feature,offsets_on", KERNEL_CASES)
def test_kernel_offsets_equal_separate_calls(feature, offsets_on, kernel_device, monkeypatch):
    """Non-causal packed calls on the kernels with the offsets (every fused feature form: the
    GERF family, signed tables, rmf, oprf's per-head parameters; offsets read on the host, on
    the device with ``max_seqlen``, and cross-attention with ``cu_seqlens_q/k``): outputs and
    the gradients of q, k, v and W equal separate fused calls of each sequence (float64, to
    rounding), empty sequences and sequences without keys included; one call of the kernels
    takes the whole row."""
    rf = _kernel_rf(feature, kernel_device)
    ql = (0, 1, 5, 17, 6, 16)
    kl = (3, 0, 7, 17, 1, 9) if offsets_on == "cross" else ql
    q, k, v = (x.detach().to(kernel_device).requires_grad_()
               for x in leaves(ql, heads=HK, kv_lengths=kl))  # fmt: skip
    cq, ck = offsets(ql).to(kernel_device), offsets(kl, torch.int64).to(kernel_device)
    kw = dict(cu_seqlens=cq) if offsets_on != "cross" else dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    if offsets_on == "max_seqlen":
        kw["max_seqlen"] = 20
    calls = _spy_packed(monkeypatch)
    packed = rfattn.rf_attention(q, k, v, rf, backend="triton", **kw)
    assert len(calls) == 1
    sep = separate(q, k, v, rf, cq.tolist(), ck.tolist(), False, backend="triton")
    w = [rf.weight] if rf.weight.requires_grad and feature != "rmf" else []
    assert_same(packed, sep, (q, k, v, *w))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [f64, torch.bfloat16])
def test_kernel_offsets_awkward_lengths(dtype, kernel_device, monkeypatch):
    """The kernels with the offsets at lengths {0, 1, 63, 64, 65, 257} (tiles and splits that
    end inside and at a sequence's end), with a key padding mask, padded queries and head
    maps: outputs and gradients equal separate fused calls (bfloat16 too: the half policy's
    rounding is per token, so the packed row rounds as the separate calls do)."""
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double().to(kernel_device).eval()
    lengths = (64, 0, 1, 257, 63, 65)
    q, k, v = (x.detach().to(kernel_device, dtype).requires_grad_()
               for x in leaves(lengths, heads=HK))  # fmt: skip
    cu = offsets(lengths).to(kernel_device)
    T = sum(lengths)
    kpm = (torch.arange(T) % 7 == 3)[None].to(kernel_device)
    qpm = (torch.arange(T) % 5 == 1)[None].to(kernel_device)
    calls = _spy_packed(monkeypatch)
    packed = rfattn.rf_attention(q, k, v, rf, backend="triton", cu_seqlens=cu,
                                 key_padding_mask=kpm, query_padding_mask=qpm)  # fmt: skip
    assert len(calls) == 1
    outs = []
    for i in range(len(lengths)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        outs.append(rfattn.rf_attention(q[:, :, s], k[:, :, s], v[:, :, s], rf, backend="triton",
                                        key_padding_mask=kpm[:, s],
                                        query_padding_mask=qpm[:, s]))  # fmt: skip
    sep = torch.cat(outs, dim=2)
    torch.testing.assert_close(packed, sep, rtol=0, atol=0)
    for a, b in zip(grads(packed, (q, k, v)), grads(sep, (q, k, v)), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12 if dtype == f64 else 0, atol=1e-12)


def test_kernel_offsets_junk_reaches_no_other_sequence(kernel_device, monkeypatch):
    """NaN and 1e30 in one sequence's q, k and v on the kernels with the offsets: the other
    sequences' outputs and gradients are those of the clean row, bit for bit."""
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double().to(kernel_device).eval()
    lengths = (6, 7, 5)
    cu = offsets(lengths).to(kernel_device)
    calls = _spy_packed(monkeypatch)
    res = []
    for junk in (None, float("nan"), 1e30):
        q, k, v = (x.detach().to(kernel_device).requires_grad_()
                   for x in leaves(lengths, heads=HK))  # fmt: skip
        if junk is not None:
            with torch.no_grad():
                for x in (q, k, v):
                    x[:, :, 6:13:2] = junk
        out = rfattn.rf_attention(q, k, v, rf, cu_seqlens=cu, backend="triton")
        res.append((out, grads(out, (q, k, v))))
    assert len(calls) == 3
    keep = torch.tensor([True] * 6 + [False] * 7 + [True] * 5, device=kernel_device)
    for out, gs in res[1:]:
        assert torch.equal(out[:, :, keep], res[0][0][:, :, keep])
        for g, g0 in zip(gs, res[0][1], strict=True):
            assert torch.equal(g[:, :, keep], g0[:, :, keep])


def test_kernel_offsets_move_running_statistics_once(kernel_device, monkeypatch):
    """oprf with running statistics in training on the kernels with the offsets: the sequences
    read the buffers as they stand and the call moves them once, from the whole row's valid
    tokens (as the torch path's packed call does)."""
    rf = _kernel_rf("oprf", kernel_device).train()
    ref = copy.deepcopy(rf).cpu()
    lengths = (0, 3, 6, 4)
    q, k, v = (x.detach() for x in leaves(lengths, heads=HK))
    cu = offsets(lengths)
    calls = _spy_packed(monkeypatch)
    with torch.no_grad():
        out = rfattn.rf_attention(*(x.to(kernel_device) for x in (q, k, v)), rf,
                                  cu_seqlens=cu.to(kernel_device), backend="triton")  # fmt: skip
        expect = rfattn.rf_attention(q, k, v, ref, cu_seqlens=cu, backend="torch")
    assert len(calls) == 1
    torch.testing.assert_close(out.cpu(), expect, rtol=1e-10, atol=1e-12)
    for name, a in ref.feature_map.named_buffers():
        torch.testing.assert_close(dict(rf.feature_map.named_buffers())[name].cpu(), a, msg=name)


#: causal: every fused feature form (one in make test), grouped-query heads, states in and out
CAUSAL_KERNEL_CASES = [
    pytest.param(f, o, id=f"{f}-{o}", marks=() if (f, o) == ("posrf", "max_seqlen")
                 else pytest.mark.slow)
    for f in ("posrf", "trigrf", "rmf", "oprf") for o in ("host", "max_seqlen")
]  # fmt: skip


@pytest.mark.parametrize("feature,offsets_on", CAUSAL_KERNEL_CASES)
def test_kernel_offsets_causal_equal_separate_calls(feature, offsets_on, kernel_device,
                                                    monkeypatch):  # fmt: skip
    """Causal packed calls on the chunk kernels with the offsets (each sequence's chunks from
    its first token; grouped-query heads, a state per sequence in, with gradients, and out):
    outputs, returned states and the gradients of q, k, v and the initial states equal
    separate fused calls (float64, to rounding: the segments fall elsewhere), an empty
    sequence passing its state through; one call of the kernels takes the whole row."""
    rf = _kernel_rf(feature, kernel_device)
    lengths = (0, 1, 5, 9) if offsets_on == "max_seqlen" else (3, 0, 17, 1, 6)
    q, k, v = (x.detach().to(kernel_device).requires_grad_() for x in leaves(lengths))
    cu = offsets(lengths).to(kernel_device)
    st = rfattn.RFState(*(x.detach().to(kernel_device).requires_grad_()
                          for x in states(len(lengths), rf)))  # fmt: skip
    kw = dict(max_seqlen=max(lengths)) if offsets_on == "max_seqlen" else {}
    calls = _spy_packed(monkeypatch)
    packed = rfattn.rf_attention(q, k, v, rf, causal=True, initial_state=st, return_state=True,
                                 cu_seqlens=cu, backend="triton", **kw)  # fmt: skip
    assert len(calls) == 1
    sep = separate(q, k, v, rf, cu.tolist(), cu.tolist(), True, st, backend="triton")
    assert_same(packed, sep, (q, k, v, st.s, st.z))


@pytest.mark.slow
def test_kernel_offsets_causal_awkward_lengths(kernel_device, monkeypatch):
    """The chunk kernels with the offsets at lengths {0, 1, 63, 64, 65, 257} (a sequence's last
    chunk full, one token long, and several segments), with a key padding mask and grouped
    heads, no state given: outputs, final states and gradients equal separate fused calls."""
    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double().to(kernel_device).eval()
    lengths = (64, 0, 1, 257, 63, 65)
    q, k, v = (x.detach().to(kernel_device).requires_grad_() for x in leaves(lengths))
    cu = offsets(lengths).to(kernel_device)
    kpm = (torch.arange(sum(lengths)) % 7 == 3)[None].to(kernel_device)
    calls = _spy_packed(monkeypatch)
    packed = rfattn.rf_attention(q, k, v, rf, causal=True, return_state=True, cu_seqlens=cu,
                                 key_padding_mask=kpm, backend="triton")  # fmt: skip
    assert len(calls) == 1
    outs, finals = [], []
    for i in range(len(lengths)):
        s = slice(int(cu[i]), int(cu[i + 1]))
        r = rfattn.rf_attention(q[:, :, s], k[:, :, s], v[:, :, s], rf, causal=True,
                                return_state=True, key_padding_mask=kpm[:, s],
                                backend="triton")  # fmt: skip
        outs.append(r[0])
        finals.append(r[1])
    sep = (torch.cat(outs, dim=2),
           rfattn.RFState(*(torch.cat(x, dim=0) for x in zip(*finals, strict=True))))  # fmt: skip
    assert_same(packed, sep, (q, k, v))


@pytest.mark.parametrize("max_seqlen", [None, 1], ids=["host-offsets", "max_seqlen"])
def test_one_token_per_sequence_is_one_decode_step(max_seqlen, kernel_device, monkeypatch):
    """Generation over packed sequences (one token each, a state per sequence, no gradient):
    the row runs as one decode step of a batch of N one-token rows (a view, no copy), equal to
    separate fused calls, outputs and states, bit for bit."""
    from rfattn import ops

    rf = rfattn.RandomFeatures(D, M, "posrf", seed=0).double().to(kernel_device).eval()
    n = 4
    q, k, v = (x.detach().to(kernel_device) for x in leaves((1,) * n))
    st = rfattn.RFState(*(x.detach().to(kernel_device) for x in states(n, rf)))
    cu = offsets((1,) * n).to(kernel_device)
    steps, real = [], ops.rf_decode
    monkeypatch.setattr(ops, "rf_decode", lambda *a, **kw: steps.append(a[0].shape) or
                        real(*a, **kw))  # fmt: skip
    with torch.no_grad():
        out, final = rfattn.rf_attention(q, k, v, rf, causal=True, initial_state=st,
                                         return_state=True, cu_seqlens=cu, max_seqlen=max_seqlen,
                                         backend="triton")  # fmt: skip
        assert steps == [(n, HQ, 1, D)]
        sep = separate(q, k, v, rf, cu.tolist(), cu.tolist(), True, st, backend="triton")
    assert torch.equal(out, sep[0])
    for a, b in zip(final, sep[1], strict=True):
        assert torch.equal(a, b)
