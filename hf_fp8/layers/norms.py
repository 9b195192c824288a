"""Recognising normalisation layers by what they compute, whatever their class is called."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["norm_eps", "norm_kind"]

_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")


def norm_eps(module: nn.Module) -> float | None:
    """The epsilon of a norm module, whatever its attribute is called; ``None`` when it has none."""
    return next((getattr(module, a) for a in _EPS_ATTRS if isinstance(getattr(module, a, None), float)), None)


def norm_kind(module: nn.Module) -> str | None:
    """``layernorm``, ``rmsnorm`` or ``rmsnorm (1 + w)`` (Gemma), told apart by what the module computes.

    Candidates are leaf modules with a 1-D ``weight`` and an epsilon attribute; a probe of the module
    (its class and attributes, float32 tensors of its parameters' shapes) runs its class's forward on a
    probe input and its output is compared with each formula. The module itself is never called nor its
    tensors read: meta-device and sharded (DTensor) modules work too, and no hook of theirs runs.
    """
    weight = getattr(module, "weight", None)
    eps = norm_eps(module)
    if isinstance(module, nn.LayerNorm):
        return "layernorm"
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 1
        or eps is None
        or next(module.children(), None)
    ):
        return None
    probe = _probe(module)
    hidden = weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, hidden, generator=generator) * 3 + 1
    with torch.no_grad():
        probe.weight.copy_(torch.rand(hidden, generator=generator) + 0.5)
        if getattr(probe, "bias", None) is not None:
            probe.bias.zero_()
        try:
            y = type(probe).forward(probe, x)
        except Exception:
            return None
        w = probe.weight
        rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        centered = x - x.mean(-1, keepdim=True)
        candidates = {
            "rmsnorm": rms * w,
            "rmsnorm (1 + w)": rms * (1 + w),
            "layernorm": centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps) * w,
        }
    if not torch.is_tensor(y) or y.shape != x.shape:
        return None
    return next(
        (kind for kind, ref in candidates.items() if torch.allclose(y, ref, rtol=1e-4, atol=1e-4)), None
    )


def _probe(module: nn.Module) -> nn.Module:
    """A shallow copy of leaf ``module`` with tensors of its own on the CPU in float32 (zeros; the
    caller fills the weight)."""
    probe = object.__new__(type(module))  # no __new__ or __init__ of its class (FSDP2's has both)
    probe.__dict__.update(module.__dict__)
    probe._parameters = {
        n: None if p is None else nn.Parameter(torch.zeros(p.shape, dtype=torch.float32), p.requires_grad)
        for n, p in module._parameters.items()
    }
    probe._buffers = {n: None if b is None else _zeros_like(b) for n, b in module._buffers.items()}
    return probe


def _zeros_like(t: torch.Tensor) -> torch.Tensor:
    return torch.zeros(t.shape, dtype=torch.float32 if t.is_floating_point() else t.dtype, device="cpu")
