"""``prepare_reference``: a frozen model that only runs forwards (DPO's reference model), run as the
FP8 policy beside it runs.

A preference trainer (TRL's ``DPOTrainer``) runs a reference model beside the policy it trains and
scores both on the same batches; its loss is a function of the difference of their log-probs, and at the
first step, where both hold the same weights, that difference must be zero (DPO starts at ln 2). The
policy the Trainer callback patches is compiled on an FP8 GPU (:func:`hf_fp8.compile`), with the
callback's recipe. So the reference runs the same compiled FP8 path, with the same recipe, casting its
weights as the policy does. On one H200 at the Llama-3.2-1B shape (8 sequences of 1024 tokens), the
summed log-probs of an eager FP8 reference differed from the compiled policy's by up to 16 nats a
sequence, those of a compiled reference with weights stored in FP8 (``reference-fp8``, cast once,
outside the compiled graph) by up to 8, and a compiled reference casting as the policy does by none.
With the ``backward-fp8`` recipe (forwards in high precision) the two forwards are the same high-precision
computation, and DPO's log-ratios carry no FP8 rounding after the first step either.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hf_fp8.checks import check_model
from hf_fp8.integrations.compiled import compile_model, compiles_by_default
from hf_fp8.patching.default_recipe import resolve_recipe
from hf_fp8.patching.patch import patch_model
from hf_fp8.recipe import Fp8Recipe
from hf_fp8.report import PatchReport

__all__ = ["prepare_reference"]


def prepare_reference(
    model: nn.Module,
    recipe: Fp8Recipe | str | None = None,
    backend: str = "auto",
    compile: bool | None = None,
) -> PatchReport:
    """Freeze ``model`` (no parameter requires a gradient), patch it with the policy's recipe (its
    forwards as the policy's: in FP8, in eval mode too, or in high precision under ``backward-fp8``), and
    compile it block by block as the Trainer callback compiles the policy.

    ``recipe`` is the policy's (``None``: the callback's default, the recipe ``hf-fp8 launch`` handed
    over, else ``patch_model``'s default for the reference's weights, ``backward-fp8`` for a
    checkpoint's, as for a policy loaded from the same one); FP8 in eval mode is switched on.
    ``"reference-fp8"`` stores the weights in FP8 instead (half the memory of a BF16 reference), at the
    price of scoring the first step slightly otherwise than the policy. ``compile=None`` (default)
    compiles when the backend compiles and an FP8 GPU is there to run it (the CPU stays eager, as the
    policy does). Pass the model to the trainer as it is (``DPOTrainer(ref_model=model)``). Returns the
    report. A reference kept in BF16 needs none of this: pass it unpatched.
    """
    check_model(model, "prepare_reference")
    if compile not in (None, True, False):
        raise TypeError(
            f"prepare_reference: compile must be True, False or None (compile on an FP8 GPU), got {compile!r}"
        )
    model.requires_grad_(False)
    recipe = dataclasses.replace(resolve_recipe(recipe, model, backend)[0], use_during_eval=True)
    report = patch_model(model, recipe, backend=backend)
    report.notes.append("a frozen reference model: its forwards run as the policy's, its weights never train")
    if compile or (compile is None and compiles_by_default(model, _fp8_device(model), sharded=False)):
        compile_model(model)
        report.notes.append("compiled block by block (hf_fp8.compile) by prepare_reference")
    return report


def _fp8_device(model: nn.Module) -> torch.device:
    """Where ``model`` will run: its parameters' GPU, or the current GPU for a model still on the CPU
    (the trainer moves it there)."""
    devices = {p.device for p in model.parameters()}
    on_gpu = next((d for d in devices if d.type == "cuda"), None)
    if on_gpu is not None:
        return on_gpu
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
