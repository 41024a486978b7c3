"""The DART decoding loop, for one row or a batch: prefill, then per step propose -> verify -> accept -> commit ->
stop -> stream. Same output as plain `generate` (greedy: token for token; sampling: the same distribution).

`dart_decode` has the signature of a transformers decoding method, so `GenerationMixin.generate` prepares
everything (GenerationConfig, logits processors and warpers, stopping criteria incl. stop strings, max length) and
then hands over to it, either through `custom_generate=dart_decode` or through the `assistant_model=DartHead` routing
installed by `import dart_hf` (see `dart_hf.integrations.transformers`). Per step:

    every row's tree (`DartDrafter`: ONE head forward and ONE tree search for all rows) -> `DraftTrees` (padded)
    `verify_batch`: one target forward over [rows, N], the mask of each row (`ragged.RaggedCache`: padding + holes +
        sliding windows + tree), returning the logits and the layer inputs the head reads next
    acceptance: `accept_greedy_batch` (vectorised over rows), else the walk per row with the processors
    `RaggedCache.commit`: each row's path into the step's new slots (holes behind shorter paths)
    stops per row (`stopping.first_stops`), finished rows leave the batch (`RaggedCache.select`)

One unpadded row is a batch of one without holes: its cache is plain decoding's, and its processors and stopping
criteria are called once per new token, in order, as plain `generate` calls them. Refusals: `checks.py`; the rows as
`generate` holds, returns and streams them: `rows.py`; the per-call results: `stats.py`.

What plain batched `generate` does, and how it is kept:
- Positions: a left-padded row counts from its first real token (cumsum of the attention mask - 1); the prefill is
  the same call `generate` makes (2D mask and those position ids).
- Logits processors see the row exactly as `generate` gives it (left padding included, length prompt + t), at its
  own batch index (`rows.RowProcessor`). In a batch they are called once per row and token, not once per token for
  the batch, so state kept across calls would see other calls than in `generate` (SynthID is refused there).
- Sampling: per row, the walk's rule (the target's own draw at each visited node, one multinomial per token). The
  same seed gives the same text; in a batch each row draws from its own stream (`rows.RowStreams`, seeded from torch's),
  so the draws are not those of plain batched `generate`, whose single multinomial per step covers all rows at once.
"""

from __future__ import annotations

import time

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .acceptance import Accepted, BatchAccepted, accept_greedy_batch, accept_walk
from .batch_budget import next_batch_budget
from .budget import BudgetPolicy, budget_policy, path_ranks
from .checks import (call_cache, check_call, check_model_inputs, check_padding, check_processors, is_batch,
                     prepare_call)
from .distributed import check_tensor_parallel_call, shared_budget, tensor_parallel_group
from .drafter import DartDrafter, default_node_budget
from .modeling import DartHead
from .ragged import RaggedCache
from .static_step import static_call
from .rows import ColumnStream, RowProcessor, Rows, RowStreams, final_length, result, scores_after_stop
from .stats import DartStats, PhaseTimer
from .stopping import fast_criteria, first_stop, first_stops
from .target import aux_request, aux_states, cache_kwargs
from .tree import DraftTrees
from .verify import verify_batch


