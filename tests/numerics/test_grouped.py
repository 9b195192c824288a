"""The experts' FP8 GEMMs: rows laid out per expert at multiples of 16, one grouped GEMM per projection
and direction on Hopper equal to the per-expert GEMMs on the same FP8 values."""

from __future__ import annotations

import functools

import pytest
import tiny_models as tm
import torch
from conftest import GroupedMmCalls
from tiny_models import build_moe as build
from tiny_models import experts_of

import hf_fp8
from hf_fp8.numerics.grouped import expert_dgrad, expert_forward, expert_wgrad, group_layout


def test_group_layout_starts_every_expert_at_a_multiple_of_16():
    """The grouped kernels read each expert's rows from a padded buffer: rows keep their order, every
    group starts at a multiple of 16, an expert without rows takes no room."""
    counts = torch.tensor([5, 0, 17, 16, 1])
    layout = group_layout(counts, 39, grouped=True)
    assert layout.offsets.tolist() == [16, 16, 48, 64, 80] and layout.offsets.dtype == torch.int32
    assert layout.starts.tolist() == [0, 16, 16, 48, 64]
    assert layout.padded_rows == 128, "39 rows and up to 15 of padding for each of 5 experts, to 16"
    assert layout.destination.tolist() == [*range(5), *range(16, 33), *range(48, 64), 64]
    assert layout.valid.sum() == 39 and layout.valid[layout.destination].all()
    assert torch.equal(layout.source[layout.destination], torch.arange(39))
    assert not layout.source[~layout.valid].any(), "places without a row point at row 0 (masked)"


def test_the_per_expert_layout_has_no_padding():
    counts = torch.tensor([5, 0, 17, 16, 1])
    layout = group_layout(counts, 39, grouped=False)
    assert layout.padded_rows == 39 and layout.valid.all()
    assert layout.starts.tolist() == [0, 5, 5, 22, 38] and layout.offsets.tolist() == [5, 5, 22, 38, 39]
    assert torch.equal(layout.destination, torch.arange(39)) and torch.equal(layout.source, torch.arange(39))


def laid_out(t: torch.Tensor, layout) -> torch.Tensor:
    """``t``'s rows (grouped by expert) at their places in the layout's buffer, zero rows elsewhere."""
    rows = t.view(torch.uint8)[layout.source]
    return torch.where(layout.valid[:, None], rows, 0).view(t.dtype)


def reference_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, rounded=True):
    """What ``torch._scaled_grouped_mm`` computes (CUDA only), in float32 on the CPU, for the two cases
    hf-fp8 uses: groups of rows (2-D x 3-D) and groups along the contraction (2-D x 2-D, out (G, N, K)).
    The arguments first pass the kernel's own checks (its meta function: layouts, scale shapes); rows
    outside every group come back NaN, as the kernel leaves them unwritten. ``rounded=False`` returns
    the float32 result, before the kernel's rounding to ``out_dtype``."""

    def meta(t):
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")

    checked = map(meta, (a, b, scale_a, scale_b))
    torch.ops.aten._scaled_grouped_mm(*checked, offs=meta(offs), out_dtype=out_dtype)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    a, b = a.float(), b.float()
    if b.dim() == 3:
        out = torch.full((a.shape[0], b.shape[-1]), float("nan"))
        for g, (start, end) in enumerate(zip(starts, ends, strict=True)):
            out[start:end] = a[start:end] * scale_a[start:end, None] @ (b[g] * scale_b[g])
        return out.to(out_dtype) if rounded else out
    n, k = a.shape[0], b.shape[1]
    parts = [
        (a[:, s:e] * scale_a[g * n : (g + 1) * n, None]) @ (b[s:e] * scale_b[g * k : (g + 1) * k])
        for g, (s, e) in enumerate(zip(starts, ends, strict=True))
    ]
    out = torch.stack(parts)
    return out.to(out_dtype) if rounded else out


