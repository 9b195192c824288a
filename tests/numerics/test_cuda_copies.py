"""The Triton copies of FSDP2's FP8 all-gather (:mod:`hf_fp8.numerics.cuda_copies`), the block recipe's
fused backward casts (:mod:`hf_fp8.numerics.block_casts`) and the weight gradient's per-column casts
(:mod:`hf_fp8.numerics.column_casts`)
against the torch ops they replace, bit for bit, on the GPU; the CPU side of the same entry points runs
everywhere."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_fp8.formats import E4M3, E5M2, cast_to_fp8, compute_scale
from hf_fp8.layers.fsdp import shard_in_fp8
from hf_fp8.numerics.block_casts import fused_cast_blocks_transposed
from hf_fp8.numerics.blockwise import cast_blocks, cast_blocks_transposed, cast_tiles, cast_tiles_transposed
from hf_fp8.numerics.column_casts import fused_cast_columns
from hf_fp8.numerics.gemm import column_major_copy, pad_rows, transposed_fp8
from hf_fp8.numerics.rowwise import cast_columns, cast_rows


def awkward_values(rows: int, columns: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Normal values, values past the format's range at the scale used, tiny ones, zeros and a NaN."""
    generator = torch.Generator().manual_seed(rows * columns)
    values = torch.randn(rows, columns, generator=generator) * 3
    values.view(-1)[::7] *= 1e4  # saturate
    values.view(-1)[1::11] *= 1e-6  # subnormal or flushed to zero
    values.view(-1)[2::13] = 0
    values.view(-1)[-1] = float("nan")
    return values.to(dtype).to(device)


def test_a_shard_is_cast_and_padded_with_zero_rows():
    values = awkward_values(5, 32, torch.bfloat16, "cpu")
    scale = compute_scale(torch.tensor(4.0), E4M3)
    shard = shard_in_fp8(values, scale, E4M3, rows=8)
    assert shard.dtype == E4M3.dtype and shard.shape == (8, 32)
    assert torch.equal(shard[:5].view(torch.uint8), cast_to_fp8(values, scale, E4M3).view(torch.uint8))
    assert not shard[5:].view(torch.uint8).any()


def test_a_column_major_copy_holds_the_same_values():
    t = awkward_values(48, 80, torch.float32, "cpu").to(E4M3.dtype)
    copied = column_major_copy(t, torch.empty(0))
    assert copied.stride() == (1, 48)
    assert torch.equal(copied.view(torch.uint8), t.view(torch.uint8))


def test_the_output_heads_transposed_gradient_holds_the_same_values():
    t = awkward_values(48, 80, torch.float32, "cpu").to(E5M2.dtype)
    transposed = transposed_fp8(t)
    assert transposed.shape == (80, 48) and transposed.is_contiguous()
    assert torch.equal(transposed.view(torch.uint8), t.t().contiguous().view(torch.uint8))


def test_each_matrix_of_a_3d_stack_is_transposed():  # MoE experts' weights: (experts, out, in)
    t = awkward_values(3 * 48, 80, torch.float32, "cpu").to(E4M3.dtype).view(3, 48, 80)
    transposed = transposed_fp8(t)
    assert transposed.shape == (3, 80, 48) and transposed.is_contiguous()
    for expert in range(3):
        assert torch.equal(transposed[expert].view(torch.uint8), t[expert].t().contiguous().view(torch.uint8))
    with pytest.raises(ValueError, match="4-D"):
        transposed_fp8(t.view(3, 2, 24, 80))


def test_a_transposed_tile_cast_pads_the_rows_to_16_with_zeros_and_keeps_the_nan_in_its_amax():
    values = awkward_values(20, 300, torch.bfloat16, "cpu")
    rows_fp8, row_scales, t_fp8, t_scales, amax = cast_tiles_transposed(values, E4M3, 0, with_rows=True)
    assert rows_fp8.shape == (20, 300) and row_scales.shape == (20, 3)
    assert t_fp8.shape == (300, 32) and t_scales.shape == (300, 1)
    assert not t_fp8[:, 20:].view(torch.uint8).any()
    unpadded = cast_tiles(values.t(), E4M3, 0)[0]
    assert torch.equal(t_fp8[:, :20].contiguous().view(torch.uint8), unpadded.view(torch.uint8))
    assert amax.isnan()
    assert cast_tiles_transposed(values, E4M3, 0, with_rows=False)[:2] == (None, None)


