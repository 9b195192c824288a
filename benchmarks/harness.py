"""What the benchmarks here share: the model shapes, building a model, timing a training step, running
modes one after the other, the command line and the results table.

Ratios between modes of one run are what to compare: absolute numbers drift between hosts.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Llama-3-8B's decoder layer (its 8b shapes differ in depth only)
_LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)

SHAPES = {
    # Llama-3.2-1B: hidden 2048, intermediate 8192, 16 layers, 32 heads, 8 KV heads, tied embeddings
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=True,
    ),
    # convergence.py's from-scratch model: 24 layers 1024 wide (384M parameters with an output head)
    "350m": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ),
    # a smoke test of the benchmarks themselves (--device cpu), not a measurement
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        vocab_size=256,
    ),
    # Llama-3-8B's layer shape, 4 layers
    "8b-4l": dict(_LLAMA3_8B, num_hidden_layers=4),
    # Llama-3-8B's shape, all 32 layers: more than one GPU holds for full fine-tuning (fsdp_bench.py)
    "8b": dict(_LLAMA3_8B, num_hidden_layers=32),
}


def llama_config(shape: str, layers: int | None = None) -> LlamaConfig:
    """The config of the Llama of ``shape`` (SDPA attention); ``layers`` overrides its number of layers."""
    config = LlamaConfig(**{"vocab_size": 128256, "max_position_embeddings": 8192, **SHAPES[shape]})
    if layers is not None:
        config.num_hidden_layers = layers
    config._attn_implementation = "sdpa"
    return config


def build(shape: str, device: str = "cuda", layers: int | None = None) -> LlamaForCausalLM:
    """The Llama of ``shape`` in BF16, in training mode; ``layers`` overrides its number of layers."""
    config = llama_config(shape, layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    return model.train()


def training_flops(model: torch.nn.Module, batch: int, seq: int) -> float:
    """Model FLOPs of one training step (forward and backward): 6 per token and weight of every linear
    layer (the output head included), and the causal attention's 6 x layers x seq x width per token."""
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    tokens = batch * seq
    return 6.0 * linear * tokens + 6.0 * config.num_hidden_layers * seq * width * tokens


def measure(step_model, optimizer, forward_context, args: argparse.Namespace, flops: float = 0.0) -> dict:
    """Train ``step_model`` on one random batch (forward inside ``forward_context``, backward,
    ``optimizer`` step) ``args.warmup`` times, then time ``args.steps`` steps with CUDA events: the
    median step, tokens/s, model TFLOP/s (from ``flops`` per step), the peak memory of the timed
    steps and of the warm-up steps (a first step that runs otherwise than the later ones can need
    more than the steady state, and a run must hold it too), the last loss and the warm-up time
    (compilation included). With ``args.profile``, also where the GPU time of a step goes."""
    device = torch.device(getattr(args, "device", "cuda"))
    cuda = device.type == "cuda"
    generator = torch.Generator(device=device).manual_seed(0)
    vocab = step_model.config.vocab_size  # a compiled model forwards the attribute to its module
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=device, generator=generator)

    def step() -> torch.Tensor:
        with forward_context():
            loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.warmup):
        step()
    warmup_peak_gib = 0.0
    if cuda:
        torch.cuda.synchronize()
        warmup_peak_gib = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    warmup_s = time.perf_counter() - start
    times, losses = [], []
    for _ in range(args.steps):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            loss = step()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            begin_s = time.perf_counter()
            loss = step()
            times.append((time.perf_counter() - begin_s) * 1e3)
        losses.append(loss.item())
    ms = statistics.median(times)
    result = {
        "ms_per_step": ms,
        "tokens_per_s": args.batch * args.seq / ms * 1e3,
        "tflops": flops / ms * 1e-9,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        "warmup_peak_gib": warmup_peak_gib,
        "loss": losses[-1],
        "warmup_s": warmup_s,
    }
    if getattr(args, "profile", False) and cuda:
        result["gpu_ms"] = gpu_time_by_kind(step)
    if getattr(args, "trace", None) and cuda:
        name = f"{args.shape}-{getattr(args, 'current_mode', 'step')}"
        result["trace"] = export_trace(step, args.trace, name)
    return result


# Kernel names by what they compute, for the profile breakdown (first match wins).
_KERNEL_KINDS = (
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa", "efficient")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
    ("triton", ("triton",)),
)


