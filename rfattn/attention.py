"""``rf_attention``: validation and backend dispatch (fused Triton kernels | torch path).

The torch path is the CPU implementation and the reference for streaming: non-causal it builds
the feature maps and applies :func:`rfattn.reference.linear_attention`; causal it runs a chunked
prefix sum (never a ``[T, F, E]`` tensor) carrying the state ``(S, z, offset)`` with the running
key max of DESIGN §3, so a sequence can be split and resumed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from rfattn.features import compute_dtype, prescale, query_features
from rfattn.reference import linear_attention, safe_denominator
from rfattn.stats import Moments
from rfattn.weights import WEIGHTED_WEIGHTS

__all__ = ["rf_attention", "RFState", "BACKENDS", "fused_kernel_available"]

BACKENDS = ("auto", "torch", "triton")
#: tokens per chunk of the causal torch path: the intra-chunk block is [C, C] per (b, h).
_CHUNK = 128


class RFState(NamedTuple):
    """Causal running state, in fp32 (fp64 for fp64 inputs).

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
        if x.shape[:2] != q.shape[:2]:
            raise ValueError(
                f"{name} has batch/heads {tuple(x.shape[:2])}, expected q's {tuple(q.shape[:2])}"
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
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal=True needs Tq == Tk, got Tq={q.shape[2]}, Tk={k.shape[2]}")
    if key_padding_mask is not None:
        _check_tensor("key_padding_mask", key_padding_mask, 2, "B, Tk")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be bool, got dtype {key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2]):
            raise ValueError(
                f"key_padding_mask must have shape [B, Tk] = {(k.shape[0], k.shape[2])}, "
                f"got {tuple(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(
                f"key_padding_mask is on device {key_padding_mask.device}, expected {q.device}"
            )
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


def _check_state(state, q, v, rf) -> None:
    if not (isinstance(state, tuple) and len(state) == 3):
        raise TypeError("initial_state must be an RFState (s, z, offset)")
    B, H, E = q.shape[0], q.shape[1], v.shape[3]
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


def _causal_torch(
    phi_q: torch.Tensor,
    u_k: torch.Tensor | None,
    g_k: torch.Tensor | None,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    state: RFState | None,
) -> tuple[torch.Tensor, RFState]:
    """Chunked causal linear attention; returns (out, final state).

    Args:
        phi_q: stabilised query features ``[B, H, T, F]``.
        u_k: key logits ``[B, H, T, F]`` of an exponential feature (phi_k = g_k * exp(u_k -
            offset) with the running key max), or None for a plain feature (phi_k = g_k, no
            offset: the state's offset stays 0).
        g_k: key amplitude ``[B, H, T, F]`` (None = 1) or, when ``u_k`` is None, the features.
        v: ``[B, H, T, E]``; key_padding_mask: ``[B, T]``; state: carried :class:`RFState`.
    """
    B, H, T, F = phi_q.shape
    E = v.shape[-1]
    dt = phi_q.dtype
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :, None]
        if u_k is not None:
            u_k = u_k.masked_fill(pad, float("-inf"))
        if g_k is not None:
            g_k = g_k.masked_fill(pad, 0.0)
        v = v.masked_fill(pad, 0.0)
    if state is None:
        s = phi_q.new_zeros(B, H, F, E)
        z = phi_q.new_zeros(B, H, F)
        off = phi_q.new_full((B, H), float("-inf") if u_k is not None else 0.0)
    else:
        s, z, off = (x.to(dt) for x in state)
    outs = []
    for c0 in range(0, T, _CHUNK):
        c1 = min(T, c0 + _CHUNK)
        vc, pq = v[:, :, c0:c1], phi_q[:, :, c0:c1]
        gk = None if g_k is None else g_k[:, :, c0:c1]
        if u_k is None:
            pk = gk  # plain features: no offset
        else:
            uk = u_k[:, :, c0:c1]
            new_off = torch.maximum(off, uk.detach().amax(dim=(-2, -1)))  # running key max
            safe_off = torch.where(new_off == float("-inf"), torch.zeros_like(new_off), new_off)
            alpha = torch.exp(off - safe_off)  # 0 while nothing was seen: S, z are 0 then
            s = s * alpha[..., None, None]
            z = z * alpha[..., None]
            pk = torch.exp(uk - safe_off[..., None, None])  # [B, H, C, F]
            if gk is not None:
                pk = gk * pk
            off = new_off
        intra = (pq @ pk.transpose(-1, -2)).tril()  # [B, H, C, C]
        num = pq @ s + intra @ vc
        den = (pq @ z[..., None]).squeeze(-1) + intra.sum(-1)
        outs.append(num / safe_denominator(den)[..., None])
        s = s + pk.transpose(-1, -2) @ vc
        z = z + pk.sum(dim=-2)
    out = torch.cat(outs, dim=2) if outs else v.new_zeros(B, H, 0, E)
    return out, RFState(s, z, off)


