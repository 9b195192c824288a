"""FP8 layers in a model that transformers' tensor parallelism (``tp_plan``) has sharded.

transformers installs each sharded layer's layout by replacing the module's ``forward`` with its
style's input, around and output transforms, and hands a layer that asks for it
(``_hf_quantized_needs_local_tp``, its extension point for quantized layers) plain local tensors: the
replicated input (its gradient summed over the ranks), the weight's local shard, and a row-wise layer's
partial output reduced after the layer. A converted layer asks for that and gets its style installed
again, so its casts and GEMMs run on local tensors. The amaxes of sharded tensors are then this rank's;
the step's end reduces every amax over the ranks (a MAX over the world group), so every rank scales by
the whole tensor's amax from the second step on, as FSDP2's shards do.

Column-wise and row-wise linear layers convert (the output head's ``colwise_gather_output`` too: a
column-wise layer whose outputs transformers gathers after it); a layer of another style (packed or
expert styles) is refused before anything changes, and so are the recipe keys a sharded
weight cannot keep (``fp8_all_gather``, ``fp8_weights``). A model that transformers sharded with FSDP2 as
well (``DistributedConfig(tp_size=..., fsdp_size=...)``: FSDP2 x TP) keeps its tensor-parallel layouts
the same way, over the mesh dimension besides FSDP2's (see :mod:`hf_fp8.patching.fsdp_first` for the
FSDP2 side).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hf_fp8.patching.fsdp_first import Fsdp2Sharding
from hf_fp8.recipe import Fp8Recipe

__all__ = ["TensorParallelLayout", "check_layouts", "install_layouts", "tensor_parallel_layouts"]

_SUPPORTED = ("ColwiseParallel", "RowwiseParallel")


@dataclass(frozen=True)
class TensorParallelLayout:
    """A sharded layer's style (transformers' ``TensorParallelLayer``), its name in the plan and mesh."""

    style: Any
    style_name: str
    mesh: Any

    @property
    def supported(self) -> bool:
        return any(cls.__name__ in _SUPPORTED for cls in type(self.style).__mro__)


def tensor_parallel_layouts(
    model: nn.Module, sharding: Fsdp2Sharding | None
) -> dict[str, TensorParallelLayout]:
    """The layout of every module of ``model`` that tensor parallelism sharded, by module name: each
    module whose own parameters are DTensors (under FSDP2, ``sharding``: over a dimension besides
    FSDP2's). Raises, naming the weight, where such a module has no tensor-parallel style (sharded by
    something else)."""
    if not torch.distributed.is_available():
        return {}
    from torch.distributed.tensor import DTensor

    sharded_modules = {}
    for name, module in model.named_modules():
        sharded = [(n, p) for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
        if not sharded:
            continue
        mesh = sharded[0][1].device_mesh if sharding is None else sharding.model_parallel_mesh(module)
        if mesh is not None:
            sharded_modules[name] = (sharded[0], mesh)
    if not sharded_modules:
        return {}
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard

    plan = getattr(model, "tp_plan", None) or {}
    layouts = {}
    for name, ((param_name, param), mesh) in sharded_modules.items():
        style_name = plan.get(replace_layer_number_by_wildcard(name))
        if style_name is None:
            raise ValueError(
                f"patch_model: {name}.{param_name} is already sharded (a DTensor, {tuple(param.placements)} "
                f"over {param.device_mesh.size()} ranks) by no tensor-parallel plan, and converting it would "
                "lose its layout. Patch before sharding: for FSDP2 or HSDP, patch_model and then fully_shard "
                "(prepare_fp8 and Fp8TrainerCallback do it in that order); for tensor parallelism, load with "
                "transformers' DistributedConfig"
            )
        layouts[name] = TensorParallelLayout(ALL_PARALLEL_STYLES[style_name], style_name, mesh)
    return layouts


def check_layouts(
    layouts: dict[str, TensorParallelLayout], converted: list[str], backend: str, recipe: Fp8Recipe
) -> None:
    """Raise, before anything changes, where a layer that would convert has a layout FP8 cannot keep."""
    sharded = [name for name in converted if name in layouts]
    if sharded and backend != "native":
        raise ValueError(
            f"patch_model: {sharded[0]} is sharded by tensor parallelism, which the {backend} backend does "
            "not handle: use backend='native'"
        )
    if sharded and recipe.fp8_weights:
        raise ValueError(
            f"patch_model: {sharded[0]} is sharded by tensor parallelism, and fp8_weights (lora-fp8, "
            "lora-fp8-block) stores frozen weights as FP8 tensors, which hf-fp8 has not made work on "
            "tensor-parallel shards: use a recipe without it (backward-fp8, hybrid-delayed)"
        )
    if sharded and recipe.fp8_all_gather:
        raise ValueError(
            f"patch_model: {sharded[0]} is sharded by tensor parallelism, and fp8_all_gather casts weights "
            "for FSDP2's all-gather, which a tensor-parallel layer's weight never takes (each rank keeps "
            "its shard): use a recipe without it (hybrid-delayed, backward-fp8)"
        )
    for name in sharded:
        if not layouts[name].supported:
            raise ValueError(
                f"patch_model: {name} is sharded by the tensor-parallel style {layouts[name].style_name!r}; "
                "FP8 layers keep column-wise and row-wise layouts ('colwise', 'rowwise'). Leave it in high "
                "precision (modules_to_not_convert) or shard it column- or row-wise"
            )


def install_layouts(layouts: dict[str, TensorParallelLayout], replaced: dict[str, nn.Module]) -> None:
    """Give each converted sharded layer (``replaced``: the new modules by name) its layout again, asking
    for local tensors."""
    for name, new in replaced.items():
        layout = layouts.get(name)
        if layout is None:
            continue
        new._hf_quantized_needs_local_tp = True
        layout.style.install_forward(new, layout.mesh)
        new._is_hooked = True
