"""TRL's trainers with FP8: each trains with FP8 layers doing the work, its gradients reach the weights
as the unpatched model's do, each optimizer step is one FP8 step, and the per-token outputs TRL reads
(its fused LM head's log-probs, a packed row's positions) are those of the unpatched model.

Every run is compared with the same run unpatched (float32 on the CPU): loss within 2% and grad norm
within 10% at every step; the FP8 step counted once per optimizer step with the gradients' amaxes
recorded; FP8 GEMMs run. Nothing in the TRL configs works around FP8 (no ``pad_to_multiple_of``).
"""

from __future__ import annotations

import math

import pytest
import torch
import trl_setup as ts
from conftest import ScaledMmCalls

import hf_fp8
from hf_fp8.layers.fp8_scaled import Fp8Scaled
from hf_fp8.numerics.scaling import GRAD_OUTPUT

trl = ts.trl


def fp8_layers(model) -> list[Fp8Scaled]:
    return [m for m in model.modules() if isinstance(m, Fp8Scaled)]


def assert_trains_as_unpatched(fp8_run, reference_run, loss_key: str = "loss") -> None:
    """FP8 GEMMs ran; every step's loss within 2% and grad norm within 10% of the unpatched run's; one FP8
    step per optimizer step, each with its gradients' amaxes."""
    (trainer, calls), (reference, _) = fp8_run, reference_run
    assert calls, "no FP8 GEMM ran"
    losses, reference_losses = ts.logged(trainer, loss_key), ts.logged(reference, loss_key)
    assert len(losses) == trainer.args.max_steps
    for step, (loss, expected) in enumerate(zip(losses, reference_losses, strict=True)):
        assert loss == pytest.approx(expected, rel=0.02), f"step {step + 1}: loss {loss} vs {expected}"
    norms, reference_norms = ts.logged(trainer, "grad_norm"), ts.logged(reference, "grad_norm")
    for step, (norm, expected) in enumerate(zip(norms, reference_norms, strict=True)):
        assert expected > 0 and norm == pytest.approx(expected, rel=0.1), f"step {step + 1}: grad norm"
    steps = trainer.state.global_step
    trained = [m for m in fp8_layers(trainer.model) if m.amax_history[GRAD_OUTPUT].any()]
    assert trained, "no FP8 layer recorded a gradient amax"
    for layer in trained:
        assert int(layer.fp8_steps) == steps, "the FP8 step did not end once per optimizer step"
        assert (layer.amax_history[GRAD_OUTPUT, 1 : steps + 1] > 0).all(), (
            "a step ended without its gradients"
        )


# ---- the fused LM head ------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [13, 40])
def test_fused_head_log_probs_are_the_unpatched_models(length):
    """TRL's fused LM head returns per-token log-probs, 2-D and shifted: the patched model returns them at
    the caller's length, equal to the unpatched model's within FP8 rounding, and its backward ends the
    step (the head's loss is never backpropagated through)."""
    from trl.trainer.utils import add_fused_lm_head

    reference, model = ts.tiny_llama(), ts.tiny_llama()
    for m in (reference, model):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    hf_fp8.patch_model(model)
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (3, length))
    labels = ids.clone()
    labels[0, :5] = -100
    expected = reference(input_ids=ids, labels=labels, fused_lm_head=True)
    got = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert got.log_probs.shape == expected.log_probs.shape == (3, length - 1)
    torch.testing.assert_close(got.log_probs, expected.log_probs, rtol=0.05, atol=0.05)
    torch.testing.assert_close(got.entropy, expected.entropy, rtol=0.02, atol=0.02)
    assert (got.log_probs[0, :4] == 0).all(), "ignored positions stay zero"
    got.log_probs.sum().backward()  # through the log-probs, not the returned loss
    torch.optim.SGD(model.parameters(), lr=0.0).step()
    layers = fp8_layers(model)
    assert all(int(m.fp8_steps) == 1 for m in layers)
    assert all(m.amax_history[GRAD_OUTPUT, 1] > 0 for m in layers), "the step's gradient amaxes"


