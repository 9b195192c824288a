"""``patch_model``: turn any HF Transformers model into an FP8 model, in place, and back.

The walk replaces every ``nn.Linear`` and transformers ``Conv1D`` it can with the backend's FP8
layer; the native backend shares the original parameters (same objects: optimizers, tied weights and
``state_dict`` keys are untouched), Transformer Engine's modules get exact copies and keep HF's keys
through state-dict hooks. With Transformer Engine, norms become TE norms and Llama-family decoder
blocks are fused (see :mod:`hf_fp8.backends.te`). Everything not converted is recorded in the
:class:`PatchReport` with the reason, and the walk always goes on with the siblings.

It also registers forward hooks on the top-level model (removed by :func:`unpatch_model`):

* before the forward, in training: pad the batch's token dimension to a multiple of 16 and enter
  ``te.autocast`` (TE backend);
* after the forward, always: leave ``te.autocast`` (so the backward runs outside it, TE's rule),
  slice per-token outputs back to the caller's length, and (native backend, training) hook the
  outputs so that the FP8 step ends when their backward has finished (see
  :func:`hf_fp8.update_fp8_scales` for what ending a step does).

Hooks are PyTorch's own extension point, so nothing of the model's class or ``forward`` is replaced.
"""

from __future__ import annotations

import copy
import fnmatch
import inspect
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.pytorch_utils import Conv1D

from hf_fp8.autocast import fp8_active
from hf_fp8.backends import te as te_backend
from hf_fp8.backends.native import Fp8Conv1D, Fp8Linear, _Fp8Module, end_fp8_step
from hf_fp8.distributed import default_amax_group
from hf_fp8.formats import FP8_ALIGNMENT
from hf_fp8.norms import norm_kind
from hf_fp8.padding import PaddedLengths, pad_batch, unpad_outputs
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import CONVERTED, KEPT, SKIPPED, ModuleRecord, PatchReport

__all__ = ["is_patched", "patch_model", "plan_patch", "unpatch_model"]

_STATE_ATTR = "_hf_fp8_state"
_BACKENDS = ("auto", "native", "te")
_ROUTER_NAMES = ("gate", "router")
_ADAPTER_NAMES = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


@dataclass
class _PatchState:
    """What a patched model carries: its recipe, backend, report, hooks and step bookkeeping."""

    recipe: Fp8Recipe
    backend: str
    report: PatchReport | None = None
    handles: list[RemovableHandle] = field(default_factory=list)
    # Native backend: its FP8 layers, whose scales each training step updates.
    fp8_modules: list[nn.Module] = field(default_factory=list)
    # TE backend: what stood where a module was replaced, to unpatch (see _Original).
    originals: list[_Original] = field(default_factory=list)
    # TE backend: the recipe object handed to te.autocast.
    te_recipe: Any = None
    # Data-parallel group whose ranks share amaxes; None: the world group when distributed.
    amax_group: Any = None
    # Native fp8_weights: FP8 layers whose weight is not stored in FP8 yet (it is while trainable).
    unquantized: list[nn.Module] = field(default_factory=list)
    # A training forward ran in FP8 since the last scale update.
    step_pending: bool = False
    # One entry per forward in flight: its padding, whether FP8 ran, the te.autocast it entered.
    calls: list[_Call] = field(default_factory=list)


@dataclass
class _Original:
    """A replaced module, kept as a meta-device copy (its class and configuration, no memory), with the
    names of the parameters its replacement shares (the same objects, handed back on unpatch)."""

    path: str
    skeleton: nn.Module | None
    shared: tuple[str, ...] = ()
    device: torch.device | None = None


@dataclass
class _Call:
    padded: PaddedLengths
    fp8: bool
    autocast: Any = None


def is_patched(model: nn.Module) -> bool:
    """Whether ``patch_model`` has been applied to ``model`` (and not undone)."""
    return hasattr(model, _STATE_ATTR)


