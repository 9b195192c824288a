"""The package's shape holds: layers import only downwards, no module over 400 lines, few modules at the
top; the public names load; modules that moved still import from their old paths."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import hf_fp8

PACKAGE = Path(hf_fp8.__file__).parent
# Each package may import the ones before it in this list, and the top-level modules (level 0).
LAYERS = ["numerics", "layers", "backends", "patching", "integrations", "apps"]


def level(module: str) -> int | None:
    """A module's layer: 0 for the top-level modules, 1.. for the packages, None outside hf_fp8 (and
    for the package itself, whose public names load lazily)."""
    parts = module.split(".")
    if parts[0] != "hf_fp8" or len(parts) == 1:
        return None
    return LAYERS.index(parts[1]) + 1 if parts[1] in LAYERS else 0


def imports_of(path: Path) -> list[str]:
    """Every hf_fp8 module ``path`` imports, a name imported from a package counted as its submodule."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hf_fp8"):
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names if alias.name.startswith("hf_fp8")]
    return names


def modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        dotted = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found.append((dotted.removesuffix(".__init__"), path))
    return found


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for module, path in modules():
        here = level(module)
        if here is None:
            continue
        for name in imports_of(path):
            there = level(name)
            if there is not None and there > here:
                upward.append(f"{module} -> {name}")
    assert upward == []


def test_no_module_is_over_400_lines_and_the_top_level_holds_at_most_8():
    long = {module: n for module, path in modules() if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}
    assert len(list(PACKAGE.glob("*.py"))) <= 8


def test_every_public_name_loads():
    for name in hf_fp8.__all__:
        assert getattr(hf_fp8, name) is not None, name


@pytest.mark.parametrize("old", ["linear", "patch", "trainer", "checkpoint", "inputs", "distributed"])
def test_a_moved_module_imports_from_its_old_path_with_a_warning(old):
    sys.modules.pop(f"hf_fp8.{old}", None)
    with pytest.warns(DeprecationWarning, match=rf"hf_fp8\.{old} is now hf_fp8\."):
        moved = importlib.import_module(f"hf_fp8.{old}")
    assert moved.__name__ != f"hf_fp8.{old}"
    assert sys.modules[f"hf_fp8.{old}"] is sys.modules[moved.__name__]  # one module, two names


def test_the_documented_peft_helpers_and_demo_assets_import_quietly():
    sys.modules.pop("hf_fp8.peft", None)
    sys.modules.pop("hf_fp8.assets", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from hf_fp8.assets import smollm2_path
        from hf_fp8.peft import merge_and_unload
    assert merge_and_unload is hf_fp8.peft.merge_and_unload
    assert smollm2_path is hf_fp8.assets.smollm2_path


def test_examples_use_the_public_api_only():
    """What users copy from examples/ must not break when a private module moves."""
    private = re.compile(
        r"hf_fp8\.(apps|patching|integrations|layers|numerics|backends|recipe)\b|(?<!torch)\._[a-z]\w*"
    )
    for path in sorted((PACKAGE.parent / "examples").glob("*.py")):
        found = [line for line in path.read_text().splitlines() if private.search(line.split("#")[0])]
        assert found == [], f"{path.name}: {found}"


def test_a_moved_module_runs_from_its_old_path():
    result = subprocess.run(
        [sys.executable, "-m", "hf_fp8.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "hf-fp8 launch" in result.stdout + result.stderr, result.stderr
