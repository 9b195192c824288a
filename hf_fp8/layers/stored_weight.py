"""``Fp8StoredWeight``: a frozen weight kept in FP8 that still looks like the weight it was.

The values live in FP8 (one byte each) with float32 scales: one for the whole tensor, or one per 128x128
block (block scaling, and the fine-grained FP8 checkpoints of DeepSeek-V3 and Qwen3-FP8); the tensor
reports the shape, device and the dtype of the weight it was made from. So code that reads
``weight.dtype`` (PEFT when it creates adapters, T5's feed-forward, ``model.dtype``) sees BF16 or
float32, not an FP8 dtype.

The FP8 layers read ``_data`` and ``_scale`` and run their GEMMs on them directly. Everything else
done with the tensor sees its dequantized values: any other operation computes on a temporary
high-precision copy. ``.to(device)`` moves the FP8 values; ``.to(dtype)`` keeps them and changes the
dtype the weight reports and dequantizes to. ``copy_`` into it quantizes; other in-place operations
are refused, since they would change a temporary copy and silently nothing else.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from hf_fp8.formats import E4M3, E5M2, Fp8Format, cast_to_fp8, compute_scale
from hf_fp8.numerics.blockwise import cast_blocks, expand_block_scales

__all__ = ["Fp8GatheredWeight", "Fp8StoredWeight"]

_aten = torch.ops.aten
# Views of the weight that stay in FP8 (the same values, maybe another shape or layout): FSDP2 shapes
# its gathered weights with some, Conv1D transposes them.
_VIEWS = (
    _aten.detach.default,
    _aten.alias.default,
    _aten.as_strided.default,
    _aten.view.default,
    _aten.t.default,
    _aten.transpose.int,
)


class Fp8StoredWeight(torch.Tensor):
    """FP8 values ``_data`` and their scale ``_scale`` (``values = _data / _scale``), reporting ``dtype``.
    ``_scale`` is one float32 value, or one per 128x128 block of ``_data`` (:attr:`in_blocks`).
    ``_margin`` is the recipe margin its scales are computed with, now and when new values come in."""

    _data: torch.Tensor
    _scale: torch.Tensor
    _margin: int

    @staticmethod
    def __new__(
        cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, margin: int = 0
    ) -> Fp8StoredWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, margin: int = 0) -> None:
        self._data = data
        self._scale = scale
        self._margin = margin

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, fmt: Fp8Format, margin: int, in_blocks: bool = False
    ) -> Fp8StoredWeight:
        """``weight`` in ``fmt`` with a scale from its own amax, or per 128x128 block (``in_blocks``)."""
        weight = weight.detach()
        if in_blocks:
            return cls(*cast_blocks(weight, fmt, margin), weight.dtype, margin)
        scale = compute_scale(weight.abs().amax().float(), fmt, margin)
        return cls(cast_to_fp8(weight, scale, fmt), scale, weight.dtype, margin)

    @property
    def in_blocks(self) -> bool:
        """Whether the values have a scale per 128x128 block (else one for the whole tensor)."""
        return self._scale.dim() == 2

    def dequantize(self, device: torch.device | None = None) -> torch.Tensor:
        """The values in the reported dtype, as a plain tensor (on ``device`` when given)."""
        data, scale = self._data, self._scale
        if device is not None:
            data, scale = data.to(device), scale.to(device)
        if self.in_blocks:
            scale = expand_block_scales(scale, *data.shape)
        return (data.float() / scale).to(self.dtype)

    def __repr__(self) -> str:
        # no .item(): a repr must not wait for the GPU, nor fail on the fake tensors of torch.compile
        return f"{type(self).__name__}({self._data.dtype} values, shape {tuple(self.shape)}, as {self.dtype})"

    # torch.compile sees through the wrapper to its two tensors.
    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype, self._margin)

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size, outer_stride) -> Fp8StoredWeight:
        return Fp8StoredWeight(inner["_data"], inner["_scale"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:
            weight, *rest = args
            data = func(weight._data, *rest, **kwargs)
            return cls(data, _view_scale(weight, data, func), weight.dtype, weight._margin)
        if func is _aten.clone.default:
            (weight,) = args
            return cls(weight._data.clone(), weight._scale.clone(), weight.dtype, weight._margin)
        if func is _aten._to_copy.default:
            (weight,) = args
            device = kwargs.get("device") or weight.device
            dtype = kwargs.get("dtype") or weight.dtype
            return cls(weight._data.to(device), weight._scale.to(device), dtype, weight._margin)
        if func is _aten.copy_.default and isinstance(args[0], cls):
            target, source = args[0], args[1]
            source = source.dequantize() if isinstance(source, cls) else source
            fmt = E4M3 if target._data.dtype == E4M3.dtype else E5M2
            incoming = cls.quantize(source.to(target._data.device), fmt, target._margin, target.in_blocks)
            target._data.copy_(incoming._data)
            target._scale.copy_(incoming._scale)
            return target

        if func._schema.is_mutable and isinstance(args[0], cls):
            raise RuntimeError(
                f"{func.__name__} would change a weight stored in FP8 (fp8_weights), whose values are "
                "read-only; call the layer's dequantize_weight_() first (hf_fp8.peft.merge_and_unload does "
                "that for merging LoRA adapters)"
            )

        def plain(t):
            return t.dequantize() if isinstance(t, cls) else t

        return func(*tree_map(plain, args), **tree_map(plain, kwargs))


def _view_scale(weight: Fp8StoredWeight, data: torch.Tensor, func) -> torch.Tensor:
    """The scale of a view of ``weight``'s values: its own, or its block scales transposed with them."""
    if not weight.in_blocks:
        return weight._scale
    if func in (_aten.t.default, _aten.transpose.int):
        return weight._scale.t()  # of a 2-D weight: (rows, cols) -> (cols, rows)
    if data.shape == weight._data.shape and data.stride() == weight._data.stride():
        return weight._scale
    raise RuntimeError(
        f"a weight stored in FP8 with 128x128 block scales cannot be viewed as {tuple(data.shape)} (from "
        f"{tuple(weight._data.shape)}): its blocks would no longer line up; dequantize() it first"
    )


class Fp8GatheredWeight(Fp8StoredWeight):
    """A trainable weight as FSDP2 all-gathered it in FP8 (:mod:`hf_fp8.layers.fsdp`), for one forward and
    backward: the FP8 layers run their GEMMs on its values, and its gradient (in the reported dtype)
    goes back to the sharded weight. Anything else sees its dequantized values, as for a stored weight."""

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: tuple, outer_size, outer_stride) -> Fp8GatheredWeight:
        return Fp8GatheredWeight(inner["_data"], inner["_scale"], *meta)
