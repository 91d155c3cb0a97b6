"""``rf_attention``: validation and backend dispatch (fused Triton kernels | torch path).

The torch path is the CPU implementation and the reference for streaming (:mod:`rfattn.blocked`):
blocks of T, features of one block at a time, hand-written backwards; causal it carries the state
``(S, z, offset)`` with the running key max of DESIGN §3, so a sequence can be split and resumed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from rfattn import blocked, calibration
from rfattn.features import compute_dtype, prescale, python_scalar
from rfattn.stats import Moments
from rfattn.weights import WEIGHTED_WEIGHTS

__all__ = ["rf_attention", "RFState", "BACKENDS", "fused_kernel_available"]

BACKENDS = ("auto", "torch", "triton")


class RFState(NamedTuple):
    """Causal running state, in fp32 (fp64 for fp64 inputs).

    ``H`` is the number of key/value heads: with grouped-query attention (fewer key/value heads
    than query heads) one state serves every query head of its group.

    Attributes:
        s: ``[B, H, F, E]`` sum over past keys of ``phi_k v^T``, ``phi_k = g_k exp(u_k - offset)``
            (exponential features) or the plain features (rmf).
        z: ``[B, H, F]`` sum over past keys of ``phi_k``.
        offset: ``[B, H]`` the key stabiliser (running max of the key logits; -inf before any
            valid key; always 0 for plain features).
    """

    s: torch.Tensor
    z: torch.Tensor
    offset: torch.Tensor


def _check_tensor(name: str, x, rank: int, dims: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have shape [{dims}], got {tuple(x.shape)}")


def _validate(q, k, v, rf, causal, key_padding_mask, scale, backend, initial_state, return_state):
    for name, x, dims in (
        ("q", q, "B, H, Tq, D"),
        ("k", k, "B, H, Tk, D"),
        ("v", v, "B, H, Tk, E"),
    ):
        _check_tensor(name, x, 4, dims)
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, expected q's dtype {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on device {x.device}, expected q's device {q.device}")
        if x.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch size {x.shape[0]}, expected q's {q.shape[0]}")
    if v.shape[1] != k.shape[1]:
        raise ValueError(f"v has {v.shape[1]} heads, expected k's {k.shape[1]}")
    if k.shape[1] == 0 and q.shape[1] != 0 or k.shape[1] and q.shape[1] % k.shape[1]:
        raise ValueError(
            f"q has {q.shape[1]} heads, which must be a multiple of k's and v's {k.shape[1]} "
            "(grouped-query attention: each key/value head serves q heads // k heads query heads)"
        )
    if k.shape[3] != q.shape[3]:
        raise ValueError(f"k has head_dim {k.shape[3]}, expected q's head_dim {q.shape[3]}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"v has {v.shape[2]} tokens, expected k's Tk={k.shape[2]}")
    if not (hasattr(rf, "feature_map") and hasattr(rf, "weight") and hasattr(rf, "head_dim")):
        raise TypeError(f"rf must be an rfattn.RandomFeatures, got {type(rf).__name__}")
    if rf.head_dim != q.shape[3]:
        raise ValueError(
            f"rf was built for head_dim={rf.head_dim}, but q has head_dim {q.shape[3]}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal=True needs Tq == Tk, got Tq={q.shape[2]}, Tk={k.shape[2]}")
    if key_padding_mask is not None:
        _check_mask("key_padding_mask", key_padding_mask, (k.shape[0], k.shape[2]), q.device)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if (initial_state is not None or return_state) and not causal:
        raise ValueError("initial_state and return_state need causal=True")
    if initial_state is not None:
        _check_state(initial_state, q, v, rf)


def _check_mask(name: str, mask, shape: tuple, device) -> None:
    _check_tensor(name, mask, 2, "B, T")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be bool, got dtype {mask.dtype}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape [B, T] = {shape}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on device {mask.device}, expected {device}")


#: the draw (``RandomFeatures.draw_id``) that made each returned state, keyed by its S tensor:
#: a state continues only the features that made it. States built or moved by hand (a new S)
#: are not known here and are taken as given.
_STATE_DRAW = WeakIdKeyDictionary()


def _returned_state(out: torch.Tensor, state: RFState, rf, return_state: bool):
    """``(out, state)`` with the state's maker recorded, or ``out``."""
    if not return_state:
        return out
    if not torch.compiler.is_compiling():
        _STATE_DRAW[state.s] = getattr(rf, "draw_id", None)
    return out, state


