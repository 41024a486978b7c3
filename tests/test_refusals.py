"""A refused DART call changes nothing: every check runs before the head is placed (cast / moved), before its stats
or budget state are touched and before the target runs, and each refusal names its real cause."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import dart_hf
from conftest import make_head, make_target

IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])
RIGHT_PADDED = torch.tensor([[1, 1, 1, 1, 0, 0]])


def prefilled(target) -> DynamicCache:
    cache = DynamicCache(config=target.config)
    target(IDS, past_key_values=cache, use_cache=True)
    return cache


# (the call's arguments besides input_ids, the error type, a regex its message matches)
REFUSED = {
    "budget 2.5": (dict(dart_node_budget=2.5), ValueError, "dart_node_budget must be a whole number"),
    "budget True": (dict(dart_node_budget=True), ValueError, "dart_node_budget must be a whole number"),
    "budget -1": (dict(dart_node_budget=-1), ValueError, "dart_node_budget must be a whole number"),
    "budget text": (dict(dart_node_budget="many"), ValueError, "dart_node_budget must be a whole number"),
    "mask length": (dict(attention_mask=torch.ones(1, 4, dtype=torch.long)), ValueError,
                    "attention_mask has 4 columns but input_ids has 6"),
    "right padding": (dict(attention_mask=RIGHT_PADDED), ValueError, "left padding only"),
    "inputs_embeds": (dict(inputs_embeds=torch.zeros(1, 6, 64)), ValueError, "inputs_embeds"),
    "attentions": (dict(return_dict_in_generate=True, output_attentions=True), ValueError, "attentions"),
    "beams": (dict(num_beams=2), ValueError, "num_beams"),
    "guidance": (dict(guidance_scale=1.5), ValueError, "guidance"),
    "cache kind": (dict(cache_implementation="offloaded"), ValueError, "cache_implementation"),
    "stats type": (dict(dart_stats="mine"), TypeError, "dart_stats must be a dart_hf.DartStats"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_call_leaves_head_stats_and_target_as_they_were(case):
    kwargs, error, message = REFUSED[case]
    target = make_target("llama").to(torch.bfloat16)  # a call would cast the fp32 head in place
    head = make_head(target).float()
    stats = dart_hf.DartStats(steps=7)
    head.stats = stats
    weights = {k: v.clone() for k, v in head.state_dict().items()}
    target_weights = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(error, match=message):
        target.generate(IDS, assistant_model=head, do_sample=False, max_new_tokens=5, **kwargs)
    assert head.stats is stats and stats.steps == 7
    assert head.budget_state is None and not head._dart_placed and not head._placed_copies
    state = head.state_dict()
    assert all(state[k].dtype == v.dtype and torch.equal(state[k], v) for k, v in weights.items())
    assert all(torch.equal(target.state_dict()[k], v) for k, v in target_weights.items())


def test_a_pre_filled_cache_is_refused_before_any_change():
    target = make_target("llama")
    head = make_head(target, node_budget=None)
    with pytest.raises(ValueError, match="pre-filled"):
        target.generate(IDS, assistant_model=head, past_key_values=prefilled(target), max_new_tokens=5)
    assert head.budget_state is None and head.stats is None
