"""Attention providers benchmarked against each other.

Each provider is built into a zero-argument call on inputs made beforehand (outside the timed
region). Random-feature providers (``rfattn``, ``rfattn-torch``, ``performer``) take the
:class:`rfattn.RandomFeatures` of the feature kind benchmarked; softmax providers ignore it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import rfattn
from rfattn.reference import attention_ratio

#: SDPA backends, by the name used in provider ids (``sdpa-<name>``) -> ``SDPBackend`` member.
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
RF_PROVIDERS = ("rfattn", "rfattn-torch", "rfattn-compiled", "fla-chunk", "performer",
                "rfattn-hybrid")  # fmt: skip
#: providers with no non-causal form
CAUSAL_ONLY = ("fla-chunk", "rfattn-hybrid")
#: the hybrid provider's exact part (``rfattn-hybrid``: rfattn.hybrid, fused where the fused
#: kernels run): the sinks and window a converted decoder takes (docs/hybrid.md)
HYBRID = dict(window=64, sinks=4)
#: largest T timed for the compiled torch path in causal mode (see _forward)
COMPILED_CAUSAL_MAX_T = 8192
ALL_PROVIDERS = RF_PROVIDERS + tuple(f"sdpa-{b}" for b in SDPA_BACKENDS) + ("flash-attn",)


def is_softmax(provider: str) -> bool:
    """Exact softmax attention (the baselines), as opposed to a random-feature approximation."""
    return provider not in RF_PROVIDERS


@dataclass
class Inputs:
    q: torch.Tensor  # [B, H, T, D]
    k: torch.Tensor  # [B, H, T, D]
    v: torch.Tensor  # [B, H, T, E]
    grad: torch.Tensor | None  # [B, H, T, E] cotangent of the output (fwd+bwd only)


def make_inputs(B, H, T, D, E, dtype, device, backward: bool, seed: int = 0) -> Inputs:
    """q, k, v ~ N(0, 1) and a fixed random cotangent, built once per shape."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*shape):
        x = torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
        return x.requires_grad_(backward)

    q, k, v = rand(B, H, T, D), rand(B, H, T, D), rand(B, H, T, E)
    grad = torch.randn(B, H, T, E, generator=g).to(device=device, dtype=dtype) if backward else None
    return Inputs(q, k, v, grad)


