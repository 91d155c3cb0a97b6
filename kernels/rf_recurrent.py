"""Fused causal decode step: a few tokens against a carried state, per (b, h), in one launch.

For each new token t in order (the state (S [M, E], z [M], R) in the accumulation dtype):

    R' = max(R, max_f u_k(t))                              (valid keys only; running offset)
    S <- S exp(R - R') + b_t v_t^T,  z <- z exp(R - R') + b_t,   b_t = g_k exp(u_k(t) - R')
    out_t = a_t S / a_t z,  a_t = g_q exp(u_q(t) - max_f u_q(t))   (safe_denominator policy)

This is exactly the chunked form (``rf_chunk``) with chunks of one token: the same features
(``common.feature_tile``), offsets and denominator policy, so a state from either
continues in the other. Cost O(M (D + E)) per token and (b, h), whatever the position: the
generation path. One program per (b, h) walks the tokens and the M tiles of its state: it reads
the initial state and writes the new one, into new tensors or (``inplace=True``) over the
initial state's own, never copying it first.

fp16/bf16 inputs run the half policy of every kernel (``common.precision_policy``: split logits,
one half product for ``b v`` and ``a S``), as ``rf_chunk`` does: a state from either continues
in the other, up to the rounding of the products' order.

Forward only (generation runs without gradients); ``rfattn.rf_attention`` uses it for causal
calls of at most :data:`MAX_TOKENS` tokens that need no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    NEG,
    Launch,
    Plan,
    feature_tile,
    form_args,
    gerf_coeffs,
    input_scale,
    launch_setup,
    load_mapped,
    load_mapped_heads,
    load_offset,
    load_rows,
    load_w,
    mask_rows,
    next_pow2,
    plan_cache,
    product,
    ratio,
    shape_plan,
    store_offset,
    valid_keys,
)
from .rf_local import decode_exact, decode_shift

__all__ = ["rf_recurrent_fwd", "rf_hybrid_step", "pool_index", "MAX_TOKENS"]

#: the most tokens a call sends through the recurrent step (longer ones use rf_chunk)
MAX_TOKENS = 16


@triton.jit
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr,
    xi_ptr, qmap_ptr, kmap_ptr, s0_ptr, z0_ptr, r0_ptr, s_ptr, z_ptr, r_ptr, o_ptr, idx_ptr,
    wk_ptr, wv_ptr, kind_ptr, sk_ptr, sv_ptr, seen_ptr, nwk_ptr, nwv_ptr, nkind_ptr, nsk_ptr,
    nsv_ptr, nseen_ptr, lscale: tl.float64, inv_n: tl.float64,
    T, H, G, WIN, NSK,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_ob, stride_oh, stride_ot, stride_oe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_INIT: tl.constexpr, PLAIN: tl.constexpr, GP: tl.constexpr, HAS_MAP: tl.constexpr,
    HAS_IDX: tl.constexpr, POOL_OUT: tl.constexpr, HYBRID: tl.constexpr, HAS_WIN: tl.constexpr,
    HAS_SINK: tl.constexpr, BK: tl.constexpr, BS: tl.constexpr,
):  # fmt: skip
    """T tokens of one key/value head (b, h) against the state (S0, z0, R0) (zeros without
    HAS_INIT), written to (S, z, R): the first token reads S0, the later ones S (the two may be
    the same tensors: in place). The G query heads that read it are the rows of one [GP, .]
    tile (GP >= 16, as tl.dot needs). HAS_IDX: the initial states are rows ``idx[b]`` of a pool
    (S0 ``[P, H, M, E]``, ...; the hybrid's window, sinks and counts too), and with POOL_OUT so
    are the written ones (in place; not the hybrid's, whose new state is ``[B, ...]``).

    HYBRID (one token, ``rfattn.hybrid``'s decode step): the key that joins the state is the one
    leaving the window, slot 0 of the state's WIN window keys ``wk`` (the token itself without
    a window), where its kind is a window key's; the features' state is in the torch path's
    units (``inv_n``: 1 / the feature map's sample count); the rows add the exact terms of the
    window, the NSK sink slots and the token (``rf_local.decode_exact``, logits at ``lscale``),
    and the state's window and sinks one token on are written to the ``n*`` tensors
    (``rf_local.decode_shift``). The hybrid state's tensors are contiguous."""
    i_bh = tl.program_id(0).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    i_in = i_bh  # the (b, h) row of the initial state, and of the written one
    i_rb = i_b  # the batch row of the initial state (the hybrid's kinds and sink counts)
    if HAS_IDX:
        i_rb = tl.load(idx_ptr + i_b).to(tl.int64)
        i_in = i_rb * H + i_h
    i_out = i_in if POOL_OUT else i_bh
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    # one token per step: its key as row 0 of a GP-row tile, its G queries as rows 0..G-1
    o_r = tl.arange(0, GP)
    m_qr = o_r < G
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_scq = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_sck = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
    q_base = q_ptr + i_b * stride_qb + i_h * G * stride_qh  # the group's first query head
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh
    b_r = load_offset(r0_ptr + i_in, PLAIN, HAS_INIT, ACC)
    # the key joining the state: token t's, or (HYBRID) the window's slot 0
    enter_k, enter_v = k_base, v_base
    stride_et, stride_ed, stride_ev, stride_ee = stride_kt, stride_kd, stride_vt, stride_ve
    if HYBRID:
        # the token's kind: padding 0, a sink while a slot is free 2, else a window key 1
        # ([GP] alike: the interpreter makes a scalar bool and'ed with a vector an int32 mask)
        seen_r = tl.load(seen_ptr + i_rb + o_r * 0)
        tok_ok = seen_r >= 0
        if HAS_PAD:
            tok_ok = tl.load(pad_ptr + i_b * stride_pb + o_r * 0) == 0
        new_kinds = tl.where(tok_ok, tl.where(seen_r < NSK, 2, 1), 0)
        seen, new_kind = tl.max(seen_r, axis=0), tl.max(new_kinds, axis=0)
        # the window's slot 0, or the token itself without a window
        enter_kind = new_kinds
        if HAS_WIN:
            enter_kind = tl.load(kind_ptr + i_rb * WIN + o_r * 0).to(tl.int32)
            enter_k, enter_v = wk_ptr + i_in * WIN * D, wv_ptr + i_in * WIN * E
            stride_et, stride_ed, stride_ev, stride_ee = D, 1, E, 1
    for t in range(0, T):
        o_t = t + o_r * 0  # [GP], all rows point at token t
        m_row = o_r == 0
        if HYBRID:
            m_k = (enter_kind == 1) & m_row
        else:
            m_k = valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD) & m_row
        b_k = load_mapped(enter_k, o_t, o_d, stride_et, stride_ed, m_k, m_d, kmap_ptr, i_h, D, GP,
                          BD, HAS_MAP, PRECISION, ACC)  # fmt: skip
        b_v = load_rows(enter_v, o_t, o_e, stride_ev, stride_ee, m_k, m_e, ACC)  # [GP, BE]
        # query row g: head h * G + g at token t
        b_q = load_mapped_heads(q_base + t * stride_qt, o_r, o_d, stride_qh, stride_qd, m_qr,
                                 m_d, qmap_ptr, i_h * G, G, D, GP, BD, HAS_MAP, PRECISION,
                                 ACC)  # fmt: skip
        b_xq, b_xk = b_q * b_scq[None, :], b_k * b_sck[None, :]
        # pass 1: the key's max logit over all features -> the new running offset
        b_rn = b_r
        for i_m in range(0, NMT):
            o_f = i_m * BM + tl.arange(0, BM)
            m_f = o_f < M
            b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)
            b_uk, b_gk, b_g1, b_g2 = feature_tile(
                b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY, b_k, b_sck,
                HAS_MAP)  # fmt: skip
            b_uk = tl.where(m_k[:, None] & m_f[None, :], b_uk, float("-inf"))
            b_rn = tl.maximum(b_rn, tl.max(tl.max(b_uk, axis=1), axis=0))
        b_alpha = tl.exp(b_r - b_rn)
        # pass 2: rescale and update the state tiles, and read the query against them
        b_mx = tl.full([GP], NEG, dtype=ACC)
        b_num = tl.zeros([GP, BE], dtype=ACC)
        b_den = tl.zeros([GP], dtype=ACC)
        for i_m in range(0, NMT):
            o_f = i_m * BM + tl.arange(0, BM)
            m_f = o_f < M
            m_fe = m_f[:, None] & m_e[None, :]
            o_fe = o_f[:, None] * E + o_e[None, :]
            # the state so far: the initial one before the first token, then the written one
            b_s = tl.load(s_ptr + i_out * M * E + o_fe, mask=m_fe & (t > 0), other=0.0)
            b_z = tl.load(z_ptr + i_out * M + o_f, mask=m_f & (t > 0), other=0.0)
            if HAS_INIT:
                b_s += tl.load(s0_ptr + i_in * M * E + o_fe, mask=m_fe & (t == 0),
                               other=0.0).to(ACC)  # fmt: skip
                b_z += tl.load(z0_ptr + i_in * M + o_f, mask=m_f & (t == 0), other=0.0).to(ACC)
            b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)
            b_uk, b_gk, b_g1, b_g2 = feature_tile(
                b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY, b_k, b_sck,
                HAS_MAP)  # fmt: skip
            b_b = b_gk * tl.where(m_k[:, None] & m_f[None, :], tl.exp(b_uk - b_rn), 0.0)
            if HYBRID:  # the torch path's units
                b_b = b_b * tl.full([], inv_n, ACC)
            # [BM, GP] @ [GP, BE] -> [BM, BE] (signed features split, as the key pass's)
            b_s = b_s * b_alpha + product(tl.trans(b_b), b_v, PRECISION, ACC, FEATURE != 0)
            b_z = b_z * b_alpha + tl.sum(b_b, axis=0)
            tl.store(s_ptr + i_out * M * E + o_fe, b_s, mask=m_fe)
            tl.store(z_ptr + i_out * M + o_f, b_z, mask=m_f)
            b_uq, b_gq, b_g1, b_g2 = feature_tile(
                b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
                M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY, b_q, b_scq,
                HAS_MAP)  # fmt: skip
            b_uq = tl.where(m_f[None, :], b_uq, float("-inf"))
            b_mx_new = tl.maximum(b_mx, tl.max(b_uq, axis=1))
            b_beta = tl.exp(b_mx - b_mx_new)
            b_a = b_gq * tl.exp(b_uq - b_mx_new[:, None])  # [GP, BM]
            # [GP, BM] @ [BM, BE] -> [GP, BE]: the state split, as the query pass's
            b_num = b_num * b_beta[:, None] + product(b_a, b_s, PRECISION, ACC, FEATURE != 0,
                                                      True)  # fmt: skip
            b_den = b_den * b_beta + tl.sum(b_a * b_z[None, :], axis=1)
            b_mx = b_mx_new
        if HYBRID:  # the exact terms, at the offset the features' terms share with them
            b_qx = tl.load(q_base + t * stride_qt + o_r[:, None] * stride_qh +
                           o_d[None, :] * stride_qd, mask=m_qr[:, None] & m_d[None, :],
                           other=0.0)  # fmt: skip
            if HAS_WIN:
                new_exact = (new_kinds != 0) & m_qr
            else:
                new_exact = (new_kinds == 2) & m_qr
            b_num, b_den = decode_exact(
                b_qx, b_num, b_den, b_mx + b_rn, k_base + t * stride_kt, v_base + t * stride_vt,
                stride_kd, stride_ve, new_exact, wk_ptr + i_in * WIN * D,
                wv_ptr + i_in * WIN * E, kind_ptr + i_rb * WIN, sk_ptr + i_in * NSK * D,
                sv_ptr + i_in * NSK * E, seen, WIN, lscale, o_r, m_qr, o_d, m_d, o_e, m_e, D, E,
                BK, BS, HAS_WIN, HAS_SINK, PRECISION, ACC,
            )  # fmt: skip
        b_o, b_den = ratio(b_num, b_den, TINY)
        p_o = o_ptr + i_b * stride_ob + (i_h * G + o_r[:, None]) * stride_oh + t * stride_ot
        tl.store(p_o + o_e[None, :] * stride_oe, b_o.to(o_ptr.dtype.element_ty),
                 mask=m_qr[:, None] & m_e[None, :])  # fmt: skip
        b_r = b_rn
    store_offset(r_ptr + i_out, b_r)
    if HYBRID:
        decode_shift(wk_ptr + i_in * WIN * D, wv_ptr + i_in * WIN * E, kind_ptr + i_rb * WIN,
                     nwk_ptr + i_bh * WIN * D, nwv_ptr + i_bh * WIN * E, nkind_ptr + i_b * WIN,
                     sk_ptr + i_in * NSK * D, sv_ptr + i_in * NSK * E, nsk_ptr + i_bh * NSK * D,
                     nsv_ptr + i_bh * NSK * E, k_base, v_base, stride_kd, stride_ve, new_kind,
                     seen, i_h, WIN, NSK, o_d, m_d, o_e, m_e, D, E, BK, BS, HAS_WIN,
                     HAS_SINK)  # fmt: skip
        tl.store(nseen_ptr + i_b, seen + (new_kind == 2).to(tl.int64), mask=i_h == 0)


