"""Where a step's new tokens stop: the first token after which plain `generate` would have stopped, for one row
(`first_stop`) or for every row of a batch (`first_stops`).

Plain `generate` checks its stopping criteria after every token; a DART step appends several tokens at once, so every
prefix of them is checked here as `generate` would have, and the tokens after the first stop are dropped. The usual
criteria (max length, EOS) take a vectorised fast path (`first_stops`, no host sync); any other criterion is called
prefix by prefix (`first_stop`). Criteria are
called row by row in a batch (plain `generate` calls them on the whole batch; the standard criteria, stop strings
included, decide each row from that row alone).
"""

from __future__ import annotations

import torch
from transformers import StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria


def fast_criteria(stopping_criteria: StoppingCriteriaList) -> bool:
    """Whether every criterion is one the vectorised path decides (max length, EOS)."""
    return all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria)


def first_stop(input_ids: torch.Tensor, n_new: int, stopping_criteria: StoppingCriteriaList, scores) -> int | None:
    """Index (0-based, within the n_new tokens just appended to `input_ids` [1, L]) of the first token after which
    generation stops, checking every prefix as plain generate would have, one token at a time (criteria off the fast
    path: `first_stops` decides max length and EOS for every row at once)."""
    start = input_ids.shape[1] - n_new
    for j in range(n_new):
        if bool(stopping_criteria(input_ids[:, : start + j + 1], scores).any()):
            return j
    return None


def first_stops(
    starts: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor, stopping_criteria: StoppingCriteriaList
) -> torch.Tensor:
    """`first_stop` for every row of a batch on the fast path (`fast_criteria`): rows whose sequences had
    starts[r] tokens get tokens[r, :lengths[r]]. Returns [rows]: the index of the first stopping token, or
    lengths[r] where the row goes on. No host sync."""
    m = tokens.shape[1]
    limit = lengths.clone()
    for c in stopping_criteria:
        if type(c) is MaxLengthCriteria:
            limit = torch.minimum(limit, (c.max_length - starts - 1).clamp(min=0))
    j = torch.arange(m, device=tokens.device).unsqueeze(0)
    for c in stopping_criteria:
        if type(c) is EosTokenCriteria:
            c.eos_token_id = c.eos_token_id.to(tokens.device)
            hit = torch.isin(tokens, c.eos_token_id) & (j < limit.unsqueeze(1))
            limit = torch.minimum(limit, torch.where(hit, j, m).min(dim=1).values)
    return limit
