"""The fused hybrid (``rfattn.fused.hybrid``): exact sinks and window inside the chunk kernels'
ratio, the features over the estimated keys' stream. float64 parity with the ``[T, T]``
reference and with the torch path (outputs, gradients, running statistics), on Triton or its
interpreter (the interpreter's chunks are 16 tokens: windows below, at and past a chunk)."""

import pytest
import torch

import rfattn
from rfattn.hybrid import (
    HybridState,
    empty_state,
    exact_terms,
    extend,
    hybrid_attention,
    hybrid_reference,
)

f64 = torch.float64


def inputs(B=2, H=4, Hk=2, T=37, D=8, E=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = 0.7 * torch.randn(B, H, T, D, generator=g, dtype=f64)
    k = 0.7 * torch.randn(B, Hk, T, D, generator=g, dtype=f64)
    v = torch.randn(B, Hk, T, E, generator=g, dtype=f64)
    return q, k, v


def features(name="posrf", **options):
    weights = "rademacher" if name == "rmf" else "orf"
    return rfattn.RandomFeatures(8, 16, feature=name, weights=weights, seed=3, **options).double()


def padding(B, T, *junk_into):
    """Left padding in batch 0, a hole in batch 1; NaN written into the padded keys' rows."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :5] = True
    mask[-1, 11:13] = True
    for x in junk_into:
        x.data.masked_fill_(mask[:, None, :, None], float("nan"))
    return mask


def check(feature, window, sinks, T=37, H=4, Hk=2, seed=0, **options):
    """The fused call (outputs and the gradients of q, k, v) equals ``hybrid_reference`` on the
    valid rows, in float64, with NaN junk in the padded keys."""
    q, k, v = inputs(H=H, Hk=Hk, T=T, seed=seed)
    rf = features(feature, **options).eval()
    mask = padding(2, T, k, v)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*leaves, rf, causal=True, window=window, sinks=sinks,
                              key_padding_mask=mask, backend="triton")  # fmt: skip
    clean = [q, *(x.masked_fill(mask[:, None, :, None], 0.0) for x in (k, v))]
    ref_leaves = [x.clone().requires_grad_() for x in clean]
    ref = hybrid_reference(*ref_leaves, rf, window=window, sinks=sinks, key_padding_mask=mask)
    ref = ref.masked_fill(mask[:, None, :, None], 0.0)  # padded queries: output 0
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=f64)
    grads = torch.autograd.grad(out, leaves, cot)
    ref_grads = torch.autograd.grad(ref, ref_leaves, cot)
    for name, g, r in zip("qkv", grads, ref_grads, strict=True):
        assert not g.isnan().any(), name
        torch.testing.assert_close(g, r, rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("window,sinks", [
    pytest.param(1, 0, marks=pytest.mark.slow), pytest.param(0, 2, marks=pytest.mark.slow), (5, 2),
    pytest.param(16, 1, marks=pytest.mark.slow), pytest.param(40, 3, marks=pytest.mark.slow),
])  # fmt: skip
def test_posrf_matches_the_reference(window, sinks):
    """Windows of one token, none, below, at and past a chunk (and past the sequence: softmax
    on the valid keys); grouped-query heads, padding with NaN junk."""
    check("posrf", window, sinks)


@pytest.mark.slow  # ~6 s each under the interpreter
@pytest.mark.parametrize("feature,options", [
    ("trigrf", {}), ("hrf", {}), ("gerf", {"A": -0.1}), ("gerf", {"A": 0.05j, "s": -1}),
    ("hyprf", {}), ("rmf", {}),
])  # fmt: skip
def test_every_fused_form_matches_the_reference(feature, options):
    check(feature, 5, 2, T=40, **options)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 15, 16, 17, 33])
def test_awkward_lengths(T):
    """A sequence of one token, one short of a chunk, a chunk, one past it; the window ending
    on a chunk boundary (T = 33: rows 32.. see keys from 2 chunks back)."""
    check("posrf", 16, 2, T=T, H=2, Hk=1)


@pytest.mark.parametrize("feature", ["oprf", pytest.param("saderf", marks=pytest.mark.slow)])
def test_statistics_forms_equal_the_torch_path(feature):
    """oprf/saderf in training (running statistics moved by the call): outputs, gradients and
    the moved buffers equal the torch path's hybrid in float64."""
    q, k, v = inputs(T=24, seed=2)
    mask = padding(2, 24, k, v)
    rfs = [features(feature, stats="running").train() for _ in range(2)]
    grads = []
    for rf, backend in zip(rfs, ("torch", "triton"), strict=True):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = rfattn.rf_attention(*leaves, rf, causal=True, window=4, sinks=2,
                                  key_padding_mask=mask, backend=backend)  # fmt: skip
        grads.append((out, *torch.autograd.grad(out.square().sum(), leaves)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), *grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-11, msg=name)
    for (name, a), b in zip(rfs[0].feature_map.named_buffers(), rfs[1].feature_map.buffers(),
                            strict=True):  # fmt: skip
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14, msg=name)


