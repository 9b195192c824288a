"""The causal LM loss ``hf_fp8.compile`` gives a model: transformers' loss, value for value up to float32
rounding, with a pointwise backward; and what the output head's backward does with that gradient (its
amax by rows, the same value; its transpose a copy of its own)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import tiny_models as tm
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.loss.loss_utils import ForCausalLMLoss

import hf_fp8
from hf_fp8.integrations.causal_lm_loss import causal_lm_loss
from hf_fp8.numerics.gemm import GemmConfig, choose_scale
from hf_fp8.numerics.scaling import GRAD_OUTPUT
from hf_fp8.recipe import Fp8Recipe

VOCAB = 50


def logits_and_labels(dtype: torch.dtype, ignored: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits and labels whose first three positions of the first row are ``ignored``."""
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 9, VOCAB, generator=generator) * 4).to(dtype)
    labels = torch.randint(0, VOCAB, (2, 9), generator=generator)
    labels[0, :3] = ignored  # a prompt that does not count
    return logits, labels


def loss_and_gradient(
    loss_function: Callable[..., torch.Tensor], logits: torch.Tensor, labels: torch.Tensor | None, **kwargs
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the logits' gradient for a gradient of 1.7 on each value of the loss."""
    leaf = logits.clone().requires_grad_()
    loss = loss_function(leaf, labels, VOCAB, **kwargs)
    (loss * 1.7).sum().backward()
    return loss.detach(), leaf.grad


@pytest.mark.parametrize(
    "num_items_in_batch",
    [None, torch.tensor(11), 7, torch.tensor([[11.0]])],
    ids=["mean", "tensor", "int", "data-parallel-replica"],
)
def test_bf16_logits_give_transformers_loss_and_gradient_to_an_ulp(num_items_in_batch):
    """Both compute in float32 and round the gradient to BF16 once; the float32 values differ in their
    last bits, so a BF16 value now and then lands one ulp apart. nn.DataParallel's replicas get a (1, 1)
    count (Trainer expands it per GPU): the loss keeps that shape, as transformers' does."""
    logits, labels = logits_and_labels(torch.bfloat16)
    theirs = loss_and_gradient(ForCausalLMLoss, logits, labels, num_items_in_batch=num_items_in_batch)
    ours = loss_and_gradient(causal_lm_loss, logits, labels, num_items_in_batch=num_items_in_batch)
    assert ours[0].shape == theirs[0].shape and ours[0].dtype == theirs[0].dtype
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=0)
    assert ours[1].dtype == torch.bfloat16
    torch.testing.assert_close(ours[1], theirs[1], rtol=2**-7, atol=0)


def test_float32_logits_and_given_shift_labels_agree_to_float32_rounding():
    logits, labels = logits_and_labels(torch.float32)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    theirs = loss_and_gradient(ForCausalLMLoss, logits, labels)
    ours = loss_and_gradient(causal_lm_loss, logits, None, shift_labels=shifted)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-7)
    assert not ours[1][0, :2].any(), "ignored targets give no gradient"


def test_an_ignore_index_of_the_models_own_is_honoured():
    logits, labels = logits_and_labels(torch.float32, ignored=3)
    theirs = loss_and_gradient(ForCausalLMLoss, logits, labels, ignore_index=3)
    ours = loss_and_gradient(causal_lm_loss, logits, labels, ignore_index=3)
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-7)
    assert not ours[1][0, :2].any() and ours[1][0, 2].any(), "targets 3 ignored, the others counted"


def test_its_backward_cannot_be_differentiated_again():
    """The backward recomputes the softmax from a log-sum-exp saved without history: a second
    derivative through it would be wrong, so asking for one raises."""
    logits, labels = logits_and_labels(torch.float32)
    leaf = logits.clone().requires_grad_()
    (grad,) = torch.autograd.grad(causal_lm_loss(leaf, labels, VOCAB), leaf, create_graph=True)
    with pytest.raises(RuntimeError, match=r"once_differentiable|does not require grad"):
        grad.sum().backward()


def test_a_batch_with_no_target_gives_what_transformers_gives():
    logits, labels = logits_and_labels(torch.float32)
    labels[:] = -100
    assert ForCausalLMLoss(logits, labels, VOCAB).isnan() and causal_lm_loss(logits, labels, VOCAB).isnan()
    summed = causal_lm_loss(logits, labels, VOCAB, num_items_in_batch=4)
    assert summed == ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=4) == 0


def test_compile_gives_a_causal_lm_this_loss_and_keeps_a_loss_of_the_users():
    model = tm.build("llama")
    hf_fp8.compile(model, backend="aot_eager")
    assert model.loss_function is causal_lm_loss

    def users_loss(logits, labels, vocab_size, **kwargs):
        return ForCausalLMLoss(logits, labels, vocab_size, **kwargs) * 2

    other = tm.build("llama")
    other.loss_function = users_loss
    hf_fp8.compile(other, backend="aot_eager")
    assert other.loss_function is users_loss
    batch = tm.batch_for("llama", 16, seed=0)
    torch.testing.assert_close(other(**batch).loss, model(**batch).loss * 2)


