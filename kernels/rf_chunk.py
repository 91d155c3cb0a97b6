"""Fused causal random-feature attention, chunkwise, forward and backward, per (b, h).

Tokens are cut into chunks of C = BT. Features are ``phi = g exp(u - offset)`` in every form
of ``rf_parallel`` (``common.feature_tile``'s epilogue: the real positive GERF family, the signed
table form -- trigrf, hrf, complex gerf, sgq row weights -- and rmf's plain products, u = 0).
R_c is the running key offset after chunk c (the max of the key logits u over all valid keys of
chunks <= c and all features); the forward reads every row at its own offset
``r_i = max(R_{c-1}, m_j for j <= i in chunk c)``, with m_j key j's max logit over features:

    a_i = g_q(i) exp(u_q(i) - mq_i)         (mq_i: per-row max of u over features, exact)
    b_j = g_k(j) exp(u_k(j) - m_j)          (key j at its own max)
    S'_c = sum_{j in chunks < c} phi_j v_j^T at offset R_{c-1}, z'_c likewise
    out_i = (exp(R_{c-1} - r_i) a_i S'_c + sum_{j in c, j <= i} exp(m_j - r_i) (a_i . b_j) v_j)
            / (exp(R_{c-1} - r_i) a_i z'_c + sum_{j in c, j <= i} exp(m_j - r_i) a_i . b_j)

Every factor is <= 1 and no row reads a later key's offset, so no output depends on a later
token, not even through underflow, and where chunks fall changes only rounding (docs/numerics.md).

Forward, two launches (features never touch HBM, nor does any per-chunk state):

1. ``_chunk_states_kernel``, one program per (b, h), segment and M tile (after the stats roles
   below, if any): the chunks fall into NS segments of consecutive chunks per (b, h); a program
   walks its segment's chunks in order from a zero state, each chunk's key features of its tile
   computed on the way and added to the running state, rescaled flash-style, and stores the
   segment's sum at the walk's own offset (the max over the tile's features of the segment's
   keys). The last of a tile's segments to finish (``common.last_to_arrive``) combines the
   sums into the carries in their slots, the state before each segment from the initial one
   (log-sum-exp: both sides at the larger offset), and with the final state asked for writes
   the tile's into it at its own offset; the (b, h)'s last tile to finish brings the final
   state to the common offset R_{NC-1};
2. ``_chunk_out_kernel``, grid (segments, B*H): a program walks its segment's chunks again,
   the running state in its segment's carry slot, each M tile at its own offset (R_{c-1}: the
   max over the tiles). Per chunk and query head, over M tiles: query and key features with an
   online per-row max (mq_i) and an online per-key max (m_j; the intra-chunk product rescaled
   on both sides), the inter-chunk ``a S'`` (the tile's state times exp(r_tile - R_{c-1}) <= 1)
   and ``a b^T`` on ``tl.dot``; once the G query heads have read a tile, the chunk's keys go
   into it (at the tile's raised offset, as launch 1 adds them). Then the rows at their own
   offsets, the masked intra-chunk ``(a b^T ⊙ decay ⊙ tril) V``, ``out = num / den`` with
   ``rfattn.reference.attention_ratio``'s policy; saves mq_i, den_i (at r_i) and m_j. A
   non-finite value poisons its own and later rows only (a prefix count along the chunk).

oprf/saderf in training (running statistics, ``kernels.stats.ChunkStats`` handed over in the
form, ``KernelForm.stats``) take no launch of their own for them: launch 1's first programs are
stats roles (``stats.stats_item``: this call's moments of q and k, padding left out), the walks
form the parameters from the running buffers as they are (data-independent: no walk waits for
a stats role, so no order between programs is needed and none can deadlock), the first walk of
each (b, h) writes them into the form's ``coeffs`` / ``psi`` for the later launches (the
backward's recomputing launch 1 reads them there, not the moved buffers), and the launch's last
program to arrive (``common.last_to_arrive`` over every program, after each walk has read the
buffers) pools the moments into the buffers (``stats.running_update``), as the stats pass's own
launch does.

The trade of the forward: key features are computed twice per segment (once per launch: a
projection of each key per M tile in each), and each walk's steps are serial, where a
chunk-parallel output pass would read every chunk's prefix state from memory: B H ceil(T / C) M
E accumulator floats (512 MiB at B4 H16 M256 E64 T = 8192, C = 64) written and read back. The
walks keep the state on chip instead: launch 2's running state is its segment's carry slot,
``[M, E]`` per program (64 KiB at M256 E64: L2-resident, read and written once per chunk and
M tile, never the HBM traffic of per-chunk states), with a CTA barrier between a tile's loads
and its stores and between chunks, so that no thread of the program overwrites what another
has yet to read and each chunk's loads see the stores of the one before it.
Registers hold one M tile's ``[BM, BE]`` state at a time, not the whole ``[M, E]``, so the
feature tiles stay those of the other kernels. Segments bring the parallelism back: on a GPU
enough (at most MAX_SEGMENTS) that no walk is longer than SEGMENT_STEPS chunks and launch 2's
grid (segments, B*H) holds two programs per SM (launch 1 has M tiles times more); at B4 H16
M256 E64 bf16 on 132 SMs, 6 segments of 3 chunks at T = 1024 (384 programs in launch 2), 5
of 26 at T = 8192 (320) and 8 of 32 at T = 16384 (512). The forward's intermediate memory is
the carries, ``[NS, M, E]`` per (b, h): 20 MiB at T = 8192.

Backward, three launches (the carries recomputed, never kept from the forward; no
reverse-subtraction of prefix sums; no chunk's state or cotangent in memory), every row and key
at the forward's own offsets, so its gradients underflow only where the forward's terms do.
With g_i = do_i / den_i, c_i = -(do_i . out_i) / den_i, w_i = exp(R_{c-1} - r_i), decay_ij =
exp(m_j - r_i), kf_j = exp(m_j - R_c) (all <= 1) and dK_ij = (v_j . g_i + c_i) decay_ij:

3. ``_chunk_states_kernel`` again: the carries, and (``OFFSETS``) each walk's offset before
   each chunk, ``r`` ``[B*H, NC + 1, M tiles]`` (R_{c-1}: the max over the tiles of it and the
   carry's, ``_prefix_offset``), which the reverse walks read;
4. ``_chunk_dstates_kernel``, grid (M tiles, segments, B*H): the reverse walk, D_c = L_{c+1} +
   exp(R_c - R_{c+1}) D_{c+1}, the cotangent of the state after chunk c at R_c, from 0 at the
   segment's end, with each chunk's L_c = sum_{i in c} w_i a_i g_i^T, l_c = sum_{i in c} w_i
   c_i a_i formed on the way (the query features of its tile, the G query heads together); the
   last of a tile's segments to finish turns the segments' sums into the carries, from the
   final state's cotangent back: the cotangent after each segment, and the initial state's;
5. ``_chunk_bwd_kernel``, grid (2 segments, B*H), two walks per segment: the forward walk,
   the prefix state S'_c on chip in the segment's carry slot as in launch 2, gives
   du_q = a ⊙ (w (g S'_c^T + c z'_c) + (dK ⊙ tril) b) and dq; the reverse walk, the cotangent
   D_c on chip in the segment's cotangent slot (read once per chunk, then D_{c-1} formed in
   place, each query head adding its rows' share), gives
   du_k = b ⊙ ((dK ⊙ tril)^T a + kf (v D_c^T + dz_c)),
   dv = (a b^T ⊙ decay ⊙ tril)^T g + kf b D_c and dk, summed over the G query heads; dq, dk
   through ``common.feature_dx`` (``phi = g e``: du = phi * dphi, dg = e * dphi).

Recomputing the carries costs the backward one launch (2 + 3 = 5 per training call), and the
walks compute the features of a chunk's queries and keys once per direction; keeping the
forward's carries instead would save the launch but hold them from each layer's forward to its
backward. Intermediate memory at B4 H16 M256 E64 bf16, T = 8192 (5 segments): the forward's
carries 20 MiB, the backward's 20 MiB and its cotangents' 20 MiB, 61 MiB in all beside the
row statistics (m_q, den, m_k) the backward takes from the forward (the launchers'
allocations, tests/test_rf_chunk.py), where per-chunk states took 1.5 GiB.

State (``rfattn.RFState``): S [B, H, M, E], z [B, H, M] in the accumulation dtype and the offset
[B, H] (-inf before any valid key). ``initial_state`` continues a sequence; gradients flow to
the initial S, z and from cotangents of the returned S, z (the offset is not differentiable).
Key padding mask: padded keys get b = 0 everywhere (left padding for batched generation works).
Limits as ``rf_parallel`` (fp32/fp16/bf16/fp64, any D, E, M, T); Tq == Tk; learnable W (dW) is
not supported here (``rf_attention`` routes it to the torch path). No chunk's state is kept
in memory: the segments' carries take ``NS M E`` accumulator floats per (b, h), NS <= 8.
Reference: ``rfattn.reference.linear_attention(causal=True)`` on ``RandomFeatures.features``.

Packed sequences (``VARLEN``, ``rf_chunk_fwd``'s ``packed``): q, k, v ``[1, H, total, .]`` and
b in every grid is sequence b (``_span``): its chunks start at its first token, so none crosses
a boundary; the segments, the carries and the walk offsets ``r`` are laid out for the longest
sequence (NC chunks), and a walk takes its segment's chunks before its sequence's end NC_b (a
segment past it none: the empty sum, which the carries' log-sum-exp weighs 0); the offset at
boundary NC_b is written by the segment it falls in (``_segment``: an empty one writes the
empty offset, and the carry into it, read beside it, holds the sequence's) and every boundary
read is clipped to NC_b, so nothing past the sequence is read or written. The rows m_q, den,
m_j are ``[H * G, total]`` and ``[H, total]``, at the sequence's offset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    CHUNK_HALF_WARPS,
    NEG,
    Launch,
    Plan,
    Scratch,
    aligned,
    arrival_counters,
    backward_strides,
    cdiv,
    check_forward_only,
    feature_dx,
    feature_tile,
    form_args,
    gerf_coeffs,
    input_scale,
    keeps_out_residual,
    last_to_arrive,
    launch_setup,
    load_mapped,
    load_offset,
    load_rows,
    load_w,
    mask_rows,
    next_pow2,
    plan_cache,
    product,
    query_rows,
    ratio,
    round_half,
    sequence,
    shape_plan,
    sq_norms,
    store_offset,
    store_out,
    store_tile,
    valid_keys,
    varlen_key,
)
from .stats import chunk_stats_arguments, running_params, running_update, stats_item, store_params

__all__ = ["rf_chunk_fwd", "rf_chunk_bwd"]


@triton.jit
def _row_offsets(b_rp, b_mk, m_tril):
    """Each row's offset r_i = max(R_{c-1}, m_j for j <= i in the chunk) [BT]: no later key's."""
    return tl.maximum(b_rp, tl.max(tl.where(m_tril, b_mk[None, :], NEG), axis=1))


@triton.jit
def _intra_decay(b_mk, b_ri):
    """exp(m_j - r_i) [BT(i), BT(j)], <= 1 where j <= i (callers select the causal part)."""
    return tl.exp(tl.minimum(b_mk[None, :] - b_ri[:, None], 0.0))


@triton.jit
def _segment(i_c, NS, CPS):
    """The segment of chunk c, or of chunk boundary c (0 .. NC; NC: the last segment's end)."""
    return tl.minimum(i_c // CPS, NS - 1)


@triton.jit
def _span(cu_ptr, i_bh, H, T, TR, NC, BT: tl.constexpr, VARLEN: tl.constexpr):
    """Where (b, h) ``i_bh``'s tokens lie (``common.sequence``): ``(row, first, length, chunks,
    index, stride)``, its per-token statistics (m_q, den, m_j) at ``(index G + g) stride +
    first + t`` (G = 1 for a key head's). Without VARLEN ``(b, 0, T, NC, i_bh, T)``; with
    VARLEN packed sequence b, its chunks ``cdiv(length, BT)`` (NC, the longest's, then sizes
    the walks' arrays only) and its statistics in ``[heads, TR]`` at its offset."""
    if VARLEN:
        row, first, length, _ = sequence(cu_ptr, i_bh, H, T, TR, True)
        nc = tl.cdiv(length, BT)
        index = i_bh % H
        stride = TR
    else:
        row, first, length, nc, index, stride = i_bh // H, 0, T, NC, i_bh, T
    return row, first, length, nc, index, stride


@triton.jit
def _prefix_offset(r_ptr, gr_ptr, i_bh, i_c, NC, NS, CPS, NR: tl.constexpr, BP: tl.constexpr):
    """R_{c-1}, the offset at chunk boundary c (0 .. NC): the max over the states kernel's NR
    feature tiles of their own offsets there, each the larger of the carry into c's segment's
    (``gr`` ``[B*H, NS + 1, NR]``) and the segment's own walk's (``r`` ``[B*H, NC + 1, NR]``).
    ``.cg``, from L2: the last program of a walk reads the other programs' stores."""
    o_p = tl.arange(0, BP)
    m_p = o_p < NR
    i_g = i_bh * (NS + 1) + _segment(i_c, NS, CPS)
    b_l = tl.load(r_ptr + (i_bh * (NC + 1) + i_c) * NR + o_p, mask=m_p, other=NEG,
                  cache_modifier=".cg")  # fmt: skip
    b_g = tl.load(gr_ptr + i_g * NR + o_p, mask=m_p, other=NEG, cache_modifier=".cg")
    return tl.max(tl.maximum(b_l, b_g), axis=0)


@triton.jit
def _chunk_states_kernel(
    k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    kmap_ptr, s0_ptr, z0_ptr, r0_ptr, r_ptr, gs_ptr, gz_ptr, gr_ptr, sT_ptr, zT_ptr, rT_ptr,
    arrive_ptr, cu_ptr,
    T, H, BH, NC, NS, CPS,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    q_ptr, qpad_ptr, part_ptr, pcnt_ptr, mom_ptr, run_mean, run_sq, run_abs, run_min, nbt_ptr,
    keep: tl.float64, momentum: tl.float64, tiny: tl.float64, psi_lo: tl.float64,
    psi_hi: tl.float64,
    RQ, TQ, TK, NSTAT, SQ, SK, q_per, k_per,
    stride_qb, stride_qh, stride_qt, stride_qd, stride_qpb, stride_qpt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_MAP: tl.constexpr, HAS_INIT: tl.constexpr, PLAIN: tl.constexpr, FINAL: tl.constexpr,
    OFFSETS: tl.constexpr, STATS: tl.constexpr, HAS_QPAD: tl.constexpr, FORM: tl.constexpr,
    BB: tl.constexpr, RACC: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Programs ``0 .. NSTAT - 1`` (STATS): stats roles, the running statistics' work items
    (``stats.stats_item``); the others: one feature tile's walk over one segment's chunks (in
    (b, h), segment, tile order) from a zero state: each chunk's state before it, S_c [BM, E],
    z_c [BM], at the walk's own offset, and the segment's sum; the last of the tile's segments
    to finish forms the carries (the state before each segment, from the initial one) and the
    tile's final state; with FINAL, the (b, h)'s last tile to finish brings the final state to
    the common offset R_{NC-1}. With STATS the walks take the parameters from the running
    buffers as they are, the first walk of each (b, h) stores them for the later launches, and
    the launch's last program moves the buffers."""
    NMT: tl.constexpr = (M + BM - 1) // BM
    pid = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    if STATS:
        # fp64 arguments as ACC (tl.full: the interpreter passes them as Python floats)
        b_tiny = tl.full([], tiny, ACC)
        b_lo, b_hi = tl.full([], psi_lo, ACC), tl.full([], psi_hi, ACC)
        if pid < NSTAT:  # a stats role: items pid, pid + NSTAT, ...
            for w in range(pid, BH * (SQ + SK), NSTAT):
                stats_item(
                    w, q_ptr, k_ptr, qpad_ptr, pad_ptr, part_ptr, pcnt_ptr,
                    arrive_ptr + BH * (NMT + 1), mom_ptr, ab_ptr, psi_ptr,
                    tl.full([], scale, ACC), b_tiny, b_lo, b_hi, BH, RQ, TQ, RQ // TQ, T, TK, H,
                    SQ, SK, q_per, k_per, stride_qb, stride_qh, stride_qt, stride_qd, stride_kb,
                    stride_kh, stride_kt, stride_kd, stride_qpb, stride_qpt, stride_pb,
                    stride_pt, D, BD, BT, HAS_QPAD, HAS_PAD, FORM, True, ACC)  # fmt: skip
    if pid >= NSTAT:  # a walk
        r = pid - NSTAT
        i_bh = (r // (NMT * NS)).to(tl.int64)
        i_g = (r // NMT) % NS
        i_m = r % NMT
        if STATS:  # the buffers as they are (they move once every program has read them)
            b_ca, b_cb, b_cd, b_psi = running_params(run_mean, run_sq, D, b_tiny, b_lo, b_hi,
                                                     o_d, m_d, FORM, ACC)  # fmt: skip
            if (i_g == 0) & (i_m == 0):  # for the output pass and the backward
                store_params(ab_ptr, psi_ptr, i_bh, b_ca, b_cb, b_cd, b_psi, D, o_d, m_d, FORM)
            b_sc = tl.full([BD], scale, ACC) / b_psi  # keys: sqrt(scale) / psi
        else:
            b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
            b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
        _walk_sums(
            i_m, i_g, i_bh, b_ca, b_cb, b_cd, b_sc, k_ptr, v_ptr, w_ptr, pad_ptr, tab_ptr, xr_ptr,
            xi_ptr, kmap_ptr, s0_ptr, z0_ptr, r0_ptr, r_ptr, gs_ptr, gz_ptr, gr_ptr, sT_ptr,
            zT_ptr, rT_ptr, arrive_ptr, cu_ptr, T, H, BH, NC, NS, CPS,
            stride_kb, stride_kh, stride_kt, stride_kd, stride_vb, stride_vh, stride_vt,
            stride_ve, stride_wm, stride_wd, stride_pb, stride_pt,
            D, M, E, BD, BM, BE, BT, BP, HAS_PAD, FEATURE, PRECISION, ACC, HAS_LAM, TINY,
            HAS_MAP, HAS_INIT, PLAIN, FINAL, OFFSETS, VARLEN)  # fmt: skip
    if STATS:
        if last_to_arrive(arrive_ptr + BH * (NMT + 2), NSTAT + NMT * NS * BH):  # the last
            running_update(mom_ptr, run_mean, run_sq, run_abs, run_min, nbt_ptr, BH, D, keep,
                           momentum, o_d, m_d, BD, BB, ACC, RACC)  # fmt: skip


@triton.jit
def _walk_sums(
    i_m, i_g, i_bh, b_ca, b_cb, b_cd, b_sc,
    k_ptr, v_ptr, w_ptr, pad_ptr, tab_ptr, xr_ptr, xi_ptr, kmap_ptr, s0_ptr, z0_ptr, r0_ptr,
    r_ptr, gs_ptr, gz_ptr, gr_ptr, sT_ptr, zT_ptr, rT_ptr, arrive_ptr, cu_ptr,
    T, H, BH, NC, NS, CPS,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_LAM: tl.constexpr, TINY: tl.constexpr, HAS_MAP: tl.constexpr, HAS_INIT: tl.constexpr,
    PLAIN: tl.constexpr, FINAL: tl.constexpr, OFFSETS: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """The walk of feature tile i_m over segment i_g of (b, h) i_bh with the (b, h)'s
    (A, B, log D) and key input scale ``b_sc`` [BD] (:func:`_chunk_states_kernel`): the
    segment's sum, and with OFFSETS the walk's offset before each chunk (``r``). VARLEN:
    (b, h)'s sequence by :func:`_span`, the walk's chunks those of its segment before the
    sequence's end (none past it: the empty sum)."""
    i_h = i_bh % H
    i_b, t0, T, NCn, _, _ = _span(cu_ptr, i_bh, H, T, 0, NC, BT, VARLEN)
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    m_fe = m_f[:, None] & m_e[None, :]
    o_fe = o_f[:, None] * E + o_e[None, :]
    b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh + t0 * stride_kt
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh + t0 * stride_vt
    p_pad = pad_ptr + t0 * stride_pt
    c0 = i_g * CPS
    c1 = tl.minimum(c0 + CPS, NCn)
    b_r = load_offset(r0_ptr, PLAIN, False, ACC)  # the empty state's
    b_s = tl.zeros([BM, BE], dtype=ACC)
    b_z = tl.zeros([BM], dtype=ACC)
    for i_c in range(c0, c1):
        if OFFSETS:
            tl.store(r_ptr + (i_bh * (NC + 1) + i_c) * NMT + i_m, b_r)
        # chunk c's keys: features of this tile [BT, BM], the offset raised to their max
        o_t = (i_c * BT + tl.arange(0, BT)).to(tl.int64)
        m_t = valid_keys(p_pad, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
        b_v = load_rows(v_base, o_t, o_e, stride_vt, stride_ve, m_t, m_e, ACC)  # padded: unread
        b_x = load_mapped(k_base, o_t, o_d, stride_kt, stride_kd, m_t, m_d, kmap_ptr, i_h, D, BT,
                          BD, HAS_MAP, PRECISION, ACC)  # fmt: skip
        b_u, b_g, b_g1, b_g2 = feature_tile(
            b_x * b_sc[None, :], b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr,
            xi_ptr, i_m, M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY, b_x, b_sc,
            HAS_MAP)  # [BT, BM]  # fmt: skip
        m_tf = m_t[:, None] & m_f[None, :]  # valid keys and features: the only ones read
        b_rn = tl.maximum(b_r, tl.max(tl.max(tl.where(m_tf, b_u, NEG), axis=1), axis=0))
        b_p = tl.where(m_tf, b_g * tl.exp(b_u - b_rn), 0.0)  # [BT, BM]
        b_alpha = tl.exp(b_r - b_rn)
        # [BM, BT] @ [BT, BE] -> [BM, BE]
        b_s = b_s * b_alpha + product(tl.trans(b_p), b_v, PRECISION, ACC, FEATURE != 0)
        b_z = b_z * b_alpha + tl.sum(b_p, axis=0)
        b_r = b_rn
    if OFFSETS:
        if VARLEN:  # the boundary after the sequence's last chunk: its segment's (_segment)
            if i_g == _segment(NCn, NS, CPS):
                tl.store(r_ptr + (i_bh * (NC + 1) + NCn) * NMT + i_m, b_r)
        elif c1 == NC:  # the boundary after the last chunk (others open the next segment)
            tl.store(r_ptr + (i_bh * (NC + 1) + NC) * NMT + i_m, b_r)
    # the segment's sum in its own slot, where its carry (the state before it) will be
    p_g = i_bh * NS + i_g
    tl.store(gs_ptr + p_g * M * E + o_fe, b_s, mask=m_fe)
    tl.store(gz_ptr + p_g * M + o_f, b_z, mask=m_f)
    tl.store(gr_ptr + (i_bh * (NS + 1) + i_g) * NMT + i_m, b_r)
    if last_to_arrive(arrive_ptr + i_bh * NMT + i_m, NS):  # every segment's sum is written
        b_r = load_offset(r0_ptr + i_bh, PLAIN, HAS_INIT, ACC)
        if HAS_INIT:
            b_s = tl.load(s0_ptr + i_bh * M * E + o_fe, mask=m_fe, other=0.0).to(ACC)
            b_z = tl.load(z0_ptr + i_bh * M + o_f, mask=m_f, other=0.0).to(ACC)
        else:
            b_s = tl.zeros([BM, BE], dtype=ACC)
            b_z = tl.zeros([BM], dtype=ACC)
        for j in range(0, NS):  # slot j: segment j's sum, replaced by the carry into it
            p_g = i_bh * NS + j
            p_r = (i_bh * (NS + 1) + j) * NMT + i_m
            b_ts = tl.load(gs_ptr + p_g * M * E + o_fe, mask=m_fe, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            b_tz = tl.load(gz_ptr + p_g * M + o_f, mask=m_f, other=0.0, cache_modifier=".cg")
            b_tr = tl.load(gr_ptr + p_r, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's loads of the slot before its stores
            tl.store(gs_ptr + p_g * M * E + o_fe, b_s, mask=m_fe)
            tl.store(gz_ptr + p_g * M + o_f, b_z, mask=m_f)
            tl.store(gr_ptr + p_r, b_r)
            b_rn = tl.maximum(b_r, b_tr)  # log-sum-exp: both sides at the larger offset
            b_fc, b_ft = tl.exp(b_r - b_rn), tl.exp(b_tr - b_rn)
            b_s, b_z, b_r = b_s * b_fc + b_ts * b_ft, b_z * b_fc + b_tz * b_ft, b_rn
        p_r = i_bh * (NS + 1) + NS  # the tile's final offset
        tl.store(gr_ptr + p_r * NMT + i_m, b_r)
        if FINAL:  # the tile's final state at its own offset, then all at the common one
            tl.store(sT_ptr + i_bh * M * E + o_fe, b_s, mask=m_fe)
            tl.store(zT_ptr + i_bh * M + o_f, b_z, mask=m_f)
            if last_to_arrive(arrive_ptr + BH * NMT + i_bh, NMT):
                o_p = tl.arange(0, BP)  # R_{NC-1}: the max of the tiles' final offsets
                b_rT = tl.max(tl.load(gr_ptr + p_r * NMT + o_p, mask=o_p < NMT, other=NEG,
                                      cache_modifier=".cg"), axis=0)  # fmt: skip
                for j in range(0, NMT):  # each tile from its own offset to the common one
                    o_fj = j * BM + tl.arange(0, BM)
                    m_fj = o_fj < M
                    m_fje = m_fj[:, None] & m_e[None, :]
                    o_fje = o_fj[:, None] * E + o_e[None, :]
                    b_f = tl.exp(tl.load(gr_ptr + p_r * NMT + j, cache_modifier=".cg") - b_rT)
                    b_s = tl.load(sT_ptr + i_bh * M * E + o_fje, mask=m_fje, other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
                    b_z = tl.load(zT_ptr + i_bh * M + o_fj, mask=m_fj, other=0.0,
                                  cache_modifier=".cg")  # fmt: skip
                    tl.debug_barrier()  # every thread's loads of the tile before its stores
                    tl.store(sT_ptr + i_bh * M * E + o_fje, b_f * b_s, mask=m_fje)
                    tl.store(zT_ptr + i_bh * M + o_fj, b_f * b_z, mask=m_fj)
                store_offset(rT_ptr + i_bh, b_rT)


@triton.jit
def _chunk_out_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr,
    xi_ptr, qmap_ptr, kmap_ptr, gs_ptr, gz_ptr, gr_ptr, o_ptr, olo_ptr, mq_ptr, den_ptr, mk_ptr,
    nex_ptr, dex_ptr, eex_ptr, wex_ptr,
    T, H, NC, G, NS, CPS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_ob, stride_oh, stride_ot, stride_oe,
    cu_ptr, TR,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr,
    HAS_PAD: tl.constexpr, FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_MAP: tl.constexpr, OUT_LO: tl.constexpr, HAS_EX: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """The walk of segment i_g of key/value head (b, h) over its chunks: out [BT, E] of each
    chunk for the G query heads from the state before it (the segment's carry slot, each
    feature tile at its own offset, brought to R_{c-1}) plus the masked intra-chunk term,
    normalised (with OUT_LO also its rounding residual, ``common.store_out``, for the
    backward); then the chunk's keys added to the state in its slot.

    HAS_EX (the hybrid, ``rfattn.hybrid``): each row's exact terms join its numerator and
    denominator before the ratio, ``nex`` ``[E]`` and ``dex`` at the row's own offset ``eex``
    (in the kernel's units: the features' sum is N times the kernel estimate, so the caller
    adds log N), both sides at the larger of ``eex`` and the row's mq_i + r_i; the saved den
    stays at mq_i + r_i (inf where the exact terms outweigh the features past fp range: their
    cotangents are then 0), and ``wex`` gets the exact terms' cotangent factor
    exp(eex - c_i) / den_i. VARLEN: (b, h)'s sequence by :func:`_span`."""
    i_g, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_h = i_bh % H
    i_b, t0, T, NCn, i_rb, RS = _span(cu_ptr, i_bh, H, T, TR, NC, BT, VARLEN)
    NMT: tl.constexpr = (M + BM - 1) // BM
    # under the half policy the rows and values stay in the input dtype (exact: every product
    # rounds its operands to it), half the registers of fp32 tiles; mapped rows are fp32
    HALF_IN: tl.constexpr = PRECISION == "bf16" or PRECISION == "fp16"
    XDT: tl.constexpr = q_ptr.dtype.element_ty if HALF_IN and not HAS_MAP else ACC
    VDT: tl.constexpr = v_ptr.dtype.element_ty if HALF_IN else ACC
    o_d, o_e, o_p = tl.arange(0, BD), tl.arange(0, BE), tl.arange(0, BP)
    m_d, m_e = o_d < D, o_e < E
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_scq = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_sck = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh + t0 * stride_kt
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh + t0 * stride_vt
    p_pad = pad_ptr + t0 * stride_pt
    p_g = i_bh * NS + i_g  # the segment's carry: the walk's running state, in place
    b_rt = tl.load(gr_ptr + (i_bh * (NS + 1) + i_g) * NMT + o_p, mask=o_p < NMT,
                   other=NEG)  # [BP] the tiles' offsets  # fmt: skip
    for i_c in range(i_g * CPS, tl.minimum(i_g * CPS + CPS, NCn)):
        o_t = (i_c * BT + tl.arange(0, BT)).to(tl.int64)
        m_q = o_t < T
        m_k = valid_keys(p_pad, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
        m_tril = o_t[:, None] >= o_t[None, :]  # [BT(i), BT(j)]
        b_xkr = load_mapped(k_base, o_t, o_d, stride_kt, stride_kd, m_k, m_d, kmap_ptr, i_h, D,
                            BT, BD, HAS_MAP, PRECISION, XDT)  # the rows, x~ = rows * scale
        b_xk = b_xkr.to(ACC) * b_sck[None, :]
        b_v = load_rows(v_base, o_t, o_e, stride_vt, stride_ve, m_k, m_e, VDT)  # [BT, BE]
        # a non-finite value poisons its own and later rows, never earlier ones: zero in the
        # product (0 * NaN would reach every row), NaN from its position on (a prefix count)
        b_bad = (b_v != b_v) | (tl.abs(b_v) == float("inf"))
        b_poison = tl.cumsum(b_bad.to(tl.int32), axis=0) > 0
        b_vc = tl.where(b_bad, 0.0, b_v).to(VDT)
        b_rp = tl.max(b_rt, axis=0)  # R_{c-1}: where the rows' offsets start
        for g in range(0, G):  # the query heads that read this key/value head
            i_hq = i_h * G + g
            q_base = q_ptr + i_b * stride_qb + i_hq * stride_qh + t0 * stride_qt
            b_xqr = load_mapped(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, qmap_ptr, i_hq,
                                D, BT, BD, HAS_MAP, PRECISION, XDT)  # fmt: skip
            b_xq = b_xqr.to(ACC) * b_scq[None, :]
            b_mx = tl.full([BT], NEG, dtype=ACC)  # per row, online over feature tiles
            b_mk = tl.full([BT], NEG, dtype=ACC)  # per key (m_j), likewise
            b_num = tl.zeros([BT, BE], dtype=ACC)
            b_den = tl.zeros([BT], dtype=ACC)
            b_A = tl.zeros([BT, BT], dtype=ACC)
            for i_m in range(0, NMT):
                o_f = i_m * BM + tl.arange(0, BM)
                m_f = o_f < M
                b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
                b_uq, b_gq, b_g1, b_g2 = feature_tile(
                    b_xq, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
                    M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY, b_xqr, b_scq,
                    HAS_MAP)  # [BT, BM]  # fmt: skip
                b_uq = tl.where(m_f[None, :], b_uq, float("-inf"))
                b_mx_new = tl.maximum(b_mx, tl.max(b_uq, axis=1))
                b_alpha = tl.exp(b_mx - b_mx_new)
                b_a = b_gq * tl.exp(b_uq - b_mx_new[:, None])  # [BT, BM]
                b_uk, b_gk, b_g1, b_g2 = feature_tile(
                    b_xk, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m,
                    M, D, BM, FEATURE, True, HAS_LAM, PRECISION, TINY, b_xkr, b_sck,
                    HAS_MAP)  # [BT, BM]  # fmt: skip
                m_kf = m_k[:, None] & m_f[None, :]  # valid keys and features: the only ones read
                b_uk = tl.where(m_kf, b_uk, NEG)
                b_mk_new = tl.maximum(b_mk, tl.max(b_uk, axis=1))
                b_beta = tl.exp(b_mk - b_mk_new)
                b_b = tl.where(m_kf, b_gk * tl.exp(b_uk - b_mk_new[:, None]), 0.0)  # [BT, BM]
                # the tile's state before the chunk, at its own offset r_m, read at R_{c-1}
                b_rm = tl.max(tl.where(o_p == i_m, b_rt, NEG), axis=0)
                b_f = tl.exp(b_rm - b_rp)  # <= 1
                o_fe = o_f[:, None] * E + o_e[None, :]
                m_fe = m_f[:, None] & m_e[None, :]
                b_s = tl.load(gs_ptr + p_g * M * E + o_fe, mask=m_fe, other=0.0)  # [BM, BE]
                b_z = tl.load(gz_ptr + p_g * M + o_f, mask=m_f, other=0.0)  # [BM]
                # [BT, BM] @ [BM, BE] -> [BT, BE]; [BT, BM] @ [BM, BT] -> [BT, BT]
                b_num = b_num * b_alpha[:, None] + b_f * product(b_a, b_s, PRECISION, ACC,
                                                                 FEATURE != 0, True)  # fmt: skip
                b_den = b_den * b_alpha + b_f * tl.sum(b_a * b_z[None, :], axis=1)
                b_A = b_A * b_alpha[:, None] * b_beta[None, :] + product(
                    b_a, tl.trans(b_b), PRECISION, ACC, FEATURE != 0, FEATURE != 0)  # fmt: skip
                b_mx, b_mk = b_mx_new, b_mk_new
                if g == G - 1:  # every head has read it: the chunk's keys into the tile
                    b_rn = tl.maximum(b_rm, tl.max(tl.max(b_uk, axis=1), axis=0))
                    b_p = tl.where(m_kf, b_gk * tl.exp(b_uk - b_rn), 0.0)  # [BT, BM]
                    b_al = tl.exp(b_rm - b_rn)
                    # [BM, BT] @ [BT, BE] -> [BM, BE]
                    b_s = b_s * b_al + product(tl.trans(b_p), b_v, PRECISION, ACC, FEATURE != 0)
                    b_z = b_z * b_al + tl.sum(b_p, axis=0)
                    tl.debug_barrier()  # every thread's loads of the tile before its stores
                    tl.store(gs_ptr + p_g * M * E + o_fe, b_s, mask=m_fe)
                    tl.store(gz_ptr + p_g * M + o_f, b_z, mask=m_f)
                    b_rt = tl.where(o_p == i_m, b_rn, b_rt)
            if g == 0:
                tl.store(mk_ptr + i_rb * RS + t0 + o_t, b_mk, mask=m_q)
            # rows at their own offsets r_i = max(R_{c-1}, m_j for j <= i): the prefix times
            # exp(R_{c-1} - r_i), key j <= i times exp(m_j - r_i) (both <= 1); later keys never
            # enter (selection, not a product with 0)
            b_ri = _row_offsets(b_rp, b_mk, m_tril)
            b_inter = tl.exp(b_rp - b_ri)
            b_num, b_den = b_num * b_inter[:, None], b_den * b_inter
            b_A = tl.where(m_tril & m_k[None, :], b_A * _intra_decay(b_mk, b_ri), 0.0)
            b_num += product(b_A, b_vc, PRECISION, ACC, FEATURE != 0)
            b_num = tl.where(b_poison, float("nan"), b_num)
            b_den += tl.sum(b_A, axis=1)
            i_row = (i_rb * G + g) * RS + t0  # the query head's rows of m_q and den
            if HAS_EX:  # the exact terms, both sides at the larger offset
                b_ee = tl.load(eex_ptr + i_row + o_t, mask=m_q, other=float("-inf")).to(ACC)
                b_ee = tl.where(b_ee == float("-inf"), NEG, b_ee)
                b_ar = b_mx + b_ri
                b_cr = tl.maximum(b_ar, b_ee)
                b_fa, b_fe = tl.exp(b_ar - b_cr), tl.exp(b_ee - b_cr)
                b_ne = tl.load(nex_ptr + (i_row + o_t)[:, None] * E + o_e[None, :],
                               mask=m_q[:, None] & m_e[None, :], other=0.0).to(ACC)  # fmt: skip
                b_de = tl.load(dex_ptr + i_row + o_t, mask=m_q, other=0.0).to(ACC)
                b_num = b_num * b_fa[:, None] + b_ne * b_fe[:, None]
                b_den = b_den * b_fa + b_de * b_fe
            b_o, b_den = ratio(b_num, b_den, TINY)
            if HAS_EX:
                tl.store(wex_ptr + i_row + o_t, b_fe / b_den, mask=m_q)
                b_den = b_den / b_fa  # at mq_i + r_i, as the backward reads it
            store_out(o_ptr, olo_ptr, i_b, i_hq, t0 + o_t, o_e, stride_ob, stride_oh, stride_ot,
                      stride_oe, b_o, m_q, m_e, OUT_LO)  # fmt: skip
            tl.store(mq_ptr + i_row + o_t, b_mx, mask=m_q)
            tl.store(den_ptr + i_row + o_t, b_den, mask=m_q)
        tl.debug_barrier()  # the state's stores before the next chunk's loads (other threads')


@triton.jit
def _chunk_dstates_kernel(
    q_ptr, w_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr, xi_ptr,
    o_ptr, olo_ptr, do_ptr, mq_ptr, den_ptr, mk_ptr, r_ptr, gr_ptr, dsT_ptr, dzT_ptr, gd_ptr,
    gdz_ptr, ds0_ptr, dz0_ptr, arrive_ptr, cu_ptr,
    T, H, NC, G, NS, CPS, TR,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_wm, stride_wd,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr,
    FEATURE: tl.constexpr, PRECISION: tl.constexpr, ACC: tl.constexpr,
    HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr, HAS_LAM: tl.constexpr, TINY: tl.constexpr,
    HAS_DFINAL: tl.constexpr, HAS_INIT: tl.constexpr, OUT_LO: tl.constexpr,
    VARLEN: tl.constexpr,
):  # fmt: skip
    """The reverse walk of one feature tile over one segment's chunks: D_c [BM, E], dz_c [BM],
    the cotangent of the state after chunk c at R_c, D_c = L_{c+1} + exp(R_c - R_{c+1}) D_{c+1},
    from 0 at the segment's end, with chunk c's own L_c = sum_{i in c} w_i a_i g_i^T and l_c =
    sum_{i in c} w_i c_i a_i (w_i = exp(R_{c-1} - r_i) <= 1, the rows of the G query heads of
    key/value head (b, h) together) formed on the way; the segment's share of the cotangent
    before it in ``gd``. The last of the tile's segments to finish turns those shares into the
    carries, from the final state's cotangent back: slot j the cotangent after segment j (at
    its end offset), and the initial state's at R_{-1}, its own offset. VARLEN: (b, h)'s
    sequence by :func:`_span`, chunk boundaries past its end read at its end."""
    i_m, i_g, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_h = i_bh % H
    i_b, t0, T, NCn, i_rb, RS = _span(cu_ptr, i_bh, H, T, TR, NC, BT, VARLEN)
    NMT: tl.constexpr = (M + BM - 1) // BM
    o_d, o_e, o_f = tl.arange(0, BD), tl.arange(0, BE), i_m * BM + tl.arange(0, BM)
    m_d, m_e, m_f = o_d < D, o_e < E, o_f < M
    m_fe = m_f[:, None] & m_e[None, :]
    o_fe = o_f[:, None] * E + o_e[None, :]
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_sc = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    c0 = i_g * CPS
    c1 = tl.minimum(c0 + CPS, NCn)
    b_ds = tl.zeros([BM, BE], dtype=ACC)
    b_dz = tl.zeros([BM], dtype=ACC)
    b_rc = _prefix_offset(r_ptr, gr_ptr, i_bh, c1, NC, NS, CPS, NMT, BP)  # R_c from c = c1 - 1
    for i_r in range(0, c1 - c0):
        i_c = c1 - 1 - i_r
        b_rp = _prefix_offset(r_ptr, gr_ptr, i_bh, i_c, NC, NS, CPS, NMT, BP)  # R_{c-1}
        # chunk c's rows at their own offsets r_i: their share of the prefix state's cotangent
        o_t = (i_c * BT + tl.arange(0, BT)).to(tl.int64)
        m_q = o_t < T
        b_mk = tl.load(mk_ptr + i_rb * RS + t0 + o_t, mask=m_q, other=NEG)
        b_wr = tl.exp(b_rp - _row_offsets(b_rp, b_mk, o_t[:, None] >= o_t[None, :]))  # [BT]
        b_L = tl.zeros([BM, BE], dtype=ACC)
        b_l = tl.zeros([BM], dtype=ACC)
        for g in range(0, G):
            i_hq = i_h * G + g
            i_row = (i_rb * G + g) * RS + t0
            q_base = q_ptr + i_b * stride_qb + i_hq * stride_qh + t0 * stride_qt
            b_xq = load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, ACC)
            b_mq = tl.load(mq_ptr + i_row + o_t, mask=m_q, other=0.0)
            b_u, b_g, b_g1, b_g2 = feature_tile(
                b_xq * b_sc[None, :], b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr,
                xi_ptr, i_m, M, D, BM, FEATURE, False, HAS_LAM, PRECISION, TINY, b_xq,
                b_sc)  # fmt: skip
            b_a = b_g * tl.where(m_q[:, None] & m_f[None, :], tl.exp(b_u - b_mq[:, None]), 0.0)
            o_off = i_b * stride_ob + i_hq * stride_oh + t0 * stride_ot
            b_do, b_den, b_cq = query_rows(
                do_ptr + i_b * stride_dob + i_hq * stride_doh + t0 * stride_dot, o_ptr + o_off,
                olo_ptr + o_off, den_ptr + t0, i_rb * G + g, o_t, o_e, RS, m_q, m_e, stride_dot,
                stride_doe, stride_ot, stride_oe, ACC, OUT_LO)  # fmt: skip
            # [BM, BT] @ [BT, BE] -> [BM, BE]: sum_i (w_i a_i / den_i) do_i^T, do as given
            b_L += product(tl.trans(b_a * (b_wr / b_den)[:, None]), b_do, PRECISION, ACC,
                           FEATURE != 0)  # fmt: skip
            b_l += tl.sum(b_a * (b_cq * b_wr)[:, None], axis=0)
        b_f = tl.exp(b_rp - b_rc)
        b_ds = b_ds * b_f + b_L
        b_dz = b_dz * b_f + b_l
        b_rc = b_rp
    p_g = i_bh * NS + i_g  # the segment's share of the cotangent before it, at R_{c0-1}
    tl.store(gd_ptr + p_g * M * E + o_fe, b_ds, mask=m_fe)
    tl.store(gdz_ptr + p_g * M + o_f, b_dz, mask=m_f)
    if last_to_arrive(arrive_ptr + i_bh * NMT + i_m, NS):  # every segment's share is written
        if HAS_DFINAL:  # the returned state sits at offset R_{NC-1}
            b_ds = tl.load(dsT_ptr + i_bh * M * E + o_fe, mask=m_fe, other=0.0).to(ACC)
            b_dz = tl.load(dzT_ptr + i_bh * M + o_f, mask=m_f, other=0.0).to(ACC)
        else:
            b_ds = tl.zeros([BM, BE], dtype=ACC)
            b_dz = tl.zeros([BM], dtype=ACC)
        for i_j in range(0, NS):  # the cotangent after segment j, from the last one back
            j = NS - 1 - i_j
            p_g = i_bh * NS + j
            b_ls = tl.load(gd_ptr + p_g * M * E + o_fe, mask=m_fe, other=0.0,
                           cache_modifier=".cg")  # fmt: skip
            b_lz = tl.load(gdz_ptr + p_g * M + o_f, mask=m_f, other=0.0, cache_modifier=".cg")
            tl.debug_barrier()  # every thread's loads of the slot before its stores
            tl.store(gd_ptr + p_g * M * E + o_fe, b_ds, mask=m_fe)
            tl.store(gdz_ptr + p_g * M + o_f, b_dz, mask=m_f)
            if VARLEN:  # (a segment past the sequence's end: 0 chunks, both at its end)
                c_j = tl.minimum(j * CPS, NCn)
            else:
                c_j = j * CPS
            b_f = tl.exp(_prefix_offset(r_ptr, gr_ptr, i_bh, c_j, NC, NS, CPS, NMT, BP) -
                         _prefix_offset(r_ptr, gr_ptr, i_bh, tl.minimum(j * CPS + CPS, NCn), NC,
                                        NS, CPS, NMT, BP))  # fmt: skip
            b_ds = b_ls + b_f * b_ds
            b_dz = b_lz + b_f * b_dz
        if HAS_INIT:  # at R_{-1}, the initial state's offset
            tl.store(ds0_ptr + i_bh * M * E + o_fe, b_ds, mask=m_fe)
            tl.store(dz0_ptr + i_bh * M + o_f, b_dz, mask=m_f)


@triton.jit
def _chunk_keys(k_base, v_base, pad_ptr, mk_ptr, i_b, i_bh, i_c, b_sck, b_rp, o_d, o_e, m_d, m_e,
                T, RS, stride_kt, stride_kd, stride_vt, stride_ve, stride_pb, stride_pt,
                BT: tl.constexpr, HAS_PAD: tl.constexpr, ACC: tl.constexpr,
                XDT: tl.constexpr):  # fmt: skip
    """Chunk c's tokens ``o_t``, row and key masks, keys [BT, BD] (unscaled: x~ = keys * b_sck),
    values [BT, BE] (both in ``XDT``: the input dtype under the half policy, whose products
    round their operands to it), the keys' max logits m_j [BT] as the forward saved them, and
    at R_{c-1} = ``b_rp`` the rows' prefix factors w_i [BT] and the causal decay
    exp(m_j - r_i) [BT, BT] (0 off the mask). The keys' m_j at ``mk_ptr + i_bh RS`` (a row of
    stride RS), the tokens' mask by T."""
    o_t = (i_c * BT + tl.arange(0, BT)).to(tl.int64)
    m_q = o_t < T
    m_k = valid_keys(pad_ptr, stride_pb, stride_pt, i_b, o_t, T, HAS_PAD)
    m_tril = o_t[:, None] >= o_t[None, :]  # [BT(i), BT(j)]
    b_xk = load_rows(k_base, o_t, o_d, stride_kt, stride_kd, m_k, m_d, XDT)
    b_v = load_rows(v_base, o_t, o_e, stride_vt, stride_ve, m_k, m_e, XDT)  # [BT, BE]
    b_mk = tl.load(mk_ptr + i_bh * RS + o_t, mask=m_q, other=NEG)
    b_ri = _row_offsets(b_rp, b_mk, m_tril)
    b_decay = tl.where(m_tril & m_k[None, :], _intra_decay(b_mk, b_ri), 0.0)
    return o_t, m_q, m_k, m_tril, b_xk, b_v, b_mk, tl.exp(b_rp - b_ri), b_decay


@triton.jit
def _decay_again(mk_ptr, i_bh, T, o_t, m_q, b_rp, m_tril):
    """The causal decay exp(m_j - r_i) [BT, BT] of :func:`_chunk_keys` (not masked), made again
    from the keys' max logits read again (the same values): a walk that makes it where it is
    used keeps no [BT, BT] tile across its feature loops (a load is not merged with the first
    one, as a recomputation from the same values would be, and kept live)."""
    b_mj = tl.load(mk_ptr + i_bh * T + o_t, mask=m_q, other=NEG)
    return _intra_decay(b_mj, _row_offsets(b_rp, b_mj, m_tril))


@triton.jit
def _head_rows(q_ptr, o_ptr, olo_ptr, do_ptr, mq_ptr, den_ptr, mk_ptr, i_b, i_h, i_bh, g, G, T,
               o_t, o_d, o_e, m_q, m_k, m_d, m_e, m_tril, b_rp, b_v, b_decay, b_scq, stride_qb,
               stride_qh, stride_qt, stride_qd, stride_ob, stride_oh, stride_ot, stride_oe,
               stride_dob, stride_doh, stride_dot, stride_doe, PRECISION: tl.constexpr,
               ACC: tl.constexpr, OUT_LO: tl.constexpr, XDT: tl.constexpr,
               GROUPED: tl.constexpr):  # fmt: skip
    """Query head ``h * G + g``'s rows of the chunk: its index, queries [BT, BD] (unscaled), their
    max logits m_q [BT], the output's cotangent do [BT, BE] as given (the products take it,
    exact in a half format, never do / den rounded), den [BT], c [BT] and dK [BT, BT], causal
    (queries and do in ``XDT``; dK rounded to it too where that is the half format: it is only
    ever a product's operand). GROUPED (G > 1): the causal decay is made again for each head
    from the keys' max logits read again (the same values), not ``b_decay`` kept across the
    heads' loops (sm_90 bf16, G = 3: 1008 -> 928 stack bytes in ``_chunk_bwd``; with one head
    a group the kept one spills less, 168 against 200). T: the rows' stride in m_q, den, m_k
    (whose pointers, and q's, o's and do's, the caller gives at the sequence's first token)."""
    i_hq = i_h * G + g
    q_base = q_ptr + i_b * stride_qb + i_hq * stride_qh
    b_xq = load_rows(q_base, o_t, o_d, stride_qt, stride_qd, m_q, m_d, XDT)
    b_mq = tl.load(mq_ptr + (i_bh * G + g) * T + o_t, mask=m_q, other=0.0)
    o_off = i_b * stride_ob + i_hq * stride_oh
    b_do, b_den, b_c = query_rows(do_ptr + i_b * stride_dob + i_hq * stride_doh, o_ptr + o_off,
                                  olo_ptr + o_off, den_ptr, i_bh * G + g, o_t, o_e, T, m_q, m_e,
                                  stride_dot, stride_doe, stride_ot, stride_oe, ACC,
                                  OUT_LO, XDT)  # fmt: skip
    # dK_ij = (v_j . do_i / den_i + c_i) exp(m_j - r_i), causal: [BT, BE] @ [BE, BT]
    b_dK = product(b_do, tl.trans(b_v), PRECISION, ACC) / b_den[:, None]
    if GROUPED:
        b_decay = tl.where(m_tril & m_k[None, :],
                           _decay_again(mk_ptr, i_bh, T, o_t, m_q, b_rp, m_tril), 0.0)
    b_dK = tl.where(m_tril, (b_dK + b_c[:, None]) * b_decay, 0.0)
    if XDT != ACC:  # an operand only: held as the products round it
        b_dK = round_half(b_dK, XDT)
    return i_hq, b_xq, b_mq, b_do, b_den, b_c, b_dK


@triton.jit
def _tile_pair(b_xq, b_xk, b_scq, b_sck, b_nq, b_nk, b_mq, b_mk, m_q, m_k, w_ptr, i_m, o_d, m_d,
               b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, stride_wm, stride_wd, M: tl.constexpr,
               D: tl.constexpr, BM: tl.constexpr, FEATURE: tl.constexpr, HAS_LAM: tl.constexpr,
               PRECISION: tl.constexpr, TINY: tl.constexpr):  # fmt: skip
    """Feature tile i_m of the chunk's rows and keys (x~ = rows * scales, |x~|^2 = ``b_nq``,
    ``b_nk``; no tile of x~ formed) at the forward's offsets: ``(o_f, m_f, W [BM, BD],
    a = g_q e_q, e_q, the query side's feature_dx terms, key logits u_k (NEG where not valid),
    g_k, e_k, the key side's feature_dx terms)``, each ``[BT, BM]``."""
    o_f = i_m * BM + tl.arange(0, BM)
    m_f = o_f < M
    b_w = load_w(w_ptr, o_f, o_d, stride_wm, stride_wd, m_f, m_d)  # [BM, BD]
    b_uq, b_gq, b_g1q, b_g2q = feature_tile(
        None, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM,
        FEATURE, False, HAS_LAM, PRECISION, TINY, b_xq, b_scq, False, b_nq)  # fmt: skip
    b_eq = tl.where(m_q[:, None] & m_f[None, :], tl.exp(b_uq - b_mq[:, None]), 0.0)
    b_uk, b_gk, b_g1k, b_g2k = feature_tile(
        None, b_w, o_f, m_f, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr, i_m, M, D, BM,
        FEATURE, True, HAS_LAM, PRECISION, TINY, b_xk, b_sck, False, b_nk)  # fmt: skip
    m_kf = m_k[:, None] & m_f[None, :]
    b_uk = tl.where(m_kf, b_uk, NEG)
    b_ek = tl.where(m_kf, tl.exp(b_uk - b_mk[:, None]), 0.0)
    return o_f, m_f, b_w, b_gq * b_eq, b_eq, b_g1q, b_g2q, b_uk, b_gk, b_ek, b_g1k, b_g2k


@triton.jit
def _chunk_bwd_kernel(
    q_ptr, k_ptr, v_ptr, w_ptr, pad_ptr, scale: tl.float64, ab_ptr, psi_ptr, tab_ptr, xr_ptr,
    xi_ptr, r_ptr, gs_ptr, gz_ptr, gr_ptr, gd_ptr, gdz_ptr, o_ptr, olo_ptr, do_ptr, mq_ptr,
    den_ptr, mk_ptr, dq_ptr, dk_ptr, dv_ptr,
    T, H, NC, G, NS, CPS,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_ve,
    stride_wm, stride_wd, stride_pb, stride_pt,
    stride_ob, stride_oh, stride_ot, stride_oe,
    stride_dob, stride_doh, stride_dot, stride_doe,
    stride_dqb, stride_dqh, stride_dqt, stride_dqd,
    stride_dkb, stride_dkh, stride_dkt, stride_dkd,
    stride_dvb, stride_dvh, stride_dvt, stride_dve,
    cu_ptr, TR,
    D: tl.constexpr, M: tl.constexpr, E: tl.constexpr,
    BD: tl.constexpr, BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr,
    BPW: tl.constexpr, RM: tl.constexpr, HAS_PAD: tl.constexpr, FEATURE: tl.constexpr,
    PRECISION: tl.constexpr, ACC: tl.constexpr, HAS_AB: tl.constexpr, HAS_PSI: tl.constexpr,
    HAS_LAM: tl.constexpr, TINY: tl.constexpr, OUT_LO: tl.constexpr, GROUPED: tl.constexpr,
    HAS_EX: tl.constexpr, VARLEN: tl.constexpr,
):  # fmt: skip
    """Program (w, b*h), w < NS: the forward walk of segment w, its prefix state in the
    segment's carry slot (each M tile at its own offset): dq [BT, D] of each chunk for the G
    query heads. w >= NS: the reverse walk of segment w - NS, the cotangent of the state after
    each chunk in the segment's cotangent slot (at R_c): dk [BT, D], dv [BT, E] of each chunk,
    summed over the heads. Every row and key at the forward's offsets: prefix S at R_{c-1} read
    by row i times w_i = exp(R_{c-1} - r_i), pair (i, j) times exp(m_j - r_i), key j's share of
    the later rows' cotangent D_c times exp(m_j - R_c); every factor <= 1. VARLEN: (b, h)'s
    sequence by :func:`_span`."""
    i_w, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_h = i_bh % H
    i_b, t0, T, NCn, i_rb, RS = _span(cu_ptr, i_bh, H, T, TR, NC, BT, VARLEN)
    HALF_IN: tl.constexpr = PRECISION == "bf16" or PRECISION == "fp16"
    XDT: tl.constexpr = q_ptr.dtype.element_ty if HALF_IN else ACC
    NMT: tl.constexpr = (M + BM - 1) // BM
    NR: tl.constexpr = (M + RM - 1) // RM  # the states kernel's feature tiles (RM >= BM)
    # dq's term in x~ itself (the |x~|^2 coefficients): none for rmf; zero in exact arithmetic
    # for the GERF family, whose -|x~_i|^2 / 2 is one factor of every feature of row i that
    # the ratio cancels (sum_f phi_if da_if = do_i . out_i + c_i den_i = 0), unless the
    # hybrid's exact terms joined the ratio (HAS_EX); adding the rounding of that zero kept a
    # [BT, BD] tile of x~ across the feature loop (sm_90 bf16 posrf: 168 -> 136 stack bytes)
    QX: tl.constexpr = FEATURE == 1 or (FEATURE == 0 and HAS_EX)
    o_d, o_e = tl.arange(0, BD), tl.arange(0, BE)
    m_d, m_e = o_d < D, o_e < E
    b_ca, b_cb, b_cd = gerf_coeffs(ab_ptr, i_bh, HAS_AB, ACC)
    b_scq = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, False, ACC)
    b_sck = input_scale(scale, psi_ptr, i_bh, o_d, m_d, D, BD, HAS_PSI, True, ACC)
    k_base = k_ptr + i_b * stride_kb + i_h * stride_kh
    v_base = v_ptr + i_b * stride_vb + i_h * stride_vh
    p_pad, p_mq, p_den, p_mk = pad_ptr, mq_ptr, den_ptr, mk_ptr
    p_q, p_o, p_olo, p_do = q_ptr, o_ptr, olo_ptr, do_ptr
    if VARLEN:  # the sequence's rows: keys, values, pad, m_q, den, m_k, q, o, do from its first
        k_base += t0 * stride_kt
        v_base += t0 * stride_vt
        p_pad, p_mq, p_den, p_mk = pad_ptr + t0 * stride_pt, mq_ptr + t0, den_ptr + t0, mk_ptr + t0
        p_q, p_o = q_ptr + t0 * stride_qt, o_ptr + t0 * stride_ot
        p_olo, p_do = olo_ptr + t0 * stride_ot, do_ptr + t0 * stride_dot
    i_s = i_w % NS
    c0 = i_s * CPS
    c1 = tl.minimum(c0 + CPS, NCn)
    p_g = i_bh * NS + i_s  # the segment's slot: prefix state (gs) or its cotangent (gd)
    if i_w < NS:  # dq: the forward walk
        o_p = tl.arange(0, BPW)  # the offsets of this kernel's M tiles, from the carry's
        b_rt = tl.load(gr_ptr + (i_bh * (NS + 1) + i_s) * NR + o_p * BM // RM, mask=o_p < NMT,
                       other=NEG)  # fmt: skip
        for i_c in range(c0, c1):
            b_rp = tl.max(b_rt, axis=0)  # R_{c-1}
            o_t, m_q, m_k, m_tril, b_xk, b_v, b_mk, b_wr, b_decay = _chunk_keys(
                k_base, v_base, p_pad, p_mk, i_b, i_rb, i_c, b_sck, b_rp, o_d, o_e, m_d, m_e,
                T, RS, stride_kt, stride_kd, stride_vt, stride_ve, stride_pb, stride_pt, BT,
                HAS_PAD, ACC, XDT)  # fmt: skip
            b_nk = sq_norms(b_xk.to(ACC) * b_sck[None, :])
            for g in range(0, G):
                i_hq, b_xq, b_mq, b_do, b_den, b_c, b_dK = _head_rows(
                    p_q, p_o, p_olo, p_do, p_mq, p_den, p_mk, i_b, i_h, i_rb, g, G,
                    RS, o_t, o_d, o_e, m_q, m_k, m_d, m_e, m_tril, b_rp, b_v, b_decay, b_scq,
                    stride_qb, stride_qh, stride_qt, stride_qd, stride_ob, stride_oh, stride_ot,
                    stride_oe, stride_dob, stride_doh, stride_dot, stride_doe, PRECISION, ACC,
                    OUT_LO, XDT, GROUPED)  # fmt: skip
                b_dxq = tl.zeros([BT, BD], dtype=ACC)
                b_dhq = tl.zeros([BT], dtype=ACC)  # the coefficient of x~ in dq, summed
                b_nq = sq_norms(b_xq.to(ACC) * b_scq[None, :])
                for i_m in range(0, NMT):
                    o_f, m_f, b_w, b_a, b_eq, b_g1q, b_g2q, b_uk, b_gk, b_ek, b_g1k, b_g2k = \
                        _tile_pair(b_xq, b_xk, b_scq, b_sck, b_nq, b_nk, b_mq, b_mk, m_q, m_k,
                                   w_ptr, i_m, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr,
                                   stride_wm, stride_wd, M, D, BM, FEATURE, HAS_LAM, PRECISION,
                                   TINY)  # fmt: skip
                    m_kf = m_k[:, None] & m_f[None, :]
                    b_b = b_gk * b_ek  # [BT, BM]
                    # the tile's state before the chunk, at its own offset r_m
                    b_rm = tl.max(tl.where(o_p == i_m, b_rt, NEG), axis=0)
                    o_fe = o_f[:, None] * E + o_e[None, :]
                    m_fe = m_f[:, None] & m_e[None, :]
                    b_s = tl.load(gs_ptr + p_g * M * E + o_fe, mask=m_fe, other=0.0)  # [BM, BE]
                    b_z = tl.load(gz_ptr + p_g * M + o_f, mask=m_f, other=0.0)  # [BM]
                    # da = w (do S^T / den + c z) + dK b: [BT, BE] @ [BE, BM], [BT, BT] @ [BT, BM]
                    b_da = product(b_do, tl.trans(b_s), PRECISION, ACC, False, True) / \
                        b_den[:, None]  # fmt: skip
                    b_fr = b_wr * tl.exp(b_rm - b_rp)  # [BT] to R_{c-1}, then to r_i
                    b_da = (b_da + b_c[:, None] * b_z[None, :]) * b_fr[:, None]
                    b_da += product(b_dK, b_b, PRECISION, ACC, False, FEATURE != 0)
                    b_dx, b_dh = feature_dx(b_a * b_da, b_eq * b_da, b_g1q, b_g2q, None, b_w,
                                            o_f, m_f, o_d, m_d, b_cb, tab_ptr, xr_ptr, xi_ptr,
                                            i_m, M, D, BM, FEATURE, False, PRECISION, TINY,
                                            b_xq, b_scq)  # fmt: skip
                    b_dxq += b_dx
                    b_dhq += b_dh
                    if g == G - 1:  # every head has read it: the chunk's keys into the tile
                        b_rn = tl.maximum(b_rm, tl.max(tl.max(b_uk, axis=1), axis=0))
                        b_p = tl.where(m_kf, b_gk * tl.exp(b_uk - b_rn), 0.0)  # [BT, BM]
                        b_al = tl.exp(b_rm - b_rn)
                        b_s = b_s * b_al + product(tl.trans(b_p), b_v, PRECISION, ACC,
                                                   FEATURE != 0)  # fmt: skip
                        b_z = b_z * b_al + tl.sum(b_p, axis=0)
                        tl.debug_barrier()  # every thread's loads of the tile before its stores
                        tl.store(gs_ptr + p_g * M * E + o_fe, b_s, mask=m_fe)
                        tl.store(gz_ptr + p_g * M + o_f, b_z, mask=m_f)
                        b_rt = tl.where(o_p == i_m, b_rn, b_rt)
                if QX:
                    b_dxq += b_dhq[:, None] * b_scq[None, :] * b_xq.to(ACC)
                store_tile(dq_ptr, i_b, i_hq, t0 + o_t, o_d, stride_dqb, stride_dqh, stride_dqt,
                           stride_dqd, b_dxq * b_scq[None, :], m_q, m_d)  # fmt: skip
            tl.debug_barrier()  # the state's stores before the next chunk's loads
    else:  # dk, dv: the reverse walk
        for i_r in range(0, c1 - c0):
            i_c = c1 - 1 - i_r
            b_rp = _prefix_offset(r_ptr, gr_ptr, i_bh, i_c, NC, NS, CPS, NR, BP)  # R_{c-1}
            o_t, m_q, m_k, m_tril, b_xk, b_v, b_mk, b_wr, b_decay = _chunk_keys(
                k_base, v_base, p_pad, p_mk, i_b, i_rb, i_c, b_sck, b_rp, o_d, o_e, m_d, m_e,
                T, RS, stride_kt, stride_kd, stride_vt, stride_ve, stride_pb, stride_pt, BT,
                HAS_PAD, ACC, XDT)  # fmt: skip
            b_nk = sq_norms(b_xk.to(ACC) * b_sck[None, :])
            b_rc = tl.maximum(b_rp, tl.max(b_mk, axis=0))  # R_c
            b_kf = tl.exp(b_mk - b_rc)  # [BT] exp(m_j - R_c)
            b_dxk = tl.zeros([BT, BD], dtype=ACC)
            b_dhk = tl.zeros([BT], dtype=ACC)  # the coefficient of x~ in dk, summed
            b_dv = tl.zeros([BT, BE], dtype=ACC)
            for g in range(0, G):  # each query head: its share of dk, dv and of D_{c-1}
                i_hq, b_xq, b_mq, b_do, b_den, b_c, b_dK = _head_rows(
                    p_q, p_o, p_olo, p_do, p_mq, p_den, p_mk, i_b, i_h, i_rb, g, G,
                    RS, o_t, o_d, o_e, m_q, m_k, m_d, m_e, m_tril, b_rp, b_v, b_decay, b_scq,
                    stride_qb, stride_qh, stride_qt, stride_qd, stride_ob, stride_oh, stride_ot,
                    stride_oe, stride_dob, stride_doh, stride_dot, stride_doe, PRECISION, ACC,
                    OUT_LO, XDT, GROUPED)  # fmt: skip
                b_A = tl.zeros([BT, BT], dtype=ACC)
                b_nq = sq_norms(b_xq.to(ACC) * b_scq[None, :])
                for i_m in range(0, NMT):
                    o_f, m_f, b_w, b_a, b_eq, b_g1q, b_g2q, b_uk, b_gk, b_ek, b_g1k, b_g2k = \
                        _tile_pair(b_xq, b_xk, b_scq, b_sck, b_nq, b_nk, b_mq, b_mk, m_q, m_k,
                                   w_ptr, i_m, o_d, m_d, b_ca, b_cb, b_cd, tab_ptr, xr_ptr, xi_ptr,
                                   stride_wm, stride_wd, M, D, BM, FEATURE, HAS_LAM, PRECISION,
                                   TINY)  # fmt: skip
                    b_b = b_gk * b_ek  # [BT, BM]
                    # db = dK^T a (+ kf (v D^T + dz) once per key, not once per query head)
                    b_db = product(tl.trans(b_dK), b_a, PRECISION, ACC, False, FEATURE != 0)
                    o_fe = o_f[:, None] * E + o_e[None, :]
                    m_fe = m_f[:, None] & m_e[None, :]
                    b_ds = tl.load(gd_ptr + p_g * M * E + o_fe, mask=m_fe, other=0.0)  # [BM, BE]
                    b_dz = tl.load(gdz_ptr + p_g * M + o_f, mask=m_f, other=0.0)  # [BM]
                    if g == 0:  # D_c, dz_c: the cotangent after chunk c at R_c
                        b_dbs = product(b_v, tl.trans(b_ds), PRECISION, ACC, False, True)
                        b_db += (b_dbs + b_dz[None, :]) * b_kf[:, None]
                        # inter-chunk dv = kf b D: [BT, BM] @ [BM, BE]
                        b_dv += product(b_b * b_kf[:, None], b_ds, PRECISION, ACC, FEATURE != 0,
                                        FEATURE != 0)  # fmt: skip
                        b_fc = tl.exp(b_rp - b_rc)  # D_{c-1} = L_c + exp(R_{c-1} - R_c) D_c
                        b_ds, b_dz = b_ds * b_fc, b_dz * b_fc
                    # the head's rows' share of L_c = sum_i w_i a_i g_i^T, l_c = sum_i w_i c_i a_i
                    b_ds += product(tl.trans(b_a * (b_wr / b_den)[:, None]), b_do, PRECISION,
                                    ACC, FEATURE != 0)  # fmt: skip
                    b_dz += tl.sum(b_a * (b_c * b_wr)[:, None], axis=0)
                    tl.debug_barrier()  # every thread's loads of the tile before its stores
                    tl.store(gd_ptr + p_g * M * E + o_fe, b_ds, mask=m_fe)
                    tl.store(gdz_ptr + p_g * M + o_f, b_dz, mask=m_f)
                    b_dx, b_dh = feature_dx(b_b * b_db, b_ek * b_db, b_g1k, b_g2k, None, b_w,
                                            o_f, m_f, o_d, m_d, b_cb, tab_ptr, xr_ptr, xi_ptr,
                                            i_m, M, D, BM, FEATURE, True, PRECISION, TINY,
                                            b_xk, b_sck)  # fmt: skip
                    b_dxk += b_dx
                    b_dhk += b_dh
                    # intra dv needs A = a b^T over all features
                    b_A += product(b_a, tl.trans(b_b), PRECISION, ACC, FEATURE != 0, FEATURE != 0)
                # the causal decay made again: the one made before the loop is not kept
                b_A = tl.where(m_tril & m_k[None, :],
                               b_A * _decay_again(p_mk, i_rb, RS, o_t, m_q, b_rp, m_tril), 0.0)
                b_dv += product(tl.trans(b_A / b_den[:, None]), b_do, PRECISION, ACC,
                                FEATURE != 0)  # fmt: skip
                tl.debug_barrier()  # the cotangent's stores before the next loads
            if FEATURE != 2:
                b_dxk += b_dhk[:, None] * b_sck[None, :] * b_xk.to(ACC)
            store_tile(dk_ptr, i_b, i_h, t0 + o_t, o_d, stride_dkb, stride_dkh, stride_dkt,
                       stride_dkd, b_dxk * b_sck[None, :], m_q, m_d)  # fmt: skip
            store_tile(dv_ptr, i_b, i_h, t0 + o_t, o_e, stride_dvb, stride_dvh, stride_dvt,
                       stride_dve, b_dv, m_q, m_e)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# launchers


#: segments per (b, h) that the walks over the chunks split into, at most
MAX_SEGMENTS = 8
#: chunks a walk's program takes in turn, at most, where MAX_SEGMENTS allows
SEGMENT_STEPS = 32
#: segments per (b, h) where no GPU picks them (the interpreter, a fake device): two, so that
#: the carries between segments run in every test with more than one chunk
HOST_SEGMENTS = 2


def sm_count(device: torch.device) -> int | None:
    """The streaming multiprocessors of ``device``, or None where no GPU picks the segments."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def segments(NC: int, BH: int, sms: int | None) -> tuple[int, int]:
    """(segments per (b, h), chunks per segment) of the walks over ``NC`` chunks of ``BH`` (b, h)
    on ``sms`` SMs (None: :data:`HOST_SEGMENTS`): enough that no program walks more than
    SEGMENT_STEPS chunks and that the output walk's grid (segments, B*H), the smallest of the
    walks', holds two programs per SM, at most MAX_SEGMENTS and one chunk each."""
    want = HOST_SEGMENTS if sms is None else max(cdiv(NC, SEGMENT_STEPS), cdiv(2 * sms, BH))
    want = max(1, min(MAX_SEGMENTS, want, NC))
    per = cdiv(NC, want)
    # fewer chunks each where rounding up left fewer segments than wanted (16 chunks in 5)
    while per > 1 and cdiv(NC, per) < want and cdiv(NC, per - 1) <= MAX_SEGMENTS:
        per -= 1
    return cdiv(NC, per), per


#: per-shape plans of the launchers (:func:`common.shape_plan`)
_FWD_PLANS = plan_cache()
_BWD_PLANS = plan_cache()


def _plan(q, k, v, form, scale, key_padding_mask, precision, gpu_tiles, backward: bool,
          has_init: bool, has_dfinal: bool, has_lo: bool, has_ex: bool = False, varlen=None,
          *_layout):  # fmt: skip
    """What a causal launcher of one shape derives once (``backward``: the backward's plan, else
    the forward's; ``has_init``: an initial state given; ``has_dfinal``: the backward gets the
    final state's cotangent; ``has_lo``: the backward reads the output's rounding residual;
    ``has_ex``: the backward of the hybrid's forward (exact terms in the ratio); ``varlen``:
    None, or packed sequences' ``(N, longest, longest, ...)``, :func:`common.varlen_key`: the
    walks' segments and arrays are then those of N rows of the longest sequence's tokens;
    ``_layout``: the backward's out and do, in the key only): the
    setup's sizes and constexprs, the segments, the scratch (the carries, and the backward's
    walk offsets and cotangents: written and read by the call's own launches) and the bound
    launches with their integer arguments."""
    c = launch_setup(q, k, v, form, scale, key_padding_mask, precision, causal=True,
                     gpu_tiles=gpu_tiles)  # fmt: skip
    if backward:
        check_forward_only(c)
    B, H, G, T, M, E, NMT, acc = c.B, c.H, c.G, c.Tq, c.M, c.E, c.NMT, c.acc
    # the rows of per-token statistics: [B*H*G, T] (queries), [B*H, T] (keys); packed, [H*G,
    # total] and [H, total] at each sequence's offset
    TR, heads = T, B * H
    if varlen is not None:
        B, T, heads = varlen[0], varlen[1], H
    BH = B * H
    NC = max(cdiv(T, c.BT), 1)
    NS, per = segments(NC, max(BH, 1), sm_count(k.device))  # (no (b, h): no launch)
    pad = c.pad[1:]  # the int32 mask's strides (contiguous), or placeholders
    warps = CHUNK_HALF_WARPS if c.itemsize <= 2 else None  # (the tiles': _chunk_tiles)
    meta = dict(**c.launch_options(warps), BT=c.BT, BP=next_pow2(NMT), VARLEN=varlen is not None,
                **c.meta)  # fmt: skip
    walk = (T, H, NC, G, NS, per, TR)
    carries = ((BH, NS, M, E), (BH, NS, M), (BH, NS + 1, NMT))
    p = dict(
        B=B, H=H, G=G, T=T, M=M, E=E, D=c.D, NMT=NMT, NS=NS, acc=acc, root=c.form_ptrs[0],
        has_pad=c.has_pad, counters=BH * (NMT + 2) + 1,
        # the states kernel's constexprs and integer arguments (the stats' come after them)
        states_meta=dict(HAS_PAD=c.has_pad, HAS_MAP=c.has_map, HAS_INIT=has_init,
                         PLAIN=c.plain, FINAL=not backward, OFFSETS=backward, **meta),
        states_ints=(T, H, BH, NC, NS, per, *k.stride(), *v.stride(), *c.w.stride(), *pad),
        varlen=varlen, TR=TR,
    )  # fmt: skip
    no_stats = chunk_stats_arguments(None, q, k, B, H, G, c.D, acc)[2]
    states = Launch(_chunk_states_kernel, (NMT * NS * BH,), **p["states_meta"], **no_stats)
    if not backward:
        out = (H * G * TR * E, TR * E, E, 1)  # contiguous, made by the launcher
        rows = ((heads * G, TR), (heads * G, TR), (heads, TR))
        final = ((B, H, M, E), (B, H, M), (B, H))
        # a half output keeps its rounding residual where a backward follows, whatever the
        # products (as the non-causal query pass does)
        lo = keeps_out_residual(q.dtype)
        # the output walk by (with its rounding residual, with exact terms: the hybrid)
        walks = {(o, x): Launch(_chunk_out_kernel, (NS, BH), HAS_PAD=c.has_pad,
                                HAS_MAP=c.has_map, OUT_LO=o, HAS_EX=x, **meta)
                 for o in ((False, True) if lo else (False,)) for x in (False, True)}
        return Plan(
            **p, states=states, stats={}, scratch=Scratch(acc, *carries), lo=lo,
            rows=rows, final=final,
            # a call that returns neither: the rows and the final state are scratch too
            # (written, never read); one that returns the state only: the rows
            scratch_all=Scratch(acc, *carries, *rows, *final),
            scratch_rows=Scratch(acc, *carries, *rows),
            # a call whose backward plan comes with it (``backward_plan``): the rows kept for
            # the backward in one allocation, the final state (unless returned) with the
            # carries, and the backward's plans by the cotangents' layout
            kept=Scratch(acc, *rows), scratch_final=Scratch(acc, *carries, *final), bwd={},
            has_init=has_init,
            walks=walks, out=walks[False, False],
            out_ints=(*walk[:-1], *q.stride(), *k.stride(), *v.stride(), *c.w.stride(), *pad, *out),
        )  # fmt: skip
    return Plan(
        **p, states=states,
        # the walks' offsets before each chunk, the carries, the cotangents' carries
        scratch=Scratch(acc, (BH, NC + 1, NMT), *carries, (BH, NS, M, E), (BH, NS, M)),
        dstates=Launch(_chunk_dstates_kernel, (NMT, NS, BH), HAS_DFINAL=has_dfinal,
                       HAS_INIT=has_init, OUT_LO=has_lo, **meta),
        dstates_ints=(*walk, *q.stride(), *c.w.stride()),
        bwd=Launch(_chunk_bwd_kernel, (2 * NS, BH), BPW=next_pow2(cdiv(M, 16)), RM=c.BM,
                   HAS_PAD=c.has_pad, OUT_LO=has_lo, GROUPED=G > 1, HAS_EX=has_ex, **meta),
        bwd_ints=(*walk[:-1], *q.stride(), *k.stride(), *v.stride(), *c.w.stride(), *pad),
    )  # fmt: skip


def plans(q, k, v, form, scale: float, key_padding_mask=None, precision=None, gpu_tiles=None,
          has_init: bool = False):  # fmt: skip
    """``(forward plan, backward plan)`` of a causal call of these inputs (a backward with a
    contiguous cotangent and no final-state cotangent): its launches (``plan.states``,
    ``.out``; ``.states``, ``.dstates``, ``.bwd``: :class:`common.Launch`, with their grids)
    and its scratch (``plan.scratch``: :class:`common.Scratch`, every buffer a launcher
    allocates beside its outputs, the forward's row statistics and the returned state), made
    without launching anything: what a call of this shape would run and hold on a GPU
    (``gpu_tiles=True``)."""
    out = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    do = torch.empty(out, dtype=q.dtype, device=q.device)
    # (no packed sequences here: _plan's varlen None)
    fwd = _plan(q, k, v, form, scale, key_padding_mask, precision, gpu_tiles, False, has_init,
                False, False)  # fmt: skip
    bwd = _plan(q, k, v, form, scale, key_padding_mask, precision, gpu_tiles, True, has_init,
                False, fwd.lo, False, None, do.stride(), do.stride(), 0, 0)  # fmt: skip
    return fwd, bwd


def _state_in(x, acc, placeholder):
    """A state tensor the kernels read: in the accumulation dtype, contiguous and aligned (what
    the plan's launches take), or the placeholder where it is absent."""
    return placeholder if x is None else aligned(x.to(acc).contiguous())


def rf_chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form,
    scale: float,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: tuple | None = None,
    precision: str | None = None,
    return_aux: bool = False,
    gpu_tiles: bool | None = None,
    return_state: bool = True,
    backward_plan: bool = False,
    exact: tuple | None = None,
    packed=None,
):
    """Causal fused random-feature attention forward (chunkwise).

    Args:
        q: ``[B, H * G, T, D]``; k: ``[B, H, T, D]``; v: ``[B, H, T, E]`` (any strides, one
            dtype): G query heads per key/value head (grouped-query attention, query head
            ``h * G + g`` reads key/value head h; G = 1 otherwise). Key features, chunk states
            and the returned state are per key/value head.
        form, scale, key_padding_mask, precision, gpu_tiles: as ``rf_parallel.rf_parallel_fwd``
            (every kernel form).
        initial_state: optional ``(S [B, H, M, E], z [B, H, M], offset [B, H])`` to continue, in
            ``rfattn.RFState``'s convention (offset -inf before any valid key).
        return_aux: also return what the backward needs.
        return_state: False: the final state is not wanted (None in its place; without
            ``return_aux`` the kernels then write it, and the rows, into the call's scratch:
            one allocation besides the output instead of seven).
        backward_plan: with ``return_aux``, the auxiliaries as :func:`rf_chunk_bwd` takes them
            with its ``plan``: the rows in one allocation (the final state, unless returned,
            in the call's scratch), and the plan the backward is found from.
        exact: the hybrid's exact terms (``rfattn.hybrid``), ``(nex [B, H * G, T, E], dex,
            eex, wex [B, H * G, T])``, contiguous and aligned, in the accumulation dtype: each
            row's numerator and denominator at its offset ``eex`` (-inf: none; in the kernel's
            units: plus log N) join the row's before the ratio (``_chunk_out_kernel``'s
            HAS_EX), and ``wex`` is written with their cotangent factor. The output, the saved
            den and the backward are then the hybrid's: :func:`rf_chunk_bwd` gives the
            features' gradients as they are, with the total denominator.
        packed: packed sequences, ``(cu, cu, max_len, max_len)`` (``rf_parallel_fwd``'s, the
            queries' and keys' offsets the same): q ``[1, H * G, total, D]``, k, v ``[1, H,
            total, .]`` hold N sequences, each attended on its own (its chunks from its first
            token, never across a boundary); states ``[N, H, ...]`` (initial and returned),
            the rows ``[H * G, total]`` and ``[H, total]``. No statistics formed here
            (``form.stats``) nor ``exact``.

    Returns:
        ``(out [B, H * G, T, E], (S, z, offset))`` with the final state ``[B, H, ...]`` in the
        accumulation dtype and ``rfattn.RFState``'s convention; with ``return_aux`` also
        ``(m_q, den, m_k, out_lo)``: the queries' offsets and the denominators at the rows'
        offsets r_i (``[B*H*G, T]``), the keys' max logits m_j (``[B*H, T]``) and, for fp16/bf16
        inputs, the output's rounding residual (``common.store_out``; shaped and typed as
        out), else an empty tensor; with ``backward_plan`` instead ``(kept, out_lo)``,
        ``kept`` the one allocation of m_q, den and m_k, followed by the plan for
        :func:`rf_chunk_bwd` (``(out, state, (kept, out_lo), plan)``, state None unless
        ``return_state``).

    Everything but the call's tensors (checks, setup, segments, launches) comes from the plan
    of the call's shape (:func:`common.shape_plan`), made at its first call.
    """
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"causal attention needs Tq == Tk, got {q.shape[2]} and {k.shape[2]}")
    p = shape_plan(_FWD_PLANS, _plan, q, k, v, form, scale, key_padding_mask, precision,
                   gpu_tiles, False, initial_state is not None, False, False, False,
                   packed and varlen_key(*packed))  # fmt: skip
    B, H, G, T, E, acc, dev = p.B, p.H, p.G, p.T, p.E, p.acc, q.device
    stats = form.stats  # running statistics this launch forms and moves (or None)
    # a form made for this call (its statistics formed here) is converted, not kept
    w, *ptrs, qmap, kmap = form_args(form, B, H * G, H, acc, dev, keep=stats is None)
    out = torch.empty(*q.shape[:3], E, device=dev, dtype=q.dtype)
    cu = w if packed is None else packed[0]  # (a placeholder: not read)
    # for a backward: the half output's rounding residual, written by the output walk that
    # OUT_LO compiles it into
    olo = torch.empty_like(out) if return_aux and p.lo else None
    if B * H == 0:
        state = tuple(torch.empty(x, device=dev, dtype=acc) for x in p.final) \
            if return_aux or return_state else None  # fmt: skip
        if not return_aux:
            return out, state
        lo = out.new_empty(0) if olo is None else olo
        if backward_plan:
            return out, state if return_state else None, (p.kept(dev, False)[0], lo), \
                (p, (w, *ptrs, qmap, kmap))  # fmt: skip
        rows = tuple(torch.empty(x, device=dev, dtype=acc) for x in p.rows)
        return out, state, (*rows, lo)
    roles, stats_args, stats_meta = chunk_stats_arguments(stats, q, k, B, H, G, p.D, acc)
    if stats is None:  # (placeholders for the statistics' arguments)
        states = p.states
    else:  # the stats roles first (a launch of their own per roles and constexprs)
        key = (roles, *stats_meta.items())
        states = p.stats.get(key)
        if states is None:
            states = p.stats[key] = Launch(_chunk_states_kernel,
                                           (roles + p.NMT * p.NS * B * H,),
                                           **p.states_meta, **stats_meta)  # fmt: skip
    walk, lo_ptr = p.walks[olo is not None, exact is not None], out if olo is None else olo
    ex = (w, w, w, w) if exact is None else exact
    # the carries, and the rows and the final state where they are not returned (written,
    # never read): scratch, as device addresses once both launches replay
    addresses = states.direct is not None and walk.direct is not None
    kept = None
    if backward_plan:  # the rows in one allocation, the final state (unless returned) scratch
        scratch = p.scratch if return_state else p.scratch_final
        kept, (mq, den, mk) = p.kept(dev, addresses)
    else:
        scratch = p.scratch if return_aux else p.scratch_rows if return_state else p.scratch_all
    ws, (gs, gz, gr, *rest) = scratch(dev, addresses)
    if kept is None and return_aux:
        mq, den, mk = tuple(torch.empty(x, device=dev, dtype=acc) for x in p.rows)
    elif kept is None:
        mq, den, mk, *rest = rest
    if return_state or return_aux and kept is None:
        state = sT, zT, rT = tuple(torch.empty(x, device=dev, dtype=acc) for x in p.final)
    else:
        state, (sT, zT, rT) = None, rest
    s0, z0, r0 = (gs,) * 3 if initial_state is None else \
        (_state_in(x, acc, gs) for x in initial_state)  # fmt: skip
    pad = mask_rows(key_padding_mask) if p.has_pad else w
    states(k, v, w, pad, p.root, *ptrs, kmap, s0, z0, r0, gr, gs, gz, gr, sT, zT, rT,
           arrival_counters(dev, p.counters), cu, *p.states_ints, *stats_args)  # fmt: skip
    if T:
        walk(q, k, v, w, pad, p.root, *ptrs, qmap, kmap, gs, gz, gr, out, lo_ptr, mq, den, mk,
             *ex, *p.out_ints, cu, p.TR)  # fmt: skip
    if not return_aux:
        return out, state
    lo = out.new_empty(0) if olo is None else olo
    if backward_plan:
        return out, state, (kept, lo), (p, (w, *ptrs, qmap, kmap))
    return out, state, (mq, den, mk, lo)


def rf_chunk_bwd(
    do: torch.Tensor,
    dstate: tuple | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    form,
    scale: float,
    out: torch.Tensor,
    aux: tuple,
    key_padding_mask: torch.Tensor | None = None,
    initial_state: tuple | None = None,
    precision: str | None = None,
    gpu_tiles: bool | None = None,
    plan=None,
    exact: bool = False,
    packed=None,
):
    """Backward of :func:`rf_chunk_fwd` (chunk states recomputed).

    Args:
        do: ``[B, H, T, E]`` cotangent of the output.
        dstate: None or ``(dS [B, H, M, E], dz [B, H, M])``, cotangents of the final state.
        out, aux: the forward's output and ``(m_q, den, m_k, out_lo)`` (``out_lo`` read where it
            is not empty; a 3-tuple: none); with ``plan``, the forward's ``(kept, out_lo)``.
            The rest as given to the forward.
        plan: what the forward of these inputs returned with ``backward_plan`` (its plan and
            the form's arguments): the backward's plan is then the forward plan's, by the
            cotangents' layout, looked up by nothing else.
        exact: the forward joined the hybrid's exact terms to the ratio (its ``exact``): the
            queries' |x~|^2 term of dq does not cancel then (``_chunk_bwd_kernel``'s HAS_EX).
        packed: as given to the forward.

    Returns:
        ``(dq, dk, dv, dS0, dz0)``; the last two are None without ``initial_state``.
    """
    has_init = initial_state is not None
    if plan is not None:  # the forward's plan holds the backward's, by the cotangents' layout
        fwd, fargs = plan
        layout = (dstate is not None, exact, do.stride(), do.data_ptr() % 16)
        p = fwd.bwd.get(layout)
        if p is None:
            p = fwd.bwd[layout] = _plan(q, k, v, form, scale, key_padding_mask, precision,
                                        gpu_tiles, True, fwd.has_init, dstate is not None,
                                        fwd.lo, exact, fwd.varlen)  # fmt: skip
        kept, olo = aux
        olo = olo if fwd.lo else None
    else:
        mq, den, mk, *lo = aux
        olo = lo[0] if lo and lo[0].numel() else None
        # the strides and alignment of out and do are the plan's too (Triton specialises;
        # out_lo is made as out is)
        p = shape_plan(_BWD_PLANS, _plan, q, k, v, form, scale, key_padding_mask, precision,
                       gpu_tiles, True, has_init, dstate is not None, olo is not None, exact,
                       packed and varlen_key(*packed), out.stride(), do.stride(),
                       out.data_ptr() % 16, do.data_ptr() % 16)  # fmt: skip
        fargs = None
    B, H, G, M, E, T, acc, dev = p.B, p.H, p.G, p.M, p.E, p.T, p.acc, q.device
    olo = out if olo is None else olo
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ds0 = torch.empty(B, H, M, E, device=dev, dtype=acc) if has_init else None
    dz0 = torch.empty(B, H, M, device=dev, dtype=acc) if has_init else None
    if B * H == 0:
        return dq, dk, dv, ds0, dz0
    w, *ptrs, _, _ = fargs or form_args(form, B, H * G, H, acc, dev)
    cu = w if packed is None else packed[0]  # (a placeholder: not read)
    # the walks' offsets, the carries and the cotangents' carries: scratch, as device addresses
    # once the three launches replay
    addresses = p.states.direct is not None and p.dstates.direct is not None and \
        p.bwd.direct is not None  # fmt: skip
    ws, (r, gs, gz, gr, gd, gdz) = p.scratch(dev, addresses)
    if plan is not None:  # the rows in the forward's one allocation
        mq, den, mk = fwd.kept.at(kept, addresses)
    s0, z0, r0 = (gs,) * 3 if initial_state is None else \
        (_state_in(x, acc, gs) for x in initial_state)  # fmt: skip
    dsT, dzT = (gd, gd) if dstate is None else (_state_in(x, acc, gd) for x in dstate)
    pad = mask_rows(key_padding_mask) if p.has_pad else w
    tails = backward_strides(p, out, do, dq, dk, dv)
    # the parameters as the forward's first launch formed them (never its statistics again)
    p.states(k, v, w, pad, p.root, *ptrs, w, s0, z0, r0, r, gs, gz, gr, gs, gs, gs,
             arrival_counters(dev, p.counters), cu, *p.states_ints,
             *chunk_stats_arguments(None, q, k, B, H, G, p.D, acc)[1])  # fmt: skip
    p.dstates(q, w, p.root, *ptrs, out, olo, do, mq, den, mk, r, gr, dsT, dzT, gd, gdz,
              ds0 if has_init else gd, dz0 if has_init else gdz,
              arrival_counters(dev, B * H * p.NMT), cu, *p.dstates_ints, *tails[0])  # fmt: skip
    if T:  # the forward walks (dq) and the reverse walks (dk, dv), one launch
        p.bwd(q, k, v, w, pad, p.root, *ptrs, r, gs, gz, gr, gd, gdz, out, olo, do, mq, den, mk,
              dq, dk, dv, *p.bwd_ints, *tails[1], cu, p.TR)  # fmt: skip
    return dq, dk, dv, ds0, dz0
