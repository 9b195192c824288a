"""The world a hostile-input test works in (a patched tiny model, its optimizer, its folder of
checkpoints), and what it means that nothing of it was lost: the weights, the FP8 scaling state and
the files, bit for bit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tiny_models as tm
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import hf_fp8
from hf_fp8.integrations.checkpoint import FP8_STATE_FILE, fp8_state_dict
from hf_fp8.recipe import Fp8Recipe

HF_FP8 = Path(sys.executable).with_name("hf-fp8")


@dataclass
class World:
    """What a case may touch: a patched model that has trained a step, a plain model, and a folder
    holding that patched model's good FP8 state file."""

    model: nn.Module
    plain: nn.Module
    folder: Path

    @property
    def state_file(self) -> Path:
        return self.folder / FP8_STATE_FILE


def make_world(tmp_path: Path) -> World:
    model = tm.build("llama")
    hf_fp8.patch_model(model)
    batch = tm.batch_for("llama", 32)
    model(**batch).loss.backward()  # one step: the FP8 state is not all zeros
    model.zero_grad()
    folder = tmp_path / "checkpoint"
    hf_fp8.save_fp8_state(model, folder)
    (folder / "notes.txt").write_text("the user's own file")
    return World(model, tm.build("llama", seed=1), folder)


def snapshot(world: World) -> dict[str, Any]:
    return {
        "weights": {
            n: p.detach().clone() for m in (world.model, world.plain) for n, p in m.named_parameters()
        },
        "fp8": fp8_state_dict(world.model),
        "files": {p.name: p.read_bytes() for p in sorted(world.folder.iterdir())},
        "patched": (hf_fp8.is_patched(world.model), hf_fp8.is_patched(world.plain)),
    }


def assert_unchanged(before: dict, after: dict) -> None:
    assert before["patched"] == after["patched"]
    assert before["files"] == after["files"], "files changed"
    assert before["fp8"].keys() == after["fp8"].keys()
    for key, tensor in before["fp8"].items():
        assert torch.equal(tensor, after["fp8"][key]), f"FP8 state {key} changed"
    for name, tensor in before["weights"].items():
        assert torch.equal(tensor, after["weights"][name]), f"weight {name} changed"


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def damaged_state(world: World, mutate: Callable[[dict], None]) -> Path:
    """A copy of the good state file with ``mutate`` applied to its tensors, in a folder of its own."""
    folder = world.folder.parent / "damaged"
    folder.mkdir(exist_ok=True)
    tensors = load_file(str(world.state_file))
    mutate(tensors)
    save_file(tensors, str(folder / FP8_STATE_FILE), metadata={"recipe": Fp8Recipe().to_yaml()})
    return folder


def last_key(tensors: dict, suffix: str) -> str:
    return sorted(k for k in tensors if k.endswith(suffix))[-1]


def with_env(variables: dict[str, str], action: Callable[[], Any]) -> Callable[[], Any]:
    def run():
        saved = {k: os.environ.get(k) for k in variables}
        os.environ.update(variables)
        try:
            return action()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    return run


def trainer_resuming_from(world: World, folder: Path):
    from transformers import TrainingArguments

    args = TrainingArguments(
        str(world.folder.parent / "out"), max_steps=2, report_to="none", use_cpu=True, disable_tqdm=True
    )
    callback = hf_fp8.Fp8TrainerCallback()
    trainer = hf_fp8.Fp8Trainer(model=world.model, args=args, train_dataset=[], fp8_callback=callback)
    trainer.state.global_step = 1
    callback.resume_from = str(folder)
    callback.on_train_begin(args, trainer.state, trainer.control, model=world.model)