def _check_state(state, q, v, rf) -> None:
    if not (isinstance(state, tuple) and len(state) == 3):
        raise TypeError("initial_state must be an RFState (s, z, offset)")
    B, H, E = q.shape[0], v.shape[1], v.shape[3]  # key/value heads (grouped-query attention)
    F = rf.feature_map.width(rf.num_features)
    expected = {"s": (B, H, F, E), "z": (B, H, F), "offset": (B, H)}
    for name, x in zip(("s", "z", "offset"), state, strict=True):
        _check_tensor(f"initial_state.{name}", x, len(expected[name]), str(expected[name]))
        if tuple(x.shape) != expected[name]:
            raise ValueError(
                f"initial_state.{name} must have shape {expected[name]}, got {tuple(x.shape)}"
            )
        if x.device != q.device:
            raise ValueError(f"initial_state.{name} is on {x.device}, expected {q.device}")
        if not x.dtype.is_floating_point:  # (other float dtypes are cast to fp32/fp64)
            raise TypeError(f"initial_state.{name} must be floating point, got dtype {x.dtype}")
    made_by = None if torch.compiler.is_compiling() else _STATE_DRAW.get(state[0])
    if made_by is not None and made_by != getattr(rf, "draw_id", None):
        raise ValueError(
            "initial_state was returned by a call with another RandomFeatures, or with this one "
            "before rf.redraw(): a state only continues the features that made it"
        )


def _causal_torch(
    phi_q: torch.Tensor,
    u_k: torch.Tensor | None,
    g_k: torch.Tensor | None,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    state: RFState | None,
) -> tuple[torch.Tensor, RFState]:
    """Causal linear attention from features (``rfattn.blocked.causal_scan``): ``(out [B, H, G,
    T, E], final state)`` for query features ``[B, H, G, T, F]``, key logits ``u_k`` (None for
    a plain feature) and amplitudes or plain features ``g_k`` ``[B, H, T, F]``; the operators'
    torch kernels and the sharded path's local states use it."""
    out, state = blocked.causal_scan(phi_q, u_k, g_k, v, key_padding_mask, state)
    return out, RFState(*state)


def _causal_keys(fm, xk, w, params) -> tuple:
    """``(u_k, g_k)`` of :func:`_causal_torch` for pre-scaled keys: an exponential feature's
    logits and amplitude, or (None, the plain features times any component weights)."""
    if fm.exponential:
        return fm.logits(xk, w, "key", params), fm.key_amplitude(xk, w, params)
    g_k = fm.values(xk, w, "key", params)
    c_k = fm.key_amplitude(xk, w, params)  # component weights, if any
    return None, g_k if c_k is None else g_k * c_k


def _group_size(q: torch.Tensor, k: torch.Tensor) -> int:
    """G, the query heads per key/value head (grouped-query attention; 1 otherwise)."""
    return q.shape[1] // k.shape[1] if k.shape[1] else 1


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Query rows ``[B, Hq, T, D]`` as ``[B, Hkv, G*T, D]``: the G query heads that share each
    key/value head (``Hq = Hkv * G``, query head ``h`` reads key/value head ``h // G``, as
    transformers' ``repeat_kv``) become more rows of it (a copy unless the layout allows a
    view)."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).flatten(2, 3)


