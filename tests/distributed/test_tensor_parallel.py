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
    """Five FP8 steps with every decoder layer sharded over two ranks, a checkpoint after the third, and
    two more resumed from it; and the five steps in one process."""
    folders = {n: tmp_path_factory.mktemp(n) for n in ("tp", "resumed", "single")}

    def on_two_ranks(folder: Path, *extra: str) -> None:
        options = [str(folder), str(model_dir), "tp", str(STEPS), *extra]
        run([([*cmd, *options], env) for cmd, env in ranks(2, TP_WORKER)], folder / "log")

    on_two_ranks(folders["tp"], "3")
    on_two_ranks(folders["resumed"], str(folders["tp"] / "checkpoint"))
    single = [sys.executable, str(TP_WORKER), str(folders["single"]), str(model_dir), "single", str(STEPS)]
    run([(single, {})], folders["single"] / "log")
    return {
        "ranks": [load(folders["tp"], 0), load(folders["tp"], 1)],
        "resumed": [load(folders["resumed"], 0), load(folders["resumed"], 1)],
        "single": load(folders["single"], 0),
    }


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
    """A model that fully_shard wrapped already: patch_model refuses before changing anything, says
    what to do, and the sharded model still runs."""
    options = [str(tmp_path), str(model_dir), "fsdp", "0"]
    run([([*cmd, *options], env) for cmd, env in ranks(2, TP_WORKER)], tmp_path / "log")
    for rank in (0, 1):
        result = load(tmp_path, rank)
        assert (
            "is already sharded by FSDP2" in result["refusal"]
            and "Patch before sharding" in result["refusal"]
        )
        assert result["fp8_modules"] == 0 and result["loss_is_finite"]


def test_resuming_a_tensor_parallel_checkpoint_gives_the_uninterrupted_run(runs):
    for rank in (0, 1):
        uninterrupted, resumed = runs["ranks"][rank]["steps"][3:], runs["resumed"][rank]["steps"]
        assert [r["step"] for r in resumed] == [3, 4]
        assert resumed == uninterrupted


def test_unpatching_a_tensor_parallel_model_is_refused_with_the_reason(runs):
    """Its FP8 layers carry the layout's forward; a plain model comes from its state_dict instead. One
    process unpatches as usual."""
    for result in runs["ranks"]:
        assert "tensor parallelism" in result["unpatch"] and "state_dict" in result["unpatch"]
    assert runs["single"]["unpatch"] is None
