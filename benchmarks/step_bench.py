"""Time one full training step of a Llama-shaped model, BF16 against hf-fp8 and its peers, on one GPU.

    python benchmarks/step_bench.py --shape 1b --modes bf16,bf16-compile,hf-fp8

Same model (built from a config, random weights, sdpa attention), same batch (4 x 2048 tokens by
default), AdamW fused; each mode builds its own model, runs warm-up steps (compilation included),
then times steps with CUDA events and reports the median. ``benchmarks/compare.py`` runs every mode
in a process of its own and prints one table; this script runs the modes it is given in one process.
Prints a Markdown table and writes JSON lines to --out when given.

Modes:
  bf16, bf16-compile         BF16 eager; BF16 with torch.compile(model)
  bf16-regional              BF16 with hf_fp8.compile (block by block)
  hf-fp8, hf-fp8-lmhead      hf-fp8's fast path: patch_model (native) + hf_fp8.compile; with the output
                             head in FP8 too
  hf-fp8-head-backward       the same with the output head's two backward GEMMs in FP8, its forward (the
                             logits) in BF16 (convert_lm_head: backward)
  hf-fp8-graphs              hf-fp8-head-backward with hf_fp8.compile(model, mode="reduce-overhead"): every
                             step replays CUDA graphs; its peak memory is the memory reserved (the
                             graphs' pool is not counted as allocated while they replay)
  hf-fp8-current             the same with current scaling
  hf-fp8-backward            ``backward-fp8`` (a checkpoint's default): forwards in BF16, dgrad and wgrad in
                             FP8
  hf-fp8-rowwise, hf-fp8-rowwise-gw-hp   the row-wise recipes, compiled
  hf-fp8-block, hf-fp8-block-lmhead, hf-fp8-block-head-backward   block scaling (DeepSeek-V3's
                             1x128 / 128x128), compiled, on cuBLAS's block-scaled kernels; with the
                             output head in FP8 too; with the head's backward GEMMs in FP8
  native, native-compile     patch_model (native), eager; with torch.compile(model)
  torchao, torchao-rowwise   torchao float8 training (tensorwise / rowwise) + torch.compile(model)
  accelerate-te              accelerate's convert_model + te.autocast (TE's DelayedScaling)
  te, te-fused, te-fused-lmhead   hf-fp8's TE backend: unfused, fused Llama blocks, fused + head
  te-block                   the TE backend, fused blocks, under TE's Float8BlockScaling
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import torch
from harness import begin_run, build, measure, parse_arguments, print_table, ratio, run_all, training_flops

import hf_fp8

MODES = (
    "bf16",
    "bf16-compile",
    "bf16-regional",
    "hf-fp8",
    "hf-fp8-lmhead",
    "hf-fp8-head-backward",
    "hf-fp8-graphs",
    "hf-fp8-current",
    "hf-fp8-backward",
    "hf-fp8-rowwise",
    "hf-fp8-rowwise-gw-hp",
    "hf-fp8-block",
    "hf-fp8-block-lmhead",
    "hf-fp8-block-head-backward",
    "native",
    "native-compile",
    "torchao",
    "torchao-rowwise",
    "accelerate-te",
    "te",
    "te-fused",
    "te-fused-lmhead",
    "te-block",
)


_HF_FP8_RECIPES = {
    "hf-fp8": hf_fp8.Fp8Recipe(),
    "hf-fp8-lmhead": hf_fp8.Fp8Recipe(convert_lm_head=True),
    "hf-fp8-head-backward": hf_fp8.Fp8Recipe(convert_lm_head="backward"),
    "hf-fp8-graphs": hf_fp8.Fp8Recipe(convert_lm_head="backward"),
    "hf-fp8-current": hf_fp8.Fp8Recipe(scaling="current"),
    "hf-fp8-backward": hf_fp8.Fp8Recipe.named("backward-fp8"),
    "hf-fp8-rowwise": hf_fp8.Fp8Recipe.named("rowwise"),
    "hf-fp8-rowwise-gw-hp": hf_fp8.Fp8Recipe.named("rowwise-gw-hp"),
    "hf-fp8-block": hf_fp8.Fp8Recipe.named("block"),
    "hf-fp8-block-lmhead": hf_fp8.Fp8Recipe.named("block-head"),
    "hf-fp8-block-head-backward": hf_fp8.Fp8Recipe.named("block").replace(convert_lm_head="backward"),
}


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    """Build, warm up and time one mode; its model and optimizer are freed when this returns."""
    model = build(args.shape, args.device)
    flops = training_flops(model, args.batch, args.seq)
    forward_context = contextlib.nullcontext
    step_model = model
    compile_options = {"backend": args.compile_backend}
    if mode == "bf16-compile":
        step_model = torch.compile(model, **compile_options)
    elif mode == "bf16-regional":
        hf_fp8.compile(model, **compile_options)
    elif mode.startswith("hf-fp8"):
        hf_fp8.patch_model(model, _HF_FP8_RECIPES[mode], backend="native")
        if mode == "hf-fp8-graphs" and args.compile_backend == "inductor":
            compile_options["mode"] = "reduce-overhead"
        hf_fp8.compile(model, **compile_options)
    elif mode.startswith("native"):
        hf_fp8.patch_model(model, hf_fp8.Fp8Recipe(), backend="native")
        step_model = torch.compile(model, **compile_options) if mode.endswith("compile") else model
    elif mode.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        recipe = "rowwise" if mode.endswith("rowwise") else "tensorwise"
        convert_to_float8_training(model.model, config=Float8LinearConfig.from_recipe_name(recipe))
        step_model = torch.compile(model, **compile_options)
    elif mode == "te-block":
        hf_fp8.patch_model(model, hf_fp8.Fp8Recipe.named("block"), backend="te", fuse=True)
    elif mode.startswith("te"):
        recipe = hf_fp8.Fp8Recipe(convert_lm_head=mode.endswith("lmhead"))
        hf_fp8.patch_model(model, recipe, backend="te", fuse=mode.startswith("te-fused"))
    elif mode == "accelerate-te":
        # The peer: accelerate's converter (nn.Linear/nn.LayerNorm -> TE) and TE's autocast around the
        # forward with TE's default DelayedScaling, as accelerate's mixed_precision="fp8" does.
        import transformer_engine.pytorch as te
        from accelerate import Accelerator
        from accelerate.utils.transformer_engine import convert_model
        from transformer_engine.common.recipe import DelayedScaling

        Accelerator()  # convert_model expects accelerate's state to exist, as in a real run
        with torch.no_grad():
            convert_model(model)
        forward_context = functools.partial(te.autocast, enabled=True, recipe=DelayedScaling())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    result = measure(step_model, optimizer, forward_context, args, flops)
    if compile_options.get("mode") == "reduce-overhead":
        result["peak_gib"] = result["peak_reserved_gib"]
    return {"mode": mode, "shape": args.shape, **result}


def main(argv: list[str] | None = None) -> int:
    args, modes = parse_arguments(__doc__.splitlines()[0], MODES, "1b", argv)
    begin_run(args, modes)
    results = run_all(modes, run_mode, args)

    def cells(r: dict, base: dict | None) -> list[str]:
        return [
            f"{r['tokens_per_s']:,.0f}",
            ratio(r, base, "tokens_per_s"),
            f"{r['ms_per_step']:.1f}",
            f"{r['tflops']:.0f}",
            f"{r['peak_gib']:.1f}",
            f"{r['warmup_peak_gib']:.1f}",
            f"{r['warmup_s']:.0f}",
            f"{r['loss']:.4f}",
        ]

    titles = [
        "tokens/s",
        "vs bf16",
        "ms/step",
        "TFLOP/s",
        "peak GiB",
        "warm-up peak GiB",
        "warm-up s",
        "loss",
    ]
    print_table(results, "bf16", titles, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