def test_statistics_of_head_mapped_inputs_equal_the_torch_path():
    """oprf in training with head maps: the statistics are those of the mapped q and k (moved
    into the running buffers alike), outputs equal the torch path's in float64."""
    q, k, v = inputs(T=24, seed=3)
    rfs = [features("oprf", stats="running").train() for _ in range(2)]
    g = torch.Generator().manual_seed(6)
    for rf in rfs:
        rf.add_head_maps(4, 2)
    with torch.no_grad():
        for m in (rfs[0].query_map, rfs[0].key_map):
            m.add_(0.3 * torch.randn(m.shape, generator=g, dtype=f64))
    rfs[1].load_state_dict(rfs[0].state_dict())
    outs = [rfattn.rf_attention(q, k, v, rf, causal=True, window=4, sinks=2, backend=backend)
            for rf, backend in zip(rfs, ("torch", "triton"), strict=True)]  # fmt: skip
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-9, atol=1e-11)
    for (name, a), b in zip(rfs[0].feature_map.named_buffers(), rfs[1].feature_map.buffers(),
                            strict=True):  # fmt: skip
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-14, msg=name)


def test_no_output_depends_on_a_later_token():
    """Not even through underflow: later keys with huge logits and values leave every earlier
    row bit for bit unchanged; a NaN value reaches its own and later rows only."""
    q, k, v = inputs(H=2, Hk=1, T=40, seed=5)
    rf = features().eval()
    run = lambda q, k, v: rfattn.rf_attention(q, k, v, rf, causal=True, window=4, sinks=1,  # noqa: E731
                                              backend="triton")  # fmt: skip
    base = run(q, k, v)
    t = 21
    k2, v2, q2 = k.clone(), v.clone(), q.clone()
    k2[:, :, t:] = 40.0 * torch.randn_like(k2[:, :, t:])
    v2[:, :, t:] = 1e6
    q2[:, :, t:] = -q2[:, :, t:]
    other = run(q2, k2, v2)
    assert torch.equal(other[:, :, :t], base[:, :, :t])
    assert not torch.equal(other[:, :, t:], base[:, :, t:])
    v3 = v.clone()
    v3[:, :, t, 0] = float("nan")
    nan = run(q, k, v3)
    assert torch.equal(nan[:, :, :t], base[:, :, :t])
    assert nan[:, :, t:].isnan().any(-1).all()


def test_exact_terms_are_the_exact_part():
    """The exact terms' ratio alone is softmax over the sinks and the window (the hybrid with
    no estimated key: a window past the sequence)."""
    q, k, v = inputs(T=20)
    mask = padding(2, 20, k, v)
    rf = features().eval()
    ext = extend(empty_state(k, v, rf, 20, 2), k, v, mask, 2)
    num, den, off = exact_terms(q, ext, 20, 8**-0.5, block=8)
    clean = [x.masked_fill(mask[:, None, :, None], 0.0) for x in (k, v)]
    want = hybrid_attention(q, *clean, rf, window=20, sinks=2, key_padding_mask=mask)
    got = (num / den[..., None]).masked_fill(mask[:, None, :, None], 0.0)
    torch.testing.assert_close(got, want.masked_fill(mask[:, None, :, None], 0.0), rtol=1e-12,
                               atol=1e-12)  # fmt: skip
    assert off.shape == den.shape == (2, 4, 20) and num.shape == (2, 4, 20, 5)