def assert_padded_row_tiles(
    tiles: torch.Tensor, scales: torch.Tensor, want: torch.Tensor, want_scales: torch.Tensor
) -> None:
    """The fused casts' row tiles are ``cast_tiles``'s to the bit, then zeros up to whole groups of 4
    tiles (512 columns), with scales of 1: what cuBLAS's block kernels contract over."""
    rows, columns = want.shape
    width = columns + -columns % 512
    assert tiles.shape == (rows, width) and scales.shape == (rows, width // 128)
    assert torch.equal(tiles[:, :columns].view(torch.uint8), want.view(torch.uint8))
    assert not tiles[:, columns:].view(torch.uint8).any()
    assert torch.equal(scales[:, : want_scales.shape[1]], want_scales)
    assert (scales[:, want_scales.shape[1] :] == 1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize(("rows", "columns"), [(1, 16), (200, 576), (1000, 77), (4096, 1024)])
def test_gpu_the_fused_tile_casts_are_the_torch_casts_to_the_bit(fmt, margin, rows, columns):
    from hf_fp8.numerics.triton_kernels import cast_tiles_both

    values = awkward_values(rows, columns, torch.bfloat16, "cuda")
    values[-1, -1] = 0.5  # the NaN goes to a tile of its own, so the others are compared value for value
    values[rows // 2, 0] = float("nan")
    target = fmt.max / 2.0**margin
    padded = pad_rows(values)
    torch._dynamo.reset()  # one lambda compiled per case
    rows_fp8, row_scales, t_fp8, t_scales, tile_amaxes = cast_tiles_both(
        values, fmt.dtype, fmt.max, target, True
    )
    assert_padded_row_tiles(rows_fp8, row_scales, *cast_tiles(values, fmt, margin)[:2])
    want, want_scales, _ = cast_tiles(padded.t(), fmt, margin)
    assert t_fp8.shape == want.shape and t_scales.shape == want_scales.shape
    assert torch.equal(t_fp8.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(t_scales, want_scales)
    magnitudes = F.pad(values.float(), (0, -columns % 64, 0, -rows % 128)).abs()
    tiles = magnitudes.view(magnitudes.shape[0] // 128, 128, magnitudes.shape[1] // 64, 64)
    assert torch.equal(tile_amaxes.nan_to_num(-1.0), tiles.amax(dim=(1, 3)).nan_to_num(-1.0))
    assert tile_amaxes.isnan().sum() == 1
    compiled = torch.compile(lambda t: cast_tiles_transposed(t, fmt, margin, with_rows=False), fullgraph=True)
    none, _, t_compiled, t_scales_compiled, amax = compiled(values)
    assert none is None and torch.equal(t_compiled.view(torch.uint8), t_fp8.view(torch.uint8))
    assert torch.equal(t_scales_compiled, t_scales) and amax.isnan()


def test_a_column_cast_is_each_columns_cast_transposed_with_zero_rows_up_to_16():
    values = awkward_values(20, 300, torch.bfloat16, "cpu")
    fp8, scales, amax = cast_columns(values, E5M2, 1)
    assert fp8.shape == (300, 32) and fp8.is_contiguous() and scales.shape == (300, 1)
    assert not fp8[:, 20:].view(torch.uint8).any()
    column_amaxes = values.float().abs().amax(dim=0, keepdim=True).t()
    want = cast_to_fp8(values.t(), compute_scale(column_amaxes, E5M2, 1), E5M2)
    assert torch.equal(fp8[:, :20].contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
    assert amax.isnan()


def test_a_weight_cast_in_blocks_for_the_input_gradient_is_its_blocks_transposed():
    values = awkward_values(300, 200, torch.bfloat16, "cpu")
    t_fp8, t_scales, amax = cast_blocks_transposed(values, E4M3, 1)
    want, want_scales = cast_blocks(values, E4M3, 1)
    assert t_fp8.shape == (200, 300) and t_fp8.is_contiguous() and t_scales.shape == (2, 3)
    assert torch.equal(t_fp8.view(torch.uint8), want.t().contiguous().view(torch.uint8))
    assert torch.equal(t_scales, want_scales.t()) and amax.isnan()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize(("rows", "columns"), [(1, 16), (200, 576), (1000, 77), (3000, 1280)])
def test_gpu_the_fused_block_cast_is_the_torch_cast_transposed_to_the_bit(fmt, margin, rows, columns):
    """One read of the weight: its 128x128 blocks cast and written transposed, the rows padded with zeros
    to whole groups of 4 blocks (scales of 1 there), as the input gradient's GEMM takes them."""
    values = awkward_values(rows, columns, torch.bfloat16, "cuda")
    values[-1, -1] = 0.5  # the NaN goes to a block of its own, the others compare by value
    values[0, 0] = float("nan")
    t_fp8, t_scales, amax = fused_cast_blocks_transposed(values, fmt, margin)
    want, want_scales = cast_blocks(values, fmt, margin)
    padded = rows + -rows % 512
    assert t_fp8.shape == (columns, padded) and t_fp8.is_contiguous()
    assert t_scales.shape == (want_scales.shape[1], padded // 128)
    assert torch.equal(t_fp8[:, :rows].view(torch.uint8), want.t().contiguous().view(torch.uint8))
    assert not t_fp8[:, rows:].view(torch.uint8).any()
    kept = want_scales.shape[0]
    assert torch.equal(t_scales[:, :kept], want_scales.t()) and (t_scales[:, kept:] == 1).all()
    assert amax.isnan()
    torch._dynamo.reset()  # one lambda compiled per case
    compiled = torch.compile(lambda t: cast_blocks_transposed(t, fmt, margin), fullgraph=True)
    compiled_fp8, compiled_scales, _ = compiled(values)
    assert torch.equal(compiled_fp8.view(torch.uint8), t_fp8.view(torch.uint8))
    assert torch.equal(compiled_scales, t_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize(("rows", "columns"), [(1, 16), (200, 576), (1000, 77), (3000, 1280)])
def test_gpu_the_fused_column_casts_are_the_torch_casts_to_the_bit(fmt, margin, rows, columns):
    values = awkward_values(rows, columns, torch.bfloat16, "cuda")
    values[-1, -1] = 0.5  # the NaN goes to a column and a tile of its own, the others compare by value
    values[rows // 2, 0] = float("nan")
    fp8, scales, amax, tiles, tile_scales = fused_cast_columns(values, fmt, margin, with_row_tiles=True)
    want, want_scales, _ = cast_rows(pad_rows(values).t(), fmt, margin)
    assert fp8.shape == want.shape and fp8.is_contiguous()
    assert torch.equal(fp8.view(torch.uint8), want.contiguous().view(torch.uint8))
    assert torch.equal(scales, want_scales) and amax.isnan()
    assert_padded_row_tiles(tiles, tile_scales, *cast_tiles(values, fmt, margin)[:2])
    torch._dynamo.reset()  # one lambda compiled per case
    compiled = torch.compile(lambda t: cast_columns(t, fmt, margin), fullgraph=True)
    compiled_fp8, compiled_scales, compiled_amax = compiled(values)
    assert torch.equal(compiled_fp8.view(torch.uint8), fp8.view(torch.uint8))
    assert torch.equal(compiled_scales, scales) and compiled_amax.isnan()
    assert fused_cast_columns(values, fmt, margin, with_row_tiles=False)[3:] == (None, None)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "columns"), [(1, 16), (37, 4096), (512, 14336)])
def test_gpu_the_shard_cast_is_the_torch_cast_to_the_bit(fmt, dtype, rows, columns):
    values = awkward_values(rows, columns, dtype, "cuda")
    scale = compute_scale(torch.tensor(50.0, device="cuda"), fmt)
    padded = rows + 3
    shard = shard_in_fp8(values, scale, fmt, rows=padded)
    expected = cast_to_fp8(values, scale, fmt)
    assert torch.equal(shard[:rows].view(torch.uint8), expected.view(torch.uint8))
    assert not shard[rows:].view(torch.uint8).any()
    assert shard[:rows].float().isnan().sum() == 1


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize(("rows", "columns"), [(1, 1), (16, 4096), (1000, 77), (4096, 14336)])
def test_gpu_the_column_major_copy_is_the_torch_transpose(fmt, rows, columns):
    t = awkward_values(rows, columns, torch.float32, "cuda").to(fmt.dtype)
    after = torch.empty(1, device="cuda")
    copied = column_major_copy(t, after)
    assert copied.shape == t.shape and copied.stride() == (1, rows)
    assert torch.equal(copied.contiguous().view(torch.uint8), t.view(torch.uint8))
    compiled = torch.compile(lambda w, a: column_major_copy(w, a), fullgraph=True)
    assert torch.equal(compiled(t, after).contiguous().view(torch.uint8), t.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize(("rows", "columns"), [(1, 1), (16, 4096), (1000, 77), (8192, 50304)])
def test_gpu_the_output_heads_transposed_gradient_is_the_torch_transpose(fmt, rows, columns):
    t = awkward_values(rows, columns, torch.float32, "cuda").to(fmt.dtype)
    expected = t.t().contiguous().view(torch.uint8)
    assert torch.equal(transposed_fp8(t).view(torch.uint8), expected)
    compiled = torch.compile(lambda g: transposed_fp8(g * 1), fullgraph=True)  # behind a fused op
    assert torch.equal(compiled(t.view(torch.uint8)).view(torch.uint8), expected)


@pytest.mark.gpu
@pytest.mark.parametrize(("experts", "rows", "columns"), [(1, 16, 16), (8, 1000, 77), (64, 2048, 1024)])
def test_gpu_a_stack_of_expert_matrices_is_transposed_matrix_by_matrix(experts, rows, columns):
    t = (
        awkward_values(experts * rows, columns, torch.float32, "cuda")
        .to(E4M3.dtype)
        .view(experts, rows, columns)
    )
    expected = t.transpose(-2, -1).contiguous().view(torch.uint8)
    assert torch.equal(transposed_fp8(t).view(torch.uint8), expected)
