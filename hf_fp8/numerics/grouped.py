"""The GEMMs of MoE experts in FP8: one grouped GEMM per projection and direction where the GPU has one
(``torch._scaled_grouped_mm``, Hopper), else one FP8 GEMM per expert (:func:`hf_fp8.numerics.gemm.fp8_mm`,
``torch._scaled_mm`` or its exact emulation).

Rows are grouped by expert, ``counts[e]`` rows for expert ``e``. The grouped kernels want every
group's rows to start at a multiple of 16 (the weight gradient contracts over them), so a
:class:`GroupLayout` places each group at such an offset in a padded buffer with zero rows in
between; zero rows add nothing to any product. The caller gathers its rows into that buffer once
(``layout.source`` and ``layout.valid`` say what goes where), and every GEMM here reads and writes
rows so laid out: no copy between a projection and the next, nor between the forward and the
backward. The grouped kernels take E4M3 operands, float32 scales per row and column (a tensorwise
scale is expanded to them: the same numbers) and write BF16. The column-major copies they read (of
the weights, for the input gradient; of the gradient and the input, for the weight gradient) are
tiled one-byte transposes (:func:`hf_fp8.numerics.gemm.transposed_fp8`): fused into Inductor's
kernels they were written one byte at a stride. A pairing they cannot run (an E5M2 gradient under
``format: hybrid``) runs expert by expert, announced once.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from hf_fp8.formats import E4M3, FP8_ALIGNMENT
from hf_fp8.numerics.gemm import fp8_mm, in_dtype, pad_rows, transposed_fp8

__all__ = [
    "GroupLayout",
    "expert_dgrad",
    "expert_forward",
    "expert_wgrad",
    "group_layout",
    "grouped_kernels_run_on",
]


class GroupLayout(NamedTuple):
    """Where each expert's rows go in the buffer the experts' GEMMs read, computed on the device (no
    host sync, and static shapes for ``torch.compile``). For the grouped kernels every group starts at a
    multiple of 16 with zero rows in between (``grouped``); for the per-expert GEMMs the groups follow
    each other (no padding)."""

    counts: torch.Tensor  # (experts,) int64: rows per expert, in order
    starts: torch.Tensor  # (experts,) int64: the first row of each expert's group
    offsets: torch.Tensor  # (experts,) int32: the end of each expert's (padded) group
    destination: torch.Tensor  # (rows,) int64: each row's place in the buffer
    source: torch.Tensor  # (buffer rows,) int64: which of the grouped rows is at each place (0 if none)
    valid: torch.Tensor  # (buffer rows,) bool: whether a place holds a row
    padded_rows: int  # rows of the buffer: enough for any counts (rows past the last group unwritten)
    grouped: bool  # whether the grouped kernels run (else one GEMM per expert)


def group_layout(counts: torch.Tensor, rows: int, grouped: bool) -> GroupLayout:
    """The layout of ``rows`` rows grouped by ``counts``: each group at a multiple of 16 when
    ``grouped`` (see :func:`grouped_kernels_run_on`), else one group after the other."""
    alignment = FP8_ALIGNMENT if grouped else 1
    padded = (counts + alignment - 1) // alignment * alignment
    ends = padded.cumsum(0)
    starts = ends - padded
    shift = starts - (counts.cumsum(0) - counts)
    destination = torch.arange(rows, device=counts.device) + torch.repeat_interleave(
        shift, counts, output_size=rows
    )
    capacity = rows + counts.numel() * (alignment - 1)
    padded_rows = -(-capacity // alignment) * alignment
    source = counts.new_zeros(padded_rows).index_copy_(
        0, destination, torch.arange(rows, device=counts.device)
    )
    valid = torch.zeros(padded_rows, dtype=torch.bool, device=counts.device).index_fill_(0, destination, True)
    return GroupLayout(counts, starts, ends.to(torch.int32), destination, source, valid, padded_rows, grouped)


def grouped_kernels_run_on(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs on ``device``: a Hopper GPU (E4M3 operands)."""
    return hasattr(torch, "_scaled_grouped_mm") and device.type == "cuda" and _hopper(device)


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
    """``x_e @ W_e.T`` for every expert e over its rows of ``x`` (FP8, (buffer rows, in), laid out as
    ``layout`` says; so is the result); ``weight`` is the FP8 (experts, out, in) stack, any strides; the
    inverses are the dequantization factors."""
    return _experts_mm(x, weight.transpose(-2, -1), x_inverse, w_inverse, layout, out_dtype)


def expert_dgrad(
    dy: torch.Tensor,
    weight: torch.Tensor,
    dy_inverse: torch.Tensor,
    w_inverse: torch.Tensor,
    layout: GroupLayout,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``dy_e @ W_e`` for every expert over its rows of ``dy`` (FP8, (buffer rows, out), laid out);
    ``weight`` as in :func:`expert_forward`."""
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
    from the FP8 ``dy`` (buffer rows, out) and ``x`` (buffer rows, in), laid out."""
    experts = layout.counts.numel()
    if _grouped_kernels(dy, x, layout):
        dy_t = transposed_fp8(dy)  # (out, buffer rows)
        x_col = transposed_fp8(x).t()  # (buffer rows, in), column-major
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


def _grouped_kernels(a: torch.Tensor, b: torch.Tensor, layout: GroupLayout) -> bool:
    """Whether this pairing runs on the grouped kernels: a grouped layout and E4M3 x E4M3."""
    return layout.grouped and a.dtype == b.dtype == E4M3.dtype


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
        right = transposed_fp8(right.contiguous()).transpose(-2, -1)
    if _grouped_kernels(a, right, layout):
        out = torch._scaled_grouped_mm(
            a,
            right,
            a_inverse.expand(layout.padded_rows).contiguous(),
            b_inverse.expand(right.shape[0], right.shape[-1]).contiguous(),
            offs=layout.offsets,
            out_dtype=torch.bfloat16,
        )
        return in_dtype(out, out_dtype)
    out = a.new_zeros(a.shape[0], right.shape[-1], dtype=out_dtype)
    for g, (start, end) in _groups(layout):
        out[start:end] = _rows_mm(a[start:end], right[g], a_inverse, b_inverse, out_dtype)
    return out


_loop_announced: set[tuple[torch.dtype, torch.dtype]] = set()


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
    for expert, (start, count) in enumerate(zip(layout.starts.tolist(), layout.counts.tolist(), strict=True)):
        if count:
            yield expert, (start, start + count)
