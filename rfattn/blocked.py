"""The torch path of :func:`rfattn.rf_attention`: blocked over T, with a hand-written backward.

This is the CPU backend (and the path every feature and option can take), built as the fused
kernels are: features are computed for one block of tokens at a time and dropped, never
``[T, F]`` for the whole sequence.

* Causal (:class:`_CausalAttention`): a block of ``T_b`` tokens is ``n`` chunks of ``C``
  (:class:`Block`). The chunks' own states and the intra-chunk products ``(phi_q phi_k^T ⊙
  decay) [V, 1]`` are a few batched products per block; the scan that carries the states is one
  in-place multiply-add per chunk, states held as ``[V, F]``. The forward keeps the state at
  each block start (``F (E+1)`` numbers per (b, h) per block) and the decayed intra-chunk
  products ``A`` (``C`` numbers per token and query head); the backward recomputes each block's
  features and states from them, runs the reverse scan (:meth:`Block.backward`) and returns the
  features' cotangents through autograd over the feature map (so every feature, its parameters
  and a learnable W get their gradients), the graph cut at the logits (:class:`_Side`: the
  exponential and its offsets are differentiated by hand, in place).
* Non-causal (:class:`_NoncausalAttention`): keys in blocks with per-feature running offsets
  (flash-style rescaling of ``S, z``), then queries in blocks; the backward recomputes query
  blocks, then key blocks at the forward's offsets.
* Given features (:class:`_CausalScan`, behind :func:`rfattn.torch_path.causal_scan`): the same
  causal blocks for the operators' torch kernels and the sharded path's local states.
* Heads in parallel: on a CPU with more than one intra-op thread, a large call of either
  Function runs its heads in contiguous parts, one per intra-op thread, each part's forward and
  backward on a worker thread with one intra-op thread (:func:`rfattn.threads.over_heads`;
  where W and the feature parameters are shared by the heads, :func:`_parts`).

Offsets are those of docs/numerics.md and of the fused chunk kernel: query row i reads
key j <= i at ``r_i = max(offset before the chunk, m_l for l <= i in the chunk)``, key j entering
as ``g_j exp(u_j - m_j) exp(m_j - r_i)`` with ``m_j`` its max logit; so no output depends on a
later key, not even through underflow. A non-finite key or value poisons the outputs from its
position on (by selection, never by multiplying with 0).

A call enters few Python functions (``tests/test_blocked.py`` counts them): a block's work is
written out in :class:`Block` and the loops, plain loops rather than generator expressions.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as nnf

from rfattn import threads, workspace
from rfattn.features import prescale, query_features
from rfattn.features.base import LOG2E, exp_diff, symbolic
from rfattn.reference import attention_ratio, linear_attention, safe_denominator

#: tokens per chunk (the intra-chunk block is [C, C] per (b, h, query head))
CHUNK = 64
#: query-feature elements per block (B * H * T_b * F): bounds the working memory of a block
BLOCK_ELEMENTS = 1 << 20

_NINF = float("-inf")
#: the [C, C] lower triangles of ones (diagonal included), by (C, dtype, device), made once
_LOWER: dict = {}


def chunk_of(tokens: int) -> int:
    """Tokens per chunk of a block of ``tokens``: :data:`CHUNK`, or the block itself where it is
    shorter (a decode step's few tokens, a short tail: no padding to a whole chunk; the same
    sums, in chunks of another size, which changes rounding only)."""
    return tokens if 0 < tokens < CHUNK else CHUNK


def block_tokens(rows: int, width: int) -> int:
    """Tokens per block for ``rows`` query rows (B * H) of ``width`` features: a multiple of
    :data:`CHUNK`, at least one chunk."""
    return max(CHUNK, BLOCK_ELEMENTS // max(1, rows * width) // CHUNK * CHUNK)


def value_width(E: int) -> int:
    """Columns of ``[V, 1]`` as the blocks hold it: E + 1 padded with zeros to a multiple of 8
    (CPU matrix products at odd widths run about 1.5x slower)."""
    return -(-(E + 1) // 8) * 8


class _Spec(NamedTuple):
    """What a call fixes besides its tensors: the feature map, scale, key mask, group size and
    the call's feature parameters (``params``: the forward's dict; those that are tensors are
    also the Function's last inputs, in the dict's order)."""

    fm: object
    scale: float
    mask: torch.Tensor | None
    groups: int
    params: dict


def _leaves(spec: _Spec, ptensors, need_p, w, need_w: bool, *xs) -> tuple:
    """``(leaves, w, parameters, param dict)`` detached, requiring grad where needed: the
    leaves of one block's recomputation in a backward (``xs``: pairs of a tensor and whether it
    needs a gradient)."""
    params, pl = dict(spec.params), []
    for name, x in spec.params.items():  # the tensors among them are ptensors, in order
        if torch.is_tensor(x):
            params[name] = ptensors[len(pl)].detach().requires_grad_(need_p[len(pl)])
            pl.append(params[name])
    leaves = []
    for x, need in xs:
        leaves.append(x.detach().requires_grad_(need))
    return leaves, w.detach().requires_grad_(need_w), pl, params


# ------------------------------------------------------------------------------------------------
# one block: inputs, features, offsets


def _key_values(v, mask, width: int, dtype, pad: int = 0) -> torch.Tensor:
    """``[V, 1, 0...]`` ``[B, H, T + pad, width]`` in ``dtype``, zero for padded keys (``mask``
    ``[B, T]``) and for the ``pad`` tokens that fill a block's last chunk (a kept buffer where
    one is kept: :func:`rfattn.workspace.buffer`)."""
    T, E = v.shape[-2:]
    vh = workspace.buffer("values", (*v.shape[:-2], T + pad, width), dtype, v.device)
    if vh is None:
        vh = nnf.pad(v.to(dtype), (0, width - E, 0, pad))
    else:
        vh[..., :T, :E] = v
        vh[..., :T, E + 1 :].zero_()  # (fill_ on views: an item assignment of a number copies
        vh[..., T:, :].zero_()  # it from the host)
    vh[..., :T, E].fill_(1.0)
    if mask is not None:
        vh[..., :T, :].masked_fill_(mask[:, None, :, None], 0.0)
    return vh


def _block_features(spec: _Spec, q, k, v, w, params: dict, mask, cut: bool = False):
    """``(query side, key side, [V, 1])`` of one causal block from its q, k, v and key mask
    (:class:`_Side`; ``cut``: a backward's recomputation): query rows ``[B, Hk, n*G*C, F]``
    (chunk-major, then query head, then token), keys ``[B, Hk, n*C, F]`` and values with a ones
    column ``[B, Hk, n, C, V]``, padded with the tokens that fill the last chunk (their keys
    masked; head maps from ``params``, applied block by block, never to the whole sequence)."""
    B, Hk, T, G = q.shape[0], k.shape[1], k.shape[2], spec.groups
    C = chunk_of(T)
    n = -(-T // C)
    pad = n * C - T
    xq = prescale(q, spec.scale, None, params.get("query_map"))
    xk = prescale(k, spec.scale, mask, params.get("key_map"))
    vh = _key_values(v, mask, value_width(v.shape[-1]), w.dtype, pad)
    if pad:  # the tokens that fill the last chunk: zeros, their keys masked
        xq, xk = nnf.pad(xq, (0, 0, 0, pad)), nnf.pad(xk, (0, 0, 0, pad))
        base = torch.zeros(B, T, dtype=torch.bool, device=q.device) if mask is None else mask
        mask = torch.cat((base, base.new_ones(B, pad)), dim=1)
    xq = xq.unflatten(1, (Hk, G)).unflatten(3, (n, C)).transpose(2, 3).flatten(2, 4)
    qs = _Side(spec.fm, xq, w, params, "query", cut=cut)
    ks = _Side(spec.fm, xk, w, params, "key", mask, cut=cut)
    return qs, ks, vh.unflatten(2, (n, C))


def _keys(u, g, mask, exponential: bool, inplace: bool = False, offsets=None, out=None):
    """``(phi_k, m)``: keys at their own max logit ``g exp(u - m)`` (plain features: ``u`` is the
    features, m = 0) and ``m`` ``[B, H, T]`` (detached; -inf for padded keys, not finite for a
    key whose features are not), padded keys 0. ``offsets`` (non-causal): per-feature offsets
    ``[B, H, F]`` to use instead of ``m``, or a function of the masked logits that gives them
    ``[B, H, 1, F]``. ``inplace``: ``u`` is a tensor of this call's own, turned into the
    features; ``out`` (exponential features, no autograd): a tensor of the caller's own that
    receives them, ``u`` left as it is."""
    pad = None if mask is None else mask[:, None, :, None]
    if exponential:
        if pad is not None and out is not None:  # the masked logits go to out, then in place
            u = torch.where(pad, u.new_full((), _NINF), u, out=out)
            inplace, out = True, None
        elif pad is not None:
            u = u.masked_fill_(pad, _NINF) if inplace else u.masked_fill(pad, _NINF)
        if offsets is None:
            m = u.detach().amax(dim=-1) if u.shape[-1] else u.new_full(u.shape[:-1], _NINF)
            off = torch.nan_to_num(m, nan=0.0, posinf=0.0, neginf=0.0)[..., None]
        else:
            m, off = None, offsets(u) if callable(offsets) else offsets[:, :, None, :]
        pk = exp_diff(u, off, out if out is not None else u if inplace else None)
        inplace = inplace or out is not None
        if g is not None:
            pk = pk.mul_(g) if inplace else g * pk
    else:
        pk = u
        # a sum is finite only where every term is (one pass, no [T, F] flags)
        m = torch.where(torch.isfinite(pk.detach().sum(dim=-1)), 0.0, float("nan"))
        if pad is not None:
            m = m.masked_fill(pad[..., 0], _NINF)
    if pad is not None:
        pk = pk.masked_fill_(pad, 0.0) if inplace else pk.masked_fill(pad, 0.0)
    return pk, m


class _Side:
    """One side's features of a block: ``phi`` ``[B, H, T, F]`` and, for keys, ``m`` ``[B, H,
    T]`` (each key's max logit with the per-row term, as :func:`_keys` gives it; None for keys
    at the non-causal per-feature offsets).

    ``offsets``: queries, the non-causal per-feature key offsets ``[B, H, F]`` moved to their
    side (:func:`rfattn.features.query_features`), or None; keys (``mask`` ``[B, T]``), the
    non-causal ``[B, H, F]`` at which they enter (or the function that raises them block by
    block, :class:`_OnlineOffsets`), or None for each key's own max logit.

    Three ways, one result:

    * no autograd (the forwards): the logits become the features in place (no further ``[T,
      F]`` buffers), and a feature's per-row logit term (:meth:`FeatureMap.logit_parts`) is
      never added: it cancels in a query's row max (not even computed) and only moves a key's
      offset ``m``;
    * recorded (``torch.compile``'s traced path): the same features by autograd's ops;
    * ``cut`` (a backward's recomputation, built under ``torch.enable_grad()``): autograd's
      graph cut at the logits. The logit parts ``(u0, r)`` and amplitude ``g`` are recorded
      (the projection and the per-row term), ``phi`` itself is computed outside autograd, in
      place in kept buffers (:mod:`rfattn.workspace`), and :func:`add_grads` turns ``d phi``
      into the cotangents of the recorded parts by hand: ``d u = d phi * phi`` (0 at padded
      keys), ``d r = sum_f d u`` (keys only: a query's features do not depend on its per-row
      term), ``d g = d phi * exp(...)``. The offsets are detached, as in the forward, so these
      are the gradients autograd gives through the recorded way (up to the query rows' ``sum_f
      d phi phi``, 0 up to rounding: the ratio does not change with a row's scale), without the
      ``[T, F]`` temporaries it would record and allocate. Plain features are recorded whole
      (``root``, ``phi`` its detached value).
    """

    def __init__(self, fm, x, w, params, side: str, mask=None, offsets=None, cut: bool = False):
        key = side == "key"
        self.pad = None if mask is None else mask[:, None, :, None]
        self.m = self.e = None
        if not fm.exponential:
            phi = fm.values(x, w, side, params)
            if key:
                c = fm.key_amplitude(x, w, params)  # component weights, if any
                phi, self.m = _keys(phi if c is None else phi * c, None, mask, False)
            self.root, self.phi = phi, phi.detach() if cut else phi
            return
        if cut:
            u0, r = fm.logit_parts(x, w, side, params, row=key)
            g = fm.key_amplitude(x, w, params) if key else fm.amplitude(x, w, side, params)
            self.u0, self.r, self.g = u0, r, g
            with torch.no_grad():
                e = workspace.buffer("phi", u0.shape, u0.dtype, u0.device, new=True)
                if not key:  # the per-row term cancels in the row max
                    e = query_features(u0.detach(), None, offsets, out=e)
                elif offsets is None:  # each key at its own max logit (the per-row term cancels)
                    e, m = _keys(u0.detach(), None, mask, True, out=e)
                    self.m = m if r is None else m + r[..., 0]
                else:  # the per-feature offsets: the per-row term stays in the logits
                    torch.add(u0, r, out=e) if r is not None else e.copy_(u0)
                    e, _ = _keys(e, None, mask, True, True, offsets)
                self.e = e
                self.phi = e
                if g is not None:
                    phi = workspace.buffer("phi_g", e.shape, e.dtype, e.device, new=True)
                    self.phi = torch.mul(e, g, out=phi)
                    if self.pad is not None:
                        phi.masked_fill_(self.pad, 0.0)
            return
        g = fm.key_amplitude(x, w, params) if key else fm.amplitude(x, w, side, params)
        if torch.is_grad_enabled():
            u = fm.logits(x, w, side, params)
            if key:
                self.phi, self.m = _keys(u, g, mask, True, False, offsets)
            else:
                self.phi = query_features(u, g, offsets)
        else:
            u, r = fm.logit_parts(x, w, side, params, row=key)  # a query's per-row term cancels
            owned = u._base is None and u.is_contiguous()  # (not a view: safe to write)
            if not key:
                self.phi = query_features(u, g, offsets, out=u if owned else None)
            elif offsets is not None:  # per-feature offsets: the per-row term stays in the logits
                if r is not None:
                    u = u.add_(r) if owned else u + r
                self.phi, _ = _keys(u, g, mask, True, owned or r is not None, offsets)
            else:  # the per-row term moves only the offset m
                self.phi, m = _keys(u, g, mask, True, owned)
                self.m = m if r is None else m + r[..., 0]


class Block:
    """One causal block's forward quantities (detached), from its query rows ``pq`` ``[B, H,
    n*G*C, F]``, keys ``pk`` ``[B, H, n*C, F]`` at their own max logits ``m`` ``[B, H, n*C]``,
    ``[V, 1]`` ``vh`` ``[B, H, n, C, V]`` and the state and offset before it.

    Offsets and factors (all ``[B, H, ...]``): ``R`` ``[n+1]`` the state's offset before the
    block (index 0) and after each chunk; ``a`` ``[n, C]`` the factor ``exp(R_{c-1} - r_i)`` of
    the prefix state for row i; ``decay`` ``[n, C, C]`` ``exp(m_j - r_i)`` for j <= i (0
    elsewhere and for empty keys); ``e`` ``[n, C]`` ``exp(m_j - R_c)``, key j's weight in the
    state after its chunk; ``step`` ``[n, 1, 1]`` ``exp(R_{c-1} - R_c)``, the factor that
    carries the state before chunk c over to the offset after it (0 while no key has been
    seen). Without an empty key (``m = -inf``: padding, the last chunk's tail, a key cleaned
    away) every ``r_i`` and ``R_c`` is finite, so each factor is a plain exponential of its
    difference (an offset of -inf before the first key gives exp(-inf) = 0); with one, -inf -
    -inf is NaN there and the factors are selected (``exp`` where the earlier term is finite, as
    :func:`rfattn.features.base.exp_diff` forms it: the same bits there).

    ``prefix`` ``[n, V, F]``: the states before each chunk; ``s_out``, ``off_out``: after the
    block. ``A`` ``[n, G*C, C]``: the decayed intra-chunk products, as the forward computed them
    when it kept them (``scores``: a backward's recomputed block reuses them, one product of the
    features and the decay's multiply fewer), else computed. ``dirty``: some key or value of the
    block is not finite; only then are they cleaned and ``poisoned`` (``[B, H, n, G*C, V]``,
    where a non-finite key or value at or before a row poisons it; None for a clean block) set
    (one flag per block, so a clean block costs no ``[T, F]`` pass for it).
    """

    def __init__(self, pq, pk, m, vh, s_in, off_in, groups: int, values: int, scores=None):
        n, C = vh.shape[2:4]
        self.E, self.groups = values, groups
        self.pq = pq.unflatten(2, (n, groups * C))  # [B, H, n, G*C, F]
        m = m.unflatten(2, (n, C))
        pk = pk.unflatten(2, (n, C))
        # traced (torch.compile): no data-dependent branch, always select. Eager: the keys' max
        # offset is NaN or +inf when some key's features are not finite (-inf: padding only),
        # and a sum of the values is finite when every value is (one pass, no [T, E] flags);
        # one read of both and of the smallest offset (-inf: an empty key), else check each
        compiling = torch.compiler.is_compiling()
        if compiling:
            self.dirty = empty = True
        else:
            top, low, total = torch.stack((m.amax(), m.amin(), vh.sum().to(m.dtype))).tolist()
            self.dirty = not (math.isfinite(total) and (top == _NINF or math.isfinite(top)))
            empty = low == _NINF
        self.poisoned = None
        if self.dirty:
            bad_k = torch.isnan(m) | (m == float("inf"))  # [B, H, n, C]: features not finite
            bad = ~torch.isfinite(vh) | bad_k[..., None]  # [B, H, n, C, V]
            self.dirty = compiling or bool(bad.any())  # (the sum may overflow)
        if self.dirty:  # non-finite terms are removed by selection, their rows poisoned
            pk = torch.where(bad_k[..., None], 0.0, pk)
            vh = torch.where(bad, 0.0, vh)
            m = torch.where(bad_k, _NINF, m)
            empty = True  # (cleaned keys are empty now)
            seen = torch.cumsum(bad.flatten(2, 3).to(torch.int32), dim=2) > 0
            seen = seen.unflatten(2, (n, C))[:, :, :, None]
            self.poisoned = seen.expand(-1, -1, -1, groups, -1, -1).flatten(3, 4)
        self.pk, self.vh = pk, vh

        # the offsets and factors
        R = torch.cummax(torch.cat((off_in[..., None], m.amax(dim=-1)), dim=-1), dim=-1).values
        prev = R[..., :-1, None]  # [B, H, n, 1]
        r = torch.maximum(prev, torch.cummax(m, dim=-1).values)  # [B, H, n, C]
        self.R = R
        mj = m[..., None, :]
        buf = workspace.buffer("decay", (*r.shape, C), r.dtype, r.device)  # None: a new one
        diff = torch.sub(mj, r[..., :, None], out=buf)
        # (exp as exp_diff forms it.) For j <= i, m_j - r_i <= 0 exactly (r_i is a max
        # over m_j). With an empty key in the block, -inf - -inf is NaN: those and j > i are
        # selected away (exp(-inf) = 0). Without one, j > i is capped at 0 (a later key's
        # larger max would overflow) and multiplied by 0: the same values, without the mask's
        # slow broadcast select.
        if empty:
            above = torch.ones(C, C, dtype=torch.bool, device=m.device).triu(1)
            self.decay = diff.masked_fill_(above | (mj == _NINF), _NINF).mul_(LOG2E).exp2_()
            factors = []  # exp(x) where the earlier term is live, else 0 (x may be NaN there)
            for x, live in ((prev - r, prev > _NINF), (m - R[..., 1:, None], m > _NINF),
                            (prev[..., 0] - R[..., 1:], prev[..., 0] > _NINF)):  # fmt: skip
                factors.append(torch.where(live, x, _NINF).mul_(LOG2E).exp2_())
            self.a, self.e, step = factors
        else:
            lower = _LOWER.get((C, m.dtype, m.device))
            if lower is None:
                lower = torch.ones(C, C, dtype=m.dtype, device=m.device).tril_()
                _LOWER[C, m.dtype, m.device] = lower
            self.decay = diff.mul_(LOG2E).clamp_max_(0.0).exp2_().mul_(lower)
            self.a = exp_diff(prev, r)
            self.e = exp_diff(m, R[..., 1:, None])
            step = exp_diff(prev[..., 0], R[..., 1:])
        self.step = step = step[..., None, None]

        # the chunks' own states and the scan over them, S_c = step_c S_{c-1} + own_c: one
        # multiply-add per chunk over F (E+1) numbers per (b, h), written in place (no stacked
        # copy, no product with a mostly-zero matrix); recorded by autograd (the traced path),
        # the same steps stacked
        ve = self.e[..., None]  # each value at its weight in its chunk's state
        self.ve = torch.mul(vh, ve, out=workspace.buffer("ve", vh.shape, vh.dtype, vh.device))
        own = workspace.product(self.ve.transpose(-1, -2), pk, "own")  # [B, H, n, V, F]
        if compiling and symbolic(n):  # dynamic shapes: no loop over a symbolic chunk count
            self.prefix, s_out = _chunk_scan(s_in, own, R)
        elif torch.is_grad_enabled():
            states = [s_in]
            for c in range(n):
                states.append(torch.addcmul(own[:, :, c], states[-1], step[:, :, c]))
            self.prefix, s_out = torch.stack(states[:-1], dim=2), states[-1]
        else:
            self.prefix = workspace.buffer("prefix", own.shape, own.dtype, own.device, new=True)
            # the chunks' views taken at once (one call each, not four indexing calls per chunk)
            own_c, pre_c, step_c = own.unbind(2), self.prefix.unbind(2), step.unbind(2)
            pre_c[0].copy_(s_in)
            for c in range(1, n):
                torch.addcmul(own_c[c - 1], pre_c[c - 1], step_c[c - 1], out=pre_c[c])
            s_out = torch.addcmul(own_c[n - 1], pre_c[n - 1], step_c[n - 1])
        if self.dirty:
            s_out = torch.where(bad.any(dim=(2, 3))[..., None], float("nan"), s_out)
        self.s_out, self.off_out = s_out, R[..., -1]
        if scores is None:  # each query head's products times the decay, in place
            scores = (self.pq @ pk.transpose(-1, -2)).unflatten(3, (groups, C))
            scores = scores.mul_(self.decay[:, :, :, None]).flatten(3, 4)
        self.A = scores

    def backward(self, out, dout, den, t0: int, t1: int, ds_out: torch.Tensor):
        """Cotangents ``(d phi_q, d phi_k, d [V, 1], d state in)`` of the block of tokens
        ``t0:t1`` from those of its outputs (``dout``; ``out`` ``[B, H, G, T, E]`` and ``den``
        ``[B, H, G, T]``: the forward's) and of the state after it."""
        G, n, C = self.groups, self.vh.shape[2], self.vh.shape[3]
        rows = []  # the block's rows of out, dout and den, as its chunk rows [B, H, n, G*C, .]
        for x in (out, dout, den[..., None]):
            xb = x[:, :, :, t0:t1]
            xb = nnf.pad(xb, (0, 0, 0, n * C - (t1 - t0))) if (t1 - t0) % C else xb
            rows.append(xb.unflatten(3, (n, C)).transpose(2, 3).flatten(3, 4))
        dnh = _ratio_grad(rows[1], rows[0], rows[2][..., 0], self.poisoned, self.vh.shape[-1])
        dnh_a = (dnh.unflatten(3, (G, C)) * self.a[:, :, :, None, :, None]).flatten(3, 4)
        dP = workspace.product(dnh_a.transpose(-1, -2), self.pq, "dP")  # [B, H, n, V, F]
        dA = (dnh @ self.vh.transpose(-1, -2)).unflatten(3, (G, C))  # [B, H, n, G*C, C]
        dA = dA.mul_(self.decay[:, :, :, None]).flatten(3, 4)
        dpq = workspace.product(dnh_a, self.prefix, "dpq")
        dpq.flatten(0, -3).baddbmm_(dA.flatten(0, -3), self.pk.flatten(0, -3))
        # the reverse scan: d own_c = d prefix_{c+1} + step_{c+1} d own_{c+1}
        d_own = workspace.buffer("d_own", dP.shape, dP.dtype, dP.device, new=True)
        dp_c, do_c, step_c = dP.unbind(2), d_own.unbind(2), self.step.unbind(2)
        do_c[n - 1].copy_(ds_out)
        for c in range(n - 2, -1, -1):
            torch.addcmul(dp_c[c + 1], do_c[c + 1], step_c[c + 1], out=do_c[c])
        ds_in = torch.addcmul(dp_c[0], do_c[0], step_c[0])
        dpk = workspace.product(self.ve, d_own, "dpk")
        dpk.flatten(0, -3).baddbmm_(dA.transpose(-1, -2).flatten(0, -3), self.pq.flatten(0, -3))
        dvh = (self.pk @ d_own.transpose(-1, -2)).mul_(self.e[..., None])
        dvh.flatten(0, -3).baddbmm_(self.A.transpose(-1, -2).flatten(0, -3), dnh.flatten(0, -3))
        return dpq.flatten(2, 3), dpk.flatten(2, 3), dvh, ds_in


def _chunk_scan(s_in, own, R):
    """``(prefix, s_out)`` of :class:`Block`'s scan over its chunks, ``S_c = step_c S_{c-1} +
    own_c``, as products for a symbolic chunk count n (``torch.compile`` with dynamic shapes,
    where a loop over the chunks would specialise the length: a recompile per length).
    Unrolled, the state before chunk c is ``sum_{j <= c} exp(R_j - R_c) X_j`` over ``X = [s_in,
    own_0, ..., own_{n-1}]`` (the steps' product telescopes; the terms of ``R_j = -inf``, no key
    yet, are 0 as the steps make them): every factor at most 1, so no overflow. n^2 in place of
    the loop's n multiply-adds of ``[V, F]`` per (b, h): below the intra-chunk products' n C^2
    (F + V) up to about C^2 (F + V) / (V F) chunks (~120 at F = 64, V = 72: T ~ 7600), then
    quadratic in T. No slice of a symbolic length is taken (its layout would be guarded on)."""
    n = own.shape[2]
    x = torch.cat((s_in[:, :, None], own), dim=2).flatten(3)  # [B, H, n + 1, V * F]
    j = torch.arange(n + 1, device=R.device)

    def weights(c, Rc):  # exp(R_j - R_c) for j <= c, R_j live, else 0: [B, H, rows, n + 1]
        live = (j <= c[:, None]) & (R[..., None, :] > _NINF)
        return torch.where(live, R[..., None, :] - Rc[..., None], _NINF).mul_(LOG2E).exp2_()

    prefix = weights(torch.arange(n, device=R.device), R[..., :-1]) @ x
    s_out = weights(j[-1:], R[..., -1:]) @ x
    return prefix.unflatten(3, own.shape[3:]), s_out[:, :, 0].unflatten(2, own.shape[3:])


def _ratio_grad(dout, out, den, poisoned, width: int):
    """Cotangent of ``[num, den, 0...]`` (the block's ``[V, 1]`` columns) from that of
    ``attention_ratio(num, den)``."""
    E = dout.shape[-1]
    den_s = safe_denominator(den)
    empty = den == 0
    if bool(empty.any()):  # rare (no key yet, or all weights underflowed): only then the rows
        empty &= (out == 0).all(dim=-1)
    else:
        empty = None
    live = den.abs() >= torch.finfo(den.dtype).tiny
    dnh = torch.empty(*dout.shape[:-1], width, dtype=dout.dtype, device=dout.device)
    d_num = torch.div(dout, den_s[..., None], out=dnh[..., :E])  # into the strided columns
    dnh[..., E] = (d_num * out).sum(dim=-1).neg_().masked_fill_(~live, 0.0)
    dnh[..., E + 1 :] = 0.0
    if empty is not None:
        dnh.masked_fill_(empty[..., None], 0.0)
    return dnh if poisoned is None else dnh.masked_fill_(poisoned, 0.0)


def add_grads(feats, d_feats, leaves, accs, assign: int = 0) -> None:
    """Add the gradients of ``feats`` (cotangent ``d_feats``) for the ``leaves`` that require
    grad into their accumulators ``accs`` (None where not needed); the first ``assign``
    accumulators (a block's own rows of dq, dk: uninitialised until here) are set instead.

    ``feats``: recorded tensors, or a backward's :class:`_Side` of a block, whose recorded parts
    get their cotangents from ``d phi`` (a tensor of the caller's own: overwritten) by hand: ``d
    u = d phi * phi`` (0 at padded keys), ``d r = sum_f d u``, ``d g = d phi * exp(...)``."""
    wrt, roots, cots = [], [], []
    for x, acc in zip(leaves, accs, strict=True):
        if acc is not None:
            wrt.append(x)
    for f, d in zip(feats if wrt else (), d_feats, strict=False):
        if isinstance(f, _Side) and f.e is None:  # plain features: recorded whole
            f = f.root
        if isinstance(f, torch.Tensor):
            # features of a side no gradient is asked of (plain features of q, say, when only
            # k needs one) are not in the graph
            if f.requires_grad:
                roots.append(f)
                cots.append(d)
            continue
        if f.pad is not None:  # padded keys' features are set to 0: no gradient there
            d = d.masked_fill_(f.pad, 0.0)
        if f.g is not None and f.g.requires_grad:
            roots.append(f.g)
            cots.append(d * f.e)
        du = d.mul_(f.phi)
        if f.r is not None and f.r.requires_grad:
            roots.append(f.r)
            cots.append(du.sum(dim=-1, keepdim=True))
        if f.u0.requires_grad:
            roots.append(f.u0)
            cots.append(du)
    grads = iter(torch.autograd.grad(roots, wrt, cots, allow_unused=True) if roots else ())
    for i, acc in enumerate(accs):
        g = next(grads, None) if acc is not None else None
        if i < assign and acc is not None:
            acc.copy_(g) if g is not None else acc.zero_()
        elif g is not None:
            acc += g


def scan_forward(spec, inputs: tuple, block: int, out, den, s, off, keep: bool, h0: int = 0,
                 h1: int | None = None):  # fmt: skip
    """Run the causal blocks in order, filling ``out`` ``[B, H, G, T, E]`` and ``den`` ``[B, H,
    G, T]``: of q, k, v, W and the feature parameters' dict (``inputs``) with ``spec``
    (:class:`_CausalAttention`; heads ``h0:h1`` only where ``h1`` is given: one part of a call
    split over worker threads), or of given features ``(phi_q, phi_k, m, v, mask)`` with
    ``spec`` None (:class:`_CausalScan`, the traced scan). Returns the final ``(s, off)``
    (copies of the initial ones when no block ran: outputs never alias inputs) and, with
    ``keep``, what the backward starts each block from: the states and offsets before it and
    its decayed intra-chunk products (``A``)."""
    G, T, E = out.shape[2], out.shape[3], out.shape[4]
    if h1 is not None:
        out, den, s, off = out[:, h0:h1], den[:, h0:h1], s[:, h0:h1], off[:, h0:h1]
        q, k, v, w, params = inputs
        inputs = (q[:, h0 * G : h1 * G], k[:, h0:h1], v[:, h0:h1], w, params)
    starts, offs, scores = [], [], []
    # blocks of ``block`` tokens; one for a symbolic length or block (torch.compile, dynamic
    # shapes: a loop over them would specialise the length, a recompile per length; the traced
    # path holds the whole sequence's features anyway)
    whole = torch.compiler.is_compiling() and (symbolic(T) or symbolic(block))
    with threads.adaptive(out.device) if threads.ENABLED else contextlib.nullcontext():
        for t0 in (0,) if whole else range(0, T, block):
            t1 = T if whole else min(T, t0 + block)
            if keep:
                starts.append(s)
                offs.append(off)
            if threads.ENABLED:  # (the opt-in thread adaptation's check)
                threads.check()
            with workspace.blocks():  # this block's kept buffers
                if spec is None:
                    blk = _given_block(*inputs, t0, t1, s, off)
                else:
                    q, k, v, w, params = inputs
                    mask = None if spec.mask is None else spec.mask[:, t0:t1]
                    qs, ks, vh = _block_features(spec, q[:, :, t0:t1], k[:, :, t0:t1],
                                                 v[:, :, t0:t1], w, params, mask)  # fmt: skip
                    blk = Block(qs.phi, ks.phi, ks.m, vh, s, off, G, E)
                    del qs, ks, vh
                if keep:
                    scores.append(blk.A)  # a tensor of its own (not a kept buffer)
                # the block's [num, den]: the prefix states read at each row's factor, plus the
                # intra-chunk products
                a = blk.a[:, :, :, None, :, None]
                n, C = blk.vh.shape[2:4]  # (a block shorter than a chunk is one chunk of its own)
                nh = (blk.pq @ blk.prefix.transpose(-1, -2)).unflatten(3, (G, C)).mul_(a)
                nh = nh.flatten(3, 4)
                nh.flatten(0, -3).baddbmm_(blk.A.flatten(0, -3), blk.vh.flatten(0, -3))
                if blk.poisoned is not None:
                    nh = torch.where(blk.poisoned, float("nan"), nh)
                num, d = nh[..., :E], nh[..., E]
                if whole or (t1 - t0) % C or torch.is_grad_enabled():  # a padded tail, traced
                    ratio = attention_ratio(num, d) if torch.is_grad_enabled() else (
                        num / safe_denominator(d)[..., None])  # fmt: skip
                    ratio = ratio.unflatten(3, (G, C)).transpose(2, 3).flatten(3, 4)
                    out[:, :, :, t0:t1] = ratio[:, :, :, : t1 - t0]
                else:  # divided straight into out's rows (no block-sized quotient, no copy)
                    dst = out[:, :, :, t0:t1].unflatten(3, (n, C)).transpose(2, 3)  # a view
                    den_s = safe_denominator(d.unflatten(3, (G, C)))
                    torch.div(num.unflatten(3, (G, C)), den_s[..., None], out=dst)
                d = d.unflatten(3, (G, C)).transpose(2, 3).flatten(3, 4)
                den[:, :, :, t0:t1] = d[:, :, :, : t1 - t0]
                s, off = blk.s_out, blk.off_out
                del blk, nh, num, d  # before the next block's features
    if T == 0:
        s, off = s.clone(), off.clone()
    return s, off, (starts, offs, scores)


def no_autocast(backward):
    """A custom backward run with autocast off (for its cotangents' device type): one called
    inside an autocast region then computes in the dtypes its forward did, which
    :func:`rfattn.rf_attention` runs with autocast off (autocast would cast its products and
    not the fp32 buffers they add into)."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        dev = "cpu"
        for g in grads:
            if isinstance(g, torch.Tensor):
                dev = g.device.type
                break
        if not torch.is_autocast_enabled(dev):  # nothing to turn off (the context costs µs)
            return backward(ctx, *grads)
        with torch.autocast(dev, enabled=False):
            return backward(ctx, *grads)

    return run


def _parts(spec: _Spec, q, w, ptensors, heads: int, T: int):
    """The heads ``(h0, h1)`` of each part of a call that runs its heads on worker threads
    (:func:`rfattn.threads.split_heads`, :func:`rfattn.threads.head_parts`; only where W and
    every feature parameter are shared by the heads: no per-head tensor to slice), or None: the
    heads at once on the caller's thread."""
    shared = w.dim() == 2
    for p in ptensors:
        shared = shared and p.dim() >= 3 and p.shape[-3] == 1
    work = q.shape[0] * q.shape[1] * T * spec.fm.width(w.shape[-2])
    return threads.head_parts(heads, True) if shared and threads.split_heads(
        q.device, heads, work) else None  # fmt: skip


def _summed(xs: list):
    """The sum of the per-part gradients ``xs`` (None where not needed)."""
    if xs[0] is None:
        return None
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


class _CausalAttention(torch.autograd.Function):
    """Causal random-feature attention over blocks of T (see the module docstring).

    Inputs: ``spec``, q ``[B, Hk*G, T, D]``, k ``[B, Hk, T, D]``, v ``[B, Hk, T, E]``, W, the
    initial ``[S, z, 0...]^T`` ``[B, Hk, value_width(E), F]`` and offset ``[B, Hk]`` (compute
    dtype), the block length, whether autograd was recording where the call was made
    (``torch.is_grad_enabled()`` there; inside a Function's forward it is off, and
    ``ctx.needs_input_grad`` says only which inputs require grad, even under ``torch.no_grad()``:
    together they say whether a backward may follow, and only then are the blocks' start states
    and products kept), then the feature parameters. Outputs: out
    ``[B, Hk, G, T, E]`` (compute dtype), the final ``[S, z, 0...]^T`` and offset. (States are
    held transposed, rows of F: the chunk products that make and read them run faster on the
    CPU that way.)
    """

    @staticmethod
    def forward(ctx, spec, q, k, v, w, s0, off0, block, recording, *ptensors):
        keep = recording and any(ctx.needs_input_grad)
        B, Hk, T, G, E = k.shape[0], k.shape[1], k.shape[2], spec.groups, v.shape[-1]
        out = torch.empty(B, Hk, G, T, E, dtype=w.dtype, device=q.device)
        den = torch.empty(B, Hk, G, T, dtype=w.dtype, device=q.device)
        run = functools.partial(scan_forward, spec, (q, k, v, w, spec.params), block, out, den,
                                s0, off0, keep)  # fmt: skip
        parts = _parts(spec, q, w, ptensors, Hk, T)
        res = [run()] if parts is None else threads.over_heads(run, parts)
        s, off, (starts, offs, scores) = res[0]
        if parts is not None:  # the parts' states joined; their blocks one part after another
            s, off = torch.cat([r[0] for r in res], dim=1), torch.cat([r[1] for r in res], dim=1)
            starts, offs, scores = ([x for r in res for x in r[2][i]] for i in range(3))
        ctx.spec, ctx.block, ctx.parts, ctx.n_blocks = spec, block, parts, len(starts)
        ctx.save_for_backward(q, k, v, w, out, den, *starts, *offs, *scores, *ptensors)
        ctx.mark_non_differentiable(off)
        return out, s, off

    @staticmethod
    @no_autocast
    def backward(ctx, dout, ds, _doff):
        spec, block, parts, nb = ctx.spec, ctx.block, ctx.parts, ctx.n_blocks
        saved = ctx.saved_tensors
        q, k, v, w, out, den = saved[:6]
        starts, offs, scores = saved[6 : 6 + nb], saved[6 + nb : 6 + 2 * nb], saved[6 + 2 * nb :]
        scores, ptensors = scores[:nb], scores[nb:]
        need_q, need_k, need_v, need_w, need_s = ctx.needs_input_grad[1:6]
        need_p = ctx.needs_input_grad[9:]
        G, T, E = spec.groups, k.shape[2], v.shape[-1]
        # every block sets its own rows of dq, dk, dv once
        dq = torch.empty_like(q) if need_q else None
        dk = torch.empty_like(k) if need_k else None
        dv = torch.empty_like(v) if need_v else None
        dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
        nb //= 1 if parts is None else len(parts)  # blocks per part (one part after another)

        def run(h0=0, h1=None):  # heads h0:h1: (d state before the call, dW, d params) of theirs
            j = 0 if parts is None else parts.index((h0, h1))
            h1 = k.shape[1] if h1 is None else h1
            qs, ks = slice(h0 * G, h1 * G), slice(h0, h1)
            dw = torch.zeros_like(w) if need_w else None
            dps = []
            for p, need in zip(ptensors, need_p, strict=True):
                dps.append(torch.zeros_like(p) if need else None)
            dstate = None if ds is None else ds[:, ks]
            if dstate is None and nb:
                dstate = torch.zeros_like(starts[j * nb])
            for i in reversed(range(nb)):
                t0, t1, at = i * block, min(T, (i + 1) * block), j * nb + i
                mask = None if spec.mask is None else spec.mask[:, t0:t1]
                if threads.ENABLED:  # (the opt-in thread adaptation's check)
                    threads.check()
                with workspace.blocks():  # this block's kept buffers
                    with torch.enable_grad():
                        (qb, kb), wl, pl, pp = _leaves(spec, ptensors, need_p, w, need_w,
                                                       (q[:, qs, t0:t1], need_q),
                                                       (k[:, ks, t0:t1], need_k))  # fmt: skip
                        qside, kside, vh = _block_features(spec, qb, kb, v[:, ks, t0:t1], wl, pp,
                                                           mask, cut=True)  # fmt: skip
                    blk = Block(qside.phi, kside.phi, kside.m, vh.detach(), starts[at], offs[at],
                                G, E, scores[at])  # fmt: skip
                    dpq, dpk, dvh, dstate = blk.backward(out[:, ks], dout[:, ks], den[:, ks], t0,
                                                         t1, dstate)  # fmt: skip
                    if need_v:  # non-finite values were selected away: 0 there
                        dvb, vb = dvh.flatten(2, 3)[:, :, : t1 - t0, :E], v[:, ks, t0:t1]
                        dv[:, ks, t0:t1] = torch.where(torch.isfinite(vb), dvb, 0.0) if blk.dirty \
                            else dvb  # fmt: skip
                    del blk, vh
                    accs = (dq[:, qs, t0:t1] if need_q else None,
                            dk[:, ks, t0:t1] if need_k else None, dw, *dps)  # fmt: skip
                    add_grads((qside, kside), (dpq, dpk), (qb, kb, wl, *pl), accs, assign=2)
                    del qside, kside
            return dstate, dw, dps

        with threads.adaptive(v.device) if threads.ENABLED else contextlib.nullcontext():
            res = [run()] if parts is None else threads.over_heads(run, parts)
        dstate, dw, dps = res[0]
        if parts is not None:  # the parts' d state joined, their dW and d params summed
            dstate = None if dstate is None else torch.cat([r[0] for r in res], dim=1)
            dw = _summed([r[1] for r in res])
            dps = [_summed(x) for x in zip(*(r[2] for r in res), strict=True)]
        return (None, dq, dk, dv, dw, dstate if need_s else None, None, None, None, *dps)


def _given_block(pq, pk, m, v, mask, t0: int, t1: int, s, off, scores=None) -> Block:
    """The :class:`Block` of tokens ``t0:t1`` from given features (:class:`_CausalScan`;
    ``scores``: :class:`Block`'s)."""
    G, T = pq.shape[2], t1 - t0
    if symbolic(T):
        # torch.compile, dynamic shapes: chunks of CHUNK tokens, at least two and at least one
        # padded token, for every length alike (torch's views and layouts treat a dim of size 1
        # and a slice that is the whole dim apart: guards on them, a graph more per case)
        C = CHUNK
        n = max(2, T // C + 1)
    else:
        C = chunk_of(T)
        n = -(-T // C)
    pad = n * C - T
    mb = None if mask is None else mask[:, t0:t1]
    vh = _key_values(v[:, :, t0:t1], mb, s.shape[-2], s.dtype, pad)
    pq, pk, mk = pq[:, :, :, t0:t1], pk[:, :, t0:t1], nnf.pad(m[:, :, t0:t1], (0, pad), value=_NINF)
    if symbolic(pad) or pad:  # the tokens that fill the last chunk: zero features, empty keys
        pq, pk = nnf.pad(pq, (0, 0, 0, pad)), nnf.pad(pk, (0, 0, 0, pad))
    rows = pq.unflatten(3, (n, C)).transpose(2, 3).flatten(2, 4)
    return Block(rows, pk, mk, vh.unflatten(2, (n, C)), s, off, G, v.shape[-1], scores)


class _CausalScan(torch.autograd.Function):
    """The causal scan of :class:`_CausalAttention` on given features (no feature map): inputs
    phi_q ``[B, H, G, T, F]``, phi_k ``[B, H, T, F]`` at the keys' own max logits ``m`` ``[B, H,
    T]`` (zero and -inf for padded keys), v ``[B, H, T, E]`` (compute dtype), the initial
    state, the block length, the key mask and whether autograd was recording where the call was
    made; outputs as :class:`_CausalAttention`'s, gradients for phi_q, phi_k, v and the initial
    ``[S, z]``."""

    @staticmethod
    def forward(ctx, pq, pk, m, v, s0, off0, block, mask, recording):
        keep = recording and any(ctx.needs_input_grad)  # (as _CausalAttention's)
        B, H, G, T = pq.shape[:4]
        out = torch.empty(B, H, G, T, v.shape[-1], dtype=v.dtype, device=v.device)
        den = torch.empty(B, H, G, T, dtype=v.dtype, device=v.device)
        s, off, (starts, offs, scores) = scan_forward(None, (pq, pk, m, v, mask), block, out, den,
                                                      s0, off0, keep)  # fmt: skip
        ctx.block, ctx.mask, ctx.n_blocks = block, mask, len(starts)
        ctx.save_for_backward(pq, pk, m, v, out, den, *starts, *offs, *scores)
        ctx.mark_non_differentiable(off)
        return out, s, off

    @staticmethod
    @no_autocast
    def backward(ctx, dout, ds, _doff):
        block, mask, nb = ctx.block, ctx.mask, ctx.n_blocks
        saved = ctx.saved_tensors
        pq, pk, m, v, out, den = saved[:6]
        starts, offs, scores = saved[6 : 6 + nb], saved[6 + nb : 6 + 2 * nb], saved[6 + 2 * nb :]
        dpq, dpk, dv = torch.zeros_like(pq), torch.zeros_like(pk), torch.zeros_like(v)
        dout = torch.zeros_like(out) if dout is None else dout
        dstate = ds if ds is not None or not nb else torch.zeros_like(starts[0])
        G, T, E = pq.shape[2], pq.shape[3], v.shape[-1]
        for i in reversed(range(nb)):
            t0, t1 = i * block, min(T, (i + 1) * block)
            blk = _given_block(pq, pk, m, v, mask, t0, t1, starts[i], offs[i], scores[i])
            dq_rows, dk_b, dvh, dstate = blk.backward(out, dout, den, t0, t1, dstate)
            n, C = blk.vh.shape[2:4]  # (G may be 0: no -1 in the shape)
            dq_b = dq_rows.unflatten(2, (n, G, C)).transpose(2, 3).flatten(3, 4)
            dpq[:, :, :, t0:t1] = dq_b[:, :, :, : t1 - t0]
            dpk[:, :, t0:t1] = dk_b[:, :, : t1 - t0]
            dvb = dvh.flatten(2, 3)[:, :, : t1 - t0, :E]  # non-finite values: 0 (selected away)
            dv[:, :, t0:t1] = torch.where(torch.isfinite(v[:, :, t0:t1]), dvb, 0.0) if blk.dirty \
                else dvb  # fmt: skip
        return dpq, dpk, None, dv, dstate, None, None, None, None


def _initial(state, B: int, H: int, F: int, E: int, exponential: bool, like):
    """``(s0, off0, given offset)``: the initial ``[S, z, 0...]^T`` ``[B, H, V, F]`` and offset
    of a causal call in ``like``'s dtype and device (plain features run at offset 0 and pass the
    given one on)."""
    dt, dev = like.dtype, like.device
    if state is None:
        s0 = torch.zeros(B, H, value_width(E), F, dtype=dt, device=dev)
        off0 = torch.full((B, H), _NINF if exponential else 0.0, dtype=dt, device=dev)
    else:
        s0 = torch.cat((state[0].to(dt).transpose(-1, -2), state[1].to(dt)[..., None, :]), dim=-2)
        s0 = nnf.pad(s0, (0, 0, 0, value_width(E) - E - 1))
        off0 = state[2].to(dt)
    return s0, off0 if exponential else torch.zeros_like(off0), off0


def _final(s, off, given, E: int, exponential: bool) -> tuple:
    """``(S, z, offset)`` of the state after a causal call."""
    # copies, not views of one tensor: an operator's outputs may not alias each other
    S = s[..., :E, :].transpose(-1, -2).contiguous()
    return S, s[..., E, :].contiguous(), off if exponential else given.clone()


def empty_state(B: int, H: int, F: int, E: int, exponential: bool, like) -> tuple:
    """``(S, z, offset)`` before any key, in ``like``'s dtype and device (the state an empty
    causal call returns)."""
    return _final(*_initial(None, B, H, F, E, exponential, like), E, exponential)


def causal_attention(fm, q, k, v, w, params: dict, scale: float, mask, state,
                     final: bool = True):  # fmt: skip
    """Causal attention on the torch path: ``(out [B, Hk, G, T, E], (S, z, offset))`` in the
    compute dtype (``w.dtype``), differentiable in q, k, v, W, the state's S and z and the
    feature parameters. ``state``: an :class:`rfattn.RFState` or None; ``final`` False: the
    caller has no use for the state after the call (None in its place, not formed).

    Under ``torch.compile`` it traces :func:`_traced_causal` instead (one graph, ``fullgraph``
    included; the autograd Functions' recomputing backwards are not traced)."""
    if torch.compiler.is_compiling():
        return _traced_causal(fm, q, k, v, w, params, scale, mask, state)
    B, Hk, G = k.shape[0], k.shape[1], q.shape[1] // max(1, k.shape[1])
    E = v.shape[-1]
    spec, ptensors = _Spec(fm, scale, mask, G, params), tuple(filter(torch.is_tensor,
                                                                     params.values()))  # fmt: skip
    F = fm.width(w.shape[-2])
    s0, off0, given = _initial(state, B, Hk, F, E, fm.exponential, w)
    block = block_tokens(B * Hk * max(G, 1), F)
    recording = torch.is_grad_enabled()
    out, s, off = _CausalAttention.apply(spec, q, k, v, w, s0, off0, block, recording, *ptensors)
    return out, _final(s, off, given, E, fm.exponential) if final else None


def _traced_causal(fm, q, k, v, w, params, scale, mask, state):
    """:func:`causal_attention` under ``torch.compile``: the features of the whole sequence
    with autograd, then :func:`causal_scan`'s traced blocks (no autograd Function, no
    data-dependent branch: a ``fullgraph`` graph that inductor fuses; memory as autograd keeps
    it)."""
    Hk, G, T = k.shape[1], q.shape[1] // max(1, k.shape[1]), q.shape[2]
    xq = prescale(q, scale, None, params.get("query_map")).unflatten(1, (Hk, G)).flatten(2, 3)
    xk = prescale(k, scale, mask, params.get("key_map"))
    pq = _Side(fm, xq, w, params, "query").phi.unflatten(2, (G, T))  # [B, Hk, G, T, F]
    ks = _Side(fm, xk, w, params, "key", mask)
    return _scan_keys(pq, ks.phi, ks.m, v.to(w.dtype), mask, state, fm.exponential)


def causal_scan(phi_q, u_k, g_k, v, mask, state):
    """Causal linear attention from features: ``(out [B, H, G, T, E], (S, z, offset))``,
    differentiable in the features, v and the state's S and z (autograd through the key
    offsets' subtraction, the scan by :class:`_CausalScan`'s hand-written backward).

    Args:
        phi_q: stabilised query features ``[B, H, G, T, F]`` (the G query heads that share each
            of the H key/value heads).
        u_k: key logits ``[B, H, T, F]`` of an exponential feature, or None for a plain one.
        g_k: key amplitude (None = 1) or, when ``u_k`` is None, the key features.
        v: ``[B, H, T, E]`` in phi_q's dtype; mask: ``[B, T]`` key padding; state: an
            :class:`rfattn.RFState` or None.
    """
    exponential = u_k is not None
    pk, m = _keys(u_k, g_k, mask, True) if exponential else _keys(g_k, None, mask, False)
    return _scan_keys(phi_q, pk, m, v, mask, state, exponential)


def _scan_keys(phi_q, pk, m, v, mask, state, exponential: bool):
    """:func:`causal_scan` from the keys of :func:`_keys` (``phi_k`` and ``m``)."""
    B, H, G, T, F = phi_q.shape
    E = v.shape[-1]
    s0, off0, given = _initial(state, B, H, F, E, exponential, phi_q)
    block = block_tokens(B * H * max(G, 1), F)
    if torch.compiler.is_compiling():  # traced: the blocks' own ops, differentiated by autograd
        out = phi_q.new_empty(B, H, G, T, E)
        den = phi_q.new_empty(B, H, G, T)
        s, off, _ = scan_forward(None, (phi_q, pk, m, v, mask), block, out, den, s0, off0, False)
    else:
        out, s, off = _CausalScan.apply(phi_q, pk, m, v, s0, off0, block, mask,
                                        torch.is_grad_enabled())  # fmt: skip
    return out, _final(s, off, given, E, exponential)


class _OnlineOffsets:
    """Non-causal key offsets reached block by block: called with a block's masked logits
    ``u``, raises the running per-feature max ``c`` and returns the offsets ``[B, H, 1, F]``
    the block's features use; ``alpha`` rescales the sums so far to them."""

    def __init__(self, c: torch.Tensor):
        self.c = c

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        old, self.c = self.c, torch.maximum(self.c, u.amax(dim=-2))
        safe = torch.where(self.c == _NINF, 0.0, self.c)
        self.alpha = torch.where(old > _NINF, old - safe, _NINF).mul_(LOG2E).exp2_()
        return safe[:, :, None]


def _noncausal_forward(spec: _Spec, q, k, v, w, block: int, out, den, h0: int = 0,
                       h1: int | None = None):  # fmt: skip
    """``([S, z], offsets)`` of non-causal attention in blocks of ``block`` tokens, its output
    and denominator written to ``out`` and ``den`` (compute dtype); heads ``h0:h1`` only where
    ``h1`` is given (one part of a call split over worker threads)."""
    if h1 is not None:
        q, k, v, out, den = q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], out[:, h0:h1], den[:, h0:h1]
    fm, scale, mask, params = spec.fm, spec.scale, spec.mask, spec.params
    B, H, Tk, E = k.shape[0], k.shape[1], k.shape[2], v.shape[-1]
    F, dt = fm.width(w.shape[-2]), w.dtype
    s = torch.zeros(B, H, F, value_width(E), dtype=dt, device=q.device)
    c = torch.full((B, H, F), _NINF, dtype=dt, device=q.device)
    for t0 in range(0, Tk, block):
        t1 = min(Tk, t0 + block)
        mb = None if mask is None else mask[:, t0:t1]
        if threads.ENABLED:  # (the opt-in thread adaptation's check)
            threads.check()
        with workspace.blocks():  # this block's kept buffers
            vh = _key_values(v[:, :, t0:t1], mb, s.shape[-1], dt)
            online = _OnlineOffsets(c)
            xk = prescale(k[:, :, t0:t1], scale, mb, params.get("key_map"))
            pk = _Side(fm, xk, w, params, "key", mb, offsets=online).phi
            if fm.exponential:
                c, s = online.c, s * online.alpha[..., None]
            s.flatten(0, -3).baddbmm_(pk.transpose(-1, -2).flatten(0, -3), vh.flatten(0, -3))
            del pk
    off = torch.where(c == _NINF, 0.0, c)  # no valid key: offset 0 (key_offset's rule)
    for r0 in range(0, q.shape[2], block):
        r1 = min(q.shape[2], r0 + block)
        if threads.ENABLED:
            threads.check()
        with workspace.blocks():
            xq = prescale(q[:, :, r0:r1], scale, None, params.get("query_map"))
            nh = _Side(fm, xq, w, params, "query", offsets=off).phi @ s
            torch.div(nh[..., :E], safe_denominator(nh[..., E])[..., None], out=out[:, :, r0:r1])
            den[:, :, r0:r1] = nh[..., E]
    return s, off


class _NoncausalAttention(torch.autograd.Function):
    """Non-causal random-feature attention over blocks of T. Inputs: ``spec``, query rows q
    ``[B, H, Tq, D]`` (grouped-query rows already regrouped), k ``[B, H, Tk, D]``, v, W, then
    the feature parameters; output ``[B, H, Tq, E]`` in the compute dtype.

    The backward recomputes query blocks (``dS += phi_q^T d[num, den]``, ``d phi_q = d[num,
    den] S^T``) and then key blocks at the forward's offsets (``d phi_k = [V, 1] dS^T``,
    ``d[V, 1] = phi_k dS``), the features' cotangents going through autograd over the feature
    map."""

    @staticmethod
    def forward(ctx, spec, q, k, v, w, *ptensors):
        B, H, E = k.shape[0], k.shape[1], v.shape[-1]
        block = block_tokens(B * H, spec.fm.width(w.shape[-2]))
        out = torch.empty(*q.shape[:3], E, dtype=w.dtype, device=q.device)
        den = torch.empty(q.shape[:3], dtype=w.dtype, device=q.device)
        run = functools.partial(_noncausal_forward, spec, q, k, v, w, block, out, den)
        parts = _parts(spec, q, w, ptensors, H, max(q.shape[2], k.shape[2]))
        with threads.adaptive(v.device) if threads.ENABLED else contextlib.nullcontext():
            res = [run()] if parts is None else threads.over_heads(run, parts)
        s, off = res[0]
        if parts is not None:  # the parts' sums and offsets joined along the heads
            s, off = torch.cat([r[0] for r in res], dim=1), torch.cat([r[1] for r in res], dim=1)
        ctx.spec, ctx.block, ctx.parts = spec, block, parts
        ctx.save_for_backward(q, k, v, w, out, den, s, off, *ptensors)
        return out

    @staticmethod
    @no_autocast
    def backward(ctx, dout):
        spec, block, parts = ctx.spec, ctx.block, ctx.parts
        q, k, v, w, out, den, s, off, *ptensors = ctx.saved_tensors
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[1:5]
        need_p = ctx.needs_input_grad[5:]
        # every block sets its own rows of dq (or dk, dv) once
        dq = torch.empty_like(q) if need_q else None
        dk = torch.empty_like(k) if need_k else None
        dv = torch.empty_like(v) if need_v else None
        dout = dout.to(out.dtype)

        def run(h0=0, h1=None):  # heads h0:h1: (dW, d params) of theirs
            hs = slice(h0, k.shape[1] if h1 is None else h1)
            dw = torch.zeros_like(w) if need_w else None
            dps = []
            for p, need in zip(ptensors, need_p, strict=True):
                dps.append(torch.zeros_like(p) if need else None)
            sh, offh = s[:, hs], off[:, hs]
            ds = torch.zeros_like(sh)
            for r0 in range(0, q.shape[2], block):
                r1 = min(q.shape[2], r0 + block)
                if threads.ENABLED:  # (the opt-in thread adaptation's check)
                    threads.check()
                with workspace.blocks():  # this block's kept buffers
                    with torch.enable_grad():
                        (qb,), wl, pl, pp = _leaves(spec, ptensors, need_p, w, need_w,
                                                    (q[:, hs, r0:r1], need_q))  # fmt: skip
                        xq = prescale(qb, spec.scale, None, pp.get("query_map"))
                        pq = _Side(spec.fm, xq, wl, pp, "query", offsets=offh, cut=True)
                    dnh = _ratio_grad(dout[:, hs, r0:r1], out[:, hs, r0:r1], den[:, hs, r0:r1],
                                      None, sh.shape[-1])  # fmt: skip
                    ds.flatten(0, -3).baddbmm_(pq.phi.transpose(-1, -2).flatten(0, -3),
                                               dnh.flatten(0, -3))  # fmt: skip
                    if need_q or need_w or any(need_p):
                        d_phi = workspace.product(dnh, sh.transpose(-1, -2), "d_phi")
                        acc = dq[:, hs, r0:r1] if need_q else None
                        add_grads((pq,), (d_phi,), (qb, wl, *pl), (acc, dw, *dps), assign=1)
                    del pq
            for t0 in range(0, k.shape[2], block):
                t1 = min(k.shape[2], t0 + block)
                mb = None if spec.mask is None else spec.mask[:, t0:t1]
                if threads.ENABLED:
                    threads.check()
                with workspace.blocks():
                    vh = _key_values(v[:, hs, t0:t1], mb, sh.shape[-1], sh.dtype)
                    with torch.enable_grad():
                        (kb,), wl, pl, pp = _leaves(spec, ptensors, need_p, w, need_w,
                                                    (k[:, hs, t0:t1], need_k))  # fmt: skip
                        xk = prescale(kb, spec.scale, mb, pp.get("key_map"))
                        pk = _Side(spec.fm, xk, wl, pp, "key", mb, offsets=offh, cut=True)
                    if need_v:
                        dv[:, hs, t0:t1] = pk.phi @ ds[..., : v.shape[-1]]
                    if need_k or need_w or any(need_p):
                        d_phi = workspace.product(vh, ds.transpose(-1, -2), "d_phi")
                        acc = dk[:, hs, t0:t1] if need_k else None
                        add_grads((pk,), (d_phi,), (kb, wl, *pl), (acc, dw, *dps), assign=1)
                    del pk
            return dw, dps

        with threads.adaptive(v.device) if threads.ENABLED else contextlib.nullcontext():
            res = [run()] if parts is None else threads.over_heads(run, parts)
        dw, dps = res[0]
        if parts is not None:  # the parts' dW and d params summed
            dw = _summed([r[0] for r in res])
            dps = [_summed(x) for x in zip(*(r[1] for r in res), strict=True)]
        return (None, dq, dk, dv, dw, *dps)


def noncausal_attention(fm, q, k, v, w, params: dict, scale: float, mask) -> torch.Tensor:
    """Non-causal attention on the torch path (:class:`_NoncausalAttention`): ``out`` ``[B, H,
    Tq, E]`` in the compute dtype (``w.dtype``) for query rows q ``[B, H, Tq, D]`` (grouped-query
    rows already regrouped by the caller) and keys k ``[B, H, Tk, D]``, v ``[B, H, Tk, E]``;
    differentiable in q, k, v, W and the feature parameters.

    Keys pass first: each block's per-feature max logit raises the running offsets ``c``
    (:func:`rfattn.features.key_offset`'s, reached online: ``S, z`` are rescaled by
    ``exp(c_old - c_new)`` per feature), then query blocks read ``[S, z]`` with the offsets moved
    to their side (:func:`rfattn.features.query_features`). Only one block's features live at a
    time; the result equals the whole-sequence features' up to rounding. Under
    ``torch.compile``: the whole-sequence features and ``linear_attention``, traced.
    """
    if torch.compiler.is_compiling():  # traced: whole-sequence features, autograd
        xq = prescale(q, scale, None, params.get("query_map"))
        xk = prescale(k, scale, mask, params.get("key_map"))
        phi_q, phi_k = fm.features(xq, xk, w, mask, params)
        return linear_attention(phi_q, phi_k, v.to(w.dtype), key_padding_mask=mask)
    spec, ptensors = _Spec(fm, scale, mask, 1, params), tuple(filter(torch.is_tensor,
                                                                     params.values()))  # fmt: skip
    return _NoncausalAttention.apply(spec, q, k, v, w, *ptensors)
