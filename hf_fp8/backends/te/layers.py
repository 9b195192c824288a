"""Single layers as Transformer Engine modules: ``te.Linear`` for ``nn.Linear`` and GPT-2's ``Conv1D``
(the same weights, shared where TE can), ``te.LayerNorm`` / ``te.RMSNorm`` for norms, built under
``quantized_model_init`` where frozen weights are stored in FP8."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_fp8.backends.te.loading import load_te
from hf_fp8.backends.te.recipes import to_te_recipe
from hf_fp8.backends.te.state_dict import keep_hf_layout
from hf_fp8.formats import FP8_ALIGNMENT, compute_scale
from hf_fp8.layers.norms import norm_eps
from hf_fp8.recipe import Fp8Recipe

__all__ = ["init_context", "take_over", "te_linear", "te_norm"]


@contextlib.contextmanager
def init_context(recipe: Fp8Recipe, frozen: bool):
    """Where TE modules are built: under ``quantized_model_init`` when their weights are frozen and
    the recipe stores frozen weights in FP8 (weights that train keep their precision)."""
    te = load_te()
    if recipe.fp8_weights and frozen:
        with te.quantized_model_init(enabled=True, recipe=to_te_recipe(recipe)):
            yield
    else:
        yield


def _assign(param: nn.Parameter, value: torch.Tensor) -> None:
    """Copy ``value`` into a TE parameter. An FP8 parameter (``fp8_weights``) quantizes it; with delayed
    scaling its scale would still be TE's initial 1.0, so it is first set from the value's own amax."""
    with torch.no_grad():
        scale = getattr(getattr(param, "_quantizer", None), "scale", None)
        if torch.is_tensor(scale):
            scale.copy_(compute_scale(value.detach().abs().amax(), "e4m3").expand_as(scale))
        param.copy_(value)


def take_over(param: nn.Parameter, value: torch.Tensor, source: nn.Parameter) -> None:
    """``_assign`` plus ``source``'s ``requires_grad``. A frozen FP8 weight keeps only its row-major copy
    (1 byte a value): TE also stores a transposed copy, needed by the GEMMs of weights that train."""
    _assign(param, value)
    param.requires_grad_(source.requires_grad)
    if not param.requires_grad and hasattr(param, "update_usage"):
        param.update_usage(rowwise_usage=True, columnwise_usage=False)


def te_linear(module: nn.Module, recipe: Fp8Recipe) -> nn.Module:
    """``te.Linear`` computing what ``module`` (``nn.Linear`` or ``Conv1D``) computes, same weights."""
    if isinstance(module, Conv1D):
        weight, in_features, out_features = module.weight.t(), module.nx, module.nf
    else:
        weight, in_features, out_features = module.weight, module.in_features, module.out_features
    bias = module.bias
    frozen = not module.weight.requires_grad
    with init_context(recipe, frozen):
        new = _te_linear_class()(
            in_features,
            out_features,
            bias=bias is not None,
            params_dtype=weight.dtype,
            device=weight.device,
        )
    if (recipe.fp8_weights and frozen) or isinstance(module, Conv1D):
        take_over(new.weight, weight, module.weight)
    else:
        new.weight = module.weight  # share: tied weights and optimizer references stay valid
    if bias is not None:
        new.bias = bias
    keep_hf_layout(new, transposed=isinstance(module, Conv1D))
    new.train(module.training)
    return new


def _te_linear_class() -> type:
    """``te.Linear`` that also takes inputs whose row count is not a multiple of 16."""
    return rows_padded(load_te().Linear)


@functools.cache
def rows_padded(te_class: type) -> type:
    """``te_class`` (a TE module whose forward runs FP8 GEMMs over the rows of its input) taking inputs of
    any row count.

    TE's FP8 GEMMs refuse a row count that is not a multiple of 16, and the model's inputs are never
    padded (a packed row, a padding-free batch, one row per sequence in a classification head): the
    rows are zero-padded for the GEMMs and the output sliced back. A zero row adds nothing to a weight
    gradient, and RMSNorm keeps it zero."""

    class RowsPadded(te_class):
        _hf_fp8_te = True

        def forward(self, inp: torch.Tensor, *args: Any, **kwargs: Any):
            rows = inp.numel() // inp.shape[-1]
            extra = -rows % FP8_ALIGNMENT
            if extra == 0 or not _fp8_on():
                return super().forward(inp, *args, **kwargs)
            flat = torch.nn.functional.pad(inp.reshape(rows, inp.shape[-1]), (0, 0, 0, extra))
            out = super().forward(flat, *args, **kwargs)
            return out[:rows].reshape(*inp.shape[:-1], out.shape[-1])

    RowsPadded.__name__ = RowsPadded.__qualname__ = f"Te{te_class.__name__}"  # TeLinear, TeLayerNormMLP, ...
    return RowsPadded


def _fp8_on() -> bool:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.is_fp8_enabled()


def te_norm(module: nn.Module, kind: str) -> nn.Module | None:
    """``te.LayerNorm`` / ``te.RMSNorm`` for an HF norm of ``kind``; ``None`` when TE has no match."""
    te = load_te()
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter):
        return None
    common = dict(eps=norm_eps(module), device=weight.device, dtype=weight.dtype)
    if kind == "layernorm":
        if getattr(module, "bias", None) is None:
            return None
        new = te.LayerNorm(weight.shape[0], **common)
        new.weight, new.bias = module.weight, module.bias
    else:
        new = te.RMSNorm(weight.shape[0], zero_centered_gamma=kind == "rmsnorm (1 + w)", **common)
        new.weight = module.weight
    new.train(module.training)
    return new
