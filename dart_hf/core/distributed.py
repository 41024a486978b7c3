"""Tensor-parallel targets: what every rank must share, checked once per `generate` call.

A target loaded with transformers' tensor parallelism (`from_pretrained(..., tp_plan="auto")` under `torchrun`)
runs every forward as a collective: each rank holds a shard, and the ranks exchange activations inside each layer.
DART adds work that every rank does on its own (the head forward, the tree search, acceptance), so every rank must
make the same choices in the same order, or their next target forwards differ in shape and the collective inside it
fails or hangs. Greedy decoding with a fixed node budget does that by construction once the ranks share

- the head's weights, configuration and n-gram tables (load it from the same folder on every rank, or broadcast
  the weights of a head built in memory),
- the call's settings (mode, batch size, node budget), and
- for sampling, the random state (the same `torch.manual_seed` on every rank before the call).

`check_tensor_parallel_call` checks those cheaply (one small `all_gather` per call: a digest of the head, cached
while its tensors are unchanged, and a digest of the generator state when sampling). Every rank takes part in the
same collective and decides from the same gathered values, so a refusal is raised on every rank, never on one rank
while another waits in the next forward. The cost-aware node budget chooses each step's tree size from the step's
measured wall time, which differs from rank to rank (unshared, the second call of a 2-rank gloo run failed inside a
collective): `shared_budget` hands every rank the first rank's choice, one tiny broadcast per step.

Nothing happens (not even an import of `torch.distributed` state beyond `is_initialized`) for a target that is not
tensor-parallel, so single-process decoding pays nothing.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch
import torch.distributed as dist

MODES = ("tree", "chain")
_DIGEST_WORDS = 4  # int64 words of the head digest (blake2b, 32 bytes)
_CHUNK = 1 << 22  # elements per chunk of the on-device checksum (bounds its temporary memory)

# head -> (key of its tensors' identity and versions, digest); recomputed only when a tensor is replaced or
# changed in place (`Tensor._version`), so a call usually pays a walk over the state dict's names, not its bytes
_HEAD_DIGESTS: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, list[int]]]" = weakref.WeakKeyDictionary()


def tensor_parallel_group(target):
    """The process group `target`'s tensor-parallel collectives run on, or None when the target is not
    tensor-parallel (or `torch.distributed` is not initialised). transformers marks a target it sharded with
    `tp_size` > 1 and keeps the mesh in `_device_mesh`; a target sharded by hand shows DTensor parameters."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    mesh = None
    if (getattr(target, "tp_size", None) or 1) > 1:
        mesh = getattr(target, "_device_mesh", None)
        if mesh is None:
            return dist.group.WORLD
    else:
        from torch.distributed.tensor import DTensor

        mesh = next((p.device_mesh for p in target.parameters() if isinstance(p, DTensor)), None)
        if mesh is None:
            return None
    names = getattr(mesh, "mesh_dim_names", None) or ()
    if "tp" in names:
        return mesh.get_group("tp")
    return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD


def is_tensor_parallel(target) -> bool:
    """Whether `target` runs its forwards as tensor-parallel collectives in this process."""
    return tensor_parallel_group(target) is not None


def check_tensor_parallel_call(head, target, *, mode: str, batch_size: int, node_budget=None,
                               do_sample: bool = False) -> None:
    """Refuse, on every rank of a tensor-parallel target with the same ValueError, a DART call the ranks would not
    run in lockstep; return at once (no collective) when the target is not tensor-parallel.

    Call it once per `generate` call, before any target forward, on every rank. `node_budget`: the call's request
    (`dart_node_budget`: an int, "auto", or None for the head's `config.node_budget`, where None means "auto").
    `do_sample`: sampling; then the default generator of the target's device must be in the same state on every
    rank (the same `torch.manual_seed` before the call).
    """
    group = tensor_parallel_group(target)
    if group is None:
        return
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    requested = head.config.node_budget if node_budget is None else node_budget
    auto = requested is None or requested == "auto"
    budget = -1 if auto else int(requested)
    mine = torch.tensor([*head_digest(head), MODES.index(mode), int(batch_size), budget, int(bool(do_sample)),
                         _rng_digest(target) if do_sample else 0], dtype=torch.int64)
    rows = _all_gather(mine, group, target)
    rank = dist.get_rank(group)
    names = ["the head's weights, configuration or n-gram tables"] * _DIGEST_WORDS + [
        "dart_mode", "the batch size", "the node budget", "do_sample", "the random generator state"]
    differ = sorted({names[i] for i in range(len(names)) if any(r[i] != rows[0][i] for r in rows)},
                    key=names.index)
    if differ:
        raise ValueError(
            f"DART on a tensor-parallel target (rank {rank} of {len(rows)}): the ranks differ in "
            f"{', '.join(differ)}. Every rank must run the same call with the same head (load it from the same "
            "folder on every rank, or broadcast the weights of a head built in memory) and, for sampling, after the "
            "same torch.manual_seed; otherwise their target forwards would differ and the collectives inside them "
            "would fail or hang. See docs/TENSOR_PARALLEL.md."
        )


