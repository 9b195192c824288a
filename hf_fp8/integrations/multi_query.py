"""Multi-query attention on PyTorch's fused kernels under ``hf_fp8.compile``: an Inductor graph pass.

Some models call ``F.scaled_dot_product_attention`` with one key/value head for all query heads and
let it broadcast (HF's Falcon-7B/40B-style multi-query attention). The fused kernels (flash, cuDNN,
memory-efficient) take no broadcast heads, so PyTorch runs the math path: float32 GEMMs and a
materialized softmax. On Falcon-7B's block at 2048 wide that was ~105 ms of a ~149 ms step on an
H200, the same in BF16 and FP8: more than all the linear layers together. One key/value head broadcast
to every query head is grouped-query attention with one group, so :class:`MultiQueryAsGroupedQuery`
asks for that (``enable_gqa=True``): the same values, on the fused kernels.

The pass runs on the graph Dynamo captured, before autograd is traced, for every graph
``hf_fp8.compile`` makes with Inductor (:func:`with_graph_passes`); a call with as many key/value heads
as query heads, or one that already says ``enable_gqa``, is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor import list_mode_options

try:  # torch >= 2.6, whose SDPA takes enable_gqa (2.5) and whose Inductor caches a pass by its uuid
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # an older torch compiles without the pass
    CustomGraphPass = object

__all__ = ["MultiQueryAsGroupedQuery", "with_graph_passes"]

_SDPA = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_HEADS = -3  # (batch, heads, tokens, head_dim)


class MultiQueryAsGroupedQuery(CustomGraphPass):
    """Rewrites ``scaled_dot_product_attention`` calls whose key and value have one head and whose query
    has several into the same call with ``enable_gqa=True``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.nodes:
            if node.op == "call_function" and node.target in _SDPA and _broadcasts_one_head(node):
                node.kwargs = {**node.kwargs, "enable_gqa": True}

    def uuid(self) -> str:
        """What Inductor's cache keys the compiled graphs by (see ``CustomGraphPass``)."""
        return "hf_fp8.multi_query_as_grouped_query.v1"


def _broadcasts_one_head(node: torch.fx.Node) -> bool:
    """Whether this attention call broadcasts a single key/value head over several query heads."""
    if node.kwargs.get("enable_gqa") or len(node.args) < 3:
        return False
    shapes = [getattr(arg, "meta", {}).get("example_value") for arg in node.args[:3]]
    if any(not isinstance(t, torch.Tensor) or t.dim() != 4 for t in shapes):
        return False
    query, key, value = (t.shape for t in shapes)
    return key[_HEADS] == value[_HEADS] == 1 < query[_HEADS] and key[0] == value[0] == query[0]


def with_graph_passes(compile_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``torch.compile`` keyword arguments with :class:`MultiQueryAsGroupedQuery` among Inductor's
    pre-grad passes. A ``mode`` becomes the Inductor options it stands for (``torch.compile`` takes a
    mode or options, not both); other backends, a caller who gave both or a pre-grad pass of their own,
    and torch before 2.6 get the arguments as they are."""
    if CustomGraphPass is object or compile_kwargs.get("backend", "inductor") != "inductor":
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
