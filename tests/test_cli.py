"""The hf-fp8 command line, run as users run it: the installed console script in a subprocess."""

import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models as tm

HF_FP8 = Path(sys.executable).with_name("hf-fp8")
REPO = Path(__file__).resolve().parents[1]


def hf_fp8(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(HF_FP8), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO)


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
        (("launch", "tests/dist_worker.py"), "launch needs --recipe"),
        (("launch", "--recipe", "turbo", "tests/dist_worker.py"), "'turbo' is neither a named recipe"),
        (("launch", "--recipe", "README.md", "tests/dist_worker.py"), "README.md"),
        (("launch", "--recipe", "hybrid-delayed"), "training_script"),
        (("launch", "--recipe", "hybrid-delayed", "missing.py"), "'missing.py' not found"),
        (
            ("launch", "--recipe", "hybrid-delayed", "--frobnicate", "2", "tests/dist_worker.py"),
            "--frobnicate",
        ),
        (("launch", "--recipe", "hybrid-delayed", "--mixed_precision", "fp8", "tests/dist_worker.py"), "fp8"),
        (("launch", "--recipe"), "--recipe needs a value"),
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
