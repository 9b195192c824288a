"""What FP8 is doing to a model, as numbers for the training logs.

Two kinds of numbers:

* from the state every FP8 layer keeps anyway (cheap, every log): the minimum, median and maximum of
  the forward (input, weight) and backward (gradient) scales, and the largest newest amax of each;
* from a sampled set of layers, on the steps that are logged (counted by the layer's own casts, inside
  a compiled step's graph too): the fraction of values that saturated (beyond the format's largest
  value, clamped) and the fraction that flushed to zero (nonzero, cast to 0), overall and the worst
  layer for each.

Keys start with ``fp8/`` so they group together in TensorBoard, W&B and the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_fp8.backends.registry import fp8_layers
from hf_fp8.layers.layer_scaling import CountsCasts

__all__ = ["Fp8Telemetry"]

_DIRECTIONS = ("fwd", "bwd")


class Fp8Telemetry:
    """Scale and amax statistics of a patched model's FP8 layers, and cast statistics of a sample.

    ``arm()`` before a step that will be logged has the sampled layers count what their casts do in that
    step; ``collect()`` after it returns the log entries and stops the counting. Layers that count their
    casts (the native ones) are sampled; TE's casts happen inside its kernels. Scale statistics cover
    every FP8 layer. Under ``hf_fp8.compile`` the first armed step compiles the sampled layers' blocks
    once more, with the counting in their graphs; later armed steps reuse that graph.
    """

    def __init__(self, model: nn.Module, sample_layers: int = 8) -> None:
        self.model = model
        counting = [(n, m) for n, m in model.named_modules() if isinstance(m, CountsCasts)]
        every = max(1, -(-len(counting) // max(sample_layers, 1)))
        self.sampled = counting[::every][:sample_layers]
        self.armed = False

    def arm(self) -> None:
        """Count the casts of the next training forward and backward, and log after the step."""
        if self.armed:
            return
        self.armed = True
        for _, module in self.sampled:
            module.count_casts(True)

    def collect(self) -> dict[str, float | str]:
        """The log entries for the step just finished; stops the counting."""
        logs: dict[str, float | str] = {}
        logs.update(self._scale_stats())
        if self.armed:
            logs.update(self._cast_stats())
        for _, module in self.sampled:
            module.count_casts(False)
        self.armed = False
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

    def _cast_counts(self) -> dict[str, list[tuple[str, torch.Tensor]]]:
        """Per direction, (layer, [values, saturated, flushed]) of each sampled layer that cast in it."""
        directions = {layer.name: layer.roles for layer in fp8_layers(self.model)}
        by_direction: dict[str, list[tuple[str, torch.Tensor]]] = {d: [] for d in _DIRECTIONS}
        for name, module in self.sampled:
            counts = module.cast_counts.cpu()
            for direction in _DIRECTIONS:
                rows = [i for i, role in enumerate(directions[name].values()) if role.direction == direction]
                total = counts[rows].sum(dim=0)
                if total[0] > 0:
                    by_direction[direction].append((name, total.double()))
        return by_direction

    def _cast_stats(self) -> dict[str, float | str]:
        logs: dict[str, float | str] = {}
        for direction, rows in self._cast_counts().items():
            if not rows:
                continue
            totals = torch.stack([c[0] for _, c in rows])
            saturated = torch.stack([c[1] for _, c in rows])
            flushed = torch.stack([c[2] for _, c in rows])
            for label, counts in (("saturated", saturated), ("flushed", flushed)):
                logs[f"fp8/{label}_{direction}"] = (counts.sum() / totals.sum()).item()
                fractions = counts / totals
                worst = int(fractions.argmax())
                logs[f"fp8/worst_{label}_{direction}"] = fractions[worst].item()
                if fractions[worst] > 0:  # no worst layer when none saturated / flushed
                    logs[f"fp8/worst_{label}_{direction}_layer"] = rows[worst][0]
        return logs
