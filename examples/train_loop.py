"""A plain PyTorch training loop on an FP8-patched HF model (GPT-2, whose layers are transformers' Conv1D).

    python examples/train_loop.py [--steps 5]
    hf-fp8 launch --recipe conservative examples/train_loop.py     # the launcher's recipe is used

Builds a small GPT-2 from a config, patches it, trains a few steps on random tokens of odd length (the
patched model pads them to 16 on the fly) and shows what changed: the report, the FP8 state of one
layer, the loss with FP8 switched off for comparison, and the plain model given back by
``unpatch_model``.
"""

from __future__ import annotations

import argparse
import sys

import torch

import hf_fp8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps")
    parser.add_argument(
        "--recipe",
        default="hybrid-delayed",
        help="FP8 recipe (name or YAML) when not started by hf-fp8 launch",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    launched = hf_fp8.Fp8Recipe.launched()
    try:
        recipe = hf_fp8.Fp8Recipe.from_launcher() if launched else hf_fp8.Fp8Recipe.load(args.recipe)
    except ValueError as err:
        parser.error(str(err))

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=256))
    print(f"recipe {'from hf-fp8 launch' if launched else 'from --recipe'}: margin {recipe.margin}")
    print(hf_fp8.patch_model(model, recipe))

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(args.steps):
        ids = torch.randint(0, 512, (4, 100))  # 100 tokens: not a multiple of 16
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")

    layer = model.transformer.h[0].mlp.c_fc
    print(f"\n{layer}")
    print("scales (input, weight, grad_output):", [f"{s:.3g}" for s in layer.scale.tolist()])
    print("latest amaxes:", [f"{a:.3g}" for a in layer.amax_history[:, 1].tolist()])

    with hf_fp8.fp8_autocast(enabled=False), torch.no_grad():
        high_precision = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        fp8 = model(input_ids=ids, labels=ids).loss
    print(
        f"\nsame batch, same weights: FP8 loss {fp8.item():.4f}, high precision {high_precision.item():.4f}"
    )

    hf_fp8.unpatch_model(model)
    print("unpatched:", type(model.transformer.h[0].mlp.c_fc).__name__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
