"""FP8 for mixture-of-experts layers: transformers 5's expert modules, whose experts are 3-D weights.

Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and the other models whose experts class follows transformers'
experts interface (``gate_up_proj`` or ``up_proj``, and ``down_proj``, one matrix per expert, with the
``has_gate`` / ``is_transposed`` / ``has_bias`` flags) keep their class: :meth:`Fp8Experts.from_float`
makes an instance of a subclass of it that shares the parameters (``isinstance`` holds, checkpoint keys
do not change) and runs, while FP8 is active, both projections and their backward in FP8:

* tokens are grouped by the expert they are routed to (each token once per expert of its top-k);
* each projection casts its input once and its 3-D weight once (one tensorwise scale each, delayed
  scaling with the recipe's history, as for linear layers), then runs its forward, dgrad and wgrad as
  one grouped FP8 GEMM each on Hopper (``torch._scaled_grouped_mm``, E4M3 operands), or one FP8 GEMM
  per expert that received tokens elsewhere (:mod:`hf_fp8.numerics.grouped`);
* every tensor is E4M3, whatever the model's format (:func:`experts_recipe`): the grouped kernels take
  nothing else, and all six GEMMs stay grouped, eager and compiled;
* gating, the activation, biases and the routing weights stay in high precision; the router is not
  part of this module and stays in high precision too.

The experts of one module share one scaling state of six roles: the inputs and weights of the two
projections, and their output gradients. With the recipe's ``fp8_weights`` frozen experts are stored
in FP8 (one byte a value), for LoRA on the rest of the model.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn

from hf_fp8.formats import FP8_ALIGNMENT
from hf_fp8.layers.fp8_scaled import Fp8Scaled
from hf_fp8.layers.stored_weight import Fp8StoredWeight
from hf_fp8.numerics.gemm import GemmConfig, quantize
from hf_fp8.numerics.grouped import (
    GroupLayout,
    expert_dgrad,
    expert_forward,
    expert_wgrad,
    group_layout,
    grouped_kernels_run_on,
)
from hf_fp8.numerics.scaling import BackwardRecord, read_stored_scale
from hf_fp8.recipe import Fp8Recipe

__all__ = ["Fp8Experts", "experts_problem", "experts_recipe", "is_experts"]

# Roles of the scaling state, forward ones first.
UP_INPUT, UP_WEIGHT, DOWN_INPUT, DOWN_WEIGHT, UP_GRAD, DOWN_GRAD = range(6)


@functools.cache  # one recipe object for all experts of a model: their steps end in one batch
def experts_recipe(recipe: Fp8Recipe) -> Fp8Recipe:
    """The recipe MoE experts run under: the model's, with every tensor in E4M3. cuBLAS's grouped FP8
    GEMM takes E4M3 only, so E5M2 gradients (format ``hybrid``) would run one GEMM per expert, sized on
    the host, which neither overlaps nor compiles; DeepSeek-V3 trains its experts with E4M3 gradients."""
    return recipe if recipe.format == "e4m3" else recipe.replace(format="e4m3")


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is an experts module of transformers' experts interface (3-D expert weights)."""
    if not all(hasattr(module, flag) for flag in ("has_gate", "is_transposed", "num_experts")):
        return False
    weights = [getattr(module, name, None) for name in (_up_name(module), "down_proj")]
    return all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights)


def experts_problem(module: nn.Module) -> str | None:
    """Why an experts module cannot run in FP8 here (``None`` when it can)."""
    if getattr(module, "_is_expert_parallel", False):
        return "MoE experts sharded by expert parallelism: not supported in FP8 yet, kept in high precision"
    bad = {
        name: tuple(getattr(module, name).shape[1:])
        for name in (_up_name(module), "down_proj")
        if any(d % FP8_ALIGNMENT for d in getattr(module, name).shape[1:])
    }
    if bad:
        shapes = ", ".join(f"{k} {v}" for k, v in bad.items())
        return f"MoE experts with per-expert matrices {shapes}: FP8 GEMMs need multiples of {FP8_ALIGNMENT}"
    return None


