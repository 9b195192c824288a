"""Every script in examples/, run as a user runs it (a process of its own, see :mod:`forked`), with tiny
settings."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import forked
import pytest
from background_runs import ONE_THREAD, BackgroundRuns, selected_tests
from demo_data import needs_demo_data

from hf_fp8.recipe import LAUNCHER_ENV, RECIPES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = ("--steps", "2", "--batch-size", "1", "--seq-len", "32")
LAUNCHED = {LAUNCHER_ENV: RECIPES["conservative"].to_yaml()}
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
)
LAYER_NAMES = {"lm_head"} | {
    f"model.layers.{i}.{p}" for i in range(30) for p in (*PROJECTIONS, "mlp.up_proj")
}
LAYER_NAMES |= {f"model.layers.{i}.mlp.down_proj" for i in range(30)}


def example(
    name: str, *args: str, env: dict | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return forked.run([sys.executable, str(EXAMPLES / name), *args], {**os.environ, **(env or {})}, cwd)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


class Run(NamedTuple):
    test: str  # the test that reads its output
    script: str
    args: tuple[str, ...]
    env: dict | None = None
    demo: bool = True  # it needs the demo's data (SmolLM2, Shakespeare)


def long_runs(out: Path) -> dict[str, Run]:
    """The runs of 5 s and more, by name, in the order they start (the longest first, the TRL ones last: they
    run beside the short tests before theirs); their output folders under ``out``."""
    one_step = ("--steps", "1", "--batch-size", "1", "--seq-len", "16")
    trl = ("--steps", "1", "--batch-size", "2", "--seq-len", "48")
    return {
        "resume": Run(
            "test_trainer_example_resumes_exactly",
            "trainer_finetune.py",
            (*TINY, "--out", str(out / "resume" / "run"), "--resume-check"),
        ),
        "compare": Run(
            "test_compare_precision_finds_fp8_error_is_the_rounding_of_its_operands",
            "compare_precision.py",
            ("--seq-len", "32", "--top", "3"),
        ),
        "accelerate": Run(
            "test_accelerate_loop_uses_the_launchers_recipe_when_given", "accelerate_loop.py", TINY
        ),
        "accelerate launched": Run(
            "test_accelerate_loop_uses_the_launchers_recipe_when_given",
            "accelerate_loop.py",
            one_step,
            LAUNCHED,
        ),
        "lora": Run(
            "test_lora_example_saves_an_adapter_and_merges_it",
            "lora_fp8.py",
            (*TINY, "--out", str(out / "lora" / "adapter")),
        ),
        "trainer": Run(
            "test_trainer_example_runs_a_single_step",
            "trainer_finetune.py",
            (*one_step, "--out", str(out / "trainer")),
        ),
        "train_loop": Run(
            "test_train_loop_honours_the_launchers_recipe", "train_loop.py", ("--steps", "2"), demo=False
        ),
        "train_loop launched": Run(
            "test_train_loop_honours_the_launchers_recipe",
            "train_loop.py",
            ("--steps", "1"),
            LAUNCHED,
            demo=False,
        ),
        **{
            f"trl {trainer}": Run(
                f"test_trl_examples_train_in_fp8[{trainer}]",
                f"trl_{trainer}.py",
                (*trl, "--out", str(out / f"trl-{trainer}"), *extra),
            )
            for trainer, extra in (("dpo", ()), ("grpo", ("--completion", "8")), ("sft", ()))
        },
    }


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The long runs of the selected tests, all started when the first of them asks for one."""
    out, selected = tmp_path_factory.mktemp("runs"), selected_tests(request)
    demo_missing = needs_demo_data.args[0]
    calls = {
        name: functools.partial(ok_example, run.script, *run.args, env={**(run.env or {}), **ONE_THREAD})
        for name, run in long_runs(out).items()
        if run.test in selected and not (run.demo and demo_missing)
    }
    started = BackgroundRuns(calls, out)
    yield started
    started.close()


def ok_example(script: str, *args: str, env: dict) -> str:
    return ok(example(script, *args, env=env))


