"""Transformer Engine backend. GPU tests need TE and an FP8 GPU; the error paths run everywhere."""

import copy

import pytest
import tiny_models as tm
import torch
from tiny_models import EXPECTED
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Recipe, patch_model, unpatch_model
from hf_fp8.backends import te as te_backend
from hf_fp8.patching.patch_state import get_state


def te_importable() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError:
        return False
    return True


# ---- everywhere -------------------------------------------------------------------------------------


@pytest.mark.skipif(te_importable(), reason="checks the message given when Transformer Engine is missing")
def test_te_backend_without_te_says_how_to_install_and_leaves_the_model_alone():
    model = tm.build("llama")
    before = [type(m) for m in model.modules()]
    with pytest.raises(ImportError, match=r"pip install 'hf-fp8\[te\]'.*backend='native'"):
        patch_model(model, backend="te")
    assert [type(m) for m in model.modules()] == before


@pytest.mark.skipif(te_backend.te_usable()[0], reason="checks the fallback of 'auto' without an FP8 GPU")
def test_auto_picks_native_without_an_fp8_gpu_and_says_so():
    report = patch_model(tm.build("llama"), backend="auto")
    assert report.backend == "native"
    usable, reason = te_backend.te_usable()
    assert not usable and reason


def test_block_scaling_on_the_cpu_is_emulated_and_the_report_says_where():
    model = tm.build("llama")
    report = patch_model(model, Fp8Recipe(scaling="block", format="e4m3"), backend="native")
    assert report.backend == "native" and len(report.converted) == 14
    assert any(
        "emulated exactly in float32" in note and "(the model is on cpu)" in note for note in report.notes
    )
    model(**tm.batch_for("llama", 32)).loss.backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0


@pytest.mark.skipif(not te_importable(), reason="needs Transformer Engine to build its recipes")
@pytest.mark.parametrize(
    ("recipe", "message"),
    [
        (Fp8Recipe(format="e5m2"), "format 'e5m2'"),
        (Fp8Recipe(interval=4), "interval=4"),
        (Fp8Recipe(scaling="current", margin=1), "margin=1"),
        (Fp8Recipe(scaling="rowwise", format="e4m3"), "scaling 'rowwise' has no Transformer Engine recipe"),
        (Fp8Recipe(fp8_all_gather=True), "fp8_all_gather is built for the native backend"),
        (Fp8Recipe(convert_lm_head="backward"), r"convert_lm_head: backward .* has no Transformer Engine"),
    ],
)
def test_recipes_te_cannot_run_are_refused(recipe, message):
    with pytest.raises(ValueError, match=message):
        te_backend.to_te_recipe(recipe)


# ---- on an FP8 GPU with Transformer Engine -----------------------------------------------------------

gpu = pytest.mark.gpu
needs_te = pytest.mark.skipif(not te_importable(), reason="needs Transformer Engine")


@gpu
@needs_te
def test_auto_takes_native_for_a_recipe_te_cannot_run_and_says_why():
    report = patch_model(tm.build("llama").cuda(), Fp8Recipe(fp8_all_gather=True), backend="auto")
    assert report.backend == "native"
    assert any(n.startswith("backend auto chose native over te: fp8_all_gather") for n in report.notes)


def train_steps(model, arch, steps=3, seed=0):
    batches = [tm.batch_for(arch, 32, seed=seed + step) for step in range(steps)]
    return tm.train(model, batches, arch, lr=1e-3, autocast=torch.bfloat16)


