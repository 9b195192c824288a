"""Long runs of a test module's subprocesses, started together in the background, two at a time.

A subprocess run of an example or a benchmark is mostly one core's work (imports, loading a model,
Dynamo tracing, Python), so on CI's two cores two of them take little more than one. Each gets one
OpenMP thread (``OMP_NUM_THREADS=1``): with two each, the two processes' workers spin against each
other and a pair is slower than one after the other.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


class BackgroundRuns:
    """``calls`` (name: a function that runs a subprocess and returns what the test reads), all started
    at once on ``workers`` threads; :meth:`output` waits for one."""

    def __init__(
        self, calls: dict[str, Callable[[], str]], out: Path | None = None, workers: int = 2
    ) -> None:
        self.out = out
        self._pool = ThreadPoolExecutor(max_workers=workers)
        self._started: dict[str, Future] = {name: self._pool.submit(call) for name, call in calls.items()}

    def output(self, name: str) -> str:
        """What run ``name`` returned, once it has ended (its failure fails the test that asks)."""
        return self._started[name].result()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def selected_tests(request: pytest.FixtureRequest) -> set[str]:
    """The names of this session's tests in the requesting test's module: only their runs start."""
    return {item.name for item in request.session.items if item.path == request.path}
