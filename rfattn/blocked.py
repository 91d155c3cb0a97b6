"""The torch path of :func:`rfattn.rf_attention`: blocked over T, with a hand-written backward.

This is the CPU backend (and the path every feature and option can take), built as the fused
kernels are: features are computed for one block of tokens at a time and dropped, never
``[T, F]`` for the whole sequence.

* Causal (:class:`_CausalAttention`): a block of ``T_b`` tokens is ``n`` chunks of ``C``. The
  chunks' own states and the intra-chunk products ``(phi_q phi_k^T ⊙ decay) [V, 1]`` are a few
  batched products per block; the scan that carries the states is one in-place multiply-add per
  chunk (:func:`_chain`), states held as ``[V, F]``. The forward keeps the state at each block
  start (``F (E+1)`` numbers per (b, h) per block) and the decayed intra-chunk products ``A``
  (``C`` numbers per token and query head); the backward recomputes each block's features
  and states from them, runs the reverse scan (:func:`_chain_back`) and returns the features'
  cotangents through autograd over the feature map (so every feature, its parameters and a
  learnable W get their gradients), the graph cut at the logits (:class:`_Cut`: the exponential
  and its offsets are differentiated by hand, in place).
* Non-causal (:class:`_NoncausalAttention`): keys in blocks with per-feature running offsets
  (flash-style rescaling of ``S, z``), then queries in blocks; the backward recomputes query
  blocks, then key blocks at the forward's offsets.
* Given features (:class:`_CausalScan`, behind :func:`rfattn.torch_path.causal_scan`): the same
  causal blocks for the operators' torch kernels and the sharded path's local states.
* Heads in parallel: on a CPU with more than one intra-op thread, a large call of either
  Function runs its heads in contiguous parts, one per intra-op thread, each part's forward and
  backward on a worker thread with one intra-op thread (:func:`rfattn.threads.over_heads`;
  where W and the feature parameters are shared by the heads, :func:`_split`).

Offsets are those of docs/numerics.md and of the fused chunk kernel: query row i reads
key j <= i at ``r_i = max(offset before the chunk, m_l for l <= i in the chunk)``, key j entering
as ``g_j exp(u_j - m_j) exp(m_j - r_i)`` with ``m_j`` its max logit; so no output depends on a
later key, not even through underflow. A non-finite key or value poisons the outputs from its
position on (by selection, never by multiplying with 0).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
import torch.nn.functional as nnf

from rfattn import threads, workspace
from rfattn.features import prescale, query_features
from rfattn.features.base import LOG2E, exp_diff
from rfattn.reference import attention_ratio, linear_attention, safe_denominator

#: tokens per chunk (the intra-chunk block is [C, C] per (b, h, query head))
CHUNK = 64
#: query-feature elements per block (B * H * T_b * F): bounds the working memory of a block
BLOCK_ELEMENTS = 1 << 20

_NINF = float("-inf")


def block_tokens(rows: int, width: int) -> int:
    """Tokens per block for ``rows`` query rows (B * H) of ``width`` features: a multiple of
    :data:`CHUNK`, at least one chunk."""
    return max(CHUNK, BLOCK_ELEMENTS // max(1, rows * width) // CHUNK * CHUNK)


def value_width(E: int) -> int:
    """Columns of ``[V, 1]`` as the blocks hold it: E + 1 padded with zeros to a multiple of 8
    (CPU matrix products at odd widths run about 1.5x slower)."""
    return -(-(E + 1) // 8) * 8


@contextlib.contextmanager
def _blocks(device):
    """The context of a blocked loop: kept buffers (:mod:`rfattn.workspace`) and intra-op threads
    that adapt to a busy CPU (:mod:`rfattn.threads`)."""
    with workspace.blocks(), threads.adaptive(device):
        yield


def _next_block() -> None:
    """A block boundary: its kept buffers may be handed out again; the threads' check."""
    workspace.next_block()
    threads.check()


