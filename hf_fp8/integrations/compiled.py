"""``hf_fp8.compile``: the fast way to train a (patched) HF model: ``torch.compile`` block by block.

A decoder has one block class repeated N times. Compiling each block (regional compilation) traces
and optimises that graph once and reuses it for every block, instead of tracing the whole model as one
graph; what a causal LM computes after its decoder (the output head, logit soft-capping or scaling,
the loss) compiles as one graph of its own, FP8 layers elsewhere outside the blocks each on their own.
What Inductor then fuses per block is what makes the native FP8 path fast: each cast, its transpose
and its amax become one kernel, fused into the norm or activation that produced the tensor.

Every graph it makes with Inductor runs one pass of this package first: attention that broadcasts a
single key/value head over all query heads (Falcon's multi-query attention) asks PyTorch for
grouped-query attention instead, the same values on its fused kernels rather than float32 math (see
:mod:`hf_fp8.integrations.multi_query`). A model that attends with ``sdpa`` attends a packed row's
sequences (TRL's padding-free batches) one by one, on variable-length flash attention, instead of
through a mask over the whole row (see :mod:`hf_fp8.integrations.packed_attention`).

With delayed scaling the first training step has no amax history yet and scales each tensor by its own
amax: a graph of its own (a Python flag per layer says which, never a branch on tensor values), run by
that step alone. Where Inductor compiles (the default backend), the blocks compile that graph with
AOTAutograd and no code generation (the ``aot_eager`` backend, after this package's graph pass), and
Inductor generates code for the steady state's graph only. The min-cut partitioner still chooses what
the backward keeps, so the first step holds about what a compiled step holds (8b-4l on an H200: the
same peak), where an eager one would hold more (8B shape under FSDP2 on two H200s: 69.1 GiB a GPU
against 61.6). Models that attend with flex attention (whose uncompiled path materializes the scores)
and blocks under gradient checkpointing (whose recomputation would compile the graph again, with
Inductor) compile it with Inductor.

A KV cache makes each block's graph depend on its layer index: one recompilation per layer, until
``torch.compile`` gives up on the block code and runs every later call eagerly, training included.
So forwards that compute a loss (training, evaluation with labels) run without a cache unless the
caller passes one or asks for it, and forwards that do use a cache (``generate()``, an evaluation
forward without labels) run eagerly, leaving the compiled training graphs as they are.
"""

from __future__ import annotations

import contextlib
import inspect
import types
import warnings
from typing import Any

import torch
from torch import nn

from hf_fp8.checks import check_model
from hf_fp8.formats import gpu_has_fp8
from hf_fp8.integrations.causal_lm_loss import causal_lm_loss, is_transformers_causal_lm_loss
from hf_fp8.integrations.graph_steps import (
    add_graph_steps,
    is_training_forward,
    replays_graphs,
    wants_cuda_graphs,
)
from hf_fp8.integrations.multi_query import aot_eager_with_graph_passes, uses_inductor, with_graph_passes
from hf_fp8.integrations.packed_attention import boundaries_for, use_packed_attention
from hf_fp8.integrations.training_logits import compile_with_detached_logits
from hf_fp8.layers.fp8_scaled import Fp8Scaled
from hf_fp8.layers.selection import output_head
from hf_fp8.module_tree import repeated_blocks
from hf_fp8.patching.forward_hooks import given_kv_cache
from hf_fp8.patching.patch_state import get_state
from hf_fp8.patching.zero import gather_blocks_whole, zero_stage

__all__ = ["compile_model", "compiles_by_default"]

_COMPILED = "_hf_fp8_compiled"  # set on a model once: compiling it again changes nothing


