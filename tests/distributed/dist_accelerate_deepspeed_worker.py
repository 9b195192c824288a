"""One rank of a custom Accelerate loop under DeepSpeed ZeRO with ``hf_fp8.prepare_fp8``, for
tests/distributed/test_deepspeed.py (two GPUs):

    hf-fp8 launch --config_file examples/deepspeed_zero3.yaml [--zero_stage 2] --recipe R \\
        dist_accelerate_deepspeed_worker.py OUT_DIR STEPS [--save-at N] [--resume-from DIR]

Trains a tiny Llama (built after the Accelerator, so that ZeRO-3 partitions it as it is made), each rank
on its own batches, the same ones in every run. ``--save-at N`` checkpoints with
``accelerator.save_state`` after step N; ``--resume-from`` loads such a checkpoint and trains the steps
after it. Writes OUT_DIR/rank<R>.json: per step the loss and one layer's FP8 state, and how the model
was prepared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
import deepspeed
import tiny_models as tm
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from deepspeed.utils import z3_leaf_module

import hf_fp8

BATCH, LENGTH = 2, 32
LAYER = "model.layers.1.mlp.down_proj"


def main(argv: list[str]) -> None:
    # DeepSpeed's shared-memory allreduce for CPUs is a C++ op it builds on first use (a minute of a
    # 2-core machine's CPU); gloo runs the same collectives.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("steps", type=int)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume-from")
    args = parser.parse_args(argv)

    accelerator = Accelerator()
    AcceleratorState().deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = BATCH
    model = tm.build("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, optimizer, report = hf_fp8.prepare_fp8(accelerator, model, optimizer)  # recipe: the launcher's
    layer = model.get_submodule(LAYER)
    first = 0
    if args.resume_from:
        accelerator.load_state(args.resume_from)
        first = args.save_at
    rank = accelerator.process_index
    steps = []
    for step in range(first, args.steps):
        batch = tm.batch_for("llama", LENGTH, BATCH, seed=1000 * step + rank)["input_ids"]
        batch = batch.to(accelerator.device)
        loss = engine(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)  # DeepSpeed's engine steps its optimizer here
        optimizer.step()
        optimizer.zero_grad()
        steps.append(
            {
                "step": step + 1,
                "loss": loss.item(),
                "history": layer.amax_history[:, :4].tolist(),
                "scale": layer.scale.tolist(),
            }
        )
        if step + 1 == args.save_at and not args.resume_from:
            accelerator.save_state(str(args.out_dir / "checkpoint"))
    result = {
        "engine": type(engine).__name__,
        "zero_stage": AcceleratorState().deepspeed_plugin.zero_stage,
        "type": type(layer).__name__,
        "partitioned": hasattr(layer.weight, "ds_id"),
        "block_leaf": z3_leaf_module(model.get_submodule(LAYER.rsplit(".", 2)[0])),
        "recipe": report.recipe.to_yaml(),
        "notes": report.notes,
        "steps": steps,
    }
    (args.out_dir / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # no interpreter teardown: see dist_worker.py
