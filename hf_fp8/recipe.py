"""``Fp8Recipe``: how a model uses FP8, as one frozen, validated value.

A recipe is built in code, from a YAML file, from a dict that may use NeMo's or the H200 guide's key
names, or from accelerate's ``ACCELERATE_FP8_*`` environment variables. Every way in goes through the
same validation, so a bad key, type or value is reported the same way wherever it came from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hf_fp8.formats import E4M3, E5M2, Fp8Format
from hf_fp8.recipe_keys import (
    BLOCK_SCALINGS,
    ENV_VARS,
    AmaxComputeAlgo,
    FormatName,
    NanPolicy,
    Scaling,
    check_format_flags,
    e4m3_only,
    parse_bool,
    translate_key,
    validate_field,
)

__all__ = [
    "LAUNCHER_ENV",
    "RECIPES",
    "RECIPE_LONG_RUNS",
    "RECIPE_PURPOSES",
    "SCALING_FIELDS",
    "Fp8Recipe",
    "as_recipe",
]

# Where `hf-fp8 launch` puts the recipe (as YAML text) for the processes it starts.
LAUNCHER_ENV = "HF_FP8_RECIPE"

# The fields that decide how scales are computed from amaxes: FP8 state saved under one value of these
# does not continue under another (the margin is restored from the state instead).
SCALING_FIELDS = ("format", "scaling", "amax_history_len", "amax_compute_algo", "interval")


@dataclass(frozen=True)
class Fp8Recipe:
    """How FP8 is used for training. Defaults are Transformer Engine's ``DelayedScaling`` defaults.

    Attributes:
        enabled: use FP8 at all; ``False`` keeps the model in its own precision (a BF16 baseline run).
        format: ``"hybrid"`` (E4M3 forward, E5M2 gradients), ``"e4m3"`` or ``"e5m2"`` everywhere.
        scaling: ``"delayed"`` (scale from the amax history of earlier steps), ``"current"`` (scale from
            the tensor's own amax, computed just in time), ``"rowwise"`` (a current scale per row of
            each GEMM operand), ``"rowwise_gw_hp"`` (the same, with the weight-gradient GEMM in high
            precision), ``"block"`` (a scale per 1x128 tile of activations and gradients and per 128x128
            block of weights; DeepSeek-V3's recipe, TE's ``Float8BlockScaling``; cuBLAS's block-scaled
            GEMMs on Hopper, emulated exactly elsewhere) or ``"block_gw_rowwise"`` (the same, the
            weight gradient's operands scaled per feature over the tokens, on cuBLAS's faster row-wise
            kernel). The last four need ``format: e4m3``.
        margin: scale = FP8_MAX / (amax * 2**margin); each step of margin halves the scale and buys one
            binade of headroom against overflow.
        amax_history_len: amaxes kept per tensor for delayed scaling.
        amax_compute_algo: ``"max"`` of the history or its ``"most_recent"`` entry.
        interval: recompute delayed scales every ``interval`` steps (histories still record every step).
        fp8_weights: keep frozen weights stored in FP8 (1 byte a value plus a scale).
        fp8_all_gather: under FSDP2, all-gather trainable weights in FP8 (native backend, tensorwise
            scaling): each rank casts its shard with the weight's scale before the all-gather (half the
            bytes of BF16) and the GEMMs use the gathered FP8 weight; a forward outside FP8 (evaluation)
            then reads the FP8-rounded weight. Without FSDP2 it changes nothing.
        modules_to_not_convert: module name patterns left in high precision (``fnmatch`` syntax; a
            pattern also matches as a suffix of the dotted name, so ``"lm_head"`` or ``"mlp.gate"``).
        convert_lm_head: also convert the output head and layers whose weight is tied to the input
            embeddings: ``True`` runs their three GEMMs in FP8; ``"backward"`` keeps the forward GEMM (the
            logits) in high precision and runs the two backward GEMMs in FP8 (native backend). Off by
            default: the logits feed the loss directly and are sensitive to rounding.
        head_scaling: the converted output head's own scaling (``None``: ``scaling``), in E4M3 for block or
            row scaling. Block scaling casts the logits' gradient in 1x128 tiles: one scale for it rounds
            its many small entries coarsely (SmolLM2's head: tensor-wise E5M2 errs by 3.9% and grows it
            0.6% on average; 1x128 tiles 0.5%, no growth). ``backward-fp8`` sets ``block_gw_rowwise``.
        convert_experts: also run MoE experts (transformers' 3-D experts modules) in FP8, every tensor in
            E4M3, through grouped FP8 GEMMs. Off by default: on Hopper (torch 2.11) a compiled step with FP8
            experts is as fast as with BF16 experts where the experts are few and wide (Mixtral's 8 of 8192
            at 2048 wide: 1.02x) and slower where they are many and narrow (OLMoE's 64 of 1024: 0.79x;
            there the grouped FP8 kernel itself is slower than BF16's), and the experts' FP8 costs loss. Under
            ``fp8_weights`` the experts convert whatever it says: frozen, they are stored in FP8 (half the
            memory, the point of that key).
        forward_in_fp8: ``False`` keeps every converted layer's forward GEMM in high precision and runs its
            two backward GEMMs in FP8 (native backend; tensorwise or block scaling). For losses made of
            forward values that FP8's rounding would move, summed over many tokens: DPO's log-ratios of
            a policy and its reference (SmolLM2-135M, 40 DPO steps on the CPU: loss within 0.1% of
            float32's, each step within 0.9%, against 4% and 8% with FP8 forwards).
        use_during_eval: also run FP8 in eval mode (off by default: evaluation in high precision).
        nan_policy: what :class:`hf_fp8.Fp8TrainerCallback` does with a non-finite loss, gradient or
            amax: ``"raise"`` (stop, naming the layer), ``"skip_step"`` (drop the step's gradients and
            roll the amax histories back) or ``"increase_margin"`` (skip the step and add one to the
            margin).
    """

    enabled: bool = True
    format: FormatName = "hybrid"
    scaling: Scaling = "delayed"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = "max"
    interval: int = 1
    fp8_weights: bool = False
    fp8_all_gather: bool = False
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)
    convert_lm_head: bool | str = False
    head_scaling: Scaling | None = None
    convert_experts: bool = False
    forward_in_fp8: bool = True
    use_during_eval: bool = False
    nan_policy: NanPolicy = "raise"

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = validate_field(f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, value)
        if e4m3_only(self.scaling) and self.format != "e4m3":
            raise ValueError(
                f"scaling {self.scaling!r} runs every GEMM operand in E4M3 (its kernels take no E5M2); set "
                f"format: e4m3 (format is {self.format!r})"
            )
        if self.head_scaling is not None and not self.convert_lm_head:
            raise ValueError(
                f"head_scaling {self.head_scaling!r} scales the output head, which convert_lm_head: false "
                "leaves in high precision: set convert_lm_head ('backward' or true), or unset head_scaling"
            )
        if self.fp8_all_gather and not self.tensorwise:
            raise ValueError(
                f"fp8_all_gather casts each weight with one scale before the all-gather; scaling "
                f"{self.scaling!r} scales weights by row or block: use scaling 'delayed' or 'current', or "
                "leave fp8_all_gather off"
            )

    @property
    def tensorwise(self) -> bool:
        """Whether a cast scales a whole tensor by one scale (delayed or current), not by row or block."""
        return self.scaling in ("delayed", "current")

    @property
    def in_blocks(self) -> bool:
        """Whether weights are cast in 128x128 blocks, activations and gradients in 1x128 tiles."""
        return self.scaling in BLOCK_SCALINGS

    @property
    def head_recipe(self) -> Fp8Recipe:
        """The converted output head's: under ``head_scaling`` if set (by parts: E4M3, no FP8 all-gather)."""
        if self.head_scaling is None:
            return self
        by_parts = e4m3_only(self.head_scaling)
        fmt, gathered = ("e4m3", False) if by_parts else (self.format, self.fp8_all_gather)
        return self.replace(scaling=self.head_scaling, format=fmt, fp8_all_gather=gathered, head_scaling=None)

    @property
    def forward_format(self) -> Fp8Format:
        """Format of activations and weights."""
        return E5M2 if self.format == "e5m2" else E4M3

    @property
    def backward_format(self) -> Fp8Format:
        """Format of gradients."""
        return E4M3 if self.format == "e4m3" else E5M2

    def replace(self, **changes: Any) -> Fp8Recipe:
        """A copy with ``changes`` applied and validated."""
        return dataclasses.replace(self, **changes)

    # ---- dicts and YAML -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base: Fp8Recipe | None = None) -> Fp8Recipe:
        """Build a recipe from ``data``, on top of ``base`` (the defaults when ``None``).

        Besides the field names, the NeMo keys (``fp8``, ``fp8_hybrid``, ``fp8_e4m3``, ``fp8_margin``,
        ``fp8_amax_history_len``, ``fp8_amax_compute_algo``, ``fp8_params``, ``fp8_interval``) and the H200
        guide's keys (``use_fp8``, ``fp8_format``) are accepted. Two keys that set the same field to
        different values are an error.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"an FP8 recipe must be a mapping of keys to values, got {type(data).__name__}")
        check_format_flags(data)
        changes: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for key, value in data.items():
            for name, raw in translate_key(key, value):
                try:
                    canonical = validate_field(name, raw)
                except ValueError as err:
                    if key == name:
                        raise
                    raise ValueError(f"{err} (given as {key!r})") from None
                if name in changes and changes[name] != canonical:
                    raise ValueError(
                        f"recipe keys {sources[name]!r} and {key!r} disagree on {name}: "
                        f"{changes[name]!r} vs {canonical!r}; keep one of them"
                    )
                changes[name] = canonical
                sources[name] = key
        return dataclasses.replace(base or cls(), **changes)

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """The recipe as YAML text; also written to ``path`` when given."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, section: str | None = None) -> Fp8Recipe:
        """Load a recipe from a YAML file; ``section`` picks a nested mapping of a larger config."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"cannot read FP8 recipe file {str(path)!r}: {err.strerror}") from None
        except UnicodeDecodeError:
            raise ValueError(
                f"FP8 recipe file {str(path)!r} is not text (not UTF-8): give a YAML file"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            raise ValueError(f"{path}:{where}: not valid YAML: {problem}") from None
        data = {} if data is None else data
        if section is not None:
            if not isinstance(data, Mapping) or section not in data:
                raise ValueError(f"{path}: no section {section!r} in this file")
            data = data[section]
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, base: Fp8Recipe | None = None) -> Fp8Recipe:
        """Build a recipe from accelerate's ``ACCELERATE_FP8_*`` variables, on top of ``base``.

        Only variables that are set change the recipe; an unset one keeps ``base``'s value (not
        accelerate's own default). ``ACCELERATE_FP8_OVERRIDE_{FPROP,DGRAD,WGRAD}`` would run a GEMM of
        every FP8 layer in high precision, which hf-fp8 does not do behind the user's back: they are
        refused, and ``modules_to_not_convert`` is the way to keep chosen layers in high precision.
        """
        environ = os.environ if environ is None else environ
        changes: dict[str, Any] = {}
        for var, (name, parse) in ENV_VARS.items():
            if var in environ:
                try:
                    parsed = parse(environ[var])
                except ValueError:
                    raise ValueError(
                        f"environment variable {var}={environ[var]!r} is not a valid {name}"
                    ) from None
                try:
                    changes[name] = validate_field(name, parsed)
                except ValueError as err:
                    raise ValueError(f"environment variable {var}={environ[var]!r}: {err}") from None
        for var in (f"ACCELERATE_FP8_OVERRIDE_{gemm}" for gemm in ("FPROP", "DGRAD", "WGRAD")):
            if parse_bool(environ.get(var, "false")):
                raise ValueError(
                    f"{var} asks for a high-precision GEMM inside every FP8 layer, which hf-fp8 does not "
                    "support; unset it, and list layers to keep in high precision in modules_to_not_convert"
                )
        try:
            return dataclasses.replace(base or cls(), **changes)
        except ValueError as err:
            raise ValueError(f"from ACCELERATE_FP8_* environment: {err}") from None

    @classmethod
    def load(cls, spec: str) -> Fp8Recipe:
        """A recipe from a name in :data:`RECIPES` or the path of a YAML file."""
        if spec in RECIPES:
            return RECIPES[spec]
        if not Path(spec).is_file():
            raise ValueError(
                f"recipe {spec!r} is neither a named recipe ({', '.join(sorted(RECIPES))}) nor a YAML file"
            )
        return cls.from_yaml(spec)

    @classmethod
    def from_launcher(cls, environ: Mapping[str, str] | None = None) -> Fp8Recipe:
        """The recipe ``hf-fp8 launch`` hands to its processes in ``HF_FP8_RECIPE`` (YAML text), or the
        defaults when the variable is not set."""
        environ = os.environ if environ is None else environ
        text = environ.get(LAUNCHER_ENV)
        if not text:
            return cls()
        try:
            return cls.from_dict(yaml.safe_load(text) or {})
        except (yaml.YAMLError, ValueError) as err:
            raise ValueError(f"{LAUNCHER_ENV} does not hold a valid recipe: {err}") from None

    @staticmethod
    def launched(environ: Mapping[str, str] | None = None) -> bool:
        """Whether ``hf-fp8 launch`` handed this process a recipe (see :meth:`from_launcher`)."""
        return bool((os.environ if environ is None else environ).get(LAUNCHER_ENV))

    @classmethod
    def named(cls, name: str) -> Fp8Recipe:
        """One of the named recipes in :data:`RECIPES` (the same as the files in ``recipes/``)."""
        try:
            return RECIPES[name]
        except KeyError:
            raise ValueError(f"unknown recipe {name!r}; named recipes are {sorted(RECIPES)}") from None


RECIPES: dict[str, Fp8Recipe] = {
    "hybrid-delayed": Fp8Recipe(),
    "current-scaling": Fp8Recipe(scaling="current"),
    "conservative": Fp8Recipe(margin=1),
    "head-backward": Fp8Recipe(convert_lm_head="backward"),
    "lora-fp8": Fp8Recipe(fp8_weights=True, convert_experts=True),
    "reference-fp8": Fp8Recipe(fp8_weights=True, use_during_eval=True),
    "backward-fp8": Fp8Recipe(
        forward_in_fp8=False, convert_lm_head="backward", head_scaling="block_gw_rowwise"
    ),
    "fsdp-fp8": Fp8Recipe(fp8_all_gather=True),
    "rowwise": Fp8Recipe(format="e4m3", scaling="rowwise"),
    "rowwise-gw-hp": Fp8Recipe(format="e4m3", scaling="rowwise_gw_hp"),
    "block": Fp8Recipe(format="e4m3", scaling="block"),
    "block-head": Fp8Recipe(format="e4m3", scaling="block", convert_lm_head=True),
    "lora-fp8-block": Fp8Recipe(format="e4m3", scaling="block", fp8_weights=True, convert_experts=True),
}

# What each named recipe is for, one line each (``hf-fp8 recipes`` and the command line's help show it).
RECIPE_PURPOSES: dict[str, str] = {
    "hybrid-delayed": "the defaults (TE's DelayedScaling): E4M3 forward, E5M2 gradients, delayed scales; the "
    "default for a model built from a config",
    "current-scaling": "scales from each tensor's own amax: no history, robust to sudden range changes",
    "conservative": "margin 1, a binade of headroom: the first thing to try against overflow or loss spikes",
    "head-backward": "the fastest with hf_fp8.compile, for pretraining: the head's backward in FP8 too",
    "lora-fp8": "LoRA: frozen base weights (MoE experts' too) stored in FP8, adapters in high precision",
    "reference-fp8": "a frozen forward-only model (DPO's reference), half the memory: weights stored in FP8",
    "backward-fp8": "fine-tuning (the default for a checkpoint's weights), DPO: forwards in high precision, "
    "the backward's GEMMs in FP8, the output head's too (its gradient in 1x128 tiles, by rows for its wgrad)",
    "fsdp-fp8": "pretraining under FSDP2: weights all-gathered in FP8 (native backend)",
    "rowwise": "a scale per row of each GEMM operand, from its own amax (torchao's row-wise recipe)",
    "rowwise-gw-hp": "row-wise scales, the weight-gradient GEMM in high precision",
    "block": "DeepSeek-V3's 1x128 / 128x128 blocks: the most robust to outliers",
    "block-head": "block scaling with the output head in block FP8 too: block scaling at its fastest",
    "lora-fp8-block": "LoRA over base weights stored in FP8 in 128x128 blocks (fine-grained FP8 checkpoints)",
}

# What the long runs against BF16 measured for each named recipe (``benchmarks/convergence.py``, H200s,
# 2026-11-28; docs/recipes.md#long-runs): from scratch, a 384M Llama over 3,100 steps; fine-tuned,
# SmolLM2-135M over 1,000. Issue 46's bounds: train loss within 0.5%, held-out perplexity within 1%.
RECIPE_LONG_RUNS: dict[str, str] = {
    "hybrid-delayed": "from scratch -0.14% loss, held-out -0.47%; SmolLM2 tuned +0.90%: OVER the 0.5% bound "
    "(held-out +0.88%)",
    "current-scaling": "from scratch -0.11% loss, held-out -0.22%: within the bounds",
    "conservative": "from scratch -0.11% loss, held-out -0.36%: within the bounds",
    "head-backward": "from scratch +0.04% loss, held-out -0.11%; SmolLM2 tuned +1.54%, held-out +1.64%: OVER "
    "both bounds",
    "lora-fp8": "SmolLM2 LoRA +0.91% loss: OVER the 0.5% bound (held-out +0.40%); lora-fp8-block does better",
    "reference-fp8": "frozen, forward only: not a training recipe",
    "backward-fp8": "SmolLM2 tuned +0.09% loss, held-out +0.13%; SmolLM2 LoRA +0.10%, held-out +0.13%: "
    "within the bounds (without the head's backward: from scratch +0.02%, tuned +0.06%)",
    "fsdp-fp8": "not run itself: over one rank it trains as hybrid-delayed bit for bit (from scratch -0.14% "
    "loss, held-out -0.47%); its FP8 forwards fine-tune as hybrid-delayed's: OVER the 0.5% bound (+0.90%)",
    "rowwise": "from scratch +0.23% loss, held-out +0.11%: within the bounds",
    "rowwise-gw-hp": "from scratch -0.13% loss, held-out -0.49%: within the bounds",
    "block": "from scratch -0.14% loss, held-out -0.34%: within the bounds",
    "block-head": "from scratch +0.01% loss, held-out -0.14%; SmolLM2 tuned +1.14%, held-out +2.84%: OVER "
    "both bounds",
    "lora-fp8-block": "SmolLM2 LoRA +0.50% loss, held-out +0.30%: within the bounds, at the edge",
}


def as_recipe(recipe: Fp8Recipe | str | os.PathLike | Mapping[str, Any] | None) -> Fp8Recipe:
    """What every public entry point takes as a recipe: an :class:`Fp8Recipe`, a name in
    :data:`RECIPES`, the path of a YAML file, a dict of recipe keys, or ``None`` (the recipe
    ``hf-fp8 launch`` handed over, else the defaults)."""
    if recipe is None:
        return Fp8Recipe.from_launcher()
    if isinstance(recipe, Fp8Recipe):
        return recipe
    if isinstance(recipe, (str, os.PathLike)):
        return Fp8Recipe.load(str(recipe))
    if isinstance(recipe, Mapping):
        return Fp8Recipe.from_dict(recipe)
    raise TypeError(
        f"a recipe must be an Fp8Recipe, a recipe name ({', '.join(sorted(RECIPES))}), the path of a YAML "
        f"file or a dict of recipe keys, got {type(recipe).__name__}"
    )
