"""``Fp8Scaled``: the scaling state every native FP8 module keeps, and how it is kept.

Per tensor role (a linear layer has three: input, weight, grad_output; an experts module six) the module
keeps an amax history and a scale as non-persistent buffers (never in ``state_dict``, so HF checkpoints
load unchanged), and a step counter. See :mod:`hf_fp8.numerics.scaling` for how they are used and updated. The
module owns its state: it says which tensors it is (``scaling_state``), keeps them float32 whatever
the model is cast to, and knows which roles already have a stored scale.

Backwards never touch that state. What a backward records (its gradients' amaxes, the scales it applied,
its cast counts) goes into the module's backward record, which the step's end folds into the state
(:func:`fold_backward_records`); the stored scales a backward casts with are read by its forward. A
compiled graph saves the tensors its backward uses and checks at the backward that nothing changed
them since: had the backward used the state, a second training forward before the backward (DPO,
contrastive losses) would have changed it and failed that check.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
from torch import nn

from hf_fp8.autocast import fp8_active
from hf_fp8.layers.layer_scaling import LayerScaling, RoleScaling
from hf_fp8.numerics.gemm import GemmConfig
from hf_fp8.numerics.scaling import BackwardRecord
from hf_fp8.recipe import Fp8Recipe

__all__ = [
    "BACKWARD_BUFFERS",
    "STATE_BUFFERS",
    "Fp8Scaled",
    "clear_backward_records",
    "fold_backward_records",
    "fold_replica_records",
    "refresh_stored_scales",
]

# The buffers of a module's scaling state, as they are named in the module and in checkpoints.
STATE_BUFFERS = ("amax_history", "scale", "fp8_steps")
# The buffers of its backward record: zero between steps, so never in checkpoints.
BACKWARD_BUFFERS = ("backward_amax", "backward_scale")


# Steps at whose end a module reads back which of its roles have a stored scale (after that, a role
# first seen later keeps scaling by its own amax: correct, if slower).
_SCALE_CHECKS = 1


class ReplicaRecord(NamedTuple):
    """What one of nn.DataParallel's replicas of a module recorded in a step (see record_replica)."""

    amax_history: torch.Tensor
    backward_amax: torch.Tensor
    cast_counts: torch.Tensor | None
    backward_cast_counts: torch.Tensor | None


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
        # The backward record: each role's amax as a one-slot history (the newest slot of amax_history,
        # as the backward's casts see it) and the scale a backward applied (0: none recorded).
        self.register_buffer("backward_amax", torch.zeros(roles, 1, device=device), persistent=False)
        self.register_buffer("backward_scale", torch.zeros(roles, device=device), persistent=False)
        self.backward_cast_counts: torch.Tensor | None = None
        # Per role, whether its stored scale comes from a history (see hf_fp8.numerics.scaling): a Python
        # flag, so that compiled code has no branch on tensor values. Read back from the scales at the end
        # of the module's first step and whenever the state is loaded: see refresh_stored_scales.
        self.stored_scales: tuple[bool, ...] = (False,) * roles
        self.scale_checks_left = _SCALE_CHECKS
        # What nn.DataParallel's replicas of this module recorded in the step (see record_replica): a
        # plain list, which every replica shares with this module (a replica's attributes are a shallow
        # copy of the module's).
        self.replica_records: list[ReplicaRecord] = []

    def _apply(self, fn, recurse: bool = True):
        """Moves (``.to(device)``, ``.cuda()``) apply to the scaling state; dtype casts of the model
        (``.half()``, ``.to(torch.bfloat16)``) do not: amaxes and scales stay float32, where gradient
        scales of 1e7 and more fit (float16 would turn them into inf). State leaving the meta device
        (``to_empty``) starts from zero, as a fresh module's does, not from uninitialised memory."""
        kept = STATE_BUFFERS + BACKWARD_BUFFERS
        state = {name: self._buffers.pop(name) for name in kept if name in self._buffers}
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
            for name in ("cast_counts", "backward_cast_counts"):  # the counts go where the casts happen
                if getattr(self, name, None) is not None:
                    setattr(self, name, getattr(self, name).to(self.scale.device))
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
        :class:`hf_fp8.layers.layer_scaling.CountsCasts`), a backward's cast to ``backward_cast_counts``
        (added in at the step's end). Plain attributes, not buffers: they are not saved, synchronised or
        moved with the model, and a compiled block sees whether they are set."""
        roles = len(self.ROLE_NAMES)
        device = self.scale.device
        self.cast_counts = torch.zeros(roles, 3, dtype=torch.int64, device=device) if on else None
        self.backward_cast_counts = torch.zeros_like(self.cast_counts) if on else None

    def backward_record(self) -> BackwardRecord:
        """Where this module's backwards record (see the module's docstring)."""
        return BackwardRecord(self.backward_amax, self.backward_scale, self.backward_cast_counts)

    def record_replica(self) -> None:
        """Called on nn.DataParallel's replica of this module for one GPU, before its training forward.
        The replica records amaxes into copies of the module's amax history (the first GPU's share its
        storage), which nn.DataParallel drops after the forward; the copies, and cast counts of the
        replica's own, are kept in ``replica_records`` for the step's end to fold into the module's; so is
        the replica's backward record (its backward writes into copies too)."""
        if self.cast_counts is not None:
            self.cast_counts = torch.zeros_like(self.cast_counts, device=self.scale.device)
            self.backward_cast_counts = torch.zeros_like(self.cast_counts)
        record = ReplicaRecord(
            self.amax_history, self.backward_amax, self.cast_counts, self.backward_cast_counts
        )
        self.replica_records.append(record)

    def take_replica_records(self) -> list[ReplicaRecord]:
        """What the replicas recorded since the last call."""
        records = self.replica_records
        if records:  # a new list only when there was something: every layer calls this every step
            self.replica_records = []
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


