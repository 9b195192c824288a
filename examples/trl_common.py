"""What the TRL examples share: their command line, the model and tokenizer they load, Shakespeare's
lines as data, and the TRL arguments for this machine (BF16 on a GPU, float32 on the CPU)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hf_fp8


def parser(doc: str, steps: int, batch_size: int, seq_len: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--model", type=Path, help="a local HF causal LM folder (default: SmolLM2-135M of the demo)"
    )
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=batch_size, help="rows per step")
    p.add_argument("--seq-len", type=int, default=seq_len, help="tokens per row at most")
    p.add_argument(
        "--recipe", help="FP8 recipe: a name or a YAML file (default: the one for a checkpoint, backward-fp8)"
    )
    p.add_argument("--out", type=Path, default=Path("trl-out"), help="the trainer's output folder")
    return p


def checked(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or not 16 <= args.seq_len <= 8192:
        p.error("--steps and --batch-size must be at least 1, --seq-len from 16 to 8192")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} is not a local HF model folder (no config.json)")
    return args


def model_and_tokenizer(p: argparse.ArgumentParser, args: argparse.Namespace):
    """The causal LM (BF16 on a GPU, float32 on the CPU) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        path = args.model or hf_fp8.assets.smollm2_path()
    except (ModuleNotFoundError, FileNotFoundError) as err:
        p.error(f"{err} ({hf_fp8.assets.DEMO_INSTALL}), or pass --model")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def shakespeare_lines(count: int) -> list[str]:
    """``count`` non-empty lines of Shakespeare's plays, from the first one on."""
    lines = (line.strip() for line in hf_fp8.assets.load_text()[:2_000_000].decode("latin-1").splitlines())
    return [line for line in lines if len(line) > 20][:count]


def trl_arguments(args: argparse.Namespace) -> dict:
    """TrainingArguments every example passes to its TRL config."""
    gpu = torch.cuda.is_available()
    return dict(
        output_dir=str(args.out),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=gpu,
        use_cpu=not gpu,
        seed=0,
    )


def summary(trainer) -> None:
    """The last logged step's loss and FP8 telemetry, and what the callback converted and compiled."""
    import hf_fp8

    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, hf_fp8.Fp8TrainerCallback))
    report = callback.report
    print(f"\nFP8 layers: {len(report.converted)}; notes: {'; '.join(report.notes) or 'none'}")
    last = [entry for entry in trainer.state.log_history if "loss" in entry][-1]
    for key, value in last.items():
        if key in ("loss", "grad_norm") or key.startswith(("fp8/amax", "fp8/scale_fwd_median", "rewards/")):
            print(f"  {key:28s} {value}")
