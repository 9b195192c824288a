"""Two copies that Inductor does not generate, in one pass each on a GPU.

FSDP2 runs its all-gather hook eagerly, so the cast of each weight's shard to FP8 there runs as torch ops:
four passes over the shard (to float32, times the scale, clamp, convert; 27 bytes moved a BF16 value).
A weight already in FP8 (all-gathered so, or stored frozen) reaches the input gradient's GEMM through a
column-major copy that is an opaque op on purpose (see :func:`hf_fp8.numerics.gemm.column_major_copy`;
so are the transposes of :func:`hf_fp8.numerics.gemm.transposed_fp8`, for the logits' gradient and MoE
experts); eagerly, a one-byte transpose is an uncoalesced strided copy (290 GB/s on an H100). On CUDA
tensors both are a Triton kernel of :mod:`hf_fp8.numerics.triton_kernels` (2.3 TB/s for that
transpose); elsewhere, and where Triton is not installed, the torch ops, which give the same bytes.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from hf_fp8.formats import Fp8Format, cast_to_fp8

__all__ = ["cast_into", "transposed_copy", "triton_installed"]


def cast_into(out: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Write :func:`~hf_fp8.formats.cast_to_fp8` of ``x`` with ``scale`` (a float32 scalar tensor) into
    ``out``, of ``x``'s shape and contiguous, and return ``out``."""
    if _triton_runs_on(x) and x.is_contiguous():
        from hf_fp8.numerics import triton_kernels  # only where Triton is installed

        return triton_kernels.saturating_cast(x, scale, fmt, out)
    return out.copy_(cast_to_fp8(x, scale, fmt))


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.transpose(-2, -1)`` of a 2-D tensor, or of each matrix of a 3-D one, of one-byte values, as a
    new contiguous tensor."""
    if _triton_runs_on(t):
        from hf_fp8.numerics import triton_kernels  # only where Triton is installed

        return triton_kernels.transposed_copy(t.contiguous())
    return t.transpose(-2, -1).clone(memory_format=torch.contiguous_format)


def _triton_runs_on(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_installed()


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported (PyTorch's CUDA builds on Linux bring it)."""
    return importlib.util.find_spec("triton") is not None
