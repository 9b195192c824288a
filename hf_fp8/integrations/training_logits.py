"""The logits of a compiled training forward that computed its own loss leave its graph detached.

A compiled graph's backward takes a gradient for every output that requires one. The logits of a
causal LM's training forward almost never get one (the loss is computed inside), so autograd fills a
zero gradient of the logits' full size each step, and the loss's backward reads it and adds it: on
Gemma-3's 262k vocabulary, 8192 tokens, a 4.3 GB fill (1.4 ms on an H200) held at the step's peak.
Returned detached, the logits need no gradient, and the graph's backward starts from the loss alone.

So that a loss computed on those logits cannot silently lose its gradient, they are handed back
attached to the loss through :class:`_LogitsWithoutGradient`, whose backward raises and says what to
do: call the model without labels and compute every loss from its logits, which then keep their
gradient. This happens in the forward itself, not in a hook, so it holds however the forward is reached
(PEFT's tuners before 0.21 call ``forward`` directly, skipping hooks). The logits returned are a view
made by that function: modifying them in place under autograd raises PyTorch's error for such views.

A caller that converts the logits to float32 after every forward (Accelerate's mixed precision does,
and so the HF Trainer under ``bf16=True``) can have them leave the graph in float32: the log-sum-exp
kernel that reads them for the loss writes them too, where the conversion outside is a pass of its own
over the largest tensor of the step (8b-4l shape, one H200: 3.1 ms of a 115 ms FP8 Trainer step).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

__all__ = ["compile_with_detached_logits"]


def compile_with_detached_logits(
    forward: Callable[..., Any], logits_dtype: torch.dtype | None = None, **options: Any
) -> Callable[..., Any]:
    """``forward`` (a causal LM's) compiled with ``options``, its logits detached where it computed a
    loss with gradients on (and then in ``logits_dtype`` when given), and attached back to the loss
    through a backward that refuses.

    The decoder inside ``forward`` is a graph break. For the detach to land in the graph that computes
    the logits (the one after the break, in ``forward``'s own frame), Dynamo resumes in nested frames
    (its ``nested_graph_breaks``, set while these forwards run; the blocks they call have no graph break,
    so it changes nothing there). A PyTorch without it compiles ``forward`` as it is (logits attached, in
    their own dtype)."""
    if not hasattr(torch._dynamo.config, "nested_graph_breaks"):
        return torch.compile(forward, **options)

    def forward_with_detached_logits(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        outputs = forward(self, *args, **kwargs)
        if _has_trained_loss_and_logits(outputs):
            logits = outputs.logits.detach()
            outputs.logits = logits if logits_dtype is None else logits.to(logits_dtype)
        return outputs

    compiled = torch.compile(forward_with_detached_logits, **options)

    @functools.wraps(forward)
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(nested_graph_breaks=True):
            outputs = compiled(self, *args, **kwargs)
        detached = _has_trained_loss_and_logits(outputs) and not outputs.logits.requires_grad
        if detached and outputs.loss.requires_grad:
            outputs.logits = _LogitsWithoutGradient.apply(outputs.loss, outputs.logits)
        return outputs

    return call


def _has_trained_loss_and_logits(outputs: Any) -> bool:
    loss, logits = getattr(outputs, "loss", None), getattr(outputs, "logits", None)
    return torch.is_grad_enabled() and isinstance(loss, torch.Tensor) and isinstance(logits, torch.Tensor)


class _LogitsWithoutGradient(torch.autograd.Function):
    """The logits, unchanged, as a function of the loss whose backward refuses: no gradient flows
    through them (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> NoReturn:
        raise RuntimeError(
            "hf_fp8.compile: these logits come from a training forward that computed its own loss (labels "
            "were given), and carry no gradient: the compiled graph returns them detached, so that each "
            "step does not fill and read a zero gradient of their full size. To train on a loss of the "
            "logits, call the model without labels and compute every loss from its logits (they then "
            "keep their gradient)."
        )
