"""``patch_model``: turn any HF Transformers model into an FP8 model, in place, and back.

The walk visits every module once, parents first. :mod:`hf_fp8.layers.selection` decides what each module is
and whether it should convert; the backend (:mod:`hf_fp8.backends`) builds the replacement, or fuses
a whole block first when it knows how. Everything not converted is recorded in the
:class:`PatchReport` with the reason, and the walk always goes on with the siblings. If anything
fails, every replacement made so far is undone and the error names the module.

A patched model carries its state (:mod:`hf_fp8.patching.patch_state`) and hooks on its top-level forward
(:mod:`hf_fp8.patching.forward_hooks`): the backend's forward context and the FP8 step, which also ends
before any optimizer steps (:mod:`hf_fp8.patching.step`). :func:`unpatch_model` removes them and gives
back the original modules.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_fp8.backends.base import Fp8Backend, Replaced
from hf_fp8.backends.native import NativeBackend
from hf_fp8.backends.registry import (
    auto_backend,
    backend_class,
    backend_for_fsdp,
    backend_for_zero,
    is_fp8_module,
    plain_module,
)
from hf_fp8.checks import check_amax_group, check_model
from hf_fp8.layers.selection import ModelContext, matches, module_record
from hf_fp8.module_tree import get_path, replace_modules, set_path, walk_children
from hf_fp8.patching import forward_hooks
from hf_fp8.patching.default_recipe import resolve_recipe
from hf_fp8.patching.fsdp_first import SHARDED_FIRST, UNIT_KEPT, fsdp2_sharding
from hf_fp8.patching.patch_state import PatchState, get_state, set_state
from hf_fp8.patching.step import unwatch_optimizer_steps, watch_optimizer_steps
from hf_fp8.patching.tensor_parallel import check_layouts, install_layouts, tensor_parallel_layouts
from hf_fp8.patching.zero import gather_blocks_whole, zero_refusal, zero_stage
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import CONVERTED, KEPT, SKIPPED, ModuleRecord, PatchReport

__all__ = ["is_patched", "move_patch", "patch_model", "patch_or_recheck", "plan_patch", "unpatch_model"]

_NORM_KINDS = ("layernorm", "rmsnorm", "rmsnorm (1 + w)")

# ``module_filter_fn(module, fqn)``: whether a module the recipe would convert converts (torchao's
# convention for this hook).
ModuleFilter = Callable[[nn.Module, str], bool]
FILTERED = "module_filter_fn returned False"


def is_patched(model: nn.Module) -> bool:
    """Whether ``patch_model`` has been applied to ``model`` (and not undone)."""
    return get_state(model) is not None


def patch_model(
    model: nn.Module,
    recipe: Fp8Recipe | str | None = None,
    backend: str = "auto",
    fuse: bool = True,
    amax_group: Any = None,
    module_filter_fn: ModuleFilter | None = None,
) -> PatchReport:
    """Convert ``model`` to FP8 in place and return the report of what was converted.

    Args:
        model: any HF Transformers model (or plain ``nn.Module``), typically fresh from
            ``from_pretrained``, before its optimizer is created.
        recipe: how FP8 is used: an :class:`Fp8Recipe`, a recipe name, a YAML path or a dict of recipe
            keys. ``None``: the recipe in ``HF_FP8_RECIPE`` (set by ``hf-fp8 launch``) when that
            variable is set, else ``backward-fp8`` for weights loaded from a checkpoint and the
            :class:`Fp8Recipe` defaults for weights built from a config (see
            :mod:`hf_fp8.patching.default_recipe`; the report says which).
        backend: ``"native"`` (PyTorch FP8, CPU and GPU), ``"te"`` (Transformer Engine, FP8 GPUs) or
            ``"auto"`` (TE for a model on a GPU that supports FP8 when TE imports, else native).
        fuse: fuse whole blocks where the backend knows how (TE: Llama-family decoder blocks).
        amax_group: the data-parallel process group over which amaxes are reduced (one all-reduce a
            step); ``None`` uses the world group whenever ``torch.distributed`` is initialised.
        module_filter_fn: ``f(module, fqn) -> bool``, asked for each module the recipe would convert
            (by its dotted name in ``model``); ``False`` keeps it in high precision, and the report says
            so. Beside the recipe's ``modules_to_not_convert`` patterns, for what a pattern cannot say
            (a shape, a class). With a filter, no block is fused (TE): each layer converts on its own.

    On any error the model is restored to what it was and the error names the module. A model that is
    already patched keeps its patch (a different recipe or backend asked for is warned about).
    """
    check_model(model, "patch_model")
    check_amax_group(amax_group)
    _check_filter(module_filter_fn, "patch_model")
    asked = recipe
    recipe, chose = resolve_recipe(recipe, model, backend)
    sharding = fsdp2_sharding(model)  # a model FSDP2 sharded before patching (transformers' loading)
    units = sharding.units if sharding is not None else set()  # FSDP2's own units stay as they are
    state = get_state(model)
    if state is not None:
        _warn_if_repatched_differently(state, asked, recipe, backend)
        stage, _ = _check_zero(model, state.recipe, state.backend.name)  # patched before DeepSpeed showed
        report = _walk(model, state.backend, False, module_filter_fn=state.module_filter_fn, units=units)[0]
        if (gathered := gather_blocks_whole(model, stage)) is not None:  # the model may have changed (PEFT)
            report.notes.append(gathered)
        return report
    layouts = tensor_parallel_layouts(model, sharding)
    unmatched = _unmatched_patterns(model, recipe)
    if not recipe.enabled:  # reported as a plan, nothing converted
        report = _walk(model, NativeBackend(recipe), False, module_filter_fn=module_filter_fn, units=units)[0]
        report.backend = "none"
        return report
    stage, backend = _check_zero(model, recipe, backend)  # refuses before the model changes
    if sharding is not None:
        sharding.check(recipe)
        backend = backend_for_fsdp(backend)
    device = _device_of(model)
    chosen_class, passed_over = (
        auto_backend(device, recipe) if backend == "auto" else (backend_class(backend, device, recipe), [])
    )
    chosen = chosen_class(recipe)
    if layouts:
        planned = _walk(model, chosen, convert=False, module_filter_fn=module_filter_fn, units=units)[0]
        check_layouts(layouts, [r.name for r in planned.converted], chosen.name, recipe)
    fusing = fuse and module_filter_fn is None
    report, replaced, handles = _walk(model, chosen, True, fusing, module_filter_fn, units)
    if sharding is not None:
        report.notes.append(SHARDED_FIRST)
    if layouts:
        report.notes.append(
            "tensor parallelism: the sharded layers keep their column- and row-wise layouts and run their "
            "FP8 casts and GEMMs on their local shards; amaxes are reduced over the ranks at each step's end"
        )
    if unmatched:
        report.notes.append(unmatched)
    if chose is not None:
        report.notes.append(chose)
    if module_filter_fn is not None and fuse and chosen.fuses_blocks:
        report.notes.append("no block fused: a module_filter_fn decides layer by layer")
    report.notes += [f"backend auto chose {chosen.name} over {why}" for why in passed_over]
    if stage is not None:
        report.notes.append(
            f"DeepSpeed (ZeRO-{stage}): the FP8 layers run inside its engine, amaxes reduced over all ranks"
        )
    state = PatchState(
        recipe=recipe,
        backend=chosen,
        report=report,
        amax_group=amax_group,
        handles=handles,
        module_filter_fn=module_filter_fn,
    )
    try:
        install_layouts(layouts, {r.path: get_path(model, r.path) for r in replaced})
        state.handles += chosen.attach(model, replaced, report)
    except Exception:
        _undo(model, replaced, state.handles)
        raise
    set_state(model, state)
    state.handles += forward_hooks.install(model)
    watch_optimizer_steps(state)
    if (gathered := gather_blocks_whole(model, stage)) is not None:
        report.notes.append(gathered)
    return report


def patch_or_recheck(
    model: nn.Module, recipe: Fp8Recipe | str | None = None, backend: str = "auto"
) -> PatchReport:
    """:func:`patch_model` for a model that may be patched already (the Trainer callback, ``prepare_fp8``):
    then the patch is checked again (PEFT, DeepSpeed) and the report returned is the patch's, where a
    second ``patch_model`` reports that it converted nothing more; the check's notes are added to it."""
    state = get_state(model)
    report = patch_model(model, recipe, backend=backend)
    if state is None:
        return report
    for note in report.notes:
        state.report.add_note(note)
    return state.report


