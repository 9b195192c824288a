"""``Fp8StoredWeight``: a frozen weight kept in FP8 that still looks like the weight it was, through
moves and dtype casts, ties and code that reads its dtype; what would change it is refused."""

import copy
import math

import pytest
import tiny_models as tm
import torch
from conftest import stored_in_fp8
from lora_setup import LORA_FP8, fp8_lora, lora, lora_for
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_fp8 import RECIPES, Fp8Conv1D, Fp8Linear, cast_to_representable, patch_model


def test_fp8_weights_survive_dtype_and_device_moves():
    """``model.to(dtype)`` (the Trainer's bf16_full_eval does it) must not touch the FP8 values: the
    weight keeps them and its float32 scale, and reports and dequantizes to the new dtype."""
    peft_model = fp8_lora("llama", "patch_first")
    probe = tm.batch_for("llama", 16)
    peft_model.eval()
    with torch.no_grad():
        before = peft_model(**probe).logits
        layer = peft_model.base_model.model.model.layers[0].mlp.up_proj.base_layer
        values = layer.weight._data.clone()
        assert layer.weight.dtype == torch.float32, "it reports the dtype it was stored from"
        peft_model.to(torch.bfloat16)
        after = peft_model(**probe).logits
    assert stored_in_fp8(layer.weight) and torch.equal(layer.weight._data, values)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight.dtype == torch.bfloat16
    assert (after.float() - before).norm() / before.norm() < 2.0**-5, "bf16 rounding, nothing more"


def test_adapters_on_a_stored_fp8_base_are_not_rounded_to_fp8():
    """PEFT gives new adapters the base layer's dtype, which a stored weight reports as its original
    one, so the adapters start exactly as on a plain BF16 base."""
    plain = lora(tm.build("llama", dtype=torch.bfloat16), "llama")
    model = tm.build("llama", dtype=torch.bfloat16).requires_grad_(False)
    patch_model(model, LORA_FP8)  # frozen already: stored in FP8 now
    peft_model = lora(model, "llama")

    def lora_a(m):
        return m.base_model.model.model.layers[0].mlp.up_proj.lora_A["default"].weight

    assert stored_in_fp8(model.model.layers[0].mlp.up_proj.base_layer.weight)
    assert torch.equal(lora_a(peft_model), lora_a(plain))


def test_a_stored_fp8_weight_refuses_to_train():
    model = tm.build("llama").requires_grad_(False)
    patch_model(model, LORA_FP8)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    with pytest.raises(
        RuntimeError, match=r"stored in FP8 \(fp8_weights\) and cannot train.*dequantize_weight_"
    ):
        model(**tm.batch_for("llama", 16))


def test_quantizing_keeps_the_parameter_object():
    """DDP, optimizers and tied references hold the Parameter: it must stay the same object."""
    model = tm.build("llama")
    layer = model.model.layers[0].mlp.up_proj
    weight = layer.weight
    patch_model(model, LORA_FP8)
    model.requires_grad_(False)
    model(**tm.batch_for("llama", 16))
    assert model.model.layers[0].mlp.up_proj.weight is weight and stored_in_fp8(weight)