#: per-shape plans of the launcher (:func:`common.shape_plan`)
_PLANS = plan_cache()


def _plan(q, k, v, form, scale, key_padding_mask, precision, gpu_tiles, has_init, has_idx,
          pool_out, hybrid, *_alignment):  # fmt: skip
    """What :func:`rf_recurrent_fwd` derives once per shape (``has_idx``: the initial states are
    rows of a pool, ``pool_out``: and so are the written ones; ``hybrid``: ``(window, sinks)``
    of :func:`rf_hybrid_step`, else None; ``_alignment``: the state's and the index's, in the
    key only): the setup's sizes, the bound launch and its integer arguments."""
    c = launch_setup(q, k, v, form, scale, key_padding_mask, precision, gpu_tiles=gpu_tiles)
    B, H, G, T, E = c.B, c.H, c.G, c.Tq, c.E
    win, nsk = hybrid or (0, 0)
    tiles = 64 if c.gpu_tiles else 16
    launch = Launch(_recurrent_kernel, (B * H,), HAS_PAD=c.has_pad, HAS_INIT=has_init,
                    PLAIN=c.plain, GP=next_pow2(G), HAS_MAP=c.has_map, HAS_IDX=has_idx,
                    POOL_OUT=pool_out, HYBRID=hybrid is not None, HAS_WIN=win > 0,
                    HAS_SINK=nsk > 0, BK=min(tiles, next_pow2(win)), BS=next_pow2(nsk),
                    **c.launch_options(num_warps=4), **c.meta)  # fmt: skip
    out = (H * G * T * E, T * E, E, 1)  # contiguous, made by the launcher
    return Plan(B=B, H=H, G=G, T=T, M=c.M, E=E, acc=c.acc, plain=c.plain, root=c.form_ptrs[0],
                has_pad=c.has_pad, launch=launch, ints=(
                    T, H, G, win, nsk, *q.stride(), *k.stride(), *v.stride(), *c.w.stride(),
                    *c.pad[1:], *out))  # fmt: skip


