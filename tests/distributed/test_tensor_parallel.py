"""FP8 under transformers' N-D parallelism, the layouts ``DistributedConfig`` builds while it loads:
tensor parallelism (two ranks), FSDP2 x TP and HSDP (four ranks), each checked with real gloo processes
on the CPU against one process; a two-node launch (``hf-fp8 launch`` with examples/two_nodes.yaml, two
node ranks on one host) of examples/nd_parallel.py that a one-node run resumes exactly; and the refusal
of what a model sharded before patching cannot honour."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import tiny_models as tm
from background_runs import ONE_THREAD
from launcher import HF_FP8, REPO, TP_WORKER, free_port, ranks, run

STEPS = 5
LAYOUTS = {"tp": 2, "fsdp-tp": 4, "hsdp": 4}  # and their number of ranks
EXAMPLE = REPO / "examples" / "nd_parallel.py"


def load(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    tm.build("llama").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir) -> dict:
    """Five FP8 steps under each layout, and in one process."""
    folders = {n: tmp_path_factory.mktemp(n) for n in (*LAYOUTS, "single")}
    for layout, world in LAYOUTS.items():
        options = [str(folders[layout]), str(model_dir), layout, str(STEPS)]
        run([([*cmd, *options], env) for cmd, env in ranks(world, TP_WORKER)], folders[layout] / "log")
    single = [sys.executable, str(TP_WORKER), str(folders["single"]), str(model_dir), "single", str(STEPS)]
    run([(single, {})], folders["single"] / "log")
    results = {layout: [load(folders[layout], r) for r in range(world)] for layout, world in LAYOUTS.items()}
    return {**results, "single": load(folders["single"], 0)}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_projection_converts_and_the_report_names_the_layout(runs, layout):
    for result in runs[layout]:
        assert result["converted"] == runs["single"]["converted"] == 14
        notes = " ".join(result["notes"])
        assert ("tensor parallelism" in notes) == (layout != "hsdp"), notes
        assert ("FSDP2 sharded the model before patching" in notes) == (layout != "tp"), notes


def test_an_fsdp2_unit_of_its_own_stays_in_high_precision_and_says_why(runs):
    """Under HSDP the output head is sharded as a unit of its own (transformers' fsdp_plan): asked to
    convert it (convert_lm_head), patch_model keeps it and says why."""
    for result in runs["hsdp"]:
        assert "FSDP2 unit of its own" in result["kept"]["lm_head"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_ranks_share_one_fp8_state_and_train_as_one_process(runs, layout):
    """Column-wise (q_proj) and row-wise (down_proj) layers hold the same scales and amaxes on every rank
    every step, and the weight amax they record is the whole weight's, not a shard's (each step's end
    reduces the amaxes over the ranks); the mean loss of the data shares is the one-process loss within
    FP8's rounding (the first step scales a sharded tensor by this rank's own amax)."""
    results = runs[layout]
    shares = {r["share"]: r for r in results}
    assert len(shares) == results[0]["shares"] == len(results) // (1 if layout == "hsdp" else 2)
    for result in results:  # the ranks of one tensor-parallel group compute one loss
        assert [s["loss"] for s in result["steps"]] == [s["loss"] for s in shares[result["share"]]["steps"]]
    for step, one in enumerate(runs["single"]["steps"]):
        records = [r["steps"][step] for r in results]
        mean = sum(r["steps"][step]["loss"] for r in shares.values()) / len(shares)
        assert mean == pytest.approx(one["loss"], rel=5e-3), step
        for kind in ("colwise", "rowwise"):
            assert all(r[kind] == records[0][kind] for r in records), (step, kind)
            assert all(amax > 0 for amax in records[0][kind]["amax"]), "the FP8 casts ran and were recorded"
            weight_amax = records[0][kind]["amax"][1]
            assert weight_amax == pytest.approx(records[0]["whole_weight_amax"][kind], rel=1e-6), (step, kind)


def test_unpatching_a_sharded_model_is_refused_with_the_reason(runs):
    """Its FP8 layers carry the layout; a plain model comes from its state_dict instead. One process
    unpatches as usual."""
    for layout in LAYOUTS:
        for result in runs[layout]:
            assert "sharded" in result["unpatch"] and "state_dict" in result["unpatch"], layout
    assert runs["single"]["unpatch"] is None


def test_what_a_sharded_model_cannot_take_leaves_it_as_it_was(model_dir, tmp_path):
    """Weights all-gathered in FP8 (fsdp-fp8) asked of a model that fully_shard wrapped already (they must
    be FP8 before sharding) and of a tensor-parallel one (its weights are never all-gathered) are refused
    before anything changes, saying what to do; a patch of a fully_shard-first model that fails after its
    walk is undone with FSDP2's records. Each model then computes the loss it computed before and trains."""
    options = [str(tmp_path), str(model_dir), "refusals", "0"]
    run([([*cmd, *options], env) for cmd, env in ranks(2, TP_WORKER)], tmp_path / "log")
    for rank in (0, 1):
        result = load(tmp_path, rank)
        sharded_first, tensor_parallel = result["fully_shard"]["error"], result["tp"]["error"]
        assert "fp8_all_gather" in sharded_first and "Patch before sharding" in sharded_first
        assert "tensor parallelism" in tensor_parallel and "fp8_all_gather" in tensor_parallel
        assert "attach failed on purpose" in result["failed attach"]["error"]
        assert all(r["fp8_modules"] == 0 and r["same_loss"] for r in result.values()), result


