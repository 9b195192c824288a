"""Transformer Engine backend (:class:`TeBackend`): HF layers -> ``te.Linear`` / ``te.LayerNorm`` /
``te.RMSNorm``, and Llama-family decoder blocks -> ``te.LayerNormLinear`` (input norm + q/k/v) and
``te.LayerNormMLP`` (post-attention norm + gate/up/down with SwiGLU); each forward runs inside
``te.autocast`` with the recipe translated to TE's, the backward outside it.

Transformer Engine is optional: this module imports it only when the backend is used. Weights are
copied exactly; HF ``state_dict`` keys are kept through state-dict hooks (q/k/v split back out of the
fused weight, Conv1D weights transposed back, TE's pickled ``_extra_state`` left out), so a patched
model's ``save_pretrained`` loads into a plain model and a plain checkpoint loads into a patched one.
The delayed-scaling state of each layer (its ``fp8_meta``) is reported by role and saved by
:mod:`hf_fp8.checkpoint` without pickle.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers.pytorch_utils import Conv1D

from hf_fp8.backends.base import Fp8Backend, FusedBlock, Replaced
from hf_fp8.formats import FP8_ALIGNMENT, compute_scale, gpu_has_fp8
from hf_fp8.module_tree import get_path, set_path
from hf_fp8.norms import norm_eps, norm_kind
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import CONVERTED, PatchReport
from hf_fp8.scaling_state import LayerScaling, RoleScaling
from hf_fp8.selection import excluded_by, record

_INSTALL_HINT = (
    "install it with `pip install 'hf-fp8[te]'` (Transformer Engine for PyTorch; needs CUDA), or use "
    "backend='native', which needs nothing beyond PyTorch"
)


def load_te():
    """``transformer_engine.pytorch``, or a clear error saying why it cannot be used here."""
    try:
        import transformer_engine.pytorch as te
    except ImportError as err:
        raise ImportError(
            f"backend='te' needs Transformer Engine, which does not import ({err}); {_INSTALL_HINT}"
        ) from None
    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        raise RuntimeError(
            f"backend='te': this machine cannot run Transformer Engine FP8 ({reason}); FP8 GEMMs need a GPU "
            "of compute capability >= 8.9 (Ada, Hopper, Blackwell). backend='native' runs the same FP8 "
            "numerics on any device, without the speed-up"
        )
    return te


def te_usable() -> tuple[bool, str]:
    """Whether ``backend="auto"`` should pick Transformer Engine, and why (not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    if not gpu_has_fp8():
        name = torch.cuda.get_device_name()
        return False, f"{name} has compute capability {torch.cuda.get_device_capability()}, FP8 needs >= 8.9"
    try:
        load_te()
    except (ImportError, RuntimeError) as err:
        return False, str(err)
    return True, "Transformer Engine imports and the GPU supports FP8"


def to_te_recipe(recipe: Fp8Recipe):
    """The Transformer Engine recipe object for ``recipe``; refuses what TE cannot do."""
    from transformer_engine.common.recipe import (
        DelayedScaling,
        Float8BlockScaling,
        Float8CurrentScaling,
        Format,
    )

    if recipe.fp8_all_gather:
        raise ValueError(
            "fp8_all_gather is built for the native backend's FSDP2 path; patch with backend='native', or "
            "leave fp8_all_gather off (TE modules are then all-gathered in their own dtype)"
        )
    if recipe.convert_lm_head == "backward":
        raise ValueError(
            "convert_lm_head: backward (the head's forward GEMM in high precision, its backward in FP8) has "
            "no Transformer Engine module; use backend='native', or convert_lm_head: true / false"
        )
    if recipe.format == "e5m2":
        raise ValueError(
            "format 'e5m2' (E5M2 for every tensor) has no Transformer Engine recipe; use 'hybrid' or 'e4m3', "
            "or backend='native'"
        )
    fp8_format = Format.HYBRID if recipe.format == "hybrid" else Format.E4M3
    if recipe.scaling == "delayed":
        if recipe.interval != 1:
            raise ValueError(
                f"interval={recipe.interval}: Transformer Engine 2 recomputes delayed scales every step and "
                "has no interval; use interval: 1, or backend='native'"
            )
        return DelayedScaling(
            margin=recipe.margin,
            fp8_format=fp8_format,
            amax_history_len=recipe.amax_history_len,
            amax_compute_algo=recipe.amax_compute_algo,
        )
    if recipe.margin != 0:
        raise ValueError(
            f"margin={recipe.margin}: Transformer Engine's {recipe.scaling} scaling has no margin; use "
            "margin: 0, or scaling: delayed"
        )
    if recipe.scaling == "current":
        return Float8CurrentScaling(fp8_format=fp8_format)
    if recipe.scaling == "block":
        return Float8BlockScaling()
    raise ValueError(
        f"scaling {recipe.scaling!r} has no Transformer Engine recipe on Hopper; use backend='native', or "
        "scaling: block / current / delayed"
    )


def _is_te_module(module: nn.Module) -> bool:
    """Whether ``module`` is already a Transformer Engine module (or one of our fused wrappers)."""
    if isinstance(module, (_FusedAttentionInput, _QkvSlice)):
        return True
    return getattr(module, "_hf_fp8_te", False) or type(module).__module__.startswith("transformer_engine.")


def _has_scaling_state(module: nn.Module) -> bool:
    """Whether ``module`` is a TE layer that keeps FP8 scaling state (``fp8_meta``); our fused
    wrappers delegate to such layers and keep none of their own."""
    return _is_te_module(module) and isinstance(getattr(module, "fp8_meta", None), dict)


class TeBackend(Fp8Backend):
    """Transformer Engine modules for linear layers and norms, fused Llama-family blocks, and
    ``te.autocast`` around each forward. TE ends its own FP8 steps inside its autocast."""

    name = "te"
    keeps_norms = None
    keeps_experts = (
        "MoE experts: the Transformer Engine backend keeps them in high precision (backend='native' runs "
        "them in FP8)"
    )
    compiles = False
    recompute_problem = "would recompute layers outside te.autocast, in another precision"
    fsdp_problem = (
        "hf-fp8 has not tested Transformer Engine's modules sharded by FSDP, and the FP8 all-gather of "
        "weights is the native backend's"
    )
    data_parallel_problem = (
        "Transformer Engine keeps its autocast and FP8 step state per process, and nn.DataParallel runs "
        "the replicas of the model in threads of one process"
    )

    def __init__(self, recipe: Fp8Recipe) -> None:
        super().__init__(recipe)
        self.te_recipe = to_te_recipe(recipe)
        self.originals: list[_Original] = []

    @classmethod
    def usable(cls, device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, "the model is not on a GPU"
        return te_usable()

    @classmethod
    def check(cls, recipe: Fp8Recipe) -> None:
        load_te()  # raises with the reason and the way out
        to_te_recipe(recipe)  # refuses what TE cannot do

    @classmethod
    def owns(cls, module: nn.Module) -> bool:
        return _is_te_module(module)

    @classmethod
    def layer_scaling(cls, name: str, module: nn.Module) -> LayerScaling | None:
        if not _has_scaling_state(module):
            return None
        roles, tensors = {}, {}
        for key, meta in _te_metas(module):
            direction = _DIRECTIONS[key]
            roles["forward" if direction == "fwd" else "backward"] = RoleScaling(
                direction, meta.amax_history, meta.scale
            )
            tensors.update({f"{key}.{t}": getattr(meta, t) for t in ("scale", "amax_history")})
        return LayerScaling(name, module, roles, tensors) if roles else None

    def convert_linear(self, module: nn.Module, forward_in_fp8: bool = True) -> nn.Module:
        return _te_linear(module, self.recipe)

    def convert_norm(self, module: nn.Module, kind: str) -> tuple[nn.Module | None, str]:
        new = _te_norm(module, kind)
        if new is None:
            return (
                None,
                "norm: no Transformer Engine equivalent (no affine weight, or no bias); kept as it is",
            )
        return new, f"te.{type(new).__name__}"

    def fuse(self, name: str, block: nn.Module) -> FusedBlock | None:
        members = [f"{name}.{member}" for member in FUSED_MEMBERS]
        if not _fusable(block) or any(excluded_by(m, self.recipe) for m in members):
            return None
        records = []
        for member, (kind, reason) in FUSED_MEMBERS.items():
            module = get_path(block, member)
            flops = module.in_features * module.out_features if kind == "linear" else 0
            records.append(record(f"{name}.{member}", module, kind, CONVERTED, reason, flops))
        replacements, handles = _fuse_block(block, self.recipe)
        return FusedBlock(records, replacements, handles)

    def attach(
        self, model: nn.Module, replaced: list[Replaced], report: PatchReport
    ) -> list[RemovableHandle]:
        skeletons: dict[int, nn.Module] = {}
        for entry in replaced:
            original = entry.original
            if original is None:  # a new attribute (the fused q/k/v owner): removed on undo
                self.originals.append(_Original(entry.path, None))
                continue
            current = get_path(model, entry.path)
            shared = tuple(
                name
                for name, p in original.named_parameters(recurse=False)
                if getattr(current, name, None) is p
            )
            skeleton = skeletons.setdefault(id(original), _skeleton(original))
            device = next(itertools.chain(original.parameters(), original.buffers()), torch.empty(0)).device
            self.originals.append(_Original(entry.path, skeleton, shared, device))
        return _install_state_dict_hooks(model)

    def unpatch(self, model: nn.Module, hooks: list[RemovableHandle]) -> None:
        """The original modules back, each on its replacement's device, with the weights in HF's keys and
        layouts: read through the block hooks, which go before the weights are loaded back. Shared
        parameters are handed back."""
        state_dict = model.state_dict()
        for handle in hooks:
            handle.remove()
        restored: dict[int, nn.Module] = {}
        for original in reversed(self.originals):
            current = get_path(model, original.path)
            if original.skeleton is None:
                set_path(model, original.path, None)
                continue
            module = restored.get(id(original.skeleton))
            if module is None:
                module = original.skeleton.to_empty(device=original.device)
                for name in original.shared:
                    setattr(module, name, getattr(current, name))
                restored[id(original.skeleton)] = module
            set_path(model, original.path, module)
        model.load_state_dict(state_dict, strict=True)  # every restored weight must come back

    def forward_context(self, model: nn.Module, fp8: bool, group: Any) -> contextlib.AbstractContextManager:
        if fp8 and model.training and recomputes_activations(model):
            raise RuntimeError(
                "hf_fp8: gradient checkpointing with the Transformer Engine backend "
                f"{self.recompute_problem}; disable it or use backend='native'"
            )
        import transformer_engine.pytorch as te

        return te.autocast(enabled=fp8, recipe=self.te_recipe, amax_reduction_group=group)

    def end_step(self, group: Any) -> None:
        """Nothing to do: TE reduces amaxes and updates scales inside ``te.autocast``."""

    def set_recipe(self, recipe: Fp8Recipe) -> None:
        super().set_recipe(recipe)
        self.te_recipe = to_te_recipe(recipe)

    def prepare_to_load(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        for name, module in model.named_modules():
            saved_scale = state.get(f"{name}.scaling_fwd.scale")
            if saved_scale is not None and _has_scaling_state(module):
                _create_te_metas(module, self.te_recipe, num_gemms=saved_scale.numel() // 3)


@dataclass
class _Original:
    """A replaced module, kept as a meta-device copy (its class and configuration, no memory), with the
    names of the parameters its replacement shares (the same objects, handed back on unpatch)."""

    path: str
    skeleton: nn.Module | None
    shared: tuple[str, ...] = ()
    device: torch.device | None = None


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


def recomputes_activations(model: nn.Module) -> bool:
    """Gradient (since transformers 5: activation) checkpointing is on."""
    for attr in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), attr) or attr in vars(model):
            return bool(getattr(model, attr))
    return False


# A TE layer's delayed-scaling meta by fp8_meta key, and the direction of the tensors it scales.
_DIRECTIONS = {"scaling_fwd": "fwd", "scaling_bwd": "bwd"}


def _te_metas(module: nn.Module) -> list:
    """(key, meta) for a TE layer's delayed-scaling meta (none before its first FP8 forward)."""
    metas = getattr(module, "fp8_meta", {})
    return [(k, metas[k]) for k in _DIRECTIONS if k in metas and hasattr(metas[k], "amax_history")]


def _create_te_metas(module: nn.Module, te_recipe, num_gemms: int) -> None:
    """Make a TE layer's delayed-scaling meta before its first forward, as that forward would (the
    number of GEMMs comes from the saved state: 3 forward tensors each), so loaded values are kept:
    TE's first forward finds meta of the recipe's kind and leaves it alone."""
    if getattr(module, "fp8_meta_tensors_initialized", False):
        return
    module.fp8_meta["recipe"] = te_recipe
    module.fp8_meta["num_gemms"] = num_gemms
    module.init_fp8_meta_tensors(te_recipe)


@contextlib.contextmanager
def _init_context(recipe: Fp8Recipe, frozen: bool):
    """Where TE modules are built: under ``quantized_model_init`` when their weights are frozen and
    the recipe stores frozen weights in FP8 (weights that train keep their precision)."""
    te = load_te()
    if recipe.fp8_weights and frozen:
        with te.quantized_model_init(enabled=True, recipe=to_te_recipe(recipe)):
            yield
    else:
        yield


def _assign(param: nn.Parameter, value: torch.Tensor) -> None:
    """Copy ``value`` into a TE parameter. An FP8 parameter (``fp8_weights``) quantizes it; with delayed
    scaling its scale would still be TE's initial 1.0, so it is first set from the value's own amax."""
    with torch.no_grad():
        scale = getattr(getattr(param, "_quantizer", None), "scale", None)
        if torch.is_tensor(scale):
            scale.copy_(compute_scale(value.detach().abs().amax(), "e4m3").expand_as(scale))
        param.copy_(value)


def _take_over(param: nn.Parameter, value: torch.Tensor, source: nn.Parameter) -> None:
    """``_assign`` plus ``source``'s ``requires_grad``. A frozen FP8 weight keeps only its row-major copy
    (1 byte a value): TE also stores a transposed copy, needed by the GEMMs of weights that train."""
    _assign(param, value)
    param.requires_grad_(source.requires_grad)
    if not param.requires_grad and hasattr(param, "update_usage"):
        param.update_usage(rowwise_usage=True, columnwise_usage=False)


def _te_linear(module: nn.Module, recipe: Fp8Recipe) -> nn.Module:
    """``te.Linear`` computing what ``module`` (``nn.Linear`` or ``Conv1D``) computes, same weights."""
    if isinstance(module, Conv1D):
        weight, in_features, out_features = module.weight.t(), module.nx, module.nf
    else:
        weight, in_features, out_features = module.weight, module.in_features, module.out_features
    bias = module.bias
    frozen = not module.weight.requires_grad
    with _init_context(recipe, frozen):
        new = _te_linear_class()(
            in_features,
            out_features,
            bias=bias is not None,
            params_dtype=weight.dtype,
            device=weight.device,
        )
    if (recipe.fp8_weights and frozen) or isinstance(module, Conv1D):
        _take_over(new.weight, weight, module.weight)
    else:
        new.weight = module.weight  # share: tied weights and optimizer references stay valid
    if bias is not None:
        new.bias = bias
    _keep_hf_layout(new, transposed=isinstance(module, Conv1D))
    new.train(module.training)
    return new


@functools.cache
def _te_linear_class() -> type:
    """``te.Linear`` that also takes inputs whose row count is not a multiple of 16.

    TE's FP8 GEMMs refuse those; inside a padded batch only layers that see one row per sequence
    (BERT's pooler, classification heads) meet them. Their rows are zero-padded for the GEMM.
    """
    te = load_te()

    class TeLinear(te.Linear):
        _hf_fp8_te = True

        def forward(self, inp: torch.Tensor, *args: Any, **kwargs: Any):
            rows = inp.numel() // inp.shape[-1]
            extra = -rows % FP8_ALIGNMENT
            if extra == 0 or not _fp8_on():
                return super().forward(inp, *args, **kwargs)
            flat = torch.nn.functional.pad(inp.reshape(rows, inp.shape[-1]), (0, 0, 0, extra))
            out = super().forward(flat, *args, **kwargs)
            return out[:rows].reshape(*inp.shape[:-1], out.shape[-1])

    return TeLinear


def _fp8_on() -> bool:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.is_fp8_enabled()


def _te_norm(module: nn.Module, kind: str) -> nn.Module | None:
    """``te.LayerNorm`` / ``te.RMSNorm`` for an HF norm of ``kind``; ``None`` when TE has no match."""
    te = load_te()
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter):
        return None
    common = dict(eps=norm_eps(module), device=weight.device, dtype=weight.dtype)
    if kind == "layernorm":
        if getattr(module, "bias", None) is None:
            return None
        new = te.LayerNorm(weight.shape[0], **common)
        new.weight, new.bias = module.weight, module.bias
    else:
        new = te.RMSNorm(weight.shape[0], zero_centered_gamma=kind == "rmsnorm (1 + w)", **common)
        new.weight = module.weight
    new.train(module.training)
    return new


# ---- state dict hygiene -----------------------------------------------------------------------------


def _drop_extra_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: TE's pickled ``_extra_state`` entries never reach an HF checkpoint."""
    for key in [k for k in state_dict if k.startswith(prefix) and k.endswith("_extra_state")]:
        del state_dict[key]


def _ignore_missing_extra_state(module: nn.Module, incompatible_keys) -> None:
    """Load hook: a plain HF checkpoint has no ``_extra_state``; that is not a missing key."""
    missing = [k for k in incompatible_keys.missing_keys if k.endswith("_extra_state")]
    for key in missing:
        incompatible_keys.missing_keys.remove(key)


def _install_state_dict_hooks(model: nn.Module) -> list:
    """Hooks on the top-level model that keep HF checkpoints free of TE's extra state; returns handles."""
    return [
        model.register_state_dict_post_hook(_drop_extra_state),
        model.register_load_state_dict_post_hook(_ignore_missing_extra_state),
    ]


def _keep_hf_layout(module: nn.Module, transposed: bool) -> None:
    """Checkpoints of a TE linear hold what the HF layer held: a dequantized weight (FP8 storage is an
    in-memory matter), transposed back to (in, out) for a Conv1D, whose layout TE does not have."""

    def save(mod, state_dict, prefix, local_metadata):
        key = prefix + "weight"
        if key in state_dict:
            weight = _dequantized(state_dict[key])
            state_dict[key] = weight.t().contiguous() if transposed else weight

    def load(mod, state_dict, prefix, *args):
        key = prefix + "weight"
        if transposed and key in state_dict:  # checkpoints always hold the Conv1D layout, square ones too
            state_dict[key] = state_dict[key].t().contiguous()

    module.register_state_dict_post_hook(save)
    module.register_load_state_dict_pre_hook(load)


def _dequantized(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize() if hasattr(t, "dequantize") and hasattr(t, "_quantizer") else t


# ---- fused Llama-family blocks ------------------------------------------------------------------------


class _FusedAttentionInput(nn.Module):
    """Input RMSNorm + q/k/v projections as one ``te.LayerNormLinear``.

    The decoder block's ``input_layernorm`` becomes an identity and ``q_proj``/``k_proj``/``v_proj``
    become :class:`_QkvSlice` views of this module's output, computed once per input.
    """

    def __init__(self, fused: nn.Module, sizes: tuple[int, int, int]) -> None:
        super().__init__()
        self.fused = fused
        self.sizes = sizes
        self._input: torch.Tensor | None = None
        self._outputs: list[torch.Tensor | None] = [None, None, None]

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if self._input is not x or self._outputs[index] is None:
            self._input = x
            self._outputs = list(self.fused(x).split(self.sizes, dim=-1))
        out, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):  # all three handed out: keep no reference
            self._input = None
        return out


class _QkvSlice(nn.Module):
    """Stands where ``q_proj``/``k_proj``/``v_proj`` stood; returns its slice of the fused projection."""

    def __init__(self, owner: _FusedAttentionInput, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # not a submodule: the owner is registered once
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner.part(x, self.index)


# The members of a fused block, what each is, and the report's reason.
FUSED_MEMBERS = {
    "input_layernorm": ("rmsnorm", "fused into te.LayerNormLinear with q/k/v"),
    "self_attn.q_proj": ("linear", "fused into te.LayerNormLinear (input_layernorm + q/k/v)"),
    "self_attn.k_proj": ("linear", "fused into te.LayerNormLinear (input_layernorm + q/k/v)"),
    "self_attn.v_proj": ("linear", "fused into te.LayerNormLinear (input_layernorm + q/k/v)"),
    "post_attention_layernorm": ("rmsnorm", "fused into te.LayerNormMLP with the MLP"),
    "mlp.gate_proj": ("linear", "fused into te.LayerNormMLP (post_attention_layernorm + SwiGLU MLP)"),
    "mlp.up_proj": ("linear", "fused into te.LayerNormMLP (post_attention_layernorm + SwiGLU MLP)"),
    "mlp.down_proj": ("linear", "fused into te.LayerNormMLP (post_attention_layernorm + SwiGLU MLP)"),
}


def _fusable(layer: nn.Module) -> bool:
    """A Llama-family decoder block (Llama, Mistral, Qwen2/3): RMSNorm -> q/k/v, RMSNorm -> SwiGLU MLP,
    plain ``nn.Linear`` projections with dimensions that are multiples of 16, no MLP biases, and q/k/v
    (and gate/up) either all training or all frozen, since each group becomes one weight."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    qkv = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    gate_up = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    projections = [*qkv, getattr(attn, "o_proj", None), *gate_up, getattr(mlp, "down_proj", None)]
    if not all(type(p) is nn.Linear for p in projections):
        return False
    if any(p.in_features % FP8_ALIGNMENT or p.out_features % FP8_ALIGNMENT for p in projections):
        return False
    if any(p.bias is not None for p in [*gate_up, mlp.down_proj]) or len({p.bias is None for p in qkv}) > 1:
        return False
    for group in (qkv, gate_up):
        flags = {t.requires_grad for p in group for t in (p.weight, p.bias) if t is not None}
        if len(flags) > 1:
            return False
    act = getattr(mlp, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return False
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return all(n is not None and norm_kind(n) == "rmsnorm" for n in norms)


def _fuse_block(layer: nn.Module, recipe: Fp8Recipe) -> tuple[list[tuple[str, nn.Module]], list]:
    """Fused TE modules for a :func:`_fusable` block, without touching it.

    Returns ``(replacements, hooks)``: (path in ``layer``, new module) pairs for the caller to set
    (``self_attn.qkv_fused`` is a new attribute), and the handles of the state-dict hooks registered on
    ``layer`` that keep HF's keys.
    """
    te = load_te()
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    sizes = (q.out_features, k.out_features, v.out_features)
    common = dict(normalization="RMSNorm", params_dtype=q.weight.dtype, device=q.weight.device)
    mlp_frozen = not any(p.weight.requires_grad for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    with _init_context(recipe, frozen=not q.weight.requires_grad):
        qkv = te.LayerNormLinear(
            q.in_features, sum(sizes), eps=norm_eps(norm1), bias=q.bias is not None, **common
        )
    with _init_context(recipe, frozen=mlp_frozen):
        fused_mlp = te.LayerNormMLP(
            q.in_features,
            mlp.gate_proj.out_features,
            eps=norm_eps(norm2),
            bias=False,
            activation="swiglu",
            **common,
        )
    _take_over(qkv.layer_norm_weight, norm1.weight, norm1.weight)
    _take_over(qkv.weight, torch.cat([q.weight, k.weight, v.weight]), q.weight)
    if q.bias is not None:
        _take_over(qkv.bias, torch.cat([q.bias, k.bias, v.bias]), q.bias)
    _take_over(fused_mlp.layer_norm_weight, norm2.weight, norm2.weight)
    _take_over(
        fused_mlp.fc1_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.gate_proj.weight
    )
    _take_over(fused_mlp.fc2_weight, mlp.down_proj.weight, mlp.down_proj.weight)
    qkv.train(layer.training)
    fused_mlp.train(layer.training)

    owner = _FusedAttentionInput(qkv, sizes)
    replacements: list[tuple[str, nn.Module]] = [
        ("self_attn.qkv_fused", owner),
        ("self_attn.q_proj", _QkvSlice(owner, 0)),
        ("self_attn.k_proj", _QkvSlice(owner, 1)),
        ("self_attn.v_proj", _QkvSlice(owner, 2)),
        ("input_layernorm", nn.Identity()),
        ("post_attention_layernorm", nn.Identity()),
        ("mlp", fused_mlp),
    ]
    return replacements, _map_fused_keys(layer, {"self_attn.qkv_fused.fused.": qkv, "mlp.": fused_mlp}, sizes)


def _map_fused_keys(layer: nn.Module, fused: dict[str, nn.Module], sizes: tuple[int, int, int]) -> list:
    """State-dict hooks on a fused block that translate between HF keys and the fused modules' keys.

    ``fused`` maps each fused module's key prefix inside the block to the module.
    """
    qkv_prefix, mlp_prefix = fused
    renamed = {
        qkv_prefix + "layer_norm_weight": "input_layernorm.weight",
        mlp_prefix + "layer_norm_weight": "post_attention_layernorm.weight",
        mlp_prefix + "fc2_weight": "mlp.down_proj.weight",
    }
    qkv_names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
    split = {
        qkv_prefix + "weight": ([f"{n}.weight" for n in qkv_names], sizes),
        qkv_prefix + "bias": ([f"{n}.bias" for n in qkv_names], sizes),
        mlp_prefix + "fc1_weight": (["mlp.gate_proj.weight", "mlp.up_proj.weight"], None),
    }
    # Every entry the fused modules put in a state dict (their parameters, buffers, extra state).
    own = {
        prefix + name: tensor
        for prefix, module in fused.items()
        for name, tensor in itertools.chain(module.named_parameters(), module.named_buffers())
    }

    def save(module, state_dict, prefix, local_metadata):
        hf_entries = {}
        for key, hf in renamed.items():
            if prefix + key in state_dict:
                hf_entries[hf] = _dequantized(state_dict[prefix + key])
        for key, (hf_names, part_sizes) in split.items():
            tensor = state_dict.get(prefix + key)
            if tensor is not None and tensor.numel():
                full = _dequantized(tensor)
                parts = full.split(list(part_sizes)) if part_sizes else full.chunk(2)
                hf_entries.update({hf: part.clone() for hf, part in zip(hf_names, parts, strict=True)})
        for key in [*own, *(p + "_extra_state" for p in fused)]:
            state_dict.pop(prefix + key, None)
        state_dict.update({prefix + hf: tensor for hf, tensor in hf_entries.items()})

    def load(module, state_dict, prefix, *args):
        for key, hf in renamed.items():
            if prefix + hf in state_dict:
                state_dict[prefix + key] = state_dict.pop(prefix + hf)
        for key, (hf_names, _) in split.items():
            if all(prefix + n in state_dict for n in hf_names):
                state_dict[prefix + key] = torch.cat([state_dict.pop(prefix + n) for n in hf_names])
        for key, tensor in own.items():  # TE-only entries (empty biases) load as they are
            state_dict.setdefault(prefix + key, tensor.detach())

    return [layer.register_state_dict_post_hook(save), layer.register_load_state_dict_pre_hook(load)]
