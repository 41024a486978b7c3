"""The DART decoding loop, for one row or a batch, on either step backend: prefill, then per step
budget -> draft -> verify -> accept -> commit (the backend's `step`) -> stop -> stream. Same output as plain
`generate` (greedy: token for token; sampling: the same distribution).

`dart_decode` has the signature of a transformers decoding method, so `GenerationMixin.generate` prepares
everything (GenerationConfig, logits processors and warpers, stopping criteria incl. stop strings, max length) and
then hands over to it, either through `custom_generate=dart_decode` or through the `assistant_model=DartHead` routing
installed by `import dart_hf` (see `dart_hf.integrations.transformers`).

The step (`step.DartStep`): over a `DynamicCache` (any tree size per step, finished rows leave the batch) or, where the
call asks for a static cache, a `StaticCache` with every shape fixed (a short ladder of tree sizes held per shape, a
graph each, captured by `torch.compile` before the call decodes). It drafts with `drafter.DartDrafter`, verifies with `target.target_forward` and accepts with the
call's `acceptance.StepAcceptance`. The node budget of each step is `budget.CallBudget`'s. Refusals: `checks.py`; the
rows as `generate` holds, returns and streams them, and where each row stops: `rows.py`.

What plain batched `generate` does, and how it is kept:
- Positions: a left-padded row counts from its first real token (cumsum of the attention mask - 1); the prefill is
  the same call `generate` makes (2D mask and those position ids).
- Logits processors see the row exactly as `generate` gives it (left padding included, length prompt + t), at its
  own batch index (`rows.RowProcessor`). In a batch they are called once per row and token, not once per token for
  the batch, so state kept across calls would see other calls than in `generate` (SynthID is refused there).
- Sampling: the target's own draw at each visited node, at a uniform given by each row's seed and the token's position
  (`acceptance`): the same seed gives the same text at every node budget and on either backend, but not plain
  `generate`'s text (it draws with `torch.multinomial`).

A static call at a node budget of 0 (asked for, or the size rule's choice for its shape: `BudgetPolicy.call_budget`) is
plain decoding for the whole call, transformers' own loop (`_plain_call`): plain `generate`'s tokens and sampled text.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from .acceptance import BatchAccepted, StepAcceptance
from .budget import CallBudget, budget_policy, ladder_around, wants_size_rule
from .checks import (check_cache, check_call, check_embeds, check_inputs, check_model_inputs, check_node_budget,
                     check_padding, check_processors, eager_cache, is_batch, prepare_call)
from .distributed import check_tensor_parallel_call
from .drafter import DartDrafter, batch_bucket, bucket
from .modeling import DartHead
from .rows import (ColumnStream, Rows, fast_criteria, final_length, first_stop, first_stops, result,
                   scores_after_stop)
from .step import DartStep, dynamic_step, fixed_step, static_requested
from .stats import DartStats, PhaseTimer
from .target import aux_request, aux_states, cache_kwargs, check_head_matches_target


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
    batch of left-padded rows. The `dart_*` options: README "Options" (dart_streamer: a transformers streamer, which
    transformers does not forward to custom decoding callables). Every check runs before anything changes: a refused
    call leaves the head, its stats and the target as they were."""
    config, mask = generation_config, model_kwargs.get("attention_mask")
    _check(model, dart_head, input_ids, mask, logits_processor, config, model_kwargs, dart_node_budget)
    head, stats = prepare_call(dart_head, model, dart_stats)
    stats.reset(mode="tree", budget_mode="fixed", node_budget=None)
    timer = PhaseTimer(stats.time, head.device, dart_timing)
    lookup = head.config.prompt_lookup if dart_prompt_lookup is None else bool(dart_prompt_lookup)
    budgets = _call_budget(head, model, dart_node_budget, lookup, dart_budget_state, bool(config.do_sample))
    rows = Rows(input_ids, torch.ones_like(input_ids) if mask is None else mask.to(torch.long))
    keep = bool(config.return_dict_in_generate) and bool(config.output_scores or config.output_logits)
    accept = StepAcceptance(logits_processor, bool(config.do_sample), rows, keep, model.device)
    backend = _backend(model, head, input_ids, mask, rows, config, model_kwargs, budgets, lookup, accept,
                       dart_budget_state)
    if backend is None:  # plain decoding for the whole call
        return _plain_call(model, input_ids, logits_processor, stopping_criteria, config, dart_streamer, budgets, stats,
                           model_kwargs)
    stats.budget_mode, stats.node_budget, stats.acceptance = budgets.mode, budgets.fixed, accept.mode
    pad_id, pad_finished = config._pad_token_tensor, any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    out_stream = ColumnStream(dart_streamer, rows, pad_id)
    if dart_streamer is not None:
        dart_streamer.put(input_ids.cpu())

    accept.start()
    with timer.phase("prefill"):
        step = _prefill(model, input_ids, mask, rows, backend, accept, head.config.aux_layer_ids)
    active, budget = list(range(len(rows))), budgets.fixed
    stats.new_tokens = _append(rows, active, step, stopping_criteria, config.max_length, pad_finished, keep)
    active = _retire(rows, active, backend, config.max_length, pad_finished)
    out_stream.flush(active)
    while active:
        budget = budgets.next(len(active))
        trees, step = backend.step(budget, [config.max_length - rows.length(b) - 1 for b in active], accept, active,
                                   timer)
        with timer.phase("accept"):
            n_new = _append(rows, active, step, stopping_criteria, config.max_length, pad_finished, keep)
        budgets.observe(budget, trees, step)
        stats.record_step(n_new, budget)
        active = _retire(rows, active, backend, config.max_length, pad_finished)
        out_stream.flush(active)

    total = final_length(rows, pad_finished)
    if keep and pad_finished:
        scores_after_stop(model, rows, total, logits_processor, pad_id)
    out_stream.flush([], total)
    if dart_streamer is not None:
        dart_streamer.end()
    stats.node_budget = budget
    stats.static, stats.compiled, stats.static_reason = backend.static, backend.compiled, backend.reason
    return result(rows, total, pad_id, config, keep, cache=backend.returned_cache)


