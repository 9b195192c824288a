"""What FP8 is doing to a model, as numbers for the training logs.

Two kinds of numbers:

* from the state every FP8 layer keeps anyway (cheap, every log): the minimum, median and maximum of
  the forward (input, weight) and backward (gradient) scales, and the largest newest amax of each;
* from a sampled set of layers, on the steps that are logged (counted by the layer's own casts, inside
  a compiled step's graph too): the fraction of values that saturated (beyond the format's largest
  value, clamped) and the fraction that flushed to zero (nonzero, cast to 0), overall and the worst
  layer for each.

Keys start with ``fp8/`` so they group together in TensorBoard, W&B and the rest.

Reading the numbers never stalls training: :meth:`Fp8Telemetry.stage` gathers them into one tensor on
the device and starts its copy to the host; :meth:`StagedLogs.read` waits for that copy only, after the
caller has synchronized anyway (the Trainer reads its loss first). The sample is whole repeated blocks
(every FP8 layer of a few evenly spaced decoder layers): under ``hf_fp8.compile`` a counting block is a
graph of its own, and whole blocks make that one extra graph, where scattered layers made one per
pattern of counting layers (up to ``torch.compile``'s recompile limit, past which blocks run eagerly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_fp8.integrations.scaling_index import ScalingIndex
from hf_fp8.layers.layer_scaling import CountsCasts
from hf_fp8.module_tree import repeated_blocks
from hf_fp8.numerics.amax_sync import gathered_on
from hf_fp8.numerics.host_copy import copy_to_host

__all__ = ["Fp8Telemetry", "StagedLogs"]

_DIRECTIONS = ("fwd", "bwd")
_SCALE_STATS = ("min", "median", "max")
_PER_DIRECTION = len(_SCALE_STATS) + 2  # the scale statistics, the count of stepped scales, the amax


@dataclass
class StagedLogs:
    """Telemetry numbers on their way to the host; :meth:`read` turns them into log entries."""

    values: torch.Tensor
    ready: torch.cuda.Event | None
    sampled: list[str]
    counted: bool

    def read(self) -> dict[str, float | str]:
        """The log entries (waits for the copy to the host, which was started at :meth:`stage`)."""
        if self.ready is not None:
            self.ready.synchronize()
        values = self.values.tolist()
        logs: dict[str, float | str] = {}
        for i, direction in enumerate(_DIRECTIONS):
            *stats, stepped, amax = values[i * _PER_DIRECTION : (i + 1) * _PER_DIRECTION]
            if amax != amax:  # NaN: no FP8 layer casts in this direction
                continue
            if stepped > 0:  # scales are 0 until their first step
                logs.update(
                    {f"fp8/scale_{direction}_{s}": v for s, v in zip(_SCALE_STATS, stats, strict=True)}
                )
            logs[f"fp8/amax_{direction}"] = amax
        if self.counted:
            logs.update(_cast_stats(values[len(_DIRECTIONS) * _PER_DIRECTION :], self.sampled))
        return logs


class Fp8Telemetry:
    """Scale and amax statistics of a patched model's FP8 layers, and cast statistics of a sample.

    ``arm()`` before a step that will be logged has the sampled layers count what their casts do in that
    step; ``collect()`` after it returns the log entries and stops the counting (``stage()`` does the same
    without waiting for the device). Layers that count their casts (the native ones) are sampled; TE's
    casts happen inside its kernels; ``sample_layers=0`` counts none. Scale statistics cover every FP8
    layer. Under ``hf_fp8.compile``
    the first armed step compiles the sampled blocks once more, with the counting in their graphs;
    later armed steps reuse that graph.
    """

    def __init__(self, model: nn.Module, sample_layers: int = 8) -> None:
        self.model = model
        self._index = ScalingIndex(model)  # every logged step reads every layer's scales
        self.sampled = _sample(model, sample_layers) if sample_layers > 0 else []
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
        return self.stage().read()

    @torch.no_grad()
    def stage(self) -> StagedLogs:
        """Gather the step's numbers on the device and start copying them to the host; stops the
        counting. Nothing here waits for the device."""
        parts = self._scale_parts()
        counted = self.armed and bool(self.sampled)
        if counted:
            parts.append(self._cast_counts(parts[0].device))
        host, ready = copy_to_host(torch.cat(parts).double())
        for _, module in self.sampled:
            module.count_casts(False)
        self.armed = False
        return StagedLogs(host, ready, [name for name, _ in self.sampled], counted)

    def _scale_parts(self) -> list[torch.Tensor]:
        """Per direction: the minimum, median and maximum of the stepped (nonzero) scales, their count,
        and the largest newest amax (NaN where no layer casts in that direction). A few fused kernels for
        the whole model, however many layers it has."""
        roles = self._index.roles()
        device = next((r.scale.device for r in roles), torch.device("cpu"))
        parts = []
        for direction in _DIRECTIONS:
            mine = [r for r in roles if r.direction == direction]
            if not mine:
                parts.append(torch.full((_PER_DIRECTION,), float("nan"), device=device))
                continue
            s = torch.cat(gathered_on([r.scale.reshape(1) for r in mine], device)).float()
            stepped = s > 0
            kept = torch.where(stepped, s, float("nan"))
            stats = [kept.nan_to_num(float("inf")).min(), kept.nanmedian(), s.max()]
            # amaxes are >= 0: the infinity norm of each history's first rows (this step's newest amax,
            # or the one just rolled into slot 1) is its largest newest amax
            newest = torch._foreach_norm([r.amax_history[:2] for r in mine], ord=float("inf"))
            amax = torch.stack(gathered_on(newest, device)).float().max()
            parts.append(torch.stack([*stats, stepped.sum().float(), amax]))
        return parts

    def _cast_counts(self, device: torch.device) -> torch.Tensor:
        """Per sampled layer and direction, ``[values, saturated, flushed]`` summed over its roles (by
        slices of the counts: indexing with a tensor made here would wait for the device)."""
        directions = {
            layer.name: [r.direction for r in layer.roles.values()] for layer in self._index.layers()
        }
        rows = []
        zero = torch.zeros(3, dtype=torch.int64, device=device)
        for name, module in self.sampled:
            counts = module.cast_counts.to(device)
            for direction in _DIRECTIONS:
                own = [i for i, d in enumerate(directions[name]) if d == direction]
                rows.append(sum((counts[i] for i in own), zero))
        return torch.stack(rows).flatten().double()


def _sample(model: nn.Module, sample_layers: int) -> list[tuple[str, nn.Module]]:
    """The layers whose casts are counted: every counting layer of evenly spaced repeated blocks, as
    many blocks as hold ``sample_layers`` layers; evenly spaced layers where there are no blocks."""
    counting = [(n, m) for n, m in model.named_modules() if isinstance(m, CountsCasts)]
    blocks = [b for b in repeated_blocks(model) if any(isinstance(m, CountsCasts) for m in b.modules())]
    if not blocks:
        every = max(1, -(-len(counting) // sample_layers))
        return counting[::every][:sample_layers]
    per_block = sum(isinstance(m, CountsCasts) for m in blocks[0].modules())
    wanted = min(len(blocks), max(1, -(-sample_layers // per_block)))
    chosen = {id(blocks[round(i * (len(blocks) - 1) / max(wanted - 1, 1))]) for i in range(wanted)}
    inside = {id(m) for b in blocks if id(b) in chosen for m in b.modules()}
    return [(n, m) for n, m in counting if id(m) in inside]


def _cast_stats(values: list[float], sampled: list[str]) -> dict[str, float | str]:
    """Saturated and flushed fractions, overall and of the worst sampled layer, per direction."""
    logs: dict[str, float | str] = {}
    for d, direction in enumerate(_DIRECTIONS):
        rows = []
        for i, name in enumerate(sampled):
            start = (i * len(_DIRECTIONS) + d) * 3
            total, saturated, flushed = values[start : start + 3]
            if total > 0:
                rows.append((name, total, saturated, flushed))
        if not rows:
            continue
        total = sum(r[1] for r in rows)
        for label, column in (("saturated", 2), ("flushed", 3)):
            logs[f"fp8/{label}_{direction}"] = sum(r[column] for r in rows) / total
            worst = max(rows, key=lambda r: r[column] / r[1])  # the first of equals, as argmax
            logs[f"fp8/worst_{label}_{direction}"] = worst[column] / worst[1]
            if worst[column] > 0:  # no worst layer when none saturated / flushed
                logs[f"fp8/worst_{label}_{direction}_layer"] = worst[0]
    return logs
