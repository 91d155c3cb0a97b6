"""The fused kernels as PyTorch operators (``torch.library``), with autograd and fake impls.

One operator per algorithmic form, each taking a feature's kernel form
(:class:`rfattn.features.form.KernelForm`, flattened into the schema by :func:`flat_form`):

* ``rfattn::parallel`` / ``rfattn::parallel_bwd``: non-causal (``rfattn.kernels.rf_parallel``);
  forward saves q, k, v, the output (fp16/bf16: with its rounding residual, the backward's
  ``c = -(do . out) / den`` from the fp32 output), S, z and the stabiliser offsets
  (``O(B H (F E + T))``, no feature maps); backward recomputes the features and returns dq,
  dk, dv and dW when the form's rows require grad.
* ``rfattn::chunk`` / ``rfattn::chunk_bwd``: causal, chunkwise (``rfattn.kernels.rf_chunk``),
  with an optional initial state; gradients reach q, k, v and the initial S0, z0 from cotangents
  of the output and of the final S, z taken with the offsets held fixed (the gradients of the
  offset-invariant ``S exp(offset)``; offsets are stabilisers, not differentiable). W gets no
  gradient here (``rf_attention`` sends learnable W to the torch path). Chunk states are
  recomputed in the backward, not saved.
* ``rfattn::decode`` (new state) and ``rfattn::decode_`` (the state updated in place): the
  recurrent step (``rfattn.kernels.rf_recurrent``), forward only.

``torch.compile(fullgraph=True)`` and ``torch.export`` see each as one operator (fake impls give
the output shapes) instead of tracing into the launchers. They are ``torch.library.custom_op``
rather than ``triton_op``: a ``triton_op`` lets Inductor trace into its body, which needs every
launch wrapped in ``wrap_triton`` and the launchers' host logic (split counts from the device's SM
count, autotuning with config pruning) traceable, and can only be checked on a GPU; as an opaque
operator the kernels run exactly as in eager mode.

Eager calls (not under ``torch.compile`` / ``torch.export``: ``torch.compiler.is_compiling()``
false) skip the operators' dispatch, which costs more host time than the launches it wraps
(``python -m bench.host``: 21 µs per call, 93 µs when inputs require grad, against 11 / 14 µs
for a plain ``torch.autograd.Function``): the same launchers run through :class:`_Parallel` /
:class:`_Chunk` when a gradient may follow, and directly otherwise (the decode step always).
Each takes only what a gradient may reach as its inputs and returns only the output (and a
causal call's final state where it is asked for), its backward's auxiliaries saved as
intermediates in one allocation and its backward's launch plan carried from the forward's: for
:class:`_Parallel` autograd handles 4 inputs and 1 output instead of the schema's 16 and 7, for
:class:`_Chunk` 5 and 1 (4 with the state) instead of 20 and 8.

On CPU tensors without the Triton interpreter, each operator runs its torch kernel instead: the
kernel form evaluated in torch (:meth:`KernelForm.evaluate`) through the torch path's attention
(``rfattn.torch_path.causal_scan`` for the causal forms), its backward by autograd over that
recomputation, with the kernels' conventions (offsets held fixed, states in ``RFState``'s form).
So the operators work on any CPU, under ``torch.compile`` too; the interpreter (CI) runs the
Triton kernels themselves, and tests hold the two to each other.

The per-form parameters (coefficients, tables, tau, rmf's rows, head maps) are held constant: no
gradient. Forms with head maps run the forward kernels only (:mod:`rfattn.fused` maps q and k
first where gradients are needed); their Triton backward raises.
Importing this module imports Triton (:mod:`rfattn.fused` imports it on the first fused call).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.library import custom_op

from rfattn.autograd import apply
from rfattn.blocked import no_autocast
from rfattn.features.base import (
    compute_dtype,
    key_features,
    key_offset,
    prescale,
    query_features,
)
from rfattn.features.form import KernelForm
from rfattn.kernels import common as kernel_common
from rfattn.kernels import rf_chunk as rf_chunk_kernels
from rfattn.kernels import rf_local as rf_local_kernels
from rfattn.kernels import rf_parallel as rf_parallel_kernels
from rfattn.kernels import rf_recurrent as rf_recurrent_kernels
from rfattn.kernels.common import INTERPRET

__all__ = ["flat_form", "on_torch", "rf_chunk", "rf_chunk_hybrid", "rf_decode", "rf_hybrid_decode",
           "rf_local", "rf_parallel", "DECODE_TOKENS"]

#: the most tokens :func:`rf_decode` takes (``rfattn.kernels.rf_recurrent.MAX_TOKENS``)
DECODE_TOKENS = rf_recurrent_kernels.MAX_TOKENS

# Schema pieces shared by the operators: the kernel form (flattened by flat_form), the call, the
# carried state and the launch options.
_FORM = (
    "str kind, Tensor w, Tensor? coeffs, Tensor? psi, Tensor? table, Tensor? extra, Tensor? index, "
    "Tensor? qmap, Tensor? kmap"
)
_CALL = "float scale, Tensor? key_padding_mask"
_STATE = "Tensor? s0, Tensor? z0, Tensor? off0"
_OPTS = "str? precision, bool? gpu_tiles"
_QKV = "Tensor q, Tensor k, Tensor v"
_INDEX = "Tensor? state_index"  # a batch's rows of a pool of states (the decode steps)
_NFORM = 9  # arguments of _FORM
_SCALE = 3 + _NFORM  # the position of scale among an operator's inputs (after q, k, v, the form)


def _op(name: str, args: str, returns: str, mutates=()):
    return custom_op(f"rfattn::{name}", mutates_args=mutates, schema=f"({args}) -> {returns}")


def _differentiable(name: str, args: str, returns: str, body, fake, setup, backward):
    """``rfattn::<name>`` with its fake impl and autograd (``setup`` the context's, ``backward``
    calling the backward operator): what ``torch.compile`` / ``torch.export`` trace. Eager
    calls take the plain ``torch.autograd.Function`` of the same launchers instead
    (:class:`_Parallel`, :class:`_Chunk`)."""
    op = _op(name, args, returns)(body)
    op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup)
    return op


def flat_form(form: KernelForm) -> tuple:
    """The form as operator arguments (``_FORM``): kind, w, coeffs, psi, table, extra, index,
    qmap, kmap."""
    extra, index = (form.tau, form.lam) if form.kind == "table" else (form.rows, form.segments)
    return (form.kind, form.w, form.coeffs, form.psi, form.table, extra, index, form.qmap,
            form.kmap)  # fmt: skip


def _form(args: tuple) -> tuple[KernelForm, tuple]:
    """(the KernelForm of the leading ``_FORM`` arguments, the arguments after them)."""
    kind, w, coeffs, psi, table, extra, index, qmap, kmap = args[:_NFORM]
    named = dict(tau=extra, lam=index) if kind == "table" else dict(rows=extra, segments=index)
    form = KernelForm(kind, w, coeffs, psi, table, qmap=qmap, kmap=kmap, **named)
    return form, args[_NFORM:]


def _state(s0, z0, off0):
    return None if s0 is None else (s0, z0, off0)


def _state_like(q, v, w) -> tuple:
    """Empty ``(S [B, H, F, E], z [B, H, F], offset [B, H])`` in the accumulation dtype, H the
    key/value heads."""
    B, H, F, E, acc = q.shape[0], v.shape[1], w.shape[0], v.shape[3], compute_dtype(q.dtype)
    return (
        q.new_empty(B, H, F, E, dtype=acc),
        q.new_empty(B, H, F, dtype=acc),
        q.new_empty(B, H, dtype=acc),
    )


#: CPU tensors take the operators' torch kernels (below) unless the Triton interpreter is on
TORCH_ON_CPU = not INTERPRET


def on_torch(q: torch.Tensor) -> bool:
    """Whether the operators run their torch kernels for ``q`` (a CPU tensor without the
    Triton interpreter, unless ``rfattn.kernels.common.FAKE_DEVICE``)."""
    return TORCH_ON_CPU and q.device.type == "cpu" and not kernel_common.FAKE_DEVICE


# ------------------------------------------------------------------------------------------------
# torch kernels (CPU without the interpreter)


def _torch_logits(q, k, form, scale):
    """``(u_q, g_q, u_k, g_k)``: the form's logits and amplitudes of the pre-scaled (and mapped)
    inputs."""
    xq, xk = prescale(q, scale, None, form.qmap), prescale(k, scale, None, form.kmap)
    return *form.evaluate(xq, "query"), *form.evaluate(xk, "key")


def _torch_features(q, k, form, scale):
    """(phi_q, u_k, g_k): stabilised query features, key logits (None: plain) and amplitudes."""
    u_q, g_q, u_k, g_k = _torch_logits(q, k, form, scale)
    if form.plain:
        return g_q, None, g_k
    return query_features(u_q, g_q), u_k, g_k


def _torch_parallel(q, k, v, form, scale, mask):
    """``(out, S, z, m_K, m_q, den, out_lo)`` of the non-causal form in torch, in the kernels'
    layout (``m_K`` the per-feature key offsets ``[B*H, F]``; m_q, the per-row query offsets,
    as 0 and the half output's rounding residual ``out_lo`` as zeros (empty for fp32 / fp64):
    only the Triton backward reads them)."""
    from rfattn.reference import attention_ratio

    u_q, g_q, u_k, g_k = _torch_logits(q, k, form, scale)
    B, H, Tq = q.shape[:3]
    vc = v.to(u_q.dtype)
    if mask is not None:
        vc = vc.masked_fill(mask[:, None, :, None], 0.0)
    if form.plain:  # no offsets
        phi_q, phi_k = g_q, g_k if mask is None else g_k.masked_fill(mask[:, None, :, None], 0.0)
        m_k = u_q.new_zeros(B, H, form.w.shape[0])
    else:
        m_k = key_offset(u_k, mask)
        phi_q, phi_k = query_features(u_q, g_q, m_k), key_features(u_k, mask, g_k, m_k)
    S, z = phi_k.transpose(-1, -2) @ vc, phi_k.sum(-2)
    den = (phi_q @ z[..., None]).squeeze(-1)
    out = attention_ratio(phi_q @ S, den)
    out = out.to(q.dtype)
    keep = kernel_common.keeps_out_residual(q.dtype)
    lo = torch.zeros_like(out) if keep else out.new_empty(0)
    aux = (S.flatten(0, 1), z.flatten(0, 1), m_k.flatten(0, 1), phi_q.new_zeros(B * H, Tq),
           den.flatten(0, 1), lo)  # fmt: skip
    return (out, *aux)


def _torch_chunk(q, k, v, form, scale, mask, state):
    """``(out, S, z, offset)`` of the causal forms in torch (the torch path's chunked scan);
    grouped-query inputs (fewer k, v heads) as the kernels take them."""
    from rfattn.call import RFState, group_size, grouped
    from rfattn.torch_path import causal_scan

    Hk, T, G = k.shape[1], q.shape[2], group_size(q, k)
    if form.qmap is not None:  # per query head, before the heads' rows are grouped
        dt, q = q.dtype, prescale(q, 1.0, None, form.qmap)
        form = dataclasses.replace(form, qmap=None)
    else:
        dt = q.dtype
    phi_q, u_k, g_k = _torch_features(grouped(q, Hk) if Hk else q, k, form, scale)
    if state is not None:
        state = RFState(*(x.to(phi_q.dtype) for x in state))
    phi_q = phi_q.unflatten(2, (G, T))  # [B, Hk, G, T, F]
    out, st = causal_scan(phi_q, u_k, g_k, v.to(phi_q.dtype), mask, state)
    # an operator's outputs never alias its inputs (a plain feature keeps the given offset)
    given = () if state is None else tuple(state)
    return (out.flatten(1, 2).to(dt),
            *(x.clone() if any(x is y for y in given) else x for x in st))  # fmt: skip


def _torch_grads(fn, inputs, need, cotangents):
    """Gradients of ``fn(*inputs)`` (a tuple of outputs) for the inputs flagged in ``need`` with
    the given cotangents (None: zero), by autograd over the torch kernel; None where not needed."""
    with torch.enable_grad():
        xs = [x.detach().requires_grad_(n) if x is not None else None
              for x, n in zip(inputs, need, strict=True)]  # fmt: skip
        outs = fn(*xs)
        pairs = [(o, c) for o, c in zip(outs, cotangents, strict=True) if c is not None]
        wrt = [x for x, n in zip(xs, need, strict=True) if n]
        grads = torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs],
                                    allow_unused=True)  # fmt: skip
    it = iter(grads)
    return [
        (torch.zeros_like(x) if (g := next(it)) is None else g) if n else None
        for x, n in zip(inputs, need, strict=True)
    ]


# ------------------------------------------------------------------------------------------------
# non-causal


def _parallel_body(q, k, v, *args):
    """``rfattn::parallel``'s body."""
    form, (scale, mask, precision, gpu_tiles) = _form(args)
    if on_torch(q):
        return _torch_parallel(q, k, v, form, scale, mask)
    out, aux = rf_parallel_kernels.rf_parallel_fwd(
        q, k, v, form, scale, mask, precision, return_aux=True, gpu_tiles=gpu_tiles
    )
    return (out, *aux)


def _residual_like(q, v) -> torch.Tensor:
    """An empty ``out_lo`` as the operators return it: shaped and typed as the output for
    fp16/bf16 inputs (``common.keeps_out_residual``), else empty."""
    if kernel_common.keeps_out_residual(q.dtype):
        return q.new_empty(*q.shape[:3], v.shape[3])
    return q.new_empty(0)


def _parallel_fake(q, k, v, *args):
    BH, Tq, F, acc = q.shape[0] * q.shape[1], q.shape[2], args[1].shape[0], compute_dtype(q.dtype)
    aux = [(BH, F, v.shape[3]), (BH, F), (BH, F), (BH, Tq), (BH, Tq)]
    out = q.new_empty(*q.shape[:3], v.shape[3])
    return (out, *(q.new_empty(s, dtype=acc) for s in aux), _residual_like(q, v))


_PARALLEL_BWD = f"Tensor do, {_QKV}, {_FORM}, {_CALL}, Tensor out, Tensor s, Tensor z, " \
    f"Tensor mk, Tensor mq, Tensor den, Tensor out_lo, {_OPTS}, bool need_dw"  # fmt: skip


def _parallel_bwd_body(do, q, k, v, *args):
    form, (scale, mask, out, *aux, precision, gpu_tiles, need_dw) = _form(args)
    dq, dk, dv, dw = rf_parallel_kernels.rf_parallel_bwd(
        do, q, k, v, form, scale, out, tuple(aux), mask, precision, need_dw=need_dw,
        gpu_tiles=gpu_tiles,
    )  # fmt: skip
    return dq, dk, dv, (dw if need_dw else form.w.new_empty(0))


_parallel_bwd = _op("parallel_bwd", _PARALLEL_BWD, "(Tensor, Tensor, Tensor, Tensor)")(
    _parallel_bwd_body
)


@_parallel_bwd.register_fake
def _(do, q, k, v, *args):
    w, need_dw = args[1], args[-1]
    dw = torch.empty_like(w) if need_dw else w.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dw


def _auxiliary(ctx, outputs) -> None:
    """Mark an operator's auxiliary outputs (offsets, row statistics kept for the backward) as
    non-differentiable, and leave the cotangents of unused outputs None: autograd would
    otherwise fill a zero tensor for each (one GPU op apiece) that the backward never reads."""
    ctx.mark_non_differentiable(*outputs)
    ctx.set_materialize_grads(False)


def _parallel_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:3], *inputs[4:_SCALE], inputs[_SCALE + 1], *output)
    _auxiliary(ctx, output[1:])
    ctx.kind, ctx.scale, ctx.opts = inputs[3], inputs[_SCALE], inputs[_SCALE + 2 :]


