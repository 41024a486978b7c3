"""The training corpus as token ids: prompts and the target's own greedy answers, one JSON line each.

Why token ids, not features: captured hidden states cost 3 x hidden x 2 bytes per token (gigabytes for a
few hundred thousand tokens), so a feature corpus can neither grow across runs nor be published. Token ids
cost a few MB per million tokens; the trainer recomputes the target's features (and its full next-token
distribution, for the KL loss) with one no-grad forward per batch (`dart_hf.training.teacher`).

File layout of a corpus folder:
    corpus.jsonl       {"prompt": [ids], "response": [ids]} per line; the response ends after the first EOS;
                       a chat imported as text (`import_conversations`) adds "spans": [[start, end], ...], the
                       labelled (assistant) stretches of prompt + response
    corpus.meta.json   {"format", "vocab_size", "eos_ids"}: a corpus belongs to one tokenizer
Appending is the only write, flushed per generation batch, so a killed run loses at most one batch; a torn
last line (killed mid-write) is cut off when the corpus is opened again, and prompts already present are
skipped, so rerunning the same command continues where it stopped and runs accumulate into one corpus.

Imported answers (`import_responses`): (prompt, response) text pairs from any engine (vLLM, SGLang,
llama.cpp) are re-tokenised with the target's chat template. The trainer takes its labels from the target's
own forward over these ids, never from the text, so an engine whose sampling or numerics differ from the
target only changes which contexts are trained on, not what the head learns to predict in them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..tools.datasets import HUMANEVAL_INSTRUCTION, load_humaneval
from .data import (_chunks, generate_batch, greedy_config, prompt_token_ids, sharegpt_chat_prompts,
                   sharegpt_code_prompts, sharegpt_training_prompts)

CORPUS_FILE = "corpus.jsonl"
META_FILE = "corpus.meta.json"
FORMAT = "dart_hf.corpus/1"
CODE_PROMPTS_START = 100
"""The code prompt set is HumanEval from this problem on: evaluation takes the first `--eval-n` problems,
so a head trained on code prompts stays clean for evaluations of up to this many HumanEval problems."""


@dataclass
class Sequence:
    ids: torch.Tensor  # [T] long: prompt then response
    prompt_length: int
    label_mask: torch.Tensor | None = None  # [T] bool: tokens the head learns to predict; None: the whole response


class Corpus:
    """An append-only token-id corpus folder (see module docstring)."""

    def __init__(self, folder: str | Path, vocab_size: int, eos_ids: list[int]):
        self.folder = Path(folder)
        self.path = self.folder / CORPUS_FILE
        self.folder.mkdir(parents=True, exist_ok=True)
        meta_path = self.folder / META_FILE
        meta = {"format": FORMAT, "vocab_size": int(vocab_size), "eos_ids": [int(i) for i in eos_ids]}
        if meta_path.exists():
            found = json.loads(meta_path.read_text())
            if found.get("format") != FORMAT or found.get("vocab_size") != meta["vocab_size"]:
                raise ValueError(f"{self.folder} holds a corpus for another tokenizer or format ({found}); "
                                 f"this target needs {meta}: use another --out folder")
        else:
            meta_path.write_text(json.dumps(meta))
        repair_torn_tail(self.path)
        self.vocab_size = int(vocab_size)
        self.eos_ids = meta["eos_ids"]
        self.done = {tuple(record["prompt"]) for record in read_records(self.path)}

    def append(self, records: list[dict]) -> int:
        """Write new (prompt, response) id records, skipping prompts already in the corpus; returns how many."""
        fresh = []
        for record in records:
            key = tuple(record["prompt"])
            if key in self.done:
                continue
            ids = record["prompt"] + record["response"]
            if any(not 0 <= int(t) < self.vocab_size for t in ids):
                raise ValueError(f"token id outside the target vocab (0..{self.vocab_size - 1}) in {record}")
            self.done.add(key)
            line = {"prompt": [int(t) for t in record["prompt"]], "response": [int(t) for t in record["response"]]}
            if record.get("spans"):
                line["spans"] = [[int(a), int(b)] for a, b in record["spans"]]
            fresh.append(json.dumps(line))
        if fresh:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write("\n".join(fresh) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
        return len(fresh)

    def pending(self, tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[tuple[int, ...]]:
        """The chat-template prompt ids of `texts` not answered yet, each once, in first-seen order: what a
        (resumed) regeneration run still has to answer, whichever engine answers it."""
        prompts = dict.fromkeys(tuple(prompt_token_ids(tokenizer, text)) for text in texts)
        return [ids for ids in prompts if ids not in self.done]


def repair_torn_tail(path: Path) -> None:
    """Cut a last line that a killed writer left without its newline (it may be half a JSON object)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    with path.open("r+b") as handle:
        handle.truncate(keep)
    print(f"{path}: dropped a torn last line ({len(data) - keep} bytes) left by an interrupted run", file=sys.stderr)


def read_records(path: Path) -> Iterator[dict]:
    if not path.exists():
        return
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                record["prompt"], record["response"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{number}: not a corpus record ({err}): {line[:80]!r}") from None
            yield record


def load_corpus(folder: str | Path) -> list[Sequence]:
    """Every sequence of a corpus folder, in file order."""
    path = Path(folder) / CORPUS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no token corpus ({CORPUS_FILE}) in {folder}; build one with `dart-hf regenerate`")
    repair_torn_tail(path)
    return [_sequence(r) for r in read_records(path) if r["response"]]


def _sequence(record: dict) -> Sequence:
    """A record as a Sequence; `spans` ([start, end) pairs over prompt + response, e.g. every assistant turn of a
    multi-turn text) become its label mask."""
    ids = torch.tensor(record["prompt"] + record["response"], dtype=torch.long)
    mask = None
    if record.get("spans"):
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        for start, end in record["spans"]:
            mask[start:end] = True
    return Sequence(ids, len(record["prompt"]), mask)


def conversation_record(tokenizer: PreTrainedTokenizerBase, turns: list[dict], max_tokens: int) -> dict | None:
    """A multi-turn chat as one corpus record: the chat-template ids of all its turns (cut at `max_tokens`), with
    every assistant turn (its end-of-turn token included) as a labelled span. None when no assistant token fits.

    Why the text itself rather than the target's regenerated answer: one no-grad target forward over it gives the
    target's distribution at every position (~10x the tokens per CPU hour of regeneration); the trainer keeps a
    deeper depth's label only where the text agrees with the target's greedy choices before it (`agreement`)."""
    spans, previous = [], []
    for i, turn in enumerate(turns):
        ids = tokenizer.apply_chat_template(turns[: i + 1], tokenize=True, return_dict=True)["input_ids"]
        if ids[: len(previous)] != previous:  # a template that rewrites earlier turns: keep what is consistent
            break
        if turn["role"] == "assistant":
            header = tokenizer.apply_chat_template(turns[:i], tokenize=True, return_dict=True,
                                                   add_generation_prompt=True)["input_ids"]
            start = len(header) if header == ids[: len(header)] else len(previous)
            spans.append([start, len(ids)])
        previous = list(ids)
        if len(previous) >= max_tokens:
            break
    ids = previous[:max_tokens]
    spans = [[a, min(b, len(ids))] for a, b in spans if a < min(b, len(ids))]
    if not spans:
        return None
    first = spans[0][0]
    return {"prompt": ids[:first], "response": ids[first:], "spans": spans}


def eos_token_ids(target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    return list(greedy_config(target, tokenizer, 1).eos_token_id or [])


def regenerate(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    out_dir: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 16,
) -> Corpus:
    """Greedy answers of the target to `prompts`, appended to the corpus in `out_dir` (resumable, deduplicated)."""
    corpus = Corpus(out_dir, target.config.get_text_config().vocab_size, eos_token_ids(target, tokenizer))
    todo = corpus.pending(tokenizer, prompts)
    todo.sort(key=len, reverse=True)  # similar lengths per batch: little padding
    config = greedy_config(target, tokenizer, max_new_tokens)
    tokens = 0
    with tqdm(total=len(todo), unit="prompt", desc="regenerate") as bar:
        for batch in _chunks(todo, batch_size):
            records = generate_batch(target, [list(ids) for ids in batch], config)
            corpus.append([{"prompt": r["prompt_ids"], "response": r["response_ids"]} for r in records])
            tokens += sum(len(r["response_ids"]) for r in records)
            bar.update(len(batch))
            bar.set_postfix(response_tokens=tokens)
    return corpus


def import_responses(
    tokenizer: PreTrainedTokenizerBase, source: str | Path, out_dir: str | Path, vocab_size: int, eos_ids: list[int]
) -> int:
    """Append (prompt, response) text pairs from a JSONL file (keys `prompt` and `response`, as any engine's
    batch output can be written) to the corpus, re-tokenised for the target; returns the number added.

    The prompt goes through the chat template (`prompt_token_ids`, as regeneration does); the response is
    tokenised without special tokens and closed with the first EOS id, so the head also learns to draft the stop."""
    if not eos_ids:
        raise ValueError("the target has no EOS token to close imported responses with")
    corpus = Corpus(out_dir, vocab_size, eos_ids)
    records = []
    for pair in _read_pairs(Path(source)):
        response = tokenizer(pair["response"], add_special_tokens=False)["input_ids"]
        if not response or response[-1] not in eos_ids:
            response = response + [eos_ids[0]]
        records.append({"prompt": prompt_token_ids(tokenizer, pair["prompt"]), "response": response})
    return corpus.append(records)


def import_conversations(tokenizer: PreTrainedTokenizerBase, conversations: list[list[dict]], out_dir: str | Path,
                         vocab_size: int, eos_ids: list[int], max_tokens: int = 1024) -> int:
    """Append whole chats as text (`conversation_record`: every assistant turn labelled, no regeneration); returns
    the number added. Chats already in the corpus (same opening ids) are skipped, so a rerun adds nothing twice."""
    corpus = Corpus(out_dir, vocab_size, eos_ids)
    records = []
    for turns in tqdm(conversations, desc="tokenise chats", unit="chat"):
        record = conversation_record(tokenizer, turns, max_tokens)
        if record is not None:
            records.append(record)
    return corpus.append(records)


def _read_pairs(path: Path) -> Iterator[dict]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                pair = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{number}: not JSON ({err})") from None
            if not isinstance(pair, dict) or not isinstance(pair.get("prompt"), str) or not isinstance(
                    pair.get("response"), str):
                raise ValueError(f"{path}:{number}: each line needs string fields 'prompt' and 'response'")
            yield pair


def training_prompts(source: str, num_prompts: int) -> list[str]:
    """User texts for regeneration: `"sharegpt"` (training split), `"sharegpt-code"` (its chats about code),
    `"sharegpt-chat"` (its other chats), `"code"` (HumanEval problems from `CODE_PROMPTS_START` on) or a JSONL file
    whose lines carry a string `prompt`."""
    if source == "sharegpt":
        return sharegpt_training_prompts(num_prompts)
    if source == "sharegpt-code":
        return sharegpt_code_prompts(num_prompts)
    if source == "sharegpt-chat":
        return sharegpt_chat_prompts(num_prompts)
    if source == "code":
        problems = load_humaneval()[CODE_PROMPTS_START:][:num_prompts]
        return [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]) for p in problems]
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"prompts must be 'sharegpt', 'sharegpt-code', 'sharegpt-chat', 'code' or a JSONL file of "
                         f"{{\"prompt\": ...}} lines; {source!r} is none of these")
    texts = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                prompt = json.loads(line).get("prompt")
                if not isinstance(prompt, str):
                    raise ValueError(f"{path}:{number}: needs a string field 'prompt'")
                texts.append(prompt)
    return texts[:num_prompts]


def run_regenerate(args: argparse.Namespace) -> int:
    """`dart-hf regenerate`: grow a token corpus with the target's answers (or import an engine's answers)."""
    from ..tools.assets import load_target

    target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    if args.conversations:
        from ..tools.datasets import load_sharegpt

        chats = load_sharegpt("train", limit=args.num_prompts)
        added = import_conversations(tokenizer, chats, args.out, target.config.get_text_config().vocab_size,
                                     eos_token_ids(target, tokenizer), args.max_tokens)
        print(f"imported {added} ShareGPT chats (as text) into {args.out}", file=sys.stderr)
        return 0
    if args.responses:
        added = import_responses(tokenizer, args.responses, args.out, target.config.get_text_config().vocab_size,
                                 eos_token_ids(target, tokenizer))
        print(f"imported {added} new responses into {args.out}", file=sys.stderr)
        return 0
    prompts = training_prompts(args.prompts, args.num_prompts)
    corpus = regenerate(target, tokenizer, prompts, args.out, args.max_new_tokens, args.batch_size)
    print(f"{len(corpus.done)} prompts in {corpus.path}", file=sys.stderr)
    return 0