@pytest.mark.parametrize("window,sinks,before", [(5, 2, 0), (5, 2, 9), (20, 0, 0), (0, 3, 4)])
def test_exact_part_kernels_equal_the_torch_exact_terms(window, sinks, before):
    """``ops.rf_local`` (the exact part's kernels) equals ``exact_terms`` in float64: num, den,
    off and the gradients of q, the extended keys and values and the sink slots; after a state
    of ``before`` tokens, with padding and NaN junk, grouped heads, windows and sinks absent."""
    from rfattn import ops

    q, k, v = inputs(T=37, seed=13)
    mask = padding(2, 37, k, v)
    rf = features().eval()
    st = empty_state(k, v, rf, window, sinks)
    if before:
        first = inputs(T=before, seed=14)
        st = rfattn.rf_attention(*first, rf, causal=True, window=window, sinks=sinks,
                                 return_state=True, backend="torch")[1]  # fmt: skip
    ext = extend(st, k, v, mask, sinks)
    fields = ("keys", "values", "sink_keys", "sink_values")
    cots = None
    results = []
    for fn in (lambda q, e: exact_terms(q, e, window, 8**-0.5, block=8),
               lambda q, e: ops.rf_local(q, e, window, 8**-0.5)):  # fmt: skip
        leaves = [q.clone().requires_grad_(), *(getattr(ext, f).clone().requires_grad_()
                                                for f in fields)]  # fmt: skip
        num, den, off = fn(leaves[0], ext._replace(**dict(zip(fields, leaves[1:], strict=True))))
        if cots is None:
            g = torch.Generator().manual_seed(5)
            cots = [torch.randn(x.shape, generator=g, dtype=f64) for x in (num, den)]
        loss = (num.nan_to_num(0.0) * cots[0]).sum() + (den * cots[1]).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        results.append((num, den, off, *(torch.zeros_like(x) if d is None else d
                                          for d, x in zip(grads, leaves, strict=True))))
    names = ("num", "den", "off", "dq", *(f"d{f}" for f in fields))
    for name, a, b in zip(names, *results, strict=True):
        if name == "off":
            assert torch.equal(a.isinf(), b.isinf())
            a, b = a.masked_fill(a.isinf(), 0.0), b.masked_fill(b.isinf(), 0.0)
        if name.startswith("d") and name not in ("dq", "den"):  # junk rows: no gradient
            a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.slow
def test_half_inputs_stay_close_to_float64():
    """bf16 and fp16 inputs (the half policy's products) err at most 1.5x (outputs) and 2.5x
    (gradients) the torch path's own error in the same dtype, against float64 on the same
    weights: test_precision's rule for the chunk kernels (measured here: outputs 1.07x, dq /
    dv 1.4x, dk 2.0x in bf16, the chunk kernels' dk most of it)."""
    q, k, v = inputs(H=2, Hk=1, T=40, seed=17)
    rf = features().eval()
    kw = dict(causal=True, window=6, sinks=2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = rfattn.rf_attention(*leaves, rf, backend="torch", **kw)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2), dtype=f64)
    ref_grads = torch.autograd.grad(ref, leaves, cot)
    for dtype in (torch.bfloat16, torch.float16):
        errors = {}
        for backend in ("torch", "triton"):
            low = [x.to(dtype).requires_grad_() for x in (q, k, v)]
            out = rfattn.rf_attention(*low, rf.float(), backend=backend, **kw)
            grads = torch.autograd.grad(out, low, cot.to(dtype))
            errors[backend] = [rfattn.testing.rel_rms(a, b)
                               for a, b in zip((out, *grads), (ref, *ref_grads), strict=True)]
        for name, fused, torch_path in zip(("out", "dq", "dk", "dv"), errors["triton"],
                                           errors["torch"], strict=True):  # fmt: skip
            assert fused <= (1.5 if name == "out" else 2.5) * torch_path, \
                (dtype, name, fused, torch_path)  # fmt: skip
        rf.double()