@no_autocast
def _parallel_backward(ctx, d_out, *_aux):
    q, k, v, *form, mask, out, s, z, mk, mq, den, out_lo = ctx.saved_tensors
    need_dw = ctx.needs_input_grad[4]
    d_out = torch.zeros_like(out) if d_out is None else d_out
    if on_torch(q):  # autograd over the torch kernel (an operator's body records no graph)
        form_ = _form((ctx.kind, *form))[0]

        def fwd(q, k, v, w):
            return _torch_parallel(q, k, v, dataclasses.replace(form_, w=w), ctx.scale, mask)[:1]

        dq, dk, dv, dw = _torch_grads(
            fwd, (q, k, v, form_.w), (True, True, True, need_dw), (d_out,)
        )
        return dq, dk, dv, None, dw, *([None] * (_NFORM + 2))
    dq, dk, dv, dw = _parallel_bwd(
        d_out, q, k, v, ctx.kind, *form, ctx.scale, mask, out, s, z, mk, mq, den, out_lo,
        *ctx.opts, need_dw,
    )  # fmt: skip
    return dq, dk, dv, None, (dw if need_dw else None), *([None] * (_NFORM + 2))


_parallel = _differentiable(
    "parallel", f"{_QKV}, {_FORM}, {_CALL}, {_OPTS}",
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _parallel_body, _parallel_fake,
    _parallel_setup, _parallel_backward,
)


