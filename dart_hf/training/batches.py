"""What one training step reads of the corpus: which sequences, in what order, and which positions are anchors.

Each micro-batch holds `batch_size` sequences (right-padded; every attention involved is causal, so the padding never
reaches a real row). In each sequence `anchors_per_sequence` anchor positions of the response are drawn, and the
packed-anchor forward (`DartHead.forward`) trains them all in one pass. Anchors are drawn from a seed of the
sequence's place in the shuffled order, so they do not depend on how batches are spread over processes.

Batches are grouped by length (transformers' `get_length_grouped_indices`: shuffled, then sorted within
mega-batches), so a batch pads to its own longest sequence rather than to a random long one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence as SequenceOf

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.trainer_pt_utils import get_length_grouped_indices

from .corpus import Sequence


def anchor_positions(example: Sequence, n_anchors: int, rng: random.Random) -> list[int]:
    """Sorted anchors of one sequence: anchor a pairs state h_a with token a+1 and its depth-d row predicts
    token a+2+d, so anchors start where the response labels start (a + 2 >= prompt length) and end where
    depth 0 still has a label; with a label mask, only anchors whose depth-0 token is labelled. `n_anchors` <= 0:
    all of them. Empty when the response is too short."""
    first, last = max(example.prompt_length - 2, 0), example.ids.numel() - 3
    if last < first:
        return []
    candidates = range(first, last + 1)
    if example.label_mask is not None:
        candidates = (torch.nonzero(example.label_mask[first + 2 : last + 3]).flatten() + first).tolist()
    if n_anchors <= 0 or n_anchors >= len(candidates):
        return list(candidates)
    return sorted(rng.sample(candidates, n_anchors))


def labelled_tokens(example: Sequence) -> int:
    """Tokens the head learns to predict in one sequence (its response, or its label mask)."""
    mask = example.label_mask
    return int(mask.sum()) if mask is not None else example.ids.numel() - example.prompt_length


def label_validity(valid: torch.Tensor, position: torch.Tensor, ids: torch.Tensor, label_mask: torch.Tensor,
                   argmax: torch.Tensor) -> torch.Tensor:
    """`valid` [B, A, K+1] narrowed to rows whose token is labelled and whose context agrees with the target.

    Row (a, d) predicts token a+2+d from the target's distribution at `position` = a+1+d, computed over the TEXT
    prefix. At decoding time depth d is only reached along the target's own greedy tokens a+2..a+1+d, so a label
    is kept only where the text's tokens before it are the target's argmax (for a corpus of the target's own
    greedy answers, everywhere). Depth 0 needs no agreement: its context is the text the target has seen."""
    token = ids.gather(1, (position + 1).clamp(max=ids.shape[1] - 1).flatten(1)).view(position.shape)
    labelled = label_mask.gather(1, (position + 1).clamp(max=label_mask.shape[1] - 1).flatten(1)).view(position.shape)
    agree = (argmax == token).long().cumprod(-1)
    prefix_agrees = torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1]], dim=-1).bool()
    return valid & labelled & prefix_agrees


class AnchorCollator:
    """Data loader items are places in the shuffled order; a batch is the padded sequences at those places.

    Returns ids [B, T] (right-padded with 0), lengths [B], anchors [B, A] and anchor_valid [B, A] (rows with
    fewer than A anchors repeat their first one, marked invalid), label_mask [B, T] (the response, or the
    sequence's own label mask), response_tokens (labelled tokens in the batch) and index [B] (corpus places)."""

    def __init__(self, data: SequenceOf[Sequence], order: list[int], n_anchors: int, seed: int):
        self.data, self.order, self.n_anchors, self.seed = data, order, n_anchors, seed

    def __call__(self, places: list[int]) -> dict[str, torch.Tensor]:
        index = [self.order[p] for p in places]
        seqs = [self.data[i] for i in index]
        anchors = [anchor_positions(s, self.n_anchors, random.Random(self.seed * 1_000_003 + p))
                   for s, p in zip(seqs, places)]
        a = max(len(x) for x in anchors)
        masks = [s.label_mask if s.label_mask is not None else torch.arange(s.ids.numel()) >= s.prompt_length
                 for s in seqs]
        return {
            "ids": pad_sequence([s.ids for s in seqs], batch_first=True),
            "lengths": torch.tensor([s.ids.numel() for s in seqs]),
            "anchors": torch.tensor([x + [x[0]] * (a - len(x)) for x in anchors]),
            "anchor_valid": torch.tensor([[True] * len(x) + [False] * (a - len(x)) for x in anchors]),
            "label_mask": pad_sequence(masks, batch_first=True),
            "response_tokens": torch.tensor(sum(labelled_tokens(s) for s in seqs)),
            "index": torch.tensor(index),
        }


def training_order(lengths: list[int], epochs: float, global_batch: int, grad_accum: int = 1, seed: int = 0,
                   group_by_length: bool = True) -> list[int]:
    """Sequence indices for every epoch (a fresh shuffle each, length-grouped by global batch so that each
    process's share pads alike), cut to whole optimizer steps of `global_batch` x `grad_accum` sequences."""
    n, passes = len(lengths), range(math.ceil(epochs))
    if group_by_length:
        order = [i for e in passes for i in get_length_grouped_indices(
            lengths, global_batch, generator=torch.Generator().manual_seed(seed * 1_000 + e))]
    else:
        rng = random.Random(seed)
        order = [i for _ in passes for i in rng.sample(range(n), n)]
    per_step = global_batch * grad_accum
    return order[: int(epochs * n) // per_step * per_step]
