"""RandomFeatures (a weight matrix plus a component function) and PPSBN."""

from __future__ import annotations

import inspect
import itertools

import torch
from torch import nn

from rfattn.features import (
    ALL_FEATURES,
    compute_dtype,
    make_feature_map,
    prescale,
    python_scalar,
)
from rfattn.features.exponential import GERF_A_MAX
from rfattn.hybrid import check_local
from rfattn.stats import gerf_real_constants
from rfattn.weights import (
    LEARNABLE_WEIGHTS,
    WEIGHTED_WEIGHTS,
    check_weights_name,
    draw_weighted,
)

__all__ = ["RandomFeatures", "PPSBN", "ppSBN"]

#: one number per draw of W (construction or redraw), process-wide: ``RandomFeatures.draw_id``
_DRAW_IDS = itertools.count()


def _normal_tensors():
    """Where a module's kept tensors are made after construction (head maps, a learnt W or A):
    normal tensors even when the call runs under ``torch.inference_mode()``, where an inference
    tensor would be one for good (no backward through it, no in-place update outside)."""
    return torch.inference_mode(False)


class RandomFeatures(nn.Module):
    """A random-feature map: weight matrix ``W [M, D]`` (rows omega_i) and a component function.

    Args:
        head_dim: D, the query/key head dimension.
        num_features: M, the number of rows of W.
        feature: component function name (``rfattn.features.ALL_FEATURES``).
        weights: weight-matrix name (``rfattn.weights.ALL_WEIGHTS``).
        seed: seed of the module's generator; the same seed gives the same W on any device and
            dtype. ``None`` draws a nondeterministic seed.
        head_maps: ``(query heads, key heads)`` to give the module learnable per-head linear maps
            of q and k (:meth:`add_head_maps`; what :func:`rfattn.calibrate` trains), or None.
        window, sinks: exact sinks and a sliding window inside the features
            (:mod:`rfattn.hybrid`) for every :func:`rfattn.rf_attention` call with this module
            that does not give its own (default 0: none).
        **feature_options: options of the component function (validated by it).

    ``weight`` is a buffer (saved in ``state_dict``, moved by ``.to``), fp32 by default. For
    ``weights="fastfoodl"`` it is instead rebuilt on every access from the learnable S, G, B of
    the submodule ``learner`` (:class:`rfattn.weights.FastFoodL`), so gradients reach them.
    ``component_weight`` ``[M]`` is a buffer of per-row weights c with mean 1: a kernel estimate
    is ``(1/M) sum_r c_r phi_r(q) phi_r(k)``. It is all ones except for ``sgq``, where it is M
    times the signed quadrature weights (negative centre weight for D >= 4), so a feature map
    must apply it signed, e.g. multiply the key features by c (not sqrt(c) on both sides).
    Methods take ``scale`` (default ``D ** -0.5``) and work on ``sqrt(scale) * q`` and
    ``sqrt(scale) * k``, so ``exp(scale * q . k)`` is the softmax kernel approximated.
    """

    component_weight: torch.Tensor
    #: bumped whenever what the fused path keeps for this module (its kernel forms,
    #: ``rfattn.fused``) may be stale without a tensor's version saying so: a redraw, a state
    #: dict loaded, a move or cast (``.to``, ``.cuda``, ``.double``), a train/eval switch, W or
    #: GERF's A made learnable, head maps added. (In-place changes of its tensors, such as an
    #: optimiser step, are seen by their version counters.)
    revision: int = 0

    def __init__(
        self,
        head_dim: int,
        num_features: int,
        feature: str = "posrf",
        weights: str = "orf",
        seed: int | None = 0,
        head_maps: tuple[int, int] | None = None,
        window: int = 0,
        sinks: int = 0,
        **feature_options,
    ) -> None:
        super().__init__()
        head_dim, num_features, seed = map(python_scalar, (head_dim, num_features, seed))
        check_local(window, sinks)
        #: the hybrid's exact part (:mod:`rfattn.hybrid`) that ``rf_attention`` takes by default
        self.window, self.sinks = window, sinks
        for name, val in (("head_dim", head_dim), ("num_features", num_features)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if not isinstance(feature, str):
            raise TypeError(f"feature must be a str among {list(ALL_FEATURES)}, got {feature!r}")
        if not isinstance(weights, str):
            raise TypeError(f"weights must be a str, got {weights!r}")
        check_weights_name(weights)
        self.revision = 0
        self.head_dim = head_dim
        self.num_features = num_features
        self.feature = feature
        self.weights = weights
        self.feature_map = make_feature_map(
            feature, weights, num_features, head_dim, related=_OWN_ARGS, **feature_options
        )
        self._generator = torch.Generator(device="cpu")
        if weights in LEARNABLE_WEIGHTS:
            self.learner = LEARNABLE_WEIGHTS[weights](
                num_features, head_dim, generator=self._generator
            )
        else:
            self.learner = None
            self.register_buffer("weight", torch.empty(num_features, head_dim))
        self.register_buffer("component_weight", torch.ones(num_features))
        self.redraw(seed if seed is not None else self._generator.seed())
        self.register_parameter("query_map", None)
        self.register_parameter("key_map", None)
        self.register_parameter("gerf_A", None)
        if head_maps is not None:
            if not isinstance(head_maps, (tuple, list)) or len(head_maps) != 2:
                raise ValueError(f"head_maps must be (query heads, key heads), got {head_maps!r}")
            self.add_head_maps(*head_maps)

    def add_head_maps(self, heads: int, kv_heads: int | None = None) -> None:
        """Give the module learnable per-head linear maps of q and k, ``query_map`` ``[heads, D,
        D]`` and ``key_map`` ``[kv_heads, D, D]`` (default ``heads``), at the identity: features
        are then taken of ``q A_h^T`` and ``k B_h^T`` (so they start as today's estimator).
        Calls with another number of heads raise. A no-op when the maps exist with these
        shapes."""
        kv_heads = heads if kv_heads is None else kv_heads
        for name, val in (("heads", heads), ("kv_heads", kv_heads)):
            val = python_scalar(val)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be an int >= 1, got {val!r}")
        if heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must divide heads={heads}")
        like = self.weight
        for name, h in (("query_map", heads), ("key_map", kv_heads)):
            old = getattr(self, name)
            if old is not None:
                if old.shape[0] != h:
                    raise ValueError(f"{name} exists with {old.shape[0]} heads, not {h}")
                continue
            with _normal_tensors():
                eye = torch.eye(self.head_dim, device=like.device, dtype=torch.float32)
                setattr(self, name, nn.Parameter(eye.expand(h, -1, -1).clone()))
            self.revision += 1

    @property
    def head_maps(self) -> tuple[int, int] | None:
        """``(query heads, key heads)`` of the maps, or None without them."""
        if self.query_map is None:
            return None
        return self.query_map.shape[0], self.key_map.shape[0]

    def learn_gerf_A(self, kv_heads: int) -> nn.Parameter:
        """Make GERF's A a learnable parameter ``gerf_A`` ``[kv_heads]``, one per key/value head
        (shared by the queries and keys of a head, as A must be), starting from the feature's A;
        what :func:`rfattn.calibrate`'s ``params="A"`` trains. Calls then use the head's A,
        capped at :data:`GERF_A_MAX` (the variance is finite only below 1/8). Only for
        ``feature="gerf"`` with a real A and ``s=1`` (real positive features). Fused kernels take
        it as a constant: a call that needs its gradient runs the torch path."""
        fm = self.feature_map
        if self.feature != "gerf" or fm.complex_form:
            raise ValueError(
                "learn_gerf_A needs feature='gerf' with a real A and s=1, this module has "
                f"feature={self.feature!r}" + (" (complex form)" if self.feature == "gerf" else "")
            )
        kv_heads = python_scalar(kv_heads)
        if not isinstance(kv_heads, int) or isinstance(kv_heads, bool) or kv_heads < 1:
            raise ValueError(f"kv_heads must be an int >= 1, got {kv_heads!r}")
        if self.gerf_A is not None:
            if self.gerf_A.shape[0] != kv_heads:
                raise ValueError(f"gerf_A exists with {self.gerf_A.shape[0]} heads, not {kv_heads}")
            return self.gerf_A
        w = self.weight
        with _normal_tensors():
            a = torch.full((kv_heads,), fm.A.real, dtype=w.dtype, device=w.device)
            self.gerf_A = nn.Parameter(a)
        self.revision += 1
        return self.gerf_A

    def map_tensors(self, q: torch.Tensor, k: torch.Tensor):
        """``(query_map, key_map)`` for a call on q ``[B, H, Tq, D]``, k ``[B, Hk, Tk, D]``: the
        maps of :meth:`add_head_maps` in the compute dtype on q's device (differentiable), or
        None without them. Raises when the calls' heads are not the maps' (or a learnable GERF
        A's)."""
        if self.gerf_A is not None and k.shape[1] != self.gerf_A.shape[0]:
            raise ValueError(
                f"k has {k.shape[1]} heads, but this RandomFeatures' gerf_A was made for "
                f"{self.gerf_A.shape[0]}"
            )
        if self.query_map is None:
            return None
        for name, x, m in (("q", q, self.query_map), ("k", k, self.key_map)):
            if x.shape[1] != m.shape[0]:
                raise ValueError(
                    f"{name} has {x.shape[1]} heads, but this RandomFeatures' head maps were "
                    f"made for {m.shape[0]} (head_maps={self.head_maps})"
                )
        dt = compute_dtype(q.dtype)
        return self.query_map.to(q.device, dt), self.key_map.to(q.device, dt)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a checkpoint with head maps loads into a module built without them (a calibrated
        # model's features rebuilt from their options): make them first
        q, k = state_dict.get(prefix + "query_map"), state_dict.get(prefix + "key_map")
        if self.query_map is None and q is not None and k is not None:
            self.add_head_maps(q.shape[0], k.shape[0])
        a = state_dict.get(prefix + "gerf_A")
        if self.gerf_A is None and a is not None:
            self.learn_gerf_A(a.shape[0])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self.revision += 1

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .double(), ...: new tensors
        out = super()._apply(fn, recurse)
        self.revision += 1
        return out

    def train(self, mode: bool = True):
        out = super().train(mode)
        self.revision += 1
        return out

    def extra_repr(self) -> str:
        return (
            f"head_dim={self.head_dim}, num_features={self.num_features}, "
            f"feature={self.feature!r}, weights={self.weights!r}"
            + ("" if self.head_maps is None else f", head_maps={self.head_maps}")
            + (f", window={self.window}, sinks={self.sinks}" if self.window or self.sinks else "")
        )

    @torch.no_grad()
    def redraw(self, seed: int | None = None) -> None:
        """Draw a new W in place (device and dtype kept).

        Args:
            seed: reseed the generator first (same seed, same W); ``None`` continues the
                module's generator stream (deterministic given the construction seed).
        """
        if seed is not None:
            seed = python_scalar(seed)
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise TypeError(f"seed must be an int or None, got {seed!r}")
            self._generator.manual_seed(seed)
        # which draw this is: a causal state is only continued by the draw that made it
        self.draw_id = next(_DRAW_IDS)
        self.revision += 1
        # the component function's own draws (hrf's lambda projections, rmf's degrees), if any
        self.feature_map.redraw(self._generator)
        if self.learner is not None:
            self.learner.reset_parameters(self._generator)
            return
        w, c = draw_weighted(
            self.weights,
            self.num_features,
            self.head_dim,
            generator=self._generator,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        self.weight.copy_(w)
        self.component_weight.copy_(c)

    @property
    def weight(self) -> torch.Tensor:
        """W ``[M, D]``: the buffer, or for ``fastfoodl`` the matrix rebuilt from S, G, B."""
        if self.learner is not None:
            return self.learner()
        if "weight" in self._parameters:  # made learnable (learn_weight)
            return self._parameters["weight"]
        if "weight" not in self._buffers:
            # AttributeError, not KeyError: register_buffer's hasattr check must see "absent".
            raise AttributeError("weight")
        return self._buffers["weight"]

    def learn_weight(self) -> nn.Parameter:
        """Make W a learnable parameter (starting from its draw; ``state_dict`` key unchanged),
        what :func:`rfattn.calibrate`'s ``params="projection"`` trains. ``fastfoodl`` weights
        are learnable already (their S, G, B): this raises for them."""
        if self.learner is not None:
            raise ValueError("weights='fastfoodl' learns its S, G, B; W itself is derived")
        if "weight" not in self._parameters:
            w = self._buffers.pop("weight")
            with _normal_tensors():
                self.register_parameter("weight", nn.Parameter(w.detach().clone()))
            self.revision += 1
        return self._parameters["weight"]

    @property
    def num_outputs(self) -> int:
        """F, the feature width."""
        return self.feature_map.width(self.num_features)

    def _check(self, q: torch.Tensor, k: torch.Tensor, key_padding_mask=None) -> None:
        for name, x in (("q", q), ("k", k)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"{name} must be a tensor [B, H, T, D]")
            if not x.dtype.is_floating_point:
                raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")
            if x.shape[-1] != self.head_dim:
                raise ValueError(
                    f"{name} has head_dim {x.shape[-1]}, but this RandomFeatures was built "
                    f"for head_dim={self.head_dim}"
                )
        if k.shape[:2] != q.shape[:2]:
            raise ValueError(f"k has batch/heads {tuple(k.shape[:2])}, q {tuple(q.shape[:2])}")
        if k.dtype != q.dtype or k.device != q.device:
            raise TypeError(f"k ({k.dtype}, {k.device}) must match q ({q.dtype}, {q.device})")
        if key_padding_mask is not None and (
            not isinstance(key_padding_mask, torch.Tensor)
            or key_padding_mask.dtype != torch.bool
            or tuple(key_padding_mask.shape) != (k.shape[0], k.shape[2])
        ):
            raise ValueError(
                f"key_padding_mask must be a bool tensor [B, Tk] = {(k.shape[0], k.shape[2])}"
            )

    def _inputs(self, q, k, scale, key_padding_mask=None):
        scale = self.head_dim**-0.5 if scale is None else float(scale)
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        w = self.weight.to(device=q.device, dtype=compute_dtype(q.dtype))
        return prescale(q, scale), prescale(k, scale, key_padding_mask), w

    def feature_params(
        self, xq: torch.Tensor, xk: torch.Tensor, key_padding_mask=None, **options
    ) -> dict:
        """The feature map's per-call parameters (:meth:`FeatureMap.params` on pre-scaled
        inputs; ``options``: its keyword arguments, ``causal``, ``update``, ``moments``,
        ``query_padding_mask``) plus this module's ``component_weight`` where the weights carry
        one (sgq)."""
        params = dict(self.feature_map.params(xq, xk, key_padding_mask, **options))
        if self.weights in WEIGHTED_WEIGHTS:
            params["component_weight"] = self.component_weight.to(xq.device, xq.dtype)
        if self.gerf_A is not None:  # per key/value head, [1, Hk, 1, 1] (differentiable)
            a = self.gerf_A.to(xq.device, xq.dtype).clamp(max=GERF_A_MAX)[None, :, None, None]
            b, log_d = gerf_real_constants(a, xq.shape[-1])
            params.update(A=a, B=b, log_D=log_d)
        return params

    def features(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        *,
        scale: float | None = None,
        query_padding_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reference feature maps with the stabilisers of docs/numerics.md.

        Args:
            q: ``[B, H, Tq, D]``; k: ``[B, H, Tk, D]``.
            key_padding_mask: ``[B, Tk]`` bool, True = padding (those keys get phi = 0).
            scale: softmax temperature (default ``D ** -0.5``).
            query_padding_mask: ``[B, Tq]`` bool, True = queries left out of the statistics.

        Returns:
            ``(phi_q [B, H, Tq, F], phi_k [B, H, Tk, F])`` in fp32 (fp64 for fp64 inputs).
        """
        self._check(q, k, key_padding_mask)
        xq, xk, w = self._inputs(q, k, scale, key_padding_mask)
        params = self.feature_params(
            xq, xk, key_padding_mask, query_padding_mask=query_padding_mask
        )
        return self.feature_map.features(xq, xk, w, key_padding_mask, params)

    def estimate_kernel(self, q: torch.Tensor, k: torch.Tensor, *, scale=None) -> torch.Tensor:
        """The unbiased random-feature estimate of :meth:`target_kernel`, ``[B, H, Tq, Tk]``."""
        self._check(q, k)
        xq, xk, w = self._inputs(q, k, scale)
        params = self.feature_params(xq, xk, update=False)
        return self.feature_map.estimate_kernel(xq, xk, w, params)

    def target_kernel(self, q: torch.Tensor, k: torch.Tensor, *, scale=None) -> torch.Tensor:
        """The exact kernel estimated, e.g. ``exp(scale * q . k)`` for posrf, ``[B, H, Tq, Tk]``."""
        self._check(q, k)
        xq, xk, _ = self._inputs(q, k, scale)
        return self.feature_map.target_kernel(xq, xk)


#: RandomFeatures' own argument names (the nearest-name hint for a misspelled feature option)
_OWN_ARGS = tuple(inspect.signature(RandomFeatures.__init__).parameters)[1:-1]


class PPSBN(nn.Module):
    """Macformer's pre-post scaling normalisation around random-feature attention
    (Algorithm 1; ``macformer-hrf.md`` A.4, resolutions C.9-C.13), usable with any feature map.

    * pre (queries and keys, per token over the head dim, as the authors' code does):
      ``x <- (x - mean(x)) / max(|x - mean(x)|, tiny)``. Algorithm 1's division by
      ``sqrt(var + eps)`` is a positive per-row factor that the unit normalisation removes, so it
      is folded away; the ``tiny`` guard turns a constant row into 0 (the code gives NaN). Rows land
      on the unit sphere, so with the default ``scale = D ** -0.5`` the dot product fed to the
      kernel satisfies ``|t| <= D ** -0.5 < 1``: inside the domains of rmf's inverse/log/sqrt.
    * attention: :func:`rfattn.rf_attention` on the normalised q, k and the raw v.
    * post: ``gamma * att`` with a learnable per-channel ``gamma`` ``[E]`` (init 1), or with
      ``power="signed"`` ``sign(y) |y|^beta`` of ``y = gamma * att`` with learnable ``beta``
      ``[E]`` (init 1; the paper's ``(gamma att)^beta`` is NaN for negative att).

    Args:
        value_dim: E, the value head dimension.
        power: "none" (default, the authors' code) or "signed".

    ``forward(q, k, v, rf, **kwargs)`` takes ``rf_attention``'s arguments; with
    ``return_state=True`` it returns ``(post(out), state)``.
    """

    def __init__(self, value_dim: int, power: str = "none") -> None:
        super().__init__()
        value_dim = python_scalar(value_dim)
        if not isinstance(value_dim, int) or isinstance(value_dim, bool) or value_dim < 1:
            raise ValueError(f"value_dim must be an int >= 1, got {value_dim!r}")
        if power not in ("none", "signed"):
            raise ValueError(f"power must be 'none' or 'signed', got {power!r}")
        self.power = power
        self.gamma = nn.Parameter(torch.ones(value_dim))
        self.beta = nn.Parameter(torch.ones(value_dim)) if power == "signed" else None

    @staticmethod
    def pre(x: torch.Tensor) -> torch.Tensor:
        """Centre each row over the last dim and scale it to unit L2 norm (0 for a constant row)."""
        c = x - x.mean(dim=-1, keepdim=True)
        norm = c.norm(dim=-1, keepdim=True)
        return c / norm.clamp_min(torch.finfo(c.dtype).tiny)

    def post(self, att: torch.Tensor) -> torch.Tensor:
        """``gamma * att`` or its signed power, over the last dim ``[..., E]``."""
        y = self.gamma.to(att.dtype) * att
        if self.beta is None:
            return y
        return torch.sign(y) * y.abs().pow(self.beta.to(att.dtype))

    def forward(self, q, k, v, rf, **kwargs):
        from rfattn.attention import rf_attention

        out = rf_attention(self.pre(q), self.pre(k), v, rf, **kwargs)
        if isinstance(out, tuple):
            return self.post(out[0]), out[1]
        return self.post(out)


#: the paper's spelling
ppSBN = PPSBN
