"""The GEMMs of MoE experts in FP8: one grouped GEMM per projection and direction where the GPU has one
(``torch._scaled_grouped_mm``, Hopper), else one FP8 GEMM per expert (:func:`hf_fp8.numerics.gemm.fp8_mm`,
``torch._scaled_mm`` or its exact emulation).

Rows arrive sorted by expert, ``counts[e]`` rows for expert ``e``. The grouped kernels want every
group's rows to start at a multiple of 16 (the weight gradient contracts over them), so a
:class:`GroupLayout` places each group at such an offset in a padded buffer with zero rows in
between; zero rows add nothing to any product. The grouped kernels take E4M3 operands, float32
scales per row and column (a tensorwise scale is expanded to them: the same numbers) and write
BF16; a pairing they cannot run (an E5M2 gradient under ``format: hybrid``) runs expert by expert,
announced once.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from hf_fp8.formats import E4M3, FP8_ALIGNMENT
from hf_fp8.numerics.gemm import fp8_mm, in_dtype, pad_rows

__all__ = ["GroupLayout", "expert_dgrad", "expert_forward", "expert_wgrad", "group_layout"]


class GroupLayout(NamedTuple):
    """Where each expert's rows go in the padded buffer of the grouped kernels, computed on the device
    (no host sync, and static shapes for ``torch.compile``)."""

    counts: torch.Tensor  # (experts,) int64: rows per expert, in order
    offsets: torch.Tensor  # (experts,) int32: the end of each expert's padded group
    destination: torch.Tensor  # (rows,) int64: each row's place in the padded buffer
    padded_rows: int  # rows of the padded buffer: enough for any counts (rows past the last group unread)


def group_layout(counts: torch.Tensor, rows: int) -> GroupLayout:
    """The padded layout of ``rows`` rows grouped by ``counts`` (each group starting at a multiple of 16)."""
    padded = (counts + FP8_ALIGNMENT - 1) // FP8_ALIGNMENT * FP8_ALIGNMENT
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)
    destination = torch.arange(rows, device=counts.device) + torch.repeat_interleave(
        shift, counts, output_size=rows
    )
    capacity = rows + counts.numel() * (FP8_ALIGNMENT - 1)
    padded_rows = -(-capacity // FP8_ALIGNMENT) * FP8_ALIGNMENT
    return GroupLayout(counts, ends.to(torch.int32), destination, padded_rows)


def grouped_kernels(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs this pairing: E4M3 x E4M3 on a Hopper GPU."""
    return (
        hasattr(torch, "_scaled_grouped_mm")
        and a.is_cuda
        and a.shape[0] > 0
        and a.dtype == b.dtype == E4M3.dtype
        and _hopper(a.device)
    )


@torch.compiler.assume_constant_result  # a fact of the machine: no guard, no graph break
def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) == (9, 0)


def expert_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_inverse: torch.Tensor,
    w_inverse: torch.Tensor,
    layout: GroupLayout,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x_e @ W_e.T`` for every expert e over its rows of ``x`` (FP8, (rows, in)); ``weight`` is the FP8
    (experts, out, in) stack, any strides; the inverses are the dequantization factors."""
    return _experts_mm(x, weight.transpose(-2, -1), x_inverse, w_inverse, layout, out_dtype)


def expert_dgrad(
    dy: torch.Tensor,
    weight: torch.Tensor,
    dy_inverse: torch.Tensor,
    w_inverse: torch.Tensor,
    layout: GroupLayout,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dy_e @ W_e`` for every expert over its rows of ``dy`` (FP8, (rows, out)); ``weight`` as in
    :func:`expert_forward`."""
    return _experts_mm(dy, weight, dy_inverse, w_inverse, layout, out_dtype)