def gpu_time_by_kind(step: Callable[[], torch.Tensor], steps: int = 3, top: int = 25) -> dict:
    """GPU milliseconds per step by kernel kind (gemm, attention, triton, optimizer, other), the kernel
    count and the ``top`` kernels taking the most time, from torch.profiler over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return kernel_time_by_kind(prof, steps, top)


def kernel_time_by_kind(prof, steps: int, top: int = 25) -> dict:
    """What :func:`gpu_time_by_kind` reports, from a finished torch.profiler ``prof`` over ``steps``
    steps (its ``total`` is the GPU time of all kernels a step)."""
    totals: dict[str, float] = {}
    by_kernel: dict[str, float] = {}
    kernels = 0
    for event in prof.key_averages():
        if not str(getattr(event, "device_type", "")).endswith("CUDA"):
            continue  # a host-side event: its kernels are counted as themselves
        device_us = getattr(event, "device_time_total", 0.0) or getattr(event, "cuda_time_total", 0.0)
        if device_us <= 0:
            continue
        name = event.key.lower()
        kind = next((k for k, marks in _KERNEL_KINDS if any(m in name for m in marks)), "other")
        totals[kind] = totals.get(kind, 0.0) + device_us / 1e3 / steps
        by_kernel[event.key[:90]] = by_kernel.get(event.key[:90], 0.0) + device_us / 1e3 / steps
        kernels += event.count
    totals["kernels"] = kernels / steps
    totals["total"] = sum(v for k, v in totals.items() if k != "kernels")
    result: dict = {k: round(v, 2) for k, v in sorted(totals.items())}
    largest = sorted(by_kernel.items(), key=lambda item: -item[1])[:top]
    result["largest"] = [(name, round(ms, 2)) for name, ms in largest]
    return result


def export_trace(step: Callable[[], torch.Tensor], folder: str, name: str) -> str:
    """One step's CPU and GPU timeline (Chrome trace format, gzipped) in ``folder``: where the GPU
    waits for the host shows there, which the per-kind totals cannot show."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(folder, exist_ok=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(folder, f"{name}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    return path + ".gz"


def fresh_start() -> None:
    """Before a mode: it compiles from scratch (never into another mode's recompile limit: the loss
    function is one function object for every mode's model) and the last mode's model is freed (FSDP2's
    state holds reference cycles), so neither its graphs nor its memory count towards this mode's."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_all(modes: list[str], run_mode, args: argparse.Namespace) -> list[dict]:
    """``run_mode`` for each mode, one after the other, each printed (and appended to ``args.out``) as
    it finishes; a mode that fails is reported and the others still run."""
    results = []
    for mode in modes:
        fresh_start()
        try:
            args.current_mode = mode  # names the trace file, if one is asked for
            result = run_mode(mode, args)
        except Exception as err:  # report and go on: one broken mode must not hide the others
            traceback.print_exc()  # the whole story on stderr; the table gets one line
            result = {"mode": mode, "shape": args.shape, "error": f"{type(err).__name__}: {err}"[:500]}
        results.append(result)
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    return results


def parse_arguments(
    description: str, modes: tuple[str, ...], shape: str, argv: list[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """The command line every benchmark here takes, and the modes it asks for (checked)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=shape)
    parser.add_argument("--modes", default=",".join(modes))
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed steps (2 at least: hf_fp8.compile compiles after the first)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="append JSON lines here")
    parser.add_argument(
        "--device", default="cuda", help="cpu: a smoke test of the benchmark, with --shape tiny"
    )
    parser.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend (aot_eager: smoke test)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also break a step's GPU time down by kernel kind"
    )
    parser.add_argument("--trace", help="also write one step's CPU/GPU timeline (Chrome trace) here")
    args = parser.parse_args(argv)
    return args, chosen_modes(parser, args.modes, modes)


def chosen_modes(parser: argparse.ArgumentParser, text: str, modes: tuple[str, ...]) -> list[str]:
    """The comma-separated modes of ``text``; an unknown one is a command-line error."""
    chosen = text.split(",")
    unknown = sorted(set(chosen) - set(modes))
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(modes)}")
    return chosen


def begin_run(args: argparse.Namespace, modes: list[str], detail: str = "") -> None:
    """Import Transformer Engine when a mode needs it, then print the run's header line.

    TE comes first, before CUDA and cuDNN are initialised: imported later, on some hosts it resolves a
    system cuDNN library that clashes with the one torch already loaded. Even so, on the hosts of
    RESULTS.md a process with TE loses torch's cuDNN attention, in every mode: run TE modes apart.
    """
    if any("te" in mode.split("-") for mode in modes):
        import transformer_engine.pytorch  # noqa: F401
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(
        f"# {device}, torch {torch.__version__}, shape {args.shape}, batch {args.batch} x {args.seq}{detail}",
        flush=True,
    )


