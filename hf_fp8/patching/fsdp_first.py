"""Patching a model that FSDP2 sharded before ``patch_model`` ran.

transformers shards while it loads: ``from_pretrained(path, distributed_config=DistributedConfig(
fsdp_size=..., dp_replicate_size=..., tp_size=...))`` applies tensor parallelism and then ``fully_shard``
(FSDP2, HSDP over a 2-D mesh) before weights are loaded, so the model reaches ``patch_model`` sharded.
FSDP2 keeps, for each parameter it manages, the module that holds it: it sets the gathered weight in
that module's parameter table before a forward and the shard after. A converted layer holds its
parameters in the very table of the module it replaced (see ``Fp8Scaled.remember_float_module``), so
FSDP2's writes reach it as they are, and nothing of FSDP2 is changed. The FSDP2 units themselves (the
decoder blocks, the embeddings, the output head and final norm that transformers' ``fsdp_plan`` wraps)
keep their class, with FSDP2's hooks on it: a unit that would convert stays in high precision, and the
report says why. FSDP2's parameter records (its ``FSDPParam``s: no public API shows them) are only read,
to tell the mesh dimensions of tensor parallelism from FSDP2's own under FSDP2 x TP.

What a weight FSDP2 shards already cannot do is refused before anything changes: weights stored or
all-gathered in FP8 (``fp8_weights``, ``fp8_all_gather``: the sharded parameter would have to become
an FP8 tensor subclass before ``fully_shard``) and the TE backend (not tested sharded). For those, patch
first and shard after (``patch_model`` then ``fully_shard``, as ``prepare_fp8`` and the Trainer callback
do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hf_fp8.recipe import Fp8Recipe

__all__ = ["SHARDED_FIRST", "UNIT_KEPT", "Fsdp2Sharding", "fsdp2_sharding"]

SHARDED_FIRST = (
    "FSDP2 sharded the model before patching: the FP8 layers train its shards (their weights all-gathered "
    "in their own dtype); its units themselves stay in high precision"
)

UNIT_KEPT = (
    "an FSDP2 unit of its own (sharded before patch_model): kept in high precision; patch before sharding "
    "to convert it"
)


@dataclass
class Fsdp2Sharding:
    """What FSDP2 holds of a model sharded before patching: its units and, by module, its parameter
    records (read only)."""

    units: set[int] = field(default_factory=set)  # ids of the modules fully_shard was applied to
    records: dict[int, list[Any]] = field(default_factory=dict)  # id(module) -> FSDP2's FSDPParams

    def check(self, recipe: Fp8Recipe) -> None:
        """Raise, before anything changes, where the sharding cannot honour the recipe (the backend is
        chosen or refused as for any FSDP2 model: ``backend_for_fsdp``)."""
        stored = [key for key in ("fp8_all_gather", "fp8_weights") if getattr(recipe, key)]
        if stored:
            raise ValueError(
                f"patch_model: the model is sharded by FSDP2 already (transformers' DistributedConfig with "
                f"fsdp_size or dp_replicate_size, or fully_shard before patching), and {stored[0]} needs its "
                "weights in FP8 before they are sharded. Patch before sharding (load without fsdp_size, "
                "patch_model, then fully_shard), or use a recipe without it (hybrid-delayed, backward-fp8)"
            )

    def model_parallel_mesh(self, module: nn.Module) -> Any:
        """The mesh over which ``module``'s parameters are sharded besides FSDP2's own dimensions (tensor
        parallelism under FSDP2 x TP), or ``None``."""
        for record in self.records.get(id(module), ()):
            mesh, data_parallel = record.sharded_param.device_mesh, record.mesh_info.mesh
            if mesh.ndim == data_parallel.ndim:
                continue
            names = [n for n in mesh.mesh_dim_names or () if n not in (data_parallel.mesh_dim_names or ())]
            if len(names) != mesh.ndim - data_parallel.ndim:
                raise ValueError(
                    "patch_model: FSDP2 shards a tensor-parallel model over a mesh whose dimensions have no "
                    "names, so the tensor-parallel one cannot be told apart: give init_device_mesh "
                    "mesh_dim_names"
                )
            return mesh[names[0]] if len(names) == 1 else mesh[tuple(names)]
        return None


def fsdp2_sharding(model: nn.Module) -> Fsdp2Sharding | None:
    """What FSDP2 holds of ``model``, or ``None`` when ``fully_shard`` was applied nowhere in it."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch before 2.6 exports FSDP2 elsewhere; hf-fp8 shards with it from 2.6 on
        return None

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return None
    sharding = Fsdp2Sharding(units={id(m) for m in units})
    for unit in units:
        state = unit._get_fsdp_state()
        # torch 2.13 keeps a list of parameter groups a unit; earlier versions one (or none)
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        for group in filter(None, groups):
            for record in group.fsdp_params:
                info = record._module_info
                for module in (info.module, *info.shared_modules):
                    sharding.records.setdefault(id(module), []).append(record)
    return sharding
