"""The hf-fp8 command line.

usage: hf-fp8 <command> [options]

FP8 training and fine-tuning for HuggingFace Transformers models.

commands:
  launch    accelerate launch with an FP8 recipe: hf-fp8 launch --recipe NAME script.py [args]
  inspect   what patch_model would convert in a model (folder or config.json), and its weight memory
  env       versions, GPUs, FP8 support, and the backend that backend='auto' picks
  recipes   every named recipe and what it is for
  demo      fine-tune SmolLM2-135M on Shakespeare in BF16 and in FP8 and compare the two runs

Run 'hf-fp8 <command> --help' for a command's options. Bad input gets one line on stderr and exit
status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

_COMMANDS = ("launch", "inspect", "env", "recipes", "demo")


class CliError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__.split("\n", 2)[2].strip())
            return 0 if argv else 2
        command, rest = argv[0], argv[1:]
        if command not in _COMMANDS:
            raise CliError(f"unknown command {command!r}; commands: {', '.join(_COMMANDS)} (hf-fp8 --help)")
        commands = {"launch": _launch, "inspect": _inspect, "env": _env, "recipes": _recipes, "demo": _demo}
        return commands[command](rest)
    except CliError as err:
        print(f"hf-fp8: error: {err}", file=sys.stderr)
        return 2


# ---- launch -----------------------------------------------------------------------------------------


def _launch(argv: list[str]) -> int:
    """``accelerate launch`` with an FP8 recipe: every accelerate option passes through untouched; the
    recipe reaches the processes in ``HF_FP8_RECIPE``, which ``patch_model()`` reads when given no
    recipe. Non-FP8 ops run in bf16; accelerate's own FP8 stays off."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from hf_fp8.recipe import LAUNCHER_ENV

    parser = launch_command_parser()
    if _asks_for_help(argv):
        print(_launch_help(parser.format_help()))
        return 0
    # Added to accelerate's own parser: its options are checked as accelerate checks them, and
    # everything after the script is the script's, a --recipe there included.
    parser.add_argument("--recipe", required=True, help=_recipe_help())

    def refuse(message: str) -> None:
        raise CliError(f"launch: {message}")

    parser.error = refuse
    args = parser.parse_args(argv)
    recipe = _load_recipe(args.recipe)
    del args.recipe
    if not (args.no_python or args.module) and not os.path.isfile(args.training_script):
        raise CliError(f"training script {args.training_script!r} not found")
    if args.mixed_precision == "fp8":
        raise CliError(
            "--mixed_precision fp8 makes accelerate convert the model itself; hf-fp8 does the FP8 "
            "conversion: leave the option out (non-FP8 ops then run in bf16)"
        )
    args.mixed_precision = args.mixed_precision or "bf16"
    previous = os.environ.get(LAUNCHER_ENV)
    os.environ[LAUNCHER_ENV] = recipe.to_yaml()  # the launched processes inherit it
    try:
        launch_command(args)
    except (subprocess.CalledProcessError, ChildFailedError) as err:  # the script failed and said why
        return getattr(err, "returncode", 1) or 1
    except (ValueError, OSError) as err:  # accelerate's own checks of the options
        raise CliError(f"launch: {str(err).strip().splitlines()[0]}") from None
    finally:
        if previous is None:
            os.environ.pop(LAUNCHER_ENV, None)
        else:
            os.environ[LAUNCHER_ENV] = previous
    return 0


def _recipe_help() -> str:
    """The --recipe option's help, built from the named recipes (imported when a command runs, not for
    ``hf-fp8 --help``)."""
    from hf_fp8.recipe import RECIPES

    return f"FP8 recipe: a name ({', '.join(RECIPES)}; hf-fp8 recipes says what each is for) or a YAML file"


def _asks_for_help(argv: list[str]) -> bool:
    """-h/--help among hf-fp8 launch's own options (after the script it is the script's)."""
    for arg in argv:
        if arg in ("-h", "--help"):
            return True
        if not arg.startswith("-") and arg.endswith(".py"):
            return False
    return False


def _launch_help(accelerate_help: str) -> str:
    rest = accelerate_help.partition("\n\n")[2]  # without accelerate's own usage line
    return "\n".join(
        [
            "usage: hf-fp8 launch --recipe RECIPE [accelerate launch options] script.py [script arguments]",
            "",
            "accelerate launch with an FP8 recipe: the training processes find it in HF_FP8_RECIPE, which",
            "hf_fp8.patch_model() reads when given no recipe. Non-FP8 ops run in bf16 (--mixed_precision",
            "defaults to bf16).",
            "",
            "hf-fp8 options:",
            f"  --recipe RECIPE       (required) {_recipe_help()}",
            "",
            "refused: --mixed_precision fp8 (accelerate would convert the model to FP8 a second time)",
            "",
            "accelerate launch options, passed through as accelerate takes them:",
            rest,
        ]
    )


