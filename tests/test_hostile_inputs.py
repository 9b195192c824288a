"""Mistaken and hostile inputs across the API, the state files and the command line.

Each case asserts the error type, that the message names the problem (and, where there is one, the
fix), and that nothing of the user's was lost: the model's weights, its FP8 scaling state and the
files in its folder are bit for bit what they were.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tiny_models as tm
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from torch import nn

import hf_fp8
from hf_fp8.checkpoint import FP8_STATE_FILE, fp8_state_dict
from hf_fp8.recipe import LAUNCHER_ENV, Fp8Recipe, as_recipe

HF_FP8 = Path(sys.executable).with_name("hf-fp8")


@dataclass
class World:
    """What a case may touch: a patched model that has trained a step, a plain model, and a folder
    holding that patched model's good FP8 state file."""

    model: nn.Module
    plain: nn.Module
    folder: Path

    @property
    def state_file(self) -> Path:
        return self.folder / FP8_STATE_FILE


def make_world(tmp_path: Path) -> World:
    model = tm.build("llama")
    hf_fp8.patch_model(model)
    batch = tm.batch_for("llama", 32)
    model(**batch).loss.backward()  # one step: the FP8 state is not all zeros
    model.zero_grad()
    folder = tmp_path / "checkpoint"
    hf_fp8.save_fp8_state(model, folder)
    (folder / "notes.txt").write_text("the user's own file")
    return World(model, tm.build("llama", seed=1), folder)


def snapshot(world: World) -> dict[str, Any]:
    return {
        "weights": {
            n: p.detach().clone() for m in (world.model, world.plain) for n, p in m.named_parameters()
        },
        "fp8": fp8_state_dict(world.model),
        "files": {p.name: p.read_bytes() for p in sorted(world.folder.iterdir())},
        "patched": (hf_fp8.is_patched(world.model), hf_fp8.is_patched(world.plain)),
    }


def assert_unchanged(before: dict, after: dict) -> None:
    assert before["patched"] == after["patched"]
    assert before["files"] == after["files"], "files changed"
    assert before["fp8"].keys() == after["fp8"].keys()
    for key, tensor in before["fp8"].items():
        assert torch.equal(tensor, after["fp8"][key]), f"FP8 state {key} changed"
    for name, tensor in before["weights"].items():
        assert torch.equal(tensor, after["weights"][name]), f"weight {name} changed"


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def damaged_state(world: World, mutate: Callable[[dict], None]) -> Path:
    """A copy of the good state file with ``mutate`` applied to its tensors, in a folder of its own."""
    folder = world.folder.parent / "damaged"
    folder.mkdir(exist_ok=True)
    tensors = load_file(str(world.state_file))
    mutate(tensors)
    save_file(tensors, str(folder / FP8_STATE_FILE), metadata={"recipe": Fp8Recipe().to_yaml()})
    return folder


def last_key(tensors: dict, suffix: str) -> str:
    return sorted(k for k in tensors if k.endswith(suffix))[-1]


def with_env(variables: dict[str, str], action: Callable[[], Any]) -> Callable[[], Any]:
    def run():
        saved = {k: os.environ.get(k) for k in variables}
        os.environ.update(variables)
        try:
            return action()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    return run


