"""MoE experts in FP8: transformers 5's 3-D expert weights, both projections and their backward."""

from __future__ import annotations

import copy

import pytest
import tiny_models as tm
import torch
from conftest import ScaledMmCalls, assert_fp8_gradients_match
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import hf_fp8
from hf_fp8.assets import load_text
from hf_fp8.experts import Fp8Experts

# MoE-shaped tiny models: as in real MoE models the experts hold most of the FLOPs (Mixtral 8x7B: the
# output head is ~1% of them); hidden 64, experts of 256, 4 layers, top-2 of 4 experts (top-4 of 8 for
# the models that route to more).
_MOE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=tm.VOCAB,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
MOE_CONFIGS = {
    "mixtral": dict(_MOE, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _MOE,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_size=256,
    ),
    "qwen3_moe": dict(_MOE, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=4, head_dim=16),
    "olmoe": dict(_MOE, intermediate_size=256, num_experts=8, num_experts_per_tok=4),
}


def text_batches(steps: int, batch: int = 4, length: int = 32) -> list[dict[str, torch.Tensor]]:
    """Shakespeare as bytes (the tiny models' vocabulary is 256)."""
    data = torch.frombuffer(bytearray(load_text()[: steps * batch * length]), dtype=torch.uint8).long()
    return [{"input_ids": r, "labels": r.clone()} for r in data.view(steps, batch, length)]


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    config = AutoConfig.for_model(arch, **MOE_CONFIGS[arch])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).train()


def experts_of(model) -> list[Fp8Experts]:
    return [m for m in model.modules() if isinstance(m, Fp8Experts)]


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_experts_convert_and_most_gemm_flops_run_in_fp8(arch):
    model = build(arch)
    originals = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    report = hf_fp8.patch_model(model)
    converted = experts_of(model)
    assert len(converted) == len(originals) == 4
    for fp8, original in zip(converted, originals, strict=True):
        assert isinstance(fp8, type(original)) and fp8.down_proj is original.down_proj
    assert report.fp8_flop_share >= 0.95, str(report)
    experts = [r for r in report.converted if r.kind == "experts"]
    assert len(experts) == 4
    routers = [r for r in report.skipped if "router" in r.reason]
    assert routers, "the router stays in high precision"


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_forward_and_backward_match_high_precision(arch):
    """The tolerances of the other architectures: loss within 0.2%, gradients within 25% and the same
    direction (E5M2 gradients have two mantissa bits)."""
    model = build(arch)
    reference = copy.deepcopy(model)
    hf_fp8.patch_model(model)
    batch = tm.batch_for("llama", 32)
    with ScaledMmCalls() as mm:
        loss = model(**batch).loss
        loss.backward()
    experts_calls = len(mm.calls) - 3 * sum(isinstance(m, hf_fp8.Fp8Linear) for m in model.modules())
    assert experts_calls >= 3 * 2 * 4, "FP8 GEMMs for both projections of every expert that got tokens"
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 2e-3 * abs(ref_loss.item())
    assert_fp8_gradients_match(model, reference)
    originals = [m for m in reference.modules() if type(m).__name__.endswith("Experts")]
    for fp8, ref in zip(experts_of(model), originals, strict=True):  # each expert weight, about the same way
        for name in ("gate_up_proj", "down_proj"):
            got, expected = getattr(fp8, name).grad.flatten(), getattr(ref, name).grad.flatten()
            assert torch.nn.functional.cosine_similarity(got, expected, dim=0) > 0.9
    assert all(torch.isfinite(m.amax_history).all() for m in experts_of(model))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_full_training_of_an_moe_model_follows_high_precision(arch):
    batches = text_batches(25)
    reference = tm.train(build(arch), batches, lr=3e-3)
    model = build(arch)
    hf_fp8.patch_model(model)
    losses = tm.train(model, batches, lr=3e-3)
    assert reference[-1] < 0.9 * reference[0], "the high-precision model learns"
    assert sum(losses[-5:]) / 5 == pytest.approx(sum(reference[-5:]) / 5, rel=0.02)


def test_experts_keep_hf_keys_and_round_trip_through_save_and_load(tmp_path):
    model = build("mixtral")
    keys = set(model.state_dict())
    hf_fp8.patch_model(model)
    assert set(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    hf_fp8.unpatch_model(model)
    assert not experts_of(model) and type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"


def test_experts_scaling_state_is_checkpointed_and_synced_like_linear_layers(tmp_path):
    model = build("qwen3_moe")
    hf_fp8.patch_model(model)
    for step in range(2):
        model(**tm.batch_for("llama", 32, seed=step)).loss.backward()
    experts = experts_of(model)[0]
    assert experts.fp8_steps.item() == 2 and (experts.amax_history[:, 1] > 0).all()
    assert (experts.scale > 0).all() and all(experts.stored_scales)
    path = hf_fp8.save_fp8_state(model, tmp_path)
    fresh = build("qwen3_moe")
    hf_fp8.patch_model(fresh)
    hf_fp8.load_fp8_state(fresh, path.parent)
    assert torch.equal(experts_of(fresh)[0].amax_history, experts.amax_history)


def test_unpatch_gives_back_the_parameters_the_experts_hold_now():
    model = build("mixtral")
    hf_fp8.patch_model(model)
    experts = experts_of(model)[0]
    replacement = torch.nn.Parameter(torch.zeros_like(experts.down_proj))
    experts.down_proj = replacement  # as load_state_dict(assign=True) or FSDP would
    hf_fp8.unpatch_model(model)
    assert model.model.layers[0].mlp.experts.down_proj is replacement


def test_model_half_keeps_the_experts_state_float32():
    model = build("olmoe")
    hf_fp8.patch_model(model)
    model.half()
    experts = experts_of(model)[0]
    assert experts.gate_up_proj.dtype == torch.float16 and experts.amax_history.dtype == torch.float32


def test_lora_over_fp8_stored_experts_learns_like_lora_in_high_precision():
    batches = text_batches(30)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "o_proj", "lm_head"])

    def run(fp8: bool) -> tuple[list[float], torch.nn.Module]:
        model = build("mixtral")
        if fp8:
            hf_fp8.patch_model(model, "lora-fp8")
        torch.manual_seed(1)
        peft_model = get_peft_model(model, lora)
        return tm.train(peft_model, batches, lr=5e-2), peft_model

    reference, _ = run(fp8=False)
    losses, model = run(fp8=True)
    stored = experts_of(model)
    assert stored and all(m.weights_in_fp8 for m in stored)
    data = stored[0].gate_up_proj._data
    assert data.dtype == torch.float8_e4m3fn and data.untyped_storage().nbytes() == data.numel()
    assert reference[-1] < 0.9 * reference[0], "the high-precision LoRA learns"
    tail = sum(losses[-5:]) / 5
    assert tail == pytest.approx(sum(reference[-5:]) / 5, rel=0.03)


def test_from_pretrained_fp8_stores_the_experts_in_fp8_too(tmp_path):
    build("qwen3_moe").save_pretrained(tmp_path)
    model, report = hf_fp8.peft.from_pretrained_fp8(tmp_path, device="cpu", dtype=torch.float32)
    experts = experts_of(model)
    assert len(experts) == 4 and all(m.weights_in_fp8 for m in experts)
    assert report.fp8_flop_share >= 0.95


def test_eval_mode_runs_the_models_own_experts_forward():
    model = build("mixtral")
    reference = copy.deepcopy(model).eval()
    hf_fp8.patch_model(model)
    model.eval()
    batch = tm.batch_for("llama", 16)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reference(**batch).logits)
