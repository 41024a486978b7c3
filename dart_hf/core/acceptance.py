"""Choosing which draft tokens the target accepts (docs/DART_SPEC.md §4). Every rule is lossless, and one
`StepAcceptance` per call picks among them for both step backends:

- `accept_nodes`: greedy without logits processors, and sampling (or greedy) with processors that read the scores
  alone, where the trees have no more nodes than path slots. Vectorised over every row's whole tree: the target's
  token after every node at once (the argmax, or a draw at the node's position), then a node is accepted when its
  token is the one chosen at its parent, all the way up; the deepest accepted node ends the path.
- `accept_depthwise`: sampling, or greedy with the processors `generate` builds from a generation config
  (temperature, top-k, top-p, min-p, repetition penalty: `DEVICE_PROCESSORS`), where `accept_nodes` does not serve
  (a repetition penalty reads the path; a tree wider than its depth would cost more vocabulary-sized work at every
  node than at the path's). On the device, for every row at once:
  one pass per depth applies the processors to the logits of the node each row stands on, with that node's own
  context, picks the target's token there (`next_tokens`) and descends to the child that carries it. Fixed shapes,
  no host read: the static step captures it inside its graph.
- `accept_walk`: any other processor (custom ones, SynthID, ...). The same rule, one row at a time, with the row as
  plain `generate` shows it (`RowProcessor`): one host read per visited node.

Sampling: at each visited node the target's token is drawn from its processed distribution, and the walk descends
when a child carries it (ancestral sampling from the target: every token follows the target's distribution
exactly whatever the tree; a drafted child is accepted with probability p(child), as the spec's child-by-child
rejection walk). The draw inverts the distribution's cumulative sum at a uniform that is a function of (the row's
seed, the token's position in the row) (`sampling_uniform`): the token at a position does not depend on the tree,
the node budget, the backend or which pass drew it, so a seed gives the same text at every budget (0: plain
decoding), eagerly or compiled. A call draws its rows' seeds from torch's generator once, before the prefill
(`StepAcceptance.start`); plain `generate` draws one `torch.multinomial` per token instead, so the same seed gives
another (equally distributed) text than plain `generate`, and leaves torch's generator elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .rows import RowProcessor, Rows
from .tree import DraftTree, DraftTrees

# the processors `accept_depthwise` runs on a batch of nodes as plain `generate` runs them on a row: each depends on
# the scores alone, or (repetition penalty) on the set of tokens of the row, where the batch layout cannot matter
DEVICE_PROCESSORS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper,
                     RepetitionPenaltyLogitsProcessor)
_U32 = 0xFFFFFFFF


@dataclass
class Accepted:
    """The accepted path (tree node indices, root first), the new tokens (path tokens after the root, then the
    bonus token) and, when asked for, the processed scores / raw logits that produced each new token."""

    path: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply rounds) on int64 tensors holding values below 2**32: both multipliers
    are below 2**31, so no product overflows int64 on any device or compiler."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _U32
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & _U32
    return h ^ (h >> 16)


def sampling_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The uniform [rows] on (0, 1) that draws the token at `positions` [rows] of rows seeded `seeds` [rows]: a hash of
    (seed, position) at 23 bits, so that u * total stays below any float32 total (`next_tokens`). The position is
    mixed before it meets the seed, then the two together: with one round over (seed ^ position) some pairs of a
    row's positions correlate at ~0.015 over a million seeds, and seeds s and s ^ p ^ q share the draws of positions
    p and q; this way no pair correlates beyond chance. Being a function of the position, not of a generator's
    state, it is the same whichever pass, tree or backend draws that token, and the static step captures it."""
    key = _mix((seeds ^ _mix(positions)) & _U32)
    return ((key >> 9).float() + 0.5) * 2.0**-23