class Fp8Experts(Fp8Scaled):
    """Mixed into a copy of an experts module's own class (see :meth:`from_float`)."""

    ROLE_NAMES = (
        "up.input",
        "up.weight",
        "down.input",
        "down.weight",
        "up.grad_output",
        "down.grad_output",
    )
    FORWARD_ROLES = 4

    @property
    def recipe(self) -> Fp8Recipe:
        """The model's recipe with every tensor in E4M3 (see :func:`experts_recipe`)."""
        return self._experts_recipe

    @recipe.setter
    def recipe(self, recipe: Fp8Recipe) -> None:
        self._experts_recipe = experts_recipe(recipe)

    @classmethod
    def from_float(cls, experts: nn.Module, recipe: Fp8Recipe | None = None) -> Fp8Experts:
        """An FP8 version of ``experts`` that shares its parameters (its very parameter table) and
        submodules; ``experts`` itself is kept for :meth:`to_float`."""
        new = _fp8_class(type(experts)).__new__(_fp8_class(type(experts)))
        new.__dict__.update(
            {
                key: copy.copy(value) if isinstance(value, dict) else value
                for key, value in experts.__dict__.items()
            }
        )
        new.remember_float_module(experts)
        device = experts.down_proj.device
        new.init_fp8_state(recipe, device)
        return new

    def to_float(self) -> nn.Module:
        """The experts module this one was made from, with the same parameters (dequantized where they
        were stored in FP8) and this module's mode."""
        self.dequantize_weights_()
        original = self.float_module
        for name, param in self._parameters.items():  # the current ones (load_state_dict(assign=True) ...)
            setattr(original, name, param)
        original.train(self.training)
        return original

    def step_end_amaxes(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The two weights (unless stored in FP8): their amaxes are taken at the step's end with every
        other layer's, so a cast with the stored scale reads the 3-D weight once, not twice."""
        slots = {_up_name(self): UP_WEIGHT, "down_proj": DOWN_WEIGHT}
        return [
            (self.amax_history[role, 0], getattr(self, name))
            for name, role in slots.items()
            if not isinstance(getattr(self, name), Fp8StoredWeight)
        ]

    # ---- FP8 storage of frozen experts ------------------------------------------------------------

    def expert_weights(self) -> list[torch.Tensor]:
        """The two 3-D weights (the up or gate-up projection, and the down projection)."""
        return [getattr(self, _up_name(self)), self.down_proj]

    @property
    def weights_in_fp8(self) -> bool:
        return isinstance(self.down_proj, Fp8StoredWeight)

    @torch.no_grad()
    def store_weights_in_fp8(self) -> None:
        """Store the frozen expert weights in FP8 (one tensorwise scale each), once."""
        for name in (_up_name(self), "down_proj"):
            weight = getattr(self, name)
            if isinstance(weight, Fp8StoredWeight):
                continue
            if weight.requires_grad:
                raise ValueError(
                    f"only frozen expert weights are stored in FP8; {name} trains (freeze it first, or leave "
                    "fp8_weights off)"
                )
            stored = Fp8StoredWeight.quantize(weight, self.recipe.forward_format, self.recipe.margin)
            torch.utils.swap_tensors(weight, nn.Parameter(stored, requires_grad=False))

    @torch.no_grad()
    def dequantize_weights_(self) -> None:
        """Undo :meth:`store_weights_in_fp8`: plain tensors again (FP8-rounded values)."""
        for name in (_up_name(self), "down_proj"):
            weight = getattr(self, name)
            if isinstance(weight, Fp8StoredWeight):
                torch.utils.swap_tensors(weight, nn.Parameter(weight.dequantize(), requires_grad=False))

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in (_up_name(self), "down_proj"):  # checkpoints keep HF's dtype
            weight = getattr(self, name)
            if isinstance(weight, Fp8StoredWeight):
                destination[prefix + name] = weight.dequantize(torch.device("cpu"))

    # ---- the forward ------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if not self.fp8_enabled or hidden_states.numel() == 0 or hidden_states.is_meta:
            return super().forward(hidden_states, top_k_index, top_k_weights)
        return _fp8_experts_forward(self, hidden_states, top_k_index, top_k_weights)


@functools.cache
def _fp8_class(experts_class: type) -> type:
    """``Fp8Experts`` combined with an experts class: the model's own forward stays reachable through
    ``super()``, and ``isinstance(module, experts_class)`` holds."""
    return type(f"Fp8{experts_class.__name__}", (Fp8Experts, experts_class), {"__module__": __name__})


def _up_name(module: nn.Module) -> str:
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def _fp8_experts_forward(
    module: Fp8Experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # each (token, choice) pair, grouped by expert
    counts = torch.zeros(module.num_experts, dtype=torch.int64, device=expert_ids.device)
    counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))  # static shape, unlike bincount
    layout = group_layout(counts, expert_ids.numel(), grouped_kernels_run_on(hidden_states.device))
    # Every row of the experts' GEMMs, in the layout they read and write (see hf_fp8.numerics.grouped):
    # each pair's token gathered once, straight into its place; zero rows where no pair is.
    pair = order[layout.source]

    def placed(t: torch.Tensor) -> torch.Tensor:
        """``t`` with zero rows at the places without a pair (only a grouped layout has any)."""
        return torch.where(layout.valid.unsqueeze(-1), t, 0) if layout.grouped else t

    rows = placed(hidden_states[pair // top_k])
    row_expert = expert_ids[pair]
    record = module.training and torch.is_grad_enabled()
    config = module.gemm_config(hidden_states)

    def project(x: torch.Tensor, name: str, roles: tuple[int, int, int]) -> torch.Tensor:
        weight = getattr(module, name)
        stored = isinstance(weight, Fp8StoredWeight)
        data, weight_scale = (weight._data, weight._scale) if stored else (weight, None)
        with torch.autocast(x.device.type, enabled=False):
            backward_record = module.backward_record()
            out = _GroupedFp8Linear.apply(
                x, data, weight_scale, layout, module.is_transposed, module.amax_history, module.scale,
                backward_record.amax, backward_record.scale, roles, record, config, module.cast_counts,
                backward_record.cast_counts,
            )  # fmt: skip
        bias = getattr(module, f"{name}_bias", None) if module.has_bias else None
        return out + bias[row_expert].to(out.dtype) if bias is not None else out

    # Places without a row are kept zero after each GEMM: past the last group the grouped kernel leaves
    # its output unwritten (NaN would reach an amax through the activation's backward, 0 * NaN).
    up = placed(project(rows, _up_name(module), (UP_INPUT, UP_WEIGHT, UP_GRAD)))
    hidden_up = module._apply_gate(up) if module.has_gate else module.act_fn(up)
    hidden_up = placed(hidden_up)  # an ungated activation with act(0) != 0
    down = project(hidden_up, "down_proj", (DOWN_INPUT, DOWN_WEIGHT, DOWN_GRAD))
    place_of_pair = torch.empty_like(order).scatter_(0, order, layout.destination)  # token by token
    down = down[place_of_pair]
    if getattr(module, "has_post_expert_norm", False):
        down = module.post_expert_norm(down)
    weighted = down * top_k_weights.reshape(-1, 1).to(down.dtype)
    return weighted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)


class _GroupedFp8Linear(torch.autograd.Function):
    """``x_e @ W_e.T`` for each expert e over its rows of ``x`` (laid out as ``layout`` says, and so is
    the result), all three GEMMs in FP8 (:mod:`hf_fp8.numerics.grouped`), one cast of ``x``, of ``W``
    and of the output gradient."""

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_scale: torch.Tensor | None,
        layout: GroupLayout,
        transposed: bool,
        amax_history: torch.Tensor,
        scale: torch.Tensor,
        backward_amax: torch.Tensor,
        backward_scale: torch.Tensor,
        roles: tuple[int, int, int],
        record: bool,
        config: GemmConfig,
        cast_counts: torch.Tensor | None,
        backward_counts: torch.Tensor | None,
    ) -> torch.Tensor:
        input_role, weight_role, grad_role = roles
        fmt = config.forward_format
        cast = functools.partial(
            quantize,
            amax_history=amax_history,
            scale=scale,
            config=config,
            record=record,
            cast_counts=cast_counts,
        )
        x_scale, x_fp8 = cast(x, input_role, fmt)
        if weight_scale is None:  # with a stored scale, the weight's amax is taken at the step's end
            record_amax = not config.stored_scales[weight_role]
            w_scale, w_fp8 = cast(weight, weight_role, fmt, record_amax=record_amax)
        else:  # frozen experts stored in FP8
            w_scale, w_fp8 = weight_scale, weight
            if record:
                scale[weight_role] = weight_scale
        x_inverse, w_inverse = x_scale.reciprocal(), w_scale.reciprocal()
        w_fp8 = w_fp8.transpose(-2, -1) if transposed else w_fp8  # (experts, out, in)
        out = expert_forward(x_fp8, w_fp8, x_inverse, w_inverse, layout, config.out_dtype)
        # the gradient's stored scale is read here: the backward never reads the state (see fp8_scaled)
        dy_stored_scale = read_stored_scale(scale, grad_role, config.stored_scales[grad_role])
        ctx.save_for_backward(x_fp8, w_fp8, x_inverse, w_inverse, dy_stored_scale)
        ctx.layout, ctx.transposed, ctx.grad_role = layout, transposed, grad_role
        ctx.backward_record = BackwardRecord(backward_amax, backward_scale, backward_counts)
        ctx.record, ctx.config = record, config
        ctx.input_dtype, ctx.weight_dtype = x.dtype, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x_fp8, w_fp8, x_inverse, w_inverse, dy_stored_scale = ctx.saved_tensors
        role, backward_record = ctx.grad_role, ctx.backward_record
        fmt = ctx.config.backward_format
        dy_scale, dy_fp8 = quantize(
            grad_output, role, fmt, backward_record.amax, backward_record.scale, ctx.config, ctx.record,
            backward_record.cast_counts,
            stored_scale=dy_stored_scale,
        )  # fmt: skip
        dy_inverse = dy_scale.reciprocal()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = expert_dgrad(dy_fp8, w_fp8, dy_inverse, w_inverse, ctx.layout, ctx.input_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = expert_wgrad(dy_fp8, x_fp8, dy_inverse, x_inverse, ctx.layout, ctx.weight_dtype)
            grad_w = grad_w.transpose(-2, -1) if ctx.transposed else grad_w
        return grad_x, grad_w, *(None,) * 12