def patch_model(
    model: nn.Module,
    recipe: Fp8Recipe | None = None,
    backend: str = "auto",
    fuse: bool = True,
    amax_group: Any = None,
) -> PatchReport:
    """Convert ``model`` to FP8 in place and return the report of what was converted.

    Args:
        model: any HF Transformers model (or plain ``nn.Module``), typically fresh from
            ``from_pretrained``, before its optimizer is created.
        recipe: how FP8 is used. ``None``: the recipe in ``HF_FP8_RECIPE`` (set by ``hf-fp8 launch``)
            when that variable is set, else :class:`Fp8Recipe` defaults.
        backend: ``"native"`` (PyTorch FP8, CPU and GPU), ``"te"`` (Transformer Engine, FP8 GPUs) or
            ``"auto"`` (TE for a model on a GPU that supports FP8 when TE imports, else native).
        fuse: with TE, fuse Llama-family decoder blocks (norm + q/k/v, norm + SwiGLU MLP).
        amax_group: the data-parallel process group over which amaxes are reduced (one all-reduce a
            step); ``None`` uses the world group whenever ``torch.distributed`` is initialised.

    On any error the model is restored to what it was and the error names the module.
    """
    recipe = recipe or Fp8Recipe.from_launcher()
    if is_patched(model):
        state: _PatchState = getattr(model, _STATE_ATTR)
        return _walk(model, state.recipe, state.backend, convert=False)
    if not recipe.enabled:
        return _walk(model, recipe, "none", convert=False)
    backend = _resolve_backend(backend, recipe, model)
    state = _PatchState(recipe=recipe, backend=backend, amax_group=amax_group)
    if backend == "te":  # also refuses what TE cannot do, before the model is touched
        state.te_recipe = te_backend.to_te_recipe(recipe)
    state.report = _walk(model, recipe, backend, convert=True, fuse=fuse, state=state)
    if backend == "native":
        state.fp8_modules = [m for m in model.modules() if isinstance(m, _Fp8Module)]
        _keep_fp8_state_out_of_ddp_broadcast(model)
        if recipe.fp8_weights:
            # A weight another module also uses (tied embeddings) must keep its dtype for that module.
            shared = {
                id(p) for m in model.modules() if not isinstance(m, _Fp8Module) for p in m.parameters(False)
            }
            tied = [m for m in state.fp8_modules if id(m.weight) in shared]
            state.unquantized = [m for m in state.fp8_modules if id(m.weight) not in shared]
            _quantize_frozen_weights(state)
            state.report.notes.append(
                "fp8_weights: frozen weights are stored in FP8 (now, or at the first forward after they are "
                "frozen, e.g. by PEFT); trainable weights keep their dtype"
            )
            if tied:
                state.report.notes.append(
                    f"fp8_weights: {len(tied)} weight(s) tied to another module (e.g. the input embeddings) "
                    "keep their dtype"
                )
    setattr(model, _STATE_ATTR, state)
    if backend == "te":
        state.handles += te_backend.install_state_dict_hooks(model)
    _hook_forward(model, state)
    return state.report


def _hook_forward(model: nn.Module, state: _PatchState) -> None:
    state.handles.append(model.register_forward_pre_hook(_before_forward, with_kwargs=True))
    state.handles.append(model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True))


def _move_patch(source: nn.Module, target: nn.Module) -> None:
    """Hand a native patch from ``source`` to ``target``, a module inside it that becomes the model
    (PEFT's ``merge_and_unload`` returns the base model of the PeftModel that was patched)."""
    state: _PatchState = getattr(source, _STATE_ATTR)
    if state.backend != "native":
        raise NotImplementedError("only a native-backend patch can move to another module")
    for handle in state.handles:
        handle.remove()
    state.handles.clear()
    delattr(source, _STATE_ATTR)
    setattr(target, _STATE_ATTR, state)
    _hook_forward(target, state)


