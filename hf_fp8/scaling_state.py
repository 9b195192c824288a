"""What an FP8 layer's scaling state looks like from outside, whichever backend made the layer: its
tensors by role (for the NaN guard, telemetry and the amax sync) and by checkpoint key (for
``fp8_state.safetensors``); and how a layer reports the casts it makes (for telemetry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["CastObserver", "LayerScaling", "ObservableCasts", "RoleScaling"]

# Called by an FP8 layer at each cast it makes while observed: (role, source tensor, scale, FP8 result).
CastObserver = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], None]


@runtime_checkable
class ObservableCasts(Protocol):
    """An FP8 layer that reports its casts to an observer (telemetry samples such layers)."""

    def observe_casts(self, observer: CastObserver | None) -> None: ...


@dataclass(frozen=True)
class RoleScaling:
    """The delayed-scaling state of one tensor role of an FP8 layer (live tensors, not copies).

    ``amax_history`` has the newest entry first (index 0 along its first dimension); ``direction`` is
    ``"fwd"`` for what the forward quantizes (inputs, weights) and ``"bwd"`` for gradients.
    """

    direction: str
    amax_history: torch.Tensor
    scale: torch.Tensor


@dataclass(frozen=True)
class LayerScaling:
    """One FP8 layer's scaling state: by role, and every tensor of it by its checkpoint key suffix."""

    name: str
    module: nn.Module
    roles: dict[str, RoleScaling]
    tensors: dict[str, torch.Tensor]
