"""A tiny end-to-end training run: the target's answers regenerated into a token corpus, a head trained on them with
the target's features computed online."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import WORDS, make_target, make_word_tokenizer
from dart_hf.core.target import aux_request, aux_states
from dart_hf.tools.evaluation import acceptance_report
from dart_hf.training import train as train_module
from dart_hf.training.batches import AnchorCollator, anchor_positions
from dart_hf.training.corpus import load_corpus, regenerate
from dart_hf.training.head_init import new_head
from dart_hf.training.teacher import target_features
from dart_hf.training.train import TrainConfig, train_head


def user_texts(n: int, offset: int = 0) -> list[str]:
    return [" ".join(WORDS[(7 * i + 3 * j) % 100] for j in range(3 + i % 5)) for i in range(offset, offset + n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0)
    tok = make_word_tokenizer()
    corpus = tmp_path_factory.mktemp("corpus")
    regenerate(target, tok, user_texts(40), corpus, max_new_tokens=24, batch_size=8)
    return target, tok, corpus


def test_features_of_a_padded_batch_line_up_with_a_plain_forward(setup):
    target, tok, corpus = setup
    sequences = load_corpus(corpus)
    assert len(sequences) == 40
    by_length = sorted(sequences, key=lambda s: s.ids.numel())
    pair = [by_length[0], by_length[-1]]
    assert pair[0].ids.numel() < pair[1].ids.numel()  # the first is right-padded in the batch
    batch = AnchorCollator(pair, [0, 1], 4, seed=0)([0, 1])
    aux, final = target_features(target, [1, 3, 4], batch["ids"], batch["lengths"])
    assert aux.shape[:2] == final.shape[:2] == (2, batch["ids"].shape[1] - 1)
    for row, seq in enumerate(pair):
        n = seq.ids.numel() - 1  # the last token is never fed
        with torch.no_grad():
            out = target.get_decoder()(seq.ids[:-1].unsqueeze(0), **aux_request([1, 3, 4]))
            hidden, ref = out.last_hidden_state[0], aux_states(out, [1, 3, 4])[0]
        assert ref.shape == (n, 3 * 64)
        torch.testing.assert_close(aux[row, :n], ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(final[row, :n], hidden, atol=1e-4, rtol=1e-4)


def test_anchors_lie_in_the_response_and_do_not_depend_on_the_batch(setup):
    target, tok, corpus = setup
    sequences = load_corpus(corpus)
    collate = AnchorCollator(sequences, list(range(len(sequences))), 4, seed=0)
    together = collate([2, 3])
    alone = collate([3])
    seq = sequences[3]
    row = together["anchors"][1][together["anchor_valid"][1]]
    assert torch.equal(row, alone["anchors"][0][alone["anchor_valid"][0]])  # same place, same anchors
    assert int(row.min()) >= seq.prompt_length - 2 and int(row.max()) <= seq.ids.numel() - 3
    assert torch.equal(together["ids"][1, : seq.ids.numel()], seq.ids)
    n = seq.ids.numel()  # the response is labelled, the prompt and the padding are not
    assert together["label_mask"][1].tolist() == [False] * seq.prompt_length + [True] * (n - seq.prompt_length) + [
        False] * (together["ids"].shape[1] - n)
    assert anchor_positions(seq, 0, random.Random(0)) == list(range(seq.prompt_length - 2, n - 2))


@pytest.mark.parametrize("draft_vocab_size, loss", [(None, "ce"), (64, "ce"), (64, "kl")])
def test_training_lowers_loss_and_raises_accepted_length(setup, tmp_path, draft_vocab_size, loss):
    target, tok, corpus = setup
    cfg = TrainConfig(draft_length=3, draft_vocab_size=draft_vocab_size, epochs=6, lr=3e-3, batch_size=2, loss=loss,
                      warmup_steps=5, anchors_per_sequence=16, log_every=10, save_every=1000)
    untrained = new_head(target, load_corpus(corpus), [1], draft_length=3, draft_vocab_size=draft_vocab_size).eval()
    held_out = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)["input_ids"] for t in user_texts(4, 200)]
    before = acceptance_report(target, untrained, held_out, max_new_tokens=24)

    def curve(h):
        assert not h.training and not torch.is_grad_enabled()
        return {"held_out": acceptance_report(target, h, held_out, 24, check_lossless=False)["mean_accepted_length"]}

    head = train_head(target, corpus, tmp_path / "head", cfg, eos_ids=[1], device="cpu", evaluate=curve, eval_every=50)
    saved = json.loads((tmp_path / "head" / "training_history.json").read_text())
    assert saved["config"]["loss"] == loss
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


def test_training_resumes_from_its_checkpoint(setup, tmp_path, monkeypatch):
    target, tok, corpus = setup
    cfg = TrainConfig(draft_length=3, draft_vocab_size=None, epochs=1, batch_size=2, save_every=5, log_every=5)
    train_head(target, corpus, tmp_path / "h", cfg, eos_ids=[1], device="cpu")
    assert (tmp_path / "h" / "checkpoint" / "trainer_state.pt").exists()
    state = torch.load(tmp_path / "h" / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 20  # 40 sequences / 2 per step, the whole run
    forwards = []
    fresh = train_module.target_features
    monkeypatch.setattr(train_module, "target_features", lambda *a: forwards.append(1) or fresh(*a))
    head = train_head(target, corpus, tmp_path / "h", cfg, eos_ids=[1], device="cpu")  # nothing left: loads, returns
    assert head.config.draft_length == 3 and forwards == []  # not one batch trained again