def _leaf_state(state):
    """A HybridState whose floating tensors are fresh leaves that require grad."""
    return HybridState(*(x.detach().clone().requires_grad_() if x.is_floating_point() and
                         i != 2 else x for i, x in enumerate(state)))  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("feature", ["posrf", "trigrf"])
def test_split_resume_and_states_equal_the_torch_path(feature):
    """A call split in three (the last cut token by token) equals one call, on the fused kernels
    and on the torch path alike; the states, and the gradients of q, k, v and of every tensor
    of the initial state, equal the torch path's in float64 (padding with NaN junk, grouped
    heads, sinks filled across the cuts)."""
    q, k, v = inputs(T=30, seed=11)
    mask = torch.zeros(2, 30, dtype=torch.bool)  # batch 0: its sinks in the first part
    mask[1, 1:4] = True  # batch 1: its sinks across the first cut
    mask[1, 11:13] = True
    for x in (k, v):
        x.masked_fill_(mask[:, None, :, None], float("nan"))
    rf = features(feature).eval()
    cuts = [(0, 3), (3, 26), *((t, t + 1) for t in range(26, 30))]
    results = {}
    for backend in ("torch", "triton"):
        st, outs = None, []
        for a, b in cuts:
            kw = dict(key_padding_mask=mask[:, a:b], initial_state=st, return_state=True)
            o, st = rfattn.rf_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], rf,
                                        causal=True, window=5, sinks=3, backend=backend,
                                        **kw)  # fmt: skip
            outs.append(o)
        one = rfattn.rf_attention(q, k, v, rf, causal=True, window=5, sinks=3,
                                  key_padding_mask=mask, backend=backend)  # fmt: skip
        torch.testing.assert_close(torch.cat(outs, 2), one, rtol=1e-9, atol=1e-10)
        results[backend] = (one, st)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-9, atol=1e-10)
    for name, a, b in zip(HybridState._fields, results["triton"][1], results["torch"][1],
                          strict=True):  # fmt: skip
        if name in ("keys", "values"):  # junk (NaN) where kinds says nothing
            keep = (results["torch"][1].kinds != 0)[:, None, :, None]
            a, b = a.masked_fill(~keep, 0.0), b.masked_fill(~keep, 0.0)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
    # gradients through an initial state (the state after 12 tokens) into the rest
    first = rfattn.rf_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], rf, causal=True,
                                window=5, sinks=3, key_padding_mask=mask[:, :12],
                                return_state=True)[1]  # fmt: skip
    cot = torch.randn(2, 4, 18, 5, generator=torch.Generator().manual_seed(3), dtype=f64)
    grads = {}
    for backend in ("torch", "triton"):
        st = _leaf_state(first)
        leaves = [x[:, :, 12:].clone().requires_grad_() for x in (q, k, v)]
        out, last = rfattn.rf_attention(*leaves, rf, causal=True, window=5, sinks=3,
                                        key_padding_mask=mask[:, 12:], initial_state=st,
                                        return_state=True, backend=backend)  # fmt: skip
        loss = (out * cot).sum() + last.s.square().sum() + last.z.sum()
        wrt = [*leaves, *(x for x in st if x.requires_grad)]
        grads[backend] = torch.autograd.grad(loss, wrt, allow_unused=True)
    names = ["q", "k", "v", *(n for n, x in zip(HybridState._fields, first, strict=True)
                              if x.is_floating_point() and n != "offset")]  # fmt: skip
    for name, a, b in zip(names, grads["triton"], grads["torch"], strict=True):
        a, b = (torch.zeros(()) if x is None else x.nan_to_num(0.0) for x in (a, b))
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)


