"""``TeBackend``: the Transformer Engine backend's class: which modules are TE's and their scaling
state (``fp8_meta``) by role, converting and fusing through the neighbouring files, ``te.autocast``
around each forward, and the undo (the original modules rebuilt from meta-device copies)."""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_fp8.backends.base import Fp8Backend, FusedBlock, Replaced
from hf_fp8.backends.te.fused_blocks import FUSED_MEMBERS, FusedAttentionInput, QkvSlice, fusable, fuse_block
from hf_fp8.backends.te.layers import te_linear, te_norm
from hf_fp8.backends.te.loading import load_te, te_usable
from hf_fp8.backends.te.recipes import to_te_recipe
from hf_fp8.backends.te.state_dict import install_state_dict_hooks
from hf_fp8.layers.layer_scaling import LayerScaling, RoleScaling
from hf_fp8.layers.selection import excluded_by, record
from hf_fp8.module_tree import get_path, set_path
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import CONVERTED, PatchReport

__all__ = ["TeBackend", "recomputes_activations"]


def _is_te_module(module: nn.Module) -> bool:
    """Whether ``module`` is already a Transformer Engine module (or one of our fused wrappers)."""
    if isinstance(module, (FusedAttentionInput, QkvSlice)):
        return True
    return getattr(module, "_hf_fp8_te", False) or type(module).__module__.startswith("transformer_engine.")


def _has_scaling_state(module: nn.Module) -> bool:
    """Whether ``module`` is a TE layer that keeps FP8 scaling state (``fp8_meta``); our fused
    wrappers delegate to such layers and keep none of their own."""
    return _is_te_module(module) and isinstance(getattr(module, "fp8_meta", None), dict)


