"""The half-precision policy of the non-causal kernels (``kernels/common.py: _precision``,
docs/numerics.md) for fp16/bf16 inputs.

Two checks, both under the interpreter (which emulates the GPU's half products,
``common.half_dot``):

* accuracy, the flash-attention rule: the fused output errs at most 2x, its gradients at most
  3x what the torch path in the same dtype errs, both against the float64 torch path on the
  same W; every fused feature form (the GERF family, the signed tables, rmf), q and k at
  sigma 0.5 and 1 and a large-norm case (the grid beyond one case per form: slow);
* the rounding policy itself: the kernel's forward and backward equal :func:`emulate`, a torch
  emulation in float64 of the operands rounded where the GPU rounds them, to 1e-6.
"""

import copy

import pytest
import torch
from rfattn.kernels.rf_parallel import rf_parallel_bwd, rf_parallel_fwd

import rfattn
from rfattn.testing import rel_rms, tolerance

f64 = torch.float64
HALVES = (torch.bfloat16, torch.float16)

#: (feature, weights, options): every fused feature form
FORMS = {
    "posrf": ("posrf", "orf", {}),
    "gerf": ("gerf", "orf", {"A": -0.1}),
    "oprf": ("oprf", "orf", {}),
    "trigrf": ("trigrf", "orf", {}),
    "hrf": ("hrf", "orf", {}),
    "rmf": ("rmf", "rademacher", {}),
}
#: (sigma of q, sigma of k): the issue's two and a large-norm case
SIGMAS = {"s1-0.5": (1.0, 0.5), "s0.5": (0.5, 0.5), "s1": (1.0, 1.0), "large": (2.0, 2.0)}
#: one case per form in make test, the rest in make test-slow
QUICK = {("posrf", torch.bfloat16, "s1-0.5"),
         ("rmf", torch.float16, "s0.5")}  # fmt: skip


def _inputs(B, H, T, D, E, sq, sk, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, H, T, D, generator=g, dtype=f64) * sq).to(dtype)
    k = (torch.randn(B, H, T, D, generator=g, dtype=f64) * sk).to(dtype)
    v = torch.randn(B, H, T, E, generator=g, dtype=f64).to(dtype)
    return q, k, v


def _errors(q, k, v, rf, backend, do):
    """Relative RMS errors of out, dq, dk, dv of ``backend`` in the inputs' dtype against the
    float64 torch path on the same W (the same cotangent ``do``)."""
    args = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = rfattn.rf_attention(*args, rf, backend=backend)
    out.backward(do.to(out.dtype))
    ref_args = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = rfattn.rf_attention(*ref_args, copy.deepcopy(rf).double(), backend="torch")
    ref.backward(do)
    errs = {"out": rel_rms(out, ref)}
    errs.update({"d" + n: rel_rms(a.grad, r.grad) for n, a, r in zip("qkv", args, ref_args,
                                                                    strict=True)})  # fmt: skip
    return errs


def _cases():
    for form in FORMS:
        for dtype in HALVES:
            for sigma in SIGMAS:
                marks = () if (form, dtype, sigma) in QUICK else (pytest.mark.slow,)
                yield pytest.param(form, dtype, sigma, marks=marks,
                                   id=f"{form}-{str(dtype)[6:]}-{sigma}")  # fmt: skip


@pytest.mark.parametrize("form, dtype, sigma", list(_cases()))
def test_half_policy_within_the_flash_attention_rule(form, dtype, sigma):
    feature, weights, opts = FORMS[form]
    B, H, T, D, M, E = 1, 2, 100, 32, 64, 32
    q, k, v = _inputs(B, H, T, D, E, *SIGMAS[sigma], dtype)
    rf = rfattn.RandomFeatures(D, M, feature=feature, weights=weights, seed=0, **opts)
    do = torch.randn(B, H, T, E, generator=torch.Generator().manual_seed(5), dtype=f64)
    kernel = _errors(q, k, v, rf, "triton", do)
    torch_errs = _errors(q, k, v, rf, "torch", do)
    for name, err in torch_errs.items():
        factor, kind = (2, "out") if name == "out" else (3, "grad")
        assert kernel[name] <= factor * err or kernel[name] <= tolerance(dtype, kind) / 10, (
            name, kernel, torch_errs)  # fmt: skip


