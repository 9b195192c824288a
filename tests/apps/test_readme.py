"""Every fenced code block of README.md, checked at a tiny size on the CPU, so the README cannot drift
from the code.

How each kind of block is checked:

- ``python``: run, each block in a fresh namespace holding only the three names the README states at its
  top: ``path`` (a tiny Llama saved with a byte-level tokenizer), ``train_dataset`` (16 tokenized rows
  of 32 tokens) and ``texts`` (a ``datasets.Dataset`` of short lines). One change is made to the code:
  ``bf16=True`` becomes ``bf16=True, use_cpu=True``, because transformers refuses ``bf16=True`` on a
  machine without a GPU (the README says so in the GPU quick start). Each block runs with real
  ``patch_model`` and real FP8 casts, and must make FP8 GEMMs whose layers end their FP8 steps; the
  saving block, which trains nothing, is checked by the files it writes and the weights it loads.
- ``bash``: each line by its command. ``hf-fp8 recipes / inspect / env / demo --help`` run through the
  command's entry point (``hf_fp8.apps.cli:main``, what the ``hf-fp8`` script calls). The others are
  checked as far as they can be here, without a network, GPUs or minutes to spare:
  ``pip install -e '.[extra]'`` (parse-checked: the extras exist in pyproject.toml), ``bash
  scripts/demo.sh`` (the script exists and runs the demo, whose ``--help`` is run), ``bash
  scripts/test.sh`` (the script exists and is exactly what CI runs; running it here would run this
  suite inside itself), and ``hf-fp8 launch`` (parse-checked: hf-fp8's real argument handling runs,
  with accelerate's ``launch_command``, which would start the processes, replaced by a recorder).
- ``text``: program output, not run. Any other fence language fails
  ``test_every_block_is_one_this_test_checks``: a new kind of block needs a rule here first.

Also checked: the README stays under 300 lines, the links of the README and of docs/ lead to files and
headings that exist, and docs/recipes.md names every named recipe with its purpose.
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import ScaledMmCalls, stored_in_fp8
from transformers import AutoModelForCausalLM
from trl_setup import byte_tokenizer, text_rows, tiny_llama

import hf_fp8
from hf_fp8.apps import cli
from hf_fp8.recipe import LAUNCHER_ENV, RECIPE_PURPOSES, Fp8Recipe

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RUN = {"python", "bash"}
OUTPUT = {"text"}  # program output shown as it prints: not run


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # where the opening fence is, 1-based

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.language or 'plain'}"


def readme_blocks() -> list[Block]:
    blocks, language, start, lines = [], None, 0, []
    for number, line in enumerate(README.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(.*)$", line)
        if fence and language is None:
            language, start, lines = fence[1].strip(), number, []
        elif fence:
            blocks.append(Block(language, "\n".join(lines) + "\n", start))
            language = None
        elif language is not None:
            lines.append(line)
    assert language is None, f"README.md: the block opened at line {start} is never closed"
    return blocks


BLOCKS = readme_blocks()
PYTHON = [b for b in BLOCKS if b.language == "python"]
BASH = [b for b in BLOCKS if b.language == "bash"]


def test_every_block_is_one_this_test_checks():
    unknown = [b.id for b in BLOCKS if b.language not in RUN | OUTPUT]
    assert not unknown, (
        f"README blocks this test cannot check (add a rule to {Path(__file__).name}): {unknown}"
    )
    assert PYTHON and BASH


def test_readme_is_a_short_guide():
    assert len(README.read_text().splitlines()) < 300


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_links_lead_to_files_and_sections_that_exist(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        assert linked.is_file(), f"{page.name} links to a missing file: {target}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
            assert anchor in {_anchor(h) for h in headings}, (
                f"{page.name} links to a missing section: {target}"
            )


def test_recipe_page_lists_every_named_recipe():
    """docs/recipes.md, where the README sends readers for the recipes, names each with its purpose."""
    page = (ROOT / "docs" / "recipes.md").read_text()
    for name, purpose in RECIPE_PURPOSES.items():
        assert f"| `{name}` | {purpose} |" in page, name


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# ---- python ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def readers_names(tmp_path_factory) -> dict:
    """The names the README asks the reader for, at a tiny size."""
    import datasets

    folder = tmp_path_factory.mktemp("model")
    # Sizes that are multiples of 128 (the projections that save_fp8_pretrained quantizes) and a vocabulary
    # of bytes and three special tokens (trl_setup's tokenizer).
    tiny_llama(hidden_size=128, intermediate_size=256, num_key_value_heads=4).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    ids = torch.randint(0, 256, (16, 32), generator=torch.Generator().manual_seed(0))
    rows = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    return {"path": str(folder), "train_dataset": rows.with_format("torch"), "texts": text_rows(24)}


@pytest.fixture
def in_a_clone(tmp_path, monkeypatch):
    """A working folder that looks like the repository's root (the README's relative paths resolve)."""
    for name in ("examples", "recipes"):
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    yield tmp_path
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # each block builds its own Accelerator


def on_the_cpu(code: str) -> str:
    """The one change made to a block: transformers refuses bf16=True without a GPU unless use_cpu=True."""
    return code.replace("bf16=True", "bf16=True, use_cpu=True")


def fp8_steps(model: torch.nn.Module) -> dict[str, int]:
    return {n: int(m.fp8_steps) for n, m in model.named_modules() if isinstance(m, hf_fp8.Fp8Module)}


def trained_model(names: dict) -> torch.nn.Module:
    """The model a block trained: its trainer's, else its ``model``."""
    return names["trainer"].model if "trainer" in names else names["model"]