def rf_recurrent_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: tuple | None = None,
    precision: str | None = None,
    inplace: bool = False,
    gpu_tiles: bool | None = None,
    state_index: torch.Tensor | None = None,
):
    """Causal decode step over ``T <= MAX_TOKENS`` tokens (no gradient).

    Args:
        q: ``[B, H * G, T, D]``; k: ``[B, H, T, D]``; v: ``[B, H, T, E]`` (G query heads per
            key/value head, as ``rf_chunk.rf_chunk_fwd``); form, scale, key_padding_mask,
            precision, gpu_tiles: as ``rf_parallel.rf_parallel_fwd``.
        initial_state: ``(S [B, H, M, E], z [B, H, M], offset [B, H])`` in ``rfattn.RFState``'s
            convention (None: empty). Read, never written, unless ``inplace``.
        inplace: write the new state into ``initial_state``'s own tensors (they must be
            contiguous, in the accumulation dtype, and not needed afterwards: the cache of a
            generation loop) instead of new ones. Either way no copy of the state is made.
        state_index: a pool of states (a server's, for requests of different ages):
            ``initial_state`` holds P states (``[P, H, M, E]``, ...) and row b of the batch
            continues state ``state_index[b]`` (``[B]`` integers on q's device,
            :func:`pool_index`); with ``inplace`` the new states are written into those rows
            of the pool (the indices distinct), else returned as ``[B, ...]``.

    Returns:
        ``(out [B, H * G, T, E], (S, z, offset))``, the state per key/value head (with
        ``state_index`` and ``inplace``: the pool).
    """
    if q.shape[2] != k.shape[2] or q.shape[2] > MAX_TOKENS:
        raise ValueError(f"the decode step takes Tq == Tk <= {MAX_TOKENS} tokens, got "
                         f"{q.shape[2]} and {k.shape[2]}")  # fmt: skip
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if initial_state is None:
        if inplace:
            raise ValueError("inplace=True needs an initial_state to update")
        state = None
    else:
        if inplace and not all(x.dtype == acc and x.is_contiguous() for x in initial_state):
            raise ValueError("inplace=True needs a contiguous state in the accumulation dtype")
        s0, z0, r0 = (x if x.dtype == acc and x.is_contiguous() else x.to(acc).contiguous()
                      for x in initial_state)  # fmt: skip
        # the state's alignment is the plan's (Triton specialises on it; in place, no copy)
        state = (s0.data_ptr() % 16, z0.data_ptr() % 16, r0.data_ptr() % 16)
    idx = None
    if state_index is not None:
        if state is None:
            raise ValueError("state_index needs an initial_state: the pool it indexes")
        idx = pool_index(state_index, q.shape[0], s0.shape[0], q.device, distinct=inplace)
        state = (*state, idx.data_ptr() % 16)
    p = shape_plan(_PLANS, _plan, q, k, v, form, scale, key_padding_mask, precision, gpu_tiles,
                   state is not None, idx is not None, inplace and idx is not None, None,
                   *(state or ()))  # fmt: skip
    B, H, G, T, M, E, dev = p.B, p.H, p.G, p.T, p.M, p.E, q.device
    w, *ptrs = form_args(form, B, H * G, H, acc, dev)
    if state is None:
        s0 = z0 = r0 = w  # never read
    elif idx is not None and (s0.shape[1:] != (H, M, E) or z0.shape != (s0.shape[0], H, M) or
                              r0.shape != (s0.shape[0], H)):  # fmt: skip
        raise ValueError(f"a pool of states must be (S [P, {H}, {M}, {E}], z [P, {H}, {M}], "
                         f"offset [P, {H}]) with one P, got {tuple(s0.shape)}, "
                         f"{tuple(z0.shape)}, {tuple(r0.shape)}")  # fmt: skip
    if inplace:
        s, z, r = s0, z0, r0
    else:
        s, z, r = (torch.empty(B, H, M, E, device=dev, dtype=acc),
                   torch.empty(B, H, M, device=dev, dtype=acc),
                   torch.empty(B, H, device=dev, dtype=acc))  # fmt: skip
    out = torch.empty(B, H * G, T, E, device=dev, dtype=q.dtype)
    if T == 0:  # no token: the state passes through (the kernel would write nothing)
        if state is None:
            s.zero_(), z.zero_(), r.fill_(0.0 if p.plain else float("-inf"))
        elif not inplace:
            rows = (s0, z0, r0) if idx is None else (x.index_select(0, idx) for x in (s0, z0, r0))
            for a, b in zip((s, z, r), rows, strict=True):
                a.copy_(b)
        return out, (s, z, r)
    if B * H:
        pad = mask_rows(key_padding_mask) if p.has_pad else w
        p.launch(q, k, v, w, pad, p.root, *ptrs, s0, z0, r0, s, z, r, out,
                 w if idx is None else idx, *(w,) * 12, 1.0, 1.0, *p.ints)  # fmt: skip
    return out, (s, z, r)


