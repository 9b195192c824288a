"""The recipe ``recipe=None`` means: ``backward-fp8`` for weights loaded from a checkpoint, the defaults
for a model built from a config, the launcher's recipe above both, and any recipe given as it is."""

from __future__ import annotations

import copy

import pytest
import tiny_models as tm
import torch
from conftest import ScaledMmCalls
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_fp8
from hf_fp8.backends.registry import fp8_layers
from hf_fp8.patching.default_recipe import checkpoint_of, resolve_recipe
from hf_fp8.recipe import LAUNCHER_ENV, RECIPES, Fp8Recipe


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama")
    tm.build("llama").save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def no_launcher_recipe(monkeypatch):
    monkeypatch.delenv(LAUNCHER_ENV, raising=False)


def batch() -> dict[str, torch.Tensor]:
    return tm.batch_for("llama", 32, seed=1)


def test_a_checkpoint_trains_with_forwards_in_high_precision_and_fp8_backward_gemms(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint).train()
    plain = copy.deepcopy(model)
    report = hf_fp8.patch_model(model)
    assert report.recipe == RECIPES["backward-fp8"]
    assert any("backward-fp8" in n and checkpoint in n for n in report.notes), report.notes
    with ScaledMmCalls() as forward_gemms:
        loss = model(**batch()).loss
    assert forward_gemms.calls == []  # the forward's GEMMs in the checkpoint's precision
    assert torch.equal(loss, plain(**batch()).loss)
    with ScaledMmCalls() as backward_gemms:
        loss.backward()
    # dgrad and wgrad of each of the 14 converted layers on E5M2 gradients, and of the output head on
    # E4M3 ones (its gradient in 1x128 tiles)
    calls = backward_gemms.calls
    assert len(calls) == 2 * 15 and calls.count((torch.float8_e4m3fn, torch.float8_e4m3fn)) == 2
    assert sum(torch.float8_e5m2 in pair for pair in calls) == 2 * 14
    plain(**batch()).loss.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        if "proj" in name:  # FP8 rounding in the GEMMs that made them, but the same gradient
            assert not torch.equal(p.grad, q.grad), name
            cosine = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), dim=0)
            assert cosine > 0.99, name


def test_a_model_built_from_a_config_keeps_the_defaults_with_fp8_forwards():
    model = tm.build("llama")
    report = hf_fp8.patch_model(model)
    assert report.recipe == Fp8Recipe() and checkpoint_of(model) is None
    assert resolve_recipe(None, model) == (Fp8Recipe(), None)
    with ScaledMmCalls() as gemms:
        model(**batch())
    assert len(gemms.calls) == 14 and set(gemms.calls) == {(torch.float8_e4m3fn, torch.float8_e4m3fn)}


def test_a_recipe_given_and_the_launchers_come_first(checkpoint, monkeypatch):
    given = hf_fp8.patch_model(AutoModelForCausalLM.from_pretrained(checkpoint), "hybrid-delayed")
    assert given.recipe == Fp8Recipe() and not any("backward-fp8" in n for n in given.notes)
    monkeypatch.setenv(LAUNCHER_ENV, "margin: 1\n")
    launched = hf_fp8.patch_model(AutoModelForCausalLM.from_pretrained(checkpoint))
    assert launched.recipe == Fp8Recipe(margin=1)


def test_transformer_engine_named_keeps_its_defaults_and_says_what_they_cost(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    recipe, note = resolve_recipe(None, model, "te")
    assert recipe == Fp8Recipe() and "Transformer Engine has no backward-fp8" in note


def test_a_peft_model_of_a_checkpoint_and_its_reference_take_the_same_default(checkpoint):
    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(checkpoint), LoraConfig(r=4, target_modules=["q_proj"])
    )
    assert checkpoint_of(policy) == checkpoint
    assert hf_fp8.patch_model(policy).recipe == RECIPES["backward-fp8"]
    reference = hf_fp8.prepare_reference(AutoModelForCausalLM.from_pretrained(checkpoint))
    assert reference.recipe == RECIPES["backward-fp8"].replace(use_during_eval=True)


def test_the_trainer_callback_takes_the_checkpoints_default(checkpoint, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    fp8 = hf_fp8.Fp8TrainerCallback()
    args = TrainingArguments(
        str(tmp_path),
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=2,
        report_to=[],
        save_strategy="no",
    )
    rows = [{"input_ids": ids, "labels": ids} for ids in batch()["input_ids"]]
    Trainer(model=model, args=args, train_dataset=rows * 2, callbacks=[fp8]).train()
    assert fp8.report.recipe == RECIPES["backward-fp8"] and fp8.report.backend == "native"
    layers = list(fp8_layers(model))
    assert len(layers) == 15, "14 projections and the output head"
    # every role's amax recorded: the input's and weight's casts for the backward GEMMs, the gradient's
    roles = [role for layer in layers for role in layer.roles.values()]
    assert len(roles) == 3 * 15 and {role.direction for role in roles} == {"fwd", "bwd"}
    assert all(float(role.amax_history.max()) > 0 and float(role.scale) > 0 for role in roles)