class _Parallel(torch.autograd.Function):
    """``rfattn::parallel`` for eager calls: the same launchers without the operator's dispatch,
    and with less for autograd to do at each call than the operator's schema asks for. Its
    inputs are q, k, v and W (the tensors a gradient may reach; the form, the mask and the
    options ride along as plain arguments), its one output is ``out``: the auxiliaries the
    backward reads (S, z, the offsets, den) are saved as intermediates rather than returned,
    so none is marked non-differentiable and no cotangent is checked for them. The backward's
    launch plan comes with the forward's (:func:`rf_parallel_kernels.rf_parallel_fwd`'s
    ``return_aux``), so it looks nothing up by shape."""

    @staticmethod
    def forward(ctx, q, k, v, w, form, scale, mask, precision, gpu_tiles, stats, packed):
        if on_torch(q):
            out, *aux = _torch_parallel(q, k, v, form, scale, mask)
            bwd = None
        else:
            out, aux, bwd = rf_parallel_kernels.rf_parallel_fwd(
                q, k, v, form, scale, mask, precision, return_aux=True, gpu_tiles=gpu_tiles,
                backward_plan=True, stats=stats, packed=packed,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, w, mask, out, *aux)
        ctx.form, ctx.scale, ctx.opts, ctx.plan = form, scale, (precision, gpu_tiles), bwd
        ctx.packed = packed
        return out

    @staticmethod
    @no_autocast
    def backward(ctx, d_out):
        q, k, v, w, mask, out, *aux = ctx.saved_tensors
        need_dw = ctx.needs_input_grad[3]
        form = ctx.form
        if ctx.plan is None:  # autograd over the torch kernel (the forward recorded no graph)
            scale = ctx.scale

            def fwd(q, k, v, w):
                return _torch_parallel(q, k, v, dataclasses.replace(form, w=w), scale, mask)[:1]

            dq, dk, dv, dw = _torch_grads(fwd, (q, k, v, w), (True, True, True, need_dw),
                                          (d_out,))  # fmt: skip
        else:
            dq, dk, dv, dw = rf_parallel_kernels.rf_parallel_bwd(
                d_out, q, k, v, form, ctx.scale, out, aux, mask, *ctx.opts[:1], need_dw=need_dw,
                gpu_tiles=ctx.opts[1], plan=ctx.plan, packed=ctx.packed,
            )  # fmt: skip
        return dq, dk, dv, dw, None, None, None, None, None, None, None


