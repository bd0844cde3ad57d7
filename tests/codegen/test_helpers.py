"""The elementwise helpers every template includes, run as kernels against float64 torch."""

import pytest
import torch

from fuser.cache import load_kernel
from fuser.codegen.render import helpers_source
from fuser.codegen.source import KernelSource

EPS = torch.finfo(torch.float32).eps
BLOCK = 1024


def helper_kernel(name: str, extra: str = "") -> KernelSource:
    """A kernel that writes ``name(x)`` (``name(x, extra)``) of each fp32 element of ``x``
    into ``out``."""
    text = f"""import triton
import triton.language as tl

{helpers_source()}


@triton.jit
def apply(x, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out + i, {name}(tl.load(x + i, mask=i < n, other=0.0){extra}), mask=i < n)
"""
    return KernelSource(
        text=text,
        entry="apply",
        signature=(("x", "*fp32"), ("out", "*fp32"), ("n", "i32")),
        constexprs=(("BLOCK", BLOCK),),
        num_warps=4,
        num_stages=1,
    )


def run_helper(name: str, x: torch.Tensor, extra: str = "") -> torch.Tensor:
    out = torch.full_like(x, 1234.5)  # poisoned: every element must be written
    kernel = load_kernel(helper_kernel(name, extra), x.device)
    kernel(((x.numel() + BLOCK - 1) // BLOCK,), x, out, x.numel())
    return out


def tanh_inputs(device) -> torch.Tensor:
    """Fresh random inputs over tanh's whole range: tiny, around the switch between the
    series and the exponential (0.3), the bulk, and where fp32 rounds tanh to +-1."""
    n = 3000
    sign = torch.where(torch.rand(5 * n) < 0.5, -1.0, 1.0)
    magnitude = torch.cat(
        [
            torch.rand(n) * 1e-3,
            0.3 + (torch.rand(n) - 0.5) * 2e-3,
            torch.rand(n) * 0.6,
            torch.rand(n) * 6.0,
            6.0 + torch.rand(n) * 30.0,
        ]
    )
    return (sign * magnitude).float().to(device)


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tanh_is_within_a_few_ulp_of_float64(where):
    x = tanh_inputs(where)
    got = run_helper("_tanh", x).double().cpu()
    want = torch.tanh(x.double().cpu())
    rel = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    assert rel <= 4 * EPS, f"_tanh: {rel / EPS:.1f} fp32 ulp from float64 tanh"
    # odd: tanh(-x) == -tanh(x) bit for bit, so a softcap keeps logits' symmetry
    assert torch.equal(run_helper("_tanh", -x).cpu(), -got.float())


@pytest.mark.parametrize("where", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tanh_at_the_edges(where):
    inf = float("inf")
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.3, -0.3, 89.0, -89.0, inf, -inf, float("nan")])
    got = run_helper("_tanh", x.to(where)).cpu()
    want = torch.tanh(x.double()).float()
    finite = ~want.isnan()
    assert torch.allclose(got[finite], want[finite], rtol=4 * EPS, atol=0.0)
    assert got[-1].isnan()


# tanh.approx.f32's relative error (PTX ISA: "maximum relative error 2^-10.987")
APPROX_TANH_BOUND = 2**-10.987


@pytest.mark.gpu
def test_approx_tanh_is_within_its_documented_error_on_gpu():
    x = tanh_inputs("cuda")
    got = run_helper("_approx_tanh", x, ", False").double().cpu()
    want = torch.tanh(x.double().cpu())
    rel = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    assert rel <= APPROX_TANH_BOUND, rel
    # not the exact helper under another name: the one instruction's error shows
    assert not torch.equal(got.float(), run_helper("_tanh", x).cpu())
    edges = torch.tensor([0.0, 30.0, -30.0, float("inf"), -float("inf"), float("nan")], device="cuda")
    out = run_helper("_approx_tanh", edges, ", False").cpu()
    assert out[:5].tolist() == [0.0, 1.0, -1.0, 1.0, -1.0] and out[5].isnan()


def test_approx_tanh_is_the_exact_helper_in_the_interpreter():
    # (the interpreter runs no assembly)
    x = tanh_inputs("cpu")
    assert torch.equal(run_helper("_approx_tanh", x, ", True"), run_helper("_tanh", x))
