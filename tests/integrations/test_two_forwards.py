"""Two training forwards before one backward (DPO, contrastive losses): one step, compiled as eager.

A compiled graph checks at its backward that the tensors it saved are unchanged. The backwards of FP8
layers record into a backward record the step's end folds into the scaling state, so the second
forward's records into that state change nothing the first forward's backward reads.
"""

from __future__ import annotations

import copy

import pytest
import tiny_models as tm
import torch

import hf_fp8
from hf_fp8.layers.fp8_scaled import Fp8Scaled

# A compiled graph skips its saved-tensor check for tensors an autograd Function keeps on ctx (as the
# backward record is kept) from torch 2.11 on; before, the second backward fails that check.
pytestmark = pytest.mark.skipif(
    tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 11), reason="needs torch 2.11 or later"
)


def two_forward_steps(model: torch.nn.Module, arch: str, steps: int = 3) -> list[float]:
    """``steps`` steps of ``loss(batch a) + loss(batch b)``, both forwards before the one backward."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        first, second = (
            {key: t.to(device) for key, t in tm.batch_for(arch, 32, seed=2 * step + k).items()}
            for k in (0, 1)
        )
        loss = model(**first).loss + model(**second).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def fp8_modules(model: torch.nn.Module) -> dict[str, Fp8Scaled]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Fp8Scaled)}


def assert_same_state(eager: torch.nn.Module, compiled: torch.nn.Module, rtol: float) -> None:
    compiled_modules = fp8_modules(compiled)
    for name, layer in fp8_modules(eager).items():
        other = compiled_modules[name]
        for mine, theirs in ((layer.amax_history, other.amax_history), (layer.scale, other.scale)):
            torch.testing.assert_close(theirs, mine, rtol=rtol, atol=0, msg=name)
        assert not other.backward_amax.any() and not other.backward_scale.any(), "folded at the step's end"


@pytest.mark.parametrize(
    ("arch", "recipe", "backend"),
    [
        ("llama", {}, "aot_eager"),
        ("llama", {}, "inductor"),
        ("llama", {"scaling": "current", "convert_lm_head": "backward"}, "aot_eager"),
        ("llama", {"scaling": "rowwise", "format": "e4m3"}, "aot_eager"),
        ("llama", {"scaling": "block", "format": "e4m3"}, "aot_eager"),
        ("mixtral", {"convert_experts": True}, "aot_eager"),
    ],
    ids=["delayed", "delayed-inductor", "current-head", "rowwise", "block", "fp8-experts"],
)
def test_two_forwards_then_one_backward_train_compiled_as_eager(arch, recipe, backend):
    """Compiled, the second forward used to fail the first one's backward ("modified by an inplace
    operation", a layer's amax history). Now the losses and every layer's state match eager's: with
    Dynamo's own autograd (aot_eager) to the bit; with Inductor, whose fused kernels round otherwise,
    to float32 rounding. The gradients' amaxes reach the history."""
    torch._dynamo.reset()
    eager = tm.build(arch)
    hf_fp8.patch_model(eager, hf_fp8.Fp8Recipe(**recipe))
    compiled = copy.deepcopy(eager)
    tm.with_compiled_loss(eager)
    hf_fp8.compile(compiled, backend=backend)
    reference = two_forward_steps(eager, arch)
    losses = two_forward_steps(compiled, arch)
    if backend == "aot_eager":
        assert losses == reference
        assert_same_state(eager, compiled, rtol=0)
    else:
        assert losses == pytest.approx(reference, rel=1e-6)
        assert_same_state(eager, compiled, rtol=1e-5)
    grad_amaxes = [m.amax_history[m.FORWARD_ROLES :, 1] for m in fp8_modules(compiled).values()]
    assert all(a.gt(0).all() for a in grad_amaxes), "the last step's gradient amaxes, rolled to slot 1"


def test_two_forwards_count_their_casts_compiled_as_eager():
    """Telemetry's cast counts (a backward's into its own record, added in at the step's end): the same
    statistics for a compiled model's two-forward step as for eager's."""
    torch._dynamo.reset()
    eager = tm.build("llama")
    hf_fp8.patch_model(eager)
    compiled = copy.deepcopy(eager)
    tm.with_compiled_loss(eager)
    hf_fp8.compile(compiled, backend="aot_eager")
    logs = []
    for model in (eager, compiled):
        telemetry = hf_fp8.Fp8Telemetry(model)
        two_forward_steps(model, "llama", steps=2)
        telemetry.arm()
        two_forward_steps(model, "llama", steps=1)
        logs.append(telemetry.collect())
    assert logs[0] == logs[1]
    # telemetry reports a direction's statistics only where it counted casts: the backward's reached it
    assert {"fp8/saturated_bwd", "fp8/flushed_bwd"} <= logs[0].keys()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_two_forwards_then_one_backward_train_compiled_like_eager(mode):
    """On the GPU, Inductor's Triton casts (and with ``reduce-overhead`` CUDA graphs): the two-forward
    step trains like eager's, the output head's backward in FP8 too."""
    torch._dynamo.reset()
    eager = tm.build("llama").cuda().to(torch.bfloat16)
    hf_fp8.patch_model(eager, "head-backward", backend="native")
    compiled = copy.deepcopy(eager)
    hf_fp8.compile(compiled, mode=mode)
    reference = two_forward_steps(eager, "llama", steps=5)
    losses = two_forward_steps(compiled, "llama", steps=5)
    # in BF16 the two runs' FP8 roundings part after the first step: the losses compare, the states not
    assert losses == pytest.approx(reference, rel=2e-2)
    for module in fp8_modules(compiled).values():
        assert module.amax_history[module.FORWARD_ROLES :, 1].gt(0).all() and not module.backward_amax.any()
