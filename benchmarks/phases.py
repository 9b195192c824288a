"""Where a Trainer step leaves the GPU idle, by the phase the host was in (``trainer_bench.py --phases``).

A compiled FP8 step is short enough for host time to show: what the host does between kernels (hooks,
callbacks, the optimizer's Python, logging) leaves the GPU waiting once the host has fallen behind.
:class:`PhaseTracer` marks the Trainer's phases of two steps after the warm-up as profiler ranges
(``prep``: from the step's start to the forward; ``forward``; ``backward_clip``: the backward and the
gradient clipping; ``optimizer``: the callbacks before the optimizer step and the step itself;
``after_optimizer``; ``end_log``: the step's end and its log), and :func:`idle_by_phase` adds up the
gaps between kernels (over 20 us) by the phase the host was in when the gap opened and closed.
"""

from __future__ import annotations

import itertools
from typing import Any

_GAP_US = 20.0


def phase_tracer(first_step: int):
    """A TrainerCallback profiling steps ``first_step`` and ``first_step + 1`` (counted from 0), host and
    GPU (on a CPU only the host: no kernels, no idle time), its phases marked; ``result`` then holds
    :func:`idle_by_phase`'s numbers. Built here: the row imports transformers, not the driver."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]

    def _synchronize() -> None:
        if cuda:
            torch.cuda.synchronize()

    class PhaseTracer(TrainerCallback):
        def __init__(self) -> None:
            self.steps = 0
            self.result: dict[str, Any] | None = None
            self._profiler = None
            self._range = None
            self._hooked = False

        def _enter(self, phase: str) -> None:
            if self._profiler is None:
                return
            if self._range is not None:
                self._range.__exit__(None, None, None)
            self._range = record_function(f"phase:{phase}")
            self._range.__enter__()

        def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
            if self.steps == first_step + 2:  # the profiled steps and their logs are over
                self.close()
            if self.steps == first_step:
                _synchronize()
                self._profiler = profile(activities=activities)
                self._profiler.__enter__()
            if model is not None and not self._hooked:
                model.register_forward_pre_hook(lambda *a: self._enter("forward"))
                model.register_forward_hook(lambda *a: self._enter("backward_clip"))
                self._hooked = True
            self._enter("prep")

        def on_pre_optimizer_step(self, *args, **kwargs) -> None:
            self._enter("optimizer")

        def on_optimizer_step(self, *args, **kwargs) -> None:
            self._enter("after_optimizer")

        def on_step_end(self, *args, **kwargs) -> None:
            self._enter("end_log")
            self.steps += 1

        def close(self) -> None:
            """End the profile (at the step after the profiled ones, after their logs; or after
            training) and keep its numbers."""
            if self._profiler is None:
                return
            if self._range is not None:
                self._range.__exit__(None, None, None)
                self._range = None
            _synchronize()
            self._profiler.__exit__(None, None, None)
            self.result = idle_by_phase(self._profiler, 2)
            self._profiler = None

    return PhaseTracer()


def idle_by_phase(prof: Any, steps: int) -> dict[str, Any]:
    """GPU busy time, and idle time by host phase, in ms a step, from a profile of ``steps`` steps
    whose phases are ``phase:NAME`` ranges."""
    import torch

    kernels = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    phases = [
        (e.time_range.start, e.time_range.end, e.name[6:])
        for e in prof.events()
        if e.name.startswith("phase:")
    ]
    busy: list[list[float]] = []
    for start, end in kernels:
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    idle: dict[str, float] = {}
    for (_, gap_start), (gap_end, _) in itertools.pairwise(busy):
        if gap_end - gap_start <= _GAP_US:
            continue
        for start, end, name in phases:
            overlap = min(gap_end, end) - max(gap_start, start)
            if overlap > 0:
                idle[name] = idle.get(name, 0.0) + overlap
    host: dict[str, float] = {}
    for start, end, name in phases:
        host[name] = host.get(name, 0.0) + end - start
    per_step = 1e3 * steps
    return {
        "gpu_busy_ms": round(sum(end - start for start, end in busy) / per_step, 2),
        "gpu_idle_ms": {name: round(us / per_step, 2) for name, us in sorted(idle.items())},
        "host_ms": {name: round(us / per_step, 2) for name, us in sorted(host.items())},
    }
