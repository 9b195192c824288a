"""Native PyTorch FP8 backend: ``Fp8Linear`` on ``torch.float8_*`` and ``torch._scaled_mm``.

Runs wherever ``torch._scaled_mm`` does (Hopper and Ada GPUs; the CPU in torch >= 2.13), so the FP8
numerics of training are the same in CPU tests and on the GPU. All three GEMMs of a linear layer run in
FP8 with tensorwise scales:

* forward  ``y  = x @ W.T``   with x, W in the forward format (E4M3 unless the recipe says E5M2),
* dgrad    ``dx = dy @ W``    with dy in the backward format (E5M2 for ``hybrid``),
* wgrad    ``dW = dy.T @ x``  skipped when the weight is frozen.

Accumulation is float32 inside the GEMM; outputs come back in the input's dtype (or the autocast
dtype); the bias is added in that precision. Only the FP8 copies of x and W are saved for backward,
so activations saved by an FP8 layer take half the memory of BF16 ones.

Per tensor role (input, weight, grad_output) the module keeps an amax history and a scale as
non-persistent buffers (they never show up in ``state_dict``, so HF checkpoints load unchanged).
Every FP8 forward/backward writes its amax into slot 0 of the history; :func:`update_fp8_scales`
ends a step by turning the histories into next step's scales and rolling them. A scale of 0 means
"no history yet": the tensor is then scaled by its own amax, so the first step is not wasted on a
guess.

With the recipe's ``fp8_weights``, a frozen weight is stored in FP8 (one byte a value plus a scale):
quantized once, never re-cast, no weight gradient and no high-precision copy on the device.
``state_dict`` still gives (and takes) the weight in its original dtype, so checkpoints stay HF's.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_fp8.autocast import fp8_active
from hf_fp8.distributed import default_amax_group, sync_amaxes
from hf_fp8.formats import FP8_ALIGNMENT, Fp8Format, cast_to_fp8, compute_scale, gpu_has_fp8
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.stored_weight import Fp8StoredWeight

__all__ = ["Fp8Conv1D", "Fp8Linear", "update_fp8_scales"]

# Rows of ``amax_history`` and entries of ``scale``.
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
_ROLES = ("input", "weight", "grad_output")


class _GemmConfig(NamedTuple):
    forward_format: Fp8Format
    backward_format: Fp8Format
    current_scaling: bool
    margin: int
    out_dtype: torch.dtype


class _Fp8Module(nn.Module):
    """State and forward shared by the FP8 replacements of ``nn.Linear`` and HF's ``Conv1D``."""

    recipe: Fp8Recipe

    def _init_fp8(self, recipe: Fp8Recipe | None) -> None:
        self.recipe = recipe or Fp8Recipe()
        self._reset_fp8_state()

    def _reset_fp8_state(self) -> None:
        device = self.weight.device
        history = torch.zeros(len(_ROLES), self.recipe.amax_history_len, device=device)
        self.register_buffer("amax_history", history, persistent=False)
        self.register_buffer("scale", torch.zeros(len(_ROLES), device=device), persistent=False)
        self.register_buffer("fp8_steps", torch.zeros((), dtype=torch.int64, device=device), persistent=False)

    def _adopt(self, source: nn.Module) -> None:
        """Take over ``source``'s weight and bias (the same Parameter objects) and its mode."""
        self.weight = source.weight
        self.bias = source.bias
        self.train(source.training)
        self._reset_fp8_state()

    @property
    def weight_in_fp8(self) -> bool:
        """Whether the weight is stored in FP8 (see :meth:`quantize_weight_`)."""
        return isinstance(self.weight, Fp8StoredWeight)

    @property
    def weight_scale(self) -> torch.Tensor:
        """The scale of a weight stored in FP8 (values = FP8 data / scale)."""
        return self.weight._scale

    @torch.no_grad()
    def quantize_weight_(self) -> None:
        """Store the frozen weight in FP8 with a tensorwise scale from its own amax, once.

        The parameter stays the same Python object (optimizers, DDP and tied references keep it) and
        keeps its shape, device and reported dtype: it becomes an :class:`Fp8StoredWeight` whose FP8
        values the GEMMs use directly. The high-precision values are freed.
        """
        if self.weight_in_fp8:
            return
        if self.weight.requires_grad:
            raise ValueError(
                "only frozen weights are stored in FP8 (a trainable weight needs its high-precision master "
                "copy); freeze it first (requires_grad=False), or leave fp8_weights off"
            )
        stored = Fp8StoredWeight.quantize(self.weight, self.recipe.forward_format, self.recipe.margin)
        torch.utils.swap_tensors(self.weight, nn.Parameter(stored, requires_grad=False))

    @torch.no_grad()
    def dequantize_weight_(self) -> None:
        """Undo :meth:`quantize_weight_`: the weight back as a plain tensor (FP8-rounded values)."""
        if self.weight_in_fp8:
            torch.utils.swap_tensors(self.weight, nn.Parameter(self.weight.dequantize(), requires_grad=False))

    def dequantized_weight(self, device: torch.device | None = None) -> torch.Tensor:
        """The weight as a plain tensor in its dtype (a temporary when it is stored in FP8)."""
        if not self.weight_in_fp8:
            return self.weight
        return self.weight.dequantize(device)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight_in_fp8:  # checkpoints keep HF's dtype; dequantized on the host, one layer at a time
            destination[prefix + "weight"] = self.dequantized_weight(torch.device("cpu"))

    @property
    def fp8_enabled(self) -> bool:
        """Whether the next forward runs in FP8 (training mode, or eval with ``use_during_eval``)."""
        return fp8_active(self.training, self.recipe.use_during_eval)

    def _fp8_forward(self, x: torch.Tensor, transposed: bool, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` in FP8, for the weight stored as W (out, in), or as W.T when ``transposed``."""
        stored = self.weight_in_fp8
        if stored and self.weight.requires_grad:
            raise RuntimeError(
                "this layer's weight is stored in FP8 (fp8_weights) and cannot train; keep it frozen, or "
                "call dequantize_weight_() first to train it in its original precision"
            )
        weight = self.weight._data if stored else self.weight
        weight = weight.t() if transposed else weight
        weight_scale = self.weight._scale if stored else None
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        config = _GemmConfig(
            forward_format=self.recipe.forward_format,
            backward_format=self.recipe.backward_format,
            current_scaling=self.recipe.scaling == "current",
            margin=self.recipe.margin,
            out_dtype=out_dtype,
        )
        # Only training forwards that build a graph are steps: a no_grad reference forward leaves the
        # amax histories alone.
        record = self.training and torch.is_grad_enabled()
        with torch.autocast(device_type, enabled=False):
            return _Fp8LinearFunction.apply(
                x, weight, bias, self.amax_history, self.scale, weight_scale, record, config
            )

    def _fp8_repr(self) -> str:
        r = self.recipe
        return f"format={r.format}, scaling={r.scaling}, margin={r.margin}"


class Fp8Linear(_Fp8Module, nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 while FP8 is active (see :mod:`hf_fp8.autocast`).

    A subclass of ``nn.Linear`` with the same ``weight``/``bias`` parameters, so ``isinstance`` checks,
    PEFT's LoRA dispatch and HF ``state_dict`` keys keep working. Outside FP8 (eval mode by default) it
    is exactly ``nn.Linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        recipe: Fp8Recipe | None = None,
    ) -> None:
        _check_gemm_shape(in_features, out_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8(recipe)

    @classmethod
    def from_float(cls, linear: nn.Linear, recipe: Fp8Recipe | None = None) -> Fp8Linear:
        """An ``Fp8Linear`` that shares ``linear``'s parameters (same objects, so optimizers and tied
        weights stay valid)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe)
        new._adopt(linear)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.dequantized_weight(), self.bias)
        return self._fp8_forward(x, False, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._fp8_repr()}"


class Fp8Conv1D(_Fp8Module, Conv1D):
    """FP8 version of transformers' ``Conv1D`` (GPT-2 and kin): a linear layer whose ``weight`` is stored
    transposed, as (in, out). The parameter keeps that shape, so checkpoints keep loading."""

    def __init__(self, nf: int, nx: int, recipe: Fp8Recipe | None = None) -> None:
        _check_gemm_shape(nx, nf)
        super().__init__(nf, nx)
        self._init_fp8(recipe)

    @classmethod
    def from_float(cls, conv: Conv1D, recipe: Fp8Recipe | None = None) -> Fp8Conv1D:
        """An ``Fp8Conv1D`` sharing ``conv``'s parameters."""
        with torch.device("meta"):
            new = cls(conv.nf, conv.nx, recipe=recipe)
        new._adopt(conv)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.dequantized_weight())
            return out.reshape(*x.shape[:-1], self.nf)
        return self._fp8_forward(x, True, self.bias)

    def __repr__(self) -> str:
        return f"Fp8Conv1D(nf={self.nf}, nx={self.nx}, {self._fp8_repr()})"


@torch.no_grad()
def update_fp8_scales(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """End an FP8 training step for every :class:`Fp8Linear` in ``model``.

    The step's amaxes are first reduced over ``group`` (default: the world group when distributed),
    in one all-reduce. Then, for delayed scaling, each role's new scale is computed from its amax
    history (``max`` over it, or its ``most_recent`` entry, which is the step just finished) every
    ``interval`` steps, and the histories roll so slot 0 is free for the next step. A patched model
    does this when the backward of each training forward has finished; call it yourself once per
    step when you use ``Fp8Linear`` without ``patch_model``.
    """
    modules = [m for m in model.modules() if isinstance(m, _Fp8Module)]
    end_fp8_step(modules, group or default_amax_group())


@torch.no_grad()
def end_fp8_step(modules: list[_Fp8Module], group: dist.ProcessGroup | None) -> None:
    """:func:`update_fp8_scales` for given FP8 layers and group (``None``: no reduction).

    Layers whose recipe and state tensors (device, shape, dtype) agree are advanced together: their
    state is stacked, updated with one set of kernels and copied back, so a step's end costs a few
    dozen kernel launches for the whole model instead of a few dozen per layer.
    """
    sync_amaxes(modules, group)
    batches: dict[tuple, list[_Fp8Module]] = {}
    for module in modules:
        history = module.amax_history
        batches.setdefault((module.recipe, history.device, history.shape, history.dtype), []).append(module)
    for (recipe, *_), batch in batches.items():
        _advance_steps(recipe, batch)


def _advance_steps(recipe: Fp8Recipe, modules: list[_Fp8Module]) -> None:
    histories = [m.amax_history for m in modules]
    scales = [m.scale for m in modules]
    steps = [m.fp8_steps for m in modules]
    history = torch.stack(histories)  # (layers, roles, history length)
    if recipe.scaling == "delayed":
        scale = torch.stack(scales)
        amax = history.amax(dim=2) if recipe.amax_compute_algo == "max" else history[:, :, 0]
        forward, backward = slice(None, GRAD_OUTPUT), slice(GRAD_OUTPUT, None)
        new_scale = torch.cat(
            [
                compute_scale(amax[:, forward], recipe.forward_format, recipe.margin, scale[:, forward]),
                compute_scale(amax[:, backward], recipe.backward_format, recipe.margin, scale[:, backward]),
            ],
            dim=1,
        )
        due = torch.remainder(torch.stack(steps), recipe.interval) == 0
        torch._foreach_copy_(scales, list(torch.where(due[:, None], new_scale, scale).unbind(0)))
    rolled = history.roll(1, dims=2)
    rolled[:, :, 0] = 0
    torch._foreach_copy_(histories, list(rolled.unbind(0)))
    torch._foreach_add_(steps, 1)


class _Fp8LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        amax_history: torch.Tensor,
        scale: torch.Tensor,
        weight_scale: torch.Tensor | None,
        record: bool,
        config: _GemmConfig,
    ) -> torch.Tensor:
        # FP8 GEMMs want row-major operands; casts keep their input's layout, so start contiguous.
        x2d = x.reshape(-1, x.shape[-1]).contiguous()
        fmt = config.forward_format
        x_scale = _pick_scale(x2d, INPUT, amax_history, scale, fmt, config, record)
        x_fp8 = cast_to_fp8(x2d, x_scale, fmt)
        if weight_scale is None:
            w_scale = _pick_scale(weight, WEIGHT, amax_history, scale, fmt, config, record)
            w_fp8 = cast_to_fp8(weight, w_scale, fmt)
        else:  # stored in FP8 (fp8_weights): no cast, no amax
            w_scale, w_fp8 = weight_scale, weight
            if record:
                scale[WEIGHT] = weight_scale
        # W (out, in) as the column-major right operand: free when W is row-major (nn.Linear), one copy
        # when it is stored transposed (Conv1D). dgrad below wants the opposite layout.
        out = _fp8_mm(x_fp8, w_fp8.contiguous().t(), x_scale, w_scale, config.out_dtype)
        if bias is not None:
            out = out + bias.to(config.out_dtype)

        needs_x_grad, needs_w_grad = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        ctx.save_for_backward(
            x_fp8 if needs_w_grad else None, w_fp8 if needs_x_grad else None, x_scale, w_scale
        )
        # The state buffers are updated in place by every call of the module (a module may run twice in
        # one forward), so they ride on ctx rather than through save_for_backward's version checks.
        ctx.amax_history = amax_history
        ctx.scale = scale
        ctx.record = record
        ctx.config = config
        ctx.has_bias = bias is not None
        ctx.input_shape = x.shape
        ctx.input_dtype = x.dtype
        ctx.weight_dtype = weight.dtype  # an FP8 weight is frozen: no gradient in this dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_fp8, w_fp8, x_scale, w_scale = ctx.saved_tensors
        config: _GemmConfig = ctx.config
        fmt = config.backward_format
        dy = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
        dy_scale = _pick_scale(dy, GRAD_OUTPUT, ctx.amax_history, ctx.scale, fmt, config, ctx.record)
        dy_fp8 = cast_to_fp8(dy, dy_scale, fmt)

        grad_x = grad_w = grad_bias = None
        if ctx.needs_input_grad[0]:
            # dx = dy @ W: W (out, in) must be the column-major right operand.
            w_col_major = w_fp8.t().contiguous().t()
            grad_x = _fp8_mm(dy_fp8, w_col_major, dy_scale, w_scale, ctx.input_dtype)
            grad_x = grad_x.reshape(ctx.input_shape)
        if ctx.needs_input_grad[1]:
            # dW = dy.T @ x contracts over tokens, which must be a multiple of 16: pad with zero rows.
            dy_t = _pad_rows(dy_fp8, FP8_ALIGNMENT).t().contiguous()
            x_col_major = _pad_rows(x_fp8, FP8_ALIGNMENT).t().contiguous().t()
            grad_w = _fp8_mm(dy_t, x_col_major, dy_scale, x_scale, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = dy.sum(dim=0)
        return grad_x, grad_w, grad_bias, None, None, None, None, None


def _pick_scale(
    t: torch.Tensor,
    role: int,
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fmt: Fp8Format,
    config: _GemmConfig,
    record: bool,
) -> torch.Tensor:
    """The scale for ``t`` in this step, recording ``t``'s amax in the history when ``record``.

    Delayed scaling uses the stored scale; current scaling, and delayed scaling before its first
    update (stored scale 0), use ``t``'s own amax. The scale used is written back to ``scale`` so that
    telemetry reads what was actually applied.
    """
    amax = t.detach().abs().amax().float()
    if record:
        amax_history[role, 0] = torch.maximum(amax_history[role, 0], amax)
    just_in_time = compute_scale(amax, fmt, config.margin)
    if config.current_scaling:
        chosen = just_in_time
    else:
        chosen = torch.where(scale[role] > 0, scale[role], just_in_time)
    if record:
        scale[role] = chosen
    return chosen


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -t.shape[0] % multiple
    if extra == 0:
        return t
    return torch.cat([t, t.new_zeros(extra, t.shape[1])])


_emulation_warned: set[tuple[str, torch.dtype, torch.dtype]] = set()


def _fp8_mm(
    a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` for FP8 ``a`` (row-major) and ``b`` (column-major).

    Uses ``torch._scaled_mm``. Where it cannot run this pairing (torch without it; cuBLAS has no
    E5M2 x E5M2 kernel) the product is emulated exactly: FP8 values multiply exactly in float32 and
    accumulate in float32, as the tensor cores do. Emulation is announced once per pairing.
    """
    if _scaled_mm_supported(a, b):
        return torch._scaled_mm(a, b, a_scale.reciprocal(), b_scale.reciprocal(), out_dtype=out_dtype)
    key = (a.device.type, a.dtype, b.dtype)
    if key not in _emulation_warned:
        _emulation_warned.add(key)
        warnings.warn(
            f"hf_fp8: no FP8 GEMM kernel for {a.dtype} x {b.dtype} on {a.device.type}; emulating it "
            "exactly in float32 (same numerics, no FP8 speed-up)",
            stacklevel=3,
        )
    out = (a.float() @ b.float()) * (a_scale.reciprocal() * b_scale.reciprocal())
    return out.to(out_dtype)


def _scaled_mm_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not hasattr(torch, "_scaled_mm"):
        return False
    if a.is_cuda:
        return gpu_has_fp8(a.device) and not a.dtype == b.dtype == torch.float8_e5m2
    return True


def _check_gemm_shape(in_features: int, out_features: int) -> None:
    dims = (("in_features", in_features), ("out_features", out_features))
    bad = {name: n for name, n in dims if n % FP8_ALIGNMENT}
    if bad:
        detail = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(
            f"FP8 GEMMs need both dimensions divisible by 16, got {detail}; keep this layer in high "
            "precision (patch_model skips it by itself) or pad its weight"
        )
