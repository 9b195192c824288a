"""DeepSpeed ZeRO as patch_model sees it before ``deepspeed.initialize``: the stage, from transformers'
DeepSpeed config or accelerate launch's environment, and the recipe keys refused under it."""

import json

import pytest
import tiny_models as tm
import torch
from transformers.integrations import HfDeepSpeedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import hf_fp8
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


def test_under_zero3_each_decoder_block_is_gathered_whole(no_deepspeed, monkeypatch):
    """ZeRO-3 would gather every linear layer's weight on its own, a graph break each inside a compiled
    block; patch_model makes each decoder block one of DeepSpeed's leaf modules instead."""
    from deepspeed.utils import z3_leaf_module

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    model = tm.build("llama")
    report = patch_model(model, "head-backward")
    leaves = [name for name, m in model.named_modules() if z3_leaf_module(m)]
    assert leaves == [f"model.layers.{i}" for i in range(len(model.model.layers))]
    assert any("each LlamaDecoderLayer gathers its weights as one unit" in note for note in report.notes)

    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")  # ZeRO-2 never gathers weights
    model = tm.build("llama")
    report = patch_model(model, "head-backward")
    assert not any(z3_leaf_module(m) for m in model.modules())
    assert not any("one unit" in note for note in report.notes)


def test_compile_gathers_blocks_whole_under_zero3_or_says_it_comes_too_late(no_deepspeed, monkeypatch):
    """hf_fp8.compile does it too (a BF16 model, a model patched before ZeRO showed); after
    deepspeed.initialize has hooked the layers inside the blocks it is too late, and it warns."""
    from deepspeed.utils import z3_leaf_module

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    model = hf_fp8.compile(tm.build("llama"))
    assert all(z3_leaf_module(block) for block in model.model.layers)

    model = tm.build("llama")
    model.model.layers[1].mlp.ds_id = 7  # what deepspeed.initialize's ZeRO-3 hooks give every module
    too_late = "deepspeed.initialize has already hooked .* before deepspeed.initialize"
    with pytest.warns(UserWarning, match=too_late):
        hf_fp8.compile(model)
    assert not any(z3_leaf_module(m) for m in model.modules())


@pytest.mark.parametrize("policy", ["skip_step", "increase_margin"])
def test_nan_policies_that_skip_a_step_are_refused_under_zero(policy, no_deepspeed, monkeypatch):
    """DeepSpeed's engine steps with its own gradient buffers (inside the backward, through accelerate):
    the guard cannot drop a step there, so a recipe that asks it to is refused, not trained on."""
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    model = tm.build("llama")
    with pytest.raises(ValueError, match=f"nan_policy {policy} cannot be honoured under DeepSpeed ZeRO-2: "):
        patch_model(model, {"nan_policy": policy})
    assert not is_patched(model)


def test_the_guard_does_not_claim_the_weights_were_kept_under_zero(no_deepspeed, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    model = tm.build("llama")
    patch_model(model)
    guard = hf_fp8.Fp8NanGuard(model)
    batch = tm.batch_for("llama", 32)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model(**batch).loss.backward()
    with pytest.raises(FloatingPointError, match="may have updated the weights with this step already"):
        guard.check(0)


def test_zero_trains_the_native_backend_and_refuses_te_before_the_model_changes(no_deepspeed, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    model = tm.build("llama")
    with pytest.raises(ValueError, match=r"the te backend is not supported under DeepSpeed ZeRO: .*'native'"):
        patch_model(model, backend="te")
    assert not is_patched(model)
    assert patch_model(model, backend="auto").backend == "native"


def test_a_model_with_frozen_parameters_is_gathered_layer_by_layer_under_zero3(no_deepspeed, monkeypatch):
    """Patched, then wrapped in LoRA (its base frozen): patching again, as the Trainer callback and
    prepare_fp8 do with a patched model, puts the blocks back to DeepSpeed's layer-by-layer gathers, with
    the reason; DeepSpeed's whole-block gathers would fail on the first block, whose input needs no
    gradient."""
    from deepspeed.utils import z3_leaf_module
    from peft import LoraConfig, get_peft_model

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    model = tm.build("llama")
    patch_model(model)
    assert all(z3_leaf_module(block) for block in model.model.layers)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    report = patch_model(lora)
    assert not any(z3_leaf_module(m) for m in lora.modules())
    assert any("gather their weights layer by layer, as the model has frozen" in n for n in report.notes)


def test_only_repeated_blocks_without_an_embedding_are_gathered_whole(no_deepspeed, monkeypatch):
    """HF's _no_split_modules names ModernBERT's embeddings beside its layers: gathered whole, the
    embeddings (whose input, token ids, needs no gradient) would fail DeepSpeed's gradient reduction."""
    from deepspeed.utils import z3_leaf_module
    from transformers import AutoConfig, AutoModelForMaskedLM

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    ids = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    config = AutoConfig.for_model(
        "modernbert", hidden_size=64, intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=128, **ids,
    )  # fmt: skip
    model = AutoModelForMaskedLM.from_config(config)
    assert "ModernBertEmbeddings" in model._no_split_modules
    patch_model(model)
    leaves = [name for name, m in model.named_modules() if z3_leaf_module(m)]
    assert leaves == ["model.layers.0", "model.layers.1"]


def test_a_patched_model_is_checked_again_when_zero_shows_later(no_deepspeed, monkeypatch):
    """Patched with a recipe ZeRO cannot honour before DeepSpeed showed: patching again under ZeRO (the
    Trainer callback and prepare_fp8 do) refuses it rather than training on."""
    model = tm.build("llama")
    patch_model(model, {"nan_policy": "skip_step"})
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match="nan_policy skip_step cannot be honoured under DeepSpeed"):
        patch_model(model)
    with pytest.raises(ValueError, match="nan_policy skip_step cannot be honoured under DeepSpeed"):
        hf_fp8.Fp8NanGuard(model)
