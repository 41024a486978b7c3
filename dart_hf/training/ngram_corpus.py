"""`dart-hf ngram`: the n-gram table of a head, from the same corpus tokenised by the target's tokenizer.

Sources: every turn of the ShareGPT training split (broad text) and the target's own regenerated answers from
token corpora (the target's phrasing, which is what the tree has to guess). Held-out prompts are never used. Rare
2..n-grams are pruned (`min_count`) so the table ships beside the head.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from ..tools.assets import load_target
from ..tools.datasets import load_sharegpt
from ..core.ngram import NGramModel
from .corpus import load_corpus


def corpus_sequences(
    tokenizer: PreTrainedTokenizerBase, sharegpt_limit: int | None = None, regenerated_weight: int = 2,
    corpora: list[str | Path] = (),
) -> list[list[int]]:
    """Token id sequences: ShareGPT train turns, then the answers of the token corpora (repeated
    `regenerated_weight` times, since they are the target's own distribution; their prompts are not counted)."""
    sequences: list[list[int]] = []
    conversations = load_sharegpt("train", limit=sharegpt_limit)
    texts = [turn["content"] for conv in conversations for turn in conv if turn["content"].strip()]
    for start in tqdm(range(0, len(texts), 256), desc="tokenise ShareGPT", unit="batch"):
        sequences += tokenizer(texts[start : start + 256], add_special_tokens=False)["input_ids"]
    for folder in corpora:
        sequences += [s.ids[s.prompt_length :].tolist() for s in load_corpus(folder)] * regenerated_weight
    return sequences


def build_ngram(
    tokenizer: PreTrainedTokenizerBase, vocab_size: int, order: int = 3, min_count: int = 2,
    sharegpt_limit: int | None = None, corpora: list[str | Path] = (),
) -> NGramModel:
    sequences = corpus_sequences(tokenizer, sharegpt_limit, corpora=corpora)
    return NGramModel.build(sequences, order=order, vocab_size=vocab_size, eos_token_id=tokenizer.eos_token_id,
                            min_count=min_count)


def run(args: argparse.Namespace) -> int:
    target, tokenizer = load_target(args.target)
    ngram = build_ngram(tokenizer, target.config.vocab_size, args.order, args.min_count, args.sharegpt_limit,
                        args.corpus)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    ngram.save(args.out)
    print(f"{ngram} -> {args.out} ({Path(args.out).stat().st_size / 2**20:.1f} MiB)")
    return 0
