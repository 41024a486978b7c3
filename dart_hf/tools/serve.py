"""`dart-hf serve`: transformers' own OpenAI-compatible server (`transformers serve`), its target decoded by DART.

Why no server of our own: transformers' server already does the hard parts (the chat completions, completions and
responses routes, streaming, chat templates, tool calls, cancellation, one model process fed one request at a time).
This module only changes how that process gets its model. `transformers serve` loads the model in a process of its
own through its `ModelLoader`, builds its `GenerateRunner` there itself and calls `model.generate(**kwargs)` for every
request; the loader is the one seam it offers. `DartModelLoader` (handed to transformers' `Serve` by `DartServe`)
maps a known target name to its converted folder, loads the head beside the target, checks it against the target
(a bad head stops the start, not a request), and gives the loaded target instance, and only it, a `generate` that
adds the head (`DartGenerate`): everything else is transformers' code, unchanged (nothing process-wide is patched).

Per request, `DartGenerate` decodes with `assistant_model=head` and a `DartStats` of its own, and logs the accepted
length and node budgets. A request DART refuses (a `ValueError` / `TypeError` from its checks, raised before any
token: beam search, several return sequences, ...) is decoded plainly, with a warning naming the reason; the plain
call then answers, or fails with the error the plain server would give. The request's `seed` and sampling settings
reach `generate` as the plain server passes them (the runner seeds torch before the call).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelLoader
from transformers.cli.serving.utils import canonical_model_id
from transformers.utils import logging

from ..core.configuration import DartConfig
from ..core.modeling import DartHead
from ..core.stats import DartStats
from ..core.target import check_head_matches_target

from .assets import announce_installs, shipped_head, target_folder

# Under transformers' serve loggers ("transformers.cli"), so that `--log-level` sets it in the model's process too
logger = logging.get_logger("transformers.cli.serving.dart_hf")

REFUSALS = (ValueError, TypeError)
"""What DART's checks raise for a call they cannot run exactly as plain `generate` would (README, Limits)."""


class _WatchedStreamer:
    """The streamer a DART call gets: the request's own (or none), noting whether DART has handed it anything. A
    refused call has not (its checks come before the prompt is put), so a plain retry streams the answer once."""

    def __init__(self, streamer: Any | None):
        self.streamer, self.started = streamer, False

    def put(self, value) -> None:
        self.started = True
        if self.streamer is not None:
            self.streamer.put(value)

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()


def describe(stats: DartStats) -> str:
    """One log line of a DART call's statistics: accepted length and the node budgets its steps used."""
    budgets = stats.node_budgets
    per_step = (f"{sum(budgets) / len(budgets):.1f} mean, {min(budgets)}-{max(budgets)}, "
                f"{budgets.count(0)} plain steps" if budgets else "no steps")
    return (f"DART: {stats.new_tokens} new tokens in {stats.steps} target forwards after the prefill, accepted "
            f"length {stats.mean_accepted_length:.2f}; node budget {stats.budget_mode} ({stats.node_budget} last), "
            f"nodes per step: {per_step}")


class DartGenerate:
    """The served target's `generate`: the target's own, with the head as `assistant_model`; plain for a request
    DART refuses (logged with the reason)."""

    def __init__(self, generate: Callable[..., Any], head: DartHead):
        self.generate, self.head = generate, head

    def __call__(self, *args, **kwargs):
        stats, streamer = DartStats(), _WatchedStreamer(kwargs.get("streamer"))
        try:
            out = self.generate(*args, **{**kwargs, "streamer": streamer}, assistant_model=self.head, dart_stats=stats)
        except REFUSALS as refusal:
            if streamer.started:  # not a refusal: DART had begun answering
                raise
            logger.warning(f"DART does not serve this request ({type(refusal).__name__}: {refusal}): decoding it "
                           "plainly")
            return self.generate(*args, **kwargs)
        logger.info(describe(stats))
        return out


class DartModelLoader(ModelLoader):
    """transformers serve's `ModelLoader` for one target, by the name the requests use (`served`), loaded from
    `folder` (a known target's converted folder), with every generation decoded by the DART head in `head` (None:
    plain decoding, the baseline). Pickled into the model's process, where `load_model_and_processor` runs."""

    def __init__(self, served: str, folder: str | Path, head: str | None, **settings):
        super().__init__(**settings)
        self.served, self.folder, self.head = canonical_model_id(served), str(folder), head

    def local(self, model_id: str) -> str:
        """The folder for the served name (the server is pinned to it: every request's model is that one)."""
        return self.folder if canonical_model_id(model_id) == self.served else model_id

    def load_config(self, model_id: str):
        return super().load_config(self.local(model_id))

    def load_processor(self, model_id: str):
        return super().load_processor(self.local(model_id))

    def load_model_and_processor(self, model_id: str, on_progress: Callable | None = None):
        model, processor = super().load_model_and_processor(self.local(model_id), on_progress)
        if self.head is not None:
            head = DartHead.from_pretrained(self.head).eval()
            check_head_matches_target(head, model)  # a head for another target fails the start, not each request
            model.generate = DartGenerate(model.generate, head)
            logger.info(f"Decoding with the DART head {self.head} (draft length {head.config.draft_length}, node "
                        f"budget {'auto' if head.config.node_budget is None else head.config.node_budget})")
        return model, processor


class DartServe(Serve):
    """transformers' `Serve`, run with a `DartModelLoader` in place of the loader it builds from the same settings
    (its `__init__` builds the loader and then serves, so the loader is swapped as serving starts)."""

    def __init__(self, loader: DartModelLoader, **options):
        self.dart_loader = loader
        super().__init__(**options)

    def run(self, socket=None, engine_connection: tuple | None = None) -> None:
        self.loader = self.dart_loader
        super().run(socket, engine_connection)


def check_head(head: str) -> str:
    """`head` as the model's process should load it (a folder: its absolute path), if it holds a DART head's config;
    else a ValueError that says what is wrong, before any model loads."""
    if Path(head).is_dir() and not (Path(head) / "config.json").is_file():
        raise ValueError(f"--head {head}: not a DART head folder (it has no config.json)")
    try:
        config, _ = DartConfig.get_config_dict(head)
    except (OSError, ValueError) as error:
        raise ValueError(f"--head {head}: not a DART head folder or Hub repo ({error})") from None
    if config.get("model_type") != DartConfig.model_type:
        raise ValueError(f"--head {head}: its config.json is not a DART head's (model_type "
                         f"{config.get('model_type')!r}, expected {DartConfig.model_type!r})")
    return str(Path(head).resolve()) if Path(head).is_dir() else head


def main(args: argparse.Namespace) -> int:
    """`dart-hf serve`: check the head, resolve the target to its folder, then serve until stopped."""
    try:
        head = None if args.no_head else check_head(args.head or str(shipped_head()))
        announce_installs("dart-hf serve", args.target)
        folder = target_folder(args.target)
    except (FileNotFoundError, ValueError) as error:
        print(f"dart-hf serve: {error}", file=sys.stderr)
        return 2
    settings = dict(device=args.device, dtype=args.dtype, attn_implementation=args.attn)
    loader = DartModelLoader(args.target, folder, head, **settings)
    try:
        DartServe(loader, force_model=args.target, host=args.host, port=args.port, log_level=args.log_level,
                  enable_log_requests=args.enable_log_requests, default_seed=args.default_seed, **settings)
    except RuntimeError as error:  # the model's process could not load (its traceback is above) or died
        print(f"dart-hf serve: {error}", file=sys.stderr)
        return 1
    return 0
