"""FP8 all-gather of weights under FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank casts its shard of a weight to FP8 before FSDP2 all-gathers it, so the all-gather moves one
byte a value instead of two or four, and the FP8 layer's GEMMs read the gathered FP8 weight as it is
(no second cast). With delayed scaling the weight's scale is known before the all-gather, so no
collective is added; only before a layer has a stored weight scale (its first step) are the shards'
amaxes reduced over the shard group first, so that every rank casts with the same scale.

The extension point is FSDP2's: a parameter whose local tensor has ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather``. :func:`gather_weight_in_fp8` puts a layer's weight in such a tensor,
:class:`Fp8ShardedWeight` (at patch time, before sharding, with the recipe's ``fp8_all_gather``);
the all-gather gives the layer an :class:`~hf_fp8.layers.stored_weight.Fp8GatheredWeight` for the
duration of its forward and backward. Everything else sees the weight's own values: the wrapper
forwards every operation to them, and ``state_dict`` holds them as a plain tensor (HF keys and dtype).
:func:`release_weight` undoes it.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_leaves, tree_map

from hf_fp8.formats import Fp8Format, compute_scale
from hf_fp8.layers.stored_weight import Fp8GatheredWeight
from hf_fp8.numerics.cuda_copies import cast_into
from hf_fp8.numerics.scaling import WEIGHT

__all__ = [
    "Fp8ShardedWeight",
    "check_releasable",
    "gather_weight_in_fp8",
    "gathered_shard",
    "plain_weight",
    "release_weight",
    "shard_in_fp8",
]

_aten = torch.ops.aten
# Operations whose result is still the weight (FSDP2 shards, pads and moves it with these): the result
# keeps the all-gather methods. Any other operation gives a plain tensor.
_KEEPS_WRAPPER = {
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.clone.default,
    _aten.detach.default,
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.split.Tensor,
    _aten.split_with_sizes.default,
    _aten.view.default,
    _aten._to_copy.default,
    _aten._pin_memory.default,
}


# The layer attribute holding the shard its weight was last all-gathered from (see gathered_shard): a
# plain attribute in the layer's __dict__, written and read there (not through nn.Module's __setattr__).
_GATHERED_SHARD = "fp8_gathered_shard"


class Fp8ShardedWeight(torch.Tensor):
    """A high-precision weight (after ``fully_shard``, this rank's shard of it) that FSDP2 all-gathers
    in FP8, cast with the scale of the layer it belongs to."""

    _tensor: torch.Tensor
    _layer: weakref.ReferenceType

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, layer: weakref.ReferenceType) -> Fp8ShardedWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.shape,
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, layer: weakref.ReferenceType) -> None:
        self._tensor = tensor
        self._layer = layer

    def __repr__(self) -> str:
        return f"Fp8ShardedWeight({self._tensor})"

    @property
    def layer(self) -> nn.Module | None:
        """The FP8 layer whose scale the all-gather casts with (``None`` once that layer is gone)."""
        return self._layer()

    def __deepcopy__(self, memo: dict) -> Fp8ShardedWeight:
        """A copy that belongs to the copy of its layer (when the layer is copied along, as by
        ``copy.deepcopy(model)``)."""
        layer = self.layer
        copied = Fp8ShardedWeight(copy.deepcopy(self._tensor, memo), weakref.ref(memo.get(id(layer), layer)))
        return nn.Parameter(copied, self.requires_grad) if isinstance(self, nn.Parameter) else copied

    def data_ptr(self) -> int:
        """The values' address (a wrapper has no storage of its own): Accelerate's FSDP2 preparation
        matches the optimizer's parameters to the sharded ones by it."""
        return self._tensor.data_ptr()

    @property
    def data(self) -> torch.Tensor:
        return torch.Tensor.data.__get__(self)

    @data.setter
    def data(self, values: torch.Tensor) -> None:
        """``param.data = values`` (Accelerate upcasts trainable weights to float32 this way before
        sharding): the wrapper and the values it forwards to both change."""
        values = plain_weight(values)
        torch.Tensor.data.__set__(self, Fp8ShardedWeight(values, self._layer))
        self._tensor = values

    def __tensor_flatten__(self):
        return ["_tensor"], self._layer

    @staticmethod
    def __tensor_unflatten__(inner: dict, layer, outer_size, outer_stride) -> Fp8ShardedWeight:
        return Fp8ShardedWeight(inner["_tensor"], layer)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        layer = next(a._layer for a in tree_leaves((args, kwargs)) if isinstance(a, cls))
        out = func(*tree_map(plain_weight, args), **tree_map(plain_weight, kwargs))
        if func._schema.is_mutable and isinstance(args[0], cls):
            return args[0]  # changed in place through its values
        if func not in _KEEPS_WRAPPER:
            return out
        return tree_map(lambda t: cls(t, layer) if isinstance(t, torch.Tensor) else t, out)

    def fsdp_pre_all_gather(
        self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...], module: nn.Module, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This rank's shard in FP8 (as bytes, which every backend gathers), and the scale it was cast
        with; zero rows pad an uneven last shard to the size FSDP2 gathers."""
        layer = self.layer
        recipe = layer.recipe
        fmt = recipe.forward_format
        values = self._tensor.detach()
        # The step's end takes the weight's amax from this shard (the weight may still be gathered then,
        # and the history must not change between a compiled forward and its backward, which saves it).
        layer.__dict__[_GATHERED_SHARD] = values
        if layer.stored_scale_roles()[WEIGHT]:
            scale = layer.scale[WEIGHT].to(torch.float32, copy=True)
        else:  # no stored scale yet: the whole weight's amax, the same on every rank
            amax = values.abs().amax().float() if values.numel() else values.new_zeros((), dtype=torch.float)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
            scale = compute_scale(amax, fmt, recipe.margin)
        shard = shard_in_fp8(values, scale, fmt, rows=-(-outer_size[0] // mesh.size()))
        return (shard.view(torch.uint8),), (scale, fmt.dtype, recipe.margin)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The gathered FP8 weight, reporting ``param_dtype``; FSDP2 refills ``out`` (the gathered weight
        of an earlier step, on the same buffer) from the second all-gather on."""
        (gathered,) = all_gather_outputs
        scale, fp8_dtype, margin = metadata
        if scale.is_cuda:
            # Made on FSDP2's copy-in stream, read here on the compute stream, and freed when the next
            # all-gather replaces it: the allocator must not hand its memory back to the copy-in stream
            # before this stream has read it (on two H200s the race gave wrong scales, then NaN).
            scale.record_stream(torch.cuda.current_stream(scale.device))
        data = gathered.view(fp8_dtype)
        if out is not None:
            out._scale.copy_(scale)
            return None
        return Fp8GatheredWeight(data, scale, param_dtype, margin), (gathered,)


def shard_in_fp8(values: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format, rows: int) -> torch.Tensor:
    """``values`` cast to ``fmt`` with ``scale``, as ``rows`` rows: zero rows pad an uneven last shard
    to the size FSDP2 gathers. FSDP2 calls its hook eagerly, twice a step for every weight, so on a GPU
    the cast is one pass (:mod:`hf_fp8.numerics.cuda_copies`), not four."""
    shard = torch.empty((rows, *values.shape[1:]), dtype=fmt.dtype, device=values.device)
    padding = rows - values.shape[0]
    cast_rows = shard[: values.shape[0]] if padding else shard
    cast_into(cast_rows, values, scale, fmt)
    if padding:
        shard[values.shape[0] :].zero_()
    return shard


def gather_weight_in_fp8(layer: nn.Module) -> None:
    """Have FSDP2 all-gather ``layer.weight`` in FP8 (see the module docstring). The parameter stays the
    same object (optimizers and tied references keep it), with the same values, shape and dtype.

    ``load_state_dict(assign=True)`` puts a plain tensor in the weight's place (Accelerate's FSDP2
    preparation does, sharding on the meta device and then loading the weights); a hook on the layer
    wraps that one too, before FSDP2's own hook takes the loaded shard."""
    _wrap_weight(layer)
    layer.register_load_state_dict_post_hook(_wrap_loaded_weight)


def _wrap_weight(layer: nn.Module) -> None:
    weight = layer.weight
    values = weight.detach()
    if isinstance(values, DTensor):  # sharded already: the shard is what the all-gather casts
        local = Fp8ShardedWeight(values.to_local(), weakref.ref(layer))
        mesh, placements = values.device_mesh, values.placements
        values = DTensor.from_local(
            local, mesh, placements, run_check=False, shape=values.shape, stride=values.stride()
        )
    else:
        values = Fp8ShardedWeight(values, weakref.ref(layer))
    torch.utils.swap_tensors(weight, nn.Parameter(values, weight.requires_grad))


def _wrap_loaded_weight(layer: nn.Module, incompatible_keys: Any) -> None:
    weight = layer.weight
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    if not isinstance(local, Fp8ShardedWeight):
        _wrap_weight(layer)


def gathered_shard(layer: nn.Module) -> torch.Tensor | None:
    """This rank's shard of ``layer``'s weight as FSDP2 last all-gathered it in FP8 (its values, before
    the optimizer step), or ``None`` for a weight not all-gathered in FP8: the step's end takes the
    weight's amax from it, whether the weight is sharded again by then or still gathered."""
    # Recorded by the all-gather hook, dropped by release_weight. The weight's type says it is sharded or
    # gathered (not a copy of the layer made unsharded); its local tensor is not looked at: through an
    # Fp8ShardedWeight, to_local() is a dispatch in Python for every layer at every step's end.
    if isinstance(layer.weight, (Fp8GatheredWeight, DTensor)):
        return layer.__dict__.get(_GATHERED_SHARD)
    return None


def check_releasable(layer: nn.Module) -> None:
    """Raise, before anything is changed, when ``layer`` cannot be given back: once FSDP2 has sharded
    it, FSDP2 holds on to the FP8 layer itself (it sets the gathered weights on it, and with the FP8
    all-gather gathers through it), so a plain layer in its place would not be trained by it; under
    tensor parallelism the FP8 layer carries the layout's forward."""
    if any(isinstance(p, DTensor) for p in layer.parameters(recurse=False)):
        raise ValueError(
            "this model's FP8 layers are sharded (DTensor weights: fully_shard after patching, or tensor "
            "parallelism) and hold its layout, so they cannot be swapped back; unpatch before sharding, or "
            "save its state_dict (plain weights, HF keys) and load it into an unpatched model"
        )


def release_weight(layer: nn.Module) -> None:
    """Undo :func:`gather_weight_in_fp8` (a no-op for a weight it did not wrap; see
    :func:`check_releasable` for a sharded one)."""
    weight = layer.weight
    layer.__dict__.pop(_GATHERED_SHARD, None)
    if isinstance(weight, Fp8ShardedWeight):
        torch.utils.swap_tensors(weight, nn.Parameter(weight._tensor, weight.requires_grad))


def plain_weight(t: Any) -> Any:
    """``t``'s values as a plain tensor if it is (or, as a DTensor, holds) an :class:`Fp8ShardedWeight`;
    ``t`` itself otherwise."""
    if isinstance(t, Fp8ShardedWeight):
        return t._tensor
    if isinstance(t, DTensor) and isinstance(local := t.to_local(), Fp8ShardedWeight):
        return DTensor.from_local(
            local._tensor, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
        )
    return t
