"""The rows of a DART call as plain `generate` holds them: where each stops, and what `generate` returns and streams
from them.

What plain batched `generate` does, and how it is kept (one row is a batch of one):
- Finished rows: when a stopping criterion has `eos_token_id` (EOS configured), `generate` appends `pad_token_id` to
  a row once it stops; here the row leaves the batch and is padded at the end. Without one, `generate` keeps
  decoding a stopped row until every row has stopped; here such a row stays in the batch until the final length
  (the longest stop) is known and reached, and is cut there.
- `return_dict_in_generate`: sequences, and scores / logits in `generate`'s layout (one [batch, vocab] tensor per
  step). A finished row's entries after its stop are what `generate` computes there (the target fed pad tokens):
  one extra target forward per finished row at the end, only when scores or logits are asked for. The returned
  cache is the call's for one unpadded row (exactly plain decoding's entries), None for a batch (ragged, and it has
  lost its finished rows).
- Streamers get what `generate` gives them: the prompt [batch, prompt], then one [batch] column per token, a column
  as soon as every row has produced that token.
- Stops: plain `generate` checks its stopping criteria after every token; a DART step appends several tokens at once,
  so every prefix of them is checked as `generate` would have, and the tokens after the first stop are dropped. The
  usual criteria (max length, EOS) take a vectorised path (`first_stops`, no host sync); any other criterion is
  called prefix by prefix (`first_stop`), row by row in a batch (plain `generate` calls them on the whole batch; the
  standard criteria, stop strings included, decide each row from that row alone).
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput


class Rows:
    """Per-row state, indexed by the row's place in the caller's batch: the row as `generate` holds it (padded
    prompt + new tokens), its scores / logits per new token, and the length at which it stopped."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.prompt = input_ids.shape[1]
        self.mask = attention_mask
        self.lefts = (attention_mask == 0).sum(dim=1).tolist()  # left padding per row
        self.seqs = list(input_ids)
        self.scores: list[list[torch.Tensor]] = [[] for _ in self.seqs]
        self.logits: list[list[torch.Tensor]] = [[] for _ in self.seqs]
        self.done: list[int | None] = [None] * len(self.seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    def length(self, b: int) -> int:
        return self.seqs[b].numel()


class RowProcessor:
    """The call's logits processors applied to ONE row b of the batch, as `generate` applies them to the whole batch.

    Some processors know the batch: repetition penalty holds a per-row prompt length (`prompt_ignore_length`, the
    row's left padding), `prefix_allowed_tokens_fn` takes the row's index. So row b's context [1, L] and scores
    [1, V] are repeated to the caller's batch size, the processors run on that batch, and row b comes back: every
    processor sees row b at index b, exactly where `generate` shows it."""

    def __init__(self, logits_processor: LogitsProcessorList, row: int, rows: int):
        self.processors, self.row, self.rows = logits_processor, row, rows

    def __len__(self) -> int:
        return len(self.processors)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.rows == 1:
            return self.processors(input_ids, scores)
        batch_ids = input_ids.expand(self.rows, -1)
        batch_scores = scores.expand(self.rows, -1).clone()
        return self.processors(batch_ids, batch_scores)[self.row : self.row + 1]


# ------------------------------------------------------------------------------------------------ stops
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
            hit = torch.isin(tokens, c.eos_token_id.to(tokens.device)) & (j < limit.unsqueeze(1))
            limit = torch.minimum(limit, torch.where(hit, j, m).min(dim=1).values)
    return limit


# ------------------------------------------------------------------------------------------------ output
def final_length(rows: Rows, pad_finished: bool) -> int:
    """The output length `generate` reaches: the longest row (EOS configured), else the longest stop (rows that
    never stopped ran to max_length)."""
    if pad_finished:
        return max(rows.length(b) for b in range(len(rows)))
    return max(rows.done[b] if rows.done[b] is not None else rows.length(b) for b in range(len(rows)))


@torch.no_grad()
def scores_after_stop(model, rows: Rows, total: int, logits_processor: LogitsProcessorList, pad_id) -> None:
    """The scores / logits `generate` computes for a finished row after its stop, where it feeds the row pad tokens
    (attention mask 1): one target forward over the padded row, then the processors on each prefix."""
    for b in range(len(rows)):
        processor = RowProcessor(logits_processor, b, len(rows))
        have = len(rows.scores[b])
        missing = total - rows.prompt - have
        if missing <= 0:
            continue
        seq = torch.cat([rows.seqs[b], pad_id.to(rows.seqs[b].device).view(1).expand(missing - 1)])
        mask = torch.cat([rows.mask[b], rows.mask.new_ones(seq.numel() - rows.prompt)]).unsqueeze(0)
        positions = (mask.cumsum(dim=-1) - 1).masked_fill(mask == 0, 0)
        logits = model(input_ids=seq.unsqueeze(0), attention_mask=mask, position_ids=positions, use_cache=False,
                       logits_to_keep=missing).logits[0].float()
        for j in range(missing):
            context = seq[: rows.prompt + have + j].unsqueeze(0)
            rows.logits[b].append(logits[j])
            rows.scores[b].append(processor(context, logits[j : j + 1].clone())[0])


def result(rows: Rows, total: int, pad_id, config: GenerationConfig, keep: bool, cache=None):
    fill = int(pad_id) if pad_id is not None else 0
    sequences = rows.seqs[0].new_full((len(rows), total), fill)
    for b, seq in enumerate(rows.seqs):
        n = min(seq.numel(), total)
        sequences[b, :n] = seq[:n]
    if not config.return_dict_in_generate:
        return sequences
    steps = total - rows.prompt
    per_step = lambda per_row: tuple(torch.stack([r[t] for r in per_row]) for t in range(steps))
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=per_step(rows.scores) if keep and config.output_scores else None,
        logits=per_step(rows.logits) if keep and config.output_logits else None,
        cache=cache if config.use_cache else None,
    )


class ColumnStream:
    """Hands a streamer what plain batched `generate` hands it: one [batch] column per new token, in order, each
    as soon as every row has produced that token (a finished row gives `pad_token_id`)."""

    def __init__(self, streamer, rows: Rows, pad_id):
        self.streamer, self.rows, self.sent = streamer, rows, 0
        self.pad = int(pad_id) if pad_id is not None else 0

    def flush(self, active: list[int], total: int | None = None) -> None:
        if self.streamer is None:
            return
        if total is None and not active:
            return  # the final length is known only at the end (rows may run past it when no EOS is configured)
        rows = self.rows
        ready = total if total is not None else min(rows.length(b) for b in active)
        for t in range(self.sent + rows.prompt, ready):
            column = [int(s[t]) if t < s.numel() else self.pad for s in rows.seqs]
            self.streamer.put(torch.tensor(column))
        self.sent = max(self.sent, ready - rows.prompt)
