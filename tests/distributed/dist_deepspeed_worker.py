"""One rank of a Trainer run under DeepSpeed ZeRO with Fp8TrainerCallback, for
tests/distributed/test_deepspeed.py: on DeepSpeed's CPU accelerator with gloo, or with
``DS_ACCELERATOR=cuda`` on the rank's GPU with NCCL and BF16.

    dist_deepspeed_worker.py OUT_DIR STAGE STEPS [--checkpoint DIR] [--lora] [--layer-by-layer]

Trains a tiny Llama (``--lora``: LoRA adapters on it, the base frozen, its GEMMs in FP8) for STEPS steps
with a checkpoint every two, or resumes from a checkpoint (``--layer-by-layer``: ZeRO-3's gathers as
DeepSpeed does them by default, each layer on its own, not a decoder block at a time), under
examples/deepspeed_zero<STAGE>.json (ZeRO-1: the ZeRO-2 config at stage 1). Writes
OUT_DIR/rank<R>.json: the FP8 state of one layer at the end, the losses, and before the first step and
after each the amax of that layer's whole weight (gathered from the ZeRO-3 partitions): the weight amax
the next step's end must record.
"""

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported (by the Trainer)

import deepspeed
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import tiny_models as tm

from hf_fp8 import Fp8TrainerCallback

LAYER = "model.layers.1.mlp.down_proj"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


class WeightAmaxes(TrainerCallback):
    """The amax of the whole weight (a collective under ZeRO-3) before the first step and after each."""

    def __init__(self, layer: str):
        self.layer = layer
        self.amaxes: list[float] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.on_step_end(args, state, control, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        weight = model.get_submodule(self.layer).weight
        with deepspeed.zero.GatheredParameters([weight], enabled=hasattr(weight, "ds_id")):
            self.amaxes.append(weight.detach().abs().max().item())


def main(argv: list[str]) -> None:
    # DeepSpeed's shared-memory allreduce for CPUs is a C++ op it builds on first use (a minute of a
    # 2-core machine's CPU); gloo runs the same collectives.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("stage", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--checkpoint")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--layer-by-layer", action="store_true")
    options = parser.parse_args(argv)
    out_dir, stage, steps = options.out_dir, options.stage, options.steps
    rank = int(os.environ["RANK"])
    cuda = os.environ["DS_ACCELERATOR"] == "cuda"
    batches = tm.batch_for("llama", 32, batch_size=32, seed=0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in batches["input_ids"]]
    with open(EXAMPLES / f"deepspeed_zero{max(stage, 2)}.json") as f:
        config = json.load(f)  # the config the README points users to, "auto" values and all
    config["zero_optimization"]["stage"] = stage
    if config["zero_optimization"]["stage"] == 3:  # every weight partitioned, the tiny ones too
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=steps,
        learning_rate=1e-3,
        use_cpu=not cuda,
        ddp_backend="nccl" if cuda else "gloo",
        bf16=cuda,
        deepspeed=config,
        report_to="none",
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        disable_tqdm=True,
    )
    # built after the arguments: under ZeRO-3 transformers builds it inside zero.Init, partitioned
    model, layer_path, block_path = tm.build("llama"), LAYER, LAYER.rsplit(".", 2)[0]
    if options.lora:
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]))
        layer_path, block_path = f"base_model.model.{LAYER}.base_layer", f"base_model.model.{block_path}"
    amaxes = WeightAmaxes(layer_path)
    fp8 = Fp8TrainerCallback("hybrid-delayed")
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[fp8, amaxes])
    if options.layer_by_layer:  # the callback has patched the model; deepspeed.initialize comes in train()
        deepspeed.utils.unset_z3_leaf_modules(model, [type(model.model.layers[0])])
    trainer.train(resume_from_checkpoint=options.checkpoint)
    layer = trainer.model.get_submodule(layer_path)
    block = trainer.model.get_submodule(block_path)
    named = trainer.model.named_parameters()
    trainable = {"lora" if ".lora_" in n else "base" for n, p in named if p.requires_grad}
    result = {
        "type": type(layer).__name__,
        "partitioned": hasattr(layer.weight, "ds_id"),
        "block_leaf": deepspeed.utils.z3_leaf_module(block),
        "hooked": [hasattr(block, "ds_id"), hasattr(layer, "ds_id")],  # ZeRO-3's hooks number the modules
        "notes": fp8.report.notes,
        "fp8_steps": layer.fp8_steps.item(),
        "history": layer.amax_history[:, : steps + 2].tolist(),
        "trainable": sorted(trainable),  # which parameters train: "lora", "base" or both
        "scale": layer.scale.tolist(),
        "weight_amaxes": amaxes.amaxes,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1:])
    os._exit(0)  # no interpreter teardown: see dist_worker.py
