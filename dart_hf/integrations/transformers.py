"""How `target.generate(..., assistant_model=DartHead)` and pipelines reach DART.

`import dart_hf` wraps two methods of `transformers.GenerationMixin` and one pipeline helper, and nothing else:

- `generate`: when `assistant_model` is a `DartHead`, the call is forwarded to the original `generate` with
  `custom_generate=dart_decode` (transformers' own hook for a decoding-method callable), so transformers still
  prepares the GenerationConfig, processors, stopping criteria and cache. `streamer` is passed as `dart_streamer`
  because transformers does not forward it to custom callables, and stop strings become a `StopStringCriteria`
  here because transformers drops `tokenizer` for custom callables. `dart_mode="chain"` instead runs transformers'
  own assisted-decoding loop with the head as a chain drafter; its `dart_*` options are taken out of the call (or
  refused by name) and the head is placed only when transformers, its own checks passed, asks for the candidate
  generator. Both modes check the prompt first (`checks.check_prompt`). `assistant_model` may also name a head's
  folder or Hub id (loaded once per process); any other string is refused at once with a ValueError that says what
  it names (transformers' `generate` takes no string). Any other call goes to the original `generate` untouched.

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
import inspect
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub
import torch
import transformers.pipelines.base as pipelines_base
from huggingface_hub.errors import EntryNotFoundError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from transformers import GenerationMixin, StoppingCriteriaList
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from ..core.budget import budget_policy, wants_size_rule
from ..core.checks import check_node_budget, check_processors, check_prompt, check_stats, prepare_call, prompt_ids
from ..core.distributed import check_tensor_parallel_call, shared_budget, tensor_parallel_group
from ..core.drafter import DartDrafter, draft_depth
from ..core.loop import dart_decode
from ..core.modeling import DartHead
from ..core.stats import DartStats, PhaseTimer
from ..core.support import check_chain_target, check_tree_target
from ..core.target import aux_request, aux_states, check_head_matches_target

MODES = ("tree", "chain")
# The `dart_*` options (README "Options"): the tree loop's are `dart_decode`'s own (less what the routing passes it);
# chain mode runs transformers' loop, with one node budget per call and no cost-aware state to learn
TREE_OPTIONS = tuple(name for name in inspect.signature(dart_decode).parameters
                     if name.startswith("dart_") and name not in ("dart_head", "dart_streamer"))
CHAIN_OPTIONS = ("dart_node_budget", "dart_prompt_lookup", "dart_timing", "dart_stats")


@dataclass(frozen=True)
class _ChainRequest:
    """A chain-mode `generate` call as checked (`_check_chain_call`), before anything changed: the head as the caller
    passed it and the `dart_*` options chain mode takes (README "Options")."""

    head: DartHead
    node_budget: int | str | None  # dart_node_budget: a whole number >= 1, "auto", or None (the head config's)
    prompt_lookup: bool | None  # dart_prompt_lookup: None, the head config's
    timing: bool  # dart_timing: synchronised phase times
    stats: DartStats | None  # dart_stats: None, a new DartStats


@dataclass
class _ChainCall:
    """What the candidate generator drafts with: the head placed for the target (`prepare_call`), the call's stats and
    its settings."""

    head: DartHead
    stats: DartStats
    node_budget: int
    prompt_lookup: bool
    timing: bool


_CHAIN_CALL: contextvars.ContextVar[_ChainRequest | None] = contextvars.ContextVar("dart_chain_call", default=None)


class DartCandidateGenerator(CandidateGenerator):
    """The head as a chain drafter inside transformers' `_assisted_decoding` loop.

    Each call proposes the best deepest path of the drafter's tree (`DartDrafter`, the same draft + tree search as
    the tree loop); transformers verifies it (greedy match or exact sampling of a deterministic draft). After each
    target forward, `update_candidate_strategy` hands the verified positions' states to the drafter.
    """

    requires_model_outputs = True  # transformers hands `get_candidates` the latest target forward's outputs

    def __init__(self, target, generation_config, call: _ChainCall):
        head = call.head
        self.stats, self.node_budget = call.stats, call.node_budget
        self.aux_ids = head.config.aux_layer_ids
        self.model_kwargs_overrides = aux_request(self.aux_ids)  # the target returns the layer inputs the head reads
        self.max_length = generation_config.max_length
        self.drafter = DartDrafter(head, target, max_length=self.max_length, node_budget=call.node_budget,
                                   prompt_lookup=call.prompt_lookup, eos_token_ids=generation_config._eos_token_tensor)
        self.timer = PhaseTimer(call.stats.time, head.device, call.timing)
        self.seen = 0  # positions whose target states the drafter has received
        self._proposed_at = 0.0

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens one call proposes (transformers >= 5.25 sizes the cache's rollback history by it)."""
        return draft_depth(self.drafter.params.node_budget, self.max_length, self.drafter.head.config.num_predictions)

    def get_candidates(self, input_ids: torch.LongTensor, is_first_iteration: bool = False, model_outputs=None,
                       **kwargs):
        if not is_first_iteration:  # first: the target's prefill produces the states we read
            rows = input_ids.shape[1] - 1 - self.seen  # the positions the latest forward verified
            aux = aux_states(model_outputs, self.aux_ids)[:, :rows]
            if self.seen == 0:  # the prompt's states and the first new token
                self.drafter.start(input_ids[:, :-1], [0], aux, input_ids[:, -1])
            else:
                self.drafter.advance(aux, input_ids[:, self.seen + 1 :])
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

    Every check runs first (`_check_chain_call`: the head against the target before transformers sees it, whose own
    assistant checks would fail first with misleading advice, e.g. "different tokenizers" for a vocab mismatch); the
    head is placed and its stats set only once transformers, its own checks passed too, asks for the candidate
    generator (`_get_candidate_generator`), so a refused call leaves the head as it was."""
    request = _check_chain_call(model, head, args, kwargs)
    token = _CHAIN_CALL.set(request)
    try:
        return _original_generate(model, *args, assistant_model=head, **kwargs)
    finally:
        _CHAIN_CALL.reset(token)


def _check_chain_call(model, head: DartHead, args: tuple, kwargs: dict) -> _ChainRequest:
    """Every refusal of a chain-mode call, before anything changes; takes the `dart_*` options out of `kwargs`
    (transformers would pass them to the target as model inputs)."""
    check_chain_target(model)
    check_prompt(model, args, kwargs, "chain")
    _check_chain_inputs(prompt_ids(args, kwargs), kwargs)
    _check_chain_stops(model, kwargs)
    _check_one_sequence(model, kwargs)
    check_head_matches_target(head, model)
    request = _chain_request(head, kwargs)
    config = kwargs.get("generation_config") or model.generation_config
    check_tensor_parallel_call(head, model, mode="chain", batch_size=1, node_budget=request.node_budget,
                               do_sample=bool(kwargs.get("do_sample", config.do_sample)))
    return request


def _chain_request(head: DartHead, kwargs: dict) -> _ChainRequest:
    """The `dart_*` options of a chain-mode call, taken out of `kwargs` and checked; one chain mode does not take is
    refused by name (`_check_chain_options`)."""
    options = {k: kwargs.pop(k) for k in [k for k in kwargs if k.startswith("dart_")]}
    _check_chain_options(options)
    budget = options.get("dart_node_budget")
    check_node_budget(budget)
    if budget == 0:
        raise ValueError('dart_node_budget=0 (plain decoding) is a dart_mode="tree" setting; dart_mode="chain" '
                         'drafts at least one node: a whole number >= 1 or "auto"')
    check_stats(options.get("dart_stats"))
    return _ChainRequest(head, budget, options.get("dart_prompt_lookup"), bool(options.get("dart_timing")),
                         options.get("dart_stats"))


def _check_chain_options(options: dict) -> None:
    """Refuse, by name, a `dart_*` option (name -> value) chain mode does not take: transformers would pass it to the
    target and blame the user's spelling ("model_kwargs are not used by the model ... typos"). A tree loop option
    left None (its default) passes: chain mode has nothing to set there."""
    takes = ", ".join(CHAIN_OPTIONS)
    for name in sorted(options):
        if name in CHAIN_OPTIONS or (name in TREE_OPTIONS and options[name] is None):
            continue
        if name in TREE_OPTIONS:
            raise ValueError(f'{name} is a dart_mode="tree" option (the tree loop\'s cost-aware budget learns across '
                             f'its steps and calls; dart_mode="chain" takes one node budget per call); '
                             f'dart_mode="chain" takes {takes}')
        raise ValueError(f'unknown DART option {name}: dart_mode="chain" takes {takes}')


def _check_one_sequence(model, kwargs: dict) -> None:
    """transformers' assisted decoding returns one sequence per prompt: it refuses num_return_sequences > 1 (after
    the call started) and runs num_beams > 1 as greedy decoding, other text than plain `generate`'s beam search."""
    config = kwargs.get("generation_config") or model.generation_config
    for name in ("num_beams", "num_return_sequences"):
        value = kwargs.get(name, getattr(config, name))
        if value not in (None, 1):
            raise ValueError(f'DART dart_mode="chain" (transformers\' assisted decoding) returns one sequence per '
                             f"prompt: {name}={value} is not supported")


