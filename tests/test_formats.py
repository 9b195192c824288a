import math

import pytest
import torch

from hf_fp8.formats import E4M3, E5M2, cast_to_fp8, cast_to_representable, compute_scale, get_format


def fp8_grid(fmt) -> torch.Tensor:
    """Every finite value of the format, sorted, from all 256 bit patterns."""
    values = torch.arange(256, dtype=torch.uint8).view(fmt.dtype).double()
    return torch.unique(values[torch.isfinite(values)])


def test_format_limits_match_torch():
    assert E4M3.max == torch.finfo(torch.float8_e4m3fn).max == 448.0
    assert E5M2.max == torch.finfo(torch.float8_e5m2).max == 57344.0
    assert fp8_grid(E4M3).max() == 448.0 and fp8_grid(E5M2).max() == 57344.0
    assert get_format("E5M2") is E5M2 and get_format(E4M3) is E4M3
    with pytest.raises(ValueError, match="unknown FP8 format 'fp4'"):
        get_format("fp4")


@pytest.mark.parametrize(
    ("amax", "fmt", "margin", "expected"),
    [
        (2.0, "e4m3", 0, 224.0),  # 448 / 2
        (2.0, "e4m3", 1, 112.0),  # 448 / (2 * 2)
        (0.5, "e4m3", 0, 896.0),
        (4.0, "e5m2", 0, 14336.0),  # 57344 / 4
        (4.0, "e5m2", 2, 3584.0),  # 57344 / (4 * 4)
        (448.0, "e4m3", 0, 1.0),
        (3.0, "e4m3", 0, 448.0 / 3.0),
    ],
)
def test_scale_math_by_hand(amax, fmt, margin, expected):
    scale = compute_scale(torch.tensor(amax), fmt, margin)
    assert scale.dtype == torch.float32
    assert scale.item() == pytest.approx(expected, rel=1e-7)


def test_scale_keeps_previous_when_amax_is_useless():
    previous = torch.tensor([5.0, 6.0, 7.0])
    amax = torch.tensor([0.0, math.inf, math.nan])
    assert torch.equal(compute_scale(amax, "e4m3", 0, previous), previous)
    assert torch.equal(compute_scale(amax, "e4m3"), torch.ones(3))


def test_scale_of_tiny_amax_is_clamped_to_float32_max():
    scale = compute_scale(torch.tensor(1e-45), "e5m2")
    assert torch.isfinite(scale) and scale.item() == torch.finfo(torch.float32).max


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_saturating_cast(fmt):
    x = torch.tensor([1e9, -1e9, math.inf, -math.inf, fmt.max * 1.01, 1.0, math.nan])
    out = cast_to_fp8(x, 1.0, fmt).float()
    assert out[:5].tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max, fmt.max]
    assert out[5] == 1.0
    assert torch.isnan(out[6]), "NaN must stay visible"


def test_cast_applies_scale():
    x = torch.tensor([1.0, -0.25])
    assert cast_to_fp8(x, torch.tensor(4.0), E4M3).float().tolist() == [4.0, -1.0]


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_to_representable_rounds_to_nearest_grid_value(fmt):
    grid = fp8_grid(fmt)
    torch.manual_seed(0)
    # Values across the whole range, subnormals included, both signs.
    exponents = torch.empty(4000).uniform_(math.log2(grid[grid > 0].min().item()) - 1, math.log2(fmt.max))
    x = (2.0**exponents) * torch.sign(torch.randn(4000))
    out = cast_to_representable(x.double(), fmt, scale=1.0)
    assert out.dtype == torch.float64
    distance = (x.double()[:, None] - grid[None, :]).abs()
    nearest = distance.min(dim=1).values
    assert torch.isin(out, grid).all(), "every result must be on the FP8 grid"
    assert torch.equal((x.double() - out).abs(), nearest), "and the nearest grid value"


@pytest.mark.parametrize("fmt", [E4M3, E5M2])
def test_cast_to_representable_with_own_scale(fmt):
    torch.manual_seed(1)
    x = torch.randn(1000) * 1e-3
    x[0] = 1e-14  # deep in the subnormal range at this scale
    out = cast_to_representable(x, fmt)
    scale = compute_scale(x.abs().max(), fmt)
    assert out.dtype == x.dtype
    # Normal range: relative error at most half a mantissa step; subnormal range: absolute error at
    # most half the subnormal spacing (both divided by the scale).
    mantissa_bits, min_normal_exp = {E4M3: (3, -6), E5M2: (2, -14)}[fmt]
    scaled = x.abs() * scale
    normal = scaled >= 2.0**min_normal_exp
    assert normal.any() and (~normal).any()
    rel = ((out - x).abs() / x.abs())[normal]
    assert rel.max().item() <= 2.0 ** -(mantissa_bits + 1) * (1 + 1e-6)
    half_subnormal_step = 2.0 ** (min_normal_exp - mantissa_bits - 1) / scale
    assert ((out - x).abs()[~normal] <= half_subnormal_step * (1 + 1e-6)).all()
    # Idempotent: representable values stay put.
    assert torch.equal(cast_to_representable(out, fmt), out)
