"""The draft half of a DART step, shared by the tree loop (`dart_hf.core.loop`) and chain mode
(`dart_hf.integrations.transformers.DartCandidateGenerator`): head forward + tree search (docs/DART_SPEC.md §1, §3).

A `DartDrafter` lives for one `generate` call. It owns everything per-call that drafting needs: the head's KV
cache, the target states of verified positions the head has not consumed yet, the n-gram model on the head's
device, the EOS ids, prompt lookup and the tree-search parameters. The head itself is only read.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PreTrainedModel

from .modeling import DartHead, TargetModules
from .ngram import NGramModel
from .prompt_lookup import lookup_for_tree
from .stats import PhaseTimer
from .tree import TreeSearchParams, build_trees, root_tree
from .tree_batch import TreeBatch


def default_node_budget(head: DartHead, target: PreTrainedModel) -> int:
    """One node budget for a whole call (chain mode): the head config's, or for a cost-aware head
    (`node_budget=None`) the budget policy's current choice, at least one node (`dart_hf.core.budget`)."""
    if head.config.node_budget is not None:
        return head.config.node_budget
    from .budget import budget_policy  # the tree loop asks the policy itself, every step

    return max(1, budget_policy(head, target).choice)


def draft_depth(params: TreeSearchParams, max_new: int, num_predictions: int) -> int:
    """How many of the head's K + 1 rows a step drafts: no deeper than the budget's tree can reach, than `max_new`
    tokens allow, or than the head predicts (at least one row)."""
    return max(1, min(params.node_budget, max_new, num_predictions))


