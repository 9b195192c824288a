"""CUDA graphs (``mode="reduce-overhead"``) under ``hf_fp8.compile``'s block-by-block compilation.

Inductor's CUDA graph trees replay one recorded graph per compiled call and group a step's graphs into a
path that starts anew each "generation". Without a marker every compiled block is a call of its own, so
the second block already finds the first one's backward pending, and the trees leave their fast path
(a warning says so). The hooks here mark one step per training forward, so a step's blocks, head and
backwards replay as one path, and keep valid past the next step what a step hands its caller:

- the loss: a scalar, copied out of the graphs' memory (a caller keeps it for logging);
- gradients being accumulated over micro-batches: a gradient the backward's graph produced lives in that
  memory, and the next replay would overwrite it; it is copied out once per optimizer step, when the
  second micro-batch begins (without accumulation nothing is copied).

Forwards that are not training steps (evaluation, generation) run eagerly: their outputs (logits
gathered across batches) would be overwritten by the next replay. Other outputs of a training forward
(the logits) hold until the next training forward, as with ``torch.compile(mode="reduce-overhead")``.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["add_graph_steps", "replays_graphs", "training_step", "wants_cuda_graphs"]

_GRAPHED = "_hf_fp8_cuda_graphs"  # set on the model whose forwards mark the steps
_KEPT_GRADS = "_hf_fp8_kept_grads"  # the gradients already copied out of the graphs' memory, by id

_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def wants_cuda_graphs(options: dict[str, Any]) -> bool:
    """Whether ``torch.compile(**options)`` replays CUDA graphs."""
    inductor = options.get("options") or {}
    return options.get("mode") in _GRAPH_MODES or bool(inductor.get("triton.cudagraphs"))


def training_step(model: nn.Module) -> bool:
    """Whether a forward of ``model`` now is a training step's (one a backward follows)."""
    return model.training and torch.is_grad_enabled()


def replays_graphs(model: nn.Module) -> bool:
    """Whether ``model``'s compiled forwards replay CUDA graphs (see :func:`add_graph_steps`)."""
    return bool(model.__dict__.get(_GRAPHED, False))


def add_graph_steps(model: nn.Module) -> None:
    """Mark a CUDA graph step at each training forward of ``model`` and keep its loss and accumulated
    gradients valid past the next step (see the module docstring)."""
    model.__dict__[_GRAPHED] = True
    model.__dict__[_KEPT_GRADS] = {}
    model.register_forward_pre_hook(_begin_step)
    model.register_forward_hook(_keep_loss)


def _begin_step(model: nn.Module, args: tuple) -> None:
    if not training_step(model):
        return
    kept: dict[int, weakref.ref] = model.__dict__[_KEPT_GRADS]
    for param in model.parameters():
        grad = param.grad
        if grad is not None and (id(grad) not in kept or kept[id(grad)]() is not grad):
            param.grad = grad.clone()
            kept[id(param.grad)] = weakref.ref(param.grad)
    for key in [key for key, ref in kept.items() if ref() is None]:
        del kept[key]
    torch.compiler.cudagraph_mark_step_begin()


def _keep_loss(model: nn.Module, args: tuple, outputs: Any) -> None:
    loss = getattr(outputs, "loss", None)
    if training_step(model) and isinstance(loss, torch.Tensor):
        outputs.loss = loss.clone()
