"""What transformers' ``TrainingArguments`` mean for FP8: the checks the Trainer callback makes, the
backend it patches with, whether it compiles, which steps are logged, and where checkpoints are.

Kept apart from the callback so that the callback holds the step's events and this module the rules
read from the arguments (each a small function of them).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.training_args import ParallelMode

from hf_fp8.backends.base import data_parallel_refusal
from hf_fp8.backends.registry import backend_class, backend_for_data_parallel, backend_for_fsdp
from hf_fp8.formats import gpu_has_fp8
from hf_fp8.integrations.compiled import compiles_by_default
from hf_fp8.patching.patch_state import get_state
from hf_fp8.patching.zero import zero_stage
from hf_fp8.recipe import Fp8Recipe

__all__ = [
    "backend_for",
    "check_arguments",
    "checkpointing_requested",
    "compiles_by_default_for",
    "data_parallel",
    "generates",
    "log_due",
    "logging_strategy",
    "logits_dtype_for",
    "resume_candidates",
    "saved_checkpoint",
    "should_compile",
    "under_deepspeed",
]


def check_arguments(args: Any, model: nn.Module) -> None:
    """Warn about TrainingArguments that fight FP8, and say what runs where FP8 cannot."""
    backend = get_state(model).backend
    if getattr(args, "fp16", False):
        warnings.warn(
            "hf_fp8: fp16=True runs everything outside the FP8 layers in float16 under a loss scaler, "
            "which FP8 training does not need and which overflows more easily (the steps the scaler "
            "would skip reach the NaN guard, which raises by default); use bf16=True",
            stacklevel=3,
        )
    if data_parallel(args) and (problem := backend.replica_problem()) is not None:
        raise ValueError(data_parallel_refusal(backend.name, problem))
    if backend.recompute_problem is not None and checkpointing_requested(args):
        raise ValueError(
            f"hf_fp8: gradient_checkpointing with the {backend.name} backend "
            f"{backend.recompute_problem}; set gradient_checkpointing=False or patch with backend='native'"
        )
    device = getattr(args, "device", None) or next(model.parameters()).device
    if device.type == "cpu":
        warnings.warn(
            "hf_fp8: the model is on the CPU; FP8 runs with real FP8 casts and torch._scaled_mm, so the "
            "numerics are those of FP8 training, but the CPU has no FP8 speed-up",
            stacklevel=3,
        )
    elif device.type == "cuda" and not gpu_has_fp8(device):
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        warnings.warn(
            f"hf_fp8: {name} (compute capability {major}.{minor}) has no FP8 tensor cores (they need 8.9 "
            "or later); the FP8 GEMMs are emulated in float32 with the same FP8 numerics, slower than BF16",
            stacklevel=3,
        )


def should_compile(asked: bool | None, args: Any, model: nn.Module) -> bool:
    """Whether the callback compiles the patched model: as asked, else by :func:`compiles_by_default_for`,
    except for a trainer that generates with the model it trains (TRL's GRPO): on one H200 (1B shape) a
    compiled FP8 GRPO step took 10-14 s against 2.8 s eager and 1.9-2.4 s in BF16, its decoding attention
    calls blocking the host, a cause not yet found."""
    if asked is not None:
        return asked
    return not generates(args) and compiles_by_default_for(args, model)


def compiles_by_default_for(args: Any, model: nn.Module) -> bool:
    """:func:`compiles_by_default` on the device the Trainer trains on, sharded under FSDP and DeepSpeed."""
    sharded = bool(getattr(args, "fsdp", None)) or under_deepspeed(args)
    device = getattr(args, "device", None) or next(model.parameters()).device
    return compiles_by_default(model, device, sharded)


def logits_dtype_for(args: Any) -> torch.dtype | None:
    """The dtype the compiled model returns its training logits in (``hf_fp8.compile``'s
    ``logits_dtype``): float32 where the Trainer's Accelerator converts every forward's half-precision
    outputs to float32 anyway (its ``bf16`` or ``fp16`` mixed precision, outside DeepSpeed), so that
    the loss's kernel writes them instead of a pass of their own; else the model's dtype."""
    mixed = bool(getattr(args, "bf16", False) or getattr(args, "fp16", False))
    return torch.float32 if mixed and not under_deepspeed(args) else None


def generates(args: Any) -> bool:
    """Whether the trainer generates with the model it trains (TRL's online methods, GRPO and RLOO,
    whose configs say how many completions a prompt gets)."""
    return getattr(args, "num_generations", None) is not None


def under_deepspeed(args: Any) -> bool:
    """Whether the Trainer runs under DeepSpeed: given a config, or ZeRO set up by its launcher."""
    return bool(getattr(args, "deepspeed", None)) or zero_stage() is not None


def data_parallel(args: Any) -> bool:
    """Whether the Trainer will wrap the model in nn.DataParallel: several GPUs, no launcher."""
    mode = getattr(args, "parallel_mode", None)
    return getattr(args, "n_gpu", 1) > 1 and mode == ParallelMode.NOT_DISTRIBUTED


def checkpointing_requested(args: Any) -> bool:
    """Activation (before transformers 5: gradient) checkpointing is asked for."""
    name = (
        "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    )
    return bool(getattr(args, name, False))


def backend_for(backend: str, args: Any, recipe: Fp8Recipe) -> str:
    """``auto`` decided by the device the Trainer trains on: the model may still be on the CPU when the
    Trainer is built (FSDP, DeepSpeed, full-precision eval settings move it later); with ``fsdp`` in the
    arguments, a backend that trains sharded; under DeepSpeed, as asked: ``patch_model`` sees the ZeRO
    stage too and chooses (or refuses) the backend for it."""
    if getattr(args, "fsdp", None):
        return backend_for_fsdp(backend)
    if under_deepspeed(args):
        return backend
    if data_parallel(args):
        return backend_for_data_parallel(backend)
    if backend != "auto":
        return backend
    device = getattr(args, "device", torch.device("cpu"))
    return backend_class("auto", device, recipe).name


def logging_strategy(args: Any) -> str:
    return str(getattr(args, "logging_strategy", "steps")).rsplit(".", 1)[-1].lower()


def log_due(args: Any, state: Any) -> bool:
    """Whether the step now starting will be logged (DefaultFlowCallback's rule). Logging by epoch
    samples every step and keeps the newest; no logging samples nothing."""
    strategy = logging_strategy(args)
    if strategy != "steps":
        return strategy != "no"
    step = state.global_step + 1
    every = state.logging_steps or args.logging_steps
    every = math.ceil(every) if every >= 1 else max(1, math.ceil(state.max_steps * every))
    return step % every == 0 or (step == 1 and args.logging_first_step)


def resume_candidates(args: Any, step: int, resume_from: str | None) -> list[Path]:
    """Where the checkpoint being resumed may be: the folder Fp8Trainer.train was given, the one in
    TrainingArguments, else the Trainer's default place for it."""
    given = (resume_from, getattr(args, "resume_from_checkpoint", None))
    return [
        *(Path(p) for p in given if isinstance(p, str)),
        Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}",
    ]


def saved_checkpoint(args: Any, step: int) -> Path | None:
    """The checkpoint folder the Trainer just wrote for ``step``: under the output folder, or under a
    hyperparameter-search run folder inside it (the newest, being the one just written)."""
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    direct = Path(args.output_dir) / name
    if direct.is_dir():
        return direct
    runs = sorted(Path(args.output_dir).glob(f"*/{name}"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None
