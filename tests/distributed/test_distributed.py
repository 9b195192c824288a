"""Amax synchronisation across ranks, checked with real processes (gloo): two ranks started with the
environment torchrun gives its workers (:mod:`launcher`), and one process under ``hf-fp8 launch`` as the
single-process reference."""

import json
import sys

import pytest
import tiny_models as tm
import torch
from launcher import HF_FP8, TRAINER_WORKER, WORKER, ranks, run

from hf_fp8 import patch_model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two ranks and one process under hf-fp8 launch, same global batches."""
    two, one, conservative = (tmp_path_factory.mktemp(n) for n in ("two", "one", "conservative"))
    run([([*cmd, str(two)], env) for cmd, env in ranks(2)], two / "log")
    for folder, recipe in ((one, "hybrid-delayed"), (conservative, "conservative")):
        launch = [str(HF_FP8), "launch", "--cpu", "--recipe", recipe, str(WORKER), str(folder)]
        run([(launch, {})], folder / "log")

    def load(folder, rank):
        return json.loads((folder / f"rank{rank}.json").read_text())

    return {
        "ranks": [load(two, 0), load(two, 1)],
        "single": load(one, 0),
        "conservative": load(conservative, 0),
    }


def test_ranks_see_different_amaxes_and_share_their_maximum(runs):
    rank0, rank1 = (r["steps"] for r in runs["ranks"])
    assert all(r["world"] == 2 for r in runs["ranks"])
    for step0, step1 in zip(rank0, rank1, strict=True):
        assert step0["own_amax"] != step1["own_amax"], "the ranks trained on different rows"
        # After the step's backward both ranks hold the same history and scales...
        assert step0["history"] == step1["history"]
        assert step0["scale"] == step1["scale"]
        # ...and the newest entry is the maximum of the ranks' own amaxes of that step, per role.
        newest = [row[0] for row in step0["history"]]
        assert newest == [max(a, b) for a, b in zip(step0["own_amax"], step1["own_amax"], strict=True)]


def test_one_all_reduce_per_step(runs):
    for rank in runs["ranks"]:
        assert [s["all_reduce_calls"] for s in rank["steps"]] == [1] * len(rank["steps"])
    assert all(s["all_reduce_calls"] == 0 for s in runs["single"]["steps"]), (
        "a single process reduces nothing"
    )


@pytest.mark.parametrize("wrap", ["peft", "peft-fp8"])
def test_lora_under_ddp_keeps_each_ranks_own_amaxes(wrap, tmp_path):
    """``peft``: LoRA added after patching makes PEFT's model the root DDP wraps, whose buffer names
    the FP8 layers' ignore list does not know; the steps end at the end of their backward, so DDP's
    next broadcast finds the histories already reduced and equal on every rank. ``peft-fp8``: PEFT
    first, then the frozen base stored in FP8, which DDP broadcasts at start-up."""
    run([([*cmd, str(tmp_path), wrap], env) for cmd, env in ranks(2)], tmp_path / "log")
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text())["steps"] for r in range(2))
    for step0, step1 in zip(rank0, rank1, strict=True):
        assert step0["own_amax"] != step1["own_amax"]
        assert step0["history"] == step1["history"]
        newest = [row[0] for row in step0["history"]]
        assert newest == [max(a, b) for a, b in zip(step0["own_amax"], step1["own_amax"], strict=True)]


def test_loss_matches_a_single_process_on_the_same_global_batch(runs):
    """Same global batch, same scales from step 1 on (the global amax is the single process's amax):
    the ranks' mean loss follows the single-process loss within FP8 rounding."""
    rank0, rank1 = (r["steps"] for r in runs["ranks"])
    for r0, r1, single in zip(rank0, rank1, runs["single"]["steps"], strict=True):
        assert abs((r0["loss"] + r1["loss"]) / 2 - single["loss"]) < 2e-3 * single["loss"]


def test_launcher_hands_the_recipe_to_the_processes(runs):
    assert runs["conservative"]["recipe"]["margin"] == 1
    assert runs["single"]["recipe"]["margin"] == 0


def test_gradient_accumulation_advances_histories_once_per_micro_batch():
    """The rule: a step is a training forward whose backward ran. With N micro-batches per optimizer
    step the histories advance N times, each micro-batch an entry of its own, as with TE's autocast."""
    model = tm.build("llama")
    patch_model(model)
    layer = model.model.layers[0].mlp.down_proj
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # two optimizer steps of three micro-batches
        for micro in range(3):
            (model(**tm.batch_for("llama", 16, seed=micro)).loss / 3).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert layer.fp8_steps.item() == 6  # six forwards, each ended by its backward
    history = layer.amax_history
    assert (history[:, 1:7] > 0).all() and (history[:, 0] == 0).all() and (history[:, 7] == 0).all()


def test_trainer_ranks_skip_a_step_together_when_one_rank_sees_a_nan(tmp_path):
    """Fp8TrainerCallback under DDP: rank 1 alone gets a NaN; the flags are reduced, so both ranks
    skip the step, roll back and go on with the same FP8 state."""
    worker = TRAINER_WORKER
    run([([sys.executable, str(worker), str(tmp_path)], env) for (_, env) in ranks(2)], tmp_path / "log")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in results] == [2, 2]
    assert [r["skipped"] for r in results] == [1, 1]
    assert results[0]["history"] == results[1]["history"]
    assert all(r["finite"] and r["fp8_steps"] == 4 for r in results)
