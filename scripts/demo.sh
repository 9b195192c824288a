#!/usr/bin/env bash
# The main job: set up, then train a small Llama in BF16 and in FP8 on Shakespeare and compare losses.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m hf_fp8.demo "$@"
