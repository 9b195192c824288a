"""GPU memory of loading a checkpoint into FP8 base weights: ``hf_fp8.peft.from_pretrained_fp8`` against
loading it in BF16 onto the GPU and storing the weights in FP8 afterwards.

    python benchmarks/load_bench.py --shape 8b-4l

Saves a Llama of the given shape (random weights) as a sharded safetensors checkpoint in a temporary
folder, then loads it both ways, each time from a clean GPU, and prints the peak of allocated GPU
memory during the load next to what stays resident and to the size of the largest checkpoint shard.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

import torch
from harness import SHAPES, build
from transformers import AutoModelForCausalLM

import hf_fp8
from hf_fp8.integrations.peft import from_pretrained_fp8
from hf_fp8.layers.linear import Fp8Module

GIB = 2**30


def load_fp8(path: str) -> torch.nn.Module:
    model, _ = from_pretrained_fp8(path, device="cuda")
    return model


def load_bf16_then_quantize(path: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    model.requires_grad_(False)
    hf_fp8.patch_model(model, hf_fp8.RECIPES["lora-fp8"], backend="native")
    for module in model.modules():  # patch_model would quantize at the first forward; do it now
        if isinstance(module, Fp8Module):
            module.quantize_weight_()
    return model


LOADS = {"from_pretrained_fp8": load_fp8, "bf16 on GPU, then quantize": load_bf16_then_quantize}


def measure(load, path: str) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = load(path)
    torch.cuda.synchronize()
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Module)]
    assert fp8_layers and all(m.weight_in_fp8 for m in fp8_layers)
    result = {
        "peak_gib": (torch.cuda.max_memory_allocated() - before) / GIB,
        "resident_gib": (torch.cuda.memory_allocated() - before) / GIB,
        "fp8_weights_gib": sum(m.weight._data.nbytes for m in fp8_layers) / GIB,
        "largest_bf16_layer_gib": max(m.weight.numel() * 2 for m in fp8_layers) / GIB,
    }
    del model
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b-4l")
    parser.add_argument("--max-shard-size", default="2GB")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as path:
        model = build(args.shape)
        model.save_pretrained(path, max_shard_size=args.max_shard_size)
        bf16_gib = sum(p.nbytes for p in model.parameters()) / GIB
        del model
        shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
        largest_shard = max(os.path.getsize(os.path.join(path, f)) for f in shards) / GIB
        print(
            f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, shape {args.shape}: BF16 model "
            f"{bf16_gib:.2f} GiB in {len(shards)} shards, largest {largest_shard:.2f} GiB",
            flush=True,
        )
        print("\n| load | peak GiB | resident GiB | FP8 weights GiB | largest layer in BF16 GiB |")
        print("|---|---|---|---|---|")
        for name, load in LOADS.items():
            r = measure(load, path)
            print(
                f"| {name} | {r['peak_gib']:.2f} | {r['resident_gib']:.2f} | {r['fp8_weights_gib']:.2f} | "
                f"{r['largest_bf16_layer_gib']:.3f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
