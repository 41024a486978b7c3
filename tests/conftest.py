"""Tiny random targets (Llama, Qwen2, Qwen3) and heads for fast CPU tests."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (AutoModelForCausalLM, DynamicCache, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config)

import dart_hf
from dart_hf.core.target import cache_kwargs

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def make_target(arch: str = "llama", seed: int = 0, attn: str = "sdpa", **overrides):
    torch.manual_seed(seed)
    cfg = CONFIGS[arch](**{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    # a sharper random target: greedy continuations are less uniform, closer to a real LM
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@torch.no_grad()
def prefilled(target, prefix: torch.Tensor) -> DynamicCache:
    """A cache holding `prefix`, from one target forward (the state a verify step starts from)."""
    cache = DynamicCache(config=target.config)
    target(input_ids=prefix, use_cache=True, **cache_kwargs(target, cache))
    return cache


def make_head(target, seed: int = 1, draft_length: int = 4, **overrides) -> dart_hf.DartHead:
    torch.manual_seed(seed)
    return dart_hf.DartHead.from_target(target, draft_length=draft_length, **overrides).eval()


def prompts(n: int, vocab: int = TINY["vocab_size"], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, int(torch.randint(1, 24, (1,), generator=g))), generator=g) for _ in range(n)]


@pytest.fixture(scope="session")
def llama():
    return make_target("llama")


@pytest.fixture(scope="session")
def llama_head(llama):
    return make_head(llama)


WORDS = [f"w{i}" for i in range(100)]


def make_word_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer over 105 whole-word tokens with a chat template (ids 0-4 are special)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", "<user>", "<assistant>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok
