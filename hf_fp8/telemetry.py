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
from torch.utils.hooks import RemovableHandle

from hf_fp8.backends import te as te_backend
from hf_fp8.backends.native import GRAD_OUTPUT, INPUT, WEIGHT, _Fp8Module
from hf_fp8.formats import Fp8Format, cast_to_fp8, compute_scale

__all__ = ["Fp8Telemetry"]

_DIRECTIONS = ("fwd", "bwd")


@dataclass
class _Counts:
    """Counters of one sampled layer, as tensors (no host sync until the log)."""

    values: dict[str, torch.Tensor] = field(default_factory=dict)
    saturated: dict[str, torch.Tensor] = field(default_factory=dict)
    flushed: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, direction: str, t: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> None:
        t = t.detach()
        scaled = t.float() * scale
        quantized = cast_to_fp8(t, scale, fmt)
        saturated = (scaled.abs() > fmt.max).sum()
        flushed = ((t != 0) & (quantized.float() == 0)).sum()
        for counter, value in (
            (self.values, t.numel()),
            (self.saturated, saturated),
            (self.flushed, flushed),
        ):
            counter[direction] = counter.get(direction, 0) + value


class Fp8Telemetry:
    """Scale and amax statistics of a patched model's FP8 layers, and cast statistics of a sample.

    ``arm()`` before a step that will be logged hooks the sampled layers for that step; ``collect()``
    after it returns the log entries and removes the hooks. Only native FP8 layers are sampled (TE's
    casts happen inside its kernels); scale statistics cover both backends.
    """

    def __init__(self, model: nn.Module, sample_layers: int = 8) -> None:
        self.layers = [(n, m) for n, m in model.named_modules() if isinstance(m, _Fp8Module)]
        self.te_layers = [(n, m) for n, m in model.named_modules() if te_backend.has_scaling_state(m)]
        every = max(1, -(-len(self.layers) // max(sample_layers, 1)))
        self.sampled = self.layers[::every][:sample_layers]
        self._counts: dict[str, _Counts] = {}
        self._handles: list[RemovableHandle] = []
        self.armed = False

    def arm(self) -> None:
        """Sample the casts of the next training forward and backward, and log after the step."""
        if self.armed:
            return
        self.armed = True
        for name, module in self.sampled:
            counts = self._counts.setdefault(name, _Counts())
            self._handles.append(module.register_forward_hook(_probe(module, counts)))

    def collect(self) -> dict[str, float | str]:
        """The log entries for the step just finished; disarms the probes."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.armed = False
        logs: dict[str, float | str] = {}
        logs.update(self._scale_stats())
        logs.update(self._cast_stats())
        self._counts.clear()
        return logs

    @torch.no_grad()
    def _scale_stats(self) -> dict[str, float]:
        forward, backward, amax_fwd, amax_bwd = [], [], [], []
        for _, m in self.layers:
            forward.append(m.scale[INPUT : WEIGHT + 1])
            backward.append(m.scale[GRAD_OUTPUT:])
            newest = m.amax_history[:, :2].amax(dim=1)  # this step's, or the one just rolled
            amax_fwd.append(newest[INPUT : WEIGHT + 1])
            amax_bwd.append(newest[GRAD_OUTPUT:])
        for _, m in self.te_layers:
            for key, scales, amaxes in (
                ("scaling_fwd", forward, amax_fwd),
                ("scaling_bwd", backward, amax_bwd),
            ):
                meta = m.fp8_meta.get(key)
                if meta is not None and hasattr(meta, "amax_history"):
                    scales.append(meta.scale.float().flatten())
                    amaxes.append(meta.amax_history[:2].amax(dim=0).float())
        logs: dict[str, float] = {}
        for direction, scales, amaxes in (("fwd", forward, amax_fwd), ("bwd", backward, amax_bwd)):
            if not scales:
                continue
            s = torch.cat(scales).float()
            s = s[s > 0]  # 0: no step yet
            if s.numel():
                stats = torch.stack([s.min(), s.median(), s.max()]).tolist()
                for label, value in zip(("min", "median", "max"), stats, strict=True):
                    logs[f"fp8/scale_{direction}_{label}"] = value
            logs[f"fp8/amax_{direction}"] = torch.cat(amaxes).max().item()
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


def _probe(module: _Fp8Module, counts: _Counts):
    """A forward hook that counts the casts of ``module``'s input and weight, and hooks its output's
    gradient to count the gradient's cast, each with the scale the layer applied."""

    def forward_hook(mod: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not (mod.fp8_enabled and mod.training and torch.is_grad_enabled()):
            return
        recipe = module.recipe
        x = args[0].reshape(-1, args[0].shape[-1])
        weight = None if module.weight_in_fp8 else module.weight  # stored in FP8: no cast happens
        with torch.no_grad():
            counts.add("fwd", x, module.scale[INPUT], recipe.forward_format)
            if weight is not None:
                counts.add("fwd", weight, module.scale[WEIGHT], recipe.forward_format)
        if output.requires_grad:
            output.register_hook(lambda grad: _count_gradient(module, counts, grad))

    return forward_hook


@torch.no_grad()
def _count_gradient(module: _Fp8Module, counts: _Counts, grad: torch.Tensor) -> None:
    """Runs before the layer's backward: the scale it will apply is the stored one, or the gradient's
    own under current scaling and before the first scale update."""
    recipe, fmt = module.recipe, module.recipe.backward_format
    own = compute_scale(grad.abs().amax().float(), fmt, recipe.margin)
    stored = module.scale[GRAD_OUTPUT]
    scale = own if recipe.scaling == "current" else torch.where(stored > 0, stored, own)
    counts.add("bwd", grad.reshape(-1, grad.shape[-1]), scale, fmt)
