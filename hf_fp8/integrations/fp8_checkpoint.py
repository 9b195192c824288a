"""Fine-grained FP8 checkpoints, both ways: the format of DeepSeek-V3 and Qwen3-*-FP8.

In that format (transformers' ``FineGrainedFP8Config``, read by transformers and vLLM) every quantized
``nn.Linear`` weight is ``float8_e4m3fn`` with ``<module>.weight_scale_inv`` beside it: float32, one per
128x128 block, ``value = fp8 * weight_scale_inv``. ``config.json`` says so in its
``quantization_config`` and lists the linear layers left in their dtype in ``modules_to_not_convert``.

:func:`save_fp8_pretrained` writes a model (plain, or patched by ``patch_model``) that way. A weight
already stored in FP8 goes out as it is stored, with no second rounding; the others are cast per block
now. Layers are quantized where every reader handles them: exactly ``nn.Linear`` (what transformers
converts), both dimensions multiples of 128 (transformers' dequantization and vLLM's fused q/k/v and
gate/up projections need whole blocks), not the output head nor a weight tied to another module.

:func:`load_fp8_pretrained` reads such a checkpoint straight into FP8-stored weights: the FP8 values go
to the device as they are (one byte a value) and become frozen ``Fp8StoredWeight``\\ s with their block
scales, so no BF16 copy of the linear weights exists (a tensorwise recipe stores them again with one
scale each, one layer's values at a time). A recipe without ``fp8_weights`` (full fine-tuning) gets
trainable weights instead, each dequantized on its own. Checkpoints written here come back bit for bit;
a ``weight_scale_inv`` that is no float32 reciprocal may come back one unit in the last place off.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_fp8.backends.registry import is_fp8_module
from hf_fp8.checks import check_model
from hf_fp8.formats import E4M3
from hf_fp8.layers.linear import Fp8Module
from hf_fp8.layers.selection import matches, output_head
from hf_fp8.layers.stored_weight import Fp8StoredWeight
from hf_fp8.numerics.blockwise import BLOCK, cast_blocks
from hf_fp8.patching.patch import patch_model
from hf_fp8.patching.patch_state import get_state
from hf_fp8.recipe import Fp8Recipe, as_recipe
from hf_fp8.report import PatchReport

__all__ = ["load_fp8_checkpoint", "save_fp8_pretrained"]

SCALE_SUFFIX = ".weight_scale_inv"
# Projections vLLM fuses into one GEMM (qkv_proj, gate_up_proj): all of them quantized, or none.
_FUSED_BY_VLLM = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def save_fp8_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    *,
    modules_to_not_convert: list[str] | None = None,
    **kwargs: Any,
) -> list[str]:
    """Save ``model`` in the fine-grained FP8 format to ``save_directory`` and return the names of the
    linear layers quantized.

    ``modules_to_not_convert``: more module name patterns (``fnmatch``, as in recipes) to keep in their
    dtype; a patched model's recipe adds its own. ``kwargs`` go to ``save_pretrained``
    (``max_shard_size``, ...). LoRA adapters must be merged first (``hf_fp8.peft.merge_and_unload``).
    """
    check_model(model, "save_fp8_pretrained")
    _refuse_adapters(model)
    state = get_state(model)
    if state is not None and state.backend.name != "native":
        raise ValueError(
            f"save_fp8_pretrained reads the native backend's FP8 layers; this model is patched with "
            f"{state.backend.name!r}: save it patched with backend='native', or unpatch_model(model) first"
        )
    patterns = [*(modules_to_not_convert or []), *(state.recipe.modules_to_not_convert if state else [])]
    quantized, kept = _plan(model, patterns)
    if not quantized:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear layer whose dimensions are both multiples of {BLOCK} "
            "(and that is not the output head or tied): nothing to store in FP8; save it with save_pretrained"
        )
    hooks = [module.register_state_dict_post_hook(_write_in_fp8) for module in quantized.values()]
    try:
        state_dict = model.state_dict()
    finally:
        for hook in hooks:
            hook.remove()
    model.save_pretrained(save_directory, state_dict=state_dict, **kwargs)
    config_path = Path(save_directory) / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": kept,
    }
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return list(quantized)


def load_fp8_checkpoint(
    path: str | os.PathLike,
    recipe: Fp8Recipe | str = "lora-fp8-block",
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    model_class: type | None = None,
    backend: str = "native",
) -> tuple[nn.Module, PatchReport]:
    """Load the fine-grained FP8 checkpoint in the folder ``path`` and patch it with ``recipe``.

    Under a recipe with ``fp8_weights`` each quantized linear weight is stored in FP8 as the checkpoint
    holds it, frozen; under block scaling its GEMMs use those very values and block scales. Under
    tensorwise scaling (``lora-fp8``) each is requantized with one scale, layer by layer, as the recipe
    stores weights. Without ``fp8_weights`` (full fine-tuning) each is dequantized, one at a time, into
    a trainable weight of ``dtype``. Everything else loads in ``dtype``.

    ``device``: where the weights go (default: the first CUDA GPU if there is one, else the CPU);
    ``model_class``: the transformers auto class, ``AutoModelForCausalLM`` by default. Returns the model,
    in eval mode as ``from_pretrained`` gives it, and the patch report.
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(path)
    recipe = as_recipe(recipe)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a checkpoint folder (it has no config.json)")
    _check_quantization(folder, json.loads((folder / "config.json").read_text()).get("quantization_config"))
    config = AutoConfig.from_pretrained(folder)
    del config.quantization_config  # the model is built plain; the FP8 weights are put in below
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, buffers computed
        model = (model_class or AutoModelForCausalLM).from_config(config, dtype=dtype)
    store = recipe.enabled and recipe.fp8_weights
    count = _fill(model, folder, device, store, recipe.margin)
    model.to(device).eval()  # the buffers; every parameter is there already
    report = patch_model(model, recipe, backend=backend)
    requantize = not recipe.in_blocks  # the recipe stores weights with one scale: these too
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not is_fp8_module(module):
            _dequantize_stored(module)  # not run in FP8 (the recipe skipped it): a plain frozen weight
        elif requantize and isinstance(weight, Fp8StoredWeight) and weight.in_blocks:
            module.dequantize_weight_()  # one layer's weight in dtype at a time
            module.quantize_weight_()
    done = "stored in FP8 as saved (128x128 block scales)"
    if not store:
        done = "dequantized into trainable weights"
    elif requantize:
        done = f"stored in FP8 with one scale each (scaling {recipe.scaling!r})"
    report.notes.append(f"fine-grained FP8 checkpoint {str(path)!r}: {count} linear weight(s) {done}")
    return model, report


