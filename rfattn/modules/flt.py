"""FourierLearner-Transformer relative positional encodings (FLT; spec ``crt-flt.md`` part B).

An RPE mask ``N[i, k] = f(r_i - r_k)`` on token positions ``r in R^l`` is learned through its
Fourier transform ``g`` (convention ``g(xi) = int f(z) exp(-2 pi i z.xi) dz``). With fixed proposal
samples ``xi_j ~ P`` (density ``p``) and weights ``w_j = g(xi_j) / p(xi_j)`` the realised mask is

    N^[i, k] = (1/R) sum_j w_j cos(2 pi (r_i - r_k).xi_j)        (B.1.5; E N^ = Re f)

which factorises exactly as ``a_i . b_k`` with the real cos/sin vectors (2R entries each)

    a_i = [c_j cos th_ij ; c_j sin th_ij],   b_k = [c'_j cos th_kj ; c'_j sin th_kj],
    th_ij = 2 pi (r_i - centre).xi_j,        c_j = sqrt(|w_j|/R + eps),  c'_j = (w_j/R) / c_j.

So ``exp(q.k * scale + N^) = exp(q^ . k^)`` for the augmented ``q^ = [sqrt(scale) q ; a]``,
``k^ = [sqrt(scale) k ; b]`` (B.1.3): any softmax-kernel random-feature map built for head dim
``D + 2R`` (posrf, oprf, ... whose statistics then see the augmented vectors) turns RPE attention
into plain linear attention, causal or not, through :func:`rfattn.rf_attention` unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rfattn.features import python_scalar

__all__ = ["FourierRPE", "PARAMETERISATIONS", "PROPOSALS"]

#: spectral parameterisations of g (spec B.1.6)
PARAMETERISATIONS = ("gaussian_mixture", "local", "gaussian_basis")
#: proposal distributions of xi: i.i.d. Gaussian (the paper) or a deterministic midpoint grid
PROPOSALS = ("gaussian", "grid")


def _check_int(name: str, val, low: int = 1) -> None:
    val = python_scalar(val)
    if not isinstance(val, int) or isinstance(val, bool) or val < low:
        raise ValueError(f"{name} must be an int >= {low}, got {val!r}")


def _check_positive(name: str, val) -> None:
    val = python_scalar(val)
    if isinstance(val, bool) or not isinstance(val, (int, float)) or not val > 0:
        raise ValueError(f"{name} must be a number > 0, got {val!r}")


def _irwin_hall(y: torch.Tensor, k: int) -> torch.Tensor:
    """Density of the sum of ``k`` independent U(0, 1) at ``y`` (0 outside ``[0, k]``)."""
    out = torch.zeros_like(y)
    for j in range(k + 1):
        t = (y - j).clamp_min(0.0)
        term = t ** (k - 1) if k > 1 else (y > j).to(y.dtype)
        out = out + (-1) ** j * math.comb(k, j) * term
    return (out / math.factorial(k - 1)).clamp_min(0.0) * ((y >= 0) & (y <= k)).to(y.dtype)


class FourierRPE(nn.Module):
    """Learned FLT relative positional encoding for random-feature attention (spec B.1-B.2).

    Args:
        num_heads: H; every head has its own g parameters and proposal samples (App. A.2).
            Share one module between layers to share the masks across layers, as the paper does.
        num_samples: R, proposal samples xi per head; the augmented head dim is ``D + 2R``.
        pos_dim: l, the dimension of a position (1 for sequences, 3 for point clouds).
        parameterisation: the form of g (B.1.6):

            * ``"gaussian_mixture"`` (FLT (6)): ``g = sum_t w_t exp(-|xi - mu_t|^2 / (2 s_t^2))``,
              learnable w ``[H, T]``, mu ``[H, T, l]``, log s^2 ``[H, T]``;
              ``Re f(d) = sum_t w_t (2 pi s_t^2)^(l/2) cos(2 pi d.mu_t) exp(-2 pi^2 s_t^2 |d|^2)``.
            * ``"local"`` (FLT (9)-(14), (12) corrected to sinc powers): ``g = sum_t w_t prod_j
              (sin(2 pi v_tj xi_j) / (pi xi_j))^k``, learnable w ``[H, T]`` and radii
              ``v = softplus(.)`` ``[H, T, l]``; ``f(d) = sum_t w_t prod_j box_v^{*k}(d_j)``:
              ``k = 1`` is the local RPE ``1[|d_j| <= v]``, ``k >= 2`` its continuous piecewise
              polynomial versions (support ``k v``).
            * ``"gaussian_basis"`` (FLT section 4.3, for 3-D points): ``g = sum_t w_t
              exp(-2 pi^2 s_t^2 |xi|^2)``, ``f(d) = sum_t w_t (2 pi s_t^2)^(-l/2)
              exp(-|d|^2 / (2 s_t^2))`` (rotation invariant).
        num_components: T, the number of terms of g.
        power: k of ``"local"`` (an int >= 1; ignored otherwise).
        proposal: ``"gaussian"`` (xi ~ N(0, s^2 I), s = ``proposal_scale``; the paper's choice) or
            ``"grid"`` (the midpoint rule on ``[-s, s]^l`` with ``R = n^l`` nodes: a
            deterministic quadrature of the inverse transform, low error for smooth g).
        proposal_scale: s above.
        split_eps: eps of the balanced split ``c_j = sqrt(|w_j|/R + eps)`` (spec C.1 item 17:
            the paper's ``sqrt(g/p)`` is imaginary for g < 0 and has an infinite slope at 0).
        init_scale: std of the initial w (small: the mask starts near 0 but gradients reach
            every parameter).
        init_range: ``(low, high)`` of the initial radii v (``"local"``, in position units) or
            widths s_t (``"gaussian_basis"``), spread log-uniformly over the T terms.
        seed: seed of the proposal draw and the initial parameters.

    Buffers (saved, moved by ``.to``): ``xi`` ``[H, R, l]`` and ``inv_density`` ``[H, R]``
    (``1 / p(xi)``). The g parameters are ``nn.Parameter`` s; gradients reach them through the
    weights ``w_j = g(xi_j) inv_density_j`` (xi is fixed, no reparameterisation).

    Positions (``positions``/``key_positions``): ``[T]`` or ``[T, l]`` shared over the batch, or
    ``[B, T, l]``; default ``arange(T)`` (l = 1 only). Phases are range-reduced in float64:
    positions minus a centre (``center``, default the midpoint of all positions of the call; the
    mask is invariant to it), times xi, minus the nearest integer, before cos/sin (C.1 item 25).
    Pass the same explicit ``center`` to every call of a causal sequence split with
    ``initial_state``, since the carried key features were built with it.
    """

    def __init__(
        self,
        num_heads: int,
        num_samples: int = 32,
        pos_dim: int = 1,
        parameterisation: str = "gaussian_mixture",
        num_components: int = 4,
        power: int = 1,
        proposal: str = "gaussian",
        proposal_scale: float = 1.0,
        split_eps: float = 1e-6,
        init_scale: float = 0.1,
        init_range: tuple[float, float] | None = None,
        seed: int | None = 0,
    ) -> None:
        super().__init__()
        _check_int("num_heads", num_heads)
        _check_int("num_samples", num_samples)
        _check_int("pos_dim", pos_dim)
        _check_int("num_components", num_components)
        _check_int("power", power)
        if parameterisation not in PARAMETERISATIONS:
            raise ValueError(
                f"parameterisation must be one of {PARAMETERISATIONS}, got {parameterisation!r}"
            )
        if proposal not in PROPOSALS:
            raise ValueError(f"proposal must be one of {PROPOSALS}, got {proposal!r}")
        _check_positive("proposal_scale", proposal_scale)
        split_eps = python_scalar(split_eps)
        if isinstance(split_eps, bool) or not isinstance(split_eps, (int, float)) or split_eps < 0:
            raise ValueError(f"split_eps must be a number >= 0, got {split_eps!r}")
        _check_positive("init_scale", init_scale)
        if proposal == "grid":
            n = round(num_samples ** (1.0 / pos_dim))
            if n**pos_dim != num_samples:
                raise ValueError(
                    f"num_samples must be n ** pos_dim for proposal='grid', got {num_samples} "
                    f"with pos_dim={pos_dim}"
                )
        if init_range is None:
            init_range = {"local": (1.0, 8.0), "gaussian_basis": (0.5, 3.0)}.get(
                parameterisation, (0.1 * proposal_scale, 0.7 * proposal_scale)
            )
        if len(init_range) != 2 or not 0 < init_range[0] <= init_range[1]:
            raise ValueError(
                f"init_range must be (low, high) with 0 < low <= high, got {init_range}"
            )
        self.num_heads = num_heads
        self.num_samples = num_samples
        self.pos_dim = pos_dim
        self.parameterisation = parameterisation
        self.num_components = num_components
        self.power = power
        self.proposal = proposal
        self.proposal_scale = float(proposal_scale)
        self.split_eps = float(split_eps)
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed if seed is not None else self._generator.seed())

        H, T, ell = num_heads, num_components, pos_dim
        gen = self._generator
        # widths spread log-uniformly over the T terms, identical in every head
        spread = torch.logspace(
            math.log10(init_range[0]), math.log10(init_range[1]), T, dtype=torch.float64
        ).float()
        self.weight = nn.Parameter(init_scale * torch.randn(H, T, generator=gen))
        if parameterisation == "gaussian_mixture":
            self.mean = nn.Parameter(0.25 * torch.randn(H, T, ell, generator=gen))
            self.log_var = nn.Parameter((2 * spread.log()).expand(H, T).clone())
        elif parameterisation == "local":
            # softplus^-1(v) = v + log(1 - exp(-v))
            raw = spread + torch.log(-torch.expm1(-spread))
            self.raw_radius = nn.Parameter(raw[None, :, None].expand(H, T, ell).clone())
        else:
            self.log_sigma = nn.Parameter(spread.log().expand(H, T).clone())
        self.register_buffer("xi", torch.empty(H, num_samples, ell))
        self.register_buffer("inv_density", torch.empty(H, num_samples))
        self.redraw()

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_samples={self.num_samples}, pos_dim={self.pos_dim}, "
            f"parameterisation={self.parameterisation!r}, num_components={self.num_components}, "
            f"proposal={self.proposal!r}"
        )

    @torch.no_grad()
    def redraw(self, seed: int | None = None) -> None:
        """Draw new proposal samples xi in place (a no-op for the deterministic grid).

        Args:
            seed: reseed first (same seed, same xi); ``None`` continues the module's stream.
        """
        if seed is not None:
            if not isinstance(seed, int) or isinstance(seed, bool):
                raise TypeError(f"seed must be an int or None, got {seed!r}")
            self._generator.manual_seed(seed)
        H, R, ell, s = self.num_heads, self.num_samples, self.pos_dim, self.proposal_scale
        if self.proposal == "gaussian":
            xi = s * torch.randn(H, R, ell, generator=self._generator, dtype=torch.float64)
            log_p = -0.5 * (xi / s).pow(2).sum(-1) - ell * math.log(s * math.sqrt(2 * math.pi))
            inv = torch.exp(-log_p)
        else:
            n = round(R ** (1.0 / ell))
            nodes = (torch.arange(n, dtype=torch.float64) + 0.5) * (2 * s / n) - s
            grid = torch.stack(torch.meshgrid(*([nodes] * ell), indexing="ij"), dim=-1)
            xi = grid.reshape(1, R, ell).expand(H, R, ell)
            inv = torch.full((H, R), (2 * s) ** ell, dtype=torch.float64)
        self.xi.copy_(xi)
        self.inv_density.copy_(inv)

    def augmented_dim(self, head_dim: int) -> int:
        """``head_dim + 2R``: the head dim a :class:`RandomFeatures` must be built for."""
        return head_dim + 2 * self.num_samples

    # ----------------------------------------------------------------------------- g and f
    def spectral(self, xi: torch.Tensor) -> torch.Tensor:
        """g at ``xi`` ``[H, N, l]`` (or ``[N, l]``, shared by the heads) -> ``[H, N]``."""
        xi = xi.expand(self.num_heads, *xi.shape[-2:]) if xi.dim() == 2 else xi
        w = self.weight.to(xi.dtype)[:, :, None]  # [H, T, 1]
        if self.parameterisation == "gaussian_mixture":
            var = self.log_var.to(xi.dtype).exp()[:, :, None]
            d2 = (xi[:, None] - self.mean.to(xi.dtype)[:, :, None]).pow(2).sum(-1)  # [H, T, N]
            terms = torch.exp(-d2 / (2 * var))
        elif self.parameterisation == "local":
            v = F.softplus(self.raw_radius.to(xi.dtype))[:, :, None]  # [H, T, 1, l]
            # sin(2 pi v x)/(pi x) = 2v sinc(2 v x): finite (2v) at x = 0
            terms = (2 * v * torch.sinc(2 * v * xi[:, None])).pow(self.power).prod(-1)
        else:
            sig2 = (2 * self.log_sigma.to(xi.dtype)).exp()[:, :, None]
            terms = torch.exp(-2 * math.pi**2 * sig2 * xi[:, None].pow(2).sum(-1))
        return (w * terms).sum(1)

    def closed_form(self, delta: torch.Tensor) -> torch.Tensor:
        """The exact mask ``Re f(delta)`` that the realised mask estimates (no sampling).

        Args:
            delta: offsets ``r_i - r_k``, ``[..., l]`` (or ``[...]`` when l = 1).

        Returns:
            ``[H, ...]`` in delta's (floating) dtype.
        """
        if self.pos_dim == 1 and (delta.dim() == 0 or delta.shape[-1] != 1):
            delta = delta[..., None]
        H, ell = self.num_heads, self.pos_dim
        extra = delta.dim() - 1
        shape = (H, self.num_components) + (1,) * extra
        d = delta.to(torch.promote_types(delta.dtype, torch.float32))
        w = self.weight.to(d.dtype).reshape(shape)
        if self.parameterisation == "gaussian_mixture":
            var = self.log_var.to(d.dtype).exp().reshape(shape)
            mu = self.mean.to(d.dtype).reshape(shape + (ell,))
            phase = (d * mu).sum(-1)
            terms = (2 * math.pi * var) ** (ell / 2) * torch.cos(2 * math.pi * phase)
            terms = terms * torch.exp(-2 * math.pi**2 * var * d.pow(2).sum(-1))
        elif self.parameterisation == "local":
            v = F.softplus(self.raw_radius.to(d.dtype)).reshape(shape + (ell,))
            k = self.power
            # box_v^{*k}(x) = (2v)^(k-1) IrwinHall_k(x / (2v) + k / 2)
            terms = ((2 * v) ** (k - 1) * _irwin_hall(d / (2 * v) + k / 2, k)).prod(-1)
        else:
            sig2 = (2 * self.log_sigma.to(d.dtype)).exp().reshape(shape)
            terms = (2 * math.pi * sig2) ** (-ell / 2) * torch.exp(-d.pow(2).sum(-1) / (2 * sig2))
        return (w * terms).sum(1)

    def sample_weights(self) -> torch.Tensor:
        """``w_j = g(xi_j) / p(xi_j)`` ``[H, R]`` (differentiable in g's parameters)."""
        return self.spectral(self.xi) * self.inv_density

    # ---------------------------------------------------------------- positional features
    def _positions(self, positions, length: int | None, name: str) -> torch.Tensor:
        """Positions as ``[T, l]`` or ``[B, T, l]``; ``arange(length)`` when None (l = 1)."""
        if positions is None:
            if self.pos_dim != 1:
                raise ValueError(f"{name} is required for pos_dim={self.pos_dim}")
            if length is None:
                raise ValueError(f"give {name} or its length")
            return torch.arange(length, dtype=torch.float64, device=self.xi.device)[:, None]
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(positions).__name__}")
        if positions.is_complex() or positions.dtype == torch.bool:
            raise TypeError(f"{name} must be real, got dtype {positions.dtype}")
        p = positions[:, None] if positions.dim() == 1 and self.pos_dim == 1 else positions
        if (
            p.dim() not in (2, 3)
            or p.shape[-1] != self.pos_dim
            or (length is not None and p.shape[-2] != length)
        ):
            raise ValueError(
                f"{name} must have shape [T], [T, l] or [B, T, l] with l={self.pos_dim}"
                + (f", T={length}" if length is not None else "")
                + f", got {tuple(positions.shape)}"
            )
        return p.to(self.xi.device)

    @staticmethod
    def default_center(*positions: torch.Tensor) -> torch.Tensor:
        """Midpoint of the range of all given positions, per coordinate ``[l]`` (float64)."""
        flat = torch.cat([p.detach().reshape(-1, p.shape[-1]).double() for p in positions])
        if flat.shape[0] == 0:
            return flat.new_zeros(flat.shape[-1])
        return 0.5 * (flat.amin(0) + flat.amax(0))

    def _phases(self, pos: torch.Tensor, center: torch.Tensor) -> torch.Tensor:
        """Range-reduced phases ``2 pi frac((r - centre).xi)`` in float64, ``[(B,) H, T, R]``."""
        # float64 product, then subtract the nearest integer: |phase| <= pi whatever |r xi|
        rel = pos.to(torch.float64) - center.to(device=pos.device, dtype=torch.float64)
        xi = self.xi.to(device=pos.device, dtype=torch.float64)  # [H, R, l]
        t = torch.einsum("...tl,hrl->...htr", rel, xi)
        return (2 * math.pi) * (t - torch.round(t).detach())

    def features(
        self,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        *,
        query_length: int | None = None,
        key_length: int | None = None,
        center: torch.Tensor | float | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The positional feature vectors ``(a, b)`` with ``a_i . b_k = N^[i, k]``.

        Args:
            positions: query positions (see the class docstring); ``key_positions`` likewise
                (default: the query positions, or ``arange(key_length)``).
            query_length, key_length: Tq, Tk when positions are not given (l = 1).
            center: ``[l]`` or a float; default :meth:`default_center` of all positions.
            dtype: output dtype (phases are always reduced in float64).

        Returns:
            ``a`` ``[(B,) H, Tq, 2R]`` and ``b`` ``[(B,) H, Tk, 2R]``; the batch dim is present
            when a position tensor has one.
        """
        pq = self._positions(positions, query_length, "positions")
        if key_positions is None and key_length in (None, pq.shape[-2]):
            pk = pq  # self-attention: the keys sit where the queries do
        else:
            pk = self._positions(key_positions, key_length, "key_positions")
        if center is None:
            c = self.default_center(pq, pk)
        else:
            c = torch.as_tensor(center, dtype=torch.float64, device=self.xi.device).reshape(-1)
            if c.numel() not in (1, self.pos_dim):
                raise ValueError(f"center must be a float or have {self.pos_dim} entries")
        w = self.sample_weights().to(torch.float64)  # [H, R]
        R = self.num_samples
        cq = torch.sqrt(w.abs() / R + self.split_eps)
        ck = (w / R) / cq  # cq * ck = w / R exactly
        out = []
        for p, coef in ((pq, cq), (pk, ck)):
            th = self._phases(p, c)  # [(B,) H, T, R]
            coef = coef[:, None, :]
            out.append(torch.cat((coef * torch.cos(th), coef * torch.sin(th)), dim=-1).to(dtype))
        return out[0], out[1]

    def mask(self, positions=None, key_positions=None, **kwargs) -> torch.Tensor:
        """The realised mask ``N^ = a b^T``, ``[(B,) H, Tq, Tk]`` (diagnostics and tests).

        Takes :meth:`features`' arguments (``dtype`` defaults to float64 here).
        """
        kwargs.setdefault("dtype", torch.float64)
        a, b = self.features(positions, key_positions, **kwargs)
        return a @ b.transpose(-1, -2)

    def augment(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        *,
        scale: float | None = None,
        center: torch.Tensor | float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Augmented queries and keys ``[sqrt(scale) q ; a]``, ``[sqrt(scale) k ; b]``.

        ``q^ . k^ = scale q . k + N^``, so ``rf_attention(q^, k^, v, rf, scale=1.0)`` with an
        ``rf`` built for :meth:`augmented_dim` is FLT attention (spec B.2).

        Args:
            q: ``[B, H, Tq, D]``; k: ``[B, H, Tk, D]``.
            positions, key_positions, center: as in :meth:`features`.
            scale: softmax temperature, default ``D ** -0.5``.

        Returns:
            ``(q^ [B, H, Tq, D + 2R], k^ [B, H, Tk, D + 2R])`` in q's dtype.
        """
        for name, x in (("q", q), ("k", k)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                raise ValueError(f"{name} must be a tensor [B, H, T, D]")
            if x.shape[1] != self.num_heads:
                raise ValueError(
                    f"{name} has {x.shape[1]} heads, but this FourierRPE has num_heads="
                    f"{self.num_heads}"
                )
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        a, b = self.features(
            positions,
            key_positions,
            query_length=q.shape[2],
            key_length=k.shape[2],
            center=center,
            dtype=q.dtype,
        )
        s = math.sqrt(scale)
        a = a.to(q.device).expand(q.shape[0], -1, -1, -1)
        b = b.to(k.device).expand(k.shape[0], -1, -1, -1)
        return torch.cat((q * s, a), dim=-1), torch.cat((k * s, b), dim=-1)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rf,
        positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
        *,
        scale: float | None = None,
        center: torch.Tensor | float | None = None,
        **kwargs,
    ):
        """FLT attention: :func:`rfattn.rf_attention` on the augmented q, k.

        Args:
            q, k, v, positions, key_positions, scale, center: as in :meth:`augment`.
            rf: a :class:`rfattn.RandomFeatures` built for ``augmented_dim(D)``.
            **kwargs: the other arguments of ``rf_attention`` (causal, key_padding_mask,
                backend, initial_state, return_state).

        Returns:
            ``rf_attention``'s output: ``[B, H, Tq, E]`` (or ``(out, state)``).
        """
        from rfattn.attention import rf_attention

        if getattr(rf, "head_dim", None) != self.augmented_dim(q.shape[-1]):
            raise ValueError(
                f"rf must be built for head_dim={self.augmented_dim(q.shape[-1])} "
                f"(D + 2R), got {getattr(rf, 'head_dim', None)}"
            )
        qa, ka = self.augment(q, k, positions, key_positions, scale=scale, center=center)
        return rf_attention(qa, ka, v, rf, scale=1.0, **kwargs)
