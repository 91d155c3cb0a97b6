"""What the fused path keeps between calls, and that nothing kept outlives what it was made from.

* Per-shape launch plans (``rfattn.kernels.common.shape_plan``): a launcher checks its inputs and
  derives its setup, splits and launches once per key (sizes, strides, dtypes, alignment, the
  form's kind, the mask's presence, scale, ...); a call with another key gets its own plan.
* Kept kernel forms (``rfattn.fused.kept_form``): valid while the module's revision, its feature
  map's mode and its tensors' versions are those they were built with; a redraw, a state dict
  loaded, a move or cast, a train/eval switch or an in-place change makes the next call rebuild.
* The path of a warm fused call: at most 20 of the project's functions in at most 6 files,
  counted by ``python -m bench.callpath --fake-gpu`` (Triton's compiled launch path against the
  fake sm_90 driver, no GPU).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rfattn.kernels import rf_parallel, rf_recurrent

import rfattn
from rfattn import fused
from rfattn.testing import assert_rel_rms, tolerance

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ lives at the root

from test_bench import fake_gpu_problem  # noqa: E402


def _inputs(device, B=2, H=2, T=40, D=16, E=16, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = ((0.5 * torch.randn(B, H, T, D, generator=g)).to(device, dtype) for _ in range(2))
    return q, k, torch.randn(B, H, T, E, generator=g).to(device, dtype)


def _same(got, want, what):
    assert_rel_rms(got, want, tolerance(got.dtype), what)


def _both(q, k, v, rf, **kw):
    """The fused call's output and the torch path's (the reference of the same call)."""
    return (rfattn.rf_attention(q, k, v, rf, backend="triton", **kw),
            rfattn.rf_attention(q, k, v, rf, backend="torch", **kw))  # fmt: skip


@pytest.fixture
def setups(monkeypatch, kernel_device):
    """Counts the launch setups of the non-causal and decode launchers."""
    count = [0]

    def counted(launch_setup):
        def run(*args, **kwargs):
            count[0] += 1
            return launch_setup(*args, **kwargs)

        return run

    for mod in (rf_parallel, rf_recurrent):
        monkeypatch.setattr(mod, "launch_setup", counted(mod.launch_setup))
    return count


def test_a_warm_call_sets_nothing_up(setups, kernel_device):
    """The second call of a shape takes its plan: no launch setup (before: one per launcher call,
    checks, tiles, the form's tensors, splits, and a key built from every launch's arguments)."""
    rf = rfattn.RandomFeatures(16, 32, "posrf", seed=0).to(kernel_device)
    q, k, v = _inputs(kernel_device, B=1, T=16)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    calls = {
        "forward": lambda: rfattn.rf_attention(q, k, v, rf, backend="triton"),
        "forward+backward": lambda: rfattn.rf_attention(*xs, rf, backend="triton").sum()
        .backward(),
        "decode": lambda: rfattn.rf_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], rf,
                                              causal=True, backend="triton"),
    }  # fmt: skip
    for name, call in calls.items():
        call()
        setups[0] = 0
        call()
        assert setups[0] == 0, name


def test_plans_follow_what_they_derive_from(setups, kernel_device):
    """Calls that differ only in the layout of q, k, v, the mask's presence, scale or dtype get
    plans of their own (a new setup each), and every result is the torch path's: a plan keyed
    without one of these would launch with the strides, flags or sqrt(scale) of another call."""
    rf = rfattn.RandomFeatures(16, 32, "posrf", seed=0).to(kernel_device)
    q, k, v = _inputs(kernel_device, T=17)  # a length no other test plans
    mask = torch.zeros(2, 17, dtype=torch.bool, device=kernel_device)
    mask[1, 10:] = True
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, H, D] memory, same values
    variants = {
        "first": (q, k, v, {}),
        "strides": (qt, k, v, {}),
        "offset": (torch.cat([q, q], 2)[:, :, 1:18], k, v, {}),  # q's data off 16 bytes
        "mask": (q, k, v, {"key_padding_mask": mask}),
        "scale": (q, k, v, {"scale": 0.3}),
        "dtype": (q.float(), k.float(), v.float(), {}),
    }
    for name, (q_, k_, v_, kw) in variants.items():
        setups[0] = 0
        got, want = _both(q_, k_, v_, rf, **kw)
        assert setups[0] == 1, name  # a plan of its own
        _same(got, want, name)
    for name, (q_, k_, v_, kw) in variants.items():  # and each kept
        setups[0] = 0
        _same(*_both(q_, k_, v_, rf, **kw), name)
        assert setups[0] == 0, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scratch_buffers_and_their_addresses(dtype):
    """A launcher's scratch (``common.Scratch``): one allocation, each buffer on 16 bytes and
    apart from the others; the addresses a replayed launch takes are those of the views Triton's
    own launch (and the interpreter) takes (an empty buffer's view has no address of its own)."""
    from rfattn.kernels.common import Scratch

    shapes = [(3, 5, 7), (3, 5), (1,), (2, 9), (0, 4), (6,)]
    scratch = Scratch(dtype, *shapes)
    buf, views = scratch("cpu", False)
    assert [tuple(x.shape) for x in views] == shapes
    used = [i for i, x in enumerate(views) if x.numel()]
    starts = [views[i].data_ptr() - buf.data_ptr() for i in used]
    ends = [a + views[i].numel() * buf.element_size() for a, i in zip(starts, used, strict=True)]
    assert all(views[i].data_ptr() % 16 == 0 for i in used)
    assert all(e <= s for e, s in zip(ends, starts[1:], strict=False))  # no overlap, in order
    assert ends[-1] <= buf.numel() * buf.element_size()
    buf2, addresses = scratch("cpu", True)
    addresses = list(addresses)
    assert [addresses[i] - buf2.data_ptr() for i in used] == starts


#: name -> (the change, whether it changes the features' values)
CHANGES = {
    "redraw": (lambda rf: rf.redraw(seed=7), True),
    "load_state_dict": (lambda rf: rf.load_state_dict(
        {n: t * 1.5 if t.is_floating_point() else t for n, t in rf.state_dict().items()}), True),
    "to(float64)": (lambda rf: rf.to(torch.float64), False),  # new tensors, the same values
    "in place": (lambda rf: rf.weight.mul_(0.5), True),
}


def test_a_kept_form_does_not_survive_a_change(kernel_device):
    """After each change of the features the fused call computes with the new ones: its result
    is the torch path's (and not the one before where the values changed); the kept form is
    replaced."""
    rf = rfattn.RandomFeatures(16, 32, "posrf", seed=0).to(kernel_device)
    q, k, v = _inputs(kernel_device, B=1, T=16)
    before, _ = _both(q, k, v, rf)
    for change, (apply, new_values) in CHANGES.items():
        kept = fused.kept_form(rf, q.device, q.dtype, False)
        assert kept is not None, change
        apply(rf)
        assert fused.kept_form(rf, q.device, q.dtype, False) is None, change
        got, want = _both(q, k, v, rf)
        _same(got, want, change)
        assert torch.allclose(got, before) is not new_values, change
        assert fused.kept_form(rf, q.device, q.dtype, False).form is not kept.form, change
        before = got


def test_a_kept_form_follows_the_training_mode(kernel_device):
    """Running statistics: in eval the kept form holds the running moments, in training each
    call takes its own (and moves the running ones); a switch either way is seen at once."""
    rf = rfattn.RandomFeatures(16, 32, "oprf", seed=0, stats="running").to(kernel_device)
    q, k, v = _inputs(kernel_device, B=1, T=16)
    rf.eval()
    first, want = _both(q, k, v, rf, causal=True)
    _same(first, want, "eval")
    assert fused.kept_form(rf, q.device, q.dtype, True) is not None
    rf.train()  # the next fused call uses (and updates) this call's moments
    assert fused.kept_form(rf, q.device, q.dtype, True) is None
    q2, k2, v2 = _inputs(kernel_device, B=1, T=16, seed=1)
    with torch.no_grad():
        rfattn.rf_attention(q2, k2, v2, rf, causal=True, backend="triton")
    rf.eval()  # running moments moved by that call
    got, want = _both(q, k, v, rf, causal=True)
    _same(got, want, "eval after training")
    assert not torch.allclose(got, first)


@pytest.mark.skipif(fake_gpu_problem() is not None, reason=str(fake_gpu_problem()))
def test_a_warm_fused_call_enters_few_functions(tmp_path):
    """A warm non-causal posrf call (no grad) enters at most 20 of the project's functions in at
    most 6 files (``python -m bench.callpath --fake-gpu``: compiled launches against the fake
    sm_90 driver, in a fresh process with the interpreter off; a few seconds with a warm Triton
    cache). Before: 34 functions in 8 files, among them a launch setup of 11 helpers and a key
    built from every launch's arguments."""
    out = tmp_path / "callpath.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.callpath", "--fake-gpu", "--paths", "noncausal-posrf",
         "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    path = json.loads(out.read_text())["paths"]["noncausal-posrf"]
    shown = "\n".join(path["functions"])
    assert len(path["functions"]) <= 20, shown
    assert len(path["files"]) <= 6, shown
    assert "kernels/common.py:launch_setup" not in path["functions"], shown


def test_the_backward_takes_its_plan_from_the_forward(monkeypatch, kernel_device):
    """An eager forward+backward looks its shape up once: the backward's plan comes with the
    forward's (kept there by the cotangent's layout), not from a second lookup by shape (before:
    one ``shape_plan`` per launcher call); a cotangent of another layout gets a plan of its own,
    and both gradients are the torch path's."""
    looked_up = [0]
    real = rf_parallel.shape_plan

    def counted(*args, **kwargs):
        looked_up[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(rf_parallel, "shape_plan", counted)
    rf = rfattn.RandomFeatures(16, 32, "posrf", seed=0).to(kernel_device)
    q, k, v = _inputs(kernel_device, B=1, T=18)
    do = torch.randn(1, 2, 18, 16, dtype=q.dtype, generator=torch.Generator().manual_seed(1))
    do = do.to(kernel_device)

    def grads(backend, cotangent):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = rfattn.rf_attention(*xs, rf, backend=backend)
        return torch.autograd.grad(out, xs, cotangent)

    for name, cotangent in (("contiguous", do), ("strided", do.transpose(-1, -2).contiguous()
                                                  .transpose(-1, -2))):  # fmt: skip
        looked_up[0] = 0
        got, want = grads("triton", cotangent), grads("torch", cotangent)
        assert looked_up[0] == 1, name  # the forward's
        for a, b in zip(got, want, strict=True):
            _same(a, b, name)


def test_live_results_never_share_memory(kernel_device):
    """Two calls' outputs and gradients, held at once, are each their own memory (nothing a plan
    keeps is handed out twice), and each is the torch path's for its own inputs."""
    rf = rfattn.RandomFeatures(16, 32, "posrf", seed=0).to(kernel_device)
    results = []
    for seed in (0, 1):
        q, k, v = _inputs(kernel_device, B=1, T=16, seed=seed)
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        out = rfattn.rf_attention(*xs, rf, backend="triton")
        out.sum().backward()
        with torch.no_grad():
            plain = rfattn.rf_attention(q, k, v, rf, backend="triton")
        want = rfattn.rf_attention(q, k, v, rf, backend="torch")
        _same(out.detach(), want, f"seed {seed}")
        _same(plain, want, f"seed {seed} without grad")
        results += [out, plain, *(x.grad for x in xs)]
    ptrs = [x.data_ptr() for x in results]
    assert len(set(ptrs)) == len(ptrs)


def test_a_form_made_for_one_call_is_not_kept(kernel_device):
    """oprf's non-causal forms, made for each call (its statistics formed by the key pass), are
    converted for the launch and not kept among the forms' kernel arguments (before: one more
    entry per call until the table started over, each holding its form's tensors and pushing out
    the kept forms' arguments)."""
    from rfattn.kernels import common

    rf = rfattn.RandomFeatures(16, 32, "oprf", seed=0).to(kernel_device)
    q, k, v = _inputs(kernel_device, B=1, T=16)
    with torch.no_grad():
        rfattn.rf_attention(q, k, v, rf, backend="triton")
        kept = len(common.FORM_ARGS)
        for _ in range(2):
            _same(*_both(q, k, v, rf), "oprf")
    assert len(common.FORM_ARGS) == kept
