"""Every decoder-only model type transformers ships, as a user would run it: a tiny random target, a fresh head,
greedy DART in tree mode and in chain mode against plain `generate`.

Each type must do what `dart_hf.tools.targets.MATRIX` (docs/TARGETS.md's table) says: give plain `generate`'s tokens, or
be refused with the clear error. A different output is a failure whatever the list says. Types whose own plain
`generate` fails on the tiny config are skipped, with transformers' error as the reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

import dart_hf
from dart_hf.tools.targets import MATRIX, TESTED_WITH, decoder_only_model_types, markdown, tiny_config

PROMPT, NEW = 16, 8  # prompt longer than the tiny sliding window (8), so the window cuts
TYPES = decoder_only_model_types()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny targets gain nothing from threads, and a busy CI machine makes them wait for them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_target(model_type: str):
    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    with torch.no_grad():  # a sharper random target: fewer near-ties between the two best logits
        target.get_output_embeddings().weight.mul_(4.0)
    target.generation_config.eos_token_id = None  # every run makes NEW tokens (a random target may start with EOS)
    return target


def observe(model_type: str) -> tuple[str, str]:
    """(verdict, detail) of one model type, measured."""
    try:
        target = tiny_target(model_type)
        ids = torch.randint(3, target.config.get_text_config().vocab_size, (1, PROMPT),
                            generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            plain = target.generate(ids, do_sample=False, max_new_tokens=NEW)
    except Exception as err:
        return "untested", f"plain generate fails: {type(err).__name__}: {str(err)[:120]}"
    if plain.shape[1] != PROMPT + NEW:
        return "untested", f"plain generate made {plain.shape[1] - PROMPT} of {NEW} tokens"
    try:
        head = dart_hf.DartHead.from_target(target, draft_length=4, tree_top_k=64, beam_width=16, node_budget=32,
                                            ngram_weight=8.0).eval()
    except (ValueError, TypeError) as err:
        return "refused", str(err)
    # the head drafts with an n-gram of the target's own greedy text, so multi-token acceptance (tree verify +
    # compaction) really runs
    head.ngram = dart_hf.NGramModel.build([plain[0].tolist()], order=3, vocab_size=head.config.vocab_size,
                                          progress=False)
    outputs = {}
    for mode in ("tree", "chain"):
        try:
            outputs[mode] = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=NEW,
                                            dart_mode=mode)
            if mode == "tree":
                accepted = max(head.stats["accepted_lengths"], default=0)
        except NotImplementedError as err:  # DART's refusal of tree mode (checked below)
            outputs[mode] = err
        except TypeError as err:  # DART's refusal of a layout without decoder `layers` (both modes)
            assert "has no decoder `layers`" in str(err), err
            outputs[mode] = err
    tree, chain = outputs["tree"], outputs["chain"]
    if isinstance(tree, TypeError):
        assert isinstance(chain, TypeError), chain
        return "refused", str(tree)
    for mode, out in outputs.items():
        if isinstance(out, torch.Tensor):
            assert torch.equal(out, plain), f"{model_type}: {mode} mode differs from plain generate"
    if isinstance(tree, torch.Tensor):
        assert isinstance(chain, torch.Tensor), f"{model_type}: chain mode failed: {chain}"
        return "tree", f"accepted up to {accepted} tokens per step"
    message = str(tree)
    assert isinstance(tree, NotImplementedError) and model_type in message, message
    if isinstance(chain, torch.Tensor):
        assert 'Use dart_mode="chain"' in message, message
        return "chain", message
    assert isinstance(chain, NotImplementedError) and "Chain mode cannot run it either" in message, chain
    return "refused", message


@pytest.mark.parametrize("model_type", TYPES)
def test_model_type_is_exact_or_refused(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdict, detail = observe(model_type)
    listed = MATRIX.get(model_type, ("unlisted", ""))[0]
    if verdict == "untested":
        assert listed == "untested", f"{model_type}: listed {listed!r}, but {detail}"
        pytest.skip(f"{model_type}: {detail}")
    assert verdict == listed, f"{model_type}: listed {listed!r}, measured {verdict!r} ({detail})"


def test_every_listed_type_is_a_decoder_only_type_of_this_transformers():
    if transformers.__version__ != TESTED_WITH:
        pytest.skip(f"MATRIX was measured on transformers {TESTED_WITH}, this is {transformers.__version__}")
    assert sorted(MATRIX) == TYPES


def test_docs_list_the_matrix():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "TARGETS.md").read_text(encoding="utf-8")
    assert markdown() in doc, "docs/TARGETS.md target table is stale: paste `python -m dart_hf.tools.targets` into it"


def test_refusal_comes_before_any_work():
    """A refused target is not run at all: no prefill, no head forward (the error is raised from the config)."""
    target = tiny_target("lfm2")
    head = dart_hf.DartHead.from_target(target, draft_length=3).eval()
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(NotImplementedError, match=r"'lfm2' targets: it has state-space .* Use dart_mode=\"chain\""):
        target.generate(torch.tensor([[5, 6, 7]]), assistant_model=head, max_new_tokens=4)
    assert calls == []