def rf_hybrid_step(q, k, v, form, scale: float, key_padding_mask, state: tuple, window: int,
                   sinks: int, inv_n: float, precision: str | None = None,
                   gpu_tiles: bool | None = None,
                   state_index: torch.Tensor | None = None):  # fmt: skip
    """The hybrid's decode step (``rfattn.hybrid``: exact sinks and window inside the features,
    one normaliser) for one token, in one launch (no gradient).

    Args:
        q: ``[B, H * G, 1, D]``; k: ``[B, H, 1, D]``; v: ``[B, H, 1, E]``; form, scale,
            key_padding_mask (``[B, 1]``), precision, gpu_tiles: as :func:`rf_recurrent_fwd`.
        state: the fields of ``rfattn.hybrid.HybridState`` (the features' state in the torch
            path's units, the window's keys and values and the sink slots in q's dtype; made
            contiguous where they are not).
        window, sinks: the state's W and S.
        inv_n: 1 / the feature map's sample count (the state's units).
        state_index: ``state`` is a pool of P hybrid states (every field ``[P, ...]``), a
            server's for requests of different ages, and batch row b continues state
            ``state_index[b]`` (``[B]`` integers on q's device, checked as
            :func:`rf_recurrent_fwd` checks its own; repeats allowed: nothing is written in
            place).

    Returns:
        ``(out [B, H * G, 1, E], the HybridState's fields one token on)``, new ``[B, ...]``
        tensors.
    """
    if q.shape[2] != 1 or k.shape[2] != 1:
        raise ValueError(f"the hybrid's decode step takes one token, got {q.shape[2]}")
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s0, z0, r0, wk, wv, kinds, sk, sv, seen = (
        x.to(dtype).contiguous()
        for x, dtype in zip(state, (acc, acc, acc, q.dtype, q.dtype, torch.int8, q.dtype,
                                    q.dtype, torch.int64), strict=True)
    )  # fmt: skip
    idx = None
    if state_index is not None:
        idx = pool_index(state_index, q.shape[0], s0.shape[0], q.device, distinct=False)
    align = tuple(x.data_ptr() % 16 for x in (s0, z0, r0))
    p = shape_plan(_PLANS, _plan, q, k, v, form, scale, key_padding_mask, precision, gpu_tiles,
                   True, idx is not None, False, (window, sinks), *align)  # fmt: skip
    B, H, G, M, E, dev = p.B, p.H, p.G, p.M, p.E, q.device
    w, *ptrs = form_args(form, B, H * G, H, acc, dev)
    new = (torch.empty(B, H, M, E, device=dev, dtype=acc),
           torch.empty(B, H, M, device=dev, dtype=acc), torch.empty(B, H, device=dev, dtype=acc),
           *(x.new_empty(B, *x.shape[1:]) for x in (wk, wv, kinds, sk, sv, seen)))  # fmt: skip
    out = torch.empty(B, H * G, 1, E, device=dev, dtype=q.dtype)
    if B * H:
        pad = mask_rows(key_padding_mask) if p.has_pad else w
        p.launch(q, k, v, w, pad, p.root, *ptrs, s0, z0, r0, *new[:3], out,
                 w if idx is None else idx, wk, wv, kinds, sk, sv, seen, *new[3:], scale, inv_n,
                 *p.ints)  # fmt: skip
    return out, new


