"""FP8 scaling state in checkpoints: ``fp8_state.safetensors``, no pickle.

Delayed scaling carries state that is not in the model's ``state_dict``: per FP8 layer the amax
histories, the scales and (native layers) the step counter. Without it a resumed run starts its scales
from scratch and drifts away from the run it continues. :func:`save_fp8_state` writes that state next
to a checkpoint, :func:`load_fp8_state` puts it back, so the resumed run quantizes with exactly the
scales the uninterrupted run would have used.

Keys are ``<layer>.<tensor>`` with the tensor names each backend gives its layers' state (native:
``amax_history``, ``scale``, ``fp8_steps``; Transformer Engine: ``scaling_fwd.scale`` and so on). The
file's metadata holds the recipe (YAML); a checkpoint written under a recipe that scales differently
is refused with both named.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from hf_fp8.backends.registry import fp8_layers
from hf_fp8.checks import check_model
from hf_fp8.layers.experts import is_experts
from hf_fp8.patching.patch_state import get_state
from hf_fp8.recipe import SCALING_FIELDS, Fp8Recipe, as_recipe

__all__ = [
    "FP8_STATE_FILE",
    "fp8_state_dict",
    "fp8_state_tensors",
    "load_fp8_state",
    "load_fp8_state_dict",
    "save_fp8_state",
]

FP8_STATE_FILE = "fp8_state.safetensors"

# Recipe fields that may change during training (the NaN guard's increase_margin) and are restored
# from the checkpoint rather than compared with the current recipe.
_RESTORED_FIELDS = ("margin",)


def fp8_state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The live tensors of every FP8 layer's scaling state, keyed ``<layer>.<tensor>``."""
    return {f"{layer.name}.{key}": t for layer in fp8_layers(model) for key, t in layer.tensors.items()}


def fp8_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every FP8 layer's scaling state, as CPU tensors keyed by layer name."""
    return {key: t.detach().cpu().clone() for key, t in fp8_state_tensors(model).items()}


def _experts_hint(model: nn.Module, unexpected: list[str]) -> str:
    """The fix when the unexpected entries are MoE experts' that this patch keeps in high precision (the
    default since convert_experts; the state was saved with FP8 experts)."""
    modules = dict(model.named_modules())
    prefixes = {key.rsplit(".", 1)[0] for key in unexpected}
    experts = [p for p in prefixes if p in modules and is_experts(modules[p])]
    if not experts:
        return ""
    return (
        f" ({len(experts)} MoE experts module(s) had FP8 state there and are kept in high precision here: "
        "patch with convert_experts: true, as the state was saved, to continue it)"
    )


@torch.no_grad()
def load_fp8_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (from :func:`fp8_state_dict`) into the model's FP8 layers, in place.

    Every FP8 layer must find its entries and every entry its layer, with the same shapes and finite
    values: a mismatch means another model or recipe, and is an error that names the keys. Everything
    is checked before anything is copied, so a refused state changes nothing."""
    patch = get_state(model)
    if patch is not None:
        patch.backend.prepare_to_load(model, state)
    targets = fp8_state_tensors(model)
    missing = sorted(set(targets) - set(state))
    unexpected = sorted(set(state) - set(targets))
    if missing or unexpected:
        raise ValueError(
            "the FP8 state does not match this model's FP8 layers"
            f"{_listing('missing', missing)}{_listing('unexpected', unexpected)}; it was saved from "
            f"another model or patched differently{_experts_hint(model, unexpected)}"
        )
    for key, target in targets.items():
        source = state[key]
        if source.shape != target.shape:
            raise ValueError(
                f"FP8 state {key!r} has shape {tuple(source.shape)}, the model has {tuple(target.shape)}; "
                "was amax_history_len changed?"
            )
        if source.is_floating_point() and not torch.isfinite(source).all():
            raise ValueError(
                f"FP8 state {key!r} holds non-finite values; the state it was saved from was broken"
            )
    for key, target in targets.items():
        target.copy_(state[key])
    if patch is not None:
        patch.backend.state_restored(model)


def save_fp8_state(
    model: nn.Module, folder: str | os.PathLike, recipe: Fp8Recipe | str | None = None
) -> Path:
    """Write ``model``'s FP8 state to ``folder/fp8_state.safetensors`` and return the path. ``recipe``:
    the one to record with it (default: the recipe the model was patched with).

    The file is written beside its final name and then moved into place, so an interrupted save never
    leaves a damaged file; a model without FP8 state is refused rather than writing an empty file."""
    recipe = _recipe_for(check_model(model, "save_fp8_state"), recipe)
    state = fp8_state_dict(model)
    if not state:
        raise ValueError(
            f"{type(model).__name__} has no FP8 scaling state to save (not patched, or no FP8 layer has run "
            f"yet with Transformer Engine); nothing was written to {str(folder)!r}"
        )
    path = Path(folder) / FP8_STATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{FP8_STATE_FILE}.partial")
    save_file(state, str(partial), metadata={"recipe": recipe.to_yaml()})
    os.replace(partial, path)
    return path


def load_fp8_state(
    model: nn.Module, folder: str | os.PathLike, recipe: Fp8Recipe | str | None = None
) -> Fp8Recipe:
    """Load ``folder/fp8_state.safetensors`` (or the file itself) into ``model`` and return the recipe to
    go on with: ``recipe`` (default: the model's) with the fields training may have changed (the
    margin) taken from the checkpoint.

    Only the fields that change how scales are computed must agree (format, scaling, history length
    and algorithm, interval); a resume with another ``nan_policy`` or ``use_during_eval`` is fine. A
    damaged file is an error that names it; the model is left as it was."""
    recipe = _recipe_for(check_model(model, "load_fp8_state"), recipe)
    path = Path(folder)
    path = path if path.is_file() else path / FP8_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {FP8_STATE_FILE} in {str(folder)!r}")
    saved, tensors = _read(path)
    changed = [k for k in SCALING_FIELDS if getattr(saved, k) != getattr(recipe, k)]
    if changed:
        detail = ", ".join(f"{k}: {getattr(saved, k)!r} -> {getattr(recipe, k)!r}" for k in changed)
        raise ValueError(
            f"{path} was written under another FP8 recipe ({detail}); resume with the checkpoint's "
            "recipe, or start the FP8 state afresh by deleting the file"
        )
    try:
        load_fp8_state_dict(model, tensors)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return recipe.replace(**{k: getattr(saved, k) for k in _RESTORED_FIELDS})


def _recipe_for(model: nn.Module, recipe: Fp8Recipe | str | None) -> Fp8Recipe:
    if recipe is not None:
        return as_recipe(recipe)
    patch = get_state(model)
    if patch is None:
        raise ValueError("give the recipe: the model is not patched, so it has none of its own")
    return patch.recipe


def _read(path: Path) -> tuple[Fp8Recipe, dict[str, torch.Tensor]]:
    """The recipe and the tensors of an FP8 state file; a damaged file is a ValueError naming it."""
    from safetensors import SafetensorError, safe_open

    fix = "restore it from a copy, or delete it to start the FP8 state afresh"
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable FP8 state file ({err}); {fix}") from None
    try:
        data = yaml.safe_load(metadata.get("recipe", "{}")) or {}
        saved = Fp8Recipe.from_dict(data)
    except (yaml.YAMLError, ValueError) as err:
        problem = str(err).splitlines()[0]
        raise ValueError(f"{path}: the recipe stored in it is not valid ({problem}); {fix}") from None
    return saved, tensors


def _listing(label: str, keys: list[str]) -> str:
    if not keys:
        return ""
    shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return f"; {label}: {shown}"