def trainer_resuming_from(world: World, folder: Path):
    from transformers import TrainingArguments

    args = TrainingArguments(
        str(world.folder.parent / "out"), max_steps=2, report_to="none", use_cpu=True, disable_tqdm=True
    )
    callback = hf_fp8.Fp8TrainerCallback()
    trainer = hf_fp8.Fp8Trainer(model=world.model, args=args, train_dataset=[], fp8_callback=callback)
    trainer.state.global_step = 1
    callback.resume_from = str(folder)
    callback.on_train_begin(args, trainer.state, trainer.control, model=world.model)


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
    ("pad-not-16", lambda w: Fp8Recipe(pad_to_multiple=8), ValueError, r"multiple of 16"),
    (
        "pad-huge",
        lambda w: Fp8Recipe(pad_to_multiple=16 * 10**6),
        ValueError,
        r"'pad_to_multiple'.*1 to 1024",
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


def test_there_are_at_least_60_cases():
    assert len(CASES) + len(BEHAVIOUR_CASES) + len(CLI_CASES) >= 60


# ---- inputs that are handled: a clear warning and the right behaviour ---------------------------------


def repatch_with_another_recipe(world: World) -> None:
    with pytest.warns(UserWarning, match=r"already patched; another recipe.*unpatch_model"):
        report = hf_fp8.patch_model(world.model, "conservative")
    assert report.recipe.margin == 0, "the model keeps its recipe"


def pattern_matching_nothing(world: World) -> None:
    with pytest.warns(UserWarning, match=r"pattern\(s\) \['lm_haed'\] match no module"):
        report = hf_fp8.patch_model(world.plain, {"modules_to_not_convert": ["lm_haed"]})
    assert any("lm_haed" in note for note in report.notes)
    hf_fp8.unpatch_model(world.plain)


def half_precision_model_keeps_float32_state(world: World) -> None:
    model = tm.build("llama")
    hf_fp8.patch_model(model)
    model.half()
    layer = model.model.layers[0].mlp.down_proj
    assert (
        layer.weight.dtype == torch.float16 and layer.scale.dtype == layer.amax_history.dtype == torch.float32
    )
    for step in range(3):
        batch = tm.batch_for("llama", 32, seed=step)
        model(**batch).loss.backward()
    assert torch.isfinite(layer.scale).all() and layer.scale[2] > 65504, (
        "a gradient scale float16 cannot hold"
    )


def zero_rows_pass_through(world: World) -> None:
    layer = world.model.model.layers[0].mlp.up_proj
    x = torch.zeros(0, layer.in_features, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, layer.out_features) and x.grad.shape == x.shape


def meta_device_forward_gives_shapes(world: World) -> None:
    with torch.device("meta"):
        model = tm.build("llama")
    hf_fp8.patch_model(model)
    ids = torch.zeros(2, 32, dtype=torch.long, device="meta")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert loss.device.type == "meta"


def nan_batch_in_a_plain_loop_is_reported_and_forgotten(world: World) -> None:
    model = world.model
    layer = model.model.layers[1].mlp.down_proj

    def poison(module, args):
        x = args[0].clone()
        x[0, 0, 0] = float("nan")
        return (x,)

    handle = layer.register_forward_pre_hook(poison)
    model(**tm.batch_for("llama", 32, seed=5)).loss.backward()
    handle.remove()
    with pytest.warns(UserWarning, match=r"non-finite amax in layer 'model.layers.1.mlp.down_proj'"):
        model(**tm.batch_for("llama", 32, seed=6)).loss.backward()
    model(**tm.batch_for("llama", 32, seed=7)).loss.backward()
    assert torch.isfinite(layer.amax_history).all(), "the NaN left the history after its step"
    assert torch.isfinite(layer.scale).all()


def names_accepted_as_recipes(world: World) -> None:
    assert hf_fp8.plan_patch(world.plain, "lora-fp8").recipe.fp8_weights
    callback = hf_fp8.Fp8TrainerCallback("conservative")
    assert callback.recipe.margin == 1


def increase_margin_stops_at_the_maximum(world: World) -> None:
    model = tm.build("llama")
    hf_fp8.patch_model(model, Fp8Recipe(nan_policy="increase_margin", margin=8))
    guard = hf_fp8.Fp8NanGuard(model)
    layer = model.model.layers[0].mlp.up_proj
    handle = layer.register_forward_pre_hook(lambda m, a: (a[0] * float("inf"),))
    model(**tm.batch_for("llama", 32)).loss.backward()
    handle.remove()
    with pytest.warns(UserWarning, match="margin already at its maximum 8"):
        assert guard.check() is False


def peft_wrapped_model_saves_its_state(world: World) -> None:
    peft_model = get_peft_model(world.model, LoraConfig(r=4, target_modules=["q_proj"]))
    path = hf_fp8.save_fp8_state(peft_model, world.folder.parent / "peft")
    assert path.is_file() and hf_fp8.load_fp8_state(peft_model, path.parent).margin == 0


BEHAVIOUR_CASES = [
    repatch_with_another_recipe,
    pattern_matching_nothing,
    half_precision_model_keeps_float32_state,
    zero_rows_pass_through,
    meta_device_forward_gives_shapes,
    nan_batch_in_a_plain_loop_is_reported_and_forgotten,
    names_accepted_as_recipes,
    increase_margin_stops_at_the_maximum,
    peft_wrapped_model_saves_its_state,
]


@pytest.mark.parametrize("case", BEHAVIOUR_CASES, ids=[c.__name__ for c in BEHAVIOUR_CASES])
def test_a_handled_input_warns_or_works(case, tmp_path):
    case(make_world(tmp_path))


# ---- the command line ---------------------------------------------------------------------------------


def broken_config(tmp_path: Path) -> str:
    config = '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": -3}'
    (tmp_path / "config.json").write_text(config)
    return str(tmp_path)


CLI_CASES = [
    (lambda t: ("inspect", broken_config(t)), "cannot build a model from the config"),
    (
        lambda t: ("inspect", "/no/model", "--recipe", str(write(t / "bin.yaml", bytes(range(256))))),
        "is not text",
    ),
    (lambda t: ("launch", "--recipe", str(write(t / "bin.yaml", bytes(range(256)))), "s.py"), "is not text"),
    (lambda t: ("demo", "--seq-len", "1"), "--seq-len must be from 2"),
    (lambda t: ("demo", "--device", "tpu"), "--device 'tpu'"),
    (lambda t: ("demo", "--lr", "5"), "--lr must be between 0 and 1"),
]


@pytest.mark.parametrize("index", range(len(CLI_CASES)))
def test_command_line_mistakes_are_one_line_and_exit_2(index, tmp_path):
    make_args, expected = CLI_CASES[index]
    result = subprocess.run(
        [str(HF_FP8), *make_args(tmp_path)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("hf-fp8: error: ") and expected in lines[0], lines
