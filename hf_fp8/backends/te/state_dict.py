"""State-dict hooks that keep a TE-patched model's checkpoints HF's: TE's pickled ``_extra_state``
left out, weights dequantized, Conv1D weights in their (in, out) layout."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["dequantized", "install_state_dict_hooks", "keep_hf_layout"]


def _drop_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: TE's pickled ``_extra_state`` entries never reach an HF checkpoint."""
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith("_extra_state")]:
        del state_dict[key]


def _ignore_missing_extra_state(module: nn.Module, incompatible_keys) -> None:
    """Load hook: a plain HF checkpoint has no ``_extra_state``; that is not a missing key."""
    missing = [k for k in incompatible_keys.missing_keys if k.endswith("_extra_state")]
    for key in missing:
        incompatible_keys.missing_keys.remove(key)


def install_state_dict_hooks(model: nn.Module) -> list:
    """Hooks on the top-level model that keep HF checkpoints free of TE's extra state; returns handles."""
    return [
        model.register_state_dict_post_hook(_drop_extra_state),
        model.register_load_state_dict_post_hook(_ignore_missing_extra_state),
    ]


def keep_hf_layout(module: nn.Module, transposed: bool) -> None:
    """Checkpoints of a TE linear hold what the HF layer held: a dequantized weight (FP8 storage is an
    in-memory matter), transposed back to (in, out) for a Conv1D, whose layout TE does not have."""

    def save(mod, state_dict, prefix, local_metadata):
        key = prefix + "weight"
        if key in state_dict:
            weight = dequantized(state_dict[key])
            state_dict[key] = weight.t().contiguous() if transposed else weight

    def load(mod, state_dict, prefix, *args):
        key = prefix + "weight"
        if transposed and key in state_dict:  # checkpoints always hold the Conv1D layout, square ones too
            state_dict[key] = state_dict[key].t().contiguous()

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


def dequantized(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") and hasattr(t, "_quantizer") else t
