"""Online RL with TRL's GRPOTrainer in FP8: the model being trained also generates its completions
(with transformers' generate, no vLLM).

    python examples/trl_grpo.py [--model PATH] [--steps 10] [--batch-size 4] [--completion 32]

Prompts are the first words of Shakespeare's lines; the reward prefers completions that end a sentence
near 40 characters. Generation runs the model's decode steps through the plain layers (a handful of
rows: faster than casting each weight to FP8 per token) and training in FP8.
"""

from __future__ import annotations

import sys

from trl_common import checked, model_and_tokenizer, parser, shakespeare_lines, summary, trl_arguments

import hf_fp8


def sentence_reward(completions: list[str], **kwargs) -> list[float]:
    """1 for a completion of 40 characters that ends a sentence, less the further it is from that."""
    return [float(c.rstrip().endswith((".", "!", "?"))) - abs(len(c) - 40) / 40 for c in completions]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, steps=10, batch_size=4, seq_len=64)
    p.add_argument("--completion", type=int, default=32, help="new tokens a completion at most")
    args = checked(p, argv)
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, tokenizer = model_and_tokenizer(p, args)
    prompts = [" ".join(line.split()[:4]) for line in shakespeare_lines(args.steps * args.batch_size + 16)]
    config = GRPOConfig(
        **trl_arguments(args),
        num_generations=args.batch_size,
        max_completion_length=args.completion,
        learning_rate=1e-6,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=sentence_reward,
        args=config,
        train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in prompts]),
        processing_class=tokenizer,
        callbacks=[hf_fp8.Fp8TrainerCallback(args.recipe)],
    )
    trainer.train()
    summary(trainer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
