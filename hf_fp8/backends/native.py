"""The native backend: PyTorch's own FP8 (``torch.float8_*``, ``torch._scaled_mm``), on the CPU and GPU.

``nn.Linear`` and transformers' ``Conv1D`` become :class:`~hf_fp8.layers.linear.Fp8Linear` /
:class:`~hf_fp8.layers.linear.Fp8Conv1D`, MoE experts modules :class:`~hf_fp8.layers.experts.Fp8Experts`, all
sharing the original parameters (same objects: optimizers, tied weights and ``state_dict`` keys are
untouched). Norms stay as they are. A step ends with one amax all-reduce over the data-parallel group
and a batched scale update (:mod:`hf_fp8.numerics.scaling`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.pytorch_utils import Conv1D

from hf_fp8.backends.base import Fp8Backend, Replaced
from hf_fp8.formats import compute_scale
from hf_fp8.layers.experts import Fp8Experts
from hf_fp8.layers.fp8_scaled import (
    BACKWARD_BUFFERS,
    STATE_BUFFERS,
    Fp8Scaled,
    clear_backward_records,
    fold_backward_records,
    fold_replica_records,
    refresh_stored_scales,
)
from hf_fp8.layers.fsdp import check_releasable, gather_weight_in_fp8, gathered_shard
from hf_fp8.layers.layer_scaling import LayerScaling
from hf_fp8.layers.linear import Fp8Conv1D, Fp8Linear, Fp8Module
from hf_fp8.layers.selection import output_head_layers
from hf_fp8.layers.shared_inputs import SharedInputCasts
from hf_fp8.module_tree import replace_modules
from hf_fp8.numerics.amax_sync import default_amax_group, local_shard, sync_amaxes
from hf_fp8.numerics.blockwise import EMULATED, block_kernels_available
from hf_fp8.numerics.host_copy import copy_to_host
from hf_fp8.numerics.scaling import WEIGHT, advance_steps
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import PatchReport

__all__ = ["NativeBackend", "end_native_step", "update_fp8_scales"]


class NativeBackend(Fp8Backend):
    name = "native"
    keeps_norms = "norm: not a GEMM; the native backend keeps norms in high precision"
    keeps_experts = None
    data_parallel_problem = None
    zero_problem = None
    movable = True

    def __init__(self, recipe: Fp8Recipe) -> None:
        super().__init__(recipe)
        self.layers: list[Fp8Scaled] = []
        self.names: list[str] = []
        # fp8_weights: FP8 modules whose weights are not stored in FP8 yet (they are not while they train).
        self.unquantized: list[Fp8Scaled] = []
        self.watch = NonFiniteWatch()
        self.shared_inputs: SharedInputCasts | None = None
        # The converted output head(s), under the recipe's head_recipe (see Fp8Recipe.head_scaling).
        self.heads: list[Fp8Module] = []

    @classmethod
    def usable(cls, device: torch.device) -> tuple[bool, str]:
        return True, "PyTorch FP8 runs on any device"

    @classmethod
    def owns(cls, module: nn.Module) -> bool:
        return isinstance(module, Fp8Scaled)

    @classmethod
    def layer_scaling(cls, name: str, module: nn.Module) -> LayerScaling | None:
        return module.scaling_state(name) if isinstance(module, Fp8Scaled) else None

    @classmethod
    def to_plain(cls, module: nn.Module) -> nn.Module | None:
        return module.to_float() if isinstance(module, Fp8Scaled) else None

    def convert_linear(self, module: nn.Module, forward_in_fp8: bool = True) -> nn.Module:
        layer_class = Fp8Conv1D if isinstance(module, Conv1D) else Fp8Linear
        return layer_class.from_float(module, self.recipe, forward_in_fp8)

    def convert_experts(self, module: nn.Module) -> nn.Module:
        return Fp8Experts.from_float(module, self.recipe)

    def attach(
        self, model: nn.Module, replaced: list[Replaced], report: PatchReport
    ) -> list[RemovableHandle]:
        named = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Scaled)]
        self.names, self.layers = [n for n, _ in named], [m for _, m in named]
        self.shared_inputs = SharedInputCasts(named)
        self.heads = [head for head in output_head_layers(model) if isinstance(head, Fp8Module)]
        head_recipe = self.recipe.head_recipe  # one object for every head: their state advances together
        for head in self.heads:
            head.recipe = head_recipe
            if not head.forward_in_fp8:  # convert_lm_head: backward
                head.output_head = True
        if self.heads and self.recipe.head_scaling is not None:
            report.notes.append(
                f"the output head runs under head_scaling {head_recipe.scaling!r} (format "
                f"{head_recipe.format!r}); every other layer under scaling {self.recipe.scaling!r}"
            )
        _keep_fp8_state_out_of_ddp_broadcast(model)
        report.notes += self._emulation_notes(model)
        experts = [m for m in self.layers if isinstance(m, Fp8Experts)]
        if experts and self.recipe.format != "e4m3":
            report.notes.append(
                f"MoE experts ({len(experts)} module(s)) run every tensor in E4M3, their gradients too "
                f"(format {self.recipe.format!r} elsewhere): cuBLAS's grouped FP8 GEMM takes E4M3 only, "
                "and DeepSeek-V3 trains its experts so; convert_experts: false keeps them in "
                "high precision"
            )
        if not self.recipe.tensorwise and experts:
            report.notes.append(
                f"MoE experts scale each of their tensors as a whole (current scaling) under scaling "
                f"{self.recipe.scaling!r}; their linear layers follow the recipe"
            )
        # A weight another module also uses (tied embeddings) must keep its form for that module.
        storing = self.recipe.fp8_all_gather or self.recipe.fp8_weights
        shared = _shared_parameter_ids(model) if storing else set()
        if self.recipe.fp8_all_gather:
            self._gather_weights_in_fp8(shared, report)
        if self.recipe.fp8_weights:
            tied = [m for m in self.layers if any(id(w) in shared for w in _weights(m))]
            # its forward reads the weight in high precision: stored in FP8, its logits would be rounded
            high_forward = [m for m in self.layers if not getattr(m, "forward_in_fp8", True)]
            self.unquantized = [m for m in self.layers if m not in tied and m not in high_forward]
            self.before_forward(model)
            report.notes.append(
                "fp8_weights: frozen weights are stored in FP8 (now, or at the first forward after they are "
                "frozen, e.g. by PEFT); trainable weights keep their dtype"
            )
            if tied:
                report.notes.append(
                    f"fp8_weights: {len(tied)} weight(s) tied to another module (e.g. the input embeddings) "
                    "keep their dtype"
                )
            if high_forward:
                report.notes.append(
                    f"fp8_weights: {len(high_forward)} weight(s) whose forward runs in high precision "
                    "(convert_lm_head: backward, forward_in_fp8: false) keep their dtype"
                )
        return []

    def _emulation_notes(self, model: nn.Module) -> list[str]:
        """Where this recipe's GEMMs have no FP8 kernel here and run emulated (exactly, in float32): said
        in the report, since compiled code does not warn (a warning would break its graph)."""
        notes = []
        devices = {p.device for layer in self.layers for p in layer.parameters(recurse=False)}
        in_blocks = any(layer.recipe.in_blocks for layer in self.layers)
        if in_blocks and not all(block_kernels_available(d) for d in devices):
            notes.append(f"{EMULATED} (the model is on {', '.join(sorted(str(d) for d in devices))})")
        if self.recipe.format == "e5m2":
            notes.append(
                "format e5m2: cuBLAS has no E5M2 x E5M2 GEMM, so on a GPU all three GEMMs are emulated "
                "exactly in float32 (no FP8 speed-up); formats hybrid and e4m3 run them in FP8"
            )
        return notes

    def _gather_weights_in_fp8(self, shared: set[int], report: PatchReport) -> None:
        """``fp8_all_gather``: the trainable weights of the FP8 linear layers are all-gathered in FP8 under
        FSDP2 (:mod:`hf_fp8.layers.fsdp`); ``shared`` ones (another module uses them too), experts', and
        those of layers whose forward runs in high precision (it would read FP8-rounded weights) are not."""
        linear = [m for m in self.layers if isinstance(m, Fp8Module) and m.forward_in_fp8]
        chosen = [
            m for m in linear if m.weight.requires_grad and id(m.weight) not in shared and m.recipe.tensorwise
        ]
        for module in chosen:
            gather_weight_in_fp8(module)
        left = len(self.layers) - len(chosen)
        report.notes.append(
            f"fp8_all_gather: {len(chosen)} weight(s) are all-gathered in FP8 under FSDP2"
            + (
                f"; {left} FP8 module(s) in their own dtype (tied, frozen, experts, a forward in high "
                "precision, or scaled by block or row: head_scaling)"
                if left
                else ""
            )
        )

    def unpatch(self, model: nn.Module, hooks: list[RemovableHandle]) -> None:
        for module in self.layers:
            check_releasable(module)  # before anything changes
        for handle in hooks:
            handle.remove()
        replace_modules(model, self.to_plain)

    @torch._dynamo.disable  # it replaces parameters: run eagerly, and let a compiled model re-trace once
    def before_forward(self, model: nn.Module) -> None:
        """Store the weights that are frozen by now in FP8 (``fp8_weights``)."""
        if not self.unquantized:
            return
        for module in [m for m in self.unquantized if not any(w.requires_grad for w in _weights(m))]:
            module.store_weights_in_fp8()
            self.unquantized.remove(module)

    def replica_problem(self) -> str | None:
        if self.recipe.fp8_weights:
            return (
                "fp8_weights keeps frozen weights in FP8, and nn.DataParallel copies every weight to each "
                "GPU at every forward with a copy that takes plain tensors only"
            )
        return None

    def track_replica(self, replica: nn.Module) -> None:
        for module in replica.modules():
            if isinstance(module, Fp8Scaled):
                module.record_replica()

    def end_step(self, group: Any) -> None:
        self.watch.poll()
        fold_replica_records(self.layers)
        named = [(n, m) for n, m in zip(self.names, self.layers, strict=True) if not m.amax_history.is_meta]
        self.watch.submit(end_native_step([m for _, m in named], group, self.shared_inputs), named)

    def set_recipe(self, recipe: Fp8Recipe) -> None:
        super().set_recipe(recipe)
        heads, head_recipe = {id(head) for head in self.heads}, recipe.head_recipe
        for module in self.layers:
            module.recipe = head_recipe if id(module) in heads else recipe

    def state_restored(self, model: nn.Module) -> None:
        layers = [m for m in model.modules() if isinstance(m, Fp8Scaled)]
        for layer in layers:
            layer.take_replica_records()  # what replicas recorded belongs to the state replaced
        clear_backward_records(layers)  # and so does what backwards recorded
        refresh_stored_scales(layers, restored=True)
        self.watch.clear()  # what the restored state replaced is no longer news


class NonFiniteWatch:
    """Says when a step recorded a non-finite amax, without making the host wait for the GPU: the
    step's per-layer flags are copied to the host asynchronously and read at the next step's end.

    The NaN guard (``Fp8NanGuard``, the Trainer callback) catches such a step before the optimizer
    does; a loop without it gets this warning, and the history forgets the value after one step."""

    def __init__(self) -> None:
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None, int, list] | None = None
        self._steps = 0

    def submit(self, bad: torch.Tensor | None, layers: list[tuple[str, Fp8Scaled]]) -> None:
        """Take one step's flags for the named ``layers``, layer by layer and role by role (``True``: a
        non-finite newest amax)."""
        self._steps += 1
        if bad is None:
            return
        self._pending = (*copy_to_host(bad), self._steps, layers)

    def poll(self) -> None:
        """Warn about the flags submitted last, if the GPU is done with them."""
        if self._pending is None:
            return
        flags, event, step, layers = self._pending
        if event is not None and not event.query():
            return
        self._pending = None
        flat, forward, backward, start = flags.tolist(), [], [], 0
        for name, layer in layers:
            roles = flat[start : start + len(layer.ROLE_NAMES)]
            start += len(roles)
            if any(roles[: layer.FORWARD_ROLES]):
                forward.append(name)
            if any(roles[layer.FORWARD_ROLES :]):
                backward.append(name)
        if forward or backward:
            # Where it started: the first layer whose forward saw it, else the last the backward reached.
            first = forward[0] if forward else backward[-1]
            count = len(set(forward) | set(backward))
            more = f" (and {count - 1} more layers after it)" if count > 1 else ""
            warnings.warn(
                f"hf_fp8: FP8 step {step} recorded a non-finite amax in layer {first!r}{more}: a NaN or inf "
                "in the batch, its activations or its gradients; those scales kept their previous values. "
                "Only an hf_fp8.Fp8NanGuard (the Trainer callback has one) keeps such a step from the "
                "weights; with a fused optimizer it raises at the next step's check",
                stacklevel=2,
            )

    def clear(self) -> None:
        self._pending = None


@torch.no_grad()
def update_fp8_scales(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """End an FP8 training step for every native FP8 layer in ``model``.

    The step's amaxes are first reduced over ``group`` (default: the world group when distributed),
    in one all-reduce. Then, for delayed scaling, each role's new scale is computed from its amax
    history (``max`` over it, or its ``most_recent`` entry, which is the step just finished) every
    ``interval`` steps, and the histories roll so slot 0 is free for the next step. A patched model
    does this when the backward of each training forward has finished; call it yourself once per
    step when you use ``Fp8Linear`` without ``patch_model``.
    """
    layers = [m for m in model.modules() if isinstance(m, Fp8Scaled)]
    end_native_step(layers, group or default_amax_group())


@torch.no_grad()
def end_native_step(
    layers: list[Fp8Scaled], group: dist.ProcessGroup | None, shared_inputs: SharedInputCasts | None = None
) -> torch.Tensor | None:
    """:func:`update_fp8_scales` for given FP8 layers and group (``None``: no reduction); returns, per
    layer and role in order (flat), whether its newest amax was non-finite (``None`` without layers).
    ``shared_inputs``: the layers that cast one input with one scale, whose newest amaxes are made one.

    Layers whose recipe and state tensors (device, shape) agree are advanced together: their
    state is stacked, updated with one set of kernels and copied back, so a step's end costs a few
    dozen kernel launches for the whole model instead of a few dozen per layer.
    """
    layers = [layer for layer in layers if not layer.amax_history.is_meta]  # shapes only: nothing to do
    if not layers:
        return None
    _record_step_end_amaxes(layers)
    fold_backward_records(layers)
    # Each layer's newest amaxes, a row per role in role order: one flat tensor, reduced at once.
    newest = sync_amaxes([layer.amax_history[:, 0] for layer in layers], group)
    _record_gathered_weight_scales(layers)
    bad = ~torch.isfinite(newest)
    if shared_inputs is not None:
        shared_inputs.step_end()
    batches: dict[tuple, list[Fp8Scaled]] = {}
    for layer in layers:
        history = layer.amax_history
        # by the recipe object first: hashing a recipe's fields for every layer every step costs more
        batches.setdefault((id(layer.recipe), history.device, history.shape), []).append(layer)
    for batch in batches.values():
        advance_steps(
            batch[0].recipe,
            [m.amax_history for m in batch],
            [m.scale for m in batch],
            [m.fp8_steps for m in batch],
            batch[0].FORWARD_ROLES,
        )
    refresh_stored_scales(layers)
    return bad


@torch.no_grad()
def _record_step_end_amaxes(layers: list[Fp8Scaled]) -> None:
    """Record the amaxes the layers left to the step's end (their weights': see
    ``Fp8Scaled.step_end_amaxes``), all in one batch. A sharded weight (FSDP2) gives its local shard's;
    the all-reduce that follows makes it the whole weight's."""
    pairs = [(slot, local_shard(t)) for layer in layers for slot, t in layer.step_end_amaxes()]
    pairs = [(slot, t) for slot, t in pairs if t.numel()]  # an FSDP2 shard may be empty
    if not pairs:
        return
    amaxes = torch._foreach_norm([t for _, t in pairs], math.inf, dtype=torch.float32)
    torch._foreach_maximum_([slot for slot, _ in pairs], list(amaxes))


