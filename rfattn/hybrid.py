"""Exact local attention inside random-feature attention: sinks, a sliding window, one normaliser.

A pretrained decoder's attention is too sharp for a random-feature estimate alone, but most of
its mass sits on a few first tokens ("sinks") and on the last few. The hybrid computes those
terms exactly and estimates only the rest, inside one ratio:

    y_i = [sum_{j in E_i} exp(s q_i . k_j) v_j + sum_{j in R_i} phi(q_i) . phi(k_j) v_j / N]
          / [the same without v]

* ``E_i`` (exact): the sinks, the first ``sinks`` valid keys of the sequence, and the window,
  the valid keys at positions ``i - window < j <= i``;
* ``R_i`` (random features): every other valid key ``j <= i - window``;
* ``phi(q) . phi(k) / N`` is the feature map's unbiased estimate of ``exp(s q . k)``
  (:meth:`rfattn.RandomFeatures.estimate_kernel`, N its sample count), so both parts are terms of
  one kernel sum and the ratio needs no mixing weight. Plain features (rmf) estimate a truncated
  series of the same exponential.

``window = 0`` and ``sinks = 0`` leave plain random-feature attention; ``window >= T`` is exact
softmax attention. Positions count padded keys (a left-padded row's window is its last
``window`` positions), sinks count only valid keys (a left-padded row's sinks are its first real
tokens).

Stabilisation, the same ideas as docs/numerics.md, in absolute units (the estimate's scale is
the exact part's, so no offset may be dropped): queries at their row max over features mq_i,
``a_i = g exp(u_q - mq_i)``; a key either in the running state, at the state's running offset
R (the max over its keys and features), or in the current block's band at its own max m_j; every
row then shares one stabiliser with the exact logits,

    c_i = max(mq_i + R, mq_i + m_j for band keys j in R_i, s q_i . k_j for j in E_i)

and every term is ``exp(. - c_i) <= 1`` times bounded factors. c_i and R read only keys a row
may see (R only keys ``<= i - window``), so no output depends on a later token, not even through
underflow.

Blocked, causal: query blocks ``c0 <= i < c1`` walk the sequence; the state (S ``[F, E]``, z
``[F]`` at R) holds the estimated keys ``j < c0 - window``, which every row of the block sees;
the block's band, keys ``c0 - window <= j < c1 - window``, is seen row by row, then joins the
state. Memory O(C (C + window + sinks) + F E) per (b, h) besides
what autograd keeps (this path is differentiated by autograd: it keeps one state per block).
Reference: :func:`hybrid_reference` (quadratic, the plainest form).
"""

from __future__ import annotations

import math

import torch

from rfattn.features.base import compute_dtype, prescale
from rfattn.reference import attention_ratio

__all__ = ["hybrid_attention", "hybrid_reference", "local_sets"]

#: query rows per block of the torch path
BLOCK = 64


