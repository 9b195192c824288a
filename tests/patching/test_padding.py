"""Padding the token dimension to a multiple of 16 on the fly (or once, in the collator): the loss and
the outputs of the unpadded batch, every input filled as documented, and no padding where it would
change a result (evaluation, generation, encoder-decoder tuples, ``*args`` forwards)."""

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
