"""An FP8 layer's scaling over steps: the first step's own amax, then delayed scales from the history
(rolled newest first, ``max`` or ``most_recent``, a margin, an interval), current scaling, saturation
on a jump, and layers of different recipes ending a step together."""

import pytest
import torch
from conftest import make_layer
from torch import nn

from hf_fp8 import E4M3, Fp8Linear, cast_to_representable, update_fp8_scales
from hf_fp8.formats import compute_scale

INPUT, WEIGHT, GRAD = 0, 1, 2


def test_first_step_scales_by_own_amax_then_history():
    _, layer = make_layer(bias=False)
    x = torch.randn(16, 64) * 3
    layer(x)
    assert layer.scale[INPUT] == compute_scale(x.abs().max(), E4M3)
    assert layer.amax_history[INPUT, 0] == x.abs().max()
    update_fp8_scales(layer)
    layer(x / 8)  # a smaller input is scaled by the history (step 0's amax), not by its own amax
    assert layer.scale[INPUT] == compute_scale(x.abs().max(), E4M3)


def test_delayed_scale_comes_from_earlier_steps_and_saturates_on_a_jump():
    """Step t uses the scale from the history up to t-1: a sudden 4x larger input saturates at the old
    scale for one step, then the scale catches up."""
    linear, layer = make_layer(bias=False)
    x = torch.randn(16, 64)
    x = x / x.abs().max()  # amax exactly 1
    layer(x)
    update_fp8_scales(layer)
    assert layer.scale[INPUT].item() == pytest.approx(448.0)

    big = 4 * x
    y = layer(big)
    assert layer.scale[INPUT].item() == pytest.approx(448.0), "step 1 must use step 0's scale"
    w_r = cast_to_representable(linear.weight.detach(), E4M3, layer.scale[WEIGHT])
    saturated = cast_to_representable(big.clamp(-1, 1), E4M3, 448.0)
    assert torch.allclose(y, saturated @ w_r.T, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(y).all()

    update_fp8_scales(layer)
    assert layer.scale[INPUT].item() == pytest.approx(112.0)  # 448 / 4: the history's max
    y = layer(big)
    assert torch.allclose(y, cast_to_representable(big, E4M3, 112.0) @ w_r.T, rtol=1e-5, atol=1e-6)


def run_steps(layer, amaxes):
    """One training step per amax: forward and backward of an input whose amax is exactly that."""
    torch.manual_seed(1)
    for amax in amaxes:
        x = torch.randn(16, 64)
        x = (x / x.abs().max() * amax).requires_grad_()
        layer(x).sum().backward()
        update_fp8_scales(layer)


def test_history_rolls_with_the_newest_amax_first():
    _, layer = make_layer(amax_history_len=4)
    run_steps(layer, [1.0, 2.0, 8.0])
    # After the update, slot 0 is free for the next step.
    assert layer.amax_history[INPUT].tolist() == [0.0, 8.0, 2.0, 1.0]
    run_steps(layer, [0.5, 0.25])
    assert layer.amax_history[INPUT].tolist() == [0.0, 0.25, 0.5, 8.0], "oldest entries fall off"
    assert layer.fp8_steps.item() == 5


@pytest.mark.parametrize("forward_in_fp8", [True, False])
def test_a_weight_cast_with_its_stored_scale_has_its_amax_taken_once_a_step(forward_in_fp8):
    """The first step takes the weight's amax in the forward (it scales by it). Later steps take it when
    the step ends, for all layers at once, so the forward records none; or, with forwards in high
    precision, in the backward's cast of the weight, its only one, which reads it anyway. Either way the
    history holds the amax of the weight each step used."""
    linear, layer = make_layer(amax_history_len=4)
    layer = Fp8Linear.from_float(linear, layer.recipe, forward_in_fp8=forward_in_fp8)
    x = torch.randn(16, 64, requires_grad=True)
    used = []
    for step in range(3):
        with torch.no_grad():
            linear.weight.mul_(2.0)  # what an optimizer step does between two steps
        used.insert(0, linear.weight.abs().max().item())
        layer(x).sum().backward()
        first = step == 0
        assert (layer.amax_history[WEIGHT, 0].item() == used[0]) == first, step
        assert (layer.backward_amax[WEIGHT, 0].item() == used[0]) == (not forward_in_fp8), step
        assert layer.amax_history[INPUT, 0] == x.abs().max()
        update_fp8_scales(layer)
    assert layer.amax_history[WEIGHT].tolist() == [0.0, *used]


@pytest.mark.parametrize(("algo", "expected_amax"), [("max", 8.0), ("most_recent", 2.0)])
def test_amax_compute_algo(algo, expected_amax):
    _, layer = make_layer(amax_history_len=4, amax_compute_algo=algo)
    run_steps(layer, [1.0, 8.0, 2.0])
    assert layer.scale[INPUT].item() == pytest.approx(448.0 / expected_amax)
    grad_amax = layer.amax_history[GRAD, 1]
    assert grad_amax == 1.0  # d(sum)/dy is all ones
    assert layer.scale[GRAD].item() == pytest.approx(57344.0)


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_margin(margin):
    _, layer = make_layer(margin=margin)
    run_steps(layer, [2.0])
    assert layer.scale[INPUT].item() == pytest.approx(448.0 / (2.0 * 2**margin))
    assert layer.scale[GRAD].item() == pytest.approx(57344.0 / 2**margin)


def test_interval_recomputes_scales_every_n_steps():
    _, layer = make_layer(interval=3, amax_history_len=1)
    seen = []
    for amax in [1.0, 2.0, 4.0, 8.0, 16.0]:
        run_steps(layer, [amax])
        seen.append(round(448.0 / layer.scale[INPUT].item(), 3))
    # Recomputed after steps 0 and 3 only; in between the scale stays.
    assert seen == [1.0, 1.0, 1.0, 8.0, 8.0]


def test_layers_of_different_recipes_end_a_step_together_as_each_would_alone():
    recipes = [
        dict(amax_history_len=4, interval=2),
        dict(amax_history_len=4, margin=2, amax_compute_algo="most_recent"),
        dict(amax_history_len=4, interval=2),  # shares the first layer's recipe, not its step count
        dict(amax_history_len=4, format="e4m3"),
        dict(amax_history_len=4, scaling="current"),
        dict(amax_history_len=4, interval=2),  # and the same recipe in a BF16 layer (its state float32)
    ]

    def layers():
        made = [make_layer(seed=i, **r)[1] for i, r in enumerate(recipes)]
        made[2].fp8_steps.fill_(1)  # due for a new scale on odd steps, while the first layer is on even
        made[5].to(torch.bfloat16)
        return made

    together, alone = nn.ModuleList(layers()), layers()
    torch.manual_seed(1)
    for amax in [1.0, 2.0, 4.0]:
        x = torch.randn(16, 64)
        x = x / x.abs().max() * amax
        for layer, single in zip(together, alone, strict=True):
            layer(x.to(layer.weight.dtype)).float().square().sum().backward()
            single(x.to(single.weight.dtype)).float().square().sum().backward()
            update_fp8_scales(single)
        update_fp8_scales(together)
    for layer, single in zip(together, alone, strict=True):
        assert layer.amax_history.dtype == single.amax_history.dtype
        assert torch.equal(layer.amax_history, single.amax_history)
        assert torch.equal(layer.scale, single.scale)
        assert layer.fp8_steps.item() == single.fp8_steps.item()
    assert together[5].weight.dtype == torch.bfloat16 and together[5].scale.dtype == torch.float32
    assert together[0].scale[INPUT] == 448.0 / 4, "interval 2 from step 0: recomputed after steps 0 and 2"
    assert together[2].scale[INPUT] == 448.0 / 2, "interval 2 from step 1: recomputed after step 1 only"
    assert together[1].scale[INPUT] == 448.0 / 4 / 2**2, "most_recent with margin 2: the last amax"


def test_current_scaling_uses_each_tensors_own_amax():
    _, layer = make_layer(scaling="current")
    for amax in [1.0, 16.0, 0.5]:
        x = torch.randn(16, 64)
        x = x / x.abs().max() * amax
        layer(x)
        assert layer.scale[INPUT].item() == pytest.approx(448.0 / amax)
        update_fp8_scales(layer)
    assert layer.amax_history[INPUT, 1:4].tolist() == [0.5, 16.0, 1.0], "amaxes still recorded"


def test_overflow_saturates_instead_of_inf_or_nan():
    linear, layer = make_layer()
    run_steps(layer, [1e-3])  # tiny scale history
    x = (torch.randn(16, 64) * 1e4).requires_grad_()  # far beyond it
    y = layer(x)
    y.backward(torch.full_like(y, 1e30))  # gradients far beyond E5M2 at the stored scale
    assert (
        torch.isfinite(y).all() and torch.isfinite(x.grad).all() and torch.isfinite(linear.weight.grad).all()
    )
