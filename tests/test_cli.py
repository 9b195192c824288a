"""The hf-fp8 command line, run as users run it: the installed console script in a subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as tm

HF_FP8 = Path(sys.executable).with_name("hf-fp8")
REPO = Path(__file__).resolve().parents[1]


def hf_fp8(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(HF_FP8), *args],
        capture_output=True,
        stdin=subprocess.DEVNULL,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-fp8: error: "), result.stderr
    for text in expected:
        assert text in lines[0]


def test_env_lists_versions_and_the_backend_choice():
    result = hf_fp8("env")
    assert result.returncode == 0, result.stderr
    for name in ("torch", "transformers", "accelerate", "peft", "transformer-engine", "backend 'auto'"):
        assert name in result.stdout


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("config")
    tm.build("qwen2").config.save_pretrained(folder)
    return folder


def test_inspect_reports_what_would_be_converted_and_the_weight_memory(config_dir):
    result = hf_fp8("inspect", str(config_dir), "--recipe", "conservative")
    assert result.returncode == 0, result.stderr
    assert "FP8 GEMM layers: 14 of 15" in result.stdout and "margin 1" in result.stdout
    assert "model.layers.*.self_attn.q_proj" in result.stdout and "weights:" in result.stdout
    assert "stored in FP8" in result.stdout


def test_demo_runs_end_to_end():
    result = hf_fp8("demo", "--steps", "3", "--batch-size", "2", "--seq-len", "32")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "held-out loss" in result.stdout and "FP8 GEMM layers: 28 of 29" in result.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "usage"),
        (("frobnicate",), "unknown command 'frobnicate'"),
        (("inspect", "/no/such/model"), "not found"),
        (("inspect", "README.md"), "cannot read a transformers config"),
        (("inspect", "--recipe"), "inspect:"),
        (("launch", "tests/dist_worker.py"), "--recipe"),
        (("launch", "--recipe", "turbo", "tests/dist_worker.py"), "'turbo' is neither a named recipe"),
        (("launch", "--recipe", "README.md", "tests/dist_worker.py"), "README.md"),
        (("launch", "--recipe", "hybrid-delayed"), "training_script"),
        (("launch", "--recipe", "hybrid-delayed", "missing.py"), "'missing.py' not found"),
        (
            ("launch", "--recipe", "hybrid-delayed", "--frobnicate", "2", "tests/dist_worker.py"),
            "--frobnicate",
        ),
        (("launch", "--recipe", "hybrid-delayed", "--mixed_precision", "fp8", "tests/dist_worker.py"), "fp8"),
        (("launch", "--recipe"), "--recipe"),
        (
            ("launch", "--recipe", "hybrid-delayed", "--config_file", "nope.yaml", "tests/dist_worker.py"),
            "nope.yaml",
        ),
        (("demo", "--steps", "0"), "at least 1"),
        (("demo", "--recipe", "turbo"), "'turbo' is neither a named recipe"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args, expected):
    result = hf_fp8(*args)
    if expected == "usage":  # no command at all: the usage, not an error line
        assert result.returncode == 2 and "hf-fp8 launch" in result.stdout
        return
    assert_one_line_error(result, expected)


def test_a_recipe_file_with_a_bad_value_names_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("fp8_margin: lots\n")
    assert_one_line_error(
        hf_fp8("launch", "--recipe", str(recipe), "tests/dist_worker.py"), str(recipe), "margin"
    )


SPY = """
import json, os, sys
with open(sys.argv[1], "w") as f:
    json.dump({"argv": sys.argv[2:], "recipe": os.environ.get("HF_FP8_RECIPE"),
               "mixed_precision": os.environ.get("ACCELERATE_MIXED_PRECISION")}, f)
"""


def test_launch_passes_the_script_its_arguments_and_the_recipe(tmp_path):
    script, out = tmp_path / "spy.py", tmp_path / "seen.json"
    script.write_text(SPY)
    result = hf_fp8(
        "launch", "--cpu", "--recipe", "conservative", str(script), str(out), "--recipe", "mine", "-x"
    )
    assert result.returncode == 0, result.stderr[-2000:]
    seen = json.loads(out.read_text())
    assert seen["argv"] == ["--recipe", "mine", "-x"], "everything after the script is the script's"
    assert "margin: 1" in seen["recipe"] and seen["mixed_precision"] == "bf16"


def test_launch_called_in_process_leaves_the_environment_as_it_was(tmp_path):
    from hf_fp8.cli import main

    script = tmp_path / "spy.py"
    script.write_text(SPY)
    assert "HF_FP8_RECIPE" not in os.environ
    assert (
        main(["launch", "--cpu", "--recipe", "hybrid-delayed", str(script), str(tmp_path / "seen.json")]) == 0
    )
    assert "HF_FP8_RECIPE" not in os.environ


def test_launch_returns_the_exit_status_of_a_failing_script(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text("import sys; sys.exit(3)\n")
    result = hf_fp8("launch", "--cpu", "--recipe", "hybrid-delayed", str(script))
    assert result.returncode != 0 and "CalledProcessError" not in result.stderr
