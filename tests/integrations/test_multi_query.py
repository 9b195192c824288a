"""Multi-query attention (one key/value head for all query heads) asks for grouped-query attention under
hf_fp8.compile: the same values, on PyTorch's fused kernels instead of float32 math."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconConfig

import hf_fp8
from hf_fp8.integrations.multi_query import MultiQueryAsGroupedQuery, with_graph_passes


def falcon(multi_query: bool = True, device: str = "cpu") -> torch.nn.Module:
    config = FalconConfig(
        hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=128, num_hidden_layers=2,
        multi_query=multi_query,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.train()


def attention_calls(block: torch.nn.Module, width: int = 64) -> list[dict]:
    """The keyword arguments of the attention calls in the graph Dynamo captures from ``block``, before
    and after the pass."""
    graphs = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(2, 16, width)
    positions = torch.arange(16)[None]
    rotary = block.self_attention.rotary_emb if hasattr(block.self_attention, "rotary_emb") else None
    kwargs = dict(alibi=None, attention_mask=None, position_ids=positions)
    if rotary is None:
        kwargs["position_embeddings"] = (torch.ones(1, 16, 16), torch.zeros(1, 16, 16))
    torch.compile(block, backend=capture)(x, **kwargs)
    graph = graphs[0].graph
    found = lambda: [dict(n.kwargs) for n in graph.nodes if "scaled_dot_product" in str(n.target)]  # noqa: E731
    before = found()
    MultiQueryAsGroupedQuery()(graph)
    return [before, found()]


def test_one_key_value_head_for_several_query_heads_becomes_grouped_query_attention():
    (before,), (after,) = attention_calls(falcon().transformer.h[0])
    assert "enable_gqa" not in before and after["enable_gqa"] is True
    assert {k: v for k, v in after.items() if k != "enable_gqa"} == before


def test_attention_with_a_key_value_head_per_query_head_is_left_alone():
    (before,), (after,) = attention_calls(falcon(multi_query=False).transformer.h[0])
    assert after == before and "enable_gqa" not in after


def test_compiled_multi_query_model_trains_as_eager_in_fp8():
    """The whole path: an FP8 Falcon through hf_fp8.compile (Inductor, the pass on) gives eager's loss and
    gradients, to float32 rounding (relative distance <= 1e-4; measured 3e-5 at most)."""
    torch._dynamo.reset()
    eager = falcon()
    hf_fp8.patch_model(eager)
    compiled = copy.deepcopy(eager)
    hf_fp8.compile(compiled)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for model in (eager, compiled):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert (a.grad - b.grad).norm() <= 1e-4 * a.grad.norm(), name


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {}),
        ({"mode": "reduce-overhead"}, {"triton.cudagraphs": True}),
        ({"options": {"max_autotune": True}, "fullgraph": True}, {"max_autotune": True}),
    ],
)
def test_compile_arguments_gain_the_pass_and_keep_what_the_caller_asked(given, expected):
    made = with_graph_passes(given)
    options = made["options"]
    assert isinstance(options.pop("pre_grad_custom_pass"), MultiQueryAsGroupedQuery)
    assert {k: v for k, v in options.items() if k in expected} == expected
    assert "mode" not in made and made.get("fullgraph") == given.get("fullgraph")


@pytest.mark.parametrize(
    "given",
    [
        {"backend": "aot_eager"},
        {"mode": "reduce-overhead", "options": {"max_autotune": True}},  # torch.compile refuses it
        {"options": {"pre_grad_custom_pass": MultiQueryAsGroupedQuery()}},
    ],
)
def test_other_backends_and_callers_own_passes_keep_their_arguments(given):
    assert with_graph_passes(given) is given


@pytest.mark.gpu
def test_multi_query_attention_runs_on_a_fused_kernel_on_the_gpu():
    """Before the pass the attention ran on float32 GEMMs (the math path); now on a fused kernel, and the
    loss agrees with eager's math path to BF16 rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch._dynamo.reset()
    model = falcon(device="cuda").to(torch.bfloat16)
    reference = copy.deepcopy(model)
    hf_fp8.compile(model)
    ids = torch.randint(0, 128, (2, 256), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()  # compiles
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.cuda.synchronize()
    names = [event.key for event in profile.key_averages()]
    fused = [n for n in names if any(k in n.lower() for k in ("flash", "fmha", "cudnn", "attention"))]
    assert fused, names
    expected = reference(input_ids=ids, labels=ids).loss
    assert loss.item() == pytest.approx(expected.item(), rel=2e-2)
