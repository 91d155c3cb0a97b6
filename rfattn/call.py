"""The record of one ``rf_attention`` call, its validation, and what every backend reads of it.

An internal module (documented, not exported from ``rfattn``): :func:`rfattn.rf_attention`
validates its arguments once (:func:`validate`) and builds a frozen :class:`Call`; every backend
(the torch path :mod:`rfattn.torch_path`, the fused kernels :mod:`rfattn.fused`, the sharded path
:mod:`rfattn.distributed`) and every tool (calibration, through :func:`intercept_calls`) takes the
record and reads its fields by name. The helpers here (grouped-query rows, head maps, padded
rows, which backend can run a call) are the one definition each path uses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple

import torch

from rfattn.features import prescale
from rfattn.hybrid import HybridState
from rfattn.weights import WEIGHTED_WEIGHTS

__all__ = [
    "BACKENDS",
    "INTERCEPTS",
    "Call",
    "RFState",
    "fused_kernel_available",
    "intercept_calls",
    "packed_offsets",
    "state_rows",
    "validate",
]

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


def state_rows(state, rows):
    """Rows ``rows`` (a slice, or an int64 index tensor) of every field of a causal state (an
    :class:`RFState`, a tuple of its three tensors, or a :class:`rfattn.hybrid.HybridState`,
    whose fields all lead with the batch), as the same kind of state."""
    kind = HybridState if isinstance(state, HybridState) else RFState
    if isinstance(rows, slice):
        return kind(*(x[rows] for x in state))
    return kind(*(x.index_select(0, rows) for x in state))


def _check_tensor(name: str, x, rank: int, dims: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have shape [{dims}], got {tuple(x.shape)}")


def validate(q, k, v, rf, causal, key_padding_mask, scale, backend, initial_state, return_state,
             query_padding_mask=None, window=0, sinks=0, group=None,
             packed=None, max_seqlen=None) -> None:  # fmt: skip
    """Raise naming the argument unless ``rf_attention``'s arguments are valid (``causal`` and
    ``scale`` already plain Python values; ``packed``: the offsets :func:`packed_offsets` read,
    or None; ``max_seqlen``: the call's)."""
    for name, x in (("window", window), ("sinks", sinks)):  # (hybrid.check_local's check,
        if type(x) is not int or x < 0:  # inline: a call enters few functions, issue 35)
            raise ValueError(f"{name} must be an int >= 0, got {x!r}")
    for name, x, dims in (
        ("q", q, "B, H, Tq, D"),
        ("k", k, "B, H, Tk, D"),
        ("v", v, "B, H, Tk, E"),
    ):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:  # the hot path skips the call
            _check_tensor(name, x, 4, dims)
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
    qs, ks, vs = q.shape, k.shape, v.shape  # (each .shape is a new object: read once)
    for name, x, xs in (("k", k, ks), ("v", v, vs)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}, expected q's dtype {q.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} is on device {x.device}, expected q's device {q.device}")
        if xs[0] != qs[0]:
            raise ValueError(f"{name} has batch size {xs[0]}, expected q's {qs[0]}")
    if vs[1] != ks[1]:
        raise ValueError(f"v has {vs[1]} heads, expected k's {ks[1]}")
    if ks[1] == 0 and qs[1] != 0 or ks[1] and qs[1] % ks[1]:
        raise ValueError(
            f"q has {qs[1]} heads, which must be a multiple of k's and v's {ks[1]} "
            "(grouped-query attention: each key/value head serves q heads // k heads query heads)"
        )
    if ks[3] != qs[3]:
        raise ValueError(f"k has head_dim {ks[3]}, expected q's head_dim {qs[3]}")
    if vs[2] != ks[2]:
        raise ValueError(f"v has {vs[2]} tokens, expected k's Tk={ks[2]}")
    # W by its class's property where it has one: reading it may rebuild it (fastfoodl)
    if not (hasattr(rf, "feature_map") and hasattr(rf, "head_dim") and
            (hasattr(type(rf), "weight") or hasattr(rf, "weight"))):  # fmt: skip
        raise TypeError(f"rf must be an rfattn.RandomFeatures, got {type(rf).__name__}")
    if rf.head_dim != qs[3]:
        raise ValueError(f"rf was built for head_dim={rf.head_dim}, but q has head_dim {qs[3]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if causal and qs[2] != ks[2]:
        raise ValueError(f"causal=True needs Tq == Tk, got Tq={qs[2]}, Tk={ks[2]}")
    if key_padding_mask is not None:
        check_mask("key_padding_mask", key_padding_mask, (ks[0], ks[2]), q.device)
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymInt,
                                                             torch.SymFloat)):  # fmt: skip
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        # comparisons, not math.isfinite: under torch.compile with dynamic shapes a scale
        # computed from sizes (a length-dependent temperature) is a SymFloat, which they check
        # by a guard on the expression, not on its value (no recompile per length); NaN fails
        if not 0 < scale < math.inf:
            raise ValueError(f"scale must be a finite number > 0, got {scale}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if (initial_state is not None or return_state) and not causal:
        raise ValueError("initial_state and return_state need causal=True")
    if packed is not None:
        n = len(packed[0]) - 1
        if max_seqlen is not None and (window or sinks) and (initial_state is not None or
                                                              return_state):  # fmt: skip
            raise NotImplementedError("max_seqlen with window or sinks and a state: each "
                                      "sequence's window would end in its row's padding; "
                                      "leave max_seqlen out")  # fmt: skip
        if (window or sinks) and initial_state is not None and (
                not isinstance(initial_state, HybridState) or initial_state.s.shape[0] != n):
            raise ValueError(f"initial_state of packed sequences with window or sinks must be a "
                             f"HybridState of {n} rows, one per sequence")  # fmt: skip
        if (window or sinks) and packed[0] is not packed[1] and (
                isinstance(packed[0], torch.Tensor) or packed[0] != packed[1]):  # fmt: skip
            raise ValueError("window and sinks need each packed sequence's queries and keys to "
                             "be the same tokens: cu_seqlens (or cu_seqlens_q == "
                             "cu_seqlens_k)")  # fmt: skip
    if window or sinks:  # the hybrid (rfattn.hybrid): its own state, checked there
        if not causal and qs[2] != ks[2]:
            raise ValueError(f"window and sinks need Tq == Tk, got Tq={qs[2]}, Tk={ks[2]}")
        if group is not None and not causal:
            raise NotImplementedError("window and sinks over a process group: causal calls "
                                      "only")  # fmt: skip
    elif initial_state is not None:  # packed: one state per sequence
        _check_state(initial_state, q, v, rf, qs[0] if packed is None else len(packed[0]) - 1)
    if query_padding_mask is not None:
        check_mask("query_padding_mask", query_padding_mask, (qs[0], qs[2]), q.device)


def _offsets(name: str, cu, total: int | None, device, max_seqlen=None):
    """The N + 1 offsets of ``cu`` read on the host (one device-to-host copy where ``cu`` lies
    on a GPU, none on the CPU), or raise naming ``name`` (``total`` None: the last offset is
    checked later, against the shards' lengths over a process group). With ``max_seqlen``
    they stay on the device: ``cu`` as int64 on ``device``, its values checked there
    (``torch._assert_async``: an error raised where the device runs it, no host read)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of N + 1 offsets, got {type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must have dtype int32 or int64, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name} must have shape [N + 1] with N >= 1 sequences, got "
                         f"{tuple(cu.shape)}")  # fmt: skip
    if cu.device != device and cu.device.type != "cpu":
        raise ValueError(f"{name} is on device {cu.device}, expected {device} or the CPU")
    if max_seqlen is not None:
        cu = cu.to(device=device, dtype=torch.int64)
        lens = cu[1:] - cu[:-1]
        torch._assert_async(cu[0] == 0, f"{name} must start at 0")
        torch._assert_async((lens >= 0).all(), f"{name} must not decrease")
        torch._assert_async(cu[-1] == total, f"{name} must end at the packed length {total}")
        torch._assert_async((lens <= max_seqlen).all(),
                            f"{name} has a sequence longer than max_seqlen={max_seqlen}")
        return cu
    offsets = tuple(cu.tolist())
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"{name} must not decrease, got {offsets[i - 1]} then {offsets[i]} "
                             f"at index {i}")  # fmt: skip
    if total is not None and offsets[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total}, got {offsets[-1]}")
    return offsets


def packed_offsets(q, k, causal: bool, cu_seqlens=None, cu_seqlens_q=None,
                   cu_seqlens_k=None, group=None, max_seqlen=None) -> tuple | None:  # fmt: skip
    """``(query offsets, key offsets)``, each N + 1 ints read on the host, of a packed call, or
    None for an unpacked one; raise naming the argument where the packing is not valid (q, k
    checked first). ``cu_seqlens`` gives both sides (self-attention, causal or not);
    ``cu_seqlens_q`` and ``cu_seqlens_k`` differ (non-causal cross-attention). With a process
    ``group`` the offsets are the whole row's (every rank's the same) and q, k this rank's shard
    of it: their last offset is checked against the shards' lengths once those are gathered
    (:func:`rfattn.distributed.packed_sharded`). With ``max_seqlen`` the offsets stay on the
    device, int64 tensors checked there (:func:`_offsets`)."""
    if cu_seqlens is None and cu_seqlens_q is None and cu_seqlens_k is None:
        if max_seqlen is not None:
            raise ValueError("max_seqlen goes with packed sequences (cu_seqlens)")
        return None
    if max_seqlen is not None:
        if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int):
            raise TypeError(f"max_seqlen must be an int (the longest sequence's length), got "
                            f"{type(max_seqlen).__name__} {max_seqlen!r}")  # fmt: skip
        if max_seqlen < 0:
            raise ValueError(f"max_seqlen must be >= 0, got {max_seqlen}")
        if group is not None:
            raise NotImplementedError("max_seqlen over a process group: the sharded path reads "
                                      "the offsets on the host; leave max_seqlen out")  # fmt: skip
    _check_tensor("q", q, 4, "B, H, Tq, D")
    _check_tensor("k", k, 4, "B, H, Tk, D")
    if cu_seqlens is not None and (cu_seqlens_q is not None or cu_seqlens_k is not None):
        raise ValueError("cu_seqlens gives the offsets of both q and k: pass it alone, or "
                         "cu_seqlens_q and cu_seqlens_k")  # fmt: skip
    if cu_seqlens is None and (cu_seqlens_q is None or cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k go together (or cu_seqlens alone)")
    if causal and cu_seqlens is None:
        raise ValueError("causal=True packs q and k alike: pass cu_seqlens, not cu_seqlens_q "
                         "and cu_seqlens_k")  # fmt: skip
    if q.shape[0] != 1:
        raise ValueError("packed sequences (cu_seqlens) need q, k and v of batch size 1, the "
                         f"sequences concatenated along T, got batch size "
                         f"{q.shape[0]}")  # fmt: skip
    if cu_seqlens is not None:
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"cu_seqlens packs q and k alike and needs Tq == Tk, got Tq="
                             f"{q.shape[2]}, Tk={k.shape[2]} (cross-attention: cu_seqlens_q "
                             "and cu_seqlens_k)")  # fmt: skip
        offsets = _offsets("cu_seqlens", cu_seqlens, None if group is not None else q.shape[2],
                           q.device, max_seqlen)  # fmt: skip
        return offsets, offsets
    sharded = group is not None
    oq = _offsets("cu_seqlens_q", cu_seqlens_q, None if sharded else q.shape[2], q.device,
                  max_seqlen)  # fmt: skip
    ok = _offsets("cu_seqlens_k", cu_seqlens_k, None if sharded else k.shape[2], q.device,
                  max_seqlen)  # fmt: skip
    if len(oq) != len(ok):
        raise ValueError(f"cu_seqlens_q has {len(oq) - 1} sequences, cu_seqlens_k "
                         f"{len(ok) - 1}")  # fmt: skip
    return oq, ok


def check_mask(name: str, mask, shape: tuple, device) -> None:
    _check_tensor(name, mask, 2, "B, T")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be bool, got dtype {mask.dtype}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape [B, T] = {shape}, got {tuple(mask.shape)}")
    if mask.device != device:
        raise ValueError(f"{name} is on device {mask.device}, expected {device}")


#: the attribute of a returned state's S tensor that holds the draw (``RandomFeatures.draw_id``)
#: that made it: a state continues only the features that made it. States built or moved by
#: hand (a new S) carry none and are taken as given. (An attribute of the tensor object, read
#: and written in well under a microsecond: a weak dictionary keyed by the tensor cost a decode
#: step ~5 µs.)
_DRAW = "_rfattn_draw_id"


def returned_state(out: torch.Tensor, state: RFState, rf, return_state: bool):
    """``(out, state)`` with the state's maker recorded, or ``out``."""
    if not return_state:
        return out
    if not torch.compiler.is_compiling():
        setattr(state.s, _DRAW, getattr(rf, "draw_id", None))
    return out, state