def test_a_step_ends_before_any_optimizer_steps():
    """A loss made from something else than the outputs (here the hidden states, through the head by
    hand) ends the step at the optimizer step, once; a second optimizer step with no forward between
    them ends nothing more."""
    model = ts.tiny_llama()
    hf_fp8.patch_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in (1, 2):
        hidden = model.model(input_ids=torch.randint(0, 256, (2, 21))).last_hidden_state
        model(
            input_ids=torch.randint(0, 256, (2, 21))
        )  # a training forward of the model, never backpropagated
        model.lm_head(hidden).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.step()
        assert {int(m.fp8_steps) for m in fp8_layers(model)} == {step}


# ---- SFT --------------------------------------------------------------------------------------------


SFT_CASES = {
    "plain": dict(dataset=ts.text_rows, config={}),
    "packing": dict(dataset=ts.text_rows, config={"packing": True, "max_length": 64}),
    "padding-free": dict(dataset=ts.text_rows, config={"padding_free": True, "max_length": None}),
    "completion-only": dict(dataset=ts.prompt_completion_rows, config={"completion_only_loss": True}),
    "assistant-only": dict(dataset=ts.conversation_rows, config={"assistant_only_loss": True}),
}


@pytest.mark.parametrize("case", SFT_CASES)
def test_sft_trains_in_fp8(case, tmp_path):
    spec = SFT_CASES[case]
    runs = ts.with_and_without_fp8(
        trl.SFTTrainer,
        trl.SFTConfig,
        tmp_path,
        train_dataset=spec["dataset"](),
        config=dict(spec["config"]),
    )
    assert_trains_as_unpatched(*runs)


def test_accumulated_micro_batches_are_one_fp8_step_under_the_fused_head(tmp_path):
    """Gradient accumulation with TRL's fused head (its loss comes from per-token log-probs, not the
    model's returned loss): the step ends at the optimizer step, once for all micro-batches."""
    runs = ts.with_and_without_fp8(
        trl.SFTTrainer,
        trl.SFTConfig,
        tmp_path,
        train_dataset=ts.text_rows(),
        config={"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2},
    )
    assert_trains_as_unpatched(*runs)


def test_sft_lora_over_fp8_weights(tmp_path):
    """LoRA through ``peft_config`` over base weights stored in FP8 (``lora-fp8``): the adapters train."""
    from peft import LoraConfig

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    runs = ts.with_and_without_fp8(
        trl.SFTTrainer,
        trl.SFTConfig,
        tmp_path,
        recipe="lora-fp8",
        train_dataset=ts.text_rows(),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=targets),
        config={"learning_rate": 1e-2},
    )
    assert_trains_as_unpatched(*runs)
    stored = [m for m in fp8_layers(runs[0][0].model) if m.weight_in_fp8]
    assert len(stored) == 2 * 7, "every targeted base weight stored in FP8"


def test_packed_row_gives_each_sequence_its_own_loss():
    """Sequences packed into one row (position ids restarting, no mask, no cache: how TRL's padding-free
    batches reach transformers, which then masks each sequence off) give the losses of the same
    sequences run one by one: no token attends across a boundary, FP8 or not."""
    model = ts.tiny_llama()
    hf_fp8.patch_model(model)
    torch.manual_seed(2)
    lengths = (7, 12, 5)  # 24 tokens in all: no multiple of 16
    sequences = [torch.randint(0, 256, (n,)) for n in lengths]
    packed = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]

    def token_losses(logits, ids):
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")

    for fp8, tolerance in ((False, 1e-5), (True, 0.02)):
        with hf_fp8.fp8_autocast(fp8), torch.no_grad():
            logits = model(input_ids=packed, position_ids=positions, use_cache=False).logits
            assert logits.shape[1] == packed.shape[1]
            start = 0
            for ids in sequences:
                alone = token_losses(model(input_ids=ids[None]).logits, ids[None])
                inside = token_losses(logits[:, start : start + len(ids)], ids[None])
                # to float rounding in high precision; in FP8, each sequence's loss to FP8 rounding
                # (packed and alone, the tensors differ, and so do their scales)
                assert inside.mean() == pytest.approx(alone.mean(), rel=tolerance)
                start += len(ids)


