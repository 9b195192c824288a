"""One rank of a data-parallel FP8 training run, for tests/distributed/test_distributed.py.

    torchrun --nproc_per_node N tests/distributed/dist_worker.py OUT_DIR   (or: hf-fp8 launch ... this file)

(tests/distributed/test_distributed.py starts the ranks itself, with the variables torchrun would set.)

Trains a tiny Llama for a few steps under DDP (gloo) with each rank on its own slice of one global
batch, and writes what the test checks to OUT_DIR/rank<R>.json: per step the loss, this rank's own
amaxes of the step (before their reduction), the amax history and scales every rank should share, and
how many all-reduces hf-fp8 issued. With one process it trains on the whole global batch: the
single-process reference.
"""

import faulthandler
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import tiny_models as tm
from peft import LoraConfig, get_peft_model

from hf_fp8 import RECIPES, patch_model
from hf_fp8.patching.patch_state import get_state

STEPS, GLOBAL_BATCH, LENGTH = 4, 4, 32


def main(out_dir: str, wrap: str = "") -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a hung rank shows where, in the test's log
    distributed = "RANK" in os.environ  # set for each rank; one plain process (hf-fp8 launch --cpu) not
    if distributed:
        dist.init_process_group("gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = tm.build("llama")
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"])
    torch.manual_seed(1)
    if wrap == "peft-fp8":  # LoRA first, then the frozen base patched and stored in FP8
        model = get_peft_model(model, lora)
        report = patch_model(model, RECIPES["lora-fp8"])
        patched = model
        layer = model.get_base_model().model.layers[0].mlp.down_proj.base_layer  # the FP8 one
    else:
        report = patch_model(model)  # recipe: HF_FP8_RECIPE from the launcher, or the defaults
        patched = model
        layer = model.model.layers[0].mlp.down_proj
        if wrap == "peft":  # LoRA added after patching: DDP then wraps a model whose root is PEFT's
            model = get_peft_model(model, lora)
    trained = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)

    own = {}
    all_reduce = dist.all_reduce
    calls = {"all_reduce": 0}
    index = get_state(patched).backend.layers.index(layer)

    def counting_all_reduce(tensor, *args, **kwargs):  # DDP's gradient buckets go through C++, not here
        calls["all_reduce"] += 1
        # this rank's own newest amaxes (per layer: input, weight, grad_output), before the reduction
        own["amax"] = tensor.view(-1, 3)[index].tolist()
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce
    per_rank = GLOBAL_BATCH // world
    records = []
    for step in range(STEPS):
        ids = tm.batch_for("llama", LENGTH, batch_size=GLOBAL_BATCH, seed=100 + step)["input_ids"]
        ids = ids * torch.arange(1, GLOBAL_BATCH + 1)[:, None] % 256  # rows unlike each other
        ids = ids[rank * per_rank : (rank + 1) * per_rank]  # each rank its own rows
        before = calls["all_reduce"]
        loss = trained(input_ids=ids, labels=ids).loss
        loss.backward()  # the FP8 step ends when the backward has finished
        optimizer.step()
        optimizer.zero_grad()
        records.append(
            {
                "step": step,
                "loss": loss.item(),
                "own_amax": own.get("amax"),
                "all_reduce_calls": calls["all_reduce"] - before,
                # Slot 1 holds the step just ended, reduced; the scales are the next step's.
                "history": layer.amax_history[:, 1:4].tolist(),
                "scale": layer.scale.tolist(),
            }
        )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"world": world, "recipe": report.recipe.to_dict(), "steps": records}, f)
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # Leave without the interpreter's teardown: a rank has been seen to hang there, in the destructors
    # of DDP and gloo objects, after its work was done and written.
    os._exit(0)