@torch.no_grad()
def dart_decode(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    dart_head: DartHead | None = None,
    dart_streamer=None,
    dart_node_budget: int | str | None = None,
    dart_prompt_lookup: bool | None = None,
    dart_timing: bool = False,
    dart_stats: DartStats | None = None,
    dart_budget_state=None,
    **model_kwargs,
):
    """Generate with DART tree speculation. Same result as greedy / sampled `generate` (lossless), for one row or a
    batch of left-padded rows.

    dart_head: the draft head (checked and placed by `checks.prepare_call`: moved and cast in place to the target's
    device and dtype on its first call; a placed copy for a target on another device or dtype).
    dart_streamer: a transformers streamer (transformers does not forward `streamer` to custom decoding callables).
    dart_node_budget: tree size override: an int (0: plain decoding in this loop), or "auto" for the cost-aware
    budget chosen step by step (`dart_hf.core.budget`); default: the head's config (`node_budget=None` there also
    means "auto").
    dart_prompt_lookup: offer prompt-lookup continuations to the tree search; default: the head's config.
    dart_timing: synchronise CUDA around phases so the phase times are exact.
    dart_stats: a `DartStats` to fill (default: a new one); `dart_head.stats` points at it from the start of the call.
    dart_budget_state: a `dart_hf.core.budget.BudgetState` for the cost-aware policy (default: the head's).
    """
    check_call(model, dart_head, input_ids, generation_config, model_kwargs)
    attention_mask = model_kwargs.get("attention_mask")
    check_processors(logits_processor, "a batch" if is_batch(input_ids, attention_mask) else None)
    head, stats = prepare_call(dart_head, model, dart_stats)
    check_tensor_parallel_call(head, model, mode="tree", batch_size=input_ids.shape[0], node_budget=dart_node_budget,
                               do_sample=bool(generation_config.do_sample))
    check_model_inputs(model, input_ids, model_kwargs, generation_config)  # after the head / target checks
    check_padding(attention_mask)
    prompt_lookup = head.config.prompt_lookup if dart_prompt_lookup is None else bool(dart_prompt_lookup)
    policy, node_budget = _budget(head, model, dart_node_budget, prompt_lookup, dart_budget_state)
    static, cache, static_reason = static_call(model, head, input_ids, attention_mask, generation_config,
                                               model_kwargs, policy, node_budget, prompt_lookup)
    if static is not None:  # one fixed budget for the call (the policy's current choice for "auto")
        policy, node_budget = None, static.spec.params.node_budget
    elif cache is None:
        cache = call_cache(model, model_kwargs)
    stats.reset(mode="tree", budget_mode="auto" if policy else "fixed", node_budget=node_budget)
    stats.static, stats.compiled, stats.static_reason = static is not None, bool(static and static.compile_options), \
        static_reason
    timer = PhaseTimer(stats.time, head.device, dart_timing)

    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(torch.long)
    rows = Rows(input_ids, mask)
    config = generation_config
    pad_id = config._pad_token_tensor
    pad_finished = any(hasattr(c, "eos_token_id") for c in stopping_criteria)  # as GenerationMixin._sample
    keep = bool(config.return_dict_in_generate) and bool(config.output_scores or config.output_logits)
    do_sample = bool(config.do_sample)
    greedy = not do_sample and len(logits_processor) == 0
    if static is not None and (not greedy or keep):
        stats.static_reason = ("acceptance walks the tree eagerly between the captured draft / verify and commit "
                               "(sampling, logits processors or returned scores)")
    drafter = None if static is not None else DartDrafter(
        head, model, max_length=config.max_length, node_budget=node_budget, prompt_lookup=prompt_lookup,
        eos_token_ids=config._eos_token_tensor, rows=len(rows))
    out_stream = ColumnStream(dart_streamer, rows, pad_id)
    streams = RowStreams(len(rows), model.device) if do_sample and len(rows) > 1 else None
    if dart_streamer is not None:
        dart_streamer.put(input_ids.cpu())

    aux_ids = head.config.aux_layer_ids
    tp_group = tensor_parallel_group(model) if policy is not None else None  # ranks share the cost-aware choice
    with timer.phase("prefill"):
        raw, processed, first, aux = _prefill(model, input_ids, attention_mask, mask, cache, logits_processor,
                                              do_sample, aux_ids)
        if drafter is not None:
            drafter.start(torch.stack([input_ids[b, left] for b, left in enumerate(rows.lefts)]))
        for b in range(len(rows) if drafter is not None else 0):  # once: rows of different left padding
            left = rows.lefts[b]
            drafter.advance(aux[b : b + 1, left:], torch.cat([input_ids[b, left + 1 :], first[b : b + 1]])[None],
                            rows=[b])
        if static is not None:
            static.start(input_ids, aux, first)
    ragged = RaggedCache(cache, mask.bool(), model.config)
    ragged_rows = len(rows) > 1 or any(rows.lefts)  # else one row without holes: nothing to compact, ever
    active = list(range(len(rows)))
    one = torch.ones(len(rows), dtype=torch.long, device=input_ids.device)
    step = BatchAccepted(paths=torch.zeros_like(one).unsqueeze(1), lengths=one, tokens=first.unsqueeze(1),
                         scores=processed.unsqueeze(1), logits=raw.unsqueeze(1))
    stats.new_tokens = _append(rows, active, step, stopping_criteria, config.max_length, pad_finished, keep)
    active = _retire(rows, active, ragged, drafter, config.max_length, pad_finished)
    out_stream.flush(active)
    budget, drafted_before, single = node_budget, False, False
    while static is not None and active:  # the fixed-shape step (`static_step`): one row, one budget
        step = static.step(rows.seqs[0], logits_processor, do_sample, greedy and not keep, timer)
        with timer.phase("accept"):
            n_new = _append(rows, active, step, stopping_criteria, config.max_length, pad_finished, keep)
        stats.record_step(n_new, node_budget)
        active = _retire(rows, active, ragged, drafter, config.max_length, pad_finished)
        out_stream.flush(active)
    if static is not None and static.fallback:
        stats.compiled, stats.static_reason = False, static.fallback
    while active:
        started = time.perf_counter()
        single = policy is not None and len(active) == 1  # the single-row rule times whole steps
        budget = _step_budget(policy, node_budget, len(active))
        budget = shared_budget(tp_group, budget, model)
        if single:
            policy.start()
        drafted = _drafting_seconds(timer)
        trees = drafter.propose([config.max_length - rows.length(b) - 1 for b in active], timer,
                                budget).to(model.device)
        with timer.phase("verify"):
            logits, tree_aux = verify_batch(model, trees, ragged, aux_ids)
        with timer.phase("accept"):
            if greedy:
                step = accept_greedy_batch(trees, logits, keep)
            else:
                step = BatchAccepted.from_rows([
                    _walk(trees.trees[i], logits[i, : trees.trees[i].size], rows.seqs[b],
                          RowProcessor(logits_processor, b, len(rows)), do_sample,
                          streams.get(b, logits.device) if streams else None)
                    for i, b in enumerate(active)
                ])
            ragged.commit(step.paths, step.lengths)
            lengths = step.lengths.tolist()  # a host read: the step's device work is done
            wall = time.perf_counter() - started
            paths = step.paths.to(tree_aux.device)
            drafter.advance(tree_aux.gather(1, paths.unsqueeze(2).expand(-1, -1, tree_aux.shape[2])), step.tokens,
                            lengths)
            n_new = _append(rows, active, step, stopping_criteria, config.max_length, pad_finished, keep)
        if single:
            policy.observe(budget, path_ranks(trees, step.paths, lengths)[0] if budget > 0 else ())
        elif policy is not None:
            _observe_batch(policy, trees, step, lengths, budget, timer, _drafting_seconds(timer) - drafted,
                           drafted_before, wall)
        drafted_before = budget > 0
        stats.record_step(n_new, budget)
        active = _retire(rows, active, ragged, drafter, config.max_length, pad_finished)
        if ragged_rows:
            ragged.compact()
        out_stream.flush(active)

    total = final_length(rows, pad_finished)
    if keep and pad_finished:
        scores_after_stop(model, rows, total, logits_processor, pad_id)
    out_stream.flush([], total)
    if dart_streamer is not None:
        dart_streamer.end()
    stats.node_budget = policy.choice if policy is not None and len(rows) == 1 else budget  # the latest choice
    return result(rows, total, pad_id, config, keep, cache=None if ragged_rows else cache)