def _probe_sdpa(backend: str, device, dtype, D: int, E: int) -> str | None:
    """None if ``sdpa_kernel(backend)`` runs these head dims and dtype here, else why not."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 1, 16, D, device=device, dtype=dtype)
    v = torch.randn(1, 1, 16, E, device=device, dtype=dtype)
    try:
        with sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[backend])):
            F.scaled_dot_product_attention(q, q, v)
    except RuntimeError as exc:
        return f"not available for D={D}, E={E}, {dtype} here: {str(exc).splitlines()[0][:160]}"
    return None


def available_providers(
    device: torch.device, dtype: torch.dtype, D: int, E: int, requested=None
) -> tuple[list[str], dict[str, str]]:
    """Providers to run on ``device`` and, for each one left out, why."""
    requested = list(requested) if requested else None
    names: list[str] = []
    skipped: dict[str, str] = {}

    def consider(name: str, why_not: str | None) -> None:
        if requested is not None and name not in requested:
            return
        if why_not is not None:
            skipped[name] = why_not
        else:
            names.append(name)

    cuda = device.type == "cuda"
    consider("rfattn", None)
    if cuda or (requested is not None and "rfattn-torch" in requested):
        consider("rfattn-torch", None)
    elif requested is None:  # backend='auto' is the torch path on CPU: same code, same time
        skipped["rfattn-torch"] = "on CPU rfattn (backend='auto') already is the torch path"
    if requested is not None and "rfattn-hybrid" in requested:
        consider("rfattn-hybrid", None)
    elif requested is None:
        skipped["rfattn-hybrid"] = "asked for by name only (--providers rfattn-hybrid)"
    if cuda or (requested is not None and "rfattn-compiled" in requested):
        consider("rfattn-compiled", None)
    elif requested is None:
        skipped["rfattn-compiled"] = "the compiled torch path is timed on CUDA only"
    try:
        from fla.ops.linear_attn import chunk_linear_attn  # noqa: F401

        why = None
        if not cuda:
            why = "flash-linear-attention's kernels need a CUDA device"
    except ImportError:
        why = "flash-linear-attention is not installed (pip install flash-linear-attention)"
    consider("fla-chunk", why)
    for backend in SDPA_BACKENDS:  # probed, not assumed: torch has a CPU flash kernel too
        if requested is None or f"sdpa-{backend}" in requested:
            consider(f"sdpa-{backend}", _probe_sdpa(backend, device, dtype, D, E))
    try:
        import flash_attn  # noqa: F401

        why = None
        if not cuda:
            why = "flash_attn needs a CUDA device"
        elif dtype not in (torch.float16, torch.bfloat16):
            why = f"flash_attn needs fp16/bf16, benchmark dtype is {dtype}"
        elif D != E:
            why = f"flash_attn needs E == D, got D={D}, E={E}"
    except ImportError:
        why = "flash_attn is not installed (pip install flash-attn)"
    consider("flash-attn", why)
    try:
        import performer_pytorch  # noqa: F401

        why = None
    except ImportError:
        why = "performer-pytorch is not installed (optional: pip install performer-pytorch)"
    consider("performer", why)
    if requested is not None:
        for name in requested:
            if name not in ALL_PROVIDERS:
                raise ValueError(f"unknown provider {name!r}; choices: {list(ALL_PROVIDERS)}")
    return names, skipped


#: tokens per chunk of the previous causal torch path
_PREVIOUS_CHUNK = 128


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _previous_causal(
    phi_q: torch.Tensor,
    u_k: torch.Tensor | None,
    g_k: torch.Tensor | None,
    v: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    state=None,
) -> tuple[torch.Tensor, tuple]:
    """The previous torch path's chunk loop, as at commit 2cde6ad (frozen here as the baseline of
    ``bench.cpu_backend``): returns (out ``[B, H, G, T, E]``, final ``(S, z, offset)``).

    Exponential features are stabilised per query row: query i reads every key j <= i at the
    offset ``r_i = max(offset before the chunk, m_j for j <= i)``, with ``m_j`` key j's max logit
    over features. Within a chunk, key j enters as ``g_j exp(u_j - m_j)`` times
    ``exp(m_j - r_i) <= 1``; the carried state sits at the running max of every key so far and
    enters row i times ``exp(offset - r_i) <= 1``. So no output depends on a later key, not even
    through underflow, and where chunks fall changes only rounding (docs/numerics.md). Non-finite
    keys or values poison the outputs from their position on, never earlier ones: future keys
    are removed by selection (``where``), not by multiplying with 0.

    Args:
        phi_q: stabilised query features ``[B, H, G, T, F]``: the G query heads that share each
            of the H key/value heads (grouped-query attention; G = 1 otherwise).
        u_k: key logits ``[B, H, T, F]`` of an exponential feature, or None for a plain feature
            (phi_k = g_k, no offset: the state's offset stays 0).
        g_k: key amplitude ``[B, H, T, F]`` (None = 1) or, when ``u_k`` is None, the features.
        v: ``[B, H, T, E]``; key_padding_mask: ``[B, T]``; state: carried :class:`RFState`
            (``[B, H, ...]``: one per key/value head).
    """
    B, H, G, T, F = phi_q.shape
    E = v.shape[-1]
    dt = phi_q.dtype
    ninf = float("-inf")
    if key_padding_mask is not None:
        pad = key_padding_mask[:, None, :, None]
        if u_k is not None:
            u_k = u_k.masked_fill(pad, ninf)
        if g_k is not None:
            g_k = g_k.masked_fill(pad, 0.0)
        v = v.masked_fill(pad, 0.0)
    if state is None:
        s = phi_q.new_zeros(B, H, F, E)
        z = phi_q.new_zeros(B, H, F)
        off = phi_q.new_full((B, H), ninf if u_k is not None else 0.0)
    else:
        s, z, off = (x.to(dt) for x in state)
    if u_k is not None:
        m = u_k.detach().amax(dim=-1) if F else u_k.new_full((B, H, T), ninf)  # [B, H, T]
        safe_m = torch.where(m == ninf, torch.zeros_like(m), m)
        pk_all = torch.exp(u_k - safe_m[..., None])  # key j at its own max: g_j exp(u_j - m_j)
        pk_all = pk_all if g_k is None else g_k * pk_all
    else:
        pk_all = g_k
    # non-finite values: zero in the products, NaN from their position on (column-wise)
    bad_v = ~torch.isfinite(v)
    bad_k = ~torch.isfinite(pk_all).all(dim=-1, keepdim=True)  # [B, H, T, 1]
    v_clean = _finite_or_zero(v)
    outs = []
    for c0 in range(0, T, _PREVIOUS_CHUNK):
        c1 = min(T, c0 + _PREVIOUS_CHUNK)
        C = c1 - c0
        tril = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
        pq, vc, pk = phi_q[:, :, :, c0:c1], v_clean[:, :, None, c0:c1], pk_all[:, :, c0:c1]
        raw = pq @ _finite_or_zero(pk).transpose(-1, -2)[:, :, None]  # [B, H, G, C, C]
        if u_k is None:  # plain features: no offsets
            intra = torch.where(tril, raw, torch.zeros_like(raw))
            num, den = pq @ s[:, :, None], (pq @ z[:, :, None, :, None]).squeeze(-1)
        else:
            mc = m[:, :, c0:c1]
            r = torch.maximum(off[..., None], torch.cummax(mc, dim=-1).values)  # [B, H, C]
            # exp(m_j - r_i) <= 1 for j <= i; keys never seen (-inf) give 0, not NaN
            seen = tril & (mc[..., None, :] > ninf)
            decay = torch.exp(torch.where(seen, mc[..., None, :] - r[..., :, None], ninf))
            decay = torch.where(mc[..., None, :].isnan() & tril, mc[..., None, :], decay)
            intra = torch.where(tril, raw * decay[:, :, None], torch.zeros_like(raw))
            carried = torch.where(off[..., None] == ninf, torch.zeros_like(r),
                                  torch.exp(off[..., None] - r))[:, :, None]  # fmt: skip
            num = (pq @ s[:, :, None]) * carried[..., None]
            den = (pq @ z[:, :, None, :, None]).squeeze(-1) * carried
            new_off = r[..., -1]
            safe_new = torch.where(new_off == ninf, torch.zeros_like(new_off), new_off)
            alpha = torch.where(off == ninf, torch.zeros_like(off), torch.exp(off - safe_new))
            s, z = s * alpha[..., None, None], z * alpha[..., None]
            pk = pk * torch.exp(torch.where(mc == ninf, mc, mc - safe_new[..., None]))[..., None]
            off = new_off
        num = num + intra @ vc
        den = den + intra.sum(-1)
        bad = bad_v[:, :, c0:c1] | bad_k[:, :, c0:c1]
        poisoned = (torch.cumsum(bad.to(torch.int32), dim=-2) > 0)[:, :, None]
        num = torch.where(poisoned, torch.full_like(num, float("nan")), num)
        outs.append(attention_ratio(num, den))
        s = s + pk.transpose(-1, -2) @ v[:, :, c0:c1]
        z = z + pk.sum(dim=-2)
    if not outs:
        # T = 0: phi_q @ S is [B, H, G, 0, E] and keeps the graph (an output without grad_fn
        # would break a caller's backward); the state too, through empty sums over the keys
        s = s + pk_all.transpose(-1, -2) @ v
        z = z + pk_all.sum(dim=-2)
        return phi_q @ s[:, :, None], (s, z, off)
    return torch.cat(outs, dim=3), (s, z, off)


def previous_torch_path(q, k, v, rf, causal: bool) -> torch.Tensor:
    """``rf_attention``'s torch path before the blocked forms of ``rfattn.blocked`` (as at commit
    2cde6ad): features of the whole sequence, then ``linear_attention`` (non-causal) or the
    chunk loop of :func:`_previous_causal` (128 tokens a step), autograd recording
    every op; no masks. ``bench.cpu_backend``'s baseline, eager and compiled."""
    from rfattn.features import query_features
    from rfattn.reference import linear_attention
    from rfattn.torch_path import causal_keys, torch_inputs

    fm, scale = rf.feature_map, q.shape[-1] ** -0.5
    w, xq, xk, params = torch_inputs(q, k, rf, None, scale, causal, None)
    if not causal:
        phi_q, phi_k = fm.features(xq, xk, w, None, params)
        return linear_attention(phi_q, phi_k, v.to(w.dtype)).to(q.dtype)
    if fm.exponential:
        phi_q = query_features(fm.logits(xq, w, "query", params),
                               fm.amplitude(xq, w, "query", params))  # fmt: skip
    else:
        phi_q = fm.values(xq, w, "query", params)
    u_k, g_k = causal_keys(fm, xk, w, params)
    out, _ = _previous_causal(phi_q[:, :, None], u_k, g_k, v.to(w.dtype), None, None)
    return out[:, :, 0].to(q.dtype)


