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
    assert [id(p) for g in prepared_optimizer.param_groups for p in g["params"]] == params
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    loss = prepared(**tm.batch_for("llama", 13)).loss
    accelerator.backward(loss)
    prepared_optimizer.step()
    assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight), (
        "the optimizer updates the model"
    )


def test_prepare_fp8_refuses_an_optimizer_whose_parameters_it_cannot_map():
    accelerator = Accelerator(cpu=True)
    model = tm.build("llama")
    stranger = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([{"params": model.parameters()}, {"params": [stranger]}], lr=0.1)
    with pytest.raises(ValueError, match="create the optimizer after prepare_fp8"):
        prepare_fp8(accelerator, model, optimizer)
