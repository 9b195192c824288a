"""Token counts that are no multiple of 16: a patched model takes them as they are (each FP8 layer pads
its own GEMM operands) and never changes its inputs or outputs; the collator's optional padding gives
the loss of the unpadded batch and keeps packed sequences apart."""

import copy

import pytest
import tiny_models as tm
import torch
from conftest import ScaledMmCalls
from torch import nn

from hf_fp8 import Fp8PaddingCollator, Fp8Recipe, patch_model
from hf_fp8.patching.padding import pad_batch


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
    assert padded["input_ids"].shape[1] == 16 and lengths.lengths["main"] == (13, 16)
    with torch.no_grad():
        plain, aligned = model(**batch), model(**padded)
    if arch == "bert":
        assert torch.allclose(plain.last_hidden_state, aligned.last_hidden_state[:, :13], atol=1e-5)
    else:
        assert torch.allclose(plain.loss, aligned.loss, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "t5"])
def test_collator_padding_trains_as_the_unpadded_batch(arch):
    """The patched model on the collator's aligned batch and on the raw one: the same loss and logits up
    to FP8 rounding (the pad tokens' activations may change a current scale), the same gradients'
    direction."""
    raw_model = tm.build(arch)
    collated = copy.deepcopy(raw_model)
    patch_model(raw_model)
    patch_model(collated)
    features = [{k: v[i] for k, v in tm.batch_for(arch, 13).items()} for i in range(2)]
    collator = Fp8PaddingCollator(
        pad_token_id=raw_model.config.pad_token_id or 0, encoder_decoder=arch == "t5"
    )
    aligned = collator(features)
    assert aligned["input_ids"].shape[1] == 16 and (aligned["attention_mask"][:, 13:] == 0).all()
    from transformers import default_data_collator

    raw = default_data_collator(features)
    out_a, out_b = raw_model(**raw), collated(**aligned)
    assert out_a.logits.shape[1] == raw["labels"].shape[1]
    assert torch.allclose(out_a.loss, out_b.loss, rtol=2e-2)
    difference = out_a.logits - out_b.logits[:, : out_a.logits.shape[1]]
    assert difference.norm() / out_a.logits.norm() < 0.05
    out_a.loss.backward()
    out_b.loss.backward()
    flat = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (raw_model, collated)]
    assert torch.nn.functional.cosine_similarity(*flat, dim=0) > 0.99


def inner_inputs(model):
    """The keyword inputs the decoder stack of a patched causal LM receives, call by call."""
    calls = []
    model.model.register_forward_pre_hook(lambda m, a, k: calls.append(dict(k)), with_kwargs=True)
    return calls


def test_the_model_sees_the_callers_inputs_and_returns_their_length():
    """No padding, no mask added, position ids as given (a packed row stays packed)."""
    model = tm.build("llama")
    patch_model(model)
    calls = inner_inputs(model)
    ids = torch.randint(4, 256, (2, 13))
    out = model(ids, labels=ids)
    assert calls[-1]["input_ids"].shape == (2, 13) and calls[-1].get("attention_mask") is None
    assert out.logits.shape == (2, 13, 256)
    positions = torch.cat([torch.arange(6), torch.arange(7)]).expand(2, 13)
    model(ids, labels=ids, position_ids=positions)
    assert torch.equal(calls[-1]["position_ids"], positions) and calls[-1].get("attention_mask") is None


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


def test_forward_taking_star_args_runs():
    """A wrapper whose forward takes *args (PeftModel's does)."""

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
