"""How busy this machine is, for the commands that time decoding (`dart-hf demo`, `dart-hf bench`): other processes'
CPU use around a timing (`CpuUse`), and the torch thread count a timing command runs on when the machine is shared
(`choose_threads`). Reports say so beside every figure timed on a busy machine."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

BUSY_CORES = 0.5  # other processes using this many cores' worth of CPU (on average) make a CPU timing untrustworthy


def _cpu_seconds() -> tuple[float, float, float] | None:
    """(wall clock, busy CPU seconds of the cores this process may run on per /proc/stat, this process's CPU
    seconds); None where /proc/stat cannot be read (not Linux)."""
    try:
        cores = os.sched_getaffinity(0)
        lines = Path("/proc/stat").read_text().splitlines()
    except (AttributeError, OSError):
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    busy = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
            busy += sum(values) - values[3] - values[4]
    return time.perf_counter(), busy / hz, time.process_time()


class CpuUse:
    """How busy the machine was around a timing, beside the timing itself: `with CpuUse() as use: ...`, then
    `use.other_cores` (cores' worth of CPU that OTHER processes used on this process's cores during the block; None
    where /proc/stat is missing), `use.load_average` (1-minute load average when the block began) and `use.cores`.
    `busy()` says why the block's timings do not describe this machine at rest (None: no reason found)."""

    def __init__(self) -> None:
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.load_average = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self.other_cores: float | None = None
        self._start = None

    def __enter__(self) -> "CpuUse":
        self._start = _cpu_seconds()
        return self

    def __exit__(self, *exc) -> None:
        end = _cpu_seconds()
        if self._start is not None and end is not None and end[0] > self._start[0]:
            wall, busy, own = (b - a for a, b in zip(self._start, end))
            self.other_cores = max(0.0, (busy - own) / wall)

    def busy(self) -> str | None:
        if self.other_cores is not None:
            if self.other_cores >= BUSY_CORES:
                return (f"other processes used {self.other_cores:.1f} of the {self.cores} cores while it ran "
                        f"(load average {self.load_average:.1f})" if self.load_average is not None else
                        f"other processes used {self.other_cores:.1f} of the {self.cores} cores while it ran")
            return None
        if self.load_average is not None and self.load_average > self.cores:
            return f"the load average was {self.load_average:.1f} on {self.cores} cores"
        return None

    def as_dict(self) -> dict:
        return {"other_cores": self.other_cores, "load_average_1min": self.load_average, "cores": self.cores}


PROBE_SECONDS = 0.5  # `other_cpu_use`: long enough to see a busy process, short beside any timing


def other_cpu_use(seconds: float = PROBE_SECONDS) -> CpuUse:
    """How busy other processes keep the CPU right now: `CpuUse` around `seconds` of this process sleeping."""
    with CpuUse() as use:
        time.sleep(seconds)
    return use


@dataclass(frozen=True)
class ThreadChoice:
    """The torch thread count a timing command runs on (`choose_threads`), and why, in words for its user."""

    threads: int
    default: int  # torch's count in this process before the choice
    busy: str | None  # why the machine counted as busy before timing (`CpuUse.busy`); None: it looked idle
    reason: str


def choose_threads(requested: int | None = None, probe: Callable[[], CpuUse] | None = None) -> ThreadChoice:
    """The torch thread count for a command that owns its process and times decoding (`dart-hf demo`; `dart-hf
    bench` may call it too): `requested` where given, else torch's own count, or, when other processes are using the
    CPU (`probe`, default `other_cpu_use`, before any timing), one thread per core they leave free, at least one.

    Why: torch's threads meet at every operation, so one of them descheduled by another process stalls the rest. On
    a 2-core machine beside one busy process SmolLM2 decoded at about 1 token/s on torch's 2 threads, at 17 on one.
    Only the command's own process may take this choice (`torch.set_num_threads`): a library call never changes a
    process-wide setting."""
    default = torch.get_num_threads()
    if requested is not None:
        return ThreadChoice(requested, default, None, f"{_threads(requested)} (--threads)")
    use = (probe or other_cpu_use)()
    busy = use.busy()
    if busy is not None and use.other_cores is not None:  # CpuUse.busy's words are for a timing's aftermath
        busy = f"other processes were using {use.other_cores:.1f} of the {use.cores} cores"
    if busy is None:
        return ThreadChoice(default, default, None, f"{_threads(default)} (torch's default; the CPU looked idle)")
    taken = max(1, round(use.other_cores)) if use.other_cores is not None else 1
    threads = max(1, min(default, use.cores - taken))
    if threads == default:
        return ThreadChoice(default, default, busy, f"{_threads(default)} (torch's default); before timing, {busy}")
    return ThreadChoice(threads, default, busy,
                        f"{_threads(threads)} instead of torch's {default}: before timing, {busy}, and torch's "
                        f"threads wait for each other at every step, so a core taken by another process stalls them "
                        f"all (--threads {default} keeps torch's default)")


def _threads(n: int) -> str:
    return f"{n} torch thread{'s' if n != 1 else ''}"