def test_head_maps_map_the_features_only():
    """Calibrated head maps map the features' q and k (the exact part takes them as they are):
    outputs and the gradients of q, k, v and both maps equal the reference's in float64."""
    q, k, v = inputs(T=30, seed=7)
    rf = features().eval()
    rf.add_head_maps(4, 2)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in (rf.query_map, rf.key_map):
            m.add_(0.3 * torch.randn(m.shape, generator=g, dtype=f64))
    maps = [rf.query_map, rf.key_map]
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*leaves, rf, causal=True, window=4, sinks=2, backend="triton")
    cot = torch.randn(out.shape, generator=g, dtype=f64)
    grads = torch.autograd.grad(out, [*leaves, *maps], cot)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = hybrid_reference(*ref_leaves, rf, window=4, sinks=2)
    ref_grads = torch.autograd.grad(ref, [*ref_leaves, *maps], cot)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    for name, a, b in zip(("q", "k", "v", "query_map", "key_map"), grads, ref_grads,
                          strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)


def test_packed_sequences_are_separate_calls():
    """Packed documents (cu_seqlens, one empty) with window and sinks on the fused hybrid equal
    one torch-path call per document in float64, outputs and gradients."""
    from rfattn import fused

    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 5, 14, 14, 33])
    q, k, v = (torch.randn(1, h, 33, d, generator=g, dtype=f64)
               for h, d in ((4, 8), (2, 8), (2, 5)))  # fmt: skip
    rf = features().eval()
    calls = []
    hybrid = fused.hybrid
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "hybrid", lambda call: calls.append(call) or hybrid(call))
        out = rfattn.rf_attention(*leaves, rf, causal=True, window=3, sinks=2, cu_seqlens=cu,
                                  backend="triton")  # fmt: skip
    assert calls  # the fused hybrid ran
    cot = torch.randn(out.shape, generator=g, dtype=f64)
    grads = torch.autograd.grad(out, leaves, cot)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    parts = [rfattn.rf_attention(*(x[:, :, a:b] for x in ref_leaves), rf, causal=True, window=3,
                                 sinks=2, backend="torch")
             for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True) if b > a]  # fmt: skip
    ref = torch.cat(parts, 2)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    for name, a, b in zip("qkv", grads, torch.autograd.grad(ref, ref_leaves, cot), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)


def test_a_cpu_without_triton_runs_the_torch_paths_hybrid(monkeypatch):
    """backend='triton' where the operators run their torch kernels (a CPU without Triton's
    interpreter): the hybrid runs the torch path's, as those kernels would, not the fused one."""
    from rfattn import fused, ops

    monkeypatch.setattr(ops, "TORCH_ON_CPU", True)
    monkeypatch.setattr(fused, "hybrid", lambda call: pytest.fail("the fused hybrid ran"))
    q, k, v = inputs(T=20)
    rf = features().eval()
    out = rfattn.rf_attention(q, k, v, rf, causal=True, window=4, sinks=2, backend="triton")
    want = rfattn.rf_attention(q, k, v, rf, causal=True, window=4, sinks=2, backend="torch")
    assert torch.equal(out, want)


def test_what_runs_the_torch_path_is_refused_on_triton():
    """backend='triton' names why a hybrid call cannot run fused; 'auto' runs the torch path."""
    q, k, v = inputs(T=12)
    rf = features().eval()
    with pytest.raises(NotImplementedError, match="non-causal window and sinks"):
        rfattn.rf_attention(q, k, v, rf, window=3, backend="triton")


@pytest.fixture
def counted_launches(monkeypatch):
    """Triton launches by kernel name (run as usual)."""
    import collections

    from triton.runtime import interpreter

    seen, run = collections.Counter(), interpreter.InterpretedFunction.run

    def counting(self, *args, **kwargs):
        seen[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counting)
    return seen


