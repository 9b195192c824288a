"""DeepSpeed ZeRO through the Trainer's ``deepspeed=`` argument with Fp8TrainerCallback, checked with real
processes on the CPU (DeepSpeed's CPU accelerator, gloo, two ranks): ZeRO-3 with every weight partitioned,
ZeRO-2 and ZeRO-1, one FP8 state on every rank, the amax of each whole weight, an exact resume, ZeRO-3's
decoder blocks gathered whole. On two GPUs (marked ``gpu``): ``hf-fp8 launch`` with the Accelerate config
examples/deepspeed_zero3.yaml and a ``prepare_fp8`` loop, ZeRO-2 and ZeRO-3, saved and resumed."""

import json
import shutil
import sys

import pytest
import torch
from launcher import ACCELERATE_DEEPSPEED_WORKER, DEEPSPEED_WORKER, REPO, free_port, ranks, run

from hf_fp8.numerics.scaling import WEIGHT


def train(folder, stage: int, steps: int, checkpoint=None, *options: str, gpus: bool = False) -> list[dict]:
    """Both ranks' results (see dist_deepspeed_worker.py)."""
    arguments = [str(folder), str(stage), str(steps), *options]
    arguments += ["--checkpoint", str(checkpoint)] if checkpoint else []
    device = {"DS_ACCELERATOR": "cuda" if gpus else "cpu"}
    run([([*cmd, *arguments], {**env, **device}) for cmd, env in ranks(2, DEEPSPEED_WORKER)], folder / "log")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def full_and_resumed(tmp_path_factory, stage: int, gpus: bool = False) -> dict[str, list[dict]]:
    """Four steps under ZeRO ``stage``, then the same run resumed from its checkpoint after step 2."""
    full, resumed = tmp_path_factory.mktemp("full"), tmp_path_factory.mktemp("resumed")
    results = {"full": train(full, stage, 4, gpus=gpus)}
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    results["resumed"] = train(resumed, stage, 4, resumed / "checkpoint-2", gpus=gpus)
    return results


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return full_and_resumed(tmp_path_factory, 3)


@pytest.fixture(scope="module")
def zero2(tmp_path_factory):
    return full_and_resumed(tmp_path_factory, 2)


def test_gathering_blocks_whole_trains_as_gathering_layer_by_layer(zero3, tmp_path):
    layer_by_layer = train(tmp_path, 3, 4, None, "--layer-by-layer")[0]
    assert not layer_by_layer["block_leaf"] and layer_by_layer["hooked"] == [True, True]
    whole = zero3["full"][0]
    assert whole["losses"] == layer_by_layer["losses"] and whole["history"] == layer_by_layer["history"]


def test_lora_trains_its_adapters_over_fp8_gemms_under_zero3(tmp_path):
    """LoRA (the base weights in BF16, frozen, partitioned) under ZeRO-3: the base layers run their GEMMs
    in FP8 with one FP8 state on both ranks, and only the adapters train. The blocks are gathered layer
    by layer: DeepSpeed's whole-block gathers fail when the first block's input needs no gradient."""
    ranks_ = train(tmp_path, 3, 2, None, "--lora")
    for rank in ranks_:
        assert rank["type"] == "Fp8Linear" and rank["partitioned"] and not rank["block_leaf"]
        assert rank["trainable"] == ["lora"]
        assert any("gather their weights layer by layer" in note for note in rank["notes"])
    assert ranks_[0]["history"] == ranks_[1]["history"] and ranks_[0]["fp8_steps"] == 2
    assert all(ranks_[0]["history"][role][1] > 0 for role in range(3))


