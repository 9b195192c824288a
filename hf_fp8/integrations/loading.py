"""``hf_fp8.from_pretrained``: one way to load a checkpoint into FP8, whatever the checkpoint holds.

A checkpoint folder is either a plain HF checkpoint or a fine-grained FP8 one (E4M3 weights in 128x128
blocks, ``quant_method: fp8`` in its config). The recipe says what to do with it:

* a recipe that stores weights in FP8 (``fp8_weights``, the LoRA recipes): the linear weights are
  loaded frozen in FP8, one layer at a time on the device (a plain checkpoint is quantized on the way;
  an FP8 one keeps its values under block scaling, else is requantized with one scale a tensor);
* any other recipe: trainable weights in ``dtype`` (an FP8 checkpoint is dequantized one layer at a
  time), patched with the recipe.

It returns ``(model, report)``, as :func:`hf_fp8.peft.from_pretrained_fp8` always did;
:func:`hf_fp8.load_fp8_pretrained` (the model alone) and ``from_pretrained_fp8`` are what it calls.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_fp8.integrations.fp8_checkpoint import load_fp8_checkpoint
from hf_fp8.integrations.peft import from_pretrained_fp8
from hf_fp8.patching.patch import patch_model
from hf_fp8.recipe import Fp8Recipe, as_recipe
from hf_fp8.report import PatchReport

__all__ = ["from_pretrained", "is_fp8_checkpoint", "load_fp8_pretrained"]


def is_fp8_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` holds a fine-grained FP8 checkpoint (``quant_method: fp8``)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    quantization = json.loads(config.read_text()).get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "fp8"


def from_pretrained(
    path: str | os.PathLike,
    recipe: Fp8Recipe | str | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    model_class: type | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, PatchReport]:
    """Load the checkpoint folder ``path`` and patch it to FP8 with ``recipe``; returns the model and the
    patch report (see the module docstring for what each kind of checkpoint and recipe gives).

    Args:
        path: a local checkpoint folder (nothing is downloaded at run time).
        recipe: default ``lora-fp8-block``: an FP8 checkpoint's block-scaled weights kept as they are, a
            plain checkpoint's quantized on load into 128x128 blocks (closer to BF16 than one scale a
            tensor on every measurement: docs/recipes.md#long-runs).
        dtype: the dtype of everything that is not stored in FP8.
        device: where the model goes (default: the first CUDA GPU if there is one, else the CPU).
        model_class: the transformers auto class, ``AutoModelForCausalLM`` by default.
        kwargs: for ``from_pretrained`` of a plain checkpoint (``trust_remote_code``, ...).
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"hf_fp8.from_pretrained loads a local checkpoint folder; {str(path)!r} is not one"
        )
    fp8_checkpoint = is_fp8_checkpoint(path)
    recipe = as_recipe(recipe if recipe is not None else "lora-fp8-block")
    if fp8_checkpoint:
        if kwargs:
            raise TypeError(f"hf_fp8.from_pretrained: an FP8 checkpoint takes no {sorted(kwargs)}")
        return load_fp8_checkpoint(path, recipe, dtype=dtype, device=device, model_class=model_class)
    if recipe.enabled and recipe.fp8_weights:
        return from_pretrained_fp8(
            path, recipe, device=device, model_class=model_class, dtype=dtype, **kwargs
        )
    from transformers import AutoModelForCausalLM

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = (model_class or AutoModelForCausalLM).from_pretrained(path, dtype=dtype, **kwargs).to(device)
    return model, patch_model(model, recipe)


def load_fp8_pretrained(
    path: str | os.PathLike,
    recipe: Fp8Recipe | str = "lora-fp8-block",
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    model_class: type | None = None,
    backend: str = "native",
    torch_dtype: torch.dtype | None = None,
) -> nn.Module:
    """:func:`load_fp8_checkpoint`'s model alone (its report is in the model's patch state).
    ``torch_dtype`` is the old name of ``dtype`` (as in transformers), with a ``FutureWarning``."""
    if torch_dtype is not None:
        warnings.warn(
            "load_fp8_pretrained: torch_dtype is now dtype (as transformers spells it); the old name goes in "
            "a later release",
            FutureWarning,
            stacklevel=2,
        )
        dtype = torch_dtype
    return load_fp8_checkpoint(
        path, recipe, dtype=dtype, device=device, model_class=model_class, backend=backend
    )[0]
