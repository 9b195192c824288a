"""A compiled training forward that computes its loss returns its logits detached from the head's graph:
no zero gradient of their full size each step, and a loss on them raises instead of losing its gradient."""

from __future__ import annotations

import copy

import pytest
import tiny_models as tm
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification

import hf_fp8


def test_the_head_graph_backward_takes_the_loss_gradient_alone():
    torch._dynamo.reset()
    graphs: list[torch.fx.GraphModule] = []
    model = tm.build("llama")
    hf_fp8.patch_model(model)
    hf_fp8.compile(model, backend=tm.keeping_backward_graphs(graphs))
    model(**tm.batch_for("llama", 32)).loss.backward()
    # how many gradients of outputs each compiled backward takes
    tangents = [
        sum(n.op == "placeholder" and n.name.startswith("tangents") for n in g.graph.nodes) for g in graphs
    ]
    assert tangents == [1, 1], "the head's backward (first) and the block's: one output gradient each"


def test_training_logits_equal_the_models_and_a_loss_on_them_raises_with_the_fix():
    torch._dynamo.reset()
    model = tm.build("llama")
    reference = copy.deepcopy(model)
    hf_fp8.compile(model, backend="aot_eager")
    batch = tm.batch_for("llama", 32)
    out = model(**batch)
    torch.testing.assert_close(out.logits, reference(**batch).logits)
    with pytest.raises(RuntimeError, match="without labels"):
        (out.loss + out.logits.float().logsumexp(-1).mean()).backward()


def test_without_labels_the_logits_keep_their_gradient():
    torch._dynamo.reset()
    model = tm.build("llama")
    reference = copy.deepcopy(model)
    hf_fp8.compile(model, backend="aot_eager")
    unlabelled = {k: v for k, v in tm.batch_for("llama", 32).items() if k != "labels"}
    for m in (model, reference):
        m(**unlabelled).logits.float().logsumexp(-1).mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_forward_called_directly_guards_its_logits_too():
    """PEFT's tuners before 0.21 call the HF model's ``forward`` itself, which runs no hooks: the guard
    is part of the forward."""
    torch._dynamo.reset()
    model = tm.build("llama")
    hf_fp8.compile(model, backend="aot_eager")
    out = model.forward(**tm.batch_for("llama", 32))
    with pytest.raises(RuntimeError, match="without labels"):
        (out.loss + out.logits.float().logsumexp(-1).mean()).backward()


def test_a_classifiers_logits_keep_their_gradient():
    """Only a language head's logits leave detached: a classifier's are small, and a loss on them trains
    as without hf_fp8.compile."""
    torch._dynamo.reset()
    config = AutoConfig.for_model("llama", **dict(tm.CONFIGS["llama"][1], num_labels=3, pad_token_id=0))
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config).train()
    reference = copy.deepcopy(model)
    hf_fp8.compile(model, backend="aot_eager")
    batch = {**tm.batch_for("llama", 32), "labels": torch.tensor([0, 2])}
    for m in (model, reference):
        out = m(**batch)
        (out.loss + out.logits.square().mean()).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_training_logits_leave_in_float32_when_asked_and_train_as_before():
    """Accelerate's mixed precision converts every forward's outputs to float32: with
    ``logits_dtype=torch.float32`` the graph hands them over converted (the conversion is then no pass
    of its own), the same values, and the loss's gradients are the ones without it."""
    torch._dynamo.reset()
    model = tm.build("llama", dtype=torch.bfloat16)
    as_is = copy.deepcopy(model)
    hf_fp8.compile(model, logits_dtype=torch.float32, backend="aot_eager")
    hf_fp8.compile(as_is, backend="aot_eager")
    batch = tm.batch_for("llama", 32)
    out, kept = model(**batch), as_is(**batch)
    assert (out.logits.dtype, kept.logits.dtype) == (torch.float32, torch.bfloat16)
    torch.testing.assert_close(out.logits, kept.logits.float(), rtol=0, atol=0)
    out.loss.backward()
    kept.loss.backward()
    for (name, p), q in zip(model.named_parameters(), as_is.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    with pytest.raises(RuntimeError, match="without labels"):
        out.logits.logsumexp(-1).mean().backward()
