"""The three GEMMs of an FP8 linear layer, forward and backward, on ``torch._scaled_mm``.

* forward  ``y  = x @ W.T``   with x, W in the forward format (E4M3 unless the recipe says E5M2),
* dgrad    ``dx = dy @ W``    with dy in the backward format (E5M2 for ``hybrid``),
* wgrad    ``dW = dy.T @ x``  skipped when the weight is frozen.

Accumulation is float32 inside the GEMM; outputs come back in the requested dtype; the bias is added
in that precision. The backward keeps x's FP8 copy (half the bytes of a BF16 activation) and the
weight as it is: no FP8 copy of the weight lives from the forward to the backward (an 8B model under
FSDP2 on two H200s: 88.6 -> 74.6 GiB a GPU); the backward casts it again with the forward's scale.

Written for ``torch.compile``: each activation is cast once, straight into every layout a GEMM needs
(``x`` row-major for the forward and transposed for the weight gradient, ``dy`` likewise), so Inductor
makes one kernel of a cast, its transpose and the amax, and fuses it into whatever produced the tensor
(a norm, an activation). With delayed scaling the cast uses the stored scale and never waits for its
own tensor's amax.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hf_fp8.formats import (
    FP8_ALIGNMENT,
    Fp8Format,
    cast_statistics,
    cast_to_fp8,
    compute_scale,
    gpu_has_fp8,
)
from hf_fp8.numerics.cpu_gemm import cpu_fp8_mm
from hf_fp8.numerics.cuda_copies import transposed_copy
from hf_fp8.numerics.scaling import GRAD_OUTPUT, INPUT, WEIGHT, BackwardRecord, read_stored_scale

__all__ = ["GemmConfig", "choose_scale", "fp8_linear", "fp8_mm", "in_dtype", "pad_rows", "quantize"]


class GemmConfig(NamedTuple):
    """What an FP8 linear call needs to know besides its tensors. ``stored_scales``, per role (input,
    weight, grad_output): cast with the layer's stored scale (delayed scaling once the role has a
    history); otherwise the tensor is scaled by its own amax (current scaling, and delayed scaling
    before the role's first amax). ``forward_in_fp8`` ``False`` runs the forward GEMM in high
    precision and only the two backward GEMMs in FP8 (the output head under ``convert_lm_head:
    backward``: exact logits, FP8 speed for two thirds of its FLOPs; every layer under
    ``backward-fp8``). ``output_head``: the layer is the model's output head with its forward in high
    precision, whose output gradient is the logits', made row by row by the loss's backward (see
    transposed_fp8; tensor-wise scaling reads it, block and row-wise scales ignore it)."""

    forward_format: Fp8Format
    backward_format: Fp8Format
    stored_scales: tuple[bool, bool, bool]
    margin: int
    out_dtype: torch.dtype
    forward_in_fp8: bool = True
    output_head: bool = False


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    backward_record: BackwardRecord,
    weight_fp8: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    record: bool,
    config: GemmConfig,
    cast_counts: torch.Tensor | None = None,
    input_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` with all three GEMMs in FP8.

    ``amax_history`` / ``scale`` are the layer's scaling state (see :mod:`hf_fp8.numerics.scaling`), which
    the forward reads and writes; the backward writes into ``backward_record`` instead. ``record`` says
    whether this call is part of a training step (amaxes and scales are then written).
    ``weight_fp8`` and ``weight_scale`` are given when the weight is already in FP8 (stored frozen, or
    all-gathered so by FSDP2): its values and scale, used as they are; ``weight`` then only receives
    the gradient. ``cast_counts``, when given, counts what every cast of a recorded call does (see
    :class:`hf_fp8.layers.layer_scaling.CountsCasts`). ``input_scales``, when given, are another layer's
    scales whose stored input scale (equal to this layer's) ``x`` is cast with: layers that read one
    input then cast it with one buffer, which a compiled graph does once for all of them.
    """
    # Flattened and reshaped outside the Function: its output is then no view, so the caller may
    # change it in place (Falcon adds the attention output into the MLP's).
    out = _Fp8LinearFunction.apply(
        x.reshape(-1, x.shape[-1]),
        weight,
        bias,
        amax_history,
        scale,
        backward_record.amax,
        backward_record.scale,
        backward_record.cast_counts,
        weight_fp8,
        weight_scale,
        record,
        config,
        cast_counts,
        input_scales,  # not `scale` when None: one tensor twice among the inputs breaks Dynamo's trace
    )
    return out.reshape(*x.shape[:-1], out.shape[-1])


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        amax_history: torch.Tensor,
        scale: torch.Tensor,
        backward_amax: torch.Tensor,
        backward_scale: torch.Tensor,
        backward_counts: torch.Tensor | None,
        weight_fp8: torch.Tensor | None,
        weight_scale: torch.Tensor | None,
        record: bool,
        config: GemmConfig,
        cast_counts: torch.Tensor | None,
        input_scales: torch.Tensor | None,
    ) -> torch.Tensor:

        fmt = config.forward_format
        needs_x_grad, needs_w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        x_fp8 = x_inverse = None
        if config.forward_in_fp8 or needs_w_grad:
            x_scales = scale if input_scales is None else input_scales
            x_scale, x_fp8 = quantize(x, INPUT, fmt, amax_history, x_scales, config, record, cast_counts)
            x_inverse = x_scale.reciprocal()
        if weight_fp8 is not None:  # already in FP8: no cast, no amax
            w_scale, w_fp8 = weight_scale, weight_fp8
        elif config.forward_in_fp8:
            # With a stored weight scale the weight's amax is taken at the end of the step, for all
            # layers at once (see Fp8Module.step_end_amaxes), not by one more reduction per layer here.
            w_scale, w_fp8 = quantize(
                weight, WEIGHT, fmt, amax_history, scale, config, record, cast_counts,
                record_amax=not config.stored_scales[WEIGHT],
            )  # fmt: skip
        else:  # the backward casts the weight, with this scale
            w_scale = choose_scale(
                weight, WEIGHT, fmt, amax_history, scale, config, record,
                record_amax=not config.stored_scales[WEIGHT],
            )  # fmt: skip
            w_fp8 = None
        w_inverse = w_scale.reciprocal()
        if config.forward_in_fp8:
            # _scaled_mm wants a row-major left and a column-major right operand: W (out, in) row-major
            # is W.T column-major as it is (Conv1D stores W.T: its cast is laid out as W here).
            out = fp8_mm(x_fp8.contiguous(), w_fp8.contiguous().t(), x_inverse, w_inverse, config.out_dtype)
            if bias is not None:
                out = out + bias.to(config.out_dtype)
        else:  # what F.linear computes in out_dtype, the bias inside the GEMM as there (one rounding)
            dtype = config.out_dtype
            plain = weight.to(dtype) if weight_fp8 is None else (weight_fp8.to(dtype) * w_inverse).to(dtype)
            out = F.linear(x.to(dtype), plain, None if bias is None else bias.to(dtype))

        # x is saved in the layout dW = dy.T @ x reads: x.T, tokens padded to 16. The weight is saved as
        # it is, not as a cast copy: a parameter (or FP8 values stored or all-gathered) that lives anyway,
        # or that FSDP2 frees after the forward and gathers again for the backward. The backward casts
        # it again with the forward's scale (the same FP8 values), one layer at a time: the step never
        # holds an FP8 copy of every layer's weight. Scales are saved as made here (FSDP2 refills a
        # gathered weight's own scale in place when it gathers it again).
        x_t = pad_rows(x_fp8).t().contiguous() if needs_w_grad else None
        saved_weight = recast_scale = None
        if needs_x_grad:
            saved_weight = w_fp8 if weight_fp8 is not None else weight
            recast_scale = None if weight_fp8 is not None else w_scale
        # The gradient's stored scale, read here: the backward never reads the state, which a second
        # forward before it may have changed (see hf_fp8.layers.fp8_scaled).
        dy_stored_scale = read_stored_scale(scale, GRAD_OUTPUT, config.stored_scales[GRAD_OUTPUT])
        ctx.save_for_backward(x_t, saved_weight, x_inverse, w_inverse, recast_scale, dy_stored_scale)
        # The backward record is updated in place by every backward of the module (a module may run
        # twice in one forward), so it rides on ctx rather than through save_for_backward's checks (in
        # compiled graphs too, from torch 2.11). Its tensors reach apply() one by one: Dynamo traces
        # an autograd Function's tensor arguments, not tensors inside a tuple.
        ctx.backward_record = BackwardRecord(backward_amax, backward_scale, backward_counts)
        ctx.record = record
        ctx.config = config
        ctx.has_bias = bias is not None
        ctx.input_dtype = x.dtype
        ctx.weight_dtype = weight.dtype  # a gathered FP8 weight reports the dtype of its gradient
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_t, saved_weight, x_inverse, w_inverse, recast_scale, dy_stored_scale = ctx.saved_tensors
        config: GemmConfig = ctx.config
        backward_record: BackwardRecord = ctx.backward_record
        fmt = config.backward_format
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        dy_scale, dy_fp8 = quantize(
            dy,
            GRAD_OUTPUT,
            fmt,
            backward_record.amax,
            backward_record.scale,
            config,
            ctx.record,
            backward_record.cast_counts,
            stored_scale=dy_stored_scale,
        )
        dy_inverse = dy_scale.reciprocal()

        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            # dx = dy @ W: W (out, in) as the column-major right operand is W.T row-major.
            if recast_scale is not None:
                w_fp8 = cast_to_fp8(saved_weight, recast_scale, config.forward_format)
                if not config.forward_in_fp8 and ctx.record:
                    # The weight's only cast of the step takes its amax: a compiled backward reads the
                    # weight once for both, not again at the step's end (Fp8Module.step_end_amaxes).
                    slot = backward_record.amax[WEIGHT, 0]
                    backward_record.amax[WEIGHT, 0] = torch.maximum(slot, _rows_first_amax(saved_weight))
                if not config.forward_in_fp8 and ctx.record and backward_record.cast_counts is not None:
                    # and is counted as the forward's cast would be
                    stats = cast_statistics(saved_weight.detach(), recast_scale, w_fp8, config.forward_format)
                    backward_record.cast_counts[WEIGHT] += stats
                w_column_major = w_fp8.t().contiguous().t()
            elif saved_weight.stride(0) == 1:  # Conv1D stores W.T: column-major W as it is
                w_column_major = saved_weight
            else:
                w_column_major = column_major_copy(saved_weight, dy_fp8)
            grad_x = fp8_mm(dy_fp8.contiguous(), w_column_major, dy_inverse, w_inverse, ctx.input_dtype)
        if ctx.needs_input_grad[1]:
            # dW = dy.T @ x contracts over tokens, padded with zero rows to a multiple of 16.
            # An output head's dy is transposed by a copy of its own (see transposed_fp8), every other
            # layer's in the kernel that cast it.
            dy_rows = pad_rows(dy_fp8)
            dy_t = transposed_fp8(dy_rows) if config.output_head else dy_rows.t().contiguous()
            grad_w = fp8_mm(dy_t, x_t.t(), dy_inverse, x_inverse, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dim=0)
        return grad_x, grad_w, grad_bias, *(None,) * 11


