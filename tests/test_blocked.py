"""The torch path's blocked forms (``rfattn.blocked``) against the reference of record.

Blocks and chunks are made tiny here (a few tokens), so every call crosses block and chunk
boundaries, ends in a partial chunk and carries states between blocks; the reference is
``rfattn.reference.linear_attention`` on the feature map's own features, in float64, with
gradients by autograd through it."""

import contextlib
import os
import sys

import pytest
import torch

import rfattn
from rfattn import blocked
from rfattn.features.base import exp_diff
from rfattn.reference import linear_attention
from rfattn.testing import rel_rms, tolerance
from rfattn.torch_path import torch_inputs

f64 = torch.float64
OUT, GRAD = tolerance(f64, "out"), tolerance(f64, "grad")

CASES = [("posrf", "orf"), ("oprf", "orf"), ("saderf", "orf"), ("trigrf", "orf"),
         ("hrf", "orf"), ("rmf", "rademacher"), ("gerf", "gaussian")]  # fmt: skip


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Chunks of 4 tokens, blocks of 3 chunks for the shapes below."""
    monkeypatch.setattr(blocked, "CHUNK", 4)
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 12 * 2 * 2 * 16)


def rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=f64) * scale).requires_grad_()


def make_rf(feature, weights, D=6, M=16, **opts):
    if feature == "rmf":
        opts.setdefault("max_degree", 5)
    return rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=0, **opts).double()


def reference(q, k, v, rf, causal, mask, groups=1):
    """Output of record: the feature map's features (key/value heads repeated) through
    ``linear_attention``."""
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    qm = mask if causal else None
    w, xq, xk, params = torch_inputs(q, k, rf, mask, q.shape[-1] ** -0.5, causal, qm)
    phi_q, phi_k = rf.feature_map.features(xq, xk, w, mask, params)
    out = linear_attention(phi_q, phi_k, v, causal=causal, key_padding_mask=mask)
    return out if qm is None else out.masked_fill(qm[:, None, :, None], 0.0)  # padded queries


def grads(out, inputs, seed=9):
    g = torch.Generator().manual_seed(seed)
    cot = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, inputs, cot)


@pytest.mark.parametrize("feature, weights", CASES)
@pytest.mark.parametrize("groups", [1, 2])
def test_causal_blocks_match_the_reference_with_gradients(feature, weights, groups, tiny_blocks):
    B, Hk, T, D, E = 2, 2, 29, 6, 3  # 29 tokens: 3 blocks, the last chunk partial
    rf = make_rf(feature, weights).eval()  # fixed running statistics: one set for both calls
    q = rand(B, Hk * groups, T, D, seed=1, scale=0.7)
    k, v = rand(B, Hk, T, D, seed=2, scale=0.7), rand(B, Hk, T, E, seed=3)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, [0, 5, 13]] = True  # the first key of a block padded, one inside a chunk
    mask[1, 20:] = True
    out = rfattn.rf_attention(q, k, v, rf, causal=True, key_padding_mask=mask, backend="torch")
    ref = reference(q, k, v, rf, True, mask, groups)
    assert rel_rms(out, ref) <= OUT
    for name, a, b in zip("qkv", grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        assert rel_rms(a, b) <= GRAD, name


def test_causal_state_in_and_out_match_one_call(tiny_blocks):
    """A state handed between calls carries its gradient: d(initial S, z) and the gradient
    through the returned state equal those of one call over both halves."""
    rf = make_rf("oprf", "orf").eval()
    B, H, T, D, E = 1, 2, 26, 6, 3
    q, k, v = (rand(B, H, T, D if i < 2 else E, seed=i, scale=0.8) for i in range(3))
    full, st_full = rfattn.rf_attention(q, k, v, rf, causal=True, return_state=True)
    cut = 11
    a, st = rfattn.rf_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], rf, causal=True,
                                return_state=True)  # fmt: skip
    b, st2 = rfattn.rf_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], rf, causal=True,
                                 initial_state=st, return_state=True)  # fmt: skip
    assert rel_rms(torch.cat((a, b), dim=2), full) <= OUT
    assert rel_rms(st2.s, st_full.s) <= OUT and rel_rms(st2.z, st_full.z) <= OUT
    g = torch.Generator().manual_seed(5)
    cs, cz = (torch.randn(x.shape, generator=g, dtype=f64) for x in (st_full.s, st_full.z))
    co = torch.randn(full.shape, generator=g, dtype=f64)

    def loss(o, s):
        return (o * co).sum() + (s.s * cs).sum() + (s.z * cz).sum()

    one = torch.autograd.grad(loss(full, st_full), (q, k, v))
    two = torch.autograd.grad(loss(torch.cat((a, b), dim=2), st2), (q, k, v))
    for name, x, y in zip("qkv", two, one, strict=True):
        assert rel_rms(x, y) <= GRAD, name


@pytest.mark.parametrize("feature, weights", [("posrf", "orf"), ("rmf", "rademacher")])
def test_causal_gradcheck_across_blocks(feature, weights, monkeypatch):
    """Finite differences through the hand-written backward: q, k, v and the initial S, z, and
    the returned state through a second call that continues from it (a state alone is not a
    function of the keys where its offset, the running max, moves with them; what it feeds
    is)."""
    monkeypatch.setattr(blocked, "CHUNK", 2)
    monkeypatch.setattr(blocked, "BLOCK_ELEMENTS", 2 * 2 * 8)
    rf = make_rf(feature, weights, D=3, M=4).eval()
    B, H, T = 1, 1, 7
    q, k, v = (rand(B, H, T, 3, seed=i, scale=0.6) for i in range(3))
    q2, k2, v2 = (rand(B, H, 3, 3, seed=4 + i, scale=0.6).detach() for i in range(3))
    _, st = rfattn.rf_attention(q.detach(), k.detach(), v.detach(), rf, causal=True,
                                return_state=True)  # fmt: skip
    s0, z0 = st.s.detach().requires_grad_(), st.z.detach().requires_grad_()
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 3] = True

    def fn(q, k, v, s0, z0):
        out, s = rfattn.rf_attention(q, k, v, rf, causal=True, key_padding_mask=mask,
                                     initial_state=rfattn.RFState(s0, z0, st.offset),
                                     return_state=True)  # fmt: skip
        return out, rfattn.rf_attention(q2, k2, v2, rf, causal=True, initial_state=s)

    assert torch.autograd.gradcheck(fn, (q, k, v, s0, z0))


@pytest.mark.parametrize("feature, weights", CASES + [("hyprf", "orf"), ("poisrf", "orf")])
def test_noncausal_blocks_match_the_reference_with_gradients(feature, weights, tiny_blocks):
    """Keys and queries run in blocks with online per-feature offsets; the backward recomputes
    both. Global statistics (oprf, saderf, poisrf) come from the whole sequence."""
    rf = make_rf(feature, weights).eval()
    q, k = rand(2, 2, 17, 6, seed=1, scale=1.2), rand(2, 2, 30, 6, seed=2, scale=1.2)
    v = rand(2, 2, 30, 3, seed=3)
    with torch.no_grad():
        k[1, :, 25, :] = 6.0  # the largest key logit late, in the last block
    mask = torch.zeros(2, 30, dtype=torch.bool)
    mask[0, :12] = True  # a whole first block padded
    out = rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask, backend="torch")
    ref = reference(q, k, v, rf, False, mask)
    assert rel_rms(out, ref) <= OUT
    with torch.no_grad():
        assert rel_rms(rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask), ref) <= OUT
    for name, a, b in zip("qkv", grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        assert rel_rms(a, b) <= GRAD, name


@pytest.mark.parametrize("causal", [False, True])
def test_gradients_through_statistics_and_learnable_weights(causal, tiny_blocks):
    """Feature parameters and W are inputs of the blocked Functions: ``stats_grad=True``
    statistics (non-causal) and fastfoodl's parameters get the reference's gradients."""
    q, k, v = (rand(2, 2, 21, 4, seed=i, scale=0.7) for i in range(3))
    rf = make_rf("posrf", "fastfoodl", D=4, M=16)
    out = rfattn.rf_attention(q, k, v, rf, causal=causal)
    ref = reference(q, k, v, rf, causal, None)
    params = [p for p in rf.parameters() if p.requires_grad]
    assert params
    for a, b in zip(grads(out, params), grads(ref, params), strict=True):
        assert a.abs().sum() > 0 and rel_rms(a, b) <= GRAD
    if causal:
        return
    rf = make_rf("oprf", "orf", D=4, stats_grad=True)
    out = rfattn.rf_attention(q, k, v, rf, causal=False)
    ref = reference(q, k, v, rf, False, None)
    for name, a, b in zip("qkv", grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        assert rel_rms(a, b) <= GRAD, name


def test_nan_in_a_later_block_leaves_earlier_blocks(tiny_blocks):
    rf = make_rf("posrf", "orf")
    q, k, v = (rand(1, 2, 30, 6 if i < 2 else 3, seed=i).detach() for i in range(3))
    clean = rfattn.rf_attention(q, k, v, rf, causal=True)
    v[0, 1, 17, 2] = float("nan")
    out = rfattn.rf_attention(q, k, v, rf, causal=True)
    assert torch.equal(out[:, :, :17], clean[:, :, :17])
    assert out[0, 1, 17:, 2].isnan().all() and torch.equal(out[0, 0], clean[0, 0])


@pytest.mark.parametrize("causal", [True, False])
def test_fullgraph_compile_traces_the_torch_path(causal):
    """Under ``torch.compile(fullgraph=True)`` the torch path traces one graph (whole-sequence
    features, the blocks' ops differentiated by autograd) that equals the eager blocked path,
    outputs and gradients, with padding and grouped heads."""
    torch._dynamo.reset()
    rf = make_rf("oprf", "orf", D=8).eval()
    q = rand(2, 4, 40, 8, seed=1, scale=0.8)
    k, v = rand(2, 2, 40, 8, seed=2, scale=0.8), rand(2, 2, 40, 3, seed=3)
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[1, 33:] = True

    def fn(q, k, v):
        return rfattn.rf_attention(q, k, v, rf, causal=causal, key_padding_mask=mask)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, ref = compiled(q, k, v), fn(q, k, v)
    assert rel_rms(out, ref) <= OUT
    for name, a, b in zip("qkv", grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
        assert rel_rms(a, b) <= GRAD, name


@pytest.mark.parametrize("causal", [True, False])
def test_kept_buffers_change_nothing_and_never_alias_a_result(tiny_blocks, causal, monkeypatch):
    """rfattn.workspace: the blocked forwards' projections and chunk states go to buffers kept
    across blocks and calls. Outputs, states and gradients are bitwise those of fresh tensors;
    a result of one call is not touched by the next; a second call of the same shapes takes no
    new buffer; clear() releases them."""
    from rfattn import workspace

    rf = make_rf("posrf", "orf")
    q1, k1, v1 = (rand(1, 4, 30, 6 if i < 2 else 3, seed=i).detach() for i in range(3))
    k1, v1 = k1[:, :2], v1[:, :2]  # grouped heads
    q2, k2, v2 = (x + 0.5 for x in (q1, k1, v1))
    kw = dict(causal=causal, return_state=causal)

    def call(q, k, v):
        res = rfattn.rf_attention(q, k, v, rf, **kw)
        return res if causal else (res,)

    workspace.clear()
    monkeypatch.setattr(workspace, "ENABLED", False)
    fresh = [call(q1, k1, v1), call(q2, k2, v2)]
    assert workspace.kept_bytes() == 0
    monkeypatch.setattr(workspace, "ENABLED", True)
    first = call(q1, k1, v1)
    kept = workspace.kept_bytes()
    assert kept > 0
    copies = [x.clone() for x in _flat(first)]
    second = call(q2, k2, v2)
    assert workspace.kept_bytes() == kept  # the same buffers again
    for a, b in zip(_flat(first), copies, strict=True):  # not overwritten by the second call
        assert torch.equal(a, b)
    for got, want in zip((first, second), fresh, strict=True):
        for a, b in zip(_flat(got), _flat(want), strict=True):
            assert torch.equal(a, b)
    # the backward (recomputing its blocks under autograd) is unchanged
    leaves = [x.clone().requires_grad_() for x in (q1, k1, v1)]
    out = call(*leaves)[0]
    g_kept = torch.autograd.grad(out.square().sum(), leaves)
    monkeypatch.setattr(workspace, "ENABLED", False)
    out = call(*leaves)[0]
    for a, b in zip(g_kept, torch.autograd.grad(out.square().sum(), leaves), strict=True):
        assert torch.equal(a, b)
    workspace.clear()
    assert workspace.kept_bytes() == 0


def _flat(res):
    return [t for x in res for t in (x if isinstance(x, tuple) else (x,))]


@pytest.mark.parametrize("w_shape", [(5, 6), (2, 5, 6), (1, 2, 1, 5, 6)])
def test_projection_recorded_into_a_kept_buffer_has_the_products_gradients(w_shape):
    """Inside the blocked backward (``workspace.blocks()`` with autograd recording) ``project``
    writes ``x W^T`` to a kept buffer through its own autograd Function; its gradients for x
    and for W, leading dims broadcast either way, are those of ``x @ W^T``."""
    from rfattn import workspace
    from rfattn.features.base import project

    x = rand(1, 2, 7, 6, seed=1)
    w = rand(*w_shape, seed=2)
    cot = rand(*torch.broadcast_shapes(x.shape[:-2], w.shape[:-2]), 7, 5, seed=3).detach()
    want = torch.autograd.grad((x @ w.transpose(-1, -2) * cot).sum(), (x, w))
    with workspace.blocks():
        got = project(x, w)
        assert got.grad_fn is not None and workspace.kept_bytes() >= got.nbytes
        got = torch.autograd.grad((got * cot).sum(), (x, w))
    workspace.clear()
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and rel_rms(a, b) <= OUT


def test_backprop_sets_a_blocks_rows_even_where_no_gradient_reaches_them():
    """The backwards leave dq, dk uninitialised and let each block set its own rows
    (``add_grads(..., assign=n)``): a leaf the features do not depend on gets zeros there, not
    whatever the memory held; accumulators after the first ``assign`` are added to."""
    x, y = rand(3, 2, seed=1), rand(3, 2, seed=2)
    feats = (y * 2.0,)
    rows = torch.full((3, 2), float("nan"), dtype=f64)
    acc_y = torch.ones(3, 2, dtype=f64)
    blocked.add_grads(feats, (torch.ones(3, 2, dtype=f64),), (x, y), (rows, acc_y), assign=1)
    assert torch.equal(rows, torch.zeros(3, 2, dtype=f64))
    assert torch.equal(acc_y, torch.full((3, 2), 3.0, dtype=f64))
    feats = (y * 2.0,)
    blocked.add_grads(feats, (torch.ones(3, 2, dtype=f64),), (y, x), (rows, None), assign=1)
    assert torch.equal(rows, torch.full((3, 2), 2.0, dtype=f64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_diff_is_exp_of_the_difference(dtype):
    """``exp_diff`` (exp2 of the log2-scaled difference; in place, into another tensor and
    recorded by autograd) equals ``exp(u - shift)``
    to a few roundings of the argument, across normal, underflowing (down to -1000) and
    non-finite arguments: 1 where u == shift (also at -1000: the difference is formed first),
    0 for -inf, NaN for NaN, and 0 for results below the dtype's smallest normal where exp gives
    a subnormal or 0."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(4, 3, 50, 40, generator=g, dtype=torch.float64) * 30 - 40
    shift = u.amax(dim=-1, keepdim=True)
    u[0, 0, 0, :3] = torch.tensor([-torch.inf, torch.nan, 2.0], dtype=torch.float64)
    u[0, 0, 0, 2] += shift[0, 0, 0, 0]
    u[1, 0, :, 0] = shift[1, 0, :, 0]
    u, shift = u.to(dtype), shift.to(dtype)
    u[2] += -1000.0
    shift[2] += -1000.0
    want = torch.exp(u.double() - shift.double())
    x = u.clone()
    got = exp_diff(x, shift, out=x)
    assert got is x
    for other in (exp_diff(u, shift, out=torch.empty_like(u)), exp_diff(u, shift)):
        # into another tensor, and the autograd form: the same values, bitwise (NaN included)
        torch.testing.assert_close(other, got, rtol=0, atol=0, equal_nan=True)
    eps = torch.finfo(dtype).eps
    arg = (u.double() - shift.double()).abs().nan_to_num(0.0, 0.0, 0.0)
    tiny = torch.finfo(dtype).tiny
    # exp2's own error (1 ulp) plus the scaled argument's rounding (|arg| eps), relative
    ok = (got.double() - want).abs() <= (2 + 2 * arg) * eps * want + tiny
    assert ok[~want.isnan()].all()
    assert got[0, 0, 0, 0] == 0 and got[0, 0, 0, 1].isnan() and got[0, 0, 0, 2] > 7  # e^2
    assert (got[1, 0, :, 0] == 1).all() and got.dtype == dtype


@pytest.mark.parametrize("empty", [False, True])
def test_chunk_decay_is_exp_of_each_keys_max_over_the_rows_offset(empty):
    """``Block.decay[i, j] = exp(m_j - r_i)`` for j <= i, 0 for j > i and for empty keys
    (m_j = -inf), with ``r_i = max(offset before the chunk, m_l for l <= i)``; a later key whose
    max is far above (overflowing exp) still gives 0, never NaN. Without empty keys the decay
    is capped and multiplied, with them selected: both hold the formula, and so do the
    per-chunk factors ``a``, ``e`` and ``step`` (plain exponentials without empty keys, an
    offset of -inf before the first key included)."""
    g = torch.Generator().manual_seed(3)
    C = blocked.CHUNK
    m = torch.randn(2, 3, 4, C, generator=g, dtype=torch.float64) * 5
    m[0, 0, 1, 40] = 900.0  # a later key far above: exp(900 - r_i) overflows
    off = torch.randn(2, 3, generator=g, dtype=torch.float64)
    if empty:
        m[1, 2, 0, :10] = -torch.inf  # the first keys empty, no offset before: r_i = -inf there
        off[1, 2] = -torch.inf
        m[0, 1, 2, 5] = -torch.inf
    off[0, 1] = -torch.inf  # no key before the block
    B, H, n = m.shape[:3]
    zeros = torch.zeros(B, H, n * C, 1, dtype=torch.float64)  # features: only the offsets matter
    o = blocked.Block(zeros, zeros, m.flatten(2), torch.zeros(B, H, n, C, 8, dtype=torch.float64),
                      torch.zeros(B, H, 8, 1, dtype=torch.float64), off, 1, 1)  # fmt: skip
    assert not o.dirty
    prev = torch.cummax(torch.cat((off[..., None], m.amax(-1)), dim=-1), dim=-1).values[..., :-1]
    r = torch.maximum(prev[..., None], torch.cummax(m, dim=-1).values)
    want = torch.zeros(2, 3, 4, C, C, dtype=torch.float64)
    for i in range(C):
        for j in range(i + 1):
            live = m[..., j] > -torch.inf
            want[..., i, j] = torch.where(live, torch.exp(m[..., j] - r[..., i]), 0.0)
    assert not o.decay.isnan().any()
    torch.testing.assert_close(o.decay, want, rtol=1e-13, atol=0)
    R = torch.cummax(torch.cat((off[..., None], m.amax(-1)), dim=-1), dim=-1).values[..., 1:]

    def exp_live(x, live):
        return torch.where(live, torch.exp(torch.where(live, x, 0.0)), 0.0)

    live_prev = prev > -torch.inf
    factors = {
        "a": (o.a, exp_live(prev[..., None] - r, live_prev[..., None])),
        "e": (o.e, exp_live(m - R[..., None], m > -torch.inf)),
        "step": (o.step[..., 0, 0], exp_live(prev - R, live_prev)),
    }
    for name, (got, want) in factors.items():
        assert not got.isnan().any(), name
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0, msg=name)


