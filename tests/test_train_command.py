"""`dart-hf train` as a newcomer runs it: without `--corpus` it regenerates a token corpus into the head folder and
trains on that (resumably), a corpus too small for one optimizer step is refused before any work (with the flags to
change), and the head it writes says it has the n-gram it writes beside it (so loading keeps it)."""

from __future__ import annotations

import json

import torch

import dart_hf
from conftest import make_head, make_target, make_word_tokenizer
from dart_hf.training import corpus as corpus_module
from dart_hf.training import pipeline
from dart_hf.training.corpus import Corpus, load_corpus
from dart_hf_cli import build_parser


def tiny_corpus(folder, n: int) -> str:
    g = torch.Generator().manual_seed(0)
    corpus = Corpus(folder, vocab_size=96, eos_ids=[1])
    corpus.append([{"prompt": torch.randint(5, 96, (6,), generator=g).tolist(),
                    "response": torch.randint(5, 96, (8,), generator=g).tolist()} for _ in range(n)])
    return str(folder)


def train_args(corpus: str, out, *extra: str):
    return build_parser().parse_args(["train", "--target", "unused", "--out", str(out), "--dtype", "float32",
                                      "--corpus", corpus, "--eval-n", "0", *extra])


def stub_pipeline(monkeypatch, target, calls: list[str]):
    """The pipeline around tiny stand-ins: no Hub target, a one-sentence n-gram, a 'training' that saves a fresh
    head as train_head does (before the n-gram is attached)."""
    monkeypatch.setattr(pipeline, "load_target", lambda *a, **k: (target, make_word_tokenizer()))

    def ngram(*a, **k):
        calls.append("ngram")
        return dart_hf.NGramModel.build([[5, 6, 7, 8]], order=2, vocab_size=96, progress=False)

    def train_head(target, features, out, cfg, **k):
        calls.append("train")
        head = make_head(target)
        head.save_pretrained(out)
        return head

    monkeypatch.setattr(pipeline, "_ngram", ngram)
    monkeypatch.setattr(pipeline, "train_head", train_head)


def test_too_small_a_corpus_is_refused_before_the_ngram_is_built(tmp_path, monkeypatch, capsys):
    calls: list[str] = []
    stub_pipeline(monkeypatch, make_target("llama"), calls)
    corpus = tiny_corpus(tmp_path / "corpus", 3)
    assert pipeline.run(train_args(corpus, tmp_path / "head", "--epochs", "1")) == 2
    err = capsys.readouterr().err
    assert "3 sequences x 1.0 epochs do not fill one optimizer step" in err and "--train-batch-size" in err
    assert calls == []  # nothing was built
    assert pipeline.run(train_args(corpus, tmp_path / "head", "--epochs", "1", "--train-batch-size", "2")) == 0
    assert calls == ["ngram", "train"]


def test_the_trained_head_loads_with_its_ngram(tmp_path, monkeypatch):
    stub_pipeline(monkeypatch, make_target("llama"), [])
    corpus = tiny_corpus(tmp_path / "corpus", 8)
    assert pipeline.run(train_args(corpus, tmp_path / "head")) == 0
    assert json.loads((tmp_path / "head" / "config.json").read_text())["has_ngram"] is True
    assert dart_hf.DartHead.from_pretrained(tmp_path / "head").ngram is not None


def test_recipe_flags_reach_the_trainer(tmp_path, monkeypatch):
    configs = []
    stub_pipeline(monkeypatch, make_target("llama"), [])
    stubbed = pipeline.train_head
    monkeypatch.setattr(pipeline, "train_head", lambda target, data, out, cfg, **k: (configs.append(cfg),
                                                                                    stubbed(target, data, out, cfg))[1])
    corpus = tiny_corpus(tmp_path / "corpus", 8)
    assert pipeline.run(train_args(corpus, tmp_path / "a")) == 0
    assert pipeline.run(train_args(corpus, tmp_path / "b", "--init-layer-from-target", "--anchors", "0")) == 0
    assert [(c.init_layer_from_target, c.anchors_per_sequence) for c in configs] == [(False, 48), (True, 0)]


def test_without_a_corpus_it_regenerates_one_in_the_head_folder_and_trains_on_it(tmp_path, monkeypatch, capsys):
    target = make_target("llama", vocab_size=112, eos_token_id=1, pad_token_id=0)  # the word tokenizer's 105 ids fit
    stub_pipeline(monkeypatch, target, [])
    trained, counted, generated = [], [], []
    stubbed, stubbed_ngram, real_generate = pipeline.train_head, pipeline._ngram, corpus_module.generate_batch

    def train_head(target, data, out, cfg, **k):
        trained.append((data, cfg.loss))
        return stubbed(target, data, out, cfg)

    def ngram(tokenizer, vocab_size, args, corpora):
        counted.append(corpora)
        return stubbed_ngram()

    def generate_batch(target, batch, config):
        generated.extend(batch)
        return real_generate(target, batch, config)

    monkeypatch.setattr(pipeline, "train_head", train_head)
    monkeypatch.setattr(pipeline, "_ngram", ngram)
    monkeypatch.setattr(corpus_module, "generate_batch", generate_batch)
    monkeypatch.setattr(pipeline, "sharegpt_training_prompts", lambda n: [f"w{i} w{i + 1} w{i + 2}" for i in range(n)])
    run = lambda out, *extra: pipeline.run(build_parser().parse_args(
        ["train", "--target", "unused", "--out", str(out), "--dtype", "float32", "--eval-n", "0", "--max-new-tokens",
         "6", "--batch-size", "4", "--train-batch-size", "2", *extra]))
    assert run(tmp_path / "head", "--num-prompts", "12") == 0
    corpus = tmp_path / "head" / "corpus"
    assert len(load_corpus(corpus)) == len(generated) == 12
    assert trained == [([corpus], "kl")] and counted == [[corpus]]  # KL by default; the n-gram counts the corpus too
    assert run(tmp_path / "head", "--num-prompts", "14") == 0  # a rerun answers only the prompts not answered yet
    assert len(load_corpus(corpus)) == len(generated) == 14
    assert run(tmp_path / "other", "--num-prompts", "0", "--loss", "ce") == 2  # nothing to train on
    assert "no token corpus (corpus.jsonl) in" in capsys.readouterr().err
    assert run(tmp_path / "ce", "--num-prompts", "12", "--loss", "ce") == 0
    assert trained[-1] == ([tmp_path / "ce" / "corpus"], "ce")
