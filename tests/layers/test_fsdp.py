"""FP8 training under FSDP2 (``fully_shard``), checked with two real processes on the CPU (gloo)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import tiny_models as tm
import torch
from launcher import FSDP_WORKER, REPO, TRAINER_FSDP_WORKER, free_port, ranks, run

import hf_fp8
from hf_fp8 import E4M3, Fp8Linear, Fp8Recipe
from hf_fp8.layers.fsdp import Fp8ShardedWeight
from hf_fp8.layers.stored_weight import Fp8GatheredWeight, Fp8StoredWeight

WORKER = FSDP_WORKER
STEPS = 6


def result(folder: Path, rank: int = 0) -> dict:
    """What the worker wrote for ``rank``."""
    return json.loads((folder / f"rank{rank}.json").read_text())


def records(folder: Path, rank: int = 0) -> list[dict]:
    return result(folder, rank)["steps"]


def sharded_runs(tmp_path_factory, *options: str) -> dict[str, Path]:
    """Six steps sharded over two ranks; three sharded steps, a checkpoint, and three more resumed
    from it; the worker's ``options`` for all of them."""
    folders = {n: tmp_path_factory.mktemp(n) for n in ("sharded", "first", "resumed")}

    def on_two_ranks(folder: Path, *args: str) -> None:
        run([([*cmd, str(folder), *args, *options], env) for cmd, env in ranks(2, WORKER)], folder / "log")

    on_two_ranks(folders["sharded"], str(STEPS))
    on_two_ranks(folders["first"], "3", "--save-at", "3")
    on_two_ranks(folders["resumed"], str(STEPS), "--resume-from", str(folders["first"] / "checkpoint"))
    return folders


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    """The six steps unsharded, in one process: the reference."""
    folder = tmp_path_factory.mktemp("single")
    run([([sys.executable, str(WORKER), str(folder), str(STEPS)], {})], folder / "log")
    return folder


SHARDINGS = {
    "high-precision all-gather": (),
    "FP8 all-gather": ("--fp8-all-gather",),
    "Accelerate, FP8 all-gather": ("--accelerate", "--fp8-all-gather"),
}


@pytest.fixture(scope="module", params=list(SHARDINGS))
def runs(request, tmp_path_factory, single):
    """The sharded runs, with weights all-gathered in their own dtype or in FP8, sharded by ``fully_shard``
    or by Accelerate's FSDP2 preparation (see the worker), and the reference."""
    options = SHARDINGS[request.param]
    return {
        **sharded_runs(tmp_path_factory, *options),
        "single": single,
        "fp8_all_gather": "--fp8-all-gather" in options,
        "accelerate": "--accelerate" in options,
    }


def test_the_forward_reads_the_weight_as_all_gathered(runs):
    """With fp8_all_gather the gathered weight is FP8, one byte a value (a quarter of these float32
    weights' bytes, half of BF16's); without, the weight in its own dtype."""
    for rank in (0, 1):
        for record in records(runs["sharded"], rank):
            seen = record["weight_seen"]
            if runs["fp8_all_gather"]:
                assert seen["type"] == "Fp8GatheredWeight", record["step"]
                assert seen["dtype"] == "torch.float8_e4m3fn" and seen["bytes"] == seen["numel"]
                if record["step"] > 0:  # cast with the layer's stored scale, refilled in place each step
                    assert seen["gathered_scale"] == seen["layer_scale"] > 0, record["step"]
            else:
                assert seen["dtype"] == "torch.float32" and seen["bytes"] == 4 * seen["numel"]


def test_unpatching_a_sharded_model_is_refused_and_changes_nothing(runs):
    """The worker checks the model is still patched after the refusal."""
    error = result(runs["sharded"])["unpatch_error"]
    assert "fully_shard" in error and "unpatch before sharding" in error


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
        # the weight's amax, taken from each rank's shard at the step's end and reduced: the whole weight's
        # (through Accelerate, of a model loaded in BF16: those weights are rounded to BF16 first)
        tolerance = 1e-2 if runs["accelerate"] else 1e-3
        assert a["history"][1][0] == pytest.approx(reference["history"][1][0], rel=tolerance)


def test_the_optimizer_updates_the_sharded_parameters(runs):
    """Each of the model's sharded parameters, once. Accelerate swaps the optimizer's parameters for the
    sharded ones by their data pointers, so a weight all-gathered in FP8 (a wrapper with no storage of
    its own) must give its values' address."""
    for rank in (0, 1):
        assert result(runs["sharded"], rank)["optimizes_the_model"]


