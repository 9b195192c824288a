"""The interface every FP8 backend implements, and the scaling state it reports.

``patch_model`` walks the model and decides which modules convert (:mod:`hf_fp8.layers.selection`); a backend
does the rest: it builds the FP8 replacements, optionally fuses whole blocks, wraps each forward in its
context, ends each FP8 step, undoes itself, and says which tensors are each FP8 layer's scaling state.
Nothing outside ``hf_fp8/backends`` knows which backend it talks to; a new backend is a new file with a
subclass of :class:`Fp8Backend`, listed in ``BACKENDS`` in :mod:`hf_fp8.backends.registry`.

A backend class answers questions about the machine and the recipe (``usable``, ``check``) and about
single modules (``owns``, ``layer_scaling``, ``to_plain``); an instance belongs to one patched model and
keeps what that model's patch needs (its FP8 layers, a translated recipe, what to put back on undo).
What a layer's scaling state looks like is :mod:`hf_fp8.layers.layer_scaling`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hf_fp8.layers.layer_scaling import LayerScaling
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import ModuleRecord, PatchReport

__all__ = ["Fp8Backend", "FusedBlock", "Replaced", "data_parallel_refusal"]


@dataclass(frozen=True)
class Replaced:
    """A module the walk replaced: where it stood and what stood there (to undo a failed walk or an
    applied patch)."""

    path: str
    original: nn.Module | None


@dataclass
class FusedBlock:
    """A block a backend fused: the report entries of the HF modules it covers, the new modules to set
    (by path inside the block), and hooks that keep the block's checkpoint keys HF's."""

    records: list[ModuleRecord]
    replacements: list[tuple[str, nn.Module]]
    handles: list[RemovableHandle] = field(default_factory=list)


class Fp8Backend(ABC):
    """One way of running FP8 GEMMs. Subclasses set ``name`` and implement the abstract methods."""

    name: ClassVar[str]
    # Why norms stay in high precision with this backend; None when it converts them (convert_norm).
    keeps_norms: ClassVar[str | None] = "norm: not a GEMM; this backend keeps norms in high precision"
    # Why MoE experts (transformers' 3-D experts layout) stay in high precision with this backend; None
    # when it converts them (convert_experts).
    keeps_experts: ClassVar[str | None] = (
        "MoE experts: this backend has no FP8 path for them, kept in high precision"
    )
    # Whether its FP8 modules run under torch.compile (hf_fp8.compile refuses backends that do not).
    compiles: ClassVar[bool] = True
    # Why activation checkpointing does not work with this backend (None: it does).
    recompute_problem: ClassVar[str | None] = None
    # Why a model of this backend is not to be sharded by FSDP (None: it trains sharded).
    fsdp_problem: ClassVar[str | None] = None
    # Why a model of this backend does not train under nn.DataParallel (None: it does).
    data_parallel_problem: ClassVar[str | None] = "hf-fp8 has not tested this backend under nn.DataParallel"
    # Why a model of this backend does not train under DeepSpeed ZeRO (None: it does).
    zero_problem: ClassVar[str | None] = "hf-fp8 has not tested this backend under DeepSpeed ZeRO"
    # Whether a patch of this backend can move to a module inside the patched model (PEFT's
    # merge_and_unload returns the base model of the PeftModel that was patched).
    movable: ClassVar[bool] = False
    # Whether fuse() fuses whole blocks (a module_filter_fn turns that off: it decides layer by layer).
    fuses_blocks: ClassVar[bool] = False

    def __init__(self, recipe: Fp8Recipe) -> None:
        self.recipe = recipe

    # ---- the machine, the recipe, single modules (no patched model needed) ----------------------

    @classmethod
    @abstractmethod
    def usable(cls, device: torch.device) -> tuple[bool, str]:
        """Whether ``backend="auto"`` should pick this backend for a model on ``device``, and why (not)."""

    @classmethod
    def check(cls, recipe: Fp8Recipe) -> None:
        """Raise with the reason and the way out when this backend cannot carry out ``recipe`` (or cannot
        run here at all); called before the model is touched."""
        return None

    @classmethod
    @abstractmethod
    def owns(cls, module: nn.Module) -> bool:
        """Whether ``module`` is already one of this backend's FP8 modules."""

    @classmethod
    @abstractmethod
    def layer_scaling(cls, name: str, module: nn.Module) -> LayerScaling | None:
        """``module``'s scaling state when it is an FP8 layer of this backend that has one (yet)."""

    @classmethod
    def to_plain(cls, module: nn.Module) -> nn.Module | None:
        """The plain module ``module`` (one of this backend's) came from, without a patch to undo;
        ``None`` when that cannot be rebuilt from the module alone."""
        return None

    # ---- conversion -------------------------------------------------------------------------------

    @abstractmethod
    def convert_linear(self, module: nn.Module, forward_in_fp8: bool = True) -> nn.Module:
        """The FP8 module that computes what ``module`` (``nn.Linear`` or ``Conv1D``) computes; with
        ``forward_in_fp8`` ``False`` its forward GEMM stays in high precision (only backends whose
        ``check`` accepts ``convert_lm_head: backward`` are asked for that)."""

    def convert_norm(self, module: nn.Module, kind: str) -> tuple[nn.Module | None, str]:
        """The replacement for a norm of ``kind`` (or ``None`` when there is none) and the report's
        reason; asked only of backends whose ``keeps_norms`` is ``None``."""
        raise NotImplementedError

    def convert_experts(self, module: nn.Module) -> nn.Module:
        """The FP8 module for an experts module; asked only of backends whose ``keeps_experts`` is
        ``None``."""
        raise NotImplementedError

    def fuse(self, name: str, block: nn.Module) -> FusedBlock | None:
        """Fused modules for a whole block, or ``None`` when this backend does not fuse it."""
        return None

    def attach(
        self, model: nn.Module, replaced: list[Replaced], report: PatchReport
    ) -> list[RemovableHandle]:
        """Called once the walk has converted ``model``: finish the patch (notes go to ``report``) and
        return hooks to remove on undo. ``replaced`` lists what the walk replaced, in order."""
        return []

    @abstractmethod
    def unpatch(self, model: nn.Module, hooks: list[RemovableHandle]) -> None:
        """Give ``model`` back its plain modules, with the same weights, and remove ``hooks`` (the
        patch's hooks, ``attach``'s among them) at the point this backend needs them gone: a backend
        whose hooks translate state-dict keys reads the weights through them first."""

    # ---- every forward, every step ----------------------------------------------------------------

    def forward_context(self, model: nn.Module, fp8: bool, group: Any) -> contextlib.AbstractContextManager:
        """Entered before the model's forward and left after it (the backward runs outside it)."""
        return contextlib.nullcontext()

    def before_forward(self, model: nn.Module) -> None:
        """Work due before a forward (e.g. storing newly frozen weights in FP8)."""
        return None

    def replica_problem(self) -> str | None:
        """Why this patch cannot train under nn.DataParallel (None: it can): the backend's reason, or
        its recipe's."""
        return self.data_parallel_problem

    def track_replica(self, replica: nn.Module) -> None:
        """``replica``, the copy of the patched model that nn.DataParallel made for one GPU, starts a
        training forward: what its FP8 layers record there must count at the step's end."""
        return None

    @abstractmethod
    def end_step(self, group: Any) -> None:
        """End an FP8 training step: reduce the step's amaxes over ``group`` (``None``: no reduction)
        and update the scales."""

    def set_recipe(self, recipe: Fp8Recipe) -> None:
        """Switch to ``recipe`` (same format and history length: a new margin, say)."""
        self.recipe = recipe

    def state_restored(self, model: nn.Module) -> None:
        """The scaling tensors were overwritten (a checkpoint loaded, a step rolled back): re-derive
        whatever the backend keeps beside them."""
        return None

    def prepare_to_load(self, model: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Make sure every layer that has saved scaling state in ``state`` has its state tensors, so
        that loading can copy into them (TE creates its state at the first forward)."""
        return None


def data_parallel_refusal(backend: str, problem: str) -> str:
    """The error for a patch that cannot train under nn.DataParallel, with the ways out."""
    return (
        f"hf_fp8: the {backend} backend cannot train under nn.DataParallel (what Trainer does on several "
        f"GPUs when the script is started without a launcher): {problem}. Start the script with a launcher, "
        "which trains with DistributedDataParallel, one process a GPU, and is faster: `hf-fp8 launch "
        "--recipe NAME script.py` or `torchrun --nproc_per_node N script.py`; or train on one GPU "
        "(CUDA_VISIBLE_DEVICES=0)"
    )