@gpu
@needs_te
@pytest.mark.parametrize("arch", list(EXPECTED))
def test_every_architecture_trains_under_te_like_bf16(arch):
    reference = tm.build(arch).cuda()
    model = copy.deepcopy(reference)
    report = patch_model(model, backend="te")
    # MoE experts stay in BF16 under the default recipe (and the TE backend would keep them so anyway)
    assert report.backend == "te" and len(report.converted_gemms) == EXPECTED[arch][0]
    norms = sum(EXPECTED[arch][2].values())
    assert len(report.converted) + len(report.kept) == EXPECTED[arch][0] + norms
    fp8_losses, ref_losses = train_steps(model, arch), train_steps(reference, arch)
    for fp8, ref in zip(fp8_losses, ref_losses, strict=True):
        assert abs(fp8 - ref) <= 0.02 * abs(ref), (fp8_losses, ref_losses)


@gpu
@needs_te
def test_llama_blocks_are_fused_and_agree_with_the_unfused_patch():
    base = tm.build("llama").cuda().bfloat16()
    fused, unfused = copy.deepcopy(base), copy.deepcopy(base)
    fused_report = patch_model(fused, backend="te", fuse=True)
    unfused_report = patch_model(unfused, backend="te", fuse=False)
    fused_reasons = [r.reason for r in fused_report.converted]
    assert sum("LayerNormLinear" in r for r in fused_reasons) == 2 * 4  # norm + q, k, v per layer
    assert sum("LayerNormMLP" in r for r in fused_reasons) == 2 * 4  # norm + gate, up, down per layer
    assert not any("fused" in r.reason for r in unfused_report.records)
    assert len(unfused_report.converted_gemms) == len(fused_report.converted_gemms) == 14
    assert type(fused.model.layers[0].mlp).__name__ == "TeLayerNormMLP"  # rows padded for FP8 GEMMs
    assert type(unfused.model.layers[0].mlp.up_proj).__name__ == "TeLinear"
    batch = {k: v.cuda() for k, v in tm.batch_for("llama", 32).items()}
    out_f, out_u = fused(**batch), unfused(**batch)
    out_f.loss.backward()
    out_u.loss.backward()
    assert abs(out_f.loss.item() - out_u.loss.item()) < 1e-2 * out_u.loss.item()
    rel = (out_f.logits.float() - out_u.logits.float()).norm() / out_u.logits.float().norm()
    assert rel < 0.05
    assert set(fused.state_dict()) == set(unfused.state_dict()) == set(base.state_dict())


@gpu
@needs_te
@pytest.mark.parametrize(
    ("arch", "fuse"), [("llama", True), ("llama", False), ("gpt2", False), ("qwen2", True)]
)
def test_checkpoints_round_trip_between_te_and_plain_models(tmp_path, arch, fuse):
    base = tm.build(arch).cuda().bfloat16()
    patched = copy.deepcopy(base)
    patch_model(patched, backend="te", fuse=fuse)
    state = patched.state_dict()
    assert set(state) == set(base.state_dict()), "same keys as HF, no _extra_state"
    for key, value in base.state_dict().items():
        assert torch.equal(state[key], value), key
    patched.save_pretrained(tmp_path / "te")
    plain, info = AutoModelForCausalLM.from_pretrained(tmp_path / "te", output_loading_info=True)
    assert all(not v for v in info.values()), info
    for key, value in base.state_dict().items():
        assert torch.equal(plain.state_dict()[key].to(value.device), value), key
    # A plain checkpoint loads strictly into a patched model and changes its outputs accordingly.
    other = tm.build(arch, seed=5).cuda().bfloat16()
    result = patched.load_state_dict(other.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for key, value in other.state_dict().items():
        assert torch.equal(patched.state_dict()[key], value), key


@gpu
@needs_te
def test_fusion_keeps_what_trains_and_what_is_frozen():
    model = tm.build("qwen2").cuda().bfloat16()  # q/k/v with biases
    for name, p in model.named_parameters():
        p.requires_grad_("layers.0.mlp" in name or "layers.1" in name)
    model.model.layers[1].self_attn.k_proj.weight.requires_grad_(False)  # q/k/v now disagree: not fused
    report = patch_model(model, backend="te")
    fused = {r.name.split(".")[2] for r in report.converted if "fused" in r.reason}
    assert fused == {"0"}, "layer 1 has q/k/v that disagree about training and stays unfused"
    layer = model.model.layers[0]
    qkv = layer.self_attn.qkv_fused.fused
    assert not qkv.weight.requires_grad and not qkv.bias.requires_grad
    assert layer.mlp.fc1_weight.requires_grad and layer.mlp.fc2_weight.requires_grad


@gpu
@needs_te
def test_gradient_checkpointing_is_refused_with_te():
    model = tm.build("llama").cuda()
    model.gradient_checkpointing_enable()
    patch_model(model, backend="te")
    with pytest.raises(RuntimeError, match=r"gradient checkpointing.*backend='native'"):
        model(**{k: v.cuda() for k, v in tm.batch_for("llama", 32).items()})
    assert not get_state(model).calls, "the failed forward left no state behind"


@gpu
@needs_te
@pytest.mark.parametrize("fuse", [True, False])
def test_unpatch_gives_back_the_plain_model(fuse):
    base = tm.build("llama").cuda().bfloat16()
    model = copy.deepcopy(base)
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    patch_model(model, backend="te", fuse=fuse)
    unpatch_model(model)
    assert model.model.layers[0].self_attn.o_proj.weight is o_proj, "shared parameters come back as they are"
    assert [type(m) for m in model.modules()] == [type(m) for m in base.modules()]
    for (key, value), (key_b, value_b) in zip(
        model.state_dict().items(), base.state_dict().items(), strict=True
    ):
        assert key == key_b and torch.equal(value, value_b), key
    batch = {k: v.cuda() for k, v in tm.batch_for("llama", 32).items()}
    model.eval(), base.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, base(**batch).logits)


