"""A worker of tests/distributed/test_tensor_parallel.py: FP8 training of a tiny Llama that
transformers sharded as it loaded (gloo on the CPU), or in one process as the reference; or
``patch_model`` asked what a sharded model cannot honour.

    python dist_tp_worker.py OUT_DIR MODEL_DIR LAYOUT STEPS

LAYOUT is ``single``, one of ``LAYOUTS`` below (transformers' ``DistributedConfig``: ``tp``, tensor
parallelism over every rank; ``fsdp-tp``, FSDP2 x TP, 2 x 2; ``hsdp``, two replicas of two FSDP2
shards, patched with the output head converted too), ``trainer`` (FSDP2 over every rank, trained by
the Trainer with ``Fp8TrainerCallback``) or ``refusals`` (what a sharded model cannot take: see
:func:`refusals`). The ranks of one tensor-parallel group train on the same
rows, each data-parallel group on its share of the global batch. Writes OUT_DIR/rank{R}.json: this rank's data
share, the patch report, per step the loss and the FP8 state of a column-wise (``q_proj``) and a
row-wise (``down_proj``) layer with the amax of its whole weight as the step began, and what
``unpatch_model`` said.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
import tiny_models as tm
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, DistributedConfig

import hf_fp8
from hf_fp8.backends.native import NativeBackend

LAYERS = {"colwise": "model.layers.0.self_attn.q_proj", "rowwise": "model.layers.1.mlp.down_proj"}
GLOBAL_BATCH = 4
LAYOUTS = {
    "tp": dict(tp_plan="auto"),
    "fsdp-tp": dict(tp_size=2, fsdp_size=2),
    "hsdp": dict(dp_replicate_size=2, fsdp_size=2),
    "trainer": dict(fsdp_size=2),
}


def fp8_state(layer) -> dict:
    """The newest amax of each role (input, weight, gradient) and the scales."""
    return {"amax": layer.amax_history[:, 1].tolist(), "scale": layer.scale.tolist()}


def whole_amax(weight: torch.Tensor) -> float:
    """The amax of the whole weight, of which this rank may hold a shard."""
    return (weight.full_tensor() if isinstance(weight, DTensor) else weight).abs().max().item()


def data_share(model) -> tuple[int, int]:
    """This rank's index among the data-parallel groups, and their number (the ranks of a tensor-parallel
    group share their rows; transformers' mesh puts the tensor-parallel dimension last)."""
    if not dist.is_initialized():
        return 0, 1
    tp_size = model.config.distributed_config.tp_size or 1
    return dist.get_rank() // tp_size, dist.get_world_size() // tp_size


def train(model, layout: str, steps: int) -> dict:
    recipe = hf_fp8.Fp8Recipe.named("hybrid-delayed")  # FP8 forwards on the shards too
    if layout == "hsdp":  # the output head is an FSDP2 unit of its own there: it stays, and says why
        recipe = recipe.replace(convert_lm_head=True)
    report = hf_fp8.patch_model(model, recipe, backend="native")
    share, shares = data_share(model)
    rows = GLOBAL_BATCH // shares
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    records = []
    for step in range(steps):
        ids = tm.batch_for("llama", 32, batch_size=GLOBAL_BATCH, seed=100 + step)["input_ids"]
        ids = ids[share * rows : (share + 1) * rows]
        whole = {kind: whole_amax(model.get_submodule(name).weight) for kind, name in LAYERS.items()}
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        layers = {kind: fp8_state(model.get_submodule(name)) for kind, name in LAYERS.items()}
        records.append({"step": step, "loss": loss.item(), "whole_weight_amax": whole, **layers})
    try:
        hf_fp8.unpatch_model(model)
        unpatched = None
    except ValueError as err:
        unpatched = str(err)
    return {
        "share": share,
        "shares": shares,
        "converted": len(report.converted_gemms),
        "kept": {r.name: r.reason for r in report.records if r.action != "converted"},
        "notes": report.notes,
        "steps": records,
        "unpatch": unpatched,
    }


def train_with_the_trainer(model, out: str, steps: int) -> dict:
    """The Trainer with the callback on a model transformers sharded: each rank's own rows."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        str(Path(out, "trainer")),
        use_cpu=True,
        max_steps=steps,
        per_device_train_batch_size=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    ids = tm.batch_for("llama", 32, batch_size=2 * steps * dist.get_world_size(), seed=7)["input_ids"]
    callback = hf_fp8.Fp8TrainerCallback("hybrid-delayed")
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": i, "labels": i} for i in ids])
    trainer.add_callback(callback)
    trainer.train()
    return {
        "notes": callback.report.notes,
        "fp8_steps": model.get_submodule(LAYERS["colwise"]).fp8_steps.item(),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        **{kind: fp8_state(model.get_submodule(name)) for kind, name in LAYERS.items()},
    }


def refusals(model_dir: str) -> dict:
    """What a sharded model cannot take leaves it as it was: ``fsdp-fp8`` (weights all-gathered in FP8)
    asked of a model ``fully_shard`` sharded first and of one transformers sharded by tensor parallelism
    (refused before anything changes), and a patch of a ``fully_shard``-first model that fails at its
    last step (the backend's ``attach`` raising: the walk and FSDP2's records undone). For each: the
    error, and a step's loss before and after (the same: nothing changed, and the model still trains)."""
    layout = {"distributed_config": DistributedConfig(**LAYOUTS["tp"])}
    cases = {
        "fully_shard": fully_sharded(model_dir),
        "tp": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **layout),
        "failed attach": fully_sharded(model_dir),
    }
    ids = tm.batch_for("llama", 16, batch_size=2, seed=0)["input_ids"]
    results = {}
    for name, model in cases.items():
        model.train()
        before = model(input_ids=ids, labels=ids).loss
        before.backward()  # gradients through FSDP2's hooks too
        model.zero_grad()
        try:
            if name == "failed attach":
                failing = RuntimeError("attach failed on purpose")  # the patch's last step, after the walk
                with mock.patch.object(NativeBackend, "attach", side_effect=failing):
                    hf_fp8.patch_model(model, "hybrid-delayed", backend="native")
            else:
                hf_fp8.patch_model(model, "fsdp-fp8", backend="native")
            error = None
        except (ValueError, RuntimeError) as err:
            error = str(err)
        after = model(input_ids=ids, labels=ids).loss
        after.backward()
        results[name] = {
            "error": error,
            "fp8_modules": sum(isinstance(m, hf_fp8.Fp8Module) for m in model.modules()),
            "same_loss": before.item() == after.item(),
        }
    return results


def fully_sharded(model_dir: str):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def main() -> None:
    out, model_dir, layout, steps = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    distributed = layout != "single"
    if distributed:
        dist.init_process_group("gloo")
    if layout == "refusals":
        result = refusals(model_dir)
    else:
        plan = {"distributed_config": DistributedConfig(**LAYOUTS[layout])} if layout in LAYOUTS else {}
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **plan).train()
        if layout == "trainer":
            result = train_with_the_trainer(model, out, steps)
        else:
            result = train(model, layout, steps)
    rank = dist.get_rank() if distributed else 0
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # as dist_worker.py: a rank has been seen to hang in the interpreter's teardown