def rf_parallel(q, k, v, form: KernelForm, scale: float, key_padding_mask=None, precision=None,
                gpu_tiles=None, stats=None, packed=None) -> torch.Tensor:  # fmt: skip
    """Fused non-causal attention of the kernel form ``form`` (``rfattn::parallel``); see
    ``rfattn.kernels.rf_parallel.rf_parallel_fwd`` for the arguments (``stats``: the statistics
    a form from ``rfattn.fused.kernel_form(..., defer=True)`` leaves to the key pass;
    ``packed``: packed sequences' offsets and longest lengths; both eager calls on the Triton
    kernels only). Gradients reach q, k, v and ``form.w``."""
    if packed is not None and (torch.compiler.is_compiling() or on_torch(q)):
        raise NotImplementedError("packed sequences on the kernels themselves: eager calls on "
                                  "the Triton kernels only")  # fmt: skip
    if torch.compiler.is_compiling():
        return _parallel(q, k, v, *flat_form(form), scale, key_padding_mask, precision,
                         gpu_tiles)[0]  # fmt: skip
    w = form.w
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                    w.requires_grad):  # fmt: skip
        return apply(_Parallel, q, k, v, w, form, scale, key_padding_mask, precision, gpu_tiles,
                     stats, packed)  # fmt: skip
    if on_torch(q):  # no gradient follows: the operator's body, on the form itself
        return _torch_parallel(q, k, v, form, scale, key_padding_mask)[0]
    return rf_parallel_kernels.rf_parallel_fwd(q, k, v, form, scale, key_padding_mask, precision,
                                               gpu_tiles=gpu_tiles, stats=stats,
                                               packed=packed)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# causal, chunkwise


def _chunk_body(q, k, v, *args):
    """``rfattn::chunk``'s body (the operator's)."""
    form, (scale, mask, s0, z0, off0, precision, gpu_tiles) = _form(args)
    if on_torch(q):  # the saved m_q, den, m_k, out_lo are only read by the Triton backward
        return (*_torch_chunk(q, k, v, form, scale, mask, _state(s0, z0, off0)),
                *(torch.zeros_like(x) for x in _chunk_aux_like(q, k, v)))  # fmt: skip
    out, state, aux = rf_chunk_kernels.rf_chunk_fwd(
        q, k, v, form, scale, mask, _state(s0, z0, off0), precision, return_aux=True,
        gpu_tiles=gpu_tiles,
    )  # fmt: skip
    return out, *state, *aux


def _chunk_aux_like(q, k, v) -> tuple:
    """Empty ``(m_q, den [B*Hq, T], m_k [B*Hk, T])`` in the accumulation dtype, and ``out_lo``
    (the output's rounding residual: shaped as the output for fp16/bf16 inputs, else empty)."""
    B, T, acc = q.shape[0], q.shape[2], compute_dtype(q.dtype)
    rows = (B * q.shape[1], B * q.shape[1], B * k.shape[1])
    return (*(q.new_empty(n, T, dtype=acc) for n in rows), _residual_like(q, v))


def _chunk_fake(q, k, v, *args):
    return (q.new_empty(*q.shape[:3], v.shape[3]), *_state_like(q, v, args[1]),
            *_chunk_aux_like(q, k, v))  # fmt: skip


_CHUNK_BWD = f"Tensor do, Tensor? ds, Tensor? dz, {_QKV}, {_FORM}, {_CALL}, {_STATE}, " \
    f"Tensor out, Tensor mq, Tensor den, Tensor mk, Tensor out_lo, bool exact, {_OPTS}"  # fmt: skip


def _chunk_bwd_body(do, ds, dz, q, k, v, *args):
    form, (scale, mask, s0, z0, off0, out, mq, den, mk, olo, exact, precision,
           gpu_tiles) = _form(args)  # fmt: skip
    dq, dk, dv, ds0, dz0 = rf_chunk_kernels.rf_chunk_bwd(
        do, None if ds is None else (ds, dz), q, k, v, form, scale, out, (mq, den, mk, olo), mask,
        _state(s0, z0, off0), precision, gpu_tiles=gpu_tiles, exact=exact,
    )  # fmt: skip
    if ds0 is None:
        return dq, dk, dv, q.new_empty(0), q.new_empty(0)
    return dq, dk, dv, ds0.to(s0.dtype), dz0.to(z0.dtype)


_chunk_bwd = _op("chunk_bwd", _CHUNK_BWD, "(Tensor, Tensor, Tensor, Tensor, Tensor)")(
    _chunk_bwd_body
)


@_chunk_bwd.register_fake
def _(do, ds, dz, q, k, v, *args):
    s0, z0 = args[_NFORM + 2], args[_NFORM + 3]
    init = s0 is not None
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(s0) if init else q.new_empty(0),
            torch.empty_like(z0) if init else q.new_empty(0))  # fmt: skip


def _chunk_setup(ctx, inputs, output, extra=()):
    """``rfattn::chunk``'s context (``extra``: more tensors saved after its own, the hybrid's)."""
    out, mq, den, mk, olo = output[0], *output[4:8]
    _auxiliary(ctx, output[3:])  # the offsets and what the backward reads of the rows
    ctx.save_for_backward(*inputs[:3], *inputs[4:_SCALE], *inputs[_SCALE + 1 : _SCALE + 5], out,
                          mq, den, mk, olo, *extra)  # fmt: skip
    ctx.kind, ctx.scale, ctx.opts = inputs[3], inputs[_SCALE], inputs[_SCALE + 5 :]


def _chunk_cotangents(q, v, w, out, d_out, d_s, d_z) -> tuple:
    """``(d_out, d_s, d_z)`` as the causal backward takes them: the output's zeros where it got
    none, and the final state's zeros for the one of S, z left without (both None where
    neither has one: the backward then reads no final-state cotangent)."""
    d_out = torch.zeros_like(out) if d_out is None else d_out
    if d_s is not None or d_z is not None:
        s, z, _ = _state_like(q, v, w)
        d_s = torch.zeros_like(s) if d_s is None else d_s
        d_z = torch.zeros_like(z) if d_z is None else d_z
    return d_out, d_s, d_z


