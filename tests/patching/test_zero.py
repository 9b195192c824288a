"""DeepSpeed ZeRO as patch_model sees it before ``deepspeed.initialize``: the stage, from transformers'
DeepSpeed config or accelerate launch's environment, and the recipe keys refused under it."""

import json

import pytest
import tiny_models as tm
import torch
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from hf_fp8 import Fp8Linear, is_patched, patch_model
from hf_fp8.patching.zero import zero_stage


@pytest.fixture
def no_deepspeed(monkeypatch):
    """No DeepSpeed in the environment, and none left behind: a live HfDeepSpeedConfig would make every
    later patch_model in this process see ZeRO."""
    for name in ("USE_DEEPSPEED", "DEEPSPEED_ZERO_STAGE", "DEEPSPEED_CONFIG_FILE"):
        monkeypatch.delenv(f"ACCELERATE_{name}", raising=False)
    yield
    unset_hf_deepspeed_config()


def test_the_stage_comes_from_accelerate_launch_or_transformers(no_deepspeed, monkeypatch, tmp_path):
    assert zero_stage() is None
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert zero_stage() == 2  # accelerate's default stage
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    assert zero_stage() == 3
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(config))
    assert zero_stage() == 1  # the config file wins over the flag
    config.write_text(json.dumps({"zero_optimization": {"stage": "auto"}}))
    assert zero_stage() == 3  # accelerate fills "auto" in from its launch arguments
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "1")
    assert zero_stage() is None  # accelerate takes "true" only
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED")
    live = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})
    assert zero_stage() == 3  # what TrainingArguments(deepspeed=...) leaves behind
    del live
    model = tm.build("llama")
    unset_hf_deepspeed_config()
    assert zero_stage(model) is None
    model.model.layers[0].mlp.up_proj.weight.ds_id = 0  # what zero.Init gives every parameter
    assert zero_stage(model) == 3


@pytest.mark.parametrize(
    ("recipe", "key"),
    [("lora-fp8", "fp8_weights"), ("lora-fp8-block", "fp8_weights"), ("fsdp-fp8", "fp8_all_gather")],
)
@pytest.mark.parametrize("stage", ["1", "2", "3"])
def test_recipe_keys_zero_cannot_honour_are_refused_before_the_model_changes(
    recipe, key, stage, no_deepspeed, monkeypatch
):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", stage)
    model = tm.build("llama")
    before = {name: p.clone() for name, p in model.state_dict().items()}
    refusal = rf"{key} cannot be honoured under DeepSpeed ZeRO-{stage}: .* Set {key}: false"
    with pytest.raises(ValueError, match=refusal):
        patch_model(model, recipe)
    assert not is_patched(model)
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_what_zero_trains_is_patched_and_the_report_names_the_stage(no_deepspeed, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    report = patch_model(tm.build("llama"), "head-backward")
    assert report.converted
    assert "DeepSpeed (ZeRO-2): the FP8 layers run inside its engine" in " ".join(report.notes)
