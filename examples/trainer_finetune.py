"""FP8 fine-tuning with transformers' Trainer, and an exact resume from a checkpoint.

    python examples/trainer_finetune.py [--steps 20] [--out trainer-out] [--resume-check]

Fine-tunes SmolLM2-135M on Shakespeare with ``hf_fp8.Fp8Trainer`` (a ``Trainer`` whose
``Fp8TrainerCallback`` patches the model, guards against NaN, logs FP8 telemetry and checkpoints the FP8
scaling state). Prints the FP8 telemetry of the last logged step. With ``--resume-check`` it also
restarts a copy of the run from its half-way checkpoint and compares the two runs' loss at the last
step: with the FP8 state restored they are the same. Runs on the CPU (real FP8 numerics, no speed-up)
or on an FP8 GPU.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

import hf_fp8


def rows(path: Path, text: bytes, count: int, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """``count`` windows of ``seq_len`` tokens of the text, as Trainer rows."""
    from transformers import AutoTokenizer

    ids = torch.tensor(AutoTokenizer.from_pretrained(path)(text[:400_000].decode("latin-1"))["input_ids"])
    starts = torch.linspace(0, len(ids) - seq_len - 1, count).long().tolist()
    return [{"input_ids": ids[s : s + seq_len], "labels": ids[s : s + seq_len]} for s in starts]


def train(path: Path, data: list, out: Path, args: argparse.Namespace, recipe, resume: Path | None = None):
    from transformers import AutoModelForCausalLM, TrainingArguments

    training = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="steps" if args.resume_check else "no",
        save_steps=max(args.steps // 2, 1),
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trainer = hf_fp8.Fp8Trainer(model=model, args=training, train_dataset=data, fp8_recipe=recipe)
    trainer.train(resume_from_checkpoint=str(resume) if resume is not None else None)
    return trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (16-2048)")
    parser.add_argument("--lr", type=float, default=3e-5, help="learning rate")
    parser.add_argument(
        "--recipe", help="FP8 recipe: a name or a YAML file (default: a checkpoint's, backward-fp8)"
    )
    parser.add_argument("--out", type=Path, default=Path("trainer-out"), help="the Trainer's output folder")
    parser.add_argument("--overwrite", action="store_true", help="write into --out even if it is not empty")
    parser.add_argument(
        "--resume-check", action="store_true", help="also resume from the half-way checkpoint and compare"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or not 16 <= args.seq_len <= 2048 or not 0 < args.lr < 1:
        parser.error("--steps and --batch-size must be at least 1, --seq-len from 16 to 2048, --lr in (0, 1)")
    if args.resume_check and args.steps < 2:
        parser.error("--resume-check needs --steps 2 or more (it resumes from the half-way checkpoint)")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())) and not args.overwrite:
        parser.error(
            f"--out {args.out} exists and is not an empty folder; choose another or pass --overwrite"
        )
    try:
        recipe = hf_fp8.Fp8Recipe.load(args.recipe) if args.recipe else None
        path, text = hf_fp8.assets.smollm2_path(), hf_fp8.assets.load_text()
    except ValueError as err:
        parser.error(str(err))
    except (ModuleNotFoundError, FileNotFoundError) as err:
        parser.error(f"{err} ({hf_fp8.assets.DEMO_INSTALL})")

    data = rows(path, text, args.steps * args.batch_size, args.seq_len)
    full = train(path, data, args.out / "run", args, recipe)
    last = [entry for entry in full.state.log_history if "loss" in entry][-1]
    print(f"\nFP8 telemetry logged at step {last['step']}:")
    for key, value in last.items():
        if key.startswith("fp8/"):
            print(f"  {key:32s} {value}")
    if not args.resume_check:
        return 0

    half = f"checkpoint-{max(args.steps // 2, 1)}"
    resumed_out = args.out / "resumed"
    shutil.copytree(args.out / "run" / half, resumed_out / half, dirs_exist_ok=True)
    resumed = train(path, data, resumed_out, args, recipe, resume=resumed_out / half)
    again = [entry for entry in resumed.state.log_history if "loss" in entry][-1]
    same = again["loss"] == last["loss"]
    print(
        f"\nloss at step {last['step']}: uninterrupted {last['loss']:.6f}; resumed from {half} "
        f"{again['loss']:.6f} ({'identical' if same else 'different'})"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
