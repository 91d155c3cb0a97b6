"""Peak memory of one call, on top of its inputs.

GPU: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the bytes
allocated before the call (the inputs): the caching allocator's view of live tensors.

CPU: there is no allocator counter, and the process peak RSS (``ru_maxrss``) only grows, so it
says nothing about the second measurement in a process. Each CPU measurement therefore runs in a
worker process (``python -m bench.memory``, started once per run, never used for timing) in which

1. glibc's ``mallopt`` puts every allocation of 64 KiB or more on its own ``mmap`` and trims the
   heap eagerly, so a freed tensor goes back to the OS at once and the resident set follows the
   bytes of live tensors (glibc's default keeps freed blocks below 32 MiB for reuse, which would
   hide them from the next measurement and distort the timings if done in the timing process);
2. the inputs are built and a tiny warm-up call of the same provider runs (lazy initialisation),
   then ``rfattn.workspace.clear()`` drops the torch path's kept buffers, so the call measured
   allocates its own (they stay allocated after it: part of its peak);
3. the kernel's peak-RSS mark is reset (``echo 5 > /proc/self/clear_refs``, Linux >= 4.0), and the
   peak is ``VmHWM`` after the call minus ``VmRSS`` before it (``/proc/self/status``).

Resolution is a page (4 KiB) for blocks >= 64 KiB; small allocations served from already-resident
heap are not seen. Where ``clear_refs`` is unavailable the peak is reported as None.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
METHOD_CPU = (
    "per-call peak RSS above the inputs, in a separate worker process: glibc mallopt "
    "(mmap threshold 64 KiB, eager trim) so freed tensors leave the resident set at once; "
    "rfattn's kept buffers (rfattn.workspace) cleared before the call, so its peak includes "
    "them; /proc/self/clear_refs resets the peak mark; peak = VmHWM after - VmRSS before"
)
METHOD_CUDA = "torch.cuda.max_memory_allocated during the call minus memory_allocated before it"

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def gpu_peak_bytes(fn, leaves=()) -> int:
    """Peak bytes allocated by ``fn()`` on the current CUDA device above what was live before."""
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - base)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def configure_malloc() -> bool:
    """Make glibc return freed blocks >= 64 KiB to the OS at once (see module docstring)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024) and libc.mallopt(_M_TRIM_THRESHOLD, 0)
        return bool(ok)
    except (OSError, AttributeError):
        return False


def cpu_peak_bytes(fn, leaves=()) -> int | None:
    """Peak RSS growth during ``fn()`` in this process, or None where it cannot be measured."""
    for t in leaves:
        t.grad = None
    gc.collect()
    try:
        rss0 = _status_kib("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        if _status_kib("VmHWM") > rss0 + 64:  # the reset did not happen
            return None
        fn()
        return max(0, _status_kib("VmHWM") - rss0) * 1024
    except OSError:
        return None


def _measure(spec: dict, cache: dict) -> dict:
    """Build ``spec``'s inputs, warm up on a tiny shape, measure one call (worker side)."""
    import rfattn
    from bench.providers import make_call, make_inputs

    key = (spec["feature"], spec["weights"], spec["D"], spec["M"])
    if key[0] is not None and key not in cache:
        cache[key] = rfattn.RandomFeatures(spec["D"], spec["M"], feature=key[0], weights=key[1])
    rf = cache.get(key)  # None for the softmax providers
    dtype = getattr(torch, spec["dtype"])
    backward, causal = spec["mode"] == "fwd+bwd", spec["causal"]
    shape = (spec["B"], spec["H"], spec["T"], spec["D"], spec["E"])
    tiny = make_inputs(*shape[:2], 64, *shape[3:], dtype, "cpu", backward)
    make_call(spec["provider"], tiny, rf, causal, backward)[0]()
    del tiny
    rfattn.workspace.clear()  # the call measured allocates (and keeps) its own buffers
    x = make_inputs(*shape, dtype, "cpu", backward)
    call, leaves = make_call(spec["provider"], x, rf, causal, backward)
    return {"peak_bytes": cpu_peak_bytes(call, leaves)}


def worker_main() -> int:
    """``python -m bench.memory``: one JSON spec per stdin line -> one JSON answer per line."""
    configure_malloc()
    torch.set_num_threads(int(os.environ.get("RFATTN_BENCH_THREADS", torch.get_num_threads())))
    cache: dict = {}
    for line in sys.stdin:
        try:
            answer = _measure(json.loads(line), cache)
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which records it
            answer = {"peak_bytes": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


class CpuMemoryWorker:
    """The parent side: a worker process started on first use, restarted if it dies."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, RFATTN_BENCH_THREADS=str(torch.get_num_threads()))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        return subprocess.Popen(
            [sys.executable, "-m", "bench.memory"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )

    def measure(self, spec: dict) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(spec) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            code = self._proc.wait()
            self._proc = None
            return {"peak_bytes": None, "error": f"memory worker died (exit code {code})"}
        return json.loads(line)

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=30)
            self._proc = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    raise SystemExit(worker_main())