@torch.library.custom_op("hf_fp8::column_major_copy", mutates_args=())
def column_major_copy(t: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """A column-major copy of the 2-D ``t``, made once ``after`` exists (it only orders the copy).

    For a weight already in FP8 (stored, or all-gathered by FSDP2), the input gradient's GEMM needs it
    column-major. Made from ``t`` with plain ops, a compiled step's partitioner may make the copy in the
    forward and keep it for the backward: under FSDP2 one byte a value of every layer's unsharded weight
    (measured). Taking the gradient's cast as ``after`` keeps the copy in the backward, one layer at a
    time. Eagerly a one-byte transpose is an uncoalesced strided copy; on a GPU it is one tiled pass."""
    return transposed_copy(t).t()


@column_major_copy.register_fake
def _(t: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    return t.new_empty_strided(t.shape, (1, t.shape[0]))


@torch.library.custom_op("hf_fp8::transposed_fp8", mutates_args=())
def transposed_fp8(t: torch.Tensor) -> torch.Tensor:
    """``t.transpose(-2, -1)`` of a 2-D tensor (or of each matrix of a 3-D one) of one-byte values, as a
    new contiguous tensor, in a pass of its own.

    Where Inductor would fuse the transpose into a kernel that walks the other dimension, it writes (or
    reads) one byte at a stride. For the logits' gradient, made by the loss's backward row by row
    (Gemma-3's 262k vocabulary, 8192 tokens: that kernel took 7.8 ms on an H200), and for the transposed
    FP8 copies of MoE experts (3-D weights, the weight gradient's operands), as an op Inductor leaves
    alone it is a tiled copy (:func:`hf_fp8.numerics.cuda_copies.transposed_copy` on a GPU: the loss's
    kernel 4.0 ms, the copy 1.3 ms). Elsewhere Inductor fuses the transpose into the cast, which costs
    less."""
    if t.dim() not in (2, 3):
        raise ValueError(f"transposed_fp8 takes a matrix or a stack of matrices, not a {t.dim()}-D tensor")
    return transposed_copy(t)


@transposed_fp8.register_fake
def _(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty((*t.shape[:-2], t.shape[-1], t.shape[-2]))


def quantize(
    t: torch.Tensor,
    role: int,
    fmt: Fp8Format,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    config: GemmConfig,
    record: bool,
    cast_counts: torch.Tensor | None,
    record_amax: bool = True,
    stored_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s scale for this step and ``t`` cast to ``fmt`` with it, for the scaling state's row
    ``role`` (see :func:`choose_scale`, also for ``stored_scale``); a recorded cast adds what it did to
    ``cast_counts[role]``."""
    chosen = choose_scale(t, role, fmt, amax_history, scale, config, record, record_amax, stored_scale)
    t_fp8 = cast_to_fp8(t, chosen, fmt)
    if record and cast_counts is not None:
        cast_counts[role] += cast_statistics(t.detach(), chosen, t_fp8, fmt)
    return chosen, t_fp8


def choose_scale(
    t: torch.Tensor,
    role: int,
    fmt: Fp8Format,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    config: GemmConfig,
    record: bool,
    record_amax: bool = True,
    stored_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scale ``t`` is cast with in this step, for the scaling state's row ``role``: the stored one
    (delayed scaling with a history), else from ``t``'s own amax. Records ``t``'s amax when ``record``
    (and ``record_amax``: a caller whose amax the step's end records says ``False``; a tensor without
    a stored scale takes its own amax whatever it says). ``stored_scale``, when given, is the role's
    stored scale as read before (a backward's, by its forward), in place of ``scale[role]``.

    The amax of a matrix is taken by rows first, then over the rows (the same value). Inductor then
    computes it in the kernel that makes the tensor or casts it, whatever made it: the logits' gradient,
    made row by row by the loss's backward, is never kept in high precision for a reduction of its own
    (Gemma-3's 262k vocabulary: 4 GiB more memory, and a kernel of 3.4 + 1.0 ms where the one kernel
    takes 2.8); and a training graph and a forward-only graph cast alike, so that a DPO reference model
    scores the first step exactly as its policy (one H200, 8b-4l shape: DPO's first loss ln 2, against
    0.746 with a whole-tensor amax, whose scale the two graphs computed in different kernels)."""
    stored = config.stored_scales[role]
    amax = None
    if (record and record_amax) or not stored:
        amax = _rows_first_amax(t)
    if stored:
        chosen = read_stored_scale(scale, role, stored) if stored_scale is None else stored_scale
    else:
        chosen = compute_scale(amax, fmt, config.margin)
        if record:  # what a checkpoint or a log reads is what was applied
            scale[role] = chosen
    if record and amax is not None:
        amax_history[role, 0] = torch.maximum(amax_history[role, 0], amax)
    return chosen


def _rows_first_amax(t: torch.Tensor) -> torch.Tensor:
    """``t``'s amax in float32, by rows first, then over the rows (:func:`choose_scale` says why)."""
    magnitude = t.detach().abs()
    return (magnitude.amax(dim=-1).amax() if t.dim() > 1 else magnitude.amax()).float()


def in_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is, never a no-op ``.to()``. Such a ``.to()``
    returns an alias, and an autograd.Function whose forward returned one lost its gradient when
    compiled (torch 2.11 on an H100, aot_eager and Inductor alike: its backward received zeros; the MoE
    experts trained with zero gradients). Results of this package's FP8 Functions go through here."""
    return t if t.dtype == dtype else t.to(dtype)


def pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) with zero rows appended up to a multiple of 16: FP8 GEMMs contract over (and cuBLAS
    wants) dimensions divisible by 16, and zero rows add nothing to a product."""
    extra = -t.shape[0] % FP8_ALIGNMENT
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, t.shape[1])])


_emulation_warned: set[tuple[str, torch.dtype, torch.dtype]] = set()


def fp8_mm(
    a: torch.Tensor, b: torch.Tensor, a_inverse: torch.Tensor, b_inverse: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(a * a_inverse) @ (b * b_inverse)`` for FP8 ``a`` (row-major) and ``b`` (column-major), where
    the inverses are the operands' dequantization factors (1 / the scale each was cast with).

    Uses ``torch._scaled_mm``; on the CPU, the call that gives its float32 fallback's numbers fast on
    this CPU (:mod:`hf_fp8.numerics.cpu_gemm`). Where a GPU cannot run this pairing (no FP8 tensor cores;
    cuBLAS has no E5M2 x E5M2 kernel) the product is emulated exactly: FP8 values multiply exactly in
    float32 and accumulate in float32, as the tensor cores do. Emulation is announced once per pairing.
    """
    if a.device.type == "cpu":
        return cpu_fp8_mm(a, b, a_inverse, b_inverse, out_dtype)
    if _scaled_mm_supported(a, b):
        return torch._scaled_mm(a, b, a_inverse, b_inverse, out_dtype=out_dtype)
    key = (a.device.type, a.dtype, b.dtype)
    # not from compiled code: a warning breaks the graph, and on torch 2.11 that break failed (Dynamo's
    # side effects); the patch report says it too (NativeBackend.attach)
    if key not in _emulation_warned and not torch.compiler.is_compiling():
        _emulation_warned.add(key)
        warnings.warn(
            f"hf_fp8: no FP8 GEMM kernel for {a.dtype} x {b.dtype} on {a.device.type}; emulating it "
            "exactly in float32 (same numerics, no FP8 speed-up)",
            stacklevel=3,
        )
    out = (a.float() @ b.float()) * (a_inverse * b_inverse)
    return in_dtype(out, out_dtype)


def _scaled_mm_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not hasattr(torch, "_scaled_mm"):
        return False
    if a.is_cuda:
        return gpu_has_fp8(a.device) and not a.dtype == b.dtype == torch.float8_e5m2
    return True  # another accelerator: its kernels, or its own error