def _check_state(state, q, v, rf, B: int) -> None:
    if not (isinstance(state, tuple) and len(state) == 3):
        raise TypeError("initial_state must be an RFState (s, z, offset)")
    H, E = v.shape[1], v.shape[3]  # key/value heads (grouped-query attention)
    F = rf.feature_map.width(rf.num_features)
    s, z, off = state
    dev = q.device
    if not (isinstance(s, torch.Tensor) and isinstance(z, torch.Tensor) and
            isinstance(off, torch.Tensor) and s.shape == (B, H, F, E) and z.shape == (B, H, F)
            and off.shape == (B, H) and s.device == dev and z.device == dev and off.device == dev
            and s.dtype.is_floating_point and z.dtype.is_floating_point and
            off.dtype.is_floating_point):  # fmt: skip
        _state_error(state, dev, B, H, F, E)  # (a decode step's every call: one test first)
    made_by = None if torch.compiler.is_compiling() else getattr(s, _DRAW, None)
    if made_by is not None and made_by != getattr(rf, "draw_id", None):
        raise ValueError(
            "initial_state was returned by a call with another RandomFeatures, or with this one "
            "before rf.redraw(): a state only continues the features that made it"
        )


def _state_error(state, device, B: int, H: int, F: int, E: int) -> None:
    """Raise naming what is wrong with ``initial_state`` (the shapes and device expected)."""
    expected = {"s": (B, H, F, E), "z": (B, H, F), "offset": (B, H)}
    for name, x in zip(("s", "z", "offset"), state, strict=True):
        _check_tensor(f"initial_state.{name}", x, len(expected[name]), str(expected[name]))
        if tuple(x.shape) != expected[name]:
            raise ValueError(
                f"initial_state.{name} must have shape {expected[name]}, got {tuple(x.shape)}"
            )
        if x.device != device:
            raise ValueError(f"initial_state.{name} is on {x.device}, expected {device}")
        if not x.dtype.is_floating_point:  # (other float dtypes are cast to fp32/fp64)
            raise TypeError(f"initial_state.{name} must be floating point, got dtype {x.dtype}")


