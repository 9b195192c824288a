"""DeepSpeed ZeRO: the stage a run will shard with, as far as it shows before ``deepspeed.initialize``,
the recipe keys ZeRO cannot honour (refused by :func:`hf_fp8.patch_model` before the model changes), and
ZeRO-3's weight gathers made one per decoder block.

What trains under ZeRO 1, 2 and 3 needs nothing from here: the FP8 layers compute inside the forward and
backward that ZeRO wraps (ZeRO-3 gathers a module's weights before it runs), the step's amaxes are
reduced over the world group as under DDP, and at a step's end a ZeRO-3 weight's amax comes from each
rank's partition (:func:`hf_fp8.numerics.amax_sync.local_shard`).

By default ZeRO-3 hooks every module: each linear layer gathers its weight before it runs and frees it
after. Inside a compiled block every such hook is a graph break (DeepSpeed keeps its hooks out of
``torch.compile``), so the block compiles to a graph per layer and the FP8 casts no longer fuse into the
norms and activations before them: on two H200s (8B shape, 16 layers) hf-fp8 ran 1.04x BF16 so, and
1.32x with every decoder block a ZeRO-3 "leaf module" (DeepSpeed's own switch, which gathers a block's
weights as one unit, hooked once). :func:`gather_blocks_whole` sets it before ``deepspeed.initialize``
registers the hooks, for models whose parameters all train (not under LoRA: see there).
"""

from __future__ import annotations

import json
import os
import warnings
from collections import Counter
from typing import Any

from torch import nn

from hf_fp8.module_tree import repeated_blocks
from hf_fp8.recipe import Fp8Recipe

__all__ = ["gather_blocks_whole", "zero_refusal", "zero_stage"]


def zero_stage(model: nn.Module | None = None) -> int | None:
    """The ZeRO stage this process will train under, or ``None`` where no DeepSpeed shows: a model built
    under ZeRO-3's ``zero.Init`` (its parameters carry DeepSpeed's ids), the config of transformers'
    ``HfDeepSpeedConfig`` (``TrainingArguments(deepspeed=...)`` makes one), or ``accelerate launch``'s
    DeepSpeed environment (its config file, else its ``zero_stage``)."""
    if model is not None and any(hasattr(p, "ds_id") for p in model.parameters()):
        return 3
    config = _transformers_deepspeed_config()
    if config is not None:
        return _stage_of(config)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":  # as accelerate reads it
        return None
    launched = int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2"))  # accelerate's own default
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none" and os.path.isfile(path):
        with open(path) as f:
            return _stage_of(json.load(f), auto=launched)
    return launched


def zero_refusal(recipe: Fp8Recipe, stage: int) -> str | None:
    """Why ``recipe`` cannot train under ZeRO stage ``stage``, with the fix; ``None`` when it can."""
    where = f"under DeepSpeed ZeRO-{stage}" if stage else "under DeepSpeed"
    if recipe.fp8_weights:
        return (
            f"fp8_weights cannot be honoured {where}: a weight stored in FP8 is a tensor subclass, which "
            "torch moves to a device by swapping the parameter, and DeepSpeed's engine holds weak "
            "references to the parameters that forbid the swap (deepspeed.initialize fails with "
            '"Couldn\'t swap Fp8Linear.weight"; ZeRO-3 would also have to partition it). Set fp8_weights: '
            "false (LoRA then keeps the frozen base weights in BF16; its GEMMs still run in FP8), or train "
            "on one GPU, under DDP or FSDP2"
        )
    if recipe.nan_policy != "raise":
        return (
            f"nan_policy {recipe.nan_policy} cannot be honoured {where}: a step cannot be skipped there, "
            "since DeepSpeed's engine keeps the gradients in its own buffers and steps the optimizer itself "
            "(through accelerate, the Trainer included, inside the backward), before the NaN guard sees the "
            "step. Set nan_policy: raise (the guard then stops the run at the first non-finite step), or "
            "train on one GPU, under DDP or FSDP2"
        )
    if recipe.fp8_all_gather:
        return (
            f"fp8_all_gather cannot be honoured {where}: it is FSDP2's FP8 all-gather, and ZeRO gathers "
            "weights in their own dtype. Set fp8_all_gather: false, or shard with FSDP2"
        )
    return None


