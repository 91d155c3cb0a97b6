"""A fake sm_90 GPU for Triton on a machine without one: real compiler, real launcher, no launch.

:func:`activate` makes Triton's CUDA backend the active driver in a process that has no GPU.
Kernels are compiled for an H100 (``GPUTarget("cuda", 90, 32)``) by Triton's own compiler and
ptxas, as ``bench.compile`` does; a launch then goes through Triton's whole host path: the JIT's
argument binding and specialisation key, its kernel cache, the grid, the launch-metadata object,
:class:`triton.backends.nvidia.driver.CudaLauncher` and the C launcher module Triton builds from
``triton/backends/nvidia/driver.c`` (argument extraction, ``data_ptr`` calls, the pointer check,
the launch config). That C module is built unchanged, linked against a stand-in ``libcuda.so.1``
(``bench/fake_libcuda.c``, built here with the C compiler Triton uses) that describes one H100
(232448 bytes of shared memory per block, 132 SMs, 1024 threads, compute capability 9.0) and
whose ``cuLaunchKernelEx`` counts the launch and returns. Tensors stay on the CPU: their
``data_ptr`` is passed as the device pointer and nothing reads it, so outputs are left
unwritten (the timings are the host's; the numbers computed are junk).

Autotuning: Triton's autotuner benchmarks every config through the driver's benchmarker, which
would time junk launches. :class:`FirstFit` replaces it: per tuning (one key of one kernel) it
compiles and launches the configs in the autotuner's order (after the kernel's
``early_config_prune``) until one fits the H100 (the autotuner turns ``OutOfResources`` into an
infinite time, as on a GPU) and scores that one 1.0 and the rest infinity without compiling
them, so the autotuner caches the first config that fits. Later calls take the autotuner's
cache, as on a GPU after the first call. Which config a GPU would pick does not change the host
path (the same arguments, a different grid).

Triton internals relied on, checked against Triton 3.9.0 (torch 2.13's); kept in this file:

* ``triton.backends.nvidia.driver.CudaDriver`` (subclassed): its ``utils`` (the C module, built
  by ``CudaUtils()`` with ``library_dirs()`` from ``knobs.nvidia.libcuda_path``) and
  ``launcher_cls``; the attributes ``get_current_device``, ``get_current_stream``,
  ``set_current_device``, ``get_device_capability`` that ``GPUDriver.__init__`` takes from
  ``torch.cuda``, replaced by device 0, stream 0, capability (9, 0).
* ``triton.runtime.driver.driver.set_active`` / ``reset_active``.
* ``DriverBase.get_benchmarker`` (the autotuner's ``do_bench`` when it was given none) and
  ``knobs.autotuning.listener`` (called after each tuning: :class:`FirstFit` starts over).
* ``knobs.runtime.launch_enter_hook`` (a ``HookChain`` in 3.9) for :func:`launch_names`.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import math
import os
import subprocess
from pathlib import Path

#: compute capability and device properties the fake GPU reports (an H100 SXM; also in the C stub)
ARCH = 90
PROPERTIES = {
    "max_shared_mem": 232448,
    "multiprocessor_count": 132,
    "warpSize": 32,
    "max_num_regs": 65536,
}
_SOURCE = Path(__file__).with_name("fake_libcuda.c")
#: the checked Triton version (what this module's internals were read against)
TRITON_CHECKED = "3.9.0"

_state: dict = {}


def _build_libcuda() -> Path:
    """The folder holding the stand-in ``libcuda.so.1``, built once per source (in Triton's cache
    folder, beside the launcher module Triton builds against it)."""
    from triton import knobs

    src = _SOURCE.read_bytes()
    include = Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "include"
    key = hashlib.sha256(src + str(include).encode()).hexdigest()[:16]
    folder = Path(knobs.cache.dir) / "rfattn-fake-libcuda" / key
    lib = folder / "libcuda.so.1"
    if not lib.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"libcuda.so.1.{os.getpid()}"
        cc = os.environ.get("CC", "gcc")
        subprocess.run(
            [cc, str(_SOURCE), "-O2", "-shared", "-fPIC", f"-I{include}",
             "-Wl,-soname,libcuda.so.1", "-o", str(tmp)],
            check=True,
        )  # fmt: skip
        tmp.replace(lib)
    return folder


class FirstFit:
    """The autotuner's benchmarker under the fake GPU (see the module docstring): the first
    config of a tuning that compiles and fits scores 1.0, every later one infinity unrun."""

    def __init__(self):
        self.found = False
        self.tunings: list[dict] = []

    def __call__(self, kernel_call, quantiles=(0.5, 0.2, 0.8), **kwargs):
        if self.found:
            return [math.inf] * len(quantiles)
        kernel_call()  # compiles and launches this config; OutOfResources: the autotuner's inf
        self.found = True
        return [1.0] * len(quantiles)

    def listener(self, *, fn, key, best_config, configs_timings, duration, cache_hit):
        self.found = False
        self.tunings.append({"kernel": fn.__name__, "key": [str(k) for k in key],
                             "config": str(best_config)})  # fmt: skip


def activate() -> dict:
    """Make the fake H100 Triton's active driver in this process (idempotent); returns a
    description of it. Raises where Triton runs under its interpreter."""
    if _state:
        return _state["info"]
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia import driver as nvidia

    if knobs.runtime.interpret:
        raise RuntimeError("the fake GPU needs Triton's compiler: unset TRITON_INTERPRET")
    folder = _build_libcuda()
    lib = ctypes.CDLL(str(folder / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)  # by soname after
    lib.fake_cuda_launches.restype = ctypes.c_ulonglong
    knobs.nvidia.libcuda_path = str(folder)
    tuner = FirstFit()

    class FakeH100Driver(nvidia.CudaDriver):
        """Triton's CUDA driver with torch.cuda's device, stream and capability replaced."""

        def __init__(self):
            super().__init__()  # builds the C launcher module against the stand-in libcuda
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None
            self.get_current_stream = lambda device=None: 0
            self.get_device_capability = lambda device=None: (ARCH // 10, ARCH % 10)

        def get_current_target(self):
            return GPUTarget("cuda", ARCH, 32)

        def get_benchmarker(self):
            return tuner

        @staticmethod
        def is_active():
            return True

    drv = FakeH100Driver()
    props = drv.utils.get_device_properties(0)  # through the C module and the stand-in
    for name, value in PROPERTIES.items():
        if props[name] != value:
            raise RuntimeError(f"fake GPU reports {name}={props[name]}, expected {value}")
    triton.runtime.driver.set_active(drv)
    previous = knobs.autotuning.listener
    if previous is not None:
        raise RuntimeError("an autotuning listener is already installed")
    knobs.autotuning.listener = tuner.listener
    info = {
        "target": f"cuda sm_{ARCH}, warp 32",
        "device_properties": props,
        "libcuda": str(folder / "libcuda.so.1"),
        "triton": triton.__version__,
        "triton_checked": TRITON_CHECKED,
        "autotune": "first config (autotuner's order, after early_config_prune) that compiles "
        "and fits the H100; the autotuner caches it",
    }
    _state.update(lib=lib, driver=drv, tuner=tuner, info=info)
    return info


def launches() -> int:
    """Kernel launches that reached the stand-in ``cuLaunchKernelEx`` since :func:`activate`."""
    return int(_state["lib"].fake_cuda_launches())


def tunings() -> list[dict]:
    """The tunings :class:`FirstFit` settled so far: kernel, key, config."""
    return list(_state["tuner"].tunings)


@contextlib.contextmanager
def launch_names():
    """Collects the name of every kernel launched inside the block (a launch-enter hook: Triton
    then builds each launch's metadata, so this costs time; not for timed runs)."""
    from triton import knobs

    names: list[str] = []

    def hook(metadata):
        names.append(metadata.get()["name"])

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        yield names
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