@pytest.mark.parametrize("transposed", [False, True])
def test_the_grouped_branch_lays_rows_out_for_the_kernel(monkeypatch, transposed):
    """The grouped branch (padded layout, expanded scales, operand layouts) on the CPU against the
    per-expert GEMMs, with the kernel's reference standing in for the CUDA-only kernel (the GPU test
    below runs the kernel itself)."""
    counts = torch.tensor([37, 0, 16, 5, 70])
    rows, experts, k, n = int(counts.sum()), counts.numel(), 64, 96
    torch.manual_seed(0)
    fp8 = torch.float8_e4m3fn
    x, dy = torch.randn(rows, k).to(fp8), torch.randn(rows, n).to(fp8)
    stack = torch.randn(experts, k, n) if transposed else torch.randn(experts, n, k)
    weight = stack.to(fp8).transpose(-2, -1) if transposed else stack.to(fp8)
    x_inv, w_inv, dy_inv = torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0)

    def gemms(grouped: bool):
        layout = group_layout(counts, rows, grouped)
        xs, dys = laid_out(x, layout), laid_out(dy, layout)
        return [
            expert_forward(xs, weight, x_inv, w_inv, layout, torch.float32)[layout.destination],
            expert_dgrad(dys, weight, dy_inv, w_inv, layout, torch.float32)[layout.destination],
            expert_wgrad(dys, xs, dy_inv, x_inv, layout, torch.float32),
        ]

    expected = gemms(grouped=False)  # one exact FP8 GEMM per expert
    kernel_calls = []

    def kernel(*args, **kwargs):
        kernel_calls.append(args[1].dim())
        return reference_scaled_grouped_mm(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", kernel)
    got = gemms(grouped=True)
    assert kernel_calls == [3, 3, 2], "forward and dgrad on the 3-D weights, wgrad along the rows"
    for name, g, want in zip(("forward", "dgrad", "wgrad"), got, expected, strict=True):
        torch.testing.assert_close(g, want, rtol=2**-8, atol=2**-9 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_experts_module_on_the_grouped_layout_trains_as_on_the_per_expert_gemms(monkeypatch, arch):
    """A whole MoE model through the grouped branch on the CPU (the kernel's reference, which leaves the
    rows past the last group NaN as the kernel leaves them unwritten, and in float32 here: the kernel's
    rounding to BF16 is not what this test is about) against the per-expert GEMMs: the same loss and
    gradients up to float32 rounding, every one finite, and the same amaxes (places without a row are
    masked before any amax)."""

    def train(grouped: bool):
        model = build(arch)
        hf_fp8.patch_model(model, hf_fp8.Fp8Recipe(format="e4m3", convert_experts=True), backend="native")
        with monkeypatch.context() as patch:
            if grouped:
                patch.setattr("hf_fp8.layers.experts.grouped_kernels_run_on", lambda device: True)
                patch.setattr(
                    torch, "_scaled_grouped_mm", functools.partial(reference_scaled_grouped_mm, rounded=False)
                )
            loss = model(**tm.batch_for("llama", 32)).loss
            loss.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        return loss.detach(), [p.grad for p in params] + [m.amax_history for m in experts_of(model)]

    (loss, grads), (expected_loss, expected_grads) = train(grouped=True), train(grouped=False)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert len(grads) == len(expected_grads)
    for got, expected in zip(grads, expected_grads, strict=True):
        assert got.isfinite().all()
        assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.9999


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_gpu_grouped_expert_gemms_match_the_per_expert_ones(arch):
    """On Hopper each projection's forward, dgrad and wgrad is one grouped FP8 GEMM (E4M3). Against the
    CPU's run the model agrees as FP8 runs on two devices do: the dense layers' FP8 values differ by
    their rounding, so E4M3 gradients differ by a few percent (the GEMMs themselves: the test below)."""
    batch = tm.batch_for("llama", 32)
    results = {}
    for device in ("cpu", "cuda"):
        model = build(arch).to(device)
        hf_fp8.patch_model(model, hf_fp8.Fp8Recipe(format="e4m3", convert_experts=True), backend="native")
        with GroupedMmCalls() as grouped:
            loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
            loss.backward()
        grads = [getattr(m, n).grad.cpu() for m in experts_of(model) for n in ("gate_up_proj", "down_proj")]
        results[device] = (loss.item(), grads, grouped.calls)
    (cpu_loss, cpu_grads, cpu_calls), (gpu_loss, gpu_grads, gpu_calls) = results["cpu"], results["cuda"]
    assert cpu_calls == 0 and gpu_calls == 4 * 2 * 3, "forward, dgrad and wgrad of both projections"
    assert gpu_loss == pytest.approx(cpu_loss, rel=1e-2)
    for got, expected in zip(gpu_grads, cpu_grads, strict=True):
        assert torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0) > 0.95


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_grouped_gemms_equal_the_per_expert_gemms_on_the_same_fp8_values(transposed):
    """The grouped kernels against the CPU's exact per-expert FP8 GEMMs, on the same FP8 operands (uneven
    groups, an expert without rows): equal up to the BF16 the grouped kernels write, and to the tensor
    cores' FP8 accumulation (measured on an H100: 0.2-0.3% of the largest output)."""
    counts = (37, 0, 16, 5, 70)
    rows, experts, k, n = sum(counts), len(counts), 64, 96
    torch.manual_seed(0)
    fp8 = torch.float8_e4m3fn
    x, dy = torch.randn(rows, k).to(fp8), torch.randn(rows, n).to(fp8)
    stack = torch.randn(experts, k, n) if transposed else torch.randn(experts, n, k)
    weight = stack.to(fp8).transpose(-2, -1) if transposed else stack.to(fp8)  # (experts, out, in)
    x_inv, w_inv, dy_inv = torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0)

    def gemms(device: str):
        layout = group_layout(torch.tensor(counts, device=device), rows, grouped=device == "cuda")
        xs, dys = laid_out(x.to(device), layout), laid_out(dy.to(device), layout)
        ws = weight.to(device)
        inv = [t.to(device) for t in (x_inv, w_inv, dy_inv)]
        return [
            expert_forward(xs, ws, inv[0], inv[1], layout, torch.float32)[layout.destination].cpu(),
            expert_dgrad(dys, ws, inv[2], inv[1], layout, torch.float32)[layout.destination].cpu(),
            expert_wgrad(dys, xs, inv[2], inv[0], layout, torch.float32).cpu(),
        ]

    with GroupedMmCalls() as grouped:
        got = gemms("cuda")
    assert grouped.calls == 3
    for name, g, expected in zip(("forward", "dgrad", "wgrad"), got, gemms("cpu"), strict=True):
        atol = 2**-9 * expected.abs().max().item()
        torch.testing.assert_close(g, expected, rtol=2**-8, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_gpu_hybrid_format_groups_all_six_expert_gemms_in_e4m3():
    """Under format hybrid the experts take E4M3 gradients, so their backward is grouped as well."""
    model = build("mixtral").cuda()
    hf_fp8.patch_model(model, hf_fp8.Fp8Recipe(convert_experts=True), backend="native")  # hybrid elsewhere
    with GroupedMmCalls() as grouped:
        model(**{k: v.cuda() for k, v in tm.batch_for("llama", 32).items()}).loss.backward()
    assert grouped.calls == 4 * 2 * 3, "forward, dgrad and wgrad of both projections, grouped"