def _exp_or_zero(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``exp(x)`` where ``keep``, else 0 (``x`` may be NaN or inf there), formed as
    :func:`rfattn.features.base.exp_diff` forms it (the same bits where ``keep``). For the small
    per-chunk factors (no autograd)."""
    return torch.where(keep, x, _NINF).mul_(LOG2E).exp2_()


class _Spec:
    """What a call fixes besides its tensors: the feature map, scale, masks, group size and
    the names of the feature parameters (tensors, passed to the Function as inputs)."""

    def __init__(self, fm, scale: float, mask, groups: int, names: tuple, consts: dict):
        self.fm, self.scale, self.mask, self.groups = fm, scale, mask, groups
        self.names, self.consts = names, consts

    def params(self, tensors) -> dict:
        return {**self.consts, **dict(zip(self.names, tensors, strict=True))}


def split_params(params: dict) -> tuple[tuple, tuple, dict]:
    """``(names, tensors, constants)`` of a feature-parameter dict."""
    names = tuple(n for n, x in params.items() if isinstance(x, torch.Tensor))
    consts = {n: x for n, x in params.items() if n not in names}
    return names, tuple(params[n] for n in names), consts


# ------------------------------------------------------------------------------------------------
# one block: inputs, features, offsets


def _pad_tokens(x: torch.Tensor, pad: int) -> torch.Tensor:
    return nnf.pad(x, (0, 0, 0, pad)) if pad else x


def _queries(q, scale: float, params: dict) -> torch.Tensor:
    """Pre-scaled queries (:func:`rfattn.features.prescale`), mapped per head by the call's
    ``"query_map"`` if it has one (calibrated head maps: applied block by block, never to the
    whole sequence at once)."""
    return prescale(q, scale, None, params.get("query_map"))


def _keys_in(k, scale: float, params: dict, mask) -> torch.Tensor:
    """Pre-scaled keys with padded rows 0, mapped per head by ``"key_map"`` (:func:`_queries`)."""
    return prescale(k, scale, mask, params.get("key_map"))


def _block_inputs(spec: _Spec, q, k, v, mask, chunk: int, dtype, params: dict):
    """One block's pre-scaled query rows ``[B, Hk, n*G*C, D]`` (chunk-major, then query head,
    then token), keys ``[B, Hk, n*C, D]``, values with a ones column ``[B, Hk, n, C, E+1]`` and
    key mask ``[B, n*C]`` (True = padding, also the tail that fills the last chunk; None when
    there is none) from its q, k, v and key mask (head maps from ``params``)."""
    B, Hk, T, G = q.shape[0], k.shape[1], k.shape[2], spec.groups
    n = -(-T // chunk)
    pad = n * chunk - T
    mask = _tail_mask(mask, B, T, pad, q.device)
    xq = _pad_tokens(_queries(q, spec.scale, params), pad)
    D = xq.shape[-1]
    xq = xq.unflatten(1, (Hk, G)).unflatten(3, (n, chunk)).transpose(2, 3).reshape(B, Hk, -1, D)
    # the tail that fills the last chunk is zeros already
    xk = _pad_tokens(_keys_in(k, spec.scale, params, None if mask is None else mask[:, :T]), pad)
    vh = _key_values(_pad_tokens(v, pad), mask, value_width(v.shape[-1]), dtype)
    return xq, xk, vh.unflatten(2, (n, chunk)), mask


def _tail_mask(mask, B: int, T: int, pad: int, device):
    """A block's key mask ``[B, T + pad]`` with the ``pad`` tokens that fill its last chunk
    marked as padding (None when there is neither)."""
    if not pad:
        return mask
    base = mask if mask is not None else torch.zeros(B, T, dtype=torch.bool, device=device)
    return torch.cat((base, base.new_ones(B, pad)), dim=1)


def _owned(u: torch.Tensor) -> bool:
    """Whether ``u`` is a dense tensor of its own (not a view or broadcast), safe to turn into
    features in place."""
    return u._base is None and u.is_contiguous()


def _query_side(fm, xq, w, params, key_offsets=None) -> torch.Tensor:
    """Query features: :func:`rfattn.features.query_features` of the feature's logits (``key
    offsets``: the non-causal per-feature ones), or a plain feature's values. Without autograd
    the logits are turned into features in place (no further ``[T, F]`` buffers)."""
    if not fm.exponential:
        return fm.values(xq, w, "query", params)
    g = fm.amplitude(xq, w, "query", params)
    if torch.is_grad_enabled():
        return query_features(fm.logits(xq, w, "query", params), g, key_offsets)
    u, _ = fm.logit_parts(xq, w, "query", params, row=False)  # a per-row term cancels
    return query_features(u, g, key_offsets, out=u if _owned(u) else None)


def _key_side(fm, xk, w, params, mask, offsets=None):
    """:func:`_keys` of the feature map's logits and amplitude (or plain features) for pre-scaled
    keys ``xk``. Without autograd the logits become the features in place."""
    if fm.exponential:
        g = fm.key_amplitude(xk, w, params)
        if torch.is_grad_enabled():
            return _keys(fm.logits(xk, w, "key", params), g, mask, True, False, offsets)
        if offsets is not None:  # per-feature offsets: the per-row term stays in the logits
            u, r = fm.logit_parts(xk, w, "key", params)
            owned = _owned(u)
            if r is not None:
                u = u.add_(r) if owned else u + r
            return _keys(u, g, mask, True, owned or r is not None, offsets)
        u, r = fm.logit_parts(xk, w, "key", params)  # a per-row term moves only the offset m
        pk, m = _keys(u, g, mask, True, _owned(u))
        return pk, m if r is None else m + r[..., 0]
    pk, c = fm.values(xk, w, "key", params), fm.key_amplitude(xk, w, params)
    return _keys(pk if c is None else pk * c, None, mask, False, False)


def _keys(u, g, mask, exponential: bool, inplace: bool = False, offsets=None, out=None):
    """``(phi_k, m)``: keys at their own max logit ``g exp(u - m)`` (plain features: ``u`` is the
    features, m = 0) and ``m`` ``[B, H, T]`` (detached; -inf for padded keys, not finite for a
    key whose features are not), padded keys 0. ``offsets``: a function of the masked logits
    giving the offsets (``[B, H, 1, F]``, non-causal) to use instead of ``m``. ``inplace``: ``u``
    is a tensor of this call's own, turned into the features; ``out`` (exponential features, no
    autograd): a tensor of the caller's own that receives them, ``u`` left as it is."""
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
            m, off = None, offsets(u)
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


class _Cut:
    """One side's features of a block in a backward pass, autograd's graph cut at the logits.

    Exponential features: the logit parts ``(u0, r)`` and amplitude ``g`` are recorded (the
    projection and the per-row term), ``phi`` itself is computed outside autograd, in place in
    kept buffers (:mod:`rfattn.workspace`), and :meth:`backprop` turns ``d phi`` into the
    cotangents of the recorded parts by hand: ``d u = d phi * phi`` (0 at padded keys), ``d r =
    sum_f d u`` (keys only: a query's features do not depend on its per-row term, which cancels
    in their row max), ``d g = d phi * exp(...)``. The offsets are detached, as in the forward,
    so these are the gradients autograd gives through :func:`_query_side` and
    :func:`_key_side` (up to the query rows' ``sum_f d phi phi``, 0 up to rounding: the ratio
    does not change with a row's scale), without the ``[T, F]`` temporaries it would record and
    allocate. Plain features: recorded
    whole (``phi`` is the root).

    Query side (``key_offsets``: the non-causal per-feature ``[B, H, F]``, or None); key side
    (``mask`` ``[B, T]``; ``offsets``: the non-causal ``[B, H, F]`` at which keys enter, or None
    for each key's own max logit, given back as ``m`` with the per-row term, as
    :func:`_key_side` without autograd gives it). Build under ``torch.enable_grad()``.
    """

    def __init__(self, fm, x, w, params, side: str, mask=None, key_offsets=None, offsets=None):
        self.pad = None if mask is None else mask[:, None, :, None]
        self.m = None
        if not fm.exponential:
            if side == "key":
                phi, self.m = _key_side(fm, x, w, params, mask)
            else:
                phi = _query_side(fm, x, w, params)
            self.roots, self.phi, self.e = (phi,), phi.detach(), None
            return
        u0, r = fm.logit_parts(x, w, side, params, row=side == "key")
        g = fm.amplitude(x, w, side, params) if side == "query" else fm.key_amplitude(x, w, params)
        self.u0, self.r, self.g = u0, r, g
        with torch.no_grad():
            e = _kept("phi", u0.detach())
            if side == "query":  # the per-row term cancels in the row max
                e = query_features(u0.detach(), None, key_offsets, out=e)
            elif offsets is None:  # each key at its own max logit (the per-row term cancels)
                e, m = _keys(u0.detach(), None, mask, True, out=e)
                self.m = m if r is None else m + r[..., 0]
            else:  # the per-feature offsets: the per-row term stays in the logits
                torch.add(u0, r, out=e) if r is not None else e.copy_(u0)
                e, _ = _keys(e, None, mask, True, True, lambda u: offsets[:, :, None, :])
            self.e = e
            self.phi = e if g is None else torch.mul(e, g, out=_kept("phi_g", e))
            if g is not None and self.pad is not None:
                self.phi.masked_fill_(self.pad, 0.0)

    def backprop(self, d_phi: torch.Tensor) -> tuple[list, list]:
        """``(roots, cotangents)`` for :func:`add_grads` from ``d phi`` (``[B, H, T, F]``, a
        tensor of the caller's own: overwritten)."""
        if self.e is None:
            return list(self.roots), [d_phi]
        roots, cots = [], []
        if self.pad is not None:  # padded keys' features are set to 0: no gradient there
            d_phi = d_phi.masked_fill_(self.pad, 0.0)
        if self.g is not None and self.g.requires_grad:
            roots.append(self.g)
            cots.append(d_phi * self.e)
        du = d_phi.mul_(self.phi)
        if self.r is not None and self.r.requires_grad:
            roots.append(self.r)
            cots.append(du.sum(dim=-1, keepdim=True))
        if self.u0.requires_grad:
            roots.append(self.u0)
            cots.append(du)
        return roots, cots