@pytest.mark.parametrize("grad", [False, "no_grad", True])
def test_causal_forwards_keep_block_quantities_only_for_a_backward(grad, tiny_blocks, monkeypatch):
    """The causal forwards keep each block's start state and intra-chunk products for the
    backward only: without autograd (inference, the sharded path's local states) nothing is
    kept, block after block, also for inputs that require grad under ``torch.no_grad()``
    ("no_grad"); with it, one of each per block, and the gradients are the reference's (those
    kept products are what the backward uses)."""
    recording = grad is True  # "no_grad": inputs that require grad, autograd off
    context = torch.no_grad() if grad == "no_grad" else contextlib.nullcontext()
    grad, kept = bool(grad), []
    scan = blocked.scan_forward

    def spy(*args):
        s, off, held = scan(*args)
        kept.append([len(x) for x in held])
        return s, off, held

    monkeypatch.setattr(blocked, "scan_forward", spy)
    q, k, v = (rand(1, 2, 30, 6 if i < 2 else 3, seed=i).requires_grad_(grad) for i in range(3))
    rf = make_rf("posrf", "orf")
    pq = rand(1, 2, 1, 30, 16, seed=5).detach().exp().requires_grad_(grad)
    u_k = rand(1, 2, 30, 16, seed=6).requires_grad_(grad)  # key logits: features exp(u_k)
    with context:
        out = rfattn.rf_attention(q, k, v, rf, causal=True)
        scanned, _ = blocked.causal_scan(pq, u_k, None, v, None, None)
    blocks = -(-30 // blocked.block_tokens(2, 16))  # B * H rows, F = 16 features
    assert blocks > 1
    assert kept == ([[blocks] * 3] * 2 if recording else [[0, 0, 0]] * 2)
    if recording:
        ref = reference(q, k, v, rf, True, None)
        for a, b in zip(grads(out, (q, k, v)), grads(ref, (q, k, v)), strict=True):
            assert rel_rms(a, b) <= GRAD
        want = linear_attention(pq[:, :, 0], u_k.exp(), v, causal=True)
        torch.testing.assert_close(scanned[:, :, 0], want, rtol=OUT, atol=0)
        wrt = (pq, u_k, v)
        for a, b in zip(grads(scanned[:, :, 0], wrt), grads(want, wrt), strict=True):
            assert rel_rms(a, b) <= GRAD


@pytest.fixture
def heads_split(monkeypatch):
    """Causal calls run their heads on two worker threads (rfattn.threads.over_heads) whatever
    their size; records whether each call that went through over_heads split (ran more than
    one part: a call that does not split runs its heads on the caller's thread)."""
    from rfattn import threads

    monkeypatch.setattr(threads, "HEADS_MIN_ELEMENTS", 0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    calls = []
    over = threads.over_heads

    def spy(fn, parts):
        calls.append(len(parts) > 1)
        return over(fn, parts)

    monkeypatch.setattr(threads, "over_heads", spy)
    yield calls
    torch.set_num_threads(before)


@pytest.mark.parametrize("feature, weights", [("posrf", "orf"), ("saderf", "orf")])
@pytest.mark.parametrize("groups", [1, 2])
def test_causal_heads_on_worker_threads_match_the_reference(feature, weights, groups,
                                                            tiny_blocks, heads_split):  # fmt: skip
    """Heads split over worker threads: outputs, the returned state and the gradients of q, k,
    v and the initial state are the reference's (float64), forward and backward both split."""
    B, Hk, T, D, E = 2, 3, 29, 6, 3
    rf = make_rf(feature, weights).eval()
    q = rand(B, Hk * groups, T, D, seed=1, scale=0.7)
    k, v = rand(B, Hk, T, D, seed=2, scale=0.7), rand(B, Hk, T, E, seed=3)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, [0, 5, 13]] = True
    mask[1, 20:] = True
    cut = 11  # a first call gives the initial state, so its gradient is checked too
    a, st = rfattn.rf_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], rf, causal=True,
                                key_padding_mask=mask[:, :cut], return_state=True)  # fmt: skip
    b = rfattn.rf_attention(q[:, :, cut:], k[:, :, cut:], v[:, :, cut:], rf, causal=True,
                            key_padding_mask=mask[:, cut:], initial_state=st)  # fmt: skip
    out = torch.cat((a, b), dim=2)
    ref = reference(q, k, v, rf, True, mask, groups)
    assert heads_split[:2] == [True, True]
    assert rel_rms(out, ref) <= OUT
    got, want = grads(out, (q, k, v)), grads(ref, (q, k, v))
    assert heads_split[2:] == [True, True]  # both backwards
    for name, x, y in zip("qkv", got, want, strict=True):
        assert rel_rms(x, y) <= GRAD, name


