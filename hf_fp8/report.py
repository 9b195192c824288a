"""``PatchReport``: what ``patch_model`` converted, what it left alone, and why."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from hf_fp8.recipe import Fp8Recipe

__all__ = ["ModuleRecord", "PatchReport"]

CONVERTED, SKIPPED, KEPT = "converted", "skipped", "kept"


@dataclass(frozen=True)
class ModuleRecord:
    """One module the patcher looked at.

    ``action`` is ``converted`` (now FP8), ``skipped`` (a GEMM left in high precision, ``reason`` says
    why) or ``kept`` (not a GEMM, such as a norm, left as it is by this backend). ``gemm_flops`` counts
    multiply-adds per token, so shares of FLOPs can be computed. ``forward_in_fp8`` is ``False`` for a
    converted layer whose forward GEMM stays in high precision (the output head under
    ``convert_lm_head: backward``): one of its three GEMMs of a training step.
    """

    name: str
    class_name: str
    kind: str
    action: str
    reason: str
    params: int
    gemm_flops: int
    forward_in_fp8: bool = True

    @property
    def fp8_gemm_flops(self) -> float:
        """Multiply-adds per token of a training step's GEMMs (forward, dgrad, wgrad: equal thirds) that
        run in FP8, in the units of ``gemm_flops``; counted for a trainable weight (a frozen one has no
        wgrad, whichever its precision)."""
        if self.action != CONVERTED:
            return 0.0
        return self.gemm_flops if self.forward_in_fp8 else self.gemm_flops * 2 / 3


@dataclass
class PatchReport:
    backend: str
    recipe: Fp8Recipe
    total_params: int
    records: list[ModuleRecord] = field(default_factory=list)
    # Things that hold for the whole model, such as a recipe option this backend does not carry out.
    notes: list[str] = field(default_factory=list)

    def add_note(self, note: str) -> None:
        """Add ``note`` unless the report has it already: a patched model's report is shared by every
        integration that takes the model (the Trainer callback, ``prepare_fp8``), each perhaps twice."""
        if note not in self.notes:
            self.notes.append(note)

    def _select(self, action: str) -> list[ModuleRecord]:
        return [r for r in self.records if r.action == action]

    @property
    def converted(self) -> list[ModuleRecord]:
        return self._select(CONVERTED)

    @property
    def skipped(self) -> list[ModuleRecord]:
        return self._select(SKIPPED)

    @property
    def kept(self) -> list[ModuleRecord]:
        return self._select(KEPT)

    @property
    def converted_gemms(self) -> list[ModuleRecord]:
        """Converted GEMM layers (linear, Conv1D), without the norms a backend may also convert."""
        return [r for r in self.converted if r.gemm_flops > 0]

    @property
    def fp8_param_share(self) -> float:
        """Share of the model's parameters that FP8 GEMMs read."""
        return sum(r.params for r in self.converted_gemms) / max(self.total_params, 1)

    @property
    def fp8_flop_share(self) -> float:
        """Share of the multiply-adds of all GEMM layers (linear, Conv1D, MoE experts) that run in FP8 in a
        training step."""
        total = sum(r.gemm_flops for r in self.records)
        return sum(r.fp8_gemm_flops for r in self.converted_gemms) / max(total, 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "recipe": self.recipe.to_dict(),
            "total_params": self.total_params,
            "fp8_param_share": self.fp8_param_share,
            "fp8_flop_share": self.fp8_flop_share,
            "converted": len(self.converted),
            "converted_gemms": len(self.converted_gemms),
            "skipped": len(self.skipped),
            "kept": len(self.kept),
            "notes": list(self.notes),
            "modules": [asdict(r) for r in self.records],
        }

    def __str__(self) -> str:
        r = self.recipe
        gemms = [x for x in self.records if x.gemm_flops > 0]
        lines = [
            f"hf-fp8 patch report (backend {self.backend}; recipe: {_describe(r)})",
            f"  FP8 GEMM layers: {len(self.converted_gemms)} of {len(gemms)}, "
            f"{self.fp8_flop_share:.1%} of GEMM FLOPs, {self.fp8_param_share:.1%} of parameters",
        ]
        if not r.enabled:
            lines.append("  FP8 is disabled by the recipe (enabled: false): nothing was converted")
        lines += [f"  note: {note}" for note in self.notes]
        for action in (CONVERTED, SKIPPED, KEPT):
            groups = Counter((_pattern(x.name), x.class_name, x.reason) for x in self._select(action))
            if not groups:
                continue
            lines.append(f"  {action}:")
            width = max(len(p) for p, _, _ in groups)
            for (pattern, class_name, reason), count in groups.items():
                why = f"  {reason}" if reason else ""
                lines.append(f"    {count:>4} x {pattern:<{width}}  {class_name}{why}")
        return "\n".join(lines)


def _describe(recipe: Fp8Recipe) -> str:
    """The recipe's format, scaling and margin, and every other field that is not the default."""
    defaults = Fp8Recipe()
    shown = f"{recipe.format}, {recipe.scaling} scaling, margin {recipe.margin}"
    others = [
        f"{key} {value}"
        for key, value in recipe.to_dict().items()
        if key not in ("format", "scaling", "margin") and value != defaults.to_dict()[key]
    ]
    return ", ".join([shown, *others])


def _pattern(name: str) -> str:
    """``model.layers.3.mlp.up_proj`` -> ``model.layers.*.mlp.up_proj``: one line per repeated layer."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
