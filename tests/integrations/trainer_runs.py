"""Training tiny models under a real transformers Trainer on Shakespeare's text (bytes as tokens): the
rows, the arguments and the run, shared by the Trainer tests on the CPU and on a GPU."""

import warnings

import tiny_models as tm
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_fp8 import (
    Fp8TrainerCallback,
)

LENGTH = 64


def arguments(out, **changes) -> TrainingArguments:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        lr_scheduler_type="constant",
        max_steps=30,
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    settings.update(changes)
    return TrainingArguments(**settings)


def train(arch, rows, out, recipe=None, callbacks=(), resume=None, trainer_class=Trainer, **changes):
    """Train a fresh tiny model; return the trainer (its model, state and callback)."""
    model = tm.build(arch, seed=0)
    fp8 = [] if recipe is False else [Fp8TrainerCallback(recipe)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="hf_fp8: the model is on the CPU")
        trainer = trainer_class(
            model=model, args=arguments(out, **changes), train_dataset=rows, callbacks=[*callbacks, *fp8]
        )
        trainer.train(resume_from_checkpoint=resume)
    return trainer


def losses(trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def fp8_callback(trainer) -> Fp8TrainerCallback:
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, Fp8TrainerCallback))


class InjectNaN(TrainerCallback):
    """Puts a NaN into the input of one FP8 layer during one optimizer step."""

    def __init__(self, layer: str, at_step: int):
        self.layer, self.at_step = layer, at_step
        self.handle = None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.at_step:
            self.handle = model.get_submodule(self.layer).register_forward_pre_hook(self.poison)
        elif self.handle is not None:
            self.handle.remove()
            self.handle = None

    @staticmethod
    def poison(module, args):
        x = args[0].clone()
        x[0, 0, 0] = float("nan")
        return (x,)


LAYER = "model.layers.1.mlp.down_proj"
