"""hf-fp8: FP8 training and fine-tuning for HuggingFace Transformers models."""

from hf_fp8 import peft as peft  # hf_fp8.peft.merge_and_unload
from hf_fp8.autocast import fp8_autocast
from hf_fp8.backends.native import update_fp8_scales
from hf_fp8.checkpoint import load_fp8_state, save_fp8_state
from hf_fp8.compile import compile_model as compile
from hf_fp8.formats import E4M3, E5M2, cast_to_representable
from hf_fp8.guard import Fp8NanGuard
from hf_fp8.linear import Fp8Conv1D, Fp8Linear, Fp8Module
from hf_fp8.padding import Fp8PaddingCollator
from hf_fp8.patch import is_patched, patch_model, plan_patch, unpatch_model
from hf_fp8.prepare import prepare_fp8
from hf_fp8.recipe import RECIPES, Fp8Recipe
from hf_fp8.report import PatchReport
from hf_fp8.telemetry import Fp8Telemetry
from hf_fp8.trainer import Fp8Trainer, Fp8TrainerCallback

__version__ = "0.1.0"

__all__ = [
    "E4M3",
    "E5M2",
    "RECIPES",
    "Fp8Conv1D",
    "Fp8Linear",
    "Fp8Module",
    "Fp8NanGuard",
    "Fp8PaddingCollator",
    "Fp8Recipe",
    "Fp8Telemetry",
    "Fp8Trainer",
    "Fp8TrainerCallback",
    "PatchReport",
    "cast_to_representable",
    "compile",
    "fp8_autocast",
    "is_patched",
    "load_fp8_state",
    "patch_model",
    "plan_patch",
    "prepare_fp8",
    "save_fp8_state",
    "unpatch_model",
    "update_fp8_scales",
]
