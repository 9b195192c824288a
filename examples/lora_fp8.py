"""LoRA on frozen base weights stored in FP8: load, train, merge, save.

    python examples/lora_fp8.py [--steps 20] [--out lora-out]

Loads SmolLM2-135M straight into FP8 base weights (``hf_fp8.peft.from_pretrained_fp8``: one byte a
value), adds LoRA adapters with PEFT, trains them on Shakespeare with the base GEMMs in FP8, then
saves the adapter (it loads onto a plain BF16 base with ``PeftModel.from_pretrained``) and merges it
into the base with ``hf_fp8.peft.merge_and_unload``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import hf_fp8

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (16-2048)")
    parser.add_argument("--lr", type=float, default=2e-4, help="AdamW learning rate of the adapters")
    parser.add_argument("--out", type=Path, default=Path("lora-out"), help="where the adapter is saved")
    parser.add_argument("--overwrite", action="store_true", help="save into --out even if it is not empty")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or not 16 <= args.seq_len <= 2048 or not 0 < args.lr < 1:
        parser.error("--steps and --batch-size must be at least 1, --seq-len from 16 to 2048, --lr in (0, 1)")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())) and not args.overwrite:
        parser.error(
            f"--out {args.out} exists and is not an empty folder; choose another or pass --overwrite"
        )
    try:
        path, text = hf_fp8.assets.smollm2_path(), hf_fp8.assets.load_text()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        parser.error(f"{err} ({hf_fp8.assets.DEMO_INSTALL})")

    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, report = hf_fp8.peft.from_pretrained_fp8(path, device=device, dtype=torch.float32)
    fp8_bytes = sum(
        m.weight.numel() for m in model.modules() if isinstance(m, hf_fp8.Fp8Module)
    )  # a byte each
    print(report)
    mib = fp8_bytes / 2**20
    print(f"base linear weights stored in FP8: {mib:.1f} MiB (in BF16: {2 * mib:.1f} MiB)")
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    model.print_trainable_parameters()

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor(tokenizer(text[:400_000].decode("latin-1"))["input_ids"])
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    progress = tqdm(range(args.steps), desc="LoRA over FP8 weights")
    for _ in progress:
        starts = torch.randint(0, len(ids) - args.seq_len, (args.batch_size,), generator=generator)
        batch = torch.stack([ids[s : s + args.seq_len] for s in starts.tolist()]).to(device)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        progress.set_postfix(loss=f"{loss.item():.3f}")

    model.save_pretrained(args.out)
    print(f"adapter saved to {args.out} (it loads onto a plain base with PeftModel.from_pretrained)")
    with torch.no_grad():
        adapter_loss = model.eval()(input_ids=batch, labels=batch).loss.item()
        merged = hf_fp8.peft.merge_and_unload(model)
        merged_loss = merged.eval()(input_ids=batch, labels=batch).loss.item()
    print(
        f"last batch, evaluated: with the adapter {adapter_loss:.4f}, merged into the base {merged_loss:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