@pytest.fixture(scope="module")
def zero1(tmp_path_factory):
    return {"full": train(tmp_path_factory.mktemp("zero1"), 1, 3)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_rank_trains_the_fp8_layers_with_one_fp8_state(stage, request):
    ranks_ = request.getfixturevalue(f"zero{stage}")["full"]
    assert [r["type"] for r in ranks_] == ["Fp8Linear"] * 2
    assert [r["partitioned"] for r in ranks_] == [stage == 3] * 2
    assert any(f"DeepSpeed (ZeRO-{stage})" in note for note in ranks_[0]["notes"])
    assert ranks_[0]["history"] == ranks_[1]["history"] and ranks_[0]["scale"] == ranks_[1]["scale"]
    history = ranks_[0]["history"]
    steps = ranks_[0]["fp8_steps"]
    assert all(history[role][slot] > 0 for role in range(3) for slot in range(1, steps + 1))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_step_records_the_amax_of_the_whole_weight(stage, request):
    """A step's end records the weight the optimizer step before it left: under ZeRO-3 each rank reads
    its partition only (the parameter itself is empty then) and the all-reduce gives the whole
    weight's; it once read the empty parameter and kept the first scale for ever."""
    result = request.getfixturevalue(f"zero{stage}")["full"][0]
    recorded = result["history"][WEIGHT][1 : result["fp8_steps"] + 1]  # newest first
    assert recorded == list(reversed(result["weight_amaxes"][:-1]))


def test_zero3_gathers_each_decoder_block_whole(zero3):
    """patch_model (the callback's, before deepspeed.initialize) made each block a ZeRO-3 leaf module:
    DeepSpeed hooked the block and nothing inside it, so a compiled block stays one graph."""
    for rank in zero3["full"]:
        assert rank["block_leaf"] and rank["hooked"] == [True, False]
        assert any("gathers its weights as one unit" in note for note in rank["notes"])


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_resumes_from_a_checkpoint_exactly(stage, request):
    results = request.getfixturevalue(f"zero{stage}")
    full, resumed = results["full"][0], results["resumed"][0]
    assert resumed["fp8_steps"] == full["fp8_steps"] == 4
    assert resumed["history"] == full["history"] and resumed["scale"] == full["scale"]
    assert resumed["losses"][2:] == full["losses"][2:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("stage", [2, 3])
def test_gpu_hf_fp8_launch_with_the_accelerate_deepspeed_config(stage, tmp_path):
    """``hf-fp8 launch --config_file examples/deepspeed_zero3.yaml`` (``--zero_stage 2`` for ZeRO-2) and a
    loop with ``prepare_fp8`` on two GPUs: FP8 layers inside DeepSpeed's engine, ZeRO-3's blocks gathered
    whole, one FP8 state on both ranks, and a run resumed from ``accelerator.save_state`` that follows the
    uninterrupted one."""
    config = REPO / "examples" / "deepspeed_zero3.yaml"
    # the command as a module: a GPU host may have the checkout on PYTHONPATH, not the console script
    launch = [sys.executable, "-m", "hf_fp8.apps.cli", "launch", "--config_file", str(config)]
    launch += ["--zero_stage", str(stage), "--recipe", "hybrid-delayed"]
    launch += ["--main_process_port", str(free_port()), str(ACCELERATE_DEEPSPEED_WORKER)]
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    for folder in (first, resumed):
        folder.mkdir()
    run([([*launch, str(first), "5", "--save-at", "3"], {})], first / "log")
    assert (first / "checkpoint" / "fp8_state.safetensors").is_file()
    resume = ("--save-at", "3", "--resume-from", str(first / "checkpoint"))
    run([([*launch, str(resumed), "5", *resume], {})], resumed / "log")
    rank0, rank1 = (json.loads((first / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["engine"] == "DeepSpeedEngine" and rank0["zero_stage"] == stage
    assert rank0["type"] == "Fp8Linear" and rank0["partitioned"] == (stage == 3)
    assert rank0["block_leaf"] == (stage == 3)
    assert any(f"DeepSpeed (ZeRO-{stage})" in note for note in rank0["notes"])
    for a, b in zip(rank0["steps"], rank1["steps"], strict=True):
        assert a["loss"] != b["loss"]  # each rank its own batches
        assert a["history"] == b["history"] and a["scale"] == b["scale"], a["step"]
    again = json.loads((resumed / "rank0.json").read_text())["steps"]
    assert [s["step"] for s in again] == [4, 5]
    for a, b in zip(again, rank0["steps"][3:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), a["step"]
        assert a["scale"] == pytest.approx(b["scale"], rel=1e-3), a["step"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("stage", [2, 3])
def test_gpu_trainer_with_a_deepspeed_config_trains_and_resumes(stage, tmp_path_factory):
    """The Trainer's ``deepspeed=`` with examples/deepspeed_zero<N>.json and Fp8TrainerCallback on two
    GPUs (NCCL, BF16): one FP8 state on both ranks, ZeRO-3's blocks gathered whole, and a run resumed
    from a checkpoint that follows the uninterrupted one (up to the GPU's nondeterministic kernels)."""
    results = full_and_resumed(tmp_path_factory, stage, gpus=True)
    full, resumed = results["full"], results["resumed"][0]
    assert [r["partitioned"] for r in full] == [r["block_leaf"] for r in full] == [stage == 3] * 2
    assert full[0]["history"] == full[1]["history"] and full[0]["scale"] == full[1]["scale"]
    assert all(full[0]["history"][role][slot] > 0 for role in range(3) for slot in range(1, 5))
    assert resumed["fp8_steps"] == 4
    assert resumed["losses"][2:] == pytest.approx(full[0]["losses"][2:], rel=1e-3)
    assert resumed["scale"] == pytest.approx(full[0]["scale"], rel=1e-3)
