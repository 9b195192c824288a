"""Transformer Engine backend: HF layers -> ``te.Linear`` / ``te.LayerNorm`` / ``te.RMSNorm``, and
Llama-family decoder blocks -> ``te.LayerNormLinear`` (input norm + q/k/v) and ``te.LayerNormMLP``
(post-attention norm + gate/up/down with SwiGLU).

Transformer Engine is optional: this module imports it only when the backend is used. Weights are
copied exactly; HF ``state_dict`` keys are kept through state-dict hooks (q/k/v split back out of the
fused weight, Conv1D weights transposed back, TE's pickled ``_extra_state`` left out), so a patched
model's ``save_pretrained`` loads into a plain model and a plain checkpoint loads into a patched one.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_fp8.formats import compute_scale
from hf_fp8.norms import norm_kind
from hf_fp8.recipe import Fp8Recipe

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
    if torch.cuda.get_device_capability() < (8, 9):
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
    if recipe.format != "e4m3":
        raise ValueError(
            "scaling 'block' stores every tensor in E4M3 (1x128 / 128x128 blocks); set format: e4m3"
        )
    return Float8BlockScaling()


def is_te_module(module: nn.Module) -> bool:
    """Whether ``module`` is already a Transformer Engine module (or one of our fused wrappers)."""
    if isinstance(module, (_FusedAttentionInput, _QkvSlice, _FusedMlp)):
        return True
    return getattr(module, "_hf_fp8_te", False) or type(module).__module__.startswith("transformer_engine.")


@contextlib.contextmanager
def _init_context(recipe: Fp8Recipe):
    """Where TE modules are built: under ``quantized_model_init`` when weights are stored in FP8."""
    te = load_te()
    if recipe.fp8_weights:
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


def _drop_transpose_if_frozen(param: nn.Parameter) -> None:
    """A frozen FP8 weight keeps only its row-major copy (1 byte a value); TE stores a transposed copy
    too, for the backward GEMMs of weights that train, which would bring storage back to 2 bytes."""
    if not param.requires_grad and hasattr(param, "update_usage"):
        param.update_usage(rowwise_usage=True, columnwise_usage=False)


def convert_linear(module: nn.Module, recipe: Fp8Recipe) -> nn.Module:
    """``te.Linear`` computing what ``module`` (``nn.Linear`` or ``Conv1D``) computes, same weights."""
    if isinstance(module, Conv1D):
        weight, in_features, out_features = module.weight.t(), module.nx, module.nf
    else:
        weight, in_features, out_features = module.weight, module.in_features, module.out_features
    bias = module.bias
    with _init_context(recipe):
        new = _te_linear_class()(
            in_features,
            out_features,
            bias=bias is not None,
            params_dtype=weight.dtype,
            device=weight.device,
        )
    if not recipe.fp8_weights and not isinstance(module, Conv1D):
        new.weight = module.weight  # share: tied weights and optimizer references stay valid
    else:
        _assign(new.weight, weight)
        new.weight.requires_grad_(module.weight.requires_grad)
        _drop_transpose_if_frozen(new.weight)
    if bias is not None:
        new.bias = bias
    if isinstance(module, Conv1D):
        _transpose_on_save_and_load(new, "weight")
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
            extra = -rows % 16
            if extra == 0 or not _fp8_on():
                return super().forward(inp, *args, **kwargs)
            flat = torch.nn.functional.pad(inp.reshape(rows, inp.shape[-1]), (0, 0, 0, extra))
            out = super().forward(flat, *args, **kwargs)
            return out[:rows].reshape(*inp.shape[:-1], out.shape[-1])

    return TeLinear


def _fp8_on() -> bool:
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.is_fp8_enabled()


def convert_norm(module: nn.Module, kind: str) -> nn.Module | None:
    """``te.LayerNorm`` / ``te.RMSNorm`` for an HF norm of ``kind``; ``None`` when TE has no match."""
    te = load_te()
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter):
        return None
    eps = _norm_eps(module)
    common = dict(eps=eps, device=weight.device, dtype=weight.dtype)
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


def _norm_eps(module: nn.Module) -> float:
    for attr in ("eps", "variance_epsilon", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, float):
            return value
    raise ValueError(f"{type(module).__name__} has no eps attribute")


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


def install_state_dict_hooks(model: nn.Module) -> list:
    """Hooks on the top-level model that keep HF checkpoints free of TE's extra state; returns handles."""
    return [
        model.register_state_dict_post_hook(_drop_extra_state),
        model.register_load_state_dict_post_hook(_ignore_missing_extra_state),
    ]


def _transpose_on_save_and_load(module: nn.Module, name: str) -> None:
    """Conv1D stores (in, out); te.Linear (out, in). Checkpoints keep the Conv1D layout."""

    def save(mod, state_dict, prefix, local_metadata):
        key = prefix + name
        if key in state_dict:
            state_dict[key] = _dequantized(state_dict[key]).t().contiguous()

    def load(mod, state_dict, prefix, *args):
        key = prefix + name
        if key in state_dict:  # checkpoints always hold the Conv1D layout, square weights too
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


class _FusedMlp(nn.Module):
    """Post-attention RMSNorm + gate/up/down with SwiGLU as one ``te.LayerNormMLP``."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)


def fusable(layer: nn.Module) -> bool:
    """A Llama-family decoder block (Llama, Mistral, Qwen2/3): RMSNorm -> q/k/v, RMSNorm -> SwiGLU MLP,
    every GEMM dimension a multiple of 16, no MLP biases."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return False
    projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(p) is nn.Linear for p in projections):
        return False
    if not all(p.in_features % 16 == 0 and p.out_features % 16 == 0 for p in projections):
        return False
    if any(p.bias is not None for p in projections[4:]):
        return False
    act = getattr(mlp, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return False
    norms = [getattr(layer, n, None) for n in ("input_layernorm", "post_attention_layernorm")]
    return all(n is not None and norm_kind(n) == "rmsnorm" for n in norms)


def fuse_block(layer: nn.Module, recipe: Fp8Recipe) -> tuple[list[tuple[str, nn.Module | None]], list]:
    """Fused TE modules for a :func:`fusable` block, without touching it.

    Returns ``(replacements, hooks)``: ``replacements`` are (path in ``layer``, new module) pairs for the
    caller to set (``None`` never occurs; ``self_attn.qkv_fused`` is a new attribute), ``hooks`` the
    handles of the state-dict hooks registered on ``layer`` that keep HF's keys.
    """
    te = load_te()
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    sizes = (q.out_features, k.out_features, v.out_features)
    dtype, device = q.weight.dtype, q.weight.device
    qkv_bias = q.bias is not None
    with _init_context(recipe):
        qkv = te.LayerNormLinear(
            q.in_features,
            sum(sizes),
            eps=_norm_eps(norm1),
            bias=qkv_bias,
            normalization="RMSNorm",
            params_dtype=dtype,
            device=device,
        )
        fused_mlp = te.LayerNormMLP(
            q.in_features,
            mlp.gate_proj.out_features,
            eps=_norm_eps(norm2),
            bias=False,
            normalization="RMSNorm",
            activation="swiglu",
            params_dtype=dtype,
            device=device,
        )
    with torch.no_grad():
        qkv.layer_norm_weight.copy_(norm1.weight)
        _assign(qkv.weight, torch.cat([q.weight, k.weight, v.weight]))
        if qkv_bias:
            qkv.bias.copy_(torch.cat([q.bias, k.bias, v.bias]))
        fused_mlp.layer_norm_weight.copy_(norm2.weight)
        _assign(fused_mlp.fc1_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        _assign(fused_mlp.fc2_weight, mlp.down_proj.weight)
    for param, source in (
        (qkv.layer_norm_weight, norm1.weight),
        (qkv.weight, q.weight),
        (fused_mlp.layer_norm_weight, norm2.weight),
        (fused_mlp.fc1_weight, mlp.gate_proj.weight),
        (fused_mlp.fc2_weight, mlp.down_proj.weight),
    ):
        param.requires_grad_(source.requires_grad)
        _drop_transpose_if_frozen(param)
    qkv.train(layer.training)
    fused_mlp.train(layer.training)

    owner = _FusedAttentionInput(qkv, sizes)
    replacements: list[tuple[str, nn.Module | None]] = [
        ("self_attn.qkv_fused", owner),
        ("self_attn.q_proj", _QkvSlice(owner, 0)),
        ("self_attn.k_proj", _QkvSlice(owner, 1)),
        ("self_attn.v_proj", _QkvSlice(owner, 2)),
        ("input_layernorm", nn.Identity()),
        ("post_attention_layernorm", nn.Identity()),
        ("mlp", _FusedMlp(fused_mlp)),
    ]
    return replacements, _map_fused_keys(layer, owner, fused_mlp, sizes, qkv_bias)


def _map_fused_keys(
    layer: nn.Module,
    owner: _FusedAttentionInput,
    fused_mlp: nn.Module,
    sizes: tuple[int, int, int],
    qkv_bias: bool,
) -> list:
    """State-dict hooks on a fused block that translate between HF keys and the fused modules' keys."""
    qkv_prefix, mlp_prefix = "self_attn.qkv_fused.fused.", "mlp.fused."
    renamed = {
        qkv_prefix + "layer_norm_weight": "input_layernorm.weight",
        mlp_prefix + "layer_norm_weight": "post_attention_layernorm.weight",
        mlp_prefix + "fc2_weight": "mlp.down_proj.weight",
    }
    split = {
        qkv_prefix + "weight": (
            ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            sizes,
        ),
        mlp_prefix + "fc1_weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), None),
    }
    if qkv_bias:
        split[qkv_prefix + "bias"] = (
            ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
            sizes,
        )
    internal = {qkv_prefix: owner.fused, mlp_prefix: fused_mlp}

    def save(module, state_dict, prefix, local_metadata):
        for fused, hf in renamed.items():
            if prefix + fused in state_dict:
                state_dict[prefix + hf] = _dequantized(state_dict.pop(prefix + fused))
        for fused, (hf_names, part_sizes) in split.items():
            if prefix + fused in state_dict:
                full = _dequantized(state_dict.pop(prefix + fused))
                parts = full.split(list(part_sizes)) if part_sizes else full.chunk(2)
                for hf, part in zip(hf_names, parts, strict=True):
                    state_dict[prefix + hf] = part.clone()
        # Whatever else the TE modules hold (empty biases, extra state) is theirs, not the checkpoint's.
        for key in [k for k in state_dict if any(k.startswith(prefix + p) for p in internal)]:
            del state_dict[key]

    def load(module, state_dict, prefix, *args):
        for fused, hf in renamed.items():
            if prefix + hf in state_dict:
                state_dict[prefix + fused] = state_dict.pop(prefix + hf)
        for fused, (hf_names, _) in split.items():
            if all(prefix + n in state_dict for n in hf_names):
                state_dict[prefix + fused] = torch.cat([state_dict.pop(prefix + n) for n in hf_names])
        for internal_prefix, fused_module in internal.items():  # TE-only entries load as they are
            for name, tensor in itertools.chain(
                fused_module.named_parameters(), fused_module.named_buffers()
            ):
                state_dict.setdefault(prefix + internal_prefix + name, tensor.detach())

    return [layer.register_state_dict_post_hook(save), layer.register_load_state_dict_pre_hook(load)]


def autocast(te_recipe: Any, enabled: bool, group: Any = None):
    """``te.autocast`` for one forward of the whole model (the backward runs outside it)."""
    te = load_te()
    return te.autocast(enabled=enabled, recipe=te_recipe, amax_reduction_group=group)
