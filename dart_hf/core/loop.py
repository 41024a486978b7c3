"""The DART tree decoding loop: prefill, then per step propose -> verify -> accept -> advance -> stop -> stream.

`dart_decode` has the signature of a transformers decoding method, so `GenerationMixin.generate` prepares
everything (GenerationConfig, logits processors and warpers, stopping criteria incl. stop strings, max
length, the DynamicCache) and then hands over to it, either through `custom_generate=dart_decode` or through
the `assistant_model=DartHead` routing installed by `import dart_hf` (see `dart_hf.integrations.transformers`).
The draft half lives in `drafter.py` (shared with chain mode), every temporary change to the target in
`runtime.py`, the per-call results in `stats.py`. A batch (more than one row, or left padding) runs the same checks
and set-up here, then the batched loop of `batch_loop.py`; one unpadded row stays on this loop.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.logits_process import (
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .acceptance import Accepted, accept_greedy, accept_walk
from .batch_loop import check_batch_call, decode_batch, is_batch
from .budget import BudgetPolicy, budget_policy
from .distributed import check_tensor_parallel_call
from .drafter import DartDrafter, default_node_budget
from .modeling import DartHead
from .stats import DartStats, PhaseTimer
from .stopping import first_stop as _first_stop
from .support import check_tree_target
from .target import aux_request, aux_states, cache_kwargs, check_head_matches_target, prepare_head
from .tree import DraftTree
from .verify import compact_cache, tree_forward


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
    batch of left-padded rows (`batch_loop.decode_batch`).

    dart_head: the draft head (checked and placed by `prepare_call`: moved and cast in place to the target's device
    and dtype on the first call with that target).
    dart_streamer: a transformers streamer (transformers does not forward `streamer` to custom decoding callables).
    dart_node_budget: tree size override: an int (0: plain decoding in this loop), or "auto" for the cost-aware
    budget chosen step by step (`dart_hf.core.budget`); default: the head's config (`node_budget=None` there also
    means "auto").
    dart_prompt_lookup: offer prompt-lookup continuations to the tree search; default: the head's config.
    dart_timing: synchronise CUDA around phases so the phase times are exact.
    dart_stats: a `DartStats` to fill (default: a new one); `dart_head.stats` points at it from the start of the call.
    dart_budget_state: a `dart_hf.core.budget.BudgetState` for the cost-aware policy (default: the head's).
    """
    _check_call(model, dart_head, input_ids, generation_config, model_kwargs)
    batched = is_batch(input_ids, model_kwargs.get("attention_mask"))
    check_processors(logits_processor, "a batch" if batched else None)
    head, stats = prepare_call(dart_head, model, dart_stats)
    check_tensor_parallel_call(head, model, mode="tree", batch_size=input_ids.shape[0], node_budget=dart_node_budget,
                               do_sample=bool(generation_config.do_sample))
    _check_model_inputs(model, input_ids, model_kwargs, generation_config)  # after the head / target checks
    cache = _empty_cache(model, model_kwargs)
    if batched:
        check_batch_call(model_kwargs.get("attention_mask"), cache)
    use_lookup = head.config.prompt_lookup if dart_prompt_lookup is None else bool(dart_prompt_lookup)
    policy, budget = _budget(head, model, dart_node_budget, use_lookup, dart_budget_state)
    stats.reset(mode="tree", budget_mode="auto" if policy else "fixed", node_budget=budget)
    timer = PhaseTimer(stats.time, head.device, dart_timing)
    if batched:
        return decode_batch(model, head, input_ids, model_kwargs.get("attention_mask"), cache, logits_processor,
                            stopping_criteria, generation_config, stats=stats, timer=timer, policy=policy,
                            node_budget=budget, prompt_lookup=use_lookup, streamer=dart_streamer)
    drafter = DartDrafter(head, model, max_length=generation_config.max_length, node_budget=budget,
                          prompt_lookup=use_lookup, eos_token_ids=generation_config._eos_token_tensor)
    output = _Output(generation_config)
    accept = _acceptance_rule(generation_config, logits_processor, output.keep)
    if dart_streamer is not None:
        dart_streamer.put(input_ids.cpu())

    aux_ids = head.config.aux_layer_ids
    with timer.phase("prefill"):
        raw, processed, first, aux = _prefill(model, input_ids, cache, logits_processor, generation_config.do_sample,
                                              aux_ids)
        drafter.advance(aux, torch.cat([input_ids[:, 1:], first], dim=1))
    input_ids, n_new, finished = _append(input_ids, first.view(-1), stopping_criteria, processed)
    stats.new_tokens = n_new
    output.add(processed, raw, n_new)
    _stream(dart_streamer, input_ids, n_new)
    while not finished:
        if policy is not None:
            budget = policy.next_budget()
            policy.start()
        past_len, max_new = cache.get_seq_length(), generation_config.max_length - input_ids.shape[1] - 1
        tree = drafter.propose(input_ids, max_new, timer, budget).to(model.device)
        with timer.phase("verify"):
            logits, tree_aux = tree_forward(model, tree, cache, past_len, aux_ids)
        with timer.phase("accept"):
            acc = accept(tree, logits, input_ids)
            compact_cache(cache, past_len, acc.path)
            drafter.advance(tree_aux[:, acc.path.to(tree_aux.device)], acc.tokens)
            input_ids, n_new, finished = _append(input_ids, acc.tokens, stopping_criteria, acc.scores)
        if policy is not None:
            policy.observe_tree(tree, acc.path, budget)
        stats.record_step(n_new, budget)
        output.add(acc.scores, acc.logits, n_new)
        _stream(dart_streamer, input_ids, n_new)

    if dart_streamer is not None:
        dart_streamer.end()
    stats.node_budget = policy.choice if policy is not None else budget
    return output.result(input_ids, cache)


# ------------------------------------------------------------------------------------------------ set-up
def prepare_call(head: DartHead, model, stats: DartStats | None) -> tuple[DartHead, DartStats]:
    """What every DART `generate` call does once with its head, tree loop and chain mode alike, before drafting:
    refuse a head built for another target (`check_head_matches_target`), get the head placed for `model`
    (`prepare_head`: the head itself, moved in place on its first call, or a placed copy; never moved while another
    call may draft with it), and make `stats` (default: a new `DartStats`) the call's, as `head.stats`. Returns (the
    head to draft with, the stats); the caller resets the stats once it knows the mode and node budget."""
    check_head_matches_target(head, model)
    placed = prepare_head(head, model)
    if stats is None:
        stats = DartStats()
    elif not isinstance(stats, DartStats):
        raise TypeError(f"dart_stats must be a dart_hf.DartStats, got {type(stats).__name__}")
    head.stats = stats
    return placed, stats


def _check_call(model, head, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict):
    """Refuse, with the argument to blame, every call the loop cannot run exactly (the head: `prepare_call`)."""
    if not isinstance(head, DartHead):
        raise TypeError(f"dart_decode needs dart_head=<DartHead>, got {type(head).__name__}")
    if model_kwargs.get("synced_gpus"):
        raise ValueError("DART decoding does not support synced_gpus")
    # beams / return sequences first: generate() has already expanded input_ids by them, and a "batch of 2"
    # error would blame the wrong argument
    if generation_config.num_beams != 1 or generation_config.num_return_sequences != 1:
        raise ValueError("DART decoding supports num_beams=1 and num_return_sequences=1")
    if generation_config.cache_implementation not in (None, "dynamic"):
        raise ValueError(
            f"DART decoding needs a DynamicCache (tree entries are compacted in place); "
            f"cache_implementation={generation_config.cache_implementation!r} is not supported"
        )
    check_tree_target(model)


# What `generate` hands the decoding method besides input_ids that this loop honours (position ids: the ones
# `generate` derives itself, `_default_positions`; the output flags: `_check_model_inputs`)
MODEL_INPUTS = frozenset({"attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep",
                          "position_ids", "output_attentions", "output_hidden_states"})


def _unset(value) -> bool:
    """None, False (a flag turned off) or empty (multimodal models get an empty `mm_encoder_outputs` when the call
    has no media)."""
    return value is None or value is False or (isinstance(value, (dict, list, tuple)) and not value)