def test_causal_heads_on_worker_threads_sum_learnable_weights_gradient(tiny_blocks, heads_split):
    """A learnable W (fastfoodl) is shared by the heads: each worker's part of its gradient is
    summed."""
    q, k, v = (rand(2, 2, 21, 4, seed=i, scale=0.7) for i in range(3))
    rf = make_rf("posrf", "fastfoodl", D=4, M=16)
    out = rfattn.rf_attention(q, k, v, rf, causal=True)
    ref = reference(q, k, v, rf, True, None)
    params = [p for p in rf.parameters() if p.requires_grad]
    assert params and heads_split == [True]
    for x, y in zip(grads(out, params), grads(ref, params), strict=True):
        assert x.abs().sum() > 0 and rel_rms(x, y) <= GRAD


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_causal_heads_on_worker_threads_without_autograd(mode, tiny_blocks, heads_split):
    """The workers run in the caller's grad and inference modes: an inference-mode call (its
    output an inference tensor written by the workers) equals the reference."""
    q, k, v = (rand(1, 4, 23, 6, seed=i, scale=0.7).detach() for i in range(3))
    rf = make_rf("posrf", "orf").eval()
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        out, st = rfattn.rf_attention(q, k, v, rf, causal=True, return_state=True)
    with torch.no_grad():
        ref = reference(q, k, v, rf, True, None)
    assert heads_split == [True]
    assert rel_rms(out, ref) <= OUT
    assert st.s.shape[:2] == (1, 4) and torch.isfinite(st.s).all()


