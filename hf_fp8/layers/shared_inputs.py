"""One FP8 cast for layers that read the same input (q/k/v, gate/up) under delayed scaling.

q, k and v each cast the same normed hidden state, and gate and up another. Each layer records that
tensor's amax into its own history and derives its own scale from it, so the scales are equal, but they
live in different buffers: a compiled block sees three different casts and makes three FP8 copies of the
input (and keeps three transposed ones for the weight gradients). Casting with one buffer makes the
casts a single expression, which the compiler merges into one kernel and one saved copy.

Which layers read one input is learned, not guessed from names: sibling layers (one parent module; a
PEFT wrapper's ``base_layer`` counts as its wrapper) whose input amaxes were bit for bit equal in the
first step (the first with finite amaxes) form a group; one of the next two steps in which they differ
undoes it, as equal amaxes can be chance (o_proj sits beside q/k/v). From then on every member casts with
its first member's input scale, and at each step's end every member records the largest input amax of
the group before the scales are updated. For layers that read one tensor that changes nothing (their
amaxes are equal anyway); for siblings that only seemed to, it keeps each member's scale the one it casts
with, and safe for every member's input.
"""

from __future__ import annotations

import math

import torch

from hf_fp8.layers.linear import Fp8Module
from hf_fp8.numerics.scaling import INPUT

__all__ = ["SharedInputCasts"]


class SharedInputCasts:
    """The groups of a patched model's FP8 layers that share their input's cast (see the module)."""

    def __init__(self, named_layers: list[tuple[str, torch.nn.Module]]) -> None:
        self.candidates = _sibling_candidates(named_layers)
        self.groups: list[list[Fp8Module]] = []
        self.checks_left = _CHECKS

    @torch.no_grad()
    def step_end(self) -> None:
        """Called at a step's end, after the step's amaxes are reduced over the ranks and before they
        become scales: forms the groups (at the first step's end that saw the candidates' inputs), checks
        them at the next ``_CHECKS`` step ends, then makes each group's newest input amaxes one (the
        largest)."""
        if self.groups and self.checks_left:
            self._dissolve_parted()
        if self.candidates:
            self._form_groups()
        for position in range(1, max((len(g) for g in self.groups), default=0)):
            longer = [g for g in self.groups if len(g) > position]
            # one pass per position: a fused kernel must not meet a group's first member twice
            torch._foreach_maximum_([_newest(g[0]) for g in longer], [_newest(g[position]) for g in longer])
        members = [(m, g[0]) for g in self.groups for m in g[1:]]
        if members:
            torch._foreach_copy_([_newest(m) for m, _ in members], [_newest(first) for _, first in members])

    def _form_groups(self) -> None:
        """Split each set of candidate siblings by their newest input amax, in one read to the host. A set
        that saw a non-finite amax (a skipped step) waits for a later step; layers that did not run keep
        casting on their own."""
        amaxes = _read([_newest(m)[0] for c in self.candidates for m in c])
        start, waiting = 0, []
        for candidate in self.candidates:
            seen = amaxes[start : start + len(candidate)]
            start += len(candidate)
            if not all(math.isfinite(a) for a in seen):
                waiting.append(candidate)
                continue
            by_amax: dict[float, list[Fp8Module]] = {}
            for module, amax in zip(candidate, seen, strict=True):
                if amax > 0:
                    by_amax.setdefault(amax, []).append(module)
            for group in by_amax.values():
                if len(group) > 1:
                    self.groups.append(group)
                    for member in group[1:]:
                        member.share_input_scale(group[0])
        self.candidates = waiting

    def _dissolve_parted(self) -> None:
        """Undo the groups whose members saw different (finite) input amaxes in this step: their first
        step's equal amaxes were a coincidence, not one input."""
        self.checks_left -= 1
        pairs = [(m, g[0]) for g in self.groups for m in g[1:]]
        amaxes = _read([t for m, first in pairs for t in (_newest(m)[0], _newest(first)[0])])
        parted = {
            id(first)
            for (_, first), own, theirs in zip(pairs, amaxes[::2], amaxes[1::2], strict=True)
            if own != theirs and math.isfinite(own) and math.isfinite(theirs)
        }
        for group in [g for g in self.groups if id(g[0]) in parted]:
            for member in group[1:]:
                member.share_input_scale(None)
            self.groups.remove(group)


# Step ends after the groups form at which every group is checked for members whose inputs differ.
_CHECKS = 2


def _read(values: list[torch.Tensor]) -> list[float]:
    """Scalar tensors as floats, in one transfer (gathered on the first one's device, as the amax
    all-reduce gathers its amaxes: a model may lie on several)."""
    return torch.stack([v.to(values[0].device) for v in values]).tolist()


def _newest(module: Fp8Module) -> torch.Tensor:
    """The slot of ``module``'s history that holds its input's amax of the current step (a view)."""
    return module.amax_history[INPUT, :1]


def _sibling_candidates(named_layers: list[tuple[str, torch.nn.Module]]) -> list[list[Fp8Module]]:
    """Sets of two or more delayed-scaling FP8 linear layers under one parent, of one input width and on
    one device. Their forwards cast the input for the forward GEMM, or with the forward in high precision
    (``backward-fp8``) for the weight gradient's; a layer that casts nothing (a frozen weight under a
    high-precision forward) records no input amax and joins no group: a set none of whose layers cast in
    the step that forms the groups is given up (waiting would read amaxes back every step)."""
    by_parent: dict[tuple, list[Fp8Module]] = {}
    for name, layer in named_layers:
        if isinstance(layer, Fp8Module) and layer.recipe.scaling == "delayed":
            parent = name.removesuffix(".base_layer").rpartition(".")[0]
            width = layer.in_features if isinstance(layer, torch.nn.Linear) else layer.nx
            by_parent.setdefault((parent, width, layer.amax_history.device), []).append(layer)
    return [layers for layers in by_parent.values() if len(layers) > 1]
