"""The logits of a compiled training forward that computed its own loss leave its graph detached.

A compiled graph's backward takes a gradient for every output that requires one. The logits of a
causal LM's training forward almost never get one (the loss is computed inside), so autograd fills a
zero gradient of the logits' full size each step, and the loss's backward reads it and adds it: on
Gemma-3's 262k vocabulary, 8192 tokens, a 4.3 GB fill (1.4 ms on an H200) and as much read again.
Returned detached, the logits need no gradient, and the graph's backward starts from the loss alone.

So that a loss computed on those logits cannot silently lose its gradient, they are handed back
attached to the loss through :class:`_LogitsWithoutGradient`, whose backward raises and says what to
do: call the model without labels and compute the loss from its logits, which then keep their gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["compile_with_detached_logits", "guard_training_logits"]


def compile_with_detached_logits(forward: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``forward`` (a causal LM's) compiled with ``options``, returning its logits detached where it
    computed a loss with gradients on.

    The decoder inside ``forward`` is a graph break. For the detach to land in the graph that computes
    the logits (the one after the break, in ``forward``'s own frame), Dynamo resumes in nested frames
    (its ``nested_graph_breaks``, set for these calls only); a PyTorch without it compiles ``forward``
    as it is."""
    if not hasattr(torch._dynamo.config, "nested_graph_breaks"):
        return torch.compile(forward, **options)

    def forward_with_detached_logits(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        outputs = forward(self, *args, **kwargs)
        if _trained_loss_and_logits(outputs):
            outputs.logits = outputs.logits.detach()
        return outputs

    compiled = torch.compile(forward_with_detached_logits, **options)

    @functools.wraps(forward)
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(nested_graph_breaks=True):
            return compiled(self, *args, **kwargs)

    return call


def guard_training_logits(model: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
    """A forward hook (eager, after the compiled forward): detached training logits come back attached to
    the loss, through a backward that raises if anything reaches it."""
    if _trained_loss_and_logits(outputs) and outputs.loss.requires_grad and not outputs.logits.requires_grad:
        outputs.logits = _LogitsWithoutGradient.apply(outputs.loss, outputs.logits)


def _trained_loss_and_logits(outputs: Any) -> bool:
    loss, logits = getattr(outputs, "loss", None), getattr(outputs, "logits", None)
    return torch.is_grad_enabled() and isinstance(loss, torch.Tensor) and isinstance(logits, torch.Tensor)


class _LogitsWithoutGradient(torch.autograd.Function):
    """The logits, unchanged, as a function of the loss whose backward refuses: no gradient flows
    through them (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        raise RuntimeError(
            "hf_fp8.compile: these logits come from a training forward that computed its own loss (labels "
            "were given), and carry no gradient: the compiled graph returns them detached, so that each "
            "step does not fill and read a zero gradient of their full size. To train on a loss of the "
            "logits, call the model without labels and compute every loss from its logits (they then "
            "keep their gradient)."
        )
