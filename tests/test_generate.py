"""What a DART call reports besides its tokens: streamed chunks, step statistics, and chain mode's drafts.
(That the tokens are plain `generate`'s is tests/test_lossless.py.)"""

from __future__ import annotations

import torch
from transformers.generation.streamers import BaseStreamer

import dart_hf
from conftest import make_head, prompts


def ngram_head(target, texts: list[torch.Tensor]) -> dart_hf.DartHead:
    """A random head with wide beams plus an n-gram of the target's own greedy text: multi-token acceptance."""
    head = make_head(target, tree_top_k=96, beam_width=32, node_budget=32)
    seqs = [target.generate(p, do_sample=False, max_new_tokens=64)[0].tolist() for p in texts]
    head.ngram = dart_hf.NGramModel.build(seqs, order=3, vocab_size=target.config.vocab_size, progress=False)
    return head


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


def record_drafts(head, monkeypatch) -> dict[int, torch.Tensor]:
    """Draft logits keyed by the prefix length the head has consumed when it drafts."""
    seen: dict[int, torch.Tensor] = {}
    original = head.draft_rows

    def spy(aux, next_tokens, real, cache_k, cache_v, lengths, depth, *args, **kwargs):
        prefix = int(lengths[0] + real[0])
        logits = original(aux, next_tokens, real, cache_k, cache_v, lengths, depth, *args, **kwargs)
        seen[prefix] = logits[0]
        return logits

    monkeypatch.setattr(head, "draft_rows", spy)
    return seen


def test_chain_mode_drafts_from_the_same_target_states_as_tree_mode(llama, monkeypatch):
    """The chain generator inside transformers' assisted loop must feed the head the target states the tree loop
    feeds it: at every prefix both modes drafted at, the same draft logits."""
    head = ngram_head(llama, prompts(3, seed=23))
    for ids in prompts(3, seed=23):
        chain_drafts = record_drafts(head, monkeypatch)
        llama.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=30, dart_mode="chain")
        tree_drafts = record_drafts(head, monkeypatch)
        llama.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=30)
        common = chain_drafts.keys() & tree_drafts.keys()
        assert len(common) >= 3
        for prefix in common:
            rows = min(len(chain_drafts[prefix]), len(tree_drafts[prefix]))  # the tree loop drafts <= budget rows
            torch.testing.assert_close(chain_drafts[prefix][:rows], tree_drafts[prefix][:rows], atol=1e-4, rtol=1e-4)


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
