"""The backward record: what FP8 backwards write instead of the scaling state, and how the step's end
folds it in (:mod:`hf_fp8.layers.fp8_scaled`)."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch
from torch import nn

import hf_fp8
from hf_fp8 import Fp8Linear, Fp8Recipe
from hf_fp8.layers.fp8_scaled import clear_backward_records, fold_backward_records
from hf_fp8.patching.step import discard_step, scaling_snapshot

INPUT, WEIGHT, GRAD = 0, 1, 2


def layer(**recipe) -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear.from_float(nn.Linear(64, 32, bias=False), Fp8Recipe(amax_history_len=4, **recipe))


def test_the_fold_keeps_the_larger_amax_and_a_nan_and_replaces_only_a_scale_a_backward_applied():
    delayed, current = layer(), layer(scaling="current")
    delayed.stored_scales = (True, True, True)  # past its first step: every role casts with its stored scale
    for module in (delayed, current):
        module.scale.copy_(torch.tensor([1.0, 2.0, 3.0]))
        module.amax_history[:, 0] = torch.tensor([4.0, 5.0, 6.0])
        module.amax_history[:, 1] = 7.0
        module.backward_amax[:, 0] = torch.tensor([0.0, 0.0, 9.0])
    delayed.backward_amax[GRAD, 0] = float("nan")
    current.backward_scale[GRAD] = 30.0  # what current scaling's backward applied to its gradient
    fold_backward_records([delayed, current])
    assert current.amax_history[:, 0].tolist() == [4.0, 5.0, 9.0], "the larger of forward and backward"
    assert delayed.amax_history[GRAD, 0].isnan(), "a NaN stays for the guard to see"
    assert current.scale.tolist() == [1.0, 2.0, 30.0] and delayed.scale.tolist() == [1.0, 2.0, 3.0]
    assert (current.amax_history[:, 1] == 7.0).all(), "older slots untouched"
    for module in (delayed, current):
        assert not module.backward_amax.any() and not module.backward_scale.any(), "cleared for the next"


def test_the_fold_adds_a_backwards_cast_counts_and_groups_layers_of_other_shapes():
    model = tm.build("mixtral")
    hf_fp8.patch_model(model, Fp8Recipe(convert_experts=True))
    modules = [m for m in model.modules() if isinstance(m, hf_fp8.Fp8Module)][:2] + tm.experts_of(model)[:1]
    assert {m.amax_history.shape[0] for m in modules} == {3, 6}, "linear layers and an experts module"
    for module in modules:
        module.count_casts(True)
        module.cast_counts[0] = 1
        module.backward_cast_counts[-1] = 2
        module.backward_amax[-1, 0] = 8.0
    fold_backward_records(modules)
    for module in modules:
        assert module.cast_counts[0].tolist() == [1, 1, 1] and module.cast_counts[-1].tolist() == [2, 2, 2]
        assert not module.backward_cast_counts.any() and module.amax_history[-1, 0] == 8.0


OLD_TORCH = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 11)


# compiled, from torch 2.11 on (see tests/integrations/test_two_forwards.py)
@pytest.mark.parametrize(
    "compiled", [False, pytest.param(True, marks=pytest.mark.skipif(OLD_TORCH, reason="torch"))]
)
def test_two_forwards_record_the_larger_gradient_amax_of_the_two(compiled):
    """``2 * y1.sum() + 5 * y2.sum()``: the gradients are all 2 and all 5; the step records 5, eager or
    compiled, and the backward leaves the state as its forward left it."""
    torch._dynamo.reset()
    fp8 = layer()
    run = torch.compile(lambda module, x: module(x), backend="aot_eager") if compiled else (lambda m, x: m(x))
    x = torch.randn(16, 64, requires_grad=True)
    y1, y2 = run(fp8, x), run(fp8, 2 * x)
    state = fp8.amax_history.clone()
    (2 * y1.sum() + 5 * y2.sum()).backward()
    assert torch.equal(fp8.amax_history, state) and fp8.backward_amax[GRAD, 0] == 5.0
    hf_fp8.update_fp8_scales(fp8)  # the step's end: folded, then rolled into slot 1
    assert fp8.amax_history[GRAD, 1] == 5.0 and fp8.amax_history[INPUT, 1] == (2 * x).abs().max()


def test_a_discarded_step_clears_the_backward_record():
    model = tm.build("llama")
    hf_fp8.patch_model(model)
    snapshot = scaling_snapshot(model)
    module = next(m for m in model.modules() if isinstance(m, hf_fp8.Fp8Module))
    module.backward_amax.fill_(3.0)  # a backward recorded, its step not ended (its output never hooked)
    discard_step(model, snapshot)
    assert not module.backward_amax.any()
    clear_backward_records([])  # nothing to clear: no error