def _check_chain_inputs(ids, kwargs: dict) -> None:
    """Chain mode is transformers' assisted decoding, which runs one row: say so, and where batches do run. The head
    drafts from token ids: chain mode needs them even where the target reads inputs_embeds."""
    if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] > 1:
        raise ValueError(
            f'DART dart_mode="chain" (transformers\' assisted decoding) supports batch size 1, got a batch of '
            f'{ids.shape[0]}; the default dart_mode="tree" decodes batches'
        )
    if kwargs.get("inputs_embeds") is not None and not isinstance(ids, torch.Tensor):
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
    if isinstance(assistant_model, (str, os.PathLike)):  # transformers' generate takes no string: a head's name
        assistant_model = _named_assistant(os.fspath(assistant_model), "generate")
    if not isinstance(assistant_model, DartHead):
        return _original_generate(self, *args, assistant_model=assistant_model, **kwargs)
    mode = kwargs.pop("dart_mode", "tree")
    if mode not in MODES:
        raise ValueError(f"dart_mode must be one of {MODES}, got {mode!r}")
    if kwargs.get("custom_generate") is not None:
        raise ValueError("assistant_model=DartHead already selects the decoding loop; drop custom_generate")
    if mode == "chain":
        return _chain_generate(self, assistant_model, args, kwargs)
    check_tree_target(self)  # before generate prepares anything
    check_prompt(self, args, kwargs, "tree")
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
    request = _CHAIN_CALL.get()
    if request is None:
        raise RuntimeError("DART chain mode runs through target.generate(..., assistant_model=head, dart_mode='chain')")
    check_processors(kwargs.get("logits_processor"), 'dart_mode="chain" (transformers\' assisted decoding)')
    return DartCandidateGenerator(self, generation_config, _chain_call(request, self, generation_config))