def _forward(provider: str, x: Inputs, rf, causal: bool) -> tuple[Callable, list]:
    """(forward call, leaf tensors whose .grad the backward fills)."""
    q, k, v = x.q, x.k, x.v
    if provider == "rfattn":
        return (lambda: rfattn.rf_attention(q, k, v, rf, causal=causal)), [q, k, v]
    if provider == "rfattn-hybrid":
        return (lambda: rfattn.rf_attention(q, k, v, rf, causal=causal, **HYBRID)), [q, k, v]
    if provider == "rfattn-torch":
        return (lambda: rfattn.rf_attention(q, k, v, rf, causal=causal, backend="torch")), [
            q,
            k,
            v,
        ]
    if provider in ("rfattn-previous", "rfattn-previous-compiled"):
        fn = previous_torch_path
        if provider.endswith("-compiled"):
            fn = torch.compile(previous_torch_path)
        return (lambda: fn(q, k, v, rf, causal)), [q, k, v]
    if provider == "rfattn-compiled":
        # the unfused torch path under torch.compile (inductor fuses its elementwise work)
        if causal and q.shape[2] > COMPILED_CAUSAL_MAX_T:
            raise NotImplementedError(
                f"rfattn-compiled causal above T={COMPILED_CAUSAL_MAX_T}: dynamo unrolls the torch "
                "path's chunk loop (T/128 steps), and compiling takes minutes"
            )
        compiled = torch.compile(rfattn.rf_attention)
        return (lambda: compiled(q, k, v, rf, causal=causal, backend="torch")), [q, k, v]
    if provider == "fla-chunk":
        if not causal:
            raise NotImplementedError("fla-chunk (chunk_linear_attn) is causal only")
        from fla.ops.linear_attn import chunk_linear_attn

        def fla():
            # the features in torch (rfattn's own maps, fp32, cast to the input dtype), then
            # flash-linear-attention's chunked kernel normalising by phi_q . cumsum(phi_k)
            phi_q, phi_k = rf.features(q, k)
            phi_q, phi_k = (p.to(q.dtype).transpose(1, 2) for p in (phi_q, phi_k))
            out, _ = chunk_linear_attn(phi_q, phi_k, v.transpose(1, 2), scale=1.0, normalize=True)
            return out.transpose(1, 2)

        return fla, [q, k, v]
    if provider.startswith("sdpa-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, SDPA_BACKENDS[provider[5:]])

        def sdpa():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return sdpa, [q, k, v]
    if provider == "flash-attn":
        from flash_attn import flash_attn_func

        # flash_attn's layout is [B, T, H, D]: transposed copies made here, outside the timing
        qt, kt, vt = (
            t.detach().transpose(1, 2).contiguous().requires_grad_(t.requires_grad)
            for t in (q, k, v)
        )

        def fa():
            return flash_attn_func(qt, kt, vt, causal=causal).transpose(1, 2)

        return fa, [qt, kt, vt]
    if provider == "performer":
        from performer_pytorch import FastAttention

        fast = FastAttention(dim_heads=q.shape[-1], nb_features=rf.num_features, causal=causal)
        fast = fast.to(q.device)
        with torch.no_grad():  # the same projection matrix as rfattn's
            fast.projection_matrix.copy_(rf.weight.to(fast.projection_matrix.dtype))
        return (lambda: fast(q, k, v)), [q, k, v]
    raise ValueError(f"unknown provider {provider!r}")


def make_call(
    provider: str, x: Inputs, rf, causal: bool, backward: bool
) -> tuple[Callable[[], object], list[torch.Tensor]]:
    """A call running ``provider`` forward, or forward and backward with the fixed cotangent;
    and the tensors whose gradients a timer should reset between calls."""
    fwd, leaves = _forward(provider, x, rf, causal)
    if not backward:
        return fwd, []
    grad = x.grad

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        fwd().backward(grad)

    return fwd_bwd, leaves


def forward_output(provider: str, x: Inputs, rf, causal: bool) -> torch.Tensor:
    """The forward output ``[B, H, T, E]`` of ``provider`` (no autograd), for checks."""
    fwd, _ = _forward(provider, x, rf, causal)
    with torch.no_grad():
        return fwd()


def reference_output(provider: str, x: Inputs, rf, causal: bool) -> torch.Tensor | None:
    """What ``provider`` must compute, in float64: exact softmax attention for the softmax
    providers; for rfattn's, the float64 torch path on a copy of ``rf`` (the same W and the
    same statistics rule: running statistics when causal, global otherwise -- the torch path is
    itself tested against ``rfattn.reference``); None for performer (its own feature
    normalisation and eps: only finiteness is checked).

    ``rf`` must be in the state the checked call saw (copy it before that call: a call in
    training mode updates running statistics afterwards)."""
    q, k, v = (t.detach().double() for t in (x.q, x.k, x.v))
    if is_softmax(provider):
        return rfattn.reference.softmax_attention(q, k, v, causal=causal)
    if provider == "performer":
        return None
    if provider == "fla-chunk" and rf.feature != "posrf":
        return None  # its features are the non-causal maps: equal to rfattn's for posrf only
    rf64 = copy.deepcopy(rf).double()
    hybrid = HYBRID if provider == "rfattn-hybrid" else {}
    with torch.no_grad():
        return rfattn.rf_attention(q, k, v, rf64, causal=causal, backend="torch", **hybrid)
