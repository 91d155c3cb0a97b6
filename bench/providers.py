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

#: SDPA backends, by the name used in provider ids (``sdpa-<name>``) -> ``SDPBackend`` member.
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}
RF_PROVIDERS = ("rfattn", "rfattn-torch", "rfattn-compiled", "fla-chunk", "performer")
#: providers with no non-causal form
CAUSAL_ONLY = ("fla-chunk",)
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


def previous_torch_path(q, k, v, rf, causal: bool) -> torch.Tensor:
    """``rf_attention``'s torch path before the blocked forms of ``rfattn.blocked`` (as at commit
    2cde6ad): features of the whole sequence, then ``linear_attention`` (non-causal) or the
    chunk loop of ``rfattn.attention._causal_torch`` (128 tokens a step), autograd recording
    every op; no masks. ``bench.cpu_backend``'s baseline, eager and compiled."""
    from rfattn.attention import _causal_keys, _causal_torch, _torch_inputs
    from rfattn.features import query_features
    from rfattn.reference import linear_attention

    fm, scale = rf.feature_map, q.shape[-1] ** -0.5
    w, xq, xk, params = _torch_inputs(q, k, rf, None, scale, causal, None)
    if not causal:
        phi_q, phi_k = fm.features(xq, xk, w, None, params)
        return linear_attention(phi_q, phi_k, v.to(w.dtype)).to(q.dtype)
    if fm.exponential:
        phi_q = query_features(fm.logits(xq, w, "query", params),
                               fm.amplitude(xq, w, "query", params))  # fmt: skip
    else:
        phi_q = fm.values(xq, w, "query", params)
    u_k, g_k = _causal_keys(fm, xk, w, params)
    out, _ = _causal_torch(phi_q[:, :, None], u_k, g_k, v.to(w.dtype), None, None)
    return out[:, :, 0].to(q.dtype)


def _forward(provider: str, x: Inputs, rf, causal: bool) -> tuple[Callable, list]:
    """(forward call, leaf tensors whose .grad the backward fills)."""
    q, k, v = x.q, x.k, x.v
    if provider == "rfattn":
        return (lambda: rfattn.rf_attention(q, k, v, rf, causal=causal)), [q, k, v]
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
    with torch.no_grad():
        return rfattn.rf_attention(q, k, v, rf64, causal=causal, backend="torch")
