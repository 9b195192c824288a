"""What a patched model carries: its recipe, its backend, the report, hooks and step bookkeeping.

The state lives in one attribute of the top-level model; :func:`get_state` finds it. A model without
it is not patched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_fp8.backends.base import Fp8Backend
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import PatchReport

__all__ = ["ForwardCall", "PatchState", "get_state", "patched_module", "set_state"]

_ATTR = "_hf_fp8_state"


@dataclass
class ForwardCall:
    """One forward in flight: whether FP8 runs, the backend context it entered, and the generation mark
    it entered (a forward without gradient given a KV cache; see ``hf_fp8.autocast.generating``)."""

    fp8: bool
    context: contextlib.AbstractContextManager | None = None
    generation: contextlib.AbstractContextManager | None = None


@dataclass(eq=False)  # compared and hashed by identity (step.py keeps live states as weak keys)
class PatchState:
    recipe: Fp8Recipe
    backend: Fp8Backend
    report: PatchReport
    # Data-parallel group whose ranks share amaxes; None: the world group when distributed.
    amax_group: Any = None
    handles: list[RemovableHandle] = field(default_factory=list)
    # patch_model's module_filter_fn, for the reports of later calls on the patched model
    module_filter_fn: Any = None
    # A training forward ran in FP8 since the last step end (see hf_fp8.patching.step).
    step_pending: bool = False
    # That forward's outputs needed no gradient: the next training forward ends the step.
    end_at_next_forward: bool = False
    # A forward with gradients in eval mode (FP8 off there) was warned of (once a model).
    warned_eval_with_gradients: bool = False
    # The forwards in flight, a stack per model object: nn.DataParallel runs its replicas' forwards (and
    # so this model's hooks) at once, in a thread each, and each replica is an object of its own.
    calls: dict[int, list[ForwardCall]] = field(default_factory=dict)

    def push_call(self, model: nn.Module, call: ForwardCall) -> None:
        """A forward of ``model`` (this patched model, or a replica of it) starts."""
        self.calls.setdefault(id(model), []).append(call)

    def pop_call(self, model: nn.Module) -> ForwardCall | None:
        """The innermost forward of ``model`` ends; ``None`` when none started (its pre-hook refused it).
        A model's stack goes once empty: DataParallel makes new replicas at every forward."""
        stack = self.calls.get(id(model))
        if not stack:
            return None
        call = stack.pop()
        if not stack:
            del self.calls[id(model)]
        return call


def get_state(model: nn.Module, own: bool = False) -> PatchState | None:
    """The patch state of ``model``, or ``None`` when it is not patched. ``own``: only state held by
    ``model`` itself, not reached through attribute forwarding (a PeftModel forwards to its base)."""
    if own:
        return vars(model).get(_ATTR)
    return getattr(model, _ATTR, None)


def patched_module(model: nn.Module) -> nn.Module | None:
    """The patched model inside ``model``: ``model`` itself, or what a wrapper holds as ``.module``
    (DDP, FSDP, accelerate's wrappers); ``None`` when there is none."""
    while get_state(model) is None:
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return model


def set_state(model: nn.Module, state: PatchState | None) -> None:
    """Attach ``state`` to ``model`` (``None``: remove it)."""
    if state is None:
        delattr(model, _ATTR)
    else:
        setattr(model, _ATTR, state)
