"""Convert a reference DART release into a dart_hf head folder: `dart-hf convert`.

The reference release (github.com/fvliang/DART) ships one head per Qwen3 size (`fvliang/qwen{1.7b,4b,8b,14b,32b}-dart`:
a Llama-style `config.json` with the extra fields `draft_length`, `draft_vocab_size`, `target_hidden_size`, and a
`model.safetensors` whose keys are already dart_hf's) and one n-gram trie for all of them
(`fvliang/dart-qwen3-ngram`: `full.trie`, `small.trie`, docs/DART_SPEC.md §5). The output folder holds:

    config.json          DartConfig (model_type "dart"): the head's shape plus the target it was built for
    model.safetensors    the reference tensors, checked key by key and shape by shape (`embed_tokens` dropped)
    ngram.safetensors    the trie as sorted n-gram count tables (dart_hf.core.ngram), when a .trie was given
    custom_generate/     DART for `generate(custom_generate=..., trust_remote_code=True)` without dart_hf

Config mapping (reference -> DartConfig), stated here because two of them are easy to get wrong:
- `draft_length` -> `draft_length` unchanged. The reference layer appends `draft_length` MASK rows and keeps the
  last `draft_length + 1` rows (last real row + MASK rows), which is exactly DartConfig's count of MASK slots.
- `final_norm_repeats = 2`: the reference applies `norm` at the end of `forward` and again in `compute_logits`.
- `aux_layer_ids = [2, L // 2, L - 3]`, `target_num_layers = L`, `target_model_type` and `vocab_size` come from the
  target (`target_config`: a config.json, or a built-in Qwen3 shape; they are not in the reference config).
- `rope_theta` / `rope_scaling` -> `rope_parameters` as the reference attention builds its rotary embedding
  (`reference_rope_parameters`); `head_dim` defaults to `hidden_size // num_attention_heads` as in the reference
  attention; biases are off (the reference has none).
- `prompt_lookup = False`: the reference tree has no prompt-lookup candidates, so a converted head drafts exactly
  the reference's trees unless the user turns that extra on. The other tree-search fields keep DartConfig's
  defaults, which are the reference's values.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..core.configuration import DartConfig, default_aux_layer_ids
from ..core.modeling import DartHead
from ..core.ngram import FILE_NAME as NGRAM_FILE
from ..core.ngram import NGramModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DROPPED_KEYS = ("embed_tokens.weight",)  # the head borrows the target's embedding; never saved by dart_hf
REQUIRED_REFERENCE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "vocab_size",
    "draft_length",
    "draft_vocab_size",
    "target_hidden_size",
)


# ---------------------------------------------------------------------------------------------------- targets
@dataclass(frozen=True)
class TargetShape:
    """The target fields a head needs, plus the Qwen3 release shapes the model cards are checked against."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    rope_theta: float | None = None
    max_position_embeddings: int | None = None
    reference_repo: str | None = None


def _qwen3(size: str, hidden: int, layers: int, heads: int, intermediate: int) -> TargetShape:
    return TargetShape(
        name=f"Qwen/Qwen3-{size}",
        model_type="qwen3",
        hidden_size=hidden,
        num_hidden_layers=layers,
        vocab_size=151936,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=intermediate,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        reference_repo=f"fvliang/qwen{size.lower()}-dart",
    )


QWEN3_TARGETS: dict[str, TargetShape] = {
    t.name: t
    for t in (
        _qwen3("1.7B", 2048, 28, 16, 6144),
        _qwen3("4B", 2560, 36, 32, 9728),
        _qwen3("8B", 4096, 36, 32, 12288),
        _qwen3("14B", 5120, 40, 40, 17408),
        _qwen3("32B", 5120, 64, 64, 25600),
    )
}
"""The five targets of the reference release (shapes of the Qwen3 config.json files on the Hub)."""