def plan_patch(model: nn.Module, recipe: Fp8Recipe | None = None) -> PatchReport:
    """What :func:`patch_model` with the native backend would convert and skip, without touching the
    model (which may live on the meta device, as ``hf-fp8 inspect`` builds it)."""
    return _walk(model, recipe or Fp8Recipe.from_launcher(), "native", convert=False)


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: the original module classes with the same weights (dequantized where
    they were stored in FP8), no hooks. Native layers give back their very parameters."""
    state: _PatchState | None = getattr(model, _STATE_ATTR, None)
    if state is not None and state.backend == "te":
        _unpatch_te(model, state)
        return model
    replaced: dict[int, nn.Module] = {}
    for parent, child_name, _, module in _children(model):
        if isinstance(module, _Fp8Module):
            if id(module) not in replaced:
                replaced[id(module)] = _to_plain(module)
            setattr(parent, child_name, replaced[id(module)])
    if state is not None:
        for handle in state.handles:
            handle.remove()
        delattr(model, _STATE_ATTR)
    return model


def _set_recipe(model: nn.Module, recipe: Fp8Recipe) -> None:
    """Switch a patched model to ``recipe`` (same format and history length; the NaN guard raises the
    margin this way, and a resumed run takes the checkpoint's margin)."""
    state: _PatchState = getattr(model, _STATE_ATTR)
    state.recipe = recipe
    for module in state.fp8_modules:
        module.recipe = recipe
    if state.backend == "te":
        state.te_recipe = te_backend.to_te_recipe(recipe)


def _end_pending_step(model: nn.Module) -> None:
    """End a step still pending (one whose end could not be hooked) now: the Trainer callback calls
    this at each optimizer step, so the state it checks, logs and saves is the step boundary's."""
    _close_step(getattr(model, _STATE_ATTR))


def _unpatch_te(model: nn.Module, state: _PatchState) -> None:
    """Put the original modules back, each on its replacement's device, with the weights in HF's keys
    and layouts (through the TE backend's hooks). Shared parameters are handed back as they are."""
    state_dict = model.state_dict()
    for handle in state.handles:
        handle.remove()
    restored: dict[int, nn.Module] = {}
    for original in reversed(state.originals):
        current = _get_path(model, original.path)
        if original.skeleton is None:
            _set_path(model, original.path, None)
            continue
        module = restored.get(id(original.skeleton))
        if module is None:
            module = original.skeleton.to_empty(device=original.device)
            for name in original.shared:
                setattr(module, name, getattr(current, name))
            restored[id(original.skeleton)] = module
        _set_path(model, original.path, module)
    model.load_state_dict(state_dict, strict=True)  # every restored weight must come back
    delattr(model, _STATE_ATTR)


# ---- the walk -------------------------------------------------------------------------------------


def _walk(
    model: nn.Module,
    recipe: Fp8Recipe,
    backend: str,
    convert: bool,
    fuse: bool = False,
    state: _PatchState | None = None,
) -> PatchReport:
    report = PatchReport(backend=backend, recipe=recipe, total_params=_count_params(model))
    context = _ModelContext.of(model)
    journal: list[tuple[str, nn.Module | None]] = []  # (path, what stood there), to roll back
    done: dict[int, nn.Module] = {}
    seen: set[int] = set()
    name = ""

    def replace(path: str, new: nn.Module | None) -> None:
        journal.append((path, _get_path(model, path)))
        _set_path(model, path, new)

    try:
        if convert and backend == "te" and fuse:
            for name, layer in list(model.named_modules()):
                if te_backend.fusable(layer) and _fusion_allowed(name, recipe):
                    records, new_modules = _fuse(name, layer, recipe, replace, state)
                    report.records += records
                    seen.update(id(m) for new in new_modules for m in new.modules())
        for _, _, name, module in _children(model):
            if id(module) in done:  # a module shared by two parents: convert once, keep it shared
                if convert:
                    replace(name, done[id(module)])
                continue
            if id(module) in seen:
                continue
            seen.add(id(module))
            record, replacement = _decide(name, module, recipe, backend, context, convert)
            if record is not None:
                report.records.append(record)
            if replacement is not None:
                replace(name, replacement)
                done[id(module)] = replacement
                seen.update(id(m) for m in replacement.modules())
    except Exception as err:
        for path, original in reversed(journal):
            _set_path(model, path, original)
        if state is not None:
            for handle in state.handles:
                handle.remove()
        raise RuntimeError(
            f"patch_model failed at module {name!r} ({type(err).__name__}: {err}); the model was restored "
            "unchanged"
        ) from err
    if state is not None:
        skeletons: dict[int, nn.Module] = {}
        for path, original in journal:
            if original is None:
                state.originals.append(_Original(path, None))
                continue
            current = _get_path(model, path)
            shared = tuple(
                name
                for name, p in original.named_parameters(recurse=False)
                if getattr(current, name, None) is p
            )
            skeleton = skeletons.setdefault(id(original), _skeleton(original))
            device = next(itertools.chain(original.parameters(), original.buffers()), torch.empty(0)).device
            state.originals.append(_Original(path, skeleton, shared, device))
    return report


_FUSED_MEMBERS = {
    "input_layernorm": ("rmsnorm", "fused into te.LayerNormLinear with q/k/v"),
    "self_attn.q_proj": ("linear", "fused into te.LayerNormLinear (input_layernorm + q/k/v)"),
    "self_attn.k_proj": ("linear", "fused into te.LayerNormLinear (input_layernorm + q/k/v)"),
    "self_attn.v_proj": ("linear", "fused into te.LayerNormLinear (input_layernorm + q/k/v)"),
    "post_attention_layernorm": ("rmsnorm", "fused into te.LayerNormMLP with the MLP"),
    "mlp.gate_proj": ("linear", "fused into te.LayerNormMLP (post_attention_layernorm + SwiGLU MLP)"),
    "mlp.up_proj": ("linear", "fused into te.LayerNormMLP (post_attention_layernorm + SwiGLU MLP)"),
    "mlp.down_proj": ("linear", "fused into te.LayerNormMLP (post_attention_layernorm + SwiGLU MLP)"),
}


def _fuse(
    name: str, layer: nn.Module, recipe: Fp8Recipe, replace, state: _PatchState | None
) -> list[ModuleRecord]:
    """Fuse one Llama-family block with TE and return the report entries of the HF modules it covers."""
    records = []
    for member, (kind, reason) in _FUSED_MEMBERS.items():
        module = _get_path(layer, member)
        flops = module.in_features * module.out_features if kind == "linear" else 0
        records.append(_record(f"{name}.{member}", module, kind, CONVERTED, reason, flops))
    replacements, hooks = te_backend.fuse_block(layer, recipe)
    for path, new in replacements:
        replace(f"{name}.{path}", new)
    if state is not None:
        state.handles += hooks
    return records, [new for _, new in replacements]


def _fusion_allowed(name: str, recipe: Fp8Recipe) -> bool:
    """No member of the block is excluded by ``modules_to_not_convert``."""
    members = [f"{name}.{member}" for member in _FUSED_MEMBERS]
    return not any(_matches(m, p) for m in members for p in recipe.modules_to_not_convert)


@dataclass
class _ModelContext:
    """Facts about the whole model that decisions about single modules need."""

    tied_weights: set[int]
    output_head: nn.Module | None
    num_experts: int | None
    experts_per_token: int | None

    @classmethod
    def of(cls, model: nn.Module) -> _ModelContext:
        tied: set[int] = set()
        inputs = _call_or_none(model, "get_input_embeddings")
        if inputs is not None and getattr(inputs, "weight", None) is not None:
            tied.add(id(inputs.weight))
        config = getattr(model, "config", None)
        num_experts = next(
            (
                getattr(config, key)
                for key in ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
                if isinstance(getattr(config, key, None), int)
            ),
            None,
        )
        top_k = getattr(config, "num_experts_per_tok", None)
        return cls(tied, _call_or_none(model, "get_output_embeddings"), num_experts, top_k)


def _decide(
    name: str, module: nn.Module, recipe: Fp8Recipe, backend: str, context: _ModelContext, convert: bool
) -> tuple[ModuleRecord | None, nn.Module | None]:
    """The report entry for ``module`` and its FP8 replacement (``None`` if it stays)."""
    if isinstance(module, (nn.Linear, Conv1D)):
        record = _linear_record(name, module, recipe, context)
        if record.action == CONVERTED and convert:
            return record, _to_fp8(module, recipe, backend)
        if record.action == CONVERTED and not recipe.enabled:
            record = _replace_record(record, SKIPPED, "FP8 disabled by the recipe (enabled: false)")
        return record, None
    if te_backend.is_te_module(module):
        return _record(name, module, "te", SKIPPED, _ALREADY_FP8, gemm_flops=0), None
    norm = norm_kind(module)
    if norm is not None:
        if backend == "te" and convert and not any(_matches(name, p) for p in recipe.modules_to_not_convert):
            new = te_backend.convert_norm(module, norm)
            if new is not None:
                return _record(name, module, norm, CONVERTED, f"te.{type(new).__name__}", gemm_flops=0), new
            reason = "norm: no Transformer Engine equivalent (no affine weight, or no bias); kept as it is"
        elif backend == "te":
            reason = "norm: kept in high precision"
        else:
            reason = "norm: not a GEMM; the native backend keeps norms in high precision"
        return _record(name, module, norm, KEPT, reason, gemm_flops=0), None
    weights = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    if weights and not isinstance(module, nn.Embedding):
        return _other_weights_record(name, module, weights, context), None
    return None, None


_ALREADY_FP8 = "already FP8 (patched before; unpatch_model first to change the recipe)"


def _linear_record(name: str, module: nn.Module, recipe: Fp8Recipe, context: _ModelContext) -> ModuleRecord:
    in_features, out_features = _gemm_shape(module)
    kind = "conv1d" if isinstance(module, Conv1D) else "linear"
    flops = in_features * out_features

    def result(action: str, reason: str = "") -> ModuleRecord:
        return _record(name, module, kind, action, reason, gemm_flops=flops)

    if isinstance(module, _Fp8Module):
        return result(SKIPPED, _ALREADY_FP8)
    if type(module) not in (nn.Linear, Conv1D):
        return result(SKIPPED, f"subclass of {_base_name(module)} with its own behaviour: not converted")
    if _is_adapter(name):
        return result(SKIPPED, "PEFT adapter weight: adapters train in high precision")
    pattern = next((p for p in recipe.modules_to_not_convert if _matches(name, p)), None)
    if pattern is not None:
        return result(SKIPPED, f"matches modules_to_not_convert pattern {pattern!r}")
    if not recipe.convert_lm_head:
        if id(module.weight) in context.tied_weights:
            return result(
                SKIPPED, "weight tied to the input embeddings (set convert_lm_head: true to convert)"
            )
        if module is context.output_head:
            return result(SKIPPED, "output head (set convert_lm_head: true to convert)")
    if _is_router(name, out_features, context):
        return result(SKIPPED, f"MoE router ({out_features} outputs): routing stays in high precision")
    if in_features % FP8_ALIGNMENT or out_features % FP8_ALIGNMENT:
        dims = f"in_features={in_features}, out_features={out_features}"
        return result(SKIPPED, f"{dims}: FP8 GEMMs need multiples of {FP8_ALIGNMENT}")
    return result(CONVERTED)


def _base_name(module: nn.Module) -> str:
    return "Conv1D" if isinstance(module, Conv1D) else "nn.Linear"


def _other_weights_record(
    name: str, module: nn.Module, weights: list, context: _ModelContext
) -> ModuleRecord:
    """A module owning matrix weights that is neither a linear layer nor a norm (MoE experts, routers)."""
    params = sum(p.numel() for p in weights)
    class_name = type(module).__name__
    if "router" in class_name.lower() or name.rsplit(".", 1)[-1] in _ROUTER_NAMES:
        return _record(name, module, "router", SKIPPED, "MoE router: routing stays in high precision", params)
    num_experts = getattr(module, "num_experts", None) or context.num_experts
    if num_experts and context.experts_per_token and any(p.dim() == 3 for p in weights):
        flops = params * context.experts_per_token // num_experts
        reason = "MoE experts stored as 3-D weights (grouped GEMM): no FP8 kernel yet, kept in high precision"
    else:
        flops = params
        reason = (
            f"{class_name} computes with its own matrix weights: not an nn.Linear, kept in high precision"
        )
    return _record(name, module, "other", SKIPPED, reason, flops)


def _record(
    name: str, module: nn.Module, kind: str, action: str, reason: str, gemm_flops: int
) -> ModuleRecord:
    params = sum(p.numel() for p in module.parameters(recurse=False))
    return ModuleRecord(name, type(module).__name__, kind, action, reason, params, gemm_flops)


def _replace_record(record: ModuleRecord, action: str, reason: str) -> ModuleRecord:
    return ModuleRecord(
        record.name, record.class_name, record.kind, action, reason, record.params, record.gemm_flops
    )


def _is_router(name: str, out_features: int, context: _ModelContext) -> bool:
    if context.num_experts is None:
        return False
    return name.rsplit(".", 1)[-1] in _ROUTER_NAMES or out_features == context.num_experts


def _is_adapter(name: str) -> bool:
    # PEFT keeps adapters in ModuleDicts named lora_A, lora_B, ... inside each tuner layer.
    return any(part in _ADAPTER_NAMES for part in name.split("."))


def _matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*.{pattern}")


# ---- module conversion ----------------------------------------------------------------------------


def _to_fp8(module: nn.Module, recipe: Fp8Recipe, backend: str) -> nn.Module:
    if backend == "te":
        return te_backend.convert_linear(module, recipe)
    if isinstance(module, Conv1D):
        return Fp8Conv1D.from_float(module, recipe)
    return Fp8Linear.from_float(module, recipe)


@torch._dynamo.disable  # it replaces parameters: run eagerly, and let a compiled model re-trace once
def _quantize_frozen_weights(state: _PatchState) -> None:
    """Store the weights that are frozen by now in FP8 (native ``fp8_weights``)."""
    for module in [m for m in state.unquantized if not m.weight.requires_grad]:
        module.quantize_weight_()
        state.unquantized.remove(module)


def _to_plain(module: _Fp8Module) -> nn.Module:
    with torch.device("meta"):
        if isinstance(module, Fp8Conv1D):
            plain: nn.Module = Conv1D(module.nf, module.nx)
        else:
            plain = nn.Linear(module.in_features, module.out_features, bias=False)
    module.dequantize_weight_()  # a weight stored in FP8 comes back in its original dtype
    plain.weight = module.weight
    plain.bias = module.bias
    plain.train(module.training)
    return plain


def _gemm_shape(module: nn.Module) -> tuple[int, int]:
    if isinstance(module, Conv1D):
        return module.nx, module.nf
    return module.in_features, module.out_features


def _keep_fp8_state_out_of_ddp_broadcast(model: nn.Module) -> None:
    """DDP copies rank 0's buffers to every rank before each forward. The FP8 layers' amax histories
    are buffers that must keep each rank's own newest amaxes until they are reduced together, so they
    are put on DDP's ignore list (its extension point for this; the model is not wrapped yet)."""
    fp8_buffers = [
        name
        for name, buffer in model.named_buffers()
        if name.rsplit(".", 1)[-1] in ("amax_history", "scale", "fp8_steps")
    ]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ignored + [n for n in fp8_buffers if n not in ignored]
    )


