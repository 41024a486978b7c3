"""`dart-hf bench --profile`: each method once more, untimed, on the first prompt of each data set, counting its
top-level aten ops (`torch.profiler`) and host syncs (CUDA's sync calls; on a CPU, reads of tensor values into Python:
`HostReads`) per decoding step and per new token (`profile_methods`). Apart from the timed runs (`bench_timing`):
it runs the profiler and patches `torch.Tensor`, neither of which any timed call may meet.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from .bench_methods import Method, seed_call
from .bench_timing import ForwardCounter, counted_run, sync_device

CUDA_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
PROFILE_HOW = (
    "aten ops: `torch.profiler` CPU events named `aten::*` with no `aten::*` event above them (the ops Python, "
    "transformers or a compiled graph's wrapper dispatched; inductor's generated C++/Triton kernels are not aten ops "
    "and do not appear, while its extern kernels such as `aten::mm` do, so a compiled step shows far fewer). "
    "Per step: the call's count (prefill included) over its decoding steps (DART: `DartStats.steps`; other methods: "
    "target forwards, plain decoding one per new token)."
)
SYNCS_HOW = {
    "value reads": "host syncs: reads of tensor values into Python (`item`, `tolist`, `__bool__`, `__int__`, "
                   "`__float__`, `__index__`, `nonzero`, `numpy`), counted by wrapping those `Tensor` methods; on a CPU "
                   "this also counts reads of tensors that already live on the host (on a GPU those are no sync)",
    "cuda": "host syncs: the profiler's `cudaStreamSynchronize` / `cudaDeviceSynchronize` / `cudaEventSynchronize` "
            "calls (every device-to-host copy the host waits for is one)",
}


class HostReads:
    """Counts reads of tensor values into Python while active (per method name, `reads`): each one a host sync on a
    GPU. Wraps those `torch.Tensor` methods rather than pushing a `TorchFunctionMode` (as tests/test_static_step.py's
    HostSyncs does): dynamo guards on the torch-function mode stack, so an active mode would recompile every compiled
    step it meets (a minute each on a CPU); a captured step has no host read to count anyway (fullgraph)."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy")

    def __init__(self):
        self.reads: Counter = Counter()
        self._saved: dict = {}

    def __enter__(self) -> "HostReads":
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = (name in vars(torch.Tensor), original)
            setattr(torch.Tensor, name, self._counted(name, original))
        return self

    def _counted(self, name: str, original: Callable) -> Callable:
        def counted(tensor, *args, **kwargs):
            self.reads[name] += 1
            return original(tensor, *args, **kwargs)

        return counted

    def __exit__(self, *exc) -> None:
        for name, (own, original) in self._saved.items():
            if own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)  # the method is inherited from torch._C.TensorBase
        self._saved = {}


def top_level_aten_ops(events) -> int:
    """Profiler events named aten::* that no other aten::* event encloses."""
    def top(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return False
            parent = parent.cpu_parent
        return True

    return sum(1 for e in events if e.name.startswith("aten::") and top(e))


def profile_methods(target, head, prompts: dict[str, list[torch.Tensor]], methods: list[Method], gen: dict) -> dict:
    """Each method once on the first prompt of each data set (untimed; after the bench's warm-up and timed runs, so
    nothing compiles here): top-level aten ops and host syncs per decoding step and per new token (`PROFILE_HOW`,
    `SYNCS_HOW`). Returns {"how", "syncs", "datasets": {data set: {method: counts}}}."""
    counter = ForwardCounter(target)
    try:
        rows = {ds: {m.name: _profile_call(m, target, head, ps[0].to(target.device), gen, counter, (ds, 0))
                     for m in methods} for ds, ps in prompts.items()}
    finally:
        counter.remove()
    syncs = "cuda" if target.device.type == "cuda" else "value reads"
    return {"how": PROFILE_HOW, "syncs": SYNCS_HOW[syncs], "datasets": rows}


def _profile_call(m: Method, target, head, ids: torch.Tensor, gen: dict, counter: ForwardCounter,
                  seed_key: tuple = ()) -> dict:
    """One profiled call of `m`: its steps, new tokens, top-level aten ops, host syncs (and host value reads by
    method; on CUDA also device-to-host copies). A sampled `gen` is seeded as the timed call on that prompt was
    (`seed_key`), so the profiled call decodes the same text."""
    seed_call(gen, *seed_key)
    from torch.profiler import ProfilerActivity, profile

    cuda = ids.device.type == "cuda"
    sync_device(ids.device)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof, \
            HostReads() as reads:
        out, stats = counted_run(m, target, head, ids, torch.ones_like(ids), gen, counter)
    events = prof.events()
    new = out.shape[1] - ids.shape[1]
    steps = stats.steps if stats is not None else counter.count
    ops = top_level_aten_ops(events)
    syncs = sum(1 for e in events if e.name in CUDA_SYNCS) if cuda else sum(reads.reads.values())
    row = {"steps": steps, "new_tokens": new, "aten_ops": ops, "aten_ops_per_step": ops / max(steps, 1),
           "aten_ops_per_token": ops / max(new, 1), "host_syncs": syncs, "host_syncs_per_step": syncs / max(steps, 1),
           "host_syncs_per_token": syncs / max(new, 1), "host_reads": dict(reads.reads)}
    if cuda:
        row["dtoh_copies"] = sum(1 for e in events if "DtoH" in e.name)
    return row


__all__ = ["CUDA_SYNCS", "PROFILE_HOW", "SYNCS_HOW", "HostReads", "profile_methods", "top_level_aten_ops"]