@torch.no_grad()
def _record_gathered_weight_scales(layers: list[Fp8Scaled]) -> None:
    """Current scaling keeps the scale each cast applied. Every rank cast its shard of a weight FSDP2
    all-gathers in FP8 with the whole weight's scale, known here from the reduced amax: the GEMM writes
    no state (a compiled forward that did handed cuBLAS a misaligned scale in its backward)."""
    for layer in layers:
        if layer.recipe.scaling == "current" and gathered_shard(layer) is not None:
            amax, recipe = layer.amax_history[WEIGHT, 0], layer.recipe
            layer.scale[WEIGHT] = compute_scale(amax, recipe.forward_format, recipe.margin)


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    """The ids of the parameters that modules other than the FP8 layers hold (tied embeddings)."""
    return {id(p) for m in model.modules() if not isinstance(m, Fp8Scaled) for p in m.parameters(False)}


def _weights(module: Fp8Scaled) -> list[torch.Tensor]:
    """The weights a module stores in FP8 under ``fp8_weights``."""
    if isinstance(module, Fp8Experts):
        return module.expert_weights()
    return [module.weight]


def _keep_fp8_state_out_of_ddp_broadcast(model: nn.Module) -> None:
    """DDP copies rank 0's buffers to every rank before each forward. The FP8 layers' amax histories
    are buffers that must keep each rank's own newest amaxes until they are reduced together, so they
    are put on DDP's ignore list (its extension point for this; the model is not wrapped yet)."""
    kept = STATE_BUFFERS + BACKWARD_BUFFERS
    fp8_buffers = [name for name, _ in model.named_buffers() if name.rsplit(".", 1)[-1] in kept]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ignored + [n for n in fp8_buffers if n not in ignored]
    )