def _chain_call(request: _ChainRequest, model, generation_config) -> _ChainCall:
    """The head placed for `model` and the stats made the call's (`prepare_call`), once every check passed, and the
    call's settings: prompt lookup, and one node budget (every rank of a tensor-parallel target the first rank's,
    `shared_budget`)."""
    head, stats = prepare_call(request.head, model, request.stats)
    lookup = request.head.config.prompt_lookup if request.prompt_lookup is None else bool(request.prompt_lookup)
    auto = wants_size_rule(request.head, request.node_budget)
    if auto:
        chosen = _auto_budget(request.head, model, lookup, bool(generation_config.do_sample))
    else:
        chosen = head.config.node_budget if request.node_budget is None else request.node_budget
    budget = shared_budget(tensor_parallel_group(model), chosen, model)
    stats.reset(mode="chain", budget_mode="auto" if auto else "fixed", node_budget=budget)
    return _ChainCall(head, stats, budget, lookup, request.timing)


def _auto_budget(head: DartHead, model, lookup: bool, sampled: bool) -> int:
    """A cost-aware chain call's node budget: the tree loop's policy's current choice for this target, prompt-lookup
    setting and sampling (chain mode reads it and teaches it nothing), at least one node."""
    return max(1, budget_policy(head, model, prompt_lookup=lookup, sampled=sampled).choice)


EXPECTED_ASSISTANT = ("assistant_model takes a DART head (its folder, holding a config.json with model_type \"dart\", "
                      "or its Hub repo id) or a loaded assistant model")


