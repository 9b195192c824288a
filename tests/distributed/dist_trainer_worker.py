"""One rank of a data-parallel Trainer run with Fp8TrainerCallback, for tests/distributed/test_distributed.py.

A NaN enters one FP8 layer on rank 1 only, in step 3; with ``nan_policy: skip_step`` every rank must
skip that step together. Writes OUT_DIR/rank<R>.json with what the test checks.
"""

import json
import os
import sys

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import tiny_models as tm

from hf_fp8 import Fp8Recipe, Fp8TrainerCallback

LAYER = "model.layers.1.mlp.down_proj"


class PoisonOneRank(TrainerCallback):
    def __init__(self, rank: int):
        self.rank, self.handle = rank, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        if self.rank == 1 and state.global_step + 1 == 3:
            self.handle = model.get_submodule(LAYER).register_forward_pre_hook(self.poison)

    @staticmethod
    def poison(module, args):
        x = args[0].clone()
        x[0, 0, 0] = float("nan")
        return (x,)


def main(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    batches = tm.batch_for("llama", 32, batch_size=32, seed=0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in batches["input_ids"]]
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=5,
        use_cpu=True,
        ddp_backend="gloo",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
    )
    callback = Fp8TrainerCallback(Fp8Recipe(nan_policy="skip_step"))
    trainer = Trainer(
        model=tm.build("llama"), args=args, train_dataset=rows, callbacks=[PoisonOneRank(rank), callback]
    )
    trainer.train()
    layer = trainer.model.get_submodule(LAYER)
    result = {
        "world": args.world_size,
        "skipped": callback.skipped_steps,
        "fp8_steps": layer.fp8_steps.item(),
        "history": layer.amax_history[:, :8].tolist(),
        "finite": all(torch.isfinite(p).all().item() for p in trainer.model.parameters()),
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)  # no interpreter teardown: see dist_worker.py
