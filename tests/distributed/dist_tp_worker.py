"""A worker of tests/distributed/test_distributed.py: patch_model on a model that tensor parallelism
(transformers' ``tp_plan="auto"``, gloo on the CPU) or FSDP2 has sharded already.

    python dist_tp_worker.py OUT_DIR MODEL_DIR {tp,fsdp}

Writes OUT_DIR/rank{R}.json: the refusal's message, whether any module became an FP8 one, and whether
the model still computes its loss afterwards.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
import tiny_models as tm
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

import hf_fp8


def main() -> None:
    out, model_dir, layout = sys.argv[1:4]
    dist.init_process_group("gloo")
    if layout == "tp":
        model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    try:
        hf_fp8.patch_model(model, backend="native")
        refusal = None
    except ValueError as err:
        refusal = str(err)
    ids = tm.batch_for("llama", 16, batch_size=2, seed=0)["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    result = {
        "refusal": refusal,
        "fp8_modules": sum(isinstance(m, hf_fp8.Fp8Module) for m in model.modules()),
        "loss_is_finite": bool(torch.isfinite(loss)),
    }
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # as dist_worker.py: a rank has been seen to hang in the interpreter's teardown
