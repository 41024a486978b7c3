"""Ctrl-C ends a `dart-hf` command with one line saying what was interrupted and what it leaves, exit status 130
(issue 73: `dart-hf demo` printed a 125-line traceback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import dart_hf_cli
from dart_hf.tools import demo
from dart_hf_cli import INTERRUPTED_EXIT, build_parser, main

# `dart-hf convert` whose work blocks (no checkpoint needed): it says when it is inside the command, then waits
BLOCKING_CONVERT = textwrap.dedent("""
    import signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job inherits it ignored)
    import dart_hf_cli
    import dart_hf.tools.convert as convert

    def blocking(args):
        print("ready", flush=True)
        time.sleep(600)

    convert.run = blocking
    sys.exit(dart_hf_cli.main(["convert", "reference", "--out", "head"]))
""")


def subcommands() -> dict:
    return build_parser()._subparsers._group_actions[0].choices


@pytest.mark.skipif(os.name != "posix", reason="SIGINT to a child process")
def test_sigint_to_a_running_command_prints_one_line(tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-c", BLOCKING_CONVERT], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "ready\n"  # waits for the command itself, however slow the imports
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    message = subcommands()["convert"].get_default("interrupted")
    assert proc.returncode == INTERRUPTED_EXIT
    assert err == f"dart-hf convert: interrupted ({message})\n" and out == ""


def test_ctrl_c_in_demo_restores_threads_and_says_so(monkeypatch, capsys):
    """The demo's own clean-up runs (its torch thread count restored) before the one line."""
    def interrupted(*args) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "announce_installs", lambda *args: None)
    monkeypatch.setattr(demo, "load_target_and_head", lambda *args: (None, None, None))
    monkeypatch.setattr(demo, "_run_demo", interrupted)
    threads = torch.get_num_threads()
    assert main(["demo", "--threads", "1"]) == INTERRUPTED_EXIT
    assert torch.get_num_threads() == threads
    message = subcommands()["demo"].get_default("interrupted")
    assert capsys.readouterr().err == f"dart-hf demo: interrupted ({message})\n"


def test_every_command_says_what_an_interrupt_leaves():
    commands = subcommands()
    assert set(commands) >= {"demo", "bench", "train", "serve"}
    for name, parser in commands.items():
        message = parser.get_default("interrupted")
        assert message and len(f"dart-hf {name}: interrupted ({message})") < 140, name
    assert dart_hf_cli.INTERRUPTED_EXIT == 130