def test_the_trainer_callback_patches_a_model_transformers_sharded(model_dir, tmp_path):
    """The Trainer with Fp8TrainerCallback on a model FSDP2 sharded as it loaded (two gloo ranks): the
    callback patches it, every step ends (amaxes of the forward and the backward recorded) and both ranks
    hold one FP8 state."""
    options = [str(tmp_path), str(model_dir), "trainer", "3"]
    run([([*cmd, *options], env) for cmd, env in ranks(2, TP_WORKER)], tmp_path / "log")
    results = [load(tmp_path, rank) for rank in (0, 1)]
    for result in results:
        assert any("FSDP2 sharded the model before patching" in note for note in result["notes"])
        assert len(result["losses"]) == 3 and result["fp8_steps"] == 3
        for kind in ("colwise", "rowwise"):
            assert result[kind] == results[0][kind] and all(a > 0 for a in result[kind]["amax"]), kind


def example_losses(log: Path) -> dict[int, float]:
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith('{"step"')]
    return {line["step"]: line["loss"] for line in lines}


def test_a_two_node_launch_trains_and_a_one_node_run_resumes_it_exactly(model_dir, tmp_path):
    """examples/nd_parallel.py, FSDP2 x TP (2 x 2), started by hf-fp8 launch with examples/two_nodes.yaml
    as two node ranks of two processes on one host, saves after step 2; the same script started as four
    ranks of one node resumes from that checkpoint and trains steps 2 and 3 to the same losses."""
    checkpoint = str(tmp_path / "checkpoint")
    script = [str(EXAMPLE), str(model_dir), "--fsdp", "2", "--tp", "2", "--steps", "4", "--seq-len", "32"]
    config = str(REPO / "examples" / "two_nodes.yaml")
    launch = [str(HF_FP8), "launch", "--config_file", config, "--num_processes", "4"]
    rendezvous = ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    saving = ["--recipe", "hybrid-delayed", *script, "--lr", "1e-3", "--save-at", "2", "--out", checkpoint]
    nodes = [  # one thread a process, as accelerate gives its processes: the same arithmetic
        ([*launch, "--machine_rank", str(node), *rendezvous, *saving], ONE_THREAD) for node in (0, 1)
    ]
    run(nodes, tmp_path / "two-nodes.log")
    resumed = [*script, "--lr", "1e-3", "--recipe", "hybrid-delayed", "--resume-from", checkpoint]
    run([([cmd[0], *resumed], {**env, **ONE_THREAD}) for cmd, env in ranks(4)], tmp_path / "one-node.log")
    two_nodes = example_losses(tmp_path / "two-nodes.log")
    one_node = example_losses(tmp_path / "one-node.log")
    assert sorted(two_nodes) == [0, 1, 2, 3] and sorted(one_node) == [2, 3]
    assert all(one_node[step] == two_nodes[step] for step in (2, 3)), (one_node, two_nodes)
