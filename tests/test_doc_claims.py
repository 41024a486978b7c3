"""Behaviours the docs state in numbers (docs/TARGETS.md "Per dtype"): with `return_dict_in_generate`, DART's
`output_scores` / `output_logits` are plain `generate`'s up to rounding, a few parts in a million of the largest
logit (a verify over N tokens sums in another order than one-token decoding), in tree and chain mode, while the
sequences are equal. The seeded-sampling claims (tree mode: a seed gives the same text at every node budget, 0 included;
not plain `generate`'s draws) are tests/test_lossless.py case 3."""

from __future__ import annotations

import pytest
import torch

from conftest import make_head, make_target, prompts

ROUNDING = 1e-5  # the bound, relative to the largest |logit|; measured: 3e-7 (tiny Llama), 2e-6 (SmolLM2)


def max_differences(target, head, ids_list, max_new_tokens: int, mode: str) -> tuple[float, float]:
    """(max |DART - plain| over every returned score and logit, max |plain logit|), asserting equal sequences."""
    worst = scale = 0.0
    kw = dict(do_sample=False, max_new_tokens=max_new_tokens, return_dict_in_generate=True, output_scores=True,
              output_logits=True)
    for ids in ids_list:
        ref = target.generate(ids, **kw)
        out = target.generate(ids, assistant_model=head, dart_mode=mode, **kw)
        assert torch.equal(out.sequences, ref.sequences)
        for a, b in [*zip(out.scores, ref.scores), *zip(out.logits, ref.logits)]:
            finite = torch.isfinite(b)
            assert torch.equal(finite, torch.isfinite(a))
            worst = max(worst, (a[finite] - b[finite]).abs().max().item())
            scale = max(scale, b[finite].abs().max().item())
    return worst, scale


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_returned_scores_and_logits_are_plain_generates_up_to_rounding(mode):
    target = make_target("llama")
    head = make_head(target, node_budget=16)
    worst, scale = max_differences(target, head, prompts(4, seed=7), 24, mode)
    assert worst <= ROUNDING * scale, (worst, scale)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_smollm2_scores_and_logits_are_plain_generates_up_to_rounding(mode):
    from transformers import AutoModel

    from dart_hf.tools.assets import load_target, shipped_head
    from dart_hf.tools.datasets import chat_input_ids

    target, tok = load_target("smollm2-135m-instruct")
    head = AutoModel.from_pretrained(shipped_head())
    texts = ["Write a function that reverses a linked list.", "Explain what a hash map is."]
    worst, scale = max_differences(target, head, [chat_input_ids(tok, t) for t in texts], 48, mode)
    assert worst <= ROUNDING * scale, (worst, scale)
