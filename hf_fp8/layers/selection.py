"""Which modules ``patch_model`` converts, and why the others stay: one report entry per module.

Nothing here changes a model; :mod:`hf_fp8.patching.patch` acts on the decisions. The rules, in order, for
``nn.Linear`` and transformers' ``Conv1D``: already FP8, a subclass that computes something else or
whose weights its parent reads directly, a PEFT adapter weight, ``modules_to_not_convert``, the output
head or a weight tied to the input embeddings (unless ``convert_lm_head``; with ``convert_lm_head:
backward`` they convert with their forward GEMM in high precision), an MoE router, and dimensions that
are not multiples of 16 are skipped; the rest converts. A subclass converts when it
computes what its base class computes (checked on a probe: Falcon's ``FalconLinear``, for one).

Norms are recognised by what they compute; whether a backend converts them is its own business. MoE
experts in transformers' experts layout (3-D weights) convert when their matrices are multiples of 16;
their FLOPs count the tokens routed to them. Other modules with matrix weights are reported as GEMMs
left in high precision, so the report's FP8 share of GEMM FLOPs is honest.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_fp8.formats import FP8_ALIGNMENT
from hf_fp8.layers.experts import experts_problem, is_experts
from hf_fp8.layers.norms import norm_kind
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import CONVERTED, KEPT, SKIPPED, ModuleRecord

__all__ = [
    "ALREADY_FP8",
    "EXPERTS_KEPT",
    "FORWARD_KEPT",
    "HEAD_FORWARD_KEPT",
    "ModelContext",
    "excluded_by",
    "linear_shape",
    "matches",
    "module_record",
    "output_head",
    "output_head_layers",
    "record",
]

ALREADY_FP8 = "already FP8 (patched before; unpatch_model first to change the recipe)"
FORWARD_KEPT = "forward GEMM in high precision, dgrad and wgrad in FP8 (forward_in_fp8: false)"
HEAD_FORWARD_KEPT = (
    "forward GEMM (the logits) in high precision, dgrad and wgrad in FP8 (convert_lm_head: backward)"
)

EXPERTS_KEPT = (
    "MoE experts kept in high precision (convert_experts: false): the grouped FP8 GEMM and its casts were "
    "slower than BF16 experts at every MoE shape measured; convert_experts: true (or fp8_weights) runs "
    "them in FP8 with the native backend"
)

_ROUTER_NAMES = ("gate", "router")
_ADAPTER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass
class ModelContext:
    """Facts about the whole model that decisions about single modules need."""

    tied_weights: set[int]
    # the layers computing the output head (through PEFT's wrappers: see output_head_layers)
    output_heads: tuple[nn.Module, ...]
    num_experts: int | None
    experts_per_token: int | None
    # Linear layers whose weights their parent reads directly (nn.MultiheadAttention's out_proj).
    read_by_parent: set[int] = field(default_factory=set)

    @classmethod
    def of(cls, model: nn.Module) -> ModelContext:
        inputs = _call_or_none(model, "get_input_embeddings")
        # through PEFT's wrappers: a wrapper's weight attribute may be a merged copy, not the parameter
        embeddings = () if inputs is None else _unwrapped(inputs)
        tied = {id(m.weight) for m in embeddings if isinstance(getattr(m, "weight", None), torch.Tensor)}
        config = getattr(model, "config", None)
        num_experts = next(
            (
                getattr(config, key)
                for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
                if isinstance(getattr(config, key, None), int)
            ),
            None,
        )
        top_k = getattr(config, "num_experts_per_tok", None)
        read = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
        return cls(tied, output_head_layers(model), num_experts, top_k, read)


def module_record(
    name: str, module: nn.Module, recipe: Fp8Recipe, context: ModelContext, is_fp8: bool
) -> ModuleRecord | None:
    """The report entry for ``module`` (``None`` for modules that compute no GEMM and are no norm).

    ``action`` is ``converted`` for a GEMM layer that should become FP8, and for a norm a backend may
    convert (the backend then confirms or keeps it); ``is_fp8`` says the module already belongs to a
    backend.
    """
    if isinstance(module, (nn.Linear, Conv1D)):
        return _linear_record(name, module, recipe, context, is_fp8)
    if is_fp8:
        return record(name, module, "fp8", SKIPPED, ALREADY_FP8, gemm_flops=0)
    if is_experts(module):
        return _experts_record(name, module, recipe, context)
    norm = norm_kind(module)
    if norm is not None:
        pattern = excluded_by(name, recipe)
        if pattern is not None:
            return record(
                name, module, norm, KEPT, f"norm: matches modules_to_not_convert pattern {pattern!r}", 0
            )
        return record(name, module, norm, CONVERTED, "", gemm_flops=0)
    weights = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    if weights and not isinstance(module, nn.Embedding):
        return _other_weights_record(name, module, weights, context)
    return None


def excluded_by(name: str, recipe: Fp8Recipe) -> str | None:
    """The ``modules_to_not_convert`` pattern that matches ``name``, if any."""
    return next((p for p in recipe.modules_to_not_convert if matches(name, p)), None)


def matches(name: str, pattern: str) -> bool:
    """Whether the ``fnmatch`` ``pattern`` matches the dotted module ``name`` or a suffix of it."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an ``nn.Linear`` or a ``Conv1D``."""
    if isinstance(module, Conv1D):
        return module.nx, module.nf
    return module.in_features, module.out_features


