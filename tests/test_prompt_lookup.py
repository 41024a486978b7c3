"""Prompt lookup: the continuation of the latest earlier occurrence of the longest matching suffix n-gram."""

from __future__ import annotations

import pytest
import torch

from conftest import make_head, make_target, prompts
from dart_hf.core import prompt_lookup
from dart_hf.core.prompt_lookup import lookup_continuation


def reference(context: list[int], length: int, min_n: int, max_n: int) -> list[int | None]:
    for n in range(max_n, min_n - 1, -1):
        if len(context) <= n:
            continue
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == context[-n:]:
                follow = context[start + n : start + n + length]
                return follow + [None] * (length - len(follow))
    return [None] * length


@pytest.mark.parametrize("seed", range(6))
def test_matches_a_plain_python_search(seed):
    g = torch.Generator().manual_seed(seed)
    for size in (1, 2, 5, 12, 40):
        context = torch.randint(0, 4 if seed % 2 else 9, (size,), generator=g)  # small alphabets repeat often
        for min_n, max_n in ((1, 1), (2, 4), (1, 3)):
            tokens, valid = lookup_continuation(context, 5, min_n, max_n)
            want = reference(context.tolist(), 5, min_n, max_n)
            assert valid.tolist() == [w is not None for w in want]
            assert [t if v else None for t, v in zip(tokens.tolist(), valid.tolist())] == want


def test_longest_then_latest_match_wins():
    #                      0  1  2  3  4  5  6  7  8  9
    context = torch.tensor([7, 8, 9, 1, 3, 8, 9, 2, 8, 9])
    tokens, valid = lookup_continuation(context, 3, min_ngram=1, max_ngram=3)
    assert tokens[:2].tolist() == [2, 8] and valid.tolist() == [True, True, True]  # "8 9" last seen at 5
    context = torch.tensor([7, 8, 9, 1, 3, 8, 9, 2, 7, 8, 9])
    tokens, valid = lookup_continuation(context, 2, min_ngram=1, max_ngram=3)
    assert tokens.tolist() == [1, 3]  # "7 8 9" (at 0) beats the later "8 9" (at 5)
    tokens, valid = lookup_continuation(torch.tensor([4, 5, 6]), 2, min_ngram=1, max_ngram=2)
    assert valid.tolist() == [False, False]


def test_generate_uses_it_by_default_and_not_when_told_not_to(monkeypatch):
    """The head's config switches it, and a call's `dart_prompt_lookup` wins over the config. (The tokens with and
    without it: tests/test_lossless.py.)"""
    target = make_target("llama")
    head = make_head(target)
    calls = []
    real = prompt_lookup.lookup_continuations
    monkeypatch.setattr("dart_hf.core.drafter.lookup_continuations", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = prompts(1, seed=3)[0]
    target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=12)
    assert calls
    calls.clear()
    target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=12, dart_prompt_lookup=False)
    assert not calls
    head.config.prompt_lookup = False
    target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=12)
    assert not calls
    target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=12, dart_prompt_lookup=True)
    assert calls  # the call's setting wins over the config