#: the real positive GERF family ``u = A |w|^2 + B w . x~ - |x~|^2 / 2`` (kernel form "gerf")
#: with per-(b, h) A, B, psi.
_GERF_FAMILY = ("posrf", "hyprf", "gerf", "oprf", "saderf")
#: the signed features the non-causal kernel also computes: trigrf, hrf and complex gerf in its
#: "table" form, rmf in its "rmf" form (see :func:`_fused_form`).
_SIGNED_FUSED = ("trigrf", "hrf", "rmf")


def _no_kernel_reason(rf, causal: bool) -> str | None:
    """Why no fused kernel can run this call, or None when one can."""
    fm = rf.feature_map
    if causal and rf.weight.requires_grad:
        return "learnable weights (dW) in causal attention need the torch path"
    if rf.feature not in _GERF_FAMILY + _SIGNED_FUSED:
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


def _kernel_moments(q, k, key_padding_mask, scale) -> Moments:
    """This call's per-(b, h) moments from the fused stats pass (``rfattn.kernels.stats``)."""
    from rfattn.kernels.stats import sequence_moments_fused

    return Moments(*sequence_moments_fused(q, k, scale, key_padding_mask))


def _gerf_form(rf, q, k, key_padding_mask, scale, causal=False):
    """The fused kernel's inputs for ``rf``: (W to project by, per-(b, h) (A, B) or None,
    per-(b, h) psi or None, log D). Statistics come from the feature map itself (one place).

    ``log D`` (a per-(b, h) constant of the feature maps' logits) cancels in attention and the
    kernels drop it; it only shifts the causal state's offset (see :func:`_causal_triton`).
    """
    fm, w = rf.feature_map, rf.weight
    if rf.feature == "posrf":
        return w, None, None, 0.0
    if rf.feature == "hyprf":  # [exp(w.x), exp(-w.x)] = posrf on the rows [W; -W]
        return torch.cat((w, -w), dim=0), None, None, 0.0
    if rf.feature == "gerf":
        a = fm.A.real
        log_d = 0.25 * q.shape[-1] * math.log(1.0 - 4.0 * a)
        return w, torch.tensor([a, math.sqrt(1.0 - 4.0 * a)], dtype=torch.float64), None, log_d
    # oprf, saderf: the feature map's parameters (one place) from the fused stats pass (held
    # constant: stats_grad=False); empty stand-ins give it dtype, device and D, never a copy
    stand_in = q.new_empty((1, 1, 0, q.shape[-1]), dtype=compute_dtype(q.dtype))
    with torch.no_grad():
        p = fm.params(stand_in, stand_in, key_padding_mask, causal=causal,
                      batch=lambda: _kernel_moments(q, k, key_padding_mask, scale))  # fmt: skip
    ab = torch.cat((p["A"], p["B"]), dim=-1).flatten(-2)  # [B|1, H|1, 2]
    psi = p["psi"].squeeze(-2) if "psi" in p else None  # [B|1, H|1, D]
    return w, ab, psi, p["log_D"][..., 0, 0]  # log D: [B|1, H|1]