# ---- DPO --------------------------------------------------------------------------------------------


def frozen_reference(fp8: bool, recipe: str | None = None):
    reference = ts.tiny_llama()
    if not fp8:
        return reference.requires_grad_(False)
    report = hf_fp8.prepare_reference(reference, recipe)
    assert any("reference" in note for note in report.notes)
    return reference


def dpo_with_and_without_fp8(tmp_path, reference, config: dict | None = None, **kwargs) -> list[tuple]:
    """:func:`ts.run` of DPO in FP8 with ``reference(True)`` as its reference, then unpatched with
    ``reference(False)``, on the same pairs."""
    return [
        ts.run(
            trl.DPOTrainer,
            trl.DPOConfig,
            tmp_path / str(fp8),
            fp8,
            ref_model=reference(fp8),
            train_dataset=ts.preference_rows(),
            config=dict(config or {}),
            **kwargs,
        )
        for fp8 in (True, False)
    ]


def assert_first_step_scores_as_unpatched(fp8_trainer, plain_trainer) -> None:
    """DPO's log-probs and loss at the first step are the unpatched run's, to float rounding."""
    for key in ("logps/chosen", "logps/rejected", "loss"):
        got, expected = ts.logged(fp8_trainer, key)[0], ts.logged(plain_trainer, key)[0]
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-5), key


DPO_CASES = {
    "reference-bf16": dict(reference=lambda: frozen_reference(False)),
    "reference-prepared": dict(reference=lambda: frozen_reference(True)),
    "reference-fp8-weights": dict(reference=lambda: frozen_reference(True, "reference-fp8")),
    "precomputed": dict(reference=lambda: frozen_reference(False), config={"precompute_ref_log_probs": True}),
}


@pytest.mark.parametrize("case", DPO_CASES)
def test_dpo_trains_in_fp8(case, tmp_path):
    spec = DPO_CASES[case]
    runs = dpo_with_and_without_fp8(
        tmp_path, lambda fp8: spec["reference"]() if fp8 else frozen_reference(False), spec.get("config")
    )
    assert_trains_as_unpatched(*runs)
    for key in ("logps/chosen", "logps/rejected"):
        got, expected = ts.logged(runs[0][0], key), ts.logged(runs[1][0], key)
        assert all(v < -1 for v in got), f"{key}: {got}"
        assert got == pytest.approx(expected, rel=0.02)


def test_dpo_lora_takes_the_disabled_adapters_as_reference(tmp_path):
    from peft import LoraConfig

    runs = ts.with_and_without_fp8(
        trl.DPOTrainer,
        trl.DPOConfig,
        tmp_path,
        recipe="lora-fp8",
        train_dataset=ts.preference_rows(),
        config={"learning_rate": 1e-2},
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]),
    )
    assert_trains_as_unpatched(*runs)
    assert ts.logged(runs[0][0], "logps/chosen")[0] < -1


def test_dpo_with_an_fp8_reference_starts_at_ln_2(tmp_path):
    """Policy and reference hold the same weights at the first step and compute the same FP8 log-probs,
    so DPO's first loss is ln 2 exactly as in BF16 (a reference that rounds otherwise starts elsewhere)."""
    trainer, _ = ts.run(
        trl.DPOTrainer,
        trl.DPOConfig,
        tmp_path,
        True,
        ref_model=frozen_reference(True),
        train_dataset=ts.preference_rows(),
        config={},
    )
    assert ts.logged(trainer, "loss")[0] == pytest.approx(math.log(2), abs=1e-4)


def test_dpo_under_backward_fp8_scores_as_the_unpatched_policy(tmp_path):
    """``backward-fp8``: forwards in high precision, so DPO's log-probs (and its loss) at the first step
    are the unpatched run's to float rounding; the backward's GEMMs still run in FP8."""
    runs = dpo_with_and_without_fp8(
        tmp_path, lambda fp8: frozen_reference(fp8, "backward-fp8" if fp8 else None), recipe="backward-fp8"
    )
    assert_trains_as_unpatched(*runs)
    assert_first_step_scores_as_unpatched(runs[0][0], runs[1][0])