def test_causal_heads_stay_together_where_the_work_is_small(tiny_blocks, monkeypatch):
    """Below HEADS_MIN_ELEMENTS, with one intra-op thread, or with the split turned off, a call
    runs its heads together on the caller's thread; a split call's parts are contiguous head
    ranges, one per intra-op thread, and its workers run on one intra-op thread each."""
    from rfattn import threads

    q, k, v = (rand(1, 4, 23, 6, seed=i, scale=0.7).detach() for i in range(3))
    rf = make_rf("posrf", "orf").eval()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert threads.split_heads("cpu", 4, threads.HEADS_MIN_ELEMENTS)
        assert not threads.split_heads("cpu", 4, threads.HEADS_MIN_ELEMENTS - 1)
        assert not threads.split_heads("cpu", 1, threads.HEADS_MIN_ELEMENTS)
        assert threads.head_parts(5, True) == [(0, 2), (2, 5)]
        assert threads.head_parts(5, False) == [(0, 5)]
        # a worker's first parallel op must not put its count back to the caller's
        counts = threads.over_heads(
            lambda h0, h1: (torch.ones(1 << 17).sum(), torch.get_num_threads())[1], [(0, 1), (1, 2)]
        )
        assert counts == [1, 1] and torch.get_num_threads() == 2
        monkeypatch.setattr(threads, "HEADS_ENABLED", False)
        assert not threads.split_heads("cpu", 4, threads.HEADS_MIN_ELEMENTS)
        torch.set_num_threads(1)
        monkeypatch.setattr(threads, "HEADS_ENABLED", True)
        assert not threads.split_heads("cpu", 4, threads.HEADS_MIN_ELEMENTS)
    finally:
        torch.set_num_threads(before)
    with torch.no_grad():
        out = rfattn.rf_attention(q, k, v, rf, causal=True)
        assert rel_rms(out, reference(q, k, v, rf, True, None)) <= OUT


