"""How `target.generate(..., assistant_model=DartHead)` and pipelines reach DART.

`import dart_hf` wraps two methods of `transformers.GenerationMixin` and one pipeline helper, and nothing else:

- `generate`: when `assistant_model` is a `DartHead`, the call is forwarded to the original `generate` with
  `custom_generate=dart_decode` (transformers' own hook for a decoding-method callable), so transformers still
  prepares the GenerationConfig, processors, stopping criteria and cache. `streamer` is passed as `dart_streamer`
  because transformers does not forward it to custom callables, and stop strings become a `StopStringCriteria`
  here because transformers drops `tokenizer` for custom callables. `dart_mode="chain"` instead runs transformers'
  own assisted-decoding loop with the head as a chain drafter. `assistant_model` may also name a head's folder or
  Hub id (loaded once per process). Any other call goes to the original `generate` untouched.

Nothing else is patched, registered or changed, at import or during a call: the target's layer inputs come back from
its own forward (`output_hidden_states` with the layer indices, which transformers collects per call), the tree mask
goes in as the forward's `attention_mask`, and every piece of per-call state lives in the call (tests/
test_concurrency.py runs DART and plain calls side by side on one target).
- `_get_candidate_generator`: returns a `DartCandidateGenerator` when the assistant is a `DartHead` (chain mode),
  and defers to the original otherwise.
- `transformers.pipelines.base.load_assistant_model`: accepts a `DartHead` (it shares the target's tokenizer by
  construction; the original compares special-token ids the head's config does not have), so
  `pipeline(..., assistant_model=head)` works.
"""

from __future__ import annotations

import contextvars
import copy
import functools
import os
import time
from dataclasses import dataclass

import torch
import transformers.pipelines.base as pipelines_base
from transformers import GenerationMixin, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from ..core.distributed import check_tensor_parallel_call, shared_budget, tensor_parallel_group
from ..core.drafter import DartDrafter, default_node_budget, draft_depth
from ..core.checks import check_processors, prepare_call
from ..core.loop import dart_decode
from ..core.modeling import DartHead
from ..core.stats import DartStats, PhaseTimer
from ..core.support import check_chain_target, check_tree_target
from ..core.target import aux_request, aux_states, check_head_matches_target

MODES = ("tree", "chain")


@dataclass
class _ChainCall:
    """What the chain-mode `generate` call set up for the candidate generator transformers builds inside it."""

    head: DartHead  # placed for the target (`prepare_call`)
    stats: DartStats
    node_budget: int


_CHAIN_CALL: contextvars.ContextVar[_ChainCall | None] = contextvars.ContextVar("dart_chain_call", default=None)


