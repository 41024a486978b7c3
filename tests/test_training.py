"""A tiny end-to-end training run: features captured during regeneration, a head trained on them."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import WORDS, make_target, make_word_tokenizer
from dart_hf.tools.evaluation import acceptance_report
from dart_hf.training.features import collect_features, iter_examples
from dart_hf.training.train import AnchorCollator, TrainConfig, new_head, train_head


def user_texts(n: int, offset: int = 0) -> list[str]:
    return [" ".join(WORDS[(7 * i + 3 * j) % 100] for j in range(3 + i % 5)) for i in range(offset, offset + n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0)
    tok = make_word_tokenizer()
    feats = tmp_path_factory.mktemp("features")
    collect_features(target, tok, user_texts(40), feats, max_new_tokens=24, batch_size=8, aux_layer_ids=[1, 3, 4])
    return target, tok, feats


def test_features_line_up_with_a_plain_forward(setup):
    target, tok, feats = setup
    examples = list(iter_examples(feats))
    assert len(examples) == 40
    from dart_hf.core.target import AuxHiddenCapture

    ex = examples[3]
    assert ex.aux.shape == (ex.ids.numel() - 1, 3 * 64)
    with AuxHiddenCapture(target, [1, 3, 4]) as cap, torch.no_grad():
        target(ex.ids[:-1].unsqueeze(0))
        ref = cap.take()[0]
    # captured during batched, left-padded, cached generation == one plain forward (bf16 storage tolerance)
    torch.testing.assert_close(ex.aux.float(), ref, atol=0.05, rtol=0.02)


def test_anchors_lie_in_the_response_and_do_not_depend_on_the_batch(setup):
    target, tok, feats = setup
    examples = list(iter_examples(feats))
    collate = AnchorCollator(examples, list(range(len(examples))), 4, seed=0)
    together = collate([2, 3])
    alone = collate([3])
    ex = examples[3]
    row = together["anchors"][1][together["anchor_valid"][1]]
    assert torch.equal(row, alone["anchors"][0][alone["anchor_valid"][0]])  # same place, same anchors
    assert int(row.min()) >= ex.prompt_length - 2 and int(row.max()) <= ex.ids.numel() - 3
    assert torch.equal(together["ids"][1, : ex.ids.numel()], ex.ids)


@pytest.mark.parametrize("draft_vocab_size", [None, 64])
def test_training_lowers_loss_and_raises_accepted_length(setup, tmp_path, draft_vocab_size):
    target, tok, feats = setup
    cfg = TrainConfig(draft_length=3, draft_vocab_size=draft_vocab_size, epochs=6, lr=3e-3, batch_size=2, loss="ce",
                      warmup_steps=5, anchors_per_sequence=16, log_every=10, save_every=1000)
    untrained = new_head(target, list(iter_examples(feats)), cfg, eos_ids=[1]).eval()
    held_out = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"] for t in user_texts(4, 200)]
    before = acceptance_report(target, untrained, held_out, max_new_tokens=24)

    def curve(h):
        assert not h.training and not torch.is_grad_enabled()
        return {"held_out": acceptance_report(target, h, held_out, 24, check_lossless=False)["mean_accepted_length"]}

    head = train_head(target, feats, tmp_path / "head", cfg, eos_ids=[1], evaluate=curve, eval_every=50)
    saved = json.loads((tmp_path / "head" / "training_history.json").read_text())
    history = saved["history"]
    assert history[-1]["loss"] < 0.7 * history[0]["loss"]
    after = acceptance_report(target, head.eval(), held_out, max_new_tokens=24)
    assert after["lossless"] and before["lossless"]
    assert after["mean_accepted_length"] > before["mean_accepted_length"] + 0.3
    # the accepted-length curve: start, every 50 steps, end (120 steps), against growing response tokens
    points = saved["evaluations"]
    assert [e["step"] for e in points] == [0, 50, 100, 120]
    assert points[0]["tokens"] == 0 and all(a["tokens"] < b["tokens"] for a, b in zip(points, points[1:]))
    assert points[-1]["accepted_length"]["held_out"] == pytest.approx(after["mean_accepted_length"])
    assert points[-1]["accepted_length"]["held_out"] > points[0]["accepted_length"]["held_out"] + 0.3
    assert (tmp_path / "head" / "training_curves.png").stat().st_size > 1000


def test_training_resumes_from_its_checkpoint(setup, tmp_path):
    target, tok, feats = setup
    cfg = TrainConfig(draft_length=3, draft_vocab_size=None, epochs=1, batch_size=2, loss="ce", save_every=5,
                      log_every=5)
    train_head(target, feats, tmp_path / "h", cfg, eos_ids=[1])
    assert (tmp_path / "h" / "checkpoint" / "trainer_state.pt").exists()
    state = torch.load(tmp_path / "h" / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 20  # 40 sequences / 2 per step, the whole run
    head = train_head(target, feats, tmp_path / "h", cfg, eos_ids=[1])  # nothing left: loads and returns
    assert head.config.draft_length == 3
