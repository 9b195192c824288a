"""``prepare_fp8``: FP8 for custom training loops driven by Accelerate."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_fp8.patch import patch_model
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import PatchReport

__all__ = ["prepare_fp8"]


def prepare_fp8(
    accelerator: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    recipe: Fp8Recipe | None = None,
    backend: str = "auto",
) -> tuple[nn.Module, torch.optim.Optimizer | None, PatchReport]:
    """Patch ``model`` to FP8, then ``accelerator.prepare`` it (and ``optimizer``).

    Patching comes first, so DDP/FSDP wrap the FP8 model and its amax state. The optimizer keeps
    working: the native backend shares every parameter; when a backend replaces some (Transformer
    Engine fuses q/k/v into one weight), an optimizer that has not stepped yet gets the model's
    trainable parameters as its one parameter group, and one that has is refused rather than left
    updating parameters the model no longer uses. ``recipe=None`` reads ``HF_FP8_RECIPE`` (set by
    ``hf-fp8 launch``) or uses the defaults. Returns the prepared model, optimizer and the report.
    """
    report = patch_model(model, recipe, backend=backend)
    if optimizer is None:
        return accelerator.prepare(model), None, report
    current = {id(p) for p in model.parameters()}
    stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in current]
    if stale:
        if optimizer.state or len(optimizer.param_groups) != 1:
            raise ValueError(
                f"prepare_fp8: {len(stale)} optimizer parameters were replaced by the {report.backend} "
                "backend, and the optimizer has state or several parameter groups; create the optimizer "
                "after prepare_fp8 (pass optimizer=None)"
            )
        optimizer.param_groups[0]["params"] = [p for p in model.parameters() if p.requires_grad]
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, report
