"""Triton kernels: behind :mod:`hf_fp8.numerics.cuda_copies` a saturating FP8 cast and a one-byte
transpose, one pass each; behind :func:`hf_fp8.numerics.blockwise.cast_tiles_transposed` the block recipe's
backward casts (a tensor in 1x128 tiles of its rows and of its columns, one read; a weight in
128x128 blocks, written transposed, one read); behind
:mod:`hf_fp8.numerics.column_casts` the weight gradient's per-column casts (two reads: the columns'
amaxes, then the cast, transposed, with the rows' 1x128 tiles if asked). Imported only for
CUDA tensors where Triton is installed (it comes with PyTorch's CUDA builds on Linux, not with the CPU
build).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_fp8.formats import FP8_ALIGNMENT, Fp8Format

__all__ = [
    "cast_blocks_transposed",
    "cast_blocks_transposed_outputs",
    "cast_columns_transposed",
    "cast_columns_transposed_outputs",
    "cast_tiles_both",
    "cast_tiles_both_outputs",
    "saturating_cast",
    "transposed_copy",
]

_CAST_BLOCK = 4096
_TILE = 64
_SCALE_TILE = 128  # the block recipe's tile: 1 x 128 values share a scale
# row tiles come in whole groups of four, zeros after the values (and scales of 1): the contraction
# cuBLAS's 128x128 block kernels take (hf_fp8.numerics.blockwise.block_mm)
_ROW_TILE_GROUP = 4 * _SCALE_TILE
_AMAX_COLUMNS = 64
_AMAX_ROWS = 1024  # the rows one program of the column amaxes reads, TILE at a time
_FLOAT32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _saturating_cast_kernel(source, target, scale, count, fp8_max, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < count
    scaled = tl.load(source + offsets, mask=inside).to(tl.float32) * tl.load(scale)
    clamped = tl.clamp(scaled, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
    tl.store(target + offsets, clamped.to(target.dtype.element_ty), mask=inside)


@triton.jit
def _transpose_kernel(source, target, rows, columns, TILE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    column = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    matrix = tl.program_id(2).to(tl.int64) * rows * columns  # the offset of this matrix of the batch
    inside = (row[:, None] < rows) & (column[None, :] < columns)
    tile = tl.load(source + matrix + row[:, None] * columns + column[None, :], mask=inside)
    tl.store(target + matrix + column[None, :] * rows + row[:, None], tile, mask=inside)


def saturating_cast(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, out: torch.Tensor) -> torch.Tensor:
    """Write ``fp8(x * scale)``, clamped to the format's largest finite value (NaN stays NaN), into
    ``out``: what :func:`hf_fp8.formats.cast_to_fp8` computes, bit for bit, in one pass. ``x`` and
    ``out`` are contiguous, of the same number of values; ``scale`` is a float32 scalar tensor."""
    count = x.numel()
    if count:
        grid = (triton.cdiv(count, _CAST_BLOCK),)
        _saturating_cast_kernel[grid](x, out, scale, count, fmt.max, BLOCK=_CAST_BLOCK)
    return out


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.transpose(-2, -1).contiguous()`` for a contiguous 2-D or 3-D (a batch of matrices) tensor of
    one-byte values."""
    *batch, rows, columns = t.shape
    source = t.view(torch.uint8)
    target = torch.empty((*batch, columns, rows), dtype=torch.uint8, device=t.device)
    if t.numel():
        grid = (triton.cdiv(rows, _TILE), triton.cdiv(columns, _TILE), batch[0] if batch else 1)
        _transpose_kernel[grid](source, target, rows, columns, TILE=_TILE)
    return target.view(t.dtype)


@triton.jit
def _max_keeping_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tile_scale(amax, target):
    """:func:`hf_fp8.formats.compute_scale` with no previous scale: 1 where the amax is zero or not
    finite, the largest float32 where the quotient overflows."""
    scale = tl.minimum(tl.math.div_rn(1.0, amax) * target, _FLOAT32_MAX)  # torch: amax.reciprocal() * target
    usable = (amax > 0) & (amax < float("inf"))  # False for NaN too
    return tl.where(usable, scale, 1.0)


