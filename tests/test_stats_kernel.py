"""The fused stats pass (kernels/stats.py) against ``rfattn.stats.sequence_moments``, and the
oprf/saderf parameters the triton path derives from it."""

import copy

import pytest
import torch

import rfattn
from rfattn.stats import Moments, sequence_moments
from rfattn.testing import rel_rms, tolerance


def rand(*shape, seed=0, scale=1.0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(device, dtype)


CASES = [  # B, H, Tq, Tk, D, masked
    (1, 1, 1, 1, 16, False),
    (2, 3, 63, 63, 24, True),
    (2, 1, 40, 300, 16, True),  # Tq != Tk: the mask is the keys' only; two key splits
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}-H{}-Tq{}-Tk{}-D{}-mask{}".format(*c))
def test_moments_match_sequence_moments(case, dtype, kernel_device):
    from rfattn.kernels.stats import stats_pass

    B, H, Tq, Tk, D, masked = case
    scale = 0.3
    q = rand(B, Tq, H, D, seed=1, dtype=dtype, device=kernel_device).transpose(1, 2)  # strided
    k = rand(B, H, Tk, D, seed=2, scale=2.0, dtype=dtype, device=kernel_device) + 0.5
    mask = None
    if masked:
        mask = torch.rand(B, Tk, generator=torch.Generator().manual_seed(3)) < 0.3
        mask[-1] = True  # a batch element with no valid token: means 0, min 0
        mask = mask.to(kernel_device)
        k[mask[:, None, :, None].expand_as(k)] = float("nan")  # padded content is never read
    got = stats_pass(q, k, scale, mask).moments
    x64 = [x.double() * scale**0.5 for x in (q, k)]
    if mask is not None:
        x64[1] = x64[1].masked_fill(mask[:, None, :, None], 0.0)
    want = sequence_moments(*x64, mask)
    tol = tolerance(dtype)
    for name, a, b in zip(Moments._fields, got, want, strict=True):
        assert a.dtype == dtype and a.shape == (B, H, 2, D), name
        assert rel_rms(a, b) <= tol, (name, rel_rms(a, b))


def test_empty_sequences(kernel_device):
    from rfattn.kernels.stats import stats_pass

    x = rand(2, 2, 0, 8, device=kernel_device)
    zeros = torch.zeros(2, 2, 2, 8, device=x.device)
    assert all(torch.equal(t, zeros) for t in stats_pass(x, x, 0.5).moments)


@pytest.mark.parametrize("feature", ["oprf", "saderf"])
@pytest.mark.parametrize("stats", ["global", "running"])
def test_feature_parameters_from_the_stats_pass(feature, stats, kernel_device):
    """The triton path's A, B, psi (formed by the stats pass in its launch) equal the
    torch path's, and a running-mode call in training updates the buffers identically."""
    from rfattn.fused import kernel_form

    B, H, T, D = 2, 2, 50, 16
    q = rand(B, H, T, D, seed=1, device=kernel_device)
    k = rand(B, H, T, D, seed=2, scale=0.5, device=kernel_device)
    k[..., :3] *= 4.0
    mask = (torch.rand(B, T, generator=torch.Generator().manual_seed(2)) < 0.3).to(kernel_device)
    rf = rfattn.RandomFeatures(D, 16, feature=feature, stats=stats, seed=0).to(kernel_device)
    rf_torch = copy.deepcopy(rf)
    if stats == "running":  # one training step each, then the eval parameters from the buffers
        rf.train(), rf_torch.train()
        kernel_form(rf, q, k, mask, 0.25, causal=False)
        rf_torch.feature_params(q * 0.5, k * 0.5, mask)
        for name in Moments._fields:
            a = getattr(rf.feature_map, f"running_{name}")
            b = getattr(rf_torch.feature_map, f"running_{name}")
            assert rel_rms(a, b) <= 1e-6, name
        rf.eval(), rf_torch.eval()
    form = kernel_form(rf, q, k, mask, 0.25, causal=False)
    ab, psi = form.coeffs, form.psi
    p = rf_torch.feature_params(q * 0.5, k * 0.5, mask)
    # per (b, h) from this call's statistics; a kept form's (eval, running) broadcast, laid
    # out per call shape once by the launchers (kernels.common.form_args)
    assert ab.shape == ((1, 1, 3) if stats == "running" else (B, H, 3))
    want = torch.cat((p["A"], p["B"], p["log_D"]), dim=-1).flatten(-2)
    assert rel_rms(ab.expand(B, H, 3), want.expand(B, H, 3)) <= 1e-6
    if feature == "saderf":
        got, ref = psi.expand(B, H, D), p["psi"].squeeze(-2).expand(B, H, D)
        assert rel_rms(got, ref) <= 1e-6
    assert float(p["A"].abs().max()) > 1e-3  # the statistics are not trivial


def _torch_coeffs(rf, q, k, mask, scale, causal=False, qmask=None, maps=None):
    """``(coeffs [.., 3], psi or None)`` of the torch path's parameters for the call."""
    from rfattn.torch_path import torch_inputs

    *_, p = torch_inputs(q, k, rf, mask, scale, causal, qmask, maps=maps)
    psi = p.get("psi")
    coeffs = torch.cat((p["A"], p["B"], p["log_D"]), dim=-1).flatten(-2)
    return coeffs, None if psi is None else psi.squeeze(-2)


def _assert_form_params(form, want, feature, tol=1e-13):
    coeffs, psi = want
    assert form.coeffs.dtype == torch.float64
    assert rel_rms(form.coeffs, coeffs.expand_as(form.coeffs)) <= tol
    if feature == "saderf":
        assert rel_rms(form.psi, psi.expand_as(form.psi)) <= tol
    else:
        assert form.psi is None


def _gqa_inputs(device, B=2, Hq=4, H=2, Tq=37, Tk=300, D=8):
    """Strided grouped-query q, shifted keys, key and query masks with one batch element whose
    keys are all padded (an empty (b, h) row on the key side)."""
    q = rand(B, Tq, Hq, D, seed=1, dtype=torch.float64, device=device).transpose(1, 2)
    k = rand(B, H, Tk, D, seed=2, scale=0.7, dtype=torch.float64, device=device) + 0.3
    g = torch.Generator().manual_seed(4)
    kmask = torch.rand(B, Tk, generator=g) < 0.3
    kmask[1] = True
    qmask = torch.rand(B, Tq, generator=g) < 0.2
    return q, k, kmask.to(device), qmask.to(device)


@pytest.mark.parametrize("feature", ["oprf", "saderf"])
@pytest.mark.parametrize("maps", [False, True], ids=["plain", "head_maps"])
def test_stats_pass_parameters_equal_the_torch_paths_float64(feature, maps, kernel_device):
    """The parameters the stats pass forms in its own launch (global statistics) equal the torch
    path's ``feature_params`` in float64: padded keys and queries left out, grouped-query query
    rows (q strided: read in place), a (b, h) without a valid key, head maps' mapped q and k."""
    from rfattn.fused import kernel_form

    q, k, kmask, qmask = _gqa_inputs(kernel_device)
    D = q.shape[-1]
    rf = rfattn.RandomFeatures(D, 16, feature=feature, seed=0).double().to(kernel_device)
    mt = None
    if maps:
        rf.add_head_maps(q.shape[1], k.shape[1])
        with torch.no_grad():
            for m, s in ((rf.query_map, 5), (rf.key_map, 6)):
                m.add_(0.3 * rand(*m.shape, seed=s, dtype=m.dtype, device=kernel_device))
        mt = rf.map_tensors(q, k)
    form = kernel_form(rf, q, k, kmask, 0.3, False, qmask, maps=mt)
    assert form.coeffs.shape == (2, 2, 3)
    _assert_form_params(form, _torch_coeffs(rf, q, k, kmask, 0.3, qmask=qmask, maps=mt), feature)
    assert form.coeffs[0, :, 0].abs().min() > 1e-3  # not trivial: A != 0 (batch 0 has keys)


@pytest.mark.parametrize("feature", ["oprf", "saderf"])
def test_running_statistics_in_the_stats_pass_float64(feature, kernel_device):
    """Causal, running statistics: in training the stats pass forms the parameters from the
    buffers as they were and then moves them (the first update copies, later ones mix), as the
    torch path does; in eval the kept form takes the moved buffers. float64 throughout."""
    from rfattn.fused import kernel_form

    q, k, kmask, _ = _gqa_inputs(kernel_device, Tq=300)
    D = q.shape[-1]
    rf = rfattn.RandomFeatures(D, 16, feature=feature, seed=0).double().to(kernel_device)
    rf_torch = copy.deepcopy(rf)
    fm, fm_torch = rf.feature_map, rf_torch.feature_map
    for step in range(3):
        rf.train(), rf_torch.train()
        qs, ks = q * (1 + step), k - 0.2 * step
        want = _torch_coeffs(rf_torch, qs, ks, kmask, 0.3, causal=True, qmask=kmask)
        _assert_form_params(kernel_form(rf, qs, ks, kmask, 0.3, True, kmask), want, feature)
        for name in Moments._fields:
            a, b = getattr(fm, f"running_{name}"), getattr(fm_torch, f"running_{name}")
            assert rel_rms(a, b) <= 1e-13, (step, name)
        assert int(fm.num_batches_tracked) == int(fm_torch.num_batches_tracked) == step + 1
        rf.eval(), rf_torch.eval()
        want = _torch_coeffs(rf_torch, q, k, kmask, 0.3, causal=True, qmask=kmask)
        _assert_form_params(kernel_form(rf, q, k, kmask, 0.3, True, kmask), want, feature)
    assert float(want[0][..., 0].abs().min()) > 1e-3


# ------------------------------------------------------------------------------------------------
# the statistics formed by the key pass (rf_parallel._fwd_kv_stats_kernel): a non-causal call's
# stats roles and key-pass roles in one launch


@pytest.fixture
def kv_launches(monkeypatch):
    """The kernels the fused call launches through its plans' bound launches
    (``common.Launch``), in order."""
    from rfattn.kernels.common import Launch

    seen, real = [], Launch.__call__

    def spy(self, *args):
        seen.append(self.kernel)
        return real(self, *args)

    monkeypatch.setattr(Launch, "__call__", spy)
    return seen


def _call64(rf, q, k, v, kmask, qmask, backend):
    """out and (dq, dk, dv) of a float64 call with both masks."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*xs, rf, key_padding_mask=kmask, query_padding_mask=qmask,
                              backend=backend)  # fmt: skip
    do = rand(*out.shape, seed=9, dtype=torch.float64, device=out.device)
    return out, torch.autograd.grad(out, xs, do)


@pytest.mark.parametrize("feature,stats", [
    ("oprf", "running"),  # global statistics in make test: the two tests below
    *(pytest.param(f, s, marks=pytest.mark.slow) for f, s in (("saderf", "global"),
                                                              ("oprf", "global"),
                                                              ("saderf", "running"))),
], ids=lambda x: x)  # fmt: skip
def test_key_pass_statistics_float64_masks_grouped_heads(feature, stats, kernel_device,
                                                         kv_launches):  # fmt: skip
    """A call whose statistics the key pass forms (one launch before the query pass) equals the
    torch path in float64, outputs and gradients: key and query padding masks, grouped-query
    heads (the query rows of each key/value head), a (b, h) without a valid key, two splits per
    side. Running statistics: two training steps, the second from the buffers the first moved
    (in the key pass's launch), and the buffers themselves."""
    from rfattn.kernels.rf_parallel import _fwd_kv_running_kernel, _fwd_kv_stats_kernel

    q, k, kmask, qmask = _gqa_inputs(kernel_device, Tq=70, Tk=140)
    v = rand(*k.shape[:3], 8, seed=3, dtype=torch.float64, device=kernel_device)
    rf = rfattn.RandomFeatures(q.shape[-1], 16, feature=feature, stats=stats, seed=0)
    rf = rf.double().to(kernel_device)
    rf_torch = copy.deepcopy(rf)
    for step in range(2 if stats == "running" else 1):
        qs, ks = q * (1 + step), k - 0.3 * step
        kv_launches.clear()
        out, grads = _call64(rf, qs, ks, v, kmask, qmask, "triton")
        want, want_grads = _call64(rf_torch, qs, ks, v, kmask, qmask, "torch")
        kernel = _fwd_kv_running_kernel if stats == "running" else _fwd_kv_stats_kernel
        # the key pass's launch was the statistics' (the query pass replays its plan:
        # tests/test_gpu_ops.py counts every launch of the call)
        assert kv_launches[:1] == [kernel]
        assert rel_rms(out, want) <= 1e-12
        for a, b in zip(grads, want_grads, strict=True):
            assert rel_rms(a, b) <= 1e-12
        if stats == "running":
            fm, fm_torch = rf.feature_map, rf_torch.feature_map
            for name in Moments._fields:
                a, b = getattr(fm, f"running_{name}"), getattr(fm_torch, f"running_{name}")
                assert rel_rms(a, b) <= 1e-13, (step, name)
            assert int(fm.num_batches_tracked) == step + 1
    # not trivial: the statistics move the result away from posrf's
    plain = rfattn.RandomFeatures(q.shape[-1], 16, seed=0).double().to(kernel_device)
    assert rel_rms(_call64(plain, qs, ks, v, kmask, qmask, "torch")[0], want) > 1e-3


def _deferred_forward(rf, q, k, v, kmask, qmask, programs, num_splits=None):
    """(out, coeffs, psi) of rf_parallel_fwd on a form whose parameters its key pass forms with
    ``programs`` stats roles."""
    from rfattn.kernels.rf_parallel import rf_parallel_fwd

    from rfattn.fused import kernel_form

    form, st = kernel_form(rf, q, k, kmask, 0.3, False, qmask, defer=True)
    assert st is not None  # left to the key pass
    st = st._replace(programs=programs, num_splits=num_splits)
    out = rf_parallel_fwd(q, k, v, form, 0.3, kmask, num_splits=num_splits, stats=st)
    return out, form


@pytest.mark.parametrize("feature,programs", [
    ("oprf", 1), ("saderf", 3), ("oprf", 40),
    *(pytest.param(f, n, marks=pytest.mark.slow) for f, n in (("saderf", 1), ("oprf", 3),
                                                              ("saderf", 40))),
], ids=lambda x: f"roles{x}" if isinstance(x, int) else x)  # fmt: skip
def test_key_pass_statistics_any_number_of_stats_roles(feature, programs, kernel_device):
    """B*H = 4 (b, h) of 3 query and 3 key splits (24 work items): one stats role for all of
    them, 3 (fewer than the (b, h); several items each, a (b, h)'s items in several roles), 40
    (more than the items: some have none). Parameters and output as the torch path's, float64;
    the arrival counters, ready flags and ticket back at 0 after each launch."""
    from rfattn.kernels.common import arrival_counters

    q, k, kmask, qmask = _gqa_inputs(kernel_device, B=2, Hq=2, H=2, Tq=300, Tk=300)
    v = rand(*k.shape[:3], 8, seed=3, dtype=torch.float64, device=kernel_device)
    rf = rfattn.RandomFeatures(q.shape[-1], 16, feature=feature, seed=0).double()
    rf = rf.to(kernel_device)
    out, form = _deferred_forward(rf, q, k, v, kmask, qmask, programs, num_splits=3)
    _assert_form_params(form, _torch_coeffs(rf, q, k, kmask, 0.3, qmask=qmask), feature)
    want = rfattn.rf_attention(q, k, v, rf, key_padding_mask=kmask, scale=0.3,
                               query_padding_mask=qmask, backend="torch")  # fmt: skip
    valid = ~qmask[:, None, :, None]  # padded query rows are the caller's to zero
    assert rel_rms(out * valid, want * valid) <= 1e-12
    assert not arrival_counters(q.device, 1).any()


def test_key_pass_statistics_two_calls_take_their_own_data(kernel_device):
    """Two launches in a row on different data: the second forms the second data's parameters
    (the ticket, flags and arrival counters the first left are at 0: none of its roles is taken
    for one of the first's, none skips its wait)."""
    from rfattn.kernels.common import arrival_counters

    q, k, kmask, qmask = _gqa_inputs(kernel_device, Hq=2, Tq=150, Tk=150)
    v = rand(*k.shape[:3], 8, seed=3, dtype=torch.float64, device=kernel_device)
    rf = rfattn.RandomFeatures(q.shape[-1], 16, feature="saderf", seed=0).double()
    rf = rf.to(kernel_device)
    firsts = []
    for qs, ks in ((q, k), (0.5 * q - 0.2, 2.0 * k)):
        _, form = _deferred_forward(rf, qs, ks, v, kmask, qmask, None)
        _assert_form_params(form, _torch_coeffs(rf, qs, ks, kmask, 0.3, qmask=qmask), "saderf")
        firsts.append(form.coeffs)
        assert not arrival_counters(q.device, 1).any()
    assert rel_rms(firsts[1], firsts[0]) > 1e-2  # the two data's parameters differ


# ------------------------------------------------------------------------------------------------
# the running statistics formed by a causal forward's first launch (rf_chunk's walk over the key
# chunks): stats roles and walks in one launch, the buffers moved by its last program


@pytest.fixture
def chunk_launches(monkeypatch):
    """The kernels launched by the causal launchers (their plans' bound launches,
    ``common.Launch``) and by the stats pass (``launch``), with their ``STATS`` flag."""
    from rfattn.kernels import common, stats

    seen = []
    real = stats.launch

    def spy(kernel, grid, *args, **kwargs):
        seen.append((getattr(kernel, "fn", kernel).__name__, kwargs.get("STATS")))
        return real(kernel, grid, *args, **kwargs)

    real_call = common.Launch.__call__

    def bound_spy(self, *args):
        seen.append((getattr(self.kernel, "fn", self.kernel).__name__, self.kwargs.get("STATS")))
        return real_call(self, *args)

    monkeypatch.setattr(stats, "launch", spy)
    monkeypatch.setattr(common.Launch, "__call__", bound_spy)
    return seen


def _causal_call64(rf, q, k, v, kmask, backend):
    """out and (dq, dk, dv) of a causal float64 call with a key padding mask."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*xs, rf, key_padding_mask=kmask, causal=True, scale=0.3,
                              backend=backend)  # fmt: skip
    do = rand(*out.shape, seed=9, dtype=torch.float64, device=out.device)
    return out, torch.autograd.grad(out, xs, do)


@pytest.mark.parametrize("feature", ["saderf", pytest.param("oprf", marks=pytest.mark.slow)])
def test_causal_walk_running_statistics_float64(feature, kernel_device, chunk_launches):
    """A causal training call forms its running statistics in the forward's first launch (no
    stats pass before it): two steps, the second from the buffers the first moved, equal the
    torch path in float64 (outputs, gradients of q, k, v, the buffers themselves), with
    grouped-query heads and padded keys left out of the statistics (their contents NaN, never
    read); the backward recomputes its states with the forward's parameters, not the moved
    buffers'."""
    B, Hq, H, T, D = 2, 2, 1, 40, 8
    q = rand(B, T, Hq, D, seed=1, dtype=torch.float64, device=kernel_device).transpose(1, 2)
    k = rand(B, H, T, D, seed=2, scale=0.7, dtype=torch.float64, device=kernel_device) + 0.3
    v = rand(B, H, T, 8, seed=3, dtype=torch.float64, device=kernel_device)
    kmask = torch.zeros(B, T, dtype=torch.bool)
    kmask[1, :11] = True  # left padding across a chunk boundary
    kmask = kmask.to(kernel_device)
    k = k.masked_fill(kmask[:, None, :, None], float("nan"))
    rf = rfattn.RandomFeatures(D, 16, feature=feature, seed=0).double().to(kernel_device)
    rf_torch = copy.deepcopy(rf)
    fm, fm_torch = rf.feature_map, rf_torch.feature_map
    for step in range(2):
        qs, ks = q * (1 + step), k - 0.3 * step
        chunk_launches.clear()
        out, grads = _causal_call64(rf, qs, ks, v, kmask, "triton")
        want, want_grads = _causal_call64(rf_torch, qs, ks, v, kmask, "torch")
        # one launch formed and moved them: the walk's, first; no stats pass
        assert chunk_launches[0] == ("_chunk_states_kernel", True), chunk_launches
        assert [n for n, st in chunk_launches if st] == ["_chunk_states_kernel"]
        assert "_stats_kernel" not in [n for n, _ in chunk_launches]
        assert rel_rms(out, want) <= 1e-12
        for a, b in zip(grads, want_grads, strict=True):
            assert rel_rms(a, b) <= 1e-12
        for name in Moments._fields:
            a, b = getattr(fm, f"running_{name}"), getattr(fm_torch, f"running_{name}")
            assert rel_rms(a, b) <= 1e-13, (step, name)
        assert int(fm.num_batches_tracked) == int(fm_torch.num_batches_tracked) == step + 1
    # not trivial: the second step's parameters (from the moved buffers) are not posrf's
    plain = rfattn.RandomFeatures(D, 16, seed=0).double().to(kernel_device)
    assert rel_rms(_causal_call64(plain, qs, ks, v, kmask, "torch")[0], want) > 1e-3
