"""FSDP2 on N GPUs: BF16 against hf-fp8, with and without the FP8 all-gather of weights.

    torchrun --nproc_per_node N benchmarks/fsdp_bench.py [--shape 8b] [--layers L]
        [--modes bf16,hf-fp8,hf-fp8-ag] [--compile]

Every mode builds the same Llama-shaped model in BF16 (patched first for the hf-fp8 modes: native
backend, hybrid delayed scaling; ``hf-fp8-ag`` adds ``fp8_all_gather``, ``hf-fp8-head-backward`` the
``head-backward`` recipe's FP8 backward of the output head, ``hf-fp8-ag-head-backward`` both), shards
each decoder layer and then the root with ``fully_shard``, and trains on 4 x 2048 tokens a rank with
fused AdamW. Rank 0 prints a JSON line per mode and one table: tokens/s per GPU, the ratio to BF16,
peak memory per GPU (of the timed steps, and of the warm-up: a first FP8 step runs eagerly before the
blocks compile), and the bytes all-gathered per step. Those are counted, not sniffed: each sharded
parameter is gathered twice a step (forward, and again for the backward after resharding), at its
all-gather dtype's size (one byte a value for the weights gathered in FP8). ``--layers`` changes the
shape's depth (fewer, to run the 8B layer shape on one GPU); ``--profile`` and ``--trace`` say where a
step's time goes.

``--device cpu --shape tiny`` runs it with gloo as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from harness import (
    add_sharded_arguments,
    build,
    chosen_modes,
    export_trace,
    fresh_start,
    gpu_time_by_kind,
    ratio,
    run_sharded,
    time_steps,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hf_fp8
from hf_fp8.layers.fsdp import Fp8ShardedWeight

RECIPES = {
    "hf-fp8": hf_fp8.Fp8Recipe(),
    "hf-fp8-ag": hf_fp8.Fp8Recipe(fp8_all_gather=True),
    "hf-fp8-head-backward": hf_fp8.Fp8Recipe.named("head-backward"),
    "hf-fp8-ag-head-backward": hf_fp8.Fp8Recipe.named("head-backward").replace(fp8_all_gather=True),
}
MODES = ("bf16", *RECIPES)
TITLES = [
    "tokens/s per GPU",
    "vs bf16",
    "peak GiB per GPU",
    "warm-up peak GiB",
    "all-gather MiB per step",
    "loss",
]
GATHERS_PER_STEP = 2  # forward, and backward after reshard_after_forward


def all_gather_bytes(model: torch.nn.Module) -> int:
    """Bytes all-gathered in one step over all ranks' shards (see the module docstring)."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        size = 1 if isinstance(local, Fp8ShardedWeight) else param.element_size()
        total += param.numel() * size
    return GATHERS_PER_STEP * total


def run_mode(mode: str, args: argparse.Namespace, rank: int) -> dict:
    # Without it, one run of two measured head-backward at 35.7 GiB instead of 30.5 (8B shape at 8 layers,
    # one H100).
    fresh_start()
    model = build(args.shape, args.device, args.layers)
    if mode != "bf16":
        hf_fp8.patch_model(model, RECIPES[mode], backend="native")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    if args.compile:
        hf_fp8.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    generator = torch.Generator(device=args.device).manual_seed(rank)
    vocab = model.config.vocab_size
    cuda = args.device == "cuda"

    def step() -> torch.Tensor:
        ids = torch.randint(0, vocab, (args.batch, args.seq), device=args.device, generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    timed = time_steps(step, args)
    profile = gpu_time_by_kind(step) if args.profile and cuda else {}  # every rank: the steps gather
    trace = export_trace(step, args.trace, f"{args.shape}-{mode}-rank{rank}") if args.trace and cuda else None
    return {
        "mode": mode,
        "shape": args.shape,
        "layers": model.config.num_hidden_layers,
        "gpus": dist.get_world_size(),
        **timed,
        "all_gather_mib_per_step": all_gather_bytes(model) / 2**20,
        **({"gpu_ms": profile} if profile else {}),
        **({"trace": trace} if trace else {}),
    }


def row_cells(result: dict, base: dict | None) -> list[str]:
    """A mode's cells after its name in the results table."""
    return [
        f"{result['tokens_per_s_per_gpu']:,.0f}",
        ratio(result, base, "tokens_per_s_per_gpu"),
        f"{result['peak_gib']:.1f}",
        f"{result['warmup_peak_gib']:.1f}",
        f"{result['all_gather_mib_per_step']:,.2f}",
        f"{result['loss']:.4f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sharded_arguments(parser, MODES)
    parser.add_argument("--profile", action="store_true", help="also a step's GPU time by kernel kind")
    parser.add_argument(
        "--trace", help="also write one step's CPU/GPU timeline (Chrome trace) here, per rank"
    )
    args = parser.parse_args(argv)
    modes = chosen_modes(parser, args.modes, MODES)
    return run_sharded(modes, run_mode, args, TITLES, row_cells)


if __name__ == "__main__":
    sys.exit(main())
