"""Mistaken and hostile inputs across the API and the state files.

Each case asserts the error type, that the message names the problem (and, where there is one, the
fix), and that nothing of the user's was lost: the model's weights, its FP8 scaling state and the
files in its folder are bit for bit what they were.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hostile_world import (
    World,
    assert_unchanged,
    damaged_state,
    last_key,
    make_world,
    snapshot,
    trainer_resuming_from,
    with_env,
    write,
)
from safetensors.torch import load_file, save_file
from torch import nn

import hf_fp8
from hf_fp8.integrations.checkpoint import FP8_STATE_FILE
from hf_fp8.recipe import LAUNCHER_ENV, Fp8Recipe, as_recipe

# (id, action taking the world, expected exception, regex the message must match)
CASES: list[tuple[str, Callable[[World], Any], type[BaseException], str]] = [
    # ---- recipe values -------------------------------------------------------------------------------
    (
        "margin-huge",
        lambda w: Fp8Recipe(margin=200),
        ValueError,
        r"'margin' must be an integer from 0 to 8.*binade",
    ),
    (
        "margin-negative",
        lambda w: Fp8Recipe(margin=-1),
        ValueError,
        r"'margin' must be an integer from 0 to 8",
    ),
    ("margin-float", lambda w: Fp8Recipe(margin=1.5), ValueError, r"'margin'.*got 1\.5"),
    ("interval-overflow", lambda w: Fp8Recipe(interval=10**30), ValueError, r"'interval'.*1 to 100000"),
    ("interval-zero", lambda w: Fp8Recipe(interval=0), ValueError, r"'interval'"),
    (
        "history-huge",
        lambda w: Fp8Recipe(amax_history_len=10**9),
        ValueError,
        r"'amax_history_len'.*12 bytes",
    ),
    ("history-zero", lambda w: Fp8Recipe(amax_history_len=0), ValueError, r"'amax_history_len'"),
    ("pad-retired", lambda w: Fp8Recipe(pad_to_multiple=16), TypeError, r"pad_to_multiple"),
    (
        "callback-compile-not-a-flag",
        lambda w: hf_fp8.Fp8TrainerCallback(compile="yes"),
        TypeError,
        r"compile must be True, False or None",
    ),
    ("format-unknown", lambda w: Fp8Recipe(format="fp16"), ValueError, r"'format' must be one of"),
    ("scaling-unknown", lambda w: Fp8Recipe(scaling="dynamic"), ValueError, r"'scaling' must be one of"),
    ("algo-unknown", lambda w: Fp8Recipe(amax_compute_algo="mean"), ValueError, r"'amax_compute_algo'"),
    ("policy-unknown", lambda w: Fp8Recipe(nan_policy="ignore"), ValueError, r"'nan_policy'"),
    ("enabled-string", lambda w: Fp8Recipe(enabled="yes"), ValueError, r"'enabled' must be true or false"),
    (
        "patterns-not-strings",
        lambda w: Fp8Recipe(modules_to_not_convert=[1]),
        ValueError,
        r"module name patterns",
    ),
    ("key-typo", lambda w: Fp8Recipe.from_dict({"fp8_margn": 1}), ValueError, r"did you mean 'fp8_margin'"),
    (
        "nemo-no-format",
        lambda w: Fp8Recipe.from_dict({"fp8": True, "fp8_hybrid": False}),
        ValueError,
        r"fp8_hybrid: false name no FP8 format.*fp8_e4m3: true",
    ),
    (
        "nemo-two-formats",
        lambda w: Fp8Recipe.from_dict({"fp8_hybrid": True, "fp8_e4m3": True}),
        ValueError,
        r"disagree on format",
    ),
    ("dict-not-mapping", lambda w: Fp8Recipe.from_dict("margin: 1"), ValueError, r"must be a mapping"),
    (
        "yaml-binary",
        lambda w: Fp8Recipe.from_yaml(write(w.folder.parent / "r.yaml", bytes(range(256)))),
        ValueError,
        r"r\.yaml.*is not text",
    ),
    (
        "yaml-broken",
        lambda w: Fp8Recipe.from_yaml(write(w.folder.parent / "r.yaml", b"margin: [1\n")),
        ValueError,
        r"r\.yaml.*line",
    ),
    ("yaml-missing", lambda w: Fp8Recipe.from_yaml("/no/such/recipe.yaml"), ValueError, r"cannot read"),
    (
        "yaml-no-section",
        lambda w: Fp8Recipe.from_yaml(write(w.folder.parent / "r.yaml", b"fp8:\n  margin: 1\n"), section="x"),
        ValueError,
        r"no section 'x'",
    ),
    (
        "env-out-of-range",
        lambda w: Fp8Recipe.from_env({"ACCELERATE_FP8_MARGIN": "-1"}),
        ValueError,
        r"ACCELERATE_FP8_MARGIN='-1'.*'margin'",
    ),
    (
        "env-not-a-number",
        lambda w: Fp8Recipe.from_env({"ACCELERATE_FP8_MARGIN": "abc"}),
        ValueError,
        r"ACCELERATE_FP8_MARGIN='abc' is not a valid margin",
    ),
    (
        "env-override",
        lambda w: Fp8Recipe.from_env({"ACCELERATE_FP8_OVERRIDE_WGRAD": "1"}),
        ValueError,
        r"ACCELERATE_FP8_OVERRIDE_WGRAD.*modules_to_not_convert",
    ),
    ("named-unknown", lambda w: Fp8Recipe.named("turbo"), ValueError, r"unknown recipe 'turbo'"),
    (
        "launcher-garbage",
        lambda w: with_env({LAUNCHER_ENV: "margin: [oops"}, Fp8Recipe.from_launcher)(),
        ValueError,
        r"HF_FP8_RECIPE does not hold a valid recipe",
    ),
    ("recipe-wrong-type", lambda w: as_recipe(42), TypeError, r"a recipe must be an Fp8Recipe.*got int"),
    # ---- patch_model, plan_patch, unpatch_model ------------------------------------------------------
    ("patch-none", lambda w: hf_fp8.patch_model(None), TypeError, r"patch_model needs a model.*got NoneType"),
    ("patch-name", lambda w: hf_fp8.patch_model("gpt2"), TypeError, r"from_pretrained\('gpt2'\)"),
    ("patch-recipe-float", lambda w: hf_fp8.patch_model(w.plain, 3.5), TypeError, r"a recipe must be"),
    (
        "patch-recipe-unknown",
        lambda w: hf_fp8.patch_model(w.plain, "turbo"),
        ValueError,
        r"'turbo' is neither",
    ),
    (
        "patch-backend-unknown",
        lambda w: hf_fp8.patch_model(w.plain, backend="cuda"),
        ValueError,
        r"unknown backend",
    ),
    (
        "patch-group-string",
        lambda w: hf_fp8.patch_model(w.plain, amax_group="world"),
        TypeError,
        r"amax_group must be a torch.distributed ProcessGroup",
    ),
    (
        "patch-block-hybrid",
        lambda w: hf_fp8.patch_model(w.plain, {"scaling": "block"}),
        ValueError,
        r"scaling 'block' runs every GEMM operand in E4M3.*format: e4m3",
    ),
    ("unpatch-none", lambda w: hf_fp8.unpatch_model(None), TypeError, r"unpatch_model needs a model"),
    ("plan-string", lambda w: hf_fp8.plan_patch("llama"), TypeError, r"plan_patch needs a model"),
    # ---- FP8 state files -----------------------------------------------------------------------------
    (
        "state-truncated",
        lambda w: hf_fp8.load_fp8_state(
            w.model, write(w.folder.parent / FP8_STATE_FILE, w.state_file.read_bytes()[:100])
        ),
        ValueError,
        r"is not a readable FP8 state file.*delete it to start the FP8 state afresh",
    ),
    (
        "state-empty",
        lambda w: hf_fp8.load_fp8_state(w.model, write(w.folder.parent / FP8_STATE_FILE, b"")),
        ValueError,
        r"not a readable FP8 state file",
    ),
    (
        "state-random-bytes",
        lambda w: hf_fp8.load_fp8_state(w.model, write(w.folder.parent / FP8_STATE_FILE, os.urandom(4096))),
        ValueError,
        r"not a readable FP8 state file",
    ),
    (
        "state-bad-recipe-metadata",
        lambda w: hf_fp8.load_fp8_state(w.model, _with_metadata(w, "margin: [oops")),
        ValueError,
        r"the recipe stored in it is not valid",
    ),
    (
        "state-one-shape-wrong",
        lambda w: hf_fp8.load_fp8_state(
            w.model,
            damaged_state(w, lambda t: t.__setitem__(last_key(t, "amax_history"), torch.zeros(3, 7))),
        ),
        ValueError,
        r"has shape \(3, 7\).*amax_history_len",
    ),
    (
        "state-nan",
        lambda w: hf_fp8.load_fp8_state(
            w.model, damaged_state(w, lambda t: t[last_key(t, "scale")].fill_(float("nan")))
        ),
        ValueError,
        r"non-finite values",
    ),
    (
        "state-other-model",
        lambda w: hf_fp8.load_fp8_state(w.model, damaged_state(w, lambda t: t.pop(last_key(t, "fp8_steps")))),
        ValueError,
        r"does not match this model's FP8 layers; missing",
    ),
    (
        "state-other-recipe",
        lambda w: hf_fp8.load_fp8_state(w.model, w.folder, Fp8Recipe(amax_history_len=16)),
        ValueError,
        r"another FP8 recipe \(amax_history_len: 1024 -> 16\)",
    ),
    (
        "state-missing",
        lambda w: hf_fp8.load_fp8_state(w.model, "/no/such/folder"),
        FileNotFoundError,
        r"no fp8",
    ),
    (
        "state-plain-without-recipe",
        lambda w: hf_fp8.load_fp8_state(w.plain, w.folder),
        ValueError,
        r"give the recipe",
    ),
    (
        "save-without-fp8-layers",
        lambda w: hf_fp8.save_fp8_state(w.plain, w.folder, "hybrid-delayed"),
        ValueError,
        r"no FP8 scaling state to save.*nothing was written",
    ),
    ("save-not-a-model", lambda w: hf_fp8.save_fp8_state("model", w.folder), TypeError, r"needs a model"),
    (
        "trainer-resume-damaged",
        lambda w: trainer_resuming_from(w, w.folder.parent),  # the truncated file written below
        ValueError,
        r"not a readable FP8 state file",
    ),
    # ---- Trainer, PEFT helpers, guard, compile -------------------------------------------------------
    (
        "callback-recipe-unknown",
        lambda w: hf_fp8.Fp8TrainerCallback("turbo"),
        ValueError,
        r"'turbo' is neither",
    ),
    ("callback-recipe-type", lambda w: hf_fp8.Fp8TrainerCallback(5), TypeError, r"a recipe must be"),
    (
        "trainer-recipe-and-callback",
        lambda w: hf_fp8.Fp8Trainer(
            model=w.plain, fp8_recipe="conservative", fp8_callback=hf_fp8.Fp8TrainerCallback()
        ),
        ValueError,
        r"either fp8_recipe or fp8_callback",
    ),
    ("merge-plain-model", lambda w: hf_fp8.peft.merge_and_unload(w.model), TypeError, r"needs a PEFT model"),
    (
        "from-pretrained-missing",
        lambda w: hf_fp8.peft.from_pretrained_fp8("/no/such/checkpoint"),
        FileNotFoundError,
        r"nothing is downloaded",
    ),
    ("guard-unpatched", lambda w: hf_fp8.Fp8NanGuard(w.plain), ValueError, r"patch_model\(model\) first"),
    ("guard-not-a-model", lambda w: hf_fp8.Fp8NanGuard("model"), TypeError, r"Fp8NanGuard needs a model"),
    ("compile-not-a-model", lambda w: hf_fp8.compile("model"), TypeError, r"hf_fp8.compile needs a model"),
    ("compile-no-blocks", lambda w: hf_fp8.compile(nn.Linear(16, 16)), ValueError, r"no repeated blocks"),
    (
        "prepare-bad-optimizer",
        lambda w: hf_fp8.prepare_fp8(object(), w.plain, optimizer="adam"),
        TypeError,
        r"optimizer must be a torch.optim.Optimizer",
    ),
]


def _with_metadata(world: World, recipe_text: str) -> Path:
    folder = world.folder.parent / "metadata"
    folder.mkdir(exist_ok=True)
    save_file(
        load_file(str(world.state_file)), str(folder / FP8_STATE_FILE), metadata={"recipe": recipe_text}
    )
    return folder


@pytest.mark.parametrize(("action", "error", "pattern"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_named_and_loses_nothing(action, error, pattern, tmp_path):
    world = make_world(tmp_path)
    write(tmp_path / FP8_STATE_FILE, world.state_file.read_bytes()[:100])  # for trainer-resume-damaged
    before = snapshot(world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # CPU warnings of the Trainer set-up; the errors are the point
        with pytest.raises(error, match=pattern):
            action(world)
    assert_unchanged(before, snapshot(world))


def test_there_are_at_least_60_cases():  # and 15 more: test_handled_inputs, test_cli_mistakes
    assert len(CASES) >= 60
