"""Block scaling in the native backend (the recipe ``scaling: block``): DeepSeek-V3's 1x128 tiles for
activations and gradients and 128x128 blocks for weights, each with its own scale, all in E4M3.

Every GEMM operand is cast in blocks along the dimension the GEMM contracts over, and every GEMM is
written ``a @ b.T`` with both operands row-major and contracting over their last dimension:

* forward ``y = x @ W.T``: ``x`` in 1x128 tiles (one token, 128 features), ``W`` in 128x128 blocks;
* dgrad ``dx = dy @ W``: ``dy`` in 1x128 tiles, ``W.T`` (the same 128x128 blocks, transposed);
* wgrad ``dW = dy.T @ x``: ``dy.T`` and ``x.T`` in 1x128 tiles, i.e. 128 tokens of one feature; under
  ``block_gw_rowwise`` each feature of ``dy`` and ``x`` scaled over all the tokens instead (row-wise
  scaling's weight gradient, :func:`~hf_fp8.numerics.rowwise.rowwise_weight_gradient`).

On Hopper these run on cuBLAS's block-scaled FP8 kernels through ``torch._scaled_mm`` (scales per 1x128
tile, ``VEC128``, and per 128x128 block, ``BLK128x128``; :func:`block_kernels_available`). cuBLAS reads
a 128x128 scale matrix with its rows padded to a multiple of 4 blocks, and torch 2.11 neither pads nor
refuses an unpadded one: the product comes out wrong. Where the contraction has a number of blocks
that is not a multiple of 4 (the output head's dgrad: 1,002 blocks of vocabulary for Llama 3), both
operands are therefore padded with zeros to whole groups of 4 blocks, which add nothing to the product.
On Hopper the casts come so padded: ``dy``'s row tiles from the fused casts below, the weight's blocks
from the kernel that casts and transposes them (:func:`cast_blocks_transposed`). (Handing the block
scales over as 1x128 tiles instead gives the same numbers on a slower kernel: 9.5 against 7.6 ms for
the 8b-4l head's dgrad on one H200.) Elsewhere (CPU, other GPUs) the GEMM is emulated exactly: the FP8
values times their scales in float32, multiplied in float32 (the patch report says so).

The backward's casts for the weight gradient (``dy`` both ways, ``x.T``) are one Triton kernel on Hopper
(:func:`cast_tiles_transposed`): one read of each tensor, the transpose written through shared memory.
Compiled from torch ops they read ``dy`` twice, the second time across rows (8b-4l on one H200: 116 ->
106 ms a step). Under ``torch.compile`` the q/k/v projections' shared ``x.T`` is cast once. Under
``block_gw_rowwise`` the weight gradient's per-column casts (:mod:`hf_fp8.numerics.column_casts`) also
write ``dy``'s row tiles, from the read that casts its columns.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F

from hf_fp8.formats import Fp8Format, cast_to_fp8, compute_scale
from hf_fp8.numerics.block_casts import fused_cast_blocks_transposed, fused_cast_tiles
from hf_fp8.numerics.column_casts import fused_cast_columns, fused_column_casts_available
from hf_fp8.numerics.cuda_copies import triton_installed
from hf_fp8.numerics.gemm import GemmConfig, in_dtype, pad_rows
from hf_fp8.numerics.rowwise import cast_columns, rowwise_weight_gradient
from hf_fp8.numerics.scaling import GRAD_OUTPUT, INPUT, WEIGHT, BackwardRecord, record_amax, tensor_amax

__all__ = [
    "BLOCK",
    "EMULATED",
    "block_kernels_available",
    "block_linear",
    "block_mm",
    "cast_blocks",
    "cast_blocks_transposed",
    "cast_tiles",
    "cast_tiles_transposed",
    "emulated_block_mm",
    "expand_block_scales",
]

BLOCK = 128
EMULATED = (
    "block scaling runs on cuBLAS's block-scaled FP8 kernels on Hopper GPUs (compute capability 9.0, "
    "torch >= 2.9 built with CUDA >= 12.9); elsewhere its GEMMs are emulated exactly in float32 (real "
    "FP8 casts and block scales, no FP8 speed-up)"
)


def block_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    backward_record: BackwardRecord,
    record: bool,
    config: GemmConfig,
    stored: tuple[torch.Tensor, torch.Tensor] | None = None,
    gw_rowwise: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with block-scaled FP8 operands (see the module docstring). ``stored`` is
    a frozen weight already in FP8: its values and 128x128 block scales, used as they are.
    ``gw_rowwise``: the weight gradient's operands scaled per feature over the tokens instead (the
    recipe's ``block_gw_rowwise``)."""
    out = _BlockFp8Linear.apply(
        x.reshape(-1, x.shape[-1]),
        weight,
        bias,
        amax_history,
        scale,
        backward_record.amax,
        backward_record.scale,
        record,
        config,
        stored,
        gw_rowwise,
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])