def expert_wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    dy_inverse: torch.Tensor,
    x_inverse: torch.Tensor,
    layout: GroupLayout,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dy_e.T @ x_e`` for every expert (an (experts, out, in) stack; zero for an expert without rows),
    from the FP8 ``dy`` (rows, out) and ``x`` (rows, in)."""
    experts = layout.counts.numel()
    if grouped_kernels(dy, x):
        dy_t = _padded(dy, layout).t().contiguous()  # (out, padded rows)
        x_col = _padded(x, layout).t().contiguous().t()  # (padded rows, in), column-major
        grad = torch._scaled_grouped_mm(
            dy_t,
            x_col,
            dy_inverse.expand(dy_t.shape[0] * experts).contiguous(),
            x_inverse.expand(x_col.shape[1] * experts).contiguous(),
            offs=layout.offsets,
            out_dtype=torch.bfloat16,
        )
        return in_dtype(grad, out_dtype)
    grad = torch.zeros(experts, dy.shape[1], x.shape[1], dtype=out_dtype, device=dy.device)
    for e, (start, end) in _groups(layout):
        dy_t = pad_rows(dy[start:end]).t().contiguous()
        x_col = pad_rows(x[start:end]).t().contiguous().t()
        grad[e] = fp8_mm(dy_t, x_col, dy_inverse, x_inverse, out_dtype)
    return grad


_loop_announced: set[tuple[torch.dtype, torch.dtype]] = set()


def _experts_mm(
    a: torch.Tensor,
    right: torch.Tensor,
    a_inverse: torch.Tensor,
    b_inverse: torch.Tensor,
    layout: GroupLayout,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a_e @ right[e]`` for every expert over its rows of ``a``; ``right`` is an FP8 (experts, K, N)
    stack in any layout, made column-major per expert (what both kinds of kernel read) if it is not."""
    if right.stride(-2) != 1:
        right = right.transpose(-2, -1).contiguous().transpose(-2, -1)
    if grouped_kernels(a, right):
        return _grouped(a, right, a_inverse, b_inverse, layout, out_dtype)
    parts = [_rows_mm(a[s:e], right[g], a_inverse, b_inverse, out_dtype) for g, (s, e) in _groups(layout)]
    return torch.cat(parts) if parts else a.new_zeros(0, right.shape[-1], dtype=out_dtype)


def _grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    a_inverse: torch.Tensor,
    b_inverse: torch.Tensor,
    layout: GroupLayout,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a_e @ b[e]`` for each group of ``a``'s rows, through the padded layout, in one kernel."""
    padded = _padded(a, layout)
    out = torch._scaled_grouped_mm(
        padded,
        b,
        a_inverse.expand(layout.padded_rows).contiguous(),
        b_inverse.expand(b.shape[0], b.shape[-1]).contiguous(),
        offs=layout.offsets,
        out_dtype=torch.bfloat16,
    )
    return in_dtype(out[layout.destination], out_dtype)


def _padded(t: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
    """``t``'s rows at their places in the padded buffer, zero rows elsewhere (FP8 copied as bytes)."""
    padded = torch.zeros(layout.padded_rows, t.shape[1], dtype=torch.uint8, device=t.device)
    padded.index_copy_(0, layout.destination, t.contiguous().view(torch.uint8))
    return padded.view(t.dtype)


def _rows_mm(a, b, a_inverse, b_inverse, out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8_mm`` for one expert's rows: padded to 16 rows for the GEMM (cuBLAS wants it), sliced back."""
    if a.is_cuda and (a.dtype, b.dtype) not in _loop_announced and not torch.compiler.is_compiling():
        _loop_announced.add((a.dtype, b.dtype))
        warnings.warn(
            f"hf_fp8: MoE experts run one FP8 GEMM per expert for {a.dtype} x {b.dtype} on this GPU: the "
            "grouped FP8 GEMM takes E4M3 x E4M3 on Hopper (there format: e4m3 groups the backward too)",
            stacklevel=4,
        )
    return fp8_mm(pad_rows(a), b, a_inverse, b_inverse, out_dtype)[: a.shape[0]]


def _groups(layout: GroupLayout):
    """(expert, (first row, end row)) for every expert that received rows (reads the counts on the host:
    the per-expert path only)."""
    start = 0
    for expert, count in enumerate(layout.counts.tolist()):
        if count:
            yield expert, (start, start + count)
        start += count