def _torch_chunk_grads(form, scale, mask, q, k, v, s0, z0, off0, cotangents) -> list:
    """``[dq, dk, dv, dS0, dz0]`` of the causal form in torch by autograd over the torch kernel
    (the forward recorded no graph); the last two None without an initial state."""
    init = s0 is not None

    def fwd(q, k, v, s0, z0):
        return _torch_chunk(q, k, v, form, scale, mask, _state(s0, z0, off0))[:3]

    return _torch_grads(fwd, (q, k, v, s0, z0), (True, True, True, init, init), cotangents)


@no_autocast
def _chunk_backward(ctx, d_out, d_s, d_z, *_rest):
    return _chunk_grads(ctx, ctx.saved_tensors, d_out, d_s, d_z)


def _chunk_grads(ctx, saved, d_out, d_s, d_z, exact: bool = False) -> tuple:
    """The gradients of ``rfattn::chunk``'s inputs from its ``saved`` tensors (``exact``: the
    hybrid's, whose exact terms joined the ratio)."""
    q, k, v, *form, mask, s0, z0, off0, out, mq, den, mk, olo = saved
    d_out, d_s, d_z = _chunk_cotangents(q, v, form[0], out, d_out, d_s, d_z)
    init = s0 is not None
    if on_torch(q):  # an operator's body records no graph
        dq, dk, dv, ds0, dz0 = _torch_chunk_grads(_form((ctx.kind, *form))[0], ctx.scale, mask,
                                                  q, k, v, s0, z0, off0, (d_out, d_s, d_z))
        return dq, dk, dv, *([None] * (_NFORM + 2)), ds0, dz0, None, None, None
    dq, dk, dv, ds0, dz0 = _chunk_bwd(
        d_out, d_s, d_z, q, k, v, ctx.kind, *form, ctx.scale, mask, s0, z0, off0, out, mq, den,
        mk, olo, exact, *ctx.opts,
    )  # fmt: skip
    return (dq, dk, dv, *([None] * (_NFORM + 2)), (ds0 if init else None),
            (dz0 if init else None),
            None, None, None)  # fmt: skip


_chunk = _differentiable(
    "chunk", f"{_QKV}, {_FORM}, {_CALL}, {_STATE}, {_OPTS}",
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _chunk_body, _chunk_fake,
    _chunk_setup, _chunk_backward,
)


class _Chunk(torch.autograd.Function):
    """``rfattn::chunk`` for eager calls, as :class:`_Parallel` is ``rfattn::parallel``'s: its
    inputs are q, k, v and the initial S0, z0 (what a gradient may reach; the form, the mask,
    the initial offset and the options ride along), its outputs ``out`` and, with
    ``return_state``, the final state (offset non-differentiable). The rows the backward reads
    (the queries' offsets and denominators, the keys' max logits) are one saved allocation, not
    outputs; the final state of a call that does not return it is the call's scratch; the
    backward's plan comes with the forward's (``rf_chunk_kernels.rf_chunk_fwd``'s
    ``backward_plan``). Cotangents of unused outputs stay None (no zero fills).

    The hybrid (:func:`rf_chunk_hybrid`) passes three more inputs, each row's exact terms
    ``nex``, ``dex`` (differentiable) at their offsets ``eex``: the output walk joins them to
    the features' terms and saves the total denominator, so the backward is the chunk kernels'
    as it is, plus the exact terms' cotangents ``do * wex`` and ``-(do . out) wex`` (``wex``
    written by the walk). On the Triton kernels only."""

    @staticmethod
    def forward(ctx, q, k, v, s0, z0, form, scale, mask, off0, precision, gpu_tiles,
                return_state, nex=None, dex=None, eex=None, packed=None):  # fmt: skip
        init = _state(s0, z0, off0)
        wex = None if nex is None else torch.empty_like(dex)
        if on_torch(q):  # (never the hybrid's: rf_chunk_hybrid refuses it)
            out, *state = _torch_chunk(q, k, v, form, scale, mask, init)
            aux, plan = (), None
        else:
            out, state, aux, plan = rf_chunk_kernels.rf_chunk_fwd(
                q, k, v, form, scale, mask, init, precision, return_aux=True,
                gpu_tiles=gpu_tiles, return_state=return_state, backward_plan=True,
                exact=None if nex is None else (nex, dex, eex, wex), packed=packed,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, mask, s0, z0, off0, out, wex, *aux)
        ctx.form, ctx.scale, ctx.opts, ctx.plan = form, scale, (precision, gpu_tiles), plan
        ctx.packed = packed
        ctx.set_materialize_grads(False)
        if not return_state:
            return out
        ctx.mark_non_differentiable(state[2])
        return out, *state

    @staticmethod
    @no_autocast
    def backward(ctx, d_out, d_s=None, d_z=None, _d_off=None):
        q, k, v, mask, s0, z0, off0, out, wex, *aux = ctx.saved_tensors
        init = s0 is not None
        d_out, d_s, d_z = _chunk_cotangents(q, v, ctx.form.w, out, d_out, d_s, d_z)
        if ctx.plan is None:  # the torch kernel's forward recorded no graph
            dq, dk, dv, ds0, dz0 = _torch_chunk_grads(ctx.form, ctx.scale, mask, q, k, v, s0, z0,
                                                      off0, (d_out, d_s, d_z))  # fmt: skip
        else:
            dq, dk, dv, ds0, dz0 = rf_chunk_kernels.rf_chunk_bwd(
                d_out, None if d_s is None else (d_s, d_z), q, k, v, ctx.form, ctx.scale, out,
                aux, mask, _state(s0, z0, off0), ctx.opts[0], gpu_tiles=ctx.opts[1],
                plan=ctx.plan, exact=wex is not None, packed=ctx.packed,
            )  # fmt: skip
            if init:
                ds0, dz0 = ds0.to(s0.dtype), dz0.to(z0.dtype)
        grads = (dq, dk, dv, ds0, dz0, None, None, None, None, None, None, None)
        if wex is None:  # (None for the exact terms and the offsets, where given)
            return (*grads, None, None, None, None)
        return (*grads, *_exact_cotangents(d_out, out, wex), None, None)


def _exact_cotangents(d_out, out, wex) -> tuple:
    """The cotangents ``(do * wex, -(do . out) wex)`` of the hybrid's exact numerator and
    denominator, from the output's and the weights ``wex`` the output walk wrote."""
    do = d_out.to(wex.dtype)
    return do * wex[..., None], -(do * out.to(wex.dtype)).sum(-1) * wex


