"""The DART loop over a batch of left-padded prompts: every row drafts its own tree, ONE target forward verifies
all of them, every row accepts its own number of tokens. Same output as plain batched `generate`, row by row.

`dart_decode` (`loop.py`) runs the checks and set-up shared with the single-row loop and hands a batch (more than one
row, or a left-padded row) to `decode_batch`. Per step:

    rows' trees (their own drafter each)  ->  `TreeBatch` (padded to one node count)
    `verify_batch`: one forward over [rows, N] with a 4D mask per row   (`ragged.RaggedCache`: padding + holes + tree)
    acceptance: `accept_greedy_batch` (vectorised over rows), else the single-row walk once per row
    `RaggedCache.commit`: each row's path into the step's new slots (holes behind shorter paths)
    stops per row (`stopping.first_stops`), finished rows leave the batch (`RaggedCache.select`)

What plain batched `generate` does, and how it is kept:
- Positions: a left-padded row counts from its first real token (cumsum of the attention mask - 1); the prefill is
  the same call `generate` makes (2D mask and those position ids).
- Finished rows: when a stopping criterion has `eos_token_id` (EOS configured), `generate` appends `pad_token_id` to
  a row once it stops; here the row leaves the batch and is padded at the end. Without one, `generate` keeps
  decoding a stopped row until every row has stopped; here such a row stays in the batch until the final length
  (the longest stop) is known and reached, and is cut there.
- Logits processors see the row exactly as `generate` gives it (left padding included, length prompt + t), at its
  own batch index (`RowProcessor`: processors may hold per-row settings, as repetition penalty's prompt lengths).
  They are called once per row and token, not once per token for the batch, so state kept across calls would see
  other calls than in `generate` (SynthID watermarking is refused: `loop.check_processors`).
- Sampling: per row, the single-row walk's rule (the target's own draw at each visited node, one multinomial per
  token). The same seed gives the same batch; the draws are not those of plain batched `generate`, whose single
  multinomial per step covers all rows at once.
- `return_dict_in_generate`: sequences, and scores / logits in `generate`'s layout (one [batch, vocab] tensor per
  step). A finished row's entries after its stop are what `generate` computes there (the target fed pad tokens):
  one extra target forward per finished row at the end, only when scores or logits are asked for. The returned
  cache is None: the batch's cache is ragged and has lost its finished rows.
- Streamers get what `generate` gives them: the prompt [batch, prompt], then one [batch] column per step, a column
  as soon as every row has produced that token.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import Accepted, BatchAccepted, accept_greedy_batch, accept_walk
from .batch_budget import batch_budget
from .budget import BudgetPolicy, path_ranks
from .drafter import DartDrafter
from .modeling import DartHead
from .ragged import RaggedCache
from .stats import DartStats, PhaseTimer
from .stopping import fast_criteria, first_stop, first_stops
from .target import aux_request, aux_states, cache_kwargs
from .tree_batch import TreeBatch
from .verify import layer_window, verify_batch


def is_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether a call takes the batched loop: more than one row, or padding."""
    return input_ids.shape[0] > 1 or (attention_mask is not None and not bool((attention_mask == 1).all()))


def check_batch_call(attention_mask: torch.Tensor | None, cache: DynamicCache) -> None:
    """Refuse, before any work, the batched calls the loop cannot run exactly."""
    if attention_mask is not None:
        mask = attention_mask.bool()
        if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
            raise ValueError(
                "DART decoding of padded inputs supports left padding only (padding_side='left', as plain generate "
                "needs for decoder-only models); the attention_mask has zeros after ones (right or middle padding)"
            )
        if not bool(mask[:, -1].all()):
            raise ValueError("DART decoding got a row whose attention_mask is all zeros (an empty prompt)")
    if any(layer_window(layer) is not None for layer in cache.layers):
        raise NotImplementedError(
            "DART batched decoding (batch size > 1 or padded inputs) does not support targets with sliding-window "
            "layers yet; decode one prompt at a time"
        )


class _Rows:
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

    def text(self, b: int) -> torch.Tensor:
        """[1, L]: row b without its left padding (what its drafter reads)."""
        return self.seqs[b][self.lefts[b] :].unsqueeze(0)


