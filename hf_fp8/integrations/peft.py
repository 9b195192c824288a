"""PEFT LoRA on FP8 models: what PEFT cannot do by itself.

LoRA needs nothing special here: ``Fp8Linear`` is an ``nn.Linear`` (and ``Fp8Conv1D`` a ``Conv1D``), so
PEFT's own dispatch wraps it in either order (``patch_model`` then ``get_peft_model``, or the other
way round), the base layer runs in FP8 and ``lora_A`` / ``lora_B`` stay in high precision. With
``fp8_weights`` the frozen base weights are stored in FP8 at the first forward after PEFT froze them.

Merging is the one thing PEFT cannot do on FP8 storage: it adds the adapter's delta to
``base_layer.weight`` in place, which has no meaning for FP8 values with a scale. :func:`merge_and_unload`
dequantizes those weights first, lets PEFT merge, and stores the merged weights in FP8 again when
asked. :func:`from_pretrained_fp8` loads a checkpoint straight into FP8 base weights.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_fp8.layers.fp8_scaled import Fp8Scaled
from hf_fp8.layers.linear import Fp8Module
from hf_fp8.patching.patch import move_patch, patch_model
from hf_fp8.patching.patch_state import get_state
from hf_fp8.patching.step import set_recipe
from hf_fp8.recipe import RECIPES, Fp8Recipe, as_recipe
from hf_fp8.report import PatchReport

__all__ = ["from_pretrained_fp8", "merge_and_unload"]


def merge_and_unload(peft_model: nn.Module, fp8: bool = False, **kwargs) -> nn.Module:
    """PEFT's ``merge_and_unload`` for a model whose base layers store their weights in FP8.

    The FP8 base weights are dequantized to their original dtype, PEFT merges the adapters into them
    and removes the LoRA layers. The result is the base model, still patched for FP8 compute, with
    merged weights in the original dtype, or stored in FP8 again (frozen) with ``fp8=True``.
    ``kwargs`` go to PEFT (``safe_merge``, ``adapter_names``, ...).
    """
    if not (hasattr(peft_model, "get_base_model") and hasattr(peft_model, "merge_and_unload")):
        raise TypeError(
            "merge_and_unload needs a PEFT model (from peft.get_peft_model or PeftModel.from_pretrained), "
            f"got {type(peft_model).__name__}"
        )
    base = peft_model.get_base_model()
    stored_in_fp8 = [m for m in base.modules() if isinstance(m, Fp8Module) and m.weight_in_fp8]
    for module in stored_in_fp8:
        module.dequantize_weight_()
    # PEFT first, then patch_model: the hooks are on the PeftModel itself (its attribute lookups also
    # reach the base model's, hence vars()).
    patched_root = get_state(peft_model, own=True) is not None
    merged = peft_model.merge_and_unload(**kwargs)
    if patched_root:
        move_patch(peft_model, merged)
    if fp8:
        for module in merged.modules():
            if isinstance(module, Fp8Module):
                module.weight.requires_grad_(False)
                module.quantize_weight_()
    return merged


def from_pretrained_fp8(
    path: str | os.PathLike,
    recipe: Fp8Recipe | None = None,
    device: str | torch.device | None = None,
    model_class: type | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, PatchReport]:
    """Load a HF checkpoint as a frozen base model whose linear weights are stored in FP8, for LoRA.

    transformers loads the checkpoint shard by shard into host memory; then each FP8 layer's weight
    goes to ``device`` alone and is quantized there, so besides the FP8 weights the device holds one
    layer's weight and its quantization temporaries at a time, never the whole model in BF16.
    Everything else (embeddings, norms, the output head unless ``convert_lm_head``) moves as it is.

    Args:
        path: a local checkpoint folder (nothing is downloaded at run time).
        recipe: the FP8 recipe; ``fp8_weights`` is turned on. Default: the ``lora-fp8`` recipe.
        device: where the model goes (default: the first CUDA GPU if there is one, else the CPU).
        model_class: the ``transformers`` auto class, ``AutoModelForCausalLM`` by default.
        kwargs: for ``from_pretrained`` (``dtype``, ``trust_remote_code``, ...).

    Returns the model (every parameter frozen: add adapters with PEFT next) and the patch report.
    """
    from transformers import AutoModelForCausalLM

    if not Path(path).is_dir():
        raise FileNotFoundError(
            "from_pretrained_fp8 loads a local checkpoint folder (nothing is downloaded); "
            f"{str(path)!r} is not one"
        )
    recipe = (as_recipe(recipe) if recipe is not None else RECIPES["lora-fp8"]).replace(fp8_weights=True)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model_class = model_class or AutoModelForCausalLM
    kwargs.setdefault("dtype", torch.bfloat16)
    model = model_class.from_pretrained(path, device_map="cpu", **kwargs)
    model.requires_grad_(False)
    # Patched on the host without quantizing, then quantized one layer at a time on the device.
    report = patch_model(model, recipe.replace(fp8_weights=False), backend="native")
    for module in model.modules():
        if isinstance(module, Fp8Scaled):  # linear layers and MoE experts
            module.to(device)
            module.store_weights_in_fp8()
    set_recipe(model, recipe)
    report.notes.append(f"fp8_weights: loaded from {path} and stored in FP8 layer by layer on {device}")
    return model.to(device), report
