"""Fine-grained FP8 checkpoints (DeepSeek-V3's and Qwen3-FP8's format) written by ``save_fp8_pretrained``
and read by ``load_fp8_pretrained`` and by transformers: the FP8 values and block scales as stored, bit
for bit both ways, the logits they give, LoRA and full fine-tuning on them, and what is refused."""

import json
import shutil

import demo_data
import pytest
import tiny_models as tm
import torch
from lora_setup import lora_for
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config

from hf_fp8 import load_fp8_pretrained, patch_model, save_fp8_pretrained
from hf_fp8.formats import E4M3
from hf_fp8.integrations.peft import merge_and_unload
from hf_fp8.layers.linear import Fp8Module
from hf_fp8.layers.stored_weight import Fp8StoredWeight
from hf_fp8.numerics.blockwise import cast_blocks
from hf_fp8.patching.patch_state import get_state

# 128 wide with 2 of 4 heads for keys and values: o_proj and the MLP are whole 128x128 blocks, k_proj and
# v_proj (64 outputs) are not, and q_proj stays with them (vLLM fuses the three).
QUANTIZED = ["self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
KEPT = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
ALL = [*KEPT, *QUANTIZED]


def wide_llama(seed=0, dtype=torch.bfloat16, **changes):
    kwargs = dict(tm.CONFIGS["llama"][1], hidden_size=128, intermediate_size=256, num_key_value_heads=2)
    config = AutoConfig.for_model("llama", **{**kwargs, **changes})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def tensors(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a saved folder, from all its shards."""
    return {k: v for path in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(path)).items()}


def quantization_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def layer_names(kinds, layers=2):
    return [f"model.layers.{i}.{kind}" for i in range(layers) for kind in kinds]


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


IDS = torch.randint(4, tm.VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def source():
    return wide_llama()


@pytest.fixture(scope="module")
def saved(source, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fp8")
    assert save_fp8_pretrained(source, folder) == layer_names(QUANTIZED)
    return folder


def test_saved_weights_are_e4m3_blocks_with_inverse_scales_and_the_rest_keeps_its_dtype(source, saved):
    written = tensors(saved)
    for name in layer_names(QUANTIZED):
        weight = source.get_submodule(name).weight
        values, scales = cast_blocks(weight, E4M3, margin=0)
        assert same_bits(written[f"{name}.weight"], values)
        assert same_bits(written[f"{name}.weight_scale_inv"], scales.reciprocal())
        rows, cols = weight.shape
        assert written[f"{name}.weight_scale_inv"].shape == (rows // 128, cols // 128)
    plain = {k: v for k, v in written.items() if k.rpartition(".")[0] not in layer_names(QUANTIZED)}
    assert plain.keys() == source.state_dict().keys() - {f"{n}.weight" for n in layer_names(QUANTIZED)}
    assert all(torch.equal(t, source.state_dict()[k]) and t.dtype == torch.bfloat16 for k, t in plain.items())
    assert quantization_config(saved) == {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": sorted(["lm_head", *layer_names(KEPT)]),
    }


def test_load_stores_the_saved_fp8_values_frozen_and_gives_the_logits_of_the_rounded_weights(source, saved):
    model = load_fp8_pretrained(saved, device="cpu")
    written = tensors(saved)
    rounded = wide_llama()
    for name in layer_names(QUANTIZED):
        layer = model.get_submodule(name)
        assert isinstance(layer, Fp8Module) and layer.weight_in_fp8 and layer.weight.in_blocks
        assert not layer.weight.requires_grad and layer.weight.dtype == torch.bfloat16
        assert same_bits(layer.weight._data, written[f"{name}.weight"])
        assert same_bits(layer.weight._scale, written[f"{name}.weight_scale_inv"].reciprocal())
        rounded.get_submodule(name).weight.data = layer.weight.dequantize()
    for name in layer_names(KEPT):  # trainable until frozen, then stored in blocks by the recipe
        assert model.get_submodule(name).weight.requires_grad
    assert torch.equal(logits(model, IDS), logits(rounded, IDS))
    torch.testing.assert_close(logits(model, IDS), logits(source, IDS), rtol=0.05, atol=0.05)
    assert "8 linear weight(s) stored in FP8 as saved" in get_state(model).report.notes[-1]


def test_a_loaded_model_saves_its_fp8_tensors_back_bit_for_bit_in_shards_or_not(saved, tmp_path):
    save_fp8_pretrained(load_fp8_pretrained(saved, device="cpu"), tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # read back through the index
    save_fp8_pretrained(load_fp8_pretrained(tmp_path, device="cpu"), tmp_path / "again")
    before, after = tensors(saved), tensors(tmp_path / "again")
    assert before.keys() == after.keys() == tensors(tmp_path).keys()
    assert all(same_bits(before[k], after[k]) for k in before)
    assert quantization_config(tmp_path / "again") == quantization_config(saved)


def test_a_patched_model_writes_its_stored_fp8_weights_as_they_are(tmp_path):
    for recipe, in_blocks in (("lora-fp8-block", True), ("lora-fp8", False)):
        model = wide_llama().requires_grad_(False)
        patch_model(model, recipe)  # the frozen weights are stored in FP8 at once
        folder = tmp_path / recipe
        save_fp8_pretrained(model, folder)
        written = tensors(folder)
        for name in layer_names(QUANTIZED):
            weight = model.get_submodule(name).weight
            assert isinstance(weight, Fp8StoredWeight) and weight.in_blocks == in_blocks
            assert same_bits(written[f"{name}.weight"], weight._data)
            inverse = weight._scale.reciprocal().expand(written[f"{name}.weight_scale_inv"].shape)
            assert torch.equal(written[f"{name}.weight_scale_inv"], inverse)  # one scale: every block's
        for name in layer_names(
            KEPT
        ):  # stored in FP8 here too; k and v are no whole blocks, q goes with them
            assert written[f"{name}.weight"].dtype == torch.bfloat16


def test_full_fine_tuning_gets_trainable_weights_dequantized_from_the_checkpoint(saved):
    model = load_fp8_pretrained(saved, "block", device="cpu")
    written = tensors(saved)
    for name in layer_names(QUANTIZED):
        weight = model.get_submodule(name).weight
        assert type(weight) is torch.nn.Parameter and weight.requires_grad and weight.dtype == torch.bfloat16
        inverse = written[f"{name}.weight_scale_inv"]
        stored = Fp8StoredWeight(written[f"{name}.weight"], inverse.reciprocal(), torch.bfloat16)
        assert torch.equal(weight, stored.dequantize())
    assert "dequantized into trainable weights" in get_state(model).report.notes[-1]


def test_a_tensorwise_recipe_stores_each_weight_again_with_one_scale(saved):
    blocks = load_fp8_pretrained(saved, device="cpu")
    model = load_fp8_pretrained(saved, "lora-fp8", device="cpu")
    for name in layer_names(QUANTIZED):
        layer = model.get_submodule(name)
        assert layer.weight_in_fp8 and not layer.weight.in_blocks
        assert torch.equal(layer.scale[1], layer.weight._scale)  # the weight's, as quantize_weight_ sets
        exact = blocks.get_submodule(name).weight.dequantize().float()
        # one rounding to E4M3 more (a unit roundoff of 2**-4, or half the subnormal step) and two to BF16
        error = (layer.weight.dequantize().float() - exact).abs()
        assert (error <= exact.abs() * (2**-4 + 2**-8) + 2**-10 / layer.weight._scale).all()
    torch.testing.assert_close(logits(model, IDS), logits(blocks, IDS), rtol=0.05, atol=0.05)


def test_lora_trains_over_the_loaded_fp8_weights_and_merges_back_into_fp8(saved, tmp_path):
    model = load_fp8_pretrained(saved, dtype=torch.float32, device="cpu")
    stored = {n: model.get_submodule(n).weight._data.clone() for n in layer_names(QUANTIZED)}
    peft_model = lora_for(model, [name.rpartition(".")[2] for name in ALL])
    with pytest.raises(ValueError, match="merge_and_unload"):
        save_fp8_pretrained(peft_model, tmp_path)
    losses = tm.train(peft_model, demo_data.text_batches(6, 2, 32), lr=2e-2)
    assert losses[-1] < 0.97 * losses[0], losses
    for name, data in stored.items():  # frozen and never cast again
        weight = peft_model.base_model.model.get_submodule(name).weight
        assert same_bits(weight._data, data) and weight.grad is None
    merged = merge_and_unload(peft_model, fp8=True)
    save_fp8_pretrained(merged, tmp_path)
    assert tensors(tmp_path)[f"{layer_names(QUANTIZED)[0]}.weight"].dtype == torch.float8_e4m3fn


def test_transformers_loads_the_saved_folder_with_its_fp8_support(source, saved):
    dequantize = FineGrainedFP8Config(dequantize=True)  # on the CPU transformers dequantizes on load
    theirs = AutoModelForCausalLM.from_pretrained(saved, quantization_config=dequantize, dtype=torch.bfloat16)
    ours = load_fp8_pretrained(saved, device="cpu")
    for name in layer_names(QUANTIZED):
        ours_weight = ours.get_submodule(name).weight.dequantize()
        # fp8 * weight_scale_inv there, fp8 / scale here: at most a unit of BF16 apart
        torch.testing.assert_close(theirs.get_submodule(name).weight, ours_weight, rtol=2**-8, atol=0)
    torch.testing.assert_close(logits(theirs, IDS), logits(ours, IDS), rtol=0.01, atol=0.01)
    torch.testing.assert_close(logits(theirs, IDS), logits(source, IDS), rtol=0.05, atol=0.05)


def test_a_tied_output_head_stays_tied_and_in_its_dtype(tmp_path):
    source = wide_llama(tie_word_embeddings=True, num_key_value_heads=4)
    assert save_fp8_pretrained(source, tmp_path) == layer_names(ALL)  # q, k and v: 128 outputs each
    assert "lm_head.weight" not in tensors(tmp_path)
    assert quantization_config(tmp_path)["modules_to_not_convert"] == ["lm_head"]
    model = load_fp8_pretrained(tmp_path, device="cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16


def broken_copy(saved, tmp_path, config=None, drop=None):
    folder = tmp_path / "broken"
    shutil.copytree(saved, folder)
    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        data["quantization_config"] = config
        (folder / "config.json").write_text(json.dumps(data))
    if drop is not None:
        kept = {k: v for k, v in tensors(folder).items() if k != drop}
        save_file(kept, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_what_is_not_a_fine_grained_fp8_checkpoint_is_refused_with_the_problem_and_the_fix(
    source, saved, tmp_path
):
    plain = tmp_path / "plain"
    source.save_pretrained(plain)
    with pytest.raises(ValueError, match=r"not a fine-grained FP8 checkpoint.*from_pretrained_fp8"):
        load_fp8_pretrained(plain, device="cpu")
    blocks_64 = dict(quantization_config(saved), weight_block_size=[64, 64])
    with pytest.raises(ValueError, match=r"blocks of \[64, 64\].*dequantize=True"):
        load_fp8_pretrained(broken_copy(saved, tmp_path, config=blocks_64), device="cpu")
    missing = "model.layers.1.mlp.up_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=r"up_proj\.weight is in FP8 but has no .*weight_scale_inv"):
        load_fp8_pretrained(broken_copy(saved, tmp_path / "2", drop=missing), device="cpu")
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_fp8_pretrained(tmp_path / "nowhere", device="cpu")
    with pytest.raises(ValueError, match=r"no nn\.Linear layer whose dimensions are both multiples of 128"):
        save_fp8_pretrained(tm.build("llama"), tmp_path / "narrow")


@pytest.fixture
def gpu_saved(tmp_path):
    """A 512-wide model whose linear weights outweigh the rest, saved: the model and the folder."""
    source = wide_llama(hidden_size=512, intermediate_size=1024, num_key_value_heads=4)
    save_fp8_pretrained(source, tmp_path / "saved")
    return source, tmp_path / "saved"


@pytest.mark.gpu
def test_loading_onto_a_gpu_holds_no_bf16_copy_of_the_linear_weights_and_saves_back(gpu_saved, tmp_path):
    source, folder = gpu_saved
    checkpoint = sum(t.numel() * t.element_size() for t in tensors(folder).values())
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load_fp8_pretrained(folder, device="cuda")
    peak = torch.cuda.max_memory_allocated() - before
    # the checkpoint's bytes (FP8 linear weights, the rest in BF16) and little more; a BF16 copy of the
    # linear weights would add twice their FP8 bytes
    linear_in_bf16 = sum(2 * source.get_submodule(n).weight.numel() for n in layer_names(ALL))
    assert peak < 1.2 * checkpoint < checkpoint + linear_in_bf16, (peak, checkpoint)
    assert all(model.get_submodule(n).weight._data.is_cuda for n in layer_names(ALL))
    save_fp8_pretrained(model, tmp_path / "again")
    before, after = tensors(folder), tensors(tmp_path / "again")
    assert before.keys() == after.keys() and all(same_bits(before[k], after[k]) for k in before)


@pytest.mark.gpu
def test_transformers_runs_the_saved_model_on_a_gpu_with_its_fp8_kernels_and_agrees(gpu_saved):
    source, folder = gpu_saved
    ours = load_fp8_pretrained(folder, device="cuda").train()  # FP8 forward: 1x128 activation tiles
    theirs = AutoModelForCausalLM.from_pretrained(folder, device_map="cuda", dtype=torch.bfloat16)
    for name in layer_names(ALL):  # transformers' FP8 layers hold the very values and scales
        mine, its = ours.get_submodule(name).weight, theirs.get_submodule(name)
        assert same_bits(its.weight, mine._data) and same_bits(its.weight_scale_inv, mine._scale.reciprocal())
    ids = IDS.cuda()
    exact = logits(source.cuda(), ids)
    ours_logits = logits(ours, ids)
    try:
        their_logits = logits(theirs, ids)
    except ImportError as err:  # transformers >= 5.1x takes its FP8 GEMMs from the kernels hub
        pytest.skip(f"transformers' FP8 kernels are not available here: {err}")
    # the same FP8 values for weights and activations: the two agree better than either with BF16
    assert (their_logits - ours_logits).abs().max() <= (ours_logits - exact).abs().max()


def test_one_loader_for_every_checkpoint_and_recipe_returns_the_model_and_its_report(source, saved, tmp_path):
    """hf_fp8.from_pretrained: an FP8 checkpoint keeps its block-scaled values (lora-fp8-block, the
    default), a plain one is quantized on load (into blocks by default, one scale a tensor under
    lora-fp8), and a recipe without fp8_weights gives trainable weights; each returns (model, report) and
    takes transformers' ``dtype``."""
    import hf_fp8

    model, report = hf_fp8.from_pretrained(saved, device="cpu")
    layer = model.get_submodule(layer_names(QUANTIZED)[0])
    assert layer.weight_in_fp8 and layer.weight.in_blocks and report is get_state(model).report
    assert same_bits(layer.weight._data, tensors(saved)[f"{layer_names(QUANTIZED)[0]}.weight"])
    plain = tmp_path / "plain"
    source.save_pretrained(plain)
    frozen, frozen_report = hf_fp8.from_pretrained(plain, device="cpu", dtype=torch.float32)
    layer = frozen.get_submodule(layer_names(QUANTIZED)[0])
    assert layer.weight_in_fp8 and layer.weight.in_blocks and not layer.weight.requires_grad
    assert frozen_report.recipe.fp8_weights and frozen.model.embed_tokens.weight.dtype == torch.float32
    tensorwise, _ = hf_fp8.from_pretrained(plain, "lora-fp8", device="cpu")
    layer = tensorwise.get_submodule(layer_names(QUANTIZED)[0])
    assert layer.weight_in_fp8 and not layer.weight.in_blocks
    trainable, trained_report = hf_fp8.from_pretrained(plain, "hybrid-delayed", device="cpu")
    layer = trainable.get_submodule(layer_names(QUANTIZED)[0])
    assert isinstance(layer, Fp8Module) and not layer.weight_in_fp8 and layer.weight.requires_grad
    assert layer.weight.dtype == torch.bfloat16 and len(trained_report.converted) == 14
    with pytest.warns(FutureWarning, match="torch_dtype is now dtype"):
        old = load_fp8_pretrained(saved, device="cpu", torch_dtype=torch.float32)
    assert old.model.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(FileNotFoundError, match="local checkpoint folder"):
        hf_fp8.from_pretrained(tmp_path / "missing")
