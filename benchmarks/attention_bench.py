"""Attention forward + backward at the benchmark shapes, by SDPA backend, eager and compiled.

    python benchmarks/attention_bench.py

Answers which ``scaled_dot_product_attention`` kernel a training step should use for Llama's grouped
query attention (32 query heads over 8 KV heads): with ``enable_gqa`` or with K/V repeated first (what
transformers does when it passes a mask), under each backend, eager and under torch.compile.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "default": None,
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
    if gqa:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def time_ms(fn, q, k, v, repeats: int = 20) -> float:
    for _ in range(3):
        fn(q, k, v).backward(torch.ones_like(q))
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(repeats):
        fn(q, k, v).backward(torch.ones_like(q))
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / repeats


def main() -> int:
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; ms per forward + backward")
    print("| head dim | backend | GQA | eager | compiled |\n|---|---|---|---|---|")
    for head_dim in (64, 128):
        shape = dict(device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q = torch.randn(4, 32, 2048, head_dim, **shape)
        k, v = (torch.randn(4, 8, 2048, head_dim, **shape) for _ in range(2))
        for name, backends in BACKENDS.items():
            for gqa in (True, False):
                cells = []
                for compiled in (False, True):
                    torch._dynamo.reset()

                    def fn(q, k, v, gqa=gqa):
                        return attention(q, k, v, gqa)

                    run = torch.compile(fn) if compiled else fn
                    try:
                        with sdpa_kernel(backends) if backends else torch.enable_grad():
                            cells.append(f"{time_ms(run, q, k, v):.3f}")
                    except Exception as err:  # a backend that cannot run this case
                        cells.append(f"n/a ({type(err).__name__})")
                print(
                    f"| {head_dim} | {name} | {'enable_gqa' if gqa else 'repeat K/V'} | {' | '.join(cells)} |"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
