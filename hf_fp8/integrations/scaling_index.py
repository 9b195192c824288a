"""``ScalingIndex``: a model's FP8 layers and their scaling state by role, found once and kept.

The NaN guard and the telemetry read every layer's amax histories and scales at every step they watch.
Finding them (a walk over the modules, a view per role) took 2.4 ms of host time a step on a 16-block
Llama (112 layers, 336 roles, a 2-core EPYC), and a compiled FP8 step is short enough for host time to
leave its GPU waiting: on one H200 at the Llama-3.2-1B shape the Trainer callback's step spent 16 ms
of host time around the optimizer step against BF16's 1 ms, the GPU idle for 8 of them.

The views stay right while the layers keep their state tensors. Native layers replace them only when
moved (``Fp8Scaled._apply``; loading a state and rolling a step back copy into them), and a model is
patched again with a new patch state: so the index is kept while the patch state and every native
layer's ``amax_history`` are the ones it was built from. Layers of other backends are found afresh
each time.
"""

from __future__ import annotations

from torch import nn

from hf_fp8.backends.registry import fp8_layers
from hf_fp8.layers.fp8_scaled import Fp8Scaled
from hf_fp8.layers.layer_scaling import LayerScaling, RoleScaling
from hf_fp8.patching.patch_state import get_state

__all__ = ["ScalingIndex"]


class ScalingIndex:
    """Every FP8 layer of ``model`` with its scaling state (see :func:`fp8_layers`), and its roles in
    order, layer by layer."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._layers: list[LayerScaling] = []
        self._roles: list[RoleScaling] = []
        self._key: tuple | None = None

    def layers(self) -> list[LayerScaling]:
        self._refresh()
        return self._layers

    def roles(self) -> list[RoleScaling]:
        """Every layer's roles, in layer order and each layer's role order (flat)."""
        self._refresh()
        return self._roles

    def _refresh(self) -> None:
        if self._key is not None and self._key == self._current_key():
            return
        self._layers = list(fp8_layers(self.model))
        self._roles = [role for layer in self._layers for role in layer.roles.values()]
        native = all(isinstance(layer.module, Fp8Scaled) for layer in self._layers)
        self._key = self._current_key() if native else None

    def _current_key(self) -> tuple:
        # The patch state itself (compared by identity), and ids of histories the index keeps alive
        return (get_state(self.model), *(id(layer.module.amax_history) for layer in self._layers))
