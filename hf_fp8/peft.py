"""PEFT LoRA on FP8 models: what PEFT cannot do by itself.

LoRA needs nothing special here: ``Fp8Linear`` is an ``nn.Linear`` (and ``Fp8Conv1D`` a ``Conv1D``), so
PEFT's own dispatch wraps it in either order (``patch_model`` then ``get_peft_model``, or the other
way round), the base layer runs in FP8 and ``lora_A`` / ``lora_B`` stay in high precision. With
``fp8_weights`` the frozen base weights are stored in FP8 at the first forward after PEFT froze them.

Merging is the one thing PEFT cannot do on FP8 storage: it adds the adapter's delta to
``base_layer.weight`` in place, which has no meaning for FP8 values with a scale. :func:`merge_and_unload`
dequantizes those weights first, lets PEFT merge, and stores the merged weights in FP8 again when
asked.
"""

from __future__ import annotations

from torch import nn

from hf_fp8.backends.native import _Fp8Module

__all__ = ["merge_and_unload"]


def merge_and_unload(peft_model: nn.Module, fp8: bool = False, **kwargs) -> nn.Module:
    """PEFT's ``merge_and_unload`` for a model whose base layers store their weights in FP8.

    The FP8 base weights are dequantized to their original dtype, PEFT merges the adapters into them
    and removes the LoRA layers. The result is the base model, still patched for FP8 compute, with
    merged weights in the original dtype, or stored in FP8 again (frozen) with ``fp8=True``.
    ``kwargs`` go to PEFT (``safe_merge``, ``adapter_names``, ...).
    """
    base = peft_model.get_base_model()
    stored_in_fp8 = [m for m in base.modules() if isinstance(m, _Fp8Module) and m.weight_in_fp8]
    for module in stored_in_fp8:
        module.dequantize_weight_()
    merged = peft_model.merge_and_unload(**kwargs)
    if fp8:
        for module in merged.modules():
            if isinstance(module, _Fp8Module):
                module.weight.requires_grad_(False)
                module.quantize_weight_()
    return merged