def _resolve_backend(backend: str, recipe: Fp8Recipe, model: nn.Module) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(_BACKENDS)}")
    if backend == "auto":  # TE for a model on an FP8 GPU with TE installed, else native
        on_cuda = any(p.is_cuda for p in itertools.islice(model.parameters(), 1))
        backend = "te" if on_cuda and te_backend.te_usable()[0] else "native"
    if backend == "te":
        te_backend.load_te()  # raises with the reason and the way out
    elif recipe.scaling == "block":
        raise ValueError("scaling 'block' (Float8BlockScaling) needs Transformer Engine: use backend='te'")
    return backend


def _skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device: its class and
    configuration without its memory, to rebuild it on unpatch."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        )
    return copy.deepcopy(module, memo)


def _get_path(root: nn.Module, path: str) -> nn.Module | None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    return getattr(parent, attr, None)


def _set_path(root: nn.Module, path: str, module: nn.Module | None) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    if module is None:
        if hasattr(parent, attr):
            delattr(parent, attr)
    else:
        setattr(parent, attr, module)


# ---- forward hooks --------------------------------------------------------------------------------


# Inputs of incremental decoding (generate()): padding would put pad tokens where the next token's
# logits are read, and into the KV cache.
_DECODING_INPUTS = ("past_key_values", "cache_position", "logits_to_keep")


