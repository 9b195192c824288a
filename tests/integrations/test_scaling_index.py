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


def test_scalars_are_gathered_on_one_device_and_moved_only_where_elsewhere():
    """What the guard and the telemetry stack every step: a model on one device hands its tensors back
    as they are; one spread over devices has the others moved."""
    from hf_fp8.numerics.amax_sync import gathered_on

    here = [torch.tensor(1.0), torch.tensor(2.0)]
    kept = gathered_on(here, torch.device("cpu"))
    assert all(a is b for a, b in zip(kept, here, strict=True))
    moved = gathered_on([*here, torch.empty((), device="meta")], torch.device("meta"))
    assert all(t.is_meta for t in moved)
