"""Row-wise scaling: a scale for every row of every FP8 operand (the recipes ``rowwise`` and
``rowwise_gw_hp``).

Where tensorwise scaling gives a whole tensor one scale, row-wise scaling gives each row of a GEMM
operand its own, taken from that row's amax when the GEMM runs (no history): one outlier token or
channel then costs precision only in its own row. ``torch._scaled_mm`` takes the scales of the left
operand per row and of the right operand per column. Each GEMM contracts along another dimension of
``x``, ``W`` and ``dy``, so the backward casts them again along the dimension it needs, from the
high-precision tensors the forward saved (as torchao's row-wise recipes do):

* forward ``y = x @ W.T``: ``x`` per token, ``W`` per output feature;
* dgrad ``dx = dy @ W``: ``dy`` per token, ``W`` per input feature;
* wgrad ``dW = dy.T @ x``: ``dy`` and ``x`` per feature, over the tokens; with ``rowwise_gw_hp`` this
  GEMM stays in high precision (the weight gradient is the most sensitive of the three).

All operands are E4M3 (cuBLAS's row-wise kernels take E4M3 only), and on the GPU the kernels write
BF16, cast to the dtype asked for afterwards. The layer's amax history still records each tensor's
amax, for telemetry and the NaN guard. Under ``forward_in_fp8: false`` the forward GEMM runs in high
precision and the backward is the same: it casts from the saved high-precision tensors either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_fp8.formats import Fp8Format, cast_to_fp8, compute_scale
from hf_fp8.numerics.column_casts import fused_cast_columns, fused_column_casts_available
from hf_fp8.numerics.gemm import GemmConfig, fp8_mm, in_dtype, pad_rows
from hf_fp8.numerics.scaling import GRAD_OUTPUT, INPUT, WEIGHT, BackwardRecord, record_amax, tensor_amax

__all__ = ["cast_columns", "rowwise_linear", "rowwise_weight_gradient"]


def rowwise_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    backward_record: BackwardRecord,
    record: bool,
    config: GemmConfig,
    weight_gradient_in_fp8: bool,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with row-wise scaled FP8 GEMMs (see the module docstring)."""
    out = _RowwiseFp8Linear.apply(
        x.reshape(-1, x.shape[-1]),
        weight,
        bias,
        amax_history,
        scale,
        backward_record.amax,
        backward_record.scale,
        record,
        config,
        weight_gradient_in_fp8,
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])