# ------------------------------------------------------------------------------------------------ the call's setup
def _check(model, head, input_ids, mask, logits_processor, config, model_kwargs, node_budget) -> None:
    """Every refusal of a tree call, before anything changes (`checks.py`; a tensor-parallel target: every rank the
    same call, `distributed.check_tensor_parallel_call`). The prompt's own checks (`check_inputs`) are chain mode's
    too; `mask` is None where transformers dropped an all-ones mask (its length: `check_model_inputs`)."""
    check_call(model, head, input_ids, config, model_kwargs)
    check_embeds(model_kwargs)
    check_inputs(model, input_ids, mask, "tree")
    check_head_matches_target(head, model)
    check_node_budget(node_budget)
    check_processors(logits_processor, "a batch" if is_batch(input_ids, mask) else None)
    check_padding(input_ids, mask)
    check_model_inputs(model, input_ids, model_kwargs, config)
    check_cache(model_kwargs)
    check_tensor_parallel_call(head, model, mode="tree", batch_size=input_ids.shape[0], node_budget=node_budget,
                               do_sample=bool(config.do_sample))


def _call_budget(head: DartHead, model, requested, lookup: bool, state, sampled: bool) -> CallBudget:
    """The call's budget: the size rule's (`wants_size_rule`; sampled and greedy calls learn apart), else fixed (the
    request, or the head config's)."""
    if wants_size_rule(head, requested):
        policy = budget_policy(head, model, prompt_lookup=lookup, state=state, sampled=sampled)
        return CallBudget(policy, policy.choice, model)  # (`fixed`: the size the eager drafter is made for)
    return CallBudget(None, head.config.node_budget if requested is None else requested, model)


def _backend(model, head, input_ids, mask, rows: Rows, config: GenerationConfig, model_kwargs: dict,
             budgets: CallBudget, lookup: bool, accept: StepAcceptance, state) -> DartStep | None:
    """The fixed-shape step when the call asks for a static cache and it can run it, else the step over a
    `DynamicCache`; None: the call asks for a static cache at a budget of 0 (plain decoding for the call,
    `_plain_call`). A fixed step's tree size: the fixed one, or (the size rule) the shape's held size and its
    neighbours on the ladder, chosen per step by a policy of that shape's own (`CallBudget.use`)."""
    static, reason = None, None
    if static_requested(config, model_kwargs):
        shape = (batch_bucket(len(rows)), bucket(config.max_length), accept.vectorised)
        budget = budgets.call_budget(len(rows), shape)
        if budget == 0:
            return None
        sizes = (budget,) if budgets.policy is None else ladder_around(budget, budgets.policy.candidates)
        static, reason = fixed_step(model, head, input_ids, mask, config, sizes, lookup, head.config.aux_layer_ids,
                                    accept.vectorised)
    if static is not None:
        if len(static.sizes) == 1:
            budgets.hold(static.sizes[0])
        else:
            budgets.use(budget_policy(head, model, prompt_lookup=lookup, state=state, sampled=accept.do_sample,
                                      ladder=(static.sizes, shape)))
        if not accept.vectorised:
            static.reason = "; ".join(filter(None, [static.reason, (
                "acceptance walks the tree eagerly between the captured draft / verify and commit (logits "
                "processors the device walk does not run, or returned scores)")]))
        return static
    drafter = DartDrafter(head, model, max_length=config.max_length, node_budget=budgets.fixed, prompt_lookup=lookup,
                          eos_token_ids=config._eos_token_tensor, rows=len(rows))
    cache = eager_cache(model, model_kwargs if reason is None else {})  # a refused StaticCache: a new cache
    backend = dynamic_step(model, drafter, cache, rows.lefts, config.max_length, head.config.aux_layer_ids)
    backend.reason = "; ".join(filter(None, [reason, _past_context(model, rows)])) or None
    return backend