@pytest.mark.filterwarnings("ignore:hf_fp8. the model is on the CPU")
@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_runs(block, readers_names, in_a_clone):
    names = dict(readers_names)
    gemms = ScaledMmCalls()
    with gemms:
        exec(compile(on_the_cpu(block.code), f"README.md:{block.line}", "exec"), names)
    if "save_fp8_pretrained" in block.code:
        check_saving(names, in_a_clone)
        return
    assert gemms.calls, "the block made no FP8 GEMM"
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    assert all(a in fp8 and b in fp8 for a, b in gemms.calls)
    steps = fp8_steps(trained_model(names))
    assert sum(n.endswith("_proj") for n in steps) == 14, "the seven projections of both layers run in FP8"
    assert min(steps.values()) >= 1, f"FP8 layers whose steps never ended: {steps}"
    if "trainer" in names:
        assert names["trainer"].state.global_step >= 1
    if "Fp8TrainerCallback(" in block.code or "Fp8Trainer(" in block.code:
        assert any(
            os.path.isfile(os.path.join(d, "fp8_state.safetensors"))
            for d, _, _ in os.walk(names["trainer"].args.output_dir)
        ), "the Trainer's checkpoint holds the FP8 state"
    if "merge_and_unload" in block.code:
        assert (in_a_clone / "adapter" / "adapter_config.json").is_file()
        assert not any("lora" in n for n, _ in names["merged"].named_modules())
    if "save_state" in block.code:
        assert (in_a_clone / "checkpoint" / "fp8_state.safetensors").is_file()


def check_saving(names: dict, folder: Path) -> None:
    """The saving block trains nothing: its files, and what loads from them, are checked instead."""
    unpatched = AutoModelForCausalLM.from_pretrained(names["path"]).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(folder / "my-model").state_dict()  # transformers alone
    patched = names["model"].state_dict()
    assert list(saved) == list(patched) == list(unpatched)
    assert all(saved[k].dtype == patched[k].dtype == unpatched[k].dtype for k in saved)
    assert hf_fp8.load_fp8_state(names["model"], folder / "my-model").scaling == "delayed"
    projections = [m for n, m in names["fp8_model"].named_modules() if n.endswith("_proj")]
    assert len(projections) == 14 and all(stored_in_fp8(m.weight) for m in projections)


# ---- bash ------------------------------------------------------------------------------------------


