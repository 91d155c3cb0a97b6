"""Fused non-causal random-feature attention, forward and backward, per (b, h):

    x~ = sqrt(scale) * q (or k)                                  [T, D]
    phi_f(x~) = g_f(x~) exp(u_f(x~) - offset)                    [T, F]   (feature form below)
    b_j = phi(k~_j) with offsets m_K,f (per (b, h) and feature f, the max over valid keys)
    a_i = g exp(u(q~_i) + m_K - m_i) (the key offsets move to the query side, m_i its row max)
    S = sum_j b_j v_j^T   z = sum_j b_j                          [F, E], [F]   (accumulator dtype)
    out_i = a_i S / a_i z                                        [T, E]

Forward, two launches (phi never touches HBM):

1. key pass ``_fwd_kv_kernel``, grid (F tiles, T splits, B*H): projection on ``tl.dot``, feature
   epilogue, running max ``m_f`` of each feature's logits over the program's keys with
   flash-style rescaling of the partial (S, z) rows; writes the partial (m, S, z). The split
   of a feature tile that finishes last (an arrival counter, below) merges them: ``m_K,f`` =
   max of the partial maxima, partials rescaled by ``exp(m_f - m_K,f)`` and summed in split
   order (deterministic); with one split the program writes (S, z, m_K) itself;
2. query pass ``_fwd_q_kernel``, grid (Tq tiles, B*H): features (logits plus ``m_K``) per F
   tile with an online per-row max, ``out = num / den`` with the denominator policy of
   ``rfattn.reference.safe_denominator`` (``|den| < tiny`` -> ``sign(den) tiny``, sign of 0 +);
   saves the row max m_i and den_i for the backward (with ``OUT_LO``, fp16/bf16 outputs where a
   gradient follows, also the output's rounding residual, ``common.store_out``: the backward's
   ``c_i`` reads the output to ~16 bits, not as rounded to the input dtype).

oprf and saderf whose per-(b, h) parameters come from the call's statistics (a form left to the
key pass: ``rf_parallel_fwd``'s ``stats``) take no launch of their own for them: the key pass
``_fwd_kv_stats_kernel`` forms them first, in its launch (below).

Merging inside the key pass, not in a launch of its own nor in the query pass: each split
program stores its partial, then adds 1 to its tile's arrival counter (one int32 per (b, h) and
F tile, ``tl.atomic_add``, acq_rel, after a barrier); the program that sees NUM_SPLITS - 1
reads every partial in split order, writes the merged tile and resets the counter to 0, so the
counters (``common.arrival_counters``, zeroed once per device and stream) need no fill per call.
Summing the partials in the query pass instead would read NUM_SPLITS states per query tile:
at B4 H16 M256 E64 on an H100 (2 splits) about 69 MB more L2 reads at T = 1024 and 1.1 GB at
T = 16384, against 8.7 MB read once by the merging programs; and the backward and the sharded
path (``combine``) need the merged state anyway.
Per-feature key offsets keep the largest term ``exp(u_q,if + u_k,jf)`` of every row exactly 1
after stabilisation, whatever the spread of the logits across features (oprf/saderf at large
norms spread them by hundreds; one offset per (b, h) made whole rows underflow to 0).

The key pass with statistics, one launch and no grid barrier (a grid-wide barrier deadlocks
when not every program of the grid is resident at once): roles by ticket, as decoupled
look-back scans assign them. Every program first takes a ticket (one ``tl.atomic_add`` on a
counter, in the order programs start, whatever their ids); tickets ``0 .. NSTAT-1`` are stats
roles, which reduce the work items ``ticket, ticket + NSTAT, ...`` of ``stats.stats_item``
(moments of q and k; the (b, h)'s last item forms A, B, log D, psi and stores them), later
tickets key-pass roles, (b, h) major, then split, then feature tile: each waits for its (b, h)'s
parameters, then runs :func:`key_tile` with them. A key-pass role waits only for stats roles,
whose tickets are smaller, so taken by programs that are already running and that wait for
nothing: this cannot deadlock, whatever the number of resident programs and the order the
hardware starts them; and the statistics are reduced from q and k once, not per program.

Memory ordering: the stats item that completes a (b, h) stores its parameters, then a CTA
barrier orders every thread's stores before one ``atomic_xchg`` of the (b, h)'s ready flag to 1
with release semantics at GPU scope (cumulative: the barrier-ordered stores of the other threads
become visible with it). A waiting role spins on ``atomic_add(flag, 0)`` with acquire semantics
at GPU scope until it reads 1, then a CTA barrier orders its threads' loads after the acquire,
and it loads the parameters with ``.cg`` (from L2, not an L1 line cached before). The interpreter
runs programs one after another in program order: tickets are program ids, every stats role has
finished before the first key-pass role starts, and the spin reads 1 at once; it checks the
roles' arithmetic, not this ordering nor the absence of a deadlock, which rest on the argument
above and the GPU tests. The launch's last program (an arrival counter over every program,
``common.last_to_arrive``, which resets itself) sets the ticket and the flags back to 0, so
the next launch on the stream finds its counters at 0 as every other launch leaves them.

``RUNNING`` (a training call with running statistics): the parameters come from the running
buffers as they are, data-independent, so key-pass roles do not wait: each forms them from the
buffers (``stats.running_params``) and the role of split 0, feature tile 0 of each (b, h)
stores them for the query pass and the backward; the stats roles only reduce the moments, and
the launch's last program, after every key-pass role has read the buffers, pools the moments
into them (``stats.running_update``).

Backward (features recomputed, never stored; same offsets m_i, m_K as the forward). With
``g_i = do_i / den_i`` and ``c_i = -(do_i . out_i) / den_i``:

    da_i = S g_i + c_i z          dS = sum_i a_i g_i^T          dz = sum_i c_i a_i
    db_j = dS v_j + dz            dv_j = dS^T b_j
    phi = g e (e = exp(u - offset)):  du = phi * dphi,  dg = e * dphi   (dphi = da or db)
    dx~ = du du/dx~ + dg dg/dx~;  dq = sqrt(scale) psi dx~;  dW likewise (per feature row)

3. ``_bwd_ds_kernel``, grid (F tiles, Tq splits, B*H): partial dS, dz, summed in split order by
   the split that finishes last (the key pass's arrival counters), and partial dW from queries;
4. ``_bwd_dqkv_kernel``, grid (Tq tiles + Tk tiles, B*H): dq of a query tile, or dk, dv of a
   key tile (one launch: the first cdiv(Tq, BT) programs take the queries);
5. ``_bwd_dwk_kernel``, grid (F tiles, Tk splits, B*H): dW from keys (only when needed).
The dW partials of both sides are summed in one torch ``sum`` (a fixed order; learnable W only).
The atomics only count arrivals: every sum runs in a fixed order (bitwise repeatable).

Feature forms: ``kernels/common.py`` (``FEATURE``: 0 gerf, 1 table, 2 rmf).

Padded keys (``key_padding_mask`` True) and rows past T are excluded from m_K, S, z and get zero
gradients; their contents are never used. A (b, h) without valid keys gives zeros.
Reference: ``rfattn.reference.linear_attention`` on ``RandomFeatures.features`` (float64, same W).

Layout: q, k ``[B, H, T, D]``, v ``[B, H, T, E]`` with arbitrary strides; w ``[F, D]``.
Packed sequences (``VARLEN``, ``rf_parallel_fwd``'s ``packed``): q, k, v ``[1, H, total, .]``
and b in every grid is sequence b, its tokens found by the offsets (``common.sequence``); the
grids are those of N rows of the longest sequence, and a tile or split past b's end does
nothing (a tile returns, a split walks no token: the empty partial, m = NEG, which the merge
weighs exp(NEG - m_K) = 0, or the sequence's m_K = NEG when it has no key at all).
Limits: inputs fp32/fp16/bf16/fp64, one dtype; w and the extra rows stay in the accumulation
dtype. fp16/bf16 inputs run the half policy (``common.precision_policy``, docs/numerics.md): the
logits as two (signed tables: three) half products of the exact rows against W split in the
kernel, every other product one half product (the query pass's signed features two), operands
rounded to the input dtype just before it. Accumulation is fp32 (fp64 for fp64 inputs).
Any D, E, F (tiles padded to powers of two >= 16; register pressure grows with D and E, meant
for <= 256), any T >= 0, Tq != Tk.
The coefficient table, tau and the per-(b, h) parameters are held constant: no gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    FEATURE_IDS,
    INTERPRET,
    KEY,
    NEG,
    PRUNE,
    Launch,
    Plan,
    Scratch,
    aligned,
    arrival_counters,
    autotune_configs,
    backward_strides,
    cdiv,
    check_forward_only,
    feature_dw,
    feature_dx,
    feature_tile,
    form_args,
    gerf_coeffs,
    input_scale,
    keeps_out_residual,
    last_to_arrive,
    launch_setup,
    load_mapped,
    load_rows,
    load_w,
    mask_rows,
    plan_cache,
    product,
    query_rows,
    ratio,
    sequence,
    shape_plan,
    span,
    split_counts,
    store_out,
    store_tile,
    valid_keys,
    varlen_key,
)
from .stats import (
    key_pass_arguments,
    key_pass_counters,
    key_pass_key,
    key_pass_plan,
    ready_params,
    running_params,
    running_update,
    stats_item,
    store_params,
)

__all__ = ["rf_parallel_fwd", "rf_parallel_bwd", "FEATURE_IDS", "INTERPRET"]


@triton.jit
def _store_rows(s_ptr, z_ptr, i_row, o_f, o_e, m_f, m_e, b_s, b_z,
                 M: tl.constexpr, E: tl.constexpr):  # fmt: skip
    """One feature tile's (S or dS [BM, BE], z or dz [BM]) at row ``i_row`` of [rows, M, E] /
    [rows, M] buffers."""
    p_s = s_ptr + i_row * M * E + o_f[:, None] * E + o_e[None, :]
    tl.store(p_s, b_s, mask=m_f[:, None] & m_e[None, :])
    tl.store(z_ptr + i_row * M + o_f, b_z, mask=m_f)


@triton.jit
def _merge_state(
    sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr, mk_ptr, i_bh, o_f, o_e, m_f, m_e, NUM_SPLITS,
    M: tl.constexpr, E: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """S, z of one feature tile of one (b, h) from its splits' partials, rescaled to the
    per-feature offsets ``m_K,f`` (the max of the partial maxima) and summed in split order
    (deterministic). ``.cg`` loads: other programs wrote them during this launch."""
    b_off = tl.full([BM], NEG, dtype=ACC)
    for i_s in range(0, NUM_SPLITS):
        i_part = i_bh * NUM_SPLITS + i_s
        b_mp = tl.load(mp_ptr + i_part * M + o_f, mask=m_f, other=NEG, cache_modifier=".cg")
        b_off = tl.maximum(b_off, b_mp)
    b_s = tl.zeros([BM, BE], dtype=ACC)
    b_z = tl.zeros([BM], dtype=ACC)
    for i_s in range(0, NUM_SPLITS):
        i_part = i_bh * NUM_SPLITS + i_s
        b_mp = tl.load(mp_ptr + i_part * M + o_f, mask=m_f, other=NEG, cache_modifier=".cg")
        b_alpha = tl.exp(b_mp - b_off)  # [BM]
        p_s = sp_ptr + i_part * M * E + o_f[:, None] * E + o_e[None, :]
        b_sp = tl.load(p_s, mask=m_f[:, None] & m_e[None, :], other=0.0, cache_modifier=".cg")
        b_s += b_alpha[:, None] * b_sp
        b_zp = tl.load(zp_ptr + i_part * M + o_f, mask=m_f, other=0.0, cache_modifier=".cg")
        b_z += b_alpha * b_zp
    _store_rows(s_ptr, z_ptr, i_bh, o_f, o_e, m_f, m_e, b_s, b_z, M, E)
    tl.store(mk_ptr + i_bh * M + o_f, b_off, mask=m_f)


@triton.jit
def key_tile(
    i_m, i_s, i_bh, b_ca, b_cb, b_cd, b_sc,
    k_ptr, v_ptr, w_ptr, pad_ptr, tab_ptr, xr_ptr, xi_ptr, kmap_ptr,
    sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr, mk_ptr, cnt_ptr, cu_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_LAM: tl.constexpr, TINY: tl.constexpr, HAS_MAP: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """(m, S, z) of feature tile i_m over T split i_s of (b, h) i_bh, with the (b, h)'s
    (A, B, log D) and key input scale ``b_sc`` [BD]; the last split to finish merges the tile's
    partials. VARLEN: b is packed sequence b of the row, its keys by ``cu_ptr``
    (:func:`common.sequence`)."""
    NMT: tl.constexpr = (M + BM - 1) // BM
    i_h = i_bh % H
    i_b, k0, T, _ = sequence(cu_ptr, i_bh, H, T, 0, VARLEN)
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh + k0 * stride_kt
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh + k0 * stride_vt
    p_pad = pad_ptr + k0 * stride_pt

    b_s = tl.zeros([BM, BE], dtype=ACC)
    b_z = tl.zeros([BM], dtype=ACC)
    b_mx = tl.full([BM], NEG, dtype=ACC)  # per feature
    t0 = i_s.to(tl.int64) * t_per_split
    for t in range(0, span(t0, t_per_split, T, VARLEN), BT):
        o_t = t0 + t + tl.arange(0, BT)
        m_t = valid_keys(p_pad, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
        b_x = load_mapped(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, kmap_ptr, i_h, D, BT,
                           BD, HAS_MAP, PRECISION, ACC)  # fmt: skip
        b_u, b_g, b_g1, b_g2 = feature_tile(
            b_x * b_sc[None, :], b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr,
            xi_ptr, i_m, M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY, b_x, b_sc,
            HAS_MAP)  # [BT, BM]  # fmt: skip
        b_u = tl.where(m_t[:, None] & m_f[None, :], b_u, float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(b_u, axis=0))  # [BM]
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_p = b_g * tl.exp(b_u - b_mx_new[None, :])  # [BT, BM], 0 on invalid rows / features
        p_v = v_base + o_t[:, None] * stride_vt + o_e[None, :] * stride_ve
        b_v = tl.load(p_v, mask=m_t[:, None] & m_e[None, :], other=0.0)  # padded values unread
        # [BM, BT] @ [BT, BE] -> [BM, BE]
        b_pv = product(tl.trans(b_p), b_v, PRECISION, ACC, FEATURE != 0)
        b_s = b_s * b_alpha[:, None] + b_pv
        b_z = b_z * b_alpha + tl.sum(b_p, axis=0)
        b_mx = b_mx_new

    if NUM_SPLITS == 1:  # the program's own (S, z, m) are the tile's
        _store_rows(s_ptr, z_ptr, i_bh, o_f, o_e, m_f, m_e, b_s, b_z, M, E)
        tl.store(mk_ptr + i_bh * M + o_f, b_mx, mask=m_f)
    else:
        # partial index: [B*H, NUM_SPLITS]; counter: [B*H, feature tiles]
        i_part = i_bh * NUM_SPLITS + i_s
        _store_rows(sp_ptr, zp_ptr, i_part, o_f, o_e, m_f, m_e, b_s, b_z, M, E)
        tl.store(mp_ptr + i_part * M + o_f, b_mx, mask=m_f)
        if last_to_arrive(cnt_ptr + i_bh * NMT + i_m, NUM_SPLITS):
            _merge_state(sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr, mk_ptr, i_bh, o_f, o_e, m_f, m_e,
                         NUM_SPLITS, M, E, BM, BE, ACC)  # fmt: skip


@triton.autotune(configs=autotune_configs(), key=KEY, prune_configs_by=PRUNE)
@triton.jit
def _fwd_kv_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    kmap_ptr, sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr, mk_ptr, cnt_ptr, cu_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_MAP: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """(m, S, z) of one feature tile over one T split of one (b, h) (:func:`key_tile`)."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    o_d = tl.arange(0, BD)
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, o_d < D, D, BD, HAS_PSI, True, ACC)  # [BD]
    key_tile(i_m, i_s, i_bh, b_ca, b_cb, b_cd, b_sc, k_ptr, v_ptr, w_ptr, pad_ptr, tab_ptr, xr_ptr,
             xi_ptr, kmap_ptr, sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr, mk_ptr, cnt_ptr, cu_ptr,
             T, H, NUM_SPLITS, t_per_split,
             stride_kb, stride_kh, stride_kt, stride_kd,
             stride_vb, stride_vh, stride_vt, stride_ve,
             stride_wm, stride_wd, stride_pb, stride_pt,
             D, M, E, BD, BM, BE, BT, HAS_PAD, FEATURE, PRECISION, ACC, HAS_LAM, TINY,
             HAS_MAP, VARLEN)  # fmt: skip


