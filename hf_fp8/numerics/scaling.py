"""Delayed and current scaling for the native FP8 layers: which scale a cast uses, and how a step's
amaxes become the next step's scales.

Each native FP8 layer keeps, per tensor role (input, weight, grad_output), an amax history (newest
entry first) and a scale. During a step every cast records its tensor's amax in slot 0 of the role's
history (:mod:`hf_fp8.numerics.gemm`); at the end of the step :func:`advance_steps` turns the histories into
new scales (every ``interval`` steps) and rolls them so slot 0 is free again.

Delayed scaling casts with the stored scale, so a cast never waits for its own tensor's amax. Before
the first step has ended there is no history: that step scales each tensor by its own amax, as
current scaling always does. Which of the two a layer does is a Python flag
(``Fp8Scaled.stored_scales``, per role), not a branch on tensor values, so a compiled step has no
data-dependent branch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hf_fp8.formats import compute_scale
from hf_fp8.recipe import Fp8Recipe

__all__ = [
    "GRAD_OUTPUT",
    "INPUT",
    "ROLES",
    "WEIGHT",
    "BackwardRecord",
    "advance_steps",
    "read_stored_scale",
    "record_amax",
    "tensor_amax",
]

# Rows of a layer's ``amax_history`` and entries of its ``scale``.
INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 2
ROLES = ("input", "weight", "grad_output")


class BackwardRecord(NamedTuple):
    """Where a layer's backward records, instead of its scaling state (see
    :mod:`hf_fp8.layers.fp8_scaled`): ``amax`` (roles, 1), the newest slot of a one-slot history;
    ``scale`` (roles,), a scale applied where the role has none stored (0: none); ``cast_counts``, as
    the forward's, when counting."""

    amax: torch.Tensor
    scale: torch.Tensor
    cast_counts: torch.Tensor | None


def read_stored_scale(scale: torch.Tensor, role: int, stored: bool) -> torch.Tensor | None:
    """Role ``role``'s stored scale as a float32 copy (not a view: the buffer changes in place), or
    ``None`` where the role has none stored (it casts with its own amax)."""
    return scale[role].to(torch.float32, copy=True) if stored else None


def tensor_amax(t: torch.Tensor) -> torch.Tensor:
    """``t``'s amax in float32, outside autograd: what a role records of a tensor it casts by parts."""
    return t.detach().abs().amax().float()


def record_amax(
    amax_history: torch.Tensor, scale: torch.Tensor, role: int, amax: torch.Tensor, fmt, margin: int
) -> None:
    """For recipes that scale by block or row and keep no history of their own: the tensor's amax in
    slot 0 of the role's history and its tensorwise scale, for telemetry and the NaN guard."""
    amax_history[role, 0] = torch.maximum(amax_history[role, 0], amax)
    scale[role] = compute_scale(amax, fmt, margin)


@torch.no_grad()
def advance_steps(
    recipe: Fp8Recipe,
    histories: list[torch.Tensor],
    scales: list[torch.Tensor],
    steps: list[torch.Tensor],
    forward_roles: int = GRAD_OUTPUT,
) -> None:
    """End a step for layers that share ``recipe`` and whose state tensors agree in device, shape and
    dtype: stacked, updated with one set of kernels, and copied back.

    ``histories[i]`` is layer i's (roles, history length) amax history, ``scales[i]`` its (roles,)
    scales, ``steps[i]`` its step counter; the first ``forward_roles`` roles are scaled for the forward
    format, the others (gradients) for the backward format.
    """
    history = torch.stack(histories)  # (layers, roles, history length)
    # A non-finite amax (a NaN batch) stops counting once its step is over: the scale made from it
    # keeps its previous value for one step, then the history is clean again.
    history[:, :, 1:] = torch.nan_to_num(history[:, :, 1:], nan=0.0, posinf=0.0, neginf=0.0)
    if recipe.scaling == "delayed":
        scale = torch.stack(scales)
        amax = history.amax(dim=2) if recipe.amax_compute_algo == "max" else history[:, :, 0]
        forward, backward = slice(None, forward_roles), slice(forward_roles, None)
        new_scale = torch.cat(
            [
                compute_scale(amax[:, forward], recipe.forward_format, recipe.margin, scale[:, forward]),
                compute_scale(amax[:, backward], recipe.backward_format, recipe.margin, scale[:, backward]),
            ],
            dim=1,
        )
        due = torch.remainder(torch.stack(steps), recipe.interval) == 0
        torch._foreach_copy_(scales, list(torch.where(due[:, None], new_scale, scale).unbind(0)))
    rolled = history.roll(1, dims=2)
    rolled[:, :, 0] = 0
    torch._foreach_copy_(histories, list(rolled.unbind(0)))
    torch._foreach_add_(steps, 1)
