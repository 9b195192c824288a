"""CUDA graphs (``mode="reduce-overhead"``) under ``hf_fp8.compile``'s block-by-block compilation.

Inductor's CUDA graph trees replay one recorded graph per compiled call and group a step's graphs into a
path that starts anew each "generation". Without a marker every compiled block is a call of its own, so
the second block already finds the first one's backward pending, and the trees leave their fast path
(a warning says so). The hooks here mark one step per training forward, so a step's blocks, head and
backwards replay as one path, and keep valid past the next step what a step hands its caller:

- the loss: a scalar, copied out of the graphs' memory (a caller keeps it for logging);
- gradients being accumulated over micro-batches: a gradient the backward's graph produced lives in that
  memory, and the next replay would overwrite it; each is copied out once per optimizer step, when the
  second micro-batch begins (with ``zero_grad(set_to_none=False)``, once for the whole run).

A training forward that comes before the previous one's backward (two forwards, one backward) marks no
step: a new step would overwrite what that backward still needs; the trees then take their slow path.
Forwards that are not training steps (evaluation, generation) run eagerly: their outputs (logits
gathered across batches) would be overwritten by the next replay. Other outputs of a training forward
(the logits) hold until the next training forward, as with ``torch.compile(mode="reduce-overhead")``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["add_graph_steps", "is_training_forward", "replays_graphs", "wants_cuda_graphs"]

_STATE = "_hf_fp8_graph_steps"  # a _GraphSteps on the model whose forwards mark the steps
_COPIED = "_hf_fp8_copied_out"  # set on a gradient copied out of the graphs' memory (accumulated into since)

_GRAPH_MODES = ("reduce-overhead", "max-autotune")


class _GraphSteps:
    """What the hooks keep between forwards: whether a backward is still to come."""

    def __init__(self) -> None:
        self.backward_pending = False

    def backward_started(self, grad: torch.Tensor) -> None:
        self.backward_pending = False


def wants_cuda_graphs(options: dict[str, Any]) -> bool:
    """Whether ``torch.compile(**options)`` replays CUDA graphs."""
    inductor = options.get("options") or {}
    return (
        options.get("mode") in _GRAPH_MODES
        or options.get("backend") == "cudagraphs"
        or bool(inductor.get("triton.cudagraphs"))
    )


def is_training_forward(model: nn.Module) -> bool:
    """Whether a forward of ``model`` now is a training step's (one a backward follows)."""
    return model.training and torch.is_grad_enabled()


def replays_graphs(model: nn.Module) -> bool:
    """Whether ``model``'s compiled forwards replay CUDA graphs (see :func:`add_graph_steps`)."""
    return _STATE in model.__dict__


def add_graph_steps(model: nn.Module) -> None:
    """Mark a CUDA graph step at each training forward of ``model`` and keep its loss and accumulated
    gradients valid past the next step (see the module docstring)."""
    model.__dict__[_STATE] = _GraphSteps()
    model.register_forward_pre_hook(_begin_step)
    model.register_forward_hook(_keep_loss, with_kwargs=True)


def _begin_step(model: nn.Module, args: tuple) -> None:
    """Before a training forward: accumulated gradients out of the graphs' memory, then a new step."""
    if not is_training_forward(model):
        return
    _copy_out_grads(model)
    if not model.__dict__[_STATE].backward_pending:
        torch.compiler.cudagraph_mark_step_begin()


def _copy_out_grads(model: nn.Module) -> None:
    """Replace each gradient not copied yet by a copy of its own, marked as such (an eagerly made one is
    copied too: which gradients a graph made is not known here)."""
    for param in model.parameters():
        if param.grad is not None and not getattr(param.grad, _COPIED, False):
            param.grad = param.grad.clone()
            setattr(param.grad, _COPIED, True)


def _keep_loss(model: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> Any:
    """After a training forward: its loss copied out of the graphs' memory, and a backward pending until
    a gradient reaches the loss (or, without one, the logits)."""
    if not is_training_forward(model):
        return None
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, torch.Tensor):
        loss = outputs.loss = loss.clone()
    elif _returns_loss_first(outputs, kwargs):
        loss = outputs[0].clone()
        outputs = (loss, *outputs[1:])
    backward_from = loss if isinstance(loss, torch.Tensor) else getattr(outputs, "logits", None)
    if isinstance(backward_from, torch.Tensor) and backward_from.requires_grad:
        steps: _GraphSteps = model.__dict__[_STATE]
        steps.backward_pending = True
        backward_from.register_hook(steps.backward_started)
    return outputs


def _returns_loss_first(outputs: Any, kwargs: dict) -> bool:
    """Whether ``outputs`` is a tuple led by the loss (``return_dict=False`` with labels)."""
    labelled = kwargs.get("labels") is not None
    return labelled and isinstance(outputs, tuple) and bool(outputs) and isinstance(outputs[0], torch.Tensor)
