"""Shared helpers: GPU gating, a counter of FP8 GEMM calls, FP8 error bounds, a seeded FP8 linear layer,
the stored-weight check, and Shakespeare's text as a dataset (the fixture ``text_rows``)."""

from __future__ import annotations

import demo_data
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hf_fp8.numerics.blockwise  # (registers the op hf_fp8::emulated_block_mm)
import hf_fp8.numerics.cpu_gemm  # noqa: F401  (registers the op hf_fp8::emulated_fp8_mm)
from hf_fp8 import Fp8Linear, Fp8Recipe
from hf_fp8.formats import E4M3, Fp8Format, gpu_has_fp8
from hf_fp8.layers.stored_weight import Fp8StoredWeight

# Unit roundoff (half a mantissa step, relative) and half the subnormal spacing of each format.
UNIT_ROUNDOFF = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
HALF_SUBNORMAL_STEP = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}


def fp8_gpu_available() -> bool:
    return torch.cuda.is_available() and gpu_has_fp8()


def pytest_collection_modifyitems(config, items):
    if fp8_gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU with FP8 (compute capability >= 8.9)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


class ScaledMmCalls(TorchDispatchMode):
    """Records the operand dtypes of every FP8 GEMM made inside the ``with`` block: ``aten._scaled_mm``,
    or on a CPU whose ``_scaled_mm`` is slow for the pairing, hf-fp8's emulation of it
    (hf_fp8.numerics.cpu_gemm), or of a block-scaled one (hf_fp8.numerics.blockwise)."""

    GEMMS = (
        torch.ops.aten._scaled_mm.default,
        torch.ops.hf_fp8.emulated_fp8_mm.default,
        torch.ops.hf_fp8.emulated_block_mm.default,
    )

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.GEMMS:
            self.calls.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


class GroupedMmCalls(TorchDispatchMode):
    """Counts the ``aten._scaled_grouped_mm`` calls made inside the ``with`` block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch.ops.aten._scaled_grouped_mm.default
        return func(*args, **(kwargs or {}))


def quantization_error_bound(
    t: torch.Tensor, scale: torch.Tensor | float, fmt: Fp8Format = E4M3
) -> torch.Tensor:
    """Largest possible |fp8(t * scale) / scale - t| per element, for values within range.

    Round-to-nearest keeps normal values within one unit roundoff (relative); below the normal range
    the error is at most half the subnormal spacing (absolute, in scaled units).
    """
    scale = float(scale)
    t = t.double().abs()
    return torch.maximum(
        UNIT_ROUNDOFF[fmt.name] * t, torch.full_like(t, HALF_SUBNORMAL_STEP[fmt.name] / scale)
    )


def matmul_error_bound(a: torch.Tensor, da: torch.Tensor, b: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
    """Bound on |(a + ea) @ (b + eb) - a @ b| given |ea| <= da and |eb| <= db, elementwise."""
    a, b = a.double().abs(), b.double().abs()
    return a @ db + da @ b + da @ db


def assert_fp8_gradients_match(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """The FP8 tolerance every architecture is held to: E5M2 gradients (two mantissa bits, a unit
    roundoff of 1/8 per value) give the whole gradient within 25% relative error, pointing the same
    way (cosine > 0.97)."""
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    ref_grads = torch.cat([p.grad.flatten() for p in reference.parameters() if p.grad is not None])
    error = ((grads.double() - ref_grads.double()).norm() / ref_grads.double().norm()).item()
    assert error < 0.25, error
    assert torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0) > 0.97


def stored_in_fp8(weight) -> bool:
    """The weight is held as E4M3 values plus a scale (while reporting its original dtype)."""
    return isinstance(weight, Fp8StoredWeight) and weight._data.dtype == torch.float8_e4m3fn


def make_layer(in_features=64, out_features=48, bias=True, dtype=torch.float32, seed=0, **recipe):
    """A seeded ``nn.Linear`` and an ``Fp8Linear`` made from it (sharing its parameters) with ``recipe``."""
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return linear, Fp8Linear.from_float(linear, Fp8Recipe(**recipe))


@pytest.fixture(scope="module")
def text_rows() -> list[dict[str, torch.Tensor]]:
    """512 windows of 64 bytes of Shakespeare, as a dataset of causal-LM examples."""
    (batch,) = demo_data.text_batches(1, 512, 64)
    return [{"input_ids": row, "labels": row.clone()} for row in batch["input_ids"]]