def _default_positions(model, input_ids: torch.Tensor, attention_mask, positions: torch.Tensor) -> bool:
    """Whether `positions` are the ones `generate` derives when the caller passes none (the model's own rule: image-text
    models add their multimodal axes), which the loop's positions follow."""
    derived = model._prepare_position_ids_for_generation(input_ids, {"attention_mask": attention_mask})
    try:  # (without a mask `generate` derives one row of positions for the whole batch)
        derived = derived.to(positions.device).expand_as(positions)
    except RuntimeError:
        return False
    return torch.equal(derived, positions)


def _check_model_inputs(model, input_ids: torch.Tensor, model_kwargs: dict, generation_config: GenerationConfig):
    """Refuse model inputs the tree loop would not feed the target (it prefills and verifies from input_ids and the
    attention mask alone), so they cannot silently change the text: inputs_embeds, images and other modalities,
    position ids other than the ones `generate` derives from the mask; and per-step attentions / hidden states,
    which a tree forward computes over draft nodes, not the emitted tokens."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("DART tree decoding reads the prompt as input_ids; inputs_embeds is not supported "
                         "(dart_mode=\"chain\" takes it beside input_ids)")
    given = {k for k, v in model_kwargs.items() if not _unset(v)}
    extra = sorted(given - MODEL_INPUTS)
    if extra:
        raise ValueError(f"DART tree decoding feeds the target input_ids and attention_mask only, not {extra} "
                         f"(images, other modalities); dart_mode=\"chain\" (transformers' assisted decoding) passes "
                         f"them to the target")
    positions = model_kwargs.get("position_ids")
    mask = model_kwargs.get("attention_mask")
    if positions is not None and not _default_positions(model, input_ids, mask, positions):
        raise ValueError("DART tree decoding places tokens by the attention mask (as plain generate does when no "
                         "position_ids are passed); custom position_ids are not supported")
    if generation_config.return_dict_in_generate and any(
            model_kwargs.get(f) or getattr(generation_config, f, False)
            for f in ("output_attentions", "output_hidden_states")):
        raise ValueError("DART tree decoding does not return per-token attentions or hidden states (its target "
                         "forwards run over draft trees); output_scores and output_logits are supported")


def check_processors(logits_processor: LogitsProcessorList | None, other_layout: str | None) -> None:
    """Refuse the processors `generate` builds that hold state across calls, which DART cannot feed as plain
    `generate` does. The tree loop on one row calls processors once per new token, in order, with the row as plain
    `generate` shows it, so stateful ones stay exact there; `other_layout` names a call that does not ("a batch":
    each row is processed on its own, at its own pace; chain mode: transformers' assisted loop processes every
    drafted position, rejected ones included). Custom processors are not inspected: the README asks that those
    depend only on their arguments."""
    for processor in logits_processor or ():
        if isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor):
            raise ValueError(
                "guidance_scale (classifier-free guidance) runs the target inside a logits processor, with its own "
                "cache, once per token; DART decoding does not support it (use plain generate)"
            )
        if isinstance(processor, SynthIDTextWatermarkLogitsProcessor) and other_layout:
            raise ValueError(
                f"SynthID watermarking keeps a state that assumes one processor call per token for the whole "
                f"batch; DART cannot keep that order in {other_layout} (it is exact in the default tree mode, "
                f"one row per call)"
            )


def _empty_cache(model, model_kwargs: dict) -> DynamicCache:
    cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    if cache is None:
        cache = DynamicCache(config=model.config)
    if not isinstance(cache, DynamicCache) or cache.get_seq_length() != 0:
        raise ValueError("DART decoding needs an empty DynamicCache (a pre-filled or static cache is not supported)")
    # the verify masks follow the cache's layers (full or sliding window): they must be the target's own
    expected = [type(layer) for layer in DynamicCache(config=model.config).layers]
    got = [type(layer) for layer in cache.layers]
    if got != expected and (got or any(getattr(t, "is_sliding", False) for t in expected)):
        raise ValueError(
            "DART decoding needs a cache with this target's layer types (sliding-window layers included): pass "
            "DynamicCache(config=model.config), or no cache"
        )
    return cache


def _budget(head: DartHead, model, requested, use_lookup: bool, state) -> tuple[BudgetPolicy | None, int]:
    """(the cost-aware policy or None, the node budget it starts from or the fixed one)."""
    if requested == "auto" or (requested is None and head.config.node_budget is None):
        policy = budget_policy(head, model, prompt_lookup=use_lookup, state=state)
        return policy, policy.choice
    if isinstance(requested, str) or (requested is not None and int(requested) < 0):
        raise ValueError(f'dart_node_budget must be an int >= 0 or "auto", got {requested!r}')
    return None, int(requested) if requested is not None else default_node_budget(head, model)


# ------------------------------------------------------------------------------------------------ the steps
def _prefill(model, input_ids, cache, logits_processor, do_sample: bool, aux_ids: list[int]):
    """(raw logits, processed scores, first new token [1, 1], the layer inputs the head reads [1, S, 3H]) of the
    prompt, the token chosen as `generate` chooses it."""
    out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache),
                **aux_request(aux_ids))
    raw = out.logits[:, -1].float()
    processed = logits_processor(input_ids, raw.clone())
    aux = aux_states(out, aux_ids)
    if do_sample:
        return raw, processed, torch.multinomial(torch.softmax(processed, dim=-1), 1), aux
    return raw, processed, processed.argmax(dim=-1, keepdim=True), aux


def _acceptance_rule(generation_config: GenerationConfig, logits_processor: LogitsProcessorList, keep_scores: bool):
    """accept(tree, logits, input_ids) -> Accepted: the vectorised greedy rule when nothing processes the logits,
    else the walk that applies the processors per visited node."""
    do_sample = bool(generation_config.do_sample)
    if not do_sample and len(logits_processor) == 0:
        return lambda tree, logits, input_ids: accept_greedy(tree, logits, keep_scores)

    def walk(tree: DraftTree, logits: torch.Tensor, input_ids: torch.Tensor) -> Accepted:
        return accept_walk(tree, logits, input_ids, logits_processor, do_sample)

    return walk


def _append(input_ids, tokens: torch.Tensor, stopping_criteria: StoppingCriteriaList, scores):
    """(input_ids + the new tokens up to the first stop, how many were kept, whether generation stops)."""
    n_new = tokens.numel()
    input_ids = torch.cat([input_ids, tokens.view(1, -1).to(input_ids.device)], dim=1)
    stop = _first_stop(input_ids, n_new, stopping_criteria, scores)
    if stop is None:
        return input_ids, n_new, False
    return input_ids[:, : input_ids.shape[1] - n_new + stop + 1], stop + 1, True


def _stream(streamer, input_ids: torch.Tensor, n_new: int) -> None:
    if streamer is not None:
        streamer.put(input_ids[0, input_ids.shape[1] - n_new :].cpu())


# ------------------------------------------------------------------------------------------------ output
class _Output:
    """The processed scores / raw logits of every new token when `return_dict_in_generate` asks for them."""

    def __init__(self, generation_config: GenerationConfig):
        self.config = generation_config
        self.keep = bool(generation_config.return_dict_in_generate) and bool(
            generation_config.output_scores or generation_config.output_logits
        )
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def add(self, scores: torch.Tensor | None, logits: torch.Tensor | None, n_new: int) -> None:
        """Rows [n, vocab] of the step's tokens; the first `n_new` are kept (the rest followed a stop)."""
        if self.keep:
            self.scores.extend(scores[:n_new].unsqueeze(1))
            self.logits.extend(logits[:n_new].unsqueeze(1))

    def result(self, input_ids: torch.Tensor, cache: DynamicCache):
        if not self.config.return_dict_in_generate:
            return input_ids
        return GenerateDecoderOnlyOutput(
            sequences=input_ids,
            scores=tuple(self.scores) if self.config.output_scores else None,
            logits=tuple(self.logits) if self.config.output_logits else None,
            cache=cache if self.config.use_cache else None,
        )
