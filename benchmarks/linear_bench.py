"""Forward + backward of one linear layer at Llama shapes: BF16 ``nn.Linear`` against ``Fp8Linear``,
eager and compiled, in one process on one GPU.

    python benchmarks/linear_bench.py [--tokens 16384]
    python benchmarks/linear_bench.py --shapes 576x1536,1024x2816,1600x1600,1600x6400,2048x8192
    python benchmarks/linear_bench.py --no-grad-rows 8,64,256,1024,4096

Shows how much of the FP8 GEMM gain the casts around it keep: the GEMMs alone run 1.6-2x BF16 at these
shapes on H100/H200, every unfused amax/scale/cast pass over a tensor eats into that. With
``--no-grad-rows``: forwards without gradient (generation) at those row counts, FP8 forced on against
the plain BF16 layer: where the plain layer wins is ``Fp8Linear``'s ``PLAIN_BELOW_ROWS``. ``--shapes``
(``INxOUT,...``) times other layers than Llama's, such as the narrow ones where FP8 stops paying.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import hf_fp8

SHAPES = [(2048, 8192), (8192, 2048), (4096, 14336), (14336, 4096)]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"576x1536,2048x8192"`` -> ``[(576, 1536), (2048, 8192)]`` (in_features x out_features)."""
    try:
        shapes = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(shape) != 2 or min(shape) <= 0 for shape in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: give shapes as INxOUT,INxOUT (576x1536,2048x8192)")
    return shapes


def time_ms(fn, warmup: int = 5, reps: int = 20) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--no-grad-rows", help="comma-separated row counts: time forwards without gradient")
    parser.add_argument("--shapes", type=parse_shapes, default=SHAPES, help="INxOUT,... (default: Llama's)")
    args = parser.parse_args(argv)
    if args.no_grad_rows:
        return no_grad_table(args.shapes, [int(r) for r in args.no_grad_rows.split(",")])
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens, fwd+bwd")
    print("| in x out | bf16 ms | fp8 eager | fp8 compiled | bf16 compiled |\n|---|---|---|---|---|")
    for in_features, out_features in args.shapes:
        torch.manual_seed(0)
        linear = nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = hf_fp8.Fp8Linear.from_float(linear)
        x = torch.randn(args.tokens, in_features, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(args.tokens, out_features, device="cuda", dtype=torch.bfloat16)
        compiled_fp8 = torch.compile(fp8)
        compiled_bf16 = torch.compile(linear)

        def fwd_bwd(module, x=x, dy=dy):
            return lambda: module(x).backward(dy)

        timings = [time_ms(fwd_bwd(m)) for m in (linear, fp8, compiled_fp8, compiled_bf16)]
        base = timings[0]
        cells = " | ".join(f"{t:.3f} ({base / t:.2f}x)" for t in timings[1:])
        print(f"| {in_features} x {out_features} | {base:.3f} | {cells} |", flush=True)
    return 0


@torch.no_grad()
def no_grad_table(shapes: list[tuple[int, int]], row_counts: list[int]) -> int:
    """Eager forwards without gradient in training mode, as inside generation: BF16 against FP8 (weight
    and input cast every call, as the layer does without a stored FP8 weight)."""
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, eager forward without gradient")
    print("| in x out | rows | bf16 ms | fp8 ms | fp8 vs bf16 |\n|---|---|---|---|---|")
    for in_features, out_features in shapes:
        torch.manual_seed(0)
        linear = nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = hf_fp8.Fp8Linear.from_float(linear)
        for rows in row_counts:
            x = torch.randn(rows, in_features, device="cuda", dtype=torch.bfloat16)
            bf16_ms = time_ms(lambda x=x, m=linear: m(x))
            with hf_fp8.fp8_autocast(enabled=True):  # past Fp8Linear.plain_is_faster
                fp8_ms = time_ms(lambda x=x, m=fp8: m(x))
            print(
                f"| {in_features} x {out_features} | {rows} | {bf16_ms:.4f} | {fp8_ms:.4f} "
                f"| {bf16_ms / fp8_ms:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
