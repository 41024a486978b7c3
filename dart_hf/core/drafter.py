"""The draft half of a DART step, shared by the tree loop (`dart_hf.core.loop`) and chain mode
(`dart_hf.integrations.transformers.DartCandidateGenerator`): head forward + tree search (docs/DART_SPEC.md §1, §3).

A `DartDrafter` lives for one `generate` call. It owns everything per-call that drafting needs: the head's KV
cache, the target states of verified positions the head has not consumed yet, the n-gram model on the head's
device, the EOS ids, prompt lookup and the tree-search parameters. The head itself is only read.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PreTrainedModel

from .modeling import DartHead, TargetModules
from .ngram import NGramModel
from .prompt_lookup import lookup_for_tree
from .stats import PhaseTimer
from .tree import DraftTree, TreeSearchParams, build_tree, root_tree


def default_node_budget(head: DartHead, target: PreTrainedModel) -> int:
    """One node budget for a whole call (chain mode): the head config's, or for a cost-aware head
    (`node_budget=None`) the budget policy's current choice, at least one node (`dart_hf.core.budget`)."""
    if head.config.node_budget is not None:
        return head.config.node_budget
    from .budget import budget_policy  # the tree loop asks the policy itself, every step

    return max(1, budget_policy(head, target).choice)


def draft_depth(params: TreeSearchParams, max_new: int, num_predictions: int) -> int:
    """How many of the head's K + 1 rows a step drafts: no deeper than the budget's tree can reach, than `max_new`
    tokens allow, or than the head predicts (at least one row)."""
    return max(1, min(params.node_budget, max_new, num_predictions))


class DartDrafter:
    """Proposes a draft tree per step from the target states of the positions verified since the last proposal."""

    def __init__(
        self,
        head: DartHead,
        target: PreTrainedModel,
        *,
        max_length: int,
        node_budget: int,
        prompt_lookup: bool,
        eos_token_ids: torch.Tensor | None,
        ngram: NGramModel | None = None,
    ):
        """max_length: the call's; drafts never reach past it nor past the target's context (positions past
        `max_position_embeddings` are decoded plainly, as plain `generate` decodes them). ngram: the head's n-gram
        already on the head's device (the rows of a batch share one copy); default: the head's, moved there."""
        self.head = head
        self.device = head.device
        self.modules = TargetModules.of(target)
        context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
        self.limit = min(max_length, context) if context else max_length  # no draft token at or past this length
        self.cache = head.new_cache(capacity=min(self.limit, 4096) + head.config.num_predictions)  # grows by doubling
        self.params = TreeSearchParams.from_config(head.config, node_budget=node_budget)
        if ngram is None and head.ngram is not None:
            ngram = head.ngram.to(self.device)
        self.ngram = ngram
        self.context_size = max(self.ngram.context_size if self.ngram is not None else 0, 1)
        self.prompt_lookup = prompt_lookup
        self.eos = eos_token_ids.to(self.device).view(-1) if eos_token_ids is not None else None
        self._aux: torch.Tensor | None = None  # [1, r, 3H]: verified positions the head has not consumed
        self._tokens: torch.Tensor | None = None  # [1, r]: the token that follows each of them
        self.exhausted = False  # the text reached `limit`: no more drafts, and no states kept for them

    def advance(self, aux: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record r newly verified positions: their target states `aux` [1, r, 3H] and the token after each
        `tokens` [1, r] (for the last one: the target's own new token, the next tree's root)."""
        if self.exhausted:
            return
        aux, tokens = aux.to(self.device), tokens.to(self.device).view(1, -1)
        if self._aux is not None:  # a step that proposed nothing (chain mode at the length limit)
            aux, tokens = torch.cat([self._aux, aux], dim=1), torch.cat([self._tokens, tokens], dim=1)
        self._aux, self._tokens = aux, tokens

    def propose(self, input_ids: torch.Tensor, max_new: int, timer: PhaseTimer, node_budget: int | None = None
                ) -> DraftTree:
        """The draft tree of `node_budget` nodes (default: the budget this drafter was made with) rooted at
        `input_ids`' last token, at most `max_new` tokens deep (>= 0), on the head's device. The head drafts only as
        deep as the tree can reach: min(node budget, max_new, K + 1) rows. Budget 0 is the root alone: no head
        forward, no search (the target's states wait for the next tree)."""
        if node_budget is not None and node_budget != self.params.node_budget:
            self.params = replace(self.params, node_budget=int(node_budget))
        max_new = min(max_new, self.limit - input_ids.shape[1] - 1)
        if max_new <= 0:  # no room left below max_length / the context: the remaining steps are plain decoding
            self.exhausted, self._aux, self._tokens = True, None, None
        if self.params.node_budget == 0 or self.exhausted:
            return root_tree(input_ids[0, -1], self.device)
        if self._aux is None:
            raise RuntimeError("propose() before advance(): the head has no target states to draft from")
        head, params = self.head, self.params
        depth = draft_depth(params, max_new, head.config.num_predictions)
        with timer.phase("draft"):
            logits = head.draft(self._aux, self._tokens, self.cache, depth=depth, target_modules=self.modules)
            self._aux = self._tokens = None
        with timer.phase("tree"):
            text = input_ids[0]
            lookup = lookup_for_tree(text, depth, head.config, self.device) if self.prompt_lookup else None
            return build_tree(
                logits,
                root_token=text[-1],
                context=text[-self.context_size :],
                params=params,
                ngram=self.ngram,
                draft_to_target=head.draft_to_target,
                eos_token_ids=self.eos,
                max_depth=max_new,
                lookup=lookup,
            )

