"""Draft tree construction: beam search over the head's K+1 distributions, rescored by an n-gram model.

This follows the reference search (`Searcher::search` of the DART release, docs/DART_SPEC.md §3) step by step, in
float32 as it does. With p_d(x) the softmax over the head's top-k logits at depth d, extending a partial draft s by
token x at depth d adds
    level_w(d) * (log(p_d(x) + 1e-10) * logit_w(d) + log(P_ngram(x | last n-1 tokens of text + s) + 1e-10) * ngram_w)
with level_w(d) = (d+1)^-level_decay, logit_w(d) = logit_decay^d, and no n-gram term at d = 0. The next beams are the
`beam_width` best extensions, drafts ending in EOS ranked after all others (they are extended only when there are
not enough other drafts). Every scored extension goes into a pool; the best `node_budget` of the pool (plus the
root) form the tree. Ties are broken by pool order (depth, then beam rank, then top-k rank), i.e. by stable sorts:
the reference's `std::sort` leaves ties unspecified, and a stable order is the one that keeps the tree closed.

With a prompt-lookup continuation c_1..c_L (`dart_hf.core.prompt_lookup`, beyond the reference), the beam that
holds c_1..c_d gets c_{d+1} as one more candidate at depth d+1, whose term is logit_w(d) * `lookup_logp` (no
n-gram term); when the head already proposes that token there, the candidate keeps the better of the two terms.

`search="best_first"` (beyond the reference, as DDTree / CAST): the tree is the `node_budget` drafts with the highest
path scores, where a depth adds log p_d(x) with p_d the head's softmax over its whole (draft) vocabulary, plus the
same n-gram and lookup terms, with no level or logit decays. It is the same search with `beam_width = node_budget`:
a draft among the best B overall has an ancestor at every depth that is among that depth's best B (a worse
ancestor would be outranked by B nodes, and so would its descendants), so a B-wide beam drops none of them.

Everything is batched torch over (beams x top-k) per depth: the only Python loop is over depths (K+1).
Every term is <= 0, so scores never increase along a path and a parent precedes its children in pool order:
the chosen set is closed under ancestors, which the tests assert (`check_closed` in tests/conftest.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .configuration import DartConfig
from .ngram import NGramModel

LOG_EPS = 1e-10  # inside every log, as the reference: a probability of 0 scores log(1e-10), not -inf


@dataclass
class TreeSearchParams:
    """Tree search settings; the defaults are DartConfig's (the reference values), stated there once."""

    search: str = DartConfig.tree_search
    top_k: int = DartConfig.tree_top_k
    beam_width: int = DartConfig.beam_width
    node_budget: int = DartConfig.node_budget
    level_decay: float = DartConfig.level_decay
    logit_decay: float = DartConfig.logit_decay
    ngram_weight: float = DartConfig.ngram_weight
    lookup_logp: float = DartConfig.lookup_logp

    @classmethod
    def from_config(cls, config, node_budget: int | None = None) -> "TreeSearchParams":
        """The config's search settings; `node_budget` overrides the config's (needed when that is None: the
        cost-aware budget, chosen per step by `dart_hf.core.budget`)."""
        node_budget = config.node_budget if node_budget is None else node_budget
        if node_budget is None:
            raise ValueError("node_budget=None (cost-aware) in the config: pass the tree's node budget explicitly")
        return cls(
            search=config.tree_search,
            top_k=config.tree_top_k,
            beam_width=config.beam_width,
            node_budget=node_budget,
            level_decay=config.level_decay,
            logit_decay=config.logit_decay,
            ngram_weight=config.ngram_weight,
            lookup_logp=config.lookup_logp,
        )


@dataclass
class DraftTree:
    """A draft tree in verification order (parents before children; node 0 is the root).

    tokens [N] target token ids; parents [N] (root's parent is 0); depths [N] (root 0);
    ancestor_mask [N, N]: mask[i, j] is True when j is i or an ancestor of i; scores [N] beam-search scores
    (root 0). All on one device.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    scores: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def to(self, device: torch.device) -> "DraftTree":
        if self.tokens.device == torch.device(device):
            return self
        return DraftTree(
            *(t.to(device) for t in (self.tokens, self.parents, self.depths, self.ancestor_mask, self.scores))
        )

    def best_chain(self) -> torch.Tensor:
        """Node indices (root first) of the best-scoring draft among the deepest ones: the tree as a chain."""
        deepest = torch.where(self.depths == self.depths.max(), self.scores, float("-inf")).argmax()
        return self.ancestor_mask[deepest].nonzero().squeeze(1)


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[N, N] self-or-ancestor mask by pointer jumping up `max_depth` levels (no per-node loop)."""
    return ancestor_masks(parents.unsqueeze(0), max_depth)[0]