class DartCandidateGenerator(CandidateGenerator):
    """The head as a chain drafter inside transformers' `_assisted_decoding` loop.

    Each call proposes the best deepest path of the drafter's tree (`DartDrafter`, the same draft + tree search as
    the tree loop); transformers verifies it (greedy match or exact sampling of a deterministic draft). After each
    target forward, `update_candidate_strategy` hands the verified positions' states to the drafter.
    """

    requires_model_outputs = True  # transformers hands `get_candidates` the latest target forward's outputs

    def __init__(self, head: DartHead, target, generation_config, call: _ChainCall):
        self.stats, self.node_budget = call.stats, call.node_budget
        self.aux_ids = head.config.aux_layer_ids
        self.model_kwargs_overrides = aux_request(self.aux_ids)  # the target returns the layer inputs the head reads
        self.max_length = generation_config.max_length
        self.drafter = DartDrafter(head, target, max_length=self.max_length, node_budget=call.node_budget,
                                   prompt_lookup=head.config.prompt_lookup,
                                   eos_token_ids=generation_config._eos_token_tensor)
        self.timer = PhaseTimer(call.stats.time, head.device)
        self.seen = 0  # positions whose target states the drafter has received
        self._proposed_at = 0.0

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one call proposes (transformers >= 5.25 sizes the cache's rollback history by it)."""
        return draft_depth(self.drafter.params, self.max_length, self.drafter.head.config.num_predictions)

    def get_candidates(self, input_ids: torch.LongTensor, is_first_iteration: bool = False, model_outputs=None,
                       **kwargs):
        if is_first_iteration:
            self.drafter.start(input_ids[:, 0])
        else:  # first: the target's prefill produces the states we read
            rows = input_ids.shape[1] - 1 - self.seen  # the positions the latest forward verified
            self.drafter.advance(aux_states(model_outputs, self.aux_ids)[:, :rows], input_ids[:, self.seen + 1 :])
            self.seen += rows
        max_new = self.max_length - input_ids.shape[1] - 1
        if not is_first_iteration and max_new > 0:
            tree = self.drafter.propose([max_new], self.timer).trees[0]
            chain = tree.tokens[tree.best_chain()[1:]].to(input_ids.device)
            input_ids = torch.cat([input_ids, chain.unsqueeze(0)], dim=1)
        self._proposed_at = time.perf_counter()
        return input_ids, None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        first = self.seen == 0
        self.timer.add("prefill" if first else "verify", time.perf_counter() - self._proposed_at)
        if first:
            self.stats.new_tokens = 1
        else:
            self.stats.record_step(int(num_matches) + 1, self.node_budget)


_original_generate = GenerationMixin.generate
_original_get_candidate_generator = GenerationMixin._get_candidate_generator
_original_load_assistant_model = pipelines_base.load_assistant_model


def _stop_strings_as_criteria(model, kwargs: dict) -> None:
    """Turn `stop_strings` + `tokenizer` into a `StopStringCriteria` among the stopping criteria, in place.

    transformers drops `tokenizer` before a `custom_generate` callable, and then refuses stop strings without one;
    the criterion it would have built is the same object, so the output is plain `generate`'s."""
    tokenizer = kwargs.pop("tokenizer", None)
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.get("stop_strings", getattr(config, "stop_strings", None))
    if tokenizer is None or stop_strings is None:
        return  # without a tokenizer transformers raises its own error
    kwargs.pop("stop_strings", None)
    if getattr(config, "stop_strings", None) is not None:
        config = copy.deepcopy(config)
        config.stop_strings = None
        kwargs["generation_config"] = config
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    kwargs["stopping_criteria"] = criteria


def _chain_generate(model, head: DartHead, args, kwargs):
    """transformers' assisted decoding with the head as chain drafter.

    `prepare_call` (the tree loop's, run before transformers sees the head: its own assistant checks would otherwise
    fail first with misleading advice, e.g. "different tokenizers" for a vocab mismatch) checks and places the head."""
    placed, stats = prepare_call(head, model, kwargs.pop("dart_stats", None))
    config = kwargs.get("generation_config") or model.generation_config
    check_tensor_parallel_call(placed, model, mode="chain", batch_size=1,
                               do_sample=bool(kwargs.get("do_sample", config.do_sample)))
    budget = shared_budget(tensor_parallel_group(model), default_node_budget(head, model), model)
    stats.reset(mode="chain", budget_mode="auto" if head.config.node_budget is None else "fixed", node_budget=budget)
    token = _CHAIN_CALL.set(_ChainCall(placed, stats, budget))
    try:
        return _original_generate(model, *args, assistant_model=head, **kwargs)
    finally:
        _CHAIN_CALL.reset(token)


def _check_chain_inputs(args: tuple, kwargs: dict) -> None:
    """Chain mode is transformers' assisted decoding, which runs one row: say so, and where batches do run. The head
    drafts from token ids: chain mode needs them even where the target reads inputs_embeds."""
    ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] > 1:
        raise ValueError(
            f'DART dart_mode="chain" (transformers\' assisted decoding) supports batch size 1, got a batch of '
            f'{ids.shape[0]}; the default dart_mode="tree" decodes batches'
        )
    if kwargs.get("inputs_embeds") is not None and (not isinstance(ids, torch.Tensor) or ids.numel() == 0):
        raise ValueError('DART dart_mode="chain" needs input_ids (the head drafts from them) beside inputs_embeds')
    config = kwargs.get("generation_config")
    if kwargs.get("output_hidden_states") or getattr(config, "output_hidden_states", False):
        raise ValueError('DART dart_mode="chain" asks the target for the hidden states its head reads, so it cannot '
                         "also return per-token hidden states (output_hidden_states)")