@triton.jit
def _cast_tiles_both_kernel(
    source, rows_out, row_scales, columns_out, column_scales, amaxes,
    rows, columns, padded_rows, row_width, fp8_max, target,
    WITH_ROWS: tl.constexpr, TILE: tl.constexpr, COLUMNS: tl.constexpr, AMAX_COLUMNS: tl.constexpr,
):  # fmt: skip
    # one program: TILE rows x COLUMNS columns (COLUMNS == TILE with the row tiles)
    tile_row, tile_column = tl.program_id(0), tl.program_id(1)
    row = tile_row.to(tl.int64) * TILE + tl.arange(0, TILE)
    column = tile_column.to(tl.int64) * COLUMNS + tl.arange(0, COLUMNS)
    values = _load_tile(source, row, column, rows, columns)
    magnitudes = tl.abs(values)
    # TILE x 1 tiles (one column, TILE rows), written transposed: row-major (columns, padded_rows)
    column_amax = tl.reduce(magnitudes, 0, _max_keeping_nan)
    column_scale = _tile_scale(column_amax, target)
    _store_transposed(values, column_scale[None, :], row, column, columns_out, columns, padded_rows, fp8_max)
    tl.store(column_scales + column * tl.num_programs(0) + tile_row, column_scale, mask=column < columns)
    # the amax of each TILE x AMAX_COLUMNS part of the program's tile
    parts: tl.constexpr = COLUMNS // AMAX_COLUMNS
    part_amax = tl.reduce(tl.reshape(column_amax, (parts, AMAX_COLUMNS)), 1, _max_keeping_nan)
    part = tile_column * parts + tl.arange(0, parts)
    amax_columns = tl.cdiv(columns, AMAX_COLUMNS)
    tl.store(amaxes + tile_row * amax_columns + part, part_amax, mask=part < amax_columns)
    if WITH_ROWS:
        _store_row_tiles(
            values, magnitudes, row, column, rows_out, row_scales, rows, row_width, fp8_max, target
        )


@triton.jit
def _load_tile(source, row, column, rows, columns):
    """A program's ``row`` x ``column`` tile of ``source`` (rows, columns), row-major, in float32: zeros
    past its rows and columns."""
    inside = (row[:, None] < rows) & (column[None, :] < columns)
    return tl.load(source + row[:, None] * columns + column[None, :], mask=inside, other=0.0).to(tl.float32)