def _budget(head: DartHead, model, requested, use_lookup: bool, state) -> tuple[BudgetPolicy | None, int]:
    """(the cost-aware policy or None, the node budget it starts from or the fixed one)."""
    if requested == "auto" or (requested is None and head.config.node_budget is None):
        policy = budget_policy(head, model, prompt_lookup=use_lookup, state=state)
        return policy, policy.choice
    if isinstance(requested, str) or (requested is not None and int(requested) < 0):
        raise ValueError(f'dart_node_budget must be an int >= 0 or "auto", got {requested!r}')
    return None, int(requested) if requested is not None else default_node_budget(head, model)


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


def _walk(tree, logits, context, logits_processor: RowProcessor, do_sample: bool,
          generator: torch.Generator | None = None) -> Accepted:
    """The single-row acceptance walk on one row: `context` is the row as `generate` holds it."""
    return accept_walk(tree, logits, context.unsqueeze(0), logits_processor, do_sample, generator)


def _observe_batch(policy: BudgetPolicy, trees: DraftTrees, step: BatchAccepted, lengths: list[int], budget: int,
                   timer: PhaseTimer, drafting: float, steady: bool, wall: float) -> None:
    """What a batched step tells the batch rule: its verify scale and per-row drafting cost, and each row's acceptance
    (a batched step is not a single-row step time). Where phase times are launch times (CUDA without `dart_timing`),
    the whole step up to the acceptance's host read (`wall`) is exact: it is observed as the verify time, so the
    scale s(n) carries that size's drafting too and the per-row drafting cost is 0 (the model stays
    T = s(n) * curve + R * D(n), learnt on every device)."""
    with policy.lock:
        rows, tokens = trees.tokens.shape[0], trees.tokens.numel()
        if timer.exact:
            policy.batch_times.observe(rows, budget, tokens, timer.last["verify"], drafting, steady=steady)
        else:
            policy.batch_times.observe(rows, budget, tokens, wall, 0.0, steady=steady)
    policy.observe_rows(budget, path_ranks(trees, step.paths, lengths) if budget > 0 else [])


