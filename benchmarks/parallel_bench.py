"""N-D parallelism as transformers builds it: BF16 against hf-fp8 under the same layout (FSDP2, HSDP,
tensor parallelism, FSDP2 x TP).

    torchrun --nproc_per_node N benchmarks/parallel_bench.py --layout {fsdp,hsdp,tp,fsdp-tp}
        [--shape 8b] [--layers L] [--modes bf16,hf-fp8,hf-fp8-backward] [--compile] [--resume-check K]

Each mode loads the same Llama-shaped model in BF16 from its config (random weights) through
``from_pretrained(None, config=..., state_dict={}, distributed_config=DistributedConfig(...))``:
transformers applies its tensor-parallel plan and FSDP2 while it loads, and hf-fp8 patches the sharded
model afterwards (native backend; ``hf-fp8``: ``hybrid-delayed``, FP8 forwards and backwards;
``hf-fp8-backward``: ``backward-fp8``, FP8 backward GEMMs only, the default for weights loaded from a
checkpoint). Each data-parallel group trains on its own 4 x 2048 tokens (the ranks of a
tensor-parallel group on the same ones) with AdamW (fused where the parameters are of one kind). Rank 0
prints a JSON line per mode and a table: tokens/s per GPU, the ratio to BF16, peak memory per GPU, the
size of what each GPU all-gathers (FSDP2) and all-reduces (the decoder layers' tensor parallelism) a
step, counted from the shapes (the tensors' bytes, not the wire's), and whether every rank holds the
same FP8 state.
``--resume-check K`` then saves a checkpoint (DCP for the sharded model and optimizer,
``save_fp8_state`` for the FP8 state), trains K steps, loads it and trains the same K steps again: the
same losses and FP8 state both times mean the checkpoint resumes exactly.

``--device cpu --shape tiny`` runs it with gloo as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import (
    add_resume_arguments,
    add_sharded_arguments,
    chosen_modes,
    fp8_state_digest,
    fresh_start,
    llama_config,
    ratio,
    run_sharded,
    same_on_every_rank,
    time_steps,
)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from transformers import DistributedConfig, LlamaForCausalLM

import hf_fp8

# hf-fp8: FP8 forwards and backwards (pretraining's default); hf-fp8-backward: FP8 backward GEMMs only
# (fine-tuning's default, for weights from a checkpoint)
RECIPES = {"hf-fp8": "hybrid-delayed", "hf-fp8-backward": "backward-fp8"}
MODES = ("bf16", *RECIPES)
# DistributedConfig for a world of N ranks (transformers' mesh puts tensor parallelism last)
LAYOUTS = {
    "fsdp": lambda world: dict(fsdp_size=world),
    "hsdp": lambda world: dict(dp_replicate_size=2, fsdp_size=world // 2),
    "tp": lambda world: dict(tp_size=world),
    "fsdp-tp": lambda world: dict(tp_size=2, fsdp_size=world // 2),
}
TITLES = [
    "tokens/s per GPU",
    "vs bf16",
    "peak GiB per GPU",
    "all-gather MiB per GPU",
    "TP all-reduce MiB per GPU",
    "one FP8 state",
    "loss",
]
# transformers' TP in a Llama layer: the row-wise outputs (o_proj, down_proj) in the forward, and each
# column-wise layer's input gradient (q, k, v, gate, up) in the backward, activation-sized
TP_ALL_REDUCES_PER_LAYER = 7


def load(args: argparse.Namespace, world: int) -> LlamaForCausalLM:
    """The model, sharded by transformers as it loads, in training mode."""
    config = llama_config(args.shape, args.layers)
    layout = DistributedConfig(**LAYOUTS[args.layout](world))
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_pretrained(
        None, config=config, state_dict={}, dtype=torch.bfloat16, distributed_config=layout
    )
    return model.train()


def all_gather_bytes_per_gpu(model: torch.nn.Module, tp_size: int) -> int:
    """The bytes one GPU all-gathers a step by FSDP2: each parameter it shards (its tensor-parallel
    part), gathered for the forward and again for the backward."""
    total = 0
    for param in model.parameters():
        names = param.device_mesh.mesh_dim_names if isinstance(param, DTensor) else ()
        if "fsdp" not in names:  # not sharded by FSDP2
            continue
        tensor_parallel = "tp" in names and param.placements[names.index("tp")].is_shard()
        total += param.numel() // (tp_size if tensor_parallel else 1) * param.element_size()
    return 2 * total


def run_mode(mode: str, args: argparse.Namespace, rank: int) -> dict:
    fresh_start()
    world = dist.get_world_size()
    model = load(args, world)
    tp_size = model.config.distributed_config.tp_size or 1
    if mode != "bf16":
        hf_fp8.patch_model(model, RECIPES[mode], backend="native")
    if args.compile:
        hf_fp8.compile(model)
    params = list(model.parameters())
    # fused AdamW takes one kind of tensor: not the DTensors and plain tensors of a TP-only model
    fused = args.device == "cuda" and len({type(p) for p in params}) == 1
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=fused)
    share, shares = rank // tp_size, world // tp_size  # the ranks of a tensor-parallel group: one share
    generator = torch.Generator(device=args.device)
    vocab = model.config.vocab_size

    def step() -> torch.Tensor:
        ids = torch.randint(0, vocab, (args.batch, args.seq), device=args.device, generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    generator.manual_seed(share)
    timed = time_steps(step, args)
    timed["tokens_per_s_per_gpu"] *= shares / world  # a tensor-parallel group's GPUs share its tokens
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    activation_bytes = args.batch * args.seq * hidden * 2
    result = {
        "mode": mode,
        "layout": args.layout,
        "mesh": LAYOUTS[args.layout](world),
        "shape": args.shape,
        "layers": layers,
        "gpus": world,
        **timed,
        "all_gather_mib_per_gpu": all_gather_bytes_per_gpu(model, tp_size) / 2**20,
        "tp_all_reduce_mib_per_gpu": (
            TP_ALL_REDUCES_PER_LAYER * layers * activation_bytes / 2**20 if tp_size > 1 else 0.0
        ),
        "one_fp8_state": same_on_every_rank(fp8_state_digest(model)) if hf_fp8.is_patched(model) else None,
    }
    if args.resume_check:
        result.update(resume_check(model, optimizer, step, generator, share, args))
    return result


def resume_check(model, optimizer, step, generator, share: int, args: argparse.Namespace) -> dict:
    """Save a checkpoint, train ``args.resume_check`` steps, load it and train the same steps on the same
    batches again."""
    folder = Path(args.checkpoint_dir, f"parallel-{args.layout}")
    state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
    dcp.save(state, checkpoint_id=str(folder / "dcp"))
    patched = hf_fp8.is_patched(model)
    if patched and dist.get_rank() == 0:
        hf_fp8.save_fp8_state(model, folder)  # the same on every rank: written once
    dist.barrier()
    runs = []
    for attempt in range(2):
        if attempt:
            state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
            dcp.load(state, checkpoint_id=str(folder / "dcp"))
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )
            if patched:
                hf_fp8.load_fp8_state(model, folder)
        generator.manual_seed(1000 + share)
        losses = [step().item() for _ in range(args.resume_check)]
        runs.append((losses, fp8_state_digest(model)))
    exact = runs[0] == runs[1]
    return {"resume_losses": runs[0][0], "resumes_exactly": exact and same_on_every_rank(exact)}


def row_cells(result: dict, base: dict | None) -> list[str]:
    """A mode's cells after its name in the results table."""
    state = result["one_fp8_state"]
    return [
        f"{result['tokens_per_s_per_gpu']:,.0f}",
        ratio(result, base, "tokens_per_s_per_gpu"),
        f"{result['peak_gib']:.1f}",
        f"{result['all_gather_mib_per_gpu']:,.0f}",
        f"{result['tp_all_reduce_mib_per_gpu']:,.0f}",
        "-" if state is None else ("yes" if state else "NO"),
        f"{result['loss']:.4f}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sharded_arguments(parser, MODES)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    add_resume_arguments(parser)
    args = parser.parse_args(argv)
    modes = chosen_modes(parser, args.modes, MODES)
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.layout in ("hsdp", "fsdp-tp") and (world < 4 or world % 2):
        parser.error(f"--layout {args.layout} splits the ranks 2 x N: start 4, 6, 8, ... (got {world})")
    return run_sharded(modes, run_mode, args, TITLES, row_cells)


if __name__ == "__main__":
    sys.exit(main())