def print_table(
    results: list[dict], baseline: str, titles: list[str], cells: Callable[[dict, dict | None], list[str]]
) -> None:
    """``results`` as a Markdown table, one row per mode: ``cells(result, baseline result)`` gives the
    columns after the mode (the baseline result is ``None`` when that mode failed or did not run)."""
    base = next((r for r in results if r["mode"] == baseline and "error" not in r), None)
    print("\n| mode | " + " | ".join(titles) + " |\n" + "|---" * (len(titles) + 1) + "|")
    for r in results:
        row = [f"error: {r['error'][:80]}"] + [""] * (len(titles) - 1) if "error" in r else cells(r, base)
        print(f"| {r['mode']} | " + " | ".join(row) + " |")


def ratio(result: dict, base: dict | None, key: str) -> str:
    """``result[key]`` over the baseline's, or ``-`` without a baseline."""
    return f"{result[key] / base[key]:.2f}x" if base and base[key] else "-"


def add_sharded_arguments(parser: argparse.ArgumentParser, modes: tuple[str, ...]) -> None:
    """The options of the benchmarks that shard one model over several processes (FSDP2, ZeRO)."""
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--modes", default=",".join(modes))
    parser.add_argument("--layers", type=int, help="the shape's number of layers, changed (one GPU: fewer)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="hf_fp8.compile the sharded model")
    parser.add_argument("--device", default="cuda", help="cpu: a gloo smoke test, with --shape tiny")


def add_resume_arguments(parser: argparse.ArgumentParser) -> None:
    """``--resume-check K`` and where it saves: the sharded benchmarks that check their checkpoints."""
    parser.add_argument(
        "--resume-check", type=int, default=0, metavar="K", help="then train K steps twice from a checkpoint"
    )
    parser.add_argument("--checkpoint-dir", default=tempfile.gettempdir(), help="where --resume-check saves")


def fp8_state_digest(model: torch.nn.Module) -> str:
    """A hash of the bytes of every FP8 layer's amax histories, scales and step counts: equal on two
    ranks when their FP8 states are equal bit for bit."""
    from hf_fp8.layers.fp8_scaled import STATE_BUFFERS

    digest = hashlib.sha256()
    for name, buffer in model.named_buffers():
        if name.rsplit(".", 1)[-1] in STATE_BUFFERS:
            digest.update(buffer.detach().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def same_on_every_rank(value: object) -> bool:
    """Whether every rank of the default process group holds an equal ``value``."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def run_sharded(
    modes: list[str], run_mode, args: argparse.Namespace, titles: list[str], row_cells: Callable
) -> int:
    """A sharded benchmark's run on this rank: the process group (NCCL on GPUs, each rank on its own;
    gloo on the CPU), every mode, and rank 0's table against ``bf16``."""
    import torch.distributed as dist

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    results = run_modes_on_ranks(modes, run_mode, args, rank)
    if rank == 0:
        print_table(results, "bf16", titles, row_cells)
    dist.destroy_process_group()
    return 0


def time_steps(step: Callable[[], torch.Tensor], args: argparse.Namespace) -> dict:
    """Run ``step`` ``args.warmup`` times, then time ``args.steps`` steps (wall clock, synchronised) of
    ``args.batch`` x ``args.seq`` tokens a rank: tokens/s per GPU and the median step's ms, the peak
    memory (GiB) of the timed steps alone and of the warm-up, the warm-up's seconds, the last loss and
    every loss: the fields of a sharded benchmark's result."""
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    started = time.perf_counter()
    warmup_s = warmup_peak_gib = 0.0
    for index in range(args.warmup + args.steps):
        if index == args.warmup:  # the warm-up (first steps, compilation) apart
            warmup_s = time.perf_counter() - started
            if cuda:
                warmup_peak_gib = torch.cuda.max_memory_allocated() / 2**30
                torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    seconds = statistics.median(times)
    return {
        "tokens_per_s_per_gpu": args.batch * args.seq / seconds,
        "ms_per_step": seconds * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
        "warmup_peak_gib": warmup_peak_gib,
        "warmup_s": warmup_s,
        "loss": losses[-1],
        "losses": losses,
    }


def run_modes_on_ranks(modes: list[str], run_mode, args: argparse.Namespace, rank: int) -> list[dict]:
    """``run_mode(mode, args, rank)`` for each mode, on every rank of a sharded run; rank 0 prints each
    result as a JSON line as it finishes."""
    results = []
    for mode in modes:
        results.append(run_mode(mode, args, rank))
        if rank == 0:
            print(json.dumps(results[-1]), flush=True)
    return results
