"""FP8 GEMMs on the CPU: the same numbers on every CPU, by the fastest call that gives them.

``torch._scaled_mm`` on the CPU computes an FP8 product one of two ways. Its own fallback converts both
operands to float32, multiplies each by its dequantization factor and runs a float32 GEMM: exact FP8
values, float32 accumulation, about the speed of float32. Where the CPU has AMX, torch hands
tensor-wise scaled products (one dtype on CPUs with AMX-INT8, mixed dtypes on CPUs with AMX-FP16) to
oneDNN, which has no fast kernel for them and runs its reference loop, a value at a time: 5.5-6.5 s
for a 512 x 576 x 576 product against 5 ms in float32 (Xeon with AMX, torch 2.13, one thread).

So for each operand pairing (the two dtypes, and whether the scales are tensor-wise or row-wise) the
first FP8 GEMM measures, once, the calls that compute this product, and keeps the first of them that
gives the float32 fallback's bits and is about as fast:

1. ``torch._scaled_mm`` as asked;
2. for tensor-wise scales, ``torch._scaled_mm`` with each scale repeated in row-wise shape (M x 1 and
   1 x N): the same product, which torch computes with its float32 fallback on every CPU;
3. hf-fp8's float32 emulation, written as torch's fallback is (the same bits).

Every CPU thus gives the numbers of the fallback that CPUs without AMX run, and a test's expected
values hold on all of them. ``hf-fp8 env`` prints what was chosen and why (:func:`cpu_gemm_choices`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["CpuGemmChoice", "choose_call", "cpu_fp8_mm", "cpu_gemm_choices", "emulated_fp8_mm"]

CpuGemmCall = Literal["scaled_mm", "scaled_mm_rowwise_scales", "emulated"]

# The probe product (64 x 128 x 128): large enough that oneDNN's reference loop takes tens of
# milliseconds where the float32 fallback takes tens of microseconds, small enough to cost nothing.
_PROBE_SHAPE = (64, 128, 128)
# A call is "about as fast" as the emulation when it takes at most this many times as long, plus
# the slack (timer noise and per-call overhead at the probe's small size).
_SLOWER_AT_MOST = 4.0
_SLACK_SECONDS = 5e-4


@dataclass(frozen=True)
class CpuGemmChoice:
    """The call FP8 GEMMs of one operand pairing take on this CPU, and why."""

    call: CpuGemmCall
    reason: str


_choices: dict[tuple[torch.dtype, torch.dtype, bool], CpuGemmChoice] = {}


def cpu_fp8_mm(
    a: torch.Tensor, b: torch.Tensor, a_inverse: torch.Tensor, b_inverse: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``(a * a_inverse) @ (b * b_inverse)`` in ``out_dtype`` for FP8 ``a`` (row-major) and ``b``
    (column-major) on the CPU, with tensor-wise (one element each) or row-wise (M x 1, 1 x N)
    dequantization factors, through the call chosen for this pairing (see the module docstring)."""
    rowwise = a_inverse.numel() != 1 or b_inverse.numel() != 1
    call = _chosen_call(a.dtype, b.dtype, rowwise)
    if call == "scaled_mm":
        return torch._scaled_mm(a, b, a_inverse, b_inverse, out_dtype=out_dtype)
    if call == "scaled_mm_rowwise_scales":
        rows = a_inverse.reshape(1, 1).expand(a.shape[0], 1).contiguous()
        columns = b_inverse.reshape(1, 1).expand(1, b.shape[1]).contiguous()
        return torch._scaled_mm(a, b, rows, columns, out_dtype=out_dtype)
    return emulated_fp8_mm(a, b, a_inverse, b_inverse, out_dtype)


