"""``Fp8Linear`` and ``Fp8Conv1D``: the native backend's FP8 layers, on ``torch.float8_*`` and
``torch._scaled_mm`` (:mod:`hf_fp8.numerics.gemm`).

They run wherever ``torch._scaled_mm`` does (Hopper and Ada GPUs; the CPU in torch >= 2.13), so the
FP8 numerics of training are the same in CPU tests and on the GPU. Each is a subclass of the layer it
replaces and shares its ``weight`` / ``bias`` parameters, so ``isinstance`` checks, PEFT's dispatch
and HF ``state_dict`` keys keep working.

Per tensor role (input, weight, grad_output) a layer keeps an amax history and a scale
(:mod:`hf_fp8.layers.fp8_scaled`); see :mod:`hf_fp8.numerics.scaling` for how they are used and updated.

With the recipe's ``fp8_weights``, a frozen weight is stored in FP8 (one byte a value plus a scale):
quantized once, never re-cast, no weight gradient and no high-precision copy on the device.
``state_dict`` still gives (and takes) the weight in its original dtype, so checkpoints stay HF's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from hf_fp8.autocast import fp8_forced, in_generation
from hf_fp8.formats import FP8_ALIGNMENT
from hf_fp8.layers.fp8_scaled import Fp8Scaled
from hf_fp8.layers.fsdp import gathered_shard, plain_weight, release_weight
from hf_fp8.layers.stored_weight import Fp8GatheredWeight, Fp8StoredWeight
from hf_fp8.numerics.blockwise import block_linear
from hf_fp8.numerics.gemm import fp8_linear
from hf_fp8.numerics.rowwise import rowwise_linear
from hf_fp8.numerics.scaling import INPUT, ROLES, WEIGHT
from hf_fp8.recipe import Fp8Recipe

__all__ = ["PLAIN_BELOW_ROWS", "Fp8Conv1D", "Fp8Linear", "Fp8Module"]

# A generation step in training mode (RL trainers generate with the model they train: a forward without
# gradient given a KV cache) over fewer rows than this runs the plain layer when the weight is kept in
# high precision. Without a gradient there is no weight-gradient GEMM to share the weight's cast with:
# each call casts the whole weight (read 2 bytes a value, write 1) for one GEMM. Measured on one H200
# (benchmarks/RESULTS.md, `linear_bench.py --no-grad-rows`), eager FP8 forwards ran 0.03-0.05x the plain
# BF16 layer at 8 to 256 rows and 0.18-0.46x at 4096, at every Llama-3 shape. Other forwards without
# gradient (a reference or log-prob pass) stay in FP8, as the training forward they are compared with.
# Where FP8 was asked for explicitly (``use_during_eval`` in eval mode, ``fp8_autocast(enabled=True)``)
# it runs; weights stored (or gathered) in FP8 run in FP8 at any row count, the cheaper read for them.
PLAIN_BELOW_ROWS = 4096


class Fp8Module(Fp8Scaled):
    """State and forward shared by the FP8 replacements of ``nn.Linear`` and HF's ``Conv1D``."""

    ROLE_NAMES = ROLES
    FORWARD_ROLES = 2
    # False: the forward GEMM runs in high precision, dgrad and wgrad in FP8 (convert_lm_head: backward,
    # every layer under backward-fp8)
    forward_in_fp8: bool = True
    # The output head with its forward in high precision (see GemmConfig.output_head)
    output_head: bool = False
    # A layer that reads the same input and whose input scale this one casts with (see share_input_scale)
    input_scale_source: Fp8Module | None = None

    def _adopt(self, source: nn.Module, recipe: Fp8Recipe | None, forward_in_fp8: bool) -> None:
        """Take over ``source``'s weight and bias (the same Parameter objects, in its very parameter
        table) and its mode; ``source`` itself is kept for :meth:`to_float`."""
        self.weight = source.weight  # refuses a weight that is not a Parameter
        self.bias = source.bias
        self.remember_float_module(source)
        self.train(source.training)
        self.init_fp8_state(recipe, self.weight.device)
        if not forward_in_fp8:
            self.forward_in_fp8 = False

    def to_float(self) -> nn.Module:
        """The layer this one was made from (its class, a subclass of ``nn.Linear`` included), with the
        same parameters (a weight stored in FP8 dequantized) and this layer's mode; a plain layer of
        the base class when this one was built directly."""
        self.dequantize_weight_()
        release_weight(self)
        plain = self.float_module or self._plain_layer()
        plain.weight = self.weight
        plain.bias = self.bias
        plain.train(self.training)
        return plain

    @property
    def weight_in_fp8(self) -> bool:
        """Whether the weight is stored in FP8 (see :meth:`quantize_weight_`)."""
        return isinstance(self.weight, Fp8StoredWeight) and not isinstance(self.weight, Fp8GatheredWeight)

    @property
    def weight_scale(self) -> torch.Tensor:
        """The scale of a weight stored in FP8 (values = FP8 data / scale)."""
        return self.weight._scale

    @torch.no_grad()
    def quantize_weight_(self) -> None:
        """Store the frozen weight in FP8 with scales from its own amax (per 128x128 block under block
        scaling, else one for the tensor), once.

        The parameter stays the same Python object (optimizers, DDP and tied references keep it) and
        keeps its shape, device and reported dtype: it becomes an :class:`Fp8StoredWeight` whose FP8
        values the GEMMs use directly. The high-precision values are freed.
        """
        if self.weight_in_fp8:
            return
        if self.weight.requires_grad:
            raise ValueError(
                "only frozen weights are stored in FP8 (a trainable weight needs its high-precision master "
                "copy); freeze it first (requires_grad=False), or leave fp8_weights off"
            )
        recipe = self.recipe
        in_blocks = recipe.in_blocks
        stored = Fp8StoredWeight.quantize(self.weight, recipe.forward_format, recipe.margin, in_blocks)
        torch.utils.swap_tensors(self.weight, nn.Parameter(stored, requires_grad=False))
        if not in_blocks:
            self.scale[WEIGHT] = stored._scale  # what the GEMMs apply (they record no scale for it)

    def share_input_scale(self, source: Fp8Module | None) -> None:
        """Cast the input with ``source``'s stored input scale (``None``: this layer's own) once a step
        has shown that both read the same tensor (:mod:`hf_fp8.layers.shared_inputs`): the values are
        equal, and one buffer lets a compiled block cast the input once for both. Kept outside the
        submodules, as ``float_module`` is."""
        object.__setattr__(self, "input_scale_source", source)

    def store_weights_in_fp8(self) -> None:
        """:meth:`quantize_weight_`, under the name every native FP8 module answers to."""
        self.quantize_weight_()

    @torch.no_grad()
    def dequantize_weight_(self) -> None:
        """Undo :meth:`quantize_weight_`: the weight back as a plain tensor (FP8-rounded values)."""
        if self.weight_in_fp8:
            torch.utils.swap_tensors(self.weight, nn.Parameter(self.weight.dequantize(), requires_grad=False))

    def dequantized_weight(self, device: torch.device | None = None) -> torch.Tensor:
        """The weight as a plain tensor in its dtype (a temporary when it is stored in FP8)."""
        if not self.weight_in_fp8:
            return self.weight
        return self.weight.dequantize(device)

    def step_end_amaxes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The weight, under tensorwise scaling with FP8 forwards: its amax, the same whichever forward
        of the step reads it, is taken at the step's end with every other layer's in one batch. A cast
        with the stored scale then takes none: one reduction per layer less in the step. A weight FSDP2
        all-gathers in FP8 gives the shard it was gathered from. With forwards in high precision the
        backward's cast of the weight, its only one, takes the amax (see gemm.py)."""
        if self.weight_in_fp8 or not self.recipe.tensorwise:
            return []
        shard = gathered_shard(self)
        # gathered, but not from a shard of this rank (not under FSDP2); or cast by the backward
        if shard is None and (isinstance(self.weight, Fp8GatheredWeight) or not self.forward_in_fp8):
            return []
        return [(self.amax_history[WEIGHT, 0], self.weight if shard is None else shard)]

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        # a weight FSDP2 all-gathers in FP8 is saved as its plain values
        destination[prefix + "weight"] = plain_weight(destination[prefix + "weight"])
        if self.weight_in_fp8:  # checkpoints keep HF's dtype; dequantized on the host, one layer at a time
            destination[prefix + "weight"] = self.dequantized_weight(torch.device("cpu"))

    def plain_is_faster(self, x: torch.Tensor) -> bool:
        """Whether this forward runs the plain layer because it is faster there: a generation step in
        training mode, fewer rows than :data:`PLAIN_BELOW_ROWS`, a weight in high precision, and FP8 not
        forced by :func:`hf_fp8.fp8_autocast` (see there)."""
        if not self.training or torch.is_grad_enabled() or not in_generation() or self.weight_in_fp8:
            return False
        if isinstance(self.weight, Fp8GatheredWeight):
            return False
        if fp8_forced():
            return False
        return x.numel() // x.shape[-1] < PLAIN_BELOW_ROWS

    def _fp8_forward(self, x: torch.Tensor, transposed: bool, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` in FP8, for the weight stored as W (out, in), or as W.T when ``transposed``."""
        stored, gathered = self.weight_in_fp8, isinstance(self.weight, Fp8GatheredWeight)
        scaling = self.recipe.scaling
        if stored and self.weight.in_blocks and not self.recipe.in_blocks:
            stored = False  # stored in blocks (from a fine-grained checkpoint): cast from its values
        if stored and self.weight.requires_grad:
            raise RuntimeError(
                "this layer's weight is stored in FP8 (fp8_weights) and cannot train; keep it frozen, or "
                "call dequantize_weight_() first to train it in its original precision"
            )
        # A weight already in FP8 (stored, or all-gathered so by FSDP2) goes to the GEMMs as it is; the
        # gradient of a gathered one goes to the parameter.
        weight = self.weight._data if stored else self.dequantized_weight()
        weight_fp8 = self.weight._data if stored or gathered else None
        if transposed:
            weight = weight.t()
            weight_fp8 = weight_fp8.t() if weight_fp8 is not None else None
        weight_scale = self.weight._scale if stored or gathered else None
        device_type = x.device.type
        config = self.gemm_config(x)._replace(
            forward_in_fp8=self.forward_in_fp8, output_head=self.output_head
        )
        # Only training forwards that build a graph are steps: a no_grad reference forward leaves the
        # amax histories alone.
        record = self.training and torch.is_grad_enabled()
        with torch.autocast(device_type, enabled=False):
            if self.recipe.in_blocks:
                stored_blocks = None
                if stored:  # its values and block scales as they are (transposed with the weight)
                    data, scales = self.weight._data, self.weight._scale
                    stored_blocks = (data.t().contiguous(), scales.t()) if transposed else (data, scales)
                scaling = (self.amax_history, self.scale, self.backward_record())
                gw_rowwise = self.recipe.scaling == "block_gw_rowwise"
                return block_linear(x, weight, bias, *scaling, record, config, stored_blocks, gw_rowwise)
            if scaling in ("rowwise", "rowwise_gw_hp"):  # cast from the weight's own values
                plain = self.dequantized_weight()
                plain = plain.t() if transposed else plain
                gw_in_fp8 = scaling == "rowwise"
                scaling = (self.amax_history, self.scale, self.backward_record())
                return rowwise_linear(x, plain, bias, *scaling, record, config, gw_in_fp8)
            # the source's scale where it lives on x's device (not for nn.DataParallel's other replicas)
            source = self.input_scale_source
            shared = (
                source is not None
                and config.stored_scales[INPUT]
                and source.stored_scales[INPUT]
                and source.scale.device == x.device
            )
            return fp8_linear(
                x,
                weight,
                bias,
                self.amax_history,
                self.scale,
                self.backward_record(),
                weight_fp8,
                weight_scale,
                record,
                config,
                self.cast_counts,
                source.scale if shared else None,
            )

    def _fp8_repr(self) -> str:
        r = self.recipe
        forward = "" if self.forward_in_fp8 else ", forward in high precision"
        return f"format={r.format}, scaling={r.scaling}, margin={r.margin}{forward}"


class Fp8Linear(Fp8Module, nn.Linear):
    """``nn.Linear`` whose three GEMMs run in FP8 while FP8 is active (see :mod:`hf_fp8.autocast`).

    Outside FP8 (eval mode by default) it is exactly ``nn.Linear``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        recipe: Fp8Recipe | None = None,
    ) -> None:
        _check_gemm_shape(in_features, out_features)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.init_fp8_state(recipe, self.weight.device)

    @classmethod
    def from_float(
        cls, linear: nn.Linear, recipe: Fp8Recipe | None = None, forward_in_fp8: bool = True
    ) -> Fp8Linear:
        """An ``Fp8Linear`` that shares ``linear``'s parameters (same objects, so optimizers and tied
        weights stay valid); ``forward_in_fp8=False`` keeps its forward GEMM in high precision and
        runs only the backward's two in FP8 (the output head's exact logits; every layer under
        ``backward-fp8``)."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe)
        new._adopt(linear, recipe, forward_in_fp8)
        return new

    def _plain_layer(self) -> nn.Linear:
        with torch.device("meta"):
            return nn.Linear(self.in_features, self.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled or _nothing_to_quantize(x) or self.plain_is_faster(x):
            return F.linear(x, self.dequantized_weight(), self.bias)
        return self._fp8_forward(x, False, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self._fp8_repr()}"


class Fp8Conv1D(Fp8Module, Conv1D):
    """FP8 version of transformers' ``Conv1D`` (GPT-2 and kin): a linear layer whose ``weight`` is stored
    transposed, as (in, out). The parameter keeps that shape, so checkpoints keep loading."""

    def __init__(self, nf: int, nx: int, recipe: Fp8Recipe | None = None) -> None:
        _check_gemm_shape(nx, nf)
        super().__init__(nf, nx)
        self.init_fp8_state(recipe, self.weight.device)

    @classmethod
    def from_float(
        cls, conv: Conv1D, recipe: Fp8Recipe | None = None, forward_in_fp8: bool = True
    ) -> Fp8Conv1D:
        """An ``Fp8Conv1D`` sharing ``conv``'s parameters (``forward_in_fp8`` as for ``Fp8Linear``)."""
        with torch.device("meta"):
            new = cls(conv.nf, conv.nx, recipe=recipe)
        new._adopt(conv, recipe, forward_in_fp8)
        return new

    def _plain_layer(self) -> Conv1D:
        with torch.device("meta"):
            return Conv1D(self.nf, self.nx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled or _nothing_to_quantize(x) or self.plain_is_faster(x):
            out = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.dequantized_weight())
            return out.reshape(*x.shape[:-1], self.nf)
        return self._fp8_forward(x, True, self.bias)

    def __repr__(self) -> str:
        return f"Fp8Conv1D(nf={self.nf}, nx={self.nx}, {self._fp8_repr()})"


def _nothing_to_quantize(x: torch.Tensor) -> bool:
    """No rows (an empty batch) or no data (the meta device, shapes only): the plain layer's result,
    with nothing recorded."""
    return x.numel() == 0 or x.is_meta


def _check_gemm_shape(in_features: int, out_features: int) -> None:
    dims = (("in_features", in_features), ("out_features", out_features))
    bad = {name: n for name, n in dims if n % FP8_ALIGNMENT}
    if bad:
        detail = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(
            f"FP8 GEMMs need both dimensions divisible by 16, got {detail}; keep this layer in high "
            "precision (patch_model skips it by itself) or pad its weight"
        )