def _check_chain_stops(model, kwargs: dict) -> None:
    """Chain mode is transformers' assisted decoding, which checks stopping criteria and stop strings once per step,
    on the sequence's end: a stop met inside an accepted chain is passed over and the text runs on (transformers does
    the same with any assistant). That would be other text than plain `generate`, so it is refused."""
    config = kwargs.get("generation_config") or model.generation_config
    stop_strings = kwargs.get("stop_strings", getattr(config, "stop_strings", None))
    if kwargs.get("stopping_criteria") or stop_strings:
        raise ValueError(
            'DART dart_mode="chain" runs transformers\' assisted decoding, which checks stopping criteria and stop '
            "strings only at the end of each accepted chain and so can run past a stop plain generate makes; the "
            'default dart_mode="tree" honours them exactly'
        )


@functools.wraps(_original_generate)
def _generate(self, *args, assistant_model=None, **kwargs):
    if isinstance(assistant_model, (str, os.PathLike)) and _names_a_head(os.fspath(assistant_model)):
        assistant_model = _head_named(os.fspath(assistant_model))
    if not isinstance(assistant_model, DartHead):
        return _original_generate(self, *args, assistant_model=assistant_model, **kwargs)
    mode = kwargs.pop("dart_mode", "tree")
    if mode not in MODES:
        raise ValueError(f"dart_mode must be one of {MODES}, got {mode!r}")
    if kwargs.get("custom_generate") is not None:
        raise ValueError("assistant_model=DartHead already selects the decoding loop; drop custom_generate")
    if mode == "chain":
        check_chain_target(self)
        _check_chain_inputs(args, kwargs)
        _check_chain_stops(self, kwargs)
        return _chain_generate(self, assistant_model, args, kwargs)
    check_tree_target(self)  # before generate prepares anything
    _stop_strings_as_criteria(self, kwargs)  # tree mode: dart_decode checks and places the head (prepare_call)
    streamer = kwargs.pop("streamer", None)
    return _original_generate(
        self, *args, custom_generate=dart_decode, dart_head=assistant_model, dart_streamer=streamer, **kwargs
    )


@functools.wraps(_original_get_candidate_generator)
def _get_candidate_generator(self, generation_config, *args, assistant_model=None, **kwargs):
    if not isinstance(assistant_model, DartHead):
        return _original_get_candidate_generator(
            self, generation_config, *args, assistant_model=assistant_model, **kwargs
        )
    call = _CHAIN_CALL.get()
    if call is None:
        raise RuntimeError("DART chain mode runs through target.generate(..., assistant_model=head, dart_mode='chain')")
    check_processors(kwargs.get("logits_processor"), 'dart_mode="chain" (transformers\' assisted decoding)')
    return DartCandidateGenerator(call.head, self, generation_config, call)


def _names_a_head(name: str) -> bool:
    """Whether `name` (a folder or Hub repo id, as pipelines take `assistant_model`) holds a DART head's config:
    transformers would load it as a causal LM, which a head is not."""
    try:
        config, _ = DartHead.config_class.get_config_dict(name)
    except (OSError, ValueError):
        return False  # transformers' own loader says what is wrong with it
    return config.get("model_type") == DartHead.config_class.model_type


@functools.lru_cache(maxsize=8)
def _head_named(name: str) -> DartHead:
    """The head in folder / Hub repo `name`, loaded once per process (as AutoModel would load it)."""
    return DartHead.from_pretrained(name).eval()


@functools.wraps(_original_load_assistant_model)
def _load_assistant_model(model, assistant_model, assistant_tokenizer):
    if isinstance(assistant_model, (str, os.PathLike)) and _names_a_head(os.fspath(assistant_model)):
        assistant_model = _head_named(os.fspath(assistant_model))
    if isinstance(assistant_model, DartHead):
        check_head_matches_target(assistant_model, model)
        return assistant_model, None  # the head drafts in the target's own vocabulary
    return _original_load_assistant_model(model, assistant_model, assistant_tokenizer)


def install() -> None:
    """Route DartHead assistants (idempotent; called by `import dart_hf`)."""
    GenerationMixin.generate = _generate
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    pipelines_base.load_assistant_model = _load_assistant_model
