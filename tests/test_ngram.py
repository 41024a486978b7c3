"""NGramModel: counts, back-off probabilities, persistence, bad files."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from dart_hf import NGramModel
from dart_hf.core.ngram import FORMAT


def naive_prob(seqs, order, context, x):
    """docs/DART_SPEC.md §5 by counting: the longest context suffix (>= 1 token) seen and seen followed by x gives
    count(suffix + x) / count(suffix), count(suffix) its own occurrences; 0 when there is none (no unigram level)."""
    grams = Counter()
    for s in seqs:
        for m in range(1, order + 1):
            for i in range(len(s) - m + 1):
                grams[tuple(s[i : i + m])] += 1
    ctx = [t for t in context if t >= 0][-(order - 1) :] if order > 1 else []
    for m in range(len(ctx), 0, -1):
        c = tuple(ctx[len(ctx) - m :])
        if grams[c] and grams[c + (x,)]:
            return grams[c + (x,)] / grams[c]
    return 0.0


def test_back_off_probabilities_match_counting_by_hand():
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 7, (int(n),), generator=g).tolist() for n in torch.randint(1, 30, (15,), generator=g)]
    ng = NGramModel.build(seqs, order=3, vocab_size=9, progress=False)
    contexts = torch.tensor([[1, 2], [-1, 3], [-1, -1], [8, 8], [8, 2], [5, 5]])
    cands = torch.arange(9).expand(6, 9)
    got = ng.prob(contexts, cands)
    for r, ctx in enumerate(contexts.tolist()):
        ctx = [t for t in ctx if t >= 0]
        for x in range(9):
            assert got[r, x].item() == pytest.approx(naive_prob(seqs, 3, ctx, x), abs=1e-6), (ctx, x)


def test_counts_and_eos_append():
    ng = NGramModel.build([[1, 2, 1, 2]], order=2, vocab_size=5, eos_token_id=4, progress=False)
    assert ng.total == 5
    p = ng.prob(torch.tensor([[2]]), torch.tensor([[1, 4, 3]]))
    assert p.tolist() == [[0.5, 0.5, 0.0]]


def test_back_off_is_per_candidate_with_the_context_count_as_denominator():
    # "5 6" is followed by 7 only; 8 follows 6 elsewhere; the last 6 ends the text, so count(6) = 3 > 2 continuations
    ng = NGramModel.build([[5, 6, 7], [6, 8], [4, 6]], order=3, vocab_size=10, progress=False)
    p = ng.prob(torch.tensor([[5, 6], [9, 9], [-1, -1]]), torch.tensor([[7, 8, 3], [7, 8, 3], [7, 8, 3]]))
    assert p[0].tolist() == [1.0, pytest.approx(1 / 3), 0.0]  # 8 unseen after "5 6": P(8 | 6), not 0
    assert p[1].tolist() == [0.0, 0.0, 0.0] and p[2].tolist() == [0.0, 0.0, 0.0]  # no unigram level
    assert ng.context_size == 2


def test_files_with_the_old_context_tables_still_load(tmp_path):
    ng = NGramModel.build([[3, 1, 4, 1, 5, 9, 2, 6]], order=3, vocab_size=10, progress=False)
    old = dict(ng.tables, ctx_keys_2=torch.tensor([1]), ctx_totals_2=torch.tensor([2]))  # the shipped head's file
    save_file(old, str(tmp_path / "ngram.safetensors"), metadata={"format": FORMAT, "order": "3", "vocab_size": "10"})
    back = NGramModel.load(tmp_path)
    assert set(back.tables) == set(ng.tables)


def test_save_load_round_trip(tmp_path):
    ng = NGramModel.build([[3, 1, 4, 1, 5, 9, 2, 6]], order=3, vocab_size=10, progress=False)
    ng.save(tmp_path / "ngram.safetensors")
    back = NGramModel.load(tmp_path)  # a folder resolves to its ngram.safetensors
    ctx, cand = torch.tensor([[4, 1], [0, 1]]), torch.arange(10).expand(2, 10)
    assert torch.equal(back.prob(ctx, cand), ng.prob(ctx, cand))
    assert back.order == 3 and back.vocab_size == 10


def test_missing_and_foreign_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="n-gram file not found"):
        NGramModel.load(tmp_path / "nope.safetensors")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a dart_hf n-gram"):
        NGramModel.load(tmp_path / "other.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="not a readable"):
        NGramModel.load(tmp_path / "junk.safetensors")


def test_bad_build_inputs():
    with pytest.raises(ValueError, match="token ids"):
        NGramModel.build([[1, 99]], order=2, vocab_size=10, progress=False)
    with pytest.raises(ValueError, match="does not fit"):
        NGramModel.build([[1, 2]], order=5, vocab_size=151936, progress=False)
