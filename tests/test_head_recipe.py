"""The head recipe's pieces: chats as text (labelled spans, agreement-masked labels), every position as an anchor,
standardised captured-layer inputs folded into the saved weights, a wall-time budget, and `dart-hf eval-head`'s
measures against hand-computed values."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import WORDS, make_target, make_word_tokenizer
from dart_hf.core.modeling import DartHead
from dart_hf.tools.eval_head import chain_accepted_length, depth_agreement, evaluate_head, format_table
from dart_hf.tools.offline_acceptance import DraftRows, Text
from dart_hf.training import train as train_module
from dart_hf.training.batches import AnchorCollator, anchor_positions, label_validity
from dart_hf.training.corpus import conversation_record, import_conversations, load_corpus
from dart_hf.training.head_init import copy_target_layer, new_head
from dart_hf.training.train import TrainConfig, train_head


def chats(n: int) -> list[list[dict]]:
    text = lambda i, k: " ".join(WORDS[(5 * i + 3 * j) % 100] for j in range(k))
    return [[{"role": "user", "content": text(i, 3)}, {"role": "assistant", "content": text(i + 1, 6)},
             {"role": "user", "content": text(i + 2, 2)}, {"role": "assistant", "content": text(i + 3, 5)}]
            for i in range(n)]


@pytest.fixture(scope="module")
def tiny():
    return make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0), make_word_tokenizer()


def test_a_chat_as_text_labels_exactly_its_assistant_turns(tiny):
    _, tok = tiny
    record = conversation_record(tok, chats(1)[0], max_tokens=100)
    ids = record["prompt"] + record["response"]
    labelled = [tok.decode(ids[a:b]) for a, b in record["spans"]]
    assert labelled == [" ".join(WORDS[(5 + 3 * j) % 100] for j in range(6)) + " <eos>",
                        " ".join(WORDS[(15 + 3 * j) % 100] for j in range(5)) + " <eos>"]
    assert record["spans"][0][0] == len(record["prompt"])  # the prompt is everything before the first answer
    cut = conversation_record(tok, chats(1)[0], max_tokens=record["spans"][1][0] + 2)
    assert cut["spans"][-1][1] == record["spans"][1][0] + 2  # a cut chat keeps the part of the answer that fits


def test_anchors_of_a_chat_sit_before_labelled_tokens_only(tiny, tmp_path):
    _, tok = tiny
    assert import_conversations(tok, chats(3), tmp_path / "c", 112, [1]) == 3
    assert import_conversations(tok, chats(3), tmp_path / "c", 112, [1]) == 0  # a rerun adds nothing twice
    seq = load_corpus(tmp_path / "c")[1]
    anchors = anchor_positions(seq, 0, random.Random(0))
    assert anchors == [a for a in range(seq.ids.numel() - 2) if seq.label_mask[a + 2]]  # every labelled one
    assert len(anchor_positions(seq, 4, random.Random(0))) == 4
    batch = AnchorCollator([seq], [0], 0, seed=0)([0])
    assert torch.equal(batch["label_mask"][0], seq.label_mask)
    assert int(batch["response_tokens"]) == int(seq.label_mask.sum())


def test_a_deeper_label_is_kept_only_where_the_text_agrees_with_the_target_before_it():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    position = torch.tensor([[[1, 2, 3]]])  # one anchor (a = 0), depths 0..2 predict tokens 2, 3, 4
    valid, mask = torch.ones(1, 1, 3, dtype=torch.bool), torch.ones(1, 7, dtype=torch.bool)
    agrees = torch.tensor([[[12, 13, 14]]])  # the target's argmax at rows 1, 2, 3 is the text's next token
    assert label_validity(valid, position, ids, mask, agrees).tolist() == [[[True, True, True]]]
    first_differs = torch.tensor([[[99, 13, 14]]])  # depth 0 still counts: its context is the text itself
    assert label_validity(valid, position, ids, mask, first_differs).tolist() == [[[True, False, False]]]
    second_differs = torch.tensor([[[12, 99, 14]]])
    assert label_validity(valid, position, ids, mask, second_differs).tolist() == [[[True, True, False]]]
    mask[0, 3] = False  # token 3 is not labelled (a user turn)
    assert label_validity(valid, position, ids, mask, agrees).tolist() == [[[True, False, True]]]


def test_a_chat_text_head_trains_on_every_position_from_the_target_layer_and_resumes(tiny, tmp_path):
    target, tok = tiny
    import_conversations(tok, chats(24), tmp_path / "c", 112, [1])
    cfg = TrainConfig(draft_length=3, draft_vocab_size=None, epochs=2, lr=3e-3, batch_size=4, warmup_steps=2,
                      anchors_per_sequence=0, init_layer_from_target=True, log_every=2, save_every=4)
    head = train_head(target, tmp_path / "c", tmp_path / "head", cfg, eos_ids=[1], device="cpu")
    saved = DartHead.from_pretrained(tmp_path / "head")
    torch.testing.assert_close(head.fc.weight, saved.fc.weight)
    last = target.get_decoder().layers[-1].mlp.down_proj.weight
    assert not torch.equal(saved.midlayer.mlp.down_proj.weight, last)  # trained away from the copy it started as
    steps = json.loads((tmp_path / "head" / "training_history.json").read_text())["history"]
    train_head(target, tmp_path / "c", tmp_path / "head", TrainConfig(**{**cfg.__dict__, "epochs": 3}), eos_ids=[1],
               device="cpu")
    resumed = json.loads((tmp_path / "head" / "training_history.json").read_text())["history"]
    assert resumed[: len(steps)] == steps and resumed[-1]["step"] > steps[-1]["step"]  # continued, not restarted


def test_a_time_budget_stops_training_and_runs_the_schedule_on_that_clock(tiny, tmp_path, monkeypatch):
    target, tok = tiny
    import_conversations(tok, chats(24), tmp_path / "c", 112, [1])
    clock = iter(range(0, 10**6, 1))  # a fake clock: one second per reading, whatever the machine does
    monkeypatch.setattr(train_module.time, "perf_counter", lambda: float(next(clock)))
    cfg = TrainConfig(draft_length=3, draft_vocab_size=None, epochs=50, batch_size=4, warmup_steps=1,
                      anchors_per_sequence=4, max_seconds=12, log_every=1, save_every=1000)
    train_head(target, tmp_path / "c", tmp_path / "head", cfg, eos_ids=[1], device="cpu")
    history = json.loads((tmp_path / "head" / "training_history.json").read_text())["history"]
    assert 2 <= history[-1]["step"] < 50 * 6  # stopped by the clock long before 50 epochs
    assert history[-1]["seconds"] <= cfg.max_seconds + 6
    assert train_module._lr_at(10, 1000, cfg, seconds=12) == pytest.approx(0.0, abs=1e-12)  # decayed on the clock
    assert train_module._lr_at(10, 1000, cfg, seconds=6) == pytest.approx(cfg.lr / 2)


def test_eval_head_measures_match_a_hand_count():
    """Two depths, one text of 6 tokens after a 2-token prompt; the head's top-1 is right at depth 0 for roots 0, 2
    and at depth 1 for root 0 only."""
    text = Text(torch.tensor([5, 6, 7, 8, 9, 10, 11, 12]), prompt_length=2, max_length=8)
    roots, depths, keep = 6, 2, 3
    ids = torch.zeros(roots, depths, keep, dtype=torch.long)
    truth = lambda j, d: int(text.ids[min(2 + j + 1 + d, 7)])
    for j in range(roots):
        for d in range(depths):
            ids[j, d] = torch.tensor([0, 1, truth(j, d)])  # the true token is third: a top-3 hit everywhere
    ids[0, 0, 0], ids[2, 0, 0], ids[0, 1, 0] = truth(0, 0), truth(2, 0), truth(0, 1)
    rows = DraftRows(torch.zeros(roots, depths, keep), ids, torch.zeros(roots, depths))

    class Head:  # what the measures read of a head
        draft_to_target = None

        class config:
            num_predictions = depths

    agreement = depth_agreement(Head, [text], [rows], k=3)
    # depth 0 has a token after all 5 roots that are not the last; depth 1 after 4 (root j predicts 2 + j + 1 + d)
    assert agreement["top1"] == pytest.approx([2 / 5, 1 / 4])
    assert agreement["top3"] == pytest.approx([1.0, 1.0])
    assert agreement["chain_top1"] == pytest.approx([2 / 5, 1 / 4])
    # the walk: root 0 accepts 2 drafts + bonus (3), root 3: 0 + 1, root 4: 0 + 1 -> 5 tokens in 3 steps
    assert chain_accepted_length([text], [rows], Head) == pytest.approx(5 / 3)


def test_eval_head_end_to_end_on_a_tiny_target(tiny):
    target, tok = tiny
    head = DartHead.from_target(target, draft_length=3).eval()
    g = torch.Generator().manual_seed(0)
    texts = {"a": [Text(torch.randint(5, 112, (20,), generator=g), 8, 20) for _ in range(2)]}
    report = evaluate_head(target, head, texts, [1, 4], eos_token_ids=torch.tensor([1]))
    entry = report["a"]
    assert len(entry["top1"]) == 4 and entry["tree"]["1"] >= 1.0 and entry["tree"]["4"] >= entry["tree"]["1"] - 1e-9
    assert entry["tree"]["1"] == pytest.approx(1 + entry["top1"][0], abs=0.35)  # budget 1 accepts the depth-0 hits
    assert "| head |" in format_table({"h": report}, [1, 4])


def test_a_head_can_start_from_the_target_last_layer(tiny):
    target, _ = tiny
    head = new_head(target, [], [1], draft_length=3, draft_vocab_size=None, init_layer_from_target=True)
    theirs, mine, h = target.get_decoder().layers[-1], head.midlayer, head.config.hidden_size
    assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
    assert torch.equal(mine.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight)
    assert torch.equal(mine.hidden_norm.weight, theirs.input_layernorm.weight)
    assert torch.equal(mine.self_attn.q_proj.weight[:, h:], theirs.self_attn.q_proj.weight)  # the feature half
    assert not torch.equal(mine.self_attn.q_proj.weight[:, :h], theirs.self_attn.q_proj.weight)  # embedding half: fresh
    fresh = new_head(target, [], [1], draft_length=3, draft_vocab_size=None)
    assert not torch.equal(fresh.midlayer.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
    narrow = DartHead.from_target(target, draft_length=3, intermediate_size=8)
    with pytest.raises(ValueError, match="differ in shape"):
        copy_target_layer(narrow, target)


def test_a_new_head_asks_for_the_cost_aware_budget(tiny):
    target, _ = tiny
    assert new_head(target, [], [1], draft_length=3, draft_vocab_size=None).config.node_budget is None
