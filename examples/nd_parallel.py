"""FP8 training under transformers' N-D parallelism: HSDP, tensor parallelism and FSDP2 x TP, on one node
or several.

    # one node, 4 GPUs: FSDP2 over 2 x tensor parallelism over 2
    hf-fp8 launch --num_processes 4 --recipe backward-fp8 examples/nd_parallel.py MODEL --fsdp 2 --tp 2
    # two nodes of 4 GPUs, HSDP: a replica a node, sharded over its GPUs (run on each node, its rank)
    hf-fp8 launch --config_file examples/two_nodes.yaml --machine_rank 0 --main_process_ip HOST \\
        --recipe backward-fp8 examples/nd_parallel.py MODEL --replicate 2 --fsdp 4

transformers shards the model while it loads (``DistributedConfig``: its tensor-parallel plan, then
FSDP2 over the data-parallel ranks); ``patch_model`` converts the sharded model, and every rank keeps
the same FP8 state (amaxes reduced over all ranks once a step). The ranks of a tensor-parallel group
train on the same batch, each data-parallel group on its own (random tokens here: bring your own data).
``--save-at N`` writes a checkpoint after step N (DCP for the sharded weights and the optimizer, the FP8
state beside them); ``--resume-from`` continues from one, with any number of nodes that gives the same
layout. Rank 0 prints the loss of its rows each step as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import hf_fp8


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("model", help="a local HF causal LM folder (config and weights)")
    parser.add_argument("--replicate", type=int, default=1, help="HSDP replicas (dp_replicate_size)")
    parser.add_argument("--fsdp", type=int, default=1, help="ranks FSDP2 shards over (fsdp_size)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (tp_size)")
    parser.add_argument("--steps", type=int, default=10, help="the step to stop before")
    parser.add_argument("--batch-size", type=int, default=4, help="rows a data-parallel group trains on")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--recipe",
        help="FP8 recipe; default: hf-fp8 launch's, else patch_model's for a checkpoint (backward-fp8)",
    )
    parser.add_argument("--save-at", type=int, help="write a checkpoint into --out after this step")
    parser.add_argument("--out", type=Path, default=Path("nd-checkpoint"))
    parser.add_argument("--resume-from", type=Path, help="a checkpoint written by --save-at")
    args = parser.parse_args(argv)
    if min(args.replicate, args.fsdp, args.tp) < 1:
        parser.error("--replicate, --fsdp and --tp must be at least 1")
    if args.save_at is not None and not 0 < args.save_at <= args.steps:
        parser.error(f"--save-at must be a step from 1 to --steps ({args.steps}), got {args.save_at}")
    return args


def load(args: argparse.Namespace):
    """The model in float32 (the optimizer's master weights), sharded by transformers as it loads; FSDP2
    gathers its weights in bf16 on a GPU, where the forward runs under bf16 autocast."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    layout = DistributedConfig(
        dp_replicate_size=args.replicate,
        fsdp_size=args.fsdp,
        tp_size=args.tp,
        fsdp_mixed_precision=torch.cuda.is_available() and args.replicate * args.fsdp > 1,
    )
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, distributed_config=layout)


def save(model, optimizer, step: int, folder: Path) -> None:
    state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
    dcp.save(state, checkpoint_id=str(folder / "dcp"))
    if dist.get_rank() == 0:  # the FP8 state is the same on every rank
        hf_fp8.save_fp8_state(model, folder)
        (folder / "step.json").write_text(json.dumps({"step": step}))
    dist.barrier()


def resume(model, optimizer, folder: Path) -> int:
    state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
    dcp.load(state, checkpoint_id=str(folder / "dcp"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    hf_fp8.load_fp8_state(model, folder)
    return json.loads((folder / "step.json").read_text())["step"]


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.replicate * args.fsdp * args.tp != world:
        sys.exit(f"nd_parallel.py: --replicate x --fsdp x --tp must be the {world} ranks launched")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    model = load(args).train()
    report = hf_fp8.patch_model(model, args.recipe, backend="native")  # None: the launcher's, or the default
    if torch.cuda.is_available():
        hf_fp8.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    start = resume(model, optimizer, args.resume_from) if args.resume_from else 0
    rank = dist.get_rank()
    if rank == 0:
        print(json.dumps({"fp8_layers": len(report.converted_gemms), "notes": report.notes}), flush=True)
    data_group = rank // args.tp  # the ranks of a tensor-parallel group see the same rows
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda")
    for step in range(start, args.steps):
        generator = torch.Generator().manual_seed(1000 * step + data_group)
        shape = (args.batch_size, args.seq_len)
        ids = torch.randint(0, model.config.vocab_size, shape, generator=generator).to(device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:  # the loss of rank 0's rows
            print(json.dumps({"step": step, "loss": loss.item()}), flush=True)
        if args.save_at == step + 1:
            save(model, optimizer, step + 1, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
