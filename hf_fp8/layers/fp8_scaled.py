"""``Fp8Scaled``: the scaling state every native FP8 module keeps, and how it is kept.

Per tensor role (a linear layer has three: input, weight, grad_output; an experts module six) the module
keeps an amax history and a scale as non-persistent buffers (never in ``state_dict``, so HF checkpoints
load unchanged), and a step counter. See :mod:`hf_fp8.numerics.scaling` for how they are used and updated. The
module owns its state: it says which tensors it is (``scaling_state``), keeps them float32 whatever
the model is cast to, and knows which roles already have a stored scale.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hf_fp8.autocast import fp8_active
from hf_fp8.layers.layer_scaling import LayerScaling, RoleScaling
from hf_fp8.numerics.gemm import GemmConfig
from hf_fp8.recipe import Fp8Recipe

__all__ = ["STATE_BUFFERS", "Fp8Scaled", "refresh_stored_scales"]

# The buffers of a module's scaling state, as they are named in the module and in checkpoints.
STATE_BUFFERS = ("amax_history", "scale", "fp8_steps")

# Steps at whose end a module reads back which of its roles have a stored scale (after that, a role
# first seen later keeps scaling by its own amax: correct, if slower).
_SCALE_CHECKS = 1


class Fp8Scaled(nn.Module):
    """The scaling state of a native FP8 module. Subclasses name their roles, forward ones first."""

    ROLE_NAMES: ClassVar[tuple[str, ...]]
    FORWARD_ROLES: ClassVar[int]  # the first FORWARD_ROLES roles are quantized by the forward
    recipe: Fp8Recipe

    def init_fp8_state(self, recipe: Fp8Recipe | None, device: torch.device) -> None:
        """Zeroed scaling state on ``device`` for ``recipe`` (default: the default recipe)."""
        self.recipe = recipe or Fp8Recipe()
        self.cast_counts: torch.Tensor | None = None  # see count_casts
        roles = len(self.ROLE_NAMES)
        history = torch.zeros(roles, self.recipe.amax_history_len, device=device)
        self.register_buffer("amax_history", history, persistent=False)
        self.register_buffer("scale", torch.zeros(roles, device=device), persistent=False)
        self.register_buffer("fp8_steps", torch.zeros((), dtype=torch.int64, device=device), persistent=False)
        # Per role, whether its stored scale comes from a history (see hf_fp8.numerics.scaling): a Python
        # flag, so that compiled code has no branch on tensor values. Read back from the scales at the end
        # of the module's first step and whenever the state is loaded: see refresh_stored_scales.
        self.stored_scales: tuple[bool, ...] = (False,) * roles
        self.scale_checks_left = _SCALE_CHECKS
        # What nn.DataParallel's replicas of this module recorded in the step (see record_replica): a
        # plain list, which every replica shares with this module (a replica's attributes are a shallow
        # copy of the module's).
        self.replica_records: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def _apply(self, fn, recurse: bool = True):
        """Moves (``.to(device)``, ``.cuda()``) apply to the scaling state; dtype casts of the model
        (``.half()``, ``.to(torch.bfloat16)``) do not: amaxes and scales stay float32, where gradient
        scales of 1e7 and more fit (float16 would turn them into inf). State leaving the meta device
        (``to_empty``) starts from zero, as a fresh module's does, not from uninitialised memory."""
        state = {name: self._buffers.pop(name) for name in STATE_BUFFERS if name in self._buffers}
        try:
            super()._apply(fn, recurse)
        finally:
            for name, tensor in state.items():
                moved = fn(tensor)
                if moved.dtype != tensor.dtype:
                    moved = tensor.to(moved.device)
                if tensor.is_meta and not moved.is_meta:
                    moved = torch.zeros_like(moved)
                self._buffers[name] = moved
            if getattr(self, "cast_counts", None) is not None:  # the counts go where the casts happen
                self.cast_counts = self.cast_counts.to(self.scale.device)
        return self

    def scaling_state(self, name: str) -> LayerScaling:
        """This module's scaling state (live tensors) by role, and by checkpoint key."""
        roles = {
            role: RoleScaling("fwd" if i < self.FORWARD_ROLES else "bwd", self.amax_history[i], self.scale[i])
            for i, role in enumerate(self.ROLE_NAMES)
        }
        return LayerScaling(name, self, roles, {b: getattr(self, b) for b in STATE_BUFFERS})

    def count_casts(self, on: bool) -> None:
        """Count what the casts of the following training steps do (``on``), from zero, or stop: each
        cast adds ``[values, saturated, flushed]`` to its role's row of ``cast_counts`` (see
        :class:`hf_fp8.layers.layer_scaling.CountsCasts`). A plain attribute, not a buffer: it is not saved,
        synchronised or moved with the model, and a compiled block sees whether it is set."""
        roles = len(self.ROLE_NAMES)
        device = self.scale.device
        self.cast_counts = torch.zeros(roles, 3, dtype=torch.int64, device=device) if on else None

    def record_replica(self) -> None:
        """Called on nn.DataParallel's replica of this module for one GPU, before its training forward.
        The replica records amaxes into copies of the module's amax history (the first GPU's share its
        storage), which nn.DataParallel drops after the forward; the copies, and cast counts of the
        replica's own, are kept in ``replica_records`` for the step's end to fold into the module's."""
        if self.cast_counts is not None:
            self.cast_counts = torch.zeros_like(self.cast_counts, device=self.scale.device)
        self.replica_records.append((self.amax_history, self.cast_counts))

    def take_replica_records(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The (amax history, cast counts) of the replicas recorded since the last call."""
        records, self.replica_records = self.replica_records, []
        return records

    def remember_float_module(self, source: nn.Module) -> None:
        """Keep the module this one was made from, to give it back on undo, and take over its parameter
        table: the two modules hold their parameters in one dict. Whoever replaces this module's
        parameters (FSDP2's sharding, ``load_state_dict(assign=True)``) so replaces that module's too,
        and the old ones are freed: kept by ``source``, they were the whole unsharded model on every
        FSDP2 rank. ``source`` is kept outside the submodules, so it is not in ``state_dict`` twice."""
        object.__setattr__(self, "_parameters", source._parameters)
        object.__setattr__(self, "_float_module", source)

    @property
    def float_module(self) -> nn.Module | None:
        return getattr(self, "_float_module", None)

    def step_end_amaxes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(newest-amax slot, tensor) for each tensor whose amax this module's casts leave to the end
        of the step, where it is taken for every layer at once; none by default."""
        return []

    def store_weights_in_fp8(self) -> None:
        """Store the module's frozen weights in FP8 (the recipe's ``fp8_weights``)."""
        raise NotImplementedError

    def to_float(self) -> nn.Module:
        """The plain module this one stands for, with the same parameters."""
        raise NotImplementedError

    @property
    def fp8_enabled(self) -> bool:
        """Whether the next forward runs in FP8 (training mode, or eval with ``use_during_eval``)."""
        return fp8_active(self.training, self.recipe.use_during_eval)

    def gemm_config(self, x: torch.Tensor) -> GemmConfig:
        """What this module's FP8 GEMMs on input ``x`` need besides tensors: the recipe's formats and
        margin, which roles cast with their stored scale, and the output dtype (autocast's, if on)."""
        device_type = x.device.type
        autocast = torch.is_autocast_enabled(device_type)
        return GemmConfig(
            forward_format=self.recipe.forward_format,
            backward_format=self.recipe.backward_format,
            stored_scales=self.stored_scale_roles(),
            margin=self.recipe.margin,
            out_dtype=torch.get_autocast_dtype(device_type) if autocast else x.dtype,
        )

    def stored_scale_roles(self) -> tuple[bool, ...]:
        """Per role, whether this step's casts use the stored scale (delayed scaling with a history)."""
        if self.recipe.scaling != "delayed":
            return (False,) * len(self.ROLE_NAMES)
        return self.stored_scales


@torch.no_grad()
def refresh_stored_scales(modules: list[Fp8Scaled], restored: bool = False) -> None:
    """Read back, in one transfer, which roles of ``modules`` have a stored scale (a scale > 0): at a
    step's end for those still in their first steps; for all of them when their state was
    ``restored`` (a checkpoint loaded, a step rolled back), after which a module whose roles do not all
    have a scale yet (a state from before the first step) is in its first steps again."""
    due = [m for m in modules if restored or m.scale_checks_left > 0]
    if not due:
        return
    flags = torch.cat([m.scale.detach().cpu() for m in due]).gt(0).tolist()
    start = 0
    for module in due:
        roles = len(module.ROLE_NAMES)
        module.stored_scales = tuple(flags[start : start + roles])
        if restored:
            module.scale_checks_left = 0 if all(module.stored_scales) else _SCALE_CHECKS
        else:
            module.scale_checks_left = max(module.scale_checks_left - 1, 0)
        start += roles