def next_tokens(processed: torch.Tensor, seeds: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    """The target's tokens [rows] after processed scores [rows, vocab]: the argmax (greedy: seeds None, as
    `GenerationMixin._sample`), or a draw from softmax(processed): the first entry whose cumulative probability
    exceeds `sampling_uniform` times the total. Each token's share of (0, 1) is its probability up to the float32
    rounding of the running sum (~1e-7), which torch rounds once per prefix rather than per addition (a tail of
    50,000 tokens of 2.5e-8 each after one likely token keeps its 1.25e-3, eager and compiled on CPU); a masked token
    (probability 0) adds nothing to the sum and is never drawn. Four vocabulary-sized ops: one kernel each on an
    eager GPU (Gumbel-max needs a hashed noise entry per token)."""
    if seeds is None:
        return processed.argmax(dim=-1)
    cumulative = processed.float().softmax(dim=-1).cumsum(dim=-1)
    threshold = sampling_uniform(seeds, positions).unsqueeze(1) * cumulative[:, -1:]
    return (cumulative <= threshold).sum(dim=-1)


def accept_walk(
    tree: DraftTree,
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    seed: torch.Tensor | None,
    position: int,
) -> Accepted:
    """Walk the tree applying `logits_processor` with each visited node's own context (input_ids + path), choosing
    the target's token with `next_tokens` (seed [1], or None: greedy; `position`: the root's next token's index in
    the row's text). One host sync per visited node (does a child carry the chosen token?)."""
    tokens, parents = tree.tokens, tree.parents
    is_child = torch.ones_like(parents, dtype=torch.bool)
    is_child[0] = False
    node, path, new_tokens, scores = 0, [0], [], []
    while True:
        context = torch.cat([input_ids, tokens[path[1:]].unsqueeze(0).to(input_ids.device)], dim=1)
        processed = logits_processor(context, logits[node : node + 1].clone())
        scores.append(processed[0])
        chosen = next_tokens(processed, seed, torch.full_like(tokens[:1], position + len(new_tokens)))
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


def accept_depthwise(trees: DraftTrees, logits: torch.Tensor, m: int, processors: LogitsProcessorList,
                     context: torch.Tensor | None, seeds: torch.Tensor | None, positions: torch.Tensor,
                     keep_scores: bool = False) -> "BatchAccepted":
    """The walk for every row at once, on the device (logits [rows, N, V], m: path slots, at least the trees' depth
    + 1): at depth d each row's current node gets the processors (`context` [rows, C]: the row's tokens, padded with
    V; the path so far is appended), the target's token (`next_tokens` at `positions` + d) and the child carrying it,
    if any. Past a row's path its last node repeats (the work of a depth no row reaches is spent anyway: fixed
    shapes, no host read)."""
    rows, n, vocab = logits.shape
    child = trees.real & (torch.arange(n, device=logits.device) > 0)
    node = torch.zeros(rows, dtype=torch.long, device=logits.device)
    going = torch.ones(rows, dtype=torch.bool, device=logits.device)
    lengths = torch.zeros_like(node)
    paths, tokens, scores, raw = [], [], [], []
    for d in range(m):
        row_logits = logits.gather(1, node.view(-1, 1, 1).expand(-1, 1, vocab)).squeeze(1)
        processed = row_logits
        if len(processors):
            ids = positions.view(-1, 1)[:, :0] if context is None else torch.cat([context, *tokens], dim=1)
            processed = processors(ids, row_logits.clone())
        chosen = next_tokens(processed, seeds, positions + d)
        paths.append(node)
        tokens.append(chosen.unsqueeze(1))
        lengths = lengths + going
        if keep_scores:
            scores.append(processed)
            raw.append(row_logits)
        if d == m - 1:  # no depth after this one to descend to
            break
        hit = child & (trees.parents == node.unsqueeze(1)) & (trees.tokens == chosen.unsqueeze(1))
        going = going & hit.any(dim=1)
        node = torch.where(going, hit.long().argmax(dim=1), node)
    stack = lambda ts: torch.stack(ts, dim=1) if keep_scores else None
    return BatchAccepted(torch.stack(paths, dim=1), lengths, torch.cat(tokens, dim=1), stack(scores), stack(raw))


@dataclass
class BatchAccepted:
    """One step's acceptance for every row of a `DraftTrees`: paths [rows, M] (tree node indices, root first; past a
    row's own length the last node repeats), lengths [rows] (path length = new tokens of the row), tokens [rows, M]
    (the new tokens, the first lengths[r] of row r real) and, when asked for, the scores / logits rows [rows, M, V].
    The static step reads its paths' score ranks (`DraftTrees.ranks`) with its result: `ranks` [rows, M - 1], host."""

    paths: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    ranks: torch.Tensor | None = None

    def trimmed(self, m: int) -> "BatchAccepted":
        """The first m path slots of every row (m >= every row's length: nothing real is cut)."""
        cut = lambda t: None if t is None else t[:, :m]
        return BatchAccepted(self.paths[:, :m], self.lengths, self.tokens[:, :m], cut(self.scores), cut(self.logits))

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
    if n == 1:  # every tree its root alone (a plain step): each path is the root
        zeros = torch.zeros(predicted.shape[0], m or 1, dtype=torch.long, device=predicted.device)
        return zeros, zeros[:, 0] + 1
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


def accept_nodes(trees: DraftTrees, logits: torch.Tensor, m: int | None = None,
                 processors: LogitsProcessorList | tuple = (), seeds: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, keep_scores: bool = False) -> BatchAccepted:
    """The target's token after EVERY node at once, then each row's deepest draft whose every token is the one chosen
    at its parent (`greedy_paths`), in m path slots (default: the longest path, one host read). logits [rows, N, V].
    Greedy without processors: the argmax at every node. Otherwise `processors` that read the scores alone (not a
    repetition penalty) and `next_tokens` at the node's position (`positions` [rows]: each row's next one, + the
    node's depth): a node's token depends on nothing but its own logits and position, so this is the device walk's
    result (`accept_depthwise`), drawn in ONE pass over the rows' N nodes instead of M passes of one node each."""
    rows, n, vocab = logits.shape
    flat = logits.reshape(rows * n, vocab)
    processed = processors(flat.new_zeros(rows * n, 0, dtype=torch.long), flat.clone()) if len(processors) else flat
    if seeds is None:  # greedy: the argmax, no position needed
        chosen = next_tokens(processed, None, positions).view(rows, n)
    else:
        node_positions = (positions.view(-1, 1) + trees.depths).reshape(-1)
        chosen = next_tokens(processed, seeds.view(-1, 1).expand(rows, n).reshape(-1), node_positions).view(rows, n)
    paths, lengths = greedy_paths(trees, chosen, m)
    # the token after path node j is the one chosen there (the next path node's token, or the bonus)
    pick = lambda t: t.view(rows, n, vocab).gather(1, paths.unsqueeze(2).expand(-1, -1, vocab)) if keep_scores else None
    raw = pick(flat)
    return BatchAccepted(paths, lengths, chosen.gather(1, paths), raw if processed is flat else pick(processed), raw)


def runs_on_device(processors: LogitsProcessorList, lefts: list[int]) -> bool:
    """Whether `accept_depthwise` runs these processors exactly: all of `DEVICE_PROCESSORS`, a repetition penalty
    only ignoring what `generate` makes it ignore (each row's left padding, or nothing)."""
    for p in processors:
        if not isinstance(p, DEVICE_PROCESSORS):
            return False
        ignore = getattr(p, "prompt_ignore_length", None)
        if ignore is not None and (isinstance(ignore, int) or ignore.tolist() != lefts):
            return False
    return True


class StepAcceptance:
    """The acceptance of a call's steps, for the eager and the static step alike (`mode`): "greedy" without
    processors (`accept_nodes`), "device" for sampling and the config's processors (`accept_nodes` or
    `accept_depthwise`: `on_device`), else
    "walk" (`accept_walk` per row, each row seeing itself as plain `generate` shows it: `RowProcessor`). Sampling draws
    with the rows' seeds (`start`), so a row's text does not depend on the trees the budget picks."""

    def __init__(self, logits_processor: LogitsProcessorList, do_sample: bool, rows: Rows, keep_scores: bool,
                 device: torch.device):
        self.processors, self.do_sample, self.rows, self.keep_scores = logits_processor, do_sample, rows, keep_scores
        self.device = device
        if not do_sample and len(logits_processor) == 0:
            self.mode = "greedy"
        else:
            self.mode = "device" if runs_on_device(logits_processor, rows.lefts) else "walk"
        self.greedy = self.mode == "greedy"
        self.needs_context = any(isinstance(p, RepetitionPenaltyLogitsProcessor) for p in logits_processor)
        # on the device a row's context is its text without padding: a repetition penalty has nothing to ignore
        self.device_processors = LogitsProcessorList([
            RepetitionPenaltyLogitsProcessor(p.penalty) if isinstance(p, RepetitionPenaltyLogitsProcessor) else p
            for p in logits_processor]) if self.mode == "device" else logits_processor
        self.seeds: torch.Tensor | None = None

    @property
    def vectorised(self) -> bool:
        """Whether every step's acceptance runs on the device (`on_device`: no host read, capturable), not the walk."""
        return self.mode != "walk" and not self.keep_scores

    def start(self) -> None:
        """Before the prefill: one seed per row from torch's generator of the target's device (where plain sampling
        draws: `torch.manual_seed` decides them; tensor-parallel ranks check it is the same on each)."""
        if self.do_sample:
            self.seeds = torch.randint(0, 2**31 - 1, (len(self.rows),), device=self.device)

    def first(self, input_ids: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill's choice of each row's first token: (processed scores [rows, V], tokens [rows])."""
        processed = self.processors(input_ids, logits.clone())
        positions = torch.tensor([input_ids.shape[1] - left for left in self.rows.lefts], device=logits.device)
        return processed, next_tokens(processed, self.seeds, positions)

    def __call__(self, trees: DraftTrees, logits: torch.Tensor, active: list[int], text: torch.Tensor,
                 text_len: torch.Tensor, m: int) -> BatchAccepted:
        """The accepted paths of `trees` (rows: the caller's rows `active`, whose texts are `text` [rows, T] up to
        `text_len` [rows]) under the target's `logits` [rows, N, V]; m: path slots (trees' depth + 1)."""
        seeds = None if self.seeds is None else self.seeds[torch.tensor(active, device=self.seeds.device)]
        if self.mode != "walk":
            return self.on_device(trees, logits, text, text_len, m, seeds)
        rows = self.rows
        return BatchAccepted.from_rows([
            accept_walk(trees.trees[i], logits[i, : trees.trees[i].size], rows.seqs[b].unsqueeze(0),
                        RowProcessor(self.processors, b, len(rows)), None if seeds is None else seeds[i : i + 1],
                        rows.length(b) - rows.lefts[b])
            for i, b in enumerate(active)
        ])

    def on_device(self, trees: DraftTrees, logits: torch.Tensor, text: torch.Tensor, text_len: torch.Tensor, m: int,
                  seeds: torch.Tensor | None) -> BatchAccepted:
        """The acceptance in m path slots without a host read, at each row's next position: `accept_nodes` for greedy
        and for processors that read the scores alone on trees of at most m nodes (every tree up to the head's K + 1
        nodes: its depth, and so m - 1, is its node budget), one pass over every node; else `accept_depthwise`, with
        the rows' texts as the processors' context (a repetition penalty's token set: the row without its padding,
        which `generate` makes it ignore), one pass per depth over the node each row stands on."""
        if self.greedy or (not self.needs_context and trees.width <= m):
            return accept_nodes(trees, logits, m, self.device_processors, seeds, text_len, self.keep_scores)
        context = None
        if self.needs_context:
            written = torch.arange(text.shape[1], device=text.device) < text_len.unsqueeze(1)
            context = torch.where(written, text, logits.shape[-1])
        return accept_depthwise(trees, logits, m, self.device_processors, context, seeds, text_len, self.keep_scores)
