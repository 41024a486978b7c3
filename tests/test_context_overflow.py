"""A prompt at or past the target's context (issue 73): DART decodes it as plain `generate` does, never an internal
index error. The tiny target's context is 64 positions; a 340-token prompt is past what the head's buffers hold
(sized from the context: 256 + its extras), the case that crashed in `DartDrafter.start`."""

from __future__ import annotations

import pytest
import torch

from conftest import left_padded, make_head, make_target
from dart_hf import DartStats

CONTEXT = 64
LENGTHS = [CONTEXT, 340]  # at the context; past it and past the head's buffers
NEW = 8


@pytest.fixture(scope="module")
def short():
    """A tiny Llama with a 64-position context and its head."""
    target = make_target("llama", max_position_embeddings=CONTEXT)
    return target, make_head(target)


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def both(target, head, ids, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain `generate`, DART) greedy outputs of one call."""
    common = dict(do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=2)
    plain_kwargs = {k: v for k, v in kwargs.items() if not k.startswith("dart_")}
    return (target.generate(ids, **common, **plain_kwargs),
            target.generate(ids, assistant_model=head, **common, **kwargs))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_one_row_equals_plain(short, n, mode):
    want, got = both(*short, prompt(n), dart_mode=mode)
    assert want.shape == (1, n + NEW) and torch.equal(got, want)


@pytest.mark.parametrize("n", LENGTHS)
def test_static_cache_equals_plain(short, n):
    want, got = both(*short, prompt(n), cache_implementation="static")
    assert torch.equal(got, want)


@pytest.mark.parametrize("cache", [None, "static"])
def test_batch_with_one_row_past_the_context(short, cache):
    """The short row drafts, the long one decodes plainly: both are plain `generate`'s rows."""
    ids, mask = left_padded([12, 340], seed=3)
    stats = DartStats()
    want, got = both(*short, ids, attention_mask=mask, cache_implementation=cache, dart_stats=stats)
    assert torch.equal(got, want)
    assert "the prompt of row 1 at or past the target's context (64 tokens): decoded plainly" in stats.static_reason


def test_the_reason_is_in_the_stats(short):
    stats = DartStats()
    both(*short, prompt(CONTEXT), dart_stats=stats)
    assert stats.static_reason == "the prompt of row 0 at or past the target's context (64 tokens): decoded plainly"
    stats = DartStats()
    both(*short, prompt(CONTEXT - 1), dart_stats=stats)
    assert stats.static_reason is None  # below the context: drafted as far as the context allows


def test_sampled_call_runs(short):
    """Sampling draws other text than plain `generate` (README), but the call decodes as long."""
    target, head = short
    ids = prompt(340)
    got = target.generate(ids, assistant_model=head, do_sample=True, max_new_tokens=NEW, eos_token_id=None)
    assert got.shape == (1, 340 + NEW) and torch.equal(got[:, :340], ids)