def compile_model(model: nn.Module, *, logits_dtype: torch.dtype | None = None, **options: Any) -> nn.Module:
    """Compile ``model``'s repeated blocks, the FP8 layers outside them, and what a causal LM computes
    after its decoder (head, logit transforms, loss; else the loss function alone) in place, and return
    ``model``.

    ``options`` go to ``torch.compile`` (``mode``, ``dynamic``, ``fullgraph``, ``backend``, ...).
    ``logits_dtype``: the dtype of the logits a causal LM's training forward returns when it computed
    its loss, written by the loss's own kernel: ``torch.float32`` where every forward's outputs are
    converted to float32 anyway (Accelerate's ``bf16`` or ``fp16`` mixed precision, the Trainer's
    ``bf16=True``; the Trainer callback and ``prepare_fp8`` pass it then); ``None`` keeps the model's
    dtype, as does a model whose head does not compile as one graph with its loss. Call it
    after ``patch_model`` (also fine on an unpatched model, as a BF16 baseline) and before training.
    Like ``torch.compile``'s ``Module.compile`` it is not undone; the model keeps its classes, its
    parameters and its ``state_dict`` keys. Under DeepSpeed ZeRO-3, call it before
    ``deepspeed.initialize``: it makes each block a ZeRO-3 leaf module, gathered whole (see
    :mod:`hf_fp8.patching.zero`). With ``mode="reduce-overhead"`` each training forward is one CUDA graph
    step (see :mod:`hf_fp8.integrations.graph_steps`), for batches of one shape.
    """
    check_model(model, "hf_fp8.compile")
    if getattr(model, _COMPILED, False):
        return model
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks to compile one at a time (no module list of "
            "one block class, nor HF's _no_split_modules); use torch.compile(model) instead"
        )
    state = get_state(model)
    if state is not None and not state.backend.compiles:
        raise ValueError(
            f"the {state.backend.name} backend does not run under torch.compile; patch with "
            "backend='native' for the compiled fast path"
        )
    _announce_emulation(model)
    options = with_graph_passes(options)  # multi-query attention on the fused kernels
    gathered = gather_blocks_whole(model, zero_stage(model))  # under ZeRO-3
    if gathered is not None and state is not None:
        state.report.notes.append(gathered)
    # The HF model itself (a PEFT model forwards attributes to it, but calls it with **kwargs).
    hf_model = next(
        (m for m in model.modules() if "use_cache" in inspect.signature(m.forward).parameters), None
    )
    if hf_model is not None:
        hf_model.register_forward_pre_hook(_route_cache, with_kwargs=True)
        hf_model.register_forward_hook(_leave_eager, with_kwargs=True, always_call=True)
        if use_packed_attention(hf_model):
            hf_model.register_forward_pre_hook(_give_packed_boundaries, with_kwargs=True)
    if wants_cuda_graphs(options):
        add_graph_steps(hf_model if hf_model is not None else model)
    if hf_model is None or not _compile_head(hf_model, blocks, options, logits_dtype):
        owner = next((m for m in model.modules() if "loss_function" in dir(type(m))), None)
        if owner is not None and callable(owner.loss_function):
            owner.loss_function = torch.compile(owner.loss_function, **options)

    for block in blocks:
        block.compile(**options)
    # FP8 layers outside the blocks that the head's graph does not hold (the head itself is inlined there
    # when it has one): eagerly, each cast of a large operand (the 8192 x 128256 logits' gradient, on the
    # Llama-3 shapes) is five passes.
    inside = {id(m) for block in blocks for m in block.modules()}
    for module in model.modules():
        if isinstance(module, Fp8Scaled) and id(module) not in inside:
            module.compile(**options)
    setattr(model, _COMPILED, True)
    return model


def compiles_by_default(model: nn.Module, device: torch.device, sharded: bool) -> bool:
    """The entry points' default (the Trainer callback, ``prepare_fp8``): compile a patched model whose
    backend compiles when it trains on a GPU with FP8, unless it will be sharded (FSDP, DeepSpeed: the
    caller opts in with ``compile=True``, as the model must be compiled before it is sharded). The CPU
    stays eager: compiling costs minutes there and buys no FP8 speed."""
    state = get_state(model)
    if sharded or state is None or not state.backend.compiles:
        return False
    return device.type == "cuda" and gpu_has_fp8(device)


