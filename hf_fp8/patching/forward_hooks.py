"""The hooks a patched model's top-level forward runs through (PyTorch's own extension point: nothing
of the model's class or ``forward`` is replaced; :func:`install` returns the handles).

Before the forward, in FP8: enter the backend's forward context (``te.autocast`` for Transformer
Engine), end a step still pending, and pad the token dimension to a multiple of 16. Under
nn.DataParallel the hooks run for each GPU's replica of the model, in a thread each: the backend then
learns of each replica (or refuses to run there, with the reason). After the forward,
always: leave that context (so the backward runs outside it), have the FP8 step end when the
backward through the outputs has finished, and slice per-token outputs back to the caller's length.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_fp8.autocast import fp8_active
from hf_fp8.backends.base import data_parallel_refusal
from hf_fp8.numerics.amax_sync import default_amax_group
from hf_fp8.patching.padding import PaddedLengths, pad_batch, unpad_outputs
from hf_fp8.patching.patch_state import ForwardCall, PatchState, get_state
from hf_fp8.patching.step import end_step, end_step_after_backward

__all__ = ["install"]

# Inputs of incremental decoding (generate()): padding would put pad tokens where the next token's
# logits are read, and into the KV cache.
_DECODING_INPUTS = ("past_key_values", "cache_position", "logits_to_keep")


def install(model: nn.Module) -> list[RemovableHandle]:
    """Hook ``model``'s forward (its patch state must be attached already)."""
    return [
        model.register_forward_pre_hook(_before_forward, with_kwargs=True),
        model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True),
    ]


def _before_forward(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    state: PatchState = get_state(model)
    recipe = state.recipe
    call = ForwardCall(PaddedLengths({}), fp8=fp8_active(model.training, recipe.use_during_eval))
    replica = getattr(model, "_is_replica", False)  # nn.DataParallel's copy of the model for one GPU
    if replica and call.fp8 and (problem := state.backend.replica_problem()) is not None:
        raise RuntimeError(data_parallel_refusal(state.backend.name, problem))
    state.push_call(model, call)
    context = state.backend.forward_context(model, call.fp8, state.amax_group or default_amax_group())
    context.__enter__()
    call.context = context
    state.backend.before_forward(model)
    if not call.fp8:
        return None
    if model.training and state.step_pending:  # a step whose end could not be hooked
        end_step(state)
    if replica and model.training and torch.is_grad_enabled():
        state.backend.track_replica(model)
    batch = _as_kwargs(model, args, kwargs)
    config = getattr(model, "config", None)
    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    if batch is None or any(batch.get(k) is not None for k in _DECODING_INPUTS):
        return None
    if encoder_decoder and not batch.get("return_dict", getattr(config, "use_return_dict", True)):
        return None  # tuple outputs of two streams cannot be told apart to slice them back
    batch, call.padded = pad_batch(batch, recipe.pad_to_multiple, _pad_token_id(config), encoder_decoder)
    return (), batch


def _after_forward(model: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> Any:
    state: PatchState = get_state(model)
    call = state.pop_call(model)
    if call is None:  # _before_forward raised: the forward never ran
        return outputs
    if call.context is not None:
        call.context.__exit__(None, None, None)
    if call.fp8 and model.training and torch.is_grad_enabled():
        end_step_after_backward(state, outputs)
    return unpad_outputs(outputs, call.padded) if outputs is not None else outputs


def _as_kwargs(model: nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """Positional arguments of the model's forward turned into keywords, so they can be padded;
    ``None`` when the forward takes ``*args`` (positions cannot be named then)."""
    if not args:
        return dict(kwargs)
    parameters = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters.values()):
        return None
    merged = dict(zip(parameters, args, strict=False))
    merged.update(kwargs)
    return merged


def _pad_token_id(config: Any) -> int:
    """A token id for padding: the pad token, else EOS, else 0; always inside the vocabulary (the
    positions are masked, so any valid id does)."""
    vocab_size = getattr(config, "vocab_size", None)
    for key in ("pad_token_id", "eos_token_id"):
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int) and value >= 0 and (vocab_size is None or value < vocab_size):
            return value
    return 0
