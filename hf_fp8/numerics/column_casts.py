"""The weight gradient's per-column casts on a GPU: ``t`` (tokens, features) scaled per feature over all
its tokens and written transposed, (features, tokens), as row-wise scaling's weight gradient takes
``dy`` and ``x`` (:func:`hf_fp8.numerics.rowwise.rowwise_weight_gradient`; ``block_gw_rowwise``'s too).

A column's scale needs its amax over every token before any of its values is cast: two reads of ``t``.
Compiled from torch ops, the amax reduces across the rows of a row-major tensor, and Inductor fuses it
with the cast into one kernel that reads across rows twice: for the output head's gradient at 8b-4l,
[8192, 128256] in BF16, 3.5 ms on one H200. Here two Triton kernels of
:mod:`hf_fp8.numerics.triton_kernels` read ``t`` along its rows: the columns' amaxes, then the cast,
written transposed through shared memory. The second read also casts ``t`` in 1x128 tiles of its rows
when asked, which ``block_gw_rowwise``'s input gradient takes of ``dy``: one read less.

Callers take this path where :func:`fused_column_casts_available` says so, and the torch ops elsewhere;
both give the same bytes.
"""

from __future__ import annotations

import functools

import torch

from hf_fp8.formats import Fp8Format, gpu_has_fp8
from hf_fp8.numerics.cuda_copies import triton_installed

__all__ = ["fused_cast_columns", "fused_column_casts_available"]


def fused_cast_columns(
    t: torch.Tensor, fmt: Fp8Format, margin: int, with_row_tiles: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``t`` (rows, columns) cast per column over its rows: ``t.T`` in ``fmt``, (columns, rows padded
    with zeros to a multiple of 16), contiguous; the scales, (columns, 1); ``t``'s amax; and with
    ``with_row_tiles`` ``t`` in 1x128 tiles of its rows and their scales, as
    :func:`hf_fp8.numerics.blockwise.cast_tiles` gives them, then zero columns (scales of 1) up to
    whole groups of 4 tiles, else ``None`` twice."""
    columns, scales, amax, row_tiles, row_scales = _cast_columns(
        t.contiguous(), fmt.dtype, fmt.max, fmt.max / 2.0**margin, with_row_tiles
    )
    if not with_row_tiles:
        row_tiles = row_scales = None
    return columns, scales.unsqueeze(1), amax, row_tiles, row_scales


@torch.compiler.assume_constant_result  # compiled code asks at trace time and keeps the answer
def fused_column_casts_available(device: torch.device) -> bool:
    """Whether :func:`fused_cast_columns` runs on ``device``: a GPU with FP8, and Triton."""
    return device.type == "cuda" and triton_installed() and _has_fp8(device.index)


@functools.cache
def _has_fp8(index: int | None) -> bool:
    return gpu_has_fp8(index)


@torch.library.custom_op("hf_fp8::cast_columns", mutates_args=())
def _cast_columns(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float, with_row_tiles: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hf_fp8.numerics.triton_kernels.cast_columns_transposed` as an op that compiled graphs call
    as it is: the scales come from its kernel, compiled or not."""
    from hf_fp8.numerics import triton_kernels  # only where Triton is installed

    return triton_kernels.cast_columns_transposed(t, fp8_dtype, fp8_max, target, with_row_tiles)


@_cast_columns.register_fake
def _(
    t: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, target: float, with_row_tiles: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from hf_fp8.numerics import triton_kernels  # traced only where the op runs

    return triton_kernels.cast_columns_transposed_outputs(t, fp8_dtype, with_row_tiles)
