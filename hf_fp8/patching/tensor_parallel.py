"""FP8 layers in a model that transformers' tensor parallelism (``tp_plan``) has sharded.

transformers installs each sharded layer's layout by replacing the module's ``forward`` with its
style's input, around and output transforms, and hands a layer that asks for it
(``_hf_quantized_needs_local_tp``, its extension point for quantized layers) plain local tensors: the
replicated input (its gradient summed over the ranks), the weight's local shard, and a row-wise layer's
partial output reduced after the layer. A converted layer asks for that and gets its style installed
again, so its casts and GEMMs run on local tensors. The amaxes of sharded tensors are then this rank's;
the step's end reduces every amax over the ranks (a MAX over the world group), so every rank scales by
the whole tensor's amax from the second step on, as FSDP2's shards do.

Column-wise and row-wise linear layers convert; a layer of another style (``colwise_gather_output``,
packed or expert styles) is refused before anything changes, as is a model sharded by ``fully_shard``
before patching or loaded with transformers' ``fsdp_size`` (its layout lives in FSDP2's references to
the old modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

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


def tensor_parallel_layouts(model: nn.Module) -> dict[str, TensorParallelLayout]:
    """The layout of every module of ``model`` whose own parameters are DTensors, by module name; raises,
    naming the weight, where one has no tensor-parallel style (sharded by ``fully_shard``)."""
    if not torch.distributed.is_available():
        return {}
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    wrapped = next((name for name, m in model.named_modules() if isinstance(m, FSDPModule)), None)
    if wrapped is not None:
        raise ValueError(
            f"patch_model: {wrapped or 'the model'} is already sharded by FSDP2 (fully_shard, or "
            "transformers' DistributedConfig(fsdp_size=...)), and converting it would lose its layout. Patch "
            "before sharding: patch_model and then fully_shard (prepare_fp8 and Fp8TrainerCallback do it in "
            "that order)"
        )
    sharded_modules = {}
    for name, module in model.named_modules():
        sharded = [(n, p) for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)]
        if sharded:
            sharded_modules[name] = sharded
    if not sharded_modules:
        return {}
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, replace_layer_number_by_wildcard

    plan = getattr(model, "tp_plan", None) or {}
    layouts = {}
    for name, sharded in sharded_modules.items():
        style_name = plan.get(replace_layer_number_by_wildcard(name))
        if style_name is None:
            param_name, param = sharded[0]
            raise ValueError(
                f"patch_model: {name}.{param_name} is already sharded (a DTensor, {tuple(param.placements)} "
                f"over {param.device_mesh.size()} ranks) by no tensor-parallel plan, and converting it would "
                "lose its layout. Patch before sharding: for FSDP2 or HSDP, patch_model and then fully_shard "
                "(prepare_fp8 and Fp8TrainerCallback do it in that order)"
            )
        mesh = sharded[0][1].device_mesh
        layouts[name] = TensorParallelLayout(ALL_PARALLEL_STYLES[style_name], style_name, mesh)
    return layouts


def check_layouts(layouts: dict[str, TensorParallelLayout], converted: list[str], backend: str) -> None:
    """Raise, before anything changes, where a layer that would convert has a layout FP8 cannot keep."""
    sharded = [name for name in converted if name in layouts]
    if sharded and backend != "native":
        raise ValueError(
            f"patch_model: {sharded[0]} is sharded by tensor parallelism, which the {backend} backend does "
            "not handle: use backend='native'"
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
