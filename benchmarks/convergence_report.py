"""The table and the plots of ``convergence.py``'s runs, from the ``.jsonl`` curve each run wrote.

``table`` holds each run to issue 46's bounds against the ``bf16`` run: its final training loss within
0.5%, its held-out perplexity within 1%, and no loss spike that BF16 does not have (every run sees the
same batches, so a spike is a step whose loss rises well above BF16's on the same batch). ``plot``
draws the smoothed loss curves (held-out losses as dots), each run's loss over BF16's, and the FP8
telemetry (fractions of values saturated and flushed, forward and backward) over the steps.
``summary_figure`` puts several folders' curves in one PNG, the README's:

    python benchmarks/convergence_report.py docs/convergence.png runs/scratch runs/smollm2-full \
        runs/smollm2-lora
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from hf_fp8.apps.demo_report import moving_average

_FINAL_SHARE = 0.05  # the final loss: the mean over this last share of the steps


def read_curve(path: Path) -> dict:
    """A run's ``.jsonl``: its losses by step, held-out losses, telemetry lines and summary."""
    curve = {"losses": [], "held_out": [], "telemetry": [], "summary": None, "args": None}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "args" in entry:
            curve["args"] = entry["args"]
        elif "losses" in entry:
            curve["losses"] += entry["losses"]
        elif "held_out_loss" in entry:
            curve["held_out"].append((entry["step"], entry["held_out_loss"]))
        elif "telemetry" in entry:
            curve["telemetry"].append((entry["step"], entry["telemetry"]))
        elif "summary" in entry:
            curve["summary"] = entry["summary"]
    return curve