def test_resuming_a_sharded_checkpoint_gives_the_uninterrupted_run(runs):
    uninterrupted = records(runs["sharded"])[3:]
    resumed = records(runs["resumed"])
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a["loss"] == b["loss"] and a["history"] == b["history"] and a["scale"] == b["scale"]
    if runs["accelerate"]:  # accelerator.save_state wrote the FP8 state beside the sharded weights
        checkpoint = runs["first"] / "checkpoint"
        assert (checkpoint / "fp8_state.safetensors").is_file()
        assert (checkpoint / "pytorch_model_fsdp_0").is_dir()


def test_a_gathered_fp8_weight_trains_and_compiles():
    """The layer's side of the FP8 all-gather, in one process: a weight in the form FSDP2 hands it over
    (FP8 values and their scale, trainable) runs the GEMMs as it is, gets its gradient, and compiles."""
    layer = Fp8Linear.from_float(torch.nn.Linear(64, 32, bias=False), Fp8Recipe(fp8_all_gather=True))
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    reference = layer.weight.detach().clone()
    gathered = Fp8StoredWeight.quantize(reference, E4M3, 0)
    weight = torch.nn.Parameter(Fp8GatheredWeight(gathered._data, gathered._scale, reference.dtype), True)
    layer.weight = weight
    # the input cast to E4M3 with its amax's scale (the first step's, and then the stored one: same x)
    expected = Fp8StoredWeight.quantize(x, E4M3, 0).dequantize() @ gathered.dequantize().t()
    for forward in (layer, torch.compile(layer, backend="aot_eager", fullgraph=True)):
        weight.grad = None
        out = forward(x)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        out.sum().backward()
        assert weight.grad is not None and weight.grad.dtype == reference.dtype
        assert weight.grad.shape == reference.shape


def gathered_layer(recipe: Fp8Recipe) -> tuple[Fp8Linear, Fp8StoredWeight]:
    """A layer whose weight is as FSDP2 hands it over after an FP8 all-gather of a one-rank group."""
    layer = Fp8Linear.from_float(torch.nn.Linear(64, 32, bias=False), recipe)
    shard = layer.weight.detach().clone()
    gathered = Fp8StoredWeight.quantize(shard, recipe.forward_format, recipe.margin)
    layer.weight = torch.nn.Parameter(Fp8GatheredWeight(gathered._data, gathered._scale, shard.dtype), True)
    layer.fp8_gathered_shard = shard
    return layer, gathered


def test_the_gemm_writes_no_state_for_a_gathered_weight_and_the_step_end_records_its_scale():
    """A compiled forward that wrote the gathered weight's scale into the layer's state handed cuBLAS a
    misaligned scale in its backward (two H200s, torch 2.11). The state still says what was applied:
    delayed scaling takes it from the amax history at the step's end, current scaling from the step's
    reduced amax."""
    for scaling in ("delayed", "current"):
        layer, gathered = gathered_layer(Fp8Recipe(scaling=scaling, fp8_all_gather=True))
        layer(torch.randn(16, 64)).sum().backward()
        assert layer.scale[1] == 0, "nothing written by the GEMMs"
        hf_fp8.update_fp8_scales(layer)
        assert torch.equal(layer.scale[1], gathered._scale), scaling


def test_hf_fp8_compile_compiles_the_fp8_all_gather():
    model = tm.build("llama")
    hf_fp8.patch_model(model, "fsdp-fp8", backend="native")
    hf_fp8.compile(model, backend="aot_eager")
    for step in range(3):  # the first step's graph (no history yet), then the steady state's
        loss = model(**tm.batch_for("llama", 16, seed=step)).loss
        loss.backward()
        assert torch.isfinite(loss)
    assert all(b._compiled_call_impl is not None for b in model.model.layers)


def test_a_head_whose_forward_stays_in_high_precision_is_not_gathered_in_fp8():
    """Its forward reads the weight in high precision: gathered in FP8, its logits would be rounded."""
    model = tm.build("llama")
    report = hf_fp8.patch_model(model, Fp8Recipe(fp8_all_gather=True, convert_lm_head="backward"))
    assert type(model.lm_head.weight) is torch.nn.Parameter
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, Fp8ShardedWeight)
    assert "a forward in high precision" in " ".join(report.notes)


