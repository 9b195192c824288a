"""LoRA on the tiny models, the same adapters for every run: the targets per architecture, and a patched
model wrapped by PEFT after or before it was patched."""

from __future__ import annotations

import warnings

import tiny_models as tm
import torch
from peft import LoraConfig, get_peft_model

from hf_fp8 import RECIPES, patch_model

LORA_FP8 = RECIPES["lora-fp8"]


TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "bert": ["query", "key", "value", "dense"],
}


def lora(model, arch: str):
    return lora_for(model, TARGETS[arch])


def lora_for(model, targets: list[str]):
    torch.manual_seed(1)  # the same adapters for every run
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=targets)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's note on fan_in_fan_out for GPT-2's Conv1D
        return get_peft_model(model, config)


def fp8_lora(arch: str, order: str):
    """LoRA on a patched tiny model, patched before or after PEFT wraps it."""
    model = tm.build(arch)
    if order == "patch_first":
        patch_model(model, LORA_FP8)
        return lora(model, arch)
    peft_model = lora(model, arch)
    patch_model(peft_model, LORA_FP8)
    return peft_model
