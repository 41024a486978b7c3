"""The training corpus: ShareGPT prompts answered again by the target itself.

Why regenerate: a draft head is only useful if it predicts what *this target* will say next. ShareGPT's
own answers come from ChatGPT, whose wording the target does not share; greedy answers from the target
are exactly the sequences the head will be asked to draft at inference time.

File format (JSON lines, one finished example per line, appended as soon as it is done so that a killed
job resumes where it stopped)::

    {"prompt_ids": [...], "response_ids": [...]}

Ids carry no padding; `response_ids` stops after the first end-of-sequence token, which is kept (the
head must learn to draft the stop too).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import IO

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from dart_hf.tools.assets import USER_TEXT_MAX_CHARS, chat_input_ids, load_sharegpt, load_target

PROMPT_MAX_TOKENS = 384
"""Prompts are cut to this many tokens: longer ones cost quadratic attention for little extra signal."""


def regenerate_responses(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    max_new_tokens: int = 256,
    batch_size: int = 16,
    out_path: str | Path | None = None,
) -> list[dict]:
    """Greedy target answers to `prompts` (user texts), one record per distinct prompt, in input order.

    Prompts are batched by similar length (left padding, so every row's next token sits in the last
    column). With `out_path`, each finished record is appended at once and prompts already in the file
    are skipped, so a killed run resumes.
    """
    prompt_ids = list(dict.fromkeys(tuple(prompt_token_ids(tokenizer, text)) for text in prompts))
    done = _read_finished(Path(out_path)) if out_path is not None else {}
    pending = sorted((ids for ids in prompt_ids if ids not in done), key=len, reverse=True)
    config = greedy_config(target, tokenizer, max_new_tokens)
    started, new_tokens = time.perf_counter(), 0
    sink_context = open(out_path, "a", encoding="utf-8") if out_path is not None else nullcontext()
    with sink_context as sink, tqdm(total=len(pending), unit="prompt", desc="regenerating") as bar:
        for batch in _chunks(pending, batch_size):
            for record in generate_batch(target, [list(ids) for ids in batch], config):
                done[tuple(record["prompt_ids"])] = record
                new_tokens += len(record["response_ids"])
                _append(sink, record)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{new_tokens / (time.perf_counter() - started):.1f}")
    return [done[ids] for ids in prompt_ids]


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


def load_corpus(path: str | Path) -> list[dict]:
    """All finished records of a corpus file (a line torn by a job killed mid-write is ignored)."""
    return list(_read_finished(Path(path), repair=False).values())


def _read_finished(path: Path, repair: bool = True) -> dict[tuple[int, ...], dict]:
    """Records already in a corpus file, keyed by prompt ids. With `repair`, a torn last line (job
    killed mid-write) is cut off the file so that appending starts on a clean line."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if repair and len(complete) < len(data):
        with open(path, "r+b") as handle:
            handle.truncate(len(complete))
    records = (json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip())
    return {tuple(record["prompt_ids"]): record for record in records}


def _append(sink: IO[str] | None, record: dict) -> None:
    if sink is not None:
        sink.write(json.dumps(record) + "\n")
        sink.flush()


def _chunks(items: list, size: int) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def sharegpt_training_prompts(num_prompts: int | None) -> list[str]:
    """Opening user turns of the first `num_prompts` training conversations (file order, deterministic)."""
    return [turns[0]["content"] for turns in load_sharegpt("train", limit=num_prompts)]


def main(argv: Iterable[str] | None = None) -> None:
    """Command line: build or extend a corpus file (safe to kill and rerun with the same arguments)."""
    parser = argparse.ArgumentParser(prog="python -m dart_hf.training.data", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct", help="known target name or local folder")
    parser.add_argument("--out", required=True, help="corpus file (JSON lines), appended to")
    parser.add_argument("--num-prompts", type=int, default=2000, help="first N ShareGPT training prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args(None if argv is None else list(argv))
    target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    records = regenerate_responses(target, tokenizer, sharegpt_training_prompts(args.num_prompts),
                                   max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, out_path=args.out)
    tokens = sum(len(record["response_ids"]) for record in records)
    print(f"{len(records)} examples, {tokens} response tokens in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