def test_clear_releases_the_worker_threads_kept_buffers(tiny_blocks, heads_split):
    """A split call's parts keep their buffers in their workers; workspace.clear() (what
    bench.memory calls before the call it measures) releases those too."""
    from rfattn import workspace

    q, k, v = (rand(1, 4, 23, 6, seed=i, scale=0.7).detach() for i in range(3))
    rf = make_rf("posrf", "orf").eval()
    workspace.clear()
    assert workspace.kept_bytes() == 0
    with torch.no_grad():
        rfattn.rf_attention(q, k, v, rf, causal=True)
    assert heads_split == [True]
    assert workspace.state.kept.bytes == 0 < workspace.kept_bytes()  # all in the workers
    workspace.clear()
    assert workspace.kept_bytes() == 0


@pytest.mark.parametrize("feature, weights", [("posrf", "orf"), ("saderf", "orf"),
                                              ("posrf", "fastfoodl")])  # fmt: skip
def test_noncausal_heads_on_worker_threads_match_the_reference(feature, weights, tiny_blocks,
                                                               heads_split):  # fmt: skip
    """Non-causal heads split over worker threads (more keys than queries, padded keys):
    outputs and the gradients of q, k, v and of a learnable W are the reference's. saderf's
    statistics of the call are per head (``[B, H, 1, D]``): nothing to slice them by, so that
    call is not split, and still right."""
    B, H, Tq, Tk, D, E = 2, 3, 17, 29, 6, 3
    rf = make_rf(feature, weights).eval()
    q = rand(B, H, Tq, D, seed=1, scale=0.7)
    k, v = rand(B, H, Tk, D, seed=2, scale=0.7), rand(B, H, Tk, E, seed=3)
    mask = torch.zeros(B, Tk, dtype=torch.bool)
    mask[0, [0, 5, 13]] = True
    mask[1, 20:] = True
    out = rfattn.rf_attention(q, k, v, rf, key_padding_mask=mask)
    ref = reference(q, k, v, rf, False, mask)
    split = feature != "saderf"
    assert heads_split == [True] * split
    assert rel_rms(out, ref) <= OUT
    inputs = (q, k, v, *(p for p in rf.parameters() if p.requires_grad))
    got, want = grads(out, inputs), grads(ref, inputs)
    assert heads_split == [True, True] * split
    assert (len(inputs) > 3) == (weights == "fastfoodl")  # its learnable W parts
    for i, (x, y) in enumerate(zip(got, want, strict=True)):
        assert x.abs().sum() > 0 and rel_rms(x, y) <= GRAD, i


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_forgets_its_parents_worker_pool(tiny_blocks, heads_split):
    """After a fork the parent's worker threads do not exist in the child: the child's pool
    starts empty (with the parent's, a split call there would wait forever for tasks that never
    run). Checked without torch ops in the child: GNU OpenMP is not fork-safe, and a child
    running a split call hung now and then on its own thread pool, not on ours."""
    import os

    from rfattn import threads

    q, k, v = (rand(1, 4, 23, 6, seed=i, scale=0.7).detach() for i in range(3))
    rf = make_rf("posrf", "orf").eval()
    with torch.no_grad():
        rfattn.rf_attention(q, k, v, rf, causal=True)  # the parent's pool exists now
    assert heads_split == [True] and threads.worker_pool["workers"] == 2
    pid = os.fork()
    if pid == 0:  # the child: exit 0 where the pool is empty and its lock free
        code = 1
        try:
            empty = threads.worker_pool["executor"] is None and threads.worker_pool["workers"] == 0
            code = 0 if empty and threads.pool_lock.acquire(blocking=False) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert threads.worker_pool["workers"] == 2  # the parent's own pool is untouched