def _grouped_mask(mask: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """A query mask ``[B, Tq]`` for the rows of :func:`_grouped`, ``[B, G*Tq]``."""
    return None if mask is None else mask.repeat(1, groups)


def _query_rows(xq: torch.Tensor, k: torch.Tensor, query_padding_mask: torch.Tensor | None):
    """``(xq, query_padding_mask)`` with grouped-query queries as rows of their key/value head
    (:func:`_grouped`, :func:`_grouped_mask`): the queries whose moments a key/value head's
    statistics take, on every path (torch, fused, sharded). Unchanged without GQA."""
    G = _group_size(xq, k)
    if G == 1:
        return xq, query_padding_mask
    return _grouped(xq, k.shape[1]), _grouped_mask(query_padding_mask, G)


def _torch_inputs(q, k, rf, key_padding_mask, scale: float, causal: bool, query_padding_mask,
                  update: bool = True, maps=None) -> tuple:  # fmt: skip
    """``(w, xq, xk, params)`` of the torch path: W and the pre-scaled inputs in the compute
    dtype (grouped-query queries as rows of their key/value head, :func:`_grouped`; with
    ``maps``, :meth:`RandomFeatures.map_tensors`, mapped per head first) and the call's feature
    parameters (statistics, the feature's own draws; ``update``: running statistics may be
    updated)."""
    qmap, kmap = (None, None) if maps is None else maps
    w = rf.weight.to(device=q.device, dtype=compute_dtype(q.dtype))
    xq, xk = prescale(q, scale, None, qmap), prescale(k, scale, key_padding_mask, kmap)
    xq, query_padding_mask = _query_rows(xq, k, query_padding_mask)
    # statistics (global ones raise when causal) and the feature's own draws, once per call
    params = rf.feature_params(xq, xk, key_padding_mask, causal=causal, update=update,
                               query_padding_mask=query_padding_mask)  # fmt: skip
    return w, xq, xk, params


def _call_params(q, k, rf, key_padding_mask, scale: float, causal: bool,
                 query_padding_mask, maps=None) -> tuple:  # fmt: skip
    """``(w, params)`` of a torch-path call, without pre-scaled copies of q and k where the
    feature's parameters do not need this sequence's moments (empty stand-ins give dtype,
    device and D; grouped-query queries are not regrouped: only their moments would be).
    ``maps`` (``(query_map, key_map)`` or None) join the parameters as ``"query_map"`` and
    ``"key_map"``: the blocks apply them (:func:`rfattn.features.prescale`), so the mapped q and
    k are never materialised (except for the moments of data-dependent statistics)."""
    fm = rf.feature_map
    needs = getattr(fm, "uses_batch_moments", None) and fm.uses_batch_moments(causal)
    if needs or getattr(fm, "stats_grad", False):
        w, _, _, params = _torch_inputs(q, k, rf, key_padding_mask, scale, causal,
                                        query_padding_mask, maps=maps)  # fmt: skip
    else:
        w = rf.weight.to(device=q.device, dtype=compute_dtype(q.dtype))
        x = q.new_empty((1, 1, 0, q.shape[-1]), dtype=w.dtype)
        params = rf.feature_params(x, x, None, causal=causal, query_padding_mask=None)
    if maps is not None:
        params = {**params, "query_map": maps[0], "key_map": maps[1]}
    return w, params


def _mapped(x: torch.Tensor, head_map: torch.Tensor | None, padding_mask=None) -> torch.Tensor:
    """``x A_h^T`` per head in x's dtype (a head map applied outside the blocks and kernels);
    rows where ``padding_mask`` is True become 0 first, so junk there never reaches the map's
    gradient."""
    if head_map is None:
        return x
    return prescale(x, 1.0, padding_mask, head_map).to(x.dtype)


def _no_kernel_reason(rf, causal: bool) -> str | None:
    """Why no fused kernel can run this call, or None when one can."""
    fm = rf.feature_map
    if causal and rf.weight.requires_grad:
        return "learnable weights (dW) in causal attention need the torch path"
    if not fm.has_kernel_form:
        return f"feature={rf.feature!r} has no fused Triton kernel yet"
    if getattr(fm, "stats_grad", False):
        return "stats_grad=True (gradients through the statistics) needs the torch path"
    if rf.weights in WEIGHTED_WEIGHTS and rf.feature in ("oprf", "saderf"):
        return f"the fused kernels do not apply {rf.weights}'s row weights (component_weight) yet"
    return None


def fused_kernel_available(rf, causal: bool = False) -> bool:
    """Whether ``rf_attention(..., backend="triton")`` has a fused kernel for ``rf`` (on CUDA,
    ``backend="auto"`` then uses it for fp32/fp16/bf16 inputs)."""
    return _no_kernel_reason(rf, causal) is None


def _kernel_form(rf, q, k, key_padding_mask, scale: float, causal: bool,
                 query_padding_mask=None, moments=None, maps=None):  # fmt: skip
    """The feature's kernel form for this call: its per-call parameters, with the statistics of
    oprf/saderf from the fused stats pass (``rfattn.kernels.stats``; in torch where the operators
    run their torch kernels) where the call needs them (held constant: ``stats_grad=False``),
    or from ``moments`` when the caller has them (a sharded call's, over every shard).
    ``maps``: head maps ``(query_map, key_map)`` (either may be None) the kernels apply (the
    form's ``qmap``, ``kmap``); statistics are then those of the mapped q and k."""
    from rfattn import autograd as ops

    fm = rf.feature_map
    # empty stand-ins give the parameters dtype, device and D, never a copy of q, k
    xq = xk = q.new_empty((1, 1, 0, q.shape[-1]), dtype=compute_dtype(q.dtype))
    needs = getattr(fm, "uses_batch_moments", None) and fm.uses_batch_moments(causal)
    if moments is None and needs:
        if maps is not None:  # the moments are the only reader of the mapped q, k
            q, k = _mapped(q, maps[0]), _mapped(k, maps[1], key_padding_mask)
        # a key/value head's statistics take its group's queries (a view of contiguous q)
        q, query_padding_mask = _query_rows(q, k, query_padding_mask)
        if ops._on_torch(q):
            xq, xk = prescale(q, scale), prescale(k, scale)
        else:
            from rfattn.kernels.stats import sequence_moments_fused

            moments = Moments(*sequence_moments_fused(q, k, scale, key_padding_mask,
                                                      query_padding_mask))  # fmt: skip
    with torch.no_grad():
        params = rf.feature_params(xq, xk, key_padding_mask, causal=causal, moments=moments,
                                   query_padding_mask=query_padding_mask)  # fmt: skip
    form = fm.kernel_form(rf.weight.to(q.device), params)
    if maps is None:
        return form
    qmap, kmap = (None if m is None else m.detach() for m in maps)
    return dataclasses.replace(form, qmap=qmap, kmap=kmap)


def _triton_attention(q, k, v, rf, causal, key_padding_mask, scale, initial_state, return_state,
                      gpu_tiles=None, query_padding_mask=None, maps=None):  # fmt: skip
    """The fused path of :func:`rf_attention` (arguments validated). Causal calls of at most
    ``rf_recurrent.MAX_TOKENS`` tokens without gradient run the decode step, others the chunked
    form; states keep the torch path's conventions (the kernel forms' offsets are the torch
    path's). ``gpu_tiles``: as the launchers' (``bench.compile`` records a GPU's launches).
    ``maps``: head maps, applied by the forward kernels as they load q and k; a call that needs
    gradients (of anything, the maps included) maps q and k first (the backward kernels take no
    maps)."""
    from rfattn import autograd as ops

    reason = _no_kernel_reason(rf, causal)
    if reason is not None:
        raise NotImplementedError(f"{reason}; use backend='torch'")
    if _learns_gerf_a(rf):
        raise NotImplementedError(
            "the fused kernels hold GERF's A constant: a call that needs the gradient of a "
            "learnable gerf_A runs backend='torch' (or run this one under torch.no_grad())"
        )
    given = (q, k, v, rf.weight) + tuple(initial_state or ())
    grad = blocked.backward_follows(*given, *(maps or ()))
    if maps is not None and grad:
        q, k, maps = _mapped(q, maps[0]), _mapped(k, maps[1], key_padding_mask), None
    form = _kernel_form(rf, q, k, key_padding_mask, scale, causal, query_padding_mask,
                        maps=maps)  # fmt: skip
    kw = dict(key_padding_mask=key_padding_mask, gpu_tiles=gpu_tiles)
    if not causal:
        return ops.rf_parallel(q, k, v, form, scale, **kw)
    from rfattn.kernels.rf_recurrent import MAX_TOKENS

    if not grad and q.shape[2] <= MAX_TOKENS:  # decoding: one launch, O(M (D + E)) per token
        out, s, z, off = ops.rf_decode(q, k, v, form, scale, initial_state=initial_state, **kw)
    else:
        out, s, z, off = ops.rf_chunk(q, k, v, form, scale, initial_state=initial_state, **kw)
    return _returned_state(out, RFState(s, z, off), rf, return_state)


def _learns_gerf_a(rf) -> bool:
    """Whether autograd would differentiate a learnable GERF A (``RandomFeatures.gerf_A``): the
    fused kernels hold their coefficients constant, so such a call runs the torch path."""
    a = getattr(rf, "gerf_A", None)
    return a is not None and a.requires_grad and torch.is_grad_enabled()


def _use_triton(q, rf, causal) -> bool:
    if not q.is_cuda or _no_kernel_reason(rf, causal) is not None or _learns_gerf_a(rf):
        return False
    return q.dtype in (torch.float32, torch.float16, torch.bfloat16)


def rf_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rf,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    initial_state: RFState | None = None,
    return_state: bool = False,
    query_padding_mask: torch.Tensor | None = None,
    group=None,
):
    """Random-feature linear attention, a drop-in for softmax attention in SDPA's layout.

    Approximates ``softmax(scale * Q K^T) V`` by ``phi(Q) (phi(K)^T V) / phi(Q) (phi(K)^T 1)``
    with the feature map and weights of ``rf``. Under ``torch.autocast`` for q's device type,
    q, k and v are first cast to the autocast dtype (as autocast casts SDPA's inputs; fp64 stays),
    and the call computes in rfattn's own dtypes, its backward too.

    Args:
        q: ``[B, H, Tq, D]`` queries (any strides, e.g. a transposed ``[B, T, H, D]`` view).
        k: ``[B, Hkv, Tk, D]`` keys; v: ``[B, Hkv, Tk, E]`` values. One floating dtype and
            device. ``Hkv = H`` or, for grouped-query attention, a divisor of H: query head h
            reads key/value head ``h // (H // Hkv)`` (transformers' ``repeat_kv`` order) without
            repeating k and v: key features and states are computed once per key/value head, and
            states are ``[B, Hkv, ...]``. The data statistics of oprf/saderf/poisrf/geomrf
            (``stats="global"``) are then per key/value head, over the queries of its group.
        rf: an :class:`rfattn.RandomFeatures` built for ``head_dim=D``; with head maps
            (:meth:`~rfattn.RandomFeatures.add_head_maps`, what :func:`rfattn.calibrate` trains)
            the features are taken of the mapped q and k.
        causal: query i attends to keys j <= i (needs Tq == Tk).
        key_padding_mask: ``[B, Tk]`` bool, True = padding: removed from numerator and
            denominator. A query with no valid key gets output 0.
        scale: softmax temperature, default ``D ** -0.5``: a number, or a one-element tensor;
            one that requires grad (a learnable temperature) gets its gradient, on every
            backend (q and k are multiplied by its square root, in q's dtype, and the call runs
            with scale 1).
        backend: "auto" (Triton on CUDA where a fused kernel exists, else torch), "torch",
            or "triton" (the fused operators; CPU tensors run the Triton kernels under
            ``TRITON_INTERPRET=1``, else the operators' torch kernels; float64 runs too).
        initial_state: causal only: the :class:`RFState` returned by a previous call, to continue
            that sequence (split/resume equals one shot).
        return_state: causal only: also return the final :class:`RFState`.
        query_padding_mask: ``[B, Tq]`` bool, True = padded queries: left out of the data
            statistics (oprf, saderf, poisrf, geomrf), read as 0 and given output 0, so junk
            there (NaN, inf) reaches no output, statistic or gradient (their cotangents are
            dropped). Default: ``key_padding_mask`` when causal (self-attention), else none
            (every query counts; pass it for non-causal self-attention with padding, as the
            layers and the Hugging Face integration do).
        group: a ``torch.distributed`` process group over which the sequence is split (context
            parallelism, :mod:`rfattn.distributed`): q, k, v and the masks hold this rank's
            contiguous shard (shards in rank order, any lengths) and the output is this rank's
            shard of the attention over the whole sequence; one all-gather of states (causal)
            or all-reduce (non-causal) per call, gradients equal to one process's. Causal:
            ``initial_state`` is the state before the whole sequence (the same on every rank),
            the returned state the one after it (on every rank). Every rank's call must
            agree on causal, dtype, feature, num_features, D, E, B, H and key/value heads,
            initial_state given or not, statistics and path: one all-gather of the calls'
            signatures checks it first, and every rank raises naming what differs
            (:func:`rfattn.distributed.check_calls_agree`). None: one process.

    Returns:
        ``out`` ``[B, H, Tq, E]`` in the input dtype, or ``(out, state)`` with ``return_state``.
    """
    if isinstance(q, torch.Tensor) and torch.is_autocast_enabled(q.device.type):
        # autocast's lower precision for the inputs (as SDPA gets them), then rfattn's own
        # compute dtypes inside: autocast would cast its products, not its fp32 buffers
        with torch.autocast(q.device.type, enabled=False):
            q, k, v = _autocast_inputs(q, k, v, torch.get_autocast_dtype(q.device.type))
            return rf_attention(q, k, v, rf, causal, key_padding_mask, scale, backend,
                                initial_state, return_state, query_padding_mask, group)  # fmt: skip
    learned = _learned_scale(scale)
    if learned is not None:  # applied to q and k (below); checked without a host sync
        torch._assert_async((learned.detach() > 0) & learned.detach().isfinite(),
                            "scale must be a finite number > 0")  # fmt: skip
        scale = 1.0
    causal, scale = python_scalar(causal), python_scalar(scale)  # numpy scalars, 0-d tensors

    def validate():
        _validate(q, k, v, rf, causal, key_padding_mask, scale, backend, initial_state,
                  return_state)  # fmt: skip
        if query_padding_mask is not None:
            _check_mask("query_padding_mask", query_padding_mask, (q.shape[0], q.shape[2]),
                        q.device)  # fmt: skip

    if group is None:
        validate()
    else:  # every rank's call checked against the others' before any other collective
        from rfattn import distributed

        distributed.check_group(group)
        distributed.check_calls_agree(group, validate, q, k, v, rf, causal, backend,
                                      initial_state)  # fmt: skip
    if query_padding_mask is None and causal:
        query_padding_mask = key_padding_mask
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if 0 in (q.shape[0], q.shape[1], k.shape[1]):
        return _empty_batch(q, k, v, rf, causal, initial_state, return_state)
    args = (causal, key_padding_mask, scale, backend, initial_state, return_state,
            query_padding_mask, group)  # fmt: skip

    def run(q, k, v):  # learnable per-head maps (calibration), applied where q, k are read
        q = _padded_rows(q, query_padding_mask)
        if learned is not None:  # scale (q kᵀ) = (√scale q)(√scale k)ᵀ, on every path
            root = learned.reshape(()).to(device=q.device, dtype=compute_dtype(q.dtype)).sqrt()
            q = (q * root).to(q.dtype)
            k = (_padded_rows(k, key_padding_mask) * root).to(k.dtype)
        res = _attend(q, k, v, rf, *args, maps=rf.map_tensors(q, k))
        if query_padding_mask is None:
            return res
        return (_padded_rows(res[0], query_padding_mask), res[1]) if return_state else \
            _padded_rows(res, query_padding_mask)

    if calibration.recording():  # inside rfattn.calibrate: this call is a layer to calibrate
        return calibration.record(q, k, v, rf, args, run)
    return run(q, k, v)