def cast_tiles(
    t: torch.Tensor, fmt: Fp8Format, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``t`` (rows, cols) cast to ``fmt`` with a scale per 1x128 tile of each row (the last tile of a row
    may be shorter): the FP8 values (row-major), the scales, (rows, ceil(cols / 128)), and ``t``'s amax
    (from the tiles' amaxes, for telemetry: no second pass over ``t``)."""
    return _cast(t, 1, fmt, margin)


def cast_tiles_transposed(
    t: torch.Tensor, fmt: Fp8Format, margin: int, with_rows: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a weight gradient needs of ``t`` (rows, cols): ``t.T`` in 1x128 tiles (128 rows of one
    column; rows padded with zeros to a multiple of 16, see :func:`pad_rows`), with ``with_rows`` also
    ``t`` in 1x128 tiles of its rows (what the input gradient needs of ``dy``; from the Triton kernel
    with zero columns up to whole groups of 4 tiles, as :func:`block_mm` takes them), else ``None``
    twice; then ``t``'s amax. As :func:`cast_tiles` gives each (up to that padding), bit for bit; on
    Hopper one Triton kernel reads ``t`` once for both and writes the transpose through shared memory,
    where the two casts compiled from torch ops read it twice, the second time across rows."""
    if _fused_casts_available(t.device):
        rows_fp8, row_scales, t_fp8, t_scales, amaxes = fused_cast_tiles(t, fmt, margin, with_rows)
        if not with_rows:
            rows_fp8 = row_scales = None
        return rows_fp8, row_scales, t_fp8, t_scales, amaxes.amax()
    rows_fp8 = row_scales = None
    if with_rows:
        rows_fp8, row_scales, _ = cast_tiles(t, fmt, margin)
    t_fp8, t_scales, amax = cast_tiles(pad_rows(t).t(), fmt, margin)
    return rows_fp8, row_scales, t_fp8, t_scales, amax


def cast_blocks(t: torch.Tensor, fmt: Fp8Format, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (rows, cols) cast to ``fmt`` with a scale per 128x128 block (edge blocks smaller): the FP8
    values (row-major) and the scales, (ceil(rows / 128), ceil(cols / 128))."""
    values, scales, _ = _cast(t, BLOCK, fmt, margin)
    return values, scales


def cast_blocks_transposed(
    t: torch.Tensor, fmt: Fp8Format, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the input gradient takes of a weight ``t`` (rows, cols) cast now: ``t.T`` in FP8, 128x128
    blocks as :func:`cast_blocks` gives them, row-major, with the blocks' scales as scales of ``t.T``
    (cols / 128, rows / 128); then ``t``'s amax. On Hopper one Triton kernel reads ``t`` once and writes
    the rows padded to whole groups of 4 blocks (see :func:`block_mm`)."""
    if _fused_casts_available(t.device):
        return fused_cast_blocks_transposed(t, fmt, margin)
    values, scales, amax = _cast(t, BLOCK, fmt, margin)
    return values.t().contiguous(), scales.t(), amax


def expand_block_scales(scales: torch.Tensor, rows: int, cols: int, block_rows: int = BLOCK) -> torch.Tensor:
    """Scales of ``block_rows`` x 128 blocks repeated to one per element of a (rows, cols) tensor."""
    full = scales.repeat_interleave(block_rows, dim=0).repeat_interleave(BLOCK, dim=1)
    return full[:rows, :cols]


def block_mm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    b_in_blocks: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``a @ b.T`` for row-major FP8 ``a`` (m, k) with 1x128 tile scales (m, k/128) and ``b`` (n, k)
    with 128x128 block scales (n/128, k/128) when ``b_in_blocks``, else 1x128 tile scales (n, k/128).
    Scales are the ones the operands were cast with (values = FP8 / scale). Either operand may come
    with zero columns past ``k`` (row tiles padded to whole groups of 4, :func:`cast_tiles_transposed`);
    the other is padded to match."""
    kernels = block_kernels_available(a.device)
    columns = max(a.shape[1], b.shape[1])
    if kernels and b_in_blocks:  # whole groups of 4 blocks (see the module docstring)
        columns += -columns % (4 * BLOCK)
    a, a_scales = _padded_contraction(a, a_scales, columns)
    b, b_scales = _padded_contraction(b, b_scales, columns)
    if kernels:
        a_inverse = a_scales.reciprocal().t().contiguous().t()  # (m, k/128), column-major
        # cuBLAS reads the right operand column-major (b.T), and its scales as scales of b.T
        b_inverse = b_scales.reciprocal()
        b_inverse = b_inverse.contiguous().t() if b_in_blocks else b_inverse.t().contiguous()
        return torch._scaled_mm(a, b.t(), a_inverse, b_inverse, out_dtype=out_dtype)
    if a.device.type != "cpu" and not torch.compiler.is_compiling():  # a warning would break a graph
        _warn_once(a.device.type)
    return emulated_block_mm(a, b, a_scales, b_scales, BLOCK if b_in_blocks else 1, out_dtype)


def _padded_contraction(
    values: torch.Tensor, scales: torch.Tensor, columns: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` (rows, k) FP8 with zero columns up to ``columns``, and its tile or block scales with
    scales of 1 for the new tiles; as they are where already that wide."""
    extra = columns - values.shape[1]
    if not extra:
        return values, scales
    padded = F.pad(values.view(torch.uint8), (0, extra)).view(values.dtype)  # FP8 zero is all zero bits
    return padded, F.pad(scales, (0, -(-columns // BLOCK) - scales.shape[1]), value=1.0)


@torch.library.custom_op("hf_fp8::emulated_block_mm", mutates_args=())
def emulated_block_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scales: torch.Tensor,
    b_scales: torch.Tensor,
    b_block_rows: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`block_mm` where no block-scaled kernel runs: each operand's exact FP8 values over their
    tile or block scales in float32 (``b``'s blocks ``b_block_rows`` rows high), a float32 GEMM, one
    rounding to ``out_dtype``. An op of its own, so that whoever watches the dispatcher (a test, a
    profiler) sees an FP8 GEMM as such."""
    a_values = a.float() / expand_block_scales(a_scales, *a.shape, block_rows=1)
    b_values = b.float() / expand_block_scales(b_scales, *b.shape, block_rows=b_block_rows)
    return in_dtype(a_values @ b_values.t(), out_dtype)


@emulated_block_mm.register_fake
def _(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scales: torch.Tensor,
    b_scales: torch.Tensor,
    b_block_rows: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


@torch.compiler.assume_constant_result  # compiled code asks at trace time and keeps the answer
def block_kernels_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs block-scaled FP8 GEMMs on ``device``: cuBLAS's 1x128 and
    128x128 kernels are Hopper's (compute capability 9.0), reached from torch 2.9 on."""
    return device.type == "cuda" and _cuda_has_block_kernels(device.index)


@torch.compiler.assume_constant_result
def _fused_casts_available(device: torch.device) -> bool:
    """Whether :func:`cast_tiles_transposed` and :func:`cast_blocks_transposed` take their Triton
    kernels on ``device`` (Hopper, Triton)."""
    return block_kernels_available(device) and triton_installed()


@functools.cache
def _cuda_has_block_kernels(index: int | None) -> bool:
    return (
        _version(torch.__version__) >= (2, 9)
        and _version(torch.version.cuda or "0") >= (12, 9)
        and torch.cuda.get_device_capability(index) == (9, 0)
    )


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2])


@functools.cache
def _warn_once(device_type: str) -> None:
    warnings.warn(f"hf_fp8: {EMULATED} ({device_type} here)", stacklevel=4)


def _cast(
    t: torch.Tensor, block_rows: int, fmt: Fp8Format, margin: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = t.shape
    extra_cols, extra_rows = -cols % BLOCK, -rows % block_rows  # edge blocks padded with zeros
    padded = F.pad(t, (0, extra_cols, 0, extra_rows)) if extra_cols or extra_rows else t
    blocks = padded.reshape(padded.shape[0] // block_rows, block_rows, padded.shape[1] // BLOCK, BLOCK)
    amax = blocks.detach().abs().amax(dim=(1, 3), keepdim=True).float()
    scales = compute_scale(amax, fmt, margin)
    values = cast_to_fp8(blocks, scales, fmt).reshape(padded.shape)[:rows, :cols]
    return values.contiguous(), scales.view(blocks.shape[0], blocks.shape[2]), amax.amax()


def _cast_for_rowwise_gradient(
    dy: torch.Tensor, fmt: Fp8Format, margin: int, with_rows: bool
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """What ``block_gw_rowwise``'s backward takes of ``dy``: its columns for the weight gradient
    (:func:`~hf_fp8.numerics.rowwise.cast_columns`), with ``with_rows`` its 1x128 row tiles and their
    scales for the input gradient (else ``None`` twice), and its amax. Where the fused column casts
    run, the tiles come from the same read as the columns' cast."""
    if fused_column_casts_available(dy.device):
        values, scales, amax, dy_fp8, dy_scales = fused_cast_columns(dy, fmt, margin, with_rows)
        return (values, scales), dy_fp8, dy_scales, amax
    values, scales, amax = cast_columns(dy, fmt, margin)
    return (values, scales), None, None, amax  # the input gradient casts its tiles itself


class _BlockFp8Linear(torch.autograd.Function):
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
        stored,
        gw_rowwise: bool,
    ):
        fmt, margin = config.forward_format, config.margin
        if config.forward_in_fp8:
            x_fp8, x_scales, x_amax = cast_tiles(x, fmt, margin)
            w_fp8, w_scales = stored if stored is not None else cast_blocks(weight, fmt, margin)
            out = block_mm(x_fp8, x_scales, w_fp8, w_scales, True, config.out_dtype)
            if bias is not None:
                out = out + bias.to(config.out_dtype)
            ctx.save_for_backward(x, w_fp8, w_scales)
        else:  # as F.linear (the output head's logits; any layer under forward_in_fp8: false)
            dtype = config.out_dtype
            if stored is not None:  # a weight stored in FP8 is its values over its block scales
                weight = stored[0].float() / expand_block_scales(stored[1], *stored[0].shape)
            out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
            x_amax = tensor_amax(x)
            ctx.save_for_backward(x, *(stored if stored is not None else (weight, None)))
        # a stored weight's scales were taken when it was stored; a weight that the backward casts (its
        # only cast of the step) has its amax taken there, from the blocks' amaxes
        weight_cast_later = stored is None and not config.forward_in_fp8 and ctx.needs_input_grad[0]
        if record:
            record_amax(amax_history, scale, INPUT, x_amax, fmt, margin)
            if stored is None and not weight_cast_later:
                record_amax(amax_history, scale, WEIGHT, tensor_amax(weight), fmt, margin)
        # the backward records into the layer's backward record, never into its state
        ctx.backward_record = BackwardRecord(backward_amax, backward_scale, None)
        ctx.record, ctx.config, ctx.gw_rowwise = record, config, gw_rowwise
        ctx.has_bias, ctx.weight_dtype = bias is not None, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, w_fp8, w_scales = ctx.saved_tensors
        config: GemmConfig = ctx.config
        fmt, margin = config.backward_format, config.margin
        dy = grad_output
        grad_x = grad_w = grad_bias = None
        dy_fp8 = dy_scales = dy_amax = None
        if ctx.needs_input_grad[1] and ctx.gw_rowwise:
            dy_columns, dy_fp8, dy_scales, dy_amax = _cast_for_rowwise_gradient(
                dy, fmt, margin, with_rows=ctx.needs_input_grad[0]
            )
            grad_w = rowwise_weight_gradient(dy_columns, x, config.forward_format, margin, ctx.weight_dtype)
        elif ctx.needs_input_grad[1]:
            # over the tokens (zero rows up to a multiple of 16 add nothing): 128 tokens of one feature
            dy_fp8, dy_scales, dy_t_fp8, dy_t_scales, dy_amax = cast_tiles_transposed(
                dy, fmt, margin, with_rows=ctx.needs_input_grad[0]
            )
            _, _, x_t_fp8, x_t_scales, _ = cast_tiles_transposed(
                x, config.forward_format, margin, with_rows=False
            )
            # in the weight's dtype from the GEMM itself where torch's block-scaled tests cover it
            written = torch.float32 if ctx.weight_dtype == torch.float16 else ctx.weight_dtype
            grad_w = block_mm(dy_t_fp8, dy_t_scales, x_t_fp8, x_t_scales, False, written)
            grad_w = in_dtype(grad_w, ctx.weight_dtype)
        if ctx.needs_input_grad[0]:
            if w_scales is None:  # forward in high precision: the weight is cast now, W.T in FP8
                w_t_fp8, w_t_scales, w_amax = cast_blocks_transposed(w_fp8, config.forward_format, margin)
                if ctx.record:
                    record = ctx.backward_record
                    record_amax(record.amax, record.scale, WEIGHT, w_amax, config.forward_format, margin)
            else:  # W.T in FP8: the same values and blocks, transposed
                w_t_fp8, w_t_scales = w_fp8.t().contiguous(), w_scales.t()
            if dy_fp8 is None:
                dy_fp8, dy_scales, dy_amax = cast_tiles(dy, fmt, margin)
            grad_x = block_mm(dy_fp8, dy_scales, w_t_fp8, w_t_scales, True, x.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dim=0)
        if ctx.record:
            dy_amax = tensor_amax(dy) if dy_amax is None else dy_amax
            record_amax(
                ctx.backward_record.amax, ctx.backward_record.scale, GRAD_OUTPUT, dy_amax, fmt, margin
            )
        return grad_x, grad_w, grad_bias, None, None, None, None, None, None, None, None
