"""Copying a few numbers from the device to the host without waiting for it.

The NaN guard, the telemetry and the native backend's non-finite warning each read a small tensor of
flags or statistics that the device computes during a step. Reading it at once (``.tolist()``) would
stall the host until the device has finished the step; instead the copy is queued behind the step's
work and an event marks when it has landed, to be read a step later or when the host waits anyway.
"""

from __future__ import annotations

import torch

__all__ = ["copy_to_host"]


def copy_to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``t`` on the host, and the event that says when the copy is complete (``None`` for a tensor that
    is already on the host: it is returned as it is). Nothing here waits for the device."""
    if not t.is_cuda:
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
