"""Training features for a head, captured while the target regenerates its own answers.

Every forward of batched greedy generation already computes the inputs of the three `aux_layer_ids`
layers at every position it processes (the prefill covers the prompt, each decode step one new token), so
recording them during generation gives the head's inputs at no extra target cost; on a 2-core CPU that
halves the data budget's price compared with generating text first and re-running the target over it.

Shard format (`features-NNNNN.safetensors`, one per generation batch, so a killed job resumes per batch):
    ids.{j}   int32 [T]          prompt + greedy response tokens (response ends after EOS, if reached)
    aux.{j}   bf16  [T - 1, 3H]  target layer inputs at positions 0 .. T-2 (the last token is never fed)
    prompt_lengths int32 [n]
Labels are the response tokens themselves: greedy tokens are the target's argmax given the true prefix.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..tools.assets import load_target
from ..core.configuration import default_aux_layer_ids
from ..core.target import AuxHiddenCapture
from .data import _chunks, generate_batch, greedy_config, prompt_token_ids, sharegpt_training_prompts

SHARD_GLOB = "features-*.safetensors"


@dataclass
class Example:
    ids: torch.Tensor  # [T] long
    aux: torch.Tensor  # [T - 1, 3H]
    prompt_length: int


def _rows_from_history(history: list[torch.Tensor], width: int, record: dict, row: int) -> torch.Tensor:
    """Positions 0..T-2 of one batch row: the prefill (left padding stripped) then one row per decode step."""
    prompt_len, n_resp = len(record["prompt_ids"]), len(record["response_ids"])
    prefill = history[0][row, width - prompt_len :]
    steps = [h[row] for h in history[1:n_resp]]  # decode step i fed response token i-1
    return torch.cat([prefill, *steps], dim=0)


def collect_features(
    target: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    out_dir: str | Path,
    max_new_tokens: int = 256,
    batch_size: int = 16,
    aux_layer_ids: list[int] | None = None,
) -> None:
    """Regenerate answers to `prompts` in batches and write one feature shard per batch (resumable)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layer_ids = aux_layer_ids or default_aux_layer_ids(target.config.get_text_config().num_hidden_layers)
    prompt_ids = list(dict.fromkeys(tuple(prompt_token_ids(tokenizer, t)) for t in prompts))
    prompt_ids.sort(key=len, reverse=True)  # similar lengths per batch: little padding
    config = greedy_config(target, tokenizer, max_new_tokens)
    batches = list(_chunks(prompt_ids, batch_size))
    tokens = 0
    with tqdm(total=len(batches), unit="batch", desc="regenerate + capture") as bar:
        for k, batch in enumerate(batches):
            shard = out / f"features-{k:05d}.safetensors"
            if shard.exists():
                bar.update(1)
                continue
            width = max(len(ids) for ids in batch)
            with AuxHiddenCapture(target, layer_ids, keep_all=True) as capture:
                records = generate_batch(target, [list(ids) for ids in batch], config)
            tensors = {"prompt_lengths": torch.tensor([len(r["prompt_ids"]) for r in records], dtype=torch.int32)}
            for j, record in enumerate(records):
                ids = record["prompt_ids"] + record["response_ids"]
                tensors[f"ids.{j}"] = torch.tensor(ids, dtype=torch.int32)
                aux = _rows_from_history(capture.history, width, record, j)
                assert aux.shape[0] == len(ids) - 1, (aux.shape, len(ids))
                tensors[f"aux.{j}"] = aux.to(torch.bfloat16).contiguous()
                tokens += len(record["response_ids"])
            save_file(tensors, str(shard.with_suffix(".tmp")))
            shard.with_suffix(".tmp").rename(shard)
            bar.update(1)
            bar.set_postfix(response_tokens=tokens)


def iter_examples(feature_dir: str | Path) -> Iterator[Example]:
    """Every example of every shard, in shard order."""
    shards = sorted(Path(feature_dir).glob(SHARD_GLOB))
    if not shards:
        raise FileNotFoundError(f"no feature shards ({SHARD_GLOB}) in {feature_dir}")
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            lengths = f.get_tensor("prompt_lengths").tolist()
            for j, prompt_length in enumerate(lengths):
                yield Example(f.get_tensor(f"ids.{j}").long(), f.get_tensor(f"aux.{j}"), prompt_length)


def main(argv: Iterable[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dart_hf.training.features", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--out", required=True, help="folder of feature shards (resumed when it exists)")
    parser.add_argument("--num-prompts", type=int, default=2000)
    parser.add_argument("--skip-prompts", type=int, default=0, help="start after this many training prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    args = parser.parse_args(None if argv is None else list(argv))
    target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype))
    prompts = sharegpt_training_prompts(args.skip_prompts + args.num_prompts)[args.skip_prompts :]
    collect_features(target, tokenizer, prompts, args.out, args.max_new_tokens, args.batch_size)
    print(f"features in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
