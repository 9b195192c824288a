"""Where a Trainer step spends host time, by Python function (``trainer_bench.py --host-profile``).

:mod:`phases` says in which phase the GPU waits for the host; this says which functions the host runs
there. ``cProfile`` runs from the start of step ``first_step`` to the start of the step two after it
(so the two steps' logs are in), and :func:`top_functions` keeps, per step, the functions taking the
most time of their own (``self_ms``) and hf_fp8's functions taking the most with what they call
(``total_ms``). ``cProfile`` slows every Python
call a little: read the numbers against each other, not as a step time.
"""

from __future__ import annotations

import cProfile
import pstats
from typing import Any

_STEPS = 2


def host_profiler(first_step: int):
    """A TrainerCallback profiling steps ``first_step`` and ``first_step + 1`` (counted from 0) on the host;
    ``result`` then holds :func:`top_functions`' rows. Built here: the row imports transformers, not
    the driver."""
    from transformers import TrainerCallback

    class HostProfiler(TrainerCallback):
        def __init__(self) -> None:
            self.steps = 0
            self.result: dict[str, list[dict[str, Any]]] | None = None
            self._profile: cProfile.Profile | None = None

        def on_step_begin(self, *args, **kwargs) -> None:
            if self.steps == first_step + _STEPS:
                self.close()
            if self.steps == first_step:
                self._profile = cProfile.Profile()
                self._profile.enable()
            self.steps += 1

        def close(self) -> None:
            """Stop profiling (at the step after the profiled ones, or after training) and keep the rows."""
            if self._profile is None:
                return
            self._profile.disable()
            stats = pstats.Stats(self._profile)
            self.result = {
                "self": top_functions(stats, _STEPS, "self_ms"),
                "hf_fp8": top_functions(stats, _STEPS, "total_ms", within="hf_fp8/"),
            }
            self._profile = None

    return HostProfiler()


def top_functions(
    stats: pstats.Stats, steps: int, key: str, within: str = "", count: int = 25
) -> list[dict[str, Any]]:
    """The ``count`` functions (of files whose path holds ``within``) with the most ``key`` time
    (``self_ms`` or ``total_ms``) per step, in ms."""
    rows = []
    for (path, line, name), (_, calls, self_s, total_s, _) in stats.stats.items():
        if within not in path:
            continue
        where = f"{'/'.join(path.split('/')[-2:])}:{line}({name})" if line else name
        rows.append(
            {
                "function": where,
                "calls": calls / steps,
                "self_ms": self_s * 1e3 / steps,
                "total_ms": total_s * 1e3 / steps,
            }
        )
    rows.sort(key=lambda r: r[key], reverse=True)
    return rows[:count]
