"""What ``recipe=None`` means: the recipe ``hf-fp8 launch`` handed over, else one chosen by where the
model's weights come from.

FP8 forwards round every linear layer's input to E4M3. A model that learns under that rounding from its
first step loses nothing to it (a 384M Llama from scratch over 3,100 steps: train loss -0.14% against
BF16); a model whose weights were trained in high precision keeps the rounding as an offset that
fine-tuning does not train away (SmolLM2-135M, 1,000 full fine-tuning steps: +0.90% train loss, and
DPO +4%). Its backward GEMMs in FP8 with its forwards in high precision held both (+0.02% from scratch,
+0.06% fine-tuned; +0.10% with the output head's backward in FP8, its gradient in 1x128 tiles). So
(measurements: ``docs/recipes.md#long-runs``):

* weights loaded from a checkpoint (an HF config that names where it came from, as ``from_pretrained``
  leaves it; a model built from a config read from a checkpoint's folder counts too):
  ``backward-fp8``, forwards in high precision;
* weights from a config (pretraining): the :class:`~hf_fp8.recipe.Fp8Recipe` defaults
  (``hybrid-delayed``), forwards in FP8, the faster;
* Transformer Engine, named as the backend: its defaults whatever the weights, as it has no
  backward-only module.

Any recipe given by name, object, file or ``hf-fp8 launch --recipe`` is used as it is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torch import nn

from hf_fp8.recipe import RECIPES, Fp8Recipe, as_recipe

__all__ = ["FINE_TUNE_RECIPE", "checkpoint_of", "resolve_recipe"]

FINE_TUNE_RECIPE = "backward-fp8"


def checkpoint_of(model: nn.Module) -> str | None:
    """Where ``model``'s weights were loaded from, as its HF config names it (``from_pretrained`` sets
    ``name_or_path``; a PEFT or other wrapper is looked through); ``None`` for a model built from a
    config of its own."""
    for module in model.modules():
        config = getattr(module, "config", None)
        name = getattr(config, "name_or_path", None)
        if isinstance(name, str) and hasattr(config, "to_dict"):
            return name or None
    return None


def resolve_recipe(
    recipe: Fp8Recipe | str | os.PathLike | Mapping[str, Any] | None, model: nn.Module, backend: str = "auto"
) -> tuple[Fp8Recipe, str | None]:
    """The recipe to patch ``model`` with: ``recipe`` as given (:func:`~hf_fp8.recipe.as_recipe`), else the
    launcher's, else the default for where the weights come from (see the module docstring); and, when that
    default depended on the weights being a checkpoint's, what the report says about it."""
    if recipe is not None or Fp8Recipe.launched():
        return as_recipe(recipe), None
    checkpoint = checkpoint_of(model)
    if checkpoint is None:
        return Fp8Recipe(), None
    if backend == "te":
        return Fp8Recipe(), (
            f"recipe: the defaults (FP8 forwards) for weights from {checkpoint!r}: Transformer Engine has "
            f"no {FINE_TUNE_RECIPE}; FP8 forwards cost SmolLM2's fine-tune +0.9% loss "
            "(docs/recipes.md#long-runs)"
        )
    return RECIPES[FINE_TUNE_RECIPE], (
        f"recipe: {FINE_TUNE_RECIPE} (forwards in high precision, backward GEMMs in FP8), the default for "
        f"weights loaded from a checkpoint ({checkpoint!r}): FP8 forwards cost SmolLM2's fine-tune +0.9% "
        "loss, this +0.10% (docs/recipes.md#long-runs); pass recipe='hybrid-delayed' for FP8 forwards"
    )
