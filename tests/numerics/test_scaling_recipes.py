"""Row-wise and block scaling in the native backend, against references written tile by tile here."""

from __future__ import annotations

import copy

import pytest
import tiny_models as tm
import torch
import torch.nn.functional as F
from conftest import ScaledMmCalls
from torch import nn

import hf_fp8
from hf_fp8 import E4M3, Fp8Linear, Fp8Recipe, cast_to_representable, update_fp8_scales
from hf_fp8.numerics.blockwise import block_mm, cast_blocks, cast_tiles
from hf_fp8.numerics.scaling import WEIGHT


def rows_rounded(t: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Each row rounded to FP8 with its own scale (its own amax), as float64."""
    return torch.stack([cast_to_representable(row.float(), fmt) for row in t]).double()


def tiles_rounded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Each rows x cols tile rounded to E4M3 with its own scale, as float64."""
    out = torch.empty_like(t, dtype=torch.float64)
    for i in range(0, t.shape[0], rows):
        for j in range(0, t.shape[1], cols):
            out[i : i + rows, j : j + cols] = cast_to_representable(
                t[i : i + rows, j : j + cols].float()
            ).double()
    return out


def assert_same_gemm(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to float32 accumulation: the FP8 GEMMs accumulate in float32, the reference in float64."""
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())


def layer(recipe: Fp8Recipe, in_features: int = 256, out_features: int = 128) -> Fp8Linear:
    torch.manual_seed(0)
    return Fp8Linear.from_float(nn.Linear(in_features, out_features, bias=False), recipe).train()


def run(fp8: Fp8Linear, tokens: int = 48):
    torch.manual_seed(1)
    x = (torch.randn(tokens, fp8.in_features) * torch.logspace(-2, 1, fp8.in_features)).requires_grad_()
    dy = torch.randn(tokens, fp8.out_features) * torch.logspace(1, -3, tokens)[:, None]
    y = fp8(x)
    y.backward(dy)
    return x, dy, y


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp"])
def test_rowwise_scales_every_row_of_every_operand(scaling):
    fp8 = layer(Fp8Recipe(format="e4m3", scaling=scaling))
    weight = fp8.weight.detach()
    with ScaledMmCalls() as mm:
        x, dy, y = run(fp8)
    assert len(mm.calls) == (3 if scaling == "rowwise" else 2), "FP8 GEMMs: forward, dgrad (and wgrad)"
    forward = rows_rounded(x.detach()) @ rows_rounded(weight).T
    assert_same_gemm(y, forward)
    dgrad = rows_rounded(dy) @ rows_rounded(weight.T).T  # W per input feature
    assert_same_gemm(x.grad, dgrad)
    if scaling == "rowwise":  # dy and x per feature, over the tokens
        wgrad = rows_rounded(dy.T) @ rows_rounded(x.detach().T).T
    else:
        wgrad = dy.double().T @ x.detach().double()
    assert_same_gemm(fp8.weight.grad, wgrad)


def test_rowwise_keeps_an_outlier_row_from_costing_the_others():
    """One token 1e5 times larger: tensorwise scaling pushes the other rows into E4M3's subnormals, row-wise
    scaling does not."""
    errors = {}
    for scaling in ("current", "rowwise"):
        fp8 = layer(Fp8Recipe(format="e4m3", scaling=scaling))
        x = torch.randn(32, 256) * 0.01
        x[0] *= 1e5
        with torch.no_grad(), hf_fp8.fp8_autocast(enabled=True):
            y = fp8(x)
        reference = x.double() @ fp8.weight.detach().double().T
        errors[scaling] = ((y[1:] - reference[1:]).norm() / reference[1:].norm()).item()
    assert errors["rowwise"] < errors["current"] / 4, errors


def test_block_scaling_rounds_each_tile_and_block():
    fp8 = layer(Fp8Recipe(format="e4m3", scaling="block"), in_features=384, out_features=256)
    weight = fp8.weight.detach()
    x, dy, y = run(fp8, tokens=200)  # 200 tokens: the 128-token tiles of the wgrad end short
    w_blocks = tiles_rounded(weight, 128, 128)
    torch.testing.assert_close(
        y.double(), tiles_rounded(x.detach(), 1, 128) @ w_blocks.T, rtol=1e-5, atol=1e-6
    )
    assert_same_gemm(x.grad, tiles_rounded(dy, 1, 128) @ w_blocks)
    wgrad = tiles_rounded(dy, 128, 1).T @ tiles_rounded(x.detach(), 128, 1)
    assert_same_gemm(fp8.weight.grad, wgrad)


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp", "block"])
def test_a_model_trains_like_high_precision_under_each_scaling(scaling):
    model = tm.build("llama")
    reference = copy.deepcopy(model)
    hf_fp8.patch_model(model, Fp8Recipe(format="e4m3", scaling=scaling))
    batches = [tm.batch_for("llama", 32, seed=s) for s in range(4)]
    losses, expected = tm.train(model, batches), tm.train(reference, batches)
    for got, want in zip(losses, expected, strict=True):
        assert got == pytest.approx(want, rel=5e-3)
    layer = model.model.layers[0].mlp.down_proj
    assert (layer.amax_history[:, 1:5] > 0).all(), "amaxes are still recorded, for telemetry and the guard"


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp", "block"])
def test_these_scalings_need_e4m3(scaling):
    with pytest.raises(
        ValueError, match=rf"scaling '{scaling}' runs every GEMM operand in E4M3.*format: e4m3"
    ):
        Fp8Recipe(scaling=scaling)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp"])
def test_gpu_rowwise_gemms_match_the_reference(scaling, compiled):
    """cuBLAS/CUTLASS row-wise kernels, eager and fused by Inductor, against the tile references: each of
    the three GEMMs separately, so a wrong one is named. (Compiled on torch 2.11 the dgrad once came out
    wrong, max error 15: the Function returned a no-op ``.to()``'s alias; see ``gemm.in_dtype``.)"""
    torch._dynamo.reset()
    fp8 = layer(Fp8Recipe(format="e4m3", scaling=scaling), in_features=512, out_features=256)
    fp8 = fp8.cuda().bfloat16()
    weight = fp8.weight.detach().float().cpu()
    torch.manual_seed(1)
    x = (torch.randn(64, 512) * torch.logspace(-2, 1, 512)).bfloat16().cuda().requires_grad_()
    dy = (torch.randn(64, 256) * torch.logspace(1, -3, 64)[:, None]).bfloat16().cuda()
    step = torch.compile(lambda m, t: m(t), backend="inductor") if compiled else (lambda m, t: m(t))
    y = step(fp8, x)
    y.backward(dy)
    xs, dys = x.detach().float().cpu(), dy.float().cpu()

    def close(got: torch.Tensor, expected: torch.Tensor, gemm: str) -> None:
        tolerance = 2**-7 * expected.abs().max().item()  # BF16 output, FP8 rounding ties
        error = (got.double().cpu() - expected).abs().max().item()
        assert error <= tolerance, f"{gemm}: max error {error:.3g} > {tolerance:.3g}"

    close(y, rows_rounded(xs) @ rows_rounded(weight).T, "forward")
    close(x.grad, rows_rounded(dys) @ rows_rounded(weight.T).T, "dgrad")
    if scaling == "rowwise":
        wgrad = rows_rounded(dys.T) @ rows_rounded(xs.T).T
    else:
        wgrad = dys.double().T @ xs.double()
    close(fp8.weight.grad, wgrad, "wgrad")


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
@pytest.mark.parametrize("stored", [False, True], ids=["trained", "stored"])
@pytest.mark.parametrize(("in_features", "out_features"), [(512, 1536), (576, 256)])
def test_gpu_block_gemms_run_on_cublas_and_match_the_reference(in_features, out_features, stored, compiled):
    """cuBLAS's block-scaled kernels (three ``_scaled_mm`` calls, none emulated), eager and compiled,
    against the tile references, each GEMM by itself. 576 input features are 4.5 blocks: the forward's
    operands are padded with zeros to 8 blocks there (torch 2.11 reads an unpadded 128x128 scale matrix
    wrongly), and 256 output features to 4 for the dgrad; 200 tokens end the wgrad's tiles short."""
    torch._dynamo.reset()
    recipe = Fp8Recipe.named("lora-fp8-block" if stored else "block")
    fp8 = layer(recipe, in_features=in_features, out_features=out_features).cuda().bfloat16()
    weight = fp8.weight.detach().float().cpu()
    fp8.weight.requires_grad_(not stored)
    if stored:
        fp8.quantize_weight_()
    torch.manual_seed(1)
    x = (
        (torch.randn(200, in_features) * torch.logspace(-2, 1, in_features))
        .bfloat16()
        .cuda()
        .requires_grad_()
    )
    dy = (torch.randn(200, out_features) * torch.logspace(1, -3, 200)[:, None]).bfloat16().cuda()
    step = torch.compile(lambda m, t: m(t), backend="inductor") if compiled else (lambda m, t: m(t))
    with ScaledMmCalls() as mm:
        y = step(fp8, x)
        y.backward(dy)
    if not compiled:
        assert len(mm.calls) == (2 if stored else 3), "forward, dgrad (and wgrad) on cuBLAS"
    xs, dys = x.detach().float().cpu(), dy.float().cpu()

    def close(got: torch.Tensor, expected: torch.Tensor, gemm: str) -> None:
        tolerance = 2**-7 * expected.abs().max().item()  # BF16 output, FP8 rounding ties
        error = (got.double().cpu() - expected).abs().max().item()
        assert error <= tolerance, f"{gemm}: max error {error:.3g} > {tolerance:.3g}"

    w_blocks = tiles_rounded(weight, 128, 128)
    close(y, tiles_rounded(xs, 1, 128) @ w_blocks.T, "forward")
    close(x.grad, tiles_rounded(dys, 1, 128) @ w_blocks, "dgrad")
    if not stored:
        close(fp8.weight.grad, tiles_rounded(dys, 128, 1).T @ tiles_rounded(xs, 128, 1), "wgrad")


@pytest.mark.parametrize("scaling", ["rowwise", "rowwise_gw_hp", "block"])
def test_hf_fp8_compile_trains_each_scaling_exactly_as_eager(scaling):
    torch._dynamo.reset()
    eager = tm.build("llama")
    hf_fp8.patch_model(eager, Fp8Recipe(format="e4m3", scaling=scaling))
    compiled = copy.deepcopy(eager)
    hf_fp8.compile(compiled, backend="aot_eager")
    tm.with_compiled_loss(eager)
    batches = [tm.batch_for("llama", 32, seed=s) for s in range(2)]
    assert tm.train(compiled, batches) == tm.train(eager, batches)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_gpu_the_heads_dgrad_pads_its_contraction_and_matches_the_reference(compiled):
    """``backward-fp8``'s output head (``block_gw_rowwise``, the forward in high precision) over 768
    outputs, 6 blocks of vocabulary: the fused column casts write ``dy``'s row tiles padded with zeros to
    8 blocks, the weight's blocks are padded to match, and the dgrad equals the tile reference. The
    backward's cast of the weight records its amax."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    recipe = Fp8Recipe.named("backward-fp8").head_recipe
    head = Fp8Linear.from_float(nn.Linear(256, 768, bias=False), recipe, forward_in_fp8=False)
    head = head.train().cuda().bfloat16()
    weight = head.weight.detach().float().cpu()
    x = (torch.randn(200, 256) * torch.logspace(-2, 1, 256)).bfloat16().cuda().requires_grad_()
    dy = (torch.randn(200, 768) * torch.logspace(1, -3, 200)[:, None]).bfloat16().cuda()
    step = torch.compile(lambda m, t: m(t), backend="inductor") if compiled else (lambda m, t: m(t))
    with ScaledMmCalls() as mm:
        step(head, x).backward(dy)
    assert len(mm.calls) == 2 or compiled, "dgrad and wgrad on cuBLAS"
    expected = tiles_rounded(dy.float().cpu(), 1, 128) @ tiles_rounded(weight, 128, 128)
    error = (x.grad.double().cpu() - expected).abs().max().item()
    assert error <= 2**-7 * expected.abs().max().item()
    assert head.backward_amax[WEIGHT, 0].item() == weight.abs().max().item()
    assert head.amax_history[WEIGHT, 0].item() == 0.0, "not read again in the forward"


@pytest.mark.parametrize("input_grad", [True, False])
def test_a_block_weight_cast_in_the_backward_has_its_amax_taken_there(input_grad):
    """With the forward in high precision (the output head of ``backward-fp8``), the backward's cast of
    the weight in 128x128 blocks is its only one of the step: its amax comes from the blocks' amaxes
    there, where the forward read the weight again for it. Without an input gradient there is no such
    cast, and the forward takes it. Either way the step's end gives the weight's scale from it."""
    recipe = Fp8Recipe(format="e4m3", scaling="block")
    torch.manual_seed(0)
    fp8 = Fp8Linear.from_float(nn.Linear(256, 128, bias=False), recipe, forward_in_fp8=False).train()
    x = torch.randn(48, 256, requires_grad=input_grad)
    fp8(x).sum().backward()
    amax = fp8.weight.detach().abs().max().item()
    assert fp8.backward_amax[WEIGHT, 0].item() == (amax if input_grad else 0.0)
    assert fp8.amax_history[WEIGHT, 0].item() == (0.0 if input_grad else amax)
    update_fp8_scales(fp8)
    assert amax in fp8.amax_history[WEIGHT].tolist()
    assert fp8.scale[WEIGHT].item() == pytest.approx(448.0 / amax)


def test_a_block_gemm_takes_an_operand_padded_with_zero_columns():
    """The fused casts write row tiles padded with zero columns to whole groups of 4 tiles, the
    contraction cuBLAS's block kernels take: ``block_mm`` pads the other operand to match (here emulated,
    the CPU's path), and the zeros add nothing."""
    torch.manual_seed(0)
    a, b = torch.randn(32, 640), torch.randn(256, 640)  # 5 blocks of 128
    a_fp8, a_scales, _ = cast_tiles(a, E4M3, 0)
    b_fp8, b_scales = cast_blocks(b, E4M3, 0)
    want = block_mm(a_fp8, a_scales, b_fp8, b_scales, True, torch.float32)
    padded = F.pad(a_fp8.view(torch.uint8), (0, 384)).view(a_fp8.dtype)
    got = block_mm(padded, F.pad(a_scales, (0, 3), value=1.0), b_fp8, b_scales, True, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_a_weight_stored_in_blocks_with_the_forward_in_high_precision_is_its_stored_values():
    """``fp8_weights`` under ``forward_in_fp8: false``: the forward multiplies by the stored FP8 values
    over their block scales (it took the raw FP8 bytes' values before), and the input gradient uses the
    same blocks; no amax is taken of them, their scales were fixed when they were stored."""
    recipe = Fp8Recipe(format="e4m3", scaling="block", fp8_weights=True)
    torch.manual_seed(0)
    fp8 = Fp8Linear.from_float(nn.Linear(256, 128, bias=False), recipe, forward_in_fp8=False).train()
    fp8.weight.requires_grad_(False)
    fp8.quantize_weight_()
    stored = fp8.dequantized_weight().float()
    x = torch.randn(48, 256, requires_grad=True)
    y = fp8(x)
    torch.testing.assert_close(y, x.detach() @ stored.T, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(y)
    y.backward(dy)
    expected = tiles_rounded(dy, 1, 128) @ stored.double()
    assert (x.grad.double() - expected).abs().max() <= 2**-7 * expected.abs().max()
    assert fp8.backward_amax[WEIGHT, 0] == 0 and fp8.amax_history[WEIGHT, 0] == 0