def _table(width: int, device, **rows) -> torch.Tensor:
    """Coefficients ``[2, 9, width]`` of the kernel's table form (float64; rows named as in
    ``rfattn.kernels.rf_parallel.TABLE_ROWS``): each a number, an ``[width]`` tensor or a
    (query, key) pair of those; rows not given are 0."""
    from rfattn.kernels.common import TABLE_ROWS

    t = torch.zeros(2, len(TABLE_ROWS), width, dtype=torch.float64, device=device)
    for name, val in rows.items():
        for side, x in enumerate(val if isinstance(val, tuple) else (val, val)):
            t[side, TABLE_ROWS.index(name)] = x.detach() if torch.is_tensor(x) else x
    return t


def _fused_form(rf, q, k, key_padding_mask, scale, causal=False) -> tuple[dict, object]:
    """The keyword arguments of :func:`rfattn.autograd.rf_parallel` / ``rf_chunk`` for ``rf``:
    the kernel's feature form, one projection row per feature ``w`` (built from ``rf.weight``
    with differentiable ops, so dW flows back) and the form's parameters; and the shift
    between the kernel's key offsets and the torch path's (log D, dropped by the "gerf" form;
    0 otherwise). The coefficients restate the feature maps' formulas (``rfattn.features``;
    tests hold them to the torch path)."""
    fm, w, name, dev = rf.feature_map, rf.weight, rf.feature, q.device
    m = w.shape[0]
    c = rf.component_weight if rf.weights in WEIGHTED_WEIGHTS else None  # key-side row weights
    if name in _GERF_FAMILY and fm.positive and c is None:
        w, gerf, psi, log_d = _gerf_form(rf, q, k, key_padding_mask, scale, causal)
        return dict(w=w, feature="gerf", gerf=gerf, psi=psi), log_d
    if name == "rmf":
        d = fm.drawn()
        deg = d["rmf_degree"].to(dev)
        proj = d["rmf_proj"].to(device=dev, dtype=w.dtype)
        stages = torch.cat((w.detach()[None].to(dev), proj), dim=0)  # [max_degree, M, D]
        starts = torch.cat((deg.new_zeros(1), deg.cumsum(0)))  # feature f: rows starts[f]..
        owner = torch.repeat_interleave(torch.arange(m, device=dev), deg)
        rows = stages[torch.arange(owner.shape[0], device=dev) - starts[owner], owner]
        cq = d["rmf_scale"].to(dev, torch.float64)
        ck = cq if c is None else cq * c.to(dev, torch.float64)
        return dict(w=w.detach(), feature="rmf", table=torch.stack((cq, ck))[:, None],
                    extra_rows=rows, index=torch.cat((starts, owner))), 0.0  # fmt: skip
    ones = torch.ones(m, dtype=torch.float64, device=dev)
    ck = 1.0 if c is None else c.to(dev, torch.float64).repeat(fm.width(m) // m)
    shift = torch.cat((0.0 * ones, -0.5 * math.pi * ones))  # [cos, sin] = cos(th - [0, pi/2])
    if name in ("posrf", "gerf") and fm.positive:  # sgq's weights: u = A |w|^2 + B z - |x|^2/2
        a = fm.A.real if name == "gerf" else 0.0
        table = _table(m, dev, cu=math.sqrt(1.0 - 4.0 * a), ch=-0.5, cw=a, ga=(1.0, ck))
        return dict(w=w, feature="table", table=table), 0.0
    if name == "hyprf":
        table = _table(2 * m, dev, cu=1.0, ch=-0.5, ga=(1.0, ck))
        return dict(w=torch.cat((w, -w), dim=0), feature="table", table=table), 0.0
    if name == "trigrf":  # u = |x|^2 / 2, g = [cos z, sin z]
        table = _table(2 * m, dev, ch=0.5, ct=1.0, tb=shift, gb=(1.0, ck))
        return dict(w=torch.cat((w, w), dim=0), feature="table", table=table), 0.0
    if name == "gerf":  # complex: u = [Re z, Re z]; g = [cos Im z, +-sin Im z] (keys: -sin)
        (bq, log_d), (bk, _) = (
            fm.coefficients(q.shape[-1], "query"),
            fm.coefficients(q.shape[-1], "key"),
        )
        table = _table(2 * m, dev, cu=(bq.real, bk.real), ch=-0.5 * fm.s, cw=fm.A.real,
                       bias=log_d.real, ct=(bq.imag, bk.imag), tw=fm.A.imag,
                       tb=log_d.imag + shift, gb=(1.0, torch.cat((ones, -ones)) * ck))  # fmt: skip
        return dict(w=torch.cat((w, w), dim=0), feature="table", table=table), 0.0
    # hrf: blocks [P, T, P (x) s_r (r < n), T (x) s_r (r < n)]; P = exp(+-z_p - |x|^2/2) (queries
    # carry -s_r), T = exp(|x|^2/2) [sin z_t, cos z_t]; lam_f = r on the s_r blocks, else -1
    wp, wt = fm._split(w)
    mp, mt, n = wp.shape[0], wt.shape[0], fm.n
    lp, lt, lr = fm.log_constants(mp, mt)
    pm = torch.cat((torch.ones(mp), -torch.ones(mp))).to(dev, torch.float64)
    sc = torch.cat((torch.full((mt,), -0.5 * math.pi), torch.zeros(mt))).to(dev, torch.float64)
    p_blk = dict(cu=pm, ch=-0.5)
    t_blk = dict(ch=0.5, ct=1.0, tb=sc, gb=1.0)
    tables = [_table(2 * mp, dev, bias=lp, ga=1.0, **p_blk), _table(2 * mt, dev, bias=lt, **t_blk)]
    tables += [_table(2 * mp, dev, bias=lp + lr, ga=(-1.0, 1.0), **p_blk)] * n
    tables += [_table(2 * mt, dev, bias=lt + lr, **t_blk)] * n
    lam = [torch.full((2 * mp + 2 * mt,), -1)]
    lam += [torch.full((2 * mp,), r) for r in range(n)]
    lam += [torch.full((2 * mt,), r) for r in range(n)]
    rows = [wp, wp, wt, wt] + [wp, wp] * n + [wt, wt] * n
    return dict(w=torch.cat(rows, dim=0), feature="table", table=torch.cat(tables, dim=-1),
                extra_rows=fm.drawn()["hrf_tau"], index=torch.cat(lam).to(dev)), 0.0  # fmt: skip


def _causal_triton(q, k, v, scale, key_padding_mask, form, shift, state, return_state):
    """The causal kernels: the decode step (``rf_recurrent``) for a few tokens without gradient,
    else the chunked form (``rf_chunk``). States keep the torch path's conventions: offsets
    include log D (``shift``), and plain features (rmf) carry offset 0."""
    from rfattn.autograd import rf_chunk

    if state is not None:
        s0, z0, off0 = state
        state = RFState(s0, z0, off0 - shift)
    from rfattn.kernels.rf_recurrent import MAX_TOKENS

    tensors = (q, k, v, form["w"]) + (() if state is None else tuple(state))
    no_grad = not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    if no_grad and q.shape[2] <= MAX_TOKENS:  # decoding: one launch, O(M (D + E)) per token
        from rfattn.kernels.rf_recurrent import rf_recurrent_fwd

        out, (s, z, off) = rf_recurrent_fwd(q, k, v, scale=scale, key_padding_mask=key_padding_mask,
                                            initial_state=state, **form)  # fmt: skip
    else:
        out, s, z, off = rf_chunk(q, k, v, scale=scale, key_padding_mask=key_padding_mask,
                                  initial_state=state, **form)  # fmt: skip
    if not return_state:
        return out
    off = torch.zeros_like(off) if form["feature"] == "rmf" else off + shift
    return out, RFState(s, z, off)


def _use_triton(q, rf, causal) -> bool:
    if not q.is_cuda or _no_kernel_reason(rf, causal) is not None:
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
):
    """Random-feature linear attention, a drop-in for softmax attention in SDPA's layout.

    Approximates ``softmax(scale * Q K^T) V`` by ``phi(Q) (phi(K)^T V) / phi(Q) (phi(K)^T 1)``
    with the feature map and weights of ``rf``.

    Args:
        q: ``[B, H, Tq, D]`` queries (any strides, e.g. a transposed ``[B, T, H, D]`` view).
        k: ``[B, H, Tk, D]`` keys; v: ``[B, H, Tk, E]`` values. One floating dtype and device.
        rf: an :class:`rfattn.RandomFeatures` built for ``head_dim=D``.
        causal: query i attends to keys j <= i (needs Tq == Tk).
        key_padding_mask: ``[B, Tk]`` bool, True = padding: removed from numerator and
            denominator. A query with no valid key gets output 0.
        scale: softmax temperature, default ``D ** -0.5``.
        backend: "auto" (Triton on CUDA where a fused kernel exists, else torch), "torch",
            or "triton" (CPU tensors need ``TRITON_INTERPRET=1``; float64 runs there too).
        initial_state: causal only: the :class:`RFState` returned by a previous call, to continue
            that sequence (split/resume equals one shot).
        return_state: causal only: also return the final :class:`RFState`.

    Returns:
        ``out`` ``[B, H, Tq, E]`` in the input dtype, or ``(out, state)`` with ``return_state``.
    """
    _validate(q, k, v, rf, causal, key_padding_mask, scale, backend, initial_state, return_state)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    use_triton = backend == "triton" or (backend == "auto" and _use_triton(q, rf, causal))
    if use_triton:
        reason = _no_kernel_reason(rf, causal)
        if reason is not None:
            raise NotImplementedError(f"{reason}; use backend='torch'")
        from rfattn.autograd import rf_parallel

        form, shift = _fused_form(rf, q, k, key_padding_mask, scale, causal)
        if causal:
            return _causal_triton(q, k, v, scale, key_padding_mask, form, shift, initial_state,
                                  return_state)  # fmt: skip
        return rf_parallel(q, k, v, scale=scale, key_padding_mask=key_padding_mask, **form)

    cdt = compute_dtype(q.dtype)
    w = rf.weight.to(device=q.device, dtype=cdt)
    vc = v.to(cdt)
    fm = rf.feature_map
    xq, xk = prescale(q, scale), prescale(k, scale)
    # statistics (global ones raise when causal) and the feature's own draws, once per call
    params = rf.feature_params(xq, xk, key_padding_mask, causal=causal)
    if not causal:
        phi_q, phi_k = fm.features(xq, xk, w, key_padding_mask, params)
        return linear_attention(phi_q, phi_k, vc, key_padding_mask=key_padding_mask).to(q.dtype)
    if fm.exponential:
        u_q = fm.logits(xq, w, "query", params)
        phi_q = query_features(u_q, fm.amplitude(xq, w, "query", params))
        u_k = fm.logits(xk, w, "key", params)
        g_k = fm.key_amplitude(xk, w, params)
    else:
        phi_q, u_k = fm.values(xq, w, "query", params), None
        g_k = fm.values(xk, w, "key", params)
        c_k = fm.key_amplitude(xk, w, params)  # component weights, if any
        g_k = g_k if c_k is None else g_k * c_k
    out, state = _causal_torch(phi_q, u_k, g_k, vc, key_padding_mask, initial_state)
    out = out.to(q.dtype)
    return (out, state) if return_state else out
