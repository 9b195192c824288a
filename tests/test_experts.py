"""MoE experts in FP8: transformers 5's 3-D expert weights, both projections and their backward."""

from __future__ import annotations

import copy

import demo_data
import pytest
import tiny_models as tm
import torch
from conftest import GroupedMmCalls, ScaledMmCalls, assert_fp8_gradients_match
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

import hf_fp8
from hf_fp8.experts import Fp8Experts
from hf_fp8.grouped import expert_dgrad, expert_forward, expert_wgrad, group_layout

# MoE-shaped tiny models: as in real MoE models the experts hold most of the FLOPs (Mixtral 8x7B: the
# output head is ~1% of them); hidden 64, experts of 256, 4 layers, top-2 of 4 experts (top-4 of 8 for
# the models that route to more).
_MOE = dict(
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=tm.VOCAB,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
MOE_CONFIGS = {
    "mixtral": dict(_MOE, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _MOE,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_size=256,
    ),
    "qwen3_moe": dict(_MOE, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=4, head_dim=16),
    "olmoe": dict(_MOE, intermediate_size=256, num_experts=8, num_experts_per_tok=4),
}


def text_batches(steps: int, batch: int = 4, length: int = 32) -> list[dict[str, torch.Tensor]]:
    return demo_data.text_batches(steps, batch, length)


def build(arch: str, seed: int = 0) -> torch.nn.Module:
    config = AutoConfig.for_model(arch, **MOE_CONFIGS[arch])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).train()


def experts_of(model) -> list[Fp8Experts]:
    return [m for m in model.modules() if isinstance(m, Fp8Experts)]


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_experts_convert_and_most_gemm_flops_run_in_fp8(arch):
    model = build(arch)
    originals = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    report = hf_fp8.patch_model(model)
    converted = experts_of(model)
    assert len(converted) == len(originals) == 4
    for fp8, original in zip(converted, originals, strict=True):
        assert isinstance(fp8, type(original)) and fp8.down_proj is original.down_proj
    assert report.fp8_flop_share >= 0.95, str(report)
    experts = [r for r in report.converted if r.kind == "experts"]
    assert len(experts) == 4
    routers = [r for r in report.skipped if "router" in r.reason]
    assert routers, "the router stays in high precision"


@pytest.mark.parametrize("arch", list(MOE_CONFIGS))
def test_forward_and_backward_match_high_precision(arch):
    """The tolerances of the other architectures: loss within 0.2%, gradients within 25% and the same
    direction (E5M2 gradients have two mantissa bits)."""
    model = build(arch)
    reference = copy.deepcopy(model)
    hf_fp8.patch_model(model)
    batch = tm.batch_for("llama", 32)
    with ScaledMmCalls() as mm:
        loss = model(**batch).loss
        loss.backward()
    experts_calls = len(mm.calls) - 3 * sum(isinstance(m, hf_fp8.Fp8Linear) for m in model.modules())
    assert experts_calls >= 3 * 2 * 4, "FP8 GEMMs for both projections of every expert that got tokens"
    ref_loss = reference(**batch).loss
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 2e-3 * abs(ref_loss.item())
    assert_fp8_gradients_match(model, reference)
    originals = [m for m in reference.modules() if type(m).__name__.endswith("Experts")]
    for fp8, ref in zip(experts_of(model), originals, strict=True):  # each expert weight, about the same way
        for name in ("gate_up_proj", "down_proj"):
            got, expected = getattr(fp8, name).grad.flatten(), getattr(ref, name).grad.flatten()
            assert torch.nn.functional.cosine_similarity(got, expected, dim=0) > 0.9
    assert all(torch.isfinite(m.amax_history).all() for m in experts_of(model))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_full_training_of_an_moe_model_follows_high_precision(arch):
    batches = text_batches(25)
    reference = tm.train(build(arch), batches, lr=3e-3)
    model = build(arch)
    hf_fp8.patch_model(model)
    losses = tm.train(model, batches, lr=3e-3)
    assert reference[-1] < 0.9 * reference[0], "the high-precision model learns"
    assert sum(losses[-5:]) / 5 == pytest.approx(sum(reference[-5:]) / 5, rel=0.02)


