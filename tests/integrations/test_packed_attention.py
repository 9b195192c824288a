"""Packed rows on variable-length flash attention (``hf_fp8.compile``): each sequence of a row found from
its position ids; on a GPU every sequence attends to itself only, as sdpa's block-diagonal mask gives;
everything else stays transformers' sdpa."""

from __future__ import annotations

import pytest
import tiny_models as tm
import torch

import hf_fp8
from hf_fp8.integrations import packed_attention
from hf_fp8.integrations.packed_attention import (
    ATTENTION,
    boundaries_for,
    packed_boundaries,
    use_packed_attention,
)

LENGTHS = (7, 12, 5)


def packed_positions(lengths=LENGTHS, device="cpu") -> torch.Tensor:
    return torch.cat([torch.arange(n, device=device) for n in lengths])[None]


def test_a_packed_rows_boundaries_come_from_its_position_ids():
    boundaries, longest = packed_boundaries(packed_positions())
    assert boundaries.tolist() == [0, 7, 19, 24] and boundaries.dtype == torch.int32
    assert longest == 24, "the longest (12) rounded up to 256, but never past the row"
    assert packed_boundaries(packed_positions((300, 40)))[1] == 340
    assert packed_boundaries(packed_positions((600, 40)))[1] == 640, "768, capped at the row"
    # a row that starts mid-sequence, as a truncated pack does
    assert packed_boundaries(torch.tensor([[5, 6, 7, 0, 1]]))[0].tolist() == [0, 3, 5]
    assert packed_boundaries(torch.arange(24)[None]) is None, "one sequence: nothing packed"
    assert packed_boundaries(packed_positions().expand(2, -1)) is None, "two rows: not a packed row"


def test_the_attention_is_sdpa_where_nothing_is_given_and_on_the_cpu():
    model, reference = tm.build("llama"), tm.build("llama")
    assert use_packed_attention(model) and model.config._attn_implementation == ATTENTION
    ids = torch.randint(4, 256, (1, sum(LENGTHS)))
    arguments = dict(input_ids=ids, position_ids=packed_positions(), use_cache=False)
    assert boundaries_for(arguments) == {}, "the CPU has no variable-length flash attention"
    with torch.no_grad():
        assert torch.equal(model(**arguments).logits, reference(**arguments).logits)
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_compile_switches_sdpa_models_only():
    model, eager = tm.build("llama"), tm.build("llama")
    eager.set_attn_implementation("eager")
    hf_fp8.compile(model)
    hf_fp8.compile(eager)
    assert model.config._attn_implementation == ATTENTION
    assert eager.config._attn_implementation == "eager"


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_packed_row_trains_as_with_sdpas_block_diagonal_mask(fp8, monkeypatch):
    """A packed row through hf_fp8.compile (variable-length flash attention, seen to run) against the same
    model on sdpa with transformers' block-diagonal mask: the loss, and the gradients' direction. 1,029
    tokens: the FP8 layers pad their own GEMM rows."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return varlen(*args, **kwargs)

    varlen = packed_attention._varlen_causal
    monkeypatch.setattr(packed_attention, "_varlen_causal", counted)
    model = tm.build("llama", dtype=torch.bfloat16).cuda()
    reference = tm.build("llama", dtype=torch.bfloat16).cuda()
    if fp8:
        hf_fp8.patch_model(model)
        hf_fp8.patch_model(reference)
    hf_fp8.compile(model)
    lengths = (300, 500, 229)
    ids = torch.randint(4, 256, (1, sum(lengths)), device="cuda")
    arguments = dict(
        input_ids=ids, labels=ids, position_ids=packed_positions(lengths, "cuda"), use_cache=False
    )
    assert boundaries_for(arguments)["cu_seq_lens_q"].tolist() == [0, 300, 800, 1029]
    for _ in range(2):  # the first step compiles
        model.zero_grad()
        reference.zero_grad()
        loss = model(**arguments).loss
        loss.backward()
        expected = reference(**arguments).loss
        expected.backward()
    assert calls and all(shape[0] == sum(lengths) for shape in calls), "the packed row's attention ran"
    assert loss.item() == pytest.approx(expected.item(), rel=0.01)
    grads = [torch.cat([p.grad.float().flatten() for p in m.parameters()]) for m in (model, reference)]
    assert torch.nn.functional.cosine_similarity(*grads, dim=0) > 0.99
