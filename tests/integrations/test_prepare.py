import pytest
import tiny_models as tm
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from hf_fp8 import Fp8Linear, is_patched, prepare_fp8


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


def test_prepare_fp8_compiles_on_an_fp8_gpu_only_unless_told():
    """The fast path is the default where it is fast (an FP8 GPU); the CPU stays eager unless asked."""
    from hf_fp8.module_tree import repeated_blocks

    eager, _, eager_report = prepare_fp8(Accelerator(cpu=True), tm.build("llama"))
    assert all(b._compiled_call_impl is None for b in repeated_blocks(eager))
    assert not any("compiled" in note for note in eager_report.notes)
    compiled, _, report = prepare_fp8(Accelerator(cpu=True), tm.build("llama"), compile=True)
    assert all(b._compiled_call_impl is not None for b in repeated_blocks(compiled))
    assert "compiled block by block (hf_fp8.compile) by prepare_fp8" in report.notes
    with pytest.raises(TypeError, match="compile must be True, False or None"):
        prepare_fp8(Accelerator(cpu=True), tm.build("llama"), compile="yes")


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


def test_prepare_fp8_under_fsdp_refuses_the_te_backend_before_patching():
    class FsdpAccelerator:  # stands in for an Accelerator with an FSDP plugin, which shards on GPUs only
        distributed_type = DistributedType.FSDP
        mixed_precision = "bf16"

    model = tm.build("llama")
    with pytest.raises(ValueError, match=r"te backend is not supported under FSDP.*backend='native'"):
        prepare_fp8(FsdpAccelerator(), model, backend="te")
    assert not is_patched(model)


def train_prepared(checkpoint: str | None, steps: range, save_at: int | None = None) -> list[float]:
    """Steps of a prepare_fp8 loop on fixed batches; optionally resumed from, or saved to, a checkpoint
    of accelerator.save_state."""
    accelerator = Accelerator(cpu=True)
    model = tm.build("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, _ = prepare_fp8(accelerator, model, optimizer)
    if checkpoint and save_at is None:
        accelerator.load_state(checkpoint)
    losses = []
    for step in steps:
        loss = model(**tm.batch_for("llama", 32, seed=step)).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if save_at == step + 1:
            accelerator.save_state(checkpoint)
    return losses


def test_accelerate_checkpoints_carry_the_fp8_state_and_resume_exactly(tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    uninterrupted = train_prepared(checkpoint, range(6), save_at=3)
    assert (tmp_path / "checkpoint" / "fp8_state.safetensors").is_file()
    assert train_prepared(checkpoint, range(3, 6)) == uninterrupted[3:]


def test_accelerate_checkpoint_without_fp8_state_resumes_with_a_warning(tmp_path):
    checkpoint = str(tmp_path / "checkpoint")
    train_prepared(checkpoint, range(2), save_at=2)
    (tmp_path / "checkpoint" / "fp8_state.safetensors").unlink()
    with pytest.warns(UserWarning, match="no fp8_state.safetensors in .*scales start afresh"):
        train_prepared(checkpoint, range(2, 3))