def _known_target(name: str) -> TargetShape | None:
    key = name.lower().removeprefix("qwen/")
    return next((t for t in QWEN3_TARGETS.values() if t.name.lower().removeprefix("qwen/") == key), None)


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _target_from_config_file(path: Path) -> TargetShape:
    if path.is_dir():
        path = path / CONFIG_FILE
    cfg = _read_json(path)
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the decoder under text_config
    missing = [k for k in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size") if k not in cfg]
    if missing:
        raise ValueError(f"{path} is not a decoder config: missing {missing}")
    return TargetShape(
        name=str(path),
        model_type=cfg["model_type"],
        hidden_size=cfg["hidden_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        vocab_size=cfg["vocab_size"],
    )


def resolve_target(target_config: str | os.PathLike | None, reference: dict) -> TargetShape:
    """The target a reference head was trained for.

    `target_config` is a target config.json (file or folder) or a built-in name ("Qwen/Qwen3-8B", "qwen3-8b").
    Without it the built-in Qwen3 table is matched on `target_hidden_size`; 14B and 32B share hidden size 5120,
    so the head's `intermediate_size` (the reference copies its target's MLP width) breaks that tie.
    """
    if target_config is not None:
        known = _known_target(os.fspath(target_config))
        target = known or _target_from_config_file(Path(target_config))
    else:
        same_width = [t for t in QWEN3_TARGETS.values() if t.hidden_size == reference["target_hidden_size"]]
        if len(same_width) > 1:
            same_width = [t for t in same_width if t.intermediate_size == reference["intermediate_size"]]
        if len(same_width) != 1:
            raise ValueError(
                f"cannot tell the target of a head with target_hidden_size={reference['target_hidden_size']} and "
                f"intermediate_size={reference['intermediate_size']}: pass --target-config <target config.json> "
                f"(built-in targets: {', '.join(QWEN3_TARGETS)})"
            )
        target = same_width[0]
    if target.hidden_size != reference["target_hidden_size"]:
        raise ValueError(
            f"the reference head expects a target with hidden size {reference['target_hidden_size']}, but "
            f"{target.name} has {target.hidden_size}"
        )
    return target


# ---------------------------------------------------------------------------------------------------- config
def read_reference_config(src_dir: Path) -> dict:
    """The reference config.json, rejected with the file and field named when it is not a reference DART head."""
    path = src_dir / CONFIG_FILE
    cfg = _read_json(path)
    if cfg.get("model_type") == "dart":
        raise ValueError(f"{path} is already a dart_hf head (model_type 'dart'); load it with DartHead.from_pretrained")
    missing = [k for k in REQUIRED_REFERENCE_FIELDS if k not in cfg]
    if missing:
        raise ValueError(
            f"{path} is not a reference DART config (model_type={cfg.get('model_type')!r}): missing {missing}"
        )
    if cfg.get("model_type", "llama") != "llama":
        raise ValueError(f"{path}: reference DART heads are Llama-style, got model_type={cfg['model_type']!r}")
    reference_rope_parameters(cfg, path)  # an unsupported rope_scaling is refused before anything is written
    if cfg["draft_vocab_size"] is None:
        raise ValueError(f"{path}: draft_vocab_size is null; reference heads always have their own lm_head")
    return cfg


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def reference_rope_parameters(reference: dict, path: Path | str = CONFIG_FILE) -> dict:
    """transformers `rope_parameters` that give the rotary embedding the reference attention builds (`_init_rope`).

    The reference's linear, dynamic and yarn embeddings are constructed without `rope_theta`, so their base is
    10000 whatever the config says; the weights were trained with that, so it is kept. llama3 without
    low/high_freq_factor or original_max_position_embeddings is plain RoPE there. yarn's cos/sin factor is always
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) there, passed as `attention_factor`. "dynamic" is
    DartConfig's reference variant (see `DartRotaryEmbedding`).
    """
    theta = float(reference.get("rope_theta", 10000.0))
    rope = reference.get("rope_scaling")
    if not rope:
        return {"rope_type": "default", "rope_theta": theta}
    if not isinstance(rope, dict):
        raise ValueError(f"{path}: rope_scaling must be an object, got {rope!r}")
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if kind in ("linear", "dynamic", "yarn") and factor is None:
        raise ValueError(f"{path}: rope_scaling of type {kind!r} needs 'factor'")
    if kind in ("linear", "dynamic"):
        return {"rope_type": kind, "rope_theta": 10000.0, "factor": float(factor)}
    if kind == "llama3":
        fields = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        if any(rope.get(f) is None for f in fields):
            return {"rope_type": "default", "rope_theta": theta}
        return {
            "rope_type": "llama3",
            "rope_theta": theta,
            "factor": float(factor if factor is not None else 1.0),
            "low_freq_factor": float(rope["low_freq_factor"]),
            "high_freq_factor": float(rope["high_freq_factor"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        }
    if kind == "yarn":
        fields = ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        missing = [f for f in fields if rope.get(f) is None]
        if missing:
            raise ValueError(f"{path}: yarn rope_scaling without {missing} (the reference head cannot run without them)")
        factor = float(factor)
        return {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": factor,
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
            "beta_fast": float(rope["beta_fast"]),
            "beta_slow": float(rope["beta_slow"]),
            "attention_factor": _yarn_mscale(factor, rope["mscale"]) / _yarn_mscale(factor, rope["mscale_all_dim"]),
        }
    raise ValueError(
        f"{path}: rope_scaling type {kind!r} is not supported (the reference head supports linear, dynamic, llama3, "
        "yarn; mrope is for multimodal targets)"
    )


def dart_config_from_reference(reference: dict, target: TargetShape) -> DartConfig:
    """DartConfig for a reference head and its target (mapping in the module docstring)."""
    if reference["vocab_size"] != target.vocab_size:
        raise ValueError(
            f"the reference head covers a vocabulary of {reference['vocab_size']} tokens, "
            f"but the target {target.name} has {target.vocab_size}"
        )
    layers = target.num_hidden_layers
    heads = reference["num_attention_heads"]
    return DartConfig(
        hidden_size=reference["hidden_size"],
        intermediate_size=reference["intermediate_size"],
        num_attention_heads=heads,
        num_key_value_heads=reference.get("num_key_value_heads") or heads,
        head_dim=reference.get("head_dim") or reference["hidden_size"] // heads,
        hidden_act=reference.get("hidden_act", "silu"),
        rms_norm_eps=float(reference.get("rms_norm_eps", 1e-6)),
        rope_parameters=reference_rope_parameters(reference),
        max_position_embeddings=reference.get("max_position_embeddings", 2048),
        attention_bias=False,
        vocab_size=reference["vocab_size"],
        draft_vocab_size=reference["draft_vocab_size"],
        draft_length=reference["draft_length"],
        target_hidden_size=reference["target_hidden_size"],
        target_num_layers=layers,
        target_model_type=target.model_type,
        aux_layer_ids=default_aux_layer_ids(layers),
        final_norm_repeats=2,
        prompt_lookup=False,
    )


# ---------------------------------------------------------------------------------------------------- weights
def _expected_shapes(config: DartConfig) -> dict[str, tuple[int, ...]]:
    """Key -> shape of a DartHead with `config`, built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        head = DartHead(config)
    return {k: tuple(v.shape) for k, v in head.state_dict().items()}


def _check_vocab_map(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    d2t, t2d = tensors["d2t"], tensors["t2d"]
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"{path}: key 'd2t' must hold integer offsets, got {d2t.dtype}")
    if t2d.dtype != torch.bool:
        raise ValueError(f"{path}: key 't2d' must be a bool mask over the target vocab, got {t2d.dtype}")
    ids = d2t.long() + torch.arange(d2t.numel())
    if ids.min() < 0 or ids.max() >= t2d.numel() or ids.unique().numel() != ids.numel():
        raise ValueError(f"{path}: key 'd2t' does not map draft ids to distinct target ids in [0, {t2d.numel()})")
    if int(t2d.sum()) != ids.numel() or not bool(t2d[ids].all()):
        raise ValueError(f"{path}: keys 'd2t' and 't2d' disagree on which target ids the draft vocab covers")
    tensors["d2t"] = d2t.long()


def read_reference_weights(src_dir: Path, config: DartConfig) -> dict[str, torch.Tensor]:
    """The reference tensors, with every key and shape checked against a DartHead built from `config`."""
    path = src_dir / WEIGHTS_FILE
    if not path.is_file():
        pickled = [p.name for p in src_dir.glob("*.bin")] + [p.name for p in src_dir.glob("*.pt")]
        hint = f" (found {pickled}: pickle checkpoints are never loaded, use the safetensors file)" if pickled else ""
        raise FileNotFoundError(f"{path} not found{hint}")
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises several types for a damaged file
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from err
    for key in DROPPED_KEYS:
        tensors.pop(key, None)
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path} does not have the reference DART layout: missing keys {missing}, unexpected {unexpected}"
        )
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != shape:
            raise ValueError(
                f"{path}: key {key!r} has shape {tuple(tensors[key].shape)}, expected {shape} for config.json"
            )
        if key not in ("d2t", "t2d") and not tensors[key].dtype.is_floating_point:
            raise ValueError(f"{path}: key {key!r} must be a float tensor, got {tensors[key].dtype}")
    _check_vocab_map(path, tensors)
    return tensors


# ---------------------------------------------------------------------------------------------------- trie
_TRIE_HEADER = 16  # u64 order, u64 node_count
_NODE = 24  # i32 token, u64 parent, i32 freq, u64 n_children
_CHILD = 12  # i32 child_token, u64 child_node_id
_NODE_DTYPE = np.dtype([("token", "<i4"), ("parent", "<u8"), ("freq", "<i4"), ("n_children", "<u8")])
_CHILD_DTYPE = np.dtype([("token", "<i4"), ("node", "<u8")])
_CHUNK = 1 << 20  # records gathered per numpy call
_LEAF_STREAK = 8  # leaves in a row before the walk looks for a longer run with numpy


def _record_offsets(mm: mmap.mmap, n_nodes: int, path: Path, progress: bool) -> np.ndarray:
    """Byte offset of every node record.

    A record's length depends on its own child count, so this walk is sequential: one cheap Python step per
    record. Leaf records (n_children == 0: most of a trie, all of its longest n-grams) often come in runs; after
    `_LEAF_STREAK` leaves in a row the rest of the run is found with one strided numpy view (doubling its length
    while runs keep filling it), so long runs cost no Python steps.
    """
    size = len(mm)
    offsets = np.empty(n_nodes, np.int64)
    off, i, streak, block, reported = _TRIE_HEADER, 0, 0, 64, 0
    with tqdm(total=n_nodes, desc="trie records", unit="node", unit_scale=True, disable=not progress) as bar:
        while i < n_nodes:
            if off + _NODE > size:
                raise ValueError(f"{path} is truncated: node {i} of {n_nodes} starts past the end of the file")
            if streak >= _LEAF_STREAK:
                fit = min(block, n_nodes - i, (size - off) // _NODE)
                counts = np.ndarray((fit,), "<u8", mm, off + 16, (_NODE,))
                nonzero = np.flatnonzero(counts)
                del counts  # a live view would keep the memory map from closing
                run = int(nonzero[0]) if nonzero.size else fit
                offsets[i : i + run] = off + _NODE * np.arange(run, dtype=np.int64)
                off, i = off + _NODE * run, i + run
                block = min(2 * block, _CHUNK) if run == fit else 64
                streak = 0
            else:
                n_children = int.from_bytes(mm[off + 16 : off + 24], "little")
                end = off + _NODE + _CHILD * n_children
                if n_children >= n_nodes or end > size:
                    raise ValueError(f"{path} is corrupt or truncated: node {i} claims {n_children} children")
                offsets[i] = off
                off, i = end, i + 1
                streak = streak + 1 if n_children == 0 else 0
            if i - reported >= 1 << 16 or i == n_nodes:
                bar.update(i - reported)
                reported = i
    if off != size:
        raise ValueError(f"{path}: {size - off} bytes left after the last of {n_nodes} nodes (not a .trie file?)")
    return offsets


def _gather(mm: mmap.mmap, offsets: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Records of `dtype` at byte `offsets`, copied out of the memory map in one fancy-indexing call."""
    raw = np.frombuffer(mm, dtype=np.uint8)
    shape = (raw.size - dtype.itemsize + 1, dtype.itemsize)
    windows = np.lib.stride_tricks.as_strided(raw, shape=shape, strides=(1, 1))  # every byte starts a window
    out = windows[offsets].view(dtype).reshape(-1)
    del windows, raw
    return out


def _read_nodes(mm: mmap.mmap, offsets: np.ndarray, progress: bool) -> np.ndarray:
    nodes = np.empty(offsets.size, _NODE_DTYPE)
    for start in tqdm(range(0, offsets.size, _CHUNK), desc="trie nodes", unit="chunk", disable=not progress):
        nodes[start : start + _CHUNK] = _gather(mm, offsets[start : start + _CHUNK], _NODE_DTYPE)
    return nodes


def _check_children(mm: mmap.mmap, offsets: np.ndarray, nodes: np.ndarray, path: Path, progress: bool) -> None:
    """Every child entry must name a node whose parent and token agree with it (the trie is read twice over)."""
    n = nodes.size
    n_children = nodes["n_children"].astype(np.int64)
    if int(n_children.sum()) != n - 1:
        raise ValueError(f"{path}: {int(n_children.sum())} child entries for {n} nodes (a trie has n - 1)")
    # node ranges holding about _CHUNK child entries each, so memory stays bounded however wide the trie is
    bounds = np.searchsorted(np.cumsum(n_children), np.arange(_CHUNK, n, _CHUNK), side="right")
    bounds = np.unique(np.concatenate([[0], bounds, [n]]))
    ranges = zip(bounds[:-1], bounds[1:])
    for start, stop in tqdm(ranges, total=bounds.size - 1, desc="trie children", unit="chunk", disable=not progress):
        counts = n_children[start:stop]
        total = int(counts.sum())
        if not total:
            continue
        owner = np.repeat(np.arange(start, stop), counts)
        first = np.cumsum(counts) - counts
        rank = np.arange(total) - np.repeat(first, counts)
        entries = _gather(mm, offsets[owner] + _NODE + _CHILD * rank, _CHILD_DTYPE)
        child = entries["node"]
        bad = (child >= n) | (child == 0)
        if bad.any():
            raise ValueError(f"{path}: node {int(owner[bad][0])} lists child id {int(child[bad][0])} outside the trie")
        child = child.astype(np.int64)
        bad = (nodes["parent"][child] != owner) | (nodes["token"][child] != entries["token"])
        if bad.any():
            raise ValueError(f"{path}: node {int(owner[bad][0])}'s child list disagrees with node {int(child[bad][0])}")


def _ngram_keys(nodes: np.ndarray, order: int, vocab_size: int, path: Path, progress: bool):
    """(key, length) of the n-gram each non-root node spells (key = sum t_i * V^(m-i), as in dart_hf.core.ngram).

    Each chunk of nodes climbs towards the root together, `order` vectorised steps at most.
    """
    tokens, parents = nodes["token"], nodes["parent"]
    keys = np.empty(nodes.size - 1, np.int64)
    lengths = np.empty(nodes.size - 1, np.int8)
    for start in tqdm(range(1, nodes.size, _CHUNK), desc="n-gram keys", unit="chunk", disable=not progress):
        stop = min(nodes.size, start + _CHUNK)
        key = tokens[start:stop].astype(np.int64)
        length = np.ones(stop - start, np.int8)
        scale = np.full(stop - start, vocab_size, np.int64)
        cursor = parents[start:stop].astype(np.int64)
        for _ in range(order):
            active = np.flatnonzero(cursor)
            if active.size == 0:
                break
            up = cursor[active]
            key[active] += tokens[up].astype(np.int64) * scale[active]
            scale[active] *= vocab_size
            length[active] += 1
            cursor[active] = parents[up].astype(np.int64)
        if cursor.any():
            node = start + int(np.flatnonzero(cursor)[0])
            raise ValueError(f"{path}: node {node} lies deeper than the order {order}")
        keys[start - 1 : stop - 1], lengths[start - 1 : stop - 1] = key, length
    return keys, lengths


def read_trie(path: str | os.PathLike, vocab_size: int | None = None, progress: bool = True) -> NGramModel:
    """Read a reference `.trie` (docs/DART_SPEC.md §5) into an `NGramModel` with the same counts.

    The file is memory-mapped, never read byte by byte: node fields are gathered with numpy, and the only Python
    loop is the walk over record boundaries (one step per record, long runs of leaf records in one numpy view).
    Memory grows with the node count (tens of bytes per node on top of the file's reclaimable page cache), so
    `small.trie`-class files convert in seconds to minutes, while the released `full.trie` (~1.3e9 nodes) needs a
    machine with RAM well beyond its size: convert it once and ship `ngram.safetensors`.

    Every node's freq becomes its n-gram's count, which is what the reference lookup reads (a context's count is
    its own node's freq, docs/DART_SPEC.md §5), so probabilities equal the reference's. Nodes with freq 0 (left by
    the reference's `reduce`) are kept: there a candidate found under such a node stops the back-off with 0.
    `vocab_size` is the target's vocabulary (default: largest token id + 1); token ids must lie below it.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < _TRIE_HEADER + _NODE:
        raise ValueError(f"{path} is too small to be a .trie file ({size} bytes)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        order, n_nodes = (int(v) for v in np.frombuffer(mm[:_TRIE_HEADER], "<u8"))
        if not 1 <= order <= 16 or not 1 <= n_nodes <= (size - _TRIE_HEADER) // _NODE:
            raise ValueError(f"{path} is not a .trie file: header says order {order}, {n_nodes} nodes in {size} bytes")
        offsets = _record_offsets(mm, n_nodes, path, progress)
        nodes = _read_nodes(mm, offsets, progress)
        _check_children(mm, offsets, nodes, path, progress)
    del offsets
    _check_node_fields(nodes, vocab_size, path)
    if vocab_size is None:
        vocab_size = int(nodes["token"][1:].max()) + 1
    if vocab_size**order >= 2**63:
        raise ValueError(f"{path}: order {order} n-grams over {vocab_size} tokens do not fit dart_hf's int64 keys")
    keys, lengths = _ngram_keys(nodes, order, vocab_size, path, progress)
    freqs = nodes["freq"][1:]
    tables = {}
    for m in range(1, order + 1):
        sel = lengths == m
        k = keys[sel]
        sort = np.argsort(k)
        k, c = k[sort], freqs[sel][sort].astype(np.int64)
        if k.size > 1 and (k[1:] == k[:-1]).any():
            raise ValueError(f"{path}: two nodes spell the same {m}-gram (corrupt trie)")
        tables[f"keys_{m}"], tables[f"counts_{m}"] = torch.from_numpy(k), torch.from_numpy(c)
    del nodes, keys, lengths, freqs
    return NGramModel.from_counts(order, vocab_size, tables)


def _check_node_fields(nodes: np.ndarray, vocab_size: int | None, path: Path) -> None:
    """Parents inside the trie and not the node itself, token ids in the vocabulary, counts not negative."""
    n = nodes.size
    parents, tokens, freqs = nodes["parent"][1:], nodes["token"][1:], nodes["freq"][1:]
    bad = (parents >= n) | (parents == np.arange(1, n, dtype=np.uint64))
    if bad.any():
        raise ValueError(f"{path}: node {int(np.flatnonzero(bad)[0]) + 1} has no valid parent")
    if n > 1 and tokens.min() < 0:
        raise ValueError(f"{path}: negative token id at node {int(np.flatnonzero(tokens < 0)[0]) + 1}")
    if n > 1 and vocab_size is not None and tokens.max() >= vocab_size:
        raise ValueError(f"{path}: token id {int(tokens.max())} does not fit the target vocabulary of {vocab_size}")
    if (freqs < 0).any():
        raise ValueError(f"{path}: negative frequency at node {int(np.flatnonzero(freqs < 0)[0]) + 1}")


# ---------------------------------------------------------------------------------------------------- conversion
def convert_reference(
    src_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    ngram_trie: str | os.PathLike | None = None,
    target_config: str | os.PathLike | None = None,
    progress: bool = True,
) -> DartHead:
    """Write a dart_hf head folder from a reference DART checkpoint (and optionally its `.trie`), then load it back.

    Everything is validated before anything is written; the returned head is what `DartHead.from_pretrained`
    (strict: every key, every shape) makes of the new folder, so a folder that comes out cannot fail to load.
    `target_config`: see `resolve_target`.
    """
    from .hub import write_custom_generate

    src, out = Path(src_dir), Path(out_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"reference folder {src} not found")
    if out.resolve() == src.resolve():
        raise ValueError("--out must differ from the reference folder (its model.safetensors would be replaced)")
    reference = read_reference_config(src)
    config = dart_config_from_reference(reference, resolve_target(target_config, reference))
    tensors = read_reference_weights(src, config)
    ngram = read_trie(ngram_trie, vocab_size=config.vocab_size, progress=progress) if ngram_trie else None
    config.dtype = tensors["fc.weight"].dtype
    config.has_ngram = ngram is not None  # from_pretrained then refuses a copy of the folder that lost the file
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    if ngram is not None:
        ngram.save(out / NGRAM_FILE)
    write_custom_generate(out)
    return DartHead.from_pretrained(out)


def run(args: argparse.Namespace) -> int:
    try:
        head = convert_reference(args.reference_dir, args.out, ngram_trie=args.ngram, target_config=args.target_config)
    except (ValueError, OSError) as err:
        print(f"dart-hf convert: error: {err}", file=sys.stderr)
        return 1
    cfg = head.config
    print(
        f"wrote {args.out}: DART head for {cfg.target_model_type} ({cfg.target_num_layers} layers), "
        f"{cfg.draft_length} MASK slots, draft vocab {cfg.draft_vocab_size}, n-gram: {head.ngram or 'none'}"
    )
    return 0


__all__ = [
    "QWEN3_TARGETS",
    "TargetShape",
    "convert_reference",
    "dart_config_from_reference",
    "read_reference_config",
    "read_reference_weights",
    "read_trie",
    "reference_rope_parameters",
    "resolve_target",
]
