"""Global switch that decides whether FP8 modules compute in FP8.

By default an FP8 module computes in FP8 while it is in training mode, and in eval mode only when its
recipe has ``use_during_eval``. :func:`fp8_autocast` overrides that for a region of code, e.g. to
compare a patched model's FP8 loss with its high-precision loss without unpatching it::

    with hf_fp8.fp8_autocast(enabled=False):
        reference_loss = model(**batch).loss

Unlike Transformer Engine's autocast, the backward pass needs no care: each FP8 layer's backward uses
the precision its forward ran in, whatever the switch says when ``backward()`` is called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["fp8_active", "fp8_autocast", "fp8_forced", "generating", "in_generation"]

_override: bool | None = None
_generations = 0  # forwards with a KV cache in flight (see generating)


@contextmanager
def fp8_autocast(enabled: bool = True) -> Iterator[None]:
    """Force FP8 on (also in eval mode) or off for every FP8 module inside the ``with`` block."""
    global _override
    previous = _override
    _override = bool(enabled)
    try:
        yield
    finally:
        _override = previous


def fp8_active(training: bool, use_during_eval: bool) -> bool:
    """Whether an FP8 module in this mode computes in FP8 right now."""
    if _override is not None:
        return _override
    return training or use_during_eval


def fp8_forced() -> bool:
    """Whether an ``fp8_autocast(enabled=True)`` block is on: FP8 then runs wherever it can, also where
    the plain layer would be faster (a decode step's few rows)."""
    return _override is True


@contextmanager
def generating() -> Iterator[None]:
    """Mark a forward as a generation step (a patched model's hook does, for a forward without gradient
    that is given a KV cache): where the plain layer is faster there, FP8 layers in training mode use it
    (see ``Fp8Linear.plain_is_faster``)."""
    global _generations
    _generations += 1
    try:
        yield
    finally:
        _generations -= 1


def in_generation() -> bool:
    """Whether a :func:`generating` block is on."""
    return _generations > 0
