"""A training run on disk: the checkpoint a killed run resumes from, and the results of a finished one.

`<out>/checkpoint/` holds the head, the optimizer state and the run's progress (`trainer_state.pt`); rerunning the
same command continues from it. It is written to a temporary folder and renamed, so a run killed while saving keeps
the previous checkpoint whole. A finished run writes the head, `training_history.json` (config, logged history,
held-out evaluations) and `training_curves.png` into `<out>`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.modeling import DartHead
from .plots import plot_history

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "trainer_state.pt"
HISTORY_FILE = "training_history.json"
CURVES_FILE = "training_curves.png"


@dataclass
class Progress:
    """Where a run stands: what a resumed run continues from."""

    step: int = 0  # optimizer steps taken
    history: list[dict] = field(default_factory=list)  # logged loss and per-depth accuracy, every `log_every` steps
    evaluations: list[dict] = field(default_factory=list)  # held-out accepted length against tokens trained on
    tokens: int = 0  # response tokens trained on, summed over processes
    seconds: float = 0.0  # wall time of this run and the ones it resumes (the time budget's clock)


def save_checkpoint(folder: Path, head: DartHead, optimizer: torch.optim.Optimizer, progress: Progress) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    head.save_pretrained(tmp)
    state = {"optimizer": optimizer.state_dict(), "step": progress.step, "history": json.dumps(progress.history),
             "evaluations": json.dumps(progress.evaluations), "tokens": progress.tokens, "seconds": progress.seconds}
    torch.save(state, tmp / STATE_FILE)
    if folder.exists():
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    tmp.rename(folder)


def load_checkpoint(folder: Path) -> tuple[DartHead, dict, Progress]:
    """(the head in float32, the optimizer's state dict, the progress). Checkpoints written before evaluations,
    tokens and seconds were recorded resume with those empty."""
    state = torch.load(folder / STATE_FILE, weights_only=True)
    progress = Progress(step=state["step"], history=json.loads(state["history"]),
                        evaluations=json.loads(state.get("evaluations", "[]")), tokens=int(state.get("tokens", 0)),
                        seconds=float(state.get("seconds", 0.0)))
    return DartHead.from_pretrained(folder).float(), state["optimizer"], progress


def save_result(out: Path, head: DartHead, config: dict, progress: Progress) -> None:
    """The trained head, its training record (`config`: the run's settings) and its curves."""
    head.save_pretrained(out)
    record = {"config": config, "history": progress.history, "evaluations": progress.evaluations}
    (out / HISTORY_FILE).write_text(json.dumps(record, indent=1))
    plot_history(progress.history, out / CURVES_FILE, progress.evaluations)
