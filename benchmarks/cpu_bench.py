"""FP8 on the CPU against float32: one GEMM by each call that computes it, and a patched linear layer's
training step, in one process.

    python benchmarks/cpu_bench.py [--threads 2] [--tokens 512] [--features 576]

The first table times the FP8 product of every operand pairing by each call hf-fp8 chooses from
(:mod:`hf_fp8.numerics.cpu_gemm`) beside a float32 GEMM of the same shape; a call that takes over
``--give-up`` seconds once is timed that once. The second table times forward + backward of an
``nn.Linear`` patched with each recipe (and its step end) against the same layer in float32 and BF16.
The default shape is SmolLM2-135M's (the demo's model): 576 features, 4 x 128 tokens.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import hf_fp8
from hf_fp8.numerics.cpu_gemm import cpu_gemm_choices, emulated_fp8_mm
from hf_fp8.numerics.gemm import fp8_mm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRINGS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3), (E5M2, E5M2)]
RECIPES = ["hybrid-delayed", "current-scaling", "lora-fp8", "rowwise"]


def seconds(run: Callable[[], object], give_up: float, repeats: int = 5) -> float:
    """The median of ``repeats`` calls after a warm-up call; only the warm-up's time when it alone
    took longer than ``give_up`` seconds."""
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    if first > give_up:
        return first
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gemm_table(m: int, k: int, n: int, give_up: float) -> None:
    a32, b32 = torch.randn(m, k), torch.randn(n, k)
    float32 = seconds(lambda: a32 @ b32.t(), give_up)
    print(f"\n## One GEMM, {m} x {k} x {n} (float32: {float32 * 1e3:.2f} ms)\n")
    print("| operands | torch._scaled_mm | same, scales row-wise | emulation | hf-fp8 (chosen) |")
    print("|---|---|---|---|---|")
    one, inverse = torch.tensor(0.03), torch.tensor(1.7)
    rows, columns = one.expand(m, 1).contiguous(), inverse.expand(1, n).contiguous()
    for a_dtype, b_dtype in PAIRINGS:
        a, b = a32.to(a_dtype), b32.to(b_dtype).t()
        runs = [
            lambda a=a, b=b: torch._scaled_mm(a, b, one, inverse, out_dtype=torch.bfloat16),
            lambda a=a, b=b: torch._scaled_mm(a, b, rows, columns, out_dtype=torch.bfloat16),
            lambda a=a, b=b: emulated_fp8_mm(a, b, one, inverse, torch.bfloat16),
            lambda a=a, b=b: fp8_mm(a, b, one, inverse, torch.bfloat16),
        ]
        text = " | ".join(_cell(run, float32, give_up) for run in runs)
        print(f"| {_name(a_dtype)} x {_name(b_dtype)} | {text} |", flush=True)


def _cell(run: Callable[[], object], float32: float, give_up: float) -> str:
    try:
        took = seconds(run, give_up)
    except RuntimeError as err:  # this torch has no CPU kernel for the call
        return f"fails: {str(err).splitlines()[0][:60]}"
    return f"{took * 1e3:.2f} ms ({took / float32:.1f}x)"


def step_table(tokens: int, features: int, give_up: float) -> None:
    print(f"\n## nn.Linear({features}, {features}) on {tokens} tokens: forward + backward + step end\n")
    print("| layer | ms a step | against float32 |\n|---|---|---|")
    x = torch.randn(tokens, features)
    dy = torch.randn(tokens, features)
    baseline = None
    for label, dtype, recipe in [("float32", torch.float32, None), ("BF16", torch.bfloat16, None)] + [
        (f"FP8 {r} (float32 master)", torch.float32, r) for r in RECIPES
    ]:
        torch.manual_seed(0)
        layer = nn.Linear(features, features, bias=False).to(dtype)
        if recipe is not None:
            layer = hf_fp8.Fp8Linear.from_float(layer, hf_fp8.Fp8Recipe.named(recipe))
            if layer.recipe.fp8_weights:  # LoRA's base layer: frozen, stored in FP8
                layer.weight.requires_grad_(False)
                layer.quantize_weight_()
        inputs = x.to(dtype).requires_grad_()

        def step(layer=layer, inputs=inputs):
            layer(inputs).backward(dy.to(inputs.dtype))
            if isinstance(layer, hf_fp8.Fp8Linear):
                hf_fp8.update_fp8_scales(layer)

        took = seconds(step, give_up)
        baseline = baseline or took
        print(f"| {label} | {took * 1e3:.2f} | {took / baseline:.2f}x |", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--features", type=int, default=576)
    parser.add_argument("--give-up", type=float, default=2.0, help="seconds; see the module docstring")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {_cpu_name()}, {torch.backends.cpu.get_cpu_capability()}, AMX: {_amx_flags()}")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("\n## The call hf-fp8 chose for each pairing (hf_fp8.numerics.cpu_gemm)\n")
    for pairing, choice in cpu_gemm_choices().items():
        print(f"- {pairing}: {choice.call} ({choice.reason})")
    gemm_table(args.tokens, args.features, args.features, args.give_up)
    step_table(args.tokens, args.features, args.give_up)
    return 0


def _name(dtype: torch.dtype) -> str:
    return "E4M3" if dtype == E4M3 else "E5M2"


def _cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _amx_flags() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return "unknown"
    flags = next((line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")), "")
    amx = sorted({f for f in flags.split() if f.startswith("amx")})
    return ", ".join(amx) or "none"


if __name__ == "__main__":
    sys.exit(main())
