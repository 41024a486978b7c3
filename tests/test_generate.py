"""Lossless contract on tiny random targets: DART output == plain `generate`, token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import dart_hf
from conftest import make_head, make_target, prompts


def plain(target, ids, **kw):
    return target.generate(ids, do_sample=False, **kw)


def dart(target, head, ids, **kw):
    return target.generate(ids, assistant_model=head, do_sample=False, **kw)


def ngram_from_target(target, texts: list[torch.Tensor], new_tokens: int = 64) -> dart_hf.NGramModel:
    """An n-gram of the target's own greedy text: with it the tree finds multi-token continuations even with a
    random head (the head only has to put the right first token among the beams)."""
    seqs = [plain(target, p, max_new_tokens=new_tokens)[0].tolist() for p in texts]
    return dart_hf.NGramModel.build(seqs, order=3, vocab_size=target.config.vocab_size, progress=False)


def wide_head(target):
    """A random head whose depth-1 beams cover a third of the tiny vocab, plus a target n-gram."""
    return make_head(target, tree_top_k=96, beam_width=32, node_budget=96)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_generate_over_prompts_and_lengths(arch):
    target = make_target(arch)
    head = wide_head(target)
    head.ngram = ngram_from_target(target, prompts(6, seed=7))
    accepted = []
    for i, ids in enumerate(prompts(6, seed=7)):
        n_new = [1, 2, 9, 40, 64, 17][i]
        ref = plain(target, ids, max_new_tokens=n_new)
        out = dart(target, head, ids, max_new_tokens=n_new)
        assert torch.equal(out, ref), f"{arch} prompt {i}: DART diverged from generate"
        accepted += head.stats["accepted_lengths"]
    # the n-gram of the target's own text makes multi-token acceptance happen
    assert sum(accepted) / len(accepted) > 1.3


def test_greedy_reuses_head_across_calls_and_targets(llama, llama_head):
    other = make_target("llama", seed=5)
    for target in (llama, other, llama):
        ids = prompts(1, seed=3)[0]
        assert torch.equal(dart(target, llama_head, ids, max_new_tokens=20), plain(target, ids, max_new_tokens=20))


def test_max_length_instead_of_max_new_tokens(llama, llama_head):
    ids = prompts(1, seed=4)[0]
    ref = plain(llama, ids, max_length=ids.shape[1] + 13)
    assert torch.equal(dart(llama, llama_head, ids, max_length=ids.shape[1] + 13), ref)


@pytest.mark.parametrize("eos", [[11], [11, 40, 57]])
def test_eos_inside_accepted_path_ends_output(llama, eos):
    head = wide_head(llama)
    head.ngram = ngram_from_target(llama, prompts(8, seed=9))
    hits = 0
    for ids in prompts(8, seed=9):
        free = plain(llama, ids, max_new_tokens=60)[0, ids.shape[1] :].tolist()
        eos_here = [t for t in free[3:] if t not in free[:3]][:1] or eos  # a token the text really produces
        ref = plain(llama, ids, max_new_tokens=60, eos_token_id=eos_here + eos)
        out = dart(llama, head, ids, max_new_tokens=60, eos_token_id=eos_here + eos)
        assert torch.equal(out, ref)
        hits += ref.shape[1] < ids.shape[1] + 60
    assert hits > 0, "no prompt stopped at EOS: the test would not exercise the EOS path"


class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria_stop_mid_path(llama):
    head = wide_head(llama)
    ids = prompts(1, seed=11)[0]
    head.ngram = ngram_from_target(llama, [ids])
    free = plain(llama, ids, max_new_tokens=40)[0, ids.shape[1] :].tolist()
    stop_token = free[12]
    crit = StoppingCriteriaList([StopAfterToken(stop_token)])
    ref = plain(llama, ids, max_new_tokens=40, stopping_criteria=crit)
    out = dart(llama, head, ids, max_new_tokens=40, stopping_criteria=crit)
    assert torch.equal(out, ref) and out[0, -1].item() == stop_token


@pytest.mark.parametrize(
    "processors",
    [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2), dict(min_new_tokens=10, eos_token_id=[1])],
)
def test_greedy_with_logits_processors(llama, llama_head, processors):
    for ids in prompts(3, seed=13):
        ref = plain(llama, ids, max_new_tokens=30, **processors)
        assert torch.equal(dart(llama, llama_head, ids, max_new_tokens=30, **processors), ref)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.view(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_every_new_token(llama, llama_head):
    ids = prompts(1, seed=17)[0]
    streamer = Collect()
    out = llama.generate(ids, assistant_model=llama_head, max_new_tokens=25, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()
    assert sum(streamer.chunks[1:], []) == out[0, ids.shape[1] :].tolist()


def test_return_dict_scores_match_plain_generate(llama, llama_head):
    ids = prompts(1, seed=19)[0]
    kw = dict(max_new_tokens=15, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = plain(llama, ids, **kw)
    out = dart(llama, llama_head, ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 15
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def record_drafts(head, monkeypatch) -> dict[int, torch.Tensor]:
    """Draft logits keyed by the prefix length the head has consumed when it drafts."""
    seen: dict[int, torch.Tensor] = {}
    original = head.draft

    def spy(aux, next_tokens, cache, depth=None, **kwargs):
        prefix = cache.length + aux.shape[1]
        seen[prefix] = original(aux, next_tokens, cache, depth=depth, **kwargs)
        return seen[prefix]

    monkeypatch.setattr(head, "draft", spy)
    return seen


def test_chain_mode_inside_transformers_assisted_loop(llama, monkeypatch):
    head = wide_head(llama)
    head.ngram = ngram_from_target(llama, prompts(3, seed=23))
    for ids in prompts(3, seed=23):
        ref = plain(llama, ids, max_new_tokens=30)
        chain_drafts = record_drafts(head, monkeypatch)
        out = llama.generate(ids, assistant_model=head, max_new_tokens=30, dart_mode="chain")
        assert torch.equal(out, ref)
        tree_drafts = record_drafts(head, monkeypatch)
        dart(llama, head, ids, max_new_tokens=30)
        # the chain generator must feed the head the same target states as the tree loop does
        common = chain_drafts.keys() & tree_drafts.keys()
        assert len(common) >= 3
        for prefix in common:
            rows = min(len(chain_drafts[prefix]), len(tree_drafts[prefix]))  # the tree loop drafts <= budget rows
            torch.testing.assert_close(chain_drafts[prefix][:rows], tree_drafts[prefix][:rows], atol=1e-4, rtol=1e-4)


def test_custom_generate_callable(llama, llama_head):
    ids = prompts(1, seed=29)[0]
    out = llama.generate(ids, custom_generate=dart_hf.dart_decode, dart_head=llama_head, max_new_tokens=20)
    assert torch.equal(out, plain(llama, ids, max_new_tokens=20))


def test_stats_count_target_forwards(llama, llama_head):
    ids = prompts(1, seed=31)[0]
    calls = []
    handle = llama.register_forward_hook(lambda *a: calls.append(1))
    try:
        llama.generate(ids, assistant_model=llama_head, max_new_tokens=30)
    finally:
        handle.remove()
    stats = llama_head.stats
    assert stats["new_tokens"] == 30
    assert stats["steps"] == len(calls) - 1  # every target forward but the prefill
    assert sum(stats["accepted_lengths"]) == 29


def test_plain_generate_untouched_without_dart_head(llama):
    ids = prompts(1, seed=37)[0]
    a = llama.generate(ids, max_new_tokens=5, do_sample=False)
    assert a.shape[1] == ids.shape[1] + 5