@triton.jit
def _store_transposed(values, scale, row, column, columns_out, columns, padded_rows, fp8_max):
    """Cast a program's ``values * scale`` (clamped to ``fp8_max``) and store them transposed, row-major
    (columns, padded_rows): the rows past the source's, up to ``padded_rows``, hold the zeros loaded."""
    scaled = tl.clamp(values * scale, -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
    written = (row[:, None] < padded_rows) & (column[None, :] < columns)
    tl.store(
        columns_out + column[None, :] * padded_rows + row[:, None],
        scaled.to(columns_out.dtype.element_ty),
        mask=written,
    )


@triton.jit
def _store_row_tiles(values, magnitudes, row, column, rows_out, row_scales, rows, row_width, fp8_max, target):
    """Cast a program's values in 1 x TILE tiles (one row, all the program's TILE columns) and store them
    row-major, ``row_width`` columns a row (the source's padded to whole tile groups: programs past the
    source's columns hold zeros), with one scale per tile (program (i, j) holds tile column j)."""
    row_amax = tl.reduce(magnitudes, 1, _max_keeping_nan)
    row_scale = _tile_scale(row_amax, target)
    scaled = tl.clamp(values * row_scale[:, None], -fp8_max, fp8_max, propagate_nan=tl.PropagateNan.ALL)
    inside = (row[:, None] < rows) & (column[None, :] < row_width)
    tl.store(
        rows_out + row[:, None] * row_width + column[None, :],
        scaled.to(rows_out.dtype.element_ty),
        mask=inside,
    )
    tl.store(row_scales + row * tl.num_programs(1) + tl.program_id(1), row_scale, mask=row < rows)


def cast_tiles_both(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float, with_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` (rows, columns), contiguous, cast to ``fp8_dtype`` in one read, each tile scaled by
    ``target / its amax`` (:func:`hf_fp8.formats.compute_scale`) and clamped to ``fp8_max``:

    * in 128 x 1 tiles along its rows, written transposed: (columns, padded_rows) FP8, the rows padded
      with zeros to a multiple of 16, and the scales (columns, ceil(padded_rows / 128));
    * with ``with_rows``, in 1 x 128 tiles along its columns: (rows, row_width) FP8, the columns padded
      with zeros to whole groups of four tiles (a multiple of 512), and the scales (rows, row_width /
      128), 1 for the padding; empty tensors otherwise;
    * the amaxes of its 128 x 64 tiles, (ceil(padded_rows / 128), ceil(columns / 64)) (NaN where a tile
      holds one): their amax is ``t``'s, with no second pass.

    A program casts 128 x 128 values with the row tiles, 128 x 64 without; fewer warps than the usual
    eight keep more programs in flight (one H200: 2.3-2.6 TB/s with the row tiles, 3.0-3.8 without).
    """
    outputs = cast_tiles_both_outputs(t, fp8_dtype, with_rows)
    rows_out, row_scales, columns_out, column_scales, amaxes = outputs
    (rows, columns), padded_rows, row_width = t.shape, columns_out.shape[1], rows_out.shape[1]
    if t.numel():
        width, warps = (_SCALE_TILE, 4) if with_rows else (_AMAX_COLUMNS, 2)
        grid = (triton.cdiv(padded_rows, _SCALE_TILE), triton.cdiv(max(columns, row_width), width))
        _cast_tiles_both_kernel[grid](
            t, rows_out, row_scales, columns_out, column_scales, amaxes,
            rows, columns, padded_rows, row_width, fp8_max, target,
            WITH_ROWS=with_rows, TILE=_SCALE_TILE, COLUMNS=width, AMAX_COLUMNS=_AMAX_COLUMNS,
            num_warps=warps,
        )  # fmt: skip
    return outputs


def cast_tiles_both_outputs(
    t: torch.Tensor, fp8_dtype: torch.dtype, with_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensors :func:`cast_tiles_both` writes, empty (for a fake tensor, their shapes)."""
    rows, columns = t.shape
    padded_rows = rows + -rows % FP8_ALIGNMENT
    row_tiles = triton.cdiv(padded_rows, _SCALE_TILE)
    kept_rows, row_width = _row_tiles_shape(rows, columns, with_rows)
    return (
        t.new_empty((kept_rows, row_width), dtype=fp8_dtype),
        t.new_empty((kept_rows, row_width // _SCALE_TILE), dtype=torch.float32),
        t.new_empty((columns, padded_rows), dtype=fp8_dtype),
        t.new_empty((columns, row_tiles), dtype=torch.float32),
        t.new_empty((row_tiles, triton.cdiv(columns, _AMAX_COLUMNS)), dtype=torch.float32),
    )


@triton.jit
def _column_amaxes_kernel(source, amaxes, rows, columns, TILE: tl.constexpr, ROWS: tl.constexpr):
    # one program: ROWS rows (TILE at a time) x TILE columns; a row of partial amaxes per ROWS rows
    column = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    first = tl.program_id(0).to(tl.int64) * ROWS
    amax = tl.zeros((TILE,), dtype=tl.float32)
    for start in range(0, ROWS, TILE):
        row = first + start + tl.arange(0, TILE)
        values = _load_tile(source, row, column, rows, columns)
        amax = _max_keeping_nan(amax, tl.reduce(tl.abs(values), 0, _max_keeping_nan))
    tl.store(amaxes + tl.program_id(0) * columns + column, amax, mask=column < columns)


def _column_amaxes(t: torch.Tensor) -> torch.Tensor:
    """The amax of each column of ``t`` (rows, columns), contiguous, over all its rows, as float32 (NaN
    where the column holds one): one read along the rows, then the partial amaxes of each 1024 rows."""
    rows, columns = t.shape
    partials = t.new_empty((triton.cdiv(rows, _AMAX_ROWS), columns), dtype=torch.float32)
    grid = (partials.shape[0], triton.cdiv(columns, _SCALE_TILE))
    _column_amaxes_kernel[grid](t, partials, rows, columns, TILE=_SCALE_TILE, ROWS=_AMAX_ROWS)
    return partials.amax(dim=0)


@triton.jit
def _cast_columns_transposed_kernel(
    source, column_amaxes, columns_out, column_scales, rows_out, row_scales,
    rows, columns, padded_rows, row_width, fp8_max, target,
    WITH_ROWS: tl.constexpr, TILE: tl.constexpr, COLUMNS: tl.constexpr,
):  # fmt: skip
    # one program: TILE rows x COLUMNS columns (COLUMNS == TILE with the row tiles)
    row = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    column = tl.program_id(1).to(tl.int64) * COLUMNS + tl.arange(0, COLUMNS)
    values = _load_tile(source, row, column, rows, columns)
    scale = _tile_scale(tl.load(column_amaxes + column, mask=column < columns, other=0.0), target)
    if tl.program_id(0) == 0:
        tl.store(column_scales + column, scale, mask=column < columns)
    _store_transposed(values, scale[None, :], row, column, columns_out, columns, padded_rows, fp8_max)
    if WITH_ROWS:
        _store_row_tiles(
            values, tl.abs(values), row, column, rows_out, row_scales, rows, row_width, fp8_max, target
        )


def cast_columns_transposed(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float, with_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` (rows, columns), contiguous, cast to ``fp8_dtype`` per column over all its rows, in two
    reads (the columns' amaxes, then the cast), each scale ``target / the amax``
    (:func:`hf_fp8.formats.compute_scale`) and each value clamped to ``fp8_max``:

    * ``t.T``: (columns, padded_rows) FP8, the rows padded with zeros to a multiple of 16, and the
      scales, (columns,);
    * the amax of ``t`` (NaN if it holds one);
    * with ``with_rows``, from the second read, ``t`` in 1 x 128 tiles along its columns, as
      :func:`cast_tiles_both` gives them (padded to whole groups of four tiles); empty tensors
      otherwise.

    A program of the cast takes 128 x 128 values with the row tiles, 128 x 64 without.
    """
    outputs = cast_columns_transposed_outputs(t, fp8_dtype, with_rows)
    columns_out, column_scales, amax, rows_out, row_scales = outputs
    (rows, columns), padded_rows, row_width = t.shape, columns_out.shape[1], rows_out.shape[1]
    if not t.numel():
        column_scales.fill_(1.0)  # compute_scale's for a zero amax
        amax.zero_()
        return outputs
    column_amaxes = _column_amaxes(t)
    torch.amax(column_amaxes, dim=0, out=amax)
    width, warps = (_SCALE_TILE, 4) if with_rows else (_AMAX_COLUMNS, 2)
    grid = (triton.cdiv(padded_rows, _SCALE_TILE), triton.cdiv(max(columns, row_width), width))
    _cast_columns_transposed_kernel[grid](
        t, column_amaxes, columns_out, column_scales, rows_out, row_scales,
        rows, columns, padded_rows, row_width, fp8_max, target,
        WITH_ROWS=with_rows, TILE=_SCALE_TILE, COLUMNS=width, num_warps=warps,
    )  # fmt: skip
    return outputs


def cast_columns_transposed_outputs(
    t: torch.Tensor, fp8_dtype: torch.dtype, with_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensors :func:`cast_columns_transposed` writes, empty (for a fake tensor, their shapes)."""
    rows, columns = t.shape
    padded_rows = rows + -rows % FP8_ALIGNMENT
    kept_rows, row_width = _row_tiles_shape(rows, columns, with_rows)
    return (
        t.new_empty((columns, padded_rows), dtype=fp8_dtype),
        t.new_empty(columns, dtype=torch.float32),
        t.new_empty((), dtype=torch.float32),
        t.new_empty((kept_rows, row_width), dtype=fp8_dtype),
        t.new_empty((kept_rows, row_width // _SCALE_TILE), dtype=torch.float32),
    )


@triton.jit
def _cast_blocks_transposed_kernel(
    source, columns_out, scales, amaxes, rows, columns, padded_rows, fp8_max, target, BLOCK: tl.constexpr,
):  # fmt: skip
    # one program: a BLOCK x BLOCK block, scaled by its amax, written transposed; past the rows, zeros
    row = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    column = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    values = _load_tile(source, row, column, rows, columns)
    row_amax = tl.reduce(tl.abs(values), 1, _max_keeping_nan)
    amax = tl.reduce(row_amax, 0, _max_keeping_nan)
    scale = _tile_scale(amax, target)
    _store_transposed(values, scale, row, column, columns_out, columns, padded_rows, fp8_max)
    block = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(scales + block, scale)
    tl.store(amaxes + block, amax)


def cast_blocks_transposed(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` (rows, columns), contiguous, cast to ``fp8_dtype`` in 128 x 128 blocks, each scaled by
    ``target / its amax`` (:func:`hf_fp8.formats.compute_scale`) and clamped to ``fp8_max``, in one read:

    * ``t.T``: (columns, padded_rows) FP8, the rows padded with zeros to whole groups of four blocks
      (a multiple of 512: what the input gradient's GEMM contracts over, see :func:`cast_tiles_both`);
    * the blocks' scales, (padded_rows / 128, ceil(columns / 128)), 1 for the padding;
    * the blocks' amaxes, the same shape (NaN where a block holds one): their amax is ``t``'s.
    """
    columns_out, scales, amaxes = cast_blocks_transposed_outputs(t, fp8_dtype)
    rows, columns = t.shape
    if scales.numel():
        grid = (scales.shape[0], scales.shape[1])
        _cast_blocks_transposed_kernel[grid](
            t, columns_out, scales, amaxes, rows, columns, columns_out.shape[1], fp8_max, target,
            BLOCK=_SCALE_TILE, num_warps=8,
        )  # fmt: skip
    return columns_out, scales, amaxes


def cast_blocks_transposed_outputs(
    t: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tensors :func:`cast_blocks_transposed` writes, empty (for a fake tensor, their shapes)."""
    rows, columns = t.shape
    padded_rows = rows + -rows % _ROW_TILE_GROUP
    blocks = (padded_rows // _SCALE_TILE, triton.cdiv(columns, _SCALE_TILE))
    return (
        t.new_empty((columns, padded_rows), dtype=fp8_dtype),
        t.new_empty(blocks, dtype=torch.float32),
        t.new_empty(blocks, dtype=torch.float32),
    )


def _row_tiles_shape(rows: int, columns: int, with_rows: bool) -> tuple[int, int]:
    """The shape of the row tiles' values: the columns padded to whole tile groups; (0, 0) without."""
    return (rows, columns + -columns % _ROW_TILE_GROUP) if with_rows else (0, 0)