@pytest.mark.parametrize("feature,window,sinks,prefill,maps", [
    ("posrf", 0, 2, 1, False),  # no window: the token itself joins the features or the sinks
    ("posrf", 1, 0, 6, False),
    ("posrf", 5, 3, 2, False),  # sinks still filling during the steps
    ("posrf", 5, 2, 12, True),  # head maps: the features' q and leaving key mapped in the kernel
    ("posrf", 40, 3, 12, False),  # a window past the sequence: exact softmax
    pytest.param("trigrf", 5, 2, 12, False, marks=pytest.mark.slow),
    pytest.param("rmf", 5, 2, 12, False, marks=pytest.mark.slow),
])  # fmt: skip
def test_decode_steps_are_one_launch_each_and_equal_the_torch_path(
    feature, window, sinks, prefill, maps, counted_launches
):  # fmt: skip
    """Generation after a prefill, one token a call under no_grad: each step is one launch
    (the recurrent step with the window and the sinks), and over four steps its outputs and
    every field of its states equal the torch path's in float64 (grouped-query heads; batch
    1's second token padded, with NaN junk in it and in a padded key of the prefill)."""
    q, k, v = inputs(T=prefill + 4, seed=5)
    mask = torch.zeros(2, prefill + 4, dtype=torch.bool)
    mask[1, prefill + 1] = True
    mask[0, prefill - 1] = prefill > 1
    for x in (k, v):
        x.masked_fill_(mask[:, None, :, None], float("nan"))
    rf = features(feature).eval()
    if maps:
        rf.add_head_maps(4, 2)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for m in (rf.query_map, rf.key_map):
                m.add_(0.3 * torch.randn(m.shape, generator=g, dtype=f64))
    kw = dict(causal=True, window=window, sinks=sinks, return_state=True)
    _, st0 = rfattn.rf_attention(q[:, :, :prefill], k[:, :, :prefill], v[:, :, :prefill], rf,
                                 key_padding_mask=mask[:, :prefill], backend="torch",
                                 **kw)  # fmt: skip
    results = {}
    for backend in ("torch", "triton"):
        st, outs = st0, []
        counted_launches.clear()
        for t in range(prefill, prefill + 4):
            s = slice(t, t + 1)
            with torch.no_grad():  # as generation runs (the head maps are parameters)
                o, st = rfattn.rf_attention(q[:, :, s], k[:, :, s], v[:, :, s], rf,
                                            initial_state=st, key_padding_mask=mask[:, s],
                                            backend=backend, **kw)  # fmt: skip
            outs.append(o)
        results[backend] = (torch.cat(outs, 2), st, dict(counted_launches))
    assert results["triton"][2] == {"_recurrent_kernel": 4}
    assert not results["triton"][0].isnan().any()
    torch.testing.assert_close(results["triton"][0], results["torch"][0], rtol=1e-9, atol=1e-10)
    ours, theirs = results["triton"][1], results["torch"][1]
    for name, a, b in zip(HybridState._fields, ours, theirs, strict=True):
        if name in ("keys", "values"):  # junk where kinds says nothing
            keep = (theirs.kinds != 0)[:, None, :, None]
            a, b = a.masked_fill(~keep, 0.0), b.masked_fill(~keep, 0.0)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)


def test_a_decode_step_reads_what_a_row_reads():
    """NaN in a window key's value reaches the step's rows (they read it) and no other batch
    row; a NaN in a padded token reaches nothing."""
    q, k, v = inputs(T=9, seed=4)
    rf = features().eval()
    kw = dict(causal=True, window=4, sinks=1, return_state=True)
    v[0, 1, 6, 2] = float("nan")  # batch 0, head 1: inside the last step's window
    _, st = rfattn.rf_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], rf, backend="torch", **kw)
    mask = torch.tensor([[False], [True]])
    k[1, :, 8], v[1, :, 8] = float("nan"), float("nan")
    out, st = rfattn.rf_attention(q[:, :, 8:], k[:, :, 8:], v[:, :, 8:], rf, initial_state=st,
                                  key_padding_mask=mask, backend="triton", **kw)  # fmt: skip
    bad = out.isnan()
    assert bad[0, 2:4, 0, 2].all() and bad.sum() == 2  # heads 2, 3 read key/value head 1
    assert torch.equal(st.kinds[1, -1], torch.tensor(0, dtype=torch.int8))


