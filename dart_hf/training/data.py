"""The training corpus: ShareGPT prompts answered again by the target itself.

Why regenerate: a draft head is only useful if it predicts what *this target* will say next. ShareGPT's
own answers come from ChatGPT, whose wording the target does not share; greedy answers from the target
are exactly the sequences the head will be asked to draft at inference time.

`dart_hf.training.corpus.regenerate` regenerates in batches with `generate_batch` and appends the answers to a
token corpus. Responses stop after the first end-of-sequence token, which is kept (the head must learn to draft the
stop too).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from ..tools.datasets import USER_TEXT_MAX_CHARS, chat_input_ids, load_sharegpt

PROMPT_MAX_TOKENS = 384
"""Prompts are cut to this many tokens: longer ones cost quadratic attention for little extra signal."""


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase, user_text: str) -> list[int]:
    """Chat-template ids of one user turn, cut to `USER_TEXT_MAX_CHARS` characters and `PROMPT_MAX_TOKENS` tokens."""
    return chat_input_ids(tokenizer, user_text[:USER_TEXT_MAX_CHARS], max_tokens=PROMPT_MAX_TOKENS)[0].tolist()


def greedy_config(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_new_tokens: int) -> GenerationConfig:
    """A fresh greedy config: inheriting the target's may carry sampling settings we must not use."""
    eos = target.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    if pad is None:
        raise ValueError("batched generation needs a pad token or an eos token; the tokenizer has neither")
    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos_ids or None,
                            pad_token_id=pad, bos_token_id=target.generation_config.bos_token_id)


def generate_batch(target: PreTrainedModel, batch: list[list[int]], config: GenerationConfig) -> list[dict]:
    """Greedy responses for a batch of prompts (left-padded together), each cut after its first EOS."""
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[config.pad_token_id] * (width - len(ids)) + ids for ids in batch], device=target.device)
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch], device=target.device)
    with torch.inference_mode():
        output = target.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
    eos_ids = set(config.eos_token_id or [])
    return [{"prompt_ids": ids, "response_ids": cut_after_eos(row[width:].tolist(), eos_ids)}
            for ids, row in zip(batch, output)]


def cut_after_eos(token_ids: list[int], eos_ids: set[int]) -> list[int]:
    """Tokens up to and including the first EOS (the rest is padding `generate` adds to finished rows)."""
    for position, token in enumerate(token_ids):
        if token in eos_ids:
            return token_ids[: position + 1]
    return token_ids


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def sharegpt_training_prompts(num_prompts: int | None) -> list[str]:
    """Opening user turns of the first `num_prompts` training conversations (file order, deterministic)."""
    return [turns[0]["content"] for turns in load_sharegpt("train", limit=num_prompts)]


CODE_FENCE = "```"


def is_code_chat(turns: list[dict]) -> bool:
    """A ShareGPT chat about code: its opening turn or first answer holds a fenced code block (ShareGPT's answers
    fence code; about one chat in five)."""
    answer = turns[1]["content"] if len(turns) > 1 else ""
    return CODE_FENCE in turns[0]["content"] or CODE_FENCE in answer


def sharegpt_code_prompts(num_prompts: int | None, path: str | Path | None = None) -> list[str]:
    """Opening user turns of the training conversations about code (`is_code_chat`), the first `num_prompts` in
    file order. The code split of the training data; HumanEval stays held out. `path`: another ShareGPT file."""
    return _sharegpt_prompts_where(True, num_prompts, path)


def sharegpt_chat_prompts(num_prompts: int | None, path: str | Path | None = None) -> list[str]:
    """Opening user turns of the other training conversations (not `is_code_chat`), the first `num_prompts` in file
    order: with `sharegpt_code_prompts` a partition of the training chats (a popular prompt can still open chats of
    both kinds), so corpora grown from the two add different data."""
    return _sharegpt_prompts_where(False, num_prompts, path)


def _sharegpt_prompts_where(code: bool, num_prompts: int | None, path: str | Path | None) -> list[str]:
    prompts = []
    for turns in load_sharegpt("train", path=path):
        if is_code_chat(turns) == code:
            prompts.append(turns[0]["content"])
            if num_prompts is not None and len(prompts) >= num_prompts:
                break
    return prompts
