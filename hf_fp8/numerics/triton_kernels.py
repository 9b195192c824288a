"""Triton kernels behind :mod:`hf_fp8.numerics.cuda_copies`: a saturating FP8 cast and a one-byte
transpose, one pass each. Imported only for CUDA tensors where Triton is installed (it comes with
PyTorch's CUDA builds on Linux, not with the CPU build).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_fp8.formats import Fp8Format

__all__ = ["saturating_cast", "transposed_copy"]

_CAST_BLOCK = 4096
_TILE = 64


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
    inside = (row[:, None] < rows) & (column[None, :] < columns)
    tile = tl.load(source + row[:, None] * columns + column[None, :], mask=inside)
    tl.store(target + column[None, :] * rows + row[:, None], tile, mask=inside)


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
    """``t.t().contiguous()`` for a contiguous 2-D tensor of one-byte values."""
    rows, columns = t.shape
    source = t.view(torch.uint8)
    target = torch.empty((columns, rows), dtype=torch.uint8, device=t.device)
    if t.numel():
        grid = (triton.cdiv(rows, _TILE), triton.cdiv(columns, _TILE))
        _transpose_kernel[grid](source, target, rows, columns, TILE=_TILE)
    return target.view(t.dtype)