def storage_bytes(param: torch.Tensor) -> int:
    """Bytes a parameter holds on the device: all internal tensors of a TE FP8 tensor, or its own."""
    inner = [t for t in vars(param).values() if torch.is_tensor(t)] if hasattr(param, "_quantizer") else []
    return sum(t.numel() * t.element_size() for t in inner) or param.numel() * param.element_size()


@gpu
@needs_te
def test_fp8_weights_store_frozen_weights_in_one_byte():
    """Bytes held by the weights of the converted layers, BF16 vs FP8 storage."""
    config = dict(tm.CONFIGS["llama"][1], hidden_size=1024, intermediate_size=4096, num_attention_heads=8)

    def build():
        torch.manual_seed(0)
        from transformers import AutoConfig

        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **config))
        return model.to("cuda", torch.bfloat16)

    reference, model = build(), build()
    bf16_bytes = sum(storage_bytes(p) for n, p in model.named_parameters() if "layers." in n and p.dim() == 2)
    for p in model.parameters():
        p.requires_grad_(False)
    patch_model(model, Fp8Recipe(fp8_weights=True), backend="te")

    def fp8_bytes():
        return sum(storage_bytes(p) for n, p in model.named_parameters() if "layers." in n and p.dim() == 2)

    ratio = fp8_bytes() / bf16_bytes
    print(f"FP8 weight storage: {ratio:.3f} of the BF16 bytes ({bf16_bytes / 2**20:.1f} MiB in BF16)")
    assert ratio <= 0.55, ratio
    batch = {k: v.cuda() for k, v in tm.batch_for("llama", 32).items()}
    with torch.no_grad():
        loss, ref_loss = model(**batch).loss, reference(**batch).loss
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * ref_loss.item()
    # Gradients flow through the frozen FP8 layers (to trainable embeddings, as LoRA's flow to its
    # adapters). TE then keeps a transposed FP8 copy of each weight for the dgrad GEMM as well.
    model.model.embed_tokens.weight.requires_grad_(True)
    model(**batch).loss.backward()
    assert torch.isfinite(model.model.embed_tokens.weight.grad).all()
    assert all(p.grad is None for n, p in model.named_parameters() if "layers." in n)