def test_dpo_from_a_checkpoint_takes_backward_fp8_without_being_told(tmp_path):
    """DPO as users run it: the policy given as a checkpoint's path and a reference loaded from it, no recipe
    named. Both take a checkpoint's default, ``backward-fp8``: the first step scores as the unpatched run,
    and only backward GEMMs run in FP8 (one operand E5M2)."""
    from transformers import AutoModelForCausalLM

    checkpoint = tmp_path / "checkpoint"
    ts.tiny_llama().save_pretrained(checkpoint)

    def reference(fp8: bool):
        model = AutoModelForCausalLM.from_pretrained(checkpoint)
        if not fp8:
            return model.requires_grad_(False)
        report = hf_fp8.prepare_reference(model)
        assert report.recipe == hf_fp8.RECIPES["backward-fp8"].replace(use_during_eval=True)
        return model

    runs = dpo_with_and_without_fp8(tmp_path, reference, model=str(checkpoint))
    (fp8_trainer, gemms), (plain_trainer, _) = runs
    (callback,) = [
        c for c in fp8_trainer.callback_handler.callbacks if isinstance(c, hf_fp8.Fp8TrainerCallback)
    ]
    assert callback.report.recipe == hf_fp8.RECIPES["backward-fp8"]
    assert gemms and all(torch.float8_e5m2 in pair for pair in gemms), "backward GEMMs only, in FP8"
    assert_trains_as_unpatched(*runs)  # gradients reach the weights: grad norms beside the unpatched run's
    assert_first_step_scores_as_unpatched(fp8_trainer, plain_trainer)
    assert ts.logged(fp8_trainer, "loss")[0] == pytest.approx(math.log(2), abs=1e-4)


def test_prepare_reference_freezes_the_model_and_takes_the_policys_recipe():
    model = ts.tiny_llama()
    report = hf_fp8.prepare_reference(model)
    assert not any(p.requires_grad for p in model.parameters())
    assert report.recipe == hf_fp8.Fp8Recipe(use_during_eval=True), "the policy's recipe, FP8 in eval"
    assert not any(m.weight_in_fp8 for m in fp8_layers(model)), "cast as the policy casts"
    assert not any("compiled" in note for note in report.notes), "the CPU stays eager"
    with pytest.raises(TypeError, match="compile must be"):
        hf_fp8.prepare_reference(ts.tiny_llama(), compile="yes")


def test_reference_fp8_recipe_runs_a_frozen_model_in_fp8_in_eval_mode():
    reference = frozen_reference(True, "reference-fp8").eval()
    assert all(m.weight_in_fp8 for m in fp8_layers(reference)) and fp8_layers(reference)
    with torch.no_grad(), ScaledMmCalls() as calls:
        reference(input_ids=torch.randint(0, 256, (4, 80)))
    assert calls.calls, "the reference's forward ran no FP8 GEMM"


# ---- GRPO, generation, reward models ---------------------------------------------------------------


def reward_length(completions, **kwargs) -> list[float]:
    return [-abs(len(c) - 12) / 12.0 for c in completions]


def test_grpo_trains_in_fp8(tmp_path):
    """GRPO generates with the model it trains (no vLLM): same sampled completions from the same seed in
    FP8 and not, the per-token log-probs and entropy of the training forward as the unpatched model's."""
    config = {
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 12,
        "learning_rate": 1e-2,
        "temperature": 1.0,
    }
    runs = ts.with_and_without_fp8(
        trl.GRPOTrainer,
        trl.GRPOConfig,
        tmp_path,
        reward_funcs=reward_length,
        train_dataset=ts.prompt_rows(),
        config=dict(config),
    )
    (trainer, calls), (reference, _) = runs
    assert calls
    # GRPO's first loss is zero by construction (advantages times a ratio of 1); its gradient is not.
    for key in ("entropy", "completions/mean_length"):
        assert ts.logged(trainer, key) == pytest.approx(ts.logged(reference, key), rel=0.05), key
    norms, expected = ts.logged(trainer, "grad_norm"), ts.logged(reference, "grad_norm")
    assert all(e > 0 for e in expected) and norms == pytest.approx(expected, rel=0.1)
    steps = trainer.state.global_step
    assert all(int(m.fp8_steps) == steps for m in fp8_layers(trainer.model))


