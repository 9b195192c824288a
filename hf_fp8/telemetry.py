"""What FP8 is doing to a model, as numbers for the training logs.

Two kinds of numbers:

* from the state every FP8 layer keeps anyway (cheap, every log): the minimum, median and maximum of
  the forward (input, weight) and backward (gradient) scales, and the largest newest amax of each;
* from a sampled set of layers, on the steps that are logged (a real FP8 cast of the tensors the layer
  quantized, with the scale it applied): the fraction of values that saturated (beyond the format's
  largest value, clamped) and the fraction that flushed to zero (nonzero, cast to 0), overall and the
  worst layer for each.

Keys start with ``fp8/`` so they group together in TensorBoard, W&B and the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hf_fp8.backends.registry import fp8_layers
from hf_fp8.formats import E4M3, E5M2
from hf_fp8.scaling_state import ObservableCasts

__all__ = ["Fp8Telemetry"]

_DIRECTIONS = ("fwd", "bwd")


@dataclass
class _Counts:
    """Counters of one sampled layer, as tensors (no host sync until the log)."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    saturated: dict[str, torch.Tensor] = field(default_factory=dict)
    flushed: dict[str, torch.Tensor] = field(default_factory=dict)

    @torch.no_grad()
    def add(self, direction: str, source: torch.Tensor, scale: torch.Tensor, fp8: torch.Tensor) -> None:
        """Count one cast: ``fp8`` is what the layer made of ``source`` with ``scale``."""
        fmt = E4M3 if fp8.dtype == E4M3.dtype else E5M2
        saturated = ((source.float() * scale).abs() > fmt.max).sum()
        flushed = ((source != 0) & (fp8.float() == 0)).sum()
        for counter, value in (
            (self.values, source.numel()),
            (self.saturated, saturated),
            (self.flushed, flushed),
        ):
            counter[direction] = counter.get(direction, 0) + value


class Fp8Telemetry:
    """Scale and amax statistics of a patched model's FP8 layers, and cast statistics of a sample.

    ``arm()`` before a step that will be logged has the sampled layers report their casts in that
    step; ``collect()`` after it returns the log entries and stops the reports. Layers that report
    their casts (the native ones) are sampled; TE's casts happen inside its kernels. Scale statistics
    cover every FP8 layer.
    """

    def __init__(self, model: nn.Module, sample_layers: int = 8) -> None:
        self.model = model
        observable = [(n, m) for n, m in model.named_modules() if isinstance(m, ObservableCasts)]
        every = max(1, -(-len(observable) // max(sample_layers, 1)))
        self.sampled = observable[::every][:sample_layers]
        self._counts: dict[str, _Counts] = {}
        self.armed = False

    def arm(self) -> None:
        """Count the casts of the next training forward and backward, and log after the step."""
        if self.armed:
            return
        self.armed = True
        directions = {layer.name: layer.roles for layer in fp8_layers(self.model)}
        for name, module in self.sampled:
            counts = self._counts.setdefault(name, _Counts())
            roles = directions[name]

            def observe(role, source, scale, fp8, counts=counts, roles=roles):
                counts.add(roles[role].direction, source, scale, fp8)

            module.observe_casts(observe)

    def collect(self) -> dict[str, float | str]:
        """The log entries for the step just finished; disarms the probes."""
        for _, module in self.sampled:
            module.observe_casts(None)
        self.armed = False
        logs: dict[str, float | str] = {}
        logs.update(self._scale_stats())
        logs.update(self._cast_stats())
        self._counts.clear()
        return logs

    @torch.no_grad()
    def _scale_stats(self) -> dict[str, float]:
        scales: dict[str, list[torch.Tensor]] = {d: [] for d in _DIRECTIONS}
        amaxes: dict[str, list[torch.Tensor]] = {d: [] for d in _DIRECTIONS}
        for layer in fp8_layers(self.model):
            for role in layer.roles.values():
                scales[role.direction].append(role.scale.float().flatten())
                # this step's newest amax, or the one just rolled into slot 1
                amaxes[role.direction].append(role.amax_history[:2].amax(dim=0).float().flatten())
        logs: dict[str, float] = {}
        for direction in _DIRECTIONS:
            if not scales[direction]:
                continue
            s = torch.cat(scales[direction])
            s = s[s > 0]  # 0: no step yet
            if s.numel():
                stats = torch.stack([s.min(), s.median(), s.max()]).tolist()
                for label, value in zip(("min", "median", "max"), stats, strict=True):
                    logs[f"fp8/scale_{direction}_{label}"] = value
            logs[f"fp8/amax_{direction}"] = torch.cat(amaxes[direction]).max().item()
        return logs

    def _cast_stats(self) -> dict[str, float | str]:
        logs: dict[str, float | str] = {}
        for direction in _DIRECTIONS:
            rows = [(name, c) for name, c in self._counts.items() if direction in c.values]
            if not rows:
                continue
            totals = torch.tensor([float(c.values[direction]) for _, c in rows])
            saturated = torch.stack([torch.as_tensor(c.saturated[direction]).float().cpu() for _, c in rows])
            flushed = torch.stack([torch.as_tensor(c.flushed[direction]).float().cpu() for _, c in rows])
            for label, counts in (("saturated", saturated), ("flushed", flushed)):
                logs[f"fp8/{label}_{direction}"] = (counts.sum() / totals.sum()).item()
                fractions = counts / totals
                worst = int(fractions.argmax())
                logs[f"fp8/worst_{label}_{direction}"] = fractions[worst].item()
                if fractions[worst] > 0:  # no worst layer when none saturated / flushed
                    logs[f"fp8/worst_{label}_{direction}_layer"] = rows[worst][0]
        return logs