def group_size(q: torch.Tensor, k: torch.Tensor) -> int:
    """G, the query heads per key/value head (grouped-query attention; 1 otherwise)."""
    return q.shape[1] // k.shape[1] if k.shape[1] else 1


def grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Query rows ``[B, Hq, T, D]`` as ``[B, Hkv, G*T, D]``: the G query heads that share each
    key/value head (``Hq = Hkv * G``, query head ``h`` reads key/value head ``h // G``, as
    transformers' ``repeat_kv``) become more rows of it (a copy unless the layout allows a
    view)."""
    return x.unflatten(1, (kv_heads, x.shape[1] // kv_heads)).flatten(2, 3)


def grouped_mask(mask: torch.Tensor | None, groups: int) -> torch.Tensor | None:
    """A query mask ``[B, Tq]`` for the rows of :func:`grouped`, ``[B, G*Tq]``."""
    return None if mask is None else mask.repeat(1, groups)


def query_rows(xq: torch.Tensor, k: torch.Tensor, query_padding_mask: torch.Tensor | None):
    """``(xq, query_padding_mask)`` with grouped-query queries as rows of their key/value head
    (:func:`grouped`, :func:`grouped_mask`): the queries whose moments a key/value head's
    statistics take, on every path (torch, fused, sharded). Unchanged without GQA."""
    G = group_size(xq, k)
    if G == 1:
        return xq, query_padding_mask
    return grouped(xq, k.shape[1]), grouped_mask(query_padding_mask, G)


def mapped(x: torch.Tensor, head_map: torch.Tensor | None, padding_mask=None) -> torch.Tensor:
    """``x A_h^T`` per head in x's dtype (a head map applied outside the blocks and kernels);
    rows where ``padding_mask`` is True become 0 first, so junk there never reaches the map's
    gradient."""
    if head_map is None:
        return x
    return prescale(x, 1.0, padding_mask, head_map).to(x.dtype)


def padded_rows(x: torch.Tensor, query_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[B, H, Tq, .]`` with the padded query rows replaced by 0 (selected, not multiplied:
    junk there never reaches a result). Applied to q and to the output, a padded query enters no
    product of the forward or the backward: its output is 0 and its cotangent, whatever it is,
    is dropped."""
    if query_padding_mask is None:
        return x
    return x.masked_fill(query_padding_mask[:, None, :, None], 0.0)


