"""The demo's outputs: the loss curves as a picture and the comparison as a Markdown report."""

from __future__ import annotations

import argparse
import math
import platform
from pathlib import Path

import torch

__all__ = ["final_loss", "moving_average", "plot_losses", "speed_note", "summary", "write_report"]

# The accuracy targets the comparison is held to (see the README).
TRAIN_LOSS_TARGET = 0.01
PERPLEXITY_TARGET = 0.01


def final_loss(losses: list[float]) -> float:
    """Mean of the last 10% of the steps (at least one): the training loss a run ends with."""
    tail = max(len(losses) // 10, 1)
    return sum(losses[-tail:]) / tail


def _gap(fp8: float, base: float) -> float:
    return (fp8 - base) / base


def summary(arms) -> str:
    """The comparison in a few lines: final training loss, held-out loss and perplexity, time per step.
    ``arms`` are the high-precision run (named BF16 or FP32) and the FP8 run."""
    base, fp8 = arms
    name = base.name
    last = max(base.held_out)
    train_gap = _gap(final_loss(fp8.losses), final_loss(base.losses))
    ppl_base, ppl_fp8 = math.exp(base.held_out[last]), math.exp(fp8.held_out[last])
    ppl_gap = _gap(ppl_fp8, ppl_base)
    verdict = (
        "within" if abs(train_gap) <= TRAIN_LOSS_TARGET and abs(ppl_gap) <= PERPLEXITY_TARGET else "OUTSIDE"
    )
    tail = max(len(base.losses) // 10, 1)
    before = math.exp(base.held_out[0])
    base_step, fp8_step = base.seconds_per_step, fp8.seconds_per_step
    rows = [
        f"final train loss (mean of last {tail} steps): {name} {final_loss(base.losses):.4f}  "
        f"FP8 {final_loss(fp8.losses):.4f}  ({train_gap:+.2%})",
        f"held-out perplexity: before {before:.2f}; after {name} {ppl_base:.2f}  FP8 {ppl_fp8:.2f}  "
        f"({ppl_gap:+.2%})",
        f"time per step (median): {name} {base_step:.2f} s, FP8 {fp8_step:.2f} s",
        f"FP8 is {verdict} the accuracy targets (train loss within {TRAIN_LOSS_TARGET:.0%}, held-out "
        f"perplexity within {PERPLEXITY_TARGET:.0%} of {name})",
    ]
    return "\n".join(rows)


def plot_losses(arms, args: argparse.Namespace, path: Path) -> Path:
    """Both training curves (each step faint, a moving average bold) and the held-out points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4.5), dpi=120)
    window = max(len(arms[0].losses) // 10, 1)
    for arm, color in zip(arms, ("tab:blue", "tab:orange"), strict=True):
        steps = range(1, len(arm.losses) + 1)
        axis.plot(steps, arm.losses, color=color, alpha=0.3, linewidth=1)
        axis.plot(
            steps, moving_average(arm.losses, window), color=color, linewidth=2, label=f"{arm.name} train"
        )
        held = sorted(arm.held_out.items())
        axis.plot(
            [s for s, _ in held],
            [v for _, v in held],
            "o--",
            color=color,
            markersize=6,
            label=f"{arm.name} held-out",
        )
    mode = "full fine-tune" if args.full else "LoRA r=16"
    axis.set_title(f"SmolLM2-135M on Shakespeare, {mode}: {arms[0].name} vs FP8 ({args.device})")
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("loss")
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def write_report(arms, args: argparse.Namespace, patch_report, path: Path, held_out: tuple[str, ...]) -> Path:
    """``report.md``: settings, results, FP8 telemetry of the last step, and the patch report."""
    base, fp8 = arms
    name = base.name
    last = max(base.held_out)
    mode = "full fine-tune" if args.full else "LoRA (r=16, alpha 32, all seven projections)"
    eval_steps = ", ".join(map(str, sorted(base.held_out)))
    autocast = "autocast BF16" if name == "BF16" else "float32 throughout (no autocast)"
    lines = [
        f"# hf-fp8 demo: {name} vs FP8 fine-tune",
        "",
        "SmolLM2-135M-Instruct fine-tuned on Shakespeare (held out: "
        f"{', '.join(held_out)}), twice, from the same weights on the same batches.",
        "",
        "## Settings",
        "",
        "| setting | value |",
        "|---|---|",
        f"| fine-tune | {mode} |",
        f"| steps x batch x sequence | {args.steps} x {args.batch_size} x {args.seq_len} tokens |",
        f"| optimizer | AdamW, lr {args.lr:g}, gradient clipping 1.0, {autocast} |",
        f"| FP8 recipe | {_recipe_line(args.recipe)} |",
        f"| device | {_device_name(args.device)} |",
        f"| held-out | {args.eval_batches} batches, evaluated in {name} at steps {eval_steps} |",
        "",
        "## Results",
        "",
        f"| | {name} | FP8 | FP8 vs {name} |",
        "|---|---|---|---|",
        _row("final train loss (last 10% of steps)", final_loss(base.losses), final_loss(fp8.losses)),
        _row("held-out loss before", base.held_out[0], fp8.held_out[0]),
        _row("held-out loss after", base.held_out[last], fp8.held_out[last]),
        _row("held-out perplexity after", math.exp(base.held_out[last]), math.exp(fp8.held_out[last]), ".2f"),
        _row("seconds per step (median)", base.seconds_per_step, fp8.seconds_per_step, ".2f"),
        "",
        "```",
        summary(arms),
        "```",
        "",
        "![loss curves](loss_curves.png)",
        "",
        "## FP8 telemetry (the FP8 run's last step)",
        "",
        "| key | value |",
        "|---|---|",
        *[f"| {key} | {_value(value)} |" for key, value in fp8.telemetry.items()],
        "",
        "## What was converted",
        "",
        "```",
        str(patch_report),
        "```",
        "",
    ]
    lines.insert(4, speed_note(args.device, name, base.seconds_per_step, fp8.seconds_per_step) + "\n")
    path.write_text("\n".join(lines))
    return path


def speed_note(device: str, name: str, base_step: float, fp8_step: float) -> str:
    """What the two step times say, and why: the CPU emulates FP8's speed away; on a GPU, a model this
    small is bound by kernel launches, so FP8 may well be the slower one there."""
    times = f"FP8's step took {fp8_step:.2f} s against {name}'s {base_step:.2f} s"
    if device == "cpu":
        return (
            f"{times}. On the CPU the FP8 run computes real FP8 casts and GEMMs (FP8 values multiplied and "
            f"summed in float32, as `torch._scaled_mm`'s CPU fallback does), so it is slower than {name}; "
            "the speed-up is an FP8 GPU's, on larger models and batches (see `benchmarks/`)."
        )
    if fp8_step < base_step:
        return (
            f"{times} ({base_step / fp8_step:.2f}x). FP8's gain grows with the width of the layers and the "
            "tokens a step (see `benchmarks/`)."
        )
    return (
        f"{times}. At this size (135M parameters, 576 wide, a few hundred tokens a step) a GPU step is "
        f"bound by kernel launches, and the casts around each FP8 GEMM cost about what FP8 saves against "
        f"{name}; the speed-up shows on larger models and batches (see `benchmarks/`)."
    )


def _row(label: str, base: float, fp8: float, fmt: str = ".4f") -> str:
    return f"| {label} | {base:{fmt}} | {fp8:{fmt}} | {_gap(fp8, base):+.2%} |"


def _value(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _recipe_line(recipe) -> str:
    return (
        f"{recipe.format}, {recipe.scaling} scaling, margin {recipe.margin}, "
        f"FP8 weight storage {'on' if recipe.fp8_weights else 'off'}, "
        f"output head {_head(recipe.convert_lm_head)}"
        + ("" if recipe.forward_in_fp8 else ", forwards in high precision (backward GEMMs in FP8)")
    )


def _head(convert_lm_head: bool | str) -> str:
    if convert_lm_head == "backward":
        return "FP8 in its backward, logits in high precision"
    return "FP8" if convert_lm_head else "high precision"


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def moving_average(values: list[float], window: int) -> list[float]:
    """The trailing mean over ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