def _kept(role: str, like: torch.Tensor) -> torch.Tensor:
    """A kept buffer (:func:`rfattn.workspace.buffer`) shaped and typed as ``like``, or a new
    tensor where none is kept."""
    buf = workspace.buffer(role, like.shape, like.dtype, like.device)
    return torch.empty(like.shape, dtype=like.dtype, device=like.device) if buf is None else buf


class BlockOffsets:
    """The offsets and factors of one block's chunks (all detached, ``[B, H, ...]``).

    ``R``: ``[n+1]`` the state's offset before the block (index 0) and after each chunk;
    ``a``: ``[n, C]`` the factor ``exp(R_{c-1} - r_i)`` of the prefix state for row i;
    ``decay``: ``[n, C, C]`` ``exp(m_j - r_i)`` for j <= i (0 elsewhere and for empty keys);
    ``e``: ``[n, C]`` ``exp(m_j - R_c)``, key j's weight in the state after its chunk;
    ``step``: ``[n, 1, 1]`` ``exp(R_{c-1} - R_c)``, the factor that carries the state before
    chunk c over to the offset after it (0 while no key has been seen).

    ``empty``: whether some key of the block is empty (``m = -inf``: padding, the last chunk's
    tail, a key cleaned away); the caller knows it from the block's one read. Without one every
    ``r_i`` and ``R_c`` is finite, so each factor is a plain exponential of its difference (an
    offset of -inf before the first key gives exp(-inf) = 0); with one, -inf - -inf is NaN there
    and the factors are selected (:func:`_exp_or_zero`).
    """

    def __init__(self, m: torch.Tensor, off: torch.Tensor, empty: bool):
        n, C = m.shape[-2:]
        R = torch.cummax(torch.cat((off[..., None], m.amax(dim=-1)), dim=-1), dim=-1).values
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
            self.a = _exp_or_zero(prev - r, prev > _NINF)
            self.e = _exp_or_zero(m - R[..., 1:, None], m > _NINF)
            step = _exp_or_zero(prev[..., 0] - R[..., 1:], prev[..., 0] > _NINF)
        else:
            self.decay = diff.mul_(LOG2E).clamp_max_(0.0).exp2_().mul_(_lower(C, m))
            self.a = exp_diff(prev, r)
            self.e = exp_diff(m, R[..., 1:, None])
            step = exp_diff(prev[..., 0], R[..., 1:])
        self.step = step[..., None, None]


_LOWER: dict = {}


def _lower(C: int, like: torch.Tensor) -> torch.Tensor:
    """The ``[C, C]`` lower triangle of ones (diagonal included) in ``like``'s dtype and device,
    made once."""
    key = (C, like.dtype, like.device)
    t = _LOWER.get(key)
    if t is None:
        t = _LOWER[key] = torch.ones(C, C, dtype=like.dtype, device=like.device).tril_()
    return t


def _chain(own: torch.Tensor, s_in: torch.Tensor, step: torch.Tensor):
    """The scan over a block's chunks: ``(prefix, s_out)``, the states before each chunk
    ``[B, H, n, E+1, F]`` (``s_in`` first) and after the last, ``S_c = step_c S_{c-1} + own_c``.
    One multiply-add per chunk over ``F (E+1)`` numbers per (b, h), written in place (no
    stacked copy, no product with a mostly-zero matrix); recorded by autograd (the traced path),
    the same steps stacked."""
    n = own.shape[2]
    if torch.is_grad_enabled():
        states = [s_in]
        for c in range(n):
            states.append(torch.addcmul(own[:, :, c], states[-1], step[:, :, c]))
        return torch.stack(states[:-1], dim=2), states[-1]
    prefix = _kept("prefix", own)
    # the chunks' views taken at once (one call each, not four indexing calls per chunk)
    own_c, pre_c, step_c = own.unbind(2), prefix.unbind(2), step.unbind(2)
    pre_c[0].copy_(s_in)
    for c in range(1, n):
        torch.addcmul(own_c[c - 1], pre_c[c - 1], step_c[c - 1], out=pre_c[c])
    return prefix, torch.addcmul(own_c[n - 1], pre_c[n - 1], step_c[n - 1])


def _chain_back(d_prefix: torch.Tensor, ds_out: torch.Tensor, step: torch.Tensor):
    """The reverse scan of :func:`_chain`: ``(d own, d s_in)`` from the cotangents of the states
    before each chunk (``d_prefix`` ``[B, H, n, E+1, F]``) and of the state after the block."""
    n = d_prefix.shape[2]
    d_own = _kept("d_own", d_prefix)
    dp_c, do_c, step_c = d_prefix.unbind(2), d_own.unbind(2), step.unbind(2)
    do_c[n - 1].copy_(ds_out)
    for c in range(n - 2, -1, -1):
        torch.addcmul(dp_c[c + 1], do_c[c + 1], step_c[c + 1], out=do_c[c])
    return d_own, torch.addcmul(dp_c[0], do_c[0], step_c[0])


def _rows(x: torch.Tensor, f: torch.Tensor, groups: int, inplace: bool = False):
    """``x`` ``[B, H, n, G*C, K]`` times a per-token factor ``f`` ``[B, H, n, C]`` shared by
    the G query heads (G may be 0); ``inplace``: into ``x`` (contiguous, the caller's own)."""
    xs, fs = x.unflatten(3, (groups, f.shape[3])), f[:, :, :, None, :, None]
    return xs.mul_(fs).flatten(3, 4) if inplace else (xs * fs).flatten(3, 4)


def _decayed(x: torch.Tensor, decay: torch.Tensor, groups: int) -> torch.Tensor:
    """``x`` ``[B, H, n, G*C, C]`` (a product of the caller's own, contiguous) times the ``[B, H,
    n, C, C]`` decay for each query head, in place."""
    return x.unflatten(3, (groups, decay.shape[3])).mul_(decay[:, :, :, None]).flatten(3, 4)


