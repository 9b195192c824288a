"""FP8 against BF16 over thousands of steps on real text, one command on one GPU (issue 46).

    python benchmarks/convergence.py --folder runs/convergence        # every run, then the plots
    python benchmarks/convergence.py --folder runs/convergence --plot # the plots and the table again

A Llama of ``--shape`` (one of ``harness.py``'s; ``350m``: 24 layers 1024 wide, 384M parameters) from
its config, trained from scratch on :mod:`corpus` (the Python sources of the machine's packages
and Shakespeare, tokenized with the demo's SmolLM2 tokenizer; about 1% of the files held out). Every
run is a process of its own on the same batches in the same order, from the same initial weights:
float32 master weights under BF16 autocast, fused AdamW with a linear warm-up and a cosine decay,
gradients clipped at 1.0, the model compiled block by block with ``hf_fp8.compile`` (the BF16 run too:
the same compile). ``bf16`` is the baseline; every other run names a recipe (``default``: what
``patch_model`` takes given none, ``hybrid-delayed`` from scratch and ``backward-fp8`` for ``--init
smollm2``'s checkpoint), patched with ``patch_model`` and guarded with ``Fp8NanGuard`` as a user's loop
would be. A recipe that all-gathers weights in FP8 (``fsdp-fp8``) trains under FSDP2 over a one-process
group (each decoder layer, then the root), so that its own path is the one measured.

``--init smollm2`` continues the demo's real model (SmolLM2-135M-Instruct) instead, and ``--lora`` trains
LoRA adapters (rank 16 on every projection, as the demo) over its frozen weights, for example:

    python benchmarks/convergence.py --folder runs/smollm2-full --init smollm2 --lr 5e-5 --steps 1000
    python benchmarks/convergence.py --folder runs/smollm2-lora --init smollm2 --lora --lr 5e-4 \
        --steps 1000 --runs bf16,lora-fp8,lora-fp8-block

Each run writes ``<folder>/<run>.jsonl``: the training loss of every step, the held-out loss every
``--eval-every`` steps, and FP8 telemetry every ``--telemetry-every`` steps (per layer and role: the
scale and the fractions of values saturated and flushed to zero; with :class:`hf_fp8.Fp8CastWatch`'s
warnings, the Trainer callback's, where those fractions grew). The table compares the final
training loss (the mean of the last 5% of steps) and the held-out perplexity with BF16's, and counts
loss spikes (a step whose loss is more than ``--spike`` above BF16's on the same batch); the table and the
plots (``loss.png``, ``ratio.png``: each run's smoothed loss over BF16's, ``telemetry.png``) come from
:mod:`convergence_report`, again with ``--plot``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

RUNS = ("bf16", "default", "head-backward", "block", "block-head", "rowwise")


# ---- the data -------------------------------------------------------------------------------------


def load_tokenizer(spec: str):
    """``smollm2``: the demo's tokenizer (``hf_fp8.assets``); ``bytes``: a byte-level one (CPU smoke
    tests); else a folder holding a tokenizer."""
    from transformers import AutoTokenizer

    if spec == "bytes":
        from trl_bench import byte_tokenizer

        return byte_tokenizer()
    if spec == "smollm2":
        from hf_fp8.assets import smollm2_path

        spec = str(smollm2_path())
    return AutoTokenizer.from_pretrained(spec)


def load_corpus(args: argparse.Namespace):
    """The corpus (built and cached at first use), for ``args.tokenizer`` and ``args.max_files``."""
    from corpus import build_corpus, python_sources, shakespeare_texts
    from hf_fp8.assets import cache_dir

    documents = None
    if args.max_files:  # a small corpus for smoke tests: the first files only
        sources = python_sources()[: args.max_files]
        documents = [(n, p.read_text(encoding="utf-8", errors="replace")) for n, p in sources]
        documents += shakespeare_texts()[:1]
    tokenizer = load_tokenizer(args.tokenizer)
    return build_corpus(tokenizer, vocabulary_digest(tokenizer), cache_dir(), documents, args.held_out_share)


def vocabulary_digest(tokenizer) -> str:
    """A name for ``tokenizer`` by its vocabulary and end-of-text token, so that the same tokenizer read
    from another folder (``smollm2`` or a copy of its files) finds the same cached corpus."""
    entries = sorted(tokenizer.get_vocab().items())
    text = json.dumps([entries, tokenizer.eos_token_id])
    return "vocab-" + hashlib.sha1(text.encode()).hexdigest()[:12]


def window_starts(length: int, args: argparse.Namespace):
    """The start of every training window, ``(steps, batch)``, drawn once from ``args.seed``: every run
    sees the same batches in the same order."""
    import torch

    generator = torch.Generator().manual_seed(args.seed)
    return torch.randint(0, length - args.seq, (args.steps, args.batch), generator=generator)


def held_out_windows(held_out, args: argparse.Namespace):
    """``--eval-batches`` batches of evenly spaced windows of the held-out split."""
    import torch

    count = args.eval_batches * args.batch
    starts = torch.linspace(0, len(held_out) - args.seq - 1, count).long().tolist()
    windows = torch.stack([held_out[s : s + args.seq].long() for s in starts])
    return list(windows.split(args.batch))


# ---- one run --------------------------------------------------------------------------------------


def build_model(args: argparse.Namespace, vocab_size: int):
    """The model a run starts from: ``--shape`` from its config (seeded), or the demo's SmolLM2."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.init == "smollm2":
        from hf_fp8.assets import smollm2_path

        model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
        return model.to(args.device).train()
    from harness import SHAPES

    # an output head of its own, so that the head recipes differ; the corpus tokenizer's vocabulary
    shape = {**SHAPES[args.shape], "tie_word_embeddings": False, "vocab_size": -(-vocab_size // 64) * 64}
    config = LlamaConfig(max_position_embeddings=args.seq, **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        return LlamaForCausalLM(config).train()


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """The multiplier of ``--lr`` at ``step``: linear warm-up, then a cosine decay to a tenth."""
    warmup = max(1, int(args.steps * args.warmup_share))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def run_one(run: str, args: argparse.Namespace) -> dict:
    """Train one run, writing its curve to ``<folder>/<run>.jsonl``; returns its summary."""
    import torch

    import hf_fp8

    corpus = load_corpus(args)
    device = torch.device(args.device)
    model = build_model(args, corpus.vocab_size)
    fp8 = run != "bf16"
    report = hf_fp8.patch_model(model, None if run == "default" else run) if fp8 else None
    sharded = report is not None and report.recipe.fp8_all_gather
    if sharded:
        shard_over_one_process(model, device)
    if args.lora:
        model = with_lora(model, args.seed)
    if args.compile:
        hf_fp8.compile(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: learning_rate(s, args))
    guard = hf_fp8.Fp8NanGuard(model, optimizer=optimizer) if fp8 else None
    telemetry = hf_fp8.Fp8Telemetry(model, sample_layers=10**6) if fp8 else None
    watch = hf_fp8.Fp8CastWatch()  # the Trainer callback's warnings, in the run's file too
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=args.autocast == "bf16")
    starts, held_out = window_starts(len(corpus.train), args), held_out_windows(corpus.held_out, args)
    curve = Path(args.folder) / f"{run}.jsonl"
    curve.parent.mkdir(parents=True, exist_ok=True)
    curve.write_text(json.dumps({"run": run, "corpus": corpus.describe(), "args": vars(args)}) + "\n")
    losses, pending, step_ms = [], [], []
    begin = chunk_begin = time.perf_counter()
    for step in range(args.steps):
        watched = telemetry is not None and (step + 1) % args.telemetry_every == 0
        if watched:
            telemetry.arm()
        ids = torch.stack([corpus.train[s : s + args.seq].long() for s in starts[step].tolist()]).to(device)
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        if guard is None or guard.check(step=step + 1):
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        pending.append(loss.detach())
        if watched:
            _write(curve, {"step": step + 1, "layers": layer_telemetry(telemetry)})
            logs = telemetry.stage().read()
            _write(curve, {"step": step + 1, "telemetry": logs, "warnings": watch.check(step + 1, logs)})
        if len(pending) == args.log_every or step + 1 == args.steps:
            values = torch.stack(pending).float().tolist()  # one wait for the device per chunk
            step_ms.append((time.perf_counter() - chunk_begin) * 1e3 / len(pending))
            losses += values
            elapsed = round(time.perf_counter() - begin, 1)
            _write(curve, {"step": step + 1, "losses": values, "seconds": elapsed})
            pending = []
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            held = evaluate(model, held_out, autocast, device)
            _write(curve, {"step": step + 1, "held_out_loss": held})
        if not pending:
            chunk_begin = time.perf_counter()
    if guard is not None:
        guard.flush()
    seconds = time.perf_counter() - begin
    from convergence_report import final_loss

    summary = {
        "run": run,
        "shape": "smollm2" if args.init == "smollm2" else args.shape,
        "lora": args.lora,
        "steps": args.steps,
        "tokens": args.steps * args.batch * args.seq,
        "final_loss": final_loss(losses),
        "held_out_loss": held,
        "held_out_ppl": math.exp(held),
        "seconds": seconds,
        # the chunks after the first (compilation), telemetry and evaluation steps included
        "ms_per_step": statistics.median(step_ms[1:] or step_ms),
        "corpus": corpus.describe(),
        "fp8_flop_share": report.fp8_flop_share if report is not None else 0.0,
        "sharded": "FSDP2 over one process" if sharded else None,
        "high_precision": {r.name: r.reason for r in report.skipped} if report is not None else {},
    }
    _write(curve, {"summary": summary})
    return summary


def shard_over_one_process(model, device) -> None:
    """``fully_shard`` on each decoder layer and then the root, over a one-process group (NCCL on a GPU,
    gloo on the CPU): what a recipe that all-gathers weights in FP8 is for."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():  # one process: an in-memory store, no rendezvous address
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)


def with_lora(model, seed: int):
    """``model`` with LoRA adapters of rank 16 on every projection (the demo's), the same in every run."""
    import torch
    from peft import LoraConfig, get_peft_model

    from hf_fp8.apps.demo import LORA_TARGETS

    torch.manual_seed(seed)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    return get_peft_model(model, config)


def evaluate(model, batches, autocast, device) -> float:
    """The mean loss over the held-out ``batches``, in eval mode."""
    import torch

    model.eval()
    with torch.no_grad(), autocast:
        total = sum(model(input_ids=b.to(device), labels=b.to(device)).loss.float() for b in batches)
    model.train()
    return float(total / len(batches))


def layer_telemetry(telemetry) -> dict[str, dict[str, list[float]]]:
    """Per sampled FP8 layer and role, ``[scale, saturated fraction, flushed fraction]`` of the step just
    finished (its casts counted since :meth:`Fp8Telemetry.arm`)."""
    rows = {}
    for name, module in telemetry.sampled:
        if module.cast_counts is None:
            continue
        counts, scales = module.cast_counts.double().tolist(), module.scale.float().tolist()
        rows[name] = {
            role: [scale, saturated / total if total else 0.0, flushed / total if total else 0.0]
            for role, scale, (total, saturated, flushed) in zip(
                module.ROLE_NAMES, scales, counts, strict=True
            )
        }
    return rows


def _write(path: Path, line: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(line) + "\n")


# ---- the driver -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", required=True, help="where each run's curve, the plots and the table go")
    parser.add_argument("--runs", default=",".join(RUNS), help="bf16 and recipe names ('default')")
    parser.add_argument("--shape", default="350m", help="a shape of harness.py")
    parser.add_argument("--steps", type=int, default=3200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (from scratch)")
    parser.add_argument("--warmup-share", type=float, default=0.03, help="of the steps, the lr warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--init", default="config", choices=("config", "smollm2"), help="from --shape's config or SmolLM2"
    )
    parser.add_argument("--lora", action="store_true", help="train LoRA adapters over frozen weights")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--autocast", default="bf16", choices=("bf16", "none"))
    parser.add_argument("--compile", type=int, default=1, help="hf_fp8.compile every run (1) or none (0)")
    parser.add_argument("--tokenizer", default="smollm2", help="smollm2, bytes or a tokenizer folder")
    parser.add_argument("--max-files", type=int, default=0, help="a corpus of the first N files (tests)")
    parser.add_argument("--held-out-share", type=float, default=0.01, help="of the files, held out")
    parser.add_argument("--log-every", type=int, default=50, help="steps between loss reads")
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--telemetry-every", type=int, default=100)
    parser.add_argument(
        "--spike",
        type=float,
        default=0.1,
        help="a spike: a loss this much over BF16's, same batch",
    )
    parser.add_argument("--smooth", type=int, default=50, help="the plots' moving average, in steps")
    parser.add_argument("--gpus", help="GPU numbers (0,1,...): as many runs at once, one a GPU")
    parser.add_argument("--plot", action="store_true", help="only draw the plots and the table again")
    parser.add_argument("--one", help="train this one run here (the driver runs each in a process)")
    parser.add_argument("--out", help="append the summary's JSON line here")
    args = parser.parse_args(argv)
    from processes import append_result, run_modes_in_processes

    if args.init == "smollm2" and args.tokenizer != "smollm2":
        parser.error("--init smollm2 reads the corpus with its own tokenizer: --tokenizer smollm2")
    runs = args.runs.split(",")
    if unknown := sorted(set(runs) - {"bf16", "default", *_recipe_names()}):
        parser.error(f"unknown runs {unknown}: bf16, default or a named recipe")
    if args.one:
        append_result(run_one(args.one, args), args.out)
        return 0
    if not args.plot:
        print(load_corpus(args).describe(), flush=True)  # built once, here, before the runs read it
        devices = args.gpus.split(",") if args.gpus else ()
        run_modes_in_processes("convergence.py", args, runs, ("plot", "lora"), devices)
    from convergence_report import report

    print(report(Path(args.folder), runs, args.smooth, args.spike))
    return 0


def _recipe_names() -> list[str]:
    from hf_fp8.recipe import RECIPES

    return list(RECIPES)


if __name__ == "__main__":
    sys.exit(main())
