"""The FP8 backends, chosen by name or by what the machine can run, and the one walk over the FP8
layers of a model and their scaling state, whichever backend made them.

A backend is a subclass of :class:`~hf_fp8.backends.base.Fp8Backend` in a file of its own, listed in
``BACKENDS`` below; ``backend="auto"`` takes the first one, in this order, that is usable for the model
and can carry out the recipe.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from hf_fp8.backends.base import Fp8Backend
from hf_fp8.backends.native import NativeBackend
from hf_fp8.backends.te import TeBackend
from hf_fp8.layers.layer_scaling import LayerScaling
from hf_fp8.recipe import Fp8Recipe

__all__ = [
    "BACKENDS",
    "auto_backend",
    "backend_class",
    "backend_for_data_parallel",
    "backend_for_fsdp",
    "backend_for_zero",
    "fp8_layers",
    "is_fp8_module",
    "plain_module",
]

# Preference order for backend="auto".
BACKENDS: dict[str, type[Fp8Backend]] = {cls.name: cls for cls in (TeBackend, NativeBackend)}


def backend_class(name: str, device: torch.device, recipe: Fp8Recipe) -> type[Fp8Backend]:
    """The backend called ``name`` (``"auto"``: see :func:`auto_backend`), after it checked that it can
    carry out ``recipe`` here; raises with the reason and the way out."""
    if name == "auto":
        return auto_backend(device, recipe)[0]
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {['auto', *BACKENDS]}")
    chosen = BACKENDS[name]
    chosen.check(recipe)
    return chosen


def auto_backend(device: torch.device, recipe: Fp8Recipe) -> tuple[type[Fp8Backend], list[str]]:
    """The first backend, in preference order, that is usable for a model on ``device`` and can carry
    out ``recipe``, and why each preferred one before it could not run the recipe."""
    passed_over = []
    for name, cls in BACKENDS.items():
        if not cls.usable(device)[0]:
            continue
        try:
            cls.check(recipe)
        except ValueError as refusal:
            passed_over.append(f"{name}: {refusal}")
            continue
        return cls, passed_over
    raise ValueError(f"no backend can carry out this recipe here ({'; '.join(passed_over)})")


def backend_for_fsdp(name: str) -> str:
    """The backend to patch a model with that FSDP will shard: ``auto`` is the first backend that trains
    sharded; a named one that does not is refused with its reason, before anything changes."""
    return _backend_without(name, "fsdp_problem", "under FSDP", "a model that will be sharded")


def backend_for_data_parallel(name: str) -> str:
    """The backend to patch a model with that nn.DataParallel will replicate (Trainer on several GPUs,
    started without a launcher), chosen or refused as :func:`backend_for_fsdp` does."""
    return _backend_without(
        name, "data_parallel_problem", "under nn.DataParallel", "a model that nn.DataParallel will replicate"
    )


def backend_for_zero(name: str) -> str:
    """The backend to patch a model with that DeepSpeed ZeRO will train, chosen or refused as
    :func:`backend_for_fsdp` does."""
    return _backend_without(name, "zero_problem", "under DeepSpeed ZeRO", "a model that ZeRO will train")


def _backend_without(name: str, problem: str, where: str, model: str) -> str:
    """``name``, or for ``auto`` the first backend, whose ``problem`` attribute is ``None``."""
    fits = [n for n, cls in BACKENDS.items() if getattr(cls, problem) is None]
    if name == "auto":
        return fits[0]
    chosen = BACKENDS.get(name)
    if chosen is not None and getattr(chosen, problem) is not None:
        raise ValueError(
            f"the {name} backend is not supported {where}: {getattr(chosen, problem)}; use "
            f"backend={fits[0]!r} (what 'auto' picks for {model})"
        )
    return name


def fp8_layers(model: nn.Module) -> Iterator[LayerScaling]:
    """Every FP8 layer of ``model`` that has scaling state, with that state, in module order."""
    for name, module in model.named_modules():
        for cls in BACKENDS.values():
            state = cls.layer_scaling(name, module)
            if state is not None:
                yield state
                break


def is_fp8_module(module: nn.Module) -> bool:
    """Whether ``module`` already belongs to an FP8 backend."""
    return any(cls.owns(module) for cls in BACKENDS.values())


def plain_module(module: nn.Module) -> nn.Module | None:
    """The plain module an FP8 module came from, where its backend can rebuild it from it alone."""
    return next((p for cls in BACKENDS.values() if (p := cls.to_plain(module)) is not None), None)
