"""Running a benchmark script in a process of its own and reading the results it writes.

Why a process per row: compiled modes must not share compile caches or memory peaks, and a peer's
package (torchao, Transformer Engine) goes on the path of its own rows only. No torch import here: the
drivers that use this stay light.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def run_script(
    script: str, arguments: list[str], extra_path: str | None = None, device: str | None = None
) -> tuple[list[dict], int]:
    """Run ``benchmarks/<script>`` with ``arguments`` and ``--out`` a file of its own (last, so it wins),
    with ``extra_path`` and this checkout first on its path, from the benchmarks folder, on the one GPU
    ``device`` (its number; ``None``: every GPU this process sees). Returns the JSON lines it wrote there
    and its exit status. Its compile caches (Inductor's, Triton's) start empty, as on a user's first
    run: a row's warm-up never reuses what an earlier row compiled."""
    env = dict(os.environ)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(HERE.parent), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton")
        out = Path(tmp) / "results.jsonl"
        command = [sys.executable, str(HERE / script), *arguments, "--out", str(out)]
        process = subprocess.run(command, env=env, cwd=HERE)
        found = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return found, process.returncode


def append_result(result: dict, out: str | None) -> None:
    """Print ``result`` as a JSON line, and append it to the file ``out`` when one is given."""
    print(json.dumps(result), flush=True)
    _write_line(result, out)


def run_modes_in_processes(
    script: str,
    args: Any,
    modes: list[str],
    switches: tuple[str, ...] = (),
    devices: Sequence[str] = (),
) -> list[dict]:
    """Run ``benchmarks/<script> --one MODE`` for each mode, each in a process of its own, passing on
    every setting of ``args`` (``switches``: its ``store_true`` flags, passed bare when set; settings that
    are ``None`` are left to the script's defaults). A mode that leaves no result is reported as crashed.
    Each result is appended to ``args.out`` as it comes. With ``devices`` (GPU numbers), as many modes run
    at once, each on a GPU of its own; the results keep the order of ``modes``."""
    skipped = {"modes", "one", "out", *switches}
    settings = {k: v for k, v in vars(args).items() if k not in skipped and v is not None}
    passed = [item for key, value in settings.items() for item in (f"--{key.replace('_', '-')}", str(value))]
    passed += [f"--{flag.replace('_', '-')}" for flag in switches if getattr(args, flag)]
    free: queue.Queue[str | None] = queue.Queue()
    for device in devices or [None]:
        free.put(device)

    def one(mode: str) -> list[dict]:
        device = free.get()
        try:
            found, _ = run_script(script, [*passed, "--one", mode], device=device)
        finally:
            free.put(device)
        found = found or [{"mode": mode, "shape": args.shape, "error": "no result (crashed)"}]
        _write_line(found[-1], args.out)
        return found

    with ThreadPoolExecutor(max(1, len(devices))) as pool:
        return [result for found in pool.map(one, modes) for result in found]


def _write_line(result: dict, out: str | None) -> None:
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