def bash_lines() -> list:
    """Every command line of the README's bash blocks, named by where it is and what it runs."""
    return [
        pytest.param(block, line.strip(), id=f"L{block.line + i}-" + "-".join(line.split()[:2]))
        for block in BASH
        for i, line in enumerate(block.code.splitlines(), 1)
        if line.strip() and not line.strip().startswith("#")
    ]


@pytest.mark.parametrize(("block", "line"), bash_lines())
def test_bash_line(block, line, readers_names, in_a_clone, monkeypatch, capsys):
    monkeypatch.setenv("path", readers_names["path"])  # the README's "$path"
    argv = shlex.split(os.path.expandvars(line), comments=True)
    if argv[:3] == ["pip", "install", "-e"]:
        check_pip_install(argv[3:])
    elif argv[0] == "bash":
        check_script(argv[1:])
    elif argv[:2] == ["hf-fp8", "launch"]:
        check_launch(argv[2:], monkeypatch)
    elif argv[0] == "hf-fp8":
        check_command(argv[1:], capsys)
    else:
        pytest.fail(f"README.md:{block.line}: no rule in {Path(__file__).name} checks {line!r}")


def check_pip_install(specs: list[str]) -> None:
    """Parse-checked only (installing needs the network): the folder is this project, the extras its own."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "hf-fp8"
    for spec in specs:
        match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", spec)
        assert match, f"pip install -e {spec}: not this folder"
        for extra in (match[1] or "").split(",") if match[1] else []:
            assert extra in project["optional-dependencies"], f"no extra [{extra}] in pyproject.toml"


def check_script(argv: list[str]) -> None:
    """The two commands on a fresh machine. Not run: the demo takes minutes and the model's download,
    and scripts/test.sh is the suite this test is part of."""
    (script,) = argv
    text = (ROOT / script).read_text()
    if script == "scripts/test.sh":
        ci = (ROOT / ".ci" / "run").read_text()
        assert "\nbash scripts/test.sh\n" in ci, "CI runs exactly the README's test command"
        assert "pytest" in text and "ruff" in text
    elif script == "scripts/demo.sh":
        assert "-m hf_fp8.apps.demo" in text
        from hf_fp8.apps.demo import main as demo_main

        with pytest.raises(SystemExit) as exited:
            demo_main(["--help"])
        assert exited.value.code == 0
    else:
        pytest.fail(f"no rule checks bash {script}")


def check_launch(argv: list[str], monkeypatch) -> None:
    """Parse-checked: ``hf-fp8 launch`` checks its recipe, the script and accelerate's options as it always
    does; only accelerate's ``launch_command`` (which starts the processes, on GPUs) is not run."""
    import accelerate.commands.launch as accelerate_launch

    launched = []
    monkeypatch.setattr(
        accelerate_launch, "launch_command", lambda args: launched.append((args, os.environ[LAUNCHER_ENV]))
    )
    Path("train.py").write_text("# the README's Accelerate loop stands here\n")
    assert cli.main(["launch", *argv]) == 0
    ((args, recipe),) = launched
    assert args.training_script == "train.py" or (ROOT / args.training_script).is_file()
    assert args.mixed_precision == "bf16"
    assert recipe == Fp8Recipe.load(argv[argv.index("--recipe") + 1]).to_yaml()
    if args.config_file is not None:
        assert (ROOT / args.config_file).is_file()


def check_command(argv: list[str], capsys) -> None:
    """Run, through the entry point the ``hf-fp8`` script calls."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["hf-fp8"] == "hf_fp8.apps.cli:main"
    try:
        status = cli.main(argv)
    except SystemExit as exited:  # --help
        status = exited.code
    out = capsys.readouterr().out
    assert status == 0 and out.strip()
    if argv[:2] == ["recipes", "--show"]:
        assert out == Fp8Recipe.load(argv[2]).to_yaml()
    if argv[0] == "inspect":
        assert "FP8 GEMM layers: 14 of 15" in out
