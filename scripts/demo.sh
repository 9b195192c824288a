#!/usr/bin/env bash
# The main job: set up, then fine-tune SmolLM2-135M on Shakespeare in BF16 and in FP8 and compare the runs
# (writes hf-fp8-demo/report.md and hf-fp8-demo/loss_curves.png; options: --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m hf_fp8.apps.demo "$@"
