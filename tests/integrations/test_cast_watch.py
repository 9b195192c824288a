"""Fp8CastWatch: a warning, naming the layer, when the share of values FP8 saturates or flushes grows;
from the telemetry of real FP8 casts, in a plain loop and under the Trainer."""

import warnings

import pytest
import tiny_models as tm
import torch
from trainer_runs import arguments
from transformers import Trainer, TrainerCallback

from hf_fp8 import Fp8CastWarning, Fp8CastWatch, Fp8Telemetry, Fp8TrainerCallback, patch_model

LAYER = "model.layers.1.mlp.down_proj"


def _outlier(factor: float):
    """A forward pre-hook that multiplies a layer's input by ``factor``: an outlier that appears at once."""

    def hook(module, args):
        return (args[0] * factor,)

    return hook


def test_a_sudden_outlier_under_delayed_scales_warns_once_naming_the_layer():
    """Delayed scales come from earlier steps' amaxes: an input 1000x larger for one step saturates, and
    the watch says so naming the layer; at the next step that amax, now in the history, scales the usual
    inputs 1000x too small and they flush to zero, which the watch says too, once. The steady steps before
    do not warn."""
    torch.manual_seed(0)
    model = tm.build("llama")
    patch_model(model, "hybrid-delayed", backend="native")
    telemetry, watch = Fp8Telemetry(model, sample_layers=10**6), Fp8CastWatch()
    ids = torch.randint(0, 100, (4, 32))
    said = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 10):
            handle = None
            if step == 6:
                handle = model.get_submodule(LAYER).register_forward_pre_hook(_outlier(1000.0))
            telemetry.arm()
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad()
            if handle is not None:
                handle.remove()
            logs = telemetry.collect()
            said[step] = watch.check(step, logs)
            if step == 6:
                assert logs["fp8/worst_saturated_fwd_layer"] == LAYER and logs["fp8/saturated_fwd"] > 1e-3
    assert [step for step, messages in said.items() if messages] == [6, 7]
    forward, backward = said[6]  # the gradients of that step saturate too
    assert forward.startswith("hf_fp8: step 6: ") and "forward" in forward and "saturated" in forward
    assert f"the most in {LAYER} " in forward and "current-scaling" in forward
    assert "backward" in backward and "saturated" in backward
    (flushed,) = said[7]
    assert "forward" in flushed and "flushed" in flushed and f"the most in {LAYER} " in flushed
    assert [str(w.message) for w in caught if w.category is Fp8CastWarning] == [*said[6], *said[7]]


def test_the_watch_needs_growth_over_its_own_recent_level_and_a_floor():
    """A level that is high from the start is the run's own, not a change; growth below the floor is
    noise; the warning comes again only after the fraction fell back, and then against a recent level that
    holds the raised values."""
    watch = Fp8CastWatch(growth=10.0, window=3)

    def log(flushed):
        return {
            "fp8/flushed_bwd": flushed,
            "fp8/worst_flushed_bwd": flushed,
            "fp8/worst_flushed_bwd_layer": "x",
        }

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Fp8CastWarning)
        steady = [watch.check(s, log(0.05)) for s in range(1, 5)]
        tiny = Fp8CastWatch()
        below_floor = [tiny.check(s, log(v)) for s, v in enumerate((1e-6, 1e-6, 5e-4), 1)]
        rising = Fp8CastWatch(window=3)
        fired = [bool(rising.check(s, log(v))) for s, v in enumerate((1e-4, 1e-4, 2e-3, 3e-3, 1e-4, 3e-2), 1)]
    assert not any(steady) and not any(below_floor)
    assert fired == [False, False, True, False, False, True]


class _OutlierAt(TrainerCallback):
    """From ``step`` on, ``LAYER``'s input is 1000x larger: outliers that appear during training."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            model.get_submodule(LAYER).register_forward_pre_hook(_outlier(1000.0))


def test_the_trainer_callback_warns_when_saturation_grows(text_rows, tmp_path):
    """Under the Trainer the callback's telemetry goes through the watch on every logged step."""
    model = tm.build("llama")
    trainer = Trainer(
        model=model,
        args=arguments(tmp_path, max_steps=7, logging_steps=1),
        train_dataset=text_rows,
        callbacks=[_OutlierAt(5), Fp8TrainerCallback(sample_layers=10**6)],
    )
    with pytest.warns(Fp8CastWarning, match=rf"step 5: .* saturated.*the most in {LAYER}"):
        trainer.train()
