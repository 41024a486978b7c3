"""What a call leaves behind: per-call stats in one layout, nothing on the target, only declared state on the head.
(Stop strings and pipelines give plain `generate`'s tokens, a seed the same text at every node budget:
tests/test_lossless.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.generation.streamers import BaseStreamer

import dart_hf
from conftest import make_head, prompts


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
    """Records, at each streamed chunk, what is installed on the target and set in torch at that moment."""

    def __init__(self, target):
        self.target, self.seen = target, []

    def put(self, value):
        self.seen.append(installed(self.target))

    def end(self):
        pass


def installed(target) -> tuple:
    layers = target.model.layers
    return (
        target.config._attn_implementation,
        sum(len(layer._forward_pre_hooks) for layer in layers),
        tuple(type(m).__name__ for m in target.modules() if "forward" in m.__dict__),
        tuple(sorted(AttentionInterface._global_mapping)),
        torch.get_num_threads(),
    )


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_a_call_changes_nothing_on_the_target_or_in_torch_even_while_it_runs(llama, llama_head, mode):
    """No hook, swapped forward, attention name or thread count: a plain call in another thread at the same moment
    runs exactly as without DART (the layer inputs come back from the forward itself: `target.aux_request`)."""
    before = installed(llama)
    assert before[:3] == ("sdpa", 0, ()), "import dart_hf registered or patched something"
    probe = Probe(llama)
    llama.generate(prompts(1, seed=53)[0], assistant_model=llama_head, do_sample=False, max_new_tokens=12,
                   dart_mode=mode, streamer=probe)
    assert installed(llama) == before
    assert len(probe.seen) > 2 and set(probe.seen) == {before}  # during the call too


# ------------------------------------------------------------------------------------------ the head
@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_a_call_prepares_the_head_once_and_leaves_only_declared_state(llama, mode, monkeypatch):
    """One preparation per call in both modes (`loop.prepare_call`): the head check and the placement run once; the
    placement casts the head in place (the README says so); and the only attributes a call sets on the head are the
    ones `DartHead.__init__` declares (`stats`; `budget_state` stays None with a fixed budget)."""
    from dart_hf.core import checks, loop
    from dart_hf.integrations import custom_generate, transformers as routing

    calls = []
    for name in ("check_head_matches_target", "prepare_head"):
        for module in (checks, loop, routing, custom_generate):
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
    changed = {"stats", "_dart_placed"}
    assert {k: v for k, v in vars(head).items() if k not in changed} == {
        k: v for k, v in declared.items() if k not in changed}
    assert head._dart_placed and head._placed_copies == {}


# ------------------------------------------------------------------------------------------ what import changes
def test_every_wrapper_import_installs_defers_untouched_for_a_call_without_a_dart_head(llama, monkeypatch, tmp_path):
    """The three transformers functions `import dart_hf` wraps (docs/ARCHITECTURE.md lists them) hand any call
    without a DART head to the original with exactly its arguments."""
    from transformers import GenerationMixin
    import transformers.pipelines.base as pipelines_base

    from dart_hf.integrations import transformers as routing

    assert GenerationMixin.generate is routing._generate
    assert GenerationMixin._get_candidate_generator is routing._get_candidate_generator
    assert pipelines_base.load_assistant_model is routing._load_assistant_model
    seen = []
    record = lambda name: (lambda *args, **kwargs: seen.append((name, args, kwargs)) or name)
    monkeypatch.setattr(routing, "_original_generate", record("generate"))
    monkeypatch.setattr(routing, "_original_get_candidate_generator", record("candidates"))
    monkeypatch.setattr(routing, "_original_load_assistant_model", record("load"))
    ids, draft = prompts(1, seed=61)[0], make_head(llama)  # a head is not a causal LM: stand-in objects below
    assistant = object()
    assert llama.generate(ids, max_new_tokens=3, assistant_model=assistant, top_k=4) == "generate"
    assert seen[-1] == ("generate", (llama, ids), {"max_new_tokens": 3, "assistant_model": assistant, "top_k": 4})
    assert routing._get_candidate_generator(llama, "config", 1, assistant_model=assistant) == "candidates"
    assert seen[-1] == ("candidates", (llama, "config", 1), {"assistant_model": assistant})
    llama.config.save_pretrained(tmp_path)
    folder = str(tmp_path)  # a causal LM's folder, as pipelines take one (its config.json only: not a head)
    assert routing._load_assistant_model(llama, folder, None) == "load"
    assert seen[-1] == ("load", (llama, folder, None), {})
    assert draft.stats is None  # (the head was never involved)
