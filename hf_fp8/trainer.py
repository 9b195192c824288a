"""FP8 in transformers' ``Trainer``: one callback.

``Trainer(..., callbacks=[Fp8TrainerCallback()])`` patches the model when the Trainer is built (before
its optimizer exists), and then, at every optimizer step:

* makes sure the FP8 step has ended (the patched model ends it after each backward: amaxes reduced
  over the data-parallel ranks in one all-reduce, scales updated, histories rolled);
* guards against a non-finite loss, gradient or amax, naming the layer, and applies the recipe's
  ``nan_policy`` (``raise``, ``skip_step`` or ``increase_margin``);
* on logging steps adds FP8 telemetry (:mod:`hf_fp8.telemetry`) to the Trainer's logs;
* on checkpoint saves writes ``fp8_state.safetensors`` into the checkpoint folder, and on
  ``resume_from_checkpoint`` loads it back, so the resumed run uses the scales of the uninterrupted one.

Why :class:`Fp8Trainer` exists: the Trainer creates its reporting callbacks (TensorBoard, W&B, ...)
before the ones passed in ``callbacks``, so they have already written a log when a user callback sees
it. The callback adds its telemetry to ``trainer.state.log_history`` and to what later callbacks get;
``Fp8Trainer`` overrides only ``log`` to add it before any of them, so every integration records it.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_fp8.backends import te as te_backend
from hf_fp8.backends.native import _Fp8Module
from hf_fp8.checkpoint import FP8_STATE_FILE, _te_metas, fp8_state_tensors, load_fp8_state, save_fp8_state
from hf_fp8.distributed import default_amax_group
from hf_fp8.formats import gpu_has_fp8
from hf_fp8.patch import _end_pending_step, _set_recipe, is_patched, patch_model
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import PatchReport
from hf_fp8.telemetry import Fp8Telemetry

__all__ = ["Fp8Trainer", "Fp8TrainerCallback"]

# The role a TE layer's amax history is reported under, by its fp8_meta key.
_TE_DIRECTIONS = {"scaling_fwd": "forward", "scaling_bwd": "backward"}


class Fp8TrainerCallback(TrainerCallback):
    """Train in FP8 under transformers' ``Trainer``.

    Args:
        recipe: the FP8 recipe; ``None`` takes the recipe of an already patched model, else the one
            ``hf-fp8 launch`` handed over, else the defaults.
        backend: ``patch_model``'s backend when the callback patches the model.
        sample_layers: FP8 layers whose casts are sampled for saturation / flush-to-zero telemetry.
        max_consecutive_skips: under ``skip_step`` / ``increase_margin``, raise after this many
            non-finite steps in a row (the cause is then not transient).
    """

    def __init__(
        self,
        recipe: Fp8Recipe | None = None,
        backend: str = "auto",
        sample_layers: int = 8,
        max_consecutive_skips: int = 10,
    ) -> None:
        self.recipe = recipe
        self.backend = backend
        self.sample_layers = sample_layers
        self.max_consecutive_skips = max_consecutive_skips
        self.report: PatchReport | None = None
        self.skipped_steps = 0
        self._consecutive_skips = 0
        self._model: nn.Module | None = None
        self._telemetry: Fp8Telemetry | None = None
        self._losses: list[torch.Tensor] = []
        self._snapshot: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._pending_logs: dict[str, Any] = {}
        self._loss_hook = None
        # Where Fp8Trainer.train was told to resume from (a plain Trainer does not tell callbacks).
        self.resume_from: str | None = None
        if os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower() == "fp8":
            # Checked here: the Trainer builds its Accelerator, which acts on it, before on_init_end.
            warnings.warn(
                "hf_fp8: ACCELERATE_MIXED_PRECISION=fp8 makes accelerate convert the model to FP8 a second "
                "time; unset it (hf-fp8 launch does) and let hf-fp8 do the FP8",
                stacklevel=2,
            )

    # ---- set-up -------------------------------------------------------------------------------

    def on_init_end(self, args, state, control, model: nn.Module | None = None, **kwargs) -> None:
        if model is None:  # model_init: the Trainer builds the model in train(), see on_train_begin
            return
        self._set_up(model, args)

    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs) -> None:
        if model is not None and model is not self._model:  # built by model_init (hyperparameter search)
            self._set_up(model, args)
        if self._telemetry is None or state.global_step == 0:
            return
        searched = _resume_candidates(args, state.global_step, self.resume_from)
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
            _set_recipe(self._model, recipe)
            self.recipe = recipe

    def _set_up(self, model: nn.Module, args: Any) -> None:
        """Patch ``model`` (or take the recipe of an already patched one) and hook it for the guard and
        the telemetry."""
        self._model = model
        if is_patched(model):
            patched_recipe = model._hf_fp8_state.recipe
            if self.recipe is not None and self.recipe != patched_recipe:
                warnings.warn(
                    "hf_fp8: the model was already patched with another recipe than the callback's; the "
                    "model's recipe is used. Pass recipe=None, or patch the model with the recipe you want",
                    stacklevel=3,
                )
            self.recipe = patched_recipe
        else:
            self.report = patch_model(model, self.recipe, backend=_backend_for(self.backend, args))
            self.recipe = self.report.recipe
        if not is_patched(model):  # recipe.enabled is False: a high-precision run
            self._telemetry = None
            return
        _check_arguments(args, model)
        self._telemetry = Fp8Telemetry(model, self.sample_layers)
        if self._loss_hook is not None:
            self._loss_hook.remove()
        self._loss_hook = model.register_forward_hook(self._watch_loss)

    # ---- each optimizer step ------------------------------------------------------------------

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if self._telemetry is None:
            return
        self._losses.clear()
        if self.recipe.nan_policy != "raise":
            self._snapshot = [(t, t.clone()) for t in fp8_state_tensors(self._model).values()]
        if _log_due(args, state):
            self._telemetry.arm()

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self._telemetry is None:
            return
        problem = self._find_non_finite()
        if problem is None:
            self._consecutive_skips = 0
            return
        where = f"step {state.global_step + 1}: {problem}"
        policy = self.recipe.nan_policy
        if policy == "raise":
            raise FloatingPointError(
                f"hf_fp8: {where}. The weights are not updated by this step. Set nan_policy: skip_step or "
                "increase_margin in the recipe to go on past such steps"
            )
        self._consecutive_skips += 1
        if self._consecutive_skips > self.max_consecutive_skips:
            raise FloatingPointError(
                f"hf_fp8: {where}; {self._consecutive_skips} non-finite steps in a row, which skipping does "
                "not cure. Check the data and the learning rate"
            )
        for param in self._model.parameters():
            param.grad = None  # the optimizer leaves parameters without gradients alone
        for live, saved in self._snapshot:
            live.copy_(saved)
        self._model._hf_fp8_state.step_pending = False
        self.skipped_steps += 1
        action = "skipped the step and rolled the amax histories back"
        if policy == "increase_margin":
            self.recipe = self.recipe.replace(margin=self.recipe.margin + 1)
            _set_recipe(self._model, self.recipe)
            action += f", margin now {self.recipe.margin}"
        warnings.warn(f"hf_fp8: {where}; {action}", stacklevel=2)

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self._telemetry is not None:
            _end_pending_step(self._model)

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self._telemetry is None or not self._telemetry.armed:
            return
        logs = self._telemetry.collect()
        logs["fp8/skipped_steps"] = self.skipped_steps
        logs["fp8/margin"] = self.recipe.margin
        # By steps, the log comes right after this step or not at all; by epoch, it takes the newest.
        if control.should_log or _logging_strategy(args) != "steps":
            self._pending_logs = logs

    def pop_telemetry(self) -> dict[str, Any]:
        """The telemetry of the step about to be logged (once)."""
        logs, self._pending_logs = self._pending_logs, {}
        return logs

    def on_log(self, args, state, control, logs: dict | None = None, **kwargs) -> None:
        telemetry = self.pop_telemetry()
        if not telemetry or logs is None:
            return
        logs.update(telemetry)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(telemetry)

    def on_save(self, args, state, control, **kwargs) -> None:
        if self._telemetry is None or not args.should_save:
            return
        folder = _saved_checkpoint(args, state.global_step)
        if folder is None:
            warnings.warn(
                f"hf_fp8: no {PREFIX_CHECKPOINT_DIR}-{state.global_step} folder under {args.output_dir} to "
                f"put {FP8_STATE_FILE} in; this checkpoint will resume without its FP8 scales",
                stacklevel=2,
            )
            return
        save_fp8_state(self._model, folder, self.recipe)

    # ---- the NaN guard ------------------------------------------------------------------------

    def _watch_loss(self, module: nn.Module, args: tuple, outputs: Any) -> None:
        """Keep the loss the model returned (HF models return it first, as ``loss`` or in a tuple)."""
        if isinstance(outputs, dict):
            loss = outputs.get("loss")
        elif isinstance(outputs, tuple) and outputs and torch.is_tensor(outputs[0]) and outputs[0].dim() == 0:
            loss = outputs[0]
        else:
            loss = getattr(outputs, "loss", None)
        if module.training and torch.is_tensor(loss):
            self._losses.append(loss.detach())

    @torch.no_grad()
    def _find_non_finite(self) -> str | None:
        """What is non-finite in this step (loss, gradients, amaxes per layer and role), or ``None``.
        One host sync, and one all-reduce of the flags when distributed, so that every rank sees what
        any rank saw and all take the same decision."""
        model = self._model
        device = next(model.parameters()).device
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        layers = _amax_histories(model)
        roles = [(name, role) for name, histories in layers for role, _ in histories]
        histories = [h for _, per_role in layers for _, h in per_role]
        finite = torch.tensor(True, device=device)
        loss_ok = torch.stack(self._losses).isfinite().all() if self._losses else finite
        grads_ok = torch.stack(torch._foreach_norm(grads)).isfinite().all() if grads else finite
        # max |amax| of each history, in a few fused kernels: NaN and inf survive it, nothing overflows
        amax_max = torch._foreach_norm(histories, ord=float("inf")) if histories else []
        amaxes_ok = torch.stack(amax_max).to(device).isfinite() if histories else finite.new_empty(0)
        bad = (~torch.cat([torch.stack([loss_ok, grads_ok]).to(device), amaxes_ok])).int()
        group = default_amax_group()
        if group is not None:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        loss_bad, grad_bad, *amax_bad = bad.tolist()
        if not (loss_bad or grad_bad or any(amax_bad)):
            return None
        parts = []
        if any(amax_bad):
            parts.append(_first_non_finite_amax([r for r, b in zip(roles, amax_bad, strict=True) if b]))
        if loss_bad:
            parts.append("the loss is non-finite")
        if not parts:
            seen = "the loss is finite" if self._losses else "the loss was not seen (the model returned none)"
            parts.append(f"non-finite gradients outside the FP8 layers (their amaxes are finite; {seen})")
        return "; ".join(parts)


class Fp8Trainer(Trainer):
    """``Trainer`` with an :class:`Fp8TrainerCallback` whose telemetry every reporting integration
    records (see the module docstring for why this needs ``log``). ``fp8_recipe`` / ``fp8_callback``
    choose the recipe or the whole callback; everything else is ``Trainer``'s."""

    def __init__(
        self,
        *args: Any,
        fp8_recipe: Fp8Recipe | None = None,
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


# ---- helpers --------------------------------------------------------------------------------------


def _check_arguments(args: Any, model: nn.Module) -> None:
    """Warn about TrainingArguments that fight FP8, and say what runs where FP8 cannot."""
    backend = model._hf_fp8_state.backend
    if getattr(args, "fp16", False):
        warnings.warn(
            "hf_fp8: fp16=True runs everything outside the FP8 layers in float16 under a loss scaler, "
            "which FP8 training does not need and which overflows more easily (the steps the scaler "
            "would skip reach the NaN guard, which raises by default); use bf16=True",
            stacklevel=3,
        )
    if backend == "te" and _checkpointing_requested(args):
        raise ValueError(
            "hf_fp8: gradient_checkpointing with the Transformer Engine backend would recompute layers "
            "outside te.autocast; set gradient_checkpointing=False or patch with backend='native'"
        )
    device = getattr(args, "device", None) or next(model.parameters()).device
    if device.type == "cpu":
        warnings.warn(
            "hf_fp8: the model is on the CPU; FP8 runs with real FP8 casts and torch._scaled_mm, so the "
            "numerics are those of FP8 training, but the CPU has no FP8 speed-up",
            stacklevel=3,
        )
    elif device.type == "cuda" and not gpu_has_fp8(device):
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        warnings.warn(
            f"hf_fp8: {name} (compute capability {major}.{minor}) has no FP8 tensor cores (they need 8.9 "
            "or later); the FP8 GEMMs are emulated in float32 with the same FP8 numerics, slower than BF16",
            stacklevel=3,
        )


def _checkpointing_requested(args: Any) -> bool:
    """Activation (before transformers 5: gradient) checkpointing is asked for."""
    name = (
        "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    )
    return bool(getattr(args, name, False))


def _backend_for(backend: str, args: Any) -> str:
    """``auto`` decided by the device the Trainer trains on: the model may still be on the CPU when the
    Trainer is built (FSDP, DeepSpeed, full-precision eval settings move it later)."""
    if backend != "auto":
        return backend
    device = getattr(args, "device", torch.device("cpu"))
    return "te" if device.type == "cuda" and te_backend.te_usable()[0] else "native"


def _logging_strategy(args: Any) -> str:
    return str(getattr(args, "logging_strategy", "steps")).rsplit(".", 1)[-1].lower()


def _log_due(args: Any, state: Any) -> bool:
    """Whether the step now starting will be logged (DefaultFlowCallback's rule). Logging by epoch
    samples every step and keeps the newest; no logging samples nothing."""
    strategy = _logging_strategy(args)
    if strategy != "steps":
        return strategy != "no"
    step = state.global_step + 1
    every = state.logging_steps or args.logging_steps
    every = math.ceil(every) if every >= 1 else max(1, math.ceil(state.max_steps * every))
    return step % every == 0 or (step == 1 and args.logging_first_step)


def _resume_candidates(args: Any, step: int, resume_from: str | None) -> list[Path]:
    """Where the checkpoint being resumed may be: the folder Fp8Trainer.train was given, the one in
    TrainingArguments, else the Trainer's default place for it."""
    given = (resume_from, getattr(args, "resume_from_checkpoint", None))
    return [
        *(Path(p) for p in given if isinstance(p, str)),
        Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}",
    ]


def _saved_checkpoint(args: Any, step: int) -> Path | None:
    """The checkpoint folder the Trainer just wrote for ``step``: under the output folder, or under a
    hyperparameter-search run folder inside it (the newest, being the one just written)."""
    name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
    direct = Path(args.output_dir) / name
    if direct.is_dir():
        return direct
    runs = sorted(Path(args.output_dir).glob(f"*/{name}"), key=lambda p: p.stat().st_mtime)
    return runs[-1] if runs else None


def _amax_histories(model: nn.Module) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Per FP8 layer (forward order) its amax histories by role: native layers per tensor, TE layers
    per direction."""
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, _Fp8Module):
            roles = list(zip(("input", "weight", "grad_output"), module.amax_history, strict=True))
        elif te_backend.has_scaling_state(module):
            roles = [(_TE_DIRECTIONS[key], meta.amax_history) for key, meta in _te_metas(module)]
        else:
            continue
        layers.append((name, roles))
    return layers


def _first_non_finite_amax(bad: list[tuple[str, str]]) -> str:
    """Name the layer where it started: the first in forward order with a non-finite forward amax,
    else the last with a non-finite gradient amax (the first the backward reached). ``bad`` holds the
    (layer, role) pairs with a non-finite amax, in forward order."""
    forward = [(n, r) for n, r in bad if r in ("input", "weight", "forward")]
    layer = forward[0][0] if forward else bad[-1][0]
    roles = [r for n, r in bad if n == layer]
    return f"non-finite amax of {'/'.join(roles)} in layer {layer!r}"