def _load_recipe(spec: str):
    from hf_fp8.recipe import Fp8Recipe

    try:
        return Fp8Recipe.load(spec)
    except ValueError as err:
        raise CliError(str(err)) from None


# ---- recipes ----------------------------------------------------------------------------------------


def _recipes(argv: list[str]) -> int:
    parser = _parser("recipes", "Every named recipe and what it is for; --show NAME prints one as YAML.")
    parser.add_argument(
        "--show", metavar="NAME", help="print this recipe's keys as YAML (a file to start from)"
    )
    args = parser.parse_args(argv)
    from hf_fp8.recipe import RECIPE_LONG_RUNS, RECIPE_PURPOSES, RECIPES

    if args.show is not None:
        print(_load_recipe(args.show).to_yaml(), end="")
        return 0
    width = max(map(len, RECIPES))
    for name in RECIPES:
        print(f"{name:{width}}  {RECIPE_PURPOSES[name]}")
        print(f"{'':{width}}    long runs against BF16: {RECIPE_LONG_RUNS[name]}")
    print(
        "\nUse one by name (patch_model(model, NAME), Fp8TrainerCallback(NAME), --recipe NAME), or start a "
        "YAML file of your own from one: hf-fp8 recipes --show NAME > my-recipe.yaml. The long runs: "
        "docs/recipes.md#long-runs"
    )
    return 0


# ---- inspect ----------------------------------------------------------------------------------------


