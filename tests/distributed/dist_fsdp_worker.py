"""A worker of tests/layers/test_fsdp.py: FP8 training of a tiny Llama sharded with FSDP2 (``fully_shard`` on
every decoder layer and the root, gloo on the CPU), or unsharded in one process as the reference.

    python dist_fsdp_worker.py OUT_DIR STEPS [--save-at N] [--resume-from DIR] [--fp8-all-gather]
        [--device cuda] [--accelerate] [--hsdp]

Every run sees the same global batches (each rank its own share). It writes, per step, the loss and
one layer's FP8 state to OUT_DIR/rank{R}.json; ``--save-at N`` checkpoints model, optimizer and FP8
state after step N with torch.distributed.checkpoint and ``save_fp8_state``; ``--resume-from`` starts
from such a checkpoint; ``--fp8-all-gather`` patches with the recipe's ``fp8_all_gather`` and records what
one layer's forward reads as its weight; ``--device cuda`` runs each rank on its GPU with NCCL;
``--hsdp`` shards over a 2-D mesh (HSDP: the ranks in two replicas, each sharding the weights over its
half of the ranks).

``--accelerate`` shards the way a user of Accelerate does: a BF16 model, ``hf_fp8.prepare_fp8`` and
Accelerate's own FSDP2 preparation (float32 master weights, sharding on the meta device, the weights
loaded into the shards), checkpoints through ``accelerator.save_state`` / ``load_state``. Started by
``hf-fp8 launch --config_file examples/fsdp2.yaml`` on GPUs, it takes the recipe and FSDP2 settings
from there. Accelerate shards with FSDP only on GPUs, so on the CPU the worker sets the state that
launch gives (the FSDP2 plugin of examples/fsdp2.yaml, the FSDP distributed type) and the recipe
``fsdp-fp8`` itself.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: tiny_models
import tiny_models as tm
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import hf_fp8

GLOBAL_BATCH = 4
LENGTH = 32
EXAMPLE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "fsdp2.yaml"


def hsdp_mesh(device: str):
    """Two replicas, each sharding over half of the ranks (FSDP2's HSDP)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    return init_device_mesh(device, (2, world // 2), mesh_dim_names=("replicate", "shard"))


class FullyShard:
    """``fully_shard`` on every decoder layer and the root; checkpoints with DCP and ``save_fp8_state``."""

    def __init__(self, model, args, sharded: bool):
        recipe = hf_fp8.Fp8Recipe(fp8_all_gather=args.fp8_all_gather)
        # before sharding; native: the FP8 all-gather is its (and backend 'auto' picks TE where TE imports)
        hf_fp8.patch_model(model, recipe=recipe, backend="native")
        if sharded:
            mesh = hsdp_mesh(args.device) if args.hsdp else None
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def save(self, folder: Path, rank: int) -> None:
        state = dict(zip(("model", "optimizer"), get_state_dict(self.model, self.optimizer), strict=True))
        dcp.save(state, checkpoint_id=str(folder / "dcp"))
        if rank == 0:  # the FP8 state is the same on every rank: written once
            hf_fp8.save_fp8_state(self.model, folder)

    def load(self, folder: Path) -> None:
        state = dict(zip(("model", "optimizer"), get_state_dict(self.model, self.optimizer), strict=True))
        dcp.load(state, checkpoint_id=str(folder / "dcp"))
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        hf_fp8.load_fp8_state(self.model, folder)


class AccelerateFsdp2:
    """``hf_fp8.prepare_fp8`` with Accelerate's FSDP2 preparation; checkpoints with ``save_state``."""

    def __init__(self, model, args, sharded: bool):
        from accelerate import Accelerator

        if args.device == "cuda":  # started by hf-fp8 launch with examples/fsdp2.yaml
            self.accelerator, recipe = Accelerator(), None
        else:
            self.accelerator, recipe = Accelerator(cpu=True, mixed_precision="bf16"), "fsdp-fp8"
            self._set_launch_state()
        model = model.to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        self.model, self.optimizer, _ = hf_fp8.prepare_fp8(self.accelerator, model, optimizer, recipe=recipe)

    def _set_launch_state(self) -> None:
        from accelerate import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        fsdp = yaml.safe_load(EXAMPLE_CONFIG.read_text())["fsdp_config"]
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=fsdp["fsdp_version"],
            auto_wrap_policy=fsdp["fsdp_auto_wrap_policy"].lower(),
            reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
            cpu_ram_efficient_loading=fsdp["fsdp_cpu_ram_efficient_loading"],
            state_dict_type=fsdp["fsdp_state_dict_type"],
        )
        # both states: every AcceleratorState() made later copies the process's state over its own
        PartialState().distributed_type = self.accelerator.state.distributed_type = DistributedType.FSDP

    def save(self, folder: Path, rank: int) -> None:
        self.accelerator.save_state(str(folder))

    def load(self, folder: Path) -> None:
        self.accelerator.load_state(str(folder))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("steps", type=int)
    parser.add_argument("--save-at", type=int)
    parser.add_argument("--resume-from")
    parser.add_argument("--fp8-all-gather", action="store_true")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--accelerate", action="store_true")
    parser.add_argument("--hsdp", action="store_true")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(120, exit=True)  # a hung rank shows where, in the test's log
    sharded = "RANK" in os.environ
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if sharded and not args.accelerate:
        dist.init_process_group("nccl" if cuda else "gloo")
    model = tm.build("llama").to(args.device)
    training = (AccelerateFsdp2 if args.accelerate else FullyShard)(model, args, sharded)
    model, optimizer = training.model, training.optimizer
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
    start = 0
    if args.resume_from:
        folder = Path(args.resume_from)
        training.load(folder)
        start = json.loads((folder / "step.json").read_text())["step"]

    layer = model.model.layers[0].mlp.down_proj
    seen = {}

    def weight_seen(module, inputs):  # the weight as the forward reads it, all-gathered by now
        w = module.weight
        data = getattr(w, "_data", w)
        seen.update(type=type(w).__name__, dtype=str(data.dtype), bytes=data.untyped_storage().nbytes())
        if hasattr(w, "_scale"):  # gathered in FP8: the scale it was cast with, and the layer's now
            seen.update(gathered_scale=w._scale.item(), layer_scale=module.scale[1].item())

    layer.register_forward_pre_hook(weight_seen)
    guard = hf_fp8.Fp8NanGuard(model)  # it reads the sharded gradients
    records = []
    per_rank = GLOBAL_BATCH // world
    for step in range(start, args.steps):
        ids = tm.batch_for("llama", LENGTH, batch_size=GLOBAL_BATCH, seed=100 + step)["input_ids"]
        ids = ids[rank * per_rank : (rank + 1) * per_rank].to(args.device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()  # the FP8 step ends when the backward has finished: amaxes reduced over the ranks
        assert guard.check(step)
        optimizer.step()
        optimizer.zero_grad()
        records.append(
            {
                "step": step,
                "loss": loss.item(),
                "history": layer.amax_history[:, 1:3].tolist(),
                "scale": layer.scale.tolist(),
                "weight_is_sharded": type(layer.weight).__name__ == "DTensor",
                "weight_seen": dict(seen, numel=layer.weight.numel()),
            }
        )
        if args.save_at == step + 1:
            folder = Path(args.out) / "checkpoint"
            training.save(folder, rank)
            if rank == 0:
                (folder / "step.json").write_text(json.dumps({"step": step + 1}))
    unpatch_error = None
    if sharded:  # FSDP2 holds on to the FP8 layers now: unpatching is refused
        try:
            hf_fp8.unpatch_model(model)
        except ValueError as err:
            unpatch_error = str(err)
        assert hf_fp8.is_patched(model)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
        result = {"world": world, "steps": records, "unpatch_error": unpatch_error}
        json.dump({**result, "optimizes_the_model": optimized == {id(p) for p in model.parameters()}}, f)
    if sharded:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without the interpreter's teardown (see dist_worker.py: a rank has been seen to hang there).
    os._exit(0)
