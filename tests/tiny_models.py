"""Tiny HF models built from configs (no hub): every dimension a GEMM sees is a multiple of 16."""

from __future__ import annotations

from collections.abc import Callable

import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, T5ForConditionalGeneration

from hf_fp8.integrations.causal_lm_loss import causal_lm_loss
from hf_fp8.layers.experts import Fp8Experts
from hf_fp8.layers.selection import EXPERTS_KEPT

VOCAB = 256


def with_compiled_loss(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (an eager reference) computing its loss as ``hf_fp8.compile`` makes a causal LM compute
    it: transformers' loss with a pointwise backward, whose gradient differs from log-softmax's by float32
    rounding. With it, compiled and eager steps with the same backend's arithmetic agree to the bit."""
    model.loss_function = causal_lm_loss
    return model


def keeping_backward_graphs(graphs: list[torch.fx.GraphModule]) -> Callable:
    """A ``torch.compile`` backend: aot_eager that appends every backward graph it compiles to ``graphs``."""

    def keep_backward(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    return aot_autograd(
        fw_compiler=lambda graph, _: make_boxed_func(graph.forward),
        bw_compiler=keep_backward,
        keep_inference_input_mutations=True,
    )


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


# ---- what patch_model makes of each ----------------------------------------------------------------

OUTPUT_HEAD = "output head (set convert_lm_head: true to convert)"
TIED = "weight tied to the input embeddings (set convert_lm_head: true to convert)"
ROUTER = "MoE router: routing stays in high precision"

DIMS_64_1 = "in_features=64, out_features=1: FP8 GEMMs need multiples of 16"

# What each architecture implies (2 layers each): converted GEMMs, skipped GEMMs by reason, norms by kind.
EXPECTED = {
    # q, k, v, o, gate, up, down per layer; untied lm_head
    "llama": (14, {OUTPUT_HEAD: 1}, {"rmsnorm": 5}),
    "mistral": (14, {OUTPUT_HEAD: 1}, {"rmsnorm": 5}),
    "qwen2": (14, {OUTPUT_HEAD: 1}, {"rmsnorm": 5}),
    # Gemma's norms scale by (1 + w); its lm_head is tied to the embeddings
    "gemma": (14, {TIED: 1}, {"rmsnorm (1 + w)": 5}),
    # c_attn, c_proj, c_fc, mlp.c_proj per layer, all Conv1D
    "gpt2": (8, {TIED: 1}, {"layernorm": 5}),
    # query_key_value, dense, dense_h_to_4h, dense_4h_to_h per layer
    "gpt_neox": (8, {OUTPUT_HEAD: 1}, {"layernorm": 5}),
    # q, k, v, out_proj, fc1, fc2 per layer
    "opt": (12, {TIED: 1}, {"layernorm": 5}),
    # query, key, value, attention dense, intermediate, output per layer, and the pooler
    "bert": (13, {}, {"layernorm": 5}),
    # encoder: 4 attention + 2 FF per layer; decoder: 4 self + 4 cross + 2 FF per layer
    "t5": (32, {TIED: 1}, {"rmsnorm": 12}),
    # attention; the experts (3-D weights, one module a layer) only with convert_experts; routers are not
    # nn.Linear in transformers 5
    "mixtral": (8, {OUTPUT_HEAD: 1, ROUTER: 2, EXPERTS_KEPT: 2}, {"rmsnorm": 5}),
    # attention and the shared expert's MLP; its 1-output gate is too small
    "qwen2_moe": (14, {OUTPUT_HEAD: 1, ROUTER: 2, DIMS_64_1: 2, EXPERTS_KEPT: 2}, {"rmsnorm": 5}),
}


def counts(report):
    skipped, kept = {}, {}
    for r in report.skipped:
        skipped[r.reason] = skipped.get(r.reason, 0) + 1
    for r in report.kept:
        kept[r.kind] = kept.get(r.kind, 0) + 1
    return len(report.converted), skipped, kept


# ---- MoE-shaped ------------------------------------------------------------------------------------

# MoE-shaped tiny models: as in real MoE models the experts hold most of the FLOPs (Mixtral 8x7B: the
# output head is ~1% of them); hidden 64, experts of 256, 4 layers, top-2 of 4 experts (top-4 of 8 for
# the models that route to more): the dense decoder's dimensions, deeper, each family setting its own
# intermediate sizes.
_MOE = {k: v for k, v in _DECODER.items() if k != "intermediate_size"} | dict(
    num_hidden_layers=4, tie_word_embeddings=False
)


MOE_CONFIGS = {
    "mixtral": dict(_MOE, intermediate_size=256, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _MOE,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        intermediate_size=256,
    ),
    "qwen3_moe": dict(_MOE, moe_intermediate_size=256, num_experts=8, num_experts_per_tok=4, head_dim=16),
    "olmoe": dict(_MOE, intermediate_size=256, num_experts=8, num_experts_per_tok=4),
}


def build_moe(arch: str, seed: int = 0) -> torch.nn.Module:
    config = AutoConfig.for_model(arch, **MOE_CONFIGS[arch])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).train()


def experts_of(model) -> list[Fp8Experts]:
    return [m for m in model.modules() if isinstance(m, Fp8Experts)]