def _compile_head(
    hf_model: nn.Module, blocks: list[nn.Module], options: dict[str, Any], logits_dtype: torch.dtype | None
) -> bool:
    """Compile what the causal LM computes after its decoder as one graph: the output head, whatever
    the model does to the logits (Gemma-2's soft-capping, Granite's scaling) and the loss (transformers'
    causal LM loss as :func:`~hf_fp8.integrations.causal_lm_loss.causal_lm_loss`: the same values, with
    a backward that Inductor fuses with the head's FP8 cast). Left eager, each of those is a pass over
    the whole logits (Gemma-2, 256k vocabulary: 13 ms a step of tanh and scaling on an H200), and a head
    whose vocabulary is no multiple of 8 runs on cuBLAS's unaligned kernels (GPT-2's 50257: 33 ms of a
    71 ms step on an H200); compiled, Inductor pads it. A causal LM's training forward returns its
    logits detached (see :mod:`hf_fp8.integrations.training_logits`).

    The decoder (the base model, holding every block) stays a graph break: its blocks run their own
    compiled graphs. Both become instance attributes (``forward``), methods bound to their module, so
    a deep copy of the model (an EMA or a reference model) runs its own weights; deleting them undoes
    it. As with ``nn.Module.compile`` (which the blocks get), a module then refers to itself: a deleted
    model is freed by the garbage collector (``gc.collect()``), not at once. Returns whether it applied:
    a model with no separate base model holding the blocks, or whose ``forward`` someone already
    replaced, keeps the per-piece compilation. Models with a head other than a language model's (a
    sequence classifier) take the same path."""
    decoder = getattr(hf_model, "base_model", None)
    computes_loss = "labels" in inspect.signature(hf_model.forward).parameters
    if decoder is None or decoder is hf_model or not computes_loss:
        return False
    inside = {id(m) for m in decoder.modules()}
    if any(id(block) not in inside for block in blocks):
        return False
    if not (_plain_forward(hf_model) and _plain_forward(decoder)):
        return False
    loss_function = getattr(hf_model, "loss_function", None)
    if callable(loss_function):
        # Resolved once here: HF's property logs (a graph break) each time it finds no loss_type.
        # transformers' causal LM loss becomes the same loss with a pointwise backward.
        if is_transformers_causal_lm_loss(loss_function):
            loss_function = causal_lm_loss
        hf_model.loss_function = loss_function
    # the decoder is a graph break by design: fullgraph applies to the blocks, not to this graph
    head_options = {**options, "fullgraph": False}
    attention = getattr(getattr(hf_model, "config", None), "_attn_implementation", None)
    cheap = uses_inductor(options) and attention != "flex_attention"
    decoder.__dict__[_FIRST_STEP] = (blocks, _delayed_layers(blocks) if cheap else [], hf_model)
    decoder.forward = types.MethodType(
        torch.compiler.disable(_first_step_uncompiled(type(decoder).forward)), decoder
    )
    if _has_language_head(hf_model):
        head_forward = compile_with_detached_logits(type(hf_model).forward, logits_dtype, **head_options)
    else:  # a classifier's logits are small: they keep their gradient
        head_forward = torch.compile(type(hf_model).forward, **head_options)
    hf_model.forward = types.MethodType(head_forward, hf_model)
    return True


# On the decoder: (the blocks, their FP8 layers under delayed scaling, the HF model), in its __dict__ so
# that a deep copy of the model reads its own.
_FIRST_STEP = "_hf_fp8_first_step"


def _delayed_layers(blocks: list[nn.Module]) -> list[Fp8Scaled]:
    """The blocks' FP8 layers that scale with delayed scaling (whose first step has a graph of its own)."""
    layers = (m for block in blocks for m in block.modules() if isinstance(m, Fp8Scaled))
    return [m for m in layers if m.recipe.scaling == "delayed"]