@pytest.mark.slow  # ~14 s under the interpreter (make test-slow)
def test_compiled_hybrid_runs_the_operators():
    """``torch.compile(fullgraph=True)`` of a hybrid call on the fused path traces the hybrid's
    operators (the exact part, the output walk with the exact terms; the decode step for a
    generation step), no graph break: outputs, gradients and states equal the eager call's in
    float64 (padding with NaN junk, grouped-query heads)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, v = inputs(T=20, seed=8)
    mask = padding(2, 20, k, v)
    rf = features().eval()
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def call(a, b, c, m, st=None):
        return rfattn.rf_attention(a, b, c, rf, causal=True, window=5, sinks=2,
                                   key_padding_mask=m, initial_state=st, return_state=True,
                                   backend="triton")  # fmt: skip

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(call, fullgraph=True, backend=counter)
    leaves = [x[:, :, :19].clone().requires_grad_() for x in (q, k, v)]
    out, st = compiled(*leaves, mask[:, :19])
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=f64)
    grads = torch.autograd.grad((out * cot).sum() + st.s.sum(), leaves)
    ref_leaves = [x[:, :, :19].clone().requires_grad_() for x in (q, k, v)]
    ref, ref_st = call(*ref_leaves, mask[:, :19])
    ref_grads = torch.autograd.grad((ref * cot).sum() + ref_st.s.sum(), ref_leaves)
    assert counter.frame_count == 1
    assert any("rfattn.local" in o for o in seen) and any("chunk_hybrid" in o for o in seen), seen
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)
    seen.clear()
    with torch.no_grad():  # a generation step: the decode operator
        one = [x[:, :, 19:] for x in (q, k, v)]
        got, got_st = compiled(*one, mask[:, 19:], st)
        want, want_st = call(*one, mask[:, 19:], ref_st)
    assert any("hybrid_decode" in o for o in seen), seen
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    for name, a, b in zip(HybridState._fields, got_st, want_st, strict=True):
        if name in ("keys", "values"):
            keep = (want_st.kinds != 0)[:, None, :, None]
            a, b = a.masked_fill(~keep, 0.0), b.masked_fill(~keep, 0.0)
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13, msg=name)


@pytest.mark.parametrize("window,sinks", [(5, 3), (0, 2), (6, 0)], ids=["both", "sinks", "window"])
def test_decode_from_a_pool_of_hybrid_states(window, sinks):
    """The hybrid's decode step from a pool of P states (``state_index``: a server's requests of
    different ages, one repeated; grouped-query heads; sinks still filling in some): outputs
    and every field of the new ``[B, ...]`` states equal the step from those states gathered
    (the same kernel on copies), bit for bit, and the pool is left as it was."""
    from rfattn import ops
    from rfattn.call import state_rows
    from rfattn.fused import kernel_form

    rf = features().eval()
    P, T = 4, 9
    q, k, v = inputs(B=P, T=T + 1, seed=6)
    mask = torch.zeros(P, T, dtype=torch.bool)  # requests of different ages (sinks filling)
    for row, n in enumerate((8, 6, 0, 3)):
        mask[row, :n] = True
    _, pool = rfattn.rf_attention(q[:, :, :T], k[:, :, :T], v[:, :, :T], rf, causal=True,
                                  key_padding_mask=mask, window=window, sinks=sinks,
                                  return_state=True, backend="torch")  # fmt: skip
    index = torch.tensor([3, 0, 3])  # (no row its own: a kernel reading row b fails)
    step = (q[index, :, T:], k[index, :, T:], v[index, :, T:])
    form = kernel_form(rf, *step[:2], None, 8**-0.5, True)
    inv_n = 1.0 / float(rf.feature_map.num_samples(rf.weight))
    before = tuple(x.clone() for x in pool)
    out, new = ops.rf_hybrid_decode(*step, form, 8**-0.5, None, pool, window, sinks, inv_n,
                                    state_index=index)  # fmt: skip
    ref, ref_new = ops.rf_hybrid_decode(*step, form, 8**-0.5, None, state_rows(pool, index),
                                        window, sinks, inv_n)  # fmt: skip
    assert torch.equal(out, ref)
    for name, a, b, x, x0 in zip(HybridState._fields, new, ref_new, pool, before, strict=True):
        assert a.shape == b.shape and a.shape[0] == 3, name
        assert torch.equal(a, b), name
        assert torch.equal(x, x0), name  # the pool untouched
    with pytest.raises(RuntimeError, match="state_index must lie in"):
        ops.rf_hybrid_decode(*step, form, 8**-0.5, None, pool, window, sinks, inv_n,
                             state_index=torch.tensor([2, 4, 0]))  # fmt: skip