@torch.no_grad()
def fold_backward_records(modules: list[Fp8Scaled]) -> None:
    """At a step's end, fold each module's backward record into its scaling state and clear the record:
    each role's newest amax becomes the larger of the two (a NaN stays), a scale a backward applied
    replaces the stored one (as a forward's cast writes it), backward cast counts add to the forward's.

    Modules whose state agrees in device and shape are folded together, stacked (a few kernels for the
    whole model, each on whole tensors: a newest-amax slot is a strided view). Under delayed scaling
    with a history no backward applies a scale of its own, and the scales are left alone."""
    if not modules:
        return
    groups: dict[tuple, list[Fp8Scaled]] = {}
    for module in modules:
        groups.setdefault((module.amax_history.device, module.amax_history.shape), []).append(module)
    for group in groups.values():
        histories = [m.amax_history for m in group]
        history = torch.stack(histories)  # (modules, roles, history length)
        recorded = torch.stack([m.backward_amax for m in group])  # (modules, roles, 1)
        history[:, :, :1] = torch.maximum(history[:, :, :1], recorded)
        torch._foreach_copy_(histories, list(history.unbind(0)))
        applied = [m for m in group if not all(m.stored_scale_roles()[m.FORWARD_ROLES :])]
        if applied:
            scales = [m.scale for m in applied]
            stored, taken = torch.stack(scales), torch.stack([m.backward_scale for m in applied])
            torch._foreach_copy_(scales, list(torch.where(taken > 0, taken, stored).unbind(0)))
    counting = [m for m in modules if m.backward_cast_counts is not None and m.cast_counts is not None]
    if counting:
        torch._foreach_add_([m.cast_counts for m in counting], [m.backward_cast_counts for m in counting])
    clear_backward_records(modules)


@torch.no_grad()
def fold_replica_records(layers: list[Fp8Scaled]) -> None:
    """Fold what nn.DataParallel's replicas of ``layers`` recorded in the step into the layers' own
    state: each newest amax the largest any replica saw, forward or backward (as the all-reduce of
    ranks does), the cast counts summed. One batch per replica: a fused CUDA kernel that met one
    layer's state twice in a batch would add into it twice at once, and keep one of the two."""
    rounds: list[tuple[list[torch.Tensor], ...]] = []
    for layer in layers:
        for index, record in enumerate(layer.take_replica_records()):
            if index == len(rounds):
                rounds.append(([], [], [], []))
            amax_slots, amaxes, count_slots, counts = rounds[index]
            # the first GPU's replica writes into the layer's own state (and its backward record)
            if record.amax_history is not layer.amax_history:
                amax_slots.append(layer.amax_history[:, :1])
                newest = torch.maximum(record.amax_history[:, :1], record.backward_amax)
                amaxes.append(newest.to(layer.amax_history.device, non_blocking=True))
            if record.cast_counts is not None and layer.cast_counts is not None:
                count_slots.append(layer.cast_counts)
                replica_counts = record.cast_counts + record.backward_cast_counts
                counts.append(replica_counts.to(layer.cast_counts.device, non_blocking=True))
    for amax_slots, amaxes, count_slots, counts in rounds:
        if amax_slots:
            torch._foreach_maximum_(amax_slots, amaxes)
        if count_slots:
            torch._foreach_add_(count_slots, counts)


@torch.no_grad()
def clear_backward_records(modules: list[Fp8Scaled]) -> None:
    """Zero the modules' backward records: a state restored (a checkpoint loaded, a step rolled back)
    takes nothing from a step it replaced."""
    records = [t for m in modules for t in (m.backward_amax, m.backward_scale, m.backward_cast_counts)]
    records = [t for t in records if t is not None]
    if records:
        torch._foreach_zero_(records)
