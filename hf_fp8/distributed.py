"""Amax synchronisation across data-parallel ranks: one all-reduce a step.

With delayed scaling every rank must derive the same scales, or the replicas of one weight would be
quantized differently and drift apart. At each step boundary the amaxes every FP8 layer recorded in the
step just finished (forward and backward) are stacked into one flat tensor and reduced with a single
``all_reduce(MAX)`` over the data-parallel group before they enter the histories, as Transformer Engine
does with its aggregated reduction.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["default_amax_group", "sync_amaxes"]


def default_amax_group() -> dist.ProcessGroup | None:
    """The world group when ``torch.distributed`` is initialised with more than one rank, else ``None``."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


@torch.no_grad()
def sync_amaxes(modules: Sequence[nn.Module], group: dist.ProcessGroup | None) -> None:
    """Replace each module's newest amaxes (slot 0 of ``amax_history``) by their maximum over ``group``.

    One ``all_reduce`` for all modules and roles; a no-op without a group or without modules.
    """
    if group is None or not modules:
        return
    slots = [m.amax_history[:, 0] for m in modules]
    newest = torch.stack(slots)
    dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=group)
    torch._foreach_copy_(slots, list(newest.unbind(0)))
