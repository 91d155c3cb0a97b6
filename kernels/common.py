"""Shared pieces of the fused kernels: the per-tile feature epilogues, loads, and launch setup.

``rf_parallel`` (non-causal), ``rf_chunk`` (causal) and ``rf_recurrent`` (decode) compute the same
features ``phi = g exp(u - offset)`` of pre-scaled inputs ``x~`` through :func:`feature_tile`
(forward) and :func:`feature_dx` / :func:`feature_dw` (backward), and launch through
:class:`Setup`, so one feature form is written once for every algorithmic form.

Feature forms (constexpr ``FEATURE``; ``w`` ``[F, D]`` holds one projection row per feature,
``z_f = w_f . x~``, ``|w_f|^2`` computed in the kernel):

* 0, ``"gerf"``: the real positive GERF family ``u = A |w|^2 + B z - |x~|^2 / 2``, ``g = 1``, with
  per-(b, h) A, B and input scales psi (``x~ = sqrt(scale) psi x`` for queries,
  ``sqrt(scale) x / psi`` for keys): posrf (A = 0, B = 1, psi = 1), hyprf (rows [W; -W]), real
  gerf, oprf, saderf. The per-(b, h) constant log D cancels with the offsets and is dropped.
* 1, ``"table"``: signed exponential features (trigrf, hrf, complex gerf) from a per-feature,
  per-side coefficient table ``[2, 9, F]`` (side 0 queries, 1 keys):
  ``u = cu z + ch |x~|^2 + cw |w|^2 + bias``, ``th = ct z + tw |w|^2 + tb``,
  ``g = (ga + gb cos th) s``, where ``s = sgn(tau_l . x~)`` (sgn 0 = +1) for the features with an
  index ``l = lam_f >= 0`` into extra rows tau ``[n, D]`` (hrf's lambda projections), else 1.
  (sin th is ``cos(th - pi/2)``: ``tb`` carries the shift.) The sign has zero derivative.
* 2, ``"rmf"``: random Maclaurin features, plain (no exponential, no offsets: u = 0):
  ``phi_f = c_f prod_{r in seg(f)} (rho_r . x~)`` over the feature's stacked projection rows
  rho ``[R, D]`` (stage 0 = W's row, then the later stages, feature-major: feature f owns rows
  ``start_f .. start_{f+1} - 1``). In registers: ONE projection of a feature tile's row range,
  ``Z = x~ rho^T`` ``[BT, BR]``, then ``log|phi| = log|c| + (log|Z|) Seg`` and the sign parity
  ``(Z < 0) Seg mod 2`` through the 0/1 segment matrix ``Seg[r, f] = (owner(r) == f)`` on
  ``tl.dot`` (ieee: 0/1 times values is exact), so ``phi = c (-1)^parity exp(log|phi|)``.
  ``|Z|`` is floored at ``tiny`` inside the log so that the backward's exclusive products
  ``prod_{r' != r} = exp(log|phi| - log|Z_r|)`` stay finite when a projection is 0; a feature of
  degree 0 is the constant c. No dW (rmf's Rademacher rows are never learnable).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import types

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton import knobs
from triton.runtime import driver
from triton.runtime.autotuner import Autotuner
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

#: Whether kernels were decorated under the Triton interpreter (read once, at import).
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: CPU tensors stand for a GPU's: the launchers launch the compiled kernels on them through
#: whatever driver Triton has (``bench.host``'s fake sm_90 driver, which runs no kernel), and
#: the operators (:mod:`rfattn.ops`) take the Triton path for them. Set by that benchmark only.
FAKE_DEVICE = False


#: kernels launched without autotuning -> a constexpr tile that only loops inside the kernel (no
#: layout another launch shares), which :func:`fallbacks` may halve
LOOP_TILES = {"_chunk_bwd_kernel": "BM"}
#: launches that fitted only with a fallback: (kernel, specialisation) -> (overrides, stages)
_FITTED: dict = {}


def fallbacks(name: str, constexprs: dict, stages: int):
    """The ``(constexpr overrides, num_stages)`` a launch of kernel ``name`` without autotuning
    tries in turn until one fits the GPU's shared memory: the pipeline depth asked, then one
    stage fewer down to one; then, for a kernel in :data:`LOOP_TILES`, the same with that tile
    halved, down to 16 (``tl.dot``'s least).

    The launch options (:meth:`Setup.launch_options`) and tiles are sized and checked for sm_90
    (``python -m bench.compile``) with the Triton versions the project compiles with; another
    version can lay the same tiles out larger: Triton 3.8 (torch 2.14's) needs 305 KiB of the
    227 for the bf16 causal backward at D = 64 at three stages and 208 at one, where 3.9 takes
    209 at three; with grouped-query heads or rmf, 240-256 KiB even at one stage, and 208-225 at
    three with the feature tile halved.
    """
    tile = LOOP_TILES.get(name)
    size = constexprs.get(tile) if tile else None
    while True:
        for s in range(max(stages, 1), 0, -1):
            yield ({tile: size} if tile else {}), s
        if size is None or size <= 16:
            return
        size //= 2


def launch(kernel, grid, *args, **kwargs):
    """``kernel[grid](*args, **kwargs)`` through a launch plan (:data:`PLANS`): the first launch
    of a specialisation goes Triton's whole way (autotuner, JIT binding, compile or kernel cache)
    and leaves a plan; later ones call the compiled kernel directly (Triton's own last step),
    with the grid of the config the first one ran (a callable ``grid`` is called with the
    launch's constexprs and that config, never with its tensors). ~4 µs a launch instead of
    Triton's 30-50 (``python -m bench.host``). Tensors are passed positionally, constexprs and
    launch options by keyword. (A launcher with a per-shape plan binds its launches once,
    :class:`Launch`, and skips even this lookup.)

    A kernel without autotuning also takes the first of its :func:`fallbacks` that fits where
    the config asked for runs out of shared memory (which would otherwise be an
    ``OutOfResources`` error); what fitted is remembered per kernel and specialisation (and is
    then the plan's). Any other error, or shared memory short at every fallback, is raised."""
    if PLANS:
        drv = driver.active
        device = drv.get_current_device()
        # what Triton's keys hold, or more: ints and constexprs by value (Triton: their
        # divisibility by 16 and == 1), tensors by dtype and 16-byte alignment, floats by type,
        # anything else (bools, None) by type and value; ints first: the cheapest, the most
        key = (kernel, device, *kwargs.items(), *[
            a if type(a) is int else (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, Tensor)
            else (type(a), None if type(a) is float else a)
            for a in args
        ])  # fmt: skip
        plan = LAUNCH_PLANS.get(key)
        if plan is not None:
            run, compiled, tail, meta = plan
            g = grid(meta) if callable(grid) else grid
            stream = drv.get_current_stream(device)
            hooks = knobs.runtime
            run(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1, stream,
                compiled.function, compiled.packed_metadata,
                compiled.launch_metadata(g, stream, *args, *tail),
                hooks.launch_enter_hook, hooks.launch_exit_hook, *args, *tail)  # fmt: skip
            return compiled
    out, consts = _triton_launch(kernel, grid, args, kwargs)
    if PLANS:
        if len(LAUNCH_PLANS) >= MAX_PLANS:  # ever new shapes: start over rather than grow
            LAUNCH_PLANS.clear()
        LAUNCH_PLANS[key] = _plan(kernel, out, len(args), consts)
    return out


def _triton_launch(kernel, grid, args: tuple, kwargs: dict):
    """(what Triton's launch returned, its constexprs): the autotuner's way, or the fitting
    launch of a kernel without autotuning."""
    if isinstance(kernel, Autotuner):  # its configs carry the launch options
        return kernel[grid](*args, **kwargs), kwargs
    return _fitting_launch(kernel, grid, args, dict(kwargs))


class Launch:
    """One launch of a launcher's per-shape plan (:func:`shape_plan`): the kernel, its grid and
    its constexprs, bound once; each call passes the positional arguments.

    The first call goes Triton's whole way (as :func:`launch`'s first launch); later ones call
    the compiled kernel the first one ran directly, with its grid, without building a key from
    the arguments: the plan's key (sizes, strides, dtypes, devices, 16-byte alignment
    of the inputs) fixes everything Triton specialises on, and every tensor the launcher makes
    (outputs, scratch, the form's tensors, :func:`form_args`) is contiguous and aligned. The
    launch metadata Triton's hooks read is made only while a hook is installed. Under the
    interpreter (nothing compiled), or for a launch that cannot be replayed (:func:`_plan`),
    every call goes Triton's way."""

    __slots__ = ("kernel", "grid", "kwargs", "direct")

    def __init__(self, kernel, grid, **kwargs):
        self.kernel, self.grid, self.kwargs, self.direct = kernel, grid, kwargs, None

    def __call__(self, *args) -> None:
        direct = self.direct
        if direct is not None:
            drv, device, run, compiled, function, packed, g, tail, c_launch, c_flags, c_sig = direct
            if drv is driver.active and drv.get_current_device() == device:
                stream = drv.get_current_stream(device)
                hooks = knobs.runtime
                enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook
                # a hook installed: a function, or (Triton 3.9) a chain of hooks with some in it;
                # an empty chain is no hook, nothing for the launcher to call
                if enter is not None and getattr(enter, "calls", True) or \
                        leave is not None and getattr(leave, "calls", True):  # fmt: skip
                    meta = compiled.launch_metadata(g, stream, *args, *tail)
                elif c_launch is not None:  # no hook: the C launcher itself
                    c_launch(*g, stream, function, *c_flags, packed, None, None, None, None, None,
                             *c_sig, (*args, *tail))  # fmt: skip
                    return
                else:
                    meta = enter = leave = None
                run(*g, stream, function, packed, meta, enter, leave, *args, *tail)
                return
        compiled, consts = _triton_launch(self.kernel, self.grid, args, self.kwargs)
        plan = _plan(self.kernel, compiled, len(args), consts) if PLANS else None
        if plan is not None:
            run, compiled, tail, meta = plan
            g = self.grid(meta) if callable(self.grid) else self.grid
            g = (g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1)
            drv = driver.active
            self.direct = (drv, drv.get_current_device(), run, compiled, compiled.function,
                           compiled.packed_metadata, g, tail, *c_launcher(run))  # fmt: skip


#: Triton versions whose CUDA launcher :func:`c_launcher` reads (its attributes and the C
#: function's arguments, from ``triton/backends/nvidia/driver.py``'s ``CudaLauncher``)
C_LAUNCHER_TRITON = ("3.9.0",)


def c_launcher(run) -> tuple:
    """``(C launch function, (cooperative grid, PDL), (argument annotations, kernel
    signature))`` of a compiled kernel's launcher ``run``, for a replayed launch without a hook
    to call Triton's C launch function itself with what the launcher's ``__call__`` would pass
    it (no global or profile scratch to allocate, no GSan): ~3-4 µs less per launch
    (``python -m bench.host``). ``(None, (), ())`` for any other launcher or Triton version:
    such launches call ``run``."""
    if run is None or triton.__version__ not in C_LAUNCHER_TRITON or \
            type(run).__name__ != "CudaLauncher" or \
            run.global_scratch_size or run.profile_scratch_size or \
            getattr(run, "gsan_enabled", True):  # fmt: skip
        return None, (), ()
    return (run.launch, (run.launch_cooperative_grid, run.launch_pdl),
            (run.arg_annotations, run.kernel_signature))  # fmt: skip


def _fitting_launch(kernel, grid, args: tuple, kwargs: dict):
    """(what the launch returned, its constexprs) of a kernel launched without autotuning: as
    asked (or as what fitted before, for this specialisation), then through :func:`fallbacks`
    only where that runs out of shared memory (:func:`launch`)."""
    asked = kwargs.pop("num_stages", 3)  # Triton's default
    fitted = _FITTED.get(_specialisation(kernel, asked, args, kwargs)) if _FITTED else None
    over, stages = fitted or ({}, asked)
    try:
        return kernel[grid](*args, **{**kwargs, **over}, num_stages=stages), {**kwargs, **over}
    except OutOfResources as e:
        if e.name != "shared memory" or fitted:
            raise
        error = e
    for over, stages in itertools.islice(fallbacks(kernel.fn.__name__, kwargs, asked), 1, None):
        try:
            out = kernel[grid](*args, **{**kwargs, **over}, num_stages=stages)
        except OutOfResources as e:
            if e.name != "shared memory":
                raise
            error = e
            continue
        _FITTED[_specialisation(kernel, asked, args, kwargs)] = over, stages
        return out, {**kwargs, **over}
    raise error


def _plan(kernel, compiled, positional: int, consts: dict):
    """``(run, compiled kernel, the constexprs after the positional arguments in the kernel's
    order, the grid's meta)`` of a launch that returned ``compiled``, or None (no plan: every
    launch of it then goes Triton's way) when the launch cannot be replayed: not a compiled
    kernel (the interpreter), a config with a pre-hook (Triton runs it at every launch), an
    argument by keyword that is not a constexpr, or a tensor among them. An autotuner's
    ``reset_to_zero`` and ``restore_value`` act only while it tunes (around its benchmark runs,
    the first launch of a key), never at a launch of a tuned key: such a launch is replayed as
    Triton makes it."""
    compiled = compiled.result() if hasattr(compiled, "result") else compiled  # 3.6's futures
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    jit = kernel
    if isinstance(kernel, Autotuner):
        config = kernel.best_config
        if config.pre_hook:
            return None
        jit, consts = kernel.fn, {**consts, **config.kwargs}
    if not isinstance(jit, JITFunction):
        return None
    names = jit.arg_names[positional:]
    if any(n not in consts or isinstance(consts[n], torch.Tensor) for n in names):
        return None
    meta = {n: consts[n] for n in names}
    return compiled.run, compiled, tuple(meta.values()), meta


#: launch plans (:func:`launch`): (kernel, device, constexprs and options, the arguments'
#: specialisation) -> plan, or None for a launch that always goes Triton's way. Off under the
#: interpreter (nothing is compiled); ``knobs`` that change Triton's compile key (debug,
#: instrumentation) apply to specialisations first launched after the change.
LAUNCH_PLANS: dict = {}
PLANS = not INTERPRET
#: plans kept at most; past it the table starts over (each plan costs one launch Triton's way)
MAX_PLANS = 4096


#: every launcher's dictionary of per-shape plans (:func:`plan_cache`, :func:`shape_plan`)
PLAN_CACHES: list = []


def plan_cache() -> dict:
    """A launcher's dictionary of per-shape plans, known to :func:`forget_plans`."""
    plans: dict = {}
    PLAN_CACHES.append(plans)
    return plans


def forget_plans() -> None:
    """Drop every launcher's per-shape plans and every launch plan: the next calls make them
    again (for a test that changes what plans derive from, such as a module's kernel or its
    segment policy)."""
    for plans in PLAN_CACHES:
        plans.clear()
    LAUNCH_PLANS.clear()


def _specialisation(kernel, stages: int, args: tuple, kwargs: dict) -> tuple:
    """What decides a launch's shared memory: the kernel, its constexprs and options, and its
    tensors' dtypes and devices."""
    return (
        kernel,
        stages,
        tuple(sorted((k, str(v)) for k, v in kwargs.items())),
        tuple((a.dtype, a.device) for a in args if isinstance(a, torch.Tensor)),
    )


def interpreter_numpy_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why the Triton interpreter cannot run these kernels with these versions, or None.

    Triton's interpreter before 3.7 converts arrays to scalars in a way numpy 2.4 refuses
    ("only 0-dimensional arrays can be converted to Python scalars", at the first kernel);
    seen with triton 3.6.0 + numpy 2.4.6, while 3.6.0 + numpy 2.3 and 3.7/3.8 + numpy 2.4 run."""

    def major_minor(v: str) -> tuple[int, int]:
        parts = (v.split("+")[0].split(".") + ["0"])[:2]
        return tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts)

    if major_minor(triton_version) < (3, 7) and major_minor(numpy_version) >= (2, 4):
        return (
            f"the Triton interpreter (TRITON_INTERPRET=1) of triton {triton_version} fails with "
            f"numpy {numpy_version}: install numpy<2.4 (pip install 'numpy<2.4') or triton>=3.7"
        )
    return None


if INTERPRET:
    import numpy

    _why = interpreter_numpy_problem(triton.__version__, numpy.__version__)
    if _why is not None:
        raise ImportError(_why)
#: ``RFATTN_AUTOTUNE=0``: every autotuned kernel compiles one config per launch instead of one
#: per config: the half policy's own (the one it runs with autotuning on, so a GPU smoke test
#: checks the tiles that production runs), any other dtype one that fits at every dtype and
#: head size (BT 32, 4 warps, unpipelined; slower: not for timing). Read once, at import.
AUTOTUNE = os.environ.get("RFATTN_AUTOTUNE", "1") != "0"
#: Whether the launchers pick a GPU's tiles and launch options (the interpreter's are small, to
#: keep tests fast); ``bench.compile`` sets it to record a GPU's launches on CPU.
GPU_TILES = not INTERPRET
#: feature form -> constexpr id understood by the kernels
FEATURE_IDS = {"gerf": 0, "table": 1, "rmf": 2}
#: rows of the per-side coefficient table of the "table" form (``rfattn.features.form.TABLE_ROWS``,
#: in that order: cu ch cw bias ct tw tb ga gb; a test holds the two together)
NP = tl.constexpr(9)
#: running-max sentinel: finite so that exp(sentinel - sentinel) = 1, not NaN
NEG = tl.constexpr(-1.0e30)
_PRECISIONS = ("ieee", "tf32", "tf32x3")
#: ``tl.dot`` input precision of the causal kernels' fp32 products for fp16/bf16 inputs
#: (:func:`precision_policy`)
LOW_PRECISION = "tf32x3"
#: the half policy's ``PRECISION`` per input dtype (:func:`precision_policy`, :func:`product`)
HALF_PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def keeps_out_residual(dtype: torch.dtype) -> bool:
    """Whether a non-causal forward of inputs in ``dtype`` keeps its output's rounding residual
    for the backward (:func:`store_out`; the fp16/bf16 inputs)."""
    return dtype in HALF_PRECISIONS

#: tokens handled by one split program: a multiple of every BT in the configs
_SPLIT_QUANTUM = 128
#: stacked rmf projection rows per inner step (constexpr: kernels read it)
_BR = tl.constexpr(32)


#: the half policy's config (:func:`_prune_configs`): BT 64, 8 warps, pipelined
HALF_CONFIG = triton.Config({"BT": 64}, num_warps=8)


def autotune_configs(bts=(32, 64, 128), warps=(4, 8)):
    """Autotune configs (BT, num_warps), software-pipelined (Triton's default 3 stages), plus two
    unpipelined fallbacks (BT 32 and 16, 4 warps, 1 stage) that fit the shared memory of an SM
    where the pipelined ones do not (fp32 at D = 256, fp64 at D >= 128; the autotuner drops
    configs that run out of resources). A single config under the interpreter.
    :data:`PRUNE` picks the ones a launch tries."""
    if INTERPRET:
        return [triton.Config({"BT": 64}, num_warps=1)]
    if not AUTOTUNE:  # the fallback that fits at every size, and the half policy's (_prune)
        return [triton.Config({"BT": 32}, num_warps=4, num_stages=1), HALF_CONFIG]
    return [triton.Config({"BT": bt}, num_warps=w) for bt in bts for w in warps] + [
        triton.Config({"BT": bt}, num_warps=4, num_stages=1) for bt in (32, 16)
    ]


def _prune_configs(configs, nargs, **kwargs):
    """``early_config_prune``: float64 (a checking dtype, twice the bytes per tile) tries only
    the unpipelined fallbacks; the half policy (fp16/bf16 inputs of the non-causal kernels)
    only BT 64 at 8 warps, pipelined: at D = 64 every other config spills on sm_90 (255
    registers at 4 warps, 8-2120 stack bytes per thread), this one not for the GERF family
    (the signed tables and rmf still do: ``python -m bench.compile --save-results``); the
    other dtypes every config with BT >= 32. With ``RFATTN_AUTOTUNE=0`` one config: the half
    policy's, else the unpipelined BT 32. (The autotuner calls it only when it has several
    configs, i.e. not under the interpreter.)"""
    half = kwargs.get("PRECISION") in HALF_PRECISIONS.values()
    if kwargs.get("ACC") == tl.float64 or not (AUTOTUNE or half):  # without autotuning: one
        return [c for c in configs if c.num_stages == 1]
    if half:
        return [c for c in configs if c.kwargs["BT"] == 64 and c.num_warps == 8
                and c.num_stages != 1]  # fmt: skip
    return [c for c in configs if c.kwargs["BT"] >= 32]


#: ``prune_configs_by`` of every autotuned feature kernel
PRUNE = {"early_config_prune": _prune_configs}


# Autotune keys: sizes and feature kind, never T (STYLE.md).
KEY = ["D", "M", "E", "FEATURE", "ACC"]


# ------------------------------------------------------------------------------------------------
# Half-precision products as the GPU's tensor cores compute them, and their emulation
#
# On a GPU, ``tl.dot`` of bf16/fp16 operands with an fp32 accumulator multiplies the rounded
# operands exactly and adds in fp32 (HGMMA...F32.BF16). Triton's interpreter gets both halves
# wrong for bf16: its fp32 -> bf16 cast truncates instead of rounding to nearest even, and its
# bf16 ``tl.dot`` is garbage (relative error ~1e9). So under the interpreter :func:`half_dot`
# rounds each operand to the half format in fp32 arithmetic (:func:`round_bf16`; fp16 casts are
# numpy's, which round to nearest even) and multiplies the rounded values in an fp32 "ieee"
# product: the same products, summed in another order. Tests hold the emulation against torch's
# own rounding (``Tensor.to(torch.bfloat16)``), and ``bench.compile.product_kinds`` shows the
# compiled form is one bf16 tensor product.

#: products of :func:`half_dot` are emulated (fixed at import, as the kernels' decoration)
EMULATE_HALF = tl.constexpr(INTERPRET)


@triton.jit
def round_bf16(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), returned in fp32: the bits
    ``x + 0x7FFF + (bit 16 of x)`` with the low 16 cleared. NaN stays NaN (a quiet NaN's
    payload lies in the kept bits), infinities stay, values past the largest bf16 round to
    infinity, as ``cvt.rn.bf16.f32`` does."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_half(x, HALF: tl.constexpr):
    """``x`` rounded to ``HALF`` (tl.bfloat16 or tl.float16): in ``HALF`` on a GPU, in fp32
    holding the rounded value under the interpreter (whose bf16 cast truncates)."""
    if EMULATE_HALF:
        if HALF == tl.bfloat16:
            return round_bf16(x.to(tl.float32))
        else:
            return x.to(HALF).to(tl.float32)
    else:
        return x.to(HALF)


@triton.jit
def half_dot(a, b, HALF: tl.constexpr):
    """``a @ b`` as one tensor-core product: the operands rounded to ``HALF`` (tl.bfloat16 or
    tl.float16, round to nearest even), exact products, fp32 accumulation; emulated under the
    interpreter (see above)."""
    if EMULATE_HALF:
        return tl.dot(round_half(a, HALF), round_half(b, HALF), input_precision="ieee",
                      out_dtype=tl.float32)  # fmt: skip
    else:
        return tl.dot(a.to(HALF), b.to(HALF), out_dtype=tl.float32)


@triton.jit
def split_dot(a, b, HALF: tl.constexpr, SPLIT_A: tl.constexpr, THREE: tl.constexpr = False):
    """``a @ b`` in half products, ``b = b_hi + b_lo`` each part rounded to ``HALF`` (``b - b_hi``
    is exact in fp32): ``a b_hi + a b_lo``, fp32 accumulation, b to ~16 bits (bf16). ``a`` is
    exact in ``HALF`` (an input's rows); with SPLIT_A it is not, and ``a_lo b_hi`` is added (the
    ``a_lo b_lo`` term dropped). THREE: ``b = b_hi + b_mid + b_lo``, b to fp32's 24 bits.
    The low parts are scaled by a power of two (``SH``, 2^(mantissa bits of HALF)) before their
    rounding and the products scaled back in fp32, exactly: fp16's narrow exponent range
    would otherwise make them subnormal (a weight's third part, ~2^-22 of it, is below fp16's
    smallest normal)."""
    SH: tl.constexpr = 2048.0 if HALF == tl.float16 else 256.0  # 2^(bits of HALF's mantissa)
    b_hi = round_half(b, HALF).to(tl.float32)
    b_lo = (b - b_hi) * SH
    if THREE:
        b_mid = round_half(b_lo, HALF).to(tl.float32)
        c = half_dot(a, b_hi, HALF) + (half_dot(a, b_mid, HALF)
                                       + half_dot(a, (b_lo - b_mid) * SH, HALF) / SH) / SH
    else:
        c = half_dot(a, b_hi, HALF) + half_dot(a, b_lo, HALF) / SH
    if SPLIT_A:
        a_hi = round_half(a, HALF).to(tl.float32)
        c += half_dot((a - a_hi) * SH, b_hi, HALF) / SH
    return c


@triton.jit
def product(a, b, PRECISION: tl.constexpr, ACC: tl.constexpr, SPLIT_A: tl.constexpr = False,
            SPLIT_B: tl.constexpr = False):
    """``a @ b`` of a kernel's product under the precision policy (:func:`precision_policy`): for
    PRECISION "bf16" / "fp16" one half product (:func:`half_dot`: the operands rounded to that
    format just before it, as flash-attention rounds P; fp32 accumulation); with SPLIT_A two,
    ``a = a_hi + a_lo`` (signed features: their sums cancel); with SPLIT_B ``b = b_hi + b_lo``
    too (:func:`split_dot`: two products, three with SPLIT_A), for an fp32 state or weight
    whose rounding the result would not survive (docs/numerics.md); else ``tl.dot`` of ACC
    operands at that input precision."""
    if PRECISION == "bf16" or PRECISION == "fp16":
        HALF: tl.constexpr = tl.bfloat16 if PRECISION == "bf16" else tl.float16
        if SPLIT_B:
            c = split_dot(a.to(tl.float32), b.to(tl.float32), HALF, SPLIT_A)
        elif SPLIT_A:
            a_hi = round_half(a, HALF).to(tl.float32)
            c = half_dot(a_hi, b, HALF) + half_dot(a - a_hi, b, HALF)
        else:
            c = half_dot(a, b, HALF)
    else:
        c = tl.dot(a.to(ACC), b.to(ACC), input_precision=PRECISION, out_dtype=ACC)
    return c


@triton.jit
def projection(b_x, b_rows, b_sc, PRECISION: tl.constexpr, ACC: tl.constexpr,
               SPLIT_X: tl.constexpr, THREE: tl.constexpr = False):  # fmt: skip
    """``x~ rows^T`` [BT, BR] for inputs ``x~ = b_x * b_sc`` (rows b_x [BT, BD], column scales
    b_sc [BD]) against rows [BR, BD]: the logits' product. Under the half policy the rows hold
    the column scales relative to their largest ``c`` (all 1 without psi: the rows as they
    are) and are split in two half products (:func:`split_dot`; THREE: three), ``b_x`` stays
    exact (SPLIT_X: it is not, a head map's output), and ``c`` multiplies the fp32
    accumulator; else one ``tl.dot`` at PRECISION of ``x~`` as the other products get it."""
    if PRECISION == "bf16" or PRECISION == "fp16":
        HALF: tl.constexpr = tl.bfloat16 if PRECISION == "bf16" else tl.float16
        c = tl.max(b_sc, axis=0)
        b_r = b_rows.to(tl.float32) * (b_sc / c)[None, :]
        # (rows held in the half format stay in it: exact, and the product's operand as is)
        b_p = c * split_dot(b_x if b_x.dtype == HALF else b_x.to(tl.float32), tl.trans(b_r),
                            HALF, SPLIT_X, THREE)  # fmt: skip
    else:
        b_xs = b_x.to(ACC) * b_sc[None, :]
        b_p = tl.dot(b_xs.to(b_rows.dtype), tl.trans(b_rows), input_precision=PRECISION,
                     out_dtype=ACC)  # fmt: skip
    return b_p


@triton.jit
def gerf_coeffs(ab_ptr, i_bh, HAS_AB: tl.constexpr, ACC: tl.constexpr):
    """(A, B, log D) of the (b, h) in ``u = A |w|^2 + B w . x~ - |x~|^2 / 2 + log D`` (posrf:
    0, 1, 0)."""
    if HAS_AB:
        b_ca = tl.load(ab_ptr + i_bh * 3).to(ACC)
        b_cb = tl.load(ab_ptr + i_bh * 3 + 1).to(ACC)
        b_cd = tl.load(ab_ptr + i_bh * 3 + 2).to(ACC)
    else:
        b_ca = tl.zeros([], dtype=ACC)
        b_cb = tl.full([], 1.0, dtype=ACC)
        b_cd = tl.zeros([], dtype=ACC)
    return b_ca, b_cb, b_cd


@triton.jit
def input_scale(
    scale, psi_ptr, i_bh, o_d, m_d,
    D: tl.constexpr, BD: tl.constexpr, HAS_PSI: tl.constexpr, IS_KEY: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """[BD] multiplier of raw rows giving x~: sqrt(scale) psi (queries), / psi (keys).

    ``scale`` is sqrt(scale) as an fp64 kernel argument (a Python float under the interpreter),
    rounded once to ACC by ``tl.full``: the value ``torch.full(..., dtype=acc)`` held before."""
    b_sc = tl.full([BD], scale, dtype=ACC)
    if HAS_PSI:
        b_psi = tl.load(psi_ptr + i_bh * D + o_d, mask=m_d, other=1.0).to(ACC)
        if IS_KEY:
            b_sc = b_sc / b_psi
        else:
            b_sc = b_sc * b_psi
    return b_sc


#: columns of a head map read per step (:func:`load_mapped`): a [D, 16] slice of the map fits
#: shared memory at D = 256 where the whole [D, D] map does not
MAP_K = tl.constexpr(16)


@triton.jit
def load_mapped(
    base, o_t, o_d, stride_t, stride_d, m_t, m_d, map_ptr, i_hm,
    D: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, HAS_MAP: tl.constexpr,
    PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The rows ``[BT, BD]`` of :func:`load_rows`, times ``A^T`` with head ``i_hm``'s input map
    A (``[heads, D, D]``, a calibrated head map) when HAS_MAP: the product is formed as the rows
    are loaded, :data:`MAP_K` input columns at a time, so the mapped inputs are never written
    out."""
    if HAS_MAP:
        o_k = tl.arange(0, MAP_K)
        b_x = tl.zeros([BT, BD], dtype=ACC)
        for k0 in range(0, D, MAP_K):
            m_k = k0 + o_k < D
            b_xk = load_rows(base, o_t, k0 + o_k, stride_t, stride_d, m_t, m_k, ACC)
            p_a = map_ptr + i_hm * D * D + o_d[:, None] * D + (k0 + o_k)[None, :]
            b_ak = tl.load(p_a, mask=m_d[:, None] & m_k[None, :], other=0.0).to(ACC)  # [BD, K]
            if PRECISION == "bf16":  # the half policy: the rows are exact, the map is split
                b_x += split_dot(b_xk, tl.trans(b_ak), tl.bfloat16, False)
            elif PRECISION == "fp16":
                b_x += split_dot(b_xk, tl.trans(b_ak), tl.float16, False)
            else:
                b_x += tl.dot(b_xk, tl.trans(b_ak), input_precision=PRECISION, out_dtype=ACC)
    else:
        b_x = load_rows(base, o_t, o_d, stride_t, stride_d, m_t, m_d, ACC)
    return b_x


@triton.jit
def load_mapped_heads(
    base, o_r, o_d, stride_r, stride_d, m_r, m_d, map_ptr, i_h0, G,
    D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr, HAS_MAP: tl.constexpr,
    PRECISION: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """:func:`load_mapped` for rows that each have their own head: row r < G by head
    ``i_h0 + r`` (the decode step's query rows, one per query head of a group)."""
    if HAS_MAP:
        b_x = tl.zeros([BR, BD], dtype=ACC)
        for g in range(0, G):
            b_g = load_mapped(base, o_r, o_d, stride_r, stride_d, m_r, m_d, map_ptr, i_h0 + g, D,
                               BR, BD, True, PRECISION, ACC)  # fmt: skip
            b_x = tl.where((o_r == g)[:, None], b_g, b_x)
    else:
        b_x = load_rows(base, o_r, o_d, stride_r, stride_d, m_r, m_d, ACC)
    return b_x


@triton.jit
def _safe_den(b_den, TINY: tl.constexpr):
    """The denominator policy of ``rfattn.reference.safe_denominator``: ``|den| < tiny`` becomes
    ``sign(den) * tiny`` (0 -> +tiny), so a query with no valid key gets 0, never NaN."""
    eps = tl.full([], TINY, b_den.dtype)
    return tl.where(tl.abs(b_den) < eps, tl.where(b_den < 0, -eps, eps), b_den)


@triton.jit
def ratio(b_num, b_den, TINY: tl.constexpr):
    """(out, the den to save for the backward) of a query tile, ``rfattn.reference.
    attention_ratio``'s policy: a row with ``den == 0`` and ``num == 0`` exactly (no valid key)
    gives 0 and saves ``den = inf``, so that its backward cotangents ``do / den`` are 0 rather
    than ``do / tiny`` (which overflows, then meets a 0: NaN)."""
    b_empty = (b_den == 0) & (tl.max(tl.abs(b_num), axis=1) == 0)
    b_den = _safe_den(b_den, TINY)
    return b_num / b_den[:, None], tl.where(b_empty, float("inf"), b_den)


@triton.jit
def load_offset(ptr, PLAIN: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr):
    """A carried key offset (``rfattn.RFState``: -inf before any valid key) as the kernels' finite
    sentinel; without a state, the empty one's: the sentinel, or 0 for plain features."""
    if HAS_INIT:
        b_r = tl.load(ptr).to(ACC)
        b_r = tl.where(b_r == float("-inf"), NEG, b_r)
    elif PLAIN:
        b_r = tl.zeros([], dtype=ACC)
    else:
        b_r = tl.full([], NEG, dtype=ACC)
    return b_r


@triton.jit
def store_offset(ptr, b_r):
    """Store a carried key offset in ``rfattn.RFState``'s convention (the sentinel as -inf)."""
    tl.store(ptr, tl.where(b_r <= 0.5 * NEG, float("-inf"), b_r))


@triton.jit
def store_tile(ptr, i_b, i_h, o_r, o_c, stride_b, stride_h, stride_r, stride_c, b_x, m_r, m_c):
    """Store the tile ``b_x`` [rows, cols] at ``ptr[i_b, i_h, o_r, o_c]`` in ``ptr``'s dtype,
    rounded to nearest (under the interpreter, whose bf16 cast truncates, by :func:`round_half`
    first: the GPU's rounding, not twice its error)."""
    p = ptr + i_b * stride_b + i_h * stride_h + o_r[:, None] * stride_r + o_c[None, :] * stride_c
    if EMULATE_HALF and ptr.dtype.element_ty == tl.bfloat16:
        b_x = round_bf16(b_x.to(tl.float32))
    tl.store(p, b_x.to(ptr.dtype.element_ty), mask=m_r[:, None] & m_c[None, :])


@triton.jit
def store_out(ptr, lo_ptr, i_b, i_h, o_r, o_c, stride_b, stride_h, stride_r, stride_c, b_x, m_r,
              m_c, OUT_LO: tl.constexpr):  # fmt: skip
    """:func:`store_tile` of an fp32 output tile ``b_x`` in ``ptr``'s dtype; with OUT_LO (a half
    dtype) also its rounding residual ``b_x - out`` at ``lo_ptr`` (same strides and dtype),
    scaled by 2^(mantissa bits of the dtype) as :func:`split_dot` scales its low parts (in fp16
    it would otherwise be subnormal); 0 where out overflowed. out + residual holds b_x to ~16
    bits (bf16), ~22 (fp16) for the backward's ``c = -(do . out) / den`` (:func:`query_rows`)."""
    store_tile(ptr, i_b, i_h, o_r, o_c, stride_b, stride_h, stride_r, stride_c, b_x, m_r, m_c)
    if OUT_LO:
        HALF: tl.constexpr = ptr.dtype.element_ty
        SH: tl.constexpr = 2048.0 if HALF == tl.float16 else 256.0  # as split_dot's
        b_hi = round_half(b_x, HALF).to(tl.float32)
        b_lo = tl.where(tl.abs(b_hi) < float("inf"), (b_x - b_hi) * SH, 0.0)  # exact in fp32
        store_tile(lo_ptr, i_b, i_h, o_r, o_c, stride_b, stride_h, stride_r, stride_c, b_lo, m_r,
                   m_c)  # fmt: skip


@triton.jit
def _tab(tab_ptr, row: tl.constexpr, o_f, m_f, M: tl.constexpr, IS_KEY: tl.constexpr):
    """[BM] coefficients ``row`` of the table form on one side (see NP)."""
    side: tl.constexpr = 1 if IS_KEY else 0
    return tl.load(tab_ptr + (side * NP + row) * M + o_f, mask=m_f, other=0.0)


@triton.jit
def _rmf_rows(xr_ptr, xi_ptr, o_r, r1, o_d, m_d, M: tl.constexpr, D: tl.constexpr):
    """Owners [BR] (-1 past ``r1``) and stacked rows [BR, BD] of one rmf row step."""
    m_r = o_r < r1
    b_own = tl.load(xi_ptr + M + 1 + o_r, mask=m_r, other=-1)
    b_rho = tl.load(xr_ptr + o_r[:, None] * D + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                    other=0.0)  # fmt: skip
    return b_own, b_rho


@triton.jit
def _log_abs(b_z, TINY: tl.constexpr):
    """log max(|z|, tiny) (NaN kept)."""
    b_az = tl.abs(b_z)
    return tl.log(tl.where(b_az < TINY, TINY, b_az))


@triton.jit
def _project(b_xs, b_rows, b_x, b_sc, PRECISION: tl.constexpr, ACC: tl.constexpr,
             SPLIT_X: tl.constexpr, THREE: tl.constexpr = False):  # fmt: skip
    """x~ rows^T [BT, BR]: :func:`projection` of the rows b_x with scales b_sc where given, else
    ``tl.dot`` of x~ = b_xs at PRECISION (the causal kernels)."""
    if b_x is None:
        b_p = tl.dot(b_xs.to(b_rows.dtype), tl.trans(b_rows), input_precision=PRECISION,
                     out_dtype=ACC)  # fmt: skip
    else:
        b_p = projection(b_x, b_rows, b_sc, PRECISION, ACC, SPLIT_X, THREE)
    return b_p


@triton.jit
def feature_tile(
    b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
    M: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, FEATURE: tl.constexpr,
    IS_KEY: tl.constexpr, HAS_LAM: tl.constexpr, PRECISION: tl.constexpr, TINY: tl.constexpr,
    b_x=None, b_sc=None, SPLIT_X: tl.constexpr = False, b_nx=None,
):  # fmt: skip
    """(u, g, g1, g2) of one feature tile: phi = g exp(u - offset) [BT, BM] for inputs x~
    b_xs [BT, BD] (acc dtype) against rows b_w [BM, BD]. g1, g2 feed the backward: table form
    g1 = dg/dth; rmf g1 = c (-1)^parity, g2 = log|prod|. Scalars where a term is absent.
    With the rows b_x [BT, BD] and column scales b_sc [BD] of ``x~ = b_x * b_sc`` the
    projections are :func:`projection`'s (the half policy's split logits; SPLIT_X: b_x is not
    exact in the half format), else ``tl.dot`` of b_xs at PRECISION. With b_x, b_sc and
    ``b_nx`` = |x~|^2 [BT] (:func:`sq_norms`, made once for a loop over feature tiles) b_xs may
    be None: no [BT, BD] tile of x~ then lives across the caller's loop."""
    ACC = b_sc.dtype if b_xs is None else b_xs.dtype
    one = tl.full([], 1.0, dtype=ACC)
    # one return statement: compiled Triton checks every return's type, constexpr-dead or not
    if FEATURE == 2:  # rmf: plain features, u = 0
        BT: tl.constexpr = b_x.shape[0] if b_xs is None else b_xs.shape[0]
        BR: tl.constexpr = _BR
        r0 = tl.load(xi_ptr + i_m * BM)
        r1 = tl.load(xi_ptr + tl.minimum(i_m * BM + BM, M))
        b_l = tl.zeros([BT, BM], dtype=ACC)  # log |prod|
        b_n = tl.zeros([BT, BM], dtype=ACC)  # number of negative factors
        for r in range(r0, r1, BR):
            b_own, b_rho = _rmf_rows(xr_ptr, xi_ptr, r + tl.arange(0, BR), r1, o_d, m_d, M, D)
            # [BT, BD] @ [BD, BR] -> [BT, BR]
            b_z = _project(b_xs, b_rho, b_x, b_sc, PRECISION, ACC, SPLIT_X)
            b_seg = (b_own[:, None] == o_f[None, :]).to(ACC)  # [BR, BM]
            # [BT, BR] @ [BR, BM] -> [BT, BM], exact: one nonzero per (row, feature)
            b_l += tl.dot(_log_abs(b_z, TINY), b_seg, input_precision="ieee", out_dtype=ACC)
            b_n += tl.dot((b_z < 0).to(ACC), b_seg, input_precision="ieee", out_dtype=ACC)
        side: tl.constexpr = 1 if IS_KEY else 0
        b_c = tl.load(tab_ptr + side * M + o_f, mask=m_f, other=0.0).to(ACC)  # [BM]: [2, 1, F]
        b_g1 = b_c[None, :] * (1.0 - 2.0 * (b_n - 2.0 * tl.floor(0.5 * b_n)))
        b_u, b_g, b_g2 = tl.zeros([BT, BM], dtype=ACC), b_g1 * tl.exp(b_l), b_l
    else:
        # [BT, BM]; signed (table) features to fp32's accuracy: their sums cancel, and W to 16
        # bits left trigrf's output at 2.5x the torch path's error in bf16 (T = 100, M = 128)
        b_z = _project(b_xs, b_w, b_x, b_sc, PRECISION, ACC, SPLIT_X, FEATURE == 1)
        b_wf = b_w.to(ACC)
        b_nw = tl.sum(b_wf * b_wf, axis=1)  # [BM]
        if b_nx is None:
            b_nx = sq_norms(b_xs)  # [BT]
        b_g2 = one
        if FEATURE == 0:  # real positive GERF: A |w|^2 + B w . x~ - |x~|^2 / 2 + log D
            b_u = b_ca * b_nw[None, :] + b_cb * b_z - 0.5 * b_nx[:, None] + b_cd
            b_g, b_g1 = one, one
        else:  # FEATURE == 1: the table form
            b_u = (_tab(tab_ptr, 0, o_f, m_f, M, IS_KEY)[None, :] * b_z
                   + _tab(tab_ptr, 1, o_f, m_f, M, IS_KEY)[None, :] * b_nx[:, None]
                   + (_tab(tab_ptr, 2, o_f, m_f, M, IS_KEY) * b_nw
                      + _tab(tab_ptr, 3, o_f, m_f, M, IS_KEY))[None, :])  # fmt: skip
            b_th = (_tab(tab_ptr, 4, o_f, m_f, M, IS_KEY)[None, :] * b_z
                    + (_tab(tab_ptr, 5, o_f, m_f, M, IS_KEY) * b_nw
                       + _tab(tab_ptr, 6, o_f, m_f, M, IS_KEY))[None, :])  # fmt: skip
            b_gb = _tab(tab_ptr, 8, o_f, m_f, M, IS_KEY)[None, :]
            b_g = _tab(tab_ptr, 7, o_f, m_f, M, IS_KEY)[None, :] + b_gb * tl.cos(b_th)
            b_g1 = -b_gb * tl.sin(b_th)
            if HAS_LAM:
                b_lam = tl.load(xi_ptr + o_f, mask=m_f, other=-1)  # [BM]
                p_tau = xr_ptr + b_lam[:, None] * D + o_d[None, :]
                b_tau = tl.load(p_tau, mask=(b_lam[:, None] >= 0) & m_d[None, :],
                                other=0.0)  # [BM, BD]  # fmt: skip
                b_pt = _project(b_xs, b_tau, b_x, b_sc, PRECISION, ACC, SPLIT_X)  # [BT, BM]
                b_s = tl.where((b_lam[None, :] < 0) | (b_pt >= 0), 1.0, -1.0)
                b_g = b_g * b_s
                b_g1 = b_g1 * b_s
    return b_u, b_g, b_g1, b_g2


@triton.jit
def sq_norms(b_xs):
    """|x~|^2 [BT] of inputs x~ [BT, BD] (acc dtype), as :func:`feature_tile` forms them."""
    return tl.sum(b_xs * b_xs, axis=1)


@triton.jit
def feature_dx(
    b_du, b_dg, b_g1, b_g2, b_xs, b_w, o_f, m_f, o_d, m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m,
    M: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, FEATURE: tl.constexpr,
    IS_KEY: tl.constexpr, PRECISION: tl.constexpr, TINY: tl.constexpr,
    b_x=None, b_sc=None,
):  # fmt: skip
    """d(sum du u + dg g)/dx~ of one feature tile (du, dg [BT, BM]; see feature_tile, whose
    b_x, b_sc these are too) in two parts, ``(dx [BT, BD], h [BT])`` with dx + h x~ the
    derivative: through the projections, and the coefficient of x~ itself (the |x~|^2 term; 0
    for rmf). A loop over feature tiles sums each and adds ``h x~`` once after it, so no tile
    of x~ lives across the loop (b_xs may be None where b_x and b_sc are given)."""
    ACC = b_du.dtype
    if FEATURE == 2:  # rmf: dphi_f/dZ_r = c (-1)^parity sgn(Z_r) exp(log|prod| - log|Z_r|)
        BT: tl.constexpr = b_du.shape[0]
        BD: tl.constexpr = b_x.shape[1] if b_xs is None else b_xs.shape[1]
        BR: tl.constexpr = _BR
        r0 = tl.load(xi_ptr + i_m * BM)
        r1 = tl.load(xi_ptr + tl.minimum(i_m * BM + BM, M))
        b_a = b_dg * b_g1  # [BT, BM]
        b_dx = tl.zeros([BT, BD], dtype=ACC)
        for r in range(r0, r1, BR):
            b_own, b_rho = _rmf_rows(xr_ptr, xi_ptr, r + tl.arange(0, BR), r1, o_d, m_d, M, D)
            b_z = _project(b_xs, b_rho, b_x, b_sc, PRECISION, ACC, False)  # [BT, BR]
            b_seg = (o_f[:, None] == b_own[None, :]).to(ACC)  # [BM, BR]
            # owner's values on its rows: [BT, BM] @ [BM, BR] -> [BT, BR] (exact)
            b_ar = tl.dot(b_a, b_seg, input_precision="ieee", out_dtype=ACC)
            b_lr = tl.dot(b_g2, b_seg, input_precision="ieee", out_dtype=ACC)
            b_gz = tl.where(b_z < 0, -b_ar, b_ar) * tl.exp(b_lr - _log_abs(b_z, TINY))
            # [BT, BR] @ [BR, BD] -> [BT, BD]
            b_dx += product(b_gz, b_rho, PRECISION, ACC)
        b_dh = tl.zeros([BT], dtype=ACC)
    else:
        if FEATURE == 0:  # du/dx~ = B w - x~
            b_dzc = b_cb * b_du
            b_dh = -tl.sum(b_du, axis=1)
        else:  # du/dx~ = cu w + 2 ch x~;  dg/dx~ = g1 ct w
            b_dzc = (b_du * _tab(tab_ptr, 0, o_f, m_f, M, IS_KEY)[None, :]
                     + b_dg * b_g1 * _tab(tab_ptr, 4, o_f, m_f, M, IS_KEY)[None, :])  # fmt: skip
            b_dh = 2.0 * tl.sum(b_du * _tab(tab_ptr, 1, o_f, m_f, M, IS_KEY)[None, :], axis=1)
        # [BT, BM] @ [BM, BD] -> [BT, BD]
        b_dx = product(b_dzc, b_w, PRECISION, ACC)
    return b_dx, b_dh


@triton.jit
def feature_dw(
    b_du, b_dg, b_g1, b_xs, b_w, o_f, m_f, b_ca, b_cb, tab_ptr,
    M: tl.constexpr, FEATURE: tl.constexpr, IS_KEY: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """d(sum du u + dg g)/dW [BM, BD] of one token tile (du, dg [BT, BM]; not rmf)."""
    ACC = b_du.dtype
    if FEATURE == 0:  # du/dw = B x~ + 2 A w
        b_dzc = b_cb * b_du
        b_dnw = b_ca * tl.sum(b_du, axis=0)
    else:  # du/dw = cu x~ + 2 cw w;  dg/dw = g1 (ct x~ + 2 tw w)
        b_dgt = b_dg * b_g1
        b_dzc = (b_du * _tab(tab_ptr, 0, o_f, m_f, M, IS_KEY)[None, :]
                 + b_dgt * _tab(tab_ptr, 4, o_f, m_f, M, IS_KEY)[None, :])  # fmt: skip
        b_dnw = (tl.sum(b_du, axis=0) * _tab(tab_ptr, 2, o_f, m_f, M, IS_KEY)
                 + tl.sum(b_dgt, axis=0) * _tab(tab_ptr, 5, o_f, m_f, M, IS_KEY))  # fmt: skip
    # [BM, BT] @ [BT, BD] -> [BM, BD]
    b_dw = product(tl.trans(b_dzc), b_xs, PRECISION, ACC)
    return b_dw + 2.0 * b_dnw[:, None] * b_w.to(ACC)


@triton.jit
def load_rows(base, o_t, o_c, stride_t, stride_c, m_t, m_c, ACC: tl.constexpr):
    """A [BT, BC] tile of a [T, C] matrix (zeros outside), upcast to ACC."""
    p = base + o_t[:, None] * stride_t + o_c[None, :] * stride_c
    return tl.load(p, mask=m_t[:, None] & m_c[None, :], other=0.0).to(ACC)


@triton.jit
def load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d):
    """Feature rows [BM, BD] in the accumulation dtype (zeros outside)."""
    p_w = w_ptr + o_f[:, None] * stride_wm + o_d[None, :] * stride_wd
    return tl.load(p_w, mask=m_f[:, None] & m_d[None, :], other=0.0)


@triton.jit
def sequence(cu_ptr, i_bh, H, T, TR, VARLEN: tl.constexpr):
    """Where the tokens of (b, h) ``i_bh`` lie (H heads): ``(row, first, length, rows)``, so
    that its token t is token ``first + t`` of q/k/v's batch row ``row`` and its per-token
    statistics (the query offsets and denominators the backward reads) lie at ``rows + t``.
    Without VARLEN, row b of a batch of T tokens: ``(b, 0, T, i_bh T)``. With VARLEN, packed
    sequence b of a row ``[1, H, TR, ...]`` whose N + 1 offsets (flash-attention's
    ``cu_seqlens``) ``cu_ptr`` holds: ``(0, cu[b], cu[b + 1] - cu[b], h TR + cu[b])`` (T
    unused: the grid's longest)."""
    if VARLEN:
        i_b = i_bh // H
        first = tl.load(cu_ptr + i_b).to(tl.int64)
        length = tl.load(cu_ptr + i_b + 1).to(tl.int64) - first
        row = 0
        rows = (i_bh % H) * TR + first
    else:
        first = 0
        length = T
        row = i_bh // H
        rows = i_bh * T
    return row, first, length, rows


@triton.jit
def span(t0, per, T, VARLEN: tl.constexpr):
    """Tokens a program of a split reduction walks from its first ``t0``: its split's ``per``,
    or with VARLEN (splits sized for the longest sequence) those of its sequence's T left
    (0 past its end: its partial is the empty one)."""
    if VARLEN:
        n = tl.minimum(tl.maximum(T - t0, 0), per)
    else:
        n = per
    return n


@triton.jit
def valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD: tl.constexpr):
    """[BT] bool: key rows inside T and not padded."""
    m_t = o_t < T
    if HAS_PAD:
        b_pad = tl.load(pad_ptr + i_b * stride_pb + o_t * stride_pt, mask=m_t, other=1)
        m_t = m_t & (b_pad == 0)
    return m_t


# Arguments every feature kernel shares (after the pointers of its pass):
#   w_ptr [F, D] feature rows; scale sqrt(scale) (an fp64 scalar argument, not a pointer);
#   ab_ptr (A, B) per (b, h); psi_ptr [B*H, D]; tab_ptr, xr_ptr, xi_ptr: the table form's
#   coefficients / tau / lam, rmf's scales / stacked rows / (segment starts, owners).


@triton.jit
def query_rows(
    do_base, o_base, olo_base, den_ptr, i_bh, o_t, o_e, T, m_t, m_e,
    stride_dot, stride_doe, stride_ot, stride_oe, ACC: tl.constexpr, OUT_LO: tl.constexpr,
    DDT: tl.constexpr = None,
):  # fmt: skip
    """do [BT, BE] as given (exact in a half format: the half policy's products take it, not
    g = do / den, whose rounding would add to the gradients' error), den [BT] and
    c = -(do . out) / den [BT] of one query tile; with OUT_LO, out is the stored half output
    plus its rounding residual at ``olo_base`` (:func:`store_out`), in fp32: the rounded output
    alone made c the largest error of the half policy's gradients (dq 2.2-2.4x the torch
    path's at large norms, docs/numerics.md)."""
    b_do = load_rows(do_base, o_t, o_e, stride_dot, stride_doe, m_t, m_e,
                     ACC if DDT is None else DDT)  # fmt: skip
    b_o = load_rows(o_base, o_t, o_e, stride_ot, stride_oe, m_t, m_e, ACC)
    if OUT_LO:
        SH: tl.constexpr = 2048.0 if olo_base.dtype.element_ty == tl.float16 else 256.0
        b_o += load_rows(olo_base, o_t, o_e, stride_ot, stride_oe, m_t, m_e, ACC) / SH
    b_den = tl.load(den_ptr + i_bh * T + o_t, mask=m_t, other=1.0)
    return b_do, b_den, -tl.sum(b_do.to(ACC) * b_o, axis=1) / b_den


# ------------------------------------------------------------------------------------------------
# launch setup (shared by every launcher)


# Plain integer maths: triton.cdiv and triton.next_power_of_2 are constexpr functions, ~2-7 µs a
# call through their wrapper, several per launch setup.


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of non-negative ints (``triton.cdiv``)."""
    return -(-a // b)


def next_pow2(n: int, floor: int = 16) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _check_inputs(q, k, v, w, key_padding_mask) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, H, T, dim], got shape {tuple(x.shape)}")
        if x.dtype not in DTYPES:
            raise TypeError(f"{name}: the Triton kernel takes {DTYPES}, got {x.dtype}")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, q has {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    hq, hk = q.shape[1], k.shape[1]
    if k.shape[0] != q.shape[0] or v.shape[:2] != k.shape[:2] or (hq % hk if hk else hq):
        raise ValueError(f"batch/heads differ (q's heads must be a multiple of k's and v's): "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")  # fmt: skip
    if k.shape[3] != q.shape[3] or v.shape[2] != k.shape[2]:
        raise ValueError(f"shape mismatch: q {q.shape}, k {k.shape}, v {v.shape}")
    if w.dim() != 2 or w.shape[1] != q.shape[3]:
        raise ValueError(f"w must be [M, {q.shape[3]}], got {tuple(w.shape)}")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (k.shape[0], k.shape[2])
    ):
        raise ValueError(f"key_padding_mask must be bool [B, Tk], got {key_padding_mask.shape}")
    if q.device.type == "cpu" and not (INTERPRET or FAKE_DEVICE):
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 before "
            "rfattn.kernels is first imported (or use backend='torch')"
        )


def split_counts(T: int, programs_per_split: int, device: torch.device, num_splits: int | None):
    """(number of splits, tokens per split) for reductions over T: fill the device twice."""
    quanta = cdiv(T, _SPLIT_QUANTUM)
    if quanta <= 1:
        return 1, _SPLIT_QUANTUM
    if num_splits is None:
        if INTERPRET or device.type != "cuda":
            num_splits = 2  # exercises the merge without slowing the interpreter
        else:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            num_splits = cdiv(2 * sms, programs_per_split)
    per = cdiv(quanta, max(1, min(num_splits, quanta))) * _SPLIT_QUANTUM
    return cdiv(T, per), per


def _feature_rows(big: int, itemsize: int, half: bool = False) -> int:
    """Feature tile BM (rows of W per step) of the non-causal kernels for padded head sizes up to
    ``big`` and inputs of ``itemsize`` bytes, before capping at M. ``half``: the half policy on
    a GPU, whose fp32 epilogue tiles beside the split logits spill at BM 64 (sm_90, D = 64,
    bf16: 72-920 stack bytes per thread in ``_bwd_dqkv_kernel``, 0 at BM 32, 8 warps)."""
    if itemsize == 8:
        return 32 if big <= 64 else 16
    if half:
        return 32
    return 64 if big <= 128 else 32


#: warps of the causal kernels for 16-bit inputs (:func:`_chunk_tiles`): twice the registers of
#: a 4-warp program for the same tiles (one program per SM at 255 registers a thread, where
#: 4-warp programs fitted two: the same warps per SM)
CHUNK_HALF_WARPS = 8


def _chunk_tiles(big: int, itemsize: int, gpu_tiles: bool) -> tuple[int, int]:
    """(chunk length C = BT, feature tile BM) of the causal kernels (one BT for every launch of a
    call: the offsets R_c depend on it) for padded head sizes up to ``big``.

    Sized so that the backward kernel, which holds [BT, BT], [BT, BM], [BM, BE] and [BT, BD]
    tiles at once, fits the 227 KiB of shared memory of a Hopper SM for the input dtype (with the
    pipeline depth of :meth:`Setup.launch_options`; checked for D, E in {64, 128, 256} by
    ``python -m bench.compile``), and for 16-bit inputs so that the walks keep their tiles in
    registers: 32-feature tiles at 8 warps (:data:`CHUNK_HALF_WARPS`), where 64-feature tiles
    at 4 warps spilled 232-2408 stack bytes per thread in ``_chunk_out`` and 1552-4048 in
    ``_chunk_bwd`` (sm_90, D = 64, bf16; 0 and 168-2608 now: ``bench.compile --report``). The
    interpreter's: 16-token chunks (several chunks even on tiny test sequences) and 16-bit
    feature tiles.
    """
    if not gpu_tiles:
        return 16, _feature_rows(big, 2)
    if itemsize <= 2:
        return (64 if big <= 128 else 32), 32
    if itemsize == 4:
        return (64 if big <= 64 else 32), (32 if big <= 128 else 16)
    return (32 if big <= 64 else 16), (32 if big <= 64 else 16)


def precision_policy(dtype: torch.dtype, precision: str | None, causal: bool = False,
               kind: str = "gerf") -> str:
    """The kernels' ``PRECISION``: a ``tl.dot`` input precision of fp32 products, or the half
    policy ("bf16" / "fp16", :func:`product`).

    Default: fp32/fp64 inputs exact ("ieee"; "tf32" or "tf32x3" only when asked). fp16/bf16
    inputs of every kernel (non-causal, the causal chunk kernels, the decode step): the half
    policy ("half" asks for it by name), docs/numerics.md. The logits ``x~ W^T`` as two half
    products (W split into ``W_hi + W_lo`` in the input dtype, x exact, sqrt(scale) on the fp32
    accumulator:
    :func:`projection`); the products whose result cancels with an fp32 state as an operand
    (``a S``, ``do S^T`` for dq, ``v dS^T`` for dk) with the state split too
    (:func:`product`'s SPLIT_B), signed features split (SPLIT_A); every other product one
    half product of operands rounded to the input dtype, fp32 accumulation. Under the
    interpreter (T = 100, M = 64; ``tests/test_precision``): outputs at most 1.5x the torch
    path's error in the same dtype, gradients 2.5x (the stored output's rounding in the
    backward). The causal kernels' intra-chunk products too: the scores ``a b^T`` and their
    products with v and the cotangents are one half product each (both operands split for
    the signed features, whose sums cancel), as flash-attention rounds P and dS. rmf in fp16:
    its unbounded states overflow fp16, so :data:`LOW_PRECISION` (three tf32 products, about
    fp32's accuracy; measured on an H100 at 2.7x the time of one product); so do the causal
    kernels' signed (table) forms in fp16, whose intra-chunk ``dK = (v . do) / den`` leaves
    fp16's range where their denominators cancel. rmf in bf16 takes :data:`LOW_PRECISION` too
    by default: on an H100 (2026-11-27, B4 H16 T1024 D64 M256, q, k ~ N(0, 1)) its half form
    erred 0.27 non-causal and 0.059 causal against the torch path's 0.027 in bf16, where the
    interpreter's emulation of the same products errs 0.0018 (the torch path's own: 0.0021);
    asked for by name ("half") it still runs, for the next GPU run to find why.
    """
    half = HALF_PRECISIONS.get(dtype)
    # rmf's features are unbounded products (no offsets): its states overflow fp16's range;
    # the causal backward's intra-chunk dK = (v . do) / den of the signed features, whose
    # denominators cancel, does too (trigrf at sigma 1: NaN dk)
    overflows = dtype == torch.float16 and (kind == "rmf" or causal and kind == "table")
    if precision is None:
        unproven = kind == "rmf"  # wrong on an H100 in bf16, emulation right (docstring)
        return "ieee" if half is None else (LOW_PRECISION if overflows or unproven else half)
    if precision == "half":
        if half is None or overflows:
            why = str(dtype) if not overflows else (
                "kind 'rmf' in fp16 (its states overflow)" if kind == "rmf" else
                "fp16 inputs of the causal kernels with signed (table) features (their "
                "backward's products overflow fp16)")
            raise ValueError(f"precision 'half' takes fp16/bf16 inputs, got {why}")
        return half
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS + ('half',)}, got {precision!r}")
    return precision


def _per_head(x, B: int, H: int, tail: tuple, name: str, acc, device) -> torch.Tensor:
    """``x`` broadcast to ``[B*H, *tail]`` in the accumulation dtype (the kernels index it): a
    view of x where it is ``[B, H, *tail]`` already (a call's own parameters, which its stats
    pass or key pass writes: the launches that read them see those writes)."""
    if x.dtype == acc and x.device == device and x.shape == (B, H, *tail) and x.is_contiguous():
        return x.detach().view(B * H, *tail)
    try:
        x = x.detach().to(device=device, dtype=acc).expand(B, H, *tail)
    except RuntimeError:
        raise ValueError(
            f"{name} must broadcast to [B, H, {', '.join(map(str, tail))}], got {tuple(x.shape)}"
        ) from None
    return x.reshape(B * H, *tail).contiguous()


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything the launchers of one call share, fixed at construction (:func:`launch_setup`):
    sizes, tiles, precision, the mask and the kernel form's tensors in the kernels' layout.

    ``form_ptrs`` are the per-feature arguments every feature kernel takes after its inputs
    (``scale``, ``ab_ptr``, ``psi_ptr``, ``tab_ptr``, ``xr_ptr``, ``xi_ptr``): sqrt(scale) as a
    Python float (a scalar kernel argument: no device tensor, no fill per call); (A, B, log D)
    per (b, h); psi ``[B*H, D]``; the table / rmf scales; tau / rmf's stacked rows; lam / rmf's
    segment indices. An absent pointer is a placeholder the kernel's flags never read (``w``).
    ``maps``: the form's head maps (``qmap_ptr``, ``kmap_ptr``; ``[Hq, D, D]``, ``[H, D, D]``,
    placeholders without them), which only the forward kernels take (``HAS_MAP``).
    """

    B: int
    H: int  # key/value heads
    G: int  # query heads per key/value head (grouped-query attention; 1 otherwise)
    Tq: int
    Tk: int
    D: int
    E: int
    M: int
    BD: int
    BE: int
    BM: int
    BT: int | None  # the causal chunk length (None: non-causal)
    itemsize: int
    gpu_tiles: bool
    acc: torch.dtype
    precision: str
    plain: bool  # the "rmf" kind: offsets stay 0
    w: torch.Tensor
    pad: tuple  # (mask as int32 [B, Tk] or a placeholder, stride_b, stride_t)
    has_pad: bool
    form_ptrs: tuple
    maps: tuple
    has_map: bool
    NMT: int  # feature tiles
    ACC: object  # the accumulation dtype as a Triton dtype
    meta: dict  # the constexprs every feature kernel takes

    def launch_options(self, num_warps: int | None = None) -> dict:
        """num_warps (unless given) and num_stages of the kernels launched without autotuning
        (causal, decode), sized so that every launch fits a Hopper SM's shared memory (checked by
        ``python -m bench.compile``): 8 warps for 128-wide tiles, else 4; two pipeline stages
        for 256-wide tiles, else Triton's default three (:func:`launch` falls back where a
        Triton version needs more shared memory for them). float64, a checking dtype, runs
        unpipelined, and with 2 warps at 256-wide tiles (rmf's causal backward needs 262 KiB
        at 4 or 8 warps, 214 KiB at 2)."""
        if not self.gpu_tiles:
            return dict(num_warps=1)
        big, fp64 = max(self.BD, self.BE), self.itemsize == 8
        warps = 2 if fp64 and big >= 256 else (8 if big >= 128 else 4)
        stages = 1 if fp64 else (2 if big >= 256 else 3)
        return dict(num_warps=num_warps or warps, num_stages=stages)

    def acc_empty(self, *shape) -> torch.Tensor:
        return torch.empty(*shape, device=self.w.device, dtype=self.acc)


def _form_args(form, B: int, H: int, D: int, acc, placeholder) -> tuple:
    """The per-feature pointers after sqrt(scale) of a :class:`rfattn.features.form.KernelForm`,
    checked, contiguous and 16-byte aligned on the inputs' device."""
    dev = placeholder.device

    def dense(x, dtype=acc):
        return aligned(x.detach().to(device=dev, dtype=dtype).contiguous())

    ab = placeholder if form.coeffs is None else _per_head(form.coeffs, B, H, (3,), "coeffs",
                                                           acc, dev)  # fmt: skip
    psi = placeholder if form.psi is None else _per_head(form.psi, B, H, (D,), "psi", acc, dev)
    tab = placeholder if form.table is None else dense(form.table)
    extra = form.tau if form.kind == "table" else form.rows
    index = form.lam if form.kind == "table" else form.segments
    xr = placeholder if extra is None or extra.numel() == 0 else dense(extra)
    xi = placeholder if index is None else dense(index, torch.int32)
    return ab, psi, tab, xr, xi


def form_flags(form) -> dict:
    """The constexpr flags of a kernel form: its kind and which parameters it has."""
    return dict(FEATURE=FEATURE_IDS[form.kind], HAS_AB=form.coeffs is not None,
                HAS_PSI=form.psi is not None,
                HAS_LAM=form.kind == "table" and form.tau is not None)  # fmt: skip


def aligned(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it where its data does not start on 16 bytes (what Triton specialises
    pointers on: a plan's launches take every tensor the launcher makes aligned)."""
    return x.clone() if x.data_ptr() % 16 else x


def _head_maps(form, Hq: int, H: int, D: int, acc, placeholder) -> tuple:
    """``(qmap, kmap)`` of the form, checked, contiguous ``[heads, D, D]`` in the accumulation
    dtype (the identity where only the other one is given), or placeholders without maps."""
    if form.qmap is None and form.kmap is None:
        return placeholder, placeholder
    out = []
    for name, m, heads in (("qmap", form.qmap, Hq), ("kmap", form.kmap, H)):
        if m is None:
            m = torch.eye(D, dtype=acc, device=placeholder.device).expand(heads, D, D)
        if tuple(m.shape) != (heads, D, D):
            raise ValueError(f"{name} must be [{heads}, {D}, {D}], got {tuple(m.shape)}")
        out.append(aligned(m.detach().to(device=placeholder.device, dtype=acc).contiguous()))
    return tuple(out)


#: what :func:`form_args` made of a form: (id, B, Hq, H, accumulation dtype, device) ->
#: (the form, its arguments); the form is held, so its id is not reused while it is here
FORM_ARGS: dict = {}
#: forms kept at most; past it the table starts over
MAX_FORMS = 64


def form_args(form, B: int, Hq: int, H: int, acc, device, keep: bool = True) -> tuple:
    """``(w, ab, psi, tab, xr, xi, qmap, kmap)``: a kernel form's tensors as every feature kernel
    takes them (W and the parameters in the accumulation dtype ``acc``, contiguous and aligned on
    ``device``, per-(b, h) ones broadcast to ``[B*H, ...]``, placeholders for what the form lacks;
    :class:`Setup`), checked. Made once per form object and call shape: a kept form
    (``rfattn.fused``) costs a dictionary lookup at each call, a form made for one call (this
    call's statistics) its conversion; ``keep=False`` (such a form) leaves it out of
    :data:`FORM_ARGS`, where it would hold its tensors and push out the kept forms'."""
    key = (id(form), B, Hq, H, acc, device)
    kept = FORM_ARGS.get(key)
    if kept is not None and kept[0] is form:
        return kept[1]
    w, D = form.w, form.w.shape[-1]
    # W in the accumulation dtype: rounded to bf16 it would move each logit by ~|u| 2^-9. It
    # doubles as the placeholder of absent pointers (never read: the flags say so)
    w = aligned(w.detach().to(device=device, dtype=acc).contiguous())
    args = (w, *_form_args(form, B, H, D, acc, w), *_head_maps(form, Hq, H, D, acc, w))
    if not keep:
        return args
    if len(FORM_ARGS) >= MAX_FORMS:
        FORM_ARGS.clear()
    FORM_ARGS[key] = (form, args)
    return args


class Scratch:
    """The scratch buffers of one launcher call (written and read by its launches only, never
    returned), laid out once per plan in one allocation, each on 16 bytes. (Also buffers that
    are returned together and live together, as views of their one allocation: the non-causal
    forward's auxiliaries, kept for its backward.)

    ``scratch(device, addresses)`` allocates them: ``(the allocation, the buffers)``, the buffers
    as views of it, or with ``addresses`` as their device addresses (ints: what a compiled
    kernel's launcher takes for a pointer, so a replayed launch, :class:`Launch`, needs no tensor
    per buffer; Triton's own launch path and the interpreter take the views). The caller holds
    the allocation until its launches are issued. ``bench.host``: one allocation of ~2 µs
    instead of one per buffer (posrf's non-causal forward without gradient: 8 of them)."""

    __slots__ = ("dtype", "shapes", "offsets", "bytes", "total")

    def __init__(self, dtype: torch.dtype, *shapes):
        size = dtype.itemsize
        step = max(1, 16 // size)  # elements per 16 bytes
        offsets, n = [], 0
        for shape in shapes:
            offsets.append(n)
            n += -(-_numel(shape) // step) * step
        self.dtype, self.shapes, self.total = dtype, shapes, max(n, 1)
        self.offsets, self.bytes = tuple(offsets), tuple(o * size for o in offsets)

    def __call__(self, device, addresses: bool):
        buf = torch.empty(self.total, device=device, dtype=self.dtype)
        return buf, self.at(buf, addresses)

    def at(self, buf: torch.Tensor, addresses: bool):
        """The buffers of an allocation ``buf`` this scratch made: their device addresses, or
        views (a kept allocation, :func:`rfattn.kernels.rf_parallel.rf_parallel_fwd`'s
        ``backward_plan``, read by a later call's launches)."""
        if addresses:  # map over a bound method: no Python frame per buffer
            return map(buf.data_ptr().__add__, self.bytes)
        return [buf[o : o + _numel(s)].view(s) for o, s in zip(self.offsets, self.shapes,
                                                               strict=True)]  # fmt: skip


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class Plan(types.SimpleNamespace):
    """A launcher's per-shape plan (:func:`shape_plan`): named values (sizes, splits, bound
    :class:`Launch` objects, their integer arguments), fixed when it is made."""


def backward_strides(plan: Plan, out, do, dq, dk, dv) -> tuple:
    """``(strides of out and do, the same and those of dq, dk, dv)``: the last integer arguments
    of a backward plan's launches. The plan's key fixes these layouts (out's and do's, and q, k,
    v's, which the gradients are made like), so the first call reads them and the plan keeps
    them."""
    tails = getattr(plan, "strides", None)
    if tails is None:
        io = (*out.stride(), *do.stride())
        tails = plan.strides = (io, (*io, *dq.stride(), *dk.stride(), *dv.stride()))
    return tails


def shape_plan(plans: dict, build, q, k, v, form, scale: float, key_padding_mask, precision,
               gpu_tiles, *options):  # fmt: skip
    """A launcher's per-shape plan for this call: ``plans[key]``, made by ``build(q, k, v, form,
    scale, key_padding_mask, precision, gpu_tiles, *options)`` (which checks the inputs and
    derives what the launches need: :func:`launch_setup`, sizes, splits, bound :class:`Launch`
    objects) on the first call with its key, and then kept.

    The key is everything such a plan derives from and Triton specialises on, read without
    touching the data: q, k and v's sizes, strides, dtypes, devices and 16-byte alignment, the
    form's kind, width and which parameters it has (its tensors are the call's own,
    :func:`form_args`), the mask's size and dtype, ``scale``, ``precision``, the tiles
    (``gpu_tiles`` resolved) and the launcher's ``options``. A plan holds no tensor of a call.
    ``bench.host``: 3 µs for the key and lookup, against 25-40 µs for a launch setup and the
    launches' keys."""
    w, mask = form.w, key_padding_mask
    tiles = GPU_TILES if gpu_tiles is None else bool(gpu_tiles)
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
           v.dtype, q.device, k.device, v.device, q.data_ptr() % 16, k.data_ptr() % 16,
           v.data_ptr() % 16, form.kind, w.shape, form.coeffs is None, form.psi is None,
           form.table is None, form.tau is None, form.rows is None, form.qmap is None,
           form.kmap is None, None if mask is None else (mask.shape, mask.dtype, mask.device),
           scale, precision, tiles, *options)  # fmt: skip
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= MAX_PLANS:  # ever new shapes: start over rather than grow
            plans.clear()
        plan = plans[key] = build(q, k, v, form, scale, mask, precision, gpu_tiles, *options)
    return plan


def varlen_key(cu_q, cu_k, max_q: int, max_k: int) -> tuple:
    """What a launcher's plan for packed sequences (its ``packed``: ``(cu_q, cu_k, max_q,
    max_k)``) derives from and Triton specialises on: ``(N, max_q, max_k)``, then the offsets'
    dtypes and 16-byte alignment."""
    return (cu_q.shape[0] - 1, max_q, max_k, cu_q.dtype, cu_k.dtype, cu_q.data_ptr() % 16,
            cu_k.data_ptr() % 16)  # fmt: skip


def mask_rows(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """The key padding mask as the kernels read it: int32 ``[B, Tk]``, contiguous (a new tensor:
    aligned)."""
    return key_padding_mask.to(torch.int32, memory_format=torch.contiguous_format)


def check_forward_only(c: Setup) -> None:
    """Raise for a backward launch with head maps (their kernels take none: the caller maps q
    and k first where gradients are needed)."""
    if c.has_map:
        raise NotImplementedError(
            "the fused backward kernels take no head maps (qmap/kmap): map q and k first "
            "(rfattn.rf_attention does this for calls that need gradients)"
        )


def launch_setup(q, k, v, form, scale, key_padding_mask, precision=None, causal=False,
           gpu_tiles=None) -> Setup:  # fmt: skip
    """Check the inputs and fix the launch setup of one call (``gpu_tiles``: pick a GPU's tiles
    and launch options, default :data:`GPU_TILES`; ``bench.compile`` records a GPU's launches on
    CPU with True)."""
    _check_inputs(q, k, v, form.w, key_padding_mask)
    gpu = GPU_TILES if gpu_tiles is None else bool(gpu_tiles)
    B, Hq, Tq, D = q.shape
    H, Tk, E, M = k.shape[1], k.shape[2], v.shape[3], form.w.shape[0]
    G = Hq // H if H else 1
    BD, BE, itemsize = next_pow2(D), next_pow2(E), q.element_size()
    big = max(BD, BE)
    precision = precision_policy(q.dtype, precision, causal, form.kind)
    if causal:
        bt, rows = _chunk_tiles(big, itemsize, gpu)
    else:  # the interpreter keeps the big 16-bit tiles whatever the dtype: faster tests
        half = gpu and precision in HALF_PRECISIONS.values()
        bt, rows = None, _feature_rows(big, itemsize if gpu else 2, half)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    w, *ptrs, qmap, kmap = form_args(form, B, Hq, H, acc, q.device)
    flags = form_flags(form)
    if key_padding_mask is not None:
        # int32, not a uint8 view: Triton 3.6 fails to compile fp64 tl.dot kernels that mask
        # with an 8-bit load (found ahead of time by bench/compile.py); B*T ints are cheap
        mask = mask_rows(key_padding_mask)
        pad = (mask, mask.stride(0), mask.stride(1))
    else:
        pad = (w, 0, 0)
    BM = min(rows, next_pow2(M))
    ACC = tl.float64 if acc == torch.float64 else tl.float32
    meta = dict(D=D, M=M, E=E, BD=BD, BM=BM, BE=BE, PRECISION=precision, ACC=ACC,
                TINY=torch.finfo(acc).tiny, **flags)  # fmt: skip
    return Setup(
        B=B, H=H, G=G, Tq=Tq, Tk=Tk, D=D, E=E, M=M, BD=BD, BE=BE, BM=BM, BT=bt, itemsize=itemsize,
        gpu_tiles=gpu, acc=acc, precision=precision, plain=flags["FEATURE"] == FEATURE_IDS["rmf"],
        w=w, pad=pad, has_pad=key_padding_mask is not None,
        # sqrt(scale) a scalar argument (fp64 in the kernels' signatures)
        form_ptrs=(float(scale) ** 0.5, *ptrs), maps=(qmap, kmap),
        has_map=form.qmap is not None or form.kmap is not None,
        NMT=cdiv(M, BM), ACC=ACC, meta=meta,
    )  # fmt: skip


# arrival counters: the last program of a group to finish merges the group's partials


@triton.jit
def last_to_arrive(cnt_ptr, NUM_SPLITS):
    """Whether this program is the last of the NUM_SPLITS programs sharing the arrival counter
    at ``cnt_ptr`` to get there (it then resets the counter to 0 for the next launch).

    The barrier orders every thread's partial stores before the arrival, a single atomic
    (acq_rel, GPU scope: one thread's, its result shared through shared memory behind another
    barrier), so that the last program's loads of the other programs' partials see them: the
    pattern of CUTLASS's split-K semaphore. Under the interpreter programs run one by one."""
    tl.debug_barrier()
    b_prev = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    b_last = b_prev == NUM_SPLITS - 1
    if b_last:
        tl.store(cnt_ptr, 0)
    return b_last


#: arrival counters (:func:`last_to_arrive`), int32 zeros between launches (the last program of
#: each group resets its own), shared by every kernel that merges partials, per (device, stream):
#: launches on one stream run one after another, while two streams' launches may overlap and must
#: not share counters
COUNTERS: dict = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` arrival counters for a launch on ``device``'s current stream: zeroed once
    (one fill on the first launch, or when a launch needs more), never per call."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    buf = COUNTERS.get((device, stream))
    if buf is None or buf.numel() < n:
        buf = torch.zeros(triton.next_power_of_2(max(n, 1024)), dtype=torch.int32, device=device)
        COUNTERS[(device, stream)] = buf
    return buf
