"""hf_fp8.compile: block by block, with the same numerics as eager."""

from __future__ import annotations

import copy

import pytest
import tiny_models as tm
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import AutoConfig, AutoModelForCausalLM

import hf_fp8
from hf_fp8 import Fp8Linear, Fp8Recipe
from hf_fp8.module_tree import repeated_blocks


def llama(layers: int = 4) -> torch.nn.Module:
    config = AutoConfig.for_model("llama", **dict(tm.CONFIGS["llama"][1], num_hidden_layers=layers))
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).train()


def node_names(gm: torch.fx.GraphModule) -> set[str]:
    """The targets of a Dynamo graph's nodes, those of its autograd Functions' bodies included."""
    graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
    return {getattr(node.target, "__name__", str(node.target)) for graph in graphs for node in graph.nodes}


def train(model, steps: int = 4, first_seed: int = 0) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    device = next(model.parameters()).device
    for step in range(first_seed, first_seed + steps):
        batch = {k: v.to(device) for k, v in tm.batch_for("llama", 32, seed=step).items()}
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("scaling", ["delayed", "current"])
def test_compiled_blocks_train_exactly_as_eager_and_compile_once_per_kind_of_step(scaling):
    """One graph for all four blocks, compiled at once; delayed scaling compiles it once more after its
    first step (which scales each tensor by its own amax, having no history), and never again."""
    torch._dynamo.reset()
    eager = llama()
    hf_fp8.patch_model(eager, hf_fp8.Fp8Recipe(scaling=scaling))
    compiled = copy.deepcopy(eager)
    tm.with_compiled_loss(eager)
    counter = CompileCounterWithBackend("aot_eager")
    hf_fp8.compile(compiled, backend=counter)
    blocks = repeated_blocks(compiled)
    assert len(blocks) == 4 and all(b._compiled_call_impl is not None for b in blocks)
    reference = train(eager)
    losses = train(compiled, steps=1)
    first = counter.frame_count
    losses += train(compiled, steps=3, first_seed=1)
    assert losses == reference
    assert counter.frame_count - first == (1 if scaling == "delayed" else 0)
    for name, layer in eager.named_modules():
        if isinstance(layer, hf_fp8.Fp8Module):
            other = compiled.get_submodule(name)
            assert torch.equal(layer.amax_history, other.amax_history) and torch.equal(
                layer.scale, other.scale
            )


def test_under_inductor_the_first_step_of_delayed_scaling_runs_its_blocks_without_generated_code():
    """The first step's graph runs once: under Inductor (the default) the blocks compile it on
    AOTAutograd alone (``aot_eager``), so that step runs Inductor's graphs of the head alone; the next
    runs those and the steady state's block graphs, forward and backward. The losses are eager's (up to
    Inductor's float32 rounding), and a deep copy trained on its own takes the same path."""
    torch._dynamo.reset()
    model = llama(layers=2)
    hf_fp8.patch_model(model, hf_fp8.Fp8Recipe(scaling="delayed"))
    eager = copy.deepcopy(model)
    tm.with_compiled_loss(eager)
    hf_fp8.compile(model)
    twin = copy.deepcopy(model)

    def inductor_graphs_run(trained: torch.nn.Module, seed: int) -> tuple[set[str], float]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            (loss,) = train(trained, steps=1, first_seed=seed)
        return {e.name for e in profile.events() if e.name.startswith("## Call CompiledFxGraph")}, loss

    (first, loss_0), (steady, loss_1) = inductor_graphs_run(model, 0), inductor_graphs_run(model, 1)
    assert first < steady and len(steady - first) == 2, (first, steady)
    assert [loss_0, loss_1] == pytest.approx(train(eager, steps=2), rel=1e-5)
    assert inductor_graphs_run(twin, 0)[0] == first, "the copy reads its own layers' state"