def pool_index(state_index: torch.Tensor, batch: int, pool: int, device,
               distinct: bool) -> torch.Tensor:  # fmt: skip
    """``state_index`` checked as the rows of a pool of ``pool`` states that a batch of ``batch``
    continues, as int64 ``[batch]`` (contiguous): its type, shape and device at once, its values
    (in ``[0, pool)``; ``distinct``: no row twice, as an in-place update needs) by asserts that
    run on the device, without reading them on the host (an error surfaces at the next sync on
    CUDA, at once on the CPU)."""
    if not isinstance(state_index, torch.Tensor) or state_index.dtype.is_floating_point or \
            state_index.dtype.is_complex or state_index.dtype == torch.bool:  # fmt: skip
        raise TypeError(f"state_index must be an integer tensor, got "
                        f"{getattr(state_index, 'dtype', type(state_index).__name__)}")  # fmt: skip
    if tuple(state_index.shape) != (batch,):
        raise ValueError(f"state_index must have shape [B] = [{batch}], got "
                         f"{tuple(state_index.shape)}")  # fmt: skip
    if state_index.device != device:
        raise ValueError(f"state_index is on {state_index.device}, expected {device}")
    idx = state_index.to(torch.int64).contiguous()
    if batch:
        torch._assert_async(((idx >= 0) & (idx < pool)).all(),
                            f"state_index must lie in [0, {pool}): the pool's rows")  # fmt: skip
    if distinct and batch > 1:
        sorted_ = idx.sort().values
        torch._assert_async((sorted_[1:] != sorted_[:-1]).all(),
                            "state_index must not repeat a row for an in-place update")  # fmt: skip
    return idx
