"""Packed rows on PyTorch's variable-length flash attention, for :func:`hf_fp8.compile`.

TRL packs several sequences into one row without padding: position ids restart at each sequence and
no attention mask is given. transformers' ``sdpa`` attention then materializes a block-diagonal mask
over the whole row, and the fused kernel computes every pair of the row's tokens: a row of 8192 tokens
holding four sequences of 2048 costs eight times the attention the sequences need (on one H200, 153 of
a 333 ms SFT step at the Llama-3.2-1B shape).

``hf_fp8.compile`` sets a causal LM that attends with ``sdpa`` to :data:`ATTENTION` (transformers'
own extension point: ``AttentionInterface``, with sdpa's mask function). Before the model's forward,
outside the compiled blocks, :func:`packed_boundaries` reads a packed row's sequence boundaries from
its position ids once; each attention call hands them to ``torch.nn.attention.varlen.varlen_attn``,
which attends within each sequence only. Every other call (a mask, a batch of several rows, the CPU,
a KV cache, dropout, a sliding window) is transformers' ``sdpa`` as it was.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import nn

from hf_fp8.patching.forward_hooks import given_kv_cache

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch before 2.10
    varlen_attn = None

__all__ = [
    "ATTENTION",
    "boundaries_for",
    "packed_boundaries",
    "packed_sdpa",
    "register",
    "use_packed_attention",
]

ATTENTION = "hf_fp8_packed_sdpa"

# The longest sequence of a row, rounded up to this: the kernel sizes its grid by it (larger is
# correct, its blocks past a sequence's end return at once), and a compiled block sees few values.
_MAX_LENGTH_STEP = 256


def packed_boundaries(position_ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The cumulative sequence boundaries (int32, sequences + 1) of a row of packed sequences, and its
    longest sequence's length rounded up to a multiple of 256; ``None`` for a batch of more than one
    row, or a row of one sequence. A sequence starts where a position id does not follow the one
    before it by one (transformers' rule for packed rows)."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] < 2:
        return None
    positions = position_ids[0]
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    begins = starts.nonzero().flatten()
    if begins.numel() < 2:
        return None
    ends = torch.cat([begins, begins.new_tensor([positions.numel()])])
    longest = int((ends[1:] - ends[:-1]).max())
    rounded = -(-longest // _MAX_LENGTH_STEP) * _MAX_LENGTH_STEP
    return ends.to(torch.int32), min(rounded, positions.numel())


def packed_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query, key, value as (batch, heads, tokens, dim)):
    variable-length flash attention over a packed row's sequences when the forward was given their
    boundaries (``cu_seq_lens_q``, see :func:`use_packed_attention`), else ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    boundaries, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    dtype = _flash_dtype(query)
    plain = (
        boundaries is None
        or dtype is None
        or query.shape[0] != 1
        or query.shape[2] != key.shape[2]  # a KV cache
        or query.shape[-1] > 256
        or dropout
        or not getattr(module, "is_causal", True)  # an encoder's attention
        or kwargs.get("is_causal") is False
        or getattr(module, "sliding_window", None)
        or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux"))
    )
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # (tokens, heads, dim)
    out = _varlen_causal(q, k, v, boundaries, longest, scaling)
    return out.unsqueeze(0), None  # (1, tokens, heads, dim), as sdpa_attention_forward returns


def _flash_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The dtype flash attention runs this call in: autocast's, else the query's; ``None`` when that is
    no 16-bit float (float32 weights without autocast: sdpa then). Under autocast the rotary embedding
    can leave q and k in float32 beside a 16-bit v, which sdpa's autocast rule would have unified."""
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    return dtype if dtype in (torch.float16, torch.bfloat16) else None


# What this torch's varlen_attn takes: causality as a window (torch 2.11) or a flag, and whether it
# groups query heads over key/value heads itself.
_VARLEN_OPTIONS = (
    frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()
)


def _varlen_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    boundaries: torch.Tensor,
    longest: int,
    scale: float | None,
) -> torch.Tensor:
    causal = {"window_size": (-1, 0)} if "window_size" in _VARLEN_OPTIONS else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_OPTIONS:
            causal["enable_gqa"] = True
        else:  # an older varlen_attn: every query head its own key/value head
            groups = q.shape[1] // k.shape[1]
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return varlen_attn(q, k, v, boundaries, boundaries, longest, longest, scale=scale, **causal)


@functools.cache
def register() -> bool:
    """Register :data:`ATTENTION` with transformers (once); ``False`` where this torch has no
    ``varlen_attn`` or this transformers no attention interface."""
    if varlen_attn is None:
        return False
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(ATTENTION, packed_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return True


def use_packed_attention(model: nn.Module) -> bool:
    """Switch ``model`` (and its sub-models) from ``sdpa`` to :data:`ATTENTION`; ``False`` (nothing
    changed) where it attends otherwise, is an encoder-decoder, or the attention cannot be registered.
    Attention that is not causal, or that takes more than a mask (a bias, sinks, a soft cap, a window),
    stays sdpa call by call."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or getattr(
        config, "is_encoder_decoder", False
    ):
        return False
    if not register():
        return False
    model.set_attn_implementation(ATTENTION)
    return True


def boundaries_for(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that give a packed row's attention its sequences' boundaries, for a forward
    called with ``kwargs`` on a GPU; none for any other forward."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or kwargs.get("attention_mask") is not None or not position_ids.is_cuda:
        return {}
    if given_kv_cache(kwargs) or kwargs.get("cu_seq_lens_q") is not None:
        return {}
    found = packed_boundaries(position_ids)
    if found is None:
        return {}
    boundaries, longest = found
    return {
        "cu_seq_lens_q": boundaries,
        "cu_seq_lens_k": boundaries,
        "max_length_q": longest,
        "max_length_k": longest,
    }
