"""The scaling index the NaN guard and the telemetry read every step: found once, found again when the
layers' state tensors are replaced (a move) or the model is patched anew, never stale."""

import tiny_models as tm
import torch

from hf_fp8 import patch_model, unpatch_model
from hf_fp8.backends.registry import fp8_layers
from hf_fp8.integrations.scaling_index import ScalingIndex


def histories(index: ScalingIndex) -> list[torch.Tensor]:
    return [role.amax_history for role in index.roles()]


def test_the_index_is_every_layers_roles_and_is_kept_between_steps():
    model = tm.build("llama")
    patch_model(model)
    index = ScalingIndex(model)
    expected = [r.amax_history for layer in fp8_layers(model) for r in layer.roles.values()]
    assert len(index.roles()) == len(expected) > 0
    assert all(torch.equal(a, b) for a, b in zip(histories(index), expected, strict=True))
    assert index.roles() is index.roles(), "found once"
    assert index.on_one_device() == torch.device("cpu")


def test_a_move_or_a_new_patch_finds_the_layers_again():
    model = tm.build("llama")
    patch_model(model)
    index = ScalingIndex(model)
    first = index.roles()
    model.to("meta")  # the layers' state tensors are replaced
    assert index.roles() is not first and all(h.is_meta for h in histories(index))
    model = tm.build("llama")
    patch_model(model)
    index = ScalingIndex(model)
    names = {layer.name for layer in index.layers()}
    unpatch_model(model)
    assert index.layers() == []
    patch_model(model, "conservative")
    assert {layer.name for layer in index.layers()} == names
    history = index.roles()[0].amax_history
    history.fill_(3.0)  # the index's views are the live state
    assert float(next(fp8_layers(model)).module.amax_history[0, 0]) == 3.0
