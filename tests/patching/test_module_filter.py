"""``patch_model(..., module_filter_fn=f)``: a user's function keeps chosen layers in high precision
(torchao's hook), the report names them and why, and every later report of the patched model agrees."""

import pytest
import tiny_models as tm
import torch
from torch import nn

from hf_fp8 import Fp8Linear, patch_model, plan_patch
from hf_fp8.patching.patch import FILTERED


def no_mlp(module: nn.Module, fqn: str) -> bool:
    return ".mlp." not in fqn


def test_filtered_layers_stay_plain_and_the_rest_trains_in_fp8():
    model = tm.build("llama", seed=0)
    asked = []

    def watched(module: nn.Module, fqn: str) -> bool:
        asked.append(fqn)
        return no_mlp(module, fqn)

    report = patch_model(model, backend="native", module_filter_fn=watched)
    mlp = [m for n, m in model.named_modules() if n.endswith(("gate_proj", "up_proj", "down_proj"))]
    attention = [m for n, m in model.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))]
    assert mlp and all(type(m) is nn.Linear for m in mlp)
    assert attention and all(isinstance(m, Fp8Linear) for m in attention)
    skipped = {r.name: r.reason for r in report.skipped}
    assert {n for n, r in skipped.items() if r == FILTERED} == {
        n for n, _ in model.named_modules() if ".mlp." in n and n.endswith("_proj")
    }
    assert "model.layers.0.self_attn.q_proj" in asked  # asked by name in the model
    assert "model.norm" not in asked  # only what the recipe would convert is asked
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in mlp + attention)
    # a later call on the patched model (the Trainer callback makes one) still says why they are plain
    again = {r.name: r.reason for r in patch_model(model).skipped}
    assert {n for n, r in again.items() if r == FILTERED} == {n for n, r in skipped.items() if r == FILTERED}


def test_plan_patch_takes_the_filter_too():
    model = tm.build("llama", seed=0)
    planned = plan_patch(model, module_filter_fn=no_mlp)
    patched = patch_model(model, backend="native", module_filter_fn=no_mlp)
    assert [(r.name, r.action, r.reason) for r in planned.records] == [
        (r.name, r.action, r.reason) for r in patched.records
    ]


def test_a_failing_filter_leaves_the_model_as_it_was_and_names_the_module():
    model = tm.build("llama", seed=0)
    before = {n: type(m) for n, m in model.named_modules()}

    def broken(module: nn.Module, fqn: str) -> bool:
        if fqn.endswith("down_proj"):
            raise KeyError("no such table")
        return True

    with pytest.raises(RuntimeError, match=r"module 'model\.layers\.0\.mlp\.down_proj'.*restored unchanged"):
        patch_model(model, backend="native", module_filter_fn=broken)
    assert {n: type(m) for n, m in model.named_modules()} == before


def test_a_filter_that_is_not_a_function_is_refused_before_anything_changes():
    model = tm.build("llama", seed=0)
    with pytest.raises(
        TypeError, match=r"module_filter_fn must be a function \(module, fqn\) -> bool, got str"
    ):
        patch_model(model, module_filter_fn="mlp")
    with pytest.raises(TypeError, match="plan_patch: module_filter_fn"):
        plan_patch(model, module_filter_fn=["mlp"])
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
