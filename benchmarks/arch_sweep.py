"""The fast path across model families: BF16 against hf-fp8 on 13 architectures, a process per row.

    python benchmarks/arch_sweep.py --families all --out sweep.jsonl [--torchao-path /root/torchao]

Each family is built from its config at about 1B width (dense: 8 layers; MoE: 4 layers, experts on
transformers' ``grouped_mm``), random weights, PyTorch's sdpa attention where the family has it,
batch 4 x 2048, AdamW fused at lr 1e-5 on one repeated batch (``harness.py``'s ``measure``). Rows:

  bf16             eager
  bf16-compile     ``torch.compile(model)``: the baseline a user tries first
  bf16-regional    ``hf_fp8.compile(model)`` without FP8 (block by block)
  hf-fp8           ``patch_model(model)`` (the default recipe) + ``hf_fp8.compile``
  hf-fp8-fastest   ``patch_model(model, "head-backward")`` + ``hf_fp8.compile``
  hf-fp8-graphs    the same with ``hf_fp8.compile(model, mode="reduce-overhead")``: each training step
                   replays CUDA graphs (batches of one shape); its peak memory is the memory reserved,
                   since the graphs' memory pool is not counted as allocated while they replay
  hf-fp8-experts-fp8  the default recipe with MoE experts in FP8 too (``convert_experts: true``) +
                   ``hf_fp8.compile``: what FP8 experts (grouped E4M3 GEMMs) do to an MoE family
  torchao          torchao's tensorwise float8 training on the decoder + ``torch.compile(model)`` (its
                   own path only, with --torchao-path)

Every row trains the same number of steps on the same batch, so their last losses compare: the table
gives FP8's against BF16 + compile's. Every (family, row) runs in a process of its own (no shared
compile caches or memory peaks); one that fails is reported and the others still run.
``--device cpu --tiny --compile-backend aot_eager`` is a smoke test of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback

import torch
from harness import measure, training_flops
from processes import run_script

ROWS = (
    "bf16",
    "bf16-compile",
    "bf16-regional",
    "hf-fp8",
    "hf-fp8-fastest",
    "hf-fp8-graphs",
    "hf-fp8-experts-fp8",
    "torchao",
)

# family: (config class, its keyword arguments at about 1B width, layers); each a published model's
# layer shape where one exists at that width
FAMILIES: dict[str, tuple[str, dict, int]] = {
    "llama": ("LlamaConfig", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
              num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True), 8),  # Llama-3.2-1B
    "qwen3": ("Qwen3Config", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
              num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True), 8),  # 1.7B
    "mistral": ("MistralConfig", dict(hidden_size=3072, intermediate_size=9216, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=131072), 8),  # Ministral-3B
    "gemma2": ("Gemma2Config", dict(hidden_size=2304, intermediate_size=9216, num_attention_heads=8,
               num_key_value_heads=4, head_dim=256, vocab_size=256000), 8),  # Gemma-2-2B
    "gemma3": ("Gemma3TextConfig", dict(hidden_size=1152, intermediate_size=6912, num_attention_heads=4,
               num_key_value_heads=1, head_dim=256, vocab_size=262144), 8),  # Gemma-3-1B
    "phi3": ("Phi3Config", dict(hidden_size=3072, intermediate_size=8192, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32064), 8),  # Phi-3-mini
    "gpt2": ("GPT2Config", dict(n_embd=1600, n_head=25, n_positions=2048, vocab_size=50257), 8),  # GPT-2 XL
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                 vocab_size=50304), 8),  # Pythia-1B
    "falcon": ("FalconConfig", dict(hidden_size=2048, num_attention_heads=32, ffn_hidden_size=8192,
               vocab_size=65024), 8),  # Falcon-7B's block (multi-query, parallel attention) at 2048
    "granite": ("GraniteConfig", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=49155, tie_word_embeddings=True, embedding_multiplier=12.0,
                residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0), 8),  # 3.1-2B
    "mixtral": ("MixtralConfig", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32000, num_local_experts=8, num_experts_per_tok=2), 4),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32,
                  num_key_value_heads=4, head_dim=128, vocab_size=151936, num_experts=128,
                  num_experts_per_tok=8), 4),  # Qwen3-30B-A3B
    "olmoe": ("OlmoeConfig", dict(hidden_size=2048, intermediate_size=1024, num_attention_heads=16,
              num_key_value_heads=16, vocab_size=50304, num_experts=64, num_experts_per_tok=8), 4),  # 1B-7B
}  # fmt: skip

# --tiny: the same families at toy width (a smoke test)
_TINY = dict(hidden_size=64, n_embd=64, intermediate_size=128, moe_intermediate_size=32, ffn_hidden_size=128,
             num_attention_heads=4, n_head=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
             num_local_experts=4, num_experts=4, num_experts_per_tok=2)  # fmt: skip


def build(family: str, tiny: bool, device: str) -> torch.nn.Module:
    """``family``'s causal LM from its config, in BF16 and training mode."""
    import transformers

    config_class, kwargs, layers = FAMILIES[family]
    if tiny:
        kwargs = {k: _TINY.get(k, v) for k, v in kwargs.items()}
        full = FAMILIES[family][1]
        if "num_key_value_heads" in full and full["num_key_value_heads"] == full["num_attention_heads"]:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # multi-head stays multi-head
        layers = 2
    config = getattr(transformers, config_class)(**kwargs)
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):  # a toy vocabulary lacks the real ids
        if isinstance(getattr(config, token, None), int) and getattr(config, token) >= config.vocab_size:
            setattr(config, token, None)
    depth = "n_layer" if hasattr(config, "n_layer") else "num_hidden_layers"
    setattr(config, depth, layers)
    if hasattr(config, "max_position_embeddings"):
        config.max_position_embeddings = max(config.max_position_embeddings, 4096)
    if "num_experts_per_tok" in kwargs:
        config._experts_implementation = "grouped_mm"  # BF16's fast experts, not the per-expert loop
    torch.manual_seed(0)
    with torch.device(device):
        try:  # PyTorch's fused attention where the family has it (Falcon's default runs float32 GEMMs)
            model = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.bfloat16, attn_implementation="sdpa"
            )
        except ValueError:  # the family has no sdpa path: its default
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.train()