def gather_blocks_whole(model: nn.Module, stage: int | None) -> str | None:
    """Under ZeRO-3 (``stage``, as :func:`zero_stage` gives it), make each of ``model``'s decoder blocks
    a DeepSpeed leaf module, so that ZeRO-3 gathers and frees a block's weights at once and hooks nothing
    inside it; or, where the model has frozen parameters (LoRA), keep or put the blocks back to
    DeepSpeed's gathers layer by layer. Call it again when the model changes (a patched model wrapped in
    PEFT later): ``patch_model`` does on a patched model, as the Trainer callback and ``prepare_fp8``
    call it.

    DeepSpeed reduces a leaf module's gradients when the gradient of its input is ready, and for a module
    whose input needs no gradient (the first block after frozen embeddings, or the embeddings themselves)
    that comes before any of its weights' gradients: the run fails ("Cannot reduce scatter gradients
    whose size is not same as the params"). Hence only repeated blocks without an embedding, in a model
    whose parameters all train.

    Returns what it means for the run, for a report, or ``None`` where there is nothing to say (no
    ZeRO-3 shows, no such blocks, the blocks are leaves already). Warns, changing nothing, where
    ``deepspeed.initialize`` has already hooked the modules inside the blocks.
    """
    if stage != 3:
        return None
    blocks = _blocks_to_gather(model)
    if not blocks:
        return None
    try:
        from deepspeed.utils import set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module
    except ImportError:  # a stage from the environment without DeepSpeed: nothing will gather
        return None
    trainable = all(p.requires_grad for p in model.parameters())
    leaves = [z3_leaf_module(b) for b in blocks]
    if trainable and all(leaves):
        return None
    names = ", ".join(sorted({type(b).__name__ for b in blocks}))
    classes = sorted({type(b) for b in blocks}, key=lambda c: c.__name__)
    layer_by_layer = (
        f"DeepSpeed (ZeRO-3): the {names} blocks gather their weights layer by layer, as the model has "
        "frozen parameters (DeepSpeed's whole-block gathers would reduce a block's gradients before they "
        "exist); a compiled block then runs as a graph per layer"
    )
    if any(hasattr(m, "ds_id") for block in blocks for m in block.modules()):  # ZeRO-3's hooks number them
        if trainable:
            hooked = "each layer on its own, each hook a graph break in a compiled block: FP8 gains little"
        elif any(leaves):
            hooked = "each as one unit, and the model now has frozen parameters: DeepSpeed will fail to "
            hooked += "reduce the first block's gradients"
        else:
            return layer_by_layer
        warnings.warn(
            f"hf_fp8: deepspeed.initialize has already hooked the model's {names} blocks, {hooked}. Call "
            "patch_model (after PEFT's get_peft_model) and hf_fp8.compile before deepspeed.initialize "
            "(before the Trainer or accelerator.prepare takes the model)",
            stacklevel=3,
        )
        return None
    if not trainable:
        if any(leaves):
            unset_z3_leaf_modules(model, classes)
        return layer_by_layer
    set_z3_leaf_modules(model, classes)
    return (
        f"DeepSpeed (ZeRO-3): each {names} gathers its weights as one unit (a ZeRO-3 leaf module), so "
        "that a compiled block runs as one graph"
    )


def _blocks_to_gather(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (HF's ``_no_split_modules`` name embeddings and whole encoders too) of a class
    with two or more of them, none holding an embedding."""
    blocks = repeated_blocks(model)
    counts = Counter(type(b) for b in blocks)
    return [
        b for b in blocks if counts[type(b)] > 1 and not any(isinstance(m, nn.Embedding) for m in b.modules())
    ]


def _transformers_deepspeed_config() -> dict[str, Any] | None:
    """The config of the live ``HfDeepSpeedConfig`` (``None`` without one, or without transformers)."""
    try:
        from transformers.integrations.deepspeed import deepspeed_config
    except ImportError:
        return None
    return deepspeed_config()


def _stage_of(config: dict[str, Any], auto: int = 2) -> int:
    """A DeepSpeed config's ZeRO stage: 0 without ZeRO, ``auto`` where it says "auto" (accelerate fills
    it in from its launch arguments, 2 by default)."""
    stage = config.get("zero_optimization", {}).get("stage", 0)
    return int(stage) if str(stage).isdigit() else auto
