"""Fp8TrainerCallback under a real transformers Trainer, on tiny Llama and GPT-2 models trained on
Shakespeare's text (bytes as tokens)."""

import shutil
import warnings
from types import SimpleNamespace

import pytest
import tiny_models as tm
import torch
from conftest import stored_in_fp8
from trainer_runs import (
    LAYER,
    InjectNaN,
    arguments,
    fp8_callback,
    losses,
    train,
)
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_fp8 import (
    RECIPES,
    Fp8Recipe,
    Fp8Trainer,
    Fp8TrainerCallback,
    is_patched,
    load_fp8_state,
    patch_model,
    save_fp8_state,
)
from hf_fp8.backends.registry import backend_for_fsdp
from hf_fp8.backends.te import recomputes_activations
from hf_fp8.integrations.checkpoint import FP8_STATE_FILE, fp8_state_dict
from hf_fp8.integrations.training_arguments import logits_dtype_for
from hf_fp8.layers.linear import Fp8Linear
from hf_fp8.patching.patch_state import get_state


# GPT-2 at 3e-3 spikes in BF16 itself (a loss of 4.4-5.0 at step 20 on two CPUs), and where the spikes
# fall decides the final losses; at 1e-3 both runs fall smoothly
@pytest.mark.parametrize(("arch", "lr"), [("llama", 3e-3), ("gpt2", 1e-3)])
def test_loss_falls_like_bf16_and_telemetry_is_logged(arch, lr, text_rows, tmp_path):
    bf16 = train(arch, text_rows, tmp_path / "bf16", recipe=False, bf16=True, learning_rate=lr)
    fp8 = train(arch, text_rows, tmp_path / "fp8", bf16=True, learning_rate=lr)
    assert is_patched(fp8.model) and not is_patched(bf16.model)
    first, last = losses(bf16)[5], losses(bf16)[30]
    assert last < 0.8 * first, "the baseline learns"
    assert losses(fp8)[30] == pytest.approx(last, rel=0.02)

    logged = [e for e in fp8.state.log_history if "loss" in e]
    assert len(logged) == 6
    for entry in logged:
        assert 0 < entry["fp8/scale_fwd_min"] <= entry["fp8/scale_fwd_median"] <= entry["fp8/scale_fwd_max"]
        assert 0 < entry["fp8/scale_bwd_min"] <= entry["fp8/scale_bwd_median"] <= entry["fp8/scale_bwd_max"]
        assert entry["fp8/amax_fwd"] > 0 and entry["fp8/amax_bwd"] > 0
        for key in ("saturated_fwd", "flushed_fwd", "saturated_bwd", "flushed_bwd"):
            assert 0 <= entry[f"fp8/{key}"] <= entry[f"fp8/worst_{key}"] <= 1
            if entry[f"fp8/worst_{key}"] > 0:
                layer = fp8.model.get_submodule(entry[f"fp8/worst_{key}_layer"])
                assert hasattr(layer, "amax_history"), "an FP8 layer"
            else:
                assert f"fp8/worst_{key}_layer" not in entry
        assert entry["fp8/skipped_steps"] == 0 and entry["fp8/margin"] == 0
    # Delayed scaling from step 2 on: E5M2 gradients of a 64-wide model flush some tiny values.
    assert any(e["fp8/flushed_bwd"] > 0 for e in logged)


