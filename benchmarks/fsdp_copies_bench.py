"""The two eager copies of FSDP2's FP8 all-gather, torch ops against hf-fp8's Triton kernels, at the
weight shapes of one Llama-3-8B layer sharded over N ranks, on one GPU.

    python benchmarks/fsdp_copies_bench.py [--ranks 2] [--layers 32]

* the shard's cast (FSDP2's all-gather hook, twice a step for every weight): ``cast_to_fp8`` and a
  padding ``cat`` (four passes over the shard) against ``hf_fp8.layers.fsdp.shard_in_fp8`` (one);
* the gathered weight's column-major copy for the input gradient (once a step for every weight):
  ``t.t().contiguous().t()`` against ``hf_fp8.numerics.gemm.column_major_copy``.

Prints milliseconds per layer and per step of a model of ``--layers`` layers.
"""

from __future__ import annotations

import argparse
import sys

import torch
from linear_bench import time_ms

from hf_fp8.formats import E4M3, cast_to_fp8, compute_scale
from hf_fp8.layers.fsdp import shard_in_fp8
from hf_fp8.numerics.gemm import column_major_copy

# (out, in) of q, k, v, o, gate, up, down
LAYER = [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336)]


def eager_shard_cast(values: torch.Tensor, scale: torch.Tensor, rows: int) -> torch.Tensor:
    """What the all-gather hook did before the Triton cast."""
    shard = cast_to_fp8(values, scale, E4M3)
    if shard.shape[0] < rows:
        shard = torch.cat([shard, shard.new_zeros(rows - shard.shape[0], *shard.shape[1:])])
    return shard


def measure_weight(out_features: int, in_features: int, ranks: int, dtype: torch.dtype) -> dict[str, float]:
    """Milliseconds of each copy for one weight, after checking that both ways give the same bytes."""
    scale = compute_scale(torch.tensor(0.05, device="cuda"), E4M3)
    rows = -(-out_features // ranks)
    values = torch.randn(rows, in_features, device="cuda", dtype=dtype) * 0.02
    gathered = torch.randn(out_features, in_features, device="cuda").to(E4M3.dtype)
    after = torch.empty(1, device="cuda")
    assert torch.equal(eager_shard_cast(values, scale, rows), shard_in_fp8(values, scale, E4M3, rows))
    assert torch.equal(gathered.t().contiguous(), column_major_copy(gathered, after).t())
    return {
        "cast eager": time_ms(lambda: eager_shard_cast(values, scale, rows)),
        "cast triton": time_ms(lambda: shard_in_fp8(values, scale, E4M3, rows)),
        "copy eager": time_ms(lambda: gathered.t().contiguous().t()),
        "copy triton": time_ms(lambda: column_major_copy(gathered, after)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the shard's")
    args = parser.parse_args(argv)
    sizes = f"{args.ranks} ranks, {args.dtype} shards, {args.layers} layers"
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, {sizes}")
    totals = dict.fromkeys(("cast eager", "cast triton", "copy eager", "copy triton"), 0.0)
    print("| weight (out, in) | " + " | ".join(f"{key} ms" for key in totals) + " |")
    print("|---" * (len(totals) + 1) + "|")
    for out_features, in_features in LAYER:
        row = measure_weight(out_features, in_features, args.ranks, getattr(torch, args.dtype))
        for key, ms in row.items():
            totals[key] += ms
        print(f"| ({out_features}, {in_features}) | " + " | ".join(f"{ms:.3f}" for ms in row.values()) + " |")
    # the cast runs at both all-gathers of a step, the copy once (the input gradient)
    per_step = {key: ms * args.layers * (2 if key.startswith("cast") else 1) for key, ms in totals.items()}
    print("| one layer | " + " | ".join(f"{ms:.3f}" for ms in totals.values()) + " |")
    print("| a step | " + " | ".join(f"{ms:.1f}" for ms in per_step.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
