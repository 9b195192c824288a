"""Preference tuning with TRL's DPOTrainer in FP8: the policy trains with the ``backward-fp8`` recipe
(forwards in high precision, the backward's GEMMs in FP8: DPO's log-ratios carry no FP8 rounding), the
frozen reference runs as the policy does (``hf_fp8.prepare_reference``, with the policy's recipe).

    python examples/trl_dpo.py [--model PATH] [--steps 20] [--batch-size 4] [--seq-len 256]
                               [--reference bf16]

Pairs from Shakespeare: a line as the prompt, the line after it as the chosen answer, a line from
elsewhere as the rejected one. ``--reference bf16`` keeps the reference model in high precision.
"""

from __future__ import annotations

import sys

from trl_common import checked, model_and_tokenizer, parser, shakespeare_lines, summary, trl_arguments

import hf_fp8


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, steps=20, batch_size=4, seq_len=256)
    p.set_defaults(recipe="backward-fp8")
    p.add_argument(
        "--reference", choices=["fp8", "bf16"], default="fp8", help="the reference model's precision"
    )
    args = checked(p, argv)
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model, tokenizer = model_and_tokenizer(p, args)
    reference, _ = model_and_tokenizer(p, args)
    if args.reference == "fp8":
        report = hf_fp8.prepare_reference(reference, args.recipe)
        print(f"reference model: {len(report.converted)} FP8 layers, frozen")
    else:
        reference.requires_grad_(False)
    lines = shakespeare_lines(args.steps * args.batch_size + 64)
    pairs = [
        {"prompt": lines[i], "chosen": " " + lines[i + 1], "rejected": " " + lines[(i * 7 + 31) % len(lines)]}
        for i in range(len(lines) - 1)
    ]
    trainer = DPOTrainer(
        model=model,
        ref_model=reference,
        args=DPOConfig(**trl_arguments(args), max_length=args.seq_len, learning_rate=5e-7),
        train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer,
        callbacks=[hf_fp8.Fp8TrainerCallback(args.recipe)],
    )
    trainer.train()
    summary(trainer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