class DartDrafter:
    """Proposes a draft tree per row and step from the target states of the positions verified since the last
    proposal: ONE head forward (`DartHead.draft_rows`) and ONE tree search (`build_trees`) for all rows."""

    def __init__(
        self,
        head: DartHead,
        target: PreTrainedModel,
        *,
        max_length: int,
        node_budget: int,
        prompt_lookup: bool,
        eos_token_ids: torch.Tensor | None,
        ngram: NGramModel | None = None,
        rows: int = 1,
    ):
        """max_length: the call's; drafts never reach past it nor past the target's context (positions past
        `max_position_embeddings` are decoded plainly, as plain `generate` decodes them). ngram: the head's n-gram
        already on the head's device; default: the head's, moved there. rows: the batch's rows (`select` drops
        finished ones)."""
        self.head = head
        self.device = head.device
        self.modules = TargetModules.of(target)
        context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        self.limit = min(max_length, context) if context else max_length  # no draft token at or past this length
        self.cache = head.new_cache(capacity=min(self.limit, 4096) + head.config.num_predictions, rows=rows)
        self.lengths = [0] * rows  # the cache's lengths, on the host (no read-back to size the attention)
        self.params = TreeSearchParams.from_config(head.config, node_budget=node_budget)
        if ngram is None and head.ngram is not None:
            ngram = head.ngram.to(self.device)
        self.ngram = ngram
        self.context_size = max(self.ngram.context_size if self.ngram is not None else 0, 1)
        self.prompt_lookup = prompt_lookup
        self.eos = eos_token_ids.to(self.device).view(-1) if eos_token_ids is not None else None
        self._aux: list[torch.Tensor | None] = [None] * rows  # [r, 3H] per row: positions the head has not read
        self._tokens: list[torch.Tensor | None] = [None] * rows  # [r]: the token that follows each of them
        self.exhausted = [False] * rows  # the row reached `limit`: no more drafts, and no states kept for them

    def advance(self, aux: torch.Tensor, tokens: torch.Tensor, row: int = 0) -> None:
        """Record r newly verified positions of `row`: their target states `aux` [1, r, 3H] and the token after each
        `tokens` [1, r] (for the last one: the target's own new token, the next tree's root)."""
        if self.exhausted[row]:
            return
        aux = aux.reshape(-1, aux.shape[-1]).to(self.device)
        tokens = tokens.reshape(-1).to(self.device)
        if self._aux[row] is not None:  # a step that drafted nothing (plain decoding, chain mode at the limit)
            aux, tokens = torch.cat([self._aux[row], aux]), torch.cat([self._tokens[row], tokens])
        self._aux[row], self._tokens[row] = aux, tokens

    def select(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (indices into the current rows, in order): finished rows leave the batch."""
        self.cache.select(torch.tensor(keep, device=self.device))
        self.lengths = [self.lengths[i] for i in keep]
        self._aux, self._tokens = [self._aux[i] for i in keep], [self._tokens[i] for i in keep]
        self.exhausted = [self.exhausted[i] for i in keep]

    def propose(self, texts: list[torch.Tensor], max_new: list[int], timer: PhaseTimer,
                node_budget: int | None = None, fill: int = 0) -> TreeBatch:
        """The draft trees of `node_budget` nodes (default: the budget this drafter was made with), one per row:
        row b's rooted at the last token of `texts[b]` [T_b], at most max_new[b] tokens deep (>= 0), padded with
        `fill` to one node count, on the head's device. The head drafts only as deep as a tree can reach: min(node
        budget, the deepest max_new, K + 1) rows. Budget 0 gives every row its root alone: no head forward, no
        search (the target's states wait for the next tree)."""
        if node_budget is not None and node_budget != self.params.node_budget:
            self.params = replace(self.params, node_budget=int(node_budget))
        limits = [min(m, self.limit - t.numel() - 1) for t, m in zip(texts, max_new)]
        for b, m in enumerate(limits):
            if m <= 0:  # no room left below max_length / the context: the remaining steps are plain decoding
                self.exhausted[b], self._aux[b], self._tokens[b] = True, None, None
        roots = torch.stack([t[-1] for t in texts]).to(self.device)
        drafting = [b for b, done in enumerate(self.exhausted) if not done]
        if self.params.node_budget == 0 or not drafting:
            return TreeBatch.stack([root_tree(r, self.device) for r in roots], fill=fill)
        if any(self._aux[b] is None for b in drafting):
            raise RuntimeError("propose() before advance(): the head has no target states to draft from")
        depth = draft_depth(self.params, max(limits), self.head.config.num_predictions)
        with timer.phase("draft"):
            logits = self._draft(depth)
        with timer.phase("tree"):
            return TreeBatch.from_trees(self._search(logits, texts, roots, limits, depth), fill)

    def _draft(self, depth: int) -> torch.Tensor:
        """One head forward over every row's pending positions (rows that draft no more: one dummy position, not
        kept). Returns logits [rows, depth, draft vocab]."""
        rows = len(self._aux)
        counts = [0 if a is None else a.shape[0] for a in self._aux]
        width = max(max(counts), 1)
        hidden = next(a for a in self._aux if a is not None).shape[1]
        aux = torch.zeros(rows, width, hidden, device=self.device, dtype=self.head.dtype)
        tokens = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        for b, n in enumerate(counts):  # one slice copy per row
            if n:
                aux[b, :n], tokens[b, :n] = self._aux[b], self._tokens[b]
        real = torch.tensor([max(n, 1) for n in counts], device=self.device)
        kv_len = max(self.lengths) + width + depth - 1
        self.cache.reserve(kv_len)
        logits = self.head.draft_rows(aux, tokens, real, self.cache.k, self.cache.v, self.cache.lengths, depth,
                                      self.modules, kv_len=kv_len)
        self.cache.lengths += torch.tensor(counts, device=self.device)
        self.lengths = [length + n for length, n in zip(self.lengths, counts)]
        self._aux, self._tokens = [None] * rows, [None] * rows
        return logits

    def _search(self, logits: torch.Tensor, texts: list[torch.Tensor], roots: torch.Tensor, limits: list[int],
                depth: int):
        """`build_trees` for every row: its n-gram context, its prompt-lookup continuation, its depth limit."""
        longest = max(t.numel() for t in texts)
        padded = torch.full((len(texts), longest), -1, dtype=torch.long, device=self.device)
        for b, t in enumerate(texts):  # one slice copy per row
            padded[b, : t.numel()] = t
        used = torch.tensor([t.numel() for t in texts], device=self.device)
        tail = used.view(-1, 1) - self.context_size + torch.arange(self.context_size, device=self.device)
        contexts = torch.where(tail >= 0, padded.gather(1, tail.clamp(min=0)), -1)
        lookup = lookup_for_tree(padded, depth, self.head.config, self.device, used) if self.prompt_lookup else None
        return build_trees(logits, roots, contexts, self.params, ngram=self.ngram,
                           draft_to_target=self.head.draft_to_target, eos_token_ids=self.eos,
                           max_depths=torch.tensor([max(m, 0) for m in limits], device=self.device),
                           depth_bound=max(max(limits), 0), lookup=lookup)