def record(
    name: str,
    module: nn.Module,
    kind: str,
    action: str,
    reason: str,
    gemm_flops: int,
    forward_in_fp8: bool = True,
) -> ModuleRecord:
    """A report entry for ``module``, counting its own (not its children's) parameters."""
    params = sum(p.numel() for p in module.parameters(recurse=False))
    return ModuleRecord(name, type(module).__name__, kind, action, reason, params, gemm_flops, forward_in_fp8)


def _linear_record(
    name: str, module: nn.Module, recipe: Fp8Recipe, context: ModelContext, is_fp8: bool
) -> ModuleRecord:
    in_features, out_features = linear_shape(module)
    kind = "conv1d" if isinstance(module, Conv1D) else "linear"

    def result(action: str, reason: str = "", forward_in_fp8: bool = True) -> ModuleRecord:
        return record(name, module, kind, action, reason, in_features * out_features, forward_in_fp8)

    if is_fp8:
        return result(SKIPPED, ALREADY_FP8)
    base = "Conv1D" if isinstance(module, Conv1D) else "nn.Linear"
    if id(module) in context.read_by_parent:
        return result(SKIPPED, f"subclass of {base} whose weights its parent reads directly: not converted")
    if type(module) not in (nn.Linear, Conv1D) and not _computes_linear(
        type(module), module.bias is not None
    ):
        return result(
            SKIPPED, f"subclass of {base} that does not compute x @ W.T + b (probed): not converted"
        )
    if _is_adapter(name):
        return result(SKIPPED, "PEFT adapter weight: adapters train in high precision")
    pattern = excluded_by(name, recipe)
    if pattern is not None:
        return result(SKIPPED, f"matches modules_to_not_convert pattern {pattern!r}")
    tied = id(module.weight) in context.tied_weights
    is_head = any(module is head for head in context.output_heads)
    if not recipe.convert_lm_head:
        if tied:
            return result(
                SKIPPED, "weight tied to the input embeddings (set convert_lm_head: true to convert)"
            )
        if is_head:
            return result(SKIPPED, "output head (set convert_lm_head: true to convert)")
    if _is_router(name, out_features, context):
        return result(SKIPPED, f"MoE router ({out_features} outputs): routing stays in high precision")
    if in_features % FP8_ALIGNMENT or out_features % FP8_ALIGNMENT:
        dims = f"in_features={in_features}, out_features={out_features}"
        return result(SKIPPED, f"{dims}: FP8 GEMMs need multiples of {FP8_ALIGNMENT}")
    if not recipe.enabled:
        return result(SKIPPED, "FP8 disabled by the recipe (enabled: false)")
    if recipe.convert_lm_head == "backward" and (tied or is_head):
        return result(CONVERTED, HEAD_FORWARD_KEPT, forward_in_fp8=False)
    if not recipe.forward_in_fp8:
        return result(CONVERTED, FORWARD_KEPT, forward_in_fp8=False)
    return result(CONVERTED)


def _experts_record(name: str, module: nn.Module, recipe: Fp8Recipe, context: ModelContext) -> ModuleRecord:
    """MoE experts stored as 3-D weights: their GEMM FLOPs count the tokens each expert is routed
    (top-k of all experts), not the parameters stored."""
    params = sum(p.numel() for p in module.parameters(recurse=False) if p.dim() == 3)
    num_experts = getattr(module, "num_experts", None) or context.num_experts or 1
    flops = params * (context.experts_per_token or 1) // num_experts

    def result(action: str, reason: str = "") -> ModuleRecord:
        return record(name, module, "experts", action, reason, flops)

    pattern = excluded_by(name, recipe)
    if pattern is not None:
        return result(SKIPPED, f"matches modules_to_not_convert pattern {pattern!r}")
    problem = experts_problem(module)
    if problem is not None:
        return result(SKIPPED, problem)
    if not recipe.enabled:
        return result(SKIPPED, "FP8 disabled by the recipe (enabled: false)")
    if not recipe.forward_in_fp8:
        return result(SKIPPED, "forward_in_fp8: false: grouped expert GEMMs have no high-precision forward")
    if not (recipe.convert_experts or recipe.fp8_weights):
        return result(SKIPPED, EXPERTS_KEPT)
    return result(CONVERTED)


