#!/usr/bin/env bash
# The whole test suite: set up, lint, then pytest (GPU tests are skipped on machines without an FP8 GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
# A defined standard input: CI runs this with none, and torchrun's workers (tests/test_distributed.py)
# hang when pytest starts them from a process whose stdin is closed.
exec .venv/bin/python -m pytest -q "$@" </dev/null
