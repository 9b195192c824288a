"""The hooks a patched model's top-level forward runs through (PyTorch's own extension point: nothing
of the model's class or ``forward`` is replaced; :func:`install` returns the handles).

Before the forward, in FP8: enter the backend's forward context (``te.autocast`` for Transformer
Engine), end a step still pending, and mark a forward without gradient that is given a KV cache as a
generation step (FP8 layers may run plain there, see ``Fp8Linear.plain_is_faster``). Under
nn.DataParallel the hooks run for each GPU's replica of the
model, in a thread each: the backend then learns of each replica (or refuses to run there, with the
reason). After the forward, always: leave that context (so the backward runs outside it), and start
the FP8 step (see :mod:`hf_fp8.patching.step`).

FP8 layers compute in FP8 in training mode; eval mode is for evaluation, in high precision. A forward
that builds a graph in eval mode is usually training on a model ``from_pretrained`` left in eval mode,
or an evaluation outside ``torch.no_grad()``: it runs without FP8 and would say nothing, so it warns,
once a model, with both fixes.

The model's inputs and outputs are never changed. FP8 GEMMs need the dimension they contract over to
be a multiple of 16; for the weight gradient that is the number of tokens, and each FP8 layer pads the
rows of its own GEMM operands with zeros. So a packed row, a padding-free batch or a 2-D output of
per-token values (TRL's fused LM head) reaches the caller exactly as the unpatched model gives it.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_fp8.autocast import fp8_active, generating
from hf_fp8.backends.base import data_parallel_refusal
from hf_fp8.numerics.amax_sync import default_amax_group
from hf_fp8.patching.patch_state import ForwardCall, PatchState, get_state
from hf_fp8.patching.step import end_step, start_step

__all__ = ["given_kv_cache", "install"]

# What transformers calls a forward's KV cache (``cache`` from transformers 5.24 on).
_CACHE_ARGUMENTS = ("past_key_values", "cache")


def install(model: nn.Module) -> list[RemovableHandle]:
    """Hook ``model``'s forward (its patch state must be attached already)."""
    return [
        model.register_forward_pre_hook(_before_forward, with_kwargs=True),
        model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True),
    ]


def _before_forward(model: nn.Module, args: tuple, kwargs: dict) -> None:
    state: PatchState = get_state(model)
    recipe = state.recipe
    call = ForwardCall(fp8=fp8_active(model.training, recipe.use_during_eval))
    replica = getattr(model, "_is_replica", False)  # nn.DataParallel's copy of the model for one GPU
    if replica and call.fp8 and (problem := state.backend.replica_problem()) is not None:
        raise RuntimeError(data_parallel_refusal(state.backend.name, problem))
    eval_off = not call.fp8 and fp8_active(True, recipe.use_during_eval)  # on in training mode
    fp8_off_with_gradients = eval_off and torch.is_grad_enabled()
    if fp8_off_with_gradients and not state.warned_eval_with_gradients and _trains_something(model):
        _warn_of_gradients_in_eval_mode(model, state)
    state.push_call(model, call)
    context = state.backend.forward_context(model, call.fp8, state.amax_group or default_amax_group())
    context.__enter__()
    call.context = context
    state.backend.before_forward(model)
    if not call.fp8:
        return
    if not torch.is_grad_enabled() and given_kv_cache(kwargs):
        call.generation = generating()
        call.generation.__enter__()
    if model.training and state.end_at_next_forward:  # a step whose end could not be hooked
        end_step(state)
    if replica and model.training and torch.is_grad_enabled():
        state.backend.track_replica(model)


def _trains_something(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters takes a gradient (a frozen model's forward with gradients
    is an input attribution, or a teacher outside no_grad: not a training step)."""
    return any(p.requires_grad for p in model.parameters())


@torch.compiler.disable  # under torch.compile(model) the hook is traced: the warning breaks the graph here
def _warn_of_gradients_in_eval_mode(model: nn.Module, state: PatchState) -> None:
    """Once a model: this forward builds a graph in eval mode, where its FP8 layers compute in high
    precision."""
    state.warned_eval_with_gradients = True
    warnings.warn(
        f"hf_fp8: {type(model).__name__} ran a forward with gradients in eval mode, so its FP8 layers "
        "computed in high precision (eval mode is for evaluation). Training? Call model.train() first "
        "(from_pretrained returns the model in eval mode). Evaluating? Wrap it in torch.no_grad(). FP8 in "
        "eval mode: recipe use_during_eval, or hf_fp8.fp8_autocast(enabled=True).",
        stacklevel=7,  # the caller's model(...): past this, compiler.disable, the hook, Module's calls
    )


def given_kv_cache(kwargs: dict[str, Any]) -> bool:
    """Whether a forward's keyword arguments hand it a KV cache (generation, incremental decoding)."""
    return any(kwargs.get(name) is not None for name in _CACHE_ARGUMENTS)


def _after_forward(model: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
    state: PatchState = get_state(model)
    call = state.pop_call(model)
    if call is None:  # _before_forward raised: the forward never ran
        return
    if call.context is not None:
        call.context.__exit__(None, None, None)
    if call.generation is not None:
        call.generation.__exit__(None, None, None)
    if call.fp8 and model.training and torch.is_grad_enabled():
        start_step(state, outputs)
