"""Inputs that look wrong but are handled: a clear warning where one is due, and the right behaviour."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from hostile_world import (
    World,
    make_world,
)
from peft import LoraConfig, get_peft_model

import hf_fp8
from hf_fp8.recipe import Fp8Recipe


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