def ancestor_masks(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """`ancestor_mask` of every row of `parents` [B, N]: [B, N, N]."""
    b, n = parents.shape
    cur = torch.arange(n, device=parents.device).expand(b, n)
    mask = torch.zeros(b, n, n, dtype=torch.bool, device=parents.device)
    mask.scatter_(2, cur.unsqueeze(2), True)
    for _ in range(max_depth):
        cur = parents.gather(1, cur)
        mask.scatter_(2, cur.unsqueeze(2), True)
    return mask


def _add_lookup_candidate(
    logp: torch.Tensor,
    cand: torch.Tensor,
    lookup: tuple[torch.Tensor, torch.Tensor],
    d: int,
    on_lookup: torch.Tensor,
    lookup_term: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append one candidate column [rows, beams, k+1]: the lookup token c_{d+1} of each row (lookup: tokens and valid
    [rows, >= D]), with term `lookup_term`, for the beam on the lookup path; -inf (never chosen) elsewhere or where
    the head already proposes it (that entry keeps the better term)."""
    tokens, valid = lookup
    token = tokens[:, d].view(-1, 1, 1).expand(-1, cand.shape[1], 1)
    on = (on_lookup & valid[:, d : d + 1]).unsqueeze(2)
    lookup_logp = torch.full_like(logp[..., :1], lookup_term)
    same = (cand == token) & on
    logp = torch.where(same, torch.maximum(logp, lookup_logp), logp)
    extra = lookup_logp.masked_fill(~on | same.any(dim=2, keepdim=True), float("-inf"))
    return torch.cat([logp, extra], dim=2), torch.cat([cand, token], dim=2)


def _ranked(scores: torch.Tensor, is_eos: torch.Tensor | None) -> torch.Tensor:
    """Per row of `scores` [rows, n]: indices best first, ties in index order; EOS entries after all others, -inf
    entries last."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    group = torch.zeros_like(scores, dtype=torch.long) if is_eos is None else is_eos.long()
    group = torch.where(torch.isfinite(scores), group, 2)
    return order.gather(1, torch.sort(group.gather(1, order), dim=1, stable=True).indices)


def last_tokens(texts: torch.Tensor, used: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count]: the last `count` tokens of each row's text (row b: the first used[b] of texts[b]), -1 before it
    starts: the n-gram context of a tree search."""
    tail = used.view(-1, 1) - count + torch.arange(count, device=texts.device)
    return torch.where(tail >= 0, texts.gather(1, tail.clamp(min=0)), -1)


def build_tree(
    draft_logits: torch.Tensor,
    root_token: torch.Tensor,
    context: torch.Tensor,
    params: TreeSearchParams,
    ngram: NGramModel | None = None,
    draft_to_target: torch.Tensor | None = None,
    eos_token_ids: torch.Tensor | None = None,
    max_depth: int | None = None,
    lookup: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> DraftTree:
    """Beam-search a draft tree: `build_trees` for one row.

    draft_logits [D, Vd]: row d scores the token at tree depth d+1. root_token: 0-d tensor (the bonus
    token, last accepted). context [c]: the accepted tokens ending with the root (for the n-gram; only the
    last `ngram.context_size` are read). draft_to_target maps draft-vocab ids to target ids (None: identity).
    max_depth caps the depth (so no node lies past max_new_tokens). lookup: (tokens [>= D], valid [>= D]) from
    `dart_hf.core.prompt_lookup.lookup_continuation`, or None.
    """
    hist_len = max(ngram.context_size if ngram is not None else 0, 1)
    text = context.to(device=draft_logits.device, dtype=torch.long).view(1, -1)
    ctx = last_tokens(text, torch.tensor([text.shape[1]], device=text.device), hist_len)[0]
    depths = None if max_depth is None else torch.tensor([max_depth], device=draft_logits.device)
    trees = build_trees(
        draft_logits.unsqueeze(0), root_token.view(1), ctx.unsqueeze(0), params, ngram=ngram,
        draft_to_target=draft_to_target, eos_token_ids=eos_token_ids, max_depths=depths,
        depth_bound=max_depth, lookup=None if lookup is None else (lookup[0][None], lookup[1][None]),
    )
    return trees.row(0)


@dataclass
class DraftTrees:
    """One draft tree per row, padded to one node count N so that ONE target forward verifies them all (`DraftTree`
    fields with a leading row dimension): row r's tree is nodes [0, sizes[r]). A padding node has the row's root
    token, parent 0, depth 0, itself alone as ancestor (its attention row is never empty) and score -inf: no real
    node sees it, it is never accepted (`real`), and its cache entry goes with the rest of the tree. `sizes` [rows]
    is on the device; `trees` reads it (a host sync) only when asked."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    scores: torch.Tensor
    sizes: torch.Tensor
    depth: int = 0  # no node is deeper (known on the host: a walk over the trees has depth + 1 passes)

    @property
    def width(self) -> int:
        """N: nodes per row after padding."""
        return self.tokens.shape[1]

    @property
    def real(self) -> torch.Tensor:
        """[rows, N]: True for a row's own nodes, False for its padding."""
        return torch.arange(self.width, device=self.tokens.device) < self.sizes.unsqueeze(1)

    def row(self, r: int, size: int | None = None) -> DraftTree:
        """Row r's own tree (its first `size` nodes; default: its size)."""
        n = int(self.sizes[r]) if size is None else size
        return DraftTree(self.tokens[r, :n], self.parents[r, :n], self.depths[r, :n],
                         self.ancestor_mask[r, :n, :n], self.scores[r, :n])

    def ranks(self, paths: torch.Tensor) -> torch.Tensor:
        """[rows, M - 1]: the score rank (0 = the best non-root node) of each node of `paths` [rows, M] after its root,
        on the device (what the cost-aware budget learns acceptance from: `dart_hf.core.budget`). Padding nodes score
        -inf, so they outrank nothing."""
        on_path = self.scores.gather(1, paths[:, 1:].to(self.scores.device))
        return (self.scores[:, None, 1:] > on_path[:, :, None]).sum(dim=2)

    @functools.cached_property
    def trees(self) -> list[DraftTree]:
        """Every row's own tree (the sampling walk and the budget statistics read them): one read of the sizes."""
        return [self.row(r, n) for r, n in enumerate(self.sizes.tolist())]

    def to(self, device: torch.device) -> "DraftTrees":
        if self.tokens.device == torch.device(device):
            return self
        return DraftTrees(*(t.to(device) for t in (self.tokens, self.parents, self.depths, self.ancestor_mask,
                                                    self.scores, self.sizes)), depth=self.depth)

    @classmethod
    def roots(cls, tokens: torch.Tensor) -> "DraftTrees":
        """The trees of budget 0, one per root token in `tokens` [rows]: each root alone (verifying them is one plain
        decoding step)."""
        rows, device = tokens.numel(), tokens.device
        zeros = torch.zeros(rows, 1, dtype=torch.long, device=device)
        return cls(tokens.view(rows, 1).long(), zeros, zeros, torch.ones(rows, 1, 1, dtype=torch.bool, device=device),
                   torch.zeros(rows, 1, device=device), torch.ones(rows, dtype=torch.long, device=device))

    @classmethod
    def stack(cls, trees: list[DraftTree]) -> "DraftTrees":
        """Trees made one by one, padded to the largest one's node count (on the first tree's device)."""
        device, n, rows = trees[0].tokens.device, max(t.size for t in trees), len(trees)
        out = cls(torch.zeros(rows, n, dtype=torch.long, device=device),
                  torch.zeros(rows, n, dtype=torch.long, device=device),
                  torch.zeros(rows, n, dtype=torch.long, device=device),
                  torch.eye(n, dtype=torch.bool, device=device).repeat(rows, 1, 1),
                  torch.full((rows, n), float("-inf"), device=device),
                  torch.tensor([t.size for t in trees], device=device))
        for r, t in enumerate(trees):  # one slice copy per row and field (not per node)
            t, s = t.to(device), t.size
            out.tokens[r, :s], out.parents[r, :s], out.depths[r, :s], out.scores[r, :s] = (
                t.tokens, t.parents, t.depths, t.scores)
            out.tokens[r, s:] = t.tokens[0]
            out.ancestor_mask[r, :s, :s] = t.ancestor_mask
        out.depth = max(int(t.depths.max()) for t in trees)  # trees made one by one live on the host
        return out


def build_trees(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    contexts: torch.Tensor,
    params: TreeSearchParams,
    ngram: NGramModel | None = None,
    draft_to_target: torch.Tensor | None = None,
    eos_token_ids: torch.Tensor | None = None,
    max_depths: torch.Tensor | None = None,
    depth_bound: int | None = None,
    lookup: tuple[torch.Tensor, torch.Tensor] | None = None,
    fixed_size: bool = False,
) -> DraftTrees:
    """Beam-search one draft tree per row, all rows at once (module docstring; each row's tree is the one the search
    gives that row alone).

    draft_logits [B, D, Vd]; root_tokens [B]; contexts [B, c]: the last c = max(n-gram context, 1) tokens of each
    row's text, the root last (-1: before the text). max_depths [B] (or None): no node of row r deeper than
    max_depths[r] (a row at 0 gets its root alone); depth_bound: a Python int >= every max_depths entry, if known
    (the search runs no deeper; default: D). lookup: (tokens [B, >= D], valid [B, >= D]) or None. fixed_size: every
    row gets node_budget + 1 nodes (the compiled step's static shapes: a pool with fewer real candidates than the
    budget is filled from its -inf entries, which verifying checks like any other); otherwise rows have their own
    sizes, padded to the largest.
    """
    device = draft_logits.device
    rows, depth_rows = draft_logits.shape[0], draft_logits.shape[1]
    # The best B nodes are closed under ancestors and outrank every other node of their depth, so beams wider than
    # B and depths past B cannot change the tree (small CPU budgets search cheaply). top-k stays: the n-gram term
    # can lift a token the head ranks below B.
    budget = max(int(params.node_budget), 1)
    depth_limit = min(depth_rows if depth_bound is None else depth_bound, depth_rows, budget)
    k = min(params.top_k, draft_logits.shape[2])
    best_first = params.search == "best_first"
    if best_first:  # calibrated across depths: the whole softmax; no decays; every draft of the best B kept
        top_logp, top_ids = draft_logits[:, :depth_limit].float().log_softmax(dim=-1).topk(k, dim=-1)
        level_decay, logit_decay, beam_width = 0.0, 1.0, budget
    else:
        top_logits, top_ids = draft_logits[:, :depth_limit].float().topk(k, dim=-1)
        top_logp = torch.log(torch.softmax(top_logits, dim=-1) + LOG_EPS)  # softmax over the k kept (reference)
        level_decay, logit_decay, beam_width = params.level_decay, params.logit_decay, params.beam_width
    if draft_to_target is not None:
        top_ids = draft_to_target[top_ids]
    hist_len = contexts.shape[1]
    f32 = lambda w: torch.tensor(w, dtype=torch.float32, device=device)  # weights are float32 in the reference
    ngram_w = f32(params.ngram_weight)

    # pool of every scored node, per row; index 0 is the root
    pool_tokens = [root_tokens.view(rows, 1).to(device=device, dtype=torch.long)]
    pool_parents = [torch.zeros(rows, 1, dtype=torch.long, device=device)]
    pool_depths = [torch.zeros(rows, 1, dtype=torch.long, device=device)]
    pool_scores = [torch.zeros(rows, 1, device=device)]
    pool_size = 1

    beam_scores = torch.zeros(rows, 1, device=device)
    beam_nodes = torch.zeros(rows, 1, dtype=torch.long, device=device)
    beam_hist = contexts.to(device=device, dtype=torch.long).view(rows, 1, hist_len)
    beam_on_lookup = torch.ones(rows, 1, dtype=torch.bool, device=device)  # the beam's path is c_1..c_d
    for d in range(depth_limit):
        beams = beam_scores.shape[1]
        term = (top_logp[:, d] * f32(logit_decay**d)).unsqueeze(1).expand(rows, beams, k)
        cand = top_ids[:, d].unsqueeze(1).expand(rows, beams, k)
        if ngram is not None and d > 0 and params.ngram_weight != 0:
            prob = ngram.prob(beam_hist.reshape(rows * beams, hist_len), cand.reshape(rows * beams, k))
            term = term + torch.log(prob.view(rows, beams, k) + LOG_EPS) * ngram_w
        if lookup is not None:  # after the n-gram term: a lookup proposal is scored by lookup_logp alone
            lookup_term = logit_decay**d * params.lookup_logp
            term, cand = _add_lookup_candidate(term, cand, lookup, d, beam_on_lookup, lookup_term)
        scores = beam_scores.unsqueeze(2) + f32((d + 1) ** -level_decay) * term
        if max_depths is not None:  # a row past its own depth limit: nothing more (never chosen)
            scores = scores.masked_fill((max_depths <= d).view(rows, 1, 1), float("-inf"))
        width = scores.shape[1] * scores.shape[2]
        flat, flat_cand = scores.reshape(rows, width), cand.reshape(rows, width)
        pool_tokens.append(flat_cand)
        pool_parents.append(beam_nodes.unsqueeze(2).expand_as(scores).reshape(rows, width))
        pool_depths.append(torch.full((rows, width), d + 1, dtype=torch.long, device=device))
        pool_scores.append(flat)
        is_eos = torch.isin(flat_cand, eos_token_ids) if eos_token_ids is not None else None
        sel = _ranked(flat, is_eos)[:, : min(beam_width, width, budget)]
        beam_scores, beam_nodes = flat.gather(1, sel), pool_size + sel
        parent_beam = sel // cand.shape[2]
        chosen_tokens = flat_cand.gather(1, sel)
        if lookup is not None:
            beam_on_lookup = beam_on_lookup.gather(1, parent_beam) & (chosen_tokens == lookup[0][:, d : d + 1])
        parent_hist = beam_hist.gather(1, parent_beam.unsqueeze(2).expand(-1, -1, hist_len))
        beam_hist = torch.cat([parent_hist[:, :, 1:], chosen_tokens.unsqueeze(2)], dim=2)
        pool_size += width

    tokens, parents = torch.cat(pool_tokens, dim=1), torch.cat(pool_parents, dim=1)
    depths, scores = torch.cat(pool_depths, dim=1), torch.cat(pool_scores, dim=1)
    chosen = _ranked(scores[:, 1:], None)[:, : min(budget, pool_size - 1)] + 1
    kept = torch.ones_like(chosen, dtype=torch.bool) if fixed_size else torch.isfinite(scores.gather(1, chosen))
    # pool indices grow with depth, so ascending order keeps parents before children; a row's unkept entries go last
    order = torch.sort(torch.where(kept, chosen, pool_size + chosen), dim=1).values
    kept = order < pool_size
    chosen = torch.cat([torch.zeros(rows, 1, dtype=torch.long, device=device), torch.where(kept, order, 0)], dim=1)
    real = torch.cat([torch.ones(rows, 1, dtype=torch.bool, device=device), kept], dim=1)  # [rows, N]
    n = chosen.shape[1]
    node = torch.arange(n, device=device).expand(rows, n)
    tree_index = torch.zeros(rows, pool_size, dtype=torch.long, device=device)  # remap parents to tree indices
    tree_index.scatter_(1, torch.where(real, chosen, 0), torch.where(real, node, 0))
    tree_parents = torch.where(real, tree_index.gather(1, parents.gather(1, chosen)), node)
    tree_parents[:, 0] = 0
    anc = ancestor_masks(tree_parents, depth_limit)  # a padding node is its own parent: itself alone
    return DraftTrees(
        tokens=torch.where(real, tokens.gather(1, chosen), root_tokens.view(rows, 1).to(device)),
        parents=torch.where(real, tree_parents, 0),
        depths=torch.where(real, depths.gather(1, chosen), 0),
        ancestor_mask=anc,
        scores=torch.where(real, scores.gather(1, chosen), float("-inf")),
        sizes=real.sum(dim=1),
        depth=depth_limit,
    )