@torch.library.custom_op("hf_fp8::emulated_fp8_mm", mutates_args=())
def emulated_fp8_mm(
    a: torch.Tensor, b: torch.Tensor, a_inverse: torch.Tensor, b_inverse: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """The FP8 product as torch's CPU fallback computes it: each operand's exact FP8 values in float32
    times its dequantization factor, a float32 GEMM, one rounding to ``out_dtype``. An op of its own, so
    that whoever watches the dispatcher (a test, a profiler) sees an FP8 GEMM as such."""
    # b row-major, as torch's fallback lays it out: a column-major one takes another float32 kernel,
    # which sums in another order on some CPUs
    out = (a.float() * a_inverse) @ (b.contiguous().float() * b_inverse)
    return out if out.dtype == out_dtype else out.to(out_dtype)


@emulated_fp8_mm.register_fake
def _(
    a: torch.Tensor, b: torch.Tensor, a_inverse: torch.Tensor, b_inverse: torch.Tensor, out_dtype: torch.dtype
):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def cpu_gemm_choices() -> dict[str, CpuGemmChoice]:
    """The call of every pairing the native backend multiplies on the CPU, by a readable name
    (probing the ones not chosen yet)."""
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    pairings = [(e4m3, e4m3, False), (e4m3, e5m2, False), (e5m2, e4m3, False), (e5m2, e5m2, False)]
    pairings.append((e4m3, e4m3, True))  # the row-wise recipes
    return {_pairing_name(*p): _choice(*p) for p in pairings}


@torch.compiler.assume_constant_result  # compiled code asks at trace time, eagerly, and keeps the answer
def _chosen_call(a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool) -> CpuGemmCall:
    return _choice(a_dtype, b_dtype, rowwise).call


def _choice(a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool) -> CpuGemmChoice:
    key = (a_dtype, b_dtype, rowwise)
    if key not in _choices:
        _choices[key] = _probe(a_dtype, b_dtype, rowwise)
    return _choices[key]


@torch.no_grad()
def _probe(a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool) -> CpuGemmChoice:
    """The candidate calls (see the module docstring) on the probe product, and the choice among them;
    measured outside any dispatch mode of the caller's (a profiler, a FLOP counter, compile's fake
    tensors): the probe is no part of the caller's computation."""
    with _disable_current_modes():
        return _measure_candidates(a_dtype, b_dtype, rowwise)


def _measure_candidates(a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool) -> CpuGemmChoice:
    m, k, n = _PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=generator) * 16).to(a_dtype)
    b = (torch.randn(n, k, generator=generator) * 16).to(b_dtype).t()
    # dequantization factors that are no powers of two, so that a call applying them elsewhere shows
    a_inverse = torch.rand(m, 1, generator=generator) + 0.3 if rowwise else torch.tensor(0.0371)
    b_inverse = torch.rand(1, n, generator=generator) + 0.3 if rowwise else torch.tensor(1.913)
    candidates: dict[CpuGemmCall, Callable[[torch.dtype], torch.Tensor]] = {}
    if hasattr(torch, "_scaled_mm"):
        candidates["scaled_mm"] = lambda dtype: torch._scaled_mm(a, b, a_inverse, b_inverse, out_dtype=dtype)
        if not rowwise:
            rows, columns = a_inverse.expand(m, 1).contiguous(), b_inverse.expand(1, n).contiguous()
            candidates["scaled_mm_rowwise_scales"] = lambda dtype: torch._scaled_mm(
                a, b, rows, columns, out_dtype=dtype
            )
    choice = choose_call(candidates, lambda dtype: emulated_fp8_mm(a, b, a_inverse, b_inverse, dtype))
    return CpuGemmChoice(choice.call, f"{m}x{k}x{n} probe: {choice.reason}")


def choose_call(
    candidates: dict[CpuGemmCall, Callable[[torch.dtype], torch.Tensor]],
    emulation: Callable[[torch.dtype], torch.Tensor],
) -> CpuGemmChoice:
    """The first of ``candidates`` (each computing one product in the dtype it is given) that gives
    ``emulation``'s bits in float32 and BF16 and takes at most a few times as long; else the emulation."""
    expected = {dtype: emulation(dtype) for dtype in (torch.float32, torch.bfloat16)}
    emulated_seconds = _best_seconds(lambda: emulation(torch.float32))
    passed_over = []
    for call, run in candidates.items():
        try:
            seconds = _best_seconds(lambda run=run: run(torch.float32))
            same_bits = all(torch.equal(run(dtype), want) for dtype, want in expected.items())
        except (RuntimeError, NotImplementedError) as err:  # no CPU kernel in this torch
            passed_over.append(f"{call} unavailable ({str(err).splitlines()[0][:80]})")
            continue
        problems = []
        if seconds > _SLOWER_AT_MOST * emulated_seconds + _SLACK_SECONDS:
            problems.append(f"{seconds * 1e3:.2f} ms, {seconds / emulated_seconds:.0f}x slower")
        if not same_bits:
            problems.append("other bits than the emulation")
        if problems:
            passed_over.append(f"{call} {', '.join(problems)}")
            continue
        skipped = f"; passed over: {'; '.join(passed_over)}" if passed_over else ""
        return CpuGemmChoice(
            call, f"{seconds * 1e3:.2f} ms, emulation {emulated_seconds * 1e3:.2f} ms{skipped}"
        )
    reasons = "; ".join(passed_over) or "torch has no _scaled_mm"
    return CpuGemmChoice("emulated", f"emulation {emulated_seconds * 1e3:.2f} ms; passed over: {reasons}")


def _best_seconds(run: Callable[[], object], repeats: int = 3) -> float:
    """The shortest of ``repeats`` timed calls, after one untimed call (oneDNN builds its kernel then)."""
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _pairing_name(a_dtype: torch.dtype, b_dtype: torch.dtype, rowwise: bool) -> str:
    names = {torch.float8_e4m3fn: "E4M3", torch.float8_e5m2: "E5M2"}
    return f"{names[a_dtype]} x {names[b_dtype]}, {'row-wise' if rowwise else 'tensor-wise'} scales"