def shared_budget(group, budget: int, target) -> int:
    """The node budget the first rank of `group` chose (`budget` itself without a group): every rank verifies a tree
    of the same size, whatever its own step timings would have chosen."""
    if group is None:
        return budget
    value = torch.tensor([int(budget)], dtype=torch.int64, device=_collective_device(group, target))
    dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
    return int(value.item())


def head_digest(head) -> list[int]:
    """_DIGEST_WORDS int64 words that change when any of the head's weights, buffers, configuration or n-gram
    tables change (cached per head until one of its tensors is replaced or modified in place)."""
    tensors = sorted(head.state_dict(keep_vars=True).items())
    ngram = getattr(head, "ngram", None)
    if ngram is not None:
        tensors += [(f"ngram.{k}", v) for k, v in sorted(ngram.tables.items())]
    config = _config_text(head.config)
    key = (config, getattr(ngram, "order", None),
           tuple((name, t.data_ptr(), t._version, tuple(t.shape), str(t.dtype), str(t.device)) for name, t in tensors))
    cached = _HEAD_DIGESTS.get(head)
    if cached is not None and cached[0] == key:
        return cached[1]
    h = hashlib.blake2b(digest_size=8 * _DIGEST_WORDS)
    h.update(config.encode())
    h.update(repr(getattr(ngram, "order", None)).encode())
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(repr(_checksum(t)).encode())
    digest = [int.from_bytes(h.digest()[8 * i: 8 * i + 8], "little", signed=True) for i in range(_DIGEST_WORDS)]
    _HEAD_DIGESTS[head] = (key, digest)
    return digest


def _config_text(config) -> str:
    """The head's settings as JSON, without where it was loaded from (the same head may sit at other paths on
    other machines)."""
    settings = {k: v for k, v in config.to_dict().items() if "name_or_path" not in k and k != "_commit_hash"}
    return json.dumps(settings, sort_keys=True, default=str)


@torch.no_grad()
def _checksum(t: torch.Tensor) -> tuple[int, int]:
    """(sum, position-weighted sum) of the tensor's bit patterns as integers, on its own device (no host copy of a
    large head). Equal bits give equal sums; a differently initialised or loaded tensor differs in both. A sharded
    tensor (DTensor) is the target's, sharded alike on every rank by transformers: only its shape counts."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) or t.numel() == 0:
        return 0, 0
    flat = t.detach().contiguous().view(-1)
    size = flat.element_size()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(size)
    bits = flat.view(ints) if ints is not None and flat.dtype != torch.bool else flat.to(torch.uint8)
    total, weighted = 0, 0
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start: start + _CHUNK].to(torch.int64)
        weights = torch.arange(start, start + chunk.numel(), device=chunk.device, dtype=torch.int64) % 65521 + 1
        total += int(chunk.sum())
        weighted += int((chunk * weights).sum())
    return total, weighted


def _rng_digest(target) -> int:
    """A digest of the default random generator that sampling on the target's device draws from."""
    device = target.device
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device)
    elif device.type == "cpu":
        state = torch.get_rng_state()
    else:
        return 0
    return int.from_bytes(hashlib.blake2b(state.cpu().numpy().tobytes(), digest_size=8).digest(), "little",
                          signed=True)


def _all_gather(mine: torch.Tensor, group, target) -> list[list[int]]:
    """Every rank's `mine`, in rank order, on every rank (gloo: CPU tensors; nccl: the target's CUDA device)."""
    mine = mine.to(_collective_device(group, target))
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]


def _collective_device(group, target) -> torch.device:
    """Where a collective's tensors live: the target's CUDA device for nccl, the CPU for gloo."""
    backend = str(dist.get_backend(group))
    return target.device if ("nccl" in backend and target.device.type == "cuda") else torch.device("cpu")


__all__ = ["check_tensor_parallel_call", "head_digest", "is_tensor_parallel", "shared_budget",
           "tensor_parallel_group"]
