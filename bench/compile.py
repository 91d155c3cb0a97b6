"""python -m bench.compile: compile every fused kernel for a GPU, on a machine without one.

The Triton interpreter runs the kernels' Python semantics on CPU, but it is lax where real
compilation is strict: ``tl.dot`` operand dtypes and ``input_precision``, float64 on tensor cores,
layouts, shared memory. This tool closes that gap without a GPU, in two steps:

1. **record**: small calls of every fused path (non-causal and causal, forward and backward, the
   decode step, the stats pass; every feature form, dtype and head size listed in
   :func:`scenarios`) run under the interpreter on CPU while every kernel launch is recorded: its
   argument types, constexprs and launch options. The launchers are told they are on a GPU, so
   they pick the GPU's tile sizes and warps.
2. **compile**: a fresh process with the interpreter off compiles each recorded launch, every
   autotune config of it, for a CUDA target (``--arch``, default 90 = Hopper) through Triton's
   own ptxas, which needs no driver, and reads the resources from the cubin: shared memory
   (against the target's per-block limit), registers and spilled bytes.

``--report DIR`` (``--save-results``: ``bench/results/<this cpu>/``) compiles the benchmark's
scenarios (bf16, D = E = 64, M = 256; every feature form and flag) with every autotune config and
writes ``compile-sm<arch>.json``: per config the registers, spilled stack bytes, shared memory,
CTAs that fit one SM (:func:`ctas_per_sm`), and the tensor-core instructions in the SASS by kind
and static count (:func:`tensor_ops`, from ``cuobjdump -sass``: ``HGMMA.64x64x16.F32.BF16`` is one
bf16 product step, ``HGMMA.64x64x8.F32.TF32`` a TF32 one, three of them per tf32x3 product;
:func:`product_kinds` compiles one product of each kind as the check that the counts mean that).

A launch fails when no config of it compiles within the limits (the autotuner drops configs that
run out of resources; a kernel without autotuning has one config, which ``kernels.common.launch``
steps down, to fewer pipeline stages and then a smaller loop tile, until it fits: this tool
compiles the same steps, and its rows say where a launch fell back to). What this cannot show:
numerics and speed, which need the GPU (``make test``, ``python -m bench`` there).

    python -m bench.compile                       # every scenario, sm_90, table + exit status
    python -m bench.compile --quick --arch 80     # D 64 fp32 + bf16, D 256 fp32; sm_80
    python -m bench.compile --json out.json       # the per-config table as JSON
    python -m bench.compile --save-results        # the compile report, bench/results/<cpu>/
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

#: per-block shared memory limit (bytes, opt-in maximum) by compute capability
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024, 100: 227 * 1024}
#: launch options that are not kernel arguments
_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
_DTYPE_NAMES = {
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
    "torch.float64": "fp64",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.bool": "i1",
}


# ------------------------------------------------------------------------------------------------
# step 1: record launches under the interpreter


def _encode(value):
    """A kernel argument as a JSON-able ``[kind, value]``."""
    import torch
    import triton.language as tl

    if isinstance(value, torch.Tensor):
        return ["ptr", _DTYPE_NAMES[str(value.dtype)]]
    if isinstance(value, tl.dtype):
        return ["tl_dtype", value.name]
    if value is None or isinstance(value, (bool, int, float, str)):
        kind = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(value), "none")
        return [kind, value]
    raise TypeError(f"cannot record a kernel argument of type {type(value).__name__}")


def record(calls) -> list[dict]:
    """Run ``calls`` (``(tag, fn)`` pairs) under the interpreter; return their distinct launches.

    The kernels are not executed (their outputs stay uninitialised): the launchers' Python runs,
    which is all that decides what is launched. Needs ``TRITON_INTERPRET=1`` set before
    ``rfattn.kernels`` was imported.
    """
    from rfattn.kernels import common
    from triton.runtime import interpreter

    if not common.INTERPRET:
        raise RuntimeError("record() needs TRITON_INTERPRET=1 before rfattn.kernels is imported")
    seen, out, tag = set(), [], [""]
    original = interpreter.InterpretedFunction.run

    def spy(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        values = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        rec = {
            "module": fn.__module__,
            "name": fn.__name__,
            "args": {n: _encode(values[n]) for n in self.arg_names if n in values},
            "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs},
        }
        key = json.dumps(rec, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append({**rec, "tag": tag[0]})
        # not run: outputs stay uninitialised, only their types matter here

    interpreter.InterpretedFunction.run = spy
    try:
        for tag[0], fn in calls:
            fn()
    finally:
        interpreter.InterpretedFunction.run = original
    return out


def _fused(q, k, v, rf, causal, key_padding_mask=None, initial_state=None, return_state=False,
           window=0, sinks=0, packed=None):  # fmt: skip
    """``rf_attention(..., backend="triton")`` with the launchers picking a GPU's tiles and launch
    options (the interpreter runs any): the fused path's ``gpu_tiles`` parameter (head maps, if
    ``rf`` has them, in the kernels; ``window``/``sinks``: the fused hybrid; ``packed``: the
    offsets of packed sequences, on the kernels with the offsets)."""
    from rfattn import fused
    from rfattn.call import Call

    call = Call(q, k, v, rf, causal=causal, scale=q.shape[-1] ** -0.5,
                key_padding_mask=key_padding_mask, backend="triton", initial_state=initial_state,
                return_state=return_state, maps=rf.map_tensors(q, k), window=window,
                sinks=sinks, packed=packed and (packed, packed))  # fmt: skip
    if packed:
        return fused.packed(call, gpu_tiles=True)
    if window or sinks:
        return fused.hybrid(call, gpu_tiles=True)
    return fused.attend(call, gpu_tiles=True)


def _call(
    feature,
    weights,
    dtype,
    D,
    E,
    M,
    causal,
    grad=True,
    T=40,
    mask=False,
    state=False,
    learn=False,
    groups=1,
    maps=False,
    window=0,
    sinks=0,
    packed=False,
    **options,
):
    """A closure running one fused call (+ backward) on CPU (``groups`` query heads per
    key/value head; ``maps``: with calibrated head maps; ``window``, ``sinks``: the hybrid;
    ``packed``: T tokens as two packed sequences, on the kernels with the offsets)."""
    import torch

    import rfattn

    def run():
        g = torch.Generator().manual_seed(0)
        B, H = 1, 2
        q = (0.5 * torch.randn(B, H * groups, T, D, generator=g)).to(dtype)
        k = (0.5 * torch.randn(B, H, T, D, generator=g)).to(dtype)
        v = torch.randn(B, H, T, E, generator=g).to(dtype)
        rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=1, **options)
        if learn:
            rf.weight.requires_grad_(True)
        if maps:
            rf.add_head_maps(H * groups, H)
        kw = dict(window=window, sinks=sinks) if window or sinks else {}
        if packed:
            kw["packed"] = (0, T // 3, T)
        if mask:
            kw["key_padding_mask"] = torch.arange(T).expand(B, T) < 3  # left padding
        if state:
            kw["return_state"] = True
            _, st = _fused(q[:, :, :5], k[:, :, :5], v[:, :, :5], rf, True, return_state=True,
                           window=window, sinks=sinks)  # fmt: skip
            kw["initial_state"] = (
                st
                if not grad
                else type(st)(
                    st.s.clone().requires_grad_(), st.z.clone().requires_grad_(), st.offset
                )
            )
        for x in (q, k, v):
            x.requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            out = _fused(q, k, v, rf, causal, **kw)
            if grad:
                loss = (out[0] if isinstance(out, tuple) else out).float().square().sum()
                if state:
                    loss = loss + out[1].s.float().square().sum() + out[1].z.float().sum()
                loss.backward()

    return run


#: every fused feature form: (feature, weights, options for non-causal, options for causal)
_FORMS = [
    ("posrf", "orf", {}, {}),
    ("hyprf", "orf", {}, {}),
    ("gerf", "orf", {"A": -0.1}, {"A": -0.1}),
    ("oprf", "orf", {}, {"stats": "running"}),
    ("saderf", "orf", {}, {"stats": "running"}),
    ("trigrf", "orf", {}, {}),
    ("hrf", "orf", {}, {}),
    ("rmf", "rademacher", {}, {}),
    ("posrf", "sgq", {}, {}),
]


def scenarios(quick: bool = False) -> list[tuple[str, object]]:
    """``(tag, call)`` pairs covering every kernel, feature form and flag combination.

    Head sizes (D = E): 64 (the non-causal benchmark), 128 and 256 (flash-linear-attention's
    causal shapes) with M = 256; dtypes fp32, fp16, bf16, fp64. ``quick``: D = 64 in fp32 and
    bf16, and D = 256 in fp32 (the largest tiles of the dtypes the issue names; fp16 tiles are
    bf16's).
    """
    import torch

    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    combos = [(dtype, D) for dtype in dtypes for D in (64, 128, 256)]
    if quick:
        combos = [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 256)]
    M = 256
    out = []
    for dtype, D in combos:
        dt = str(dtype).removeprefix("torch.")
        for feature, weights, opts, copts in _FORMS:
            name = f"{feature}/{weights}-{dt}-D{D}"
            m = 2 * D + 1 if weights == "sgq" else M  # the sparse grid's level-1 size
            out.append(
                (f"{name}-noncausal", _call(feature, weights, dtype, D, D, m, False, **opts))
            )
            out.append((f"{name}-causal", _call(feature, weights, dtype, D, D, m, True, **copts)))
        # flags: key padding, initial/final state with gradients, decode, grouped-query heads,
        # head maps, learnable W (dW)
        base = ("posrf", "orf", dtype, D, D, M)
        out += [
            (f"posrf-{dt}-D{D}-mask", _call(*base, False, mask=True)),
            # packed sequences on the kernels with the offsets (VARLEN)
            (f"posrf-{dt}-D{D}-packed", _call(*base, False, mask=True, packed=True)),
            (f"posrf-{dt}-D{D}-causal-packed", _call(*base, True, mask=True, packed=True)),
            (f"posrf-{dt}-D{D}-causal-mask-state", _call(*base, True, mask=True, state=True)),
            (f"posrf-{dt}-D{D}-decode", _call(*base, True, grad=False, T=1, state=True)),
            (f"posrf-{dt}-D{D}-causal-gqa", _call(*base, True, groups=3)),
            # the hybrid: the output walk with the exact terms (HAS_EX)
            (f"posrf-{dt}-D{D}-causal-hybrid", _call(*base, True, window=16, sinks=4)),
            # the hybrid's decode step (the recurrent step with the window and the sinks)
            (f"posrf-{dt}-D{D}-decode-hybrid",
             _call(*base, True, grad=False, T=1, state=True, window=16, sinks=4)),
            (f"posrf-{dt}-D{D}-decode-gqa", _call(*base, True, grad=False, T=2, groups=3)),
            # calibrated head maps in the forward kernels (inference)
            (f"posrf-{dt}-D{D}-maps", _call(*base, False, grad=False, maps=True)),
            (f"posrf-{dt}-D{D}-causal-maps", _call(*base, True, grad=False, groups=2, maps=True)),
            (
                f"posrf-{dt}-D{D}-decode-maps",
                _call(*base, True, grad=False, T=2, groups=3, maps=True),
            ),
            # running statistics moved by the key pass (a training call)
            (f"oprf-{dt}-D{D}-running", _call("oprf", "orf", dtype, D, D, M, False,
                                               stats="running")),  # fmt: skip
            # the stats pass's own launch: head maps (the moments read the mapped q and k)
            (f"oprf-{dt}-D{D}-maps", _call("oprf", "orf", dtype, D, D, M, False, grad=False,
                                            maps=True)),  # fmt: skip
            (f"hrf-{dt}-D{D}-decode", _call("hrf", "orf", dtype, D, D, M, True, grad=False, T=4)),
            (
                f"rmf-{dt}-D{D}-decode",
                _call("rmf", "rademacher", dtype, D, D, M, True, grad=False, T=4),
            ),
            (
                f"posrf/fastfoodl-{dt}-D{D}-dW",
                _call("posrf", "fastfoodl", dtype, D, D, M, False, learn=True),
            ),
        ]
    return out


def report_scenarios() -> list[tuple[str, object]]:
    """The scenarios of the compile report: the GPU benchmark's head size and dtype (D = E = 64,
    M = 256, bf16), every feature form and flag."""
    return [(tag, call) for tag, call in scenarios(quick=True) if "-bfloat16-D64" in tag]


# ------------------------------------------------------------------------------------------------
# step 2: compile each launch for a CUDA target (interpreter off)


def _decode(kind, value):
    import triton.language as tl

    return tl.dtype(value) if kind == "tl_dtype" else value


def _specialise(param, kind, value):
    """(signature type, constexpr value or None) of one argument, as Triton's JIT would."""
    if param.is_constexpr:
        return "constexpr", _decode(kind, value)
    if kind == "ptr":
        return "*" + value, None
    if kind == "none" or (kind == "int" and value == 1):
        return "constexpr", value  # the JIT specialises None and ints equal to 1
    if kind == "int":
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), None
    if kind == "bool":
        return "i1", None
    if kind == "float":  # as annotated (``scale: tl.float64``), else the JIT's fp32
        return (getattr(param, "annotation_type", None) or "fp32"), None
    raise TypeError(f"argument {param.name}: cannot pass a {kind} to a non-constexpr parameter")


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """The output of Triton's bundled ``cuobjdump <flag>`` on ``cubin``."""
    from triton.backends.nvidia.compiler import knobs

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run(
            [knobs.nvidia.cuobjdump.path, flag, str(path)], capture_output=True, text=True
        ).stdout


