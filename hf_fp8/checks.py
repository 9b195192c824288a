"""Checks of what users hand to the public entry points, so a mistake is named where it is made
instead of surfacing as an AttributeError deep inside."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

__all__ = ["check_amax_group", "check_model"]


def check_model(model: Any, caller: str) -> nn.Module:
    """``model`` when it is an ``nn.Module``; otherwise a TypeError that says what was given."""
    if isinstance(model, nn.Module):
        return model
    hint = ""
    if isinstance(model, str):
        hint = f"; load it first, e.g. AutoModelForCausalLM.from_pretrained({model!r})"
    raise TypeError(
        f"{caller} needs a model (a torch.nn.Module, such as one from AutoModelForCausalLM.from_pretrained), "
        f"got {type(model).__name__} {_short(model)}{hint}"
    )


def check_amax_group(group: Any) -> Any:
    """``group`` when it is ``None`` or a ``torch.distributed`` process group."""
    if group is None or (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        return group
    raise TypeError(
        "amax_group must be a torch.distributed ProcessGroup (for example dist.new_group(ranks)) or None for "
        f"the world group, got {type(group).__name__} {_short(group)}"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
