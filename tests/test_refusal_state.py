"""A refused call changes nothing, in every mode (tree, static, batch, chain, `custom_generate=dart_decode`,
pipelines, serve): every refusal and every input error is raised by the call's checks, before the head is placed
(cast / moved), before its stats or budget state are touched, and names its cause. A bf16 target with a fresh fp32
head makes any placement visible: an accepted call casts the head in place (`test_an_accepted_call_changes_the_head`
shows the snapshot sees it)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from transformers import pipeline

import dart_hf
from conftest import TINY, make_head, make_target, make_word_tokenizer, word_llama
from dart_hf.core.budget import BudgetState
from dart_hf.integrations import custom_generate
from dart_hf.integrations import transformers as routing
from dart_hf.tools import serve

VOCAB = TINY["vocab_size"]
IDS = torch.tensor([[5, 6, 7, 8, 9, 10]])


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def snapshot(head: dart_hf.DartHead) -> dict:
    """What a call could change on the head: its weights (bytes, dtype, device), its attributes, the identity of its
    stats and budget state, its placement."""
    return dict(
        weights={k: (v.dtype, v.device, digest(v)) for k, v in head.state_dict().items()},
        attributes=set(vars(head)),
        stats=head.stats,
        steps=head.stats.steps,
        budget_state=head.budget_state,
        placed=(head._dart_placed, dict(head._placed_copies)),
    )


def assert_unchanged(head: dart_hf.DartHead, before: dict) -> None:
    after = snapshot(head)
    assert after["weights"] == before["weights"]
    assert after["stats"] is before["stats"] and after["budget_state"] is before["budget_state"]
    assert after == before


def bf16_pair(target=None) -> tuple:
    """A bf16 target (a tiny Llama, or `target` cast) and a fresh fp32 head for it that has stats of its own."""
    target = (make_target("llama") if target is None else target).to(torch.bfloat16)
    head = make_head(target).float()
    head.stats = dart_hf.DartStats(steps=7)
    return target, head


def run(mode: str, target, head, ids: torch.Tensor, **kwargs):
    """One call in `mode`: tree / static / batch (the rows as given) through `generate(assistant_model=head)`, chain,
    or the tree loop reached as `custom_generate=dart_decode`."""
    kwargs = {"max_new_tokens": 3, "do_sample": False, **kwargs}
    if mode == "custom_generate":
        return target.generate(ids, custom_generate=dart_hf.dart_decode, dart_head=head, **kwargs)
    if mode == "static":
        kwargs["cache_implementation"] = "static"
    return target.generate(ids, assistant_model=head, dart_mode="chain" if mode == "chain" else "tree", **kwargs)


def rows(tensor: torch.Tensor, mode: str) -> torch.Tensor:
    return tensor.repeat(2, 1) if mode == "batch" else tensor


# ------------------------------------------------------------------------------------------ input errors
# name -> (the call's input_ids and kwargs for `mode`, the message's pattern). Each is a ValueError in every mode.
INPUT_ERRORS = {
    "empty input_ids": (lambda m: (rows(torch.zeros(1, 0, dtype=torch.long), m), {}),
                        r"input_ids is empty: DART dart_mode=\"(tree|chain)\" needs at least one prompt token"),
    "float ids": (lambda m: (rows(IDS.float(), m), {}),
                  r"input_ids must be integer token ids \(torch.long or torch.int32\), got torch.float32"),
    "id past the vocabulary": (lambda m: (rows(torch.tensor([[5, 6, VOCAB]]), m), {}),
                               rf"token id {VOCAB} is past the target's vocabulary \({VOCAB}\)"),
    "negative id": (lambda m: (rows(torch.tensor([[5, -1, 7]]), m), {}),
                    rf"token id -1 is negative: input_ids must be token ids in 0..{VOCAB - 1}"),
    "mask columns": (lambda m: (rows(IDS, m), dict(attention_mask=rows(torch.ones(1, 4, dtype=torch.long), m))),
                     r"attention_mask( \(or position_ids\))? has 4 columns but input_ids has 6"),
    "mask rows": (lambda m: (IDS, dict(attention_mask=torch.ones(3, 6, dtype=torch.long))),
                  r"attention_mask( \(or position_ids\))? has 3 rows but input_ids has 1"),
}
MODES = ["tree", "static", "batch", "chain", "custom_generate"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(INPUT_ERRORS))
def test_an_input_error_is_named_and_changes_nothing(mode, case):
    build, message = INPUT_ERRORS[case]
    target, head = bf16_pair()
    ids, kwargs = build(mode)
    before = snapshot(head)
    with pytest.raises(ValueError, match=message):
        run(mode, target, head, ids, **kwargs)
    assert_unchanged(head, before)


def test_the_hub_entry_checks_the_prompt_before_transformers(monkeypatch):
    """`custom_generate="<head folder>"` (the Hub entry, `custom_generate.generate`): an empty batch is named before
    transformers reads its last column (an IndexError) and before the head loads."""
    target = make_target("llama")
    monkeypatch.setattr(custom_generate, "load_head", lambda *a, **k: pytest.fail("the head loaded"))
    with pytest.raises(ValueError, match=r"input_ids is empty.*shape \(2, 0\)"):
        custom_generate.generate(target, torch.zeros(2, 0, dtype=torch.long), dart_head="unused", max_new_tokens=3)


def test_plain_generate_keeps_its_own_errors():
    """Without a DART head the wrappers defer to transformers: its own error, not DART's check."""
    target = make_target("llama")
    with pytest.raises(IndexError):
        target.generate(torch.tensor([[5, 6, VOCAB]]), max_new_tokens=3, do_sample=False)
    with pytest.raises(RuntimeError, match="cannot reshape tensor of 0 elements"):
        target.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3, do_sample=False)


