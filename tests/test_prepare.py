import pytest
import tiny_models as tm
import torch
from accelerate import Accelerator

from hf_fp8 import Fp8Linear, prepare_fp8


def test_prepare_fp8_patches_before_accelerate_and_keeps_the_optimizer():
    accelerator = Accelerator(cpu=True)
    model = tm.build("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = [id(p) for group in optimizer.param_groups for p in group["params"]]
    prepared, prepared_optimizer, report = prepare_fp8(accelerator, model, optimizer)
    assert report.backend == "native" and len(report.converted) == 14
    assert isinstance(accelerator.unwrap_model(prepared).model.layers[0].mlp.up_proj, Fp8Linear)
    # The native backend shares the parameters: the optimizer's are the very same objects.
    assert [id(p) for g in prepared_optimizer.param_groups for p in g["params"]] == params
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    loss = prepared(**tm.batch_for("llama", 13)).loss
    accelerator.backward(loss)
    prepared_optimizer.step()
    assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight), (
        "the optimizer updates the model"
    )


def test_prepare_fp8_leaves_parameters_that_are_not_the_models_alone():
    accelerator = Accelerator(cpu=True)
    model = tm.build("llama")
    extra = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    _, prepared_optimizer, _ = prepare_fp8(accelerator, model, optimizer)
    params = prepared_optimizer.param_groups[0]["params"]
    assert any(p is extra for p in params) and len(params) == len(list(model.parameters())) + 1


def test_prepare_fp8_refuses_accelerates_own_fp8():
    class Fp8Accelerator:  # stands in for Accelerator(mixed_precision="fp8"), which needs TE or torchao
        mixed_precision = "fp8"

    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        prepare_fp8(Fp8Accelerator(), tm.build("llama"))
