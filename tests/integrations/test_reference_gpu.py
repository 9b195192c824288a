"""A DPO reference model on an FP8 GPU: ``prepare_reference`` compiles it as the Trainer callback
compiles the policy, so at the first step (same weights) both give the same log-probs and DPO's first
loss is ln 2, as in BF16."""

import pytest
import tiny_models as tm
import torch

import hf_fp8


def summed_log_probs(model, ids: torch.Tensor, grad: bool) -> torch.Tensor:
    with torch.set_grad_enabled(grad), torch.autocast("cuda", torch.bfloat16):
        # as a trainer calls it: labels and no KV cache (a cache would run the model eagerly)
        logits = model(input_ids=ids, labels=ids, use_cache=False).logits.float()
    per_token = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return per_token.sum(-1).detach()


@pytest.mark.gpu
def test_compiled_reference_scores_as_the_compiled_policy_at_the_first_step():
    policy = tm.build("llama", seed=0).cuda()
    hf_fp8.patch_model(policy)
    hf_fp8.compile(policy)
    reference = tm.build("llama", seed=0).cuda()
    report = hf_fp8.prepare_reference(reference)
    assert any("compiled" in note for note in report.notes), "compiled by default on an FP8 GPU"
    reference.eval()  # as the trainers run it
    ids = torch.randint(0, tm.VOCAB, (4, 96), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    policy_scores = summed_log_probs(policy, ids, grad=True)
    reference_scores = summed_log_probs(reference, ids, grad=False)
    torch.testing.assert_close(reference_scores, policy_scores, rtol=0, atol=1e-3)
