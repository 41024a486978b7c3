"""Choosing which draft tokens the target accepts (docs/DART_SPEC.md §4). Both rules are lossless.

- `accept_greedy`: no logits processors, greedy. Vectorised over the whole tree: a node is accepted when its
  token equals the target's argmax at every ancestor; the deepest accepted node ends the path.
- `accept_walk`: the general rule, for sampling and for greedy with processors (repetition penalty,
  min-length, ...). It walks from the root and applies the user's processors at each visited node with that
  node's exact context, as plain `generate` would. At a node with distribution p, children are tried in
  order: child x is accepted with probability p(x) / (mass not yet rejected); if all are rejected the bonus
  token is drawn from p with the rejected children removed. Each output token is thus distributed exactly as
  p: the children are distinct, deterministic proposals. The per-child trials are one vectorised cumsum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList

from .tree import DraftTree


@dataclass
class Accepted:
    """The accepted path (tree node indices, root first), the new tokens (path tokens after the root, then the
    bonus token) and, when asked for, the processed scores / raw logits that produced each new token."""

    path: torch.Tensor
    tokens: torch.Tensor
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def accept_greedy(tree: DraftTree, logits: torch.Tensor, keep_scores: bool = False) -> Accepted:
    """Greedy acceptance over the whole tree with one device-to-host sync (the path length)."""
    predicted = logits.argmax(dim=-1)
    matches = tree.tokens == predicted[tree.parents]
    matches[0] = True
    accepted = ~(tree.ancestor_mask & ~matches.unsqueeze(0)).any(dim=1)
    deepest = torch.where(accepted, tree.depths, -1).argmax()
    path = tree.ancestor_mask[deepest].nonzero().squeeze(1)  # ascending index == ascending depth
    tokens = torch.cat([tree.tokens[path[1:]], predicted[deepest].view(1)])
    rows = logits[path] if keep_scores else None
    return Accepted(path=path, tokens=tokens, scores=rows, logits=rows)


def _choose_at_node(
    probs: torch.Tensor, child_tokens: torch.Tensor, do_sample: bool, generator: torch.Generator | None
) -> tuple[int, int | None]:
    """(index of the accepted child or -1, bonus token when no child is accepted)."""
    if not do_sample:
        choice = int(probs.argmax())
        hit = (child_tokens == choice).nonzero()
        return (int(hit[0, 0]), None) if hit.numel() else (-1, choice)
    if child_tokens.numel():
        p_children = probs[child_tokens]
        rejected_before = torch.cat([p_children.new_zeros(1), p_children.cumsum(0)[:-1]])
        accept_prob = p_children / (1.0 - rejected_before).clamp(min=1e-20)
        draws = torch.rand(child_tokens.numel(), generator=generator, device="cpu").to(probs.device)
        hits = (draws < accept_prob).nonzero()
        if hits.numel():
            return int(hits[0, 0]), None
        probs = probs.clone()
        probs[child_tokens] = 0.0
    bonus = torch.multinomial(probs / probs.sum(), 1, generator=generator if probs.device.type == "cpu" else None)
    return -1, int(bonus)


def accept_walk(
    tree: DraftTree,
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    do_sample: bool,
    generator: torch.Generator | None = None,
) -> Accepted:
    """Walk the tree applying `logits_processor` with each visited node's own context (input_ids + path)."""
    parents = tree.parents
    is_child = torch.ones_like(parents, dtype=torch.bool)
    is_child[0] = False
    node, path, new_tokens, scores = 0, [0], [], []
    while True:
        context = torch.cat([input_ids, tree.tokens[path[1:]].unsqueeze(0)], dim=1)
        processed = logits_processor(context, logits[node : node + 1].clone())[0]
        scores.append(processed)
        probs = torch.softmax(processed.float(), dim=-1) if do_sample else processed
        kids = ((parents == node) & is_child).nonzero().squeeze(1)
        chosen, bonus = _choose_at_node(probs, tree.tokens[kids], do_sample, generator)
        if chosen < 0:
            new_tokens.append(bonus)
            break
        node = int(kids[chosen])
        path.append(node)
        new_tokens.append(int(tree.tokens[node]))
    path_t = torch.tensor(path, device=logits.device)
    return Accepted(
        path=path_t,
        tokens=torch.tensor(new_tokens, device=logits.device),
        scores=torch.stack(scores),
        logits=logits[path_t],
    )
