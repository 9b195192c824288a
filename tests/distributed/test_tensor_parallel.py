"""FP8 under transformers' tensor parallelism (``tp_plan="auto"``), checked with two real processes on
the CPU (gloo) against one process; and the refusal of a model that ``fully_shard`` sharded before
``patch_model``."""

import json
import sys
from pathlib import Path

import pytest
import tiny_models as tm
from launcher import TP_WORKER, ranks, run

STEPS = 5


def load(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    tm.build("llama").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir) -> dict:
    """Five FP8 steps with every decoder layer sharded over two ranks, and in one process."""
    two, one = tmp_path_factory.mktemp("tp"), tmp_path_factory.mktemp("single")
    options = [str(model_dir), "tp", str(STEPS)]
    run([([*cmd, str(two), *options], env) for cmd, env in ranks(2, TP_WORKER)], two / "log")
    run([([sys.executable, str(TP_WORKER), str(one), str(model_dir), "single", str(STEPS)], {})], one / "log")
    return {"ranks": [load(two, 0), load(two, 1)], "single": load(one, 0)}


def test_every_projection_converts_and_keeps_its_layout(runs):
    for result in runs["ranks"]:
        assert result["converted"] == runs["single"]["converted"] == 14
        assert any("tensor parallelism" in note for note in result["notes"])


def test_the_ranks_share_one_fp8_state_and_train_as_one_process(runs):
    """Column-wise (q_proj) and row-wise (down_proj) layers hold the same scales and amaxes on both
    ranks every step; the loss is the one-process loss within FP8's rounding (the first step scales a
    sharded tensor by this rank's own amax), and from the second step on the weights' amaxes are the
    whole weights'."""
    rank0, rank1 = (r["steps"] for r in runs["ranks"])
    single = runs["single"]["steps"]
    for a, b, one in zip(rank0, rank1, single, strict=True):
        assert a["loss"] == b["loss"] and a["loss"] == pytest.approx(one["loss"], rel=5e-3), a["step"]
        for kind in ("colwise", "rowwise"):
            assert a[kind] == b[kind], (a["step"], kind)
            assert all(amax > 0 for amax in a[kind]["amax"]), "the FP8 casts ran and were recorded"
            weight_amax, reference = a[kind]["amax"][1], one[kind]["amax"][1]
            assert weight_amax == pytest.approx(reference, rel=1e-3), (a["step"], kind)


def test_a_model_sharded_by_fully_shard_first_is_refused_and_left_working(model_dir, tmp_path):
    """Weights already DTensors without a tensor-parallel plan: patch_model refuses before changing
    anything, names the weight and what to do, and the sharded model still runs."""
    options = [str(tmp_path), str(model_dir), "fsdp", "0"]
    run([([*cmd, *options], env) for cmd, env in ranks(2, TP_WORKER)], tmp_path / "log")
    for rank in (0, 1):
        result = load(tmp_path, rank)
        assert (
            "is already sharded (a DTensor" in result["refusal"]
            and "Patch before sharding" in result["refusal"]
        )
        assert result["fp8_modules"] == 0 and result["loss_is_finite"]
