"""Layers that read one input cast it with one scale (q/k/v, gate/up), exactly as each would with its own,
and a compiled block then casts that input once."""

from __future__ import annotations

import copy

import pytest
import tiny_models as tm
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from lora_setup import fp8_lora
from torch import nn
from torch._dynamo.backends.common import aot_autograd

import hf_fp8
from hf_fp8 import Fp8Module, Fp8Recipe

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)


def sources(model: nn.Module) -> dict[str, str | None]:
    """Each FP8 linear layer's name and the name of the layer whose input scale it casts with."""
    names = {module: name for name, module in model.named_modules()}
    return {
        name: names.get(module.input_scale_source)
        for name, module in model.named_modules()
        if isinstance(module, Fp8Module)
    }


def train(model: nn.Module, arch: str, steps: int, own_scales: bool = False) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        loss = tm.loss_of(arch, model(**tm.batch_for(arch, 32, seed=step)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if own_scales:
            for module in model.modules():
                if isinstance(module, Fp8Module):
                    module.share_input_scale(None)
    return losses


def test_siblings_that_read_one_input_cast_with_the_first_ones_scale_from_the_second_step():
    model = tm.build("llama")
    hf_fp8.patch_model(model)
    assert not any(sources(model).values())
    train(model, "llama", steps=1)
    shared = {name: source for name, source in sources(model).items() if source}
    block = "model.layers.0"
    assert {n: s for n, s in shared.items() if n.startswith(block + ".")} == {
        f"{block}.self_attn.k_proj": f"{block}.self_attn.q_proj",
        f"{block}.self_attn.v_proj": f"{block}.self_attn.q_proj",
        f"{block}.mlp.up_proj": f"{block}.mlp.gate_proj",
    }
    assert len(shared) == 3 * model.config.num_hidden_layers


def test_cross_attention_shares_only_what_reads_one_input():
    """T5's cross-attention: k and v read the encoder's output, q the decoder's states, o the attention's
    output: siblings all four, yet only k and v share."""
    model = tm.build("t5")
    hf_fp8.patch_model(model)
    train(model, "t5", steps=1)
    attention = "decoder.block.0.layer.1.EncDecAttention"
    assert {n: s for n, s in sources(model).items() if n.startswith(attention)} == {
        f"{attention}.q": None,
        f"{attention}.k": None,
        f"{attention}.v": f"{attention}.k",
        f"{attention}.o": None,
    }


@pytest.mark.parametrize("recipe", ["head-backward", "backward-fp8"])
def test_shared_scales_train_bit_for_bit_as_own_scales(recipe):
    model = tm.build("llama")
    hf_fp8.patch_model(model, recipe)
    own = copy.deepcopy(model)
    assert train(model, "llama", steps=4) == train(own, "llama", steps=4, own_scales=True)
    assert any(sources(model).values()), "the groups formed"
    for name, module in model.named_modules():
        if isinstance(module, Fp8Module):
            other = own.get_submodule(name)
            assert torch.equal(module.amax_history, other.amax_history)
            assert torch.equal(module.scale, other.scale)


class TwoReaders(nn.Module):
    """Two linear layers under one parent that read one tensor, until told to read different ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(32, 16), nn.Linear(32, 16)
        self.apart = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) + self.b(4 * x if self.apart else x)


def two_readers() -> tuple[TwoReaders, Fp8Recipe]:
    model = TwoReaders()
    recipe = Fp8Recipe(amax_history_len=2, amax_compute_algo="most_recent")
    hf_fp8.patch_model(model, recipe)
    return model, recipe


def steps(model: TwoReaders, x: torch.Tensor, count: int) -> None:
    for _ in range(count):
        model(x).sum().backward()


def test_siblings_whose_inputs_part_in_the_next_steps_are_no_group():
    """Equal amaxes in the first step may be a coincidence: the next steps check, and a group whose
    members see different inputs there is undone."""
    model, _ = two_readers()
    x = torch.randn(64, 32)
    steps(model, x, 1)
    assert model.b.input_scale_source is model.a
    model.apart = True
    steps(model, x, 1)
    assert model.b.input_scale_source is None


def test_a_group_whose_inputs_part_later_casts_with_the_largest_amax():
    """Past its checks a group keeps one scale: if its inputs ever differ, the one the largest amax
    gives (safe for both), and each member's own state says so."""
    model, recipe = two_readers()
    x = torch.randn(64, 32)
    steps(model, x, 3)
    model.apart = True
    steps(model, x, 1)
    assert model.b.input_scale_source is model.a
    largest = 4 * x.abs().amax()  # the step just ended: slot 1 of the input's history
    assert model.a.amax_history[0, 1] == model.b.amax_history[0, 1] == largest
    assert model.a.scale[0] == model.b.scale[0] == recipe.forward_format.max / largest


def test_a_first_step_with_a_non_finite_input_leaves_the_choice_to_the_next():
    model, _ = two_readers()
    x = torch.randn(64, 32)
    with pytest.warns(UserWarning, match="non-finite amax"):
        steps(model, torch.full_like(x, float("inf")), 1)
        steps(model, x, 1)  # the warning comes at the next step's end
    assert model.b.input_scale_source is model.a


def test_lora_wrapped_siblings_share_their_base_layers_scale():
    model = fp8_lora("llama", "patch_first")
    train(model, "llama", steps=1)
    shared = {n: s for n, s in sources(model).items() if s and ".layers.0." in n}
    assert shared and all(n.endswith("base_layer") and s.endswith("base_layer") for n, s in shared.items())
    assert {n.split(".")[-2] for n in shared} == {"k_proj", "v_proj", "up_proj"}


def fp8_casts_per_forward_graph(model: nn.Module, steps: int, backward: list[int] | None = None) -> list[int]:
    """The casts to FP8 in each compiled forward graph, in the order the graphs were compiled (and those
    of each backward graph appended to ``backward``, when given)."""
    counts: list[int] = []

    def counter(into: list[int]):
        def count(graph: torch.fx.GraphModule, inputs):
            casts = [
                node
                for node in graph.graph.nodes
                if node.target in CASTS and getattr(node.meta.get("val"), "dtype", None) in FP8_DTYPES
            ]
            into.append(len(casts))
            return make_boxed_func(graph.forward)

        return count

    backend = aot_autograd(
        fw_compiler=counter(counts),
        bw_compiler=counter(backward if backward is not None else []),
        partition_fn=min_cut_rematerialization_partition,
        keep_inference_input_mutations=True,
    )
    torch._dynamo.reset()
    hf_fp8.compile(model, backend=backend)
    train(model, "llama", steps)
    return counts


def test_a_compiled_block_casts_each_shared_input_once():
    """Llama's block: 7 weights and 4 distinct inputs (q/k/v's, o's, gate/up's, down's). The first step
    scales by each tensor's own amax, and Dynamo merges the casts of one tensor; delayed scaling's later
    steps cast with stored scales, which are one buffer per group, so they merge too. (The graph of the
    head and the loss, in high precision here, has none, and is compiled once.)"""
    model = tm.build("llama")
    hf_fp8.patch_model(model)
    assert fp8_casts_per_forward_graph(model, steps=3) == [7 + 4, 0, 7 + 4]


def test_with_forwards_in_high_precision_a_compiled_block_casts_each_input_once_for_the_weight_gradients():
    """Forwards in high precision (``forward_in_fp8: false``, ``backward-fp8``'s blocks) cast each layer's
    input for its weight gradient (the partitioner may move the cast into the backward), each weight and
    each gradient: 4 + 7 + 7 casts a block, in the first step's graph and in the steady state's, where
    q/k/v's and gate/up's inputs cast with one scale (21 casts before they did)."""
    model = tm.build("llama")
    hf_fp8.patch_model(model, Fp8Recipe(forward_in_fp8=False))  # the head in high precision: no casts
    backward: list[int] = []
    forward = fp8_casts_per_forward_graph(model, steps=3, backward=backward)
    # compiled in this order: forwards of the first step's block, the head's, the steady block's;
    # backwards of the head's (no FP8), the first step's block, the steady block's
    assert len(forward) == len(backward) == 3 and forward[1] == backward[0] == 0
    assert [forward[0] + backward[1], forward[2] + backward[2]] == [4 + 7 + 7, 4 + 7 + 7]


def test_with_forwards_in_high_precision_a_frozen_weights_layer_joins_no_group():
    """Under ``backward-fp8`` a layer whose weight is frozen casts no input (its weight takes no
    gradient): q and gate frozen, k/v still share; unfrozen later, q casts with its own scale."""
    model = tm.build("llama")
    hf_fp8.patch_model(model, "backward-fp8")
    frozen = [m for n, m in model.named_modules() if n.endswith(("q_proj", "gate_proj"))]
    for module in frozen:
        module.weight.requires_grad_(False)
    train(model, "llama", steps=2)
    block = "model.layers.0"
    shared = {n: s for n, s in sources(model).items() if s and n.startswith(block + ".")}
    assert shared == {f"{block}.self_attn.v_proj": f"{block}.self_attn.k_proj"}
    for module in frozen:
        module.weight.requires_grad_(True)
    q_proj = model.get_submodule(f"{block}.self_attn.q_proj")
    train(model, "llama", steps=2)
    assert q_proj.input_scale_source is None and q_proj.amax_history[0, 1] > 0
