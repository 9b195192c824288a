"""FP8 in transformers' ``Trainer``: one callback.

``Trainer(..., callbacks=[Fp8TrainerCallback()])`` patches the model when the Trainer is built (before
its optimizer exists) and, on a GPU with FP8, compiles it block by block (:func:`hf_fp8.compile`: eager
FP8 casts cost more than FP8 GEMMs save), and then, at every optimizer step:

* makes sure the FP8 step has ended (the patched model ends it after each backward: amaxes reduced
  over the data-parallel ranks in one all-reduce, scales updated, histories rolled);
* guards against a non-finite loss, gradient or amax, naming the layer, and applies the recipe's
  ``nan_policy`` (``raise``, ``skip_step`` or ``increase_margin``);
* on logging steps adds FP8 telemetry (:mod:`hf_fp8.integrations.telemetry`) to the Trainer's logs,
  and warns (:class:`~hf_fp8.integrations.cast_watch.Fp8CastWarning`, naming the layer) when the share
  of values saturated or flushed to zero grows, before a loss spike shows it;
* on checkpoint saves writes ``fp8_state.safetensors`` into the checkpoint folder, and on
  ``resume_from_checkpoint`` loads it back, so the resumed run uses the scales of the uninterrupted one.

Why :class:`Fp8Trainer` exists: the Trainer creates its reporting callbacks (TensorBoard, W&B, ...)
before the ones passed in ``callbacks``, so they have already written a log when a user callback sees
it. The callback adds its telemetry to ``trainer.state.log_history`` and to what later callbacks get;
``Fp8Trainer`` overrides only ``log`` to add it before any of them, so every integration records it.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_fp8.integrations.cast_watch import Fp8CastWatch
from hf_fp8.integrations.checkpoint import FP8_STATE_FILE, load_fp8_state, save_fp8_state
from hf_fp8.integrations.compiled import compile_model
from hf_fp8.integrations.guard import Fp8NanGuard
from hf_fp8.integrations.telemetry import Fp8Telemetry, StagedLogs
from hf_fp8.integrations.training_arguments import (
    backend_for,
    check_arguments,
    compiles_by_default_for,
    generates,
    log_due,
    logging_strategy,
    logits_dtype_for,
    resume_candidates,
    saved_checkpoint,
    should_compile,
)
from hf_fp8.patching.default_recipe import resolve_recipe
from hf_fp8.patching.patch import is_patched, patch_model, patch_or_recheck
from hf_fp8.patching.patch_state import get_state
from hf_fp8.patching.step import end_pending_step, set_recipe
from hf_fp8.recipe import Fp8Recipe, as_recipe
from hf_fp8.report import PatchReport

__all__ = ["Fp8Trainer", "Fp8TrainerCallback"]


class Fp8TrainerCallback(TrainerCallback):
    """Train in FP8 under transformers' ``Trainer``.

    Args:
        recipe: the FP8 recipe; ``None`` takes the recipe of an already patched model, else the one
            ``hf-fp8 launch`` handed over, else ``patch_model``'s default for the model's weights
            (``backward-fp8`` for a checkpoint's, the defaults for a model built from a config).
        backend: ``patch_model``'s backend when the callback patches the model.
        sample_layers: FP8 layers whose casts are sampled for saturation / flush-to-zero telemetry,
            rounded up to whole decoder blocks; 0: none. ``None`` (default): 8 when the model runs
            eagerly, none when the callback compiles it: there each sampled block compiles once more
            (on one H200, 8b-4l shape: warm-up 52 s against 33 s, and 2% slower steps). Scale and amax
            statistics are logged either way.
        max_consecutive_skips: under ``skip_step`` / ``increase_margin``, raise after this many
            non-finite steps in a row (the cause is then not transient).
        compile: compile the patched model block by block with :func:`hf_fp8.compile`. ``None``
            (default): when it trains on a GPU with FP8 and the Trainer does not shard it (FSDP,
            DeepSpeed: ``compile=True`` compiles before sharding). ``TrainingArguments(torch_compile=True)``
            then means this compilation: the Trainer's whole-model ``torch.compile`` finds the blocks
            compiled and traces only the few operations between them. The CPU stays eager: compiling
            costs minutes there and buys no FP8 speed.
    """

    def __init__(
        self,
        recipe: Fp8Recipe | str | None = None,
        backend: str = "auto",
        sample_layers: int | None = None,
        max_consecutive_skips: int = 10,
        compile: bool | None = None,
    ) -> None:
        if compile not in (None, True, False):
            raise TypeError(
                "Fp8TrainerCallback: compile must be True, False or None (compile on an FP8 GPU), got "
                f"{compile!r}"
            )
        self.recipe = as_recipe(recipe) if recipe is not None else None
        self.backend = backend
        self.compile = compile
        self.sample_layers = sample_layers
        self.max_consecutive_skips = max_consecutive_skips
        self.report: PatchReport | None = None
        self._model: nn.Module | None = None
        self._telemetry: Fp8Telemetry | None = None
        self._guard: Fp8NanGuard | None = None
        self._watch = Fp8CastWatch()
        self._pending_logs: tuple[StagedLogs, dict[str, Any], int] | None = None
        self._logging = False  # whether the step under way will be logged
        # Where Fp8Trainer.train was told to resume from (a plain Trainer does not tell callbacks).
        self.resume_from: str | None = None
        if os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp8":
            # Checked here: the Trainer builds its Accelerator, which acts on it, before on_init_end.
            warnings.warn(
                "hf_fp8: ACCELERATE_MIXED_PRECISION=fp8 makes accelerate convert the model to FP8 a second "
                "time; unset it (hf-fp8 launch does) and let hf-fp8 do the FP8",
                stacklevel=2,
            )

    @property
    def skipped_steps(self) -> int:
        """Steps the NaN guard skipped so far."""
        return self._guard.skipped_steps if self._guard is not None else 0

    # ---- set-up -------------------------------------------------------------------------------

    def on_init_end(self, args, state, control, model: nn.Module | None = None, **kwargs) -> None:
        if model is None:  # model_init: the Trainer builds the model in train(), see on_train_begin
            return
        self._set_up(model, args)

    def on_train_begin(
        self, args, state, control, model: nn.Module | None = None, optimizer: Any = None, **kwargs
    ) -> None:
        if model is not None and model is not self._model:  # built by model_init (hyperparameter search)
            self._set_up(model, args)
        if self._guard is not None and optimizer is not None:
            self._guard.use_optimizer(optimizer)  # a fused optimizer skips non-finite steps on the GPU
        if self._telemetry is None or state.global_step == 0:
            return
        searched = resume_candidates(args, state.global_step, self.resume_from)
        folder = next((f for f in searched if (f / FP8_STATE_FILE).is_file()), None)
        if folder is None:
            where = ", ".join(str(f) for f in searched)
            warnings.warn(
                f"hf_fp8: resuming at step {state.global_step}, but no {FP8_STATE_FILE} in {where}; FP8 "
                "scales start afresh from the next step's amaxes, so this run will not follow the "
                "interrupted one exactly. Resume through Fp8Trainer.train(resume_from_checkpoint=...), or "
                "set TrainingArguments(resume_from_checkpoint=...) to the checkpoint folder",
                stacklevel=2,
            )
            return
        recipe = load_fp8_state(self._model, folder, self.recipe)
        if recipe != self.recipe:
            set_recipe(self._model, recipe)
            self.recipe = recipe

    def _set_up(self, model: nn.Module, args: Any) -> None:
        """Patch ``model`` (or take the recipe of an already patched one) and watch it with the NaN
        guard and the telemetry."""
        self._model = model
        if is_patched(model):
            patched_recipe = get_state(model).recipe
            if self.recipe is not None and self.recipe != patched_recipe:
                warnings.warn(
                    "hf_fp8: the model was already patched with another recipe than the callback's; the "
                    "model's recipe is used. Pass recipe=None, or patch the model with the recipe you want",
                    stacklevel=3,
                )
            self.recipe = patched_recipe
            # patched before the model took its final form (PEFT) or before DeepSpeed showed
            self.report = patch_or_recheck(model)
        else:
            recipe = resolve_recipe(self.recipe, model, self.backend)[0]
            self.report = patch_model(model, self.recipe, backend=backend_for(self.backend, args, recipe))
            self.recipe = self.report.recipe
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if not is_patched(model):  # recipe.enabled is False: a high-precision run
            self._telemetry = None
            return
        check_arguments(args, model)
        compiles = should_compile(self.compile, args, model)
        if self.compile is None and generates(args) and compiles_by_default_for(args, model):
            self.report.add_note(
                "not compiled: this trainer generates with the model it trains, and a compiled FP8 model "
                "decodes several times slower than an eager one (Fp8TrainerCallback(compile=True) compiles)"
            )
        if compiles:
            compile_model(model, logits_dtype=logits_dtype_for(args))
            self.report.add_note("compiled block by block (hf_fp8.compile) by Fp8TrainerCallback")
        sampled = self.sample_layers if self.sample_layers is not None else (0 if compiles else 8)
        if compiles and sampled == 0 and self.sample_layers is None:
            self.report.add_note(
                "no saturation / flush-to-zero telemetry under compilation (each sampled block would "
                "compile once more), so no warning when they grow; Fp8TrainerCallback(sample_layers=8) "
                "logs and watches them"
            )
        self._telemetry = Fp8Telemetry(model, sampled)
        self._guard = Fp8NanGuard(model, self.max_consecutive_skips)

    # ---- each optimizer step ------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self._telemetry is None:
            return
        self._guard.begin_step()
        self._logging = log_due(args, state)
        # The first step's casts are not counted: it scales each tensor by its own amax (no history
        # yet), and under hf_fp8.compile counting it would compile its graph once more.
        if self._logging and state.global_step > 0:
            self._telemetry.arm()

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self._guard is not None:
            self._guard.check(step=state.global_step + 1)
            self.recipe = get_state(self._model).recipe  # increase_margin changes it

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self._telemetry is not None:
            end_pending_step(self._model)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self._telemetry is None or not self._logging:
            return
        # Staged, not read: the numbers reach the host while the Trainer reads its loss, and are read
        # when the log is written, so the telemetry adds no wait for the device.
        staged = self._telemetry.stage()
        extra = {"fp8/skipped_steps": self.skipped_steps, "fp8/margin": self.recipe.margin}
        # By steps, the log comes right after this step or not at all; by epoch, it takes the newest.
        if control.should_log or logging_strategy(args) != "steps":
            self._pending_logs = (staged, extra, state.global_step)

    def pop_telemetry(self) -> dict[str, Any]:
        """The telemetry of the step about to be logged (once), watched for growing saturation and
        flushing (:class:`Fp8CastWatch` warns)."""
        if self._pending_logs is None:
            return {}
        (staged, extra, step), self._pending_logs = self._pending_logs, None
        telemetry = staged.read()
        self._watch.check(step, telemetry)
        return {**telemetry, **extra}

    def on_log(self, args, state, control, logs: dict | None = None, **kwargs) -> None:
        telemetry = self.pop_telemetry()
        if not telemetry or logs is None:
            return
        logs.update(telemetry)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(telemetry)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self._guard is not None:
            self._guard.flush()

    def on_save(self, args, state, control, **kwargs) -> None:
        if self._guard is not None:
            self._guard.flush()  # no checkpoint of a run that went non-finite
        if self._telemetry is None or not args.should_save:
            return
        folder = saved_checkpoint(args, state.global_step)
        if folder is None:
            warnings.warn(
                f"hf_fp8: no {PREFIX_CHECKPOINT_DIR}-{state.global_step} folder under {args.output_dir} to "
                f"put {FP8_STATE_FILE} in; this checkpoint will resume without its FP8 scales",
                stacklevel=2,
            )
            return
        save_fp8_state(self._model, folder, self.recipe)


class Fp8Trainer(Trainer):
    """``Trainer`` with an :class:`Fp8TrainerCallback` whose telemetry every reporting integration
    records (see the module docstring for why this needs ``log``). ``fp8_recipe`` / ``fp8_callback``
    choose the recipe or the whole callback; everything else is ``Trainer``'s."""

    def __init__(
        self,
        *args: Any,
        fp8_recipe: Fp8Recipe | str | None = None,
        fp8_callback: Fp8TrainerCallback | None = None,
        **kwargs: Any,
    ) -> None:
        if fp8_callback is not None and fp8_recipe is not None:
            raise ValueError(
                "give Fp8Trainer either fp8_recipe or fp8_callback (whose recipe is used), not both"
            )
        self.fp8_callback = fp8_callback or Fp8TrainerCallback(recipe=fp8_recipe)
        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), self.fp8_callback]
        super().__init__(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """``Trainer.train``; the callback learns which checkpoint folder it resumes from."""
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            self.fp8_callback.resume_from = str(resume_from_checkpoint)
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        logs.update(self.fp8_callback.pop_telemetry())
        super().log(logs, start_time)