def _named_assistant(name: str, caller: str) -> DartHead | None:
    """The DART head that `name` (a folder or a Hub repo id) holds; else, for a pipeline, None (transformers' own
    loader takes any other model's name) and for `generate` a ValueError (transformers' `generate` takes no string:
    without this it fails on `'str' object has no attribute 'config'`). What `name` is not is said at once, as a
    ValueError naming what was found there (`_assistant_config`)."""
    config = _assistant_config(name)
    if config.get("model_type") == DartHead.config_class.model_type:
        try:
            return _head_named(name)
        except ValueError as err:  # a head's folder that does not load (a bad field, a missing n-gram): say which
            raise ValueError(f"assistant_model={name!r}: {err}") from err
    if caller == "pipeline":
        return None
    raise ValueError(
        f"assistant_model={name!r} holds a {config.get('model_type')!r} model, not a DART head: generate takes a "
        f"DART head's folder or Hub id as a string, and any other assistant as a loaded model "
        f"(AutoModelForCausalLM.from_pretrained({name!r}))"
    )


def _assistant_config(name: str) -> dict:
    """The config.json of `name` as a dict: a local folder's, else a Hub repo's (the cached copy, or else one request:
    transformers' own loader retries an unreachable Hub for about 20 s). A ValueError says what `name` was found to
    be where it cannot be a model: a file, a folder without config.json or with an unreadable one, a path that
    does not exist, a Hub repo that is unreachable, missing or has no config.json."""
    path = Path(name).expanduser()
    if path.is_file():
        raise ValueError(f"assistant_model={name!r} is a file, not a model folder; {EXPECTED_ASSISTANT}")
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            found = sorted(p.name for p in path.iterdir())[:5]
            raise ValueError(f"assistant_model={name!r} is a folder without config.json (it holds "
                             f"{found or 'nothing'}); {EXPECTED_ASSISTANT}")
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:  # ValueError: bad JSON or bad UTF-8
            raise ValueError(f"assistant_model={name!r}: {config_file} is not readable JSON ({err}); "
                             f"{EXPECTED_ASSISTANT}") from err
        if not isinstance(config, dict):
            raise ValueError(f"assistant_model={name!r}: {config_file} holds a JSON {type(config).__name__}, not "
                             f"an object; {EXPECTED_ASSISTANT}")
        return config
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(f"assistant_model={name!r}: no such file or folder (from {os.getcwd()}), and not the form "
                         f"of a Hub repo id; {EXPECTED_ASSISTANT}") from None
    return _hub_config(name)


def _hub_config(repo_id: str) -> dict:
    """The config.json of Hub repo `repo_id`: the cached copy, or else after one request that finds it there."""
    try:
        return DartHead.config_class.get_config_dict(repo_id, local_files_only=True)[0]
    except OSError:
        pass  # not cached
    where = f"assistant_model={repo_id!r} is no local file or folder (from {os.getcwd()}) and"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError(f"{where} the Hub is offline (HF_HUB_OFFLINE) with no cached copy of that repo; "
                         f"{EXPECTED_ASSISTANT}")
    try:
        huggingface_hub.get_hf_file_metadata(huggingface_hub.hf_hub_url(repo_id, "config.json"))  # no retries
    except RepositoryNotFoundError:
        raise ValueError(f"{where} the Hub has no repo {repo_id!r} (or it is private or gated: `hf auth login`); "
                         f"{EXPECTED_ASSISTANT}") from None
    except EntryNotFoundError:
        raise ValueError(f"{where} the Hub repo {repo_id!r} has no config.json; {EXPECTED_ASSISTANT}") from None
    except Exception as err:  # the transport's own errors (no network, DNS, timeout): the library varies by version
        raise ValueError(f"{where} the Hub could not be reached ({type(err).__name__}: {err}); "
                         f"{EXPECTED_ASSISTANT}") from err
    return DartHead.config_class.get_config_dict(repo_id)[0]


@functools.lru_cache(maxsize=8)
def _head_named(name: str) -> DartHead:
    """The head in folder / Hub repo `name`, loaded once per process (as AutoModel would load it)."""
    return DartHead.from_pretrained(name).eval()


@functools.wraps(_original_load_assistant_model)
def _load_assistant_model(model, assistant_model, assistant_tokenizer):
    if isinstance(assistant_model, (str, os.PathLike)):
        assistant_model = _named_assistant(os.fspath(assistant_model), "pipeline") or assistant_model
    if isinstance(assistant_model, DartHead):
        check_head_matches_target(assistant_model, model)
        return assistant_model, None  # the head drafts in the target's own vocabulary
    return _original_load_assistant_model(model, assistant_model, assistant_tokenizer)


def install() -> None:
    """Route DartHead assistants (idempotent; called by `import dart_hf`)."""
    GenerationMixin.generate = _generate
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    pipelines_base.load_assistant_model = _load_assistant_model
