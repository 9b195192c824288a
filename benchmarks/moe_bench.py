"""Time a training step of a Mixtral-shaped MoE model: BF16 experts against hf-fp8's FP8 experts.

    python benchmarks/moe_bench.py --layers 2 --modes bf16-grouped,hf-fp8

Mixtral-8x7B's layer shape (hidden 4096, experts of 14336, top-2 of 8, 32 heads over 8 KV heads),
``--layers`` layers, batch 4 x 2048 by default, AdamW fused. ``bf16-grouped`` runs transformers'
``grouped_mm`` experts implementation (one grouped BF16 GEMM per projection), ``bf16-eager`` its
per-expert loop, ``hf-fp8`` the native backend's FP8 experts (``convert_experts: true``) with the attention
projections in FP8 too (hybrid: the experts in E4M3 throughout, all six GEMMs grouped; the attention's
gradients in E5M2), and ``hf-fp8-e4m3`` the same with ``format: e4m3`` everywhere.
``bf16-grouped-compile``, ``hf-fp8-compile`` and ``hf-fp8-e4m3-compile`` add ``hf_fp8.compile`` (block by
block; ``--compile-backend`` picks the backend); ``hf-fp8-experts-bf16-compile`` is the default recipe,
which keeps the experts in BF16 (on ``grouped_mm``) and runs the attention in FP8.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
from harness import begin_run, chosen_modes, measure, print_table, ratio, run_all, training_flops
from transformers import MixtralConfig, MixtralForCausalLM

import hf_fp8

MODES = (
    "bf16-eager",
    "bf16-grouped",
    "bf16-grouped-compile",
    "hf-fp8",
    "hf-fp8-compile",
    "hf-fp8-experts-bf16-compile",
    "hf-fp8-e4m3",
    "hf-fp8-e4m3-compile",
)


MIXTRAL = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_attention_heads=32)
# a smoke test of this script (--tiny --device cpu), not a measurement
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4)


def build(layers: int, experts_implementation: str, tiny: bool, device: str) -> MixtralForCausalLM:
    config = MixtralConfig(
        **(TINY if tiny else MIXTRAL),
        num_hidden_layers=layers,
        num_key_value_heads=8 if not tiny else 2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    with torch.device(device):
        return MixtralForCausalLM(config).to(torch.bfloat16).train()


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    grouped = mode.startswith("bf16-grouped") or "experts-bf16" in mode
    model = build(args.layers, "grouped_mm" if grouped else "eager", args.tiny, args.device)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * 2 // 8  # top-2 of 8
    flops = training_flops(model, args.batch, args.seq) + 6.0 * routed * args.batch * args.seq
    if mode.startswith("hf-fp8"):
        fmt = "e4m3" if "e4m3" in mode else "hybrid"
        recipe = hf_fp8.Fp8Recipe(format=fmt, convert_experts="experts-bf16" not in mode)
        hf_fp8.patch_model(model, recipe)
    if mode.endswith("-compile"):
        hf_fp8.compile(model, backend=args.compile_backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    result = measure(model, optimizer, contextlib.nullcontext, args, flops)
    return {"mode": mode, "shape": f"mixtral-{args.layers}l", **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--tiny", action="store_true", help="a tiny Mixtral: a smoke test of this script")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--compile-backend", default="inductor", help="aot_eager: a smoke test")
    args = parser.parse_args(argv)
    args.shape = f"mixtral-{args.layers}l"
    modes = chosen_modes(parser, args.modes, MODES)
    begin_run(args, modes)
    results = run_all(modes, run_mode, args)

    def cells(r: dict, base: dict | None) -> list[str]:
        return [
            f"{r['tokens_per_s']:,.0f}",
            ratio(r, base, "tokens_per_s"),
            f"{r['ms_per_step']:.1f}",
            f"{r['peak_gib']:.1f}",
            f"{r['loss']:.4f}",
        ]

    headers = ["tokens/s", "vs bf16-grouped", "ms/step", "peak GiB", "loss after the steps"]
    print_table(results, "bf16-grouped", headers, cells)
    return 0


if __name__ == "__main__":
    sys.exit(main())