def _inspect(argv: list[str]) -> int:
    parser = _parser("inspect", "What patch_model would convert in a model, and its weight memory.")
    parser.add_argument("model", help="a model folder (with config.json) or a config.json file")
    parser.add_argument("--recipe", default="hybrid-delayed", help=_recipe_help())
    args = parser.parse_args(argv)
    recipe = _load_recipe(args.recipe)
    model, class_note = _meta_model(args.model)

    from hf_fp8.patching.patch import plan_patch

    report = plan_patch(model, recipe)
    print(report)
    print(f"  model class: {type(model).__name__} ({class_note})")
    dtype, dtype_note = _checkpoint_dtype(Path(args.model), model)
    bytes_per_value = _DTYPE_BYTES.get(dtype, 2)
    total = report.total_params * bytes_per_value
    gemm = sum(r.params for r in report.converted_gemms) * bytes_per_value
    fp8 = total - gemm + gemm // bytes_per_value
    print(f"  weights: {_size(total)} in {dtype} ({dtype_note})")
    if recipe.fp8_weights:
        print(f"  this recipe's frozen weights stored in FP8 (fp8_weights): {_size(fp8)}, {fp8 / total:.0%}")
    else:
        print(
            f"  this recipe keeps the weights in {dtype} (FP8 casts them for each GEMM); stored in FP8 "
            f"(fp8_weights, frozen, as in lora-fp8) they would take {_size(fp8)}, {fp8 / total:.0%}"
        )
    return 0


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def _meta_model(path: str):
    """The model of a folder or config file, built on the meta device (no weights read, no memory) as
    the class its config names in ``architectures``, else an Auto class; and how the class was chosen."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if not os.path.exists(path):
        raise CliError(f"model {path!r} not found (give a model folder or a config.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # OSError, ValueError, huggingface_hub's validation errors: all bad input
        raise CliError(
            f"cannot read a transformers config from {path!r}: {str(err).splitlines()[0]}"
        ) from None
    named = next(iter(getattr(config, "architectures", None) or []), None)
    model_class = getattr(transformers, named, None) if named else None
    try:
        with torch.device("meta"):
            if model_class is not None:
                return model_class._from_config(config), "from the config's architectures"
            try:
                return AutoModelForCausalLM.from_config(
                    config
                ), "no architectures in the config: AutoModelForCausalLM"
            except ValueError:
                return AutoModel.from_config(config), "no architectures in the config: AutoModel"
    except Exception as err:  # a config that parses but describes no buildable model
        problem = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CliError(f"cannot build a model from the config in {path!r}: {problem}") from None


def _checkpoint_dtype(path: Path, model) -> tuple[str, str]:
    """The dtype the checkpoint stores its weights in (from its safetensors header), else the config's,
    and where that came from."""
    folder = path if path.is_dir() else path.parent
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        with open(shards[0], "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        kinds = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
        floats = [_SAFETENSORS_DTYPES[k] for k in kinds if k in _SAFETENSORS_DTYPES]
        if floats:
            return max(floats, key=_DTYPE_BYTES.get), f"from {shards[0].name}"
    dtype = getattr(model.config, "dtype", None)
    if dtype is not None:
        return str(dtype).replace("torch.", ""), "from the config; no safetensors weights found"
    return "bfloat16", "assumed: no safetensors weights and no dtype in the config"


# ---- env --------------------------------------------------------------------------------------------


def _env(argv: list[str]) -> int:
    _parser("env", "Versions, GPUs, FP8 support, and the backend 'auto' picks.").parse_args(argv)
    import importlib.metadata as metadata

    import torch

    from hf_fp8.backends.te import te_usable
    from hf_fp8.formats import gpu_has_fp8
    from hf_fp8.numerics.blockwise import block_kernels_available
    from hf_fp8.numerics.grouped import grouped_kernels_run_on

    for package in ("hf-fp8", "torch", "transformers", "accelerate", "peft", "transformer-engine"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{package:<20} {version}")
    scaled_mm = "available" if hasattr(torch, "_scaled_mm") else "missing (FP8 GEMMs emulated)"
    print(f"{'torch._scaled_mm':<20} {scaled_mm}")
    _print_cpu_gemms()
    print(f"  MoE experts in FP8 (convert_experts): {_experts_gemms(False)}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            capability = torch.cuda.get_device_capability(i)
            fp8 = "FP8 GEMMs" if gpu_has_fp8(i) else "no FP8 (needs compute capability >= 8.9)"
            if gpu_has_fp8(i):
                block = block_kernels_available(torch.device("cuda", i))
                fp8 += (
                    ", block-scaled ones too"
                    if block
                    else "; block scaling emulated (Hopper and torch >= 2.9 run it)"
                )
                fp8 += f"; MoE experts: {_experts_gemms(grouped_kernels_run_on(torch.device('cuda', i)))}"
            print(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {capability}: {fp8}")
    else:
        print("GPUs: none (CUDA not available); FP8 numerics run on the CPU")
    usable, reason = te_usable()
    choice = "te" if usable else "native"
    print(f"backend 'auto' for a model on the GPU: {choice} ({reason}); for a model on the CPU: native")
    if torch.cuda.is_available():
        print(f"{'cuDNN':<20} {_cudnn_status()}")
    return 0


def _experts_gemms(grouped: bool) -> str:
    """How FP8 MoE experts multiply on a device (see hf_fp8.numerics.grouped)."""
    if grouped:
        return "one grouped FP8 GEMM a projection (torch._scaled_grouped_mm)"
    return "one FP8 GEMM an expert (no grouped FP8 kernel here)"


def _print_cpu_gemms() -> None:
    """Which call each FP8 operand pairing takes on this CPU, and why (see hf_fp8.numerics.cpu_gemm)."""
    import torch

    from hf_fp8.numerics.cpu_gemm import cpu_gemm_choices

    capability, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    print(f"FP8 GEMMs on the CPU ({capability}, {threads} threads):")
    calls = {
        "scaled_mm": "torch._scaled_mm",
        "scaled_mm_rowwise_scales": "torch._scaled_mm, scales in row-wise shape",
        "emulated": "float32 emulation",
    }
    for pairing, choice in cpu_gemm_choices().items():
        print(f"  {pairing}: {calls[choice.call]} ({choice.reason})")


def _cudnn_status() -> str:
    """PyTorch's cuDNN against the one loaded into this process, checked after importing Transformer
    Engine when it is installed (``import peft`` imports it). A TE that loads an older system cuDNN
    first costs PyTorch its cuDNN attention: ``sdpa`` falls back to slower kernels (measured: the
    8B-shaped LoRA step 1.2x slower). Compares the versions directly, as PyTorch's own check does,
    because ``torch.backends.cudnn.version()`` raises only the first time it is asked."""
    import importlib.util

    import torch

    if importlib.util.find_spec("transformer_engine") is not None:
        with contextlib.suppress(Exception):  # a broken TE install is reported by the backend line above
            import transformer_engine  # noqa: F401
    binding = getattr(torch._C, "_cudnn", None)  # absent from builds without cuDNN
    if binding is None:
        return "not available"
    built, loaded = binding.getCompileVersion(), binding.getRuntimeVersion()
    built_text, loaded_text = ".".join(map(str, built)), ".".join(map(str, loaded))
    if loaded[0] == built[0] and loaded[1] >= built[1]:
        return f"{loaded_text} (PyTorch built with {built_text})"
    return (
        f"{loaded_text} loaded, PyTorch built with {built_text}: PyTorch cannot use it and attention (sdpa) "
        "falls back to slower kernels; make this process load PyTorch's cuDNN only (the usual cause: a "
        "system cuDNN older than PyTorch's, loaded by Transformer Engine)"
    )


# ---- demo -------------------------------------------------------------------------------------------


def _demo(argv: list[str]) -> int:
    from hf_fp8.apps.demo import main as demo_main

    return demo_main(argv)  # the demo reports its own bad input the same way (one line, exit 2)


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"hf-fp8 {command}", description=description)

    def refuse(message: str) -> None:
        raise CliError(f"{command}: {message}")

    parser.error = refuse
    return parser


if __name__ == "__main__":
    sys.exit(main())
