"""Launch plans (``rfattn.kernels.common.launch``): after a specialisation's first launch, later
launches call the compiled kernel directly, with the arguments Triton's own path passes.

Checked with Triton's real launch path against the fake sm_90 driver of ``python -m bench.host``
(``bench/fake_gpu.py``), in a fresh process with the interpreter off: two small kernels (one
autotuned over two configs, one not) are compiled for sm_90 (a few seconds with an empty Triton
cache) and launched through :func:`launch`, with Triton's autotuner and JIT entry points counted
and the C launcher's arguments recorded."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ lives at the root

from test_bench import fake_gpu_problem  # noqa: E402

KERNELS = '''
import triton
import triton.language as tl


@triton.jit
def plain_kernel(x_ptr, y_ptr, n, stride, BT: tl.constexpr):
    o = tl.program_id(0) * BT + tl.arange(0, BT)
    tl.store(y_ptr + o * stride, tl.load(x_ptr + o * stride, mask=o < n) * 2, mask=o < n)


@triton.autotune(configs=[triton.Config({"BT": 64}, num_warps=4),
                          triton.Config({"BT": 128}, num_warps=8)], key=["D"])
@triton.jit
def tuned_kernel(x_ptr, y_ptr, n, stride, D: tl.constexpr, BT: tl.constexpr):
    o = tl.program_id(0) * BT + tl.arange(0, BT)
    tl.store(y_ptr + o * stride, tl.load(x_ptr + o * stride, mask=o < n) + D, mask=o < n)
'''

SCRIPT = '''
import json, sys
import torch
from bench import fake_gpu

fake_gpu.activate()
import triton
from triton.backends.nvidia.driver import CudaLauncher
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import JITFunction

from rfattn.kernels import common
from plan_kernels import plain_kernel, tuned_kernel

entered = {"autotuner": 0, "jit": 0}
for cls, name in ((Autotuner, "autotuner"), (JITFunction, "jit")):
    def counted(self, *a, _run=cls.run, _name=name, **kw):
        entered[_name] += 1
        return _run(self, *a, **kw)
    cls.run = counted
sent = []  # what reached Triton's launcher: grid, stream, function, metadata, hooks, arguments
call = CudaLauncher.__call__
def recorded(self, *a):
    sent.append(a[:6] + a[7:])  # without the launch-metadata object (a new one every launch)
    return call(self, *a)
CudaLauncher.__call__ = recorded

def shown(a):
    if isinstance(a, torch.Tensor):
        return ["tensor", a.data_ptr()]
    return a if isinstance(a, (int, float, str, bool, type(None))) else repr(a)

out = {}
def step(name, kernel, grid, *args, **kw):
    before, launched = dict(entered), fake_gpu.launches()
    compiled = common.launch(kernel, grid, *args, **kw)
    out[name] = {"entered": {k: entered[k] - before[k] for k in entered},
                 "launched": fake_gpu.launches() - launched, "compiled": id(compiled),
                 "plans": len(common.LAUNCH_PLANS), "sent": [shown(a) for a in sent[-1]]}
    return compiled

x, y = torch.zeros(4096), torch.zeros(4096)
grid = lambda meta: (triton.cdiv(1000, meta["BT"]),)
step("tuned first", tuned_kernel, grid, x, y, 1000, 1, D=3)
step("tuned again", tuned_kernel, grid, x, y, 1000, 1, D=3)
x2, y2 = torch.ones(4096), torch.ones(4096)
step("tuned other tensors", tuned_kernel, grid, x2, y2, 1000, 1, D=3)
step("tuned other D", tuned_kernel, grid, x, y, 1000, 1, D=5)
step("tuned other n", tuned_kernel, grid, x, y, 999, 1, D=3)
step("plain first", plain_kernel, (8,), x, y, 1000, 1, BT=128)
step("plain again", plain_kernel, (8,), x, y, 1000, 1, BT=128)
step("plain fp64", plain_kernel, (8,), x.double(), y.double(), 1000, 1, BT=128)
step("plain misaligned", plain_kernel, (8,), x[1:], y[1:], 1000, 1, BT=128)
step("plain misaligned again", plain_kernel, (8,), x[1:], y[1:], 1000, 1, BT=128)
step("plain stride 16", plain_kernel, (8,), x, y, 200, 16, BT=128)
common.PLANS = False  # Triton's whole way, for the same launch as "plain again"
step("plain unplanned", plain_kernel, (8,), x, y, 1000, 1, BT=128)
common.PLANS = True

json.dump(out, sys.stdout)
'''


def _run(tmp_path, script: str):
    """What ``script`` (beside :data:`KERNELS`) prints as JSON, run in a fresh process with the
    interpreter off."""
    (tmp_path / "plan_kernels.py").write_text(textwrap.dedent(KERNELS))
    (tmp_path / "check.py").write_text(textwrap.dedent(script))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    proc = subprocess.run([sys.executable, str(tmp_path / "check.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.skipif(fake_gpu_problem() is not None, reason=str(fake_gpu_problem()))
def test_launch_plans_replay_what_triton_launches(tmp_path):
    """The first launch of a specialisation goes through Triton's autotuner and JIT; later ones
    with other tensors of the same dtype and alignment enter neither and launch the same compiled
    kernel. Another autotune key, another int, another dtype or a pointer off the 16-byte
    alignment gets its own plan (and the misaligned pointer its own compiled kernel: Triton
    specialises on it). What reaches Triton's launcher is exactly what Triton's own path sends
    for the same launch: grid (the autotuned config's, from a callable grid), stream, function,
    metadata, hooks, arguments, constexprs."""
    r = _run(tmp_path, SCRIPT)
    planned = {"autotuner": 0, "jit": 0}
    for name in ("tuned first", "tuned other D"):  # a tuning: the autotuner launches configs
        assert r[name]["entered"]["autotuner"] == 1 and r[name]["entered"]["jit"] >= 1, name
    assert r["tuned other n"]["entered"] == {"autotuner": 1, "jit": 1}  # D's tuning, cached
    for name in ("tuned again", "tuned other tensors"):
        assert r[name]["entered"] == planned, name
        assert r[name]["compiled"] == r["tuned first"]["compiled"]
    for name in ("plain first", "plain fp64", "plain misaligned", "plain stride 16"):
        assert r[name]["entered"] == {"autotuner": 0, "jit": 1}, name
    for name in ("plain again", "plain misaligned again"):
        assert r[name]["entered"] == planned, name
    assert r["plain misaligned"]["compiled"] != r["plain first"]["compiled"]
    assert r["plain misaligned again"]["compiled"] == r["plain misaligned"]["compiled"]
    tunings = ("tuned first", "tuned other D")
    assert all(r[name]["launched"] == 1 for name in r if name not in tunings)
    assert r["plain stride 16"]["plans"] == 7  # one per specialisation launched
    sent = {name: r[name]["sent"] for name in r}
    # grid (1000 / BT of the config the autotuner chose), stream, function, metadata, hooks,
    # arguments, constexprs: as the first launch's (Triton's way); other tensors: their pointers
    assert sent["tuned again"] == sent["tuned first"]
    first, other = sent["tuned first"], sent["tuned other tensors"]
    assert other[:8] == first[:8] and other[10:] == first[10:] and other[8:10] != first[8:10]
    assert first[0] == -(-1000 // 64)  # FirstFit keeps the autotuner's first config that fits
    assert sent["plain again"] == sent["plain first"] == sent["plain unplanned"]


def test_no_plans_under_the_interpreter(kernel_device):
    """Under the interpreter nothing is compiled: every launch goes Triton's way, no plan."""
    from rfattn.kernels import common

    if not common.INTERPRET:
        pytest.skip("the interpreter is off")
    import rfattn

    rf = rfattn.RandomFeatures(8, 16, feature="posrf", seed=0)
    q = torch.randn(1, 1, 16, 8)
    rfattn.rf_attention(q, q, q, rf, backend="triton")
    assert not common.PLANS and common.LAUNCH_PLANS == {}


def test_integer_helpers_match_triton():
    """The launch setup's plain integer maths (no constexpr-function wrapper per call) equals
    ``triton.cdiv`` and ``triton.next_power_of_2``."""
    import triton
    from rfattn.kernels.common import cdiv, next_pow2

    for n in range(600):
        for b in (1, 16, 64, 128):
            assert cdiv(n, b) == triton.cdiv(n, b)
        assert next_pow2(n, 1) == triton.next_power_of_2(max(n, 1))
        assert next_pow2(n) == max(16, triton.next_power_of_2(max(n, 1)))


C_SCRIPT = '''
import json, sys
import torch
from bench import fake_gpu

fake_gpu.activate()
import triton
from triton import knobs
from triton.runtime import driver

from rfattn.kernels import common
from plan_kernels import plain_kernel, tuned_kernel

sent = []  # what reached Triton's C launch function (every launcher is built with it)
real = driver.active.utils.launch
def recorded(*a):
    sent.append(a)
    return real(*a)
driver.active.utils.launch = recorded

def shown(a):
    if isinstance(a, tuple):
        return [shown(x) for x in a]
    if isinstance(a, torch.Tensor):
        return ["tensor", a.data_ptr()]
    if hasattr(a, "calls") and not a.calls:  # an empty hook chain: no hook
        return None
    return a if isinstance(a, (int, float, str, bool, type(None))) else repr(a)

out = {"direct": [common.c_launcher(None)[0] is None]}
x, y = torch.zeros(4096), torch.zeros(4096)
for name, kernel, grid, kw in (
        ("plain", plain_kernel, (8,), dict(BT=128)),
        ("tuned", tuned_kernel, lambda meta: (triton.cdiv(1000, meta["BT"]),), dict(D=3))):
    launch = common.Launch(kernel, grid, **kw)
    launch(x, y, 1000, 1)  # Triton's way: its launcher's __call__, then the C function
    first = sent[-1]
    launch(x, y, 1000, 1)  # replayed: the C function itself
    out["direct"].append(launch.direct[-3] is not None)
    # without the launch metadata (Triton's way makes one; nothing reads it without a hook)
    out[name] = [shown(a[:8] + a[9:]) for a in (first, sent[-1])]
    out[name + " launches"] = len(sent)
json.dump(out, sys.stdout)
'''


@pytest.mark.skipif(fake_gpu_problem() is not None, reason=str(fake_gpu_problem()))
def test_replayed_launches_call_the_c_launcher_as_triton_does(tmp_path):
    """A replayed launch without a hook calls Triton's C launch function itself
    (``common.c_launcher``), with exactly what Triton's launcher passes it for the same launch
    (grid, stream, function, cooperative grid and PDL flags, metadata, hooks (none: Triton's
    empty hook chains), scratch, argument annotations, signature, arguments), for a kernel with
    and without autotuning."""
    r = _run(tmp_path, C_SCRIPT)
    assert r["direct"] == [True, True, True]
    for name in ("plain", "tuned"):
        triton_way, replayed = r[name]
        assert replayed == triton_way, name
