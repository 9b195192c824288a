"""The FP8 step of a patched model: when it ends, and what ending, discarding or re-recipeing it does.

A step is a training forward whose outputs a backward went through. It ends when that backward has
finished: the autograd engine then runs :func:`end_step` (the backend reduces the step's amaxes over the
data-parallel ranks and updates the scales), before the optimizer step and before DDP's next buffer
broadcast. Two forwards before one backward (DPO, contrastive losses) are one step; a forward whose
outputs never see a backward (logging, a reference pass) is none. A step whose end could not be hooked
(outputs that need no gradient) stays pending and ends at the next training forward, or when the
Trainer callback calls :func:`end_pending_step`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hf_fp8.backends.registry import fp8_layers
from hf_fp8.numerics.amax_sync import default_amax_group
from hf_fp8.patching.patch_state import PatchState, get_state
from hf_fp8.recipe import Fp8Recipe

__all__ = [
    "discard_step",
    "end_pending_step",
    "end_step",
    "end_step_after_backward",
    "scaling_snapshot",
    "set_recipe",
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


def end_pending_step(model: nn.Module) -> None:
    """End a step of ``model`` still pending, now, so that the state checked, logged and saved next is
    the step boundary's (the Trainer callback calls this at each optimizer step)."""
    end_step(_state_of(model))


@torch._dynamo.disable
def end_step_after_backward(state: PatchState, outputs: Any) -> None:
    """Have the step end when a backward through ``outputs`` has finished (or at the next training
    forward, when no output needs a gradient)."""
    tensor = _first_tensor_needing_grad(outputs)
    if tensor is None:
        state.step_pending = True
        return

    def backward_reached(grad: torch.Tensor) -> None:
        state.step_pending = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: end_step(state))

    tensor.register_hook(backward_reached)


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