def test_over_heads_raises_a_parts_error_after_every_part_is_done():
    """An error in one part is raised to the caller, only once the other parts have finished
    (they write into the caller's tensors)."""
    import time

    from rfattn import threads

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    done = []

    def part(h0, h1):
        if h0 == 0:
            raise ValueError("part 0")
        time.sleep(0.2)
        done.append(h0)

    try:
        with pytest.raises(ValueError, match="part 0"):
            threads.over_heads(part, [(0, 1), (1, 2)])
        assert done == [1]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("causal", [False, True])
def test_a_call_after_an_inference_mode_call_reuses_its_kept_buffers(causal, tiny_blocks):
    """Kept buffers made under inference mode are normal tensors: a later call outside it
    writes them in place (an inference tensor there raised), and both calls agree."""
    q, k, v = (rand(1, 2, 23, 6, seed=i, scale=0.7).detach() for i in range(3))
    rf = make_rf("posrf", "orf").eval()
    with torch.inference_mode():
        a = rfattn.rf_attention(q, k, v, rf, causal=causal)
    with torch.no_grad():
        b = rfattn.rf_attention(q, k, v, rf, causal=causal)
    assert torch.equal(a, b)


@pytest.mark.parametrize("feature, weights", CASES)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_one_input_alone_requires_grad(feature, weights, causal, tiny_blocks):
    """Only q, only k or only v requiring grad: its gradient equals the one from the call where
    all three do (before: plain features (rmf) in causal calls raised in the backward, 'element 1
    of tensors does not require grad', the other side's features being outside the graph)."""
    rf = make_rf(feature, weights).eval()
    B, H, T, D, E = 1, 2, 21, 6, 3
    xs = [rand(B, H, T, D if i < 2 else E, seed=i, scale=0.7).detach() for i in range(3)]
    do = rand(B, H, T, E, seed=7).detach()
    leaves = [x.clone().requires_grad_() for x in xs]
    out = rfattn.rf_attention(*leaves, rf, causal=causal, backend="torch")
    full = torch.autograd.grad(out, leaves, do)
    for i, name in enumerate("qkv"):
        one = [x.clone().requires_grad_(j == i) for j, x in enumerate(xs)]
        out = rfattn.rf_attention(*one, rf, causal=causal, backend="torch")
        (g,) = torch.autograd.grad(out, one[i], do)
        torch.testing.assert_close(g, full[i], rtol=1e-12, atol=1e-14, msg=name)


