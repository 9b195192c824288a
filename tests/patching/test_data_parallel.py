"""nn.DataParallel, which Trainer uses on several GPUs when a script is started without a launcher: the
replicas' forwards run in a thread each, and every replica's amaxes and cast counts reach the model's
FP8 state at the step's end.

On the CPU the replicas are made as ``torch.nn.parallel.replicate`` makes them for several GPUs (the
first replica shares the model's buffers, the others hold copies; parameters reach them through an
autograd op) and run in threads as ``parallel_apply`` runs them; on two GPUs, by nn.DataParallel itself.
"""

import copy
import threading

import pytest
import tiny_models as tm
import torch

from hf_fp8 import patch_model
from hf_fp8.backends.registry import backend_for_data_parallel
from hf_fp8.integrations.checkpoint import fp8_state_dict
from hf_fp8.layers.fp8_scaled import Fp8Scaled
from hf_fp8.numerics.scaling import INPUT

REPLICAS = 2


def replicate_on_cpu(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """What ``torch.nn.parallel.replicate`` makes of ``model`` for ``count`` GPUs, on the CPU."""
    modules = list(model.modules())
    replicas = []
    for index in range(count):
        copies = {id(m): m._replicate_for_data_parallel() for m in modules}
        for module in modules:
            replica = copies[id(module)]
            for key, child in module._modules.items():
                replica._modules[key] = None if child is None else copies[id(child)]
            for key, param in module._parameters.items():
                # not a leaf (broadcast, on GPUs): the gradient flows back to the model's parameter
                setattr(replica, key, None if param is None else param.view_as(param))
            for key, buffer in module._buffers.items():
                shared = buffer is None or index == 0  # the first GPU's replica shares the buffers
                replica._buffers[key] = buffer if shared else buffer.clone()
        replicas.append(copies[id(model)])
    return replicas


def data_parallel_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """nn.DataParallel's training forward on the CPU: the batch split over the replicas, their forwards
    in a thread each, the mean of their losses (what Trainer takes of the gathered losses)."""
    split = {key: value.chunk(REPLICAS) for key, value in batch.items()}
    chunks = [{key: parts[i] for key, parts in split.items()} for i in range(REPLICAS)]
    replicas = replicate_on_cpu(model, REPLICAS)
    losses: list[torch.Tensor | None] = [None] * REPLICAS

    def run(i: int) -> None:
        losses[i] = replicas[i](**chunks[i]).loss

    threads = [threading.Thread(target=run, args=(i,)) for i in range(REPLICAS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return torch.stack(losses).mean()


def patched_pair(recipe: str = "hybrid-delayed") -> tuple[torch.nn.Module, torch.nn.Module]:
    model = tm.build("llama", seed=0)
    patch_model(model, recipe)
    return model, copy.deepcopy(model)


def count_casts(model: torch.nn.Module) -> list[Fp8Scaled]:
    layers = [m for m in model.modules() if isinstance(m, Fp8Scaled)]
    for layer in layers:
        layer.count_casts(True)
    return layers


def test_every_replicas_amaxes_and_cast_counts_reach_the_model():
    model, reference = patched_pair()
    first_half_only = copy.deepcopy(model)
    batch = tm.batch_for("llama", 32, batch_size=4)
    counted, reference_counted = count_casts(model), count_casts(reference)
    for _ in range(2):
        data_parallel_loss(model, batch).backward()
        reference(**batch).loss.backward()
    first_half_only(**{k: v[:2] for k, v in batch.items()}).loss.backward()

    state, expected = fp8_state_dict(model), fp8_state_dict(reference)
    histories = [k for k in state if k.endswith("amax_history")]
    assert all(state[k.replace("amax_history", "fp8_steps")] == 2 for k in histories)  # one step end each
    for key in histories:  # the whole batch's amaxes, as one process saw them, within FP8 rounding:
        # in its first step each replica scaled its half of the batch by that half's own amax, so the
        # layers after the first saw activations (E4M3) and gradients (E5M2) rounded differently
        torch.testing.assert_close(state[key][:2, 1:3], expected[key][:2, 1:3], rtol=2.0**-4, atol=0)
        torch.testing.assert_close(state[key][2, 1:3], expected[key][2, 1:3], rtol=2.0**-2, atol=0)
    embedded = "model.layers.0.self_attn.q_proj.amax_history"  # the first GEMM's input: exactly
    assert torch.equal(state[embedded][INPUT, 1:3], expected[embedded][INPUT, 1:3])
    # the second replica's half of the batch mattered: the first half alone saw other amaxes
    lost = fp8_state_dict(first_half_only)
    assert any(not torch.equal(state[k][:, 2], lost[k][:, 1]) for k in histories)
    assert_counts_of_every_replica(counted, reference_counted)


def assert_counts_of_every_replica(layers: list[Fp8Scaled], reference: list[Fp8Scaled]) -> None:
    """The values cast, counted over the replicas: the batch's inputs and gradients once, the weight
    once by each replica (each casts its own copy)."""
    per_role = torch.tensor([1, REPLICAS, 1])
    for layer, own in zip(layers, reference, strict=True):
        assert torch.equal(layer.cast_counts[:, 0].cpu(), own.cast_counts[:, 0].cpu() * per_role)


def test_a_replica_with_frozen_weights_stored_in_fp8_is_refused_with_the_ways_out():
    model, _ = patched_pair("lora-fp8")
    for param in model.parameters():
        param.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"nn\.DataParallel .*fp8_weights.*hf-fp8 launch.*torchrun"):
        replicate_on_cpu(model, REPLICAS)[1](**tm.batch_for("llama", 32))
    assert all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_auto_picks_a_backend_that_trains_under_data_parallel_and_te_is_refused_with_its_reason():
    assert backend_for_data_parallel("auto") == "native"
    assert backend_for_data_parallel("native") == "native"
    with pytest.raises(
        ValueError, match=r"te backend is not supported under nn\.DataParallel: .*per process"
    ):
        backend_for_data_parallel("te")


# ---- on two FP8 GPUs --------------------------------------------------------------------------------

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


@pytest.mark.gpu
@two_gpus
def test_gpu_data_parallel_trains_with_the_whole_batchs_amaxes():
    model, reference = patched_pair()
    model, reference = model.cuda(), reference.cuda()
    parallel = torch.nn.DataParallel(model)
    batch = {k: v.cuda() for k, v in tm.batch_for("llama", 64, batch_size=8).items()}
    counted, reference_counted = count_casts(model), count_casts(reference)
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            parallel(**batch).loss.mean().backward()
            reference(**batch).loss.backward()
    state, expected = fp8_state_dict(model), fp8_state_dict(reference)
    for key in [k for k in state if k.endswith("amax_history")]:  # as on the CPU, BF16 activations
        torch.testing.assert_close(state[key][:2, 1:4], expected[key][:2, 1:4], rtol=2.0**-4, atol=0)
        torch.testing.assert_close(state[key][2, 1:4], expected[key][2, 1:4], rtol=2.0**-2, atol=0)
    assert_counts_of_every_replica(counted, reference_counted)
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    reference_grads = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert torch.nn.functional.cosine_similarity(grads.float(), reference_grads.float(), dim=0) > 0.99