def _learned_scale(scale) -> torch.Tensor | None:
    """``scale`` when it is a one-element tensor autograd is to differentiate (a learnable
    temperature), else None. rf_attention then runs with scale 1 on ``√scale q`` and
    ``√scale k``, so every backend gives it its gradient (the fused kernels take scale as a
    number)."""
    if not (torch.is_tensor(scale) and scale.requires_grad and torch.is_grad_enabled()):
        return None
    if scale.numel() != 1 or not scale.dtype.is_floating_point:
        raise ValueError(
            f"scale must be a number or a one-element float tensor, got a tensor of shape "
            f"{tuple(scale.shape)} and dtype {scale.dtype}"
        )
    return scale


def _padded_rows(x: torch.Tensor, query_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[B, H, Tq, .]`` with the padded query rows replaced by 0 (selected, not multiplied:
    junk there never reaches a result). Applied to q and to the output, a padded query enters no
    product of the forward or the backward: its output is 0 and its cotangent, whatever it is,
    is dropped."""
    if query_padding_mask is None:
        return x
    return x.masked_fill(query_padding_mask[:, None, :, None], 0.0)


def _autocast_inputs(q, k, v, dtype: torch.dtype) -> tuple:
    """q, k, v as autocast casts a lower-precision op's inputs: fp32, fp16 and bf16 tensors in
    ``dtype`` (the autocast dtype of their device type), anything else (fp64, a non-tensor: left
    to the validation) unchanged."""
    low = (torch.float32, torch.float16, torch.bfloat16)
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype in low else x
                 for x in (q, k, v))  # fmt: skip


def _empty_batch(q, k, v, rf, causal: bool, initial_state, return_state: bool):
    """:func:`rf_attention` of a call with no batch rows or no heads: the empty output (its
    gradients, all empty, reach every input) and, causal with ``return_state``, the state
    given (or the empty one before any key). Nothing is computed: no statistic moves."""
    tie = sum(x.sum() for x in (q, k, v, *(initial_state or ())) if x.is_floating_point())
    out = q.new_zeros(*q.shape[:3], v.shape[-1]) + (tie * 0).to(q.dtype)
    if not (causal and return_state):
        return out
    if initial_state is None:  # the torch path's state before any key
        B, H, E, F = q.shape[0], k.shape[1], v.shape[-1], rf.feature_map.width(rf.num_features)
        exp, like = rf.feature_map.exponential, q.new_empty(0, dtype=compute_dtype(q.dtype))
        initial_state = blocked._final(*blocked._initial(None, B, H, F, E, exp, like), E, exp)
    return _returned_state(out, RFState(*initial_state), rf, True)


def _attend(q, k, v, rf, causal, key_padding_mask, scale, backend, initial_state, return_state,
            query_padding_mask, group, maps=None):  # fmt: skip
    """:func:`rf_attention` after validation (``scale`` a float). ``maps``: ``(query_map,
    key_map)`` (:meth:`RandomFeatures.map_tensors`; either may be None) or None. The torch path
    applies them inside its blocks and the fused kernels in their prologue (inference); the
    grouped-query queries of a non-causal call, the sharded path and fused calls that need
    gradients map q, k here first."""
    Hk, Tq = k.shape[1], q.shape[2]
    qmap, kmap = (None, None) if maps is None else maps
    G = _group_size(q, k)
    if G > 1 and not causal:  # grouped-query: each key/value head's queries are more rows of it
        qm = _grouped_mask(query_padding_mask, G)
        q = _mapped(q, qmap)  # per query head, before its rows join the key/value head's
        out = _attend(_grouped(q, Hk), k, v, rf, False, key_padding_mask, scale, backend, None,
                      False, qm, group, maps=None if kmap is None else (None, kmap))  # fmt: skip
        return out.unflatten(2, (G, Tq)).flatten(1, 2)
    if group is not None:
        from rfattn import distributed

        q, k = _mapped(q, qmap), _mapped(k, kmap, key_padding_mask)
        distributed.check_group(group)
        res = distributed.sharded_attention(q, k, v, rf, causal, key_padding_mask, scale,
                                            backend, initial_state, return_state,
                                            query_padding_mask, group)  # fmt: skip
        return _returned_state(*res, rf, True) if return_state else res
    use_triton = backend == "triton" or (backend == "auto" and _use_triton(q, rf, causal))
    if use_triton:
        return _triton_attention(q, k, v, rf, causal, key_padding_mask, scale, initial_state,
                                 return_state, query_padding_mask=query_padding_mask,
                                 maps=maps)  # fmt: skip

    fm = rf.feature_map
    if causal:
        w, params = _call_params(q, k, rf, key_padding_mask, scale, True, query_padding_mask,
                                 maps)  # fmt: skip
        out, state = blocked.causal_attention(fm, q, k, v, w, params, scale, key_padding_mask,
                                              initial_state)  # fmt: skip
        return _returned_state(out.flatten(1, 2).to(q.dtype), RFState(*state), rf, return_state)
    w, params = _call_params(q, k, rf, key_padding_mask, scale, False, query_padding_mask, maps)
    out = blocked.noncausal_attention(fm, q, k, v, w, params, scale, key_padding_mask)
    return out.to(q.dtype)
