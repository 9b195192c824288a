"""Tiny HF models built from configs (no hub): every dimension a GEMM sees is a multiple of 16."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, T5ForConditionalGeneration

VOCAB = 256
_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

CONFIGS = {
    "llama": ("llama", dict(_DECODER, tie_word_embeddings=False)),
    "mistral": ("mistral", dict(_DECODER, tie_word_embeddings=False)),
    "qwen2": ("qwen2", dict(_DECODER, tie_word_embeddings=False)),
    "gemma": ("gemma", dict(_DECODER, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)),
    "gpt2": (
        "gpt2",
        dict(
            n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=1, eos_token_id=2
        ),
    ),
    "gpt_neox": (
        "gpt_neox",
        dict(
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "opt": (
        "opt",
        dict(
            hidden_size=64,
            ffn_dim=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=128,
            word_embed_proj_dim=64,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
        ),
    ),
    "bert": (
        "bert",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            vocab_size=VOCAB,
            max_position_embeddings=128,
            pad_token_id=0,
        ),
    ),
    "t5": (
        "t5",
        dict(
            d_model=64,
            d_ff=128,
            d_kv=16,
            num_layers=2,
            num_heads=4,
            vocab_size=VOCAB,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(_DECODER, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    ),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            _DECODER,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
}


def build(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A freshly initialised tiny model of ``arch`` in train mode, dropout off (so runs compare)."""
    model_type, kwargs = CONFIGS[arch]
    config = AutoConfig.for_model(model_type, **kwargs)
    for key in (
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
    ):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    for key in ("dropout", "attention_dropout", "dropout_rate", "hidden_dropout", "activation_dropout"):
        if isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)
    torch.manual_seed(seed)
    if arch == "t5":
        model = T5ForConditionalGeneration(config)
    elif arch == "bert":
        model = AutoModel.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    return model.to(dtype).train()


def batch_for(arch: str, length: int, batch_size: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random token ids (no special tokens) and the matching labels for ``arch``."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (batch_size, length), generator=generator)
    if arch == "t5":
        labels = torch.randint(4, VOCAB, (batch_size, max(length // 2, 1)), generator=generator)
        return {"input_ids": ids, "labels": labels}
    if arch == "bert":
        return {"input_ids": ids}
    return {"input_ids": ids, "labels": ids.clone()}


def loss_of(arch: str, outputs) -> torch.Tensor:
    """A scalar training objective for every architecture (BERT here has no head)."""
    if arch == "bert":  # all features of layer-normed states square to 1 on average; a slice of them does not
        hidden, pooled = outputs.last_hidden_state.float(), outputs.pooler_output.float()
        return hidden[..., :16].pow(2).mean() + pooled[..., :16].pow(2).mean()
    return outputs.loss


def train(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    arch: str = "llama",
    lr: float = 1e-3,
    autocast: torch.dtype | None = None,
) -> list[float]:
    """The tests' training loop: AdamW over the trainable parameters, one step per batch (moved to the
    model's device), optionally under autocast; returns the losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    device = next(model.parameters()).device
    model.train()
    losses = []
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = loss_of(arch, model(**batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses
