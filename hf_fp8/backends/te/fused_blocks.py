"""Llama-family decoder blocks fused into two Transformer Engine modules: the input RMSNorm with
q/k/v as one ``te.LayerNormLinear``, the post-attention RMSNorm with the SwiGLU MLP as one
``te.LayerNormMLP``; state-dict hooks give the block HF's keys both ways."""

from __future__ import annotations

import itertools

import torch
from torch import nn

from hf_fp8.backends.te.layers import init_context, rows_padded, take_over
from hf_fp8.backends.te.loading import load_te
from hf_fp8.backends.te.state_dict import dequantized
from hf_fp8.formats import FP8_ALIGNMENT
from hf_fp8.layers.norms import norm_eps, norm_kind
from hf_fp8.recipe import Fp8Recipe

__all__ = ["FUSED_MEMBERS", "FusedAttentionInput", "QkvSlice", "fusable", "fuse_block"]


class FusedAttentionInput(nn.Module):
    """Input RMSNorm + q/k/v projections as one ``te.LayerNormLinear``.

    The decoder block's ``input_layernorm`` becomes an identity and ``q_proj``/``k_proj``/``v_proj``
    become :class:`QkvSlice` views of this module's output, computed once per input.
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


class QkvSlice(nn.Module):
    """Stands where ``q_proj``/``k_proj``/``v_proj`` stood; returns its slice of the fused projection."""

    def __init__(self, owner: FusedAttentionInput, index: int) -> None:
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


def fusable(layer: nn.Module) -> bool:
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


def fuse_block(layer: nn.Module, recipe: Fp8Recipe) -> tuple[list[tuple[str, nn.Module]], list]:
    """Fused TE modules for a :func:`fusable` block, without touching it.

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
    with init_context(recipe, frozen=not q.weight.requires_grad):
        qkv = rows_padded(te.LayerNormLinear)(
            q.in_features, sum(sizes), eps=norm_eps(norm1), bias=q.bias is not None, **common
        )
    with init_context(recipe, frozen=mlp_frozen):
        fused_mlp = rows_padded(te.LayerNormMLP)(
            q.in_features,
            mlp.gate_proj.out_features,
            eps=norm_eps(norm2),
            bias=False,
            activation="swiglu",
            **common,
        )
    take_over(qkv.layer_norm_weight, norm1.weight, norm1.weight)
    take_over(qkv.weight, torch.cat([q.weight, k.weight, v.weight]), q.weight)
    if q.bias is not None:
        take_over(qkv.bias, torch.cat([q.bias, k.bias, v.bias]), q.bias)
    take_over(fused_mlp.layer_norm_weight, norm2.weight, norm2.weight)
    take_over(
        fused_mlp.fc1_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.gate_proj.weight
    )
    take_over(fused_mlp.fc2_weight, mlp.down_proj.weight, mlp.down_proj.weight)
    qkv.train(layer.training)
    fused_mlp.train(layer.training)

    owner = FusedAttentionInput(qkv, sizes)
    replacements: list[tuple[str, nn.Module]] = [
        ("self_attn.qkv_fused", owner),
        ("self_attn.q_proj", QkvSlice(owner, 0)),
        ("self_attn.k_proj", QkvSlice(owner, 1)),
        ("self_attn.v_proj", QkvSlice(owner, 2)),
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
                hf_entries[hf] = dequantized(state_dict[prefix + key])
        for key, (hf_names, part_sizes) in split.items():
            tensor = state_dict.get(prefix + key)
            if tensor is not None and tensor.numel():
                full = dequantized(tensor)
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
