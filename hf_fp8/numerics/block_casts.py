"""The block recipe's backward casts on a Hopper GPU, as ops over the Triton kernels of
:mod:`hf_fp8.numerics.triton_kernels` that compiled graphs call as they are (Inductor compiles its own
kernels, not these):

* :func:`fused_cast_tiles`: a gradient or an input in 1x128 tiles of its columns, written transposed,
  and of its rows if asked, in one read (the weight gradient's operands, the input gradient's ``dy``);
* :func:`fused_cast_blocks_transposed`: a weight in 128x128 blocks written transposed, as the input
  gradient takes it, in one read. Compiled from torch ops, the blocks' amaxes are one read and the cast,
  written transposed, another (the 8b-4l output head's weight, one H200: 0.3 + 1.1 ms).

:mod:`hf_fp8.numerics.blockwise` chooses between these and its torch casts, which give the same bytes.
"""

from __future__ import annotations

import torch

from hf_fp8.formats import Fp8Format

__all__ = ["fused_cast_blocks_transposed", "fused_cast_tiles"]


def fused_cast_tiles(
    t: torch.Tensor, fmt: Fp8Format, margin: int, with_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hf_fp8.numerics.triton_kernels.cast_tiles_both` of ``t`` in ``fmt``, ``margin`` binades
    below its largest value."""
    return _cast_tiles(t.contiguous(), fmt.dtype, fmt.max, fmt.max / 2.0**margin, with_rows)


def fused_cast_blocks_transposed(
    t: torch.Tensor, fmt: Fp8Format, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` (rows, columns) in 128x128 blocks of ``fmt``: ``t.T`` in FP8, (columns, rows padded with
    zeros to a multiple of 512), contiguous; the blocks' scales as scales of ``t.T``, (columns / 128,
    padded rows / 128), 1 for the padding; and ``t``'s amax."""
    target = fmt.max / 2.0**margin
    values, scales, amaxes = _cast_blocks_transposed(t.contiguous(), fmt.dtype, fmt.max, target)
    return values, scales.t(), amaxes.amax()


@torch.library.custom_op("hf_fp8::fused_tile_casts", mutates_args=())
def _cast_tiles(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float, with_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from hf_fp8.numerics import triton_kernels  # only where Triton is installed

    return triton_kernels.cast_tiles_both(t, fp8_dtype, fp8_max, target, with_rows)


@_cast_tiles.register_fake
def _(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float, with_rows: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from hf_fp8.numerics import triton_kernels  # traced only where the op runs

    return triton_kernels.cast_tiles_both_outputs(t, fp8_dtype, with_rows)


@torch.library.custom_op("hf_fp8::cast_blocks_transposed", mutates_args=())
def _cast_blocks_transposed(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hf_fp8.numerics import triton_kernels  # only where Triton is installed

    return triton_kernels.cast_blocks_transposed(t, fp8_dtype, fp8_max, target)


@_cast_blocks_transposed.register_fake
def _(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from hf_fp8.numerics import triton_kernels  # traced only where the op runs

    return triton_kernels.cast_blocks_transposed_outputs(t, fp8_dtype)
