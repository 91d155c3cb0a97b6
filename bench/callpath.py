"""The Python-level path of ``rf_attention(..., backend="triton")`` through the project's code.

``python -m bench.callpath [--out FILE.json]`` runs four calls on tiny CPU inputs under the
Triton interpreter (B=1, H=1, T=16, D=8, M=16, fp32) and, for each, reports how many of the
project's functions and files the call goes through: a measure of how far the code of one call
is spread, to compare before and after a refactor (fewer hops for the same work reads easier).

Paths: ``noncausal-posrf`` and ``noncausal-oprf`` (``rf_parallel``), ``causal-posrf`` (inputs
that require grad, so the chunked form ``rf_chunk``), ``decode-posrf`` (causal, under
``torch.no_grad()``: one token with the state of a 15-token prefix, ``rf_recurrent``), and
``torch-causal-posrf`` (``backend="torch"``, causal, inputs that require grad: the torch path's
blocked forward and its hand-written backward, ``out.sum().backward()``). The fused paths trace
the forward call only.

What is counted, with ``sys.setprofile``, during one warm call (the same call runs once before,
untraced, so that lazy imports and the autotuner's first benchmark stay out of the count):

* call events: ``'call'`` events of code whose file lies in this checkout's ``rfattn/`` or
  ``kernels/`` folder; not module bodies (``<module>``), not a generator's resumptions (only its
  first entry), not the bodies of ``@triton.jit`` functions that the interpreter executes (their
  file and name are those of the functions found under a JIT function's ``.fn``, through any
  ``@triton.autotune`` / ``@triton.heuristics`` wrapper, at module level in the loaded
  ``rfattn`` modules, ``rfattn.kernels`` included): those are GPU code, not the Python path.
* functions: distinct ``file:qualified name`` among the call events, in order of first entry;
* files: distinct files among them;
* file crossings: consecutive call events whose files differ (a return is no event: A calls B
  in another file and then C in A's file counts 2).

``--fake-gpu`` runs the fused paths through Triton's compiled launch path against the fake sm_90
driver of ``python -m bench.host`` (``bench/fake_gpu.py``; the interpreter off, the kernels
compiled for an H100, launches that do nothing) instead of the interpreter: the functions a GPU's
call enters (the interpreter adds its own few per launch: Triton's launch and the grid).
``--paths`` picks some of the paths.

Imports come from the checkout this file lies in (``rfattn`` from ``rfattn/``, ``rfattn.kernels``
from ``kernels/``), whatever editable install the environment has; the script checks that.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import inspect
import itertools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"rfattn": ROOT / "rfattn", "rfattn.kernels": ROOT / "kernels"}
FOLDERS = tuple(str(p) + os.sep for p in PACKAGES.values())
#: the interpreter unless --fake-gpu (read when the kernels are decorated, at rfattn's import)
FAKE_GPU = "--fake-gpu" in sys.argv[1:] and __name__ == "__main__"
if not FAKE_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # CPU inputs
else:
    os.environ.pop("TRITON_INTERPRET", None)


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds ``rfattn`` and ``rfattn.kernels`` in ROOT (ahead of an editable install's finder);
    their submodules follow from the packages' ``__path__``."""

    def find_spec(self, name, path=None, target=None):
        if name not in PACKAGES:
            return None
        folder = PACKAGES[name]
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


sys.meta_path.insert(0, _CheckoutFinder())

import torch  # noqa: E402

if FAKE_GPU:  # Triton's CUDA driver against the stand-in libcuda, before the kernels compile
    from bench import fake_gpu, host  # noqa: E402

    fake_gpu.activate()

import rfattn  # noqa: E402
from rfattn import kernels  # noqa: E402

if FAKE_GPU:
    host.route_cpu_tensors_to_triton()

B, H, T, D, M = 1, 1, 16, 8, 16


