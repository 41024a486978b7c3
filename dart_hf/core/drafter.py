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
from .tree import DraftTrees, TreeSearchParams, build_trees, last_tokens

PENDING_LIMIT = 64  # positions a row may keep waiting through plain steps before the head reads them


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
    proposal: ONE head forward (`DartHead.draft_rows`) and ONE tree search (`build_trees`) for all rows. Its per-row
    state (pending states, texts) is padded tensors with per-row counts, appended to by scatter: no loop over rows."""

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
        already on the head's device; default: the head's, moved there. rows: the batch's rows (`start` gives their
        first tokens, `select` drops finished ones)."""
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
        self.text = torch.full((rows, 256), -1, dtype=torch.long, device=self.device)  # -1: no token (lookup)
        self.used = [0] * rows  # tokens of each row's text
        self._aux: torch.Tensor | None = None  # [rows, R, 3H]: positions the head has not read, pending[b] real
        self._tokens: torch.Tensor | None = None  # [rows, R]: the token that follows each of them
        self.pending = [0] * rows
        self.exhausted = [False] * rows  # the row reached `limit`: no more drafts, and no states kept for them

    def start(self, first_tokens: torch.Tensor) -> None:
        """Each row's first token [rows] (every later one comes with `advance`)."""
        self.text[:, 0] = first_tokens.to(self.device).view(-1)
        self.used = [1] * len(self.used)

    def texts(self, row: int) -> torch.Tensor:
        """Row `row`'s text so far [T]: its first token and every token `advance` brought."""
        return self.text[row, : self.used[row]]

    def advance(self, aux: torch.Tensor, tokens: torch.Tensor, lengths: list[int] | None = None,
                rows: list[int] | None = None) -> None:
        """Record newly verified positions of `rows` (default: every row): their target states `aux` [rows, M, 3H]
        and the token after each `tokens` [rows, M] (for the last one: the target's own new token, the next tree's
        root), the first lengths[i] of row i real (default: all M). Rows that draft no more keep no states."""
        rows = list(range(len(self.used))) if rows is None else rows
        m = tokens.shape[1]
        lengths = [m] * len(rows) if lengths is None else list(lengths)
        aux, tokens = aux.to(self.device), tokens.to(self.device)
        self.text = _append(self.text, self.used, rows, tokens, lengths, fill=-1)
        self.used = _added(self.used, rows, lengths)
        lengths = [0 if self.exhausted[b] else n for b, n in zip(rows, lengths)]
        if self._aux is None:
            self._aux = aux.new_zeros(len(self.used), 0, aux.shape[2])
            self._tokens = tokens.new_zeros(len(self.used), 0)
        self._aux = _append(self._aux, self.pending, rows, aux, lengths)
        self._tokens = _append(self._tokens, self.pending, rows, tokens, lengths)
        self.pending = _added(self.pending, rows, lengths)

    def select(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (indices into the current rows, in order): finished rows leave the batch."""
        index = torch.tensor(keep, device=self.device)
        self.cache.select(index)
        self.text = self.text[index]
        if self._aux is not None:
            self._aux, self._tokens = self._aux[index], self._tokens[index]
        self.lengths, self.used, self.pending, self.exhausted = (
            [v[i] for i in keep] for v in (self.lengths, self.used, self.pending, self.exhausted))

    def propose(self, max_new: list[int], timer: PhaseTimer, node_budget: int | None = None) -> DraftTrees:
        """The draft trees of `node_budget` nodes (default: the budget this drafter was made with), one per row:
        row b's rooted at the last token of its text, at most max_new[b] tokens deep (>= 0), padded to one node
        count, on the head's device. The head drafts only as deep as a tree can reach: min(node budget,
        the deepest max_new, K + 1) rows. Budget 0 gives every row its root alone: no search, and no head forward
        until a row has `PENDING_LIMIT` positions waiting (the target's states wait for the next tree; a long run of
        plain steps has the head read them in blocks, so their memory and the next tree's catch-up stay bounded)."""
        if node_budget is not None and node_budget != self.params.node_budget:
            self.params = replace(self.params, node_budget=int(node_budget))
        limits = [min(m, self.limit - n - 1) for n, m in zip(self.used, max_new)]
        for b, m in enumerate(limits):
            if m <= 0:  # no room left below max_length / the context: the remaining steps are plain decoding
                self.exhausted[b], self.pending[b] = True, 0
        used = torch.tensor(self.used, device=self.device)
        roots = self.text.gather(1, (used - 1).view(-1, 1)).view(-1)
        if self.params.node_budget == 0 or all(self.exhausted):
            if max(self.pending) >= PENDING_LIMIT:
                with timer.phase("draft"):
                    self._draft(1)  # the head's cache takes them in; the one draft row is not used
            return DraftTrees.roots(roots)
        if any(n == 0 for n, done in zip(self.pending, self.exhausted) if not done):
            raise RuntimeError("propose() before advance(): the head has no target states to draft from")
        depth = draft_depth(self.params, max(limits), self.head.config.num_predictions)
        with timer.phase("draft"):
            logits = self._draft(depth)
        with timer.phase("tree"):
            return self._search(logits, used, roots, limits, depth)

    def _draft(self, depth: int) -> torch.Tensor:
        """One head forward over every row's pending positions (a row that drafts no more: one dummy position, not
        kept). Returns logits [rows, depth, draft vocab]."""
        width = max(self.pending)  # >= 1: `propose` drafts only when a drafting row has pending positions
        aux, tokens = self._aux[:, :width], self._tokens[:, :width]
        real = torch.tensor([max(n, 1) for n in self.pending], device=self.device)
        kv_len = max(self.lengths) + width + depth - 1
        self.cache.reserve(kv_len)
        logits = self.head.draft_rows(aux.to(self.head.dtype), tokens, real, self.cache.k, self.cache.v,
                                      self.cache.lengths, depth, self.modules, kv_len=kv_len)
        self.cache.lengths += torch.tensor(self.pending, device=self.device)
        self.lengths = [length + n for length, n in zip(self.lengths, self.pending)]
        self._aux = self._tokens = None
        self.pending = [0] * len(self.pending)
        return logits

    def _search(self, logits: torch.Tensor, used: torch.Tensor, roots: torch.Tensor, limits: list[int],
                depth: int) -> DraftTrees:
        """`build_trees` for every row: its n-gram context, its prompt-lookup continuation, its depth limit."""
        text = self.text[:, : max(self.used)]
        contexts = last_tokens(text, used, self.context_size)
        lookup = lookup_for_tree(text, depth, self.head.config, self.device, used) if self.prompt_lookup else None
        return build_trees(logits, roots, contexts, self.params, ngram=self.ngram,
                           draft_to_target=self.head.draft_to_target, eos_token_ids=self.eos,
                           max_depths=torch.tensor([max(m, 0) for m in limits], device=self.device),
                           depth_bound=max(max(limits), 0), lookup=lookup)


def _append(buffer: torch.Tensor, counts: list[int], rows: list[int], new: torch.Tensor, lengths: list[int],
            fill: int = 0) -> torch.Tensor:
    """`buffer` [B, W, ...] with new[i, :lengths[i]] written after the counts[rows[i]] entries of row rows[i], by one
    scatter (the rest of `new` lands past each row's count, where nothing reads it). Grows the buffer (doubling) when
    a row would not fit."""
    m = new.shape[1]
    need = max(counts[b] for b in rows) + m
    if need > buffer.shape[1]:
        extra = buffer.new_full((buffer.shape[0], max(need, 2 * buffer.shape[1]) - buffer.shape[1],
                                 *buffer.shape[2:]), fill)
        buffer = torch.cat([buffer, extra], dim=1)
    index = torch.tensor([counts[b] for b in rows], device=new.device).view(-1, 1) + torch.arange(m, device=new.device)
    index = index.view(*index.shape, *([1] * (new.dim() - 2))).expand_as(new)
    target = torch.tensor(rows, device=new.device)
    part = buffer.index_select(0, target)
    part.scatter_(1, index, new.to(buffer.dtype))
    buffer.index_copy_(0, target, part)
    return buffer


def _added(counts: list[int], rows: list[int], lengths: list[int]) -> list[int]:
    counts = list(counts)
    for b, n in zip(rows, lengths):
        counts[b] += n
    return counts
