"""How `target.generate(..., assistant_model=DartHead)` reaches the DART loop.

`import dart_hf` wraps two methods of `transformers.GenerationMixin`, and nothing else:

- `generate`: when `assistant_model` is a `DartHead`, the call is forwarded unchanged to the original
  `generate` with `custom_generate=dart_decode` (transformers' own hook for a decoding-method callable), so
  transformers still prepares the GenerationConfig, processors, stopping criteria and cache. `streamer` is
  passed as `dart_streamer` because transformers does not forward it to custom callables.
  `dart_mode="chain"` instead runs transformers' own assisted-decoding loop with the head as a chain drafter.
  Any other call goes to the original `generate` untouched.
- `_get_candidate_generator`: returns a `DartCandidateGenerator` when the assistant is a `DartHead` (chain
  mode), and defers to the original otherwise.
"""

from __future__ import annotations

import functools
import weakref

import torch
from transformers import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator

from ..core.loop import dart_decode
from ..core.modeling import DartHead
from ..core.prompt_lookup import lookup_for_tree
from ..core.target import AuxHiddenCapture, check_head_matches_target
from ..core.tree import TreeSearchParams, build_tree

MODES = ("tree", "chain")


class DartCandidateGenerator(CandidateGenerator):
    """The head as a chain drafter inside transformers' `_assisted_decoding` loop.

    Each call drafts K+1 tokens, builds the tree and proposes its best deepest path; transformers verifies it
    (greedy match or exact sampling of a deterministic draft). The target states come from forward pre-hooks,
    removed when this generator is garbage collected at the end of `generate`.
    """

    requires_model_outputs = True
    model_kwargs_overrides: dict = {}

    def __init__(self, head: DartHead, target, generation_config, node_budget: int | None = None):
        head.bind_target(target)
        self.head = head
        self.max_length = generation_config.max_length
        self.capture = AuxHiddenCapture(target, head.config.aux_layer_ids)
        weakref.finalize(self, self.capture.remove)
        self.head_cache = head.new_cache(capacity=self.max_length + head.config.num_predictions)
        self.params = TreeSearchParams.from_config(head.config, node_budget=node_budget or head.node_budget_for(target))
        self.ngram = head.ngram.to(head.device) if head.ngram is not None else None
        eos = generation_config._eos_token_tensor
        self.eos = eos.to(head.device).view(-1) if eos is not None else None
        self.proposed = self.accepted = self.calls = 0

    def get_candidates(self, input_ids: torch.LongTensor, is_first_iteration: bool = False, **kwargs):
        if is_first_iteration:  # the target has not run yet: let its prefill produce the states we read
            return input_ids, None
        head_len = self.head_cache.length
        new_rows = input_ids.shape[1] - 1 - head_len
        aux = self.capture.take(self.head.device)[:, :new_rows]
        next_tokens = input_ids[:, head_len + 1 :].to(self.head.device)
        draft_logits = self.head.draft(aux, next_tokens, self.head_cache)
        depth = min(self.head.config.num_predictions, self.max_length - input_ids.shape[1] - 1)
        if depth <= 0:
            return input_ids, None
        cfg = self.head.config
        tree = build_tree(
            draft_logits,
            root_token=input_ids[0, -1],
            context=input_ids[0, -8:],
            params=self.params,
            ngram=self.ngram,
            draft_to_target=self.head.draft_to_target,
            eos_token_ids=self.eos,
            max_depth=depth,
            lookup=lookup_for_tree(input_ids[0], depth, cfg, self.head.device) if cfg.prompt_lookup else None,
        )
        chain = tree.tokens[tree.best_chain()[1:]].to(input_ids.device)
        self.calls += 1
        self.proposed += chain.numel()
        return torch.cat([input_ids, chain.unsqueeze(0)], dim=1), None

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, num_matches: int):
        self.accepted += int(num_matches)
        self.head.stats = {
            "steps": self.calls,
            "proposed": self.proposed,
            "accepted_draft_tokens": self.accepted,
            "mean_accepted_length": (self.accepted + self.calls) / max(self.calls, 1),
        }


_original_generate = GenerationMixin.generate
_original_get_candidate_generator = GenerationMixin._get_candidate_generator


@functools.wraps(_original_generate)
def _generate(self, *args, assistant_model=None, **kwargs):
    if not isinstance(assistant_model, DartHead):
        return _original_generate(self, *args, assistant_model=assistant_model, **kwargs)
    mode = kwargs.pop("dart_mode", "tree")
    if mode not in MODES:
        raise ValueError(f"dart_mode must be one of {MODES}, got {mode!r}")
    if kwargs.get("custom_generate") is not None:
        raise ValueError("assistant_model=DartHead already selects the decoding loop; drop custom_generate")
    # up front, in both modes: transformers' own assistant checks (chain mode) would otherwise fail first with
    # misleading advice (e.g. "different tokenizers" for a vocab mismatch)
    check_head_matches_target(assistant_model, self)
    if mode == "chain":
        return _original_generate(self, *args, assistant_model=assistant_model, **kwargs)
    streamer = kwargs.pop("streamer", None)
    return _original_generate(
        self, *args, custom_generate=dart_decode, dart_head=assistant_model, dart_streamer=streamer, **kwargs
    )


@functools.wraps(_original_get_candidate_generator)
def _get_candidate_generator(self, generation_config, *args, assistant_model=None, **kwargs):
    if isinstance(assistant_model, DartHead):
        return DartCandidateGenerator(assistant_model, self, generation_config)
    return _original_get_candidate_generator(self, generation_config, *args, assistant_model=assistant_model, **kwargs)


def install() -> None:
    """Route DartHead assistants (idempotent; called by `import dart_hf`)."""
    GenerationMixin.generate = _generate
    GenerationMixin._get_candidate_generator = _get_candidate_generator