def _first_step_uncompiled(forward: Any) -> Any:
    """``forward`` (the decoder's) running its blocks' first training step on AOTAutograd alone (see the
    module docstring)."""

    def decoder_forward(decoder: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not _in_first_step(decoder):
            return forward(decoder, *args, **kwargs)
        with torch.compiler.set_stance("default", force_backend=aot_eager_with_graph_passes):
            return forward(decoder, *args, **kwargs)

    return decoder_forward


def _in_first_step(decoder: nn.Module) -> bool:
    """Whether this forward of ``decoder`` is a first training step whose blocks compile on AOTAutograd
    alone: none of their delayed-scaling layers has a stored scale yet (a run's first step, or a state
    saved before it), no block recomputes under gradient checkpointing, and the forward was not routed
    to eager execution."""
    blocks, layers, hf_model = decoder.__dict__[_FIRST_STEP]
    if not layers or not is_training_forward(decoder):
        return False
    # after the first step the first layer already has a stored scale: one check a forward from then on
    if any(any(m.stored_scale_roles()) for m in layers) or _runs_eagerly(hf_model):
        return False
    return not any(getattr(m, "gradient_checkpointing", False) for m in (decoder, *blocks))


def _has_language_head(hf_model: nn.Module) -> bool:
    """Whether ``hf_model`` ends in an output head over a vocabulary (a causal LM's ``lm_head``)."""
    return output_head(hf_model) is not None


def _plain_forward(module: nn.Module) -> bool:
    """Whether ``module.forward`` is its class's own (no wrapper of someone else's in its place)."""
    return "forward" not in vars(module)


def _announce_emulation(model: nn.Module) -> None:
    """Warn, before compiling, where the FP8 GEMMs will be emulated: compiled code does not warn (a
    warning inside it breaks the graph), and a GPU without FP8 tensor cores emulates every one."""
    if not any(isinstance(m, Fp8Scaled) for m in model.modules()):
        return
    for device in {p.device for p in model.parameters() if p.is_cuda}:
        if not gpu_has_fp8(device):
            warnings.warn(
                f"hf_fp8.compile: {torch.cuda.get_device_name(device)} has no FP8 tensor cores (compute "
                "capability below 8.9): its FP8 GEMMs are emulated exactly in float32, with FP8 numerics "
                "and no speed-up (slower than BF16)",
                stacklevel=3,
            )


_EAGER_CALLS = "_hf_fp8_eager_calls"  # a stack: forwards may nest (PEFT, a model inside a model)


def _route_cache(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Before the HF model's forward: no KV cache where a loss is computed and nobody asked for one;
    eager execution where a cache is used (see the module docstring), and under CUDA graphs for every
    forward that is not a training step (see :mod:`hf_fp8.integrations.graph_steps`)."""
    cache_given = given_kv_cache(kwargs)
    asked = kwargs.get("use_cache")
    config_wants = bool(getattr(getattr(model, "config", None), "use_cache", False))
    computes_loss = model.training or kwargs.get("labels") is not None
    if asked is None and not cache_given and computes_loss:
        kwargs = {**kwargs, "use_cache": False}
        asked = False
    uses_cache = cache_given or bool(asked) or (asked is None and config_wants)
    eager = uses_cache or (replays_graphs(model) and not is_training_forward(model))
    # set_stance takes effect when it is made, so it is made only for a forward that runs eagerly
    stance = torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()
    model.__dict__.setdefault(_EAGER_CALLS, []).append(stance)
    return args, kwargs


def _give_packed_boundaries(model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Before the HF model's forward: a packed row's sequence boundaries for its attention."""
    extra = boundaries_for(kwargs)
    return (args, {**kwargs, **extra}) if extra else None


def _runs_eagerly(model: nn.Module) -> bool:
    """Whether the HF model's forward now running was routed to eager execution (``_route_cache``)."""
    calls = model.__dict__.get(_EAGER_CALLS)
    return bool(calls) and not isinstance(calls[-1], contextlib.nullcontext)


def _leave_eager(model: nn.Module, args: tuple, kwargs: dict, outputs: Any) -> None:
    calls = model.__dict__.get(_EAGER_CALLS)
    if calls:
        calls.pop().__exit__(None, None, None)