def test_a_converted_head_compiles_on_its_own_and_trains_exactly_as_eager():
    """The output head lies outside the blocks: under ``convert_lm_head`` it is compiled by itself (its
    casts fused), with the same numerics as eager."""
    torch._dynamo.reset()
    eager = llama(layers=2)
    hf_fp8.patch_model(eager, hf_fp8.Fp8Recipe(convert_lm_head="backward"))
    compiled = copy.deepcopy(eager)
    tm.with_compiled_loss(eager)
    hf_fp8.compile(compiled, backend="aot_eager")
    assert compiled.lm_head._compiled_call_impl is not None and not compiled.lm_head.forward_in_fp8
    assert train(compiled) == train(eager)
    assert torch.equal(compiled.lm_head.amax_history, eager.lm_head.amax_history)


def test_telemetry_counts_a_compiled_steps_casts_as_it_counts_an_eager_ones():
    """The sampled layers count what their casts do inside the compiled graph (a Python callback there
    broke tracing on the GPU): the same saturation and flush statistics as an eager step's."""
    torch._dynamo.reset()
    eager = llama(layers=2)
    hf_fp8.patch_model(eager)
    compiled = copy.deepcopy(eager)
    tm.with_compiled_loss(eager)
    hf_fp8.compile(compiled, backend="aot_eager")
    logs = []
    for model in (eager, compiled):
        telemetry = hf_fp8.Fp8Telemetry(model)
        train(model, steps=2)
        telemetry.arm()
        train(model, steps=1, first_seed=2)
        logs.append(telemetry.collect())
        assert all(m.cast_counts is None for _, m in telemetry.sampled), "counting stops at collect()"
    assert logs[0] == logs[1]
    assert 0 < logs[0]["fp8/flushed_fwd"] < 1 and 0 < logs[0]["fp8/saturated_bwd"] < 1


def test_telemetry_samples_whole_blocks_so_counting_compiles_one_graph_more():
    """Sampled layers scattered over the blocks made a counting graph per pattern of sampled layers (up
    to the recompile limit, past which blocks ran eagerly); whole blocks make one."""
    torch._dynamo.reset()
    model = llama(layers=4)
    hf_fp8.patch_model(model)
    telemetry = hf_fp8.Fp8Telemetry(model, sample_layers=10)  # 7 FP8 layers a block: two blocks
    names = {name for name, _ in telemetry.sampled}
    layers = [f"model.layers.{i}.{p}" for i in (0, 3) for p in ("self_attn.q_proj", "self_attn.k_proj")]
    assert len(names) == 14 and set(layers) <= names, sorted(names)
    hf_fp8.compile(model, backend="aot_eager")
    train(model, steps=2)
    telemetry.arm()
    train(model, steps=1, first_seed=2)  # compiles the counting block once
    telemetry.collect()
    with torch._dynamo.config.patch(error_on_recompile=True):
        telemetry.arm()
        train(model, steps=1, first_seed=3)
        logs = telemetry.stage().read()
        train(model, steps=1, first_seed=4)  # not counting: the graph of the blocks not sampled
    assert logs["fp8/amax_bwd"] > 0 and "fp8/flushed_fwd" in logs


def test_an_unpatched_model_compiles_at_once_and_compiling_twice_changes_nothing():
    torch._dynamo.reset()
    model = llama(layers=2)
    assert hf_fp8.compile(model, backend="aot_eager") is model
    assert all(b._compiled_call_impl is not None for b in repeated_blocks(model))
    hooks = len(model._forward_pre_hooks)
    hf_fp8.compile(model, backend="aot_eager")
    assert len(model._forward_pre_hooks) == hooks
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses = train(model, steps=2)
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_model_whose_get_output_embeddings_raises_compiles():
    """Some remote code says by raising that its model has no output head: hf_fp8.compile takes it at its
    word (it crashed on the call before), compiles the model's forward as a classifier's and trains."""
    from transformers import LlamaForCausalLM

    class HeadlessByRaising(LlamaForCausalLM):
        def get_output_embeddings(self):
            raise NotImplementedError

    torch.manual_seed(0)
    model = HeadlessByRaising(tm.build("llama").config).train()
    hf_fp8.patch_model(model)
    assert hf_fp8.compile(model, backend="aot_eager") is model
    assert all(torch.isfinite(torch.tensor(train(model, steps=2))))