class _Recorder(TrainerCallback):
    def __init__(self):
        self.keys: list[set[str]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.keys.append(set(logs))


def test_fp8_trainer_hands_telemetry_to_callbacks_created_before_it(text_rows, tmp_path):
    """Reporting integrations come before user callbacks: with plain Trainer they miss the telemetry,
    with Fp8Trainer they get it."""
    plain, ordered = _Recorder(), _Recorder()
    train("llama", text_rows, tmp_path / "a", callbacks=[plain], max_steps=5)
    model = tm.build("llama")
    trainer = Fp8Trainer(
        model=model, args=arguments(tmp_path / "b", max_steps=5), train_dataset=text_rows, callbacks=[ordered]
    )
    trainer.train()
    assert not any("fp8/scale_fwd_max" in keys for keys in plain.keys)
    assert any("fp8/scale_fwd_max" in keys for keys in ordered.keys)


# The Trainer's default optimizer (fused AdamW) skips the step on the device and the error comes at the
# next step's check; a foreach AdamW has the check wait for the device and raise before the update.
@pytest.mark.parametrize(
    ("optim", "raised_after", "said"),
    [("adamw_torch_fused", 4, "skipped"), ("adamw_torch", 3, "The weights are not updated")],
)
def test_nan_raise_names_the_layer_and_keeps_the_weights(optim, raised_after, said, text_rows, tmp_path):
    model = tm.build("llama")
    args = arguments(tmp_path, max_steps=6, optim=optim)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=text_rows,
        callbacks=[InjectNaN(LAYER, 4), Fp8TrainerCallback()],
    )
    before = {}

    class Snapshot(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 3:  # before the non-finite step 4
                before.update({n: p.detach().clone() for n, p in model.named_parameters()})

    trainer.add_callback(Snapshot())
    with pytest.raises(
        FloatingPointError,
        match=rf"step 4: non-finite amax of input/grad_output in layer '{LAYER}'; the loss is non.*{said}",
    ):
        trainer.train()
    assert trainer.state.global_step == raised_after
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by the non-finite step"


def test_a_non_finite_last_step_raises_at_the_end_of_training(text_rows, tmp_path):
    with pytest.raises(FloatingPointError, match=rf"step 3: non-finite amax .* in layer '{LAYER}'"):
        train("llama", text_rows, tmp_path, callbacks=[InjectNaN(LAYER, 3)], max_steps=3)


@pytest.mark.parametrize("policy", ["skip_step", "increase_margin"])
def test_nan_skip_policies_drop_the_step_and_roll_the_histories_back(policy, text_rows, tmp_path):
    recipe = Fp8Recipe(nan_policy=policy)
    with pytest.warns(
        UserWarning, match=rf"step 4: non-finite amax of input/grad_output in layer '{LAYER}'.*skipped"
    ):
        trainer = train("llama", text_rows, tmp_path, recipe, callbacks=[InjectNaN(LAYER, 4)], max_steps=8)
    callback = fp8_callback(trainer)
    layer = trainer.model.get_submodule(LAYER)
    assert callback.skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert torch.isfinite(layer.amax_history).all()
    # Eight steps of one micro-batch, one rolled back: seven recorded steps, each ended at its optimizer
    # step (slot 0 is the next step's, still empty).
    assert layer.fp8_steps.item() == 7
    history = layer.amax_history
    assert (history[:, 1:8] > 0).all() and (history[:, 0] == 0).all() and (history[:, 8:] == 0).all()
    expected_margin = 1 if policy == "increase_margin" else 0
    assert layer.recipe.margin == expected_margin and callback.recipe.margin == expected_margin
    assert trainer.state.log_history[-2]["fp8/skipped_steps"] == 1


def test_resume_gives_the_uninterrupted_run_exactly(text_rows, tmp_path):
    """Stopped at step 6 and resumed from its checkpoint: the same later losses, FP8 state and weights
    as the uninterrupted run. Without fp8_state.safetensors the resumed run warns and differs."""
    settings = dict(max_steps=12, logging_steps=1, save_strategy="steps", save_steps=6)
    full = train("llama", text_rows, tmp_path / "full", **settings)
    assert (tmp_path / "full" / "checkpoint-6" / FP8_STATE_FILE).is_file()

    def resumed(name: str, keep_fp8_state: bool):
        folder = tmp_path / name
        shutil.copytree(tmp_path / "full" / "checkpoint-6", folder / "checkpoint-6")
        if not keep_fp8_state:
            (folder / "checkpoint-6" / FP8_STATE_FILE).unlink()
        return train("llama", text_rows, folder, resume=True, **settings)

    again = resumed("again", keep_fp8_state=True)
    later = {s: v for s, v in losses(full).items() if s > 6}
    assert {s: v for s, v in losses(again).items() if s > 6} == later
    full_state, again_state = fp8_state_dict(full.model), fp8_state_dict(again.model)
    assert all(torch.equal(full_state[k], again_state[k]) for k in full_state)
    for (name, p), q in zip(full.model.named_parameters(), again.model.parameters(), strict=True):
        assert torch.equal(p, q), name

    with pytest.warns(UserWarning, match="resuming at step 6, but no fp8_state.safetensors in .*fresh"):
        fresh = resumed("fresh", keep_fp8_state=False)
    assert {s: v for s, v in losses(fresh).items() if s > 6} != later


def test_resume_from_a_checkpoint_outside_the_output_folder(text_rows, tmp_path):
    """Fp8Trainer tells the callback which folder it resumes from; a plain Trainer's callback finds the
    folder through TrainingArguments(resume_from_checkpoint=...)."""
    settings = dict(max_steps=8, logging_steps=1, save_strategy="steps", save_steps=4)
    full = train("llama", text_rows, tmp_path / "full", **settings)
    checkpoint = tmp_path / "full" / "checkpoint-4"
    model = tm.build("llama")
    trainer = Fp8Trainer(
        model=model, args=arguments(tmp_path / "elsewhere", **settings), train_dataset=text_rows
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))
    later = {s: v for s, v in losses(full).items() if s > 4}
    assert {s: v for s, v in losses(trainer).items() if s > 4} == later
    via_arguments = train(
        "llama",
        text_rows,
        tmp_path / "other",
        resume=str(checkpoint),
        resume_from_checkpoint=str(checkpoint),
        **settings,
    )
    assert {s: v for s, v in losses(via_arguments).items() if s > 4} == later