@needs_demo_data
def test_compare_precision_finds_fp8_error_is_the_rounding_of_its_operands(runs):
    out = runs.output("compare")
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    assert len(rows) == 3 and all(row.split(" | ")[0][2:] in LAYER_NAMES for row in rows), rows
    match = re.search(
        r"(\d+) layers; mean FP8 error ([\d.e+-]+); largest FP8 GEMM vs rounded gap ([\d.e+-]+)", out
    )
    assert match is not None, out
    layers, mean_error, gemm_gap = int(match[1]), float(match[2]), float(match[3])
    assert layers == 211  # 30 layers x 7 projections, and the output head
    assert 1e-3 < mean_error < 0.1, "E4M3 operands cost a few percent of relative error"
    assert gemm_gap < 1e-5, "the FP8 GEMM equals the float32 GEMM of the rounded operands"


@needs_demo_data
def test_accelerate_loop_uses_the_launchers_recipe_when_given(runs):
    own = runs.output("accelerate")
    assert "recipe from --recipe: hybrid, delayed scaling, margin 0, forwards in high precision" in own
    assert "done: 2 steps" in own
    launched = runs.output("accelerate launched")
    assert "recipe from hf-fp8 launch: hybrid, delayed scaling, margin 1, forwards in FP8" in launched


@needs_demo_data
def test_lora_example_saves_an_adapter_and_merges_it(runs):
    out = runs.output("lora")
    assert (runs.out / "lora" / "adapter" / "adapter_config.json").is_file()
    match = re.search(r"with the adapter ([\d.]+), merged into the base ([\d.]+)", out)
    assert match is not None, out
    assert float(match[1]) == pytest.approx(float(match[2]), rel=1e-3)


@needs_demo_data
def test_trainer_example_runs_a_single_step(runs):
    out = runs.output("trainer")
    assert "FP8 telemetry logged at step 1" in out


@needs_demo_data
def test_trainer_example_resumes_exactly(runs):
    out = runs.output("resume")
    assert "fp8/scale_fwd_max" in out and "(identical)" in out


def test_train_loop_honours_the_launchers_recipe(runs):
    own = runs.output("train_loop")
    assert "recipe from --recipe: margin 0" in own and "unpatched: Conv1D" in own
    launched = runs.output("train_loop launched")
    assert "recipe from hf-fp8 launch: margin 1" in launched


@pytest.mark.parametrize("name", ["trainer_finetune.py", "lora_fp8.py"])
def test_examples_never_write_into_a_folder_that_holds_other_files(name, tmp_path):
    keep = tmp_path / "mine.txt"
    keep.write_text("the user's file")
    result = example(name, *TINY, "--out", str(tmp_path))
    assert result.returncode == 2 and "--overwrite" in result.stderr and "Traceback" not in result.stderr
    assert (
        sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"] and keep.read_text() == "the user's file"
    )


@pytest.mark.parametrize(
    ("name", "args", "expected"),
    [
        ("trainer_finetune.py", ("--steps", "0"), "--steps"),
        ("trainer_finetune.py", ("--steps", "1", "--resume-check"), "--resume-check needs"),
        ("accelerate_loop.py", ("--seq-len", "8"), "--seq-len"),
        ("accelerate_loop.py", ("--recipe", "turbo"), "'turbo' is neither a named recipe"),
        ("lora_fp8.py", ("--lr", "3"), "--lr"),
        ("compare_precision.py", ("--top", "0"), "--top"),
        ("train_loop.py", ("--steps", "-1"), "--steps"),
    ],
)
def test_examples_refuse_bad_arguments_in_one_line(name, args, expected):
    result = example(name, *args)
    assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr


SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


def test_helpers_beside_the_scripts_are_few():
    """examples/ holds scripts, and one module the TRL scripts share."""
    assert sorted(p.name for p in EXAMPLES.glob("*.py") if p.name not in SCRIPTS) == ["trl_common.py"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_example_has_help(name):
    out = ok(example(name, "--help"))
    assert "usage:" in out and ("--steps" in out or "--seq-len" in out)


@needs_demo_data
@pytest.mark.parametrize("trainer", ["sft", "dpo", "grpo"])
def test_trl_examples_train_in_fp8(trainer, runs):
    """Each TRL example trains SmolLM2 one step with the callback: its 211 layers in FP8 (the tied head's
    backward too), the gradients' amax recorded (the FP8 step ended at the optimizer step)."""
    out = runs.output(f"trl {trainer}")
    assert "FP8 layers: 211" in out, out
    amax = re.search(r"fp8/amax_bwd\s+([\d.e+-]+)", out)
    assert amax is not None and float(amax[1]) > 0, out
