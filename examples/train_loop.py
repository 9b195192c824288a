"""A plain PyTorch training loop on an FP8-patched HF model.

    python examples/train_loop.py

Builds a small GPT-2 from a config (GPT-2 uses transformers' Conv1D, which hf-fp8 converts too),
patches it, trains a few steps on random tokens of odd length (the patched model pads them to 16 on
the fly) and shows what changed: the report, the FP8 state of one layer, and the loss with FP8
switched off for comparison.
"""

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_fp8

torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=256))
report = hf_fp8.patch_model(model, hf_fp8.Fp8Recipe.named("hybrid-delayed"))
print(report)

optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model.train()
for step in range(5):
    ids = torch.randint(0, 512, (4, 100))  # 100 tokens: not a multiple of 16
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(f"step {step}: loss {loss.item():.4f}")

layer = model.transformer.h[0].mlp.c_fc
print(f"\n{layer}")
print("scales (input, weight, grad_output):", [f"{s:.3g}" for s in layer.scale.tolist()])
print("latest amaxes:", [f"{a:.3g}" for a in layer.amax_history[:, 1].tolist()])

with hf_fp8.fp8_autocast(enabled=False), torch.no_grad():
    high_precision = model(input_ids=ids, labels=ids).loss
with torch.no_grad():
    fp8 = model(input_ids=ids, labels=ids).loss
print(
    f"\nsame batch, same weights: FP8 loss {fp8.item():.4f}, high-precision loss {high_precision.item():.4f}"
)

hf_fp8.unpatch_model(model)
print("unpatched:", type(model.transformer.h[0].mlp.c_fc).__name__)
