"""Running a benchmark script in a process of its own and reading the results it writes.

Why a process per row: compiled modes must not share compile caches or memory peaks, and a peer's
package (torchao, Transformer Engine) goes on the path of its own rows only. No torch import here: the
drivers that use this stay light.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_script(script: str, arguments: list[str], extra_path: str | None = None) -> tuple[list[dict], int]:
    """Run ``benchmarks/<script>`` with ``arguments`` and ``--out`` a file of its own (last, so it wins),
    with ``extra_path`` and this checkout first on its path, from the benchmarks folder. Returns the JSON
    lines it wrote there and its exit status. Its compile caches (Inductor's, Triton's) start empty, as
    on a user's first run: a row's warm-up never reuses what an earlier row compiled."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(HERE.parent), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory() as tmp:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton")
        out = Path(tmp) / "results.jsonl"
        command = [sys.executable, str(HERE / script), *arguments, "--out", str(out)]
        process = subprocess.run(command, env=env, cwd=HERE)
        found = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return found, process.returncode