def _cubin_resources(cubin: bytes) -> dict:
    """Registers per thread and local stack bytes (spills) of a cubin, from Triton's cuobjdump."""
    log = _cuobjdump(cubin, "--dump-resource-usage")
    regs, stack = re.search(r"REG:(\d+)", log), re.search(r"STACK:(\d+)", log)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
    }


#: tensor-core instructions in SASS: Hopper's warpgroup HGMMA, the warp-level HMMA / IMMA / DMMA
_TENSOR_OP = re.compile(r"\b((?:HGMMA|HMMA|IMMA|DMMA)(?:\.[0-9A-Za-z_]+)*)")


def tensor_ops(sass: str) -> dict[str, int]:
    """Static count of tensor-core instructions in SASS text by full opcode, e.g.
    ``{"HGMMA.64x64x16.F32.BF16": 8}``: the kind (operand type after the accumulator's) says
    whether a product ran as bf16/fp16, TF32 or fp64; the count is per kernel, every loop body
    counted once (an unrolled loop counts each copy)."""
    counts: dict[str, int] = {}
    for line in sass.splitlines():
        m = _TENSOR_OP.search(line.split("/*")[1] if line.count("/*") >= 2 else line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return dict(sorted(counts.items()))


#: per-SM limits by compute capability: registers, threads, CTAs, shared memory (bytes) and the
#: shared memory each CTA reserves beside its own (CUDA occupancy calculator's values)
SM_LIMITS = {
    80: dict(regs=65536, threads=2048, ctas=32, smem=164 * 1024, reserved=1024),
    90: dict(regs=65536, threads=2048, ctas=32, smem=228 * 1024, reserved=1024),
    100: dict(regs=65536, threads=2048, ctas=32, smem=228 * 1024, reserved=1024),
}


def ctas_per_sm(registers: int, num_warps: int, shared_bytes: int, arch: int = 90) -> int:
    """How many CTAs of a kernel fit one SM at once (registers allocated per warp in units of 256,
    threads, the CTA limit, shared memory with each CTA's reserve): what hides one CTA's
    latency behind another's."""
    lim = SM_LIMITS.get(arch, SM_LIMITS[90])
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = lim["regs"] // (per_warp * num_warps)
    by_threads = lim["threads"] // (32 * num_warps)
    by_smem = lim["smem"] // (shared_bytes + lim["reserved"])
    return min(by_regs, by_threads, lim["ctas"], by_smem)


def _compile_args(jit, args: dict, options: dict, arch: int):
    """Triton's compile of ``jit`` for ``arch`` with the recorded ``args`` (``[kind, value]`` by
    name) and launch ``options``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs = {}, {}
    for param in jit.params:
        kind, value = args[param.name]
        signature[param.name], const = _specialise(param, kind, value)
        if signature[param.name] == "constexpr":
            constexprs[param.name] = const
    src = ASTSource(fn=jit, signature=signature, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _compile_one(job: dict) -> dict:
    """Compile one (launch, config) for ``job["arch"]``; never raises. A launch without
    autotuning is compiled with each of its fallbacks in turn until one fits
    (``kernels.common.fallbacks``; ``fell_back_to`` in the row names it)."""
    import triton
    from rfattn.kernels.common import fallbacks

    rec, cfg, arch = job["launch"], job["config"], job["arch"]
    row = {"kernel": rec["name"], "tag": rec["tag"], "config": cfg, "status": "ok"}
    try:
        obj = getattr(importlib.import_module(rec["module"]), rec["name"])
        jit = obj.fn if isinstance(obj, triton.runtime.Autotuner) else obj
        args = {**rec["args"], **{k: ["int", v] for k, v in cfg["kwargs"].items()}}
        options = {**rec["options"], **cfg["options"]}
        limit = SMEM_LIMIT.get(arch, 48 * 1024)
        asked = options.get("num_stages", 3)  # Triton's default
        if isinstance(obj, triton.runtime.Autotuner):  # the autotuner drops what does not fit
            tries = [({}, asked)]
        else:  # what kernels.common.launch tries in turn
            tries = fallbacks(rec["name"], {k: v for k, (_, v) in args.items()}, asked)
        for i, (over, stages) in enumerate(tries):  # noqa: B007 -- i is read after the loop
            kernel = _compile_args(jit, {**args, **{k: ["int", v] for k, v in over.items()}},
                                   {**options, "num_stages": stages}, arch)  # fmt: skip
            if kernel.metadata.shared <= limit:
                break
        if i:
            row["fell_back_to"] = {**over, "num_stages": stages}
        row["shared_bytes"] = kernel.metadata.shared
        row["num_warps"] = kernel.metadata.num_warps
        row.update(_cubin_resources(kernel.asm["cubin"]))
        if job.get("sass"):
            row["tensor_ops"] = tensor_ops(_cuobjdump(kernel.asm["cubin"], "-sass"))
            row["ctas_per_sm"] = ctas_per_sm(row["registers"] or 0, row["num_warps"],
                                             row["shared_bytes"], arch)  # fmt: skip
        if kernel.metadata.shared > limit:
            row["status"] = "shared memory over the limit"
    except Exception as e:  # noqa: BLE001 -- reported per row
        row["status"] = "error: " + _describe(e)
    return row


def _describe(e: Exception) -> str:
    """One line: where in the kernel (Triton's "at line:col" of each call level) and the cause."""
    chain = [e]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    where = [str(x).split(":\n")[0] for x in chain if str(x).startswith("at ")]
    lines = str(chain[-1]).strip().splitlines()
    carets = [i for i, line in enumerate(lines) if line.strip() == "^"]
    what = " ".join(lines[carets[-1] + 1 :] if carets else lines[-1:]).strip()
    if not carets and not str(chain[-1]).startswith("at "):
        what = f"{type(chain[-1]).__name__}: {what}"
    return (" > ".join(where) + " | " + what)[:500]


def _configs_of(rec: dict, which: str = "all") -> list[dict]:
    """The autotune configs a launch is compiled with: those its autotuner tries after its
    ``early_config_prune`` (its own options when not autotuned); ``which="smallest"``: only the
    one with the fewest tokens per tile, warps and pipeline stages, the config most likely to fit
    (a launch fails only when none does)."""
    import triton

    obj = getattr(importlib.import_module(rec["module"]), rec["name"])
    if not isinstance(obj, triton.runtime.Autotuner):
        return [{"kwargs": {}, "options": {}}]
    configs = obj.configs
    if obj.early_config_prune is not None:
        args = {name: _decode(*value) for name, value in rec["args"].items()}
        configs = obj.early_config_prune(configs, args, **args)
    if which == "smallest":
        configs = [
            min(configs, key=lambda c: (sorted(c.kwargs.values()), c.num_warps, c.num_stages))
        ]
    return [
        {
            "kwargs": dict(c.kwargs),
            "options": {"num_warps": c.num_warps, "num_stages": c.num_stages},
        }
        for c in configs
    ]


def compile_launches(
    launches: list[dict], arch: int = 90, jobs: int | None = None, configs: str = "all",
    sass: bool = False,
) -> list[dict]:  # fmt: skip
    """Compile the configs (``"all"`` or ``"smallest"``) of every launch, in worker processes
    (``sass``: also count each one's tensor instructions and CTAs per SM).

    The interpreter must be off in this process (``TRITON_INTERPRET`` unset before import).
    """
    from rfattn.kernels import common

    if common.INTERPRET:
        raise RuntimeError("compile_launches() needs the interpreter off (TRITON_INTERPRET unset)")
    work = [
        {"launch": r, "config": c, "arch": arch, "sass": sass}
        for r in launches
        for c in _configs_of(r, configs)
    ]
    with ProcessPoolExecutor(max_workers=jobs or os.cpu_count()) as pool:
        return list(pool.map(_compile_one, work, chunksize=1))


def _stage(*args: str, interpret: bool) -> None:
    """Run one stage of this module in a child process (the interpreter is fixed at import)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-m", "bench.compile", "--stage", *args], env=env, check=True, cwd=repo
    )


def compile_in_child(
    launches: list[dict], arch: int = 90, jobs: int | None = None, configs: str = "all",
    sass: bool = False,
) -> list[dict]:  # fmt: skip
    """:func:`compile_launches` in a child process with the interpreter off; the rows."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "launches.json", Path(d) / "rows.json"
        src.write_text(json.dumps(launches))
        _stage(
            "compile",
            str(src),
            str(dst),
            *(["sass"] if sass else []),
            "--arch",
            str(arch),
            "--configs",
            configs,
            *(["--jobs", str(jobs)] if jobs else []),
            interpret=False,
        )
        return json.loads(dst.read_text())


def check(
    quick: bool = False, arch: int = 90, jobs: int | None = None, configs: str = "all",
    report: bool = False,
) -> list[dict]:  # fmt: skip
    """Record under the interpreter in a child process, then compile in another; the rows.
    ``report``: only the benchmark's scenarios (:func:`report_scenarios`), with SASS counts."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "launches.json"
        which = ["report"] if report else ["--quick"] if quick else []
        _stage("record", str(path), *which, interpret=True)
        return compile_in_child(json.loads(path.read_text()), arch, jobs, configs, sass=report)


def failures(rows: list[dict]) -> list[str]:
    """One line per launch none of whose configs compiled within the limits."""
    by_launch: dict[tuple, list[dict]] = {}
    for r in rows:
        by_launch.setdefault((r["kernel"], r["tag"]), []).append(r)
    bad = []
    for (kernel, tag), rs in by_launch.items():
        if not any(r["status"] == "ok" for r in rs):
            bad.append(f"{kernel} [{tag}]: " + "; ".join(sorted({r["status"] for r in rs})))
    return bad


#: every fused kernel under the half policy: no config of theirs may spill for fp16/bf16 inputs
#: (:func:`spills`), but for :data:`KNOWN_SPILLS`
NO_SPILL = ("_fwd_kv_kernel", "_fwd_kv_stats_kernel", "_fwd_q_kernel", "_bwd_ds_kernel",
            "_bwd_dqkv_kernel", "_bwd_dwk_kernel", "_recurrent_kernel", "_chunk_states_kernel",
            "_chunk_out_kernel", "_chunk_dstates_kernel", "_chunk_bwd_kernel",
            "_local_rows_kernel", "_local_dkv_kernel", "_local_dsink_kernel")  # fmt: skip

#: the causal scenarios of the compile report's feature forms (rmf's bf16 inputs run tf32x3:
#: listed, as the report compiles them, though the compile check holds the half policy only)
_CAUSAL = ("gerf/orf", "hyprf/orf", "posrf/orf", "saderf/orf", "hrf/orf", "trigrf/orf",
           "posrf/sgq", "rmf/rademacher")  # fmt: skip


#: ``(kernel, scenario tag)`` of the held kernels' configs that still spill on sm_90 with bf16
#: inputs at D = E = 64, M = 256: the signed-table forms (trigrf, hrf, sgq's signed rows) and rmf
#: in the non-causal kernels, saderf's backward (psi's scales beside the split state products
#: the gradients' accuracy needs, docs/numerics.md: 32 bytes), and the decode step of hrf, rmf
#: and grouped-query heads (16-336 stack bytes at 255 registers); in the causal kernels (32
#: features a tile at 8 warps, ``kernels.common._chunk_tiles``) the whole backward walk
#: (``_chunk_bwd``, 168-1184 bytes), and the output walk and reverse state walk of the signed
#: tables, grouped-query heads and head maps (24-368 bytes), and rmf's (tf32x3: 8-2640 bytes).
#: :func:`unexpected_spills` holds every other config to 0 and names one of these that no
#: longer spills.
KNOWN_SPILLS = frozenset(
    [(k, f"{form}-bfloat16-D64-noncausal")
     for k in ("_fwd_kv_kernel", "_fwd_q_kernel", "_bwd_ds_kernel", "_bwd_dqkv_kernel")
     for form in ("hrf/orf", "trigrf/orf", "posrf/sgq", "rmf/rademacher")]
    + [("_bwd_dqkv_kernel", "saderf/orf-bfloat16-D64-noncausal")]
    + [("_recurrent_kernel", f"{t}-bfloat16-D64-decode{x}")
       for t, x in (("hrf", ""), ("rmf", ""), ("posrf", "-gqa"))]
    + [("_chunk_bwd_kernel", f"{form}-bfloat16-D64-causal") for form in _CAUSAL]
    + [("_chunk_bwd_kernel", f"posrf-bfloat16-D64-causal-{x}")
       for x in ("gqa", "mask-state", "hybrid", "packed")]
    # packed sequences (VARLEN): each sequence's pointers shifted to its first token, live
    # across the walks (8 and 256 stack bytes, against 0 and 184 with the same mask unpacked)
    + [("_chunk_out_kernel", "posrf-bfloat16-D64-causal-packed")]
    + [(k, f"{form}-bfloat16-D64-causal")
       for k in ("_chunk_out_kernel", "_chunk_dstates_kernel")
       for form in ("hrf/orf", "trigrf/orf", "posrf/sgq", "rmf/rademacher")]
    + [("_chunk_states_kernel", "rmf/rademacher-bfloat16-D64-causal")]
    + [(k, "posrf-bfloat16-D64-causal-gqa") for k in ("_chunk_out_kernel", "_chunk_dstates_kernel")]
    + [("_chunk_out_kernel", "posrf-bfloat16-D64-causal-maps")]
)  # fmt: skip


def unexpected_spills(rows: list[dict], known=KNOWN_SPILLS, ceilings: dict | None = None
                      ) -> list[str]:  # fmt: skip
    """:func:`spills` of configs outside ``known``, one line per ``known`` row compiled here
    whose every config now fits without spilling (drop it from ``known``), and with
    ``ceilings`` (:func:`spill_ceilings`) one per config of a ``known`` row that spills more
    than the most its row's configs spilled in the committed report."""
    found = [r for r in rows if (r["kernel"], r["tag"]) not in known]
    fixed = {(r["kernel"], r["tag"]) for r in rows} & known
    fixed -= {(r["kernel"], r["tag"]) for r in rows if r.get("stack_bytes")}
    grown = [
        f"{r['kernel']} [{r['tag']}] {r['config']}: {r['stack_bytes']} stack bytes, more than "
        f"the committed report's {ceilings[r['kernel'], r['tag']]} (rerun python -m bench.compile "
        "--save-results where that is meant)"
        for r in rows
        if ceilings and (r["kernel"], r["tag"]) in known and (r["kernel"], r["tag"]) in ceilings
        and (r.get("stack_bytes") or 0) > ceilings[r["kernel"], r["tag"]]
    ]  # fmt: skip
    return spills(found) + [f"{k} [{t}]: no longer spills (drop it from KNOWN_SPILLS)"
                            for k, t in sorted(fixed)] + grown  # fmt: skip


#: the committed compile report (``--save-results``), whose spills bound the known rows'
REPORT = Path(__file__).resolve().parent / "results" / "cpu-x86_64-2core" / "compile-sm90.json"


def spill_ceilings(report: Path = REPORT) -> dict | None:
    """``{(kernel, tag): the most stack bytes any config of the row spilled}`` in the committed
    compile report, for :func:`unexpected_spills`: a known spill may shrink, not grow. None where
    the report is missing or was compiled by another Triton than this one (whose register
    allocation differs: the report's numbers say nothing of it)."""
    import triton

    try:
        doc = json.loads(Path(report).read_text())
    except FileNotFoundError:
        return None
    if doc.get("env", {}).get("triton") != triton.__version__:
        return None
    out: dict = {}
    for r in doc["rows"]:
        k = (r["kernel"], r["tag"])
        out[k] = max(out.get(k, 0), r.get("stack_bytes") or 0)
    return out


def spills(rows: list[dict], kernels=NO_SPILL) -> list[str]:
    """One line per compiled config of ``kernels`` that spills (stack bytes per thread > 0)."""
    return [
        f"{r['kernel']} [{r['tag']}] {r['config']}: {r['stack_bytes']} stack bytes, "
        f"{r['registers']} registers"
        for r in rows
        if r["kernel"] in kernels and r.get("stack_bytes")
    ]


def _print_table(rows: list[dict]) -> None:
    """Worst case per kernel: most shared memory, most registers, any spill, failures, and the
    launches that fitted only with fewer pipeline stages than asked."""
    kernels: dict[str, list[dict]] = {}
    for r in rows:
        kernels.setdefault(r["kernel"], []).append(r)
    print(
        f"{'kernel':<26}{'configs':>8}{'failed':>8}{'max smem KiB':>14}{'max regs':>10}"
        f"{'spilling':>10}{'fell back':>11}"
    )
    for name, rs in sorted(kernels.items()):
        ok = [r for r in rs if "shared_bytes" in r]
        smem = max((r["shared_bytes"] for r in ok), default=0) / 1024
        regs = max((r["registers"] or 0 for r in ok), default=0)
        spill = sum(1 for r in ok if r.get("stack_bytes"))
        fail = sum(1 for r in rs if r["status"] != "ok")
        back = sum(1 for r in rs if "fell_back_to" in r)
        print(f"{name:<26}{len(rs):>8}{fail:>8}{smem:>14.1f}{regs:>10}{spill:>10}{back:>11}")


def product_kinds(arch: int = 90) -> dict[str, dict[str, int]]:
    """What one 64 x 64 x 64 ``tl.dot`` compiles to for ``arch`` per operand dtype and
    ``input_precision`` (:func:`tensor_ops` of each), and ``kernels.common.half_dot`` of fp32
    operands: the check that the report's counts mean what they say, and that the kernels' half
    product is one bf16 tensor product. The interpreter must be off."""
    import triton
    import triton.language as tl
    from rfattn.kernels.common import half_dot
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def _product(a_ptr, b_ptr, c_ptr, PREC: tl.constexpr):
        o = tl.arange(0, 64)
        a = tl.load(a_ptr + o[:, None] * 64 + o[None, :])
        b = tl.load(b_ptr + o[:, None] * 64 + o[None, :])
        if PREC == "half_dot":  # fp32 operands, kernels.common's bf16 product
            c = half_dot(a, b, tl.bfloat16)
        else:
            c = tl.dot(a, b, input_precision=PREC)
        tl.store(c_ptr + o[:, None] * 64 + o[None, :], c)

    out = {}
    kinds = (("bf16", "ieee"), ("fp32", "tf32"), ("fp32", "tf32x3"), ("fp32", "half_dot"))
    for dtype, precision in kinds:
        sig = {"a_ptr": "*" + dtype, "b_ptr": "*" + dtype, "c_ptr": "*fp32", "PREC": "constexpr"}
        src = ASTSource(fn=_product, signature=sig, constexprs={"PREC": precision})
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        out[f"{dtype}/{precision}"] = tensor_ops(_cuobjdump(kernel.asm["cubin"], "-sass"))
    return out


def product_kinds_in_child(arch: int = 90) -> dict[str, dict[str, int]]:
    """:func:`product_kinds` in a child process with the interpreter off."""
    with tempfile.TemporaryDirectory() as d:
        dst = Path(d) / "kinds.json"
        _stage("products", str(dst), "--arch", str(arch), interpret=False)
        return json.loads(dst.read_text())


def report(rows: list[dict], arch: int) -> dict:
    """The compile report: the environment, every row, and per kernel its worst config
    (registers, spill bytes, shared memory, fewest CTAs per SM) and the tensor instruction kinds
    any config uses."""
    import torch

    from bench.env import environment

    kernels: dict[str, dict] = {}
    for r in rows:
        k = kernels.setdefault(r["kernel"], {"configs": 0, "failed": 0, "registers": 0,
                                             "spilling_configs": 0, "stack_bytes": 0,
                                             "shared_bytes": 0, "ctas_per_sm": None,
                                             "tensor_ops": {}})  # fmt: skip
        k["configs"] += 1
        if "shared_bytes" not in r:
            k["failed"] += 1
            continue
        k["registers"] = max(k["registers"], r["registers"] or 0)
        k["stack_bytes"] = max(k["stack_bytes"], r["stack_bytes"] or 0)
        k["spilling_configs"] += bool(r["stack_bytes"])
        k["shared_bytes"] = max(k["shared_bytes"], r["shared_bytes"])
        c = r.get("ctas_per_sm")
        k["ctas_per_sm"] = c if k["ctas_per_sm"] is None else min(k["ctas_per_sm"], c)
        for op, n in r.get("tensor_ops", {}).items():
            k["tensor_ops"][op] = max(k["tensor_ops"].get(op, 0), n)
    return {
        "schema": "rfattn.compile_report/1",
        "env": environment(torch.device("cpu")),
        "arch": arch,
        "scenarios": "bf16, D = E = 64, M = 256: every fused feature form and flag "
        "(bench.compile.report_scenarios), every autotune config",
        "kernels": dict(sorted(kernels.items())),
        "rows": rows,
    }


def markdown(doc: dict) -> str:
    """The report's per-kernel table (worst config of each kernel)."""
    lines = [
        f"sm_{doc['arch']}, {doc['scenarios']}",
        "",
        "| kernel | configs | max regs | spilling configs | max stack B | max smem KiB "
        "| min CTAs/SM | tensor instructions (most in one config) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, k in doc["kernels"].items():
        ops = ", ".join(f"{n} × {op}" for op, n in k["tensor_ops"].items()) or "none"
        lines.append(f"| `{name}` | {k['configs']} | {k['registers']} | {k['spilling_configs']} "
                     f"| {k['stack_bytes']} | {k['shared_bytes'] / 1024:.1f} | {k['ctas_per_sm']} "
                     f"| {ops} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compile", description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability (90: H100/H200)")
    p.add_argument(
        "--quick", action="store_true", help="D = 64 in fp32 and bf16, D = 256 in fp32 only"
    )
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: all cores)")
    p.add_argument(
        "--configs",
        choices=("all", "smallest"),
        default="all",
        help="autotune configs to compile per launch (smallest: the likeliest to fit)",
    )
    p.add_argument("--json", type=Path, default=None, help="write the per-config rows here")
    p.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="the compile report: bf16 D 64 scenarios, every config, registers, spills, shared "
        "memory, CTAs per SM and tensor instructions; writes DIR/compile-sm<arch>.json",
    )
    p.add_argument("--save-results", action="store_true",
                   help="--report into bench/results/<this cpu>/")  # fmt: skip
    p.add_argument("--stage", nargs="+", help=argparse.SUPPRESS)  # internal: record / compile
    a = p.parse_args(argv)
    if a.stage and a.stage[0] == "record":
        which = report_scenarios() if "report" in a.stage[2:] else scenarios(a.quick)
        Path(a.stage[1]).write_text(json.dumps(record(which)))
        return 0
    if a.stage and a.stage[0] == "products":
        Path(a.stage[1]).write_text(json.dumps(product_kinds(a.arch)))
        return 0
    if a.stage and a.stage[0] == "compile":
        launches = json.loads(Path(a.stage[1]).read_text())
        rows = compile_launches(launches, a.arch, a.jobs, a.configs, sass="sass" in a.stage[3:])
        Path(a.stage[2]).write_text(json.dumps(rows))
        return 0
    if a.save_results:
        import torch

        from bench.env import results_slug

        a.report = Path(__file__).parent / "results" / results_slug(torch.device("cpu"))
    if a.report:
        rows = check(arch=a.arch, jobs=a.jobs, configs="all", report=True)
        a.report.mkdir(parents=True, exist_ok=True)
        path = a.report / f"compile-sm{a.arch}.json"
        path.write_text(json.dumps(report(rows, a.arch), indent=1) + "\n")
        print(markdown(json.loads(path.read_text())))
        print(f"# wrote {path}")
        for line in unexpected_spills(rows):
            print("SPILLS", line)
        return 1 if failures(rows) or unexpected_spills(rows) else 0
    rows = check(a.quick, a.arch, a.jobs, a.configs)
    _print_table(rows)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    bad = failures(rows)
    for line in bad:
        print("FAILED", line)
    print(f"{len(rows)} compiles for sm_{a.arch}: {len(bad)} launches with no working config")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