def test_experts_keep_hf_keys_and_round_trip_through_save_and_load(tmp_path):
    model = build("mixtral")
    keys = set(model.state_dict())
    hf_fp8.patch_model(model)
    assert set(model.state_dict()) == keys
    model.save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in plain.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    hf_fp8.unpatch_model(model)
    assert not experts_of(model) and type(model.model.layers[0].mlp.experts).__name__ == "MixtralExperts"


def test_experts_scaling_state_is_checkpointed_and_synced_like_linear_layers(tmp_path):
    model = build("qwen3_moe")
    hf_fp8.patch_model(model)
    for step in range(2):
        model(**tm.batch_for("llama", 32, seed=step)).loss.backward()
    experts = experts_of(model)[0]
    assert experts.fp8_steps.item() == 2 and (experts.amax_history[:, 1] > 0).all()
    assert (experts.scale > 0).all() and all(experts.stored_scales)
    path = hf_fp8.save_fp8_state(model, tmp_path)
    fresh = build("qwen3_moe")
    hf_fp8.patch_model(fresh)
    hf_fp8.load_fp8_state(fresh, path.parent)
    assert torch.equal(experts_of(fresh)[0].amax_history, experts.amax_history)


def test_unpatch_gives_back_the_parameters_the_experts_hold_now():
    model = build("mixtral")
    hf_fp8.patch_model(model)
    experts = experts_of(model)[0]
    replacement = torch.nn.Parameter(torch.zeros_like(experts.down_proj))
    experts.down_proj = replacement  # as load_state_dict(assign=True) or FSDP would
    hf_fp8.unpatch_model(model)
    assert model.model.layers[0].mlp.experts.down_proj is replacement


def test_model_half_keeps_the_experts_state_float32():
    model = build("olmoe")
    hf_fp8.patch_model(model)
    model.half()
    experts = experts_of(model)[0]
    assert experts.gate_up_proj.dtype == torch.float16 and experts.amax_history.dtype == torch.float32


def test_lora_over_fp8_stored_experts_learns_like_lora_in_high_precision():
    batches = text_batches(30)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "o_proj", "lm_head"])

    def run(fp8: bool) -> tuple[list[float], torch.nn.Module]:
        model = build("mixtral")
        if fp8:
            hf_fp8.patch_model(model, "lora-fp8")
        torch.manual_seed(1)
        peft_model = get_peft_model(model, lora)
        # at 5e-2 the adapters' loss spikes (to 6.0 from 4.0 in one step), and where the spikes fall
        # decides the tail; at 2e-2 both runs fall without them
        return tm.train(peft_model, batches, lr=2e-2), peft_model

    reference, _ = run(fp8=False)
    losses, model = run(fp8=True)
    stored = experts_of(model)
    assert stored and all(m.weights_in_fp8 for m in stored)
    data = stored[0].gate_up_proj._data
    assert data.dtype == torch.float8_e4m3fn and data.untyped_storage().nbytes() == data.numel()
    assert reference[-1] < 0.9 * reference[0], "the high-precision LoRA learns"
    tail = sum(losses[-5:]) / 5
    assert tail == pytest.approx(sum(reference[-5:]) / 5, rel=0.03)


def test_from_pretrained_fp8_stores_the_experts_in_fp8_too(tmp_path):
    build("qwen3_moe").save_pretrained(tmp_path)
    model, report = hf_fp8.peft.from_pretrained_fp8(tmp_path, device="cpu", dtype=torch.float32)
    experts = experts_of(model)
    assert len(experts) == 4 and all(m.weights_in_fp8 for m in experts)
    assert report.fp8_flop_share >= 0.95


def test_hf_fp8_compile_refuses_experts_with_e5m2_gradients_and_compiles_nothing():
    """Under format hybrid the experts' backward runs one GEMM per expert (the grouped kernel takes E4M3
    only), reading the group sizes on the host: on torch 2.11 GPUs that backward did not compile."""
    model = build("mixtral")
    hf_fp8.patch_model(model)
    with pytest.raises(
        ValueError, match=r"E5M2 gradients \(format 'hybrid': model.layers.0.mlp.experts, 4 in"
    ):
        hf_fp8.compile(model, backend="aot_eager")
    assert all(b._compiled_call_impl is None for b in model.model.layers), "nothing compiled"
    for way_out in ({"format": "e4m3"}, {"modules_to_not_convert": ["experts"]}):  # as the message says
        kept = build("mixtral")
        hf_fp8.patch_model(kept, way_out)
        hf_fp8.compile(kept, backend="aot_eager")


