"""Attention layers: :class:`RFAttention` and :class:`RFMultiheadAttention`, a drop-in for
``torch.nn.MultiheadAttention`` that runs :func:`rfattn.rf_attention`.

Both hold one :class:`RandomFeatures` (``.rf``) shared by the heads, redraw it every
``feature_redraw_interval`` training forwards (seeds derived from the layer seed and the redraw
count, both saved in ``state_dict``, so a reloaded layer continues identically) until
:meth:`fix_projection`, and accept a :class:`FourierRPE` (``rpe=``) for FLT positional encodings.

Incremental decoding: a causal layer takes and returns the :class:`rfattn.RFState` of the tokens
so far, so each new token costs ``O(M E)`` per head whatever the position::

    layer = RFAttention(dim, heads, causal=True).eval()
    out, state = layer(prompt, return_state=True)              # prefill, [B, T0, dim]
    for _ in range(steps):
        y, state = layer(x_new, initial_state=state, return_state=True)  # [B, 1, dim]

Continuing equals one call on the whole sequence (to rounding). The state belongs to this layer's
current feature draw: a redraw (``feature_redraw_interval`` in training, :meth:`redraw_features`)
makes it invalid, and passing it on raises.

Context parallelism: set ``layer.group`` to a ``torch.distributed`` process group (for a
``DeviceMesh``, ``mesh.get_group("cp")``) and give each rank its contiguous shard of the sequence,
in rank order; outputs are that rank's shard of the whole-sequence attention, gradients those of
one process (:mod:`rfattn.distributed`; every rank runs the backward; parameters are replicated,
so sum their gradients over the group as data parallelism does). With an ``rpe``, pass each
shard's global ``positions``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rfattn.features import python_scalar
from rfattn.hybrid import check_local
from rfattn.modules.features import RandomFeatures
from rfattn.modules.flt import FourierRPE

__all__ = ["RFAttention", "RFMultiheadAttention", "layer_seed"]

_MASK64 = (1 << 63) - 1


def layer_seed(seed: int, index: int) -> int:
    """A deterministic, well-spread seed for layer ``index`` of a stack built from ``seed``."""
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (seed, index)):
        raise TypeError(f"seed and index must be ints, got {seed!r}, {index!r}")
    # splitmix64 of (seed, index): neighbouring layers get unrelated generator streams
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK64


class _RandomFeatureLayer(nn.Module):
    """Shared machinery: the feature map, its redraw schedule and the call to rf_attention."""

    feature_seed: torch.Tensor
    redraw_count: torch.Tensor
    steps_since_redraw: torch.Tensor
    projection_fixed: torch.Tensor

    def _init_features(
        self,
        num_heads: int,
        head_dim: int,
        num_features: int,
        feature: str,
        weights: str,
        seed: int | None,
        feature_redraw_interval: int | None,
        rpe: FourierRPE | None,
        scale: float | None,
        backend: str,
        device,
        feature_options: dict,
    ) -> None:
        if feature_redraw_interval is not None and (
            not isinstance(feature_redraw_interval, int)
            or isinstance(feature_redraw_interval, bool)
            or feature_redraw_interval < 1
        ):
            raise ValueError(
                f"feature_redraw_interval must be an int >= 1 or None, got "
                f"{feature_redraw_interval!r}"
            )
        if feature_redraw_interval is not None and weights == "fastfoodl":
            raise ValueError(
                "feature_redraw_interval must be None for weights='fastfoodl' (learned weights "
                "are trained, not redrawn)"
            )
        if rpe is not None:
            if not isinstance(rpe, FourierRPE):
                raise TypeError(
                    f"rpe must be a rfattn.FourierRPE or None, got {type(rpe).__name__}"
                )
            if rpe.num_heads != num_heads:
                raise ValueError(
                    f"rpe has num_heads={rpe.num_heads}, but this layer has num_heads={num_heads}"
                )
        if scale is not None and (isinstance(scale, bool) or not scale > 0):
            raise ValueError(f"scale must be a number > 0 or None, got {scale!r}")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"seed must be an int or None, got {seed!r}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        #: context parallelism: a ``torch.distributed`` process group over which each call's
        #: sequence is split (see :mod:`rfattn.distributed`; None: one process)
        self.group = None
        self.feature_redraw_interval = feature_redraw_interval
        self.rpe = rpe
        rf_dim = rpe.augmented_dim(head_dim) if rpe is not None else head_dim
        self.rf = RandomFeatures(rf_dim, num_features, feature, weights, seed, **feature_options)
        if device is not None:
            self.rf.to(device)
        for name, val in (("feature_seed", seed), ("redraw_count", 0), ("steps_since_redraw", 0)):
            self.register_buffer(name, torch.tensor(val, dtype=torch.int64, device=device))
        self.register_buffer("projection_fixed", torch.tensor(False, device=device))

    @torch.no_grad()
    def redraw_features(self, seed: int | None = None) -> None:
        """Redraw the random features now (also resets the interval counter).

        Args:
            seed: the new draw's seed; ``None`` derives it from the layer seed and the number of
                redraws so far (deterministic and reproducible from ``state_dict``).
        """
        self.redraw_count += 1
        if seed is None:
            seed = layer_seed(int(self.feature_seed), int(self.redraw_count))
        self.rf.redraw(seed)
        self.steps_since_redraw.zero_()

    def fix_projection(self) -> None:
        """Stop the periodic redraws: the current features are kept from now on."""
        self.projection_fixed.fill_(True)

    def _before_forward(self) -> None:
        """Count a training forward; redraw first when ``feature_redraw_interval`` are done."""
        if not self.training or self.feature_redraw_interval is None or self.projection_fixed:
            return
        if int(self.steps_since_redraw) >= self.feature_redraw_interval:
            self.redraw_features()
        self.steps_since_redraw += 1

    #: exact sinks and window inside the features (``rf_attention``'s ``window``, ``sinks``)
    window: int = 0
    sinks: int = 0

    def _init_local(self, window, sinks) -> None:
        """The layer's hybrid (:mod:`rfattn.hybrid`): ``window`` and ``sinks`` checked, kept."""
        check_local(window, sinks)
        if (window or sinks) and self.rpe is not None:
            raise ValueError("window and sinks take no rpe (FourierRPE) yet")
        self.window, self.sinks = window, sinks

    def _attend(self, q, k, v, key_padding_mask, causal, positions, key_positions, center,
                initial_state, return_state, self_attention=False):  # fmt: skip
        """rf_attention (through the RPE when set) on ``[B, H, T, D]`` views; self-attention
        leaves its padded queries out of the statistics too; the layer's window and sinks."""
        from rfattn.attention import rf_attention

        kwargs = dict(causal=causal, key_padding_mask=key_padding_mask, backend=self.backend)
        if self.window or self.sinks:
            kwargs.update(window=self.window, sinks=self.sinks)
        if self.group is not None:
            kwargs["group"] = self.group
        if self_attention and key_padding_mask is not None and self.rpe is None:
            kwargs["query_padding_mask"] = key_padding_mask
        if causal and (initial_state is not None or return_state):
            kwargs.update(initial_state=initial_state, return_state=return_state)
        elif initial_state is not None or return_state:
            raise ValueError("initial_state and return_state need causal attention")
        if self.rpe is None:
            if positions is not None or key_positions is not None:
                raise ValueError("positions need an rpe (FourierRPE) on this layer")
            return rf_attention(q, k, v, self.rf, scale=self.scale, **kwargs)
        return self.rpe(q, k, v, self.rf, positions, key_positions, scale=self.scale,
                        center=center, **kwargs)  # fmt: skip


