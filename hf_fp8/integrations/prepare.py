"""``prepare_fp8``: FP8 for custom training loops driven by Accelerate."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_fp8.backends.registry import backend_for_fsdp
from hf_fp8.checks import check_model
from hf_fp8.integrations.checkpoint import FP8_STATE_FILE, load_fp8_state, save_fp8_state
from hf_fp8.integrations.compiled import compile_model, compiles_by_default
from hf_fp8.patching.patch import patch_or_recheck
from hf_fp8.patching.patch_state import get_state
from hf_fp8.patching.step import end_pending_step, set_recipe
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import PatchReport

__all__ = ["keep_fp8_state_with_checkpoints", "prepare_fp8"]


def prepare_fp8(
    accelerator: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    recipe: Fp8Recipe | str | None = None,
    backend: str = "auto",
    compile: bool | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None, PatchReport]:
    """Patch ``model`` to FP8, compile it block by block (:func:`hf_fp8.compile`), then
    ``accelerator.prepare`` it (and ``optimizer``).

    ``compile=None`` (default) compiles on a GPU with FP8 unless Accelerate shards the model (FSDP,
    DeepSpeed: pass ``compile=True`` to compile before sharding); an Accelerate ``dynamo_backend`` then
    finds the blocks compiled and traces only the few operations between them. The CPU stays eager.

    ``accelerator.save_state`` / ``load_state`` then also write and read the model's FP8 state
    (``fp8_state.safetensors`` next to the checkpoint; see :func:`keep_fp8_state_with_checkpoints`).
    Patching comes first, so DDP/FSDP wrap the FP8 model and its amax state. The optimizer keeps
    working: the native backend shares every parameter. When a backend replaces some (Transformer
    Engine fuses q/k/v into one weight), an optimizer that has not stepped yet and has one parameter
    group swaps the replaced parameters for the new trainable ones (parameters that are not the
    model's stay); any other optimizer is refused rather than left updating parameters the model no
    longer uses. ``recipe=None`` reads ``HF_FP8_RECIPE`` (set by ``hf-fp8 launch``), else takes
    ``patch_model``'s default for the model's weights. Returns the prepared model, optimizer and the
    report.
    """
    check_model(model, "prepare_fp8")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"prepare_fp8: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if getattr(accelerator, "mixed_precision", None) == "fp8":
        raise ValueError(
            "prepare_fp8: the Accelerator has mixed_precision='fp8' and would convert the model a second "
            "time; create it with mixed_precision='bf16' (hf-fp8 does the FP8 conversion)"
        )
    if compile not in (None, True, False):
        raise TypeError(
            f"prepare_fp8: compile must be True, False or None (compile on an FP8 GPU), got {compile!r}"
        )
    distributed = getattr(accelerator, "distributed_type", None)  # a str enum: equal to its value
    if distributed == "FSDP":
        backend = backend_for_fsdp(backend)
    before = {id(p) for p in model.parameters()}
    report = patch_or_recheck(model, recipe, backend=backend)
    sharded = distributed in ("FSDP", "DEEPSPEED")
    if compile or (compile is None and compiles_by_default(model, torch.device(accelerator.device), sharded)):
        # Accelerate's mixed precision converts each forward's outputs to float32: let the graph do it
        converts = getattr(accelerator, "native_amp", False)
        compile_model(model, logits_dtype=torch.float32 if converts else None)
        report.add_note("compiled block by block (hf_fp8.compile) by prepare_fp8")
    keep_fp8_state_with_checkpoints(accelerator, model)
    if optimizer is None:
        return accelerator.prepare(model), None, report
    current = {id(p) for p in model.parameters()}
    replaced = [
        p for g in optimizer.param_groups for p in g["params"] if id(p) in before and id(p) not in current
    ]
    if replaced:
        if optimizer.state or len(optimizer.param_groups) != 1:
            raise ValueError(
                f"prepare_fp8: the {report.backend} backend replaced {len(replaced)} of the optimizer's "
                "parameters, and the optimizer has state or several parameter groups; create the "
                "optimizer after prepare_fp8 (pass optimizer=None)"
            )
        group = optimizer.param_groups[0]
        kept = [p for p in group["params"] if id(p) not in before or id(p) in current]
        added = [p for p in model.parameters() if p.requires_grad and id(p) not in before]
        group["params"] = kept + added
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, report


def keep_fp8_state_with_checkpoints(accelerator: Any, model: nn.Module) -> None:
    """Have ``accelerator.save_state`` write ``model``'s FP8 state next to its checkpoint (the main
    process only: the state is the same on every rank) and ``load_state`` read it back, through
    Accelerate's state hooks. ``model`` is the patched model itself, not the prepared wrapper, so the
    file's keys are the model's own. A checkpoint without the file resumes with a warning: its scales
    start afresh."""

    def save(models: list[nn.Module], weights: list[dict], output_dir: str) -> None:
        end_pending_step(model)  # the state at the step boundary
        if accelerator.is_main_process:
            save_fp8_state(model, output_dir)

    def load(models: list[nn.Module], input_dir: str) -> None:
        if not (Path(input_dir) / FP8_STATE_FILE).is_file():
            warnings.warn(
                f"hf_fp8: no {FP8_STATE_FILE} in {input_dir}; FP8 scales start afresh from the next step's "
                "amaxes, so this run will not follow the interrupted one exactly",
                stacklevel=2,
            )
            return
        recipe = load_fp8_state(model, input_dir)
        if recipe != get_state(model).recipe:
            set_recipe(model, recipe)  # the checkpoint's margin (the NaN guard may have raised it)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
