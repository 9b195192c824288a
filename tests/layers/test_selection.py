"""Which modules of a model convert, and the report's reason for every one that does not: the
architectures' counts, linear subclasses, ``modules_to_not_convert``, shapes not divisible by 16, the
output head, shared modules, norms recognised by what they compute, and the report itself."""

import pytest
import tiny_models as tm
import torch
from conftest import ScaledMmCalls
from tiny_models import EXPECTED, counts
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from hf_fp8 import Fp8Conv1D, Fp8Linear, Fp8Recipe, is_patched, patch_model, unpatch_model
from hf_fp8.layers.experts import Fp8Experts
from hf_fp8.layers.selection import FORWARD_KEPT, HEAD_FORWARD_KEPT
from hf_fp8.patching.patch import plan_patch
from hf_fp8.patching.step import set_recipe


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
    from transformers import AutoConfig

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


def test_backward_fp8_keeps_every_forward_in_high_precision_and_its_outputs_exact():
    """``forward_in_fp8: false`` (the ``backward-fp8`` recipe): every converted layer computes its forward
    as the plain layer does, to the bit, and runs its backward GEMMs in FP8; the report says so."""
    reference, model = tm.build("llama"), tm.build("llama")
    report = patch_model(model, "backward-fp8")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert layers and not any(m.forward_in_fp8 for m in layers)
    reasons = {r.name: r.reason for r in report.records if r.action == "converted"}
    assert reasons.pop("lm_head") == HEAD_FORWARD_KEPT, "the output head's backward in FP8 too"
    assert set(reasons.values()) == {FORWARD_KEPT}
    assert model.lm_head.recipe.scaling == "block_gw_rowwise", "its gradient in tiles (head_scaling)"
    assert {m.recipe.scaling for m in layers if m is not model.lm_head} == {"delayed"}
    batch = tm.batch_for("llama", 16, seed=0)
    expected, got = reference(**batch), model(**batch)
    assert torch.equal(got.logits, expected.logits), "forwards in high precision"
    with ScaledMmCalls() as calls:
        got.loss.backward()
    assert calls.calls, "the backward's GEMMs ran in FP8"
    expected.loss.backward()
    weight = model.model.layers[0].mlp.up_proj.weight.grad.flatten()
    exact = reference.model.layers[0].mlp.up_proj.weight.grad.flatten()
    assert not torch.equal(weight, exact), "FP8 gradients"
    assert torch.nn.functional.cosine_similarity(weight, exact, dim=0) > 0.99


def test_a_head_whose_forward_stays_in_high_precision_is_not_stored_in_fp8():
    """Under fp8_weights its forward would read FP8-rounded weights: it keeps its dtype, and says so."""
    model = tm.build("llama").requires_grad_(False)
    report = patch_model(model, Fp8Recipe(fp8_weights=True, convert_lm_head="backward"))
    assert not model.lm_head.weight_in_fp8 and model.model.layers[0].mlp.up_proj.weight_in_fp8
    assert any("whose forward runs in high precision" in note for note in report.notes)


def test_head_scaling_scales_the_head_alone_and_stays_through_recipe_changes():
    """``head_scaling``: the converted head (here tied to the embeddings) runs under its own scaling, in
    E4M3, the other layers under the recipe's; the report says so, and a later recipe change (the NaN
    guard's margin, a checkpoint's) keeps the head's scaling."""
    model = tm.build("gemma")
    recipe = Fp8Recipe(convert_lm_head="backward", head_scaling="rowwise")
    report = patch_model(model, recipe)
    head = model.lm_head
    assert (head.recipe.scaling, head.recipe.format) == ("rowwise", "e4m3") and not head.forward_in_fp8
    assert head.weight is model.model.embed_tokens.weight
    others = {(m.recipe.scaling, m.recipe.format) for m in model.modules() if isinstance(m, Fp8Linear)} - {
        ("rowwise", "e4m3")
    }
    assert others == {("delayed", "hybrid")}
    assert any("head_scaling 'rowwise'" in note for note in report.notes), report.notes
    batch = tm.batch_for("gemma", 16, seed=0)
    with ScaledMmCalls() as calls:
        model(**batch).loss.backward()
    assert (torch.float8_e4m3fn, torch.float8_e4m3fn) in calls.calls, "the head's row-wise GEMMs"
    set_recipe(model, recipe.replace(margin=1))
    assert head.recipe == recipe.replace(margin=1).head_recipe and head.recipe.margin == 1
    assert model.model.layers[0].mlp.up_proj.recipe == recipe.replace(margin=1)


def test_head_scaling_needs_a_converted_head():
    with pytest.raises(ValueError, match=r"head_scaling 'block' .*convert_lm_head: false .*unset head_sc"):
        Fp8Recipe(head_scaling="block")
    assert Fp8Recipe(convert_lm_head=True, head_scaling="block").head_recipe.format == "e4m3"
    rowwise = Fp8Recipe(convert_lm_head="backward", scaling="rowwise", format="e4m3")
    assert rowwise.head_recipe is rowwise, "row-wise scaling keeps a head whose forward stays in BF16"


def test_shared_module_is_converted_once_and_stays_shared():
    shared = nn.Linear(32, 32)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    report = patch_model(model)
    assert model[0] is model[2] and isinstance(model[0], Fp8Linear)
    assert len(report.converted) == 1


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
    report = patch_model(model, Fp8Recipe(convert_experts=True))
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