#: the most distinct functions of rfattn a torch-path forward+backward may enter
MAX_FUNCTIONS = 50


def _functions_entered(call) -> list[str]:
    """``file:name`` of each distinct function of rfattn's source (code objects: generator
    expressions and comprehensions included, module bodies not) that ``call()`` enters, in order
    of first entry: what ``python -m bench.callpath`` counts."""
    kernels = sys.modules.get("rfattn.kernels")  # (a folder of its own, where it is loaded)
    roots = tuple(os.path.dirname(m.__file__) + os.sep for m in (rfattn, kernels) if m)
    seen = {}

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code not in seen and code.co_name != "<module>":
            if code.co_filename.startswith(roots):
                seen[code] = f"{os.path.basename(code.co_filename)}:{code.co_qualname}"

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return list(seen.values())


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_a_torch_path_call_enters_few_functions(causal):
    """A posrf forward+backward on the torch path (``bench.callpath``'s call: no mask; here two
    heads and a partial last chunk) enters at most MAX_FUNCTIONS of rfattn's functions, as
    ``bench.callpath`` counts them: the blocked path is written as a few functions with plain
    loops, not a chain of small helpers and generator expressions (114 in the causal call
    before)."""
    rf = rfattn.RandomFeatures(8, 16, feature="posrf", seed=0)
    q, k, v = (rand(2, 2, 70, 8, seed=i, scale=0.5) for i in range(3))

    def call():
        rfattn.rf_attention(q, k, v, rf, causal=causal, backend="torch").sum().backward()

    call()  # lazy imports and first-call set-up stay out of the count
    functions = _functions_entered(call)
    assert len(functions) <= MAX_FUNCTIONS, "\n".join(functions)
    assert any("blocked.py:Block" in f for f in functions) == causal  # (the path it counts)
