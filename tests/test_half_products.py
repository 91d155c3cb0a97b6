"""Half-precision tensor products (``kernels/common.py: round_bf16, round_half, half_dot``) against
torch's own rounding: under the interpreter they are an emulation of the GPU's bf16/fp16 products
(round to nearest even, exact products, fp32 sums), on a GPU the products themselves."""

import pytest
import torch
import triton
import triton.language as tl
from rfattn.kernels.common import half_dot, round_bf16

HALVES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _round_kernel(x_ptr, y_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(y_ptr + o, round_bf16(tl.load(x_ptr + o)))


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, R: tl.constexpr, K: tl.constexpr, C: tl.constexpr,
                HALF: tl.constexpr):  # fmt: skip
    r, k, c = tl.arange(0, R), tl.arange(0, K), tl.arange(0, C)
    a = tl.load(a_ptr + r[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * C + c[None, :])
    tl.store(c_ptr + r[:, None] * C + c[None, :], half_dot(a, b, HALF))


def _awkward_fp32(device) -> torch.Tensor:
    """fp32 values where rounding to bf16 is easy to get wrong: exact ties to even and to odd
    (a bf16 value plus half its last place), one ulp either side of a tie, subnormals, signed
    zeros, the largest bf16 and the fp32 values past it that round to infinity, infinities, NaN,
    and ordinary values over many magnitudes."""
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(256, generator=g) * 2.0 ** torch.randint(-30, 30, (256,), generator=g))
    bits = base.to(torch.bfloat16).float().view(torch.int32)
    tie = (bits + 0x8000).view(torch.float32)  # halfway to the next bf16: both parities occur
    near = torch.cat([(bits + 0x8000 + d).view(torch.float32) for d in (-1, 1)])
    big = torch.finfo(torch.bfloat16).max
    special = torch.tensor([0.0, -0.0, 1e-40, -3e-39, 1e-45, big, -big, 3.3961e38, 3.4e38,
                            float("inf"), -float("inf"), float("nan"), 1.0, -1.0])  # fmt: skip
    x = torch.cat([base, tie, near, special])
    return x[: 1 << (x.numel().bit_length() - 1)].to(device)  # a power of two for tl.arange


def test_round_bf16_is_torchs_rounding(kernel_device):
    x = _awkward_fp32(kernel_device)
    y = torch.empty_like(x)
    _round_kernel[(1,)](x, y, N=x.numel())
    want = x.to(torch.bfloat16).float()
    nan = want.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int32), want[~nan].view(torch.int32))  # bit for bit
    # the ties are there and both parities round (a truncating cast gets the odd ones wrong)
    assert (x[256:512].view(torch.int32) & 0xFFFF == 0x8000).all()
    assert (y[256:512] != x[256:512].view(torch.int32).bitwise_and(~0xFFFF).view(
        torch.float32)).any()  # fmt: skip


@pytest.mark.parametrize("half", list(HALVES), ids=str)
def test_half_dot_is_one_rounded_product(half, kernel_device):
    g = torch.Generator().manual_seed(1)
    R, K, C = 32, 64, 16
    a = torch.randn(R, K, generator=g).to(kernel_device)
    b = (torch.randn(K, C, generator=g) * 3).to(kernel_device)
    out = torch.empty(R, C, device=kernel_device)
    _dot_kernel[(1,)](a, b, out, R=R, K=K, C=C, HALF=HALVES[half])
    # the exact product of the rounded operands; fp32 sums of K terms differ from it by at most
    # ~K eps32 of sum |a_i b_i|
    want = a.to(half).double() @ b.to(half).double()
    bound = a.to(half).double().abs() @ b.to(half).double().abs()
    err = ((out.double() - want).abs() / bound).max().item()
    assert err <= K * 2.0**-24
    # and rounding the operands mattered: the unrounded product is far from it
    unrounded = ((a.double() @ b.double() - want).abs() / bound).max().item()
    assert unrounded > 10 * K * 2.0**-24