def test_int32_ids_decode_as_plain_generate():
    """torch.int32 ids are token ids too (the embedding takes them): not refused."""
    target = make_target("llama")
    head = make_head(target)
    ids = IDS.to(torch.int32)
    for mode in ("tree", "chain"):
        assert torch.equal(run(mode, target, head, ids), target.generate(ids, max_new_tokens=3, do_sample=False))


# ------------------------------------------------------------------------------------------ refusals
# name -> (the call's kwargs, the error type, the message's pattern)
CHAIN_REFUSED = {
    "num_return_sequences": (dict(num_return_sequences=2, do_sample=True), ValueError,
                             r'dart_mode="chain" .* returns one sequence per prompt: num_return_sequences=2'),
    "num_beams": (dict(num_beams=2), ValueError, r'dart_mode="chain" .* num_beams=2 is not supported'),
    "budget state": (dict(dart_budget_state=BudgetState()), ValueError,
                     r'dart_budget_state is a dart_mode="tree" option .* dart_mode="chain" takes one node budget'),
    "unknown option": (dict(dart_node_budgets=4), ValueError,
                       r'unknown DART option dart_node_budgets: dart_mode="chain" takes dart_node_budget, '
                       r"dart_prompt_lookup, dart_timing, dart_stats"),
    "budget 0": (dict(dart_node_budget=0), ValueError, r'dart_node_budget=0 \(plain decoding\) is a dart_mode="tree"'),
    "budget 2.5": (dict(dart_node_budget=2.5), ValueError, "dart_node_budget must be a whole number"),
    "stats type": (dict(dart_stats="mine"), TypeError, "dart_stats must be a dart_hf.DartStats"),
    "guidance": (dict(guidance_scale=1.5), ValueError, "guidance_scale"),
    # transformers' own checks run before the head is placed too
    "model kwarg typo": (dict(output_atentions=True), ValueError, "output_atentions"),
}


@pytest.mark.parametrize("case", sorted(CHAIN_REFUSED))
def test_a_chain_refusal_changes_nothing(case):
    kwargs, error, message = CHAIN_REFUSED[case]
    target, head = bf16_pair()
    before = snapshot(head)
    with pytest.raises(error, match=message):
        run("chain", target, head, IDS, **kwargs)
    assert_unchanged(head, before)


@pytest.mark.parametrize("mode", ["tree", "static", "batch", "custom_generate"])
def test_a_misspelt_option_changes_nothing_in_tree_mode(mode):
    """The tree loop's options are `dart_decode`'s arguments: a misspelt one is transformers' typo error (it is one),
    raised before the loop runs."""
    target, head = bf16_pair()
    before = snapshot(head)
    with pytest.raises(ValueError, match=r"not used by the model: \['dart_node_budgets'\] \(note: typos"):
        run(mode, target, head, rows(IDS, mode), dart_node_budgets=4)
    assert_unchanged(head, before)


@pytest.mark.parametrize("mode", MODES)
def test_an_accepted_call_changes_the_head(mode):
    """The control: the snapshot sees the first call's placement (the fp32 head cast to bf16 in place) and stats."""
    target, head = bf16_pair()
    before = snapshot(head)
    run(mode, target, head, rows(IDS, mode))
    assert next(head.parameters()).dtype == torch.bfloat16
    assert snapshot(head)["weights"] != before["weights"] and head.stats is not before["stats"]


