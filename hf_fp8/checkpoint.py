"""FP8 scaling state in checkpoints: ``fp8_state.safetensors``, no pickle.

Delayed scaling carries state that is not in the model's ``state_dict``: per FP8 layer the amax
histories, the scales and the step counter. Without it a resumed run starts its scales from scratch
and drifts away from the run it continues. :func:`save_fp8_state` writes that state next to a
checkpoint, :func:`load_fp8_state` puts it back, so the resumed run quantizes with exactly the scales
the uninterrupted run would have used.

Native layers store ``<layer>.amax_history`` / ``.scale`` / ``.fp8_steps``; Transformer Engine layers
their delayed-scaling meta, ``<layer>.scaling_fwd.scale`` and so on. The file's metadata holds the
recipe (YAML), so a checkpoint written under another recipe is refused with both named.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from hf_fp8.backends import te as te_backend
from hf_fp8.backends.native import _Fp8Module
from hf_fp8.recipe import Fp8Recipe

__all__ = [
    "FP8_STATE_FILE",
    "fp8_state_dict",
    "fp8_state_tensors",
    "load_fp8_state",
    "load_fp8_state_dict",
    "save_fp8_state",
]

FP8_STATE_FILE = "fp8_state.safetensors"

_NATIVE_BUFFERS = ("amax_history", "scale", "fp8_steps")
_TE_META_KEYS = ("scaling_fwd", "scaling_bwd")
_TE_TENSORS = ("scale", "amax_history")
# Recipe fields that may change during training (the NaN guard's increase_margin) and are restored
# from the checkpoint rather than compared with the current recipe.
_RESTORED_FIELDS = ("margin",)


def fp8_state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live tensors of every FP8 layer's scaling state, keyed by layer name: native layers'
    buffers, TE layers' delayed-scaling meta (once it exists)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, _Fp8Module):
            for buffer in _NATIVE_BUFFERS:
                tensors[f"{name}.{buffer}"] = getattr(module, buffer)
        elif te_backend.has_scaling_state(module):
            for key, meta in _te_metas(module):
                for tensor in _TE_TENSORS:
                    tensors[f"{name}.{key}.{tensor}"] = getattr(meta, tensor)
    return tensors


def fp8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every FP8 layer's scaling state, as CPU tensors keyed by layer name."""
    return {key: t.detach().cpu().clone() for key, t in fp8_state_tensors(model).items()}


@torch.no_grad()
def load_fp8_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`fp8_state_dict`) into the model's FP8 layers, in place.

    Every FP8 layer must find its entries and every entry its layer, with the same shapes: a mismatch
    means another model or recipe, and is an error that names the keys."""
    te_recipe = getattr(getattr(model, "_hf_fp8_state", None), "te_recipe", None)
    if te_recipe is not None:
        for name, module in model.named_modules():
            saved_scale = state.get(f"{name}.scaling_fwd.scale")
            if saved_scale is not None and te_backend.has_scaling_state(module):
                _create_te_metas(module, te_recipe, num_gemms=saved_scale.numel() // 3)
    targets = fp8_state_tensors(model)
    missing = sorted(set(targets) - set(state))
    unexpected = sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            "the FP8 state does not match this model's FP8 layers"
            f"{_listing('missing', missing)}{_listing('unexpected', unexpected)}; it was saved from "
            "another model or patched differently"
        )
    for key, target in targets.items():
        source = state[key]
        if source.shape != target.shape:
            raise ValueError(
                f"FP8 state {key!r} has shape {tuple(source.shape)}, the model has {tuple(target.shape)}; "
                "was amax_history_len changed?"
            )
        target.copy_(source)


def save_fp8_state(model: nn.Module, folder: str | os.PathLike, recipe: Fp8Recipe) -> Path:
    """Write ``model``'s FP8 state to ``folder/fp8_state.safetensors`` and return the path."""
    path = Path(folder) / FP8_STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(fp8_state_dict(model), str(path), metadata={"recipe": recipe.to_yaml()})
    return path


def load_fp8_state(model: nn.Module, folder: str | os.PathLike, recipe: Fp8Recipe) -> Fp8Recipe:
    """Load ``folder/fp8_state.safetensors`` into ``model`` and return the recipe to go on with:
    ``recipe`` with the fields training may have changed (the margin) taken from the checkpoint."""
    path = Path(folder) / FP8_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {FP8_STATE_FILE} in {str(folder)!r}")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    saved = Fp8Recipe.from_dict(yaml.safe_load(metadata.get("recipe", "{}")) or {})
    restored = recipe.replace(**{k: getattr(saved, k) for k in _RESTORED_FIELDS})
    if saved != restored:
        changed = [k for k in saved.to_dict() if getattr(saved, k) != getattr(restored, k)]
        detail = ", ".join(f"{k}: {getattr(saved, k)!r} -> {getattr(restored, k)!r}" for k in changed)
        raise ValueError(
            f"{path} was written under another FP8 recipe ({detail}); resume with the checkpoint's "
            "recipe, or start the FP8 state afresh by deleting the file"
        )
    load_fp8_state_dict(model, load_file(str(path)))
    return restored


def _te_metas(module: nn.Module) -> list:
    """(key, meta) for a TE layer's delayed-scaling meta (none before its first FP8 forward)."""
    metas = getattr(module, "fp8_meta", {})
    return [(k, metas[k]) for k in _TE_META_KEYS if k in metas and hasattr(metas[k], "amax_history")]


def _create_te_metas(module: nn.Module, te_recipe, num_gemms: int) -> None:
    """Make a TE layer's delayed-scaling meta before its first forward, as that forward would (the
    number of GEMMs comes from the saved state: 3 forward tensors each), so loaded values are kept:
    TE's first forward finds meta of the recipe's kind and leaves it alone."""
    if getattr(module, "fp8_meta_tensors_initialized", False):
        return
    module.fp8_meta["recipe"] = te_recipe
    module.fp8_meta["num_gemms"] = num_gemms
    module.init_fp8_meta_tensors(te_recipe)


def _listing(label: str, keys: list[str]) -> str:
    if not keys:
        return ""
    shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return f"; {label}: {shown}"
