"""The DART tree decoding loop: prompt -> head -> tree -> verify -> accept, one target forward per step.

`dart_decode` has the signature of a transformers decoding method, so `GenerationMixin.generate` prepares
everything (GenerationConfig, logits processors and warpers, stopping criteria incl. stop strings, max
length, the DynamicCache) and then hands over to it, either through `custom_generate=dart_decode` or through
the `assistant_model=DartHead` routing installed by `import dart_hf` (see `dart_hf.integrations.transformers`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import Accepted, accept_greedy, accept_walk
from .cpu_linear import few_row_linears
from .modeling import DartHead
from .prompt_lookup import lookup_for_tree
from .target import AuxHiddenCapture
from .tree import TreeSearchParams, build_tree
from .verify import compact_cache, verify_tree


class StepTimer:
    """Accumulates wall time per phase; synchronises CUDA only when timing was asked for."""

    def __init__(self, device: torch.device, enabled: bool):
        self.sync = enabled and device.type == "cuda"
        self.totals: dict[str, float] = {}
        self.last: dict[str, float] = {}  # the latest duration of each phase

    @contextmanager
    def phase(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        self.last[name] = time.perf_counter() - start
        self.totals[name] = self.totals.get(name, 0.0) + self.last[name]


def _check_supported(model, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict):
    # beams / return sequences first: generate() has already expanded input_ids by them, and a "batch of 2"
    # error would blame the wrong argument
    if generation_config.num_beams != 1 or generation_config.num_return_sequences != 1:
        raise ValueError("DART decoding supports num_beams=1 and num_return_sequences=1")
    if input_ids.shape[0] != 1:
        raise ValueError(f"DART decoding supports batch size 1, got a batch of {input_ids.shape[0]}")
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"DART decoding needs a DynamicCache (tree entries are compacted in place); "
            f"cache_implementation={generation_config.cache_implementation!r} is not supported"
        )
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise ValueError("DART decoding does not support padded inputs (attention_mask with zeros)")
    max_pos = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_pos is not None and generation_config.max_length > max_pos:
        raise ValueError(
            f"max_length {generation_config.max_length} (prompt {input_ids.shape[1]} + new tokens) exceeds the "
            f"target's context of {max_pos} positions"
        )


def _first_stop(
    input_ids: torch.Tensor, n_new: int, stopping_criteria: StoppingCriteriaList, scores
) -> int | None:
    """Index (0-based, within the n_new tokens just appended) of the first token after which generation stops,
    checking every prefix as plain generate would have, one token at a time.

    Fast path for the usual criteria (max length, EOS): arithmetic plus one vectorised EOS lookup, one host sync
    per step instead of one per new token."""
    start = input_ids.shape[1] - n_new
    if all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria):
        limit = n_new  # index of the first stopping token; n_new: none
        for c in stopping_criteria:
            if type(c) is MaxLengthCriteria:
                limit = min(limit, max(c.max_length - start - 1, 0))
        span = input_ids[0, start : start + limit]
        for c in stopping_criteria:
            if type(c) is EosTokenCriteria and span.numel():
                c.eos_token_id = c.eos_token_id.to(input_ids.device)  # as EosTokenCriteria itself does
                hit = torch.isin(span, c.eos_token_id).nonzero()
                if hit.numel():
                    limit = int(hit[0, 0])
                    span = span[:limit]
        return limit if limit < n_new else None
    for j in range(n_new):
        if bool(stopping_criteria(input_ids[:, : start + j + 1], scores).any()):
            return j
    return None


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
    **model_kwargs,
):
    """Generate with DART tree speculation. Same result as greedy / sampled `generate` (lossless).

    dart_head: the draft head. dart_streamer: a transformers streamer (transformers does not forward
    `streamer` to custom decoding callables, so the routing passes it under this name).
    dart_node_budget: tree size override: an int, or "auto" for the cost-aware budget chosen step by step
    (`dart_hf.core.budget`); default: the head's config (`node_budget=None` there also means "auto").
    dart_prompt_lookup: offer prompt-lookup continuations to the tree search (`dart_hf.core.prompt_lookup`); default:
    the head's config (`prompt_lookup`).
    dart_timing: synchronise CUDA around phases so `head.stats` timings are exact.
    """
    if not isinstance(dart_head, DartHead):
        raise TypeError(f"dart_decode needs dart_head=<DartHead>, got {type(dart_head).__name__}")
    if model_kwargs.get("synced_gpus"):
        raise ValueError("DART decoding does not support synced_gpus")
    head = dart_head
    _check_supported(model, input_ids, generation_config, model_kwargs)
    head.bind_target(model)
    cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    if cache is None:
        cache = DynamicCache(config=model.config)
    if not isinstance(cache, DynamicCache) or cache.get_seq_length() != 0:
        raise ValueError("DART decoding needs an empty DynamicCache (a pre-filled or static cache is not supported)")

    do_sample = bool(generation_config.do_sample)
    fast_greedy = not do_sample and len(logits_processor) == 0
    keep_scores = bool(generation_config.return_dict_in_generate) and bool(
        generation_config.output_scores or generation_config.output_logits
    )
    eos = generation_config._eos_token_tensor
    eos = eos.to(head.device).view(-1) if eos is not None else None
    use_lookup = head.config.prompt_lookup if dart_prompt_lookup is None else bool(dart_prompt_lookup)
    controller = None
    if dart_node_budget == "auto" or (dart_node_budget is None and head.config.node_budget is None):
        from .budget import budget_controller

        controller = budget_controller(head, model, prompt_lookup=use_lookup)
        budget = controller.max_budget
    elif isinstance(dart_node_budget, str) or (dart_node_budget is not None and int(dart_node_budget) < 1):
        raise ValueError(f'dart_node_budget must be a positive int or "auto", got {dart_node_budget!r}')
    else:
        budget = dart_node_budget or head.node_budget_for(model)
    params = TreeSearchParams.from_config(head.config, node_budget=budget)
    budgets: list[int] = []
    ngram = head.ngram.to(head.device) if head.ngram is not None else None
    draft_to_target = head.draft_to_target
    timer = StepTimer(head.device, dart_timing)
    exact_verify_time = model.device.type == "cpu" or timer.sync  # else phase times are launch times only
    all_scores, all_logits, accepted_lengths = [], [], []
    if dart_streamer is not None:
        dart_streamer.put(input_ids.cpu())

    with AuxHiddenCapture(model, head.config.aux_layer_ids) as capture, few_row_linears(model, head):
        with timer.phase("prefill"):
            out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
            raw = out.logits[:, -1].float()
            processed = logits_processor(input_ids, raw.clone())
            if do_sample:
                first = torch.multinomial(torch.softmax(processed, dim=-1), 1)
            else:
                first = processed.argmax(dim=-1, keepdim=True)
            aux = capture.take(head.device)
        if keep_scores:
            all_scores.append(processed)
            all_logits.append(raw)
        input_ids = torch.cat([input_ids, first.to(input_ids.device)], dim=1)
        if dart_streamer is not None:
            dart_streamer.put(first.cpu())
        head_cache = head.new_cache(capacity=generation_config.max_length + head.config.num_predictions)
        next_tokens = input_ids[:, 1:]
        finished = _first_stop(input_ids, 1, stopping_criteria, processed) is not None

        while not finished:
            step_start = time.perf_counter()
            if controller is not None:
                params.node_budget = controller.next_budget()
            remaining = generation_config.max_length - input_ids.shape[1]
            past_len = cache.get_seq_length()
            with timer.phase("draft"):
                depth = max(1, min(params.node_budget, remaining - 1, head.config.num_predictions))
                draft_logits = head.draft(aux, next_tokens.to(head.device), head_cache, depth=depth)
            with timer.phase("tree"):
                lookup = lookup_for_tree(input_ids[0], depth, head.config, head.device) if use_lookup else None
                tree = build_tree(
                    draft_logits,
                    root_token=input_ids[0, -1],
                    context=input_ids[0, -8:],
                    params=params,
                    ngram=ngram,
                    draft_to_target=draft_to_target,
                    eos_token_ids=eos,
                    max_depth=remaining - 1,
                    lookup=lookup,
                )
                tree = tree.to(model.device)
            with timer.phase("verify"):
                logits = verify_tree(model, tree, cache, past_len)
                tree_aux = capture.take(head.device)
            with timer.phase("accept"):
                if fast_greedy:
                    acc: Accepted = accept_greedy(tree, logits, keep_scores)
                else:
                    acc = accept_walk(tree, logits, input_ids, logits_processor, do_sample)
                compact_cache(cache, past_len, acc.path)
                aux = tree_aux[:, acc.path.to(tree_aux.device)]
                next_tokens = acc.tokens.view(1, -1)
                input_ids = torch.cat([input_ids, acc.tokens.view(1, -1).to(input_ids.device)], dim=1)
                n_new = acc.tokens.numel()
                stop = _first_stop(input_ids, n_new, stopping_criteria, acc.scores)
                if stop is not None:
                    input_ids = input_ids[:, : input_ids.shape[1] - n_new + stop + 1]
                    n_new, finished = stop + 1, True
            if controller is not None:
                verify_s = timer.last["verify"] if exact_verify_time else None
                controller.observe_tree(tree, acc.path, params.node_budget, time.perf_counter() - step_start, verify_s)
            budgets.append(params.node_budget)
            accepted_lengths.append(n_new)
            if keep_scores:
                all_scores.extend(acc.scores[:n_new].unsqueeze(1))
                all_logits.extend(acc.logits[:n_new].unsqueeze(1))
            if dart_streamer is not None:
                dart_streamer.put(input_ids[0, input_ids.shape[1] - n_new :].cpu())

    if dart_streamer is not None:
        dart_streamer.end()
    steps = len(accepted_lengths)
    head.stats = {
        "steps": steps,
        "new_tokens": 1 + sum(accepted_lengths),
        "accepted_lengths": accepted_lengths,
        "mean_accepted_length": sum(accepted_lengths) / steps if steps else 0.0,
        "node_budget": controller.best() if controller is not None else params.node_budget,
        "node_budgets": budgets,
        "budget_mode": "auto" if controller is not None else "fixed",
        "time": dict(timer.totals),
    }
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=input_ids,
            scores=tuple(all_scores) if generation_config.output_scores else None,
            logits=tuple(all_logits) if generation_config.output_logits else None,
            cache=cache if generation_config.use_cache else None,
        )
    return input_ids
