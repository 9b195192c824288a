"""Patching a model that FSDP2 sharded before ``patch_model`` ran.

transformers shards while it loads: ``from_pretrained(path, distributed_config=DistributedConfig(
fsdp_size=..., dp_replicate_size=..., tp_size=...))`` applies tensor parallelism and then ``fully_shard``
(FSDP2, HSDP over a 2-D mesh) before weights are loaded, so the model reaches ``patch_model`` sharded.
FSDP2 keeps, for each parameter it manages, the module that holds it: it sets the gathered weight on
that module before a forward and the shard after. A converted layer takes over its module's very
parameters, so FSDP2's records need only point at the new layer instead of the old one; that is what
:meth:`Fsdp2Sharding.hand_over` does (FSDP2 has no public way to do it: the records are its
``FSDPParam``'s module info, read and changed here only). The FSDP2 units themselves (the decoder
blocks, the embeddings, the output head and final norm that transformers' ``fsdp_plan`` wraps) keep
their class: a unit that would convert stays in high precision, and the report says why.

What a weight FSDP2 shards already cannot do is refused before anything changes: weights stored or
all-gathered in FP8 (``fp8_weights``, ``fp8_all_gather``: the sharded parameter would have to become
an FP8 tensor subclass before ``fully_shard``) and the TE backend (not tested sharded). For those, patch
first and shard after (``patch_model`` then ``fully_shard``, as ``prepare_fp8`` and the Trainer callback
do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hf_fp8.recipe import Fp8Recipe

__all__ = ["HANDED_OVER", "UNIT_KEPT", "Fsdp2Sharding", "fsdp2_sharding"]

HANDED_OVER = (
    "FSDP2 sharded the model before patching: the FP8 layers take over its records of their weights "
    "(all-gathered in their own dtype); its units themselves stay in high precision"
)

UNIT_KEPT = (
    "an FSDP2 unit of its own (sharded before patch_model): kept in high precision; patch before sharding "
    "to convert it"
)


@dataclass
class Fsdp2Sharding:
    """What FSDP2 holds of a model sharded before patching: its units and, by module, its parameter
    records."""

    units: set[int] = field(default_factory=set)  # ids of the modules fully_shard was applied to
    records: dict[int, list[Any]] = field(default_factory=dict)  # id(module) -> FSDP2's FSDPParams

    def check(self, recipe: Fp8Recipe, backend: str) -> None:
        """Raise, before anything changes, where the sharding cannot honour the recipe or backend."""
        stored = [key for key in ("fp8_all_gather", "fp8_weights") if getattr(recipe, key)]
        if stored:
            raise ValueError(
                f"patch_model: the model is sharded by FSDP2 already (transformers' DistributedConfig with "
                f"fsdp_size or dp_replicate_size, or fully_shard before patching), and {stored[0]} needs its "
                "weights in FP8 before they are sharded. Patch before sharding (load without fsdp_size, "
                "patch_model, then fully_shard), or use a recipe without it (the default, hybrid-delayed)"
            )
        if backend not in ("auto", "native"):
            raise ValueError(
                f"patch_model: the model is sharded by FSDP2 already, which the {backend} backend does not "
                "handle: use backend='native'"
            )

    def hand_over(self, replacements: list[tuple[nn.Module, nn.Module]]) -> None:
        """Point FSDP2's records of each replaced module's parameters at its replacement (and back, for
        pairs given the other way round)."""
        for old, new in replacements:
            for record in self.records.get(id(old), ()):
                info = record._module_info
                if info.module is old:
                    info.module = new
                info.shared_modules = [new if m is old else m for m in info.shared_modules]
            self.records[id(new)] = self.records.pop(id(old), [])


def fsdp2_sharding(model: nn.Module) -> Fsdp2Sharding | None:
    """What FSDP2 holds of ``model``, or ``None`` when ``fully_shard`` was applied nowhere in it."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        return None
    sharding = Fsdp2Sharding(units={id(m) for m in units})
    for unit in units:
        state = unit._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None) or [state._fsdp_param_group]
        for group in filter(None, groups):
            for record in group.fsdp_params:
                info = record._module_info
                for module in (info.module, *info.shared_modules):
                    sharding.records.setdefault(id(module), []).append(record)
    return sharding
