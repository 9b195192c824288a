"""TRL's trainers on a tiny Llama, patched and unpatched, for the TRL tests: a byte-level tokenizer (no
hub), datasets of each kind TRL takes, and one call that trains a trainer with or without FP8 from the
same weights and data."""

from __future__ import annotations

import pytest
import torch
from conftest import ScaledMmCalls
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

import hf_fp8

trl = pytest.importorskip("trl", reason="TRL is in the dev extras: pip install -e '.[dev]'")
datasets = pytest.importorskip("datasets")

# Bytes, then <pad>, <s>, </s>, then unused ids up to a multiple of 16 (the head converts).
VOCAB = 272
PAD, BOS, EOS = 256, 257, 258
# A chat template that marks the assistant's turns for TRL's assistant-only loss.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}A: {{ m['content'] }}</s>"
    "{% endgeneration %}{% else %}U: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}A: {% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token a byte (ids 0-255, as the tiny models' embeddings), three special tokens after them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(alphabet)}
    vocab.update({"<pad>": PAD, "<s>": BOS, "</s>": EOS})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(seed: int = 0, **changes) -> torch.nn.Module:
    config = AutoConfig.for_model(
        "llama",
        **{
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": VOCAB,
            "max_position_embeddings": 256,
            "pad_token_id": PAD,
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "tie_word_embeddings": False,
            **changes,
        },
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


_WORDS = ["the", "a", "king", "queen", "speaks", "runs", "sleeps", "over", "under", "crown", "sword", "night"]


def _sentence(i: int, words: int) -> str:
    return " ".join(_WORDS[(i * 7 + j * 3) % len(_WORDS)] for j in range(words))


def text_rows(count: int = 24) -> datasets.Dataset:
    """Sentences of 3 to 12 words: lengths that are rarely multiples of 16."""
    return datasets.Dataset.from_list([{"text": _sentence(i, 3 + i % 10)} for i in range(count)])


def prompt_completion_rows(count: int = 24) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [
            {"prompt": f"Q{i}: {_sentence(i, 2 + i % 4)}?", "completion": f" {_sentence(i + 1, 3 + i % 5)}."}
            for i in range(count)
        ]
    )


def conversation_rows(count: int = 24) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [
            {
                "messages": [
                    {"role": "user", "content": _sentence(i, 2 + i % 4)},
                    {"role": "assistant", "content": _sentence(i + 3, 3 + i % 5)},
                ]
            }
            for i in range(count)
        ]
    )


def preference_rows(count: int = 16) -> datasets.Dataset:
    return datasets.Dataset.from_list(
        [
            {
                "prompt": f"Q{i}: {_sentence(i, 2 + i % 3)}?",
                "chosen": f" {_sentence(i + 1, 2 + i % 4)}.",
                "rejected": f" {_sentence(i + 5, 4 + i % 3)} or so",
            }
            for i in range(count)
        ]
    )


def prompt_rows(count: int = 8) -> datasets.Dataset:
    return datasets.Dataset.from_list([{"prompt": f"Q{i}: {_sentence(i, 2 + i % 3)}?"} for i in range(count)])


def common_arguments(out, **changes) -> dict:
    """TrainingArguments every TRL run here shares: CPU, no reports, a log each step, no saving."""
    return {
        "output_dir": str(out),
        "max_steps": 3,
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "seed": 0,
        "data_seed": 0,
        "disable_tqdm": True,
        **changes,
    }


def run(trainer_class, config_class, out, fp8: bool, recipe=None, model=None, **kwargs):
    """Train ``trainer_class`` on a tiny Llama (seed 0), in FP8 through ``Fp8TrainerCallback`` or not;
    ``config`` changes the TRL config's arguments. Returns the trainer and the FP8 GEMMs it ran."""
    config = config_class(**common_arguments(out, **kwargs.pop("config", {})))
    callbacks = [hf_fp8.Fp8TrainerCallback(recipe)] if fp8 else []
    kwargs.setdefault("processing_class", byte_tokenizer())
    trainer = trainer_class(model=model or tiny_llama(), args=config, callbacks=callbacks, **kwargs)
    with ScaledMmCalls() as calls:
        trainer.train()
    return trainer, calls.calls


def with_and_without_fp8(trainer_class, config_class, out, **kwargs) -> list[tuple]:
    """:func:`run` in FP8, then the same run unpatched (each builds its own model from the same seed)."""
    model = kwargs.pop("model", None)
    return [
        run(trainer_class, config_class, out / str(fp8), fp8, model=model() if model else None, **kwargs)
        for fp8 in (True, False)
    ]


def logged(trainer, key: str) -> list[float]:
    """``key`` of every step's log."""
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]
