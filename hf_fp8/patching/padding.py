"""Padding batches to a multiple of 16 tokens in the data pipeline: optional, and only a saving.

FP8 GEMMs need the dimension they contract over to be a multiple of 16; for the weight gradient that
is the number of tokens. Each FP8 layer pads the rows of its own GEMM operands with zeros, so a patched
model takes batches of any length and never changes them. A batch whose tokens are already a multiple
of 16 saves those per-layer copies: :class:`Fp8PaddingCollator` pads each sequence on the right with
masked tokens, which keeps every real position's result unchanged (pad tokens are masked out of
attention, never attended by real tokens in causal models, and their labels are ``-100``). A batch that
is already padded is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hf_fp8.formats import FP8_ALIGNMENT

__all__ = ["Fp8PaddingCollator", "pad_batch"]

IGNORE_INDEX = -100

# Per sequence key: its stream ("main" for the encoder/decoder-only input, "decoder" for the decoder
# of encoder-decoder models) and how its new positions are filled. "labels" follow the decoder
# stream when the model has one, else the main one.
_FILL_TOKEN, _FILL_ZERO, _FILL_IGNORE, _FILL_POSITIONS = "token", "zero", "ignore", "positions"
_SEQUENCE_KEYS = {
    "input_ids": ("main", _FILL_TOKEN),
    "inputs_embeds": ("main", _FILL_ZERO),
    "attention_mask": ("main", _FILL_ZERO),
    "token_type_ids": ("main", _FILL_ZERO),
    "position_ids": ("main", _FILL_POSITIONS),
    "decoder_input_ids": ("decoder", _FILL_TOKEN),
    "decoder_inputs_embeds": ("decoder", _FILL_ZERO),
    "decoder_attention_mask": ("decoder", _FILL_ZERO),
    "decoder_position_ids": ("decoder", _FILL_POSITIONS),
    "labels": ("labels", _FILL_IGNORE),
}


@dataclass(frozen=True)
class PaddedLengths:
    """Original and padded token length of each stream of a batch."""

    lengths: dict[str, tuple[int, int]]


def pad_batch(
    batch: Mapping[str, Any],
    multiple: int,
    pad_token_id: int,
    encoder_decoder: bool = False,
) -> tuple[dict[str, Any], PaddedLengths]:
    """Right-pad every sequence tensor of ``batch`` so its token dimension is a multiple of ``multiple``.

    ``input_ids`` get ``pad_token_id``, masks and token types 0, labels ``-100``, position ids continue
    counting. A batch with neither ``attention_mask`` nor ``position_ids`` gets a mask (ones for the
    real tokens), so the new positions are masked for bidirectional models too. A batch with position
    ids and no mask is left without one: it may be packed (position ids restarting per sequence), which
    HF detects only when no mask is given; causal models never attend to the padding at the end.
    Returns the new batch and the lengths before and after, per stream.
    """
    out = dict(batch)
    streams: dict[str, tuple[int, int]] = {}
    for key, value in batch.items():
        if key not in _SEQUENCE_KEYS or not torch.is_tensor(value) or value.dim() < 2:
            continue
        stream, fill = _SEQUENCE_KEYS[key]
        if stream == "labels":
            stream = "decoder" if encoder_decoder else "main"
        length = value.shape[1]
        padded = -(-length // multiple) * multiple
        if stream in streams and streams[stream][0] != length:
            other = streams[stream][0]
            raise ValueError(f"cannot pad {key!r} of length {length}: other {stream} inputs are {other} long")
        streams[stream] = (length, padded)
        if padded != length:
            out[key] = _pad_tensor(value, padded - length, fill, pad_token_id)
    main = streams.get("main")
    unmasked = batch.get("attention_mask") is None and batch.get("position_ids") is None
    if unmasked and main is not None and main[0] != main[1]:
        reference = batch.get("input_ids", batch.get("inputs_embeds"))
        mask = torch.ones(reference.shape[:2], dtype=torch.long, device=reference.device)
        out["attention_mask"] = _pad_tensor(mask, main[1] - main[0], _FILL_ZERO, pad_token_id)
    return out, PaddedLengths(streams)


def _pad_tensor(t: torch.Tensor, extra: int, fill: str, pad_token_id: int) -> torch.Tensor:
    if fill == _FILL_POSITIONS:
        steps = torch.arange(1, extra + 1, device=t.device, dtype=t.dtype)
        return torch.cat([t, t[:, -1:] + steps], dim=1)
    value = {_FILL_TOKEN: pad_token_id, _FILL_ZERO: 0, _FILL_IGNORE: IGNORE_INDEX}[fill]
    shape = (t.shape[0], extra, *t.shape[2:])
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)


class Fp8PaddingCollator:
    """Wraps a data collator so every batch comes out padded to a multiple of 16 tokens.

    Optional: padding once here saves each FP8 layer the copy that pads its GEMM operands.
    ``collator`` defaults to ``transformers.default_data_collator``; pass the one you
    use (``DataCollatorForLanguageModeling``, ``DataCollatorForSeq2Seq``, ...).
    """

    def __init__(
        self,
        collator: Callable[[list[Any]], Mapping[str, Any]] | None = None,
        pad_token_id: int = 0,
        multiple: int = FP8_ALIGNMENT,
        encoder_decoder: bool = False,
    ) -> None:
        if collator is None:
            from transformers import default_data_collator

            collator = default_data_collator
        if multiple < 1 or multiple % FP8_ALIGNMENT:
            raise ValueError(f"multiple must be a positive multiple of 16 for FP8 GEMMs, got {multiple}")
        self.collator = collator
        self.pad_token_id = pad_token_id
        self.multiple = multiple
        self.encoder_decoder = encoder_decoder

    def __call__(self, features: list[Any]) -> dict[str, Any]:
        batch, _ = pad_batch(
            self.collator(features), self.multiple, self.pad_token_id, encoder_decoder=self.encoder_decoder
        )
        return batch
