"""DeepSpeed ZeRO on N GPUs: BF16 against hf-fp8 under the same stage.

    torchrun --nproc_per_node N benchmarks/zero_bench.py [--stage 3] [--shape 8b] [--layers L]
        [--modes bf16,hf-fp8,hf-fp8-head-backward] [--compile] [--resume-check K]

Every mode builds the same Llama-shaped model in BF16 (patched first for the hf-fp8 modes: native backend,
the default recipe, or ``head-backward``), hands it to ``deepspeed.initialize`` with a ZeRO config of the
stage asked for (bf16 on, so ZeRO keeps float32 master weights and optimizer state, partitioned; torch's
fused AdamW as the client optimizer) and trains on 4 x 2048 tokens a rank. Rank 0 prints a JSON line per
mode and one table: tokens/s per GPU, the ratio to BF16, peak memory per GPU, the last loss, and whether
every rank ended with the same FP8 state (a hash of the amax histories, scales and step counts).
The ZeRO config is announced to transformers first (``HfDeepSpeedConfig``, as the Trainer's
``deepspeed=`` does), so that ``patch_model`` and ``hf_fp8.compile`` see the stage.
``--compile`` runs ``hf_fp8.compile`` on the model before ``deepspeed.initialize`` (the BF16 row too).
Give one mode a process for numbers to compare: after ``engine.destroy()`` ZeRO-3 still holds part of
the engine's memory (on two H200s the second mode of a run peaked 40 GiB higher than in a process of its
own). ``--resume-check K`` then saves a checkpoint, trains K steps, loads it and trains the same K steps
again: whether the losses and the FP8 state came out the same.

``--device cpu --shape tiny`` runs it on DeepSpeed's CPU accelerator with gloo, as a smoke test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from harness import (
    add_resume_arguments,
    add_sharded_arguments,
    build,
    chosen_modes,
    fp8_state_digest,
    fresh_start,
    print_table,
    ratio,
    run_modes_on_ranks,
    same_on_every_rank,
    time_steps,
)

import hf_fp8

RECIPES = {"hf-fp8": hf_fp8.Fp8Recipe(), "hf-fp8-head-backward": hf_fp8.Fp8Recipe.named("head-backward")}
MODES = ("bf16", *RECIPES)
TITLES = ["ZeRO", "tokens/s per GPU", "vs bf16", "peak GiB per GPU", "warm-up s", "loss", "same FP8 state"]


def zero_config(args: argparse.Namespace) -> dict:
    zero = {"stage": args.stage, "overlap_comm": True, "contiguous_gradients": True}
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": args.device == "cuda"},
        "steps_per_print": 10**9,
    }


def run_mode(mode: str, args: argparse.Namespace, rank: int) -> dict:
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig

    fresh_start()
    config = zero_config(args)
    # As TrainingArguments(deepspeed=...) does: the config announced before the model is patched, so that
    # patch_model and hf_fp8.compile see the ZeRO stage (under ZeRO-3 they gather each block whole).
    announced = HfDeepSpeedConfig(config)
    model = build(args.shape, args.device, args.layers)
    if mode != "bf16":
        hf_fp8.patch_model(model, RECIPES[mode], backend="native")
    if args.compile:  # before deepspeed.initialize hooks the model
        hf_fp8.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    generator = torch.Generator(device=args.device).manual_seed(rank)
    vocab = engine.module.config.vocab_size

    def step() -> torch.Tensor:
        ids = torch.randint(0, vocab, (args.batch, args.seq), device=args.device, generator=generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    timed = time_steps(step, args)
    resumed = resume_check(engine, step, generator, args) if args.resume_check else {}
    result = {
        "mode": mode,
        "stage": args.stage,
        "shape": args.shape,
        "layers": engine.module.config.num_hidden_layers,
        "gpus": dist.get_world_size(),
        "compiled": args.compile,
        **timed,
        "same_fp8_state_on_every_rank": same_on_every_rank(fp8_state_digest(engine.module)),
        **resumed,
    }
    engine.destroy()
    del announced
    return result


def resume_check(
    engine: Any, step: Callable[[], torch.Tensor], generator: torch.Generator, args: argparse.Namespace
) -> dict:
    """Save a checkpoint (DeepSpeed's: weights, optimizer state; hf-fp8's FP8 state), train
    ``args.resume_check`` steps, load the checkpoint and train the same steps on the same batches again.
    Equal losses and FP8 state both times: the checkpoint resumes the run exactly."""
    folder = os.path.join(args.checkpoint_dir, "zero_bench_checkpoint")
    fp8 = hf_fp8.is_patched(engine.module)
    engine.save_checkpoint(folder, tag="resume")
    if fp8 and dist.get_rank() == 0:
        hf_fp8.save_fp8_state(engine.module, folder)
    dist.barrier()
    batches = generator.get_state()
    runs = []
    for _ in range(2):
        losses = [step().item() for _ in range(args.resume_check)]
        runs.append((losses, fp8_state_digest(engine.module)))
        engine.load_checkpoint(folder, tag="resume")
        if fp8:
            hf_fp8.load_fp8_state(engine.module, folder)
        generator.set_state(batches)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "resume_losses": [run[0] for run in runs],
        "resumes_exactly": runs[0] == runs[1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    add_sharded_arguments(parser, MODES)
    add_resume_arguments(parser)
    args = parser.parse_args(argv)
    modes = chosen_modes(parser, args.modes, MODES)
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported
    import deepspeed

    if args.device == "cpu":  # gloo's collectives, not a shared-memory allreduce DeepSpeed builds first
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    if args.device == "cuda":  # before the process group, so NCCL binds each rank to its own GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    results = run_modes_on_ranks(modes, run_mode, args, rank)
    if rank == 0:
        print_table(results, "bf16", TITLES, row_cells)
    dist.destroy_process_group()
    return 0


def row_cells(result: dict, base: dict | None) -> list[str]:
    """A mode's cells after its name in the results table."""
    return [
        str(result["stage"]),
        f"{result['tokens_per_s_per_gpu']:,.0f}",
        ratio(result, base, "tokens_per_s_per_gpu"),
        f"{result['peak_gib']:.1f}",
        f"{result['warmup_s']:.0f}",
        f"{result['loss']:.4f}",
        str(result["same_fp8_state_on_every_rank"]),
    ]


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without the interpreter's teardown: there DeepSpeed's shared-memory communication op has
    # aborted a rank after its work was done ("terminate called without an active exception", once on
    # 2 CPU cores), failing the run.
    os._exit(code)
