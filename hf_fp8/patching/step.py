"""The FP8 step of a patched model: when it ends, and what ending, discarding or re-recipeing it does.

A step starts with a training forward in FP8 (amaxes recorded) and ends, whichever comes first:

* when a backward through the forward's outputs has finished (the autograd engine then runs
  :func:`end_step`: the backend reduces the step's amaxes over the data-parallel ranks and updates the
  scales). Two forwards before one backward (DPO, contrastive losses) are one step;
* before any optimizer steps: PyTorch's global optimizer step pre-hook ends every pending step. This
  is the end a caller who backpropagates through something else than the outputs reaches (TRL's
  fused LM head backpropagates through per-token log-probs it computes from the hidden states), and
  the one that makes each optimizer step one FP8 step whatever the loss is made of;
* at the next training forward, when the outputs needed no gradient (nothing to hook);
* when the Trainer callback or the NaN guard calls :func:`end_pending_step`.

A forward whose outputs never see a backward and after which no optimizer steps (a reference pass in
training mode) only adds its amaxes to the step that follows.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hf_fp8.backends.registry import fp8_layers
from hf_fp8.numerics.amax_sync import default_amax_group
from hf_fp8.patching.patch_state import PatchState, get_state
from hf_fp8.recipe import Fp8Recipe

__all__ = [
    "discard_step",
    "end_pending_step",
    "end_step",
    "scaling_snapshot",
    "set_recipe",
    "start_step",
    "unwatch_optimizer_steps",
    "watch_optimizer_steps",
]


# nn.DataParallel runs a model's forwards in a thread per GPU; a step still pending ends once.
_ending = threading.Lock()


@torch.no_grad()
def end_step(state: PatchState) -> None:
    """End the pending FP8 step, if any."""
    with _ending:
        if state.step_pending:
            state.backend.end_step(state.amax_group or default_amax_group())
        state.step_pending = False
        state.end_at_next_forward = False


def end_pending_step(model: nn.Module) -> None:
    """End a step of ``model`` still pending, now, so that the state checked, logged and saved next is
    the step boundary's (the Trainer callback calls this at each optimizer step)."""
    end_step(_state_of(model))


@torch._dynamo.disable
def start_step(state: PatchState, outputs: Any) -> None:
    """A training forward in FP8 gave ``outputs``: its step is pending, and ends when a backward through
    them has finished (or at the next training forward, when no output needs a gradient). Whatever
    the caller backpropagates through, the optimizer step ends it (see :func:`watch_optimizer_steps`)."""
    state.step_pending = True
    watch_optimizer_steps(state)  # a deep copy of a patched model carries a state of its own
    tensor = _first_tensor_needing_grad(outputs)
    if tensor is None:
        state.end_at_next_forward = True
        return

    def backward_reached(grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(lambda: end_step(state))

    tensor.register_hook(backward_reached)


# The patch states of live patched models, for the optimizer step pre-hook, in the order they were
# first watched: every rank of a data-parallel run then ends its models' steps (each an all-reduce) in
# the same order.
_watched: weakref.WeakKeyDictionary[PatchState, None] = weakref.WeakKeyDictionary()
_optimizer_hook: list[Any] = []


def watch_optimizer_steps(state: PatchState) -> None:
    """End ``state``'s pending step before any optimizer steps (``torch.optim``'s global step pre-hook,
    registered once for all patched models; a model that is unpatched or freed leaves the watch)."""
    if state in _watched:
        return
    _watched[state] = None
    if not _optimizer_hook:
        _optimizer_hook.append(register_optimizer_step_pre_hook(_end_pending_steps))


def unwatch_optimizer_steps(state: PatchState) -> None:
    """``state``'s model is unpatched: its steps no longer end at optimizer steps."""
    _watched.pop(state, None)


@torch._dynamo.disable  # a compiled optimizer step runs it eagerly
def _end_pending_steps(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for state in list(_watched):
        if state.step_pending:
            end_step(state)


def scaling_snapshot(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(live tensor, copy) for every tensor of ``model``'s FP8 scaling state, for :func:`discard_step`."""
    return [(t, t.clone()) for layer in fp8_layers(model) for t in layer.tensors.values()]


@torch.no_grad()
def discard_step(model: nn.Module, snapshot: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Forget the current step: the scaling state back to ``snapshot`` (taken before the step), and
    nothing pending."""
    for live, saved in snapshot:
        live.copy_(saved)
    state = _state_of(model)
    state.step_pending = False
    state.end_at_next_forward = False
    state.backend.state_restored(model)


def set_recipe(model: nn.Module, recipe: Fp8Recipe) -> None:
    """Switch a patched model to ``recipe`` (same format and history length; the NaN guard raises the
    margin this way, and a resumed run takes the checkpoint's margin)."""
    state = _state_of(model)
    state.recipe = recipe
    state.report.recipe = recipe
    state.backend.set_recipe(recipe)


def _state_of(model: nn.Module) -> PatchState:
    state = get_state(model)
    if state is None:
        raise ValueError("the model is not patched for FP8: call hf_fp8.patch_model(model) first")
    return state


def _first_tensor_needing_grad(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, Mapping):
        values = [outputs["loss"]] if outputs.get("loss") is not None else list(outputs.values())
    elif isinstance(outputs, (tuple, list)):
        values = list(outputs)
    else:
        values = [outputs]
    for value in values:
        if torch.is_tensor(value) and value.requires_grad:
            return value
        if isinstance(value, (tuple, list, Mapping)):
            found = _first_tensor_needing_grad(value)
            if found is not None:
                return found
    return None