def test_compiled_e4m3_experts_train_exactly_as_eager():
    """All six expert GEMMs grouped (E4M3): compiled block by block, the same losses and expert
    gradients as eager (on torch 2.11 GPUs the compiled experts once got zero gradients; the GPU test
    below checks the grouped kernels themselves)."""
    torch._dynamo.reset()
    eager = build("mixtral")
    hf_fp8.patch_model(eager, hf_fp8.Fp8Recipe(format="e4m3"))
    compiled = copy.deepcopy(eager)
    hf_fp8.compile(compiled, backend="aot_eager")
    for batch in text_batches(2):
        for model in (eager, compiled):
            model(**batch).loss.backward()
        for got, expected in zip(experts_of(compiled), experts_of(eager), strict=True):
            assert got.down_proj.grad.norm() > 0
            assert torch.equal(got.down_proj.grad, expected.down_proj.grad)
            assert torch.equal(got.gate_up_proj.grad, expected.gate_up_proj.grad)


@pytest.mark.gpu
def test_gpu_compiled_e4m3_experts_get_the_eager_gradients():
    """With Inductor on a Hopper GPU, the grouped FP8 experts' gradients follow eager's, as E4M3 gradients
    of a tiny model do when fused casts round a few values otherwise (measured on an H100: cosine 0.977;
    they came out zero on torch 2.11 while the Function returned a no-op ``.to()``'s alias)."""
    torch._dynamo.reset()
    eager = build("mixtral").cuda().to(torch.bfloat16)
    hf_fp8.patch_model(eager, hf_fp8.Fp8Recipe(format="e4m3"), backend="native")
    compiled = copy.deepcopy(eager)
    hf_fp8.compile(compiled)
    batch = {k: v.cuda() for k, v in tm.batch_for("llama", 64).items()}
    for model in (eager, compiled):
        model(**batch).loss.backward()
    for got, expected in zip(experts_of(compiled), experts_of(eager), strict=True):
        for name in ("gate_up_proj", "down_proj"):
            g, e = getattr(got, name).grad.float(), getattr(expected, name).grad.float()
            assert g.norm() > 0
            assert torch.nn.functional.cosine_similarity(g.flatten(), e.flatten(), dim=0) > 0.95


def test_eval_mode_runs_the_models_own_experts_forward():
    model = build("mixtral")
    reference = copy.deepcopy(model).eval()
    hf_fp8.patch_model(model)
    model.eval()
    batch = tm.batch_for("llama", 16)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reference(**batch).logits)


def test_group_layout_starts_every_expert_at_a_multiple_of_16():
    """The grouped kernels read each expert's rows from a padded buffer: rows keep their order, every
    group starts at a multiple of 16, an expert without rows takes no room."""
    counts = torch.tensor([5, 0, 17, 16, 1])
    layout = group_layout(counts, 39)
    assert layout.offsets.tolist() == [16, 16, 48, 64, 80] and layout.offsets.dtype == torch.int32
    assert layout.padded_rows == 128, "39 rows and up to 15 of padding for each of 5 experts, to 16"
    assert layout.destination.tolist() == [*range(5), *range(16, 33), *range(48, 64), 64]