class TeBackend(Fp8Backend):
    """Transformer Engine modules for linear layers and norms, fused Llama-family blocks, and
    ``te.autocast`` around each forward. TE ends its own FP8 steps inside its autocast."""

    name = "te"
    fuses_blocks = True
    keeps_norms = None
    keeps_experts = (
        "MoE experts: the Transformer Engine backend keeps them in high precision (backend='native' with "
        "convert_experts: true runs them in FP8)"
    )
    compiles = False
    recompute_problem = "would recompute layers outside te.autocast, in another precision"
    fsdp_problem = (
        "hf-fp8 has not tested Transformer Engine's modules sharded by FSDP, and the FP8 all-gather of "
        "weights is the native backend's"
    )
    data_parallel_problem = (
        "Transformer Engine keeps its autocast and FP8 step state per process, and nn.DataParallel runs "
        "the replicas of the model in threads of one process"
    )
    zero_problem = (
        "hf-fp8 has not tested Transformer Engine's modules under DeepSpeed ZeRO (ZeRO-3 would partition "
        "and gather their fused weights, and TE keeps FP8 copies of weights of its own)"
    )

    def __init__(self, recipe: Fp8Recipe) -> None:
        super().__init__(recipe)
        self.te_recipe = to_te_recipe(recipe)
        self.originals: list[_Original] = []

    @classmethod
    def usable(cls, device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, "the model is not on a GPU"
        return te_usable()

    @classmethod
    def check(cls, recipe: Fp8Recipe) -> None:
        load_te()  # raises with the reason and the way out
        to_te_recipe(recipe)  # refuses what TE cannot do

    @classmethod
    def owns(cls, module: nn.Module) -> bool:
        return _is_te_module(module)

    @classmethod
    def layer_scaling(cls, name: str, module: nn.Module) -> LayerScaling | None:
        if not _has_scaling_state(module):
            return None
        roles, tensors = {}, {}
        for key, meta in _te_metas(module):
            direction = _DIRECTIONS[key]
            roles["forward" if direction == "fwd" else "backward"] = RoleScaling(
                direction, meta.amax_history, meta.scale
            )
            tensors.update({f"{key}.{t}": getattr(meta, t) for t in ("scale", "amax_history")})
        return LayerScaling(name, module, roles, tensors) if roles else None

    def convert_linear(self, module: nn.Module, forward_in_fp8: bool = True) -> nn.Module:
        return te_linear(module, self.recipe)

    def convert_norm(self, module: nn.Module, kind: str) -> tuple[nn.Module | None, str]:
        new = te_norm(module, kind)
        if new is None:
            return (
                None,
                "norm: no Transformer Engine equivalent (no affine weight, or no bias); kept as it is",
            )
        return new, f"te.{type(new).__name__}"

    def fuse(self, name: str, block: nn.Module) -> FusedBlock | None:
        members = [f"{name}.{member}" for member in FUSED_MEMBERS]
        if not fusable(block) or any(excluded_by(m, self.recipe) for m in members):
            return None
        records = []
        for member, (kind, reason) in FUSED_MEMBERS.items():
            module = get_path(block, member)
            flops = module.in_features * module.out_features if kind == "linear" else 0
            records.append(record(f"{name}.{member}", module, kind, CONVERTED, reason, flops))
        replacements, handles = fuse_block(block, self.recipe)
        return FusedBlock(records, replacements, handles)

    def attach(
        self, model: nn.Module, replaced: list[Replaced], report: PatchReport
    ) -> list[RemovableHandle]:
        skeletons: dict[int, nn.Module] = {}
        for entry in replaced:
            original = entry.original
            if original is None:  # a new attribute (the fused q/k/v owner): removed on undo
                self.originals.append(_Original(entry.path, None))
                continue
            current = get_path(model, entry.path)
            shared = tuple(
                name
                for name, p in original.named_parameters(recurse=False)
                if getattr(current, name, None) is p
            )
            skeleton = skeletons.setdefault(id(original), _skeleton(original))
            device = next(itertools.chain(original.parameters(), original.buffers()), torch.empty(0)).device
            self.originals.append(_Original(entry.path, skeleton, shared, device))
        return install_state_dict_hooks(model)

    def unpatch(self, model: nn.Module, hooks: list[RemovableHandle]) -> None:
        """The original modules back, each on its replacement's device, with the weights in HF's keys and
        layouts: read through the block hooks, which go before the weights are loaded back. Shared
        parameters are handed back."""
        state_dict = model.state_dict()
        for handle in hooks:
            handle.remove()
        restored: dict[int, nn.Module] = {}
        for original in reversed(self.originals):
            current = get_path(model, original.path)
            if original.skeleton is None:
                set_path(model, original.path, None)
                continue
            module = restored.get(id(original.skeleton))
            if module is None:
                module = original.skeleton.to_empty(device=original.device)
                for name in original.shared:
                    setattr(module, name, getattr(current, name))
                restored[id(original.skeleton)] = module
            set_path(model, original.path, module)
        model.load_state_dict(state_dict, strict=True)  # every restored weight must come back

    def forward_context(self, model: nn.Module, fp8: bool, group: Any) -> contextlib.AbstractContextManager:
        if fp8 and model.training and recomputes_activations(model):
            raise RuntimeError(
                "hf_fp8: gradient checkpointing with the Transformer Engine backend "
                f"{self.recompute_problem}; disable it or use backend='native'"
            )
        import transformer_engine.pytorch as te

        return te.autocast(enabled=fp8, recipe=self.te_recipe, amax_reduction_group=group)

    def end_step(self, group: Any) -> None:
        """Nothing to do: TE reduces amaxes and updates scales inside ``te.autocast``."""

    def set_recipe(self, recipe: Fp8Recipe) -> None:
        super().set_recipe(recipe)
        self.te_recipe = to_te_recipe(recipe)

    def prepare_to_load(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        for name, module in model.named_modules():
            saved_scale = state.get(f"{name}.scaling_fwd.scale")
            if saved_scale is not None and _has_scaling_state(module):
                _create_te_metas(module, self.te_recipe, num_gemms=saved_scale.numel() // 3)


@dataclass
class _Original:
    """A replaced module, kept as a meta-device copy (its class and configuration, no memory), with the
    names of the parameters its replacement shares (the same objects, handed back on unpatch)."""

    path: str
    skeleton: nn.Module | None
    shared: tuple[str, ...] = ()
    device: torch.device | None = None


def _skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device: its class and
    configuration without its memory, to rebuild it on unpatch."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        )
    return copy.deepcopy(module, memo)


def recomputes_activations(model: nn.Module) -> bool:
    """Gradient (since transformers 5: activation) checkpointing is on."""
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), attr) or attr in vars(model):
            return bool(getattr(model, attr))
    return False


# A TE layer's delayed-scaling meta by fp8_meta key, and the direction of the tensors it scales.
_DIRECTIONS = {"scaling_fwd": "fwd", "scaling_bwd": "bwd"}


def _te_metas(module: nn.Module) -> list:
    """(key, meta) for a TE layer's delayed-scaling meta (none before its first FP8 forward)."""
    metas = getattr(module, "fp8_meta", {})
    return [(k, metas[k]) for k in _DIRECTIONS if k in metas and hasattr(metas[k], "amax_history")]


def _create_te_metas(module: nn.Module, te_recipe, num_gemms: int) -> None:
    """Make a TE layer's delayed-scaling meta before its first forward, as that forward would (the
    number of GEMMs comes from the saved state: 3 forward tensors each), so loaded values are kept:
    TE's first forward finds meta of the recipe's kind and leaves it alone."""
    if getattr(module, "fp8_meta_tensors_initialized", False):
        return
    module.fp8_meta["recipe"] = te_recipe
    module.fp8_meta["num_gemms"] = num_gemms
    module.init_fp8_meta_tensors(te_recipe)