def _before_forward(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state: _PatchState = getattr(model, _STATE_ATTR)
    recipe = state.recipe
    call = _Call(PaddedLengths({}), fp8=fp8_active(model.training, recipe.use_during_eval))
    state.calls.append(call)
    group = state.amax_group or default_amax_group()
    if state.backend == "te":
        if call.fp8 and model.training and _recomputes_activations(model):
            raise RuntimeError(
                "hf_fp8: gradient checkpointing with the Transformer Engine backend would recompute layers "
                "outside te.autocast, in another precision; disable it or use backend='native'"
            )
        # The whole forward runs inside te.autocast; _after_forward leaves it, so backward is outside.
        call.autocast = te_backend.autocast(state.te_recipe, enabled=call.fp8, group=group)
        call.autocast.__enter__()
    if state.unquantized:
        _quantize_frozen_weights(state)
    if not call.fp8:
        return None
    if model.training and state.step_pending:  # a step whose end could not be hooked
        _close_step(state)
    batch = _as_kwargs(model, args, kwargs)
    config = getattr(model, "config", None)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if batch is None or any(batch.get(k) is not None for k in _DECODING_INPUTS):
        return None
    if encoder_decoder and not batch.get("return_dict", getattr(config, "use_return_dict", True)):
        return None  # tuple outputs of two streams cannot be told apart to slice them back
    batch, call.padded = pad_batch(batch, recipe.pad_to_multiple, _pad_token_id(config), encoder_decoder)
    return (), batch


def _after_forward(model: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> Any:
    state: _PatchState = getattr(model, _STATE_ATTR)
    call = state.calls.pop()
    if call.autocast is not None:
        call.autocast.__exit__(None, None, None)
    if call.fp8 and model.training and torch.is_grad_enabled():
        _end_step_after_backward(state, outputs)
    return unpad_outputs(outputs, call.padded) if outputs is not None else outputs


@torch._dynamo.disable
def _end_step_after_backward(state: _PatchState, outputs: Any) -> None:
    """A step ends when a backward through this forward's outputs has finished: the autograd engine
    then runs :func:`_close_step` (amaxes reduced over the ranks, scales updated, histories rolled),
    before the optimizer step and before DDP's next buffer broadcast. Two forwards before one backward
    (DPO, contrastive losses) are one step, and a forward whose outputs never see a backward (logging,
    a reference pass) is none."""
    tensor = _first_tensor_needing_grad(outputs)
    if tensor is None:  # nothing to hook: the forward itself counts, closed at the next one
        state.step_pending = True
        return

    def backward_reached(grad: torch.Tensor) -> None:
        state.step_pending = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _close_step(state))

    tensor.register_hook(backward_reached)


@torch.no_grad()
def _close_step(state: _PatchState) -> None:
    """End the pending FP8 step (native backend; TE ends its own inside ``te.autocast``)."""
    if state.step_pending and state.backend == "native":
        end_fp8_step(state.fp8_modules, state.amax_group or default_amax_group())
    state.step_pending = False


def _first_tensor_needing_grad(outputs: Any) -> torch.Tensor | None:
    if isinstance(outputs, Mapping):
        values = [outputs["loss"]] if outputs.get("loss") is not None else list(outputs.values())
    elif isinstance(outputs, (tuple, list)):
        values = list(outputs)
    else:
        values = [outputs]
    for value in values:
        if torch.is_tensor(value) and value.requires_grad:
            return value
        if isinstance(value, (tuple, list, Mapping)):
            found = _first_tensor_needing_grad(value)
            if found is not None:
                return found
    return None


def _as_kwargs(model: nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """Positional arguments of the model's forward turned into keywords, so they can be padded;
    ``None`` when the forward takes ``*args`` (positions cannot be named then)."""
    if not args:
        return dict(kwargs)
    parameters = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values()):
        return None
    merged = dict(zip(parameters, args, strict=False))
    merged.update(kwargs)
    return merged


def _recomputes_activations(model: nn.Module) -> bool:
    """Gradient (since transformers 5: activation) checkpointing is on."""
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), attr) or attr in vars(model):
            return bool(getattr(model, attr))
    return False


def _pad_token_id(config: Any) -> int:
    """A token id for padding: the pad token, else EOS, else 0; always inside the vocabulary (the
    positions are masked, so any valid id does)."""
    vocab_size = getattr(config, "vocab_size", None)
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int) and value >= 0 and (vocab_size is None or value < vocab_size):
            return value
    return 0


# ---- helpers --------------------------------------------------------------------------------------


def _children(model: nn.Module, prefix: str = ""):
    """(parent, child name, full name, child) for every module below ``model``, parents first.

    Unlike ``named_children``, a module registered twice under one parent is yielded at both places.
    """
    for child_name, child in list(model._modules.items()):
        if child is None:
            continue
        full = f"{prefix}{child_name}"
        yield model, child_name, full, child
        yield from _children(child, f"{full}.")


def _count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _call_or_none(model: nn.Module, method: str) -> Any:
    try:
        return getattr(model, method)()
    except (AttributeError, NotImplementedError):
        return None
