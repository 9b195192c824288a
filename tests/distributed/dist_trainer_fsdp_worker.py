"""One rank of a Trainer run sharded with FSDP2 (``TrainingArguments.fsdp_config`` with
``fsdp_version: 2``, the configuration the README gives) and ``Fp8TrainerCallback("fsdp-fp8")``, for
tests/layers/test_fsdp.py. The Trainer shards with FSDP only on GPUs (on the CPU it falls back to DDP).

    python dist_trainer_fsdp_worker.py OUT_DIR [--resume-from CHECKPOINT]

Six steps of a tiny Llama in BF16, a checkpoint every three; writes OUT_DIR/rank<R>.json with the
losses, one layer's FP8 state after each step and what its forward read as its weight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import tiny_models as tm

from hf_fp8 import Fp8TrainerCallback

FSDP_CONFIG = {"fsdp_version": 2, "reshard_after_forward": True, "cpu_ram_efficient_loading": True}
LAYER = "model.layers.0.mlp.down_proj"


class RecordFp8State(TrainerCallback):
    """One layer's FP8 state after each step, and the weight its forward reads (all-gathered by then)."""

    def __init__(self):
        self.steps, self.seen = [], {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.get_submodule(LAYER).register_forward_pre_hook(self.weight_seen)

    def weight_seen(self, module, inputs):
        data = getattr(module.weight, "_data", module.weight)
        self.seen = {"type": type(module.weight).__name__, "dtype": str(data.dtype), "numel": data.numel()}
        self.seen["bytes"] = data.untyped_storage().nbytes()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        layer = model.get_submodule(LAYER)
        self.steps.append(
            {
                "step": state.global_step,
                "history": layer.amax_history[:, 1:3].tolist(),
                "scale": layer.scale.tolist(),
                "weight_seen": dict(self.seen),
            }
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--resume-from")
    args = parser.parse_args()
    batches = tm.batch_for("llama", 32, batch_size=24, seed=0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in batches["input_ids"]]
    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=2,
        max_steps=6,
        learning_rate=1e-3,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),  # a smoke run only: on the CPU the Trainer falls back to DDP
        fsdp="full_shard auto_wrap",
        fsdp_config=FSDP_CONFIG,
        save_strategy="steps",
        save_steps=3,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    record = RecordFp8State()
    trainer = Trainer(
        model=tm.build("llama").to(torch.bfloat16),
        args=training,
        train_dataset=rows,
        callbacks=[Fp8TrainerCallback("fsdp-fp8"), record],
    )
    trainer.train(resume_from_checkpoint=args.resume_from)
    result = {
        "fsdp": trainer.is_fsdp_enabled,
        "losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e},
        "steps": record.steps,
    }
    with open(os.path.join(args.out, f"rank{training.process_index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
    os._exit(0)  # no interpreter teardown: see dist_worker.py