@torch.no_grad()
def decode_batch(
    model,
    head: DartHead,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: DynamicCache,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    *,
    stats: DartStats,
    timer: PhaseTimer,
    policy: BudgetPolicy | None,
    node_budget: int,
    prompt_lookup: bool,
    streamer=None,
):
    """The batched DART loop (see the module docstring). Returns what plain batched `generate` returns. The caller
    has run `check_batch_call`."""
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
    rows = _Rows(input_ids, mask)
    config = generation_config
    pad_id = config._pad_token_tensor
    pad_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)  # as GenerationMixin._sample
    keep = bool(config.return_dict_in_generate) and bool(config.output_scores or config.output_logits)
    do_sample = bool(config.do_sample)
    greedy = not do_sample and len(logits_processor) == 0
    ngram = head.ngram.to(head.device) if head.ngram is not None else None  # one copy for every row
    drafters = {b: DartDrafter(head, model, max_length=config.max_length, node_budget=node_budget,
                               prompt_lookup=prompt_lookup, eos_token_ids=config._eos_token_tensor, ngram=ngram)
                for b in range(len(rows))}
    out_stream = _ColumnStream(streamer, rows, pad_id)
    if streamer is not None:
        streamer.put(input_ids.cpu())

    aux_ids = head.config.aux_layer_ids
    with timer.phase("prefill"):
        raw, processed, first, aux = _prefill(model, input_ids, attention_mask, mask, cache, logits_processor,
                                              do_sample, aux_ids)
        for b, drafter in drafters.items():
            left = rows.lefts[b]
            drafter.advance(aux[b : b + 1, left:], torch.cat([input_ids[b, left + 1 :], first[b : b + 1]]))
    ragged = RaggedCache(cache, mask.bool())
    active = list(range(len(rows)))
    one = torch.ones(len(rows), dtype=torch.long, device=input_ids.device)
    step = BatchAccepted(paths=torch.zeros_like(one).unsqueeze(1), lengths=one, tokens=first.unsqueeze(1),
                         scores=processed.unsqueeze(1), logits=raw.unsqueeze(1))
    stats.new_tokens = _append(rows, active, step, stopping_criteria, config.max_length, pad_finished, keep)
    active = _retire(rows, active, ragged, drafters, config.max_length, pad_finished)
    out_stream.flush(active)
    probe, budget, drafted_before = 0, node_budget, False
    while active:
        budget, probe = _step_budget(policy, node_budget, len(active), probe)
        drafted = _drafting_seconds(timer)
        trees = TreeBatch.stack(
            [drafters[b].propose(rows.text(b), config.max_length - rows.length(b) - 1, timer, budget)
             .to(model.device) for b in active],
            fill=int(pad_id) if pad_id is not None else 0,
        )
        with timer.phase("verify"):
            logits, tree_aux = verify_batch(model, trees, ragged, aux_ids)
        with timer.phase("accept"):
            if greedy:
                step = accept_greedy_batch(trees, logits, keep)
            else:
                step = BatchAccepted.from_rows([
                    _walk(trees.trees[i], logits[i, : trees.trees[i].size], rows.seqs[b],
                          RowProcessor(logits_processor, b, len(rows)), do_sample)
                    for i, b in enumerate(active)
                ])
            ragged.commit(step.paths, step.lengths)
            lengths = step.lengths.tolist()
            for i, b in enumerate(active):
                path = step.paths[i, : lengths[i]]
                drafters[b].advance(tree_aux[i : i + 1, path.to(tree_aux.device)], step.tokens[i, : lengths[i]])
            n_new = _append(rows, active, step, stopping_criteria, config.max_length, pad_finished, keep)
        if policy is not None and timer.exact:  # the batch rule's verify scale and (steady) drafting cost
            with policy.lock:
                policy.batch_times.observe(len(trees.trees), budget, trees.tokens.numel(), timer.last["verify"],
                                           _drafting_seconds(timer) - drafted, steady=drafted_before)
        drafted_before = budget > 0
        if policy is not None and budget > 0:  # acceptance per row (a batched step is not a single-row step time)
            for i, tree in enumerate(trees.trees):
                path = step.paths[i, : lengths[i]].to(tree.tokens.device)
                policy.observe(budget, path_ranks(tree, path).tolist())
        stats.record_step(n_new, budget)
        active = _retire(rows, active, ragged, drafters, config.max_length, pad_finished)
        ragged.compact()
        out_stream.flush(active)

    total = _final_length(rows, pad_finished)
    if keep and pad_finished:
        _scores_after_stop(model, rows, total, logits_processor, pad_id)
    out_stream.flush([], total)
    if streamer is not None:
        streamer.end()
    stats.node_budget = budget  # the last step's (the cost-aware rule's latest choice)
    return _result(rows, total, pad_id, config, keep)


# ------------------------------------------------------------------------------------------------ the steps
def _prefill(model, input_ids, attention_mask, mask, cache, logits_processor, do_sample: bool, aux_ids: list[int]):
    """(raw logits, processed scores, first new token per row [B], the layer inputs the head reads [B, S, 3H]) of the
    prompts: the forward `generate` runs (2D mask, positions counted from each row's first real token) and its choice
    of token."""
    positions = (mask.cumsum(dim=-1) - 1).masked_fill(mask == 0, 0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                logits_to_keep=1, **cache_kwargs(model, cache), **aux_request(aux_ids))
    raw = out.logits[:, -1].float()
    processed = logits_processor(input_ids, raw.clone())
    aux = aux_states(out, aux_ids)
    if do_sample:
        return raw, processed, torch.multinomial(torch.softmax(processed, dim=-1), num_samples=1).squeeze(1), aux
    return raw, processed, processed.argmax(dim=-1), aux


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


def _walk(tree, logits, context, logits_processor: RowProcessor, do_sample: bool) -> Accepted:
    """The single-row acceptance walk on one row: `context` is the row as `generate` holds it."""
    return accept_walk(tree, logits, context.unsqueeze(0), logits_processor, do_sample)