@triton.autotune(configs=autotune_configs(), key=KEY + ["FORM"], prune_configs_by=PRUNE)
@triton.jit
def _fwd_kv_stats_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    kmap_ptr, sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr, mk_ptr, cnt_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    q_ptr, qpad_ptr, part_ptr, pcnt_ptr, mom_ptr, run_mean, run_sq, run_abs, run_min, nbt_ptr,
    keep: tl.float64, momentum: tl.float64, tiny: tl.float64, psi_lo: tl.float64,
    psi_hi: tl.float64,
    BH, RQ, TQ, TK, NSTAT, SQ, SK, q_per, k_per,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_qpb, stride_qpt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_QPAD: tl.constexpr, FORM: tl.constexpr, RUNNING: tl.constexpr,
    BB: tl.constexpr, RACC: tl.constexpr,
):  # fmt: skip
    """The stats pass and the key pass in one launch, roles by ticket (module docstring): a
    stats role reduces work items of ``stats.stats_item``, a key-pass role runs
    :func:`key_tile` once its (b, h)'s parameters are ready; the launch's last program resets
    the ticket and the flags, and with RUNNING updates the running buffers."""
    NMT: tl.constexpr = (M + BM - 1) // BM
    p_arrive = cnt_ptr + BH * NMT  # [BH] arrivals of the stats items of each (b, h)
    p_flag = p_arrive + BH  # [BH] 1 once the (b, h)'s parameters are stored
    p_ticket = p_flag + BH  # then the ticket counter, then the launch's arrivals
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    # fp64 arguments as ACC (tl.full: the interpreter passes them as Python floats)
    b_tiny = tl.full([], tiny, ACC)
    b_lo, b_hi = tl.full([], psi_lo, ACC), tl.full([], psi_hi, ACC)
    ticket = tl.atomic_add(p_ticket, 1, sem="relaxed")
    if ticket < NSTAT:  # a stats role: items ticket, ticket + NSTAT, ...
        for w in range(ticket, BH * (SQ + SK), NSTAT):
            done = stats_item(
                w, q_ptr, k_ptr, qpad_ptr, pad_ptr, part_ptr, pcnt_ptr, p_arrive, mom_ptr, ab_ptr,
                psi_ptr, tl.full([], scale, ACC), b_tiny, b_lo, b_hi, BH, RQ, TQ, 1, T, TK, H,
                SQ, SK, q_per, k_per, stride_qb, stride_qh, stride_qt, stride_qd, stride_kb,
                stride_kh, stride_kt, stride_kd, stride_qpb, stride_qpt, stride_pb, stride_pt,
                D, BD, BT, HAS_QPAD, HAS_PAD, FORM, RUNNING, ACC)  # fmt: skip
            if not RUNNING:
                if done:  # release: every thread's parameter stores before the flag
                    tl.debug_barrier()
                    tl.atomic_xchg(p_flag + w // (SQ + SK), 1, sem="release")
    else:  # a key-pass role: (b, h) major, then split, then feature tile
        r = ticket - NSTAT
        i_bh = (r // (NMT * NUM_SPLITS)).to(tl.int64)
        i_s = (r // NMT) % NUM_SPLITS
        i_m = r % NMT
        if RUNNING:  # the buffers as they are: no wait (they move after every role is done)
            b_ca, b_cb, b_cd, b_psi = running_params(run_mean, run_sq, D, b_tiny, b_lo, b_hi,
                                                     o_d, m_d, FORM, ACC)  # fmt: skip
            if (i_s == 0) & (i_m == 0):  # for the query pass and the backward
                store_params(ab_ptr, psi_ptr, i_bh, b_ca, b_cb, b_cd, b_psi, D, o_d, m_d, FORM)
        else:  # acquire: wait for the (b, h)'s stats role (a smaller ticket: it is running)
            b_ready = tl.atomic_add(p_flag + i_bh, 0, sem="acquire")
            while b_ready == 0:
                b_ready = tl.atomic_add(p_flag + i_bh, 0, sem="acquire")
            tl.debug_barrier()
            b_ca, b_cb, b_cd, b_psi = ready_params(ab_ptr, psi_ptr, i_bh, D, o_d, m_d, BD, FORM,
                                                   ACC)  # fmt: skip
        b_sc = tl.full([BD], scale, ACC) / b_psi  # keys: sqrt(scale) / psi
        key_tile(i_m, i_s, i_bh, b_ca, b_cb, b_cd, b_sc, k_ptr, v_ptr, w_ptr, pad_ptr, tab_ptr,
                 xr_ptr, xi_ptr, kmap_ptr, sp_ptr, zp_ptr, mp_ptr, s_ptr, z_ptr, mk_ptr, cnt_ptr,
                 cnt_ptr, T, H, NUM_SPLITS, t_per_split,
                 stride_kb, stride_kh, stride_kt, stride_kd,
                 stride_vb, stride_vh, stride_vt, stride_ve,
                 stride_wm, stride_wd, stride_pb, stride_pt,
                 D, M, E, BD, BM, BE, BT, HAS_PAD, FEATURE, PRECISION, ACC, HAS_LAM, TINY,
                 HAS_MAP, False)  # fmt: skip
    if last_to_arrive(p_ticket + 1, NSTAT + BH * NMT * NUM_SPLITS):  # the launch's last
        tl.store(p_ticket, 0)
        for i0 in range(0, BH, 1024):
            o_b = i0 + tl.arange(0, 1024)
            tl.store(p_flag + o_b, tl.zeros([1024], dtype=tl.int32), mask=o_b < BH)
        if RUNNING:
            running_update(mom_ptr, run_mean, run_sq, run_abs, run_min, nbt_ptr, BH, D, keep,
                           momentum, o_d, m_d, BD, BB, ACC, RACC)  # fmt: skip


# the same kernel for the running mode: restore_value, since tuning runs the kernel once per
# config and the running buffers move only once
_fwd_kv_running_kernel = triton.autotune(
    configs=autotune_configs(), key=KEY + ["FORM"], prune_configs_by=PRUNE,
    restore_value=["run_mean", "run_sq", "run_abs", "run_min", "nbt_ptr"],
)(_fwd_kv_stats_kernel.fn)


@triton.autotune(configs=autotune_configs(), key=KEY, prune_configs_by=PRUNE)
@triton.jit
def _fwd_q_kernel(
    q_ptr, w_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr, qmap_ptr,
    s_ptr, z_ptr, mk_ptr, o_ptr, olo_ptr, mq_ptr, den_ptr, cu_ptr,
    T, H, TR,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_MAP: tl.constexpr, OUT_LO: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """out [BT, E] of one query tile of one (b, h): online per-row max over feature tiles (with
    OUT_LO, a half output's rounding residual at ``olo_ptr`` too, for the backward). VARLEN: b
    is packed sequence b, its queries by ``cu_ptr`` (a tile past its end returns at once)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_h = i_bh % H
    i_b, q0, T, i_r = sequence(cu_ptr, i_bh, H, T, TR, VARLEN)
    if VARLEN:
        if i_t * BT >= T:
            return
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_t, m_d, m_e = o_t < T, o_d < D, o_e < E
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)  # [BD]
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh + q0 * stride_qt
    b_x = load_mapped(q_base, o_t, o_d, stride_qt, stride_qd, m_t, m_d, qmap_ptr, i_h, D, BT, BD,
                       HAS_MAP, PRECISION, ACC)  # fmt: skip
    b_xs = b_x * b_sc[None, :]
    b_mx = tl.full([BT], NEG, dtype=ACC)
    b_num = tl.zeros([BT, BE], dtype=ACC)
    b_den = tl.zeros([BT], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_u, b_g, b_g1, b_g2 = feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY, b_x, b_sc,
            HAS_MAP)  # [BT, BM]  # fmt: skip
        b_mk = tl.load(mk_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # key offsets
        b_u = tl.where(m_f[None, :], b_u + b_mk[None, :], float("-inf"))
        b_mx_new = tl.maximum(b_mx, tl.max(b_u, axis=1))  # [BT]
        b_alpha = tl.exp(b_mx - b_mx_new)
        b_p = b_g * tl.exp(b_u - b_mx_new[:, None])  # [BT, BM]
        p_s = s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :]
        b_s = tl.load(p_s, mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]
        b_z = tl.load(z_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        # [BT, BM] @ [BM, BE] -> [BT, BE]; signed features' a split in two (the half policy):
        # rounded once, rmf's output erred 2.2x the torch path's in bf16 (T = 100, M = 128)
        b_num = b_num * b_alpha[:, None] + product(b_p, b_s, PRECISION, ACC, FEATURE != 0, True)
        b_den = b_den * b_alpha + tl.sum(b_p * b_z[None, :], axis=1)
        b_mx = b_mx_new
    b_o, b_den = ratio(b_num, b_den, TINY)
    store_out(o_ptr, olo_ptr, i_b, i_h, q0 + o_t, o_e, stride_ob, stride_oh, stride_ot,
              stride_oe, b_o, m_t, m_e, OUT_LO)  # fmt: skip
    tl.store(mq_ptr + i_r + o_t, b_mx, mask=m_t)
    tl.store(den_ptr + i_r + o_t, b_den, mask=m_t)


@triton.autotune(configs=autotune_configs(), key=KEY + ["W_GRAD"], prune_configs_by=PRUNE)
@triton.jit
def _bwd_ds_kernel(
    q_ptr, w_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    s_ptr, z_ptr, mk_ptr, o_ptr, olo_ptr, do_ptr, mq_ptr, den_ptr, dsp_ptr, dzp_ptr, dwp_ptr,
    ds_ptr, dz_ptr, cnt_ptr, cu_ptr,
    T, H, NUM_SPLITS, t_per_split, TR,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    W_GRAD: tl.constexpr, OUT_LO: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """dS [BM, E], dz [BM] over one Tq split (the last split to finish sums the tile's
    partials), and the partial dW from queries [BM, D]. VARLEN: as the query pass's."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_h = i_bh % H
    i_b, q0, T, i_r = sequence(cu_ptr, i_bh, H, T, TR, VARLEN)
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)  # [BD]
    b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    b_s = tl.load(s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                  mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
    b_z = tl.load(z_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
    b_mk = tl.load(mk_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM] key offsets
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh + q0 * stride_qt
    o_base = o_ptr + i_b * stride_ob + i_h * stride_oh + q0 * stride_ot
    olo_base = olo_ptr + i_b * stride_ob + i_h * stride_oh + q0 * stride_ot
    do_base = do_ptr + i_b * stride_dob + i_h * stride_doh + q0 * stride_dot

    b_ds = tl.zeros([BM, BE], dtype=ACC)
    b_dz = tl.zeros([BM], dtype=ACC)
    b_dw = tl.zeros([BM, BD], dtype=ACC)
    t0 = i_s.to(tl.int64) * t_per_split
    for t in range(0, span(t0, t_per_split, T, VARLEN), BT):
        o_t = t0 + t + tl.arange(0, BT)
        m_t = o_t < T
        b_x = load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_t, m_d, ACC)
        b_xs = b_x * b_sc[None, :]
        b_mq = tl.load(mq_ptr + i_r + o_t, mask=m_t, other=0.0)
        b_u, b_g, b_g1, b_g2 = feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY, b_x, b_sc)  # [BT, BM]  # fmt: skip
        b_e = tl.where(m_t[:, None] & m_f[None, :],
                       tl.exp(b_u + b_mk[None, :] - b_mq[:, None]), 0.0)  # fmt: skip
        b_a = b_g * b_e
        b_do, b_den, b_c = query_rows(do_base, o_base, olo_base, den_ptr + i_r, 0, o_t, o_e, 0,
                                      m_t, m_e, stride_dot, stride_doe, stride_ot, stride_oe, ACC,
                                      OUT_LO)  # fmt: skip
        # dS = a^T g = (a / den)^T do: [BM, BT] @ [BT, BE] -> [BM, BE]
        b_ds += product(tl.trans(b_a / b_den[:, None]), b_do, PRECISION, ACC, FEATURE != 0)
        b_dz += tl.sum(b_a * b_c[:, None], axis=0)
        if W_GRAD:
            # da = g S^T + c z: [BT, BE] @ [BE, BM] -> [BT, BM]
            b_da = (
                product(b_do, tl.trans(b_s), PRECISION, ACC) / b_den[:, None]
                + b_c[:, None] * b_z[None, :]
            )
            # [BM, BT] @ [BT, BD] -> [BM, BD]
            b_dw += feature_dw(b_a * b_da, b_e * b_da, b_g1, b_xs, b_w, o_f, m_f, b_ca, b_cb,
                                tab_ptr, M, FEATURE, False, PRECISION)  # fmt: skip

    i_part = i_bh * NUM_SPLITS + i_s
    if NUM_SPLITS == 1:
        _store_rows(ds_ptr, dz_ptr, i_bh, o_f, o_e, m_f, m_e, b_ds, b_dz, M, E)
    else:
        _store_rows(dsp_ptr, dzp_ptr, i_part, o_f, o_e, m_f, m_e, b_ds, b_dz, M, E)
        if last_to_arrive(cnt_ptr + i_bh * tl.num_programs(0) + i_m, NUM_SPLITS):
            # the splits' partials summed in split order (deterministic)
            b_ds = tl.zeros([BM, BE], dtype=ACC)
            b_dz = tl.zeros([BM], dtype=ACC)
            for j_s in range(0, NUM_SPLITS):
                j_part = i_bh * NUM_SPLITS + j_s
                b_ds += tl.load(dsp_ptr + j_part * M * E + o_f[:, None] * E + o_e[None, :],
                                mask=m_f[:, None] & m_e[None, :], other=0.0,
                                cache_modifier=".cg")  # fmt: skip
                b_dz += tl.load(dzp_ptr + j_part * M + o_f, mask=m_f, other=0.0,
                                cache_modifier=".cg")  # fmt: skip
            _store_rows(ds_ptr, dz_ptr, i_bh, o_f, o_e, m_f, m_e, b_ds, b_dz, M, E)
    if W_GRAD:
        tl.store(dwp_ptr + i_part * M * D + o_f[:, None] * D + o_d[None, :], b_dw,
                 mask=m_f[:, None] & m_d[None, :])  # fmt: skip


@triton.jit
def _dq_tile(
    i_t, i_bh, q_ptr, w_ptr, scale, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    s_ptr, z_ptr, mk_ptr, o_ptr, olo_ptr, do_ptr, mq_ptr, den_ptr, dq_ptr, cu_ptr,
    T, H, TR,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    OUT_LO: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """dq [BT, D] of query tile i_t: da = g S^T + c z, dq = sqrt(scale) psi dx~. VARLEN: as
    the query pass's."""
    i_h = i_bh % H
    i_b, q0, T, i_r = sequence(cu_ptr, i_bh, H, T, TR, VARLEN)
    if VARLEN:
        if i_t * BT >= T:
            return
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_t, m_d, m_e = o_t < T, o_d < D, o_e < E
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)  # [BD]
    q_base = q_ptr + i_b * stride_qb + i_h * stride_qh + q0 * stride_qt
    b_x = load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_t, m_d, ACC)
    b_xs = b_x * b_sc[None, :]
    b_mq = tl.load(mq_ptr + i_r + o_t, mask=m_t, other=0.0)
    o_off = i_b * stride_ob + i_h * stride_oh + q0 * stride_ot
    b_do, b_den, b_c = query_rows(do_ptr + i_b * stride_dob + i_h * stride_doh + q0 * stride_dot,
                                  o_ptr + o_off, olo_ptr + o_off, den_ptr + i_r, 0, o_t, o_e, 0,
                                  m_t, m_e, stride_dot, stride_doe, stride_ot, stride_oe, ACC,
                                  OUT_LO)  # fmt: skip
    b_dx = tl.zeros([BT, BD], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_s = tl.load(s_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                      mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
        b_z = tl.load(z_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        b_mk = tl.load(mk_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM] key offsets
        b_u, b_g, b_g1, b_g2 = feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY, b_x, b_sc)  # [BT, BM]  # fmt: skip
        b_e = tl.where(m_t[:, None] & m_f[None, :],
                       tl.exp(b_u + b_mk[None, :] - b_mq[:, None]), 0.0)  # fmt: skip
        # da = g S^T + c z: [BT, BE] @ [BE, BM] -> [BT, BM]
        b_da = (
            product(b_do, tl.trans(b_s), PRECISION, ACC, False, True) / b_den[:, None]
            + b_c[:, None] * b_z[None, :]
        )
        b_dxm, b_dh = feature_dx(b_g * b_e * b_da, b_e * b_da, b_g1, b_g2, b_xs, b_w, o_f, m_f,
                                 o_d, m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM, FEATURE,
                                 False, PRECISION, TINY, b_x, b_sc)  # fmt: skip
        b_dx += b_dxm if FEATURE == 2 else b_dxm + b_dh[:, None] * b_xs  # (rmf: no x~ term)
    store_tile(dq_ptr, i_b, i_h, q0 + o_t, o_d, stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                b_dx * b_sc[None, :], m_t, m_d)  # fmt: skip


@triton.jit
def _dkv_tile(
    i_t, i_bh, k_ptr, v_ptr, w_ptr, pad_ptr, scale, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    ds_ptr, dz_ptr, mk_ptr, dk_ptr, dv_ptr, cu_ptr,
    T, H,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dve,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    VARLEN: tl.constexpr,
):  # fmt: skip
    """dk [BT, D], dv [BT, E] of key tile i_t: db = v dS^T + dz, dv = b dS. VARLEN: b is
    packed sequence b, its keys by ``cu_ptr`` (a tile past its end returns at once)."""
    i_h = i_bh % H
    i_b, k0, T, _ = sequence(cu_ptr, i_bh, H, T, 0, VARLEN)
    if VARLEN:
        if i_t * BT >= T:
            return
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_t = i_t.to(tl.int64) * BT + tl.arange(0, BT)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_in, m_d, m_e = o_t < T, o_d < D, o_e < E
    m_t = valid_keys(pad_ptr + k0 * stride_pt, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh + k0 * stride_kt
    b_x = load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, ACC)
    b_xs = b_x * b_sc[None, :]
    b_v = load_rows(v_ptr + i_b * stride_vb + i_h * stride_vh + k0 * stride_vt, o_t, o_e,
                     stride_vt, stride_ve, m_t, m_e, ACC)  # [BT, BE]  # fmt: skip
    b_dx = tl.zeros([BT, BD], dtype=ACC)
    b_dv = tl.zeros([BT, BE], dtype=ACC)
    for i_m in range(0, NMT):
        o_f = i_m * BM + tl.arange(0, BM)
        m_f = o_f < M
        b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
        b_ds = tl.load(ds_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                       mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
        b_dz = tl.load(dz_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        b_mk = tl.load(mk_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
        b_u, b_g, b_g1, b_g2 = feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY, b_x, b_sc)  # [BT, BM]  # fmt: skip
        b_e = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mk[None, :]), 0.0)
        b_b = b_g * b_e
        # db = v dS^T + dz: [BT, BE] @ [BE, BM] -> [BT, BM]
        b_db = product(b_v, tl.trans(b_ds), PRECISION, ACC, False, True) + b_dz[None, :]
        b_dxm, b_dh = feature_dx(b_b * b_db, b_e * b_db, b_g1, b_g2, b_xs, b_w, o_f, m_f, o_d,
                                 m_d, b_cb, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM, FEATURE, True,
                                 PRECISION, TINY, b_x, b_sc)  # fmt: skip
        b_dx += b_dxm if FEATURE == 2 else b_dxm + b_dh[:, None] * b_xs  # (rmf: no x~ term)
        # [BT, BM] @ [BM, BE] -> [BT, BE]
        b_dv += product(b_b, b_ds, PRECISION, ACC, FEATURE != 0, FEATURE != 0)
    store_tile(dk_ptr, i_b, i_h, k0 + o_t, o_d, stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                b_dx * b_sc[None, :], m_in, m_d)  # fmt: skip
    store_tile(dv_ptr, i_b, i_h, k0 + o_t, o_e, stride_dvb, stride_dvh, stride_dvt, stride_dve,
                b_dv, m_in, m_e)  # fmt: skip


@triton.autotune(configs=autotune_configs(), key=KEY, prune_configs_by=PRUNE)
@triton.jit
def _bwd_dqkv_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr,
    xi_ptr, s_ptr, z_ptr, mk_ptr, o_ptr, olo_ptr, do_ptr, mq_ptr, den_ptr, ds_ptr, dz_ptr,
    dq_ptr, dk_ptr, dv_ptr, cuq_ptr, cuk_ptr,
    Tq, Tk, H, TR,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dve,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    OUT_LO: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """dq of query tile i_t for the first cdiv(Tq, BT) programs of axis 0, dk and dv of key tile
    i_t - cdiv(Tq, BT) for the rest: one launch for both (VARLEN: Tq and Tk the longest
    sequence's, the grid's)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    NQT = tl.cdiv(Tq, BT)
    if i_t < NQT:
        _dq_tile(i_t, i_bh, q_ptr, w_ptr, scale, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
                 s_ptr, z_ptr, mk_ptr, o_ptr, olo_ptr, do_ptr, mq_ptr, den_ptr, dq_ptr, cuq_ptr,
                 Tq, H, TR, stride_qb, stride_qh, stride_qt, stride_qd, stride_wm, stride_wd,
                 stride_ob, stride_oh, stride_ot, stride_oe,
                 stride_dob, stride_doh, stride_dot, stride_doe,
                 stride_dqb, stride_dqh, stride_dqt, stride_dqd,
                 D, M, E, BD, BM, BE, BT, FEATURE, PRECISION, ACC, HAS_AB, HAS_PSI, HAS_LAM,
                 TINY, OUT_LO, VARLEN)  # fmt: skip
    else:
        _dkv_tile(i_t - NQT, i_bh, k_ptr, v_ptr, w_ptr, pad_ptr, scale, ab_ptr, psi_ptr, tab_ptr,
                  xr_ptr, xi_ptr, ds_ptr, dz_ptr, mk_ptr, dk_ptr, dv_ptr, cuk_ptr, Tk, H,
                  stride_kb, stride_kh, stride_kt, stride_kd,
                  stride_vb, stride_vh, stride_vt, stride_ve,
                  stride_wm, stride_wd, stride_pb, stride_pt,
                  stride_dkb, stride_dkh, stride_dkt, stride_dkd,
                  stride_dvb, stride_dvh, stride_dvt, stride_dve,
                  D, M, E, BD, BM, BE, BT, HAS_PAD, FEATURE, PRECISION, ACC, HAS_AB, HAS_PSI,
                  HAS_LAM, TINY, VARLEN)  # fmt: skip


@triton.autotune(configs=autotune_configs(), key=KEY, prune_configs_by=PRUNE)
@triton.jit
def _bwd_dwk_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    ds_ptr, dz_ptr, mk_ptr, dwp_ptr, cu_ptr,
    T, H, NUM_SPLITS, t_per_split,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    VARLEN: tl.constexpr,
):  # fmt: skip
    """Partial dW [BM, D] from the keys of one Tk split (VARLEN: as the key pass's)."""
    i_m, i_s, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_h = i_bh % H
    i_b, k0, T, _ = sequence(cu_ptr, i_bh, H, T, 0, VARLEN)
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)  # [BD]
    b_mk = tl.load(mk_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
    b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    b_ds = tl.load(ds_ptr + i_bh * M * E + o_f[:, None] * E + o_e[None, :],
                   mask=m_f[:, None] & m_e[None, :], other=0.0)  # [BM, BE]  # fmt: skip
    b_dz = tl.load(dz_ptr + i_bh * M + o_f, mask=m_f, other=0.0)  # [BM]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh + k0 * stride_kt
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh + k0 * stride_vt
    p_pad = pad_ptr + k0 * stride_pt
    b_dw = tl.zeros([BM, BD], dtype=ACC)
    t0 = i_s.to(tl.int64) * t_per_split
    for t in range(0, span(t0, t_per_split, T, VARLEN), BT):
        o_t = t0 + t + tl.arange(0, BT)
        m_t = valid_keys(p_pad, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
        b_x = load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, ACC)
        b_xs = b_x * b_sc[None, :]
        b_v = load_rows(v_base, o_t, o_e, stride_vt, stride_ve, m_t, m_e, ACC)
        b_u, b_g, b_g1, b_g2 = feature_tile(
            b_xs, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
            M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY, b_x, b_sc)  # [BT, BM]  # fmt: skip
        b_e = tl.where(m_t[:, None] & m_f[None, :], tl.exp(b_u - b_mk[None, :]), 0.0)
        b_db = product(b_v, tl.trans(b_ds), PRECISION, ACC) + b_dz[None, :]
        # [BM, BT] @ [BT, BD] -> [BM, BD]
        b_dw += feature_dw(b_g * b_e * b_db, b_e * b_db, b_g1, b_xs, b_w, o_f, m_f, b_ca, b_cb,
                            tab_ptr, M, FEATURE, True, PRECISION)  # fmt: skip
    i_part = i_bh * NUM_SPLITS + i_s
    tl.store(dwp_ptr + i_part * M * D + o_f[:, None] * D + o_d[None, :], b_dw,
             mask=m_f[:, None] & m_d[None, :])  # fmt: skip


# ------------------------------------------------------------------------------------------------
# launchers


def _one_group(c) -> None:
    if c.G != 1:
        raise ValueError(
            "the non-causal kernel takes as many query heads as key/value heads; for grouped-query "
            "attention pass the queries of each group as rows ([B, Hkv, G*Tq, D]), as "
            "rfattn.rf_attention does"
        )


#: per-shape plans of the launchers (:func:`common.shape_plan`)
_FWD_PLANS = plan_cache()
_BWD_PLANS = plan_cache()


def _plan(q, k, v, form, scale, key_padding_mask, precision, gpu_tiles, num_splits, need_dw,
          varlen, *_layout):  # fmt: skip
    """What a launcher of one shape derives once (``need_dw``: None for the forward, whether the
    backward computes dW; ``varlen``: None, or packed sequences' ``(N, longest queries, longest
    keys, ...)``, :func:`common.varlen_key`; ``_layout``: the backward's out and do, in the key
    only): the setup's sizes and constexprs, the splits over T and the bound launches with
    their integer arguments."""
    c = launch_setup(q, k, v, form, scale, key_padding_mask, precision, gpu_tiles=gpu_tiles)
    _one_group(c)
    B, H, Tq, Tk, NMT, dev = c.B, c.H, c.Tq, c.Tk, c.NMT, q.device
    # per (b, h), the rows of the query statistics the backward reads (m_q, den): [B*H, Tq];
    # packed, [H, total queries] (a sequence's at its offset), and the grids and splits are
    # those of a batch of N rows of the longest sequence's tokens, whose programs past their
    # sequence's end return at once (the kernels' VARLEN)
    TR, rows = Tq, B * H
    if varlen is not None:
        (B, Tq, Tk), rows = varlen[:3], H
    # a half output's rounding residual, kept for the backward (``common.store_out``)
    lo = keeps_out_residual(q.dtype)
    p = dict(B=B, H=H, Tq=Tq, Tk=Tk, M=c.M, D=c.D, E=c.E, NMT=NMT, acc=c.acc, root=c.form_ptrs[0],
             has_pad=c.has_pad, lo=lo, varlen=varlen)  # fmt: skip
    pad = c.pad[1:]  # the int32 mask's strides (contiguous), or placeholders
    flags = dict(VARLEN=varlen is not None, **c.meta)
    if need_dw is None:  # the forward: a key pass split over Tk, a query pass
        splits, per = split_counts(Tk, max(B * H * NMT, 1), dev, num_splits)
        kv = Launch(_fwd_kv_kernel, (NMT, splits, B * H), HAS_PAD=c.has_pad, HAS_MAP=c.has_map,
                    **flags)  # fmt: skip
        q_, q_lo = (Launch(_fwd_q_kernel, lambda meta: (cdiv(Tq, meta["BT"]), B * H),
                           HAS_MAP=c.has_map, OUT_LO=x, **flags) for x in (False, lo))  # fmt: skip
        out = (H * TR * c.E, TR * c.E, c.E, 1)  # contiguous, made by the launcher
        BH, M, E, n = B * H, c.M, c.E, B * H * splits
        # the splits' partials of S, z, m_K, merged by the last split of each tile
        parts = ((n, M, E), (n, M), (n, M)) if splits > 1 else ()
        aux = ((BH, M, E), (BH, M), (BH, M), (rows, TR), (rows, TR))
        return Plan(
            **p, splits=splits, bwd={}, stats={}, aux_shapes=aux, part_shapes=parts,
            aux=Scratch(c.acc, *aux, *parts), parts=Scratch(c.acc, *parts) if parts else None,
            outs=Scratch(c.acc, *aux),
            kv=kv, kv_ints=(Tk, H, splits, per if Tk else 0, *k.stride(), *v.stride(),
                            *c.w.stride(), *pad),
            q=q_, q_lo=q_lo, q_ints=(Tq, H, TR, *q.stride(), *c.w.stride(), *out),
        )  # fmt: skip
    check_forward_only(c)
    programs = max(B * H * NMT, 1)  # (no (b, h): the launcher returns before any launch)
    splits, per = split_counts(Tq, programs, dev, num_splits)
    ksplits, kper = split_counts(Tk, programs, dev, num_splits) if need_dw and Tk else (0, 0)
    BH, M, E, n = B * H, c.M, c.E, B * H * splits
    parts = ((n, M, E), (n, M)) if splits > 1 else ()
    return Plan(
        **p, splits=splits, ksplits=ksplits, scratch=Scratch(c.acc, (BH, M, E), (BH, M), *parts),
        # (with dW: c from the rounded output, as before out_lo: the residual's tile spilled
        # the W_GRAD variant on sm_90, 254 registers -> 255 and 16 stack bytes)
        ds=Launch(_bwd_ds_kernel, (NMT, splits, B * H), W_GRAD=need_dw,
                  OUT_LO=lo and not need_dw, **flags),
        ds_ints=(Tq, H, splits, per if Tq else 0, TR, *q.stride(), *c.w.stride()),
        dqkv=Launch(_bwd_dqkv_kernel, lambda meta: (cdiv(Tq, meta["BT"]) + cdiv(Tk, meta["BT"]),
                                                    B * H), HAS_PAD=c.has_pad, OUT_LO=lo,
                    **flags),
        dqkv_ints=(Tq, Tk, H, TR, *q.stride(), *k.stride(), *v.stride(), *c.w.stride(), *pad),
        dwk=Launch(_bwd_dwk_kernel, (NMT, ksplits, B * H), HAS_PAD=c.has_pad, **flags),
        dwk_ints=(Tk, H, ksplits, kper, *k.stride(), *v.stride(), *c.w.stride(), *pad),
    )  # fmt: skip


def rf_parallel_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    precision: str | None = None,
    num_splits: int | None = None,
    return_aux: bool = False,
    gpu_tiles: bool | None = None,
    combine=None,
    backward_plan: bool = False,
    stats=None,
    packed=None,
):
    """Non-causal fused random-feature attention forward.

    Args:
        q: ``[B, H, Tq, D]``; k: ``[B, H, Tk, D]``; v: ``[B, H, Tk, E]`` (any strides, one dtype).
        form: the feature's :class:`rfattn.features.form.KernelForm` (``FeatureMap.kernel_form``):
            kind, projection rows ``w`` ``[F, D]`` and the kind's parameters (no gradient here).
        scale: softmax temperature; inputs are multiplied by ``sqrt(scale)`` before projection.
        key_padding_mask: optional ``[B, Tk]`` bool, True = padding.
        precision: ``tl.dot`` input precision for fp32 products ("ieee", "tf32", "tf32x3"), or
            "half" (fp16/bf16 inputs: the half policy, their default); default "ieee" for
            fp32/fp64 inputs.
        num_splits: programs sharing one (b, h)'s keys (default: fill the device).
        return_aux: also return what the backward needs.
        gpu_tiles: pick a GPU's tiles (default: on a GPU; ``bench.compile`` sets it on CPU).
        combine: keys sharded over processes (``rfattn.distributed``): ``(S, z, m_K) ->
            (S, z, m_K)`` of every shard together (``[B*H, M, E]``, ``[B*H, M]``, ``[B*H, M]``;
            m_K is -1e30 where a shard has no valid key), called between the key and query
            passes.
        stats: the :class:`stats.KeyPassStats` of a form whose coefficients (and psi) are
            left to this forward (oprf/saderf, ``rfattn.fused.kernel_form(..., defer=True)``):
            its key pass forms them first, in its launch, before the query pass reads them.
        backward_plan: with ``return_aux``, also return what :func:`rf_parallel_bwd` takes as
            ``plan`` for this call (its plans and the form's arguments, found once here).
        packed: packed sequences, ``(cu_q, cu_k, max_q, max_k)``: q ``[1, H, total_q, D]``, k
            and v ``[1, H, total_k, *]`` hold N sequences, sequence i the queries
            ``cu_q[i] .. cu_q[i + 1]`` and keys ``cu_k[i] .. cu_k[i + 1]`` (int32/int64 tensors of
            N + 1 offsets on q's device, flash-attention's ``cu_seqlens``, read by the kernels
            only), each attended on its own; ``max_q``, ``max_k`` at least its longest's lengths
            (they size the grids). The key padding mask is then ``[1, total_k]``; S, z, m_K are
            per sequence and head (``[N*H, ...]``), m_q and den ``[H, total_q]``. No statistics
            (``stats``) nor ``combine``.

    Returns:
        ``out [B, H, Tq, E]`` in the input dtype; with ``return_aux`` also
        ``(S [B*H, M, E], z [B*H, M], m_K [B*H, M], m_q [B*H, Tq], den [B*H, Tq], out_lo)``
        (``out_lo``: for fp16/bf16 inputs the output's rounding residual, ``[B, H, Tq, E]`` in
        the input dtype scaled as ``common.store_out`` stores it, else an empty tensor); with
        ``backward_plan`` instead ``(kept, out_lo)``, ``kept`` the one allocation of the first
        five (the backward finds them in it), and then the backward's plan.

    Everything but the call's tensors (checks, setup, splits, launches) comes from the plan of
    the call's shape (:func:`common.shape_plan`), made at its first call.
    """
    p = shape_plan(_FWD_PLANS, _plan, q, k, v, form, scale, key_padding_mask, precision,
                   gpu_tiles, num_splits, None, packed and varlen_key(*packed))  # fmt: skip
    B, H, Tq, E, acc, dev = p.B, p.H, p.Tq, p.E, p.acc, q.device
    # a form made for this call (its statistics formed here) is converted, not kept
    fargs = form_args(form, B, H, H, acc, dev, keep=stats is None)
    w, *ptrs, qmap, kmap = fargs
    out = torch.empty(*q.shape[:3], E, device=dev, dtype=q.dtype)
    cu_q, cu_k = packed[:2] if packed else (w, w)  # (placeholders: not read)
    # for the backward only: a half output's rounding residual (``common.store_out``; empty for
    # fp32 / fp64), written by the query pass that OUT_LO compiles it into
    if return_aux:
        olo = torch.empty_like(out) if p.lo else out.new_empty(0)
        qpass, lo_ptr = p.q_lo, (olo if p.lo else out)
    else:
        olo, qpass, lo_ptr = None, p.q, out
    # the key pass's launch: the forward's own, or the one that forms the statistics first
    kp = p if stats is None else _stats_plan(p, stats, q, k)
    # S, z, m_K, m_q, den: outputs where asked for, else scratch with the splits' partials (and
    # the statistics' buffers), as device addresses once both launches replay
    addresses = kp.kv.direct is not None and qpass.direct is not None
    kept = None
    if return_aux or combine is not None or B * H == 0:
        if backward_plan:  # kept for the caller's backward only: one allocation, its buffers
            # as addresses where the launches replay (no view to make, ~15 µs a call)
            assert combine is None, "backward_plan: the combined statistics are new tensors"
            kept, bufs = p.outs(dev, addresses)
            s, z, mk, mq, den = bufs
        else:  # returned (an operator's outputs alias nothing, each other included)
            s, z, mk, mq, den = (torch.empty(x, device=dev, dtype=acc) for x in p.aux_shapes)
        if B * H == 0:
            return _returned(out, (s, z, mk, mq, den, olo), kept, return_aux, backward_plan, p,
                             fargs)  # fmt: skip
        ws, bufs = kp.parts(dev, addresses) if kp.parts is not None else (None, ())
        bufs = [*bufs]
    else:
        ws, bufs = kp.aux(dev, addresses)
        s, z, mk, mq, den, *bufs = bufs
    parts, bufs = bufs[: len(p.part_shapes)], bufs[len(p.part_shapes) :]
    if p.splits == 1:
        parts = s, z, mk  # unused: the one split writes S, z, m_K itself
    # (ws: the scratch's allocation, held until the launches are issued)
    pad = mask_rows(key_padding_mask) if p.has_pad else w
    kv_args = (k, v, w, pad, p.root, *ptrs, kmap, *parts, s, z, mk)
    if stats is None:
        p.kv(*kv_args, arrival_counters(dev, B * H * p.NMT), cu_k, *p.kv_ints)
    else:  # the stats roles first, then the key-pass roles
        counters = arrival_counters(dev, B * H * p.NMT + key_pass_counters(B * H))
        kp.kv(*kv_args, counters, *p.kv_ints, *key_pass_arguments(stats, kp.extra, q, *bufs))
    if combine is not None:
        s, z, mk = (aligned(x.contiguous()) for x in combine(s, z, mk))
    if Tq:
        qpass(q, w, p.root, *ptrs, qmap, s, z, mk, out, lo_ptr, mq, den, cu_q, *p.q_ints)
    return _returned(out, (s, z, mk, mq, den, olo), kept, return_aux, backward_plan, p, fargs)


def _stats_plan(p, stats, q, k) -> Plan:
    """The key pass of the forward plan ``p`` that forms ``stats`` first (kept in ``p.stats`` by
    :func:`stats.key_pass_key`): its bound launch, what :func:`stats.key_pass_arguments` takes,
    and the forward's scratch with the statistics' buffers after it."""
    key = key_pass_key(stats)
    sp = p.stats.get(key)
    if sp is None:
        if p.varlen is not None:
            raise NotImplementedError("packed sequences with statistics formed in the key pass")
        extra = key_pass_plan(stats, q, k, p.B, p.H, p.D, p.acc)
        kernel = _fwd_kv_running_kernel if stats.running is not None else _fwd_kv_stats_kernel
        n = extra["roles"] + p.NMT * p.splits * p.B * p.H
        kw = {name: x for name, x in p.kv.kwargs.items() if name != "VARLEN"}
        sp = p.stats[key] = Plan(
            kv=Launch(kernel, (n,), **kw, **extra["meta"]), extra=extra,
            aux=Scratch(p.acc, *p.aux_shapes, *p.part_shapes, *extra["buffers"]),
            parts=Scratch(p.acc, *p.part_shapes, *extra["buffers"]),
        )  # fmt: skip
    return sp


def _returned(out, aux, kept, return_aux: bool, backward_plan: bool, p, fargs):
    """What :func:`rf_parallel_fwd` returns (``backward_plan``: the auxiliaries as ``(kept,
    out_lo)``, ``kept`` the one allocation of S, z, m_K, m_q and den laid out by the plan's
    ``outs``; then the forward's plan, whose :attr:`bwd` holds the backward's plans by the
    cotangent's layout, and the form's arguments)."""
    if not return_aux:
        return out
    return (out, (kept, aux[-1]), (p, fargs)) if backward_plan else (out, aux)


def rf_parallel_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form,
    scale: float,
    out: torch.Tensor,
    aux: tuple,
    key_padding_mask: torch.Tensor | None = None,
    precision: str | None = None,
    need_dw: bool = False,
    num_splits: int | None = None,
    gpu_tiles: bool | None = None,
    reduce_ds=None,
    plan=None,
    packed=None,
):
    """Backward of :func:`rf_parallel_fwd`: features recomputed, offsets from the forward.

    Args:
        do: ``[B, H, Tq, E]`` cotangent of the output (any strides).
        q, k, v, form, scale, key_padding_mask, precision, gpu_tiles: as given to the forward.
        out, aux: the forward's output and auxiliaries (``return_aux=True``; with ``plan``,
            the forward's ``(kept, out_lo)``).
        need_dw: also compute the gradient of ``form.w`` (not for the "rmf" kind).
        reduce_ds: keys sharded over processes (the forward's ``combine``): ``(dS, dz) ->
            (dS, dz)`` summed over every shard's queries, before the key pass. ``dw`` is then
            this process's share.
        plan: what the forward of these inputs returned with ``backward_plan`` (the out it
            made, num_splits as given to it): the plan is then found from there.
        packed: as given to the forward.

    Returns:
        ``(dq, dk, dv, dw)``; ``dw`` is None unless ``need_dw`` (then ``[F, D]`` in w's dtype).
    """
    if need_dw and form.plain:
        raise NotImplementedError("kind 'rmf': no gradient for its projection rows")
    need_dw = bool(need_dw)
    if plan is not None:  # the forward's plan holds the backward's, by the cotangent's layout
        fwd, fargs = plan
        layout = (need_dw, do.stride(), do.data_ptr() % 16)
        p = fwd.bwd.get(layout)
        if p is None:
            p = fwd.bwd[layout] = _plan(q, k, v, form, scale, key_padding_mask, precision,
                                        gpu_tiles, num_splits, need_dw, fwd.varlen)  # fmt: skip
    else:  # the strides and alignment of out and do are the plan's too (Triton specialises)
        p = shape_plan(_BWD_PLANS, _plan, q, k, v, form, scale, key_padding_mask, precision,
                       gpu_tiles, num_splits, need_dw, packed and varlen_key(*packed),
                       out.stride(), do.stride(), out.data_ptr() % 16,
                       do.data_ptr() % 16)  # fmt: skip
        fargs = None
    B, H, Tq, Tk, M, D, acc, dev = p.B, p.H, p.Tq, p.Tk, p.M, p.D, p.acc, q.device
    addresses = p.ds.direct is not None and p.dqkv.direct is not None and \
        (p.dwk.direct is not None or not (need_dw and p.ksplits))  # fmt: skip
    if plan is not None:  # S, z, m_K, m_q, den in the forward's one allocation
        kept, olo = aux
        s, z, mk, mq, den = fwd.outs.at(kept, addresses)
    else:
        s, z, mk, mq, den, olo = aux
    if p.lo:  # read with out's strides (the forward made it so where it kept the plan)
        assert plan is not None or olo.shape == out.shape and olo.stride() == out.stride(), \
            "out_lo is not out's"  # fmt: skip
    else:
        olo = out  # a placeholder: not read
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if B * H == 0:
        return dq, dk, dv, (torch.zeros(M, D, device=dev, dtype=form.w.dtype) if need_dw else None)
    tails = backward_strides(p, out, do, dq, dk, dv)
    w, *ptrs, _, _ = fargs or form_args(form, B, H, H, acc, dev)
    cu_q, cu_k = packed[:2] if packed else (w, w)  # (placeholders: not read)
    splits, ksplits = p.splits, p.ksplits
    # dS, dz and the splits' partials of them (summed by the last split of each tile): scratch,
    # or tensors for reduce_ds (ws: the scratch's allocation, held until the launches are issued)
    ws, (ds, dz, *parts) = p.scratch(dev, addresses and reduce_ds is None)
    ds_part, dz_part = parts if splits > 1 else (ds, dz)  # (unused with one split)
    # dW's partials: the query side's [B*H*splits], then the key side's [B*H*ksplits]
    dw_part = torch.empty(B * H * (splits + ksplits), M, D, device=dev, dtype=acc) \
        if need_dw else ds  # fmt: skip
    p.ds(q, w, p.root, *ptrs, s, z, mk, out, olo, do, mq, den, ds_part, dz_part, dw_part, ds, dz,
         arrival_counters(dev, B * H * p.NMT), cu_q, *p.ds_ints, *tails[0])  # fmt: skip
    if reduce_ds is not None:
        ds, dz = (aligned(x.contiguous()) for x in reduce_ds(ds, dz))
    pad = mask_rows(key_padding_mask) if p.has_pad else w
    if Tq or Tk:
        p.dqkv(q, k, v, w, pad, p.root, *ptrs, s, z, mk, out, olo, do, mq, den, ds, dz, dq, dk, dv,
               cu_q, cu_k, *p.dqkv_ints, *tails[1])  # fmt: skip
    if not need_dw:
        return dq, dk, dv, None
    if ksplits:
        p.dwk(k, v, w, pad, p.root, *ptrs, ds, dz, mk, dw_part[B * H * splits :], cu_k,
              *p.dwk_ints)  # fmt: skip
    # both sides' partials in one fixed-order torch sum (learnable W only)
    return dq, dk, dv, dw_part.sum(0).to(form.w.dtype)
