"""Prompt lookup inside the draft tree: the continuation of the latest earlier occurrence of the text's ending.

Why: text often repeats itself (code echoes the signature and names of its prompt, answers quote the question,
small models loop), and such tokens are exactly the ones a one-layer head is unsure of. Transformers' own
`prompt_lookup_num_tokens` drafts only this chain; DART offers it as one more candidate per depth of the beam
search (`dart_hf.core.tree.build_tree`), so the node budget goes to whichever of head and lookup is more likely
right (`examples/tune_tree_search.py` measures the accepted length with and without it).

Vectorised over the context (one comparison of all n-gram windows per n), with no host sync, so it runs
on the device that holds the tokens.
"""

from __future__ import annotations

import torch


def lookup_continuation(
    context: torch.Tensor, length: int, min_ngram: int = 2, max_ngram: int = 4, used: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [length], valid [length]): the `length` tokens that followed the latest earlier occurrence of the
    longest n-gram (max_ngram down to min_ngram) that the text ends with; `valid` is False past the end of the text
    or everywhere when nothing matches. The text is `context` [T], or its first `used` tokens (a 0-d tensor: the
    compiled step's fixed-size text buffer, where every shape stays T). `lookup_continuations` for one row."""
    end = None if used is None else used.view(1)
    tokens, valid = lookup_continuations(context.unsqueeze(0), length, min_ngram, max_ngram, end)
    return tokens[0], valid[0]


def lookup_continuations(
    texts: torch.Tensor, length: int, min_ngram: int = 2, max_ngram: int = 4, used: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lookup_continuation` of every row of `texts` [B, T] at once: row b's text is its first used[b] tokens
    (default: all T; pad the rest with -1, which no text token equals). Returns tokens, valid [B, length]."""
    rows, t = texts.shape
    device = texts.device
    end = torch.full((rows,), t, device=device) if used is None else used.to(device).view(rows)
    start = torch.full((rows,), -1, dtype=torch.long, device=device)
    for n in range(min_ngram, max_ngram + 1):  # a longer match overrides a shorter one
        if t <= n:
            break
        windows = texts.unfold(1, n, 1)  # every n-gram; those starting before the final one count
        ending = texts.gather(1, (end.view(rows, 1) - n + torch.arange(n, device=device)).clamp(min=0))
        index = torch.arange(windows.shape[1], device=device)
        hit = (windows == ending.unsqueeze(1)).all(dim=2) & (index < (end - n).view(rows, 1))
        latest = torch.where(hit, index, -1).max(dim=1).values
        start = torch.where(latest >= 0, latest + n, start)
    index = start.view(rows, 1) + torch.arange(length, device=device)
    valid = (start >= 0).view(rows, 1) & (index < end.view(rows, 1))
    return texts.gather(1, index.clamp(0, max(t - 1, 0))), valid


def lookup_for_tree(
    texts: torch.Tensor, length: int, config, device: torch.device, used: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`lookup_continuations` of rows `texts` [B, T] (each its first used[b] tokens) with a head config's n-gram
    range, on the head's device: the `lookup` argument of `dart_hf.core.tree.build_trees`."""
    tokens, valid = lookup_continuations(texts, length, config.lookup_min_ngram, config.lookup_max_ngram, used)
    return tokens.to(device), valid.to(device)


__all__ = ["lookup_continuation", "lookup_continuations", "lookup_for_tree"]