def test_epoch_logging_carries_the_telemetry(text_rows, tmp_path):
    trainer = train(
        "llama", text_rows[:64], tmp_path, logging_strategy="epoch", max_steps=-1, num_train_epochs=2
    )
    epochs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(epochs) == 2
    assert all(e["fp8/scale_fwd_max"] > 0 and "fp8/saturated_fwd" in e for e in epochs)


def test_model_init_builds_a_model_that_gets_patched(text_rows, tmp_path):
    trainer = Trainer(
        model_init=lambda: tm.build("llama"),
        args=arguments(tmp_path, max_steps=4, save_strategy="steps", save_steps=4),
        train_dataset=text_rows,
        callbacks=[Fp8TrainerCallback()],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hf_fp8: the model is on the CPU")
        trainer.train()
    assert is_patched(trainer.model)
    assert trainer.model.model.layers[0].mlp.up_proj.fp8_steps.item() == 4
    assert (tmp_path / "checkpoint-4" / FP8_STATE_FILE).is_file()


def test_the_callback_under_fsdp_refuses_the_te_backend_and_leaves_the_model_alone(tmp_path):
    """The callback's set-up as the Trainer calls it (a Trainer refuses fsdp in one process, before its
    callbacks run), with arguments that shard with FSDP."""
    model = tm.build("llama")
    callback = Fp8TrainerCallback("hybrid-delayed", backend="te")
    with pytest.raises(ValueError, match=r"te backend is not supported under FSDP.*backend='native'"):
        callback.on_init_end(arguments(tmp_path, fsdp="full_shard"), None, None, model=model)
    assert not is_patched(model)
    assert backend_for_fsdp("auto") == "native"


def test_fp8_state_file_checks_model_and_recipe(tmp_path):
    model = tm.build("llama")
    recipe = Fp8Recipe()
    callback = Fp8TrainerCallback(recipe)
    callback.on_init_end(arguments(tmp_path), None, None, model=model)
    model(**tm.batch_for("llama", 16)).loss.backward()
    save_fp8_state(model, tmp_path, recipe)
    other = tm.build("gpt2")
    Fp8TrainerCallback(recipe).on_init_end(arguments(tmp_path), None, None, model=other)
    with pytest.raises(ValueError, match=r"FP8 layers; missing: transformer\.h\.0"):
        load_fp8_state(other, tmp_path, recipe)
    with pytest.raises(ValueError, match=r"another FP8 recipe \(format: 'hybrid' -> 'e4m3'\)"):
        load_fp8_state(model, tmp_path, recipe.replace(format="e4m3"))
    assert load_fp8_state(model, tmp_path, recipe.replace(margin=2)).margin == 0, "margin comes from the file"


def test_conflicting_arguments_warn(tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match="fp16=True .* use bf16=True"):
        Trainer(
            model=tm.build("llama"), args=arguments(tmp_path, fp16=True), callbacks=[Fp8TrainerCallback()]
        )
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.warns(UserWarning, match="ACCELERATE_MIXED_PRECISION=fp8 .* unset it"):
        Fp8TrainerCallback()
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    with pytest.warns(UserWarning, match="the model is on the CPU; FP8 runs with real FP8 casts"):
        Trainer(model=tm.build("llama"), args=arguments(tmp_path), callbacks=[Fp8TrainerCallback()])


def test_an_already_patched_model_keeps_its_recipe(tmp_path):
    model = tm.build("llama")
    patch_model(model, Fp8Recipe(margin=1))
    callback = Fp8TrainerCallback(Fp8Recipe())
    with pytest.warns(UserWarning, match="already patched with another recipe"):
        Trainer(model=model, args=arguments(tmp_path), callbacks=[callback])
    assert callback.recipe.margin == 1


def test_the_report_of_an_already_patched_model_says_what_its_patch_converted(tmp_path):
    model = tm.build("llama")
    patched = patch_model(model, module_filter_fn=lambda module, fqn: "down_proj" not in fqn)
    callback = Fp8TrainerCallback()
    Trainer(model=model, args=arguments(tmp_path), callbacks=[callback])
    assert [r.name for r in callback.report.converted_gemms] == [r.name for r in patched.converted_gemms]
    assert len(callback.report.converted_gemms) == 12  # 14 GEMM layers less the two down_proj
    from accelerate import Accelerator

    from hf_fp8 import prepare_fp8

    _, _, report = prepare_fp8(Accelerator(cpu=True), model)
    assert [r.name for r in report.converted_gemms] == [r.name for r in patched.converted_gemms]
    Trainer(model=model, args=arguments(tmp_path), callbacks=[again := Fp8TrainerCallback()])
    assert again.report is report  # one report of the patch, shared


def test_gradient_accumulation_ends_one_fp8_step_per_micro_batch(text_rows, tmp_path):
    accumulated = train(
        "llama",
        text_rows,
        tmp_path / "ga",
        gradient_accumulation_steps=4,
        max_steps=6,
        per_device_train_batch_size=2,
    )
    layer = accumulated.model.get_submodule(LAYER)
    assert layer.fp8_steps.item() == 24, (
        "every micro-batch is an FP8 step, the last ended at the optimizer step"
    )
    assert not get_state(accumulated.model).step_pending
    whole = train("llama", text_rows, tmp_path / "whole", max_steps=6)
    assert losses(accumulated)[5] == pytest.approx(losses(whole)[5], rel=0.02)


def test_gradient_checkpointing_recomputes_with_the_same_scales(text_rows, tmp_path):
    plain = train("llama", text_rows, tmp_path / "plain", max_steps=8, logging_steps=1)
    recompute = (
        "activation_checkpointing"
        if hasattr(TrainingArguments, "activation_checkpointing")
        else ("gradient_checkpointing")
    )
    checkpointed = train(
        "llama", text_rows, tmp_path / "gc", max_steps=8, logging_steps=1, **{recompute: True}
    )
    assert recomputes_activations(checkpointed.model)
    a, b = fp8_state_dict(plain.model), fp8_state_dict(checkpointed.model)
    assert all(torch.equal(a[k], b[k]) for k in a), "histories advanced once a step, with the same amaxes"
    assert losses(checkpointed) == pytest.approx(losses(plain), rel=1e-5)
    assert any(isinstance(m, Fp8Linear) for m in checkpointed.model.modules())


def test_lora_with_fp8_base_weights_under_the_trainer_resumes_exactly(text_rows, tmp_path):
    """The usual LoRA fine-tune: patch with lora-fp8, PEFT, Trainer with the callback; checkpoints
    hold the adapter and the FP8 state, and a resumed run follows the uninterrupted one."""
    from peft import LoraConfig, get_peft_model

    def run(out, resume=None):
        model = tm.build("llama")
        patch_model(model, RECIPES["lora-fp8"])
        torch.manual_seed(1)
        peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj", "up_proj"]))
        settings = dict(max_steps=8, logging_steps=1, save_strategy="steps", save_steps=4, learning_rate=2e-2)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="hf_fp8: the model is on the CPU")
            trainer = Trainer(
                model=peft_model,
                args=arguments(out, **settings),
                train_dataset=text_rows,
                callbacks=[Fp8TrainerCallback()],
            )
            trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    up = full.model.base_model.model.model.layers[0].mlp.up_proj.base_layer
    assert stored_in_fp8(up.weight) and fp8_callback(full).recipe.fp8_weights
    assert losses(full)[8] < losses(full)[1]
    assert (tmp_path / "full" / "checkpoint-4" / FP8_STATE_FILE).is_file()
    shutil.copytree(tmp_path / "full" / "checkpoint-4", tmp_path / "again" / "checkpoint-4")
    again = run(tmp_path / "again", resume=True)
    assert {s: v for s, v in losses(again).items() if s > 4} == {
        s: v for s, v in losses(full).items() if s > 4
    }


