"""The ways users reach DART besides a bare `generate` call: stop strings, pipelines, seeds, per-call stats, and
what a call leaves behind on the target (nothing)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AttentionInterface, PreTrainedTokenizerFast, pipeline
from transformers.generation.streamers import BaseStreamer

import dart_hf
from conftest import WORDS, make_head, make_target, prompts


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Whole-word tokens, plus "abcdef": the probe `StopStringCriteria` tokenizes to learn how tokens print."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *WORDS, "abcdef"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def word_model():
    tok = word_tokenizer()
    target = make_target("llama", vocab_size=len(tok), eos_token_id=1, pad_token_id=0, bos_token_id=None)
    return target, tok, make_head(target)


def word_prompt(tok, text: str = "w3 w14 w15 w92 w65 w35") -> torch.Tensor:
    return tok(text, return_tensors="pt").input_ids


# ------------------------------------------------------------------------------------------ stop strings
def test_stop_strings_with_tokenizer_equal_plain_generate(word_model):
    target, tok, head = word_model
    ids = word_prompt(tok)
    free = target.generate(ids, do_sample=False, max_new_tokens=30)[0, ids.shape[1] :]
    stop = tok.convert_ids_to_tokens(int(free[10]))  # a word the text really reaches
    kw = dict(do_sample=False, max_new_tokens=30, stop_strings=[stop], tokenizer=tok)
    ref = target.generate(ids, **kw)
    assert ref.shape[1] < ids.shape[1] + 30, "the stop string must end the text early for this test to mean much"
    assert torch.equal(target.generate(ids, assistant_model=head, **kw), ref)


# ------------------------------------------------------------------------------------------ pipelines
def test_pipeline_with_the_head_at_construction_and_at_call_time(word_model):
    target, tok, head = word_model
    kw = dict(do_sample=False, max_new_tokens=12)
    text = "w3 w14 w15 w92"
    ref = pipeline("text-generation", model=target, tokenizer=tok)(text, **kw)
    head.stats = None
    built = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=head)
    assert built(text, **kw) == ref
    assert head.stats is not None and head.stats.steps > 0, "the pipeline did not decode with DART"
    head.stats = None
    assert pipeline("text-generation", model=target, tokenizer=tok)(text, assistant_model=head, **kw) == ref
    assert head.stats is not None and head.stats.steps > 0


# ------------------------------------------------------------------------------------------ seeds
def sample(target, head, ids, seed: int, **kw):
    torch.manual_seed(seed)
    return target.generate(ids, assistant_model=head, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=40,
                           **kw)


def soft_target():
    target = make_target("llama")
    with torch.no_grad():
        target.lm_head.weight.div_(4.0)  # a soft distribution: many outcomes, long trees still accept tokens
    return target


def test_same_seed_same_text_whatever_the_node_budget():
    target = soft_target()
    head = make_head(target, tree_top_k=8, beam_width=4)
    ids = prompts(1, seed=41)[0]
    outs = [sample(target, head, ids, seed=3, dart_node_budget=b) for b in (1, 3, 12, 40, 12)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert not torch.equal(sample(target, head, ids, seed=4, dart_node_budget=12), outs[0])  # the seed matters


def test_sampling_consumes_the_random_stream_like_plain_generate():
    """One multinomial per new token over the same distribution: same seed -> the text plain generate samples."""
    target = soft_target()
    head = make_head(target, tree_top_k=8, beam_width=4, node_budget=12)
    for i, ids in enumerate(prompts(4, seed=43)):
        torch.manual_seed(i)
        ref = target.generate(ids, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=40)
        assert torch.equal(sample(target, head, ids, seed=i), ref), f"prompt {i}"


# ------------------------------------------------------------------------------------------ stats
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_stats_have_one_layout_in_both_modes(llama, mode):
    head = make_head(llama)
    ids = prompts(1, seed=47)[0]
    mine = dart_hf.DartStats()
    out = llama.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=20, dart_mode=mode,
                         dart_stats=mine)
    assert head.stats is mine and mine.mode == mode
    assert mine["new_tokens"] == out.shape[1] - ids.shape[1] == 1 + sum(mine["accepted_lengths"])
    assert mine["steps"] == len(mine["accepted_lengths"]) == len(mine["node_budgets"]) > 0
    assert mine["mean_accepted_length"] == sum(mine["accepted_lengths"]) / mine["steps"]
    assert {"prefill", "draft", "tree", "verify"} <= set(mine["time"]), mine["time"]
    assert set(dict(mine)) == set(dart_hf.DartStats().keys())


# ------------------------------------------------------------------------------------------ runtime
class Probe(BaseStreamer):
    """Records, at each streamed chunk, what DART has installed on the target at that moment."""

    def __init__(self, target):
        self.target, self.seen = target, []

    def put(self, value):
        layers = self.target.model.layers
        self.seen.append((self.target.config._attn_implementation, sum(len(l._forward_pre_hooks) for l in layers)))

    def end(self):
        pass


def installed(target) -> tuple:
    layers = target.model.layers
    return (
        target.config._attn_implementation,
        sum(len(layer._forward_pre_hooks) for layer in layers),
        [type(m).__name__ for m in target.modules() if "forward" in m.__dict__],
        "dart_grouped_sdpa" in AttentionInterface._global_mapping,
    )


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_a_call_changes_the_target_only_while_it_runs(llama, llama_head, mode):
    before = installed(llama)
    assert before == ("sdpa", 0, [], False), "import dart_hf registered or patched something"
    probe = Probe(llama)
    llama.generate(prompts(1, seed=53)[0], assistant_model=llama_head, do_sample=False, max_new_tokens=12,
                   dart_mode=mode, streamer=probe)
    assert installed(llama) == before
    assert probe.seen[-1] == ("dart_grouped_sdpa", 3)  # during the call: verify attention and the 3 capture hooks


# ------------------------------------------------------------------------------------------ the head
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_a_call_prepares_the_head_once_and_leaves_only_declared_state(llama, mode, monkeypatch):
    """One preparation per call in both modes (`loop.prepare_call`): the head check and the placement run once; the
    placement casts the head in place (the README says so); and the only attributes a call sets on the head are the
    ones `DartHead.__init__` declares (`stats`; `budget_state` stays None with a fixed budget)."""
    from dart_hf.core import loop
    from dart_hf.integrations import custom_generate, transformers as routing

    calls = []
    for name in ("check_head_matches_target", "prepare_head"):
        for module in (loop, routing, custom_generate):
            if hasattr(module, name):
                original = getattr(module, name)
                monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    head = make_head(llama, node_budget=4).to(torch.bfloat16)
    declared = dict(vars(head))
    assert declared["stats"] is None and declared["budget_state"] is None
    ids = prompts(1, seed=59)[0]
    out = llama.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=10, dart_mode=mode)
    assert torch.equal(out, llama.generate(ids, do_sample=False, max_new_tokens=10))
    assert sorted(calls) == ["check_head_matches_target", "prepare_head"], calls
    assert next(head.parameters()).dtype == torch.float32  # moved / cast in place, as the README says
    assert set(vars(head)) == set(declared) and head.stats.mode == mode and head.budget_state is None
    assert {k: v for k, v in vars(head).items() if k != "stats"} == {k: v for k, v in declared.items() if k != "stats"}