def rf_chunk(q, k, v, form: KernelForm, scale: float, key_padding_mask=None, initial_state=None,
             precision=None, gpu_tiles=None, return_state: bool = True,
             packed=None):  # fmt: skip
    """Causal fused attention of the kernel form ``form`` (``rfattn::chunk``); see
    ``rfattn.kernels.rf_chunk.rf_chunk_fwd`` (``packed``: packed sequences' offsets and
    longest length, eager calls on the Triton kernels only). Returns ``(out, S, z, offset)``;
    with ``return_state`` False the state may be None (a call without gradient on the kernels
    then leaves it in its scratch: no allocation for it)."""
    s0, z0, off0 = (None, None, None) if initial_state is None else initial_state
    traced = torch.compiler.is_compiling()
    if packed is not None and (traced or on_torch(q)):
        raise NotImplementedError("packed sequences on the kernels themselves: eager calls on "
                                  "the Triton kernels only")  # fmt: skip
    if not traced and not (torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad or
            s0 is not None and (s0.requires_grad or z0.requires_grad))):  # fmt: skip
        if on_torch(q):  # no gradient follows: the operator's body, on the form itself
            return _torch_chunk(q, k, v, form, scale, key_padding_mask, initial_state)
        out, state = rf_chunk_kernels.rf_chunk_fwd(
            q, k, v, form, scale, key_padding_mask, initial_state, precision,
            gpu_tiles=gpu_tiles, return_state=return_state, packed=packed,
        )  # fmt: skip
        return (out, None, None, None) if state is None else (out, *state)
    if not traced:
        res = apply(_Chunk, q, k, v, s0, z0, form, scale, key_padding_mask, off0, precision,
                    gpu_tiles, return_state, None, None, None, packed)  # fmt: skip
        return res if return_state else (res, None, None, None)
    out, s, z, off, *_ = _chunk(q, k, v, *flat_form(form), scale, key_padding_mask, s0, z0,
                                off0, precision, gpu_tiles)  # fmt: skip
    return out, s, z, off


class _Local(torch.autograd.Function):
    """The hybrid's exact part on its kernels (:func:`rf_local`): inputs q, the extended keys and
    values, the sink slots' keys and values (what a gradient may reach; the kinds, the sinks'
    positions and presence, the window and the scale ride along); outputs ``num``, ``den`` and
    ``off`` (not differentiable: held constant, as the torch path detaches it)."""

    @staticmethod
    def forward(ctx, q, keys, values, sink_keys, sink_values, kinds, sink_pos, sink_present,
                window, scale):  # fmt: skip
        num, den, off = rf_local_kernels.local_fwd(q, keys, values, kinds, sink_keys,
                                                   sink_values, sink_pos, sink_present, window,
                                                   scale)  # fmt: skip
        ctx.save_for_backward(q, keys, values, sink_keys, sink_values, kinds, sink_pos,
                              sink_present, off)  # fmt: skip
        ctx.window, ctx.scale = window, scale
        ctx.mark_non_differentiable(off)
        return num, den, off

    @staticmethod
    @no_autocast
    def backward(ctx, d_num, d_den, _d_off):
        return (*_local_grads(_local_bwd_body, ctx.saved_tensors, d_num, d_den, ctx.window,
                              ctx.scale), None, None, None, None, None)  # fmt: skip


def _local_grads(backward, saved, d_num, d_den, window: int, scale: float) -> tuple:
    """dq and the gradients of the extended keys and values and the sink slots' (the inputs'
    dtypes) of the exact part, from its saved tensors (:class:`_Local`, ``rfattn::local``),
    by ``backward`` (the kernels' launcher, or the operator ``rfattn::local_bwd``)."""
    q, keys, values, sink_keys, sink_values, kinds, sink_pos, sink_present, off = saved
    grads = backward(d_num.contiguous(), d_den.contiguous(), off, q, keys, values, sink_keys,
                     sink_values, kinds, sink_pos, sink_present, window, scale)  # fmt: skip
    return tuple(g.to(x.dtype) for g, x in
                 zip(grads, (q, keys, values, sink_keys, sink_values), strict=True))  # fmt: skip


# The hybrid's operators: what torch.compile / torch.export trace (eager calls take _Local and
# _Chunk); Triton or its interpreter only (the torch path's hybrid runs elsewhere).
_LOCAL = ("Tensor q, Tensor keys, Tensor values, Tensor sink_keys, Tensor sink_values, "
          "Tensor kinds, Tensor sink_pos, Tensor sink_present, int window, float scale")


def _local_body(q, keys, values, sink_keys, sink_values, kinds, sink_pos, sink_present, window,
                scale):  # fmt: skip
    return rf_local_kernels.local_fwd(q, keys, values, kinds, sink_keys, sink_values, sink_pos,
                                      sink_present, window, scale)  # fmt: skip


def _local_fake(q, keys, values, *_args):
    acc = compute_dtype(q.dtype)
    rows = q.new_empty(*q.shape[:3], dtype=acc)
    return q.new_empty(*q.shape[:3], values.shape[3], dtype=acc), rows, torch.empty_like(rows)


def _local_bwd_body(dnum, dden, off, q, keys, values, sink_keys, sink_values, kinds, sink_pos,
                    sink_present, window, scale):  # fmt: skip
    return rf_local_kernels.local_bwd(dnum, dden, off, q, keys, values, kinds, sink_keys,
                                      sink_values, sink_pos, sink_present, window,
                                      scale)  # fmt: skip


_local_bwd = _op("local_bwd", f"Tensor dnum, Tensor dden, Tensor off, {_LOCAL}",
                 "(Tensor, Tensor, Tensor, Tensor, Tensor)")(_local_bwd_body)  # fmt: skip


@_local_bwd.register_fake
def _(dnum, dden, off, q, keys, values, sink_keys, sink_values, *_args):
    acc = compute_dtype(q.dtype)
    return tuple(torch.empty_like(x, dtype=acc) for x in (q, keys, values, sink_keys,
                                                          sink_values))  # fmt: skip


def _local_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8], output[2])
    ctx.window, ctx.scale = inputs[8], inputs[9]
    ctx.mark_non_differentiable(output[2])


@no_autocast
def _local_backward(ctx, d_num, d_den, _d_off):
    return (*_local_grads(_local_bwd, ctx.saved_tensors, d_num, d_den, ctx.window, ctx.scale),
            None, None, None, None, None)  # fmt: skip


_local = _differentiable("local", _LOCAL, "(Tensor, Tensor, Tensor)", _local_body, _local_fake,
                         _local_setup, _local_backward)  # fmt: skip


