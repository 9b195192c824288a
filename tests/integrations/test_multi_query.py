"""Multi-query attention (one key/value head for all query heads) asks for grouped-query attention under
hf_fp8.compile: the same values, on PyTorch's fused kernels instead of float32 math."""

from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import EagerAndRecordGraphs
from transformers import AutoModelForCausalLM, FalconConfig

import hf_fp8
import hf_fp8.integrations.multi_query as multi_query
from hf_fp8.integrations.multi_query import MultiQueryAsGroupedQuery, with_graph_passes

needs_custom_passes = pytest.mark.skipif(
    multi_query.CustomGraphPass is object, reason="torch before 2.6 compiles without the pass"
)


def falcon(multi_query: bool = True, device: str = "cpu") -> torch.nn.Module:
    config = FalconConfig(
        hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=128, num_hidden_layers=2,
        multi_query=multi_query,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.train()


def attention_calls(fn, *args, **kwargs) -> tuple[list[dict], list[dict]]:
    """The keyword arguments of the attention calls in the graph Dynamo captures from ``fn(*args,
    **kwargs)``, before and after the pass."""
    recorder = EagerAndRecordGraphs()
    torch._dynamo.reset()
    torch.compile(fn, backend=recorder)(*args, **kwargs)
    graph = recorder.graphs[0].graph

    def found() -> list[dict]:
        return [dict(n.kwargs) for n in graph.nodes if "scaled_dot_product" in str(n.target)]

    before = found()
    MultiQueryAsGroupedQuery()(graph)
    return before, found()


def falcon_block_calls(multi_query: bool) -> tuple[list[dict], list[dict]]:
    block = falcon(multi_query).transformer.h[0]
    rotary = (torch.ones(1, 16, 16), torch.zeros(1, 16, 16))
    kwargs = dict(
        alibi=None, attention_mask=None, position_ids=torch.arange(16)[None], position_embeddings=rotary
    )
    return attention_calls(block, torch.randn(2, 16, 64), **kwargs)


def test_a_multi_query_falcon_block_asks_for_grouped_query_attention():
    (before,), (after,) = falcon_block_calls(multi_query=True)
    assert "enable_gqa" not in before and after["enable_gqa"] is True
    assert {k: v for k, v in after.items() if k != "enable_gqa"} == before


def test_a_multi_head_falcon_block_is_left_alone():
    (before,), (after,) = falcon_block_calls(multi_query=False)
    assert after == before and "enable_gqa" not in after


def sdpa_positional(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, mask)


def sdpa_keywords(q, k, v, mask):
    return F.scaled_dot_product_attention(query=q, key=k, value=v, attn_mask=mask)


@pytest.mark.parametrize(
    ("call", "heads", "key_batch", "mask", "rewritten"),
    [
        (sdpa_positional, (4, 1), 2, None, True),
        (sdpa_keywords, (4, 1), 2, None, True),  # operands given by name
        (sdpa_positional, (4, 1), 2, (2, 1, 8, 8), True),
        (sdpa_positional, (4, 1), 2, (8,), False),  # a 1-D mask, which grouped-query attention refuses
        (sdpa_positional, (4, 1), 1, None, False),  # a broadcast batch, not only heads
        (sdpa_positional, (1, 1), 2, None, False),  # one query head: nothing to group
        (sdpa_positional, (4, 4), 2, None, False),
    ],
)
def test_the_pass_rewrites_only_attention_that_broadcasts_one_key_value_head(
    call, heads, key_batch, mask, rewritten
):
    """The values stay those of the call as written, whether it was rewritten or not."""
    q = torch.randn(2, heads[0], 8, 16)
    k, v = torch.randn(key_batch, heads[1], 8, 16), torch.randn(key_batch, heads[1], 8, 16)
    attn_mask = None if mask is None else torch.zeros(mask)
    _, (after,) = attention_calls(call, q, k, v, attn_mask)
    assert after.get("enable_gqa", False) is rewritten
    if rewritten:
        grouped = F.scaled_dot_product_attention(q, k, v, attn_mask, enable_gqa=True)
        assert torch.allclose(grouped, call(q, k, v, attn_mask), atol=1e-6)


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


@needs_custom_passes
def test_hf_fp8_compile_runs_the_pass_on_its_graphs(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # compiled afresh, not from the cache
    seen = []
    original = MultiQueryAsGroupedQuery.__call__
    monkeypatch.setattr(
        MultiQueryAsGroupedQuery, "__call__", lambda self, g: seen.append(g) or original(self, g)
    )
    torch._dynamo.reset()
    model = falcon()
    hf_fp8.compile(model)
    ids = torch.randint(0, 128, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    assert seen, "hf_fp8.compile compiled without the multi-query pass"


@needs_custom_passes
def test_an_fp8_models_first_step_runs_the_pass_before_aot_eager(monkeypatch):
    """Under delayed scaling the blocks' first step compiles on AOTAutograd alone (see
    hf_fp8.integrations.compiled); the pass runs there too, so that step's attention asks for
    grouped-query attention as every later one does."""
    rewritten = []
    original = MultiQueryAsGroupedQuery.__call__

    def watched(self, graph: torch.fx.Graph) -> None:
        original(self, graph)
        calls = [n for n in graph.nodes if n.op == "call_function" and n.target is multi_query._SDPA]
        rewritten.extend(n.kwargs.get("enable_gqa", False) for n in calls)

    monkeypatch.setattr(MultiQueryAsGroupedQuery, "__call__", watched)
    torch._dynamo.reset()
    model = falcon()
    hf_fp8.patch_model(model, hf_fp8.Fp8Recipe(scaling="delayed"))
    hf_fp8.compile(model)
    ids = torch.randint(0, 128, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    assert rewritten and all(rewritten), rewritten


@needs_custom_passes
def test_the_cache_key_follows_the_pass_code():
    expected = hashlib.sha256(Path(multi_query.__file__).read_bytes()).hexdigest()
    assert MultiQueryAsGroupedQuery().uuid() == expected


@needs_custom_passes
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
    assert options == expected
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