# ---- saving ---------------------------------------------------------------------------------------


def _refuse_adapters(model: nn.Module) -> None:
    if hasattr(model, "peft_config") or any(hasattr(m, "base_layer") for m in model.modules()):
        raise ValueError(
            "save_fp8_pretrained writes a model's own weights, and this one has PEFT adapters beside "
            "them: merge them first, model = hf_fp8.peft.merge_and_unload(model) (PEFT's merge_and_unload "
            "for FP8-stored base weights; fp8=True keeps them in FP8), then save the model it returns"
        )


def _plan(model: nn.Module, patterns: list[str]) -> tuple[dict[str, nn.Module], list[str]]:
    """The linear layers to store in FP8, by name, and the names of the linear layers and MoE experts
    modules left in their dtype (the checkpoint's ``modules_to_not_convert``)."""
    head = output_head(model)
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    keep32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    quantized, kept = {}, []
    for name, module in model.named_modules():
        if name.endswith(".experts"):  # transformers converts these too; hf-fp8 writes them as they are
            kept.append(name)
        elif isinstance(module, (nn.Linear, Conv1D)):
            fits = (
                _plain_type(module) is nn.Linear
                and module is not head
                and holders[id(module.weight)] == 1
                and module.in_features % BLOCK == 0
                and module.out_features % BLOCK == 0
                and not any(matches(name, p) for p in [*patterns, *keep32])
            )
            if fits:
                quantized[name] = module
            else:
                kept.append(name)
    for names in _FUSED_BY_VLLM:
        for parent in {n.rpartition(".")[0] for n in quantized if n.rpartition(".")[2] in names}:
            group = [f"{parent}.{n}" if parent else n for n in names]
            if any(n in kept for n in group):
                for n in group:
                    if n in quantized:
                        del quantized[n]
                        kept.append(n)
    return quantized, sorted(kept)