_EXACT = _SCALE + 5  # the position of nex among rfattn::chunk_hybrid's inputs (dex, eex after)


def _chunk_hybrid_body(q, k, v, *args):
    form, (scale, mask, s0, z0, off0, nex, dex, eex, precision, gpu_tiles) = _form(args)
    wex = torch.empty_like(dex)
    out, state, aux = rf_chunk_kernels.rf_chunk_fwd(
        q, k, v, form, scale, mask, _state(s0, z0, off0), precision, return_aux=True,
        gpu_tiles=gpu_tiles, exact=(nex, dex, eex, wex),
    )  # fmt: skip
    return out, *state, *aux, wex


def _chunk_hybrid_fake(q, k, v, *args):
    return (*_chunk_fake(q, k, v, *args), torch.empty_like(args[_EXACT - 2]))  # wex as dex


def _chunk_hybrid_setup(ctx, inputs, output):
    _chunk_setup(ctx, (*inputs[:_EXACT], *inputs[_EXACT + 3 :]), output[:8], extra=output[8:])


@no_autocast
def _chunk_hybrid_backward(ctx, d_out, d_s, d_z, *_rest):
    *saved, wex = ctx.saved_tensors
    grads = _chunk_grads(ctx, saved, d_out, d_s, d_z, exact=True)
    out = saved[_SCALE + 3]
    d_out = torch.zeros_like(out) if d_out is None else d_out
    return (*grads[:_EXACT], *_exact_cotangents(d_out, out, wex), None,
            *grads[_EXACT:])  # fmt: skip


_chunk_hybrid = _differentiable(
    "chunk_hybrid", f"{_QKV}, {_FORM}, {_CALL}, {_STATE}, Tensor nex, Tensor dex, Tensor eex, "
    f"{_OPTS}", "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    _chunk_hybrid_body, _chunk_hybrid_fake, _chunk_hybrid_setup, _chunk_hybrid_backward,
)  # fmt: skip


def rf_local(q, ext, window: int, scale: float):
    """``(num [B, H, T, E], den, off [B, H, T])``: the hybrid's exact terms of a causal call on
    their kernels (``rfattn.kernels.rf_local``, eager, Triton or its interpreter), as
    ``rfattn.hybrid.exact_terms`` computes them in torch: ``q`` against the call's keys after its
    state ``ext`` (``rfattn.hybrid.Extended``). Gradients reach q and the extended keys, values
    and sink slots (so the call's k, v and the state's)."""
    if on_torch(q):
        raise NotImplementedError("the hybrid's exact part runs on Triton (a GPU or the "
                                  "interpreter); use backend='torch'")  # fmt: skip
    dt = q.dtype
    kinds, pos = ext.kinds.contiguous(), ext.sink_pos.contiguous()
    present = ext.sink_present.to(torch.int8).contiguous()
    args = (q, ext.keys.to(dt), ext.values.to(dt), ext.sink_keys.to(dt), ext.sink_values.to(dt),
            kinds, pos, present, window, scale)  # fmt: skip
    if torch.compiler.is_compiling():
        return _local(*args)
    return apply(_Local, *args)


def rf_chunk_hybrid(q, k, v, form: KernelForm, scale: float, key_padding_mask, exact: tuple,
                    initial_state=None, precision=None, gpu_tiles=None,
                    return_state: bool = False):  # fmt: skip
    """The hybrid's causal output on the chunk kernels (eager, Triton or its interpreter):
    ``(out [B, H * G, T, E], state)`` of the features over ``k``, ``v`` (the estimated keys'
    stream, ``key_padding_mask`` leaving out every other position; ``initial_state`` and the
    final state ``(S, z, offset)`` as ``rfattn.kernels.rf_chunk.rf_chunk_fwd``'s, the state None
    unless ``return_state``) with each row's exact terms ``exact = (nex [B, H * G, T, E], dex,
    eex [B, H * G, T])`` in the same ratio (``rf_chunk_fwd``'s ``exact``). Gradients reach q, k,
    v, the initial S and z, nex and dex."""
    if on_torch(q):
        raise NotImplementedError("the hybrid's fused call runs on Triton (a GPU or the "
                                  "interpreter); use backend='torch'")  # fmt: skip
    s0, z0, off0 = (None, None, None) if initial_state is None else initial_state
    if torch.compiler.is_compiling():
        out, s, z, off, *_ = _chunk_hybrid(q, k, v, *flat_form(form), scale, key_padding_mask,
                                           s0, z0, off0, *(x.contiguous() for x in exact),
                                           precision, gpu_tiles)  # fmt: skip
        return out, ((s, z, off) if return_state else None)
    nex, dex, eex = (kernel_common.aligned(x.contiguous()) for x in exact)
    inputs = (q, k, v, nex, dex) if s0 is None else (q, k, v, nex, dex, s0, z0)
    if not (torch.is_grad_enabled() and any(x.requires_grad for x in inputs)):
        wex = torch.empty_like(dex)
        return rf_chunk_kernels.rf_chunk_fwd(
            q, k, v, form, scale, key_padding_mask, initial_state, precision,
            gpu_tiles=gpu_tiles, return_state=return_state, exact=(nex, dex, eex, wex),
        )  # fmt: skip
    res = apply(_Chunk, q, k, v, s0, z0, form, scale, key_padding_mask, off0, precision,
                gpu_tiles, return_state, nex, dex, eex)  # fmt: skip
    return (res[0], tuple(res[1:])) if return_state else (res, None)


def rf_hybrid_decode(q, k, v, form: KernelForm, scale: float, key_padding_mask, state: tuple,
                     window: int, sinks: int, inv_n: float, precision=None,
                     gpu_tiles=None, state_index=None):  # fmt: skip
    """The hybrid's decode step for one token in one launch (eager, Triton or its interpreter;
    no gradient): ``(out, the HybridState's fields one token on)`` of ``state`` (the fields of
    ``rfattn.hybrid.HybridState``, window ``window``, ``sinks`` sink slots; ``inv_n`` 1 / the
    feature map's sample count), as ``rfattn.kernels.rf_recurrent.rf_hybrid_step``.
    ``state_index`` (``[B]`` integers on q's device): ``state`` is a pool of P hybrid states and
    batch row b continues ``state_index[b]`` (as :func:`rf_decode`'s; the new states are
    ``[B, ...]``, not written into the pool)."""
    if on_torch(q):
        raise NotImplementedError("the hybrid's decode step runs on Triton (a GPU or the "
                                  "interpreter); use backend='torch'")  # fmt: skip
    if torch.compiler.is_compiling():
        out, *new = _hybrid_decode(q, k, v, *flat_form(form), scale, key_padding_mask, *state,
                                   state_index, window, sinks, inv_n, precision,
                                   gpu_tiles)  # fmt: skip
        return out, tuple(new)
    return rf_recurrent_kernels.rf_hybrid_step(q, k, v, form, scale, key_padding_mask, state,
                                               window, sinks, inv_n, precision, gpu_tiles,
                                               state_index)  # fmt: skip