def _dropout_out(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(x, p, training) if p > 0 else x


def _check_dropout(dropout) -> float:
    dropout = python_scalar(dropout)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
    return float(dropout)


def _check_heads(embed_dim, num_heads) -> None:
    for name, val in (("embed_dim", embed_dim), ("num_heads", num_heads)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{name} must be an int >= 1, got {val!r}")
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")


class RFAttention(_RandomFeatureLayer):
    """Multi-head random-feature attention with q/k/v/out projections (self or cross).

    Args:
        embed_dim: model width E; ``num_heads`` heads of ``E / num_heads``.
        num_features, feature, weights, seed, **feature_options: the :class:`RandomFeatures`
            (one map shared by all heads; ``seed`` also seeds its redraws, see
            :func:`layer_seed` for stacks).
        kdim, vdim: widths of the key and value inputs (default ``embed_dim``).
        bias: biases in the projections.
        dropout: dropout on the attention output (before ``out_proj``), training only. Random
            features have no attention matrix to drop entries from.
        causal: default of ``forward``'s ``causal``.
        batch_first: inputs ``[B, T, E]`` (default) or ``[T, B, E]``.
        scale: softmax temperature, default ``head_dim ** -0.5``.
        feature_redraw_interval: redraw the features every this many training forwards
            (None = never); :meth:`fix_projection` stops it.
        rpe: a :class:`FourierRPE` with ``num_heads`` heads (FLT); the feature map is then built
            for the augmented head dim ``head_dim + 2R``. Pass the same module to several layers
            to share the masks between them (the paper's choice).
        backend: ``rf_attention``'s backend.
        window, sinks: exact sinks and a sliding window inside the features
            (``rf_attention``'s, :mod:`rfattn.hybrid`; 0: none); no ``rpe`` with them.
        device, dtype: of the parameters.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        num_features: int = 256,
        feature: str = "posrf",
        weights: str = "orf",
        seed: int | None = 0,
        *,
        kdim: int | None = None,
        vdim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        causal: bool = False,
        batch_first: bool = True,
        scale: float | None = None,
        feature_redraw_interval: int | None = None,
        rpe: FourierRPE | None = None,
        backend: str = "auto",
        window: int = 0,
        sinks: int = 0,
        device=None,
        dtype=None,
        **feature_options,
    ) -> None:
        super().__init__()
        _check_heads(embed_dim, num_heads)
        if not isinstance(causal, bool):
            raise TypeError(f"causal must be a bool, got {causal!r}")
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        self.dropout = _check_dropout(dropout)
        self.causal = causal
        self.batch_first = bool(batch_first)
        fk = {"device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias, **fk)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias, **fk)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        self._init_features(num_heads, embed_dim // num_heads, num_features, feature, weights,
                            seed, feature_redraw_interval, rpe, scale, backend, device,
                            feature_options)  # fmt: skip
        self._init_local(window, sinks)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, E]`` -> ``[B, H, T, E/H]`` (a strided view)."""
        B, T, _ = x.shape
        return x.view(B, T, self.num_heads, x.shape[-1] // self.num_heads).transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        *,
        causal: bool | None = None,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        center: torch.Tensor | float | None = None,
        initial_state=None,
        return_state: bool = False,
    ):
        """Attend ``query`` to ``key``/``value``.

        Args:
            query: ``[B, Tq, E]`` (``[Tq, B, E]`` unless ``batch_first``).
            key: ``[B, Tk, kdim]``, default ``query`` (self-attention); value: ``[B, Tk, vdim]``,
                default ``key``.
            key_padding_mask: ``[B, Tk]`` bool, True = padding.
            causal: override the layer's default (needs Tq == Tk).
            positions, key_positions, center: token positions for the RPE (see
                :class:`FourierRPE`; default ``arange(T)``).
            initial_state, return_state: causal streaming, as in :func:`rfattn.rf_attention`.

        Returns:
            ``[B, Tq, E]`` (same layout as ``query``), or ``(out, state)`` with ``return_state``.
        """
        causal = self.causal if causal is None else causal
        self_attention = key is None or key is query
        key = query if key is None else key
        value = key if value is None else value
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3:
                raise ValueError(f"{name} must be a tensor of rank 3 ([B, T, E] or [T, B, E])")
        for name, x, arg, width in (("query", query, "embed_dim", self.embed_dim),
                                    ("key", key, "kdim", self.kdim),
                                    ("value", value, "vdim", self.vdim)):  # fmt: skip
            if x.shape[-1] != width:
                raise ValueError(f"{name} has {x.shape[-1]} channels, expected {arg}={width}")
        b, t = (0, 1) if self.batch_first else (1, 0)
        if not query.shape[b] == key.shape[b] == value.shape[b]:
            raise ValueError(
                f"query, key and value must share the batch size (dim {b}), got "
                f"{query.shape[b]}, {key.shape[b]}, {value.shape[b]}"
            )
        if key.shape[t] != value.shape[t]:
            raise ValueError(f"key and value must have the same length, got {key.shape[t]}, "
                             f"{value.shape[t]}")  # fmt: skip
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        self._before_forward()
        q = self._heads(self.q_proj(query))
        k = self._heads(self.k_proj(key))
        v = self._heads(self.v_proj(value))
        res = self._attend(q, k, v, key_padding_mask, causal, positions, key_positions, center,
                           initial_state, return_state, self_attention)  # fmt: skip
        out, state = res if isinstance(res, tuple) else (res, None)
        B, H, T, Dv = out.shape
        out = _dropout_out(out.transpose(1, 2).reshape(B, T, H * Dv), self.dropout, self.training)
        out = self.out_proj(out)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return (out, state) if return_state else out


def _blocked(mask: torch.Tensor, name: str) -> torch.Tensor:
    """A bool mask with True = blocked, from torch's bool (True = blocked) or additive float
    (0 = keep, -inf = blocked) conventions; other additive values have no linear form."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise TypeError(f"{name} must be bool or floating point, got dtype {mask.dtype}")
    blocked = mask == float("-inf")
    other = ((mask != 0) & ~blocked).any()
    why = (f"{name}: additive float masks must hold only 0 and -inf; an additive bias has no "
           "random-feature (linear) form")  # fmt: skip
    if torch.compiler.is_compiling():  # checked when the graph runs (no data-dependent branch)
        torch._assert_async(~other, why)
    elif bool(other):
        raise ValueError(why)
    return blocked


class RFMultiheadAttention(_RandomFeatureLayer):
    """Drop-in for :class:`torch.nn.MultiheadAttention` running random-feature attention.

    Same constructor and ``forward`` arguments, same parameter names (``in_proj_weight``,
    ``in_proj_bias``, ``q/k/v_proj_weight``, ``out_proj``, ``bias_k``, ``bias_v``), so
    ``load_state_dict(mha.state_dict(), strict=False)`` or :meth:`from_torch` takes over a
    trained layer. Keyword-only extras configure the features: ``num_features``, ``feature``,
    ``weights``, ``seed``, ``feature_redraw_interval``, ``rpe``, ``scale``, ``backend``,
    ``window`` and ``sinks`` (exact sinks and a sliding window inside the features,
    :mod:`rfattn.hybrid`) and the feature options of :class:`RandomFeatures`.

    Differences, since no ``[Tq, Tk]`` attention matrix exists:

    * ``need_weights`` defaults to False and True raises ValueError; ``forward`` returns
      ``(out, None)``. The common calls ``mha(x, x, x)`` and ``mha(...)[0]`` (and torch's
      Transformer layers, which pass ``need_weights=False``) work unchanged; code that reads the
      weights fails loudly instead of getting a silent None.
    * ``attn_mask``: only masks expressible in linear form are accepted: none/all-keep, or the
      causal mask (bool upper triangle / float ``-inf`` above the diagonal, ``[L, L]`` or
      ``[B*H, L, L]``), which runs causal linear attention (so does ``is_causal=True``, with or
      without the mask). Any other pattern or additive bias raises ValueError naming
      ``attn_mask``; padding belongs in ``key_padding_mask`` (bool, or float 0/-inf). With
      ``group`` set (context parallelism) a shard's causal mask of one token (``[[0.]]``) or
      none (``[0, 0]``), which masks nothing, still means causal, as on the other ranks; give
      no ``attn_mask`` for non-causal sharded attention.
    * ``dropout`` drops entries of the attention output (before ``out_proj``), not of weights.
    * ``add_bias_kv``/``add_zero_attn`` append their key/value token as torch does; they are
      not defined for causal attention (ValueError).
    * ``_qkv_same_embed_dim`` is always False so that ``nn.TransformerEncoderLayer``'s
      inference fast path (a fused softmax kernel reading ``in_proj_weight``) is never taken;
      ``qkv_same_embed_dim`` holds the real layout.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device=None,
        dtype=None,
        *,
        num_features: int = 256,
        feature: str = "posrf",
        weights: str = "orf",
        seed: int | None = 0,
        feature_redraw_interval: int | None = None,
        rpe: FourierRPE | None = None,
        scale: float | None = None,
        backend: str = "auto",
        window: int = 0,
        sinks: int = 0,
        **feature_options,
    ) -> None:
        super().__init__()
        _check_heads(embed_dim, num_heads)
        fk = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else kdim
        self.vdim = embed_dim if vdim is None else vdim
        for name, val in (("kdim", self.kdim), ("vdim", self.vdim)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be an int >= 1 or None, got {val!r}")
        self.qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self._qkv_same_embed_dim = False  # see the class docstring: no torch fast path
        self.dropout = _check_dropout(dropout)
        self.batch_first = bool(batch_first)
        self.add_zero_attn = bool(add_zero_attn)
        if self.qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **fk))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **fk))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **fk))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **fk))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **fk))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **fk)
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty(1, 1, embed_dim, **fk))
            self.bias_v = nn.Parameter(torch.empty(1, 1, embed_dim, **fk))
        else:
            self.bias_k = self.bias_v = None
        self._reset_parameters()
        self._init_features(num_heads, embed_dim // num_heads, num_features, feature, weights,
                            seed, feature_redraw_interval, rpe, scale, backend, device,
                            feature_options)  # fmt: skip
        self._init_local(window, sinks)

    def _reset_parameters(self) -> None:
        """torch's initialisation (xavier-uniform projections, zero biases)."""
        if self.qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
            nn.init.xavier_normal_(self.bias_v)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, **rf_options) -> RFMultiheadAttention:
        """An RFMultiheadAttention with ``mha``'s configuration and a copy of its parameters.

        Args:
            mha: the ``nn.MultiheadAttention`` to replace.
            **rf_options: the keyword-only feature arguments (num_features, feature, ...).
        """
        if not isinstance(mha, nn.MultiheadAttention):
            raise TypeError(f"mha must be an nn.MultiheadAttention, got {type(mha).__name__}")
        p = mha.out_proj.weight
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            dropout=mha.dropout,
            bias=mha.in_proj_bias is not None,
            add_bias_kv=mha.bias_k is not None,
            add_zero_attn=mha.add_zero_attn,
            kdim=mha.kdim,
            vdim=mha.vdim,
            batch_first=mha.batch_first,
            device=p.device,
            dtype=p.dtype,
            **rf_options,
        )
        missing, unexpected = new.load_state_dict(mha.state_dict(), strict=False)
        if unexpected or any(not m.startswith(("rf.", "rpe.")) and m not in new._buffers
                             for m in missing):  # fmt: skip
            raise RuntimeError(f"parameter mismatch: missing {missing}, unexpected {unexpected}")
        return new

    def _project(self, query, key, value):
        E = self.embed_dim
        if self.qkv_same_embed_dim:
            wq, wk, wv = self.in_proj_weight.split(E)
        else:
            wq, wk, wv = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        bq = bk = bv = None
        if self.in_proj_bias is not None:
            bq, bk, bv = self.in_proj_bias.split(E)
        return F.linear(query, wq, bq), F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _is_causal_mask(self, attn_mask, is_causal: bool, L: int, S: int) -> bool:
        """Whether ``attn_mask`` (with the hint ``is_causal``) asks for causal attention;
        raises for patterns that linear attention cannot express."""
        if attn_mask is None:
            return bool(is_causal)
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.dim() not in (2, 3):
            raise ValueError("attn_mask must be a tensor [L, S] or [B * num_heads, L, S]")
        if tuple(attn_mask.shape[-2:]) != (L, S):
            raise ValueError(
                f"attn_mask must end in [L, S] = {(L, S)}, got {tuple(attn_mask.shape)}"
            )
        blocked = _blocked(attn_mask, "attn_mask")
        if L == S:
            causal = torch.ones(L, L, dtype=torch.bool, device=blocked.device).triu(1)
            if bool((blocked == causal).all()):
                # the causal mask; with L <= 1 ([[0.]], [[False]], [0, 0]) it masks nothing,
                # and one process reads it as is_causal says, a sharded call as causal (a shard
                # of a causal sequence: the other ranks run causal)
                from rfattn.distributed import runs_causal

                return bool(is_causal) or runs_causal(True, L, self.group)
        if not bool(blocked.any()) and not is_causal:
            return False
        raise ValueError(
            "attn_mask: only the causal mask (or no mask) maps onto random-feature linear "
            "attention; pass padding as key_padding_mask, and use softmax attention for other "
            "patterns"
        )

    def _nested(self, query, key, value, key_padding_mask, attn_mask, is_causal) -> torch.Tensor:
        """Self-attention over a nested batch ``[N, (L_i), E]``, as ``nn.TransformerEncoder``'s
        fast path hands one in (eval mode, padding given, built with a multi-head attention
        that this layer replaced): padded, its rows' lengths as ``key_padding_mask``, and the
        output nested again."""
        if not (query is key and key is value):
            raise ValueError("nested query, key, value: only self-attention (the same tensor)")
        if not self.batch_first or key_padding_mask is not None or attn_mask is not None:
            raise ValueError(
                "nested query: needs batch_first=True and no key_padding_mask or attn_mask "
                "(the nested rows' lengths are the padding)"
            )
        rows = query.unbind()
        x = torch.nested.to_padded_tensor(query, 0.0)
        lengths = torch.tensor([r.shape[0] for r in rows], device=x.device)
        pad = torch.arange(x.shape[1], device=x.device) >= lengths[:, None]
        out, _ = self.forward(x, x, x, key_padding_mask=pad, is_causal=is_causal)
        return torch.nested.as_nested_tensor(
            [o[: r.shape[0]] for o, r in zip(out, rows, strict=True)], layout=query.layout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """``nn.MultiheadAttention.forward`` with random-feature attention.

        Args:
            query: ``[L, N, E]`` (``[N, L, E]`` with ``batch_first``, or unbatched ``[L, E]``),
                or a nested batch ``[N, (L_i), E]`` for self-attention (``batch_first``; what
                ``nn.TransformerEncoder`` passes in eval mode with padding).
            key: ``[S, N, kdim]``; value: ``[S, N, vdim]`` (same layout rules).
            key_padding_mask: ``[N, S]`` (or ``[S]``) bool True = ignore, or float 0/-inf.
            need_weights: must be False (no attention matrix exists; see the class docstring).
            attn_mask: None, or a causal mask (see the class docstring).
            average_attn_weights: accepted for compatibility; unused (no weights).
            is_causal: causal attention (L == S).

        Returns:
            ``(attn_output, None)``; ``attn_output`` in ``query``'s layout.
        """
        if need_weights:
            raise ValueError(
                "need_weights=True is not supported: random-feature attention never forms the "
                "attention-weight matrix; call with need_weights=False"
            )
        if any(isinstance(x, torch.Tensor) and x.is_nested for x in (query, key, value)):
            return self._nested(query, key, value, key_padding_mask, attn_mask, is_causal), None
        same = query is key  # self-attention: the key mask is also the query mask (statistics)
        unbatched = query.dim() == 2
        for name, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor) or x.dim() != (2 if unbatched else 3):
                raise ValueError(f"{name} must have rank {2 if unbatched else 3} like query")
        if unbatched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        L, N, E = query.shape
        S = key.shape[0]
        if E != self.embed_dim:
            raise ValueError(f"query has embed dim {E}, expected embed_dim={self.embed_dim}")
        if key.shape[:2] != value.shape[:2] or key.shape[1] != N:
            raise ValueError(
                f"key {tuple(key.shape)} and value {tuple(value.shape)} must share [S, N] with "
                f"N={N}"
            )
        causal = self._is_causal_mask(attn_mask, is_causal, L, S)
        if causal and L != S:
            raise ValueError(f"is_causal/attn_mask: causal attention needs L == S, got {L}, {S}")
        if key_padding_mask is not None:
            if not isinstance(key_padding_mask, torch.Tensor) or tuple(key_padding_mask.shape) != (
                N,
                S,
            ):
                raise ValueError(f"key_padding_mask must have shape [N, S] = {(N, S)}")
            key_padding_mask = _blocked(key_padding_mask, "key_padding_mask")
        self._before_forward()
        q, k, v = self._project(query, key, value)  # [L|S, N, E]
        extra = int(self.bias_k is not None) + int(self.add_zero_attn)
        if extra and causal:
            raise ValueError("add_bias_kv/add_zero_attn are not defined for causal attention")
        if self.bias_k is not None:
            k = torch.cat((k, self.bias_k.expand(1, N, E)))
            v = torch.cat((v, self.bias_v.expand(1, N, E)))
        if self.add_zero_attn:
            k = torch.cat((k, k.new_zeros(1, N, E)))
            v = torch.cat((v, v.new_zeros(1, N, E)))
        if extra and key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, extra), value=False)
        H = self.num_heads
        q, k, v = (x.reshape(x.shape[0], N, H, E // H).permute(1, 2, 0, 3) for x in (q, k, v))
        out = self._attend(q, k, v, key_padding_mask, causal, None, None, None, None, False,
                           same and not extra)  # fmt: skip
        out = out.permute(2, 0, 1, 3).reshape(L, N, E)  # [L, N, E]
        out = self.out_proj(_dropout_out(out, self.dropout, self.training))
        if unbatched:
            return out.squeeze(1), None
        return (out.transpose(0, 1) if self.batch_first else out), None