def _drafting_seconds(timer: PhaseTimer) -> float:
    """Seconds spent so far on head forwards and tree searches (the drafters time their phases into `timer`)."""
    return timer.totals.get("draft", 0.0) + timer.totals.get("tree", 0.0)


def _step_budget(policy: BudgetPolicy | None, fixed: int, rows: int, probe: int) -> tuple[int, int]:
    """(this step's node budget per row, steps since the last probe). Fixed budgets stay fixed; the cost-aware one
    follows `batch_budget.batch_budget`, and one step in 32 is a probe of the other side: drafting with the best tree
    when the rule says plain decoding (whose acceptance would otherwise never be measured again), plain decoding when
    it says draft (so the rule compares two measured verify times, not the curve's guess of one)."""
    if policy is None:
        return fixed, 0
    with policy.lock:
        budget = batch_budget(policy, rows)
        if probe >= 31:
            return (batch_budget(policy, rows, drafting_only=True) if budget == 0 else 0), 0
    return budget, probe + 1


def _append(rows: _Rows, active: list[int], step: BatchAccepted, stopping_criteria: StoppingCriteriaList,
            max_length: int, pad_finished: bool, keep: bool) -> int:
    """Append each active row's new tokens up to its first stop (`stopping.first_stops`); record where rows stop.
    Returns how many tokens were appended over all rows.

    With `pad_finished` (EOS configured) a row's tokens after its stop are dropped (`generate` pads there). Without,
    a row keeps every token up to max_length (`generate` keeps decoding it until every row has stopped)."""
    device = step.tokens.device
    starts = torch.tensor([rows.length(b) for b in active], device=device)
    if fast_criteria(stopping_criteria):
        stops = first_stops(starts, step.tokens, step.lengths.to(device), stopping_criteria).tolist()
    else:
        stops = [_row_stop(rows, b, step, i, stopping_criteria) for i, b in enumerate(active)]
    lengths, total = step.lengths.tolist(), 0
    for i, b in enumerate(active):
        n, start = lengths[i], rows.length(b)
        stopped = stops[i] < n and rows.done[b] is None
        kept = stops[i] + 1 if stopped and pad_finished else min(n, max_length - start)
        if stopped:
            rows.done[b] = start + stops[i] + 1
        rows.seqs[b] = torch.cat([rows.seqs[b], step.tokens[i, :kept].to(rows.seqs[b].device)])
        if keep:
            rows.scores[b].extend(step.scores[i, :kept])
            rows.logits[b].extend(step.logits[i, :kept])
        total += kept
    return total


def _row_stop(rows: _Rows, b: int, step: BatchAccepted, i: int, stopping_criteria: StoppingCriteriaList) -> int:
    """`stopping.first_stop` on one row for criteria off the fast path (n: no stop). Rows that stopped already are
    not asked again."""
    n = int(step.lengths[i])
    if rows.done[b] is not None:
        return n
    ids = torch.cat([rows.seqs[b], step.tokens[i, :n].to(rows.seqs[b].device)]).unsqueeze(0)
    scores = step.scores[i, :n] if step.scores is not None else None
    stop = first_stop(ids, n, stopping_criteria, scores)
    return n if stop is None else stop


def _retire(rows: _Rows, active: list[int], ragged: RaggedCache, drafters: dict, max_length: int,
            pad_finished: bool) -> list[int]:
    """Drop the rows that need no more tokens from the batch (and their drafters); returns the active rows."""
    all_done = all(d is not None for d in rows.done)
    final = max((d for d in rows.done if d is not None), default=0)

    def finished(b: int) -> bool:
        if rows.length(b) >= max_length:
            return True
        if pad_finished:
            return rows.done[b] is not None
        return all_done and rows.length(b) >= final

    keep = [i for i, b in enumerate(active) if not finished(b)]
    if len(keep) == len(active):
        return active
    for i, b in enumerate(active):
        if i not in keep:
            drafters.pop(b, None)
    if keep:
        ragged.select(torch.tensor(keep, device=ragged.valid.device))
    return [active[i] for i in keep]


# ------------------------------------------------------------------------------------------------ output
def _final_length(rows: _Rows, pad_finished: bool) -> int:
    """The output length `generate` reaches: the longest row (EOS configured), else the longest stop (rows that
    never stopped ran to max_length)."""
    if pad_finished:
        return max(rows.length(b) for b in range(len(rows)))
    return max(rows.done[b] if rows.done[b] is not None else rows.length(b) for b in range(len(rows)))


@torch.no_grad()
def _scores_after_stop(model, rows: _Rows, total: int, logits_processor: LogitsProcessorList, pad_id) -> None:
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


def _result(rows: _Rows, total: int, pad_id, config: GenerationConfig, keep: bool):
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
        cache=None,
    )


class _ColumnStream:
    """Hands a streamer what plain batched `generate` hands it: one [batch] column per new token, in order, each
    as soon as every row has produced that token (a finished row gives `pad_token_id`)."""

    def __init__(self, streamer, rows: _Rows, pad_id):
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
