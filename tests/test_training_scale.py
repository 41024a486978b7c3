"""The trainer that scales: a token-id corpus (regenerated, resumable, importable), online target features,
the KL loss, and data parallelism through accelerate (2 CPU processes)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import WORDS, make_target, make_word_tokenizer
from dart_hf.core.tree import TreeSearchParams
from dart_hf.tools.evaluation import acceptance_report
from dart_hf.tools.offline_acceptance import draft_rows, mean_accepted_length, reference_texts
from dart_hf.training import corpus as corpus_module
from dart_hf.core.modeling import DartHead
from dart_hf.training.corpus import CORPUS_FILE, Corpus, Sequence, import_responses, load_corpus, regenerate
from dart_hf.tools.datasets import load_sharegpt
from dart_hf.training.data import prompt_token_ids, sharegpt_chat_prompts, sharegpt_code_prompts
from dart_hf.training.batches import training_order
from dart_hf.training.head_init import new_head, widen_draft_vocab
from dart_hf.training.teacher import TeacherTargets, batch_loss, kl_terms, target_over_draft, teacher_targets
from dart_hf.training.train import TrainConfig, load_training_data, train_head
from dart_hf_cli import build_parser
from dart_hf_cli import main as cli

TESTS = Path(__file__).resolve().parent


def user_texts(n: int, offset: int = 0) -> list[str]:
    return [" ".join(WORDS[(7 * i + 3 * j) % 100] for j in range(3 + i % 5)) for i in range(offset, offset + n)]


@pytest.fixture(scope="module")
def tiny():
    return make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0), make_word_tokenizer()


def test_regenerate_train_online_kl_evaluate(tiny, tmp_path):
    target, tok = tiny
    corpus = regenerate(target, tok, user_texts(24), tmp_path / "corpus", max_new_tokens=16, batch_size=8)
    assert len(corpus.done) == 24
    # a few MB per million tokens: ids, not features
    sequences = load_corpus(tmp_path / "corpus")
    n_tokens = sum(s.ids.numel() for s in sequences)
    assert (tmp_path / "corpus" / CORPUS_FILE).stat().st_size < 8 * n_tokens
    cfg = TrainConfig(draft_length=3, draft_vocab_size=64, loss="kl", epochs=8, lr=3e-3, batch_size=4,
                      warmup_steps=5, anchors_per_sequence=12, log_every=8, save_every=1000)
    held_out = [torch.tensor([prompt_token_ids(tok, t)]) for t in user_texts(4, 200)]
    untrained = new_head(target, sequences, [1], draft_length=3, draft_vocab_size=64).eval()
    before = acceptance_report(target, untrained, held_out, max_new_tokens=16)
    head = train_head(target, tmp_path / "corpus", tmp_path / "head", cfg, eos_ids=[1], device="cpu")
    history = json.loads((tmp_path / "head" / "training_history.json").read_text())["history"]
    assert history[-1]["loss"] < 0.6 * history[0]["loss"]
    after = acceptance_report(target, head.eval(), held_out, max_new_tokens=16)
    assert after["lossless"] and after["mean_accepted_length"] >= 1.0
    assert after["mean_accepted_length"] > before["mean_accepted_length"]

    # the offline replay (no target in the loop) gives the accepted length of real decoding, prompt by prompt,
    # for the reference beam search and for best-first
    texts = reference_texts(target, held_out, max_new_tokens=16)
    rows = draft_rows(target, head, texts)
    for search in ("beam", "best_first"):
        head.config.tree_search = search
        real = acceptance_report(target, head, held_out, max_new_tokens=16)["per_prompt"]
        params = TreeSearchParams.from_config(head.config, node_budget=60)  # acceptance_report's fixed tree
        replay = [mean_accepted_length(head, [t], [r], params, False, torch.tensor([1])) for t, r in zip(texts, rows)]
        assert replay == pytest.approx(real), search
    head.config.tree_search = "beam"

    # fine-tuning: starting from the trained head, the first loss is already near where training ended
    cfg_more = TrainConfig(**{**cfg.__dict__, "epochs": 1, "init_from": str(tmp_path / "head")})
    train_head(target, tmp_path / "corpus", tmp_path / "head2", cfg_more, eos_ids=[1], device="cpu")
    history2 = json.loads((tmp_path / "head2" / "training_history.json").read_text())["history"]
    assert history2[0]["loss"] < 0.7 * history[0]["loss"]


def test_regeneration_resumes_skips_done_prompts_and_repairs_a_torn_line(tiny, tmp_path, monkeypatch):
    target, tok = tiny
    out = tmp_path / "corpus"
    regenerate(target, tok, user_texts(10), out, max_new_tokens=8, batch_size=4)
    path = out / CORPUS_FILE
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # killed mid-write
    generated = []
    real = corpus_module.generate_batch

    def counting(target, batch, config):
        generated.extend(tuple(ids) for ids in batch)
        return real(target, batch, config)

    monkeypatch.setattr(corpus_module, "generate_batch", counting)
    prompts = user_texts(14) + user_texts(3)  # 4 new prompts, 3 duplicates
    regenerate(target, tok, prompts, out, max_new_tokens=8, batch_size=4)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [tuple(r["prompt"]) for r in records]
    assert len(keys) == len(set(keys)) == 14
    assert path.read_text().splitlines()[:9] == [line.rstrip("\n") for line in lines[:9]]  # kept as written
    assert len(generated) == 5  # the torn prompt and the 4 new ones; nothing done is regenerated
    torn_prompt = tuple(json.loads(lines[-1])["prompt"])
    assert torn_prompt in generated


def test_import_of_engine_responses(tiny, tmp_path):
    target, tok = tiny
    pairs = tmp_path / "vllm.jsonl"
    pairs.write_text(json.dumps({"prompt": "w1 w2", "response": "w5 w6 w7"}) + "\n"
                     + json.dumps({"prompt": "w3", "response": "w8 <eos>"}) + "\n"
                     + json.dumps({"prompt": "w1 w2", "response": "w9"}) + "\n")  # a repeated prompt: skipped
    assert import_responses(tok, pairs, tmp_path / "c", vocab_size=112, eos_ids=[1]) == 2
    seqs = load_corpus(tmp_path / "c")
    assert seqs[0].ids.tolist() == prompt_token_ids(tok, "w1 w2") + tok.convert_tokens_to_ids(["w5", "w6", "w7"]) + [1]
    assert seqs[0].prompt_length == len(prompt_token_ids(tok, "w1 w2"))
    assert seqs[1].ids.tolist()[-2:] == [tok.convert_tokens_to_ids("w8"), 1]  # EOS not doubled
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "w1"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1.*'response'"):
        import_responses(tok, bad, tmp_path / "c2", vocab_size=112, eos_ids=[1])
    with pytest.raises(ValueError, match="another tokenizer"):
        Corpus(tmp_path / "c", vocab_size=50, eos_ids=[1])
    with pytest.raises(ValueError, match="do not fill one optimizer step"):  # 2 sequences, a batch of 8
        train_head(target, tmp_path / "c", tmp_path / "h", TrainConfig(draft_vocab_size=None, batch_size=8),
                   eos_ids=[1], device="cpu")


def test_kl_loss_matches_a_hand_computed_value_and_is_minimised_by_the_target():
    teacher = torch.tensor([[[[2.0, 0.0, 1.0, -1.0], [0.5, 0.5, 0.0, 3.0]]]])  # [B=1, A=1, K+1=2, V=4]
    draft = torch.tensor([0, 2, 3])  # draft vocab S: target ids 0, 2, 3
    head = torch.tensor([[[[1.0, 0.0, 0.0], [0.0, 1.0, 2.0]]]])
    valid = torch.ones(1, 1, 2, dtype=torch.bool)
    labels = torch.zeros(1, 1, 2, dtype=torch.long)
    targets = TeacherTargets(*target_over_draft(teacher, draft), argmax=teacher.argmax(-1))
    total, weight = batch_loss("kl", head, valid, labels, 0.6, targets)
    want = 0.0
    for d, gamma_d in enumerate([1.0, 0.6]):
        p = [math.exp(x) for x in teacher[0, 0, d].tolist()]
        p = [x / sum(p) for x in p]
        p_s = [p[i] for i in draft.tolist()]
        mass = sum(p_s)
        p_s = [x / mass for x in p_s]
        q = [math.exp(x) for x in head[0, 0, d].tolist()]
        q = [x / sum(q) for x in q]
        want += gamma_d * mass * sum(a * math.log(a / b) for a, b in zip(p_s, q))
    assert float(weight) == pytest.approx(1.6)
    assert float(total) == pytest.approx(want, rel=1e-5)
    # the renormalised target distribution is the minimum: zero loss, zero gradient, anything else is worse
    best = teacher[..., draft].log_softmax(-1).clone().requires_grad_(True)
    at_best, _ = batch_loss("kl", best, valid, labels, 0.6, targets)
    at_best.backward()
    assert float(at_best.detach()) == pytest.approx(0.0, abs=1e-6)
    assert best.grad.abs().max() < 1e-6
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        other = best.detach() + 0.3 * torch.randn(best.shape, generator=g)
        assert float(batch_loss("kl", other, valid, labels, 0.6, targets)[0]) > 1e-4
    log_p, mass = target_over_draft(teacher, None)  # full vocab: no renormalisation, mass 1
    assert torch.allclose(mass, torch.ones_like(mass)) and kl_terms(teacher, log_p).abs().max() < 1e-6


def test_teacher_targets_at_distinct_rows_equal_the_per_anchor_computation():
    """Overlapping anchors share rows: computing each distinct row once must give every (anchor, depth) the
    row it reads, in every sequence of the batch (rows past the end clamp to the last one)."""
    g = torch.Generator().manual_seed(0)
    lm_head = torch.nn.Linear(6, 11, bias=False)
    target = SimpleNamespace(get_output_embeddings=lambda: lm_head, config=SimpleNamespace(
        get_text_config=lambda: SimpleNamespace(final_logit_softcapping=None)))
    final = torch.randn(3, 9, 6, generator=g)
    position = torch.tensor([[0, 1, 4], [2, 3, 8]]).view(1, 2, 3).repeat(3, 1, 1) + torch.tensor([0, 1, 5]).view(3, 1, 1)
    draft = torch.tensor([0, 3, 4, 7, 10])
    got = teacher_targets(target, final, position, draft)
    rows = position.clamp(max=8)
    direct = lm_head(final[torch.arange(3).view(3, 1, 1), rows]).detach()
    want_log_p, want_mass = target_over_draft(direct, draft)
    assert torch.allclose(got.log_p_s, want_log_p, atol=1e-6) and torch.allclose(got.mass, want_mass, atol=1e-6)
    assert torch.equal(got.argmax, direct.argmax(-1))


DP_WORKER = textwrap.dedent('''
    """Train a head on a fixed corpus; record which sequences each process saw (argv: corpus out batch_size)."""
    import json, os, sys
    sys.path[:0] = [{tests!r}, {root!r}]  # this checkout's dart_hf, whatever the installed one is
    import torch
    torch.set_num_threads(1)
    from conftest import make_target
    from dart_hf.training.batches import AnchorCollator
    from dart_hf.training.train import TrainConfig, train_head

    corpus, out, batch_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    seen = []
    call = AnchorCollator.__call__
    def recording(self, places):
        seen.extend(self.order[p] for p in places)
        return call(self, places)
    AnchorCollator.__call__ = recording
    target = make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0)
    cfg = TrainConfig(draft_length=2, draft_vocab_size=None, loss="kl", epochs=1, lr=1e-2, warmup_steps=1,
                      batch_size=batch_size, anchors_per_sequence=4, log_every=1, save_every=1000)
    train_head(target, corpus, out, cfg, eos_ids=[1], device="cpu")
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"seen-{{rank}}.json"), "w") as f:
        json.dump(seen, f)
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_data_parallel_two_processes_match_one_process_on_the_same_global_batch(tmp_path):
    g = torch.Generator().manual_seed(0)
    corpus = Corpus(tmp_path / "corpus", vocab_size=112, eos_ids=[1])
    # responses of 2..11 tokens: ranks hold different numbers of labelled rows, so a per-rank mean averaged
    # over ranks would differ from the global-batch loss
    corpus.append([{"prompt": torch.randint(5, 112, (6,), generator=g).tolist(),
                    "response": torch.randint(5, 112, (2 + i * 7 % 10,), generator=g).tolist()} for i in range(16)])
    script = tmp_path / "worker.py"
    script.write_text(DP_WORKER.format(tests=str(TESTS), root=str(TESTS.parent)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = lambda *cmd: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    corpus_dir = str(tmp_path / "corpus")
    single = run(sys.executable, str(script), corpus_dir, str(tmp_path / "one"), "4")
    assert single.returncode == 0, single.stderr[-3000:]
    half = run(sys.executable, str(script), corpus_dir, str(tmp_path / "half"), "2")
    assert half.returncode == 0, half.stderr[-3000:]
    # `--multi_gpu` picks accelerate's torchrun launcher; without a GPU its processes join as MULTI_CPU (gloo)
    # (`--cpu --num_processes 2` would expect an external mpirun)
    dp = run(sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
             "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
             "--main_process_port", str(_free_port()), str(script), corpus_dir, str(tmp_path / "two"), "2")
    assert dp.returncode == 0, dp.stderr[-3000:]

    seen = [json.loads((tmp_path / "two" / f"seen-{r}.json").read_text()) for r in (0, 1)]
    one_seen = json.loads((tmp_path / "one" / "seen-0.json").read_text())
    assert seen[0] and seen[1] and not set(seen[0]) & set(seen[1])  # each rank its own sequences
    assert sorted(seen[0] + seen[1]) == sorted(one_seen) == list(range(16))
    from safetensors.torch import load_file

    one, two, halfway = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "two", "half"))
    hist = lambda d: json.loads((tmp_path / d / "training_history.json").read_text())["history"]
    assert [h["step"] for h in hist("two")] == [h["step"] for h in hist("one")] == [1, 2, 3, 4]
    for h1, h2 in zip(hist("one"), hist("two")):
        assert h2["loss"] == pytest.approx(h1["loss"], rel=1e-4)  # the global-batch loss, gathered
    gap = max((one[k] - two[k]).abs().max().item() for k in one)
    control = max((one[k] - halfway[k]).abs().max().item() for k in one)  # one process, half the batch
    assert gap < 1e-3 < control  # padding widths differ per process: float noise, well below one lr step


def test_code_prompts_are_the_training_chats_with_fenced_code(tmp_path):
    fence = "```"
    records = []
    for i in range(200):
        code = i % 3 == 0
        answer = f"here:\n{fence}python\nprint({i})\n{fence}" if code else f"plain answer {i}"
        question = f"{fence}x = {i}{fence} why?" if i % 5 == 0 else f"question {i}"
        records.append({"id": f"c{i:03d}_0", "conversations": [{"from": "human", "value": question},
                                                                 {"from": "gpt", "value": answer}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    train = load_sharegpt("train", path=path)
    expected = [t[0]["content"] for t in train if fence in t[0]["content"] or fence in t[1]["content"]]
    assert 0 < len(expected) < len(train)
    assert sharegpt_code_prompts(None, path=path) == expected
    assert sharegpt_code_prompts(7, path=path) == expected[:7]
    heldout = {t[0]["content"] for t in load_sharegpt("heldout", path=path)}
    assert not set(sharegpt_code_prompts(None, path=path)) & heldout
    code = set(expected)
    chat = [t[0]["content"] for t in train if t[0]["content"] not in code]
    assert sharegpt_chat_prompts(None, path=path) == chat  # the two sources partition the training split
    assert sharegpt_chat_prompts(5, path=path) == chat[:5]


def _varied_corpus(path: Path, n: int = 24) -> None:
    g = torch.Generator().manual_seed(1)
    corpus = Corpus(path, vocab_size=112, eos_ids=[1])
    corpus.append([{"prompt": torch.randint(5, 112, (4 + i % 5,), generator=g).tolist(),
                    "response": torch.randint(5, 112, (3 + (i * 7) % 19,), generator=g).tolist()} for i in range(n)])


def test_ngram_counts_the_answers_of_several_token_corpora_twice_and_never_their_prompts(tmp_path, monkeypatch):
    from dart_hf.training import ngram_corpus

    monkeypatch.setattr(ngram_corpus, "load_sharegpt", lambda split, limit=None: [])  # answers only
    for name, answer in (("a", [7, 8, 9]), ("b", [7, 8, 10])):
        Corpus(tmp_path / name, vocab_size=112, eos_ids=[1]).append([{"prompt": [50, 51, 52], "response": answer}])
    ngram = ngram_corpus.build_ngram(make_word_tokenizer(), 112, corpora=[tmp_path / "a", tmp_path / "b"])
    probs = ngram.prob(torch.tensor([[7, 8], [50, 51]]), torch.tensor([[9, 10], [52, 52]]))
    assert probs[0].tolist() == [0.5, 0.5]  # 7 8 -> 9 and 7 8 -> 10, each counted twice: kept at min_count 2
    assert probs[1].tolist() == [0.0, 0.0]  # prompts are not counted


def test_cached_features_train_like_fresh_ones_and_skip_the_target_after_the_first_epoch(tmp_path, monkeypatch):
    from dart_hf.training import train

    _varied_corpus(tmp_path / "corpus")
    target = make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0)
    calls = []
    fresh = train.target_features
    monkeypatch.setattr(train, "target_features", lambda *a: calls.append(1) or fresh(*a))
    cfg = TrainConfig(draft_length=2, draft_vocab_size=None, loss="kl", epochs=3, lr=1e-2, warmup_steps=1,
                      batch_size=4, anchors_per_sequence=4, log_every=1, save_every=1000)
    heads, forwards = {}, {}
    for cache in (False, True):
        calls.clear()
        cfg_run = TrainConfig(**{**cfg.__dict__, "cache_features": cache})
        heads[cache] = train_head(target, tmp_path / "corpus", tmp_path / f"head-{cache}", cfg_run, eos_ids=[1],
                                  device="cpu").state_dict()
        forwards[cache] = len(calls)
    assert forwards[False] == 18  # 24 sequences x 3 epochs / 4 per batch
    assert 6 <= forwards[True] < 12  # the first epoch's batches, and a few later ones holding an unseen sequence
    gap = max((heads[True][k] - heads[False][k]).abs().max().item() for k in heads[True])
    assert gap < 1e-4


def test_length_grouped_batches_pad_less_and_still_cover_every_sequence_each_epoch():
    lengths = [3 + (i * 37) % 200 for i in range(400)]
    padded = {}
    for grouped in (True, False):
        order = training_order(lengths, epochs=2, global_batch=4, group_by_length=grouped)
        assert sorted(order[:400]) == sorted(order[400:]) == list(range(400))
        assert order[:400] != order[400:]  # a fresh shuffle per epoch
        padded[grouped] = sum(4 * max(lengths[i] for i in order[b : b + 4]) for b in range(0, 800, 4))
    assert padded[True] < 0.8 * padded[False]
    assert padded[True] < 1.05 * 2 * sum(lengths)


def test_several_corpora_train_as_one_and_corpora_of_another_tokenizer_are_refused(tmp_path):
    _varied_corpus(tmp_path / "a", n=5)
    _varied_corpus(tmp_path / "b", n=7)
    joined = load_training_data([tmp_path / "a", tmp_path / "b"])
    expected = load_corpus(tmp_path / "a") + load_corpus(tmp_path / "b")
    assert [s.ids.tolist() for s in joined] == [s.ids.tolist() for s in expected]
    other = Corpus(tmp_path / "other", vocab_size=500, eos_ids=[1])
    other.append([{"prompt": [300, 301], "response": [302, 303, 304]}])
    with pytest.raises(ValueError, match="different tokenizers"):
        load_training_data([tmp_path / "a", tmp_path / "other"])
    with pytest.raises(FileNotFoundError, match="no token corpus"):
        load_training_data([tmp_path / "a", tmp_path / "missing"])
    target = make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0)
    cfg = TrainConfig(draft_length=2, draft_vocab_size=None, epochs=1, batch_size=4, anchors_per_sequence=2)
    with pytest.raises(ValueError, match="outside this target's vocabulary"):
        train_head(target, tmp_path / "other", tmp_path / "head", cfg, eos_ids=[1], device="cpu")


def test_widening_the_draft_vocab_keeps_trained_rows_and_maps_new_ones_into_the_heads_space(tmp_path):
    target = make_target("llama", vocab_size=200, eos_token_id=1, pad_token_id=0)
    old = list(range(10, 90))  # 80 rows for a hidden size of 64: the map from target rows to head rows is determined
    response = [150] * 40 + [151] * 30 + [152] * 20 + [153] * 10 + old
    data = [Sequence(torch.tensor([195, 196] + response), 2)]  # prompt tokens 195, 196 must not count
    head = new_head(target, [Sequence(torch.tensor([5] + old), 1)], [], draft_length=2, draft_vocab_size=80).eval()
    to_head_space = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) / 8
    with torch.no_grad():  # "trained": the warm start's target rows moved by a linear map
        head.lm_head.weight.copy_(head.lm_head.weight @ to_head_space)
    wide = widen_draft_vocab(head, target, data, 83)
    assert wide.config.draft_vocab_size == 83
    assert wide.draft_to_target.tolist() == old + [150, 151, 152]
    target_rows = target.get_output_embeddings().weight.detach()
    assert torch.equal(wide.lm_head.weight[:80], head.lm_head.weight)
    assert torch.allclose(wide.lm_head.weight[80:], target_rows[[150, 151, 152]] @ to_head_space, atol=1e-4)
    old_state = head.state_dict()
    for k, v in wide.state_dict().items():
        if k not in ("lm_head.weight", "d2t", "t2d"):
            assert torch.equal(v, old_state[k]), k
    assert wide.t2d.sum() == 83 and wide.t2d[[150, 151, 152]].all() and not wide.t2d[[153, 195, 196]].any()
    assert widen_draft_vocab(head, target, data, 400).config.draft_vocab_size == 84  # only 4 unseen tokens exist
    with pytest.raises(ValueError, match="can be widened, not cut"):
        widen_draft_vocab(head, target, data, 50)
    wide.save_pretrained(tmp_path / "wide")
    assert DartHead.from_pretrained(tmp_path / "wide").draft_to_target.tolist() == wide.draft_to_target.tolist()


def test_fine_tuning_with_a_widened_draft_vocab_trains_the_new_rows(tmp_path):
    _varied_corpus(tmp_path / "corpus")
    target = make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0)
    base = TrainConfig(draft_length=2, draft_vocab_size=20, loss="kl", epochs=1, lr=1e-2, warmup_steps=1,
                       batch_size=4, anchors_per_sequence=4, log_every=1, save_every=1000)
    train_head(target, tmp_path / "corpus", tmp_path / "small", base, eos_ids=[1], device="cpu")
    with pytest.raises(ValueError, match="set init_from"):
        train_head(target, tmp_path / "corpus", tmp_path / "x",
                   TrainConfig(**{**base.__dict__, "widen_draft_vocab": 40}), eos_ids=[1], device="cpu")
    cfg = TrainConfig(**{**base.__dict__, "init_from": str(tmp_path / "small"), "widen_draft_vocab": 40})
    wide = train_head(target, [tmp_path / "corpus"], tmp_path / "wide", cfg, eos_ids=[1], device="cpu")

    small = DartHead.from_pretrained(tmp_path / "small").float()
    start = widen_draft_vocab(small, target, load_training_data(tmp_path / "corpus"), 40)
    assert wide.config.draft_vocab_size == 40
    assert wide.draft_to_target.tolist() == start.draft_to_target.tolist()
    new_rows = ~small.t2d[wide.draft_to_target]
    assert (wide.lm_head.weight[new_rows] - start.lm_head.weight[new_rows]).abs().amax(dim=1).min() > 0  # all trained
    assert DartHead.from_pretrained(tmp_path / "wide").config.draft_vocab_size == 40


def test_cli_refuses_to_widen_without_a_head_to_widen(tmp_path, capsys):
    assert cli(["train", "--out", str(tmp_path / "x"), "--corpus", str(tmp_path), "--widen-draft-vocab", "100"]) == 2
    assert "pass --init" in capsys.readouterr().err
    args = build_parser().parse_args(["train", "--out", "x", "--corpus", "a", "b"])
    assert args.corpus == ["a", "b"]
