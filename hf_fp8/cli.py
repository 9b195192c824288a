"""The ``hf-fp8`` command line: launch, inspect, env, demo.

    hf-fp8 launch [accelerate launch options] --recipe RECIPE script.py [script args]
    hf-fp8 inspect MODEL_DIR_OR_CONFIG [--recipe RECIPE]
    hf-fp8 env
    hf-fp8 demo [demo options]

Bad input ends with one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["main"]

_COMMANDS = ("launch", "inspect", "env", "demo")


class CliError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__.strip())
            return 0 if argv else 2
        command, rest = argv[0], argv[1:]
        if command not in _COMMANDS:
            raise CliError(f"unknown command {command!r}; commands: {', '.join(_COMMANDS)}")
        return {"launch": _launch, "inspect": _inspect, "env": _env, "demo": _demo}[command](rest)
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
    # Added to accelerate's own parser: its options are checked as accelerate checks them, and
    # everything after the script is the script's, a --recipe there included.
    parser.add_argument("--recipe", required=True, help="a named recipe (hybrid-delayed, ...) or a YAML file")

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


def _load_recipe(spec: str):
    from hf_fp8.recipe import Fp8Recipe

    try:
        return Fp8Recipe.load(spec)
    except ValueError as err:
        raise CliError(str(err)) from None


# ---- inspect ----------------------------------------------------------------------------------------


def _inspect(argv: list[str]) -> int:
    parser = _parser("inspect", "What patch_model would convert in a model, and its weight memory.")
    parser.add_argument("model", help="a model folder (with config.json) or a config.json file")
    parser.add_argument("--recipe", default="hybrid-delayed", help="a named recipe or a YAML file")
    args = parser.parse_args(argv)
    recipe = _load_recipe(args.recipe)
    model, dtype = _meta_model(args.model)

    from hf_fp8.patch import plan_patch

    report = plan_patch(model, recipe)
    print(report)
    bytes_per_value = 4 if dtype == "float32" else 2
    total = report.total_params * bytes_per_value
    gemm = sum(r.params for r in report.converted_gemms) * bytes_per_value
    fp8 = total - gemm + gemm // bytes_per_value
    print(f"  weights: {_size(total)} in {dtype or 'bfloat16 (assumed)'}")
    print(f"  converted layers' weights stored in FP8 (fp8_weights, frozen): {_size(fp8)}, {fp8 / total:.0%}")
    return 0


def _size(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def _meta_model(path: str):
    """The model of a folder or config file, built on the meta device: no weights read, no memory."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    if not os.path.exists(path):
        raise CliError(f"model {path!r} not found (give a model folder or a config.json)")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as err:  # OSError, ValueError, huggingface_hub's validation errors: all bad input
        raise CliError(
            f"cannot read a transformers config from {path!r}: {str(err).splitlines()[0]}"
        ) from None
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError:
            model = AutoModel.from_config(config)
    dtype = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
    return model, str(dtype).replace("torch.", "") if dtype is not None else None


# ---- env --------------------------------------------------------------------------------------------


def _env(argv: list[str]) -> int:
    _parser("env", "Versions, GPUs, FP8 support, and the backend 'auto' picks.").parse_args(argv)
    import importlib.metadata as metadata

    import torch

    from hf_fp8.backends.te import te_usable
    from hf_fp8.formats import gpu_has_fp8

    for package in ("hf-fp8", "torch", "transformers", "accelerate", "peft", "transformer-engine"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{package:<20} {version}")
    scaled_mm = "available" if hasattr(torch, "_scaled_mm") else "missing (FP8 GEMMs emulated)"
    print(f"{'torch._scaled_mm':<20} {scaled_mm}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            capability = torch.cuda.get_device_capability(i)
            fp8 = "FP8 GEMMs" if gpu_has_fp8(i) else "no FP8 (needs compute capability >= 8.9)"
            print(f"GPU {i}: {torch.cuda.get_device_name(i)}, compute capability {capability}: {fp8}")
    else:
        print("GPUs: none (CUDA not available); FP8 numerics run on the CPU")
    usable, reason = te_usable()
    choice = "te" if usable else "native"
    print(f"backend 'auto' for a model on the GPU: {choice} ({reason}); for a model on the CPU: native")
    if torch.cuda.is_available():
        print(f"{'cuDNN':<20} {_cudnn_status()}")
    return 0


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
    from hf_fp8.demo import main as demo_main

    try:
        return demo_main(argv)
    except ValueError as err:  # a bad recipe, step count or device
        raise CliError(f"demo: {err}") from None


def _parser(command: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"hf-fp8 {command}", description=description)

    def refuse(message: str) -> None:
        raise CliError(f"{command}: {message}")

    parser.error = refuse
    return parser


if __name__ == "__main__":
    sys.exit(main())