def _addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, inplace: bool = False):
    """``c + a @ b`` over the leading dims in one batched product (no separate sum pass);
    ``inplace``: added into ``c`` (a contiguous tensor of the caller's own), no copy of it."""
    if inplace:
        c.flatten(0, -3).baddbmm_(a.flatten(0, -3), b.flatten(0, -3))
        return c
    lead = a.shape[:-2]
    out = torch.baddbmm(*(x.flatten(0, -3) for x in (c, a, b)))
    return out.view(*lead, *out.shape[-2:])


class _Block:
    """One block's forward quantities (detached). ``dirty``: some key or value of the block is
    not finite; only then are they cleaned and rows poisoned (one flag per block, so a clean
    block costs no ``[T, F]`` pass for it). ``scores``: the block's decayed intra-chunk products
    ``A`` as the forward computed them (a backward's recomputed block reuses them: one product
    of the features and the decay's multiply fewer, for ``C`` numbers per token and query head
    kept)."""

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
        bad = None
        if self.dirty:
            bad_k = torch.isnan(m) | (m == float("inf"))  # [B, H, n, C]: features not finite
            bad = ~torch.isfinite(vh) | bad_k[..., None]  # [B, H, n, C, E+1]
            self.dirty = compiling or bool(bad.any())  # (the sum may overflow)
        if self.dirty:  # non-finite terms are removed by selection, their rows poisoned
            pk = torch.where(bad_k[..., None], 0.0, pk)
            vh = torch.where(bad, 0.0, vh)
            m = torch.where(bad_k, _NINF, m)
            empty = True  # (cleaned keys are empty now)
        self.pk, self.vh, self.bad = pk, vh, bad
        self.o = o = BlockOffsets(m, off_in, empty)
        ve = o.e[..., None]  # each value at its weight in its chunk's state
        self.ve = torch.mul(vh, ve, out=workspace.buffer("ve", vh.shape, vh.dtype, vh.device))
        own = workspace.product(self.ve.transpose(-1, -2), pk, "own")  # [B, H, n, E+1, F]
        self.prefix, s_out = _chain(own, s_in, o.step)
        if self.dirty:
            s_out = torch.where(bad.any(dim=(2, 3))[..., None], float("nan"), s_out)
        self.s_out, self.off_out = s_out, o.R[..., -1]
        # the decayed intra-chunk products [B, H, n, G*C, C]: as the forward made them, when it
        # kept them for the backward (``scores``), else computed
        self.A = (
            _decayed(self.pq @ pk.transpose(-1, -2), o.decay, groups) if scores is None else scores
        )

    def poisoned(self) -> torch.Tensor | None:
        """Where a non-finite key or value at or before a row poisons it: ``[B, H, n, G*C,
        E+1]`` (per column of ``[V, 1]``); None for a clean block."""
        if not self.dirty:
            return None
        n, C = self.vh.shape[2:4]
        seen = torch.cumsum(self.bad.flatten(2, 3).to(torch.int32), dim=2) > 0
        seen = seen.unflatten(2, (n, C))[:, :, :, None]
        return seen.expand(-1, -1, -1, self.groups, -1, -1).flatten(3, 4)

    def num_den(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(num, den)``: ``[B, H, n, G*C, E]`` and ``[..., G*C]``."""
        nh = _rows(self.pq @ self.prefix.transpose(-1, -2), self.o.a, self.groups, inplace=True)
        nh = _addmm(nh, self.A, self.vh, inplace=True)
        poisoned = self.poisoned()
        if poisoned is not None:
            nh = torch.where(poisoned, float("nan"), nh)
        return nh[..., : self.E], nh[..., self.E]

    def backward(self, dnh: torch.Tensor, ds_out: torch.Tensor):
        """Cotangents ``(d phi_q, d phi_k, d [V, 1], d state in)`` from those of ``[num, den]``
        (``[B, H, n, G*C, E+1]``) and of the state after the block."""
        G, o = self.groups, self.o
        dnh_a = _rows(dnh, o.a, G)
        dP = workspace.product(dnh_a.transpose(-1, -2), self.pq, "dP")  # [B, H, n, E+1, F]
        dA = _decayed(dnh @ self.vh.transpose(-1, -2), o.decay, G)  # [B, H, n, G*C, C]
        dpq = _addmm(workspace.product(dnh_a, self.prefix, "dpq"), dA, self.pk, inplace=True)
        d_own, ds_in = _chain_back(dP, ds_out, o.step)
        dpk = workspace.product(self.ve, d_own, "dpk")
        dpk = _addmm(dpk, dA.transpose(-1, -2), self.pq, inplace=True)
        dvh = _rows(self.pk @ d_own.transpose(-1, -2), o.e, 1, inplace=True)
        dvh = _addmm(dvh, self.A.transpose(-1, -2), dnh, inplace=True)
        return dpq.flatten(2, 3), dpk.flatten(2, 3), dvh, ds_in


def _ratio(num: torch.Tensor, den: torch.Tensor, out=None) -> torch.Tensor:
    """:func:`rfattn.reference.attention_ratio` of a block. Not recorded by autograd, it is
    ``num / safe_denominator(den)``: the same values (an empty row's ``num`` is exactly 0), without
    the ``[T, E]`` passes that find the empty rows, which only the gradient needs (there it is
    :func:`_ratio_grad`); ``out``: written there (no autograd only)."""
    if torch.is_grad_enabled():
        return attention_ratio(num, den)
    return torch.div(num, safe_denominator(den)[..., None], out=out)


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


def _to_rows(x: torch.Tensor, n: int, groups: int) -> torch.Tensor:
    """``[B, Hk, G, n*C, K]`` as chunk rows ``[B, Hk, n, G*C, K]``."""
    return x.unflatten(3, (n, CHUNK)).transpose(2, 3).flatten(3, 4)


def _from_rows(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Chunk rows ``[B, Hk, n, G*C, K]`` as ``[B, Hk, G, n*C, K]``."""
    return x.unflatten(3, (groups, CHUNK)).transpose(2, 3).flatten(3, 4)


def _block_rows(x: torch.Tensor, t0: int, t1: int, n: int) -> torch.Tensor:
    """Tokens ``t0:t1`` of ``[B, Hk, G, T, K]`` as the chunk rows of their block."""
    xb = x[:, :, :, t0:t1]
    return _to_rows(_pad_tokens(xb, n * CHUNK - xb.shape[3]), n, x.shape[2])


def scan_forward(make_block, T: int, block: int, out, den, s, off, keep: bool):
    """Run the causal blocks in order: ``make_block(t0, t1, s, off)`` gives a block's
    :class:`_Block` from the state before it; fills ``out`` ``[B, H, G, T, E]`` and ``den``
    ``[B, H, G, T]``; returns the final ``(s, off)`` (copies of the initial ones when no block
    ran: outputs never alias inputs) and, with ``keep``, what the backward starts each block
    from: the states and offsets before it and its decayed intra-chunk products (``A``)."""
    G = out.shape[2]
    starts, offs, scores = [], [], []
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        if keep:
            starts.append(s)
            offs.append(off)
        _next_block()
        blk = make_block(t0, t1, s, off)
        if keep:
            scores.append(blk.A)  # a tensor of its own (not a kept buffer)
        num, d = blk.num_den()
        if (t1 - t0) % CHUNK or torch.is_grad_enabled():  # a padded tail, or traced
            out[:, :, :, t0:t1] = _from_rows(_ratio(num, d), G)[:, :, :, : t1 - t0]
        else:  # divided straight into out's rows (no block-sized quotient, no copy)
            n = (t1 - t0) // CHUNK
            dst = out[:, :, :, t0:t1].unflatten(3, (n, CHUNK)).transpose(2, 3)  # a view
            _ratio(num.unflatten(3, (G, CHUNK)), d.unflatten(3, (G, CHUNK)), out=dst)
        den[:, :, :, t0:t1] = _from_rows(d[..., None], G)[:, :, :, : t1 - t0, 0]
        s, off = blk.s_out, blk.off_out
        del blk, num, d  # before the next block's features
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
        dev = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), "cpu")
        if not torch.is_autocast_enabled(dev):  # nothing to turn off (the context costs µs)
            return backward(ctx, *grads)
        with torch.autocast(dev, enabled=False):
            return backward(ctx, *grads)

    return run