def plan_patch(
    model: nn.Module, recipe: Fp8Recipe | str | None = None, module_filter_fn: ModuleFilter | None = None
) -> PatchReport:
    """What :func:`patch_model` with the native backend would convert and skip, without touching the
    model (which may live on the meta device, as ``hf-fp8 inspect`` builds it)."""
    check_model(model, "plan_patch")
    _check_filter(module_filter_fn, "plan_patch")
    backend = NativeBackend(resolve_recipe(recipe, model, "native")[0])
    return _walk(model, backend, convert=False, module_filter_fn=module_filter_fn)[0]


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: the original module classes with the same weights (dequantized where
    they were stored in FP8), no hooks. Native layers give back their very parameters. FP8 layers
    made without ``patch_model`` are turned back too, where their backend can do that from the layer
    alone."""
    check_model(model, "unpatch_model")
    state = get_state(model)
    if state is None:
        replace_modules(model, plain_module)
        return model
    state.backend.unpatch(model, state.handles)
    unwatch_optimizer_steps(state)
    set_state(model, None)
    return model


def move_patch(source: nn.Module, target: nn.Module) -> None:
    """Hand the patch of ``source`` to ``target``, a module inside it that becomes the model (PEFT's
    ``merge_and_unload`` returns the base model of the PeftModel that was patched)."""
    state = get_state(source, own=True)
    if not state.backend.movable:
        raise NotImplementedError(
            f"a patch of the {state.backend.name} backend cannot move to another module"
        )
    for handle in state.handles:
        handle.remove()
    state.handles.clear()
    set_state(source, None)
    set_state(target, state)
    state.handles += forward_hooks.install(target)


# ---- the walk -------------------------------------------------------------------------------------


def _walk(
    model: nn.Module,
    backend: Fp8Backend,
    convert: bool,
    fuse: bool = False,
    module_filter_fn: ModuleFilter | None = None,
    units: set[int] | frozenset[int] = frozenset(),
) -> tuple[PatchReport, list[Replaced], list[RemovableHandle]]:
    """Report every module of ``model``; with ``convert``, replace those that convert (fusing blocks
    first when ``fuse``; ``module_filter_fn`` may keep any in high precision, and FSDP2's ``units``, by
    id, stay). Returns the report, what was replaced (in order) and the hooks fused blocks registered."""
    recipe = backend.recipe
    report = PatchReport(backend=backend.name, recipe=recipe, total_params=_count_params(model))
    context = ModelContext.of(model)
    replaced: list[Replaced] = []
    handles: list[RemovableHandle] = []
    done: dict[int, nn.Module] = {}  # id of a converted module -> its replacement
    seen: set[int] = set()
    name = ""

    def replace(path: str, new: nn.Module | None) -> None:
        replaced.append(Replaced(path, get_path(model, path)))
        set_path(model, path, new)

    try:
        if convert and fuse:
            for name, block in list(model.named_modules()):
                fused = backend.fuse(name, block)
                if fused is None:
                    continue
                handles += fused.handles
                report.records += fused.records
                for path, new in fused.replacements:
                    replace(f"{name}.{path}", new)
                    seen.update(id(m) for m in new.modules())
        for _, _, name, module in walk_children(model):
            if id(module) in done:  # a module shared by two parents: convert once, keep it shared
                if convert:
                    replace(name, done[id(module)])
                continue
            if id(module) in seen:
                continue
            seen.add(id(module))
            unit = id(module) in units
            record, new = _decide(name, module, backend, context, convert, module_filter_fn, unit)
            if record is not None:
                report.records.append(record)
            if new is not None:
                replace(name, new)
                done[id(module)] = new
                seen.update(id(m) for m in new.modules())
    except Exception as err:
        _undo(model, replaced, handles)
        raise RuntimeError(
            f"patch_model failed at module {name!r} ({type(err).__name__}: {err}); the model was restored "
            "unchanged"
        ) from err
    return report, replaced, handles


def _decide(
    name: str,
    module: nn.Module,
    backend: Fp8Backend,
    context: ModelContext,
    convert: bool,
    module_filter_fn: ModuleFilter | None = None,
    fsdp2_unit: bool = False,
) -> tuple[ModuleRecord | None, nn.Module | None]:
    """The report entry for ``module`` and its FP8 replacement (``None`` if it stays)."""
    fp8 = is_fp8_module(module)
    record = module_record(name, module, backend.recipe, context, fp8)
    if record is None or record.action != CONVERTED:
        return record, None
    if record.kind == "experts" and backend.keeps_experts is not None:
        return _with(record, SKIPPED, backend.keeps_experts), None
    norm = record.kind in _NORM_KINDS
    if norm and backend.keeps_norms is not None:
        return _with(record, KEPT, backend.keeps_norms), None
    if module_filter_fn is not None and not fp8 and not module_filter_fn(module, name):
        return _with(record, KEPT if norm else SKIPPED, FILTERED), None
    if fsdp2_unit:
        return _with(record, KEPT if norm else SKIPPED, UNIT_KEPT), None
    if record.kind == "experts":
        return record, backend.convert_experts(module) if convert else None
    if not norm:
        return record, backend.convert_linear(module, record.forward_in_fp8) if convert else None
    if not convert:
        return _with(record, KEPT, "norm: kept in high precision"), None
    new, reason = backend.convert_norm(module, record.kind)
    return _with(record, CONVERTED if new is not None else KEPT, reason), new


def _with(record: ModuleRecord, action: str, reason: str) -> ModuleRecord:
    return dataclasses.replace(record, action=action, reason=reason)


def _check_filter(module_filter_fn: Any, caller: str) -> None:
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(
            f"{caller}: module_filter_fn must be a function (module, fqn) -> bool, got "
            f"{type(module_filter_fn).__name__}"
        )


def _undo(model: nn.Module, replaced: list[Replaced], handles: list[RemovableHandle]) -> None:
    """Put back what the walk replaced, newest first, and remove the hooks it registered."""
    for entry in reversed(replaced):
        set_path(model, entry.path, entry.original)
    for handle in handles:
        handle.remove()


def _check_zero(model: nn.Module, recipe: Fp8Recipe, backend: str) -> tuple[int | None, str]:
    """The ZeRO stage the model will train under (``None``: no DeepSpeed shows) and the backend to patch
    with there; raises where ZeRO cannot honour the recipe or the backend."""
    stage = zero_stage(model)
    if stage is None:
        return None, backend
    if (refusal := zero_refusal(recipe, stage)) is not None:
        raise ValueError(f"hf_fp8: {refusal}")
    return stage, backend_for_zero(backend)


def _warn_if_repatched_differently(state: PatchState, asked: Any, recipe: Fp8Recipe, backend: str) -> None:
    differences = []
    if asked is not None and recipe != state.recipe:
        differences.append("another recipe")
    if backend not in ("auto", state.backend.name):
        differences.append(f"backend {backend!r} (it has {state.backend.name!r})")
    if differences:
        warnings.warn(
            f"hf_fp8: the model is already patched; {' and '.join(differences)} asked for now are not "
            "applied and the model keeps its patch. Call hf_fp8.unpatch_model(model) first to patch it anew",
            stacklevel=3,
        )


def _unmatched_patterns(model: nn.Module, recipe: Fp8Recipe) -> str | None:
    """A note, also warned, about ``modules_to_not_convert`` patterns that match no module (typos)."""
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [p for p in recipe.modules_to_not_convert if not any(matches(n, p) for n in names)]
    if not unmatched:
        return None
    example = names[len(names) // 2] if names else "(the model has no submodules)"
    note = (
        f"modules_to_not_convert pattern(s) {unmatched} match no module of {type(model).__name__}; check the "
        f"spelling (module names look like {example!r}; a pattern also matches a suffix of a name)"
    )
    warnings.warn(f"hf_fp8: {note}", stacklevel=3)
    return note


def _device_of(model: nn.Module) -> torch.device:
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def _count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