# ------------------------------------------------------------------------------------------------
# the rounding policy, emulated in torch


def _r(x: torch.Tensor, half: torch.dtype) -> torch.Tensor:
    """x rounded to ``half`` (to nearest even), in float64."""
    return x.to(torch.float32).to(half).to(f64)


def _split(w: torch.Tensor, half: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``w`` as ``w_hi + w_lo``, each in ``half`` (the difference is exact in fp32)."""
    hi = w.to(half)
    return hi.to(f64), (w - hi.to(torch.float32)).to(half).to(f64)


def emulate(q, k, v, w, scale, do):
    """The half policy for posrf (u = w . x~ - |x~|^2 / 2, offsets per key feature and per query
    row) in float64, operands rounded where the GPU rounds them: the logits as two products of
    the exact rows with ``W = W_hi + W_lo`` times sqrt(scale) (fp32, as the kernel holds it),
    every other product of operands rounded to the input dtype. One key tile and one feature
    tile (T <= 64, M <= 64 under the interpreter): the offsets are the final maxima.

    Returns a dict: the key pass's ``S, z``, the query pass's ``den`` and ``out``, and ``dq, dk,
    dv`` (the last four before their rounding to the input dtype)."""
    h = q.dtype
    c = torch.tensor(scale**0.5, dtype=torch.float32).double()
    w_hi, w_lo = _split(w.float(), h)
    q, k, v, w = q.double(), k.double(), v.double(), w.float().double()

    def logits(x):
        xs = x * c
        return c * (x @ w_hi.T + x @ w_lo.T) - 0.5 * (xs * xs).sum(-1, keepdim=True), xs

    uk, ks = logits(k)
    mk = uk.amax(-2, keepdim=True)  # per feature
    b = (uk - mk).exp()  # [T, M]
    S, z = _r(b, h).transpose(-1, -2) @ v, b.sum(-2)  # [M, E], [M]
    uq, qs = logits(q)
    uq = uq + mk
    mq = uq.amax(-1, keepdim=True)  # per row
    a = (uq - mq).exp()
    num, den = _r(a, h) @ _r(S, h), (a * z[..., None, :]).sum(-1)
    out = num / den[..., None]
    # backward: g = do / den, c = -(do . out) / den; out as the kernel stored it
    o = _r(out, h)
    do = do.double()
    g, cq = do / den[..., None], -(do * o).sum(-1) / den
    dS = _r(a, h).transpose(-1, -2) @ _r(g, h)
    dz = (a * cq[..., None]).sum(-2)
    da = _r(g, h) @ _r(S, h).transpose(-1, -2) + cq[..., None] * z[..., None, :]
    du = a * da  # du/dx~ = w - x~ (posrf)
    dq = (_r(du, h) @ _r(w, h) - du.sum(-1, keepdim=True) * qs) * c
    db = _r(v, h) @ _r(dS, h).transpose(-1, -2) + dz[..., None, :]
    du = b * db
    dk = (_r(du, h) @ _r(w, h) - du.sum(-1, keepdim=True) * ks) * c
    dv = _r(b, h) @ _r(dS, h)
    return dict(S=S, z=z, den=den, out=out, dq=dq, dk=dk, dv=dv)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_kernel_is_its_rounding_policy(dtype):
    """The kernel under the interpreter (its half products emulated as the GPU computes them)
    equals the torch emulation of the policy: forward state and output, and the gradients."""
    B, H, T, D, M, E = 1, 2, 50, 32, 64, 16
    q, k, v = _inputs(B, H, T, D, E, 1.0, 0.5, dtype)
    rf = rfattn.RandomFeatures(D, M, seed=0)
    form = rf.feature_map.kernel_form(rf.weight)
    scale = D**-0.5
    do = torch.randn(B, H, T, E, generator=torch.Generator().manual_seed(5), dtype=f64)
    out, aux = rf_parallel_fwd(q, k, v, form, scale, return_aux=True)
    dq, dk, dv, _ = rf_parallel_bwd(do.to(dtype), q, k, v, form, scale, out, aux)
    want = emulate(q, k, v, form.w, scale, do.to(dtype))
    # fp32 state: to 1e-6. fp16 rounds in steps of 2^-11: a feature within ~1e-7 of a tie
    # (fp32 against float64 before the rounding) rounds the other way in ~2e-4 of the elements,
    # 7e-6 RMS in S (bf16's 2^-8 steps: ~5e-8)
    bound = 1e-6 if dtype == torch.bfloat16 else 2e-5
    S, z, _, _, den = aux
    for name, got in (("S", S), ("z", z), ("den", den)):
        assert rel_rms(got, want[name].reshape(got.shape)) <= bound, name
    # stored in the input dtype, rounded to nearest: within half an ulp of the emulation's (for
    # fp16 all but 1 %: the flips above move a few elements whose terms cancel)
    eps = torch.finfo(dtype).eps
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        exp = want[name].reshape(got.shape)
        off = (got.double() - exp).abs() > (0.5 * eps + 1e-6) * exp.abs()
        assert off.double().mean() <= (0 if dtype == torch.bfloat16 else 0.01), name


# ------------------------------------------------------------------------------------------------
# which kernels run it, and their configs


@pytest.mark.parametrize("dtype", [torch.float32, *HALVES, torch.float64], ids=str)
def test_policy_per_dtype_and_path(dtype):
    """The half policy is the default for fp16/bf16 inputs of the non-causal kernels (and asked
    for as "half"); fp32 stays exact unless TF32 is asked for, fp64 is fp64, and the causal
    kernels keep tf32x3 for fp16/bf16."""
    from rfattn.kernels.common import HALF_PRECISIONS, LOW_PRECISION, launch_setup

    x = torch.zeros(1, 1, 4, 16, dtype=dtype)
    rf = rfattn.RandomFeatures(16, 16, seed=0)
    form = rf.feature_map.kernel_form(rf.weight)
    half = HALF_PRECISIONS.get(dtype)
    assert launch_setup(x, x, x, form, 0.25, None).precision == (half or "ieee")
    assert launch_setup(x, x, x, form, 0.25, None, causal=True).precision == (
        LOW_PRECISION if half else "ieee")  # fmt: skip
    assert launch_setup(x, x, x, form, 0.25, None, precision="tf32").precision == "tf32"
    if half:
        assert launch_setup(x, x, x, form, 0.25, None, precision="half").precision == half
    else:
        with pytest.raises(ValueError, match="half"):
            launch_setup(x, x, x, form, 0.25, None, precision="half")


def test_half_policy_configs_do_not_spill():
    """The autotuner offers the half policy only BT 64 at 8 warps, the one config without spills
    on sm_90 for the GERF family (``tests/test_compile.py`` compiles it for every form); fp32
    keeps every BT >= 32."""
    import triton
    import triton.language as tl
    from rfattn.kernels.common import PRUNE

    configs = [triton.Config({"BT": bt}, num_warps=w) for bt in (32, 64, 128) for w in (4, 8)]
    prune = PRUNE["early_config_prune"]
    kept = prune(configs, {}, PRECISION="bf16", ACC=tl.float32)
    assert [(c.kwargs["BT"], c.num_warps) for c in kept] == [(64, 8)]
    assert len(prune(configs, {}, PRECISION="ieee", ACC=tl.float32)) == len(configs)