def _check(q, k, v, window, sinks, key_padding_mask) -> None:
    for name, value in (("window", window), ("sinks", sinks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be [B, H, T, D] / [B, H, T, E]")
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(f"causal attention needs Tq == Tk, got {q.shape[-2]} and {k.shape[-2]}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key heads {k.shape[1]}")
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or key_padding_mask.shape != (k.shape[0], k.shape[2])
    ):
        want = (k.shape[0], k.shape[2])
        got = f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        raise ValueError(f"key_padding_mask must be bool [B, T] = {want}, got {got}")


def local_sets(
    T: int, window: int, sinks: int, key_padding_mask: torch.Tensor | None, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(exact, estimated)``: bool ``[B or 1, 1, T, T]`` of the (query, key) pairs each part
    holds (:mod:`rfattn.hybrid`'s E_i and R_i; disjoint, their union the causal valid pairs)."""
    i = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    if key_padding_mask is None:
        valid = torch.ones(1, T, dtype=torch.bool, device=device)
    else:
        valid = ~key_padding_mask
    rank = valid.long().cumsum(-1) - 1  # among valid keys
    sink = (valid & (rank < sinks))[:, None, None, :]
    seen = (j <= i) & valid[:, None, None, :]
    in_window = j > i - window
    exact = seen & (in_window | sink)
    return exact, seen & ~exact


def hybrid_reference(q, k, v, rf, *, window: int, sinks: int = 0, scale: float | None = None,
                     key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The hybrid as ``[T, T]`` kernel matrices (run it in float64): ``exp(s q . k)`` on the
    exact pairs, :meth:`rfattn.RandomFeatures.estimate_kernel` on the estimated ones, then
    :func:`rfattn.reference.kernel_attention`'s ratio. Causal; grouped-query heads repeated."""
    _check(q, k, v, window, sinks, key_padding_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    if key_padding_mask is not None:  # junk in padded keys reaches no kernel value or gradient
        pad = key_padding_mask[:, None, :, None]
        k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)
    exact, estimated = local_sets(q.shape[-2], window, sinks, key_padding_mask, q.device)
    if rf.head_maps is not None:
        raise NotImplementedError("window/sinks with head maps: not supported yet")
    est = rf.estimate_kernel(q, k, scale=scale)
    kmat = torch.exp((q @ k.transpose(-1, -2)) * scale)
    kmat = torch.where(exact, kmat, torch.where(estimated, est, torch.zeros_like(est)))
    return attention_ratio(kmat @ v.to(kmat.dtype), kmat.sum(-1)).to(q.dtype)


def _sink_slots(valid: torch.Tensor, sinks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [B, S], present [B, S])`` of each row's first ``sinks`` valid keys (``present``
    False where a row has fewer), without reading the mask on the host."""
    T = valid.shape[-1]
    rank = valid.long().cumsum(-1) - 1
    is_sink = valid & (rank < sinks)
    order = torch.arange(T, device=valid.device).expand_as(valid)
    order = torch.argsort(torch.where(is_sink, order, order + T), dim=-1)[:, :sinks]
    return order, is_sink.gather(1, order)


def hybrid_attention(q, k, v, rf, *, window: int, sinks: int = 0, scale: float | None = None,
                     key_padding_mask: torch.Tensor | None = None,
                     block: int = BLOCK) -> torch.Tensor:  # fmt: skip
    """Causal hybrid attention (module docstring): exact sinks and window, random features for
    the rest, one normaliser. The torch path, blocked, differentiated by autograd.

    Args:
        q: ``[B, H, T, D]``; k: ``[B, Hk, T, D]``; v: ``[B, Hk, T, E]`` (H a multiple of Hk).
        rf: a :class:`rfattn.RandomFeatures` (no head maps).
        window: exact keys per row, ``i - window < j <= i`` (0: none).
        sinks: exact first valid keys (0: none).
        scale: softmax temperature, default ``D ** -0.5``.
        key_padding_mask: ``[B, T]`` bool, True = padding (never read).
        block: query rows per block.

    Returns:
        ``[B, H, T, E]`` in q's dtype; 0 for a row with no valid key.
    """
    _check(q, k, v, window, sinks, key_padding_mask)
    if rf.head_maps is not None:
        raise NotImplementedError("window/sinks with head maps: not supported yet")
    B, H, T, _ = q.shape
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    group = H // k.shape[1]
    if group > 1:
        k, v = (x.repeat_interleave(group, dim=1) for x in (k, v))
    cd = compute_dtype(q.dtype)
    xq, xk = prescale(q, scale), prescale(k, scale, key_padding_mask)
    w = rf.weight.to(device=q.device, dtype=cd)
    params = rf.feature_params(xq, xk, key_padding_mask, causal=True)
    fm = rf.feature_map
    if fm.exponential:
        u_q, u_k = fm.logits(xq, w, "query", params), fm.logits(xk, w, "key", params)
        mq = u_q.amax(-1, keepdim=True).detach()
        mk = u_k.amax(-1, keepdim=True).detach()
        a, b = torch.exp(u_q - mq), torch.exp(u_k - mk)
        g_q = fm.amplitude(xq, w, "query", params)
        a = a if g_q is None else g_q * a
    else:
        a, b = fm.values(xq, w, "query", params), fm.values(xk, w, "key", params)
        mq, mk = xq.new_zeros(B, H, T, 1), xk.new_zeros(B, H, T, 1)
    g_k = fm.key_amplitude(xk, w, params)
    b = (b if g_k is None else g_k * b) / fm.num_samples(w)
    valid = (torch.ones(B, T, dtype=torch.bool, device=q.device) if key_padding_mask is None
             else ~key_padding_mask)  # fmt: skip
    slot, present = _sink_slots(valid, sinks)
    rank = valid.long().cumsum(-1) - 1
    eligible = (valid & (rank >= sinks))[:, None, :, None]  # keys the features may hold
    b = b.masked_fill(~eligible, 0.0)
    mk = mk.masked_fill(~eligible, -math.inf)
    vv = v.to(cd)
    if key_padding_mask is not None:
        vv = vv.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    x_s = xk.gather(2, slot[:, None, :, None].expand(B, H, sinks, xk.shape[-1]))
    v_s = vv.gather(2, slot[:, None, :, None].expand(B, H, sinks, vv.shape[-1]))
    F, E = a.shape[-1], vv.shape[-1]
    S = a.new_zeros(B, H, F, E)
    z = a.new_zeros(B, H, F)
    R = a.new_full((B, H, 1), -math.inf)
    outs = []
    for c0 in range(0, T, block):
        c1 = min(c0 + block, T)
        i = torch.arange(c0, c1, device=q.device)[:, None]
        a_i, mq_i, xq_i = a[:, :, c0:c1], mq[:, :, c0:c1, 0], xq[:, :, c0:c1]
        # the band: estimated keys that leave the window inside this block, c0 - W <= j < c1 - W
        lo, hi = max(0, c0 - window), max(0, c1 - window)
        jb = torch.arange(lo, hi, device=q.device)[None, :]
        lb = (mq_i[..., None] + mk[:, :, lo:hi, 0][:, :, None, :]).masked_fill(
            jb > i - window, -math.inf)  # fmt: skip
        # the window, exact: i - W < j <= i
        wl = max(0, c0 - window + 1)
        jw = torch.arange(wl, c1, device=q.device)[None, :]
        seen = (jw > i - window) & (jw <= i) & valid[:, None, None, wl:c1]
        le = (xq_i @ xk[:, :, wl:c1].transpose(-1, -2)).masked_fill(~seen, -math.inf)
        # the sinks outside the window, exact
        sink_seen = (slot[:, None, None, :] <= i - window) & present[:, None, None, :]
        ls = (xq_i @ x_s.transpose(-1, -2)).masked_fill(~sink_seen, -math.inf)
        # one stabiliser per row for both parts, from the keys the row sees
        c = mq_i + R
        for part, present_ in ((lb, hi > lo), (le, True), (ls, sinks > 0)):
            if present_:
                c = torch.maximum(c, part.amax(-1))
        c = c.detach().masked_fill(c == -math.inf, 0.0)
        f_state = torch.exp(mq_i + R - c)
        num = f_state[..., None] * (a_i @ S)
        den = f_state * (a_i @ z[..., None])[..., 0]
        if hi > lo:
            p = torch.exp(lb - c[..., None]) * (a_i @ b[:, :, lo:hi].transpose(-1, -2))
            num, den = num + p @ vv[:, :, lo:hi], den + p.sum(-1)
        p = torch.exp(le - c[..., None])
        num, den = num + p @ vv[:, :, wl:c1], den + p.sum(-1)
        if sinks:
            p = torch.exp(ls - c[..., None])
            num, den = num + p @ v_s, den + p.sum(-1)
        outs.append(attention_ratio(num, den))
        # the band joins the state: it then holds every estimated key j < c1 - W
        if hi > lo and c1 < T:
            R_new = torch.maximum(R, mk[:, :, lo:hi, 0].amax(-1, keepdim=True))
            R_safe = R_new.masked_fill(R_new == -math.inf, 0.0)
            k_w = torch.exp(mk[:, :, lo:hi] - R_safe[..., None]) * b[:, :, lo:hi]
            decay = torch.exp(R - R_safe)
            S = decay[..., None] * S + k_w.transpose(-1, -2) @ vv[:, :, lo:hi]
            z = decay * z + k_w.sum(-2)
            R = R_new
    return torch.cat(outs, dim=2).to(q.dtype)