# ------------------------------------------------------------------------------------------ chain mode's options
def chain_generator(monkeypatch) -> list:
    """The candidate generators chain-mode calls build from now on."""
    built, init = [], routing.DartCandidateGenerator.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(routing.DartCandidateGenerator, "__init__", record)
    return built


@pytest.mark.parametrize("budget", [3, "auto"])
def test_chain_mode_takes_its_dart_options(llama, monkeypatch, budget):
    """dart_node_budget (the tree whose best chain is proposed), dart_prompt_lookup, dart_timing and dart_stats reach
    the chain drafter; the text stays plain greedy decoding's."""
    head = make_head(llama, node_budget=8, prompt_lookup=False)  # the config's budget and lookup are not the call's
    built, stats = chain_generator(monkeypatch), dart_hf.DartStats()
    out = run("chain", llama, head, IDS, max_new_tokens=8, dart_node_budget=budget, dart_prompt_lookup=True,
              dart_timing=True, dart_stats=stats)
    assert torch.equal(out, llama.generate(IDS, max_new_tokens=8, do_sample=False))
    (generator,) = built
    assert head.stats is stats and stats.mode == "chain"
    assert stats.budget_mode == ("fixed" if budget == 3 else "auto") and generator.node_budget == stats.node_budget
    assert stats.node_budget == 3 if budget == 3 else stats.node_budget >= 1
    assert generator.drafter.params.node_budget == stats.node_budget
    assert generator.drafter.lookup is not None and generator.timer.requested
    assert (head.budget_state is None) == (budget == 3)  # "auto" reads the cost-aware policy's choice


def test_chain_mode_defaults_come_from_the_head_config(llama, monkeypatch):
    head = make_head(llama, node_budget=5)
    built = chain_generator(monkeypatch)
    run("chain", llama, head, IDS, dart_budget_state=None)  # a tree option left at its default passes
    (generator,) = built
    assert head.stats.node_budget == 5 and head.stats.budget_mode == "fixed"
    assert (generator.drafter.lookup is not None) == head.config.prompt_lookup and not generator.timer.requested


# ------------------------------------------------------------------------------------------ pipelines and serve
@pytest.fixture()
def word_pipeline():
    target, head = bf16_pair(word_llama())
    return pipeline("text-generation", model=target, tokenizer=make_word_tokenizer(), assistant_model=head), head


@pytest.mark.parametrize("mode, kwargs, message", [
    ("chain", dict(dart_node_budget=0), r"dart_node_budget=0 \(plain decoding\)"),
    ("chain", dict(dart_timings=True), r'unknown DART option dart_timings: dart_mode="chain"'),
    ("chain", dict(num_beams=2), r'dart_mode="chain" .* num_beams=2 is not supported'),
    ("tree", dict(num_beams=2), "DART decoding supports num_beams=1"),
    ("tree", dict(dart_node_budget=-1), "dart_node_budget must be a whole number"),
])
def test_a_pipeline_refusal_changes_nothing(word_pipeline, mode, kwargs, message):
    pipe, head = word_pipeline
    before = snapshot(head)
    with pytest.raises(ValueError, match=message):
        pipe("w1 w2 w3", max_new_tokens=3, do_sample=False, dart_mode=mode, **kwargs)
    assert_unchanged(head, before)


def test_serve_names_a_refusal_and_leaves_the_head(monkeypatch):
    """The server's `generate` (`serve.DartGenerate`): a request DART refuses is logged with DART's message and decoded
    plainly (a plain error stays plain `generate`'s), the head as it was."""
    target, head = bf16_pair()
    warnings = []
    monkeypatch.setattr(serve.logger, "warning", warnings.append)
    served = serve.DartGenerate(target.generate, head)
    before = snapshot(head)
    with pytest.raises(IndexError):  # plain generate's own error for the id past the vocabulary
        served(torch.tensor([[5, 6, VOCAB]]), max_new_tokens=3, do_sample=False)
    assert f"ValueError: token id {VOCAB} is past the target's vocabulary" in warnings[-1]
    beams = dict(max_new_tokens=3, do_sample=False, num_beams=2)
    assert torch.equal(served(IDS, **beams), target.generate(IDS, **beams))
    assert "num_beams=1" in warnings[-1]
    assert_unchanged(head, before)
