"""One rank of a Trainer run under DeepSpeed ZeRO (CPU accelerator, gloo) with Fp8TrainerCallback, for
tests/distributed/test_deepspeed.py.

    dist_deepspeed_worker.py OUT_DIR STAGE STEPS [CHECKPOINT]

Trains a tiny Llama for STEPS steps with a checkpoint every two, or resumes from CHECKPOINT, under
examples/deepspeed_zero<STAGE>.json (ZeRO-1: the ZeRO-2 config at stage 1). Writes
OUT_DIR/rank<R>.json: the FP8 state of one layer at the end, the losses, and before the first step and
after each the amax of that layer's whole weight (gathered from the ZeRO-3 partitions): the weight amax
the next step's end must record.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported (by the Trainer)

import deepspeed
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import tiny_models as tm

from hf_fp8 import Fp8TrainerCallback

LAYER = "model.layers.1.mlp.down_proj"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class WeightAmaxes(TrainerCallback):
    """The amax of the whole weight (a collective under ZeRO-3) before the first step and after each."""

    def __init__(self):
        self.amaxes: list[float] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.on_step_end(args, state, control, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        weight = model.get_submodule(LAYER).weight
        with deepspeed.zero.GatheredParameters([weight], enabled=hasattr(weight, "ds_id")):
            self.amaxes.append(weight.detach().abs().max().item())


def main(out_dir: str, stage: str, steps: str, checkpoint: str = "") -> None:
    rank = int(os.environ["RANK"])
    batches = tm.batch_for("llama", 32, batch_size=32, seed=0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in batches["input_ids"]]
    with open(EXAMPLES / f"deepspeed_zero{max(int(stage), 2)}.json") as f:
        config = json.load(f)  # the config the README points users to, "auto" values and all
    config["zero_optimization"]["stage"] = int(stage)
    if config["zero_optimization"]["stage"] == 3:  # every weight partitioned, the tiny ones too
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=int(steps),
        learning_rate=1e-3,
        use_cpu=True,
        ddp_backend="gloo",
        deepspeed=config,
        report_to="none",
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        disable_tqdm=True,
    )
    amaxes = WeightAmaxes()
    fp8 = Fp8TrainerCallback("hybrid-delayed")
    # built after the arguments: under ZeRO-3 transformers builds it inside zero.Init, partitioned
    trainer = Trainer(model=tm.build("llama"), args=args, train_dataset=rows, callbacks=[fp8, amaxes])
    trainer.train(resume_from_checkpoint=checkpoint or None)
    layer = trainer.model.get_submodule(LAYER)
    block = trainer.model.get_submodule(LAYER.rsplit(".", 2)[0])
    result = {
        "type": type(layer).__name__,
        "partitioned": hasattr(layer.weight, "ds_id"),
        "block_leaf": deepspeed.utils.z3_leaf_module(block),
        "hooked": [hasattr(block, "ds_id"), hasattr(layer, "ds_id")],  # ZeRO-3's hooks number the modules
        "notes": fp8.report.notes,
        "fp8_steps": layer.fp8_steps.item(),
        "history": layer.amax_history[:, : int(steps) + 2].tolist(),
        "scale": layer.scale.tolist(),
        "weight_amaxes": amaxes.amaxes,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
    os._exit(0)  # no interpreter teardown: see dist_worker.py
