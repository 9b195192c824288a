"""hf-fp8: FP8 training and fine-tuning for HuggingFace Transformers models."""

from hf_fp8.autocast import fp8_autocast
from hf_fp8.backends.native import Fp8Linear, update_fp8_scales
from hf_fp8.formats import E4M3, E5M2, cast_to_representable
from hf_fp8.recipe import RECIPES, Fp8Recipe

__version__ = "0.1.0"

__all__ = [
    "E4M3",
    "E5M2",
    "RECIPES",
    "Fp8Linear",
    "Fp8Recipe",
    "cast_to_representable",
    "fp8_autocast",
    "update_fp8_scales",
]
