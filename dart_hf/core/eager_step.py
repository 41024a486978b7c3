"""The eager step backend: transformers' `DynamicCache` with ragged rows (`RaggedCache`), any node budget per step,
any batch of left-padded rows. One step: the drafter's trees (`DartDrafter.propose`: one head forward and one tree
search for all rows) -> one target forward over every tree (`verify_batch`) -> the call's acceptance -> each row's
path into the cache (`RaggedCache.commit`) and its target states to the drafter (`DartDrafter.advance`).

The static backend (`static_step.StaticStep`) has the same three methods; the loop (`loop.dart_decode`) cannot tell
them apart.
"""

from __future__ import annotations

import torch

from .acceptance import BatchAccepted, StepAcceptance
from .drafter import DartDrafter
from .ragged import RaggedCache, verify_batch
from .rows import Rows
from .stats import PhaseTimer
from .tree import DraftTrees


class EagerStep:
    """One call's eager steps: its cache, its drafter."""

    static = compiled = False
    reason: str | None = None

    def __init__(self, target, drafter: DartDrafter, cache, rows: Rows, aux_layer_ids: list[int]):
        self.target, self.drafter, self.cache, self.aux_ids = target, drafter, cache, aux_layer_ids
        solid = len(rows) == 1 and not any(rows.lefts)  # one row without holes: nothing to compact, ever
        self.ragged = RaggedCache(cache, rows.mask.bool(), target.config, solid=solid)

    @property
    def cache_rows(self) -> int:
        """Rows the prefill writes: the call's."""
        return self.ragged.valid.shape[0]

    @property
    def returned_cache(self):
        """The cache `generate` returns: the call's for one unpadded row (plain decoding's entries), else None
        (ragged, and it has lost its finished rows)."""
        return self.cache if self.ragged.solid else None

    def start(self, input_ids: torch.Tensor, lefts: list[int], aux: torch.Tensor, first: torch.Tensor) -> None:
        """After the prefill: the prompts' states and first tokens to the drafter."""
        self.drafter.start(input_ids, lefts, aux, first)

    def step(self, budget: int, max_new: list[int], accept: StepAcceptance, active: list[int],
             timer: PhaseTimer) -> tuple[DraftTrees, BatchAccepted]:
        """Draft, verify, accept and commit one step of every active row. The accepted lengths come back to the host
        here, once (the step's device work is done then), and the paths are cut to the longest; the result holds the
        lengths on the host."""
        trees = self.drafter.propose(max_new, timer, budget).to(self.target.device)
        with timer.phase("verify"):
            logits, aux = verify_batch(self.target, trees, self.ragged, self.aux_ids)
        with timer.phase("accept"):
            drafter = self.drafter
            step = accept(trees, logits, active, drafter.text, drafter.text_len, trees.depth + 1)
            lengths = step.lengths.tolist()  # the step's one host read
            step = step.trimmed(max(lengths))  # as wide as the longest path: the cache keeps no slot past it
            self.ragged.commit(step.paths, step.lengths)
            paths = step.paths.to(aux.device)
            drafter.advance(aux.gather(1, paths.unsqueeze(2).expand(-1, -1, aux.shape[2])), step.tokens, lengths)
            step.lengths = torch.tensor(lengths)
        return trees, step

    def retire(self, keep: list[int]) -> None:
        """After a step: only the rows `keep` (indices into the active rows) decode on; holes every row has go."""
        if not keep:
            return
        if len(keep) < self.drafter.head_len.shape[0]:
            self.ragged.select(torch.tensor(keep, device=self.ragged.valid.device))
            self.drafter.select(keep)
        if not self.ragged.solid:
            self.ragged.compact()