def test_a_copied_model_gathers_with_its_own_layers():
    model = tm.build("llama")
    hf_fp8.patch_model(model, Fp8Recipe(fp8_all_gather=True), backend="native")
    copied = copy.deepcopy(model)
    layer = copied.model.layers[0].mlp.up_proj
    assert isinstance(layer.weight, Fp8ShardedWeight) and layer.weight.layer is layer
    assert isinstance(layer.weight, torch.nn.Parameter) and layer.weight.requires_grad


@pytest.mark.gpu
def test_gpu_one_rank_all_gathers_in_fp8_through_the_triton_copies(tmp_path):
    """FSDP2 over one GPU with NCCL: the all-gather hook casts the shard with one Triton kernel and the
    input gradient reads the Triton transpose of the gathered weight; the run trains as the unsharded
    FP8 run does, its weight cast with the same scale."""
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    sharded.mkdir(), single.mkdir()
    options = [str(STEPS), "--fp8-all-gather", "--device", "cuda"]
    run([([*cmd, str(sharded), *options], env) for cmd, env in ranks(1, WORKER)], sharded / "log")
    run([([sys.executable, str(WORKER), str(single), str(STEPS), "--device", "cuda"], {})], single / "log")
    for a, ref in zip(records(sharded), records(single), strict=True):
        assert a["weight_seen"]["type"] == "Fp8GatheredWeight"
        assert a["weight_seen"]["bytes"] == a["weight_seen"]["numel"]
        assert a["loss"] == pytest.approx(ref["loss"], rel=5e-3), a["step"]
        assert a["scale"][1] == pytest.approx(ref["scale"][1], rel=1e-2), a["step"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_two_ranks_train_with_the_fp8_all_gather(tmp_path_factory):
    """The gloo checks above, on two GPUs with NCCL: FP8 on the wire, one FP8 state, the unsharded losses,
    and a resumed run that follows the uninterrupted one (up to the GPU's nondeterministic kernels)."""
    options = ("--fp8-all-gather", "--device", "cuda")
    runs = sharded_runs(tmp_path_factory, *options)
    single = tmp_path_factory.mktemp("single_gpu")
    run([([sys.executable, str(WORKER), str(single), str(STEPS), "--device", "cuda"], {})], single / "log")
    rank0, rank1, reference = records(runs["sharded"], 0), records(runs["sharded"], 1), records(single)
    for a, b, ref in zip(rank0, rank1, reference, strict=True):
        assert a["weight_seen"]["type"] == "Fp8GatheredWeight"
        assert a["weight_seen"]["bytes"] == a["weight_seen"]["numel"]
        assert a["history"] == b["history"] and a["scale"] == b["scale"], a["step"]
        assert (a["loss"] + b["loss"]) / 2 == pytest.approx(ref["loss"], rel=5e-3), a["step"]
    for a, b in zip(records(runs["resumed"]), rank0[3:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("config", "gpus"), [("fsdp2.yaml", 2), ("hsdp.yaml", 4)])
def test_gpu_hf_fp8_launch_with_the_accelerate_fsdp2_config(tmp_path, config, gpus):
    """The README's command: ``hf-fp8 launch --config_file examples/fsdp2.yaml --recipe fsdp-fp8`` and a
    script with ``prepare_fp8``, and the same with examples/hsdp.yaml (Accelerate's ParallelismConfig: two
    replicas of two FSDP2 shards): the weights are all-gathered in FP8, every rank holds one FP8 state,
    and a run resumed from ``accelerator.save_state`` follows the uninterrupted one."""
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    # the command as a module: a GPU host may have the checkout on PYTHONPATH, not the console script
    launch = [
        sys.executable,
        "-m",
        "hf_fp8.apps.cli",
        "launch",
        "--config_file",
        str(REPO / "examples" / config),
    ]
    launch += ["--recipe", "fsdp-fp8", "--main_process_port", str(free_port()), str(WORKER)]
    options = ("--accelerate", "--fp8-all-gather", "--device", "cuda")
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    for folder in (first, resumed):
        folder.mkdir()
    run([([*launch, str(first), str(STEPS), "--save-at", "3", *options], {})], first / "log")
    checkpoint = first / "checkpoint"
    assert (checkpoint / "fp8_state.safetensors").is_file()
    resume = ("--resume-from", str(checkpoint))
    run([([*launch, str(resumed), str(STEPS), *resume, *options], {})], resumed / "log")
    on_ranks = [records(first, rank) for rank in range(gpus)]
    for a, *others in zip(*on_ranks, strict=True):
        assert a["weight_seen"]["type"] == "Fp8GatheredWeight", a["step"]
        assert a["weight_seen"]["bytes"] == a["weight_seen"]["numel"]
        assert all(a["history"] == b["history"] and a["scale"] == b["scale"] for b in others), a["step"]
    assert all(
        result(first, r)["optimizes_the_model"] and result(first, r)["world"] == gpus for r in range(gpus)
    )
    again = records(resumed)
    assert [r["step"] for r in again] == [3, 4, 5]
    for a, b in zip(again, on_ranks[0][3:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), a["step"]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_gpu_trainer_with_an_fsdp2_config_all_gathers_in_fp8_and_resumes(tmp_path):
    """``TrainingArguments(fsdp="full_shard auto_wrap", fsdp_config={"fsdp_version": 2, ...})`` with
    ``Fp8TrainerCallback("fsdp-fp8")`` on two GPUs: sharded, FP8 on the wire, one FP8 state, checkpoints
    with the FP8 state, and a resumed run that follows the uninterrupted one."""
    worker = TRAINER_FSDP_WORKER
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    run([([*cmd, str(first)], env) for cmd, env in ranks(2, worker)], tmp_path / "first.log")
    assert (first / "checkpoint-3" / "fp8_state.safetensors").is_file()
    resume = ("--resume-from", str(first / "checkpoint-3"))
    run([([*cmd, str(resumed), *resume], env) for cmd, env in ranks(2, worker)], tmp_path / "resumed.log")
    a, b = result(first, 0), result(first, 1)
    assert a["fsdp"] and b["fsdp"]
    for x, y in zip(a["steps"], b["steps"], strict=True):
        assert x["weight_seen"]["type"] == "Fp8GatheredWeight" and x["weight_seen"]["dtype"].startswith(
            "torch.float8"
        )
        assert x["history"] == y["history"] and x["scale"] == y["scale"], x["step"]
    again = result(resumed, 0)
    assert [s["step"] for s in again["steps"]] == [4, 5, 6]
    for step in ("4", "5", "6"):
        assert again["losses"][step] == pytest.approx(a["losses"][step], rel=1e-3), step


HSDP_WORLD = 4


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> dict[str, Path]:
    """HSDP on four ranks (two replicas, each sharding over two ranks), weights all-gathered in FP8 within
    each replica: six steps with a checkpoint after the third, and three more resumed from it."""
    folders = {n: tmp_path_factory.mktemp(f"hsdp-{n}") for n in ("sharded", "resumed")}

    def on_four_ranks(folder: Path, *args: str) -> None:
        commands = ranks(HSDP_WORLD, WORKER)
        run(
            [([*cmd, str(folder), *args, "--hsdp", "--fp8-all-gather"], env) for cmd, env in commands],
            folder / "log",
        )

    on_four_ranks(folders["sharded"], str(STEPS), "--save-at", "3")
    on_four_ranks(folders["resumed"], str(STEPS), "--resume-from", str(folders["sharded"] / "checkpoint"))
    return folders


def test_hsdp_ranks_share_one_fp8_state_and_train_as_one_process(hsdp, single):
    """Every rank of both replicas holds the same FP8 state each step (one amax all-reduce over all four);
    the weight's amax is the whole weight's, the mean of the ranks' losses the one-process loss, and the
    forward reads its weight all-gathered in FP8 within its replica."""
    runs = [records(hsdp["sharded"], rank) for rank in range(HSDP_WORLD)]
    reference = records(single)
    for step, (*on_ranks, one) in enumerate(zip(*runs, reference, strict=True)):
        first = on_ranks[0]
        assert all(r["history"] == first["history"] and r["scale"] == first["scale"] for r in on_ranks), step
        assert all(
            r["weight_is_sharded"] and r["weight_seen"]["type"] == "Fp8GatheredWeight" for r in on_ranks
        )
        assert sum(r["loss"] for r in on_ranks) / HSDP_WORLD == pytest.approx(one["loss"], rel=5e-3), step
        assert first["history"][1][0] == pytest.approx(one["history"][1][0], rel=1e-3), step


def test_hsdp_resumes_exactly(hsdp):
    uninterrupted = records(hsdp["sharded"])[3:]
    resumed = records(hsdp["resumed"])
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a["loss"] == b["loss"] and a["history"] == b["history"] and a["scale"] == b["scale"]
