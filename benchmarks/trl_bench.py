"""TRL's trainers in BF16 and in FP8, each exactly as a user runs it, each row a process of its own.

    python benchmarks/trl_bench.py --shape 1b [--modes sft-bf16,sft-fp8,...] [--steps 8 --warmup 4]

Rows: ``sft`` (SFTTrainer, packed rows of ``--seq`` tokens), ``dpo`` (DPOTrainer, a frozen reference
model: BF16 for the BF16 row, ``hf_fp8.prepare_reference`` for FP8 rows; ``dpo-fp8-backward`` with the
``backward-fp8`` recipe, as the docs advise for DPO; DPOConfig's learning rate),
``grpo`` (GRPOTrainer generating with the model it trains, no vLLM), and ``generate``
(``model.generate``, batch 8, 256 new tokens, greedy; ``-train`` rows in training mode, as GRPO calls
it). ``-bf16`` rows run the model as loaded; ``-fp8`` rows add ``hf_fp8.Fp8TrainerCallback()`` and
nothing else (it compiles on an FP8 GPU); ``sft-bf16-compile`` is BF16 with
``TrainingArguments(torch_compile=True)``, ``sft-bf16-hfcompile`` BF16 with ``hf_fp8.compile(model)``
first: the same compiled path and attention without FP8, the yardstick of FP8's own gain.

Text is synthetic English-like sentences from a fixed seed through a byte-level tokenizer (no hub): the
model learns it within steps, so the final losses compare. Trainer rows time each optimizer step
(median after ``--warmup``), tokens/s from TRL's ``num_tokens``; the warm-up includes compilation.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

MODES = (
    "sft-bf16",
    "sft-bf16-compile",
    "sft-bf16-hfcompile",
    "sft-fp8",
    "dpo-bf16",
    "dpo-fp8",
    "dpo-fp8-backward",
    "grpo-bf16",
    "grpo-fp8",
    "grpo-fp8-eager",
    "grpo-bf16-hfcompile",
    "generate-bf16",
    "generate-fp8",
    "generate-bf16-train",
    "generate-fp8-train",
)
# Words of the synthetic text, each chosen by the one before it and a little chance.
_TEXT = (
    "the king queen night day speaks sleeps runs over under crown sword castle river horse battle and of in "
    "to with a an his her their my our is was be shall will not"
)


def sentences(rng: random.Random, size: int) -> str:
    """Text of about ``size`` bytes: sentences of a small vocabulary, each word chosen by the last."""
    vocabulary = _TEXT.split()
    words, index = [], rng.randrange(len(vocabulary))
    while sum(len(w) + 1 for w in words) < size:
        index = (index * 7 + rng.randrange(3)) % len(vocabulary)
        words.append(vocabulary[index])
    return " ".join(words)


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<pad>": 256, "<s>": 257, "</s>": 258})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def model_for(args: argparse.Namespace):
    from harness import build

    model = build(args.shape, args.device)
    if model.config.vocab_size < 272:  # the tiny smoke-test shape: room for the tokenizer's special tokens
        model.resize_token_embeddings(272)
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 256, 257, 258
    model.generation_config.pad_token_id = 256
    model.generation_config.eos_token_id = 258
    return model


def step_timer(device: str, profile_after: int | None = None):
    """A TrainerCallback recording each optimizer step's wall time, the device synchronized at both
    ends; with ``profile_after`` it also profiles the two steps after that many and keeps where their
    GPU time went (``gpu_ms``). Built here: transformers is imported by the row, not the driver."""
    import torch
    from transformers import TrainerCallback

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._begin = 0.0
            self._profiler = None
            self.gpu_ms: dict | None = None

        def on_step_begin(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            if profile_after is not None and len(self.times) == profile_after:
                from torch.profiler import ProfilerActivity, profile

                self._profiler = profile(activities=[ProfilerActivity.CUDA])
                self._profiler.__enter__()
            self._begin = time.perf_counter()

        def on_step_end(self, *a, **k):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._begin)
            if self._profiler is not None and len(self.times) == profile_after + 2:
                from harness import kernel_time_by_kind

                self._profiler.__exit__(None, None, None)
                self.gpu_ms = kernel_time_by_kind(self._profiler, 2, top=15)
                self._profiler = None

    return StepTimes()


def trainer_row(mode: str, args: argparse.Namespace) -> dict:
    import torch
    import torch._dynamo.utils
    import trl
    from datasets import Dataset

    import hf_fp8

    task, precision = mode.split("-", 1)
    fp8 = precision.startswith("fp8")
    rng = random.Random(0)
    steps = args.warmup + args.steps
    common = dict(
        output_dir=str(Path(args.workdir) / mode),
        max_steps=steps,
        per_device_train_batch_size=args.batch,
        learning_rate=1e-5,
        logging_steps=args.logging_steps,
        report_to=[],
        save_strategy="no",
        bf16=args.device == "cuda",
        use_cpu=args.device == "cpu",
        optim="adamw_torch_fused" if args.device == "cuda" else "adamw_torch",
        torch_compile=precision == "bf16-compile",
        disable_tqdm=True,
        seed=0,
    )
    timer = step_timer(args.device, args.warmup if args.profile else None)
    recipe = "backward-fp8" if precision == "fp8-backward" else None
    compiles = False if precision == "fp8-eager" else None
    callbacks = [timer] + ([hf_fp8.Fp8TrainerCallback(recipe, compile=compiles)] if fp8 else [])
    host = None
    if args.host_profile:
        from host_profile import host_profiler

        host = host_profiler(args.warmup)
        callbacks.insert(0, host)
    model, tokenizer = model_for(args), byte_tokenizer()
    if precision == "bf16-hfcompile":
        hf_fp8.compile(model)
    if task == "sft":
        rows = [{"text": sentences(rng, args.seq)} for _ in range(steps * args.batch + 8)]
        config = trl.SFTConfig(**common, packing=True, max_length=args.seq)
        trainer = trl.SFTTrainer(
            model=model,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    elif task == "dpo":
        quarter = args.seq // 4  # prompt and answer: half the max length
        rows = [
            {
                "prompt": sentences(rng, quarter),
                "chosen": sentences(rng, quarter),
                "rejected": sentences(rng, quarter),
            }
            for _ in range(steps * args.batch + 8)
        ]
        reference = model_for(args).requires_grad_(False)
        if fp8:
            hf_fp8.prepare_reference(reference, recipe)
        # DPO's own learning rate (DPOConfig's default, 1e-6), as its users run it
        config = trl.DPOConfig(**{**common, "learning_rate": 1e-6}, max_length=args.seq)
        trainer = trl.DPOTrainer(
            model=model,
            ref_model=reference,
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    else:  # grpo
        rows = [{"prompt": sentences(rng, args.grpo_prompt)} for _ in range(steps * args.batch + 8)]
        config = trl.GRPOConfig(
            **common,
            num_generations=args.batch,
            max_completion_length=args.grpo_completion,
            temperature=1.0,
            generation_kwargs={"min_new_tokens": args.grpo_completion},
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **k: [len(set(c)) / 10.0 for c in completions],
            args=config,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    start = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - start
    print(torch._dynamo.utils.compile_times(repr="str"), file=sys.stderr)  # where the warm-up went
    if host is not None:
        host.close()
    timed = timer.times[args.warmup :]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    tokens = [
        (b["num_tokens"] - a["num_tokens"]) / (b["step"] - a["step"]) for a, b in itertools.pairwise(logs)
    ]
    tokens_per_step = (
        statistics.mean(tokens[-args.steps :]) if tokens else logs[-1]["num_tokens"] / logs[-1]["step"]
    )
    profiled = args.profile or args.host_profile
    step_s = statistics.median(t for i, t in enumerate(timed) if not (profiled and i < 2))
    return {
        **({"gpu_ms": timer.gpu_ms} if timer.gpu_ms else {}),
        **({"host": host.result} if host is not None and host.result is not None else {}),
        "mode": mode,
        "shape": args.shape,
        "ms_per_step": step_s * 1e3,
        "tokens_per_s": tokens_per_step / step_s,
        "warmup_s": total_s - sum(timed),
        "first_loss": logs[0]["loss"],
        "final_loss": statistics.mean(h["loss"] for h in logs[-3:]),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0,
    }


def generate_row(mode: str, args: argparse.Namespace) -> dict:
    import torch

    import hf_fp8

    model = model_for(args)
    if "fp8" in mode:
        hf_fp8.patch_model(model)
    model.train(mode.endswith("-train"))
    generator = torch.Generator(device=args.device).manual_seed(0)
    prompt = torch.randint(0, 256, (8, args.prompt), device=args.device, generator=generator)
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    times = []
    with torch.no_grad():
        for _ in range(args.generate_repeats + 1):
            if args.device == "cuda":
                torch.cuda.synchronize()
            begin = time.perf_counter()
            out = model.generate(prompt, **kwargs)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - begin)
    new = out.shape[0] * (out.shape[1] - args.prompt)
    return {
        "mode": mode,
        "shape": args.shape,
        "ms_per_generate": statistics.median(times[1:]) * 1e3,
        "tokens_per_s": new / statistics.median(times[1:]),
        "warmup_s": times[0],
        "first_tokens": out[0, args.prompt : args.prompt + 8].tolist(),
    }


def run_one(mode: str, args: argparse.Namespace) -> dict:
    try:
        return generate_row(mode, args) if mode.startswith("generate") else trainer_row(mode, args)
    except Exception as err:  # one broken row must not hide the others
        import traceback

        traceback.print_exc()
        return {"mode": mode, "shape": args.shape, "error": f"{type(err).__name__}: {err}"[:300]}


def print_table(results: list[dict]) -> None:
    by_mode = {r["mode"]: r for r in results if "error" not in r}
    print(
        "\n| mode | tokens/s | vs BF16 | ms | warm-up s | first loss | final loss | vs BF16 loss | peak GiB |"
        "\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | error: {r['error'][:90]} ||||||||")
            continue
        task = r["mode"].split("-")[0]
        base = by_mode.get(f"{task}-bf16-train" if r["mode"].endswith("-train") else f"{task}-bf16")
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        ms = r.get("ms_per_step", r.get("ms_per_generate"))
        loss, base_loss = r.get("final_loss"), (base or {}).get("final_loss")
        loss_cell = f"{loss:.4f}" if loss is not None else "-"
        loss_ratio = f"{(loss / base_loss - 1) * 100:+.2f}%" if loss is not None and base_loss else "-"
        first = f"{r['first_loss']:.4f}" if "first_loss" in r else "-"
        print(
            f"| {r['mode']} | {r['tokens_per_s']:,.0f} | {ratio} | {ms:.1f} | {r['warmup_s']:.1f} "
            f"| {first} | {loss_cell} | {loss_ratio} | {r.get('peak_gib', 0):.1f} |"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", default="1b", help="a shape of benchmarks/harness.py (tiny: CPU smoke test)"
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--batch", type=int, default=4, help="rows a step (GRPO: generations a prompt too)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens a packed SFT row; DPO's max length")
    parser.add_argument("--grpo-prompt", type=int, default=512, help="GRPO prompt bytes")
    parser.add_argument("--grpo-completion", type=int, default=128, help="GRPO completion tokens")
    parser.add_argument("--prompt", type=int, default=128, help="generate: prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=256, help="generate: new tokens")
    parser.add_argument("--generate-repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument(
        "--logging-steps",
        type=int,
        default=1,
        help="the Trainer logs (and the FP8 callback collects) every N steps",
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--profile", action="store_true", help="also break two steps' GPU time down by kernel kind (untimed)"
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="trainer rows: host time by Python function, 2 steps after warm-up (host_profile.py)",
    )
    parser.add_argument("--workdir", default="/tmp/trl-bench")
    parser.add_argument("--one", help="run this one mode here (the driver runs each in a process)")
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args(argv)
    from processes import append_result, run_modes_in_processes

    if args.one:
        result = run_one(args.one, args)
        append_result(result, args.out)
        return 0 if "error" not in result else 1
    modes = args.modes.split(",")
    if unknown := sorted(set(modes) - set(MODES)):
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    results = run_modes_in_processes("trl_bench.py", args, modes, ("profile", "host_profile"))
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
