"""The front doors, each exactly as the README shows it, BF16 against FP8, each row a process of its own.

    python benchmarks/trainer_bench.py --shape 8b-4l [--modes trainer-bf16,trainer-fp8,...]

Rows:

* ``trainer-*``: transformers' ``Trainer`` on rows of ``--seq`` tokens. ``-bf16`` trains the model as
  loaded, ``-fp8`` adds ``callbacks=[hf_fp8.Fp8TrainerCallback()]`` and nothing else; ``-compile``
  rows also set ``TrainingArguments(torch_compile=True)``.
* ``loop-*``: a custom loop with Accelerate (``Accelerator(mixed_precision="bf16")``, fused AdamW);
  ``-fp8`` prepares with ``hf_fp8.prepare_fp8`` and guards with ``hf_fp8.Fp8NanGuard(model,
  optimizer=optimizer)``, ``-bf16-compile`` prepares a ``dynamo_backend="inductor"`` Accelerator.
  Each step reads its loss (as a progress bar does).
* ``sft-*``: TRL's ``SFTTrainer`` with packing (``trl_bench.py``'s rows).

An FP8 row may name a recipe after ``@`` (``trainer-fp8@head-backward``): the callback's or
``prepare_fp8``'s ``recipe``; without one, their default.

Trainer rows log every step (``--logging-steps 1``, the worst case for host syncs) and clip gradients at
1.0 (the Trainer's default, ``--max-grad-norm``). Each optimizer step is
timed with the device synchronized at both ends (median after ``--warmup``); the warm-up is everything
before the timed steps (building the Trainer, compiling, the first steps); ``graphs`` counts the graphs
torch.compile made. Text is trl_bench's synthetic sentences through a byte-level tokenizer (no hub).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

MODES = (
    "trainer-bf16",
    "trainer-bf16-compile",
    "trainer-fp8",
    "trainer-fp8-compile",
    "loop-bf16",
    "loop-bf16-compile",
    "loop-fp8",
    "sft-bf16",
    "sft-bf16-compile",
    "sft-fp8",
)


def token_rows(args: argparse.Namespace, count: int) -> list[dict]:
    """``count`` causal-LM rows of ``--seq`` tokens of synthetic text, labels the inputs."""
    from trl_bench import byte_tokenizer, sentences

    tokenizer, rng = byte_tokenizer(), random.Random(0)
    rows = []
    for _ in range(count):
        ids = tokenizer(sentences(rng, args.seq + 16))["input_ids"][: args.seq]
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def base_mode(mode: str) -> str:
    """``trainer-fp8`` of ``trainer-fp8@head-backward``."""
    return mode.partition("@")[0]


def recipe_of(mode: str) -> str | None:
    """The recipe an FP8 row names after ``@``, else ``None`` (the entry point's default)."""
    return mode.partition("@")[2] or None


def compiled_graphs() -> int:
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def trainer_row(mode: str, args: argparse.Namespace) -> dict:
    import torch._dynamo.utils
    from transformers import Trainer, TrainingArguments
    from trl_bench import model_for, step_timer

    import hf_fp8

    steps = args.warmup + args.steps
    start = time.perf_counter()
    model = model_for(args)
    training = TrainingArguments(
        output_dir=str(Path(args.workdir) / mode),
        max_steps=steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-5,
        logging_steps=args.logging_steps,
        max_grad_norm=args.max_grad_norm,
        report_to=[],
        save_strategy="no",
        bf16=args.device == "cuda",
        use_cpu=args.device == "cpu",
        torch_compile=base_mode(mode).endswith("-compile"),
        disable_tqdm=True,
        seed=0,
    )
    timer = step_timer(args.device, args.warmup if args.profile else None)
    options = {"sample_layers": args.sample_layers} if args.sample_layers is not None else {}
    fp8 = hf_fp8.Fp8TrainerCallback(recipe_of(mode), **options)
    callbacks = [timer] + ([fp8] if "fp8" in mode else [])
    tracer = None
    if args.phases:
        from phases import phase_tracer

        tracer = phase_tracer(args.warmup)
        callbacks.insert(0, tracer)  # its profile ends before the timer times the next step
    host = None
    if args.host_profile:
        from host_profile import host_profiler

        host = host_profiler(args.warmup)
        callbacks.insert(0, host)
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=token_rows(args, steps * args.batch),
        callbacks=callbacks,
    )
    trainer.train()
    total_s = time.perf_counter() - start
    print(torch._dynamo.utils.compile_times(repr="str"), file=sys.stderr)
    for profiler in (tracer, host):
        if profiler is not None:
            profiler.close()
    timed = timer.times[args.warmup :]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # logging less often than every step may log no step loss: the run's mean then
    losses = losses or [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h]
    profiled = args.profile or args.phases or args.host_profile
    step_s = statistics.median(timed[2:] if profiled else timed)  # not the profiled steps
    result = row(mode, args, step_s, total_s - sum(timed), losses[-3:])
    extra = {"first_steps_s": [round(t, 2) for t in timer.times[: args.warmup]]}
    if timer.gpu_ms:
        extra["gpu_ms"] = timer.gpu_ms
    if tracer is not None and tracer.result is not None:
        extra["phases"] = tracer.result
    if host is not None and host.result is not None:
        extra["host"] = host.result
    return {**result, **extra}