def _drafting_seconds(timer: PhaseTimer) -> float:
    """Seconds spent so far on head forwards and tree searches (the drafters time their phases into `timer`)."""
    return timer.totals.get("draft", 0.0) + timer.totals.get("tree", 0.0)


def _step_budget(policy: BudgetPolicy | None, fixed: int, rows: int) -> int:
    """This step's node budget per row. Fixed budgets stay fixed. The cost-aware rule for one row is the policy's own
    (`BudgetPolicy.next_budget`: whole steps timed, paced probes); for a batch `batch_budget.next_batch_budget` (the
    batch model, paced probes of the other side)."""
    if policy is None:
        return fixed
    if rows == 1:
        return policy.next_budget()
    with policy.lock:
        return next_batch_budget(policy, rows)


def _append(rows: Rows, active: list[int], step: BatchAccepted, stopping_criteria: StoppingCriteriaList,
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


def _row_stop(rows: Rows, b: int, step: BatchAccepted, i: int, stopping_criteria: StoppingCriteriaList) -> int:
    """`stopping.first_stop` on one row for criteria off the fast path (n: no stop). Rows that stopped already are
    not asked again."""
    n = int(step.lengths[i])
    if rows.done[b] is not None:
        return n
    ids = torch.cat([rows.seqs[b], step.tokens[i, :n].to(rows.seqs[b].device)]).unsqueeze(0)
    scores = step.scores[i, :n] if step.scores is not None else None
    stop = first_stop(ids, n, stopping_criteria, scores)
    return n if stop is None else stop


def _retire(rows: Rows, active: list[int], ragged: RaggedCache, drafter: DartDrafter | None, max_length: int,
            pad_finished: bool) -> list[int]:
    """Drop the rows that need no more tokens from the batch (and from the drafter); returns the active rows."""
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
    if keep:
        ragged.select(torch.tensor(keep, device=ragged.valid.device))
        if drafter is not None:
            drafter.select(keep)
    return [active[i] for i in keep]


