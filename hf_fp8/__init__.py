"""hf-fp8: FP8 training and fine-tuning for HuggingFace Transformers models.

The names below load on first use (PEP 562): ``import hf_fp8`` costs nothing, the ``hf-fp8`` command
answers at once, and what is not used is not imported (PEFT, the Trainer, and through PEFT
Transformer Engine, load only with the features that need them).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> (module, attribute in it).
_EXPORTS = {
    "E4M3": ("hf_fp8.formats", "E4M3"),
    "E5M2": ("hf_fp8.formats", "E5M2"),
    "RECIPES": ("hf_fp8.recipe", "RECIPES"),
    "Fp8Conv1D": ("hf_fp8.layers.linear", "Fp8Conv1D"),
    "assets": ("hf_fp8.apps.assets", None),  # the module: the demo's real model and text, from PyPI
    "Fp8Linear": ("hf_fp8.layers.linear", "Fp8Linear"),
    "Fp8Module": ("hf_fp8.layers.linear", "Fp8Module"),
    "Fp8CastWarning": ("hf_fp8.integrations.cast_watch", "Fp8CastWarning"),
    "Fp8CastWatch": ("hf_fp8.integrations.cast_watch", "Fp8CastWatch"),
    "Fp8NanGuard": ("hf_fp8.integrations.guard", "Fp8NanGuard"),
    "Fp8PaddingCollator": ("hf_fp8.patching.padding", "Fp8PaddingCollator"),
    "Fp8Recipe": ("hf_fp8.recipe", "Fp8Recipe"),
    "Fp8Telemetry": ("hf_fp8.integrations.telemetry", "Fp8Telemetry"),
    "Fp8Trainer": ("hf_fp8.integrations.trainer", "Fp8Trainer"),
    "Fp8TrainerCallback": ("hf_fp8.integrations.trainer", "Fp8TrainerCallback"),
    "PatchReport": ("hf_fp8.report", "PatchReport"),
    "cast_to_representable": ("hf_fp8.formats", "cast_to_representable"),
    "compile": ("hf_fp8.integrations.compiled", "compile_model"),
    "fp8_autocast": ("hf_fp8.autocast", "fp8_autocast"),
    "from_pretrained": ("hf_fp8.integrations.loading", "from_pretrained"),
    "is_patched": ("hf_fp8.patching.patch", "is_patched"),
    "load_fp8_pretrained": ("hf_fp8.integrations.loading", "load_fp8_pretrained"),
    "load_fp8_state": ("hf_fp8.integrations.checkpoint", "load_fp8_state"),
    "patch_model": ("hf_fp8.patching.patch", "patch_model"),
    "peft": ("hf_fp8.integrations.peft", None),  # the module: hf_fp8.peft.merge_and_unload
    "plan_patch": ("hf_fp8.patching.patch", "plan_patch"),
    "prepare_fp8": ("hf_fp8.integrations.prepare", "prepare_fp8"),
    "prepare_reference": ("hf_fp8.integrations.reference", "prepare_reference"),
    "save_fp8_pretrained": ("hf_fp8.integrations.fp8_checkpoint", "save_fp8_pretrained"),
    "save_fp8_state": ("hf_fp8.integrations.checkpoint", "save_fp8_state"),
    "unpatch_model": ("hf_fp8.patching.patch", "unpatch_model"),
    "update_fp8_scales": ("hf_fp8.backends.native", "update_fp8_scales"),
}

__all__ = [
    "E4M3",
    "E5M2",
    "RECIPES",
    "Fp8CastWarning",
    "Fp8CastWatch",
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
    "assets",
    "cast_to_representable",
    "compile",
    "fp8_autocast",
    "from_pretrained",
    "is_patched",
    "load_fp8_pretrained",
    "load_fp8_state",
    "patch_model",
    "peft",
    "plan_patch",
    "prepare_fp8",
    "prepare_reference",
    "save_fp8_pretrained",
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


# Modules that moved into the packages (0.2): their old paths import the new modules, with a
# DeprecationWarning; ``hf_fp8.peft`` and ``hf_fp8.assets`` are the documented names of
# ``hf_fp8.integrations.peft`` and ``hf_fp8.apps.assets`` and warn not. CHANGELOG.md lists them.
_MOVED = {
    "scaling": "numerics.scaling",
    "gemm": "numerics.gemm",
    "rowwise": "numerics.rowwise",
    "blockwise": "numerics.blockwise",
    "grouped": "numerics.grouped",
    "cuda_copies": "numerics.cuda_copies",
    "triton_kernels": "numerics.triton_kernels",
    "distributed": "numerics.amax_sync",
    "scaling_state": "layers.layer_scaling",
    "scaled": "layers.fp8_scaled",
    "linear": "layers.linear",
    "experts": "layers.experts",
    "stored_weight": "layers.stored_weight",
    "fsdp": "layers.fsdp",
    "norms": "layers.norms",
    "selection": "layers.selection",
    "patch_state": "patching.patch_state",
    "patch": "patching.patch",
    "forward_hooks": "patching.forward_hooks",
    "step": "patching.step",
    "padding": "patching.padding",
    "trainer": "integrations.trainer",
    "prepare": "integrations.prepare",
    "peft": "integrations.peft",
    "guard": "integrations.guard",
    "telemetry": "integrations.telemetry",
    "checkpoint": "integrations.checkpoint",
    "compiled": "integrations.compiled",
    "cli": "apps.cli",
    "demo_report": "apps.demo_report",
    "demo": "apps.demo",
    "assets": "apps.assets",
    "inputs": "checks",
}
_DOCUMENTED = {"assets", "peft"}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import hf_fp8.<old name>`` with the module at its new path (the same module object, so
    ``isinstance`` checks and module state are shared), and ``python -m hf_fp8.<old name>`` with its
    code."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        package, _, name = fullname.rpartition(".")
        if package != __name__ or name not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        name = spec.name.rpartition(".")[2]
        new = f"{__name__}.{_MOVED[name]}"
        if name not in _DOCUMENTED:
            warnings.warn(
                f"{spec.name} is now {new}; the old path goes in a later release",
                DeprecationWarning,
                stacklevel=2,
            )
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        return None  # the module at its new path ran already

    def get_code(self, fullname: str) -> Any:
        new = f"{__name__}.{_MOVED[fullname.rpartition('.')[2]]}"
        return importlib.util.find_spec(new).loader.get_code(new)


sys.meta_path.append(_MovedModuleFinder())


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names load on first use
    from hf_fp8.apps import assets
    from hf_fp8.autocast import fp8_autocast
    from hf_fp8.backends.native import update_fp8_scales
    from hf_fp8.formats import E4M3, E5M2, cast_to_representable
    from hf_fp8.integrations import peft
    from hf_fp8.integrations.cast_watch import Fp8CastWarning, Fp8CastWatch
    from hf_fp8.integrations.checkpoint import load_fp8_state, save_fp8_state
    from hf_fp8.integrations.compiled import compile_model as compile
    from hf_fp8.integrations.fp8_checkpoint import save_fp8_pretrained
    from hf_fp8.integrations.guard import Fp8NanGuard
    from hf_fp8.integrations.loading import from_pretrained, load_fp8_pretrained
    from hf_fp8.integrations.prepare import prepare_fp8
    from hf_fp8.integrations.telemetry import Fp8Telemetry
    from hf_fp8.integrations.trainer import Fp8Trainer, Fp8TrainerCallback
    from hf_fp8.layers.linear import Fp8Conv1D, Fp8Linear, Fp8Module
    from hf_fp8.patching.padding import Fp8PaddingCollator
    from hf_fp8.patching.patch import is_patched, patch_model, plan_patch, unpatch_model
    from hf_fp8.recipe import RECIPES, Fp8Recipe
    from hf_fp8.report import PatchReport
