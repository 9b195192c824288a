"""``hf_fp8.compile(model, mode="reduce-overhead")``: one CUDA graph step per training forward, the loss
and accumulated gradients kept past the next replay, evaluation run eagerly."""

from __future__ import annotations

import copy
import warnings

import pytest
import tiny_models as tm
import torch
from torch._dynamo.utils import counters

import hf_fp8
from hf_fp8.integrations.graph_steps import wants_cuda_graphs


def llama(device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    model = tm.build("llama", dtype=dtype).to(device)
    hf_fp8.patch_model(model, backend="native")
    return model


def batch(step: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in tm.batch_for("llama", 32, seed=step).items()}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"mode": "reduce-overhead"}, True),
        ({"mode": "max-autotune"}, True),
        ({"options": {"triton.cudagraphs": True}}, True),
        ({"backend": "cudagraphs"}, True),
        ({"mode": "max-autotune-no-cudagraphs"}, False),
        ({}, False),
    ],
)
def test_the_modes_that_replay_cuda_graphs_are_recognised(options, expected):
    assert wants_cuda_graphs(options) is expected


def test_evaluation_runs_eagerly_and_leaves_the_training_graphs_alone():
    """Under CUDA graphs an evaluation forward (no gradient) runs eagerly: its logits would be
    overwritten by the next replay. Without graphs the same forward compiles a graph of its own."""
    for mode, evaluation_compiles in (("reduce-overhead", False), ("default", True)):
        torch._dynamo.reset()
        model = llama()
        hf_fp8.compile(model, mode=mode, backend="aot_eager")
        tm.train(model, [batch(0), batch(1)])
        model.eval()
        with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
            if evaluation_compiles:
                with pytest.raises(torch._dynamo.exc.RecompileError):
                    model(**batch(5))
            else:
                assert torch.isfinite(model(**batch(5)).loss)


def test_accumulated_gradients_are_copied_once_per_optimizer_step_and_sum_as_without_graphs():
    torch._dynamo.reset()
    graphed = llama()
    plain = copy.deepcopy(graphed)
    hf_fp8.compile(graphed, mode="reduce-overhead", backend="aot_eager")
    hf_fp8.compile(plain, backend="aot_eager")
    params = dict(graphed.named_parameters())
    for model in (graphed, plain):
        model(**batch(0)).loss.backward()
    first = {name: p.grad for name, p in params.items()}
    for model in (graphed, plain):
        model(**batch(1)).loss.backward()  # the second micro-batch: the first one's gradients are copied
    copied = {name: p.grad for name, p in params.items()}
    assert all(copied[name] is not first[name] for name in params)
    graphed(**batch(2)).loss.backward()
    assert all(p.grad is copied[name] for name, p in params.items()), "copied once, then accumulated into"
    plain(**batch(2)).loss.backward()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-5, atol=1e-6)
    graphed.zero_grad()
    graphed(**batch(3)).loss.backward()
    fresh = {name: p.grad for name, p in params.items()}
    graphed(**batch(4))
    assert all(p.grad is not fresh[name] for name, p in params.items()), "a new optimizer step copies again"


def test_a_step_is_marked_per_training_forward_but_not_before_a_pending_backward(monkeypatch):
    """Two training forwards before one backward (R-Drop, a loss of two batches) share one step: a new
    step would overwrite what the first forward's backward still needs."""
    marks = []
    mark = torch.compiler.cudagraph_mark_step_begin
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: (marks.append(1), mark()))
    torch._dynamo.reset()
    model = llama()
    hf_fp8.compile(model, mode="reduce-overhead", backend="aot_eager")
    model(**batch(0)).loss.backward()
    assert len(marks) == 1
    first = model(**batch(1)).loss
    second = model(**batch(2)).loss  # the first one's backward is pending: no new step
    assert len(marks) == 2
    (first + second).backward()
    model(**batch(3))
    assert len(marks) == 3
    model.eval()
    with torch.no_grad():
        model(**batch(4))
    assert len(marks) == 3, "evaluation marks no step"


def test_a_tuple_outputs_loss_is_copied_out_of_the_graphs_memory():
    torch._dynamo.reset()
    model = llama()
    hf_fp8.compile(model, mode="reduce-overhead", backend="aot_eager")
    outputs = model(**batch(0), return_dict=False)
    assert isinstance(outputs, tuple) and outputs[0].grad_fn.name() == "CloneBackward0"
    outputs[0].backward()


@pytest.mark.gpu
def test_gpu_cuda_graphs_replay_on_their_fast_path_and_train_as_without_them():
    """Every block, the head and their backwards replay as CUDA graphs (no skipped graph, no warning of
    the slow path; a step's logits are overwritten by the next replay), with gradient accumulation, and
    the losses equal those of the compiled model without graphs. Each step's loss is read only after all
    steps: it outlives the replays."""
    torch._dynamo.reset()
    counters.clear()
    graphed = llama("cuda", torch.bfloat16)
    plain = copy.deepcopy(graphed)
    hf_fp8.compile(graphed, mode="reduce-overhead")
    hf_fp8.compile(plain)

    def train(model: torch.nn.Module) -> list[torch.Tensor]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, outputs = [], []
        for step in range(8):
            outputs.append(model(**batch(step, "cuda")))
            outputs[-1].loss.backward()
            losses.append(outputs[-1].loss.detach())
            if step % 2:  # two micro-batches a step
                optimizer.step()
                optimizer.zero_grad()
        if model is graphed:
            with pytest.raises(RuntimeError, match="overwritten"):
                outputs[0].logits.sum()
        return losses

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphed_losses = train(graphed)
    assert not [w for w in caught if "CUDAGraphs" in str(w.message)]
    assert counters["inductor"]["cudagraph_skips"] == 0
    expected = train(plain)
    assert len({loss.item() for loss in graphed_losses}) == len(graphed_losses), "each step's own loss"
    for got, reference in zip(graphed_losses, expected, strict=True):
        assert got.item() == pytest.approx(reference.item(), rel=1e-3)