def _plain_type(module: nn.Module) -> type:
    """The class ``module`` is, or was before ``patch_model`` made it FP8."""
    if isinstance(module, Fp8Module):
        source = module.float_module
        return type(source) if source is not None else (Conv1D if isinstance(module, Conv1D) else nn.Linear)
    return type(module)


def _write_in_fp8(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict post-hook of a layer to quantize: its weight as E4M3 values and ``weight_scale_inv``,
    on the host. A weight stored in E4M3 gives its own values and scales (one scale for the tensor
    is every block's); any other is cast per 128x128 block now."""
    stored = module.weight if isinstance(module, Fp8Module) and module.weight_in_fp8 else None
    if stored is not None and stored._data.dtype == E4M3.dtype:
        values, inverse = stored._data, stored._scale.reciprocal()
        if not stored.in_blocks:
            inverse = inverse.expand(*_grid(stored.shape)).contiguous()
    else:
        values, scales = cast_blocks(state_dict[prefix + "weight"].detach(), E4M3, margin=0)
        inverse = scales.reciprocal()
    state_dict[prefix + "weight"] = values.cpu()
    state_dict[prefix + SCALE_SUFFIX[1:]] = inverse.float().cpu()


def _grid(shape: torch.Size) -> tuple[int, int]:
    """How many 128x128 blocks a (rows, cols) weight has along each dimension, edge blocks included."""
    return math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK)


# ---- loading --------------------------------------------------------------------------------------


def _check_quantization(folder: Path, quantization: dict | None) -> None:
    """Refuse, naming the problem and the way out, what is not a checkpoint of 128x128 E4M3 blocks."""
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "fp8":
        raise ValueError(
            f"{folder} is not a fine-grained FP8 checkpoint (its config.json has no quantization_config with "
            "quant_method 'fp8'); load it with hf_fp8.peft.from_pretrained_fp8, which quantizes on load"
        )
    block = list(quantization.get("weight_block_size") or [])
    dequantize = (
        "load it with transformers' FineGrainedFP8Config(dequantize=True) and patch that model, or "
        "requantize it to 128x128 blocks"
    )
    if block != [BLOCK, BLOCK]:
        raise ValueError(
            f"{folder} has FP8 weights in blocks of {block or 'one tensor'}; hf-fp8 stores 128x128 blocks "
            f"(weight_block_size [128, 128]): {dequantize}"
        )
    problems = {
        "activation_scheme": ("dynamic", "static activation scales, which hf-fp8 does not use"),
        "scale_fmt": ("float", "block scales in another format than float32"),
        "expert_dtype": ("fp8", "experts in another format than FP8"),
    }
    for key, (expected, what) in problems.items():
        if quantization.get(key, expected) != expected:
            raise ValueError(f"{folder} has {what} ({key}: {quantization[key]!r}): {dequantize}")


def _shards(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, or the one file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        return [folder / name for name in files]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise FileNotFoundError(
        f"{folder} has no model.safetensors (nor its index): not a safetensors checkpoint"
    )


@torch.no_grad()
def _fill(model: nn.Module, folder: Path, device: torch.device, store: bool, margin: int) -> int:
    """Put the checkpoint's tensors into ``model``'s meta parameters and persistent buffers, file by
    file, and return how many linear weights were in FP8: stored so (frozen) when ``store``, else
    dequantized into trainable weights. The rest takes the dtype the model has for it."""
    from safetensors import safe_open

    targets = model.state_dict(keep_vars=True)
    names_of: dict[int, list[str]] = {}  # a tensor's names (a tied weight has several)
    for name, tensor in targets.items():
        names_of.setdefault(id(tensor), []).append(name)
    count, unexpected = 0, []
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}  # tensor name -> the open file that holds it
        for path in _shards(folder):
            f = stack.enter_context(safe_open(str(path), framework="pt", device=str(device)))
            where.update(dict.fromkeys(f.keys(), f))
        for key, f in where.items():
            prefix = key.removesuffix(SCALE_SUFFIX).removesuffix(".weight")
            if key.endswith(SCALE_SUFFIX):  # read with its weight
                if f"{prefix}.weight" not in where:
                    raise ValueError(
                        f"{folder}: {key} has no {prefix}.weight beside it: the checkpoint is cut"
                    )
                continue
            target = targets.get(key)
            if target is None:
                unexpected.append(key)
                continue
            if not target.is_meta:  # a tied weight, under its other name
                continue
            tensor = f.get_tensor(key)
            if key.endswith(".weight") and prefix + SCALE_SUFFIX in where:
                inverse = where[prefix + SCALE_SUFFIX].get_tensor(prefix + SCALE_SUFFIX)
                stored = _stored(model, folder, prefix, tensor, inverse, target.dtype, margin)
                value = nn.Parameter(stored if store else stored.dequantize(), requires_grad=not store)
                count += 1
            elif tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ValueError(
                    f"{folder}: {key} is in FP8 but has no {prefix}{SCALE_SUFFIX} beside it: the checkpoint "
                    "is incomplete (or names its scales otherwise); take it again from its source"
                )
            elif isinstance(target, nn.Parameter):
                value = nn.Parameter(tensor.to(target.dtype), requires_grad=target.requires_grad)
            else:
                value = tensor.to(target.dtype)
            for name in names_of[id(target)]:
                owner, _, attribute = name.rpartition(".")
                setattr(model.get_submodule(owner), attribute, value)
                targets[name] = value
    model.tie_weights()  # the output head to the input embeddings, where the config ties them
    missing = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if unexpected or missing:
        raise ValueError(
            f"{folder} does not match {type(model).__name__}{_listing('unexpected', unexpected)}"
            f"{_listing('missing', missing)}; load_fp8_pretrained reads checkpoints whose tensor names are "
            "the model's own (one that transformers renames on load, such as MoE experts stored one by one, "
            "loads with transformers' FineGrainedFP8Config(dequantize=True))"
        )
    return count


def _stored(
    model: nn.Module,
    folder: Path,
    prefix: str,
    values: torch.Tensor,
    inverse: torch.Tensor,
    dtype: torch.dtype,
    margin: int,
) -> Fp8StoredWeight:
    """The FP8 weight of the linear layer ``prefix``, checked: E4M3 values with a float32
    ``weight_scale_inv`` per 128x128 block, reporting ``dtype``."""
    layer = model.get_submodule(prefix)
    if not isinstance(layer, nn.Linear):
        raise ValueError(
            f"{folder}: {prefix} ({type(layer).__name__}) has FP8 weights, and hf-fp8 loads them into "
            "nn.Linear layers only; load it with transformers' FineGrainedFP8Config(dequantize=True)"
        )
    if values.dtype != E4M3.dtype:
        raise ValueError(f"{folder}: {prefix}.weight is {values.dtype}, not float8_e4m3fn")
    if tuple(inverse.shape) != _grid(values.shape):
        raise ValueError(
            f"{folder}: {prefix}{SCALE_SUFFIX} has shape {tuple(inverse.shape)}, where a weight of shape "
            f"{tuple(values.shape)} has {_grid(values.shape)} blocks of 128x128: its blocks are of another "
            "size than config.json says; take the checkpoint again from its source"
        )
    return Fp8StoredWeight(values, inverse.float().reciprocal(), dtype, margin)


def _dequantize_stored(module: nn.Module) -> None:
    """A weight stored in FP8 in a layer that does not run in FP8 becomes a plain frozen tensor."""
    for p in module.parameters(recurse=False):
        if isinstance(p, Fp8StoredWeight):
            torch.utils.swap_tensors(p, nn.Parameter(p.dequantize(), requires_grad=False))


def _listing(label: str, keys: list[str]) -> str:
    if not keys:
        return ""
    shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return f"; {label}: {shown}"
