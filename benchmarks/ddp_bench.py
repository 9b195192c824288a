"""Data-parallel FP8 training on N GPUs (NCCL, DDP): checks the amax synchronisation and times it.

    torchrun --nproc_per_node N benchmarks/ddp_bench.py [--shape 8b-4l] [--compile]

Each rank trains the same Llama-shaped model (hf-fp8 native backend) on its own batch of 4 x 2048
tokens. Every step the script checks, outside the timed region, that all ranks hold the same amax
history and scales, that the newest history entry is the maximum of the ranks' own amaxes, and that
hf-fp8 issued exactly one all-reduce (none with one GPU). Rank 0 prints one JSON line with tokens/s
over all GPUs and the problems found (an empty list when the synchronisation held).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.distributed as dist
from harness import SHAPES, build

import hf_fp8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b-4l")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args(argv)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    model = build(args.shape)
    hf_fp8.patch_model(model, hf_fp8.Fp8Recipe(), backend="native")
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    step_model = torch.compile(ddp) if args.compile else ddp
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    layer = model.model.layers[0].mlp.down_proj
    generator = torch.Generator(device="cuda").manual_seed(rank)

    calls = {"n": 0}
    all_reduce = dist.all_reduce

    def counting_all_reduce(*a, **k):
        calls["n"] += 1
        return all_reduce(*a, **k)

    dist.all_reduce = counting_all_reduce
    times, problems, previous_own = [], [], None
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, 128256, (4, 2048), device="cuda", generator=generator)
        before = calls["n"]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end.record()
        end.synchronize()
        if step >= args.warmup:
            times.append(begin.elapsed_time(end))
        # Checks, untimed: the boundary at this step's start reduced the previous step's amaxes.
        issued = calls["n"] - before
        state = torch.cat([layer.amax_history[:, 1], layer.scale])
        gathered = [torch.empty_like(state) for _ in range(world)]
        dist.all_gather(gathered, state)
        if step > 0:
            expected = previous_own.clone()
            all_reduce(expected, op=dist.ReduceOp.MAX)
            if issued != (1 if world > 1 else 0):  # one process has no one to share amaxes with
                problems.append(f"step {step}: {issued} all-reduces")
            if not all(torch.equal(g, gathered[0]) for g in gathered):
                problems.append(f"step {step}: ranks disagree on history/scales")
            if not torch.equal(layer.amax_history[:, 1], expected):
                problems.append(f"step {step}: history is not the maximum over ranks")
        previous_own = layer.amax_history[:, 0].clone()
    if rank == 0:
        ms = statistics.median(times)
        print(
            json.dumps(
                {
                    "gpus": world,
                    "shape": args.shape,
                    "compile": args.compile,
                    "ms_per_step": ms,
                    "tokens_per_s": world * 4 * 2048 / ms * 1e3,
                    "loss": loss.item(),
                    "sync_problems": problems,
                    "device": torch.cuda.get_device_name(),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