def test_a_weight_tied_to_the_embeddings_keeps_its_dtype():
    model = tm.build("gemma").requires_grad_(False)  # lm_head tied to embed_tokens
    report = patch_model(model, LORA_FP8.replace(convert_lm_head=True))
    assert isinstance(model.lm_head, Fp8Linear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.float32
    assert stored_in_fp8(model.model.layers[0].mlp.up_proj.weight)
    assert any("1 weight(s) tied" in note for note in report.notes)
    model(**tm.batch_for("gemma", 16))
    assert model.lm_head.weight.dtype == torch.float32, "not at the first forward either"


def test_models_that_read_the_weight_dtype_run_on_stored_weights():
    """T5's feed-forward casts its input to ``wo.weight.dtype``, and ``model.dtype`` reads parameter
    dtypes: a stored weight reports its original dtype, so both keep working."""
    model = tm.build("t5")
    patch_model(model, LORA_FP8)
    peft_model = lora_for(model, ["q", "v", "wi", "wo"])
    wo = model.encoder.block[0].layer[1].DenseReluDense.wo.base_layer
    batch = tm.batch_for("t5", 16)
    peft_model(**batch).loss.backward()  # the base weights are stored in FP8 at this first forward
    assert stored_in_fp8(wo.weight) and wo.weight.dtype == torch.float32 and model.dtype == torch.float32
    peft_model.eval()
    with torch.no_grad():
        assert torch.isfinite(peft_model(**batch).loss)


def test_in_place_changes_of_a_stored_weight_are_refused():
    """PEFT's own merge adds to ``weight.data`` in place; on FP8 values that would silently change a
    temporary copy, so it is an error that points to the way that works."""
    peft_model = fp8_lora("llama", "patch_first")
    peft_model(**tm.batch_for("llama", 16))
    with pytest.raises(
        RuntimeError, match=r"stored in FP8 .* read-only; call the layer's dequantize_weight_"
    ):
        peft_model.merge_and_unload()


def blocks_rounded(t: torch.Tensor) -> torch.Tensor:
    """Each 128x128 block of ``t`` rounded to E4M3 with its own scale."""
    out = torch.empty_like(t)
    for i in range(0, t.shape[0], 128):
        for j in range(0, t.shape[1], 128):
            out[i : i + 128, j : j + 128] = cast_to_representable(t[i : i + 128, j : j + 128])
    return out


def block_layers(cls=nn.Linear):
    """The same layer (384 in, 208 out) twice under block scaling: its weight trainable, and frozen and
    stored in FP8."""
    torch.manual_seed(0)
    plain = nn.Linear(384, 208) if cls is nn.Linear else Conv1D(208, 384)
    trained = (Fp8Linear if cls is nn.Linear else Fp8Conv1D).from_float(plain, RECIPES["block"]).train()
    frozen = copy.deepcopy(plain).requires_grad_(False)
    stored = type(trained).from_float(frozen, RECIPES["lora-fp8-block"]).train()
    stored.quantize_weight_()
    return trained, stored


@pytest.mark.parametrize("cls", [nn.Linear, Conv1D], ids=["linear", "conv1d"])
def test_lora_fp8_block_stores_a_scale_per_128x128_block_and_computes_as_block_scaling(cls):
    """A stored weight's blocks are the blocks block scaling casts the weight to at each forward (for
    GPT-2's Conv1D too, whose weight is stored transposed): the same outputs and input gradients."""
    trained, stored = block_layers(cls)
    weight = stored.weight
    assert stored_in_fp8(weight) and weight.in_blocks and weight._data.dtype == torch.float8_e4m3fn
    assert weight._scale.shape == (math.ceil(weight.shape[0] / 128), math.ceil(weight.shape[1] / 128))
    assert torch.equal(weight.dequantize(), blocks_rounded(trained.weight.detach()))
    assert torch.equal(stored.state_dict()["weight"], weight.dequantize()), "checkpoints keep HF's dtype"
    torch.manual_seed(1)
    x = torch.randn(2, 24, 384, requires_grad=True)
    x_stored = x.detach().clone().requires_grad_()
    y, y_stored = trained(x), stored(x_stored)
    assert torch.equal(y, y_stored)
    y.sum().backward()
    y_stored.sum().backward()
    assert torch.equal(x.grad, x_stored.grad) and stored.weight.grad is None


def test_a_block_stored_weight_keeps_its_blocks_through_copies_and_refuses_reshaping():
    _, stored = block_layers()
    weight = stored.weight
    new_values = torch.randn(weight.shape)
    with torch.no_grad():
        weight.copy_(new_values)
    assert weight.in_blocks and torch.equal(weight.dequantize(), blocks_rounded(new_values))
    assert torch.equal(weight.t().dequantize(), weight.dequantize().t())
    with pytest.raises(RuntimeError, match="128x128 block scales cannot be viewed as"):
        weight.view(-1)