def _hybrid_decode_body(q, k, v, *args):
    form, (scale, mask, *state, index, window, sinks, inv_n, precision, gpu_tiles) = _form(args)
    out, new = rf_recurrent_kernels.rf_hybrid_step(q, k, v, form, scale, mask, tuple(state),
                                                   window, sinks, inv_n, precision, gpu_tiles,
                                                   index)  # fmt: skip
    return out, *new


_hybrid_decode = _op(
    "hybrid_decode", f"{_QKV}, {_FORM}, {_CALL}, Tensor s0, Tensor z0, Tensor off0, Tensor keys, "
    "Tensor values, Tensor kinds, Tensor sink_keys, Tensor sink_values, Tensor sinks_seen, "
    f"{_INDEX}, int window, int sinks, float inv_n, {_OPTS}",
    "(" + ", ".join(["Tensor"] * 10) + ")",
)(_hybrid_decode_body)  # fmt: skip


@_hybrid_decode.register_fake
def _(q, k, v, *args):
    state = args[_NFORM + 2 : _NFORM + 11]
    acc, dt = compute_dtype(q.dtype), q.dtype
    dtypes = (acc, acc, acc, dt, dt, torch.int8, dt, dt, torch.int64)
    return (q.new_empty(*q.shape[:3], v.shape[3]),
            *(x.new_empty((q.shape[0], *x.shape[1:]), dtype=d)
              for x, d in zip(state, dtypes, strict=True)))  # fmt: skip


# ------------------------------------------------------------------------------------------------
# decode


def _decode_run(q, k, v, form, scale, mask, state, precision, gpu_tiles, inplace=False,
                index=None):  # fmt: skip
    """The decode step's body (both operators' and the eager call's): ``(out, S, z, offset)``,
    or ``out`` with ``inplace`` (the new state written into ``state``'s tensors; with ``index``
    into those rows of the pool ``state``)."""
    if on_torch(q):
        pool = state
        if index is not None:
            if state is None:
                raise ValueError("state_index needs an initial_state: the pool it indexes")
            index = rf_recurrent_kernels.pool_index(index, q.shape[0], state[0].shape[0],
                                                    q.device, distinct=inplace)  # fmt: skip
            state = tuple(x.index_select(0, index) for x in pool)
        out, *new = _torch_chunk(q, k, v, form, scale, mask, state)
        if not inplace:
            return out, *new
        for old_, new_ in zip(pool, new, strict=True):
            if index is None:
                old_.copy_(new_)
            else:
                old_.index_copy_(0, index, new_.to(old_.dtype))
        return out
    out, new = rf_recurrent_kernels.rf_recurrent_fwd(
        q, k, v, form, scale, mask, state, precision, inplace=inplace, gpu_tiles=gpu_tiles,
        state_index=index,
    )  # fmt: skip
    return out if inplace else (out, *new)


def _decode_body(q, k, v, *args):
    form, (scale, mask, s0, z0, off0, index, precision, gpu_tiles) = _form(args)
    return _decode_run(q, k, v, form, scale, mask, _state(s0, z0, off0), precision, gpu_tiles,
                       index=index)  # fmt: skip


_decode = _op("decode", f"{_QKV}, {_FORM}, {_CALL}, {_STATE}, {_INDEX}, {_OPTS}",
              "(Tensor, Tensor, Tensor, Tensor)")(_decode_body)  # fmt: skip


@_decode.register_fake
def _(q, k, v, *args):
    return q.new_empty(*q.shape[:3], v.shape[3]), *_state_like(q, v, args[1])


_DECODE_ = f"{_QKV}, {_FORM}, {_CALL}, Tensor(a!) s, Tensor(b!) z, Tensor(c!) off, {_INDEX}, " \
    f"{_OPTS}"  # fmt: skip


def _decode_inplace_body(q, k, v, *args):
    form, (scale, mask, s, z, off, index, precision, gpu_tiles) = _form(args)
    return _decode_run(q, k, v, form, scale, mask, (s, z, off), precision, gpu_tiles, True,
                       index)  # fmt: skip


_decode_ = _op("decode_", _DECODE_, "Tensor", mutates=("s", "z", "off"))(_decode_inplace_body)


@_decode_.register_fake
def _(q, k, v, *args):
    return q.new_empty(*q.shape[:3], v.shape[3])


def rf_decode(q, k, v, form: KernelForm, scale: float, key_padding_mask=None,
              initial_state=None, precision=None, inplace=False, gpu_tiles=None,
              state_index=None):  # fmt: skip
    """The causal decode step of the kernel form ``form`` (no gradient): ``(out, S, z, offset)``.

    ``inplace=True`` (``rfattn::decode_``) writes the new state over ``initial_state``'s tensors
    (contiguous, in the accumulation dtype) and returns them: for a caller that owns the state,
    such as a generation cache. Otherwise (``rfattn::decode``) the given state is only read.

    ``state_index`` (``[B]`` integers on q's device): ``initial_state`` is a pool of P states
    (``[P, H, F, E]``, ...), as a server keeps them for requests of different ages, and batch
    row b continues state ``state_index[b]``; with ``inplace`` the new states are written into
    those rows (distinct) and the pool is returned, else the new states are ``[B, ...]``
    (``rfattn.kernels.rf_recurrent.pool_index`` checks the indices on the device, without a
    host read).
    """
    if inplace and initial_state is None:
        raise ValueError("inplace=True needs an initial_state to update")
    if not torch.compiler.is_compiling():  # the body: no gradient, no dispatch needed
        out = _decode_run(q, k, v, form, scale, key_padding_mask, initial_state, precision,
                          gpu_tiles, inplace, state_index)  # fmt: skip
        return (out, *initial_state) if inplace else out
    args = (*flat_form(form), scale, key_padding_mask)
    if inplace:
        out = _decode_(q, k, v, *args, *initial_state, state_index, precision, gpu_tiles)
        return (out, *initial_state)
    s0, z0, off0 = (None, None, None) if initial_state is None else initial_state
    return _decode(q, k, v, *args, s0, z0, off0, state_index, precision, gpu_tiles)
