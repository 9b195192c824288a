"""What an FP8 layer's scaling state looks like from outside, whichever backend made the layer: its
tensors by role (for the NaN guard, telemetry and the amax sync) and by checkpoint key (for
``fp8_state.safetensors``); and how a layer counts what its casts do (for telemetry).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["CountsCasts", "LayerScaling", "RoleScaling"]


@runtime_checkable
class CountsCasts(Protocol):
    """An FP8 layer that counts what its casts do (telemetry samples such layers).

    While counting, each cast of a training step adds ``[values, saturated, flushed]`` to its role's row
    of ``cast_counts`` (int64, one row per role, in the order of the layer's roles), in place and with
    tensor ops only: a compiled step counts inside its graph. A backward's casts are counted in the
    layer's backward record and added in at the step's end (see :mod:`hf_fp8.layers.fp8_scaled`)."""

    cast_counts: torch.Tensor | None

    def count_casts(self, on: bool) -> None: ...


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
