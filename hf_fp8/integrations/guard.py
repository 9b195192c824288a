"""The NaN guard: a non-finite loss, gradient or FP8 amax caught in the step it happens, before the
optimizer touches the weights, named, and handled by the recipe's ``nan_policy``.

It works in any training loop::

    guard = hf_fp8.Fp8NanGuard(model)
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        if guard.check():          # False: the step was skipped (gradients dropped, FP8 state rolled back)
            optimizer.step()
        optimizer.zero_grad()

``Fp8TrainerCallback`` runs one for the Trainer. The policies: ``raise`` (stop, naming the layer),
``skip_step`` (drop the step's gradients and roll the FP8 scaling state back to before the step),
``increase_margin`` (the same, and one more binade of headroom from then on). Skipping raises after
``max_consecutive_skips`` non-finite steps in a row: the cause is then not transient.

Given the optimizer (``Fp8NanGuard(model, optimizer=optimizer)``; the Trainer callback gives it), the
``raise`` policy does not wait for the device each step. When the optimizer can skip a step on the device
(PyTorch's fused Adam, AdamW, SGD and Adagrad read a ``found_inf`` flag, as ``GradScaler`` uses them),
:meth:`Fp8NanGuard.check` hands it the step's flag and returns at once; the weights are left as they
were by a non-finite step, and the error is raised one step later, or by :meth:`Fp8NanGuard.flush` (at
the end of training, before a checkpoint). The skipping policies must know before the optimizer steps,
and so wait for the device, as do optimizers without the flag.

The gradients of the native FP8 linear layers' weights and biases, most of a model's, are not read (at
8b-4l on one H200 the pass over all gradients took 1.6 ms of a 113 ms step; those weights are three
quarters of its bytes). Such a layer's weight gradient is a sum, over the step's tokens, of products of
its input and its output's gradient, whose amaxes the step records (their casts take them): it is finite
when those amaxes are finite, which the guard checks, and their product under 2**90 (then 2**35 tokens a
step stay far from overflow), which it checks too, naming the layer, as if non-finite. What changes such
a gradient after the backward (a gradient hook of the user's) is not watched. Shared (tied) weights,
float16 gradients and layers keeping one amax a role (``amax_history_len: 1``, which forgets it when the
step ends) are read.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from hf_fp8.checks import check_model
from hf_fp8.integrations.scaling_index import ScalingIndex
from hf_fp8.layers.linear import Fp8Module
from hf_fp8.numerics.amax_sync import default_amax_group, gathered_on, local_shard
from hf_fp8.numerics.host_copy import copy_to_host
from hf_fp8.patching.patch_state import get_state, patched_module
from hf_fp8.patching.step import discard_step, end_pending_step, scaling_snapshot, set_recipe
from hf_fp8.patching.zero import zero_refusal, zero_stage
from hf_fp8.recipe_keys import MAX_MARGIN

__all__ = ["Fp8NanGuard"]

# Above this product of a layer's input and output-gradient amaxes, the guard does not vouch for the
# layer's weight gradient (see the module docstring): |dW| <= tokens * 1.25**2 * amax_x * amax_dy.
_AMAX_PRODUCT_BOUND = 2.0**90
_BOUNDED_DTYPES = (torch.bfloat16, torch.float32)


class Fp8NanGuard:
    """Watches a patched model's steps for non-finite values (see the module docstring).

    Args:
        model: a model patched with :func:`hf_fp8.patch_model`, or a wrapper of one (PEFT, DDP,
            ``accelerator.prepare``).
        max_consecutive_skips: under ``skip_step`` / ``increase_margin``, raise after this many
            non-finite steps in a row.
    """

    def __init__(
        self,
        model: nn.Module,
        max_consecutive_skips: int = 10,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        patched = patched_module(check_model(model, "Fp8NanGuard"))
        if patched is None:
            raise ValueError("Fp8NanGuard needs a patched model: call hf_fp8.patch_model(model) first")
        self.model = model
        self._patched = patched
        self._index = ScalingIndex(model)  # every step reads every layer's histories
        self.max_consecutive_skips = max_consecutive_skips
        self.skipped_steps = 0
        self._consecutive_skips = 0
        self._handed = False
        self._losses: list[torch.Tensor] = []
        self._snapshot: list[tuple[torch.Tensor, torch.Tensor]] = []
        stage = zero_stage(patched)
        self._under_deepspeed = stage is not None
        if stage is not None and (refusal := zero_refusal(self.recipe, stage)) is not None:
            raise ValueError(f"hf_fp8: {refusal}")  # a model patched before DeepSpeed showed
        self._take_snapshot()
        self._hook = model.register_forward_hook(self._watch_loss)
        self._optimizer_hooks: list[Any] = []
        self._skip_flag: torch.Tensor | None = None  # for the optimizer's next step
        self._in_flight: tuple[torch.Tensor, torch.cuda.Event | None, int | None] | None = None
        self._bounded: _BoundedLayers | None = None
        if optimizer is not None:
            self.use_optimizer(optimizer)

    @property
    def waits_for_device(self) -> bool:
        """Whether :meth:`check` waits for the device (see the module docstring)."""
        return not self._optimizer_hooks or self.recipe.nan_policy != "raise"

    def use_optimizer(self, optimizer: Any) -> None:
        """Let the optimizer skip a non-finite step on the device, so that :meth:`check` need not wait
        for it (``raise`` policy); an optimizer that cannot (not fused, DeepSpeed's, sharded parameters)
        leaves :meth:`check` waiting. ``optimizer`` may be Accelerate's wrapper of one."""
        for hook in self._optimizer_hooks:
            hook.remove()
        self._optimizer_hooks = []
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if self._under_deepspeed or not _skips_on_device(inner):
            return
        self._optimizer_hooks = [
            inner.register_step_pre_hook(self._hand_skip_flag),
            inner.register_step_post_hook(self._take_skip_flag_back),
        ]

    @property
    def recipe(self):
        return get_state(self._patched).recipe

    def begin_step(self) -> None:
        """Optional: mark the start of a step when the FP8 state may have changed since the last
        :meth:`check` (a checkpoint was loaded), so a skipped step rolls back to the right state."""
        self._losses.clear()
        self._take_snapshot()

    def check(self, step: int | None = None) -> bool:
        """Call after the backward, before the optimizer step: ``True`` when everything was finite.

        Otherwise, under ``raise`` a ``FloatingPointError`` names what was non-finite (and where);
        under the skipping policies the gradients are dropped (the optimizer leaves parameters without
        gradients alone), the FP8 scaling state rolls back to before the step, a warning says so, and
        ``False`` is returned. ``step`` only labels the messages. When the check does not wait for the
        device (``raise`` with an optimizer that skips on the device, see the module docstring), it
        returns ``True`` and raises for a non-finite step at the next check or :meth:`flush`.
        """
        end_pending_step(self._patched)  # the state checked is the step boundary's
        flags = self._non_finite_flags()
        self._losses.clear()
        if not self.waits_for_device:
            self._skip_flag = flags.amax().float()
            previous, self._in_flight = self._in_flight, (*copy_to_host(flags), step)
            if previous is not None:
                self._raise_if_non_finite(*previous)
            return True
        problem = self._describe(flags.tolist())
        if problem is None:
            self._consecutive_skips = 0
            self._take_snapshot()
            return True
        where = f"step {step}: {problem}" if step is not None else problem
        policy = self.recipe.nan_policy
        if policy == "raise" and self._under_deepspeed:
            raise FloatingPointError(
                f"hf_fp8: {where}. Under DeepSpeed the engine may have updated the weights with this step "
                "already (it steps inside the backward): resume from the last checkpoint"
            )
        if policy == "raise":
            raise FloatingPointError(
                f"hf_fp8: {where}. The weights are not updated by this step. Set nan_policy: skip_step or "
                "increase_margin in the recipe to go on past such steps"
            )
        self._consecutive_skips += 1
        if self._consecutive_skips > self.max_consecutive_skips:
            raise FloatingPointError(
                f"hf_fp8: {where}; {self._consecutive_skips} non-finite steps in a row, which skipping does "
                "not cure. Check the data and the learning rate"
            )
        for param in self.model.parameters():
            param.grad = None
        discard_step(self._patched, self._snapshot)
        self.skipped_steps += 1
        action = "skipped the step and rolled the amax histories back"
        if policy == "increase_margin" and self.recipe.margin < MAX_MARGIN:
            set_recipe(self._patched, self.recipe.replace(margin=self.recipe.margin + 1))
            action += f", margin now {self.recipe.margin}"
        elif policy == "increase_margin":
            action += f", margin already at its maximum {MAX_MARGIN}"
        warnings.warn(f"hf_fp8: {where}; {action}", stacklevel=2)
        self._take_snapshot()
        return False

    def flush(self) -> None:
        """Raise now for a non-finite step whose check did not wait for the device (the last one)."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._raise_if_non_finite(*previous)

    def remove(self) -> None:
        """Stop watching the model's loss and the optimizer's steps."""
        self._hook.remove()
        for hook in self._optimizer_hooks:
            hook.remove()
        self._optimizer_hooks = []

    def _raise_if_non_finite(
        self, flags: torch.Tensor, ready: torch.cuda.Event | None, step: int | None
    ) -> None:
        if ready is not None:
            ready.synchronize()
        problem = self._describe(flags.tolist())
        if problem is None:
            return
        where = f"step {step}: {problem}" if step is not None else problem
        raise FloatingPointError(
            f"hf_fp8: {where}. The optimizer skipped that step, so the weights are not updated by it (the "
            "check did not wait for the device: this error comes a step later). Set nan_policy: skip_step "
            "or increase_margin in the recipe to go on past such steps"
        )

    def _hand_skip_flag(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Before the optimizer steps: its ``found_inf``, or-ed with one a ``GradScaler`` set."""
        if self._skip_flag is None:
            return
        theirs = getattr(optimizer, "found_inf", None)
        flag = self._skip_flag.to(theirs.device) if theirs is not None else self._skip_flag
        optimizer.found_inf = torch.maximum(theirs, flag) if theirs is not None else flag
        self._handed = theirs is None

    def _take_skip_flag_back(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._skip_flag is None:
            return
        if self._handed:  # a GradScaler removes its own
            del optimizer.found_inf
        self._skip_flag = None

    def _take_snapshot(self) -> None:
        self._snapshot = scaling_snapshot(self.model) if self.recipe.nan_policy != "raise" else []

    def _watch_loss(self, module: nn.Module, args: tuple, outputs: Any) -> None:
        """Keep the loss the model returned (HF models return it first, as ``loss`` or in a tuple)."""
        if isinstance(outputs, dict):
            loss = outputs.get("loss")
        elif isinstance(outputs, tuple) and outputs and torch.is_tensor(outputs[0]) and outputs[0].dim() == 0:
            loss = outputs[0]
        else:
            loss = getattr(outputs, "loss", None)
        if module.training and torch.is_tensor(loss):
            self._losses.append(loss.detach())

    @torch.no_grad()
    def _non_finite_flags(self) -> torch.Tensor:
        """On the device, 1 where this step is non-finite: ``[loss, gradients, *amaxes per layer and
        role, *amax products past the bound per bounded layer]``. Reduced over the ranks when
        distributed (one all-reduce), so that every rank sees what any rank saw and all take the same
        decision. Nothing here waits for the device."""
        model = self.model
        device = next(model.parameters()).device
        bounded = self._bounded_layers()
        # under FSDP2 each rank checks its own shards (the flags are reduced below)
        grads = [
            local_shard(p.grad)
            for p in model.parameters()
            if p.grad is not None and id(p) not in bounded.params
        ]
        histories = [r.amax_history for r in self._index.roles()]
        finite = torch.ones((), dtype=torch.bool, device=device)  # torch.tensor would wait for the GPU
        losses = [loss.to(device) for loss in self._losses]  # a model spread over GPUs: one device
        loss_ok = torch.stack(losses).isfinite().all() if losses else finite
        grad_norms = torch.stack(gathered_on(torch._foreach_norm(grads), device)) if grads else None
        grads_ok = grad_norms.isfinite().all() if grads else finite
        # max |amax| of each history, in a few fused kernels: NaN and inf survive it, nothing overflows
        amax_max = torch._foreach_norm(histories, ord=float("inf")) if histories else []
        amax_max = gathered_on(amax_max, device)
        amaxes_ok = torch.stack(amax_max).isfinite() if histories else finite.new_empty(0)
        ok = torch.cat([torch.stack([loss_ok, grads_ok]).to(device), amaxes_ok])
        # per bounded layer; a NaN amax is flagged above, and its product compares False here
        products = (
            torch.stack([amax_max[i] for i in bounded.inputs])
            * torch.stack([amax_max[g] for g in bounded.gradients])
            if bounded.names
            else finite.new_empty(0).float()
        )
        bad = torch.cat([~ok, products > _AMAX_PRODUCT_BOUND]).int()
        group = default_amax_group()
        if group is not None:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        return bad

    def _bounded_layers(self) -> _BoundedLayers:
        """The layers whose weight gradients the guard bounds instead of reading (see the module
        docstring), found again when the index is."""
        roles, layers = self._index.roles(), self._index.layers()
        # The parameters as they are now (FSDP2 or a reload may replace them): ids of live objects, so
        # an id kept here cannot be another parameter's.
        owned = [_own_parameters(layer.module) for layer in layers]
        weights = tuple(id(p) for own in owned for p in own)
        if self._bounded is not None and self._bounded.roles is roles and self._bounded.weights == weights:
            return self._bounded
        uses = Counter(id(p) for _, p in self.model.named_parameters(remove_duplicate=False))
        params, names, inputs, gradients, position = set(), [], [], [], 0
        for layer, own in zip(layers, owned, strict=True):
            order = list(layer.roles)
            # a one-slot history forgets the step's amaxes when the step ends, before the check
            kept = bool(own) and layer.module.amax_history.shape[-1] > 1
            if kept and all(uses[id(p)] == 1 and p.dtype in _BOUNDED_DTYPES for p in own):
                params.update(id(p) for p in own)
                names.append(layer.name)
                inputs.append(position + order.index("input"))
                gradients.append(position + order.index("grad_output"))
            position += len(order)
        self._bounded = _BoundedLayers(roles, weights, frozenset(params), names, inputs, gradients)
        return self._bounded

    def _describe(self, flags: list[int]) -> str | None:
        """What :meth:`_non_finite_flags` found, in words, or ``None`` when everything was finite."""
        layers = self._index.layers()
        roles = [(layer.name, name, r.direction) for layer in layers for name, r in layer.roles.items()]
        loss_bad, grad_bad = flags[:2]
        amax_bad, unbounded = flags[2 : 2 + len(roles)], flags[2 + len(roles) :]
        if not (loss_bad or grad_bad or any(amax_bad) or any(unbounded)):
            return None
        parts = []
        if any(amax_bad):
            parts.append(_first_non_finite_amax([r for r, b in zip(roles, amax_bad, strict=True) if b]))
        if any(unbounded):
            name = next(n for n, b in zip(self._bounded.names, unbounded, strict=True) if b)
            parts.append(
                f"the amaxes of layer {name!r}'s input and output gradient are too large (their product past "
                "2**90) to vouch for its weight gradient, which the guard does not read"
            )
        if loss_bad:
            parts.append("the loss is non-finite")
        if not parts:
            seen = "the loss is finite" if self._losses else "the loss was not seen (the model returned none)"
            parts.append(f"non-finite gradients outside the FP8 layers (their amaxes are finite; {seen})")
        return "; ".join(parts)


class _BoundedLayers(NamedTuple):
    """The layers whose weight gradients the guard bounds (see the module docstring), for ``roles`` (the
    index's list they were found for) and ``weights`` (the ids of every native linear layer's parameters
    then): the bounded parameters' ids, the layers' names, and the positions of their input and
    output-gradient roles among ``roles``."""

    roles: list
    weights: tuple[int, ...]
    params: frozenset[int]
    names: list[str]
    inputs: list[int]
    gradients: list[int]


def _own_parameters(module: nn.Module) -> list[torch.Tensor]:
    """A native FP8 linear layer's weight and bias (whose gradients its amaxes bound); none for others."""
    if not isinstance(module, Fp8Module):
        return []
    return [p for p in (module.weight, module.bias) if p is not None]


def _skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer`` skips a step on the device when handed ``found_inf`` (PyTorch's fused
    optimizers); not over sharded (DTensor) parameters, where the flag would be a plain tensor."""
    if not isinstance(optimizer, torch.optim.Optimizer) or not optimizer.defaults.get("fused"):
        return False
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return not any(isinstance(p, DTensor) for p in params)


def _first_non_finite_amax(bad: list[tuple[str, str, str]]) -> str:
    """Name the layer where it started: the first in forward order with a non-finite forward amax,
    else the last with a non-finite gradient amax (the first the backward reached). ``bad`` holds the
    (layer, role, direction) of each non-finite amax, in forward order."""
    forward = [n for n, _, direction in bad if direction == "fwd"]
    layer = forward[0] if forward else bad[-1][0]
    roles = [r for n, r, _ in bad if n == layer]
    return f"non-finite amax of {'/'.join(roles)} in layer {layer!r}"