def backward_follows(*tensors) -> bool:
    """Whether autograd records a call on ``tensors`` (None allowed), i.e. whether a backward
    may follow (only then does a causal forward keep its blocks' quantities). Decide it before
    ``apply``: inside a Function's forward ``ctx.needs_input_grad`` says only which inputs
    require grad, even under ``torch.no_grad()``."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def _save_blocks(ctx, head: tuple, kept: tuple, tail: tuple = ()) -> None:
    """Save ``head``, the per-block lists ``kept`` of :func:`scan_forward` and ``tail`` for a
    backward (:func:`_saved_blocks` unpacks them)."""
    ctx.n_blocks, ctx.n_head = len(kept[0]), len(head)
    ctx.save_for_backward(*head, *(x for lst in kept for x in lst), *tail)


def _saved_blocks(ctx) -> tuple[list, tuple, list]:
    """``(head, (starts, offsets, scores), tail)`` as :func:`_save_blocks` saved them."""
    saved, nh, nb = ctx.saved_tensors, ctx.n_head, ctx.n_blocks
    kept = tuple(saved[nh + i * nb : nh + (i + 1) * nb] for i in range(3))
    return list(saved[:nh]), kept, list(saved[nh + 3 * nb :])


def _block_backward(blk: _Block, out, dout, den, t0: int, t1: int, dstate):
    """``(d phi_q rows, d phi_k, d [V, 1], d state before the block)`` of one block from the
    cotangents of its outputs (in ``dout``) and of the state after it."""
    n = blk.vh.shape[2]
    rows = [_block_rows(x, t0, t1, n) for x in (out, dout, den[..., None])]
    dnh = _ratio_grad(rows[1], rows[0], rows[2][..., 0], blk.poisoned(), blk.vh.shape[-1])
    return blk.backward(dnh, dstate)


def _finite_values(dvh, v, dirty: bool):
    """``d v`` of a block from ``d [V, 1]``: non-finite values get 0 (they were selected away;
    ``dirty``: the block's flag, False when every value is finite)."""
    dv = dvh.flatten(2, 3)[:, :, : v.shape[2], : v.shape[3]]
    return torch.where(torch.isfinite(v), dv, 0.0) if dirty else dv


class _CausalAttention(torch.autograd.Function):
    """Causal random-feature attention over blocks of T (see the module docstring).

    Inputs: ``spec``, q ``[B, Hk*G, T, D]``, k ``[B, Hk, T, D]``, v ``[B, Hk, T, E]``, W, the
    initial ``[S, z, 0...]^T`` ``[B, Hk, value_width(E), F]`` and offset ``[B, Hk]`` (compute
    dtype), the block length, whether a backward follows (:func:`backward_follows`: only then
    are the blocks' start states and products kept), then the feature parameters. Outputs: out
    ``[B, Hk, G, T, E]`` (compute dtype), the final ``[S, z, 0...]^T`` and offset. (States are
    held transposed, rows of F: the chunk products that make and read them run faster on the
    CPU that way.)
    """

    @staticmethod
    def forward(ctx, spec, q, k, v, w, s0, off0, block, keep, *ptensors):
        params = spec.params(ptensors)
        B, Hk, T, G, E = k.shape[0], k.shape[1], k.shape[2], spec.groups, v.shape[-1]
        out = torch.empty(B, Hk, G, T, E, dtype=w.dtype, device=q.device)
        den = torch.empty(B, Hk, G, T, dtype=w.dtype, device=q.device)

        def run(h0, h1):  # heads h0:h1
            qh, kh, vh = q[:, h0 * G : h1 * G], k[:, h0:h1], v[:, h0:h1]

            def make_block(t0, t1, s, off):
                return _forward_block(spec, qh[:, :, t0:t1], kh[:, :, t0:t1], vh[:, :, t0:t1],
                                      w, params, _mask(spec, t0, t1), s, off)  # fmt: skip

            with _blocks(v.device):
                return scan_forward(make_block, T, block, out[:, h0:h1], den[:, h0:h1],
                                     s0[:, h0:h1], off0[:, h0:h1], keep)  # fmt: skip

        bounds = threads.head_parts(Hk, _split(spec, q, w, ptensors, Hk, T))
        parts = threads.over_heads(run, bounds)
        s, off = (_joined(x) for x in zip(*(p[:2] for p in parts), strict=True))
        kept = tuple(sum((list(p[2][i]) for p in parts), []) for i in range(3))
        ctx.spec, ctx.block, ctx.bounds = spec, block, bounds
        _save_blocks(ctx, (q, k, v, w, out, den), kept, ptensors)
        ctx.mark_non_differentiable(off)
        return out, s, off

    @staticmethod
    @no_autocast
    def backward(ctx, dout, ds, _doff):
        spec, block = ctx.spec, ctx.block
        (q, k, v, w, out, den), (starts, offs, scores), ptensors = _saved_blocks(ctx)
        need = ctx.needs_input_grad
        need_q, need_k, need_v, need_w, need_s = need[1:6]
        need_p = need[9:]
        G = spec.groups
        # every block sets its own rows of dq, dk, dv once
        dq = torch.empty_like(q) if need_q else None
        dk = torch.empty_like(k) if need_k else None
        dv = torch.empty_like(v) if need_v else None
        dout = torch.zeros_like(out) if dout is None else dout.to(out.dtype)
        bounds = ctx.bounds
        nb = ctx.n_blocks // len(bounds)  # blocks per part (the parts' lists one after another)

        def run(h0, h1):  # heads h0:h1: (d state before the call, dW, d params) of theirs
            j = bounds.index((h0, h1))
            qs, ks = slice(h0 * G, h1 * G), slice(h0, h1)
            st, of, sc = (x[j * nb : (j + 1) * nb] for x in (starts, offs, scores))
            dw = torch.zeros_like(w) if need_w else None
            dps = [torch.zeros_like(p) if n else None
                   for p, n in zip(ptensors, need_p, strict=True)]  # fmt: skip
            dstate = ds[:, ks] if ds is not None else torch.zeros_like(st[0]) if nb else None
            with _blocks(v.device):
                for i in reversed(range(nb)):
                    t0, t1 = i * block, min(k.shape[2], (i + 1) * block)
                    _next_block()
                    with torch.enable_grad():
                        (qb, kb), wl, pl, pp = _leaves(
                            spec,
                            (q[:, qs, t0:t1], k[:, ks, t0:t1]),
                            (need_q, need_k),
                            w,
                            need_w,
                            ptensors,
                            need_p,
                        )
                        xq, xk, vh, mask = _block_inputs(
                            spec, qb, kb, v[:, ks, t0:t1], _mask(spec, t0, t1), CHUNK, w.dtype, pp
                        )
                        pq = _Cut(spec.fm, xq, wl, pp, "query")
                        pk = _Cut(spec.fm, xk, wl, pp, "key", mask)
                    blk = _Block(pq.phi, pk.phi, pk.m, vh.detach(), st[i], of[i], G, v.shape[-1],
                                 sc[i])  # fmt: skip
                    dpq, dpk, dvh, dstate = _block_backward(blk, out[:, ks], dout[:, ks],
                                                            den[:, ks], t0, t1, dstate)  # fmt: skip
                    dirty = blk.dirty
                    del blk
                    if need_v:
                        dv[:, ks, t0:t1] = _finite_values(dvh, v[:, ks, t0:t1], dirty)
                    accs = (dq[:, qs, t0:t1] if need_q else None,
                            dk[:, ks, t0:t1] if need_k else None, dw, *dps)  # fmt: skip
                    if any(x is not None for x in accs):
                        rq, cq = pq.backprop(dpq)
                        rk, ck = pk.backprop(dpk)
                        add_grads(rq + rk, cq + ck, (qb, kb, wl, *pl), accs, assign=2)
                    del pq, pk
            return dstate, dw, dps

        res = threads.over_heads(run, bounds)
        dstate = None if res[0][0] is None else _joined([r[0] for r in res])
        dw = _summed([r[1] for r in res])
        dps = [_summed(x) for x in zip(*(r[2] for r in res), strict=True)] if ptensors else []
        return (None, dq, dk, dv, dw, dstate if need_s else None, None, None, None, *dps)


def _joined(xs) -> torch.Tensor:
    """The per-part tensors ``xs`` joined along the head dim (a single part's as it is: an
    unsplit call copies nothing)."""
    return xs[0] if len(xs) == 1 else torch.cat(xs, dim=1)


def _summed(xs: list):
    """The sum of the per-part gradients ``xs`` (None where not needed)."""
    if xs[0] is None:
        return None
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def _split(spec: _Spec, q, w, ptensors, heads: int, T: int) -> bool:
    """Whether a call runs its heads on worker threads (:func:`rfattn.threads.split_heads`):
    when W and every feature parameter are shared by the heads (no per-head tensor to slice)."""
    shared = w.dim() == 2 and all(p.dim() >= 3 and p.shape[-3] == 1 for p in ptensors)
    rows = q.shape[0] * q.shape[1] * T
    return shared and threads.split_heads(q.device, heads, rows * spec.fm.width(w.shape[-2]))


def _mask(spec: _Spec, t0: int, t1: int):
    return None if spec.mask is None else spec.mask[:, t0:t1]


def _forward_block(spec, q, k, v, w, params, mask, s, off) -> _Block:
    """The :class:`_Block` of one block's q, k, v and key mask (no autograd: the forward)."""
    xq, xk, vh, mask = _block_inputs(spec, q, k, v, mask, CHUNK, w.dtype, params)
    pq = _query_side(spec.fm, xq, w, params)
    pk, m = _key_side(spec.fm, xk, w, params, mask)
    return _Block(pq, pk, m, vh, s, off, spec.groups, v.shape[-1])


def _given_block(pq, pk, m, v, mask, t0: int, t1: int, s, off, scores=None) -> _Block:
    """The :class:`_Block` of tokens ``t0:t1`` from given features (:class:`_CausalScan`;
    ``scores``: :class:`_Block`'s)."""
    G, n = pq.shape[2], -(-(t1 - t0) // CHUNK)
    pad = n * CHUNK - (t1 - t0)
    mb = _tail_mask(None if mask is None else mask[:, t0:t1], v.shape[0], t1 - t0, pad, v.device)
    vh = _key_values(_pad_tokens(v[:, :, t0:t1], pad), mb, s.shape[-2], s.dtype)
    rows = _to_rows(_pad_tokens(pq[:, :, :, t0:t1], pad), n, G).flatten(2, 3)
    mk = nnf.pad(m[:, :, t0:t1], (0, pad), value=_NINF)
    return _Block(rows, _pad_tokens(pk[:, :, t0:t1], pad), mk, vh.unflatten(2, (n, CHUNK)), s,
                  off, G, v.shape[-1], scores)  # fmt: skip


class _CausalScan(torch.autograd.Function):
    """The causal scan of :class:`_CausalAttention` on given features (no feature map): inputs
    phi_q ``[B, H, G, T, F]``, phi_k ``[B, H, T, F]`` at the keys' own max logits ``m`` ``[B, H,
    T]`` (zero and -inf for padded keys), v ``[B, H, T, E]`` (compute dtype), the initial
    state, the block length, the key mask and whether a backward follows; outputs as
    :class:`_CausalAttention`'s, gradients for phi_q, phi_k, v and the initial ``[S, z]``."""

    @staticmethod
    def forward(ctx, pq, pk, m, v, s0, off0, block, mask, keep):
        B, H, G, T = pq.shape[:4]
        out = torch.empty(B, H, G, T, v.shape[-1], dtype=v.dtype, device=v.device)
        den = torch.empty(B, H, G, T, dtype=v.dtype, device=v.device)

        def make_block(t0, t1, s, off):
            return _given_block(pq, pk, m, v, mask, t0, t1, s, off)

        with _blocks(v.device):
            s, off, kept = scan_forward(make_block, T, block, out, den, s0, off0, keep)
        ctx.block, ctx.mask = block, mask
        _save_blocks(ctx, (pq, pk, m, v, out, den), kept)
        ctx.mark_non_differentiable(off)
        return out, s, off

    @staticmethod
    @no_autocast
    def backward(ctx, dout, ds, _doff):
        block, mask, nb = ctx.block, ctx.mask, ctx.n_blocks
        (pq, pk, m, v, out, den), (starts, offs, scores), _ = _saved_blocks(ctx)
        dpq, dpk, dv = torch.zeros_like(pq), torch.zeros_like(pk), torch.zeros_like(v)
        dout = torch.zeros_like(out) if dout is None else dout
        dstate = ds if ds is not None or not nb else torch.zeros_like(starts[0])
        G = pq.shape[2]
        for i in reversed(range(nb)):
            t0, t1 = i * block, min(pq.shape[3], (i + 1) * block)
            blk = _given_block(pq, pk, m, v, mask, t0, t1, starts[i], offs[i], scores[i])
            dq_rows, dk_b, dvh, dstate = _block_backward(blk, out, dout, den, t0, t1, dstate)
            n = blk.vh.shape[2]
            dq_b = _from_rows(dq_rows.unflatten(2, (n, G * CHUNK)), G)
            dpq[:, :, :, t0:t1] = dq_b[:, :, :, : t1 - t0]
            dpk[:, :, t0:t1] = dk_b[:, :, : t1 - t0]
            dv[:, :, t0:t1] = _finite_values(dvh, v[:, :, t0:t1], blk.dirty)
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


def causal_attention(fm, q, k, v, w, params: dict, scale: float, mask, state):
    """Causal attention on the torch path: ``(out [B, Hk, G, T, E], (S, z, offset))`` in the
    compute dtype (``w.dtype``), differentiable in q, k, v, W, the state's S and z and the
    feature parameters. ``state``: an :class:`rfattn.RFState` or None.

    Under ``torch.compile`` it traces :func:`_traced_causal` instead (one graph, ``fullgraph``
    included; the autograd Functions' recomputing backwards are not traced)."""
    if torch.compiler.is_compiling():
        return _traced_causal(fm, q, k, v, w, params, scale, mask, state)
    B, Hk, G = k.shape[0], k.shape[1], q.shape[1] // max(1, k.shape[1])
    E = v.shape[-1]
    names, ptensors, consts = split_params(params)
    keep = backward_follows(q, k, v, w, *ptensors, *(state or ()))
    spec = _Spec(fm, scale, mask, G, names, consts)
    F = fm.width(w.shape[-2])
    s0, off0, given = _initial(state, B, Hk, F, E, fm.exponential, w)
    block = block_tokens(B * Hk * max(G, 1), F)
    out, s, off = _CausalAttention.apply(spec, q, k, v, w, s0, off0, block, keep, *ptensors)
    return out, _final(s, off, given, E, fm.exponential)


def _traced_causal(fm, q, k, v, w, params, scale, mask, state):
    """:func:`causal_attention` under ``torch.compile``: the features of the whole sequence
    with autograd, then :func:`causal_scan`'s traced blocks (no autograd Function, no
    data-dependent branch: a ``fullgraph`` graph that inductor fuses; memory as autograd keeps
    it)."""
    Hk, G, T = k.shape[1], q.shape[1] // max(1, k.shape[1]), q.shape[2]
    xq = _queries(q, scale, params).unflatten(1, (Hk, G)).flatten(2, 3)  # [B, Hk, G*T, D]
    xk = _keys_in(k, scale, params, mask)
    pq = _query_side(fm, xq, w, params).unflatten(2, (G, T))
    pk, m = _key_side(fm, xk, w, params, mask)
    return _scan_keys(pq, pk, m, v.to(w.dtype), mask, state, fm.exponential)


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

        def make_block(t0, t1, s, off):
            return _given_block(phi_q, pk, m, v, mask, t0, t1, s, off)

        s, off, _ = scan_forward(make_block, T, block, out, den, s0, off0, False)
    else:
        keep = backward_follows(phi_q, pk, v, s0)
        out, s, off = _CausalScan.apply(phi_q, pk, m, v, s0, off0, block, mask, keep)
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
        self.alpha = _exp_or_zero(old - safe, old > _NINF)
        return safe[:, :, None]


def _noncausal_forward(spec: _Spec, q, k, v, w, params: dict, block: int, out, den):
    """``([S, z], offsets)`` of non-causal attention in blocks of ``block`` tokens, its output
    and denominator written to ``out`` and ``den`` (compute dtype)."""
    fm, scale, mask = spec.fm, spec.scale, spec.mask
    B, H, Tk, E = k.shape[0], k.shape[1], k.shape[2], v.shape[-1]
    F, dt = fm.width(w.shape[-2]), w.dtype
    s = torch.zeros(B, H, F, value_width(E), dtype=dt, device=q.device)
    c = torch.full((B, H, F), _NINF, dtype=dt, device=q.device)
    for t0 in range(0, Tk, block):
        t1 = min(Tk, t0 + block)
        mb = None if mask is None else mask[:, t0:t1]
        vh = _key_values(v[:, :, t0:t1], mb, s.shape[-1], dt)
        _next_block()
        online = _OnlineOffsets(c)
        pk, _ = _key_side(fm, _keys_in(k[:, :, t0:t1], scale, params, mb), w, params, mb,
                          offsets=online)  # fmt: skip
        if fm.exponential:
            c, s = online.c, s * online.alpha[..., None]
        s = _addmm(s, pk.transpose(-1, -2), vh, inplace=True)
        del pk
    off = torch.where(c == _NINF, 0.0, c)  # no valid key: offset 0 (key_offset's rule)
    for r0 in range(0, q.shape[2], block):
        r1 = min(q.shape[2], r0 + block)
        _next_block()
        nh = _query_side(fm, _queries(q[:, :, r0:r1], scale, params), w, params, off) @ s
        _ratio(nh[..., :E], nh[..., E], out=out[:, :, r0:r1])  # (no autograd here)
        den[:, :, r0:r1] = nh[..., E]
    return s, off


def _key_values(v, mask, width: int, dtype) -> torch.Tensor:
    """``[V, 1, 0...]`` ``[B, H, T, width]`` in ``dtype``, zero for padded keys (a kept buffer
    where one is kept: :func:`rfattn.workspace.buffer`)."""
    E = v.shape[-1]
    vh = workspace.buffer("values", (*v.shape[:-1], width), dtype, v.device)
    if vh is None:
        vh = nnf.pad(v.to(dtype), (0, width - E))
    else:
        vh[..., :E] = v
        vh[..., E + 1 :] = 0.0
    vh[..., E] = 1.0
    return vh if mask is None else vh.masked_fill_(mask[:, None, :, None], 0.0)


def _leaves(spec: _Spec, xs, need_x, w, need_w: bool, ptensors, need_p):
    """``(xs, w, params, param dict)`` detached, requiring grad where needed: the leaves of one
    block's recomputation in a backward."""
    xs = tuple(x.detach().requires_grad_(n) for x, n in zip(xs, need_x, strict=True))
    pl = [p.detach().requires_grad_(n) for p, n in zip(ptensors, need_p, strict=True)]
    return xs, w.detach().requires_grad_(need_w), pl, spec.params(pl)


def add_grads(feats, d_feats, leaves, accs, assign: int = 0) -> None:
    """Add the gradients of ``feats`` (cotangent ``d_feats``) for the ``leaves`` that require
    grad into their accumulators ``accs`` (None where not needed); the first ``assign``
    accumulators (a block's own rows of dq, dk: uninitialised until here) are set instead."""
    wrt = [x for x, a in zip(leaves, accs, strict=True) if a is not None]
    # features of a side no gradient is asked of (plain features of q, say, when only k needs
    # one) are not in the graph
    pairs = [(f, d) for f, d in zip(feats, d_feats, strict=True) if f.requires_grad]
    feats, d_feats = [f for f, _ in pairs], [d for _, d in pairs]
    grads = torch.autograd.grad(feats, wrt, d_feats, allow_unused=True) if feats and wrt else ()
    grads = iter(grads)
    for i, a in enumerate(accs):
        g = next(grads, None) if a is not None else None
        if i < assign and a is not None:
            a.copy_(g) if g is not None else a.zero_()
        elif g is not None:
            a += g


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
        params = spec.params(ptensors)
        B, H, E = k.shape[0], k.shape[1], v.shape[-1]
        block = block_tokens(B * H, spec.fm.width(w.shape[-2]))
        out = torch.empty(*q.shape[:3], E, dtype=w.dtype, device=q.device)
        den = torch.empty(q.shape[:3], dtype=w.dtype, device=q.device)

        def run(h0, h1):  # heads h0:h1
            with _blocks(v.device):
                return _noncausal_forward(spec, q[:, h0:h1], k[:, h0:h1], v[:, h0:h1], w, params,
                                          block, out[:, h0:h1], den[:, h0:h1])  # fmt: skip

        T = max(q.shape[2], k.shape[2])
        bounds = threads.head_parts(H, _split(spec, q, w, ptensors, H, T))
        parts = threads.over_heads(run, bounds)
        s, off = (_joined(x) for x in zip(*parts, strict=True))
        ctx.spec, ctx.block, ctx.bounds = spec, block, bounds
        ctx.save_for_backward(q, k, v, w, out, den, s, off, *ptensors)
        return out

    @staticmethod
    @no_autocast
    def backward(ctx, dout):
        spec, block = ctx.spec, ctx.block
        q, k, v, w, out, den, s, off, *ptensors = ctx.saved_tensors
        need_q, need_k, need_v, need_w = ctx.needs_input_grad[1:5]
        need_p = ctx.needs_input_grad[5:]
        # every block sets its own rows of dq (or dk, dv) once
        dq = torch.empty_like(q) if need_q else None
        dk = torch.empty_like(k) if need_k else None
        dv = torch.empty_like(v) if need_v else None
        dout = dout.to(out.dtype)

        def run(h0, h1):  # heads h0:h1: (dW, d params) of theirs
            hs = slice(h0, h1)
            dw = torch.zeros_like(w) if need_w else None
            dps = [torch.zeros_like(p) if n else None
                   for p, n in zip(ptensors, need_p, strict=True)]  # fmt: skip
            sh, offh = s[:, hs], off[:, hs]
            ds = torch.zeros_like(sh)
            grads = need_q or need_w or any(need_p)
            with _blocks(v.device):
                for r0 in range(0, q.shape[2], block):
                    r1 = min(q.shape[2], r0 + block)
                    _next_block()
                    with torch.enable_grad():
                        (qb,), wl, pl, pp = _leaves(spec, (q[:, hs, r0:r1],), (need_q,), w,
                                                    need_w, ptensors, need_p)  # fmt: skip
                        pq = _Cut(spec.fm, _queries(qb, spec.scale, pp), wl, pp, "query",
                                  key_offsets=offh)  # fmt: skip
                    dnh = _ratio_grad(dout[:, hs, r0:r1], out[:, hs, r0:r1], den[:, hs, r0:r1],
                                      None, sh.shape[-1])  # fmt: skip
                    ds = _addmm(ds, pq.phi.transpose(-1, -2), dnh, inplace=True)
                    if grads:
                        d_phi = workspace.product(dnh, sh.transpose(-1, -2), "d_phi")
                        acc = dq[:, hs, r0:r1] if need_q else None
                        add_grads(*pq.backprop(d_phi), (qb, wl, *pl), (acc, dw, *dps), assign=1)
                    del pq
                grads = need_k or need_w or any(need_p)
                for t0 in range(0, k.shape[2], block):
                    t1 = min(k.shape[2], t0 + block)
                    _next_block()
                    mb = None if spec.mask is None else spec.mask[:, t0:t1]
                    vh = _key_values(v[:, hs, t0:t1], mb, sh.shape[-1], sh.dtype)
                    with torch.enable_grad():
                        (kb,), wl, pl, pp = _leaves(spec, (k[:, hs, t0:t1],), (need_k,), w,
                                                    need_w, ptensors, need_p)  # fmt: skip
                        pk = _Cut(spec.fm, _keys_in(kb, spec.scale, pp, mb), wl, pp, "key", mb,
                                  offsets=offh)  # fmt: skip
                    if need_v:
                        dv[:, hs, t0:t1] = pk.phi @ ds[..., : v.shape[-1]]
                    if grads:
                        d_phi = workspace.product(vh, ds.transpose(-1, -2), "d_phi")
                        acc = dk[:, hs, t0:t1] if need_k else None
                        add_grads(*pk.backprop(d_phi), (kb, wl, *pl), (acc, dw, *dps), assign=1)
                    del pk
            return dw, dps

        res = threads.over_heads(run, ctx.bounds)
        dw = _summed([r[0] for r in res])
        dps = [_summed(x) for x in zip(*(r[1] for r in res), strict=True)] if ptensors else []
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
        xq, xk = _queries(q, scale, params), _keys_in(k, scale, params, mask)
        phi_q, phi_k = fm.features(xq, xk, w, mask, params)
        return linear_attention(phi_q, phi_k, v.to(w.dtype), key_padding_mask=mask)
    names, ptensors, consts = split_params(params)
    spec = _Spec(fm, scale, mask, 1, names, consts)
    return _NoncausalAttention.apply(spec, q, k, v, w, *ptensors)
