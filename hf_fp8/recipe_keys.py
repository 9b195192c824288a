"""The keys a recipe is written with: each field's check (type, choices, range and why the range), and
the keys of NeMo, the H200 training guide and accelerate's ``ACCELERATE_FP8_*`` variables that map onto
the fields. :class:`hf_fp8.recipe.Fp8Recipe` validates every value through here, whichever way it came.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from typing import Any, Literal, get_args

__all__ = [
    "BLOCK_SCALINGS",
    "ENV_VARS",
    "MAX_MARGIN",
    "AmaxComputeAlgo",
    "FormatName",
    "NanPolicy",
    "Scaling",
    "check_format_flags",
    "e4m3_only",
    "parse_bool",
    "translate_key",
    "validate_field",
]

FormatName = Literal["hybrid", "e4m3", "e5m2"]
Scaling = Literal["delayed", "current", "rowwise", "rowwise_gw_hp", "block", "block_gw_rowwise"]
# Scalings that cast weights in 128x128 blocks and activations and gradients in 1x128 tiles.
BLOCK_SCALINGS = ("block", "block_gw_rowwise")
AmaxComputeAlgo = Literal["max", "most_recent"]
NanPolicy = Literal["raise", "skip_step", "increase_margin"]

# Upper bounds of the integer fields, each with the reason a larger value cannot help.
MAX_MARGIN = 8
_MARGIN_WHY = (
    "each step of margin gives up one binade of range; at 8 the largest value already sits 256x below "
    "E4M3's maximum, with half of its normal range gone"
)
MAX_AMAX_HISTORY_LEN = 65536
_HISTORY_WHY = "a longer history costs 12 bytes per entry and FP8 layer and adapts no better"
MAX_INTERVAL = 100_000
_INTERVAL_WHY = "scales that are never recomputed stop following the tensors; use a smaller interval"


def e4m3_only(scaling: Scaling) -> bool:
    """Whether ``scaling``'s GEMMs take E4M3 operands only (cuBLAS's row-wise kernels; DeepSeek-style
    blocks)."""
    return scaling in ("rowwise", "rowwise_gw_hp", *BLOCK_SCALINGS)


def validate_field(name: str, value: Any) -> Any:
    """``value`` for the recipe field ``name``, in its canonical form; raises naming the key, the value,
    what is allowed and why."""
    return _VALIDATORS[name](name, value)


# ---- the checks -------------------------------------------------------------------------------------


def _expect_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"recipe key {name!r} must be true or false, got {value!r}")
    return value


def _expect_int(name: str, value: Any, minimum: int, maximum: int | None = None, why: str = "") -> int:
    allowed = f"an integer from {minimum} to {maximum}" if maximum is not None else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"recipe key {name!r} must be {allowed}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        reason = f"; {why}" if why and maximum is not None and value > maximum else ""
        raise ValueError(f"recipe key {name!r} must be {allowed}, got {value}{reason}")
    return value


def _expect_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value.lower() in choices:
        return value.lower()
    raise ValueError(f"recipe key {name!r} must be one of {list(choices)}, got {value!r}")


def _validate_head(name: str, value: Any) -> bool | str:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() == "backward":
        return "backward"
    raise ValueError(
        f"recipe key {name!r} must be true (the head's three GEMMs in FP8), false (none) or 'backward' (its "
        f"two backward GEMMs in FP8, the logits in high precision), got {value!r}"
    )


def _validate_head_scaling(name: str, value: Any) -> str | None:
    if value is None:
        return None
    return _expect_choice(name, value, get_args(Scaling))


def _validate_patterns(name: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"recipe key {name!r} must be a list of module name patterns, got {value!r}")
    return tuple(value)


def _choice(values: Any) -> Any:
    choices = get_args(values)
    return lambda name, value: _expect_choice(name, value, choices)


_VALIDATORS = {
    "enabled": _expect_bool,
    "format": _choice(FormatName),
    "scaling": _choice(Scaling),
    "margin": lambda n, v: _expect_int(n, v, 0, MAX_MARGIN, _MARGIN_WHY),
    "amax_history_len": lambda n, v: _expect_int(n, v, 1, MAX_AMAX_HISTORY_LEN, _HISTORY_WHY),
    "amax_compute_algo": _choice(AmaxComputeAlgo),
    "interval": lambda n, v: _expect_int(n, v, 1, MAX_INTERVAL, _INTERVAL_WHY),
    "fp8_weights": _expect_bool,
    "convert_experts": _expect_bool,
    "fp8_all_gather": _expect_bool,
    "modules_to_not_convert": _validate_patterns,
    "convert_lm_head": _validate_head,
    "head_scaling": _validate_head_scaling,
    "forward_in_fp8": _expect_bool,
    "use_during_eval": _expect_bool,
    "nan_policy": _choice(NanPolicy),
}


# ---- other projects' keys (NeMo, the H200 guide, accelerate) ---------------------------------------

_ALIASES = {
    "use_fp8": "enabled",
    "fp8_format": "format",
    "fp8_margin": "margin",
    "fp8_amax_history_len": "amax_history_len",
    "fp8_amax_compute_algo": "amax_compute_algo",
    "fp8_interval": "interval",
    "fp8_params": "fp8_weights",
}


# Keys that set nothing any more, with what took their place; recipes and checkpoints that have them
# still load.
_RETIRED = {
    "pad_to_multiple": "each FP8 layer pads the rows of its own GEMMs to 16, and the model's inputs are "
    "never padded (packed rows and per-token outputs stay as they are)",
}


def translate_key(key: Any, value: Any) -> list[tuple[str, Any]]:
    """Map one input key to the (field, value) pairs it sets."""
    if key in _VALIDATORS:
        return [(key, value)]
    if key in _RETIRED:
        warnings.warn(f"hf_fp8: recipe key {key!r} is ignored: {_RETIRED[key]}", FutureWarning, stacklevel=4)
        return []
    if key in _ALIASES:
        return [(_ALIASES[key], value)]
    if key == "fp8":  # NeMo: a bool that turns FP8 on, or (some configs) the format name
        return [("format", value)] if isinstance(value, str) else [("enabled", _expect_bool(key, value))]
    if key in ("fp8_hybrid", "fp8_e4m3"):  # NeMo: a bool per format
        return [("format", key[4:])] if _expect_bool(key, value) else []
    known = sorted([*_VALIDATORS, *_ALIASES, "fp8", "fp8_hybrid", "fp8_e4m3"])
    hint = difflib.get_close_matches(str(key), known, n=1)
    did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
    raise ValueError(f"unknown recipe key {key!r}{did_you_mean} Known keys: {', '.join(known)}")


def check_format_flags(data: Mapping[str, Any]) -> None:
    """NeMo's per-format flags: one set to false while none is true names no format at all."""
    flags = {k: data[k] for k in ("fp8_hybrid", "fp8_e4m3") if k in data}
    enabled = all(data.get(k, True) is not False for k in ("fp8", "enabled", "use_fp8"))
    if enabled and flags and all(v is False for v in flags.values()):
        given = ", ".join(f"{k}: false" for k in flags)
        raise ValueError(
            f"recipe keys {given} name no FP8 format (NeMo refuses FP8 without one); set fp8_hybrid: true "
            "(E4M3 forward, E5M2 gradients) or fp8_e4m3: true (E4M3 everywhere)"
        )


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)


# accelerate's variables, by the field each sets and how its text is read.
ENV_VARS = {
    "ACCELERATE_FP8_FORMAT": ("format", str),
    "ACCELERATE_FP8_MARGIN": ("margin", int),
    "ACCELERATE_FP8_INTERVAL": ("interval", int),
    "ACCELERATE_FP8_AMAX_HISTORY_LEN": ("amax_history_len", int),
    "ACCELERATE_FP8_AMAX_COMPUTE_ALGO": ("amax_compute_algo", str),
    "ACCELERATE_FP8_USE_AUTOCAST_DURING_EVAL": ("use_during_eval", parse_bool),
}
