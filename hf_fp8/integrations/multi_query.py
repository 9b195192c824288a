"""Multi-query attention on PyTorch's fused kernels under ``hf_fp8.compile``: an Inductor graph pass.

Some models call ``F.scaled_dot_product_attention`` with one key/value head for all query heads and
let it broadcast (HF's Falcon-7B-style multi-query attention). The fused kernels (flash, cuDNN,
memory-efficient) take no broadcast heads, so PyTorch runs the math path: float32 GEMMs and a
materialized softmax. On Falcon-7B's block at hidden size 2048 that was ~105 ms of a ~149 ms step on
an H200, the same in BF16 and FP8: more than all the linear layers together. One key/value head
broadcast to every query head is grouped-query attention with one group, so
:class:`MultiQueryAsGroupedQuery` asks for that (``enable_gqa=True``): the same values, on the fused
kernels.

The pass runs on the graph Dynamo captured, before autograd is traced, for every graph
``hf_fp8.compile`` makes with Inductor (:func:`with_graph_passes`); a call with as many key/value heads
as query heads, or one that already says ``enable_gqa=True``, is left as it is.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch._inductor import list_mode_options

try:  # torch >= 2.6: SDPA takes enable_gqa (since 2.5), Inductor takes custom passes with a cache key
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # an older torch compiles without the pass
    CustomGraphPass = object

__all__ = ["MultiQueryAsGroupedQuery", "aot_eager_with_graph_passes", "uses_inductor", "with_graph_passes"]

_SDPA = torch._C._nn.scaled_dot_product_attention  # F.scaled_dot_product_attention is this function
_OPERANDS = ("query", "key", "value", "attn_mask")  # its first parameters, in order
_ENABLE_GQA_POSITION = 7
_HEADS = -3  # (batch, heads, tokens, head_dim)


class MultiQueryAsGroupedQuery(CustomGraphPass):
    """Rewrites ``scaled_dot_product_attention`` calls whose key and value have one head and whose query
    has several into the same call with ``enable_gqa=True``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function" and node.target is _SDPA and _broadcasts_one_head(node):
                node.kwargs = {**node.kwargs, "enable_gqa": True}

    def uuid(self) -> str:
        """What Inductor's cache keys the compiled graphs by (see ``CustomGraphPass``): this file's
        contents, so graphs compiled by an earlier version of the pass are not reused."""
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _broadcasts_one_head(node: torch.fx.Node) -> bool:
    """Whether this attention call broadcasts a single key/value head over several query heads of the
    same batch (4-D operands; a mask of two or more dimensions, which grouped-query attention takes)."""
    if node.kwargs.get("enable_gqa") or len(node.args) > _ENABLE_GQA_POSITION:
        return False
    positional = dict(zip(_OPERANDS, node.args, strict=False))  # later arguments are no operands
    given = {**positional, **{k: v for k, v in node.kwargs.items() if k in _OPERANDS}}
    query, key, value = (_example(given.get(name)) for name in _OPERANDS[:3])
    if any(t is None or t.dim() != 4 for t in (query, key, value)):
        return False
    mask = given.get("attn_mask")
    if mask is not None and ((example := _example(mask)) is None or example.dim() < 2):
        return False
    one_head = key.shape[_HEADS] == value.shape[_HEADS] == 1 < query.shape[_HEADS]
    return one_head and key.shape[0] == value.shape[0] == query.shape[0]


def _example(arg: object) -> torch.Tensor | None:
    """The example tensor Dynamo recorded for a graph node (``None`` for anything else)."""
    example = arg.meta.get("example_value") if isinstance(arg, torch.fx.Node) else None
    return example if isinstance(example, torch.Tensor) else None


def with_graph_passes(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keyword arguments with :class:`MultiQueryAsGroupedQuery` among Inductor's
    pre-grad passes. A ``mode`` becomes the Inductor options it stands for (``torch.compile`` takes a
    mode or options, not both); other backends, a caller who gave both or a pre-grad pass of their own,
    and torch before 2.6 get the arguments as they are."""
    if CustomGraphPass is object or not uses_inductor(compile_kwargs):
        return compile_kwargs
    mode, options = compile_kwargs.get("mode"), compile_kwargs.get("options")
    if mode is not None and options is not None:
        return compile_kwargs  # torch.compile says what is wrong
    inductor = dict(options or {})
    if mode is not None:
        inductor = {**list_mode_options(mode, compile_kwargs.get("dynamic")), **inductor}
    if inductor.get("pre_grad_custom_pass") is not None:
        return compile_kwargs  # the caller's own pre-grad pass stays the only one
    inductor["pre_grad_custom_pass"] = MultiQueryAsGroupedQuery()
    rest = {k: v for k, v in compile_kwargs.items() if k not in ("mode", "options")}
    return {**rest, "options": inductor}


def uses_inductor(compile_kwargs: dict[str, Any]) -> bool:
    """Whether ``torch.compile(**compile_kwargs)`` compiles with Inductor."""
    return (compile_kwargs.get("backend") or _default_backend()) == "inductor"


def aot_eager_with_graph_passes(graph: torch.fx.GraphModule, example_inputs: list) -> Any:
    """A ``torch.compile`` backend: :class:`MultiQueryAsGroupedQuery` on the captured graph, then
    AOTAutograd without code generation (the ``aot_eager`` backend). For a graph that runs once (see
    :mod:`hf_fp8.integrations.compiled`): multi-query attention stays on the fused kernels there too,
    whose math path would keep every layer's attention scores for the backward."""
    if CustomGraphPass is not object:
        MultiQueryAsGroupedQuery()(graph.graph)
        graph.recompile()
    return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)


def _default_backend() -> Any:
    """The backend ``torch.compile`` uses when given none (which newer torch lets a program set)."""
    get_default = getattr(torch.compiler, "get_default_backend", None)
    return get_default() if get_default is not None else "inductor"
