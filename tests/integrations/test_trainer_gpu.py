"""Fp8TrainerCallback under the Trainer on an FP8 GPU, both backends (on several GPUs without a launcher
the Trainer wraps the model in nn.DataParallel), and Transformer Engine's NaN in its own step."""

import shutil

import pytest
import tiny_models as tm
import torch
from trainer_runs import (
    InjectNaN,
    arguments,
    fp8_callback,
)
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_fp8 import (
    Fp8TrainerCallback,
)
from hf_fp8.integrations.checkpoint import FP8_STATE_FILE, fp8_state_dict


def gpu_arguments(out, **changes) -> TrainingArguments:
    return arguments(out, use_cpu=False, bf16=True, **changes)


def gpu_train(rows, out, backend, recipe=None, callbacks=(), resume=None, after=(), **changes):
    model = tm.build("llama", seed=0).cuda()
    callback = Fp8TrainerCallback(recipe, backend=backend)
    trainer = Trainer(
        model=model,
        args=gpu_arguments(out, **changes),
        train_dataset=rows,
        callbacks=[*callbacks, callback, *after],
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["native", "te"])
def test_gpu_trainer_learns_logs_and_resumes_with_the_saved_fp8_state(backend, text_rows, tmp_path):
    if backend == "te":
        pytest.importorskip("transformer_engine.pytorch")
    settings = dict(max_steps=12, logging_steps=4, save_strategy="steps", save_steps=6)
    full = gpu_train(text_rows, tmp_path / "full", backend, **settings)
    assert fp8_callback(full).report.backend == backend
    logged = [e for e in full.state.log_history if "loss" in e]
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert all(e["fp8/scale_fwd_max"] > 0 and e["fp8/scale_bwd_max"] > 0 for e in logged)
    saved = load_file_state(tmp_path / "full" / "checkpoint-6")
    # Resumed at step 6: before its first step the model holds exactly the checkpoint's FP8 state.
    folder = tmp_path / "again"
    shutil.copytree(tmp_path / "full" / "checkpoint-6", folder / "checkpoint-6")
    loaded = {}

    class AfterLoad(TrainerCallback):  # runs after the FP8 callback's on_train_begin, before any step
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            loaded.update(fp8_state_dict(model))

    gpu_train(text_rows, folder, backend, resume=True, after=[AfterLoad()], **settings)
    assert loaded.keys() == saved.keys() and len(saved) > 0
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)


def load_file_state(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / FP8_STATE_FILE))


@pytest.mark.gpu
def test_gpu_te_nan_is_caught_in_its_step(text_rows, tmp_path):
    """TE folds a step's amaxes into its own scale update inside the step, so the guard sees the NaN in
    the loss rather than in a TE layer's history; it still stops before the optimizer step."""
    pytest.importorskip("transformer_engine.pytorch")
    layer = "model.layers.1.self_attn.o_proj"  # a TE Linear (q/k/v and the MLP are fused blocks)
    with pytest.raises(FloatingPointError, match=r"step 3: .*the loss is non-finite\. The weights are not"):
        gpu_train(text_rows, tmp_path, "te", callbacks=[InjectNaN(layer, 3)], max_steps=5)


@pytest.mark.gpu
def test_gpu_callback_compiles_by_default_and_trains(text_rows, tmp_path):
    """On an FP8 GPU the callback compiles the patched model block by block (its report says so), and the
    compiled run learns; ``compile=False`` keeps it eager."""
    trainer = gpu_train(text_rows, tmp_path / "default", "native", max_steps=6, logging_steps=1)
    notes = fp8_callback(trainer).report.notes
    assert any("compiled block by block" in note for note in notes)
    blocks = trainer.model.model.layers
    assert all(block._compiled_call_impl is not None for block in blocks)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    eager = Trainer(
        model=tm.build("llama", seed=0).cuda(),
        args=gpu_arguments(tmp_path / "eager", max_steps=1),
        train_dataset=text_rows,
        callbacks=[Fp8TrainerCallback(compile=False)],
    )
    assert all(block._compiled_call_impl is None for block in eager.model.model.layers)


@pytest.mark.gpu
def test_gpu_fp8_step_end_guard_and_telemetry_never_wait_for_the_gpu():
    """What hf-fp8 adds to a training step (the step's end, the NaN guard's check with a fused optimizer,
    the telemetry) queues work without waiting for the device: a wait there leaves the GPU idle while
    the host catches up. After the first steps (which read back which scales exist), CUDA's sync debug
    mode raises at any synchronizing call."""
    from hf_fp8 import Fp8NanGuard, patch_model
    from hf_fp8.integrations.telemetry import Fp8Telemetry

    model = tm.build("llama", seed=0).cuda()
    patch_model(model, backend="native")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    guard = Fp8NanGuard(model, optimizer=optimizer)
    telemetry = Fp8Telemetry(model, sample_layers=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda")
    staged = []
    for step in range(6):
        telemetry.arm()
        loss = model(input_ids=ids, labels=ids).loss
        torch.cuda.set_sync_debug_mode("error" if step >= 4 else "default")
        try:
            loss.backward()
            assert guard.check(step=step)
            optimizer.step()
            optimizer.zero_grad()
            staged.append(telemetry.stage())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    guard.flush()
    logs = staged[-1].read()
    assert logs["fp8/scale_fwd_max"] > 0 and logs["fp8/scale_bwd_max"] > 0
