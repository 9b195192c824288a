"""Fp8NanGuard in a plain training loop (no Trainer): non-finite steps caught before the optimizer."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from peft import LoraConfig, get_peft_model

from hf_fp8 import Fp8NanGuard, Fp8Recipe, patch_model

LAYER = "model.layers.1.mlp.down_proj"


def poison(module, args):
    x = args[0].clone()
    x[0, 0, 0] = float("nan")
    return (x,)


def loop(model, guard, steps: int, poisoned_step: int, layer, optimizer=None) -> list[bool]:
    """Train ``steps`` steps, a NaN put into ``layer``'s input at ``poisoned_step``; what check said."""
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    results = []
    for step in range(steps):
        handle = layer.register_forward_pre_hook(poison) if step == poisoned_step else None
        batch = tm.batch_for("llama", 32, seed=step)
        model(**batch).loss.backward()
        if handle is not None:
            handle.remove()
        ok = guard.check(step)
        if ok:
            optimizer.step()
        optimizer.zero_grad()
        results.append(ok)
    return results


def test_raise_names_the_layer_before_the_weights_change():
    model = tm.build("llama")
    patch_model(model)
    guard = Fp8NanGuard(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(
        FloatingPointError, match=rf"step 0: non-finite amax of input/grad_output in layer '{LAYER}'"
    ):
        loop(model, guard, steps=2, poisoned_step=0, layer=model.get_submodule(LAYER))
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_with_a_fused_optimizer_the_check_waits_for_nothing_and_the_optimizer_skips_the_step():
    """Handed the optimizer, ``raise`` does not read the flags at once: the fused optimizer skips the
    non-finite step itself (found_inf), and the next check raises, naming the step and the layer."""
    model = tm.build("llama")
    patch_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = Fp8NanGuard(model, optimizer=optimizer)
    assert not guard.waits_for_device
    weights: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(
        lambda *_: weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    )
    with pytest.raises(
        FloatingPointError, match=rf"step 2: non-finite amax of input/grad_output in layer '{LAYER}'.*skipped"
    ):
        loop(model, guard, steps=4, poisoned_step=2, layer=model.get_submodule(LAYER), optimizer=optimizer)
    assert len(weights) == 3, "raised at the check after the non-finite step, before the next update"
    assert all(not torch.equal(weights[1][n], weights[2][n]) for n in ("model.layers.0.mlp.up_proj.weight",))
    for name, param in model.named_parameters():
        assert torch.equal(param, weights[2][name]), f"{name} changed by the non-finite step"
    assert all(optimizer.state[p]["step"].item() == 2 for p in model.parameters()), "the skip is undone"
    assert not hasattr(optimizer, "found_inf"), "the flag is the optimizer's for one step only"


def test_flush_raises_for_the_last_step_and_a_plain_optimizer_keeps_the_waiting_check():
    model = tm.build("llama")
    patch_model(model)
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    guard = Fp8NanGuard(model, optimizer=fused)
    assert loop(
        model, guard, steps=2, poisoned_step=1, layer=model.get_submodule(LAYER), optimizer=fused
    ) == [
        True,
        True,
    ]
    with pytest.raises(FloatingPointError, match="step 1: "):
        guard.flush()
    guard.flush()  # nothing left to report
    guard.use_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))  # foreach, no found_inf
    assert guard.waits_for_device


@pytest.mark.parametrize("policy", ["skip_step", "increase_margin"])
def test_skipping_policies_drop_one_step_and_roll_the_state_back(policy):
    model = tm.build("llama")
    patch_model(model, Fp8Recipe(nan_policy=policy))
    layer = model.get_submodule(LAYER)
    guard = Fp8NanGuard(model)
    with pytest.warns(UserWarning, match="skipped the step and rolled the amax histories back"):
        results = loop(model, guard, steps=6, poisoned_step=3, layer=layer)
    assert results == [True, True, True, False, True, True]
    assert guard.skipped_steps == 1
    assert torch.isfinite(layer.amax_history).all() and all(
        torch.isfinite(p).all() for p in model.parameters()
    )
    assert layer.fp8_steps.item() == 5  # six steps, one rolled back
    assert layer.recipe.margin == (1 if policy == "increase_margin" else 0)


def test_the_guard_finds_the_patch_inside_a_peft_model():
    model = tm.build("llama")
    patch_model(model, Fp8Recipe(nan_policy="skip_step"))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    guard = Fp8NanGuard(peft_model)
    layer = peft_model.get_base_model().get_submodule(LAYER)
    with pytest.warns(UserWarning, match=LAYER.replace(".", r"\.")):
        assert loop(peft_model, guard, steps=3, poisoned_step=1, layer=layer) == [True, False, True]


def test_an_unpatched_model_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="patch_model"):
        Fp8NanGuard(tm.build("llama"))


def test_a_first_step_rolled_back_does_not_switch_delayed_scaling_off():
    """Skipping the very first step restores a state without scales; the next step's end must read the
    flags again, or delayed scaling would quietly run as current scaling from then on."""
    model = tm.build("llama")
    patch_model(model, Fp8Recipe(nan_policy="skip_step"))
    layer = model.get_submodule(LAYER)
    guard = Fp8NanGuard(model)
    with pytest.warns(UserWarning, match="skipped the step"):
        assert loop(model, guard, steps=2, poisoned_step=0, layer=layer) == [False, True]
    assert layer.stored_scale_roles() == (True, True, True)


def test_to_empty_starts_the_scaling_state_from_zero():
    with torch.device("meta"):
        model = tm.build("llama")
    patch_model(model)
    model.to_empty(device="cpu")
    layer = model.get_submodule(LAYER)
    assert not layer.amax_history.any() and not layer.scale.any() and layer.fp8_steps.item() == 0
    assert not layer.backward_amax.any() and not layer.backward_scale.any(), "the backward record too"


def test_an_fp8_layers_weight_gradient_is_vouched_for_by_its_amaxes_and_refused_past_their_bound():
    """The guard does not read the FP8 linear layers' weight gradients: finite amaxes whose product is
    under 2**90 bound them. A product past it (a finite amax of 1e30 here) is refused, naming the layer,
    before the weights change."""
    model = tm.build("llama")
    patch_model(model)
    layer = model.get_submodule(LAYER)
    guard = Fp8NanGuard(model)
    assert loop(model, guard, steps=2, poisoned_step=-1, layer=layer) == [True, True]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(**tm.batch_for("llama", 32, seed=2)).loss.backward()
    with torch.no_grad():
        layer.amax_history[0, 7] = 1e30  # an input amax kept from an earlier step
    with pytest.raises(FloatingPointError, match=rf"step 2: the amaxes of layer '{LAYER}'.*too large"):
        guard.check(2)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name


def test_gradients_outside_the_fp8_layers_are_read():
    model = tm.build("llama")
    patch_model(model)
    guard = Fp8NanGuard(model)
    embedding = model.get_input_embeddings().weight
    embedding.register_hook(lambda grad: grad.index_fill(0, torch.tensor([3]), float("inf")))
    model(**tm.batch_for("llama", 32, seed=0)).loss.backward()
    with pytest.raises(FloatingPointError, match="non-finite gradients outside the FP8 layers"):
        guard.check(0)
