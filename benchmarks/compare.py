"""One command, one table: every training-step mode of ``step_bench.py``, each in a process of its own.

    python benchmarks/compare.py --shape 1b,8b-4l --torchao-path /root/torchao --te-path /root/site

Why a process per row: compiled modes must not share caches or memory peaks, torchao is a peer that
should not be on the path of the others, and a process that can import Transformer Engine loses
PyTorch's cuDNN attention on some hosts (see RESULTS.md), so the TE rows run in one process of their
own with their own BF16 baseline (``bf16 (TE process)``). Rows whose package is not given or does not
import are left out with a note. Ratios are against the rows of the same run.
"""

from __future__ import annotations

import argparse
import json
import sys

from processes import run_script

DEFAULT_ROWS = "bf16,bf16-compile,hf-fp8,hf-fp8-lmhead,torchao,te-fused,te-fused-lmhead"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1b", help="one shape, or several comma-separated (1b,8b-4l)")
    parser.add_argument("--rows", default=DEFAULT_ROWS, help="step_bench.py modes, comma-separated")
    parser.add_argument(
        "--torchao-path", help="a folder holding torchao (put on the torchao row's path only)"
    )
    parser.add_argument("--te-path", help="a folder holding Transformer Engine (TE rows only)")
    parser.add_argument("--out", help="append every result as a JSON line here")
    args, passed_on = parser.parse_known_args(argv)  # --batch, --seq, --warmup, --steps, --profile
    rows = args.rows.split(",")
    te_rows = [r for r in rows if r.startswith(("te", "accelerate-te"))]
    groups = [([r], _extra_path(r, args)) for r in rows if r not in te_rows]
    if te_rows:
        groups.append((["bf16", *te_rows], args.te_path))
    tables = []
    for shape in args.shape.split(","):
        results = []
        for modes, extra in groups:
            if extra is False:
                print(f"# {modes[0]}: left out (no --torchao-path given)", flush=True)
                continue
            if any(m in te_rows for m in modes) and not args.te_path:
                print(f"# {', '.join(te_rows)}: left out (no --te-path given)", flush=True)
                continue
            te_process = modes[0] == "bf16" and len(modes) > 1
            results += _run(modes, extra, shape, passed_on, te_process)
        if args.out:
            with open(args.out, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in results)
        tables.append((shape, results))
    for shape, results in tables:  # at the end, together: ratios are within a shape
        print(f"\n## {shape}")
        _print_table(results)
    return 0


def _extra_path(row: str, args: argparse.Namespace) -> str | bool | None:
    if row.startswith("torchao"):
        return args.torchao_path or False
    return None


def _run(
    modes: list[str], extra: str | None, shape: str, passed_on: list[str], te_process: bool
) -> list[dict]:
    arguments = ["--shape", shape, "--modes", ",".join(modes), *passed_on]
    found, status = run_script("step_bench.py", arguments, extra)
    if status and not found:
        found = [{"mode": m, "shape": shape, "error": f"exit status {status}"} for m in modes]
    if te_process:
        for result in found:
            if result["mode"] == "bf16":
                result["mode"] = "bf16 (TE process)"
    return found


def _print_table(results: list[dict]) -> None:
    by_mode = {r["mode"]: r for r in results if "error" not in r}

    def vs(r: dict, mode: str, key: str = "tokens_per_s") -> str:
        base = by_mode.get(mode)
        return f"{r[key] / base[key]:.2f}x" if base and base[key] else "-"

    titles = [
        "tokens/s",
        "vs bf16",
        "vs bf16-compile",
        "vs torchao",
        "peak GiB",
        "vs bf16",
        "warm-up peak GiB",
        "warm-up s",
        "TFLOP/s",
    ]
    print("\n| mode | " + " | ".join(titles) + " |\n" + "|---" * (len(titles) + 1) + "|")
    for r in results:
        if "error" in r:
            print(f"| {r['mode']} | error: {r['error'][:100]} |")
            continue
        own_bf16 = "bf16 (TE process)" if r["mode"].startswith(("te", "accelerate-te")) else "bf16"
        cells = [
            f"{r['tokens_per_s']:,.0f}",
            vs(r, own_bf16),
            vs(r, "bf16-compile"),
            vs(r, "torchao"),
            f"{r['peak_gib']:.1f}",
            vs(r, own_bf16, "peak_gib"),
            f"{r.get('warmup_peak_gib', 0.0):.1f}",
            f"{r['warmup_s']:.0f}",
            f"{r['tflops']:.0f}",
        ]
        print(f"| {r['mode']} | " + " | ".join(cells) + " |")
    for r in results:
        if "gpu_ms" in r:
            print(f"# {r['mode']} GPU ms per step by kernel kind: {r['gpu_ms']}")


if __name__ == "__main__":
    sys.exit(main())
