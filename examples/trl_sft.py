"""Supervised fine-tuning with TRL's SFTTrainer in FP8, sequences packed into full rows.

    python examples/trl_sft.py [--model PATH] [--steps 20] [--batch-size 4] [--seq-len 512]

``hf_fp8.Fp8TrainerCallback()`` is the only FP8 line: it patches the model, compiles it on an FP8 GPU,
ends each FP8 step at the optimizer step and logs FP8 telemetry. TRL's best-fit packing puts several
lines in one row with their own position ids; nothing about it changes for FP8 (no padding to 16).
Runs on the CPU (real FP8 numerics, no speed-up) or an FP8 GPU.
"""

from __future__ import annotations

import sys

from trl_common import checked, model_and_tokenizer, parser, shakespeare_lines, summary, trl_arguments

import hf_fp8


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, steps=20, batch_size=4, seq_len=512)
    args = checked(p, argv)
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = model_and_tokenizer(p, args)
    lines = shakespeare_lines(args.steps * args.batch_size * args.seq_len // 30 + 64)
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**trl_arguments(args), packing=True, max_length=args.seq_len, learning_rate=2e-5),
        train_dataset=Dataset.from_list([{"text": line} for line in lines]),
        processing_class=tokenizer,
        callbacks=[hf_fp8.Fp8TrainerCallback(args.recipe)],
    )
    trainer.train()
    summary(trainer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