def gemma2_with_soft_capping() -> torch.nn.Module:
    config = AutoConfig.for_model(
        "gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=250, final_logit_softcapping=30.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def test_a_logit_transform_compiles_in_the_loss_graph_and_fullgraph_still_compiles():
    """Gemma-2's soft-capping (tanh over the whole logits) is in the head's graph; ``fullgraph=True``
    holds for the blocks (the decoder is a graph break by design)."""
    torch._dynamo.reset()
    model = gemma2_with_soft_capping()
    reference = copy.deepcopy(model)
    graphs: list[set[str]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(node_names(gm))
        return gm.forward

    hf_fp8.compile(model, backend=backend, fullgraph=True)
    ids = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    (with_loss,) = [g for g in graphs if "logsumexp" in g]
    assert "tanh" in with_loss
    assert loss.item() == pytest.approx(reference(input_ids=ids, labels=ids).loss.item(), rel=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "gemma"])
def test_the_head_and_the_loss_compile_as_one_graph_beside_the_blocks(arch):
    """What a causal LM does after its decoder (head, logit transforms, loss) is one graph: eager, a
    head over a vocabulary no multiple of 8 ran on cuBLAS's unaligned kernels and each logit transform
    was a pass of its own. The decoder stays a graph break; its blocks keep their own graph."""
    torch._dynamo.reset()
    model = tm.build(arch)
    reference = copy.deepcopy(model)
    hf_fp8.patch_model(model, "head-backward")
    graphs: list[set[str]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(node_names(gm))
        return gm.forward

    hf_fp8.compile(model, backend=backend)
    batch = tm.batch_for(arch, 32, seed=0)
    loss = model(**batch).loss
    loss.backward()
    with_loss = [g for g in graphs if "logsumexp" in g]
    # the head (its FP8 Function reads its weight) in the loss's graph
    assert len(with_loss) == 1 and any("lm_head_parameters_weight" in t for t in with_loss[0])
    assert "scaled_dot_product_attention" not in with_loss[0]  # no block inlined into it
    assert any("scaled_dot_product_attention" in g for g in graphs)  # the blocks: graphs of their own
    # the head's forward keeps the logits in high precision, so the loss is what the plain head gives
    hf_fp8.patch_model(reference, Fp8Recipe.named("head-backward").replace(convert_lm_head=False))
    assert isinstance(model.get_output_embeddings(), Fp8Linear)
    assert loss.item() == pytest.approx(reference(**batch).loss.item(), rel=1e-5)


def test_a_deep_copy_of_a_compiled_model_runs_its_own_weights():
    """An EMA or a reference model (TRL deep-copies the policy) must not run the original's forward."""
    torch._dynamo.reset()
    model = tm.build("llama")
    hf_fp8.compile(model, backend="aot_eager")
    batch = tm.batch_for("llama", 32, seed=0)
    original = model(**batch).loss.item()
    clone = copy.deepcopy(model)
    expected = tm.build("llama")
    with torch.no_grad():
        clone.lm_head.weight.mul_(100)
        expected.lm_head.weight.mul_(100)
    assert clone(**batch).loss.item() == pytest.approx(expected(**batch).loss.item(), rel=1e-5)
    assert model(**batch).loss.item() == original != pytest.approx(clone(**batch).loss.item(), rel=0.1)


@pytest.mark.parametrize("options", [{"mode": "max-autotune-no-cudagraphs"}, {"options": {"debug": False}}])
def test_inductor_options_of_the_caller_go_through(options):
    """A ``mode`` (which torch.compile refuses next to ``options``) or the caller's own Inductor
    ``options`` compile as given."""
    torch._dynamo.reset()
    model = llama(layers=2)
    hf_fp8.compile(model, **options)
    assert all(torch.isfinite(torch.tensor(train(model, steps=1))))


def test_training_forwards_build_no_kv_cache():
    model = llama(layers=2)
    hf_fp8.compile(model, backend="aot_eager")
    out = model(**tm.batch_for("llama", 16))
    assert out.past_key_values is None
    model.eval()
    with torch.no_grad():
        unlabelled = {k: v for k, v in tm.batch_for("llama", 16).items() if k != "labels"}
        assert model(**unlabelled).past_key_values is not None, "generation keeps its cache"


def test_evaluation_and_generation_leave_the_training_graph_alone():
    """A KV cache would recompile the block per layer index until torch.compile gave up on it and ran
    training eagerly too: forwards with labels run without a cache, forwards with one run eagerly."""
    torch._dynamo.reset()
    model = llama(layers=9)  # more layers than torch.compile's recompile limit (8)
    hf_fp8.patch_model(model)
    hf_fp8.compile(model, backend="aot_eager")
    train(model, steps=3)
    model.eval()
    with torch.no_grad():
        batch = tm.batch_for("llama", 16)
        assert model(**batch).past_key_values is None, "an evaluation loss needs no cache"
        unlabelled = {k: v for k, v in batch.items() if k != "labels"}
        with torch._dynamo.config.patch(error_on_recompile=True):  # forwards with a cache compile nothing
            assert model(**unlabelled).past_key_values is not None, "a caller without labels keeps its cache"
            generated = model.generate(unlabelled["input_ids"][:1], max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == unlabelled["input_ids"].shape[1] + 3
    model.train()
    with torch._dynamo.config.patch(error_on_recompile=True):  # back to the graph compiled for training
        losses = train(model, steps=2)
    assert all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.gpu
@pytest.mark.parametrize("forward_in_fp8", [True, False])
def test_gpu_inductor_fused_casts_match_the_eager_reference(forward_in_fp8):
    """On the GPU Inductor fuses each cast, its transpose and its amax into Triton kernels: one FP8 layer's
    forward and backward, compiled, equal the eager reference path's within FP8 rounding (also with the
    forward GEMM in high precision, as the head under ``convert_lm_head: backward``)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 512, bias=False, device="cuda", dtype=torch.bfloat16)
    eager = hf_fp8.Fp8Linear.from_float(copy.deepcopy(linear), forward_in_fp8=forward_in_fp8)
    fused = hf_fp8.Fp8Linear.from_float(copy.deepcopy(linear), forward_in_fp8=forward_in_fp8)
    step = torch.compile(lambda layer, x: layer(x), backend="inductor")
    for i in range(3):  # a first step by own amaxes, then delayed scales from the history
        x = (torch.randn(64, 256, device="cuda", dtype=torch.bfloat16) * (i + 1)).requires_grad_()
        x2 = x.detach().clone().requires_grad_()
        dy = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
        y_ref, y = eager(x), step(fused, x2)
        y_ref.backward(dy)
        y.backward(dy)
        torch.testing.assert_close(y, y_ref, rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(x2.grad, x.grad, rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(fused.weight.grad, eager.weight.grad, rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(fused.amax_history, eager.amax_history)
        hf_fp8.update_fp8_scales(eager)
        hf_fp8.update_fp8_scales(fused)
        fused.weight.grad = eager.weight.grad = None


@pytest.mark.gpu
def test_gpu_compiled_model_trains_like_eager():
    torch._dynamo.reset()
    eager = llama().cuda().to(torch.bfloat16)
    hf_fp8.patch_model(eager, backend="native")  # the default is TE where it is installed
    compiled = copy.deepcopy(eager)
    hf_fp8.compile(compiled)
    reference = train(eager, steps=6)
    losses = train(compiled, steps=6)
    for got, expected in zip(losses, reference, strict=True):
        assert got == pytest.approx(expected, rel=2e-2)