def run_row(family: str, row: str, args: argparse.Namespace) -> dict:
    """Build, warm up and time one row of one family (in this process)."""
    import hf_fp8

    model = build(family, args.tiny, args.device)
    flops = training_flops(model, args.batch, args.seq)
    step_model = model
    backend = {"backend": args.compile_backend}
    if row in ("bf16-compile", "torchao"):
        if row == "torchao":
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = Float8LinearConfig.from_recipe_name("tensorwise")
            convert_to_float8_training(model.base_model, config=config)
        step_model = torch.compile(model, **backend)
    elif row == "bf16-regional":
        hf_fp8.compile(model, **backend)
    elif row.startswith("hf-fp8"):
        recipe = {
            "hf-fp8-fastest": hf_fp8.Fp8Recipe.named("head-backward"),
            "hf-fp8-graphs": hf_fp8.Fp8Recipe.named("head-backward"),
            "hf-fp8-experts-fp8": hf_fp8.Fp8Recipe(convert_experts=True),
        }.get(row)
        hf_fp8.patch_model(model, recipe, backend="native")
        if row == "hf-fp8-graphs" and args.compile_backend == "inductor":
            backend["mode"] = "reduce-overhead"
        hf_fp8.compile(model, **backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    result = measure(step_model, optimizer, contextlib.nullcontext, args, flops)
    if backend.get("mode") == "reduce-overhead":
        result["peak_gib"] = result["peak_reserved_gib"]
    return {"family": family, "mode": row, **result}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="all", help=f"comma-separated, or all: {', '.join(FAMILIES)}")
    default_rows = ",".join(r for r in ROWS if r not in ("hf-fp8-experts-fp8", "torchao"))
    parser.add_argument("--rows", default=default_rows, help=f"comma-separated of {', '.join(ROWS)}")
    parser.add_argument("--torchao-path", help="a folder holding torchao, put on the torchao row's path only")
    parser.add_argument("--out", help="append every result as a JSON line here")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps (2 at least)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy widths: a smoke test with --device cpu")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--profile", action="store_true", help="also break a step's GPU time down by kind")
    parser.add_argument("--worker", nargs=2, metavar=("FAMILY", "ROW"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup < 2:
        parser.error("--warmup 2 at least: under delayed scaling hf_fp8.compile compiles after the first")
    if args.worker:
        try:
            result = run_row(*args.worker, args)
        except Exception as err:  # the table gets one line; stderr has the whole story
            traceback.print_exc()
            family, row = args.worker
            result = {"family": family, "mode": row, "error": f"{type(err).__name__}: {err}"}
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
        return 0
    families = list(FAMILIES) if args.families == "all" else args.families.split(",")
    rows = args.rows.split(",")
    unknown = sorted(set(families) - set(FAMILIES)) + sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown families or rows: {unknown}")
    passed_on = list(argv if argv is not None else sys.argv[1:])  # the worker ignores the driver's own
    results = []
    for family in families:
        for row in rows:
            if row == "torchao" and not args.torchao_path:
                print("# torchao: left out (no --torchao-path given)", flush=True)
                continue
            result = _run_worker(family, row, args, passed_on)
            print(json.dumps(result), flush=True)
            results.append(result)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(result) + "\n")
    print_sweep(results)
    return 0


def _run_worker(family: str, row: str, args: argparse.Namespace, passed_on: list[str]) -> dict:
    """One row of one family in a process of its own (torchao on its path only for its row); its result,
    or the error it ended with. The worker's options come after the driver's: they win."""
    extra = os.path.abspath(args.torchao_path) if row == "torchao" else None
    found, status = run_script("arch_sweep.py", [*passed_on, "--worker", family, row], extra)
    return found[-1] if found else {"family": family, "mode": row, "error": f"exit status {status}"}


def print_sweep(results: list[dict]) -> None:
    """One Markdown line per family: tokens/s per row, FP8's ratios, last losses, memory, warm-up."""
    by = {(r["family"], r["mode"]): r for r in results if "error" not in r}
    ratio_titles = ["default / compile", "fastest / compile", "graphs / compile", "fastest / eager"]
    loss_titles = ["loss compile", "loss default", "loss fastest", "loss graphs"]
    titles = [
        *ROWS,
        *ratio_titles,
        *loss_titles,
        "peak GiB compile / fastest / graphs",
        "warm-up s compile / fastest / graphs",
    ]
    print("\n| family | " + " | ".join(titles) + " |\n" + "|---" * (len(titles) + 1) + "|")

    def get(family: str, mode: str, key: str) -> float | None:
        r = by.get((family, mode))
        return r[key] if r else None

    def vs(family: str, mode: str, base: str) -> str:
        a, b = get(family, mode, "tokens_per_s"), get(family, base, "tokens_per_s")
        return f"{a / b:.2f}x" if a and b else "-"

    def loss(family: str, mode: str) -> str:
        a, b = get(family, mode, "loss"), get(family, "bf16-compile", "loss")
        if a is None:
            return "-"
        return f"{a:.3f}" + (f" ({(a / b - 1) * 100:+.1f}%)" if b and mode != "bf16-compile" else "")

    def trio(family: str, key: str, fmt: str) -> str:
        values = [get(family, mode, key) for mode in ("bf16-compile", "hf-fp8-fastest", "hf-fp8-graphs")]
        return " / ".join("-" if v is None else format(v, fmt) for v in values)

    for family in dict.fromkeys(r["family"] for r in results):
        speeds = []
        for mode in ROWS:
            tokens = get(family, mode, "tokens_per_s")
            failed = any(r["family"] == family and r["mode"] == mode and "error" in r for r in results)
            speeds.append(f"{tokens:,.0f}" if tokens else ("error" if failed else "-"))
        fp8_rows = ("hf-fp8", "hf-fp8-fastest", "hf-fp8-graphs")
        ratios = [vs(family, mode, "bf16-compile") for mode in fp8_rows] + [vs(family, fp8_rows[1], "bf16")]
        losses = [loss(family, mode) for mode in ("bf16-compile", *fp8_rows)]
        cells = [*speeds, *ratios, *losses, trio(family, "peak_gib", ".1f"), trio(family, "warmup_s", ".0f")]
        print(f"| {family} | " + " | ".join(cells) + " |")
    for r in results:
        if "error" in r:
            print(f"# {r['family']} {r['mode']}: {r['error'][:200]}")
        elif "gpu_ms" in r:
            print(f"# {r['family']} {r['mode']} GPU ms per step by kernel kind: {r['gpu_ms']}")


if __name__ == "__main__":
    sys.exit(main())
