"""Time one full training step of a Llama-shaped model, BF16 against hf-fp8, in one process on one GPU.

    python benchmarks/step_bench.py --shape 1b --modes bf16,bf16-compile,native,native-compile

Same model (built from a config, random weights, sdpa attention), same batch (4 x 2048 tokens by
default), AdamW fused; each mode builds its own model, runs warm-up steps, then times steps with CUDA
events and reports the median. Ratios between modes of one run are what to compare: absolute numbers
drift between hosts. Prints a Markdown table and writes JSON lines to --out when given.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import torch
from harness import begin_run, build, measure, parse_arguments, print_table, ratio, run_all

import hf_fp8

MODES = (
    "bf16",
    "bf16-compile",
    "native",
    "native-compile",
    "native-current-compile",
    "accelerate-te",
    "te",
    "te-fused",
    "te-fused-lmhead",
)


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    """Build, warm up and time one mode; its model and optimizer are freed when this returns."""
    model = build(args.shape)
    forward_context = contextlib.nullcontext
    if mode.startswith("native"):
        recipe = hf_fp8.Fp8Recipe(scaling="current" if "current" in mode else "delayed")
        hf_fp8.patch_model(model, recipe, backend="native")
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
    step_model = torch.compile(model) if mode.endswith("compile") else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return {"mode": mode, "shape": args.shape, **measure(step_model, optimizer, forward_context, args)}


def main(argv: list[str] | None = None) -> int:
    args, modes = parse_arguments(__doc__.splitlines()[0], MODES, "1b", argv)
    begin_run(args, modes)
    results = run_all(modes, run_mode, args)

    def cells(r: dict, base: dict | None) -> list[str]:
        return [
            f"{r['tokens_per_s']:,.0f}",
            ratio(r, base, "tokens_per_s"),
            f"{r['ms_per_step']:.1f}",
            f"{r['peak_gib']:.1f}",
            f"{r['loss']:.4f}",
        ]

    print_table(results, "bf16", ["tokens/s", "vs bf16", "ms/step", "peak GiB", "loss"], cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
