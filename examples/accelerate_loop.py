"""A custom training loop with Accelerate, in FP8: start it with ``hf-fp8 launch``.

    hf-fp8 launch --recipe conservative examples/accelerate_loop.py --steps 20
    python examples/accelerate_loop.py --steps 20            # one process, the --recipe below

Fine-tunes SmolLM2-135M on Shakespeare. ``hf_fp8.prepare_fp8`` patches the model before
``accelerator.prepare`` (so DDP wraps the FP8 model and one amax all-reduce a step keeps the ranks'
scales equal; on an FP8 GPU it also compiles the model block by block), and ``hf_fp8.Fp8NanGuard``
keeps a non-finite step from the weights without waiting for the GPU (the fused AdamW skips it).
The recipe is the launcher's when ``hf-fp8 launch --recipe`` gave one, else ``--recipe``: by default
``backward-fp8``, what ``patch_model`` gives a checkpoint's weights (forwards in high precision, the
backward's GEMMs in FP8: FP8 forwards cost a fine-tune of this model about 1% of its loss).
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
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step and process")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (16-2048)")
    parser.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate")
    parser.add_argument(
        "--recipe",
        default="backward-fp8",
        help="FP8 recipe (name or YAML) when not started by hf-fp8 launch",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or not 16 <= args.seq_len <= 2048 or not 0 < args.lr < 1:
        parser.error("--steps and --batch-size must be at least 1, --seq-len from 16 to 2048, --lr in (0, 1)")
    launched = hf_fp8.Fp8Recipe.launched()
    try:
        recipe = hf_fp8.Fp8Recipe.from_launcher() if launched else hf_fp8.Fp8Recipe.load(args.recipe)
        path, text = hf_fp8.assets.smollm2_path(), hf_fp8.assets.load_text()
    except ValueError as err:
        parser.error(str(err))
    except (ModuleNotFoundError, FileNotFoundError) as err:
        parser.error(f"{err} ({hf_fp8.assets.DEMO_INSTALL})")

    from accelerate import Accelerator
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no")
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor(tokenizer(text[:400_000].decode("latin-1"))["input_ids"])
    generator = torch.Generator().manual_seed(accelerator.process_index)  # each rank its own batches
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    model, optimizer, report = hf_fp8.prepare_fp8(accelerator, model, optimizer, recipe=recipe)
    guard = hf_fp8.Fp8NanGuard(model, optimizer=optimizer)  # fused: a bad step is skipped on the GPU
    if accelerator.is_main_process:
        source = "from hf-fp8 launch" if launched else "from --recipe"
        forwards = "FP8" if recipe.forward_in_fp8 else "high precision"
        scaling = f"{recipe.format}, {recipe.scaling} scaling, margin {recipe.margin}"
        print(f"recipe {source}: {scaling}, forwards in {forwards}")
        print(report)

    model.train()
    progress = tqdm(range(args.steps), desc="FP8 fine-tune", disable=not accelerator.is_main_process)
    for step in progress:
        starts = torch.randint(0, len(ids) - args.seq_len, (args.batch_size,), generator=generator)
        batch = torch.stack([ids[s : s + args.seq_len] for s in starts.tolist()]).to(accelerator.device)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        if guard.check(step):
            optimizer.step()
        optimizer.zero_grad()
        progress.set_postfix(loss=f"{loss.item():.3f}")
    guard.flush()  # raises if the last step was non-finite (its check did not wait for the GPU)
    if accelerator.is_main_process:
        print(f"done: {args.steps} steps, last loss {loss.item():.4f}, skipped steps {guard.skipped_steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
