#!/usr/bin/env bash
# The whole test suite: set up, lint, then pytest (GPU tests are skipped on machines without an FP8 GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
.venv/bin/python -m ruff format --check .
# Two workers (pytest-xdist), each taking whole test files, so a module's fixtures and background runs
# start once; one OpenMP thread each, as two processes with two spinning threads each run slower than
# one each. On a 2-core AVX2 EPYC the suite took 38 min in one process, 26 in two. (`-n 0` after the
# script's name runs it in one process, for -s or --pdb.)
# A defined standard input: CI runs this with none, and torchrun's workers (tests/test_distributed.py)
# hang when pytest starts them from a process whose stdin is closed.
OMP_NUM_THREADS=1 exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@" </dev/null