def test_greedy_generate_matches_and_never_pads_a_decode_step():
    """``generate`` from a patched model in training mode (as GRPO calls it): the greedy tokens of the
    unpatched model; each decode step's layers see one row a sequence (no padding to 16), through the
    plain layer (faster at a few rows: see Fp8Linear.plain_is_faster), and the prefill in FP8."""
    reference, model = (ts.tiny_llama(seed=3, max_position_embeddings=2560) for _ in range(2))
    hf_fp8.patch_model(model)
    prompt = torch.randint(0, 256, (2, 2100))  # a prefill of 4200 rows: above the plain layer's limit
    rows = []
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.register_forward_pre_hook(lambda m, args: rows.append(args[0].numel() // args[0].shape[-1]))
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=ts.PAD)
    with torch.no_grad():
        expected = reference.generate(prompt, **kwargs, output_scores=True, return_dict_in_generate=True)
        with ScaledMmCalls() as calls:
            got = model.generate(prompt, **kwargs)
    assert len(calls.calls) == len(fp8_layers(model)), "the prefill ran in FP8, the decode steps did not"
    assert rows == [4200] + [2] * 7
    # Each row's tokens are the unpatched model's until, if ever, a choice within FP8 rounding of a tie
    # (a random model's logits are nearly flat): there the unpatched model ranks FP8's token within 0.2.
    for row in range(2):
        new, reference_new = got[row, 2100:], expected.sequences[row, 2100:]
        differs = (new != reference_new).nonzero()
        if len(differs):
            step = int(differs[0])
            scores = expected.scores[step][row]
            assert scores.max() - scores[new[step]] < 0.2, f"row {row}, step {step}: not a near tie"
    assert model.training and all(int(m.fp8_steps) == 0 for m in fp8_layers(model)), "no step recorded"


def test_reward_trainer_trains_in_fp8(tmp_path):
    """A sequence classification head of one output stays in high precision (FP8 GEMMs need 16), the
    decoder runs in FP8, and the reward margin grows as the unpatched model's."""
    from transformers import AutoModelForSequenceClassification

    def reward_model():
        torch.manual_seed(0)
        config = ts.tiny_llama().config
        config.num_labels = 1
        return AutoModelForSequenceClassification.from_config(config)

    runs = ts.with_and_without_fp8(
        trl.RewardTrainer,
        trl.RewardConfig,
        tmp_path,
        model=reward_model,
        train_dataset=ts.preference_rows(),
    )
    assert_trains_as_unpatched(*runs)
    callback = next(
        c for c in runs[0][0].callback_handler.callbacks if isinstance(c, hf_fp8.Fp8TrainerCallback)
    )
    assert any(r.name == "score" and "16" in r.reason for r in callback.report.records)


# ---- checkpoints ------------------------------------------------------------------------------------


def test_sft_resumes_exactly_from_a_checkpoint(tmp_path):
    config = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "packing": True, "max_length": 64}
    whole, _ = ts.run(
        trl.SFTTrainer,
        trl.SFTConfig,
        tmp_path / "whole",
        True,
        train_dataset=ts.text_rows(),
        config=dict(config),
    )
    config_resumed = trl.SFTConfig(**ts.common_arguments(tmp_path / "whole", **config))
    resumed = trl.SFTTrainer(
        model=ts.tiny_llama(seed=9),
        args=config_resumed,
        train_dataset=ts.text_rows(),
        processing_class=ts.byte_tokenizer(),
        callbacks=[hf_fp8.Fp8TrainerCallback()],
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    assert ts.logged(resumed, "loss")[2:] == ts.logged(whole, "loss")[2:]
    for a, b in zip(fp8_layers(whole.model), fp8_layers(resumed.model), strict=True):
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
    assert not math.isnan(ts.logged(resumed, "loss")[-1])
