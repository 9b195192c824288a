"""Where does FP8 lose precision in a real model? A per-layer table, FP8 against float32.

    python examples/compare_precision.py [--seq-len 128] [--top 12]

Runs one batch of Shakespeare through SmolLM2-135M in float32, keeps every linear layer's input, and
compares three outputs of each layer:

* the float32 reference ``x @ W.T``;
* the same GEMM on ``cast_to_representable`` inputs (x and W rounded to what E4M3 can hold, with the
  scales FP8 would use): the error of quantizing the operands, and nothing else;
* the layer's real FP8 forward (``Fp8Linear``, ``torch._scaled_mm``).

The second column is the quantization error; the last one, the FP8 GEMM against the representable
GEMM, should be float32 rounding only: if it is not, something other than the casts differs (the TE
primer's recipe for debugging FP8 numerics). Layers are sorted by their FP8 error, worst first.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import hf_fp8


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--seq-len", type=int, default=128, help="tokens of text run through the model (16-2048)"
    )
    parser.add_argument("--top", type=int, default=12, help="layers shown, worst first")
    args = parser.parse_args(argv)
    if not 16 <= args.seq_len <= 2048 or args.top < 1:
        parser.error("--seq-len must be from 16 to 2048 and --top at least 1")
    try:
        path, text = hf_fp8.assets.smollm2_path(), hf_fp8.assets.shakespeare_plays()["hamlet"]
    except (ModuleNotFoundError, FileNotFoundError) as err:
        parser.error(f"{err} ({hf_fp8.assets.DEMO_INSTALL})")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, 1000 : 1000 + args.seq_len]

    inputs: dict[str, torch.Tensor] = {}
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    hooks = [
        m.register_forward_hook(lambda mod, a, out, name=name: inputs.__setitem__(name, a[0].detach()))
        for name, m in linears.items()
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()

    recipe = hf_fp8.Fp8Recipe(scaling="current", format="e4m3")  # one batch: each tensor's own scale
    rows = []
    for name, linear in linears.items():
        x = inputs[name].reshape(-1, linear.in_features)
        weight = linear.weight.detach()
        reference = x.double() @ weight.double().T
        x_r = hf_fp8.cast_to_representable(x, "e4m3")
        w_r = hf_fp8.cast_to_representable(weight, "e4m3")
        representable = x_r.double() @ w_r.double().T
        fp8_layer = hf_fp8.Fp8Linear.from_float(linear, recipe)
        with torch.no_grad(), hf_fp8.fp8_autocast(enabled=True):
            fp8 = fp8_layer(x)
        rows.append(
            (
                name,
                relative_error(fp8, reference),
                relative_error(representable, reference),
                relative_error(fp8, representable),
                x.abs().max().item(),
                weight.abs().max().item(),
            )
        )
    rows.sort(key=lambda r: r[1], reverse=True)
    print(f"SmolLM2-135M, {ids.numel()} tokens of Hamlet; relative error of each layer's output (E4M3)\n")
    print("| layer | FP8 vs float32 | operand rounding | FP8 GEMM vs rounded | input amax | weight amax |")
    print("|---|---|---|---|---|---|")
    for name, total, rounding, gemm, x_amax, w_amax in rows[: args.top]:
        print(f"| {name} | {total:.2e} | {rounding:.2e} | {gemm:.1e} | {x_amax:.3g} | {w_amax:.3g} |")
    mean = sum(r[1] for r in rows) / len(rows)
    worst_gemm = max(r[3] for r in rows)
    print(
        f"\n{len(rows)} layers; mean FP8 error {mean:.2e}; largest FP8 GEMM vs rounded gap {worst_gemm:.1e}"
    )
    print("(the gap is float32 accumulation order only: FP8's error is the rounding of its operands)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