def learned_scale(scale) -> torch.Tensor | None:
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


def autocast_inputs(q, k, v, dtype: torch.dtype) -> tuple:
    """q, k, v as autocast casts a lower-precision op's inputs: fp32, fp16 and bf16 tensors in
    ``dtype`` (the autocast dtype of their device type), anything else (fp64, a non-tensor: left
    to the validation) unchanged."""
    low = (torch.float32, torch.float16, torch.bfloat16)
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.dtype in low else x
                 for x in (q, k, v))  # fmt: skip


def no_kernel_reason(rf, causal: bool) -> str | None:
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
    return no_kernel_reason(rf, causal) is None


def learns_gerf_a(rf) -> bool:
    """Whether autograd would differentiate a learnable GERF A (``RandomFeatures.gerf_A``): the
    fused kernels hold their coefficients constant, so such a call runs the torch path."""
    a = getattr(rf, "gerf_A", None)
    return a is not None and a.requires_grad and torch.is_grad_enabled()


def use_fused(q, rf, causal) -> bool:
    if not q.is_cuda or no_kernel_reason(rf, causal) is not None or learns_gerf_a(rf):
        return False
    return q.dtype in (torch.float32, torch.float16, torch.bfloat16)


def runs_fused(q, rf, causal: bool, backend: str) -> bool:
    """Whether ``backend`` runs a call on the fused kernels ("triton"; for "auto", a CUDA input
    with a fused form)."""
    return backend == "triton" or (backend == "auto" and use_fused(q, rf, causal))


