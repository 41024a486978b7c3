"""Choosing which draft tokens the target accepts (docs/DART_SPEC.md §4). Both rules are lossless; `StepAcceptance`
is the call's choice between them, the one acceptance both step backends run.

- `accept_greedy_batch`: no logits processors, greedy. Vectorised over every row's whole tree: a node is accepted
  when its token equals the target's argmax at every ancestor; the deepest accepted node ends the path.
- `accept_walk`: the general rule, for sampling and for greedy with processors (repetition penalty,
  min-length, ...). It walks from the root and applies the user's processors at each visited node with that
  node's exact context, as plain `generate` would. At each node it picks the target's own next token x exactly
  as plain `generate` does (argmax, or softmax + one `torch.multinomial` draw); when a child carries x the walk
  descends, else x is the bonus token and the step ends.

Why this sampling rule: it is ancestral sampling from the target, so every token is distributed exactly as the
target's processed distribution whatever the tree; a drafted child is accepted with probability p(child), the
same as the spec's child-by-child rejection walk; and it draws one multinomial per emitted token, like plain
`generate`. The random stream therefore no longer depends on the tree (its size, the node budget, the head): the
same seed and inputs give the same text on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from .rows import RowProcessor, Rows, RowStreams
from .tree import DraftTree, DraftTrees


@dataclass
class Accepted:
    """The accepted path (tree node indices, root first), the new tokens (path tokens after the root, then the
    bonus token) and, when asked for, the processed scores / raw logits that produced each new token."""

    path: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def _next_token(processed: torch.Tensor, do_sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token after scores `processed` [1, vocab], chosen as `GenerationMixin._sample` chooses it."""
    if not do_sample:
        return processed.argmax(dim=-1)
    return torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1, generator=generator).squeeze(1)


def accept_walk(
    tree: DraftTree,
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Walk the tree applying `logits_processor` with each visited node's own context (input_ids + path).
    One host sync per visited node (does a child carry the chosen token?)."""
    tokens, parents = tree.tokens, tree.parents
    is_child = torch.ones_like(parents, dtype=torch.bool)
    is_child[0] = False
    node, path, new_tokens, scores = 0, [0], [], []
    while True:
        context = torch.cat([input_ids, tokens[path[1:]].unsqueeze(0).to(input_ids.device)], dim=1)
        processed = logits_processor(context, logits[node : node + 1].clone())
        scores.append(processed[0])
        chosen = _next_token(processed, do_sample, generator)
        new_tokens.append(chosen)
        hit = ((parents == node) & is_child & (tokens == chosen)).nonzero()
        if not hit.numel():
            break
        node = int(hit[0, 0])
        path.append(node)
    path_t = torch.tensor(path, device=logits.device)
    return Accepted(
        path=path_t,
        tokens=torch.cat(new_tokens).to(logits.device),
        scores=torch.stack(scores),
        logits=logits[path_t],
    )


@dataclass
class BatchAccepted:
    """One step's acceptance for every row of a `DraftTrees`: paths [rows, M] (tree node indices, root first; past a
    row's own length the last node repeats), lengths [rows] (path length = new tokens of the row), tokens [rows, M]
    (the new tokens, the first lengths[r] of row r real) and, when asked for, the scores / logits rows [rows, M, V]."""

    paths: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @classmethod
    def from_rows(cls, rows: list[Accepted]) -> "BatchAccepted":
        """Pad per-row results (the walk's) to one [rows, M] layout."""
        lengths = torch.tensor([r.path.numel() for r in rows], device=rows[0].path.device)
        m = int(lengths.max())
        pad = lambda t: torch.cat([t, t[-1:].expand(m - t.shape[0], *t.shape[1:])]) if t.shape[0] < m else t
        stack = lambda ts: torch.stack([pad(t) for t in ts])
        scores = stack([r.scores for r in rows]) if rows[0].scores is not None else None
        logits = stack([r.logits for r in rows]) if rows[0].logits is not None else None
        return cls(stack([r.path for r in rows]), lengths, stack([r.tokens for r in rows]), scores, logits)


def greedy_paths(trees: DraftTrees, predicted: torch.Tensor, m: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(paths [rows, m]: node indices root first, the deepest node repeated past a path's end; lengths [rows]) of
    each row's deepest draft whose every token is `predicted` [rows, N] (the target's greedy token after each node)
    at its parent; padding nodes are never accepted. m: path slots (the compiled step's fixed M; default: the
    longest path, one host read)."""
    n = trees.width
    matches = (trees.tokens == predicted.gather(1, trees.parents)) & trees.real
    matches[:, 0] = True
    accepted = ~(trees.ancestor_mask & ~matches.unsqueeze(1)).any(dim=2)
    deepest = torch.where(accepted, trees.depths, -1).argmax(dim=1)  # [rows]
    on_path = trees.ancestor_mask.gather(1, deepest.view(-1, 1, 1).expand(-1, 1, n)).squeeze(1)
    lengths = trees.depths.gather(1, deepest.unsqueeze(1)).squeeze(1) + 1
    idx = torch.arange(n, device=on_path.device).expand_as(on_path)
    m = int(lengths.max()) if m is None else m
    order = torch.sort(torch.where(on_path, idx, n + idx), dim=1).values[:, :m]  # the path's nodes, ascending
    return torch.where(order < n, order, deepest.unsqueeze(1)), lengths


def accept_greedy_batch(trees: DraftTrees, logits: torch.Tensor, keep_scores: bool = False) -> BatchAccepted:
    """Greedy acceptance for every row at once (logits [rows, N, V]): `greedy_paths` of the target's argmax at every
    node. One host sync (the longest path)."""
    predicted = logits.argmax(dim=-1)  # [rows, N]
    paths, lengths = greedy_paths(trees, predicted)
    # greedy: the token after path node j is the target's argmax there (the next path node's token, or the bonus)
    tokens = predicted.gather(1, paths)
    rows = logits.gather(1, paths.unsqueeze(2).expand(-1, -1, logits.shape[2])) if keep_scores else None
    return BatchAccepted(paths, lengths, tokens, rows, rows)


class StepAcceptance:
    """The acceptance of a call's steps, for the eager and the static step alike: greedy without processors
    (`accept_greedy_batch`, vectorised over rows), else the walk per row with the call's processors, each row seeing
    itself as plain `generate` shows it (`RowProcessor`); a sampled batch draws each row from its own stream
    (`RowStreams`), so its text does not depend on the trees the budget picks."""

    def __init__(self, logits_processor: LogitsProcessorList, do_sample: bool, rows: Rows, keep_scores: bool,
                 device: torch.device):
        self.processors, self.do_sample, self.rows, self.keep_scores = logits_processor, do_sample, rows, keep_scores
        self.greedy = not do_sample and len(logits_processor) == 0
        self.streams = RowStreams(len(rows), device) if do_sample and len(rows) > 1 else None

    def __call__(self, trees: DraftTrees, logits: torch.Tensor, active: list[int]) -> BatchAccepted:
        """The accepted paths of `trees` (rows: the caller's rows `active`) under the target's `logits` [rows, N, V]."""
        if self.greedy:
            return accept_greedy_batch(trees, logits, self.keep_scores)
        rows = self.rows
        return BatchAccepted.from_rows([
            accept_walk(trees.trees[i], logits[i, : trees.trees[i].size], rows.seqs[b].unsqueeze(0),
                        RowProcessor(self.processors, b, len(rows)), self.do_sample,
                        self.streams.get(b, logits.device) if self.streams else None)
            for i, b in enumerate(active)
        ])