def _past_context(model, rows: Rows) -> str | None:
    """Which rows' prompts are at or past the target's context (`max_position_embeddings`), said in
    `DartStats.static_reason`: the drafter drafts no position there (`DartDrafter.start`), so those rows decode
    plainly, as plain `generate` decodes them; None: no such row."""
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    past = [b for b, left in enumerate(rows.lefts) if context and rows.prompt - left >= context]
    if not past:
        return None
    which = f"the prompt of row {past[0]}" if len(past) == 1 else f"the prompts of rows {past}"
    return f"{which} at or past the target's context ({context} tokens): decoded plainly"


def _prefill(model, input_ids, attention_mask, rows: Rows, backend: DartStep, accept: StepAcceptance,
             aux_ids: list[int]) -> BatchAccepted:
    """The prompts' forward `generate` runs (2D mask, positions counted from each row's first real token) into the
    backend's cache, and its choice of each row's first token; the backend gets the layer inputs the head reads.
    Rows past the call's (`backend.cache_rows`) are copies of the first."""
    n, extra = len(rows), backend.cache_rows - len(rows)
    more = lambda t: torch.cat([t, t[:1].expand(extra, *t.shape[1:])]) if extra else t
    mask = more(rows.mask)
    positions = (mask.cumsum(dim=-1) - 1).masked_fill(mask == 0, 0)
    out = model(input_ids=more(input_ids), attention_mask=None if attention_mask is None else mask,
                position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kwargs(model, backend.cache),
                **aux_request(aux_ids))
    raw = out.logits[:n, -1].float()
    processed, first = accept.first(input_ids, raw)
    backend.start(more(input_ids), rows.lefts + rows.lefts[:1] * extra, aux_states(out, aux_ids), more(first))
    one = torch.ones(len(rows), dtype=torch.long)
    return BatchAccepted(paths=torch.zeros_like(one).unsqueeze(1), lengths=one, tokens=first.unsqueeze(1),
                         scores=processed.unsqueeze(1), logits=raw.unsqueeze(1))


def _plain_call(model, input_ids, logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList,
                config: GenerationConfig, streamer, budgets: CallBudget, stats: DartStats, model_kwargs: dict):
    """Plain decoding for the whole call: transformers' own loop (`_sample`) on the cache and with the arguments
    `generate` prepared, compiled where plain `generate` compiles, so the call is plain `generate`'s, sampled text
    included. Where a static call's budget is 0: asked for, or the size rule's choice for the call's shape."""
    if streamer is not None:
        streamer.put(input_ids.cpu())
    out = model._sample(input_ids, logits_processor, stopping_criteria, config, streamer=streamer, **model_kwargs)
    stats.budget_mode, stats.node_budget = budgets.mode, 0
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    for _ in range(sequences.shape[-1] - input_ids.shape[-1] - 1):  # the decoding steps, one token each
        stats.record_step(1, 0)
    stats.new_tokens += 1  # the prefill's token
    stats.static, stats.compiled = True, bool(model._valid_auto_compile_criteria(model_kwargs, config))
    stats.static_reason = ("plain decoding for the call (transformers' own loop): " + (
        "node budget 0" if budgets.policy is None else "the size rule's choice for this shape"))
    return out


# ------------------------------------------------------------------------------------------------ after a step
def _append(rows: Rows, active: list[int], step: BatchAccepted, stopping_criteria: StoppingCriteriaList,
            max_length: int, pad_finished: bool, keep: bool) -> int:
    """Append each active row's new tokens up to its first stop (`rows.first_stops`); record where rows stop.
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
    """`rows.first_stop` on one row for criteria off the fast path (n: no stop). Rows that stopped already are
    not asked again."""
    n = int(step.lengths[i])
    if rows.done[b] is not None:
        return n
    ids = torch.cat([rows.seqs[b], step.tokens[i, :n].to(rows.seqs[b].device)]).unsqueeze(0)
    scores = step.scores[i, :n] if step.scores is not None else None
    stop = first_stop(ids, n, stopping_criteria, scores)
    return n if stop is None else stop


def _retire(rows: Rows, active: list[int], backend: DartStep, max_length: int, pad_finished: bool) -> list[int]:
    """The rows that need more tokens (the backend keeps only those); returns them."""
    all_done = all(d is not None for d in rows.done)
    final = max((d for d in rows.done if d is not None), default=0)

    def finished(b: int) -> bool:
        if rows.length(b) >= max_length:
            return True
        if pad_finished:
            return rows.done[b] is not None
        return all_done and rows.length(b) >= final

    keep = [i for i, b in enumerate(active) if not finished(b)]
    backend.retire(keep)
    return [active[i] for i in keep]
