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
from torch.distributed.tensor import DTensor

__all__ = [
    "default_amax_group",
    "gathered_on",
    "local_shard",
    "sync_amaxes",
]


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``, to read without autograd: its shard when FSDP2 shards it, its partition
    while DeepSpeed ZeRO-3 holds it partitioned (the parameter itself is then empty), else ``t`` itself
    (no detached alias: callers read every weight or gradient of a model each step, hundreds of them)."""
    if isinstance(t, DTensor):
        return t.to_local().detach()
    if t.numel() == 0 and getattr(t, "ds_tensor", None) is not None:
        return _zero3_partition(t)
    return t


def _zero3_partition(param: torch.Tensor) -> torch.Tensor:
    """The values of a ZeRO-3 parameter this rank holds: ``ds_tensor`` is a flat slice of the flattened
    weight, one per rank of ``ds_process_group`` in rank order, and the last rank's ends in padding that
    DeepSpeed leaves uninitialized (left out here, so it never enters an amax). A partition swapped out to
    NVMe, or stored quantized (ZeRO++), gives nothing: the weight's amax is not recorded that step."""
    partition = param.ds_tensor
    start = partition.ds_numel * dist.get_rank(group=param.ds_process_group)
    held = max(0, min(partition.ds_numel, param.ds_numel - start))
    if partition.numel() < held or hasattr(param, "ds_quant_scale") or not partition.is_floating_point():
        return partition.new_empty(0)
    return partition.detach().narrow(0, 0, held)


def gathered_on(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``, each moved only where it lives elsewhere (a model spread over several
    GPUs): for a model on one device, no call per tensor (hundreds, at every step)."""
    if all(t.device == device for t in tensors):
        return list(tensors)
    return [t.to(device) for t in tensors]


def default_amax_group() -> dist.ProcessGroup | None:
    """The world group when ``torch.distributed`` is initialised with more than one rank, else ``None``."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


@torch.no_grad()
def sync_amaxes(newest: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor | None:
    """Replace each tensor of ``newest`` (the newest-amax slots of the layers' histories, one entry per
    role) by its elementwise maximum over ``group``, in place, and return them all flattened into one
    tensor (on the first one's device) as reduced, so the caller reads the step's amaxes without
    gathering them again.

    One ``all_reduce`` for all of them; without a group nothing is reduced; ``None`` without tensors.
    """
    if not newest:
        return None
    device = newest[0].device
    flat = torch.cat([t.reshape(-1).to(device) for t in newest])
    if group is not None:
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        parts = flat.split([t.numel() for t in newest])
        torch._foreach_copy_(list(newest), [p.view_as(t) for p, t in zip(parts, newest, strict=True)])
    return flat
