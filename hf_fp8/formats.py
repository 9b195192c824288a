"""FP8 number formats, scale math, saturating casts, and which GPUs have FP8 tensor cores.

The two FP8 formats of Hopper tensor cores:

* E4M3 (``torch.float8_e4m3fn``): 3 mantissa bits, finite range +-448, used for activations and weights.
* E5M2 (``torch.float8_e5m2``): 2 mantissa bits, range +-57344, used for gradients.

A tensor ``x`` is stored as ``fp8(x * scale)`` and read back as ``fp8 / scale``. The scale maps the
tensor's absolute maximum (amax) onto the top of the format's range, less a safety margin:
``scale = FP8_MAX / (amax * 2**margin)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_ALIGNMENT",
    "Fp8Format",
    "cast_to_fp8",
    "cast_to_representable",
    "compute_scale",
    "get_format",
    "gpu_has_fp8",
]


@dataclass(frozen=True)
class Fp8Format:
    """One FP8 storage format: its torch dtype and the largest finite value it holds."""

    name: str
    dtype: torch.dtype
    max: float

    def __repr__(self) -> str:
        return f"Fp8Format({self.name})"


# FP8 GEMMs (cuBLASLt, Transformer Engine) need their dimensions to be multiples of this.
FP8_ALIGNMENT = 16

E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0)

_FORMATS = {fmt.name: fmt for fmt in (E4M3, E5M2)}


def get_format(fmt: str | Fp8Format) -> Fp8Format:
    """Return the :class:`Fp8Format` named ``fmt`` (``"e4m3"`` or ``"e5m2"``)."""
    if isinstance(fmt, Fp8Format):
        return fmt
    try:
        return _FORMATS[str(fmt).lower()]
    except KeyError:
        raise ValueError(f"unknown FP8 format {fmt!r}; expected one of {sorted(_FORMATS)}") from None


def compute_scale(
    amax: torch.Tensor,
    fmt: str | Fp8Format,
    margin: int = 0,
    previous: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scale that maps ``amax`` to ``fmt.max / 2**margin``, as float32.

    Where ``amax`` is zero or not finite there is nothing to learn from it, so the ``previous`` scale is
    kept (1.0 when none is given). A scale that would overflow float32 (a tiny amax) is clamped to the
    largest float32, as Transformer Engine does.
    """
    fmt = get_format(fmt)
    amax = amax.float()
    fallback = torch.ones_like(amax) if previous is None else previous.float()
    scale = (fmt.max / 2.0**margin) / amax
    scale = torch.clamp(scale, max=torch.finfo(torch.float32).max)
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, scale, fallback)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor | float, fmt: str | Fp8Format) -> torch.Tensor:
    """Return ``fp8(x * scale)``, saturating at the format's largest finite value.

    A plain ``.to(torch.float8_e4m3fn)`` turns an out-of-range value into NaN (E4M3 has no infinity), and
    into inf for E5M2, so values are clamped first. NaN inputs stay NaN, so they can still be detected.
    """
    fmt = get_format(fmt)
    scaled = x.float() * scale
    return scaled.clamp(min=-fmt.max, max=fmt.max).to(fmt.dtype)


def cast_statistics(
    source: torch.Tensor, scale: torch.Tensor, fp8: torch.Tensor, fmt: str | Fp8Format
) -> torch.Tensor:
    """What one cast did, as an int64 tensor ``[values, saturated, flushed]``: how many values ``source``
    had, how many lay beyond the format's largest value at ``scale`` (clamped), and how many nonzero ones
    became zero in ``fp8``. Tensor ops only, so a compiled step computes them inside its cast kernels."""
    fmt = get_format(fmt)
    saturated = ((source.float() * scale).abs() > fmt.max).sum()
    flushed = ((source != 0) & (fp8.float() == 0)).sum()
    return torch.stack([torch.full_like(saturated, source.numel()), saturated, flushed])


def cast_to_representable(
    t: torch.Tensor, fmt: str | Fp8Format = "e4m3", scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """Round ``t`` to the nearest value FP8 can store, returned in ``t``'s dtype.

    A debugging helper: an FP8 GEMM on representable inputs equals a high-precision GEMM up to
    accumulation order, so differences left after this rounding come from elsewhere. ``scale`` is the
    scale the value would be stored with (``fp8(t * scale) / scale``); by default the tensor's own
    current scale (``compute_scale(t.abs().max())``), which is what current scaling would use.
    """
    fmt = get_format(fmt)
    if scale is None:
        scale = compute_scale(t.detach().abs().amax(), fmt)
    return (cast_to_fp8(t, scale, fmt).float() / scale).to(t.dtype)


def gpu_has_fp8(device: torch.device | int | None = None) -> bool:
    """Whether a CUDA GPU has FP8 tensor cores (compute capability 8.9: Ada, 9.0: Hopper, and later)."""
    return torch.cuda.get_device_capability(device) >= (8, 9)