def reference_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None):
    """What ``torch._scaled_grouped_mm`` computes (CUDA only), in float32 on the CPU, for the two cases
    hf-fp8 uses: groups of rows (2-D x 3-D) and groups along the contraction (2-D x 2-D, out (G, N, K)).
    The arguments first pass the kernel's own checks (its meta function: layouts, scale shapes); rows
    outside every group come back NaN, as the kernel leaves them unwritten."""

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
        return out.to(out_dtype)
    n, k = a.shape[0], b.shape[1]
    parts = [
        (a[:, s:e] * scale_a[g * n : (g + 1) * n, None]) @ (b[s:e] * scale_b[g * k : (g + 1) * k])
        for g, (s, e) in enumerate(zip(starts, ends, strict=True))
    ]
    return torch.stack(parts).to(out_dtype)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_grouped_branch_lays_rows_out_for_the_kernel(monkeypatch, transposed):
    """The grouped branch (padded layout, expanded scales, operand layouts) on the CPU against the
    per-expert GEMMs, with the kernel's reference standing in for the CUDA-only kernel (the GPU test
    below runs the kernel itself)."""
    import hf_fp8.grouped as grouped

    counts = torch.tensor([37, 0, 16, 5, 70])
    rows, experts, k, n = int(counts.sum()), counts.numel(), 64, 96
    torch.manual_seed(0)
    fp8 = torch.float8_e4m3fn
    x, dy = torch.randn(rows, k).to(fp8), torch.randn(rows, n).to(fp8)
    stack = torch.randn(experts, k, n) if transposed else torch.randn(experts, n, k)
    weight = stack.to(fp8).transpose(-2, -1) if transposed else stack.to(fp8)
    x_inv, w_inv, dy_inv = torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0)
    layout = group_layout(counts, rows)

    def gemms():
        return [
            expert_forward(x, weight, x_inv, w_inv, layout, torch.float32),
            expert_dgrad(dy, weight, dy_inv, w_inv, layout, torch.float32),
            expert_wgrad(dy, x, dy_inv, x_inv, layout, torch.float32),
        ]

    expected = gemms()
    monkeypatch.setattr(grouped, "grouped_kernels", lambda a, b: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", reference_scaled_grouped_mm)
    for name, got, want in zip(("forward", "dgrad", "wgrad"), gemms(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=2**-8, atol=2**-9 * want.abs().max().item(), msg=name)


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
        hf_fp8.patch_model(model, hf_fp8.Fp8Recipe(format="e4m3"), backend="native")
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
        layout = group_layout(torch.tensor(counts, device=device), rows)
        xs, ws, dys = x.to(device), weight.to(device), dy.to(device)
        inv = [t.to(device) for t in (x_inv, w_inv, dy_inv)]
        return [
            expert_forward(xs, ws, inv[0], inv[1], layout, torch.float32).cpu(),
            expert_dgrad(dys, ws, inv[2], inv[1], layout, torch.float32).cpu(),
            expert_wgrad(dys, xs, inv[2], inv[0], layout, torch.float32).cpu(),
        ]

    with GroupedMmCalls() as grouped:
        got = gemms("cuda")
    assert grouped.calls == 3
    for name, g, expected in zip(("forward", "dgrad", "wgrad"), got, gemms("cpu"), strict=True):
        atol = 2**-9 * expected.abs().max().item()
        torch.testing.assert_close(g, expected, rtol=2**-8, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
def test_gpu_hybrid_format_groups_the_forward_and_says_the_backward_runs_per_expert():
    model = build("mixtral").cuda()
    hf_fp8.patch_model(model, backend="native")  # hybrid: E5M2 gradients
    with GroupedMmCalls() as grouped, pytest.warns(UserWarning, match="run one FP8 GEMM per expert"):
        model(**{k: v.cuda() for k, v in tm.batch_for("llama", 32).items()}).loss.backward()
    assert grouped.calls == 4 * 2, "the forwards grouped; dgrad and wgrad (E5M2 gradients) per expert"


def test_expert_weights_have_their_amaxes_taken_at_the_step_end():
    """As for linear layers: the first step's forward takes the weights' amaxes (it scales by them),
    later steps' forwards leave them to the step's end; the history holds them either way."""
    model = build("mixtral")
    hf_fp8.patch_model(model, backend="native")
    experts = experts_of(model)[0]
    up_role, down_role = (Fp8Experts.ROLE_NAMES.index(f"{p}.weight") for p in ("up", "down"))
    batch = tm.batch_for("llama", 32)
    for step in range(2):
        model(**batch).loss.backward()  # the step ends with the backward
        up, down = experts.gate_up_proj.abs().max().item(), experts.down_proj.abs().max().item()
        assert experts.amax_history[up_role, 1].item() == up, step
        assert experts.amax_history[down_role, 1].item() == down, step
    model(**batch)
    assert experts.amax_history[down_role, 0] == 0, "a forward with stored scales records no weight amax"
