"""The :class:`FeatureMap` interface and the stabilisers shared by every component function.

A feature map turns pre-scaled queries/keys ``x = sqrt(scale) * q`` ``[B, H, T, D]`` and the
weight matrix ``W [M, D]`` into features ``[B, H, T, F]`` whose inner products estimate a kernel.
Spec: ``spectraformer.md`` §1.8 and §2, ``crt-flt.md`` part A, ``macformer-hrf.md``.

Every feature is one of three forms (the attributes ``exponential`` and ``positive`` say which):

* positive exponential (posrf, hyprf, oprf, saderf, real gerf): ``phi = exp(u)``;
* signed exponential (trigrf, complex gerf, poisrf, geomrf, hrf): ``phi = g * exp(u)`` with a
  bounded signed *amplitude* ``g`` (cos/sin values, sign parities, ±1 block signs);
* plain (rmf): ``phi`` directly (products of projections; ``exponential = False``).

Exponential features are stabilised through their logits ``u`` with the offsets of docs/numerics.md,
applied identically by the torch path, the references and the kernels:

* non-causal keys: one offset ``c_f`` per (b, h, feature), the max of ``u`` over the valid keys
  (:func:`key_offset`), added to the query logits so that each product ``phi_q,f phi_k,f`` is
  unchanged; then queries per row, the max over features (:func:`query_features`). Every row's
  largest term is then exactly 1 (docs/numerics.md has one key offset per (b, h); at large norms the
  logits of oprf/saderf spread by hundreds across features and whole rows underflowed, so the
  non-causal offsets became per feature);
* causal keys (the torch path's scan, ``rfattn.attention``): one running offset per (b, h), the
  max over valid keys and features so far, per query row as in docs/numerics.md.

A per-key max would re-weight keys and bias the kernel; a max across the batch would couple batch
elements. Padded keys get ``phi = 0``; a (b, h) with no valid key gets offset 0.

The amplitude never enters the offsets, so the stabilised ``phi`` is ``g * exp(u - offset)``.

Parameters beyond ``W``: :meth:`FeatureMap.params` returns a dict of everything else a feature
needs for one call: data statistics turned into per-(b, h) parameters (oprf's A, saderf's psi,
...; see :mod:`rfattn.stats`) and the module's extra random draws (hrf's lambda projections,
rmf's degrees and later-stage projections). Every maths method takes that dict, so a caller (the
torch path, a kernel launcher, a test vectorising redraws over the batch axis) can compute it
once and pass it on. ``W`` may carry leading batch dimensions ``[..., M, D]`` that broadcast
against ``x``; tests use that to vectorise redraws.
"""

from __future__ import annotations

import math

import numpy
import torch
from torch import nn

from rfattn import workspace
from rfattn.features.form import KernelForm
from rfattn.stats import (
    STATS_MODES,
    Moments,
    register_running,
    running_moments,
    sequence_moments,
    update_running,
)

try:  # torch >= 2.8 (Dynamo traces it without a graph break from then on)
    from torch.fx.experimental.symbolic_shapes import has_static_value as _has_static_value
except ImportError:
    _has_static_value = None