def loop_row(mode: str, args: argparse.Namespace) -> dict:
    import torch
    from accelerate import Accelerator
    from trl_bench import model_for

    import hf_fp8

    start = time.perf_counter()
    accelerator = Accelerator(
        mixed_precision="bf16" if args.device == "cuda" else "no",
        cpu=args.device == "cpu",
        dynamo_backend="inductor" if base_mode(mode).endswith("-compile") else None,
    )
    model = model_for(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    if "fp8" in mode:
        model, optimizer, _ = hf_fp8.prepare_fp8(accelerator, model, optimizer, recipe=recipe_of(mode))
        guard = hf_fp8.Fp8NanGuard(model, optimizer=optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
        guard = None
    rows = token_rows(args, args.batch)
    batch = torch.tensor([r["input_ids"] for r in rows], device=accelerator.device)
    times, losses = [], []
    model.train()
    for _ in range(args.warmup + args.steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
        begin = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        if guard is None or guard.check():
            optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    total_s = time.perf_counter() - start
    timed = times[args.warmup :]
    return row(mode, args, statistics.median(timed), total_s - sum(timed), losses[-3:])


def row(mode: str, args: argparse.Namespace, step_s: float, warmup_s: float, last_losses: list) -> dict:
    import torch

    return {
        "mode": mode,
        "shape": args.shape,
        "ms_per_step": step_s * 1e3,
        "tokens_per_s": args.batch * args.seq / step_s,
        "warmup_s": warmup_s,
        "graphs": compiled_graphs(),
        "final_loss": statistics.mean(last_losses),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0,
    }


def sft_row(mode: str, args: argparse.Namespace) -> dict:
    import trl_bench

    args.profile = False
    result = trl_bench.trainer_row(mode, args)
    return {**result, "graphs": compiled_graphs()}


def run_one(mode: str, args: argparse.Namespace) -> dict:
    runner = {"trainer": trainer_row, "loop": loop_row, "sft": sft_row}[base_mode(mode).split("-")[0]]
    try:
        return runner(mode, args)
    except Exception as err:  # one broken row must not hide the others
        import traceback

        traceback.print_exc()
        return {"mode": mode, "shape": args.shape, "error": f"{type(err).__name__}: {err}"[:300]}


def print_table(results: list[dict]) -> None:
    """One table: tokens/s against the same front door's BF16 row and its BF16 + compile row."""
    by_mode = {r["mode"]: r for r in results if "error" not in r}
    print(
        "\n| mode | tokens/s | vs BF16 | vs BF16 compiled | warm-up s | graphs | final loss | peak GiB |"
        "\n|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | error: {r['error'][:90]} |||||||")
            continue
        door = base_mode(r["mode"]).split("-")[0]
        cells = []
        for base in (by_mode.get(f"{door}-bf16"), by_mode.get(f"{door}-bf16-compile")):
            cells.append(f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-")
        print(
            f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {cells[0]} | {cells[1]} | {r['warmup_s']:.1f} "
            f"| {r['graphs']} | {r['final_loss']:.4f} | {r.get('peak_gib', 0):.1f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", default="8b-4l", help="a shape of benchmarks/harness.py (tiny: CPU smoke test)"
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=4, help="rows a step")
    parser.add_argument("--seq", type=int, default=2048, help="tokens a row")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--sample-layers", type=int, help="Fp8TrainerCallback(sample_layers=N) (default: the callback's)"
    )
    parser.add_argument("--logging-steps", type=int, default=1, help="trainer rows' logging_steps")
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="trainer rows' gradient clipping (0: none)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="trainer rows: GPU time by kernel kind, 2 steps after warm-up"
    )
    parser.add_argument(
        "--phases", action="store_true", help="trainer rows: GPU idle time by Trainer phase (phases.py)"
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="trainer rows: host time by Python function, 2 steps after warm-up (host_profile.py)",
    )
    parser.add_argument("--workdir", default="/tmp/trainer-bench")
    parser.add_argument("--one", help="run this one mode here (the driver runs each in a process)")
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args(argv)
    from processes import append_result, run_modes_in_processes

    if args.one:
        result = run_one(args.one, args)
        append_result(result, args.out)
        return 0 if "error" not in result else 1
    modes = args.modes.split(",")
    if unknown := sorted({base_mode(m) for m in modes} - set(MODES)):
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    results = run_modes_in_processes("trainer_bench.py", args, modes, ("profile", "phases", "host_profile"))
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
