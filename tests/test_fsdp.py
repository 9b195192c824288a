"""FP8 training under FSDP2 (``fully_shard``), checked with two real processes on the CPU (gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_distributed import ranks, run

WORKER = Path(__file__).with_name("dist_fsdp_worker.py")
STEPS = 6


def records(folder: Path, rank: int = 0) -> list[dict]:
    return json.loads((folder / f"rank{rank}.json").read_text())["steps"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Six steps sharded over two ranks; the same unsharded; three sharded steps, a checkpoint, and
    three more resumed from it."""
    folders = {n: tmp_path_factory.mktemp(n) for n in ("sharded", "single", "first", "resumed")}
    run(
        [([*cmd, str(folders["sharded"]), str(STEPS)], env) for cmd, env in ranks(2, WORKER)],
        folders["sharded"] / "log",
    )
    run([([sys.executable, str(WORKER), str(folders["single"]), str(STEPS)], {})], folders["single"] / "log")
    first = [([*cmd, str(folders["first"]), "3", "--save-at", "3"], env) for cmd, env in ranks(2, WORKER)]
    run(first, folders["first"] / "log")
    checkpoint = str(folders["first"] / "checkpoint")
    resumed = [
        ([*cmd, str(folders["resumed"]), str(STEPS), "--resume-from", checkpoint], env)
        for cmd, env in ranks(2, WORKER)
    ]
    run(resumed, folders["resumed"] / "log")
    return folders


def test_sharded_ranks_hold_the_same_fp8_state_every_step(runs):
    rank0, rank1 = records(runs["sharded"], 0), records(runs["sharded"], 1)
    assert len(rank0) == len(rank1) == STEPS
    for a, b in zip(rank0, rank1, strict=True):
        assert a["weight_is_sharded"] and b["weight_is_sharded"]
        assert a["history"] == b["history"] and a["scale"] == b["scale"], a["step"]
        assert all(row[0] > 0 for row in a["history"]), "the newest step's amaxes are recorded"


def test_sharded_training_matches_the_unsharded_run(runs):
    """Each rank's loss is the mean over its half of the global batch: their mean is the global loss.
    Not bit for bit: the first step scales each tensor by its own amax, which is a half batch's on
    each rank, and the ranks sum their weight gradients in another order than one GEMM does."""
    rank0, rank1, single = records(runs["sharded"], 0), records(runs["sharded"], 1), records(runs["single"])
    for a, b, reference in zip(rank0, rank1, single, strict=True):
        assert (a["loss"] + b["loss"]) / 2 == pytest.approx(reference["loss"], rel=5e-3), a["step"]
    for a, reference in zip(rank0, single, strict=True):
        # each rank's gradient is of its half batch's mean loss: twice the whole batch's (a factor FP8
        # scaling takes exactly)
        assert a["history"][2][0] == pytest.approx(2 * reference["history"][2][0], rel=5e-2)


def test_resuming_a_sharded_checkpoint_gives_the_uninterrupted_run(runs):
    uninterrupted = records(runs["sharded"])[3:]
    resumed = records(runs["resumed"])
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a["loss"] == b["loss"] and a["history"] == b["history"] and a["scale"] == b["scale"]