def _jit_bodies() -> set[tuple[str, str]]:
    """(file, name) of every module-level @triton.jit function of the loaded rfattn modules."""
    from triton.runtime.jit import KernelInterface

    found = set()
    for name, mod in list(sys.modules.items()):
        if not (name == "rfattn" or name.startswith("rfattn.")) or mod is None:
            continue
        for obj in vars(mod).values():
            jit = False
            while isinstance(obj, KernelInterface) and hasattr(obj, "fn"):
                jit, obj = True, obj.fn
            if jit and inspect.isfunction(obj):
                found.add((os.path.realpath(obj.__code__.co_filename), obj.__code__.co_name))
    return found


def trace(call) -> list[str]:
    """``file:qualified name`` of each project call event while ``call()`` runs."""
    skip, where, events, started = _jit_bodies(), {}, [], set()
    gen = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code not in where:
            path = os.path.realpath(code.co_filename)
            keep = path.startswith(FOLDERS) and code.co_name != "<module>"
            keep = keep and (path, code.co_name) not in skip
            qualname = getattr(code, "co_qualname", code.co_name)
            where[code] = f"{os.path.relpath(path, ROOT)}:{qualname}" if keep else None
        if where[code] is None:
            return
        if code.co_flags & gen:  # a generator's frame: count its first entry only
            if frame in started:
                return
            started.add(frame)
        events.append(where[code])

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return events


def summary(events: list[str]) -> dict:
    files = [e.rsplit(":", 1)[0] for e in events]
    return {
        "functions": list(dict.fromkeys(events)),
        "files": list(dict.fromkeys(files)),
        "calls": len(events),
        "crossings": sum(a != b for a, b in itertools.pairwise(files)),
    }


def paths() -> dict:
    """name -> zero-argument call of rf_attention on fixed tiny inputs."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=gen) * 0.5 for _ in range(3))
    posrf = rfattn.RandomFeatures(D, M, feature="posrf", seed=0)
    oprf = rfattn.RandomFeatures(D, M, feature="oprf", seed=0)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    prefix, last = [x[:, :, :-1] for x in (q, k, v)], [x[:, :, -1:] for x in (q, k, v)]
    with torch.no_grad():
        kw = dict(causal=True, backend="triton", return_state=True)
        _, state = rfattn.rf_attention(*prefix, posrf, **kw)

    def decode():
        with torch.no_grad():
            return rfattn.rf_attention(*last, posrf, initial_state=state, **kw)

    return {
        "noncausal-posrf": lambda: rfattn.rf_attention(q, k, v, posrf, backend="triton"),
        "noncausal-oprf": lambda: rfattn.rf_attention(q, k, v, oprf, backend="triton"),
        "causal-posrf": lambda: rfattn.rf_attention(
            qg, kg, vg, posrf, causal=True, backend="triton"
        ),
        "decode-posrf": decode,
        "torch-causal-posrf": lambda: rfattn.rf_attention(
            qg, kg, vg, posrf, causal=True, backend="torch"
        ).sum().backward(),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.callpath",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    parser.add_argument("--fake-gpu", action="store_true",
                        help="compiled launches on the fake sm_90 driver, not the interpreter")
    parser.add_argument("--paths", nargs="+", help="only these paths (default: every one)")
    args = parser.parse_args(argv)
    for mod in (rfattn, kernels):
        if not os.path.realpath(mod.__file__).startswith(FOLDERS):
            raise RuntimeError(f"{mod.__name__} imported from {mod.__file__}, not from {ROOT}")
    torch.set_num_threads(1)
    results = {}
    for name, call in paths().items():
        if args.paths and name not in args.paths:
            continue
        call()  # warm: lazy imports, autotuning, launch plans
        results[name] = summary(trace(call))
    how = "the fake sm_90 driver" if FAKE_GPU else "TRITON_INTERPRET=1"
    print(f"rfattn call paths ({ROOT}, backend='triton', {how})\n")
    print("| path | functions | files | file crossings |\n| --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {len(r['functions'])} | {len(r['files'])} | {r['crossings']} |")
    for name, r in results.items():
        print(f"\n{name}:\n  " + "\n  ".join(r["functions"]))
    if args.out:
        args.out.write_text(json.dumps({"root": str(ROOT), "fake_gpu": FAKE_GPU,
                                        "paths": results}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