@dataclasses.dataclass(frozen=True, init=False)
class Call:
    """One validated ``rf_attention`` call (:func:`rfattn.rf_attention`'s arguments, defaults
    resolved).

    Attributes:
        q: ``[B, H, Tq, D]``; k: ``[B, Hkv, Tk, D]``; v: ``[B, Hkv, Tk, E]`` (one dtype, device).
        rf: the :class:`rfattn.RandomFeatures`.
        causal: query i reads keys j <= i.
        scale: the softmax temperature, a float.
        key_padding_mask: ``[B, Tk]`` bool or None.
        query_padding_mask: ``[B, Tq]`` bool or None (resolved: the key mask when causal).
        backend: one of :data:`BACKENDS`.
        initial_state: the :class:`RFState` to continue, or None.
        return_state: also return the final state.
        group: the process group of a sharded call, or None.
        maps: ``(query_map, key_map)`` head maps the backend applies where it reads q and k
            (either may be None), or None for none.
        window, sinks: exact local attention inside the random features (:mod:`rfattn.hybrid`;
            0 and 0: none).
        packed: packed sequences (``cu_seqlens``): ``(query offsets, key offsets)``, each the
            N + 1 ints of :func:`packed_offsets` (B is 1), or, with ``max_seqlen``, the offsets
            as int64 tensors on q's device (never read on the host); None for an unpacked call.
        max_seqlen: with ``packed``, the longest sequence's length: the sequences run as one
            batch padded to it (:meth:`padded_batch`); None: the offsets are the host's.
        update_stats: the call may move running statistics (in training); False for the
            sequences of a packed call, whose statistics move once, from the whole row.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rf: object
    causal: bool = False
    scale: float = 1.0
    key_padding_mask: torch.Tensor | None = None
    query_padding_mask: torch.Tensor | None = None
    backend: str = "auto"
    initial_state: RFState | None = None
    return_state: bool = False
    group: object = None
    maps: tuple | None = None
    window: int = 0
    sinks: int = 0
    packed: tuple | None = None
    update_stats: bool = True
    max_seqlen: int | None = None

    def __init__(self, q, k, v, rf, causal=False, scale=1.0, key_padding_mask=None,
                 query_padding_mask=None, backend="auto", initial_state=None,
                 return_state=False, group=None, maps=None, window=0, sinks=0, packed=None,
                 update_stats=True, max_seqlen=None):  # fmt: skip
        # the fields straight into the instance's dict: a frozen dataclass's own __init__ sets
        # each through object.__setattr__ (~2 µs more per call, bench.host)
        self.__dict__.update(
            q=q, k=k, v=v, rf=rf, causal=causal, scale=scale, key_padding_mask=key_padding_mask,
            query_padding_mask=query_padding_mask, backend=backend, initial_state=initial_state,
            return_state=return_state, group=group, maps=maps, window=window, sinks=sinks,
            packed=packed, update_stats=update_stats, max_seqlen=max_seqlen,
        )  # fmt: skip

    @property
    def groups(self) -> int:
        """G, the query heads per key/value head (grouped-query attention; 1 otherwise)."""
        return group_size(self.q, self.k)

    @property
    def fused(self) -> bool:
        """Whether the fused kernels run this call (``backend``, and for "auto" a CUDA input
        with a fused form)."""
        return runs_fused(self.q, self.rf, self.causal, self.backend)

    def replace(self, **changes) -> Call:
        """This call with some fields changed."""
        return dataclasses.replace(self, **changes)

    def sequences(self):
        """The sequences of a packed call, in order, each as :meth:`sequence` gives it."""
        return (self.sequence(i) for i in range(len(self.packed[0]) - 1))

    def sequence(self, i: int) -> Call:
        """Sequence ``i`` of a packed call as a call of its own: views of its tokens in q, k
        and v, its slices of the masks, its ``[1, Hkv, ...]`` of the initial states, running
        statistics left where they are (the packed call moves them once)."""
        oq, ok = self.packed
        qs, ks = slice(oq[i], oq[i + 1]), slice(ok[i], ok[i + 1])
        kpm, qpm, st = self.key_padding_mask, self.query_padding_mask, self.initial_state
        return self.replace(
            q=self.q[:, :, qs], k=self.k[:, :, ks], v=self.v[:, :, ks],
            key_padding_mask=None if kpm is None else kpm[:, ks],
            query_padding_mask=None if qpm is None else qpm[:, qs],
            initial_state=None if st is None else state_rows(st, slice(i, i + 1)),
            packed=None, update_stats=False,
        )  # fmt: skip

    def batch_of(self, indices: list[int], last: list[bool] | None = None
                 ) -> tuple[Call, torch.Tensor, torch.Tensor]:  # fmt: skip
        """Sequences ``indices`` of a packed call as one call of a batch: row j holds sequence
        ``indices[j]``, its tokens first and zeros after them up to the longest of them (where
        ``last[j]``: its tokens last, the zeros before them), the zeros key- and query-padded
        (so they reach no output, statistic or gradient) besides the packed call's own masks;
        its rows of the initial states; running statistics left where they are (as
        :meth:`sequence`). Returns ``(call, slots, tokens)``: the batch's query slots
        (``[n * Lq]``, flat over rows) that hold tokens and those tokens' positions in the
        packed row, for the output's way back."""
        oq, ok = self.packed
        dev = self.q.device

        n = len(indices)

        def layout(offsets):  # (slots, positions, length) of the sequences' tokens
            lens = torch.tensor([offsets[i + 1] - offsets[i] for i in indices])
            starts = torch.tensor([offsets[i] for i in indices])
            L = int(lens.max())
            first = torch.repeat_interleave(lens.cumsum(0) - lens, lens)  # per token, on CPU
            t = torch.arange(len(first)) - first  # the token's place in its sequence
            if last is not None:  # those rows' tokens after their zeros
                t = t + torch.repeat_interleave(torch.tensor(last) * (L - lens), lens)
            slots = torch.repeat_interleave(torch.arange(n) * L, lens) + t
            pos = torch.repeat_interleave(starts, lens) + torch.arange(len(first)) - first
            return slots.to(dev), pos.to(dev), L

        # (causal: q and k share one list of offsets, one layout)
        (sq, pq, Lq) = layout(oq)
        (sk, pk, Lk) = (sq, pq, Lq) if ok is oq else layout(ok)

        def rows(x, slots, pos, L):  # [1, H, total, D] -> [n, H, L, D], zeros after the tokens
            flat = x.new_zeros(x.shape[1], n * L, x.shape[3])
            flat = flat.index_copy(1, slots, x[0].index_select(1, pos))
            return flat.unflatten(1, (n, L)).transpose(0, 1)

        def padding(mask, slots, pos, L):  # [1, total] -> [n, L] bool, True = padding
            given = torch.zeros(len(pos), dtype=torch.bool, device=dev) if mask is None \
                else mask[0].index_select(0, pos)  # fmt: skip
            return torch.ones(n * L, dtype=torch.bool, device=dev).index_copy(0, slots,
                                                                             given).view(n, L)

        st = self.initial_state
        if st is not None:
            st = state_rows(st, torch.tensor(indices, dtype=torch.int64, device=st[0].device))
        call = self.replace(
            q=rows(self.q, sq, pq, Lq), k=rows(self.k, sk, pk, Lk), v=rows(self.v, sk, pk, Lk),
            key_padding_mask=padding(self.key_padding_mask, sk, pk, Lk),
            query_padding_mask=padding(self.query_padding_mask, sq, pq, Lq),
            initial_state=st, packed=None, update_stats=False,
        )  # fmt: skip
        return call, sq, pq

    def padded_batch(self) -> tuple[Call, torch.Tensor]:
        """A packed call with ``max_seqlen`` as one call of N rows of ``max_seqlen`` tokens:
        row i holds sequence i's tokens first, then zeros, key- and query-padded (as
        :meth:`batch_of` pads), every index made on the device from the offsets (no host read,
        no shape that depends on them). Returns ``(call, slots)``: each row slot's position in
        the packed row (``[N * max_seqlen]``; slots past a sequence's end: the row's length,
        one past its last token), for :meth:`padded_output`."""
        L, (cq, ck), dev = self.max_seqlen, self.packed, self.q.device
        t = torch.arange(L, device=dev)

        def layout(cu, total):  # (slot positions [N * L], padding [N, L])
            starts, lens = cu[:-1], cu[1:] - cu[:-1]
            pad = t[None, :] >= lens[:, None]
            return torch.where(pad, total, starts[:, None] + t[None, :]).reshape(-1), pad

        sq, pq = layout(cq, self.q.shape[2])
        sk, pk = (sq, pq) if ck is cq else layout(ck, self.k.shape[2])
        n = cq.shape[0] - 1

        def rows(x, slots):  # [1, H, T, D] -> [N, H, L, D]: a zero token at T for the padding
            x = torch.cat((x[0], x.new_zeros(x.shape[1], 1, x.shape[3])), dim=1)
            return x.index_select(1, slots).unflatten(1, (n, L)).transpose(0, 1)

        def padding(mask, slots, pad):  # [1, T] -> [N, L], True = padding
            if mask is None:
                return pad
            mask = torch.cat((mask[0], mask.new_ones(1)))
            return pad | mask.index_select(0, slots).view(n, L)

        call = self.replace(
            q=rows(self.q, sq), k=rows(self.k, sk), v=rows(self.v, sk),
            key_padding_mask=padding(self.key_padding_mask, sk, pk),
            query_padding_mask=padding(self.query_padding_mask, sq, pq),
            packed=None, max_seqlen=None, update_stats=False,
        )  # fmt: skip
        return call, sq

    def padded_output(self, slots: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The packed row's output ``[1, H, total, E]`` from :meth:`padded_batch`'s rows ``out``
        ``[N, H, L, E]`` and ``slots`` (the padding's slot, one past the row, dropped)."""
        flat = out.transpose(0, 1).flatten(1, 2)  # [H, N * L, E]
        row = flat.new_zeros(flat.shape[0], self.q.shape[2] + 1, flat.shape[2])
        return row.index_copy(1, slots, flat)[:, : self.q.shape[2]][None]

    def packed_output(self, parts: list) -> torch.Tensor:
        """A packed call's output ``[1, H, total, E]`` from its parts ``(slots, pos, out)``: a
        batch's rows (its query slots and their positions in the row, :meth:`batch_of`) or,
        with ``slots`` None, sequence ``pos``'s own output."""
        oq = self.packed[0]
        q, v = self.q, self.v
        if len(parts) == 1 and parts[0][0] is None:  # one sequence: its output is the row's
            return parts[0][2]
        pieces, positions = [], []
        for slots, pos, out in parts:
            if slots is None:  # sequence pos: [1, H, its queries, E]
                pieces.append(out[0])
                positions.append(torch.arange(oq[pos], oq[pos + 1], device=q.device))
            else:  # [n, H, Lq, E]: the rows' token slots
                pieces.append(out.transpose(0, 1).flatten(1, 2).index_select(1, slots))
                positions.append(pos)
        values, where = torch.cat(pieces, dim=1), torch.cat(positions)
        row = values.new_zeros(q.shape[1], q.shape[2], v.shape[3])
        return row.index_copy(1, where, values)[None]

    def with_maps_applied(self) -> Call:
        """This call with its head maps applied to q and k here (padded keys zeroed first), for
        the paths that read q and k more than once or take no maps."""
        if self.maps is None:
            return self
        qmap, kmap = self.maps
        return self.replace(q=mapped(self.q, qmap), k=mapped(self.k, kmap, self.key_padding_mask),
                            maps=None)  # fmt: skip

    def as_rows(self) -> Call:
        """A non-causal grouped-query call as one call per key/value head: the G query heads
        of each become more rows of it (``[B, Hkv, G*Tq, D]``, query maps applied first, per
        query head), their padding mask repeated; :meth:`ungroup` returns its output to
        ``[B, H, Tq, E]``. The call itself when there is no grouping."""
        if self.groups == 1 or self.causal:
            return self
        qmap, kmap = (None, None) if self.maps is None else self.maps
        q, qpm = query_rows(mapped(self.q, qmap), self.k, self.query_padding_mask)
        return self.replace(q=q, query_padding_mask=qpm,
                            maps=None if kmap is None else (None, kmap))  # fmt: skip

    def ungroup(self, out: torch.Tensor) -> torch.Tensor:
        """The output of :meth:`as_rows`'s call as this call's ``[B, H, Tq, E]``."""
        G = self.groups
        if G == 1 or self.causal:
            return out
        return out.unflatten(2, (G, self.q.shape[2])).flatten(1, 2)


#: the functions that run a call in place of its backends while :func:`intercept_calls` holds
#: them, the open one last (rfattn.calibrate records the calls of a model's layers through it);
#: ``rf_attention`` reads the list itself (no function call on its hot path)
INTERCEPTS: list = []


@contextlib.contextmanager
def intercept_calls(hook):
    """While the context is open, every ``rf_attention`` call runs as ``hook(call, run)``:
    ``call`` its :class:`Call` (validated), ``run(call)`` what the call would return, for the
    hook to use or not. How a tool (:func:`rfattn.calibrate`) sees the calls without the core
    knowing of it. Not nested: an open interception is replaced and then restored."""
    INTERCEPTS.append(hook)
    try:
        yield
    finally:
        INTERCEPTS.pop()