@functools.cache
def _computes_linear(cls: type, bias: bool) -> bool:
    """Whether a subclass of ``nn.Linear`` (or ``Conv1D``) computes what its base does, ``x @ W.T + b``
    (Falcon's ``FalconLinear`` adds its bias separately, for one): checked on a small probe instance built
    like the base class; a class that cannot be built so, or computes anything else, does not."""
    try:
        with torch.no_grad():
            generator = torch.Generator().manual_seed(0)
            if issubclass(cls, Conv1D):
                probe, weight_t = cls(16, 32), True  # Conv1D(nf=out, nx=in): weight stored (in, out)
            else:
                probe, weight_t = cls(32, 16, bias=bias), False
            probe.weight.copy_(torch.randn(probe.weight.shape, generator=generator))
            if probe.bias is not None:
                probe.bias.copy_(torch.randn(probe.bias.shape, generator=generator))
            x = torch.randn(3, 32, generator=generator)
            weight = probe.weight.t() if weight_t else probe.weight
            expected = torch.nn.functional.linear(x, weight, probe.bias)
            return torch.allclose(probe(x), expected, rtol=1e-5, atol=1e-5)
    except Exception:  # a constructor or forward unlike the base class's
        return False


def _other_weights_record(name: str, module: nn.Module, weights: list, context: ModelContext) -> ModuleRecord:
    """A module owning matrix weights that is neither a linear layer nor a norm (MoE experts, routers)."""
    params = sum(p.numel() for p in weights)
    class_name = type(module).__name__
    if "router" in class_name.lower() or name.rsplit(".", 1)[-1] in _ROUTER_NAMES:
        return record(name, module, "router", SKIPPED, "MoE router: routing stays in high precision", params)
    num_experts = getattr(module, "num_experts", None) or context.num_experts
    if num_experts and context.experts_per_token and any(p.dim() == 3 for p in weights):
        flops = params * context.experts_per_token // num_experts
        reason = (
            f"{class_name}: 3-D expert weights outside transformers' experts layout, kept in high precision"
        )
    else:
        flops = params
        reason = (
            f"{class_name} computes with its own matrix weights: not an nn.Linear, kept in high precision"
        )
    return record(name, module, "other", SKIPPED, reason, flops)


def _is_router(name: str, out_features: int, context: ModelContext) -> bool:
    if context.num_experts is None:
        return False
    return name.rsplit(".", 1)[-1] in _ROUTER_NAMES or out_features == context.num_experts


def _is_adapter(name: str) -> bool:
    # PEFT keeps adapters in ModuleDicts named lora_A, lora_B, ... inside each tuner layer.
    return any(part in _ADAPTER_NAMES for part in name.split("."))


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output head (HF's ``get_output_embeddings``); ``None`` for a model without one, or
    whose method says it has none by raising."""
    return _call_or_none(model, "get_output_embeddings")


def output_head_layers(model: nn.Module) -> tuple[nn.Module, ...]:
    """The layers that compute ``model``'s output head: the head itself or, where PEFT wraps it, the
    layers the wrapper computes with (a LoRA layer's base layer; ``modules_to_save``'s original and its
    trained copies; the layer under ``trainable_token_indices``' wrapper). PEFT's wrappers are recognised
    by their attributes, so PEFT is not imported."""
    head = output_head(model)
    return () if head is None else _unwrapped(head)


def _unwrapped(module: nn.Module) -> tuple[nn.Module, ...]:
    copies = getattr(module, "modules_to_save", None)
    if isinstance(copies, nn.ModuleDict) and hasattr(module, "original_module"):  # ModulesToSaveWrapper
        wrapped = [m for m in (module.original_module, *copies.values()) if m is not None]
        return tuple(layer for m in wrapped for layer in _unwrapped(m))
    original = getattr(module, "original_module", None)  # TrainableTokensWrapper, or a wrapper like it
    if isinstance(original, nn.Module) and original is not module:
        return _unwrapped(original)
    get_base_layer = getattr(module, "get_base_layer", None)  # a LoRA (or other tuner) layer
    if callable(get_base_layer) and get_base_layer() is not module:
        return _unwrapped(get_base_layer())
    return (module,)


def _call_or_none(model: nn.Module, method: str) -> Any:
    try:
        return getattr(model, method)()
    except (AttributeError, NotImplementedError):
        return None