def test_an_amax_taken_by_rows_is_the_whole_tensors_nan_included():
    config = GemmConfig(
        Fp8Recipe().forward_format, Fp8Recipe().backward_format, (False,) * 3, 0, torch.float32
    )
    t = torch.randn(2, 24, 40) * 3
    for values in (
        t,
        t.index_put((torch.tensor([1]), torch.tensor([5]), torch.tensor([7])), t.new_tensor(float("nan"))),
    ):
        history, scale = torch.zeros(3, 4), torch.ones(3)
        choose_scale(values, GRAD_OUTPUT, config.backward_format, history, scale, config, True, True)
        expected = values.abs().amax()
        got = history[GRAD_OUTPUT, 0]
        assert torch.equal(got, expected) or (got.isnan() and expected.isnan())


def backward_calls(recipe: str | Fp8Recipe | None) -> list[tuple[object, tuple]]:
    """The ops (and their arguments) of every compiled backward of two training steps of a tiny Llama
    patched with ``recipe`` (``None``: the default) and compiled by ``hf_fp8.compile``."""
    graphs: list[torch.fx.GraphModule] = []
    torch._dynamo.reset()
    model = tm.build("llama")
    hf_fp8.patch_model(model, recipe)
    hf_fp8.compile(model, backend=tm.keeping_backward_graphs(graphs))
    batch = tm.batch_for("llama", 32, seed=0)
    for _ in range(2):  # own amaxes, then delayed scales
        model(**batch).loss.backward()
    return [(n.target, n.args) for g in graphs for n in g.graph.nodes if n.op == "call_function"]


def transposed_copies(calls: list[tuple[object, tuple]]) -> int:
    return sum(op is torch.ops.hf_fp8.transposed_fp8.default for op, _ in calls)


HEAD_BACKWARD_ONLY_FP8 = Fp8Recipe(forward_in_fp8=False, convert_lm_head="backward")


@pytest.mark.parametrize("recipe", ["head-backward", HEAD_BACKWARD_ONLY_FP8])
def test_the_heads_backward_takes_the_gradients_amax_by_rows_and_transposes_it_by_a_copy(recipe):
    """With the head's backward in FP8 it is in the loss's graph: there the logits' gradient gets an amax
    by rows and the tiled transpose, the head's alone (a block's layers under ``forward_in_fp8: false``
    transpose their gradient in the kernel that casts it)."""
    calls = backward_calls(recipe)
    amax_dims = [
        tuple(args[1]) if len(args) > 1 else () for op, args in calls if op is torch.ops.aten.amax.default
    ]
    by_rows = sum(dims in ((1,), (-1,)) for dims in amax_dims)
    assert transposed_copies(calls) == 2, "one each in the first step's graph and in the later one"
    assert by_rows >= 2


@pytest.mark.parametrize("recipe", [None, "backward-fp8", Fp8Recipe(convert_lm_head=True)])
def test_with_the_heads_forward_in_high_precision_alone_a_gradient_is_transposed_by_a_copy(recipe):
    """The defaults keep the head out of FP8, and ``backward-fp8``'s head casts its gradient in 1x128
    tiles (both layouts in one pass of its own); a head whose forward is in FP8 too transposes its
    gradient in the kernel that casts it, as every other layer does."""
    assert transposed_copies(backward_calls(recipe)) == 0


@pytest.mark.gpu
def test_gpu_a_compiled_head_backward_gradient_is_as_close_to_bf16_as_the_eager_one():
    """Inductor makes the loss's pointwise backward, the head gradient's cast and its row amaxes one
    kernel, and the transpose a copy of its own. Compiled and eager FP8 runs cast with scales a few
    BF16 ulps apart (Inductor's norms round otherwise), so their FP8 roundings are independent: each is
    held against the BF16 model's gradient, with transformers' own loss, after the scales have turned
    delayed."""
    torch._dynamo.reset()
    config = AutoConfig.for_model(
        "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    bf16 = AutoModelForCausalLM.from_config(config).cuda().to(torch.bfloat16).train()
    eager = copy.deepcopy(bf16)
    hf_fp8.patch_model(eager, "head-backward")
    compiled = hf_fp8.compile(copy.deepcopy(eager))
    ids = torch.randint(0, 4096, (4, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses = {}
    for model in (bf16, eager, compiled):
        # lr 0: every step sees the same weights, the scales still advance (own amaxes, then delayed)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses[model] = loss.item()
    exact = bf16.lm_head.weight.grad.float()
    errors = [(m.lm_head.weight.grad.float() - exact).norm() / exact.norm() for m in (eager, compiled)]
    assert errors[0] < 0.15 and errors[1] < 1.5 * errors[0], errors
    assert losses[compiled] == pytest.approx(losses[bf16], rel=1e-2)