__all__ = [
    "FeatureMap",
    "StatsFeature",
    "check_choice",
    "check_number",
    "python_scalar",
    "symbolic",
    "query_features",
    "component_weights",
    "key_offset",
    "key_features",
    "compute_dtype",
    "prescale",
    "project",
    "row_sq_norms",
    "sq_norm",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Features, S and z accumulate in fp32, or fp64 for fp64 inputs (docs/numerics.md)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def prescale(
    x: torch.Tensor,
    scale: float,
    padding_mask: torch.Tensor | None = None,
    head_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sqrt(scale) * x`` in the compute dtype: ``exp(x_q . x_k) = exp(scale * q . k)``.

    ``padding_mask`` (``[B, T]`` bool, True = padding): padded rows become 0, so junk there
    (NaN, inf) reaches no feature and no gradient (its features are masked out later anyway).
    ``head_map`` ``[H, D, D]`` (a :class:`rfattn.RandomFeatures`' calibrated head maps, in the
    compute dtype): each head's rows then become ``sqrt(scale) x A_h^T``; the map is applied after
    the mask, so junk in padded rows never reaches it or its gradient."""
    x = x.to(compute_dtype(x.dtype)) * math.sqrt(scale)
    if padding_mask is not None:
        x = x.masked_fill(padding_mask[:, None, :, None], 0.0)
    if head_map is not None:
        x = x @ head_map.transpose(-1, -2)
    return x


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x W^T``: ``[..., T, D] x [..., M, D] -> [..., T, M]`` (leading dims of W broadcast).
    Inside the torch path's blocked forwards and backwards the product goes to a kept buffer
    (:mod:`rfattn.workspace`); where autograd records it there, through :class:`_KeptProduct`."""
    wt = w.transpose(-1, -2).to(x.dtype)
    if torch.is_grad_enabled() and workspace.keeps(x.device):
        return _KeptProduct.apply(x, wt)
    return workspace.product(x, wt, "project")


class _KeptProduct(torch.autograd.Function):
    """``x @ wt`` written to a kept buffer while autograd records it (the blocked backward's
    projections: without it each block's ``[T, M]`` product is a new allocation, and glibc hands
    those back to the kernel and faults them in again, block after block). Its gradients are
    the product's: ``dx = g wt^T``, ``dwt = x^T g``, summed over broadcast dims."""

    @staticmethod
    def forward(ctx, x, wt):
        ctx.save_for_backward(x, wt)
        return workspace.product(x, wt, "project")

    @staticmethod
    def backward(ctx, g):
        x, wt = ctx.saved_tensors
        dx = dwt = None
        if ctx.needs_input_grad[0]:
            dx = (g @ wt.transpose(-1, -2)).sum_to_size(x.shape)
        if ctx.needs_input_grad[1]:
            if wt.dim() == 2:
                dwt = x.reshape(-1, x.shape[-1]).transpose(0, 1) @ g.reshape(-1, g.shape[-1])
            else:
                dwt = (x.transpose(-1, -2) @ g).sum_to_size(wt.shape)
        return dx, dwt


def row_sq_norms(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``|omega_f|^2`` shaped ``[..., 1, M]`` to broadcast against ``[..., T, M]`` logits."""
    w = w.to(dtype)
    return (w * w).sum(dim=-1).unsqueeze(-2)


def sq_norm(x: torch.Tensor) -> torch.Tensor:
    """``|x|^2`` per row, ``[..., T, 1]``."""
    return (x * x).sum(dim=-1, keepdim=True)


#: log2(e): ``exp(x) = exp2(x * LOG2E)``
LOG2E = math.log2(math.e)


def exp_diff(u: torch.Tensor, shift: torch.Tensor, out: torch.Tensor | None = None):
    """``exp(u - shift)`` as ``exp2((u - shift) log2 e)``; ``shift`` broadcasts against ``u``.

    torch's CPU ``exp`` (MKL's vector exp) takes a slow path for every element whose result
    underflows: 10x to 37x the time of a normal one on this project's 2-core CPU
    (``bench.cpu_backend``'s ``exp_paths``), and a logit far below its row's max, a key of large
    norm or a masked -inf is just that; ``exp2`` has no such path and is faster besides, so the
    extra multiply pays for itself. The difference is formed first (exact where ``u`` and
    ``shift`` are close: logits near -1000 keep their small differences), then scaled: one more
    rounding of the argument, about 1e-6 relative in float32 for arguments of magnitude 10.

    ``out`` None: a new tensor (autograd records it). Otherwise the result is written there
    (``u`` itself: in place; no autograd), without further temporaries.
    """
    if out is None:
        return torch.exp2((u - shift) * LOG2E)
    return torch.sub(u, shift, out=out).mul_(LOG2E).exp2_()


def query_features(
    u_q: torch.Tensor,
    g_q: torch.Tensor | None = None,
    key_offsets: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stabilised query features ``g * exp(u + c - max_f (u + c))`` (per-row max, exact in the
    ratio). ``key_offsets`` ``c`` ``[B, H, F]`` (None = 0): the per-feature key offsets of
    :func:`key_offset`, moved to the query side so that the pair products stay exact. ``out``
    (no autograd): a tensor of the caller's own (``u_q`` itself: in place) that receives them,
    with no further temporaries (:func:`exp_diff`)."""
    if key_offsets is not None:
        u_q = torch.add(u_q, key_offsets[:, :, None, :], out=out)
    phi = exp_diff(u_q, u_q.amax(dim=-1, keepdim=True).detach(), out)
    if g_q is None:
        return phi
    return g_q * phi if out is None else phi.mul_(g_q)


def component_weights(params: dict | None, width: int) -> torch.Tensor | None:
    """The owner's per-row weights c ``[M]`` (``params["component_weight"]``, e.g. sgq's scaled
    quadrature weights) tiled over the ``width // M`` component blocks of the F features
    (component-major order, docs/design.md), or None when the owner gave none (all ones).

    They multiply the key features only, sign included (sgq's centre weight is negative), so an
    estimate is ``(1/M) sum_f c_f phi_q,f phi_k,f``.
    """
    c = None if not params else params.get("component_weight")
    if c is None:
        return None
    return c.repeat(width // c.shape[-1])


def key_offset(
    u_k: torch.Tensor, key_padding_mask: torch.Tensor | None = None, reduce=None
) -> torch.Tensor:
    """The non-causal key stabilisers: per feature, the max of ``u_k`` over the valid keys.

    One offset per (b, h, feature), compensated on the query side (:func:`query_features`), so
    the largest product ``exp(u_q,if + u_k,jf)`` of every query row is computed without underflow
    whatever the spread of the logits across features and keys (a single offset per (b, h) let
    oprf/saderf rows at large norms underflow to 0).

    Args:
        u_k: key logits ``[B, H, T, F]``.
        key_padding_mask: ``[B, T]`` bool, True = padding.
        reduce: for keys sharded over processes (``rfattn.distributed``), the in-place max of
            the local offsets (-inf where a shard has no valid key) across them.

    Returns:
        ``[B, H, F]`` offsets (detached: they cancel exactly); 0 where a (b, h) has no valid key.
    """
    if key_padding_mask is not None:
        u_k = u_k.masked_fill(key_padding_mask[:, None, :, None], float("-inf"))
    if u_k.shape[-2] == 0:
        off = u_k.new_full((*u_k.shape[:2], u_k.shape[-1]), float("-inf"))
    else:
        off = u_k.detach().amax(dim=-2)
    if reduce is not None:
        reduce(off)
    return torch.where(off == float("-inf"), torch.zeros_like(off), off)


def key_features(
    u_k: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    g_k: torch.Tensor | None = None,
    key_offsets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stabilised key features ``g * exp(u - c_f)``, zero for padded keys; ``key_offsets`` ``c``
    ``[B, H, F]`` default to :func:`key_offset` (give the same to :func:`query_features`)."""
    off = key_offset(u_k, key_padding_mask) if key_offsets is None else key_offsets
    phi = exp_diff(u_k, off[:, :, None, :])
    if g_k is not None:
        phi = g_k * phi
    if key_padding_mask is not None:
        phi = phi.masked_fill(key_padding_mask[:, None, :, None], 0.0)
    return phi


class FeatureMap(nn.Module):
    """One component function. Subclasses define the maths; this class the plumbing.

    A feature map is an ``nn.Module`` held by :class:`rfattn.RandomFeatures` as ``feature_map``:
    its buffers (extra random draws, running statistics) are saved in the owner's
    ``state_dict`` and moved by ``.to``. Inputs ``x`` are already pre-scaled by
    ``sqrt(scale)`` and in the compute dtype (fp32, or fp64 for fp64 inputs).

    Subclass contract:

    * exponential features implement :meth:`logits` (and :meth:`amplitude` when signed);
      plain ones (``exponential = False``) implement :meth:`values`;
    * features with data statistics or extra draws override :meth:`params` / :meth:`draw`;
    * :meth:`num_samples` is the divisor that makes ``sum_f phi_q phi_k`` (offsets undone) an
      unbiased estimate of :meth:`target_kernel`.

    Args:
        num_rows: M, the rows of W (None where the feature does not need it at construction).
        head_dim: D (likewise).
        **options: feature options; a feature without options rejects any.
    """

    #: registry name
    name: str = ""
    #: F / M: how many features each row of W yields (see :meth:`width` where it is not fixed)
    width_factor: int = 1
    #: True when every feature is > 0 (the denominator cannot vanish)
    positive: bool = True
    #: True when phi = g * exp(logits) (stabilised by offsets); False: phi = values(...)
    exponential: bool = True
    #: whether :meth:`kernel_form` is implemented: the fused kernels can run this feature (set
    #: for each subclass)
    has_kernel_form: bool = False
    #: names of the extra-draw buffers (set by :meth:`_register_draws`)
    _draw_names: tuple[str, ...] = ()

    def __init__(self, num_rows: int | None = None, head_dim: int | None = None, **options):
        super().__init__()
        if options:
            raise ValueError(f"feature={self.name!r} takes no options, got {sorted(options)}")
        self.num_rows = num_rows
        self.head_dim = head_dim

    def extra_repr(self) -> str:
        return f"name={self.name!r}"

    # ---- random draws beyond W -------------------------------------------------------------

    def draw(
        self, generator: torch.Generator, batch_shape: tuple[int, ...] = ()
    ) -> dict[str, torch.Tensor]:
        """Extra random tensors this feature needs besides W, drawn on the CPU in float64.

        Args:
            generator: the owner's CPU generator (drawn after W, so a seed fixes both).
            batch_shape: leading dims (tests draw many independent copies at once).

        Returns:
            name -> tensor; :meth:`redraw` copies them into buffers of the same names.
        """
        return {}

    def _register_draws(self) -> None:
        """Register zero buffers shaped like :meth:`draw`'s output (filled by :meth:`redraw`)."""
        draws = self.draw(torch.Generator().manual_seed(0))
        self._draw_names = tuple(draws)
        for key, val in draws.items():
            dtype = torch.get_default_dtype() if val.is_floating_point() else val.dtype
            self.register_buffer(key, torch.zeros_like(val, dtype=dtype))

    @torch.no_grad()
    def redraw(self, generator: torch.Generator) -> None:
        """Refill the extra-draw buffers in place (device and dtype kept)."""
        for key, val in self.draw(generator).items():
            getattr(self, key).copy_(val)

    def drawn(self) -> dict[str, torch.Tensor]:
        """The current extra-draw buffers, by name."""
        drawn = {}
        for key in self._draw_names:
            drawn[key] = getattr(self, key)
        return drawn

    # ---- per-call parameters ----------------------------------------------------------------

    def params(
        self,
        xq: torch.Tensor,
        xk: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        causal: bool = False,
        update: bool = True,
        moments: Moments | None = None,
        query_padding_mask: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """Everything beyond (x, W) one call needs: statistics-derived parameters and draws.

        Args:
            xq: pre-scaled queries ``[B, H, Tq, D]``; xk: keys ``[B, H, Tk, D]``.
            key_padding_mask: ``[B, Tk]`` bool, True = padding (excluded from statistics).
            query_padding_mask: ``[B, Tq]`` bool, True = padded queries (excluded likewise).
            causal: the call is causal (global statistics would leak the future: they raise).
            update: allow a running-statistics update (training mode only).
            moments: this call's per-(b, h) moments when the caller has them (see
                :meth:`StatsFeature.moments`); ignored by features without statistics.

        Returns:
            name -> tensor; per-(b, h) values are shaped ``[B, H, ...]``.
        """
        return self.drawn()

    # ---- the maths ----------------------------------------------------------------------------

    def width(self, num_rows: int) -> int:
        """F, the feature width for M = ``num_rows``."""
        return self.width_factor * num_rows

    def logits(
        self, x: torch.Tensor, w: torch.Tensor, side: str, params: dict | None = None
    ) -> torch.Tensor:
        """``u`` ``[B, H, T, F]`` with ``phi = g * exp(u)``; ``side`` is "query" or "key"."""
        raise NotImplementedError(f"feature={self.name!r} is not exponential")

    def logit_parts(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        side: str,
        params: dict | None = None,
        row: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(u0, r)`` with :meth:`logits` ``= u0 + r`` and ``r`` ``[B, H, T, 1]`` a per-row term
        (None: none split off). A per-row term cancels in a query's features and only moves a
        key's offset, so the torch path's blocks skip the ``[T, F]`` pass that adds it.
        ``row=False``: the caller has no use for ``r`` (a query's); it is not computed and None
        is returned in its place (``u0`` unchanged)."""
        return self.logits(x, w, side, params), None

    def amplitude(
        self, x: torch.Tensor, w: torch.Tensor, side: str, params: dict | None = None
    ) -> torch.Tensor | None:
        """The bounded signed factor ``g`` ``[B, H, T, F]`` of a signed feature, None when 1."""
        return None

    def values(
        self, x: torch.Tensor, w: torch.Tensor, side: str, params: dict | None = None
    ) -> torch.Tensor:
        """``phi`` ``[B, H, T, F]`` of a plain (non-exponential) feature."""
        raise NotImplementedError(f"feature={self.name!r} is exponential: use logits")

    def key_amplitude(
        self, x: torch.Tensor, w: torch.Tensor, params: dict | None = None
    ) -> torch.Tensor | None:
        """The key side's amplitude with the owner's component weights folded in (None = 1)."""
        g = self.amplitude(x, w, "key", params) if self.exponential else None
        if not params or params.get("component_weight") is None:
            return g
        c = component_weights(params, self.width(w.shape[-2]))
        c = c.to(device=x.device, dtype=x.dtype).expand(*x.shape[:-1], c.shape[-1])
        return c if g is None else g * c

    def kernel_form(self, w: torch.Tensor, params: dict | None = None) -> KernelForm:
        """This feature as the fused kernels compute it (:class:`rfattn.features.form.KernelForm`):
        the same ``phi`` as :meth:`logits`/:meth:`amplitude` or :meth:`values`, with the same key
        offsets (tests hold each form to its feature map).

        Args:
            w: ``[M, D]`` the weight matrix (gradients reach it through the form's ``w``).
            params: :meth:`params`' dict for the call (plus the owner's ``component_weight``).

        Raises:
            NotImplementedError: the feature has no kernel form (see :attr:`has_kernel_form`).
        """
        raise NotImplementedError(f"feature={self.name!r} has no fused kernel form")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.has_kernel_form = cls.kernel_form is not FeatureMap.kernel_form

    def num_samples(self, w: torch.Tensor) -> int:
        """The Monte Carlo sample count the estimate averages over (M by default)."""
        return w.shape[-2]

    def features(
        self,
        xq: torch.Tensor,
        xk: torch.Tensor,
        w: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        params: dict | None = None,
        reduce=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stabilised ``(phi_q, phi_k)``, each ``[B, H, T, F]``; padded keys give 0. Keys sit at
        per-feature offsets (:func:`key_offset`) carried over to the queries: their products,
        not each side alone, are the estimate's terms.

        ``params`` default to :meth:`params` on these inputs (non-causal); ``reduce``: as
        :func:`key_offset`'s (keys sharded over processes).
        """
        if params is None:
            params = self.params(xq, xk, key_padding_mask)
        g_k = self.key_amplitude(xk, w, params)
        if not self.exponential:
            phi_q = self.values(xq, w, "query", params)
            phi_k = self.values(xk, w, "key", params)
            phi_k = phi_k if g_k is None else phi_k * g_k
            if key_padding_mask is not None:
                phi_k = phi_k.masked_fill(key_padding_mask[:, None, :, None], 0.0)
            return phi_q, phi_k
        u_q = self.logits(xq, w, "query", params)
        u_k = self.logits(xk, w, "key", params)
        g_q = self.amplitude(xq, w, "query", params)
        c = key_offset(u_k, key_padding_mask, reduce)
        return query_features(u_q, g_q, c), key_features(u_k, key_padding_mask, g_k, c)

    def estimate_kernel(
        self, xq: torch.Tensor, xk: torch.Tensor, w: torch.Tensor, params: dict | None = None
    ) -> torch.Tensor:
        """The unbiased estimate ``[B, H, Tq, Tk]`` of :meth:`target_kernel` (no offsets)."""
        if params is None:
            params = self.params(xq, xk, update=False)
        g_k = self.key_amplitude(xk, w, params)
        if not self.exponential:
            phi_q = self.values(xq, w, "query", params)
            phi_k = self.values(xk, w, "key", params)
            phi_k = phi_k if g_k is None else phi_k * g_k
            return phi_q @ phi_k.transpose(-1, -2) / self.num_samples(w)
        u_q = self.logits(xq, w, "query", params)
        u_k = self.logits(xk, w, "key", params)
        g_q = self.amplitude(xq, w, "query", params)
        # sum_f g_q g_k exp(u_q + u_k) without overflow: factor out each side's row max.
        m_q = u_q.amax(dim=-1, keepdim=True)
        m_k = u_k.amax(dim=-1, keepdim=True)
        a_q, a_k = torch.exp(u_q - m_q), torch.exp(u_k - m_k)
        a_q = a_q if g_q is None else g_q * a_q
        a_k = a_k if g_k is None else g_k * a_k
        inner = a_q @ a_k.transpose(-1, -2)
        return inner * torch.exp(m_q + m_k.transpose(-1, -2)) / self.num_samples(w)

    def target_kernel(self, xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor:
        """The exact kernel ``[B, H, Tq, Tk]`` this feature map estimates: ``exp(x_q . x_k)``."""
        return torch.exp(xq @ xk.transpose(-1, -2))


def symbolic(n) -> bool:
    """Whether ``n``, a size or a number computed from sizes, is symbolic: a dynamic shape of
    ``torch.compile`` (``dynamic=True``, or a length Dynamo has seen vary) that has no value
    while tracing, so a Python branch or loop on it would specialise it (a guard on its value:
    a recompile per length). False in eager calls and for static shapes. Adds no guard. Dynamo
    shows a symbolic int to ``isinstance`` and ``type`` as an int, so this asks
    ``has_static_value``, which Dynamo reads from torch 2.8 on; before, False: dynamic lengths
    specialise there."""
    if type(n) in (int, float) and not torch.compiler.is_compiling():  # eager: no call
        return False
    return _has_static_value is not None and not _has_static_value(n)


def python_scalar(value):
    """A numpy scalar or a 0-d tensor as the Python bool, int or float it holds (what PyTorch
    users pass for a number: ``np.float32(0.1)``, ``torch.tensor(0.125)``, ``np.int64(64)``);
    anything else unchanged, for the caller's check to name."""
    if isinstance(value, numpy.generic) or (torch.is_tensor(value) and value.dim() == 0):
        return value.item()
    return value


def check_choice(feature: str, option: str, value, choices) -> None:
    """Raise ValueError naming ``option`` when ``value`` is not one of ``choices``."""
    if value not in choices:
        raise ValueError(
            f"feature={feature!r}: option {option}={value!r} is invalid; valid: {list(choices)}"
        )


def check_number(
    feature: str,
    option: str,
    value,
    *,
    integer: bool = False,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """Validate a numeric option (bounds inclusive unless ``*_open``); returns it as float/int
    (numpy scalars and 0-d tensors taken as their value)."""
    value = python_scalar(value)
    kind = "an int" if integer else "a real number"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer:
        ok = ok and float(value).is_integer()
    if ok and not math.isfinite(value):
        ok = False
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo = "" if low is None else f"{'>' if low_open else '>='} {low}"
        hi = "" if high is None else f"{'<' if high_open else '<='} {high}"
        rng = " and ".join(s for s in (lo, hi) if s)
        raise ValueError(
            f"feature={feature!r}: option {option} must be {kind}"
            + (f" {rng}" if rng else "")
            + f", got {value!r}"
        )
    return int(value) if integer else float(value)


class StatsFeature(FeatureMap):
    """Base of the data-dependent features: the ``stats`` options and the moments step.

    Options (validated, each error names the option):
        stats: "global" | "running" | "fixed" | None (None: global non-causal, running causal).
        stats_grad: let gradients flow through the statistics (default False: detached).
        momentum: EMA factor of the running buffers, in (0, 1] (default 0.1).
        the feature's fixed-mode parameters (``fixed_options``): required with
        ``stats="fixed"``, rejected otherwise.

    See :mod:`rfattn.stats` for the modes. Running buffers ``running_{mean,sq,abs,min}``
    ``[2, D]`` and ``num_batches_tracked`` live on this module (so on the owning RandomFeatures).
    """

    #: option names of the parameters given by the user in ``stats="fixed"`` mode
    fixed_options: tuple[str, ...] = ()
    #: fixed options that may be left out (they default to a neutral value)
    optional_fixed: tuple[str, ...] = ()
    #: the closed form the fused stats pass forms the parameters with in its own launch
    #: (``rfattn.kernels.stats``: "oprf", "saderf"), or None: formed in torch from its moments
    kernel_stats: str | None = None

    def _init_stats(self, head_dim, stats, stats_grad, momentum, fixed: dict) -> None:
        check_choice(self.name, "stats", stats, (None, *STATS_MODES))
        if not isinstance(stats_grad, bool):
            raise ValueError(f"feature={self.name!r}: option stats_grad must be a bool")
        self.momentum = check_number(
            self.name, "momentum", momentum, low=0.0, high=1.0, low_open=True
        )
        self.stats = stats
        self.stats_grad = stats_grad
        given = sorted(k for k, v in fixed.items() if v is not None)
        if stats == "fixed":
            missing = [
                k for k in self.fixed_options if k not in given and k not in self.optional_fixed
            ]
            if missing:
                raise ValueError(f"feature={self.name!r}: stats='fixed' needs option(s) {missing}")
        elif given:
            raise ValueError(
                f"feature={self.name!r}: option(s) {given} are only used with stats='fixed', "
                f"got stats={stats!r}"
            )
        if not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError(f"feature={self.name!r} needs head_dim (an int >= 1) for its stats")
        register_running(self, head_dim)

    def extra_repr(self) -> str:
        return f"name={self.name!r}, stats={self.stats!r}"

    def mode(self, causal: bool) -> str:
        """The statistics mode in effect for a (non-)causal call."""
        if self.stats is None:
            return "running" if causal else "global"
        if causal and self.stats == "global":
            raise ValueError(
                f"feature={self.name!r}: stats='global' uses the whole sequence and would leak "
                "future tokens into causal attention; use stats='running' or 'fixed'"
            )
        return self.stats

    def uses_batch_moments(self, causal: bool, update: bool = True) -> bool:
        """Whether a call needs this sequence's moments: global mode, or a running-mode update
        in training (a caller with a faster reduction, the fused stats pass, gives them)."""
        mode = self.mode(causal)
        return mode == "global" or (mode == "running" and update and self.training)

    def moments(
        self,
        xq,
        xk,
        key_padding_mask,
        causal: bool,
        update: bool,
        given: Moments | None = None,
        query_padding_mask=None,
    ) -> Moments | None:
        """The moments this call uses: ``[B, H, 2, D]`` (global), ``[1, 1, 2, D]`` (running),
        or None (fixed). A running-mode call in training updates the buffers afterwards.

        ``given``: this call's detached per-(b, h) moments when the caller reduced them (the
        fused stats pass; see :meth:`uses_batch_moments`); then ``xq``, ``xk`` may be empty
        stand-ins giving only dtype, device and D. Otherwise they are reduced here."""
        mode = self.mode(causal)
        if mode == "fixed":
            return None
        if given is None or (mode == "global" and self.stats_grad):
            given = None
            if self.uses_batch_moments(causal, update):
                grad = mode == "global" and self.stats_grad
                xq_, xk_ = (xq, xk) if grad else (xq.detach(), xk.detach())
                given = sequence_moments(xq_, xk_, key_padding_mask, query_padding_mask)
        if mode == "global":
            return given
        cur = Moments(*(t.detach().clone().to(xq.dtype)[None, None] for t in running_moments(self)))
        if update and self.training:
            update_running(self, given, self.momentum)
        return cur