@pytest.mark.parametrize("compile", [None, False])
def test_the_callback_stays_eager_on_the_cpu(compile, text_rows, tmp_path):
    """Compiling buys no FP8 speed on the CPU and costs minutes: by default (and when told not to) the
    callback leaves the model eager there, and its report says nothing was compiled."""
    callback = Fp8TrainerCallback(compile=compile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(
            model=tm.build("llama"), args=arguments(tmp_path), train_dataset=text_rows, callbacks=[callback]
        )
    assert callback.report.converted and not any("compiled" in note for note in callback.report.notes)
    assert all(block._compiled_call_impl is None for block in trainer.model.model.layers)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"bf16": True}, torch.float32),  # the Trainer's Accelerator converts every output to float32
        ({"fp16": True}, torch.float32),
        ({}, None),
        ({"bf16": True, "deepspeed": {"zero_optimization": {"stage": 2}}}, None),  # DeepSpeed: no conversion
    ],
)
def test_the_logits_dtype_the_callback_compiles_with_is_float32_where_the_trainer_converts(options, expected):
    """Under mixed precision, Accelerate converts each forward's half-precision outputs to float32 (a
    pass over the logits, 3.1 ms of a 115 ms step at the 8b-4l shape): the rule the callback compiles
    with asks the graph for float32 logits there, converted by the loss's own kernel. (The callback
    compiles on FP8 GPUs only; this checks the rule, not a compiled Trainer step.)"""
    args = SimpleNamespace(**{"bf16": False, "fp16": False, "deepspeed": None, **options})
    assert logits_dtype_for(args) is expected
