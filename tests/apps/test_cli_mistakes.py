"""Mistakes on the command line: one line on stderr naming the problem, exit status 2, before any
model or data is loaded.
"""

from __future__ import annotations

from pathlib import Path

import forked
import pytest
from hostile_world import (
    HF_FP8,
    write,
)


def broken_config(tmp_path: Path) -> str:
    config = '{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": -3}'
    (tmp_path / "config.json").write_text(config)
    return str(tmp_path)


CLI_CASES = [
    (lambda t: ("inspect", broken_config(t)), "cannot build a model from the config"),
    (
        lambda t: ("inspect", "/no/model", "--recipe", str(write(t / "bin.yaml", bytes(range(256))))),
        "is not text",
    ),
    (lambda t: ("launch", "--recipe", str(write(t / "bin.yaml", bytes(range(256)))), "s.py"), "is not text"),
    (lambda t: ("demo", "--seq-len", "1"), "--seq-len must be from 2"),
    (lambda t: ("demo", "--device", "tpu"), "--device 'tpu'"),
    (lambda t: ("demo", "--lr", "5"), "--lr must be between 0 and 1"),
]


@pytest.mark.parametrize("index", range(len(CLI_CASES)))
def test_command_line_mistakes_are_one_line_and_exit_2(index, tmp_path):
    make_args, expected = CLI_CASES[index]
    result = forked.run([str(HF_FP8), *make_args(tmp_path)], timeout=300)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("hf-fp8: error: ") and expected in lines[0], lines
