"""Evaluation and training data: ShareGPT chats, HumanEval problems, and the chat prompts built from them.

Why a module of its own: reading data is a different job from getting targets (`assets`: PyPI packages, GGUF
conversion, the shipped head). This one only reads the data files that `assets` installs into the shapes the
rest of dart_hf uses, with a fixed train / held-out split, so training never sees an evaluation prompt.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from .assets import HUMANEVAL_FILE, SHAREGPT_FILE, packaged_file

Conversation = list[dict[str, str]]
"""Chat turns, each `{"role": "user" | "assistant", "content": str}`."""

HELDOUT_PER_10K = 200
"""2% of ShareGPT conversations (by a stable hash of their id) are kept out of training for evaluation."""

USER_TEXT_MAX_CHARS = 1000
"""Long ShareGPT turns (pasted documents, code dumps) are cut so one prompt cannot dominate time or memory."""

HUMANEVAL_INSTRUCTION = "Complete the following Python function:\n```python\n{prompt}```"

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant"}
# Other ShareGPT speakers ("system", 41 turns) have no place in a user/assistant chat and are dropped.


# --------------------------------------------------------------------------------------------------
# ShareGPT


def read_json_array_prefix(path: str | Path) -> list[Any]:
    """Every whole element of a JSON array file, stopping quietly at a cut-off tail.

    The packaged ShareGPT file is truncated mid-record, so `json.load` fails on it; decoding element by
    element keeps the 17,671 whole conversations before the cut.
    """
    return list(_iter_json_array(Path(path).read_text(encoding="utf-8")))


def _iter_json_array(text: str) -> Iterator[Any]:
    decoder = json.JSONDecoder()
    whitespace = re.compile(r"\s*")
    index = whitespace.match(text).end()
    if text[index:index + 1] != "[":
        raise ValueError("not a JSON array")
    index += 1
    while True:
        index = whitespace.match(text, index).end()
        try:
            element, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return
        yield element
        index = whitespace.match(text, index).end()
        if text[index:index + 1] != ",":
            return
        index += 1


def parse_sharegpt(path: str | Path) -> list[tuple[str, Conversation]]:
    """`(id, conversation)` for each usable ShareGPT record, in file order.

    Records are skipped when they are empty or do not open with a human turn (those are continuation
    fragments of a longer chat and make no prompt); turns from speakers other than human/assistant
    (e.g. "system") are dropped.
    """
    conversations = []
    for record in read_json_array_prefix(path):
        raw_turns = record.get("conversations") or []
        if not raw_turns or _SHAREGPT_ROLES.get(raw_turns[0].get("from")) != "user":
            continue
        turns = [{"role": _SHAREGPT_ROLES[turn["from"]], "content": turn["value"]}
                 for turn in raw_turns if turn.get("from") in _SHAREGPT_ROLES]
        if turns[0]["content"].strip():
            conversations.append((record["id"], turns))
    return conversations


def sharegpt_split_of(conversation_id: str) -> str:
    """`"heldout"` for a stable 2% of conversations, else `"train"`.

    The hash is of the id without its `_<part>` suffix, so all fragments of one chat land on the same
    side (they share a topic, and a fragment in training would leak into the held-out prompt). hashlib
    rather than `hash()` so the split is the same in every process.
    """
    stem = re.sub(r"_\d+$", "", conversation_id)
    bucket = int.from_bytes(hashlib.sha256(stem.encode("utf-8")).digest()[:8], "big") % 10_000
    return "heldout" if bucket < HELDOUT_PER_10K else "train"


@functools.lru_cache(maxsize=2)
def _sharegpt_splits(path: str) -> dict[str, tuple[Conversation, ...]]:
    """Both splits of one ShareGPT file.

    ShareGPT repeats many chats under different ids (14% of held-out opening prompts also open a
    training chat), so training also drops every chat whose opening prompt is a held-out one: otherwise
    the head would be trained on the very prompts it is evaluated on.
    """
    records = parse_sharegpt(path)
    heldout = tuple(turns for conv_id, turns in records if sharegpt_split_of(conv_id) == "heldout")
    heldout_prompts = {turns[0]["content"].strip() for turns in heldout}
    train = tuple(turns for conv_id, turns in records
                  if sharegpt_split_of(conv_id) == "train" and turns[0]["content"].strip() not in heldout_prompts)
    return {"train": train, "heldout": heldout}


def load_sharegpt(split: str = "train", limit: int | None = None, path: str | Path | None = None) -> list[Conversation]:
    """ShareGPT conversations of one fixed split, in file order (parsed once per process: 125 MB of JSON).

    `path` overrides the packaged file (tests use a small synthetic one). The turn dicts are shared with
    the cache, so treat them as read-only.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    source = str(path) if path is not None else str(packaged_file(SHAREGPT_FILE))
    return list(_sharegpt_splits(source)[split][:limit])


# --------------------------------------------------------------------------------------------------
# HumanEval


def read_humaneval(path: str | Path) -> list[dict]:
    """HumanEval problems from a `.jsonl.gz` (each has at least `task_id` and `prompt`)."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def load_humaneval() -> list[dict]:
    """The 164 HumanEval problems (`task_id`, `prompt`, `entry_point`, `canonical_solution`, `test`)."""
    return read_humaneval(packaged_file(HUMANEVAL_FILE))


# --------------------------------------------------------------------------------------------------
# Prompts


def chat_input_ids(
    tokenizer: PreTrainedTokenizerBase, user_text: str, max_tokens: int | None = None
) -> torch.LongTensor:
    """Token ids `[1, T]` of a one-turn chat ending with the assistant's generation prompt.

    With `max_tokens`, the user text (never the template) is shortened until the whole prompt fits, so
    the model still sees a well-formed turn and the cue to answer.
    """
    ids = _encode_user_turn(tokenizer, user_text)
    while max_tokens is not None and ids.shape[1] > max_tokens:
        if not user_text:
            raise ValueError(f"the chat template alone takes {ids.shape[1]} tokens, more than max_tokens={max_tokens}")
        user_text = user_text[: int(len(user_text) * 0.9 * max_tokens / ids.shape[1])]
        ids = _encode_user_turn(tokenizer, user_text)
    return ids


def _encode_user_turn(tokenizer: PreTrainedTokenizerBase, user_text: str) -> torch.LongTensor:
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"].long()


def eval_prompts(tokenizer: PreTrainedTokenizerBase, dataset: str, n: int) -> list[torch.LongTensor]:
    """The first `n` evaluation prompts of a data set, as `[1, T]` chat ids (deterministic).

    `"humaneval"`: function stubs with an instruction to complete them. `"sharegpt"`: the first user turn
    of held-out conversations (never seen by training), cut to `USER_TEXT_MAX_CHARS`.
    """
    if dataset == "humaneval":
        texts = [HUMANEVAL_INSTRUCTION.format(prompt=problem["prompt"]) for problem in load_humaneval()[:n]]
    elif dataset == "sharegpt":
        texts = [turns[0]["content"][:USER_TEXT_MAX_CHARS] for turns in load_sharegpt("heldout", limit=n)]
    else:
        raise ValueError(f"unknown eval dataset {dataset!r}; use 'humaneval' or 'sharegpt'")
    if len(texts) < n:
        raise ValueError(f"{dataset} has only {len(texts)} evaluation prompts, {n} requested")
    return [chat_input_ids(tokenizer, text) for text in texts]