def table(
    curves: dict[str, dict], runs: list[str], bounds: tuple[float, float] = (0.5, 1.0), spike: float = 0.1
) -> str:
    """Markdown: each run's final training loss (the mean of its last 5% of steps) and held-out perplexity
    (at its last evaluation) against BF16's over the same steps, the steps where its loss rose more than
    ``spike`` (a fraction) above BF16's on the same batch, and whether it holds issue 46's bounds
    (``bounds``: % of the loss, % of the perplexity). A run that stopped early is compared over the steps
    it ran and marked incomplete."""
    base = curves.get("bf16")
    lines = [
        "| run | steps | final train loss | vs BF16 | held-out ppl | vs BF16 | spikes over BF16 | ms a step "
        "| within bounds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        curve = curves.get(run)
        if curve is None or not curve["losses"] or not curve["held_out"]:
            lines.append(f"| {run} | no curve: the run did not start or crashed early ||||||||")
            continue
        losses, (step, held) = curve["losses"], curve["held_out"][-1]
        final = final_loss(losses)
        loss_gap = ppl_gap = float("nan")
        extra: list[int] = []
        if base is not None:
            loss_gap = 100 * (final / final_loss(base["losses"][: len(losses)]) - 1)
            base_held = dict(base["held_out"]).get(step)
            ppl_gap = 100 * (math.exp(held - base_held) - 1) if base_held is not None else float("nan")
            extra = spikes_over(losses, base["losses"], spike)
        summary = curve["summary"]
        done = summary is not None
        holds = run == "bf16" or (abs(loss_gap) <= bounds[0] and abs(ppl_gap) <= bounds[1] and not extra)
        verdict = ("yes" if holds else "**no**") if done else "incomplete"
        first = f" ({extra[0]})" if extra else ""
        speed = f"{summary['ms_per_step']:.0f}" if done else ""
        steps = f"{len(losses)}" if done else f"{len(losses)} of {_planned(curve)}"
        lines.append(
            f"| {run} | {steps} | {final:.4f} | {loss_gap:+.2f}% | {math.exp(held):.3f} | {ppl_gap:+.2f}% | "
            f"{len(extra)}{first} | {speed} | {verdict} |"
        )
    return "\n".join(lines)


def spikes_over(losses: list[float], base: list[float], threshold: float) -> list[int]:
    """The steps (from 1) whose loss is more than ``threshold`` (a fraction) above ``base``'s loss on the
    same step, or not finite: the spikes that the base run, on the same batch, did not have."""
    return [
        step
        for step, (ours, theirs) in enumerate(zip(losses, base, strict=False), start=1)
        if not math.isfinite(ours) or ours > theirs * (1 + threshold)
    ]


def final_loss(losses: list[float]) -> float:
    """The mean loss over the last 5% of ``losses`` (one step's loss is noisy)."""
    count = max(1, int(len(losses) * _FINAL_SHARE))
    return statistics.mean(losses[-count:])


def _planned(curve: dict) -> int:
    return curve["args"].get("steps", 0) if curve.get("args") else 0


def plot(folder: Path, curves: dict[str, dict], window: int) -> list[Path]:
    """``loss.png``, ``ratio.png`` and (with FP8 telemetry) ``telemetry.png`` in ``folder``."""
    plt = _pyplot()
    written = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for run, curve in curves.items():
        steps = range(1, len(curve["losses"]) + 1)
        (line,) = ax.plot(steps, moving_average(curve["losses"], window), label=run, linewidth=1)
        if curve["held_out"]:
            ax.plot(*zip(*curve["held_out"], strict=True), "o", color=line.get_color(), markersize=3)
    ax.set(xlabel="step", ylabel=f"training loss (mean of {window} steps); dots: held-out", yscale="log")
    ax.legend()
    written.append(_save(fig, folder / "loss.png"))
    base = curves.get("bf16")
    if base is not None:
        fig, ax = plt.subplots(figsize=(8, 4))
        _draw_gaps(ax, base, {r: c for r, c in curves.items() if r != "bf16"}, window, linewidth=1)
        ax.set(xlabel="step", ylabel=f"loss vs BF16, % (mean of {window} steps)")
        ax.legend()
        written.append(_save(fig, folder / "ratio.png"))
    watched = {run: c["telemetry"] for run, c in curves.items() if c["telemetry"]}
    if watched:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for run, entries in watched.items():
            steps = [step for step, _ in entries]
            for ax, key in zip(axes, ("saturated", "flushed"), strict=True):
                for direction, style in (("fwd", "-"), ("bwd", "--")):
                    values = [logs.get(f"fp8/{key}_{direction}", float("nan")) for _, logs in entries]
                    ax.plot(steps, values, style, label=f"{run} {direction}", linewidth=1)
        for ax, key in zip(axes, ("saturated", "flushed"), strict=True):
            ax.set(xlabel="step", ylabel=f"fraction of values {key}", yscale="symlog", ylim=(0, None))
            ax.set_yscale("symlog", linthresh=1e-6)
            ax.legend(fontsize=7)
        written.append(_save(fig, folder / "telemetry.png"))
    return written


def _pyplot():
    """matplotlib's pyplot, drawing to files (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw_gaps(ax, base: dict, curves: dict[str, dict], window: int, linewidth: float) -> None:
    """Each of ``curves``' smoothed loss over ``base``'s, in percent, step by step, and the zero line."""
    reference = moving_average(base["losses"], window)
    for run, curve in curves.items():
        ours = moving_average(curve["losses"], window)
        gaps = [100 * (a / b - 1) for a, b in zip(ours, reference, strict=False)]
        ax.plot(range(1, len(gaps) + 1), gaps, label=run, linewidth=linewidth)
    ax.axhline(0, color="black", linewidth=0.5)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def report(folder: Path, runs: list[str], window: int, spike: float = 0.1) -> str:
    """The table and the plots from the runs' files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    curves = {r: read_curve(folder / f"{r}.jsonl") for r in runs if (folder / f"{r}.jsonl").is_file()}
    plot(folder, curves, window)
    text = table(curves, runs, spike=spike)
    (folder / "table.md").write_text(text + "\n")
    return text


def summary_figure(folders: list[Path], out: Path, window: int = 50) -> Path:
    """One PNG for the README: the first folder's smoothed loss curves, then for every folder each run's
    smoothed loss over BF16's (a panel a folder, titled by the folder's name)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(folders) + 1, figsize=(5 * (len(folders) + 1), 4))
    for i, folder in enumerate(folders):
        curves = {p.stem: read_curve(p) for p in sorted(folder.glob("*.jsonl")) if p.stem != "summaries"}
        base = curves.pop("bf16")
        if i == 0:
            smoothed = moving_average(base["losses"], window)
            axes[0].plot(range(1, len(smoothed) + 1), smoothed, label="bf16", linewidth=1.5, color="black")
            for run, curve in curves.items():
                ours = moving_average(curve["losses"], window)
                axes[0].plot(range(1, len(ours) + 1), ours, label=run, linewidth=0.8)
            axes[0].set(title=f"{folder.name}: training loss", xlabel="step", yscale="log")
            axes[0].legend(fontsize=7)
        ax = axes[i + 1]
        _draw_gaps(ax, base, curves, window, linewidth=0.8)
        ax.set(title=f"{folder.name}: loss vs BF16, %", xlabel="step")
        ax.legend(fontsize=7)
    return _save(fig, out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="the README's convergence figure from runs' folders")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("folders", type=Path, nargs="+", help="convergence.py --folder folders")
    parsed = parser.parse_args()
    print(summary_figure(parsed.folders, parsed.out))
