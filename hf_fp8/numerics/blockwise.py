"""Block scaling in the native backend (the recipe ``scaling: block``): DeepSeek-V3's 1x128 tiles for
activations and gradients and 128x128 blocks for weights, each with its own scale, all in E4M3.

Every GEMM operand is cast in blocks along the dimension the GEMM contracts over: ``x`` and ``dy`` in
1x128 tiles (one token, 128 features) for the forward and dgrad, in 128x1 tiles (128 tokens, one
feature) for the weight gradient, which contracts over tokens; ``W`` in 128x128 blocks, the same for
the forward and the dgrad. PyTorch has no block-scaled FP8 GEMM kernel in the native path yet, so the
GEMM is emulated exactly: the FP8 values are real casts, they are multiplied by their block scales in
float32 and multiplied in float32 (announced once). The numerics are block scaling's; the speed is
not (Transformer Engine's ``Float8BlockScaling`` runs it on Hopper: ``backend='te'``).
"""

from __future__ import annotations

import warnings

import torch

from hf_fp8.formats import Fp8Format, cast_to_fp8, compute_scale
from hf_fp8.numerics.gemm import GemmConfig, in_dtype
from hf_fp8.numerics.scaling import GRAD_OUTPUT, INPUT, WEIGHT, record_amax

__all__ = ["BLOCK", "EMULATED", "block_linear", "block_quantize"]

BLOCK = 128
EMULATED = (
    "block scaling in the native backend emulates its FP8 GEMMs in float32 (real FP8 casts and block "
    "scales, no FP8 speed-up); backend='te' runs Float8BlockScaling kernels on Hopper"
)


def block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    record: bool,
    config: GemmConfig,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with block-scaled FP8 operands (see the module docstring)."""
    if not torch.compiler.is_compiling():  # a warning would break a compiled graph (the report says it)
        warnings.warn(  # shown once per place it is called from, by Python's default filter
            f"hf_fp8: {EMULATED}", stacklevel=3
        )
    out = _BlockFp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, bias, amax_history, scale, record, config)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def block_quantize(t: torch.Tensor, rows: int, cols: int, fmt: Fp8Format, margin: int = 0) -> torch.Tensor:
    """``t`` rounded to what ``fmt`` holds with one scale per ``rows`` x ``cols`` block (edge blocks
    smaller), returned in float32: real FP8 casts, divided back by their block's scale."""
    height, width = t.shape
    pad_rows, pad_cols = -height % rows, -width % cols
    padded = torch.nn.functional.pad(t.float(), (0, pad_cols, 0, pad_rows))
    blocks = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    scales = compute_scale(amax, fmt, margin)
    rounded = cast_to_fp8(blocks, scales, fmt).float() / scales
    return rounded.view(padded.shape)[:height, :width]


class _BlockFp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, amax_history, scale, record, config: GemmConfig):
        fmt, margin = config.forward_format, config.margin
        x_q = block_quantize(x, 1, BLOCK, fmt, margin)
        w_q = block_quantize(weight, BLOCK, BLOCK, fmt, margin)
        out = in_dtype(x_q @ w_q.t(), config.out_dtype)
        if bias is not None:
            out = out + bias.to(config.out_dtype)
        if record:
            record_amax(amax_history, scale, INPUT, _amax(x), fmt, margin)
            record_amax(amax_history, scale, WEIGHT, _amax(weight), fmt, margin)
        ctx.save_for_backward(x, w_q)
        ctx.amax_history, ctx.scale, ctx.record, ctx.config = amax_history, scale, record, config
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, w_q = ctx.saved_tensors
        config: GemmConfig = ctx.config
        fmt, margin = config.backward_format, config.margin
        dy = grad_output
        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = in_dtype(block_quantize(dy, 1, BLOCK, fmt, margin) @ w_q, x.dtype)
        if ctx.needs_input_grad[1]:
            dy_q = block_quantize(dy, BLOCK, 1, fmt, margin)  # 128 tokens x 1 feature
            x_q = block_quantize(x, BLOCK, 1, config.forward_format, margin)
            grad_w = in_dtype(dy_q.t() @ x_q, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dim=0)
        if ctx.record:
            record_amax(ctx.amax_history, ctx.scale, GRAD_OUTPUT, _amax(dy), fmt, margin)
        return grad_x, grad_w, grad_bias, None, None, None, None


def _amax(t: torch.Tensor) -> torch.Tensor:
    return t.detach().abs().amax().float()
