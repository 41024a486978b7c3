"""The draft half of a DART step: the head's state for a call, its forward and the tree search (docs/DART_SPEC.md §1,
§3), written once for the step (`step.DartStep`, over a dynamic or a static cache) and chain mode
(`dart_hf.integrations.transformers.DartCandidateGenerator`).

A `DartDrafter` lives for one `generate` call and holds, per row, as device tensors of fixed shapes:
- the head's keys/values of every position it has read (`kv`, the head's `HeadKVCache`);
- the target states of verified positions it has not read yet and the token after each (`pend_aux`, `pend_tok`,
  `n_pend`): the next head forward reads them, then drafts;
- the text so far (`text`, `text_len`): the n-gram context, prompt lookup and the tree's root read it.
The device-side methods (`forward`, `search`, `append`) never read a length back, so the static step captures them
whole. The step over a `DynamicCache` keeps host copies of the counts (`head_lens`, `used`, `pending`) so that it can
slice the buffers to what is filled (`propose`, `advance`): the same buffers, the same methods, a narrower view.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PreTrainedModel

from .modeling import DartHead, TargetModules
from .ngram import NGramModel
from .stats import PhaseTimer
from .tree import DraftTrees, TreeSearchParams, build_trees, last_tokens
from .prompt_lookup import lookup_continuations

PENDING_LIMIT = 64  # positions a row may keep waiting through plain steps before the head reads them
SLOT_ROUNDING = 256  # every buffer of a call is sized from max_length rounded up to this (`bucket`)


def bucket(max_length: int) -> int:
    """The one rounding rule for every fixed buffer of a call (head keys/values, text, the static step's target
    cache): max_length rounded up to `SLOT_ROUNDING`, each buffer adding its own fixed extra. Calls whose max_length
    falls in one bucket get the same shapes, so the compiled step is one graph per bucket."""
    return -(-max_length // SLOT_ROUNDING) * SLOT_ROUNDING


def batch_bucket(rows: int) -> int:
    """The rows a fixed-shape step holds for a batch of `rows`: the next power of two (1, 2, 4, 8, ...), so that
    batches of nearby sizes share one compiled graph; the extra rows are masked copies of the first."""
    return 1 << (rows - 1).bit_length()


def draft_depth(node_budget: int, max_new: int, num_predictions: int) -> int:
    """How many of the head's K + 1 rows a step drafts: no deeper than the budget's tree can reach, than `max_new`
    tokens allow, or than the head predicts (at least one row)."""
    return max(1, min(node_budget, max_new, num_predictions))


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
        pending: int | None = None,
        full: bool = False,
    ):
        """max_length: the call's; drafts never reach past it nor past the target's context (positions past
        `max_position_embeddings` are decoded plainly, as plain `generate` decodes them). ngram: the head's n-gram
        already on the head's device; default: the head's, moved there. rows: the batch's rows (`select` drops
        finished ones). pending: positions a row may hold unread (default: `PENDING_LIMIT` + the longest accepted
        path; the static step: one path). full: allocate every buffer at its final size now (the static step:
        fixed addresses); otherwise the head's keys/values grow by doubling up to it."""
        self.head, self.device = head, head.device
        config = head.config
        self.modules = TargetModules.of(target)
        context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        self.limit = min(max_length, context) if context else max_length  # no draft token at or past this length
        self.params = TreeSearchParams.from_config(config, node_budget=node_budget)
        if ngram is None and head.ngram is not None:
            ngram = head.ngram.to(self.device)
        self.ngram = ngram
        self.context_size = max(self.ngram.context_size if self.ngram is not None else 0, 1)
        self.lookup = (config.lookup_min_ngram, config.lookup_max_ngram) if prompt_lookup else None
        self.eos = eos_token_ids.to(self.device).view(-1) if eos_token_ids is not None else None
        k1 = config.num_predictions
        self.capacity = PENDING_LIMIT + k1 + 1 if pending is None else pending
        self.slots = bucket(self.limit) + self.capacity + k1  # head: every read position + a forward's rows
        self.kv = head.new_cache(self.slots if full else min(self.slots, 4096), rows)
        long = lambda *shape: torch.zeros(shape, dtype=torch.long, device=self.device)
        self.pend_aux = torch.zeros(rows, self.capacity, 3 * config.target_hidden_size, device=self.device,
                                    dtype=head.dtype)
        self.pend_tok, self.n_pend = long(rows, self.capacity), long(rows)
        # the text: every token up to max_length (rows decode plainly past the context) + one accepted path
        self.text = torch.full((rows, bucket(max_length) + k1 + 1), -1, dtype=torch.long, device=self.device)
        self.text_len = long(rows)  # -1 past it: no token (prompt lookup)
        # host copies of the counts, kept by the eager methods (`start`, `propose`, `advance`, `select`)
        self.head_lens, self.used, self.pending = [0] * rows, [0] * rows, [0] * rows
        self.exhausted = [False] * rows  # the row reached `limit`: no more drafts, and no states kept for them

    def tensors(self) -> list[torch.Tensor]:
        """The state updated in place every step (the static step gives them fixed addresses)."""
        return [self.kv.k, self.kv.v, self.kv.lengths, self.pend_aux, self.pend_tok, self.n_pend, self.text,
                self.text_len]

    # ------------------------------------------------------------------------------ after the prefill (eager)
    def start(self, input_ids: torch.Tensor, lefts: list[int], aux: torch.Tensor, first: torch.Tensor) -> None:
        """The prompts' hand-off: each row's text is its prompt (without its left padding) + its first new token
        `first` [rows]; the head reads the prompt's target states `aux` [rows, T, 3H] now (one forward), all but the
        last position, which waits for the first tree's forward. A row whose prompt leaves no room to draft below
        `limit` (a prompt at or past the target's context, or within a token of max_length) is exhausted now: the
        head reads none of its states (its buffers hold positions below `limit` only, and a prompt past the context
        is longer) and the row decodes plainly, as plain `generate` decodes it."""
        rows, t = input_ids.shape
        dev = self.device
        index = (torch.tensor(lefts, device=dev).view(-1, 1) + torch.arange(t, device=dev)).clamp(max=t - 1)
        ids = input_ids.to(dev)
        text = ids.gather(1, index)  # each row's prompt left-aligned (repeats its last token past its length)
        nxt = torch.cat([ids, first.to(dev).view(-1, 1)], dim=1).gather(1, index + 1)  # the token after each
        states = aux.to(dev, self.head.dtype).gather(1, index.unsqueeze(2).expand(-1, -1, aux.shape[2]))
        n = [t - left for left in lefts]
        self.text[:, :t] = text
        self.text.scatter_(1, torch.tensor(n, device=dev).view(-1, 1), first.to(dev).view(-1, 1))
        self.text_len.copy_(torch.tensor(n, device=dev) + 1)
        self.used = [m + 1 for m in n]
        self.exhausted = [self.limit - u - 1 <= 0 for u in self.used]  # `propose`'s rule, at any max_new
        self.pend_aux[:, 0] = states[torch.arange(rows, device=dev), self.text_len - 2]
        self.pend_tok[:, 0] = nxt[torch.arange(rows, device=dev), self.text_len - 2]
        read = [0 if done else m - 1 for m, done in zip(n, self.exhausted)]
        if max(read) > 0:
            self._read(states[:, : max(read)], nxt[:, : max(read)], read)
        self.pending = [0 if done else 1 for done in self.exhausted]
        self.n_pend.copy_(torch.tensor(self.pending, device=dev))

    # ------------------------------------------------------------------------------ device-side (captured)
    def forward(self, depth: int, width: int | None = None, kv_len: int | None = None) -> torch.Tensor:
        """One head forward over every row's pending positions (the first `width` buffer slots; default all) and
        depth - 1 MASK rows: logits [rows, depth, draft vocab]. The pending positions join the head's keys/values.
        A row with none pending drafts from one dummy position, not kept. kv_len: attend to that many slots."""
        aux, tokens = self.pend_aux[:, :width], self.pend_tok[:, :width]
        logits = self.head.draft_rows(aux, tokens, self.n_pend.clamp(min=1), self.kv.k, self.kv.v, self.kv.lengths,
                                      depth, self.modules, kv_len=kv_len)
        self.kv.lengths.add_(self.n_pend)
        self.n_pend.zero_()
        return logits

    def search(self, logits: torch.Tensor, max_depths: torch.Tensor | None = None, depth_bound: int | None = None,
               text_width: int | None = None, fixed_size: bool = False) -> DraftTrees:
        """`build_trees` for every row, rooted at its text's last token: its n-gram context, its prompt-lookup
        continuation (over the first `text_width` text slots; default all), its depth limit."""
        text = self.text[:, :text_width]
        contexts = last_tokens(text, self.text_len, self.context_size)
        lookup = None
        if self.lookup is not None:
            lookup = lookup_continuations(text, logits.shape[1], *self.lookup, used=self.text_len)
        return build_trees(logits, contexts[:, -1], contexts, self.params, ngram=self.ngram,
                           draft_to_target=self.head.draft_to_target, eos_token_ids=self.eos, max_depths=max_depths,
                           depth_bound=depth_bound, lookup=lookup, fixed_size=fixed_size)

    def append(self, aux: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
               keep_states: torch.Tensor | None = None) -> None:
        """Newly verified positions: row r's first lengths[r] of `tokens` [rows, M] join its text, and their target
        states `aux` [rows, M, 3H] with the token after each wait for the head (rows where keep_states is False: the
        text only). Written by scatter after each row's count, all M (what lies past a count is never read)."""
        m, dev = tokens.shape[1], tokens.device
        step = torch.arange(m, device=dev)
        self.text.scatter_(1, self.text_len.view(-1, 1) + step, tokens)
        self.text_len.add_(lengths)
        at = self.n_pend.view(-1, 1) + step
        self.pend_tok.scatter_(1, at, tokens)
        self.pend_aux.scatter_(1, at.unsqueeze(2).expand(-1, -1, aux.shape[2]), aux.to(self.pend_aux.dtype))
        self.n_pend.add_(lengths if keep_states is None else lengths * keep_states)

    # ------------------------------------------------------------------------------ eager (host counts)
    def texts(self, row: int) -> torch.Tensor:
        """Row `row`'s text so far [T]."""
        return self.text[row, : self.used[row]]

    def advance(self, aux: torch.Tensor, tokens: torch.Tensor, lengths: list[int] | None = None) -> None:
        """`append` with the host counts kept: row r's first lengths[r] (default: all M) positions. Rows that draft
        no more keep no states; a row that would overflow its pending slots has the head read them first."""
        m = tokens.shape[1]
        lengths = [m] * len(self.used) if lengths is None else list(lengths)
        if max(self.pending) + m > self.capacity:
            self._read_pending()
        keep = [not e for e in self.exhausted]
        self.append(aux.to(self.device), tokens.to(self.device), torch.tensor(lengths, device=self.device),
                    torch.tensor(keep, device=self.device))
        self.used = [u + n for u, n in zip(self.used, lengths)]
        self.pending = [p + n * k for p, n, k in zip(self.pending, lengths, keep)]

    def propose(self, max_new: list[int], timer: PhaseTimer, node_budget: int | None = None) -> DraftTrees:
        """The draft trees of `node_budget` nodes (default: the budget this drafter was made with), one per row:
        row b's rooted at the last token of its text, at most max_new[b] tokens deep (>= 0), padded to one node
        count. The head drafts only as deep as a tree can reach (`draft_depth`). Budget 0 gives every row its root
        alone: no search, and no head forward until a row has `PENDING_LIMIT` positions waiting (the target's states
        wait for the next tree; a long run of plain steps has the head read them in blocks, so their memory and the
        next tree's catch-up stay bounded)."""
        if node_budget is not None and node_budget != self.params.node_budget:
            self.params = replace(self.params, node_budget=int(node_budget))
        limits = [min(m, self.limit - n - 1) for n, m in zip(self.used, max_new)]
        for b, m in enumerate(limits):
            if m <= 0:  # no room left below max_length / the context: the remaining steps are plain decoding
                self.exhausted[b], self.pending[b] = True, 0
                self.n_pend[b] = 0
        if self.params.node_budget == 0 or all(self.exhausted):
            if max(self.pending) >= PENDING_LIMIT:
                with timer.phase("draft"):
                    self._read_pending()
            return DraftTrees.roots(self.text.gather(1, (self.text_len - 1).view(-1, 1)).view(-1))
        if any(n == 0 for n, done in zip(self.pending, self.exhausted) if not done):
            raise RuntimeError("propose() before advance(): the head has no target states to draft from")
        depth = draft_depth(self.params.node_budget, max(limits), self.head.config.num_predictions)
        with timer.phase("draft"):
            width = max(self.pending)
            kv_len = max(self.head_lens) + width + depth - 1
            self.kv.reserve(kv_len, self.slots)
            logits = self.forward(depth, width, kv_len)
            self._pending_read()
        with timer.phase("tree"):
            return self.search(logits, torch.tensor([max(m, 0) for m in limits], device=self.device),
                               max(max(limits), 0), max(self.used))

    def select(self, keep: list[int]) -> None:
        """Keep only the rows `keep` (indices into the current rows, in order): finished rows leave the batch."""
        index = torch.tensor(keep, device=self.device)
        self.kv.select(index)
        for name in ("pend_aux", "pend_tok", "n_pend", "text", "text_len"):
            setattr(self, name, getattr(self, name)[index])
        self.head_lens, self.used, self.pending, self.exhausted = (
            [v[i] for i in keep] for v in (self.head_lens, self.used, self.pending, self.exhausted))

    def _read(self, aux: torch.Tensor, tokens: torch.Tensor, counts: list[int]) -> None:
        """The head reads positions into its keys/values now: row r's first counts[r] of `aux` / `tokens` (one
        forward; its one prediction is not used)."""
        width = aux.shape[1]
        kv_len = max(self.head_lens) + width
        self.kv.reserve(kv_len, self.slots)
        real = torch.tensor([max(c, 1) for c in counts], device=self.device)
        self.head.draft_rows(aux, tokens, real, self.kv.k, self.kv.v, self.kv.lengths, 1, self.modules, kv_len=kv_len)
        self.kv.lengths.add_(torch.tensor(counts, device=self.device))
        self.head_lens = [h + c for h, c in zip(self.head_lens, counts)]

    def _read_pending(self) -> None:
        """The head reads every waiting position now (a long run of plain steps; a hand-off larger than the slots)."""
        width = max(self.pending)
        if width:
            self._read(self.pend_aux[:, :width], self.pend_tok[:, :width], self.pending)
        self.n_pend.zero_()
        self.pending = [0] * len(self.pending)

    def _pending_read(self) -> None:
        """After `forward`: its pending positions are the head's now (host counts)."""
        self.head_lens = [h + p for h, p in zip(self.head_lens, self.pending)]
        self.pending = [0] * len(self.pending)
