"""A warning before FP8 costs a loss spike: when the share of values that saturate or flush to zero grows.

FP8's known failures build up before the loss shows them. A scale that lags a growing amax (delayed
scaling) clamps the new outliers to the format's largest value: the fraction saturated jumps. Gradients
that shrink as the loss falls, or grow apart in range, flush more small values to zero. Both show in the
cast statistics that :class:`~hf_fp8.integrations.telemetry.Fp8Telemetry` logs (``fp8/saturated_fwd``,
``fp8/flushed_bwd``, ... and the worst sampled layer of each); :class:`Fp8CastWatch` reads those logs
and warns, naming the layer, when one rises well above its own recent level.

Measured first (``benchmarks/convergence.py``, 3,100 steps of a 384M Llama from scratch, H200): under
the default recipe the forward saturated at most 8e-8 of its values and flushed 3-4e-4, steady or
falling, the backward flushed 2e-4 falling to 3e-5; no loss spike. The thresholds sit well above that.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Fp8CastWarning", "Fp8CastWatch"]

_DIRECTIONS = {"fwd": "forward (inputs and weights)", "bwd": "backward (gradients)"}
_ADVICE = {
    "saturated": (
        "values beyond FP8's range are clamped: scales lag a growing amax, and a loss spike can follow. "
        "The recipe 'current-scaling' scales each tensor by its own amax, 'conservative' keeps a binade "
        "of headroom, 'block' scales each tile by its own"
    ),
    "flushed": (
        "small values are lost to FP8's range: a layer's values spread over more binades than FP8 holds. "
        "The recipe 'block' scales each 1x128 tile by its own amax"
    ),
}


class Fp8CastWarning(UserWarning):
    """The share of values that FP8 saturates or flushes to zero grew: a loss spike may follow."""


@dataclass
class Fp8CastWatch:
    """Warns when a logged cast fraction rises above ``growth`` times the median of its last ``window``
    logs (and above ``floor`` for its kind), once until it falls back.

    Args:
        growth: how many times its recent median a fraction must reach.
        window: how many earlier logs make the recent median (the first log only sets it).
        floor: the smallest fraction worth a warning, per kind (``saturated``, ``flushed``).
    """

    growth: float = 10.0
    window: int = 5
    floor: Mapping[str, float] = field(default_factory=lambda: {"saturated": 1e-5, "flushed": 1e-3})
    _history: dict[str, list[float]] = field(default_factory=dict, init=False, repr=False)
    _raised: set[str] = field(default_factory=set, init=False, repr=False)

    def check(self, step: int, logs: Mapping[str, float | str]) -> list[str]:
        """The warnings that ``logs`` (one logged step's telemetry) call for, each also issued as an
        :class:`Fp8CastWarning`."""
        said = []
        for kind in self.floor:
            for direction in _DIRECTIONS:
                message = self._check_one(step, logs, kind, direction)
                if message is not None:
                    warnings.warn(message, Fp8CastWarning, stacklevel=2)
                    said.append(message)
        return said

    def _check_one(self, step: int, logs: Mapping[str, float | str], kind: str, direction: str) -> str | None:
        key = f"fp8/{kind}_{direction}"
        value = logs.get(key)
        if not isinstance(value, float | int):
            return None
        history = self._history.setdefault(key, [])
        recent = statistics.median(history[-self.window :]) if history else None
        history.append(float(value))
        if recent is None or value <= max(self.floor[kind], self.growth * recent):
            self._raised.discard(key)
            return None
        if key in self._raised:
            return None
        self._raised.add(key)
        layer = logs.get(f"fp8/worst_{key[4:]}_layer", "an unsampled layer")
        worst = logs.get(f"fp8/worst_{key[4:]}", value)
        return (
            f"hf_fp8: step {step}: {value:.3%} of the sampled FP8 {_DIRECTIONS[direction]} values "
            f"{kind}, up from {recent:.3%} in the logs before; the most in {layer} ({worst:.3%}). "
            f"{_ADVICE[kind]}"
        )
