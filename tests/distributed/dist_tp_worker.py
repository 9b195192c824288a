"""A worker of tests/distributed/test_tensor_parallel.py: FP8 training of a tiny Llama sharded by
transformers' tensor parallelism (``DistributedConfig(tp_plan="auto")``, gloo on the CPU), or in one
process as the reference; or ``patch_model`` on a model that ``fully_shard`` sharded first.

    python dist_tp_worker.py OUT_DIR MODEL_DIR {tp,single,fsdp} STEPS [SAVE_AT | RESUME_FROM]

Every rank trains on the same batches (tensor parallelism splits the layers, not the data). Writes
OUT_DIR/rank{R}.json: per step the loss and the FP8 state of a column-wise (``q_proj``) and a row-wise
(``down_proj``) layer, and what ``unpatch_model`` said; or, for ``fsdp``, the refusal and whether the
model still runs. A number after STEPS checkpoints after that step (torch.distributed.checkpoint for the
sharded weights and the optimizer, ``save_fp8_state`` for the FP8 state) into OUT_DIR/checkpoint; a
folder resumes from such a checkpoint.
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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_fp8

LAYERS = {"colwise": "model.layers.0.self_attn.q_proj", "rowwise": "model.layers.1.mlp.down_proj"}


def fp8_state(layer) -> dict:
    """The newest amax of each role (input, weight, gradient) and the scales."""
    return {"amax": layer.amax_history[:, 1].tolist(), "scale": layer.scale.tolist()}


def train(model, steps: int, checkpoint: str | None) -> dict:
    report = hf_fp8.patch_model(model, "hybrid-delayed", backend="native")  # FP8 forwards on the shards too
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = 0
    if checkpoint is not None and not checkpoint.isdigit():  # resume
        saved = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
        dcp.load(saved, checkpoint_id=str(Path(checkpoint, "dcp")))
        set_state_dict(model, optimizer, model_state_dict=saved["model"], optim_state_dict=saved["optimizer"])
        hf_fp8.load_fp8_state(model, checkpoint)
        start = json.loads(Path(checkpoint, "step.json").read_text())["step"]
    records = []
    for step in range(start, steps):
        ids = tm.batch_for("llama", 32, batch_size=4, seed=100 + step)["input_ids"]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        layers = {kind: fp8_state(model.get_submodule(name)) for kind, name in LAYERS.items()}
        records.append({"step": step, "loss": loss.item(), **layers})
        if checkpoint == str(step + 1):
            save(model, optimizer, step + 1)
    try:
        hf_fp8.unpatch_model(model)
        unpatched = None
    except ValueError as err:
        unpatched = str(err)
    return {
        "converted": len(report.converted_gemms),
        "notes": report.notes,
        "steps": records,
        "unpatch": unpatched,
    }


def save(model, optimizer, step: int) -> None:
    folder = Path(OUT, "checkpoint")
    state = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer), strict=True))
    dcp.save(state, checkpoint_id=str(folder / "dcp"))
    if dist.get_rank() == 0:  # the FP8 state is the same on every rank: written once
        hf_fp8.save_fp8_state(model, folder)
        (folder / "step.json").write_text(json.dumps({"step": step}))
    dist.barrier()


def refuse_sharded(model) -> dict:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    try:
        hf_fp8.patch_model(model, "hybrid-delayed", backend="native")
        refusal = None
    except ValueError as err:
        refusal = str(err)
    ids = tm.batch_for("llama", 16, batch_size=2, seed=0)["input_ids"]
    loss = model(input_ids=ids, labels=ids).loss
    return {
        "refusal": refusal,
        "fp8_modules": sum(isinstance(m, hf_fp8.Fp8Module) for m in model.modules()),
        "loss_is_finite": bool(torch.isfinite(loss)),
    }


OUT = sys.argv[1] if len(sys.argv) > 1 else "."


def main() -> None:
    out, model_dir, layout, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    checkpoint = sys.argv[5] if len(sys.argv) > 5 else None
    distributed = layout != "single"
    if distributed:
        dist.init_process_group("gloo")
    plan = {"distributed_config": DistributedConfig(tp_plan="auto")} if layout == "tp" else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **plan).train()
    result = refuse_sharded(model) if layout == "fsdp" else train(model, steps, checkpoint)
    rank = dist.get_rank() if distributed else 0
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # as dist_worker.py: a rank has been seen to hang in the interpreter's teardown
