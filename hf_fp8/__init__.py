"""hf-fp8: FP8 training and fine-tuning for HuggingFace Transformers models.

The names below load on first use (PEP 562): ``import hf_fp8`` costs nothing, the ``hf-fp8`` command
answers at once, and what is not used is not imported (PEFT, the Trainer, and through PEFT
Transformer Engine, load only with the features that need them).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> (module, attribute in it).
_EXPORTS = {
    "E4M3": ("hf_fp8.formats", "E4M3"),
    "E5M2": ("hf_fp8.formats", "E5M2"),
    "RECIPES": ("hf_fp8.recipe", "RECIPES"),
    "Fp8Conv1D": ("hf_fp8.linear", "Fp8Conv1D"),
    "Fp8Linear": ("hf_fp8.linear", "Fp8Linear"),
    "Fp8Module": ("hf_fp8.linear", "Fp8Module"),
    "Fp8NanGuard": ("hf_fp8.guard", "Fp8NanGuard"),
    "Fp8PaddingCollator": ("hf_fp8.padding", "Fp8PaddingCollator"),
    "Fp8Recipe": ("hf_fp8.recipe", "Fp8Recipe"),
    "Fp8Telemetry": ("hf_fp8.telemetry", "Fp8Telemetry"),
    "Fp8Trainer": ("hf_fp8.trainer", "Fp8Trainer"),
    "Fp8TrainerCallback": ("hf_fp8.trainer", "Fp8TrainerCallback"),
    "PatchReport": ("hf_fp8.report", "PatchReport"),
    "cast_to_representable": ("hf_fp8.formats", "cast_to_representable"),
    "compile": ("hf_fp8.compiled", "compile_model"),
    "fp8_autocast": ("hf_fp8.autocast", "fp8_autocast"),
    "is_patched": ("hf_fp8.patch", "is_patched"),
    "load_fp8_state": ("hf_fp8.checkpoint", "load_fp8_state"),
    "patch_model": ("hf_fp8.patch", "patch_model"),
    "peft": ("hf_fp8.peft", None),  # the module: hf_fp8.peft.merge_and_unload
    "plan_patch": ("hf_fp8.patch", "plan_patch"),
    "prepare_fp8": ("hf_fp8.prepare", "prepare_fp8"),
    "save_fp8_state": ("hf_fp8.checkpoint", "save_fp8_state"),
    "unpatch_model": ("hf_fp8.patch", "unpatch_model"),
    "update_fp8_scales": ("hf_fp8.backends.native", "update_fp8_scales"),
}

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
    "peft",
    "plan_patch",
    "prepare_fp8",
    "save_fp8_state",
    "unpatch_model",
    "update_fp8_scales",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hf_fp8' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from hf_fp8 import peft
    from hf_fp8.autocast import fp8_autocast
    from hf_fp8.backends.native import update_fp8_scales
    from hf_fp8.checkpoint import load_fp8_state, save_fp8_state
    from hf_fp8.compiled import compile_model as compile
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
