"""FP8 GEMMs on the CPU: whichever call this CPU takes, the numbers of torch's float32 fallback."""

import re
import time

import pytest
import torch

from hf_fp8.numerics.cpu_gemm import choose_call, cpu_fp8_mm, cpu_gemm_choices, emulated_fp8_mm
from hf_fp8.numerics.gemm import fp8_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRINGS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)]


def operands(m: int, k: int, n: int, a_dtype: torch.dtype, b_dtype: torch.dtype, seed: int = 0):
    """Real FP8 casts of normal values: ``a`` row-major (m, k), ``b`` column-major (k, n)."""
    generator = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=generator) * 20).to(a_dtype)
    b = (torch.randn(n, k, generator=generator) * 20).to(b_dtype).t()
    return a, b


@pytest.mark.parametrize(("a_dtype", "b_dtype"), PAIRINGS)
@pytest.mark.parametrize("shape", [(16, 64, 32), (512, 576, 576), (48, 1536, 400)])
def test_every_pairing_gives_the_float32_fallbacks_bits_tensorwise(a_dtype, b_dtype, shape):
    a, b = operands(*shape, a_dtype, b_dtype)
    a_inverse, b_inverse = torch.tensor(0.0173), torch.tensor(3.31)  # no powers of two
    for out_dtype in (torch.float32, torch.bfloat16):
        expected = emulated_fp8_mm(a, b, a_inverse, b_inverse, out_dtype)
        assert torch.equal(fp8_mm(a, b, a_inverse, b_inverse, out_dtype), expected)
        if choices_of(a_dtype, b_dtype).call == "scaled_mm":  # torch's own call: today's results
            assert torch.equal(torch._scaled_mm(a, b, a_inverse, b_inverse, out_dtype=out_dtype), expected)


def choices_of(a_dtype: torch.dtype, b_dtype: torch.dtype):
    names = {E4M3: "E4M3", E5M2: "E5M2"}
    return cpu_gemm_choices()[f"{names[a_dtype]} x {names[b_dtype]}, tensor-wise scales"]


def test_rowwise_scales_give_the_float32_fallbacks_bits():
    a, b = operands(96, 256, 80, E4M3, E4M3)
    generator = torch.Generator().manual_seed(1)
    a_inverse, b_inverse = (
        torch.rand(96, 1, generator=generator) + 0.1,
        torch.rand(1, 80, generator=generator),
    )
    for out_dtype in (torch.float32, torch.bfloat16):
        expected = emulated_fp8_mm(a, b, a_inverse, b_inverse, out_dtype)
        assert torch.equal(cpu_fp8_mm(a, b, a_inverse, b_inverse, out_dtype), expected)


@pytest.mark.parametrize(("a_dtype", "b_dtype"), PAIRINGS)
def test_the_product_is_exact_where_float32_sums_are(a_dtype, b_dtype):
    """Small integers and power-of-two scales: every partial sum is exact in float32, whatever order a
    kernel adds in, so each CPU's result must equal the product computed in float64."""
    generator = torch.Generator().manual_seed(2)
    a = torch.randint(-8, 9, (64, 128), generator=generator).float().to(a_dtype)
    b = torch.randint(-8, 9, (32, 128), generator=generator).float().to(b_dtype).t()
    a_inverse, b_inverse = torch.tensor(0.25), torch.tensor(8.0)
    expected = (a.double() * 0.25) @ (b.double() * 8.0)
    assert torch.equal(fp8_mm(a, b, a_inverse, b_inverse, torch.float32).double(), expected)


def test_the_choice_names_a_call_and_why_for_every_pairing():
    choices = cpu_gemm_choices()
    assert len(choices) == 5
    for pairing, choice in choices.items():
        assert choice.call in ("scaled_mm", "scaled_mm_rowwise_scales", "emulated"), pairing
        assert "probe" in choice.reason and " ms" in choice.reason


def probe_product():
    a, b = operands(64, 128, 128, E4M3, E4M3)
    a_inverse, b_inverse = torch.tensor(0.0371), torch.tensor(1.913)

    def emulation(dtype):
        return emulated_fp8_mm(a, b, a_inverse, b_inverse, dtype)

    def scales_after_the_gemm(dtype):  # another real FP8 product: the same values, other roundings
        return ((a.float() @ b.float()) * (a_inverse * b_inverse)).to(dtype)

    def slow(dtype):  # the right bits, at the pace of a reference kernel (slower than the emulation
        time.sleep(0.1)  # even on a loaded 2-core machine, where that can take milliseconds)
        return emulation(dtype)

    def unavailable(dtype):
        raise RuntimeError("no CPU kernel for this pairing")

    return emulation, scales_after_the_gemm, slow, unavailable


def test_a_call_with_other_bits_or_much_slower_is_passed_over_with_the_reason():
    emulation, other_bits, slow, unavailable = probe_product()
    assert not torch.equal(other_bits(torch.float32), emulation(torch.float32))  # the test can fail
    choice = choose_call({"scaled_mm": other_bits, "scaled_mm_rowwise_scales": emulation}, emulation)
    assert choice.call == "scaled_mm_rowwise_scales"
    assert "passed over: scaled_mm other bits than the emulation" in choice.reason
    choice = choose_call({"scaled_mm": slow, "scaled_mm_rowwise_scales": unavailable}, emulation)
    assert choice.call == "emulated"
    assert re.search(r"passed over: scaled_mm (\d+)\.\d\d ms, \d+x slower", choice.reason), choice.reason
    assert "scaled_mm_rowwise_scales unavailable (no CPU kernel for this pairing)" in choice.reason


def test_a_call_as_fast_with_the_same_bits_is_taken():
    emulation, *_ = probe_product()
    assert choose_call({"scaled_mm": emulation}, emulation).call == "scaled_mm"


def test_compiled_code_takes_the_same_call_with_the_same_bits():
    a, b = operands(32, 64, 48, E4M3, E5M2)
    a_inverse, b_inverse = torch.tensor(0.5), torch.tensor(0.125)
    compiled = torch.compile(fp8_mm, fullgraph=True, backend="aot_eager")
    eager = fp8_mm(a, b, a_inverse, b_inverse, torch.bfloat16)
    assert torch.equal(compiled(a, b, a_inverse, b_inverse, torch.bfloat16), eager)