def cast_rows(
    t: torch.Tensor, fmt: Fp8Format, margin: int, dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` cast to ``fmt`` with a scale per slice along ``dim`` (per row for ``dim=1``): the FP8
    values, the scales (keeping ``dim`` as size 1) and ``t``'s amax."""
    amax = t.detach().abs().amax(dim=dim, keepdim=True).float()
    scales = compute_scale(amax, fmt, margin)
    return cast_to_fp8(t, scales, fmt), scales, amax.amax()


def cast_columns(
    t: torch.Tensor, fmt: Fp8Format, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` (tokens, features) cast per feature over the tokens, for a weight gradient: ``t.T`` in FP8,
    (features, tokens padded with zeros to a multiple of 16), contiguous; the scales, (features, 1); and
    ``t``'s amax. Two Triton kernels where they run (:mod:`hf_fp8.numerics.column_casts`)."""
    if fused_column_casts_available(t.device):
        values, scales, amax, _, _ = fused_cast_columns(t, fmt, margin, with_row_tiles=False)
        return values, scales, amax
    values, scales, amax = cast_rows(pad_rows(t).t(), fmt, margin)
    return values.contiguous(), scales, amax


class _RowwiseFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        amax_history,
        scale,
        backward_amax,
        backward_scale,
        record,
        config: GemmConfig,
        gw_in_fp8: bool,
    ):
        fmt, dtype = config.forward_format, config.out_dtype
        if config.forward_in_fp8:
            x_fp8, x_scales, x_amax = cast_rows(x, fmt, config.margin)  # (tokens, 1)
            w_fp8, w_scales, w_amax = cast_rows(weight, fmt, config.margin)  # (out, 1)
            out = _mm(x_fp8.contiguous(), w_fp8.contiguous().t(), x_scales, w_scales.t(), dtype)
            if bias is not None:
                out = out + bias.to(dtype)
        else:  # as F.linear (the output head's logits; any layer under forward_in_fp8: false)
            out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
            x_amax, w_amax = tensor_amax(x), tensor_amax(weight)
        if record:
            record_amax(amax_history, scale, INPUT, x_amax, fmt, config.margin)
            record_amax(amax_history, scale, WEIGHT, w_amax, fmt, config.margin)
        ctx.save_for_backward(x, weight)
        # the backward records into the layer's backward record, never into its state
        ctx.backward_record = BackwardRecord(backward_amax, backward_scale, None)
        ctx.record, ctx.config, ctx.gw_in_fp8 = record, config, gw_in_fp8
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight = ctx.saved_tensors
        config: GemmConfig = ctx.config
        fmt, margin = config.backward_format, config.margin
        dy = grad_output
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            dy_fp8, dy_scales, dy_amax = cast_rows(dy, fmt, margin)  # per token
            w_fp8, w_scales, _ = cast_rows(weight, config.forward_format, margin, dim=0)  # per input feature
            # the right operand (out, in) column-major: W.T row-major
            grad_x = _mm(dy_fp8.contiguous(), w_fp8.t().contiguous().t(), dy_scales, w_scales, x.dtype)
        else:
            dy_amax = tensor_amax(dy)
        if ctx.needs_input_grad[1]:
            if ctx.gw_in_fp8:
                dy_columns = cast_columns(dy, fmt, margin)[:2]
                grad_w = rowwise_weight_gradient(dy_columns, x, config.forward_format, margin, weight.dtype)
            else:
                grad_w = in_dtype(dy.t().to(x.dtype) @ x, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dim=0)
        if ctx.record:
            record_amax(
                ctx.backward_record.amax, ctx.backward_record.scale, GRAD_OUTPUT, dy_amax, fmt, margin
            )
        return grad_x, grad_w, grad_bias, None, None, None, None, None, None, None


def rowwise_weight_gradient(
    dy_columns: tuple[torch.Tensor, torch.Tensor],
    x: torch.Tensor,
    x_format: Fp8Format,
    margin: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``dy.T @ x`` (out, in) in FP8, ``dy`` (tokens, out) scaled per output feature and ``x`` (tokens,
    in) per input feature, each over the tokens: a feature seen by few tokens (a rare token's row of an
    output head's gradient) keeps its own range. ``dy_columns``: ``dy`` as :func:`cast_columns` gives it
    (its values and scales; the caller casts it, with whatever else it needs of ``dy``). On the GPU the
    product comes out in BF16, as :func:`_mm` says."""
    dy_fp8, dy_scales = dy_columns
    x_fp8, x_scales, _ = cast_columns(x, x_format, margin)  # (in, tokens), per input feature
    return _mm(dy_fp8, x_fp8.t(), dy_scales, x_scales.t(), dtype)


def _mm(a: torch.Tensor, b: torch.Tensor, a_scales, b_scales, out_dtype: torch.dtype) -> torch.Tensor:
    """``fp8_mm`` with row-wise scales (the ones the operands were cast with). On the GPU the row-wise
    kernels write BF16 only (CUTLASS's, and cuBLAS's before 12.9): the product comes out in BF16 and
    is cast to ``out_dtype``."""
    kernel_dtype = torch.bfloat16 if a.is_cuda else out_dtype
    return in_dtype(fp8_mm(a, b, a_scales.reciprocal(), b_scales.reciprocal(), kernel_dtype), out_dtype)
