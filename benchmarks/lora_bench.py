"""Time one LoRA training step of a Llama-shaped model: PEFT in BF16, PEFT over Transformer Engine, and
hf-fp8 (native and TE) with the frozen base weights stored in FP8. One process, one GPU.

    python benchmarks/lora_bench.py --shape 8b-4l --modes peft-bf16,peft-te,native-compile,te

LoRA r=16, alpha 32 on q, k, v, o, gate, up and down; everything else frozen. Same model (from a
config, random weights, sdpa attention), same batch (4 x 2048 tokens), AdamW fused over the adapters;
median of the timed steps after warm-up, peak memory of the timed steps. Ratios between modes of one
run are what to compare. Also prints the bytes of the base layers' weights as stored.

Modes:
  peft-bf16             PEFT LoRA on the BF16 model (the baseline)
  peft-te               accelerate's convert_model under te.quantized_model_init, then PEFT (its TE
                        dispatch) and te.autocast: the peer with FP8 weights
  native[-compile]      patch_model(recipe lora-fp8), then PEFT; base GEMMs in FP8 from FP8 weights
  native-block-compile  the same under lora-fp8-block: base weights stored per 128x128 block
  te                    PEFT, then patch_model(recipe lora-fp8, backend="te"): TE layers, FP8 weights
  ...-lmhead            the same with the output head in FP8 too (convert_lm_head)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import torch
from harness import begin_run, build, measure, parse_arguments, print_table, ratio, run_all
from peft import LoraConfig, get_peft_model

import hf_fp8

MODES = (
    "peft-bf16",
    "peft-te",
    "native",
    "native-compile",
    "native-compile-lmhead",
    "native-block-compile",
    "te",
    "te-lmhead",
)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora(model: torch.nn.Module) -> torch.nn.Module:
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))


def base_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the LoRA base layers' weights as stored: FP8 data (TE keeps a row-wise and, while it
    has one, a column-wise copy) or the BF16 tensor."""
    total = 0
    for module in model.modules():
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            weight = module.base_layer.weight
            copies = [getattr(weight, a, None) for a in ("_rowwise_data", "_columnwise_data", "_data")]
            copies = [c for c in copies if torch.is_tensor(c)]
            total += sum(c.nbytes for c in copies) if copies else weight.untyped_storage().nbytes()
    return total


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    model = build(args.shape, args.device)
    forward_context = contextlib.nullcontext
    recipe = hf_fp8.RECIPES["lora-fp8-block" if "block" in mode else "lora-fp8"]
    recipe = recipe.replace(convert_lm_head=mode.endswith("lmhead"))
    if mode == "peft-bf16":
        model = lora(model)
    elif mode == "peft-te":
        import transformer_engine.pytorch as te
        from accelerate import Accelerator
        from accelerate.utils.transformer_engine import convert_model
        from transformer_engine.common.recipe import DelayedScaling

        Accelerator()
        with torch.no_grad(), te.quantized_model_init(enabled=True):
            convert_model(model.model)
        model = lora(model)
        forward_context = functools.partial(te.autocast, enabled=True, recipe=DelayedScaling())
    elif mode.startswith("native"):
        hf_fp8.patch_model(model, recipe, backend="native")
        model = lora(model)
    elif mode.startswith("te"):
        model = lora(model)  # frozen before patching: TE creates the base weights in FP8
        hf_fp8.patch_model(model, recipe, backend="te")
    step_model = torch.compile(model, backend=args.compile_backend) if "compile" in mode else model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    result = {"mode": mode, "shape": args.shape, **measure(step_model, optimizer, forward_context, args)}
    result["base_weight_gib"] = base_weight_bytes(model) / 2**30
    return result


def main(argv: list[str] | None = None) -> int:
    args, modes = parse_arguments(__doc__.splitlines()[0], MODES, "8b-4l", argv)
    begin_run(args, modes, f", LoRA r=16 on {','.join(TARGETS)}")
    results = run_all(modes, run_mode, args)

    def cells(r: dict, base: dict | None) -> list[str]:
        return [
            f"{r['tokens_per_s']:,.0f}",
            ratio(r, base, "tokens_per_s"),
            f"{r['ms_per_step']:.1f}",
            f"{r['peak_gib']:.1f}",
            ratio(r, base, "peak_gib"),
            f"{r['base_weight_gib']:.2f}",
            f"{r['loss']:.4f}",
        ]

    titles = ["tokens/s", "vs peft-bf16", "ms/step", "peak GiB", "vs peft-bf16", "base weights GiB", "loss"]
    print_table(results, "peft-bf16", titles, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
