"""The table and the plots of ``convergence.py``'s runs, from the ``.jsonl`` curve each run wrote.

``table`` holds each run to issue 46's bounds against the ``bf16`` run: its final training loss within
0.5%, its held-out perplexity within 1%, and no loss spike that BF16 does not have. ``plot`` draws the
smoothed loss curves (held-out losses as dots), each run's loss over BF16's, and the FP8 telemetry
(fractions of values saturated and flushed, forward and backward) over the steps.
"""

from __future__ import annotations

import json
from pathlib import Path

from hf_fp8.apps.demo_report import moving_average


def read_curve(path: Path) -> dict:
    """A run's ``.jsonl``: its losses by step, held-out losses, telemetry lines and summary."""
    curve = {"losses": [], "held_out": [], "telemetry": [], "summary": None}
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        if "losses" in entry:
            curve["losses"] += entry["losses"]
        elif "held_out_loss" in entry:
            curve["held_out"].append((entry["step"], entry["held_out_loss"]))
        elif "telemetry" in entry:
            curve["telemetry"].append((entry["step"], entry["telemetry"]))
        elif "summary" in entry:
            curve["summary"] = entry["summary"]
    return curve


def table(summaries: list[dict], bounds: tuple[float, float] = (0.5, 1.0)) -> str:
    """Markdown: each run's final training loss and held-out perplexity against BF16's, its spikes, and
    whether it holds issue 46's bounds (``bounds``: % of the loss, % of the perplexity)."""
    base = next((s for s in summaries if s["run"] == "bf16"), None)
    lines = [
        "| run | final train loss | vs BF16 | held-out ppl | vs BF16 | spikes (first) | ms a step "
        "| within bounds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        if "error" in s:
            lines.append(f"| {s['run']} | error: {s['error'][:80]} |||||||")
            continue
        loss_gap = 100 * (s["final_loss"] / base["final_loss"] - 1) if base else float("nan")
        ppl_gap = 100 * (s["held_out_ppl"] / base["held_out_ppl"] - 1) if base else float("nan")
        extra = sorted(set(s["spikes"]) - set(base["spikes"] if base else []))
        spike = f"{len(s['spikes'])} ({s['spikes'][0]})" if s["spikes"] else "0"
        holds = s is base or (abs(loss_gap) <= bounds[0] and abs(ppl_gap) <= bounds[1] and not extra)
        lines.append(
            f"| {s['run']} | {s['final_loss']:.4f} | {loss_gap:+.2f}% | {s['held_out_ppl']:.3f} | "
            f"{ppl_gap:+.2f}% | {spike} | {s['ms_per_step']:.0f} | {'yes' if holds else '**no**'} |"
        )
    return "\n".join(lines)


def plot(folder: Path, curves: dict[str, dict], window: int) -> list[Path]:
    """``loss.png``, ``ratio.png`` and (with FP8 telemetry) ``telemetry.png`` in ``folder``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        reference = moving_average(base["losses"], window)
        for run, curve in curves.items():
            if run == "bf16":
                continue
            ours = moving_average(curve["losses"], window)
            gaps = [100 * (a / b - 1) for a, b in zip(ours, reference, strict=False)]
            ax.plot(range(1, len(gaps) + 1), gaps, label=run, linewidth=1)
        ax.axhline(0, color="black", linewidth=0.5)
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


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def report(folder: Path, runs: list[str], window: int) -> str:
    """The table and the plots from the runs' files in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    curves = {r: read_curve(folder / f"{r}.jsonl") for r in runs if (folder / f"{r}.jsonl").is_file()}
    summaries = [
        curves[r]["summary"] if r in curves and curves[r]["summary"] else {"run": r, "error": "no summary"}
        for r in runs
    ]
    plot(folder, curves, window)
    text = table(summaries)
    (folder / "table.md").write_text(text + "\n")
    return text
