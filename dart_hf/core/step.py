"""One DART step: the drafter's trees -> one target forward over every row's tree (`verify`) -> the call's acceptance
-> each row's path into the cache (`commit`) and its target states to the drafter. One cache layout, one mask
builder, one commit, one acceptance entry point (`StepAcceptance`), for every call; what differs is the cache
transformers holds the keys in and whether the shapes are fixed:

- `DartStep` over transformers' `DynamicCache` (the default): any tree size per step, the drafter's buffers read as
  far as they are filled, finished rows leave the batch;
- `DartStep` over its `StaticCache` (`cache_implementation="static"`): every shape fixed for the call and a short
  ladder of tree sizes, so the whole step (`decode_step`) is one graph per size that `torch.compile` captures
  (transformers' auto-compile decides, as for plain `generate`), every size compiled before the call's first decode
  step (`DartStep._compile_first`); finished rows stay, masked. Eager (`disable_compile=True`) it is the same
  function, uncompiled.

The layout (no model code copied, the cache stays transformers' own):
- Row r's committed tokens sit in slots [left_r, end_r): its left padding first (never attended to), then its text
  but the last token (the root of its next tree, not yet in the cache). Positions are per row, as plain `generate`
  counts them for a left-padded row: slot s holds position s - left_r. Keys are stored already rotated, so moving an
  entry to another slot does not change what it means.
- A step's N tree nodes go into slots [P, P + N), P = the cache's length = the furthest row's end. Node i of row r
  sits at position end_r - left_r + depth_i and sees the row's committed slots and its own ancestors (`verify_mask`).
- The accepted path's entries move to [end_r, end_r + len_r) (one gather and one scatter per layer: `commit`); the
  cache's length becomes the furthest new end (a `DynamicCache` is cropped there; a `StaticCache` has its length set
  on the device). Slots a row has not reached are never attended to, so a batch's rows never leave holes to compact,
  and one unpadded row's cache is exactly plain decoding's.
- Sliding-window layers keep every slot (their cache layers are made full: `decode_cache`, `static_cache`); the window
  is applied by the mask from the slots' positions. A target whose layers differ (full and sliding: Gemma 2/3,
  gpt-oss, ...) gets one mask per layer type, keyed by its config's `layer_types`, which is how those models take
  prepared masks. The verify forward is `target.target_forward`; nothing in transformers or the target is changed.

What the fixed-shape step cannot run (a batch whose acceptance walks the host, a tensor-parallel or split target,
FlexAttention, a text past the context) runs over the `DynamicCache`, and `DartStats.static_reason` says why
(`static_refusal`).
"""

from __future__ import annotations

import os
import threading
import time
import types
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch._dynamo.utils import counters
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, StaticCache
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.utils import logging

from .acceptance import BatchAccepted, StepAcceptance
from .distributed import tensor_parallel_group
from .drafter import DartDrafter, batch_bucket, bucket, draft_depth
from .modeling import DartHead
from .stats import PhaseTimer
from .target import backend_mask, layer_windows, target_forward
from .tree import DraftTree, DraftTrees

CUDA_GRAPHS = os.environ.get("DART_HF_CUDA_GRAPHS") == "1"  # opt in to CUDA graphs for the DART step (untested)
logger = logging.get_logger(__name__)


# ---------------------------------------------------------------------------------------------- the caches
def decode_cache(config, cache: DynamicCache | None = None) -> DynamicCache:
    """The (empty) `DynamicCache` a DART call decodes into: `cache` (the caller's) or a new one, with every
    sliding-window layer replaced by a full `DynamicLayer` (in place: the caller's object is the one that gets filled,
    as in `generate`)."""
    if cache is None:
        cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


def static_cache(config, max_cache_len: int) -> StaticCache:
    """transformers' `StaticCache` of `max_cache_len` slots with every layer full (`StaticLayer`: the masks apply the
    windows)."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    cache.layers = [StaticLayer(max_cache_len) if getattr(layer, "is_sliding", False) else layer
                    for layer in cache.layers]
    return cache


@dataclass(frozen=True)
class StepSpec:
    """The step's Python constants (a change recompiles): the layers the head reads, the attention backend, the
    distinct windows of the target's layers and each layer type's window (`by_type`: None when every layer takes one
    mask)."""

    aux_ids: tuple[int, ...]
    attn: str
    windows: tuple[int | None, ...]  # the distinct windows of the target's layers
    by_type: tuple[tuple[str, int | None], ...] | None  # (layer type, its window) when the windows differ

    @classmethod
    def of(cls, target: PreTrainedModel, aux_ids: list[int]) -> "StepSpec":
        """The spec for `target`; a target mixing windows without `layer_types` (no way to say which layer takes
        which mask) raises NotImplementedError before any work."""
        windows = layer_windows(target.config)
        text = target.config.get_text_config(decoder=True)
        distinct = tuple(dict.fromkeys(windows))
        by_type = None
        if len(distinct) > 1:
            types = getattr(text, "layer_types", None)
            if types is None or len(types) != len(windows):
                raise NotImplementedError(
                    f"{text.model_type} mixes layers of windows {sorted(distinct, key=str)} without `layer_types` in "
                    'its config; DART tree verification cannot tell which mask each layer takes; use dart_mode="chain"')
            seen: dict[str, int | None] = {}
            for kind, w in zip(types, windows):
                if seen.setdefault(kind, w) != w:
                    raise NotImplementedError(f"{text.model_type} has {kind!r} layers of different windows; DART tree "
                                              'verification passes one mask per layer type; use dart_mode="chain"')
            by_type = tuple(seen.items())
        return cls(tuple(aux_ids), target.config._attn_implementation or "eager", distinct, by_type)


@dataclass
class RowSlots:
    """The rows' place in the cache, on the device: left padding, the last position a node may take (max_length - 1
    - left: nodes past it are never kept, and a dynamic RoPE must not see a longer text than plain decoding does),
    and which rows still decode (a finished row of a fixed-shape step is masked: it accepts nothing more)."""

    left: torch.Tensor
    last_pos: torch.Tensor
    alive: torch.Tensor

    @classmethod
    def of(cls, lefts: list[int], max_length: int, device) -> "RowSlots":
        left = torch.tensor(lefts, dtype=torch.long, device=device)
        return cls(left, max_length - 1 - left, torch.ones_like(left))

    def end(self, drafter: DartDrafter) -> torch.Tensor:
        """[rows]: each row's committed cache slots end here (its text but the last token, the root, after its
        padding)."""
        return self.left + drafter.text_len.to(self.left.device) - 1

    def select(self, rows: torch.Tensor) -> None:
        self.left, self.last_pos, self.alive = self.left[rows], self.last_pos[rows], self.alive[rows]


# ---------------------------------------------------------------------------------------------- verify and commit
def verify_mask(spec: StepSpec, tree: DraftTrees, rows: RowSlots, end: torch.Tensor, start, slots: int,
                positions: torch.Tensor, dtype: torch.dtype):
    """The verify forward's `attention_mask` over `slots` key slots (the tree's nodes at [start, start + N)): row r's
    node i sees the row's committed slots [left_r, end_r) and its ancestors' slots; in a sliding-window layer only
    those within the window of its position. One mask in the form the attention backend takes (`backend_mask`), or
    {layer type: mask} when the layers' windows differ."""
    n = tree.width
    slot = torch.arange(slots, device=end.device)
    rel = slot - start
    node_slot = (rel >= 0) & (rel < n)
    at = rel.clamp(0, n - 1)
    visible = (tree.ancestor_mask[:, :, at] & node_slot) | (
        (slot >= rows.left.unsqueeze(1)) & (slot < end.unsqueeze(1))).unsqueeze(1)
    masks = {}
    for w in spec.windows:
        shown = visible
        if w is not None:  # a key's position: a tree slot's node position, a committed slot's s - left
            key_pos = torch.where(node_slot, positions[:, at], slot - rows.left.unsqueeze(1))
            shown = visible & (positions.unsqueeze(2) - key_pos.unsqueeze(1) < w)
        masks[w] = backend_mask(shown, spec.attn, dtype)
    if spec.by_type is None:
        return masks[spec.windows[0]]
    return {kind: masks[w] for kind, w in spec.by_type}


def verify(target, cache, spec: StepSpec, tree: DraftTrees, rows: RowSlots, end: torch.Tensor,
           plain_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward (`target_forward`) over every row's tree, written into the cache slots after the furthest
    row's end. Returns (float logits [rows, N, vocab], node i predicting its next token; the inputs of the layers the
    head reads at every node [rows, N, 3H]). `plain_row`: one unpadded row's plain step (its tree the root alone)
    passes no mask, as plain `generate` does: the target's own causal path, plain decoding's forward. end [rows]:
    each row's committed slots end there (`RowSlots.end`)."""
    positions = torch.minimum((end - rows.left).unsqueeze(1) + tree.depths, rows.last_pos.unsqueeze(1))
    start = cache.get_seq_length()
    slots = cache.layers[0].max_cache_len if isinstance(cache, StaticCache) else start + tree.width
    mask = None if plain_row else verify_mask(spec, tree, rows, end, start, slots, positions, target.dtype)
    return target_forward(target, tree.tokens, mask, positions, cache, list(spec.aux_ids))


def commit(cache, rows: RowSlots, end: torch.Tensor, start, paths: torch.Tensor, lengths: torch.Tensor,
           furthest: int | None = None) -> None:
    """Keep each live row's accepted path: its entries move from the tree's slots (from `start`) to the row's own end
    `end` (those past its length are overwritten next step); the cache's length becomes the furthest live row's new
    end: `furthest` (a `DynamicCache`, cropped there) or computed on the device (a `StaticCache`). paths [rows, M]."""
    src = (start + paths)[:, None, :, None]
    dst = (end.unsqueeze(1) + torch.arange(paths.shape[1], device=paths.device))[:, None, :, None]
    static = isinstance(cache, StaticCache)
    if static:
        furthest_t = torch.where(rows.alive > 0, end + lengths, 0).max()
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        for t in (layer.keys, layer.values):
            idx = lambda i: i.to(t.device).expand(-1, t.shape[1], -1, t.shape[3])
            t.scatter_(2, idx(dst), t.gather(2, idx(src)))
        if static:
            layer.cumulative_length.copy_(furthest_t)
        else:
            layer.keys, layer.values = layer.keys[:, :, :furthest], layer.values[:, :, :furthest]


@torch.no_grad()
def verify_tree(target: PreTrainedModel, tree: DraftTree, cache: DynamicCache, past_len: int) -> torch.Tensor:
    """The float logits [N, vocab] of one row's tree after `past_len` committed tokens in `cache` (a `decode_cache`),
    the verify forward a step runs (what `dart-hf bench --synthetic` times). The tree's entries stay in the cache
    (crop them off, or `commit` a path)."""
    trees = DraftTrees.stack([tree])
    rows = RowSlots.of([0], 1 << 30, trees.tokens.device)
    end = torch.tensor([past_len], device=trees.tokens.device)
    return verify(target, cache, StepSpec.of(target, [0]), trees, rows, end)[0][0]


# ---------------------------------------------------------------------------------------------- the fixed-shape step
def draft_tree(drafter: DartDrafter, depth: int) -> DraftTrees:
    """Head forward + tree search on the drafter's fixed buffers: every row's tree of exactly node budget + 1 nodes
    (`build_trees` with fixed_size)."""
    return drafter.search(drafter.forward(depth), fixed_size=True)


def accept_commit(cache, drafter: DartDrafter, rows: RowSlots, tree: DraftTrees, logits: torch.Tensor,
                  aux: torch.Tensor, accept: StepAcceptance, m: int,
                  seeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call's acceptance on the device in m fixed path slots (`StepAcceptance.on_device`, no host sync), `commit`
    and the paths' states and tokens to the drafter (`append`). Returns (lengths [rows], tokens [rows, m]: the
    accepted draft tokens then the target's own, the first lengths[r] real; the paths' score ranks [rows, m - 1], for
    the size rule)."""
    step = accept.on_device(tree, logits, drafter.text, drafter.text_len, m, seeds)
    append_paths(cache, drafter, rows, step.paths, step.lengths, step.tokens, aux)
    return step.lengths, step.tokens, tree.ranks(step.paths)


def append_paths(cache, drafter: DartDrafter, rows: RowSlots, paths: torch.Tensor, lengths: torch.Tensor,
                 tokens: torch.Tensor, aux: torch.Tensor) -> None:
    """`commit` on the fixed-shape cache, then the paths' target states and tokens to the drafter (`append`)."""
    lengths = lengths * rows.alive
    start = cache.layers[0].cumulative_length - aux.shape[1]  # the verify appended the N tree nodes there
    commit(cache, rows, rows.end(drafter), start, paths, lengths)
    drafter.append(aux.gather(1, paths.unsqueeze(2).expand(-1, -1, aux.shape[2])), tokens, lengths)


def decode_step(target, cache, drafter: DartDrafter, rows: RowSlots, spec: StepSpec, depth: int,
                accept: StepAcceptance, seeds: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """One whole DART step of every row on fixed shapes, captured as one graph: `draft_tree`, `verify`,
    `accept_commit`."""
    tree = draft_tree(drafter, depth)
    logits, aux = verify(target, cache, spec, tree, rows, rows.end(drafter))
    return accept_commit(cache, drafter, rows, tree, logits, aux, accept, depth + 1, seeds)


_COMPILED: dict = {}
_WARMED: set = set()  # the shapes whose compiled step this process has run (`DartStep._compile_first`)
_COMPILE_LOCK = threading.Lock()


def compiled(fn, compile_options: dict | None, shape: tuple = ()):
    """`fn` compiled with fullgraph=True and the call's compile options (transformers' `CompileConfig`), made once
    per process, options and `shape` (the step's rows, cache slots, tree size); None options: `fn` itself. Each
    shape compiles its own copy of `fn` (a code object of its own, on which dynamo keeps its graphs), so the shapes a
    process runs never share dynamo's limit of `recompile_limit` graphs per function (8): a server's batch buckets
    and tree sizes each keep their graph, with no process-wide setting changed."""
    if compile_options is None:
        return fn
    options = {**compile_options, "fullgraph": True, "dynamic": False}
    key = (fn, tuple(sorted((k, repr(v)) for k, v in options.items())), shape)
    with _COMPILE_LOCK:
        if key not in _COMPILED:
            name = f"{fn.__name__}_{len(_COMPILED)}"
            copy = types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, fn.__name__, fn.__defaults__,
                                      fn.__closure__)
            _COMPILED[key] = torch.compile(copy, **options)
        return _COMPILED[key]


def compile_options(options: dict) -> tuple[dict, str | None]:
    """The call's torch.compile options for the DART step, and what was changed in them. CUDA graphs (mode
    "reduce-overhead", transformers' default on CUDA) have not yet run the DART step on a GPU, whose in-place state
    updates they would replay: until a GPU run validates them (`examples/gpu_check.sh` part 5) the step compiles
    without them unless `DART_HF_CUDA_GRAPHS=1` is set; plain `generate` keeps its own."""
    if options.get("mode") != "reduce-overhead" or CUDA_GRAPHS:
        return options, None
    return {**options, "mode": None}, ("CUDA graphs (compile mode 'reduce-overhead') are off for the DART step until a "
                                       "GPU run validates them (DART_HF_CUDA_GRAPHS=1 turns them on)")


# ---------------------------------------------------------------------------------------------- the call's step
def static_requested(generation_config: GenerationConfig, model_kwargs: dict) -> bool:
    """Whether the call asks for a static cache (`cache_implementation="static"`, or a `StaticCache` passed in)."""
    cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    return generation_config.cache_implementation == "static" or isinstance(cache, StaticCache)


def static_refusal(model, input_ids: torch.Tensor, attention_mask, generation_config: GenerationConfig,
                   tensor_parallel: bool, vectorised: bool) -> str | None:
    """Why this call cannot take the fixed-shape step (it then runs over a `DynamicCache`, exactly), or None."""
    text = model.config.get_text_config(decoder=True)
    context = getattr(text, "max_position_embeddings", None)
    batch = input_ids.shape[0] != 1 or (attention_mask is not None and not bool(attention_mask.all()))
    if batch and not vectorised:
        return ("the static step decodes a batch or padded rows with the acceptance on the device (greedy, or "
                "sampling with the generation config's processors) and no returned scores")
    if context and generation_config.max_length > context:
        return f"max_length {generation_config.max_length} is past the target's context ({context})"
    if (model.config._attn_implementation or "eager") not in ("sdpa", "eager"):
        return f"attn_implementation={model.config._attn_implementation!r} (the static step builds sdpa / eager masks)"
    if tensor_parallel:
        return "a tensor-parallel target"
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "a target split over devices (device_map)"
    return None


class DartStep:
    """One call's steps: its cache (a `DynamicCache`, or a `StaticCache` with fixed shapes), its drafter, its rows'
    slots. `step` drafts, verifies, accepts and commits one step of every active row and hands the loop the accepted
    tokens on the host."""

    def __init__(self, target, drafter: DartDrafter, cache, lefts: list[int], max_length: int,
                 aux_layer_ids: list[int], call_rows: int):
        self.target, self.drafter, self.cache, self.max_length = target, drafter, cache, max_length
        self.sizes: tuple[int, ...] = ()  # a fixed step's tree sizes (a graph each), and its current one's depth
        self.depth = 0
        self.spec = StepSpec.of(target, aux_layer_ids)
        self.static = isinstance(cache, StaticCache)
        n = len(lefts) if not self.static else drafter.kv.lengths.shape[0]
        self.rows = RowSlots.of((lefts + [0] * n)[:n], max_length, target.device)
        self.lefts = list(lefts)  # host copy (a `DynamicCache` is cropped to a host length)
        # one unpadded row has no unused slot and never will: plain decoding's cache, and its plain steps pass no mask
        self.solid = not self.static and len(lefts) == 1 and lefts[0] == 0
        self.rows.alive[call_rows:] = 0  # a fixed step's batch-bucket rows (`batch_bucket`) never decode
        self.active = list(range(call_rows))  # the caller's active rows, as indices into this step's rows
        self.seeds: torch.Tensor | None = None  # a fixed step's rows' sampling seeds, the extra rows' the first's
        self.compile_options: dict | None = None  # torch.compile options (None: uncompiled)
        self.twin: Callable[[], "DartStep"] | None = None  # makes a step of the same shapes (`_compile_first`)
        self.reason: str | None = None  # why the call has no fixed-shape step, or what of it runs outside its graph
        if self.static:
            for t in [*drafter.tensors(), *vars(self.rows).values()]:  # updated in place: fixed addresses
                torch._dynamo.mark_static_address(t)

    @property
    def cache_rows(self) -> int:
        """Rows the prefill writes: the call's, then (a fixed step) copies of its first up to the batch bucket."""
        return self.rows.left.shape[0]

    @property
    def compiled(self) -> bool:
        return self.compile_options is not None

    @property
    def nodes(self) -> int:
        return self.drafter.params.node_budget + 1

    @property
    def returned_cache(self):
        """The cache `generate` returns: a `StaticCache`; a `DynamicCache` for one unpadded row (plain decoding's
        entries), else None (rows leave the batch)."""
        return self.cache if self.static or self.solid else None

    def start(self, input_ids: torch.Tensor, lefts: list[int], aux: torch.Tensor, first: torch.Tensor) -> None:
        """After the prefill: the prompts' states and first tokens to the drafter, each row's left padding to its
        slots."""
        self.drafter.start(input_ids, lefts, aux, first)
        left = torch.tensor(lefts, device=self.rows.left.device)
        self.rows.last_pos.add_(self.rows.left - left)
        self.rows.left.copy_(left)

    def step(self, budget: int, max_new: list[int], accept: StepAcceptance, active: list[int],
             timer: PhaseTimer) -> tuple[DraftTrees | None, BatchAccepted]:
        if self.static:
            self.resize(budget)
            return self._fixed_step(accept, active, timer)
        return self._dynamic_step(budget, max_new, accept, active, timer)

    def _dynamic_step(self, budget: int, max_new: list[int], accept: StepAcceptance, active: list[int],
                      timer: PhaseTimer) -> tuple[DraftTrees, BatchAccepted]:
        """Any tree size, the drafter's buffers as far as filled (`propose`, `advance`). The accepted lengths come back
        to the host once (the step's device work is done then), and the paths are cut to the longest."""
        drafter = self.drafter
        trees = drafter.propose(max_new, timer, budget).to(self.target.device)
        end = self.rows.end(drafter)  # (the drafter's text grows only in `advance`, after the commit)
        with timer.phase("verify"):
            logits, aux = verify(self.target, self.cache, self.spec, trees, self.rows, end,
                                 plain_row=self.solid and trees.width == 1)
        with timer.phase("accept"):
            step = accept(trees, logits, active, drafter.text, drafter.text_len, trees.depth + 1)
            lengths = step.lengths.tolist()  # the step's one host read
            step = step.trimmed(max(lengths))  # as wide as the longest path: the cache keeps no slot past it
            furthest = max(left + used - 1 + n for left, used, n in zip(self.lefts, drafter.used, lengths))
            start = self.cache.get_seq_length() - trees.width
            if not (self.solid and trees.width == 1):  # a plain step of one row: its one node is in place already
                commit(self.cache, self.rows, end, start, step.paths.to(end.device), step.lengths.to(end.device),
                       furthest)
            paths = step.paths.to(aux.device)
            drafter.advance(aux.gather(1, paths.unsqueeze(2).expand(-1, -1, aux.shape[2])), step.tokens, lengths)
            step.lengths = torch.tensor(lengths)
        return trees, step

    def _fixed_step(self, accept: StepAcceptance, active: list[int],
                    timer: PhaseTimer) -> tuple[DraftTrees | None, BatchAccepted]:
        """One step at the step's tree size (one of `sizes`, `resize`) on fixed shapes. The acceptance on the device:
        the captured `decode_step` and ONE device-to-host copy (lengths, tokens, ranks); with `dart_timing` its parts
        are captured and timed one by one (phases draft = head + tree search, verify, accept). Processors off the
        device, or returned scores (one row): the captured draft and verify, the call's acceptance walk (eager), the
        captured commit."""
        if self.compiled and self.twin is not None:
            self._compile_first(accept, active, timer)
        run, drafter, spec, rows = self._run, self.drafter, self.spec, self.rows
        depth = self.depth
        if accept.vectorised and not timer.requested:
            with timer.phase("step"):
                return None, self._host_result(*run(decode_step, self.target, self.cache, drafter, rows, spec, depth,
                                                    accept, self._seeds(accept)))
        with timer.phase("draft"):
            tree = run(draft_tree, drafter, depth)
        with timer.phase("verify"):
            logits, aux = run(verify, self.target, self.cache, spec, tree, rows, rows.end(drafter))
        with timer.phase("accept"):
            if accept.vectorised:
                return tree, self._host_result(*run(accept_commit, self.cache, drafter, rows, tree, logits, aux,
                                                    accept, depth + 1, self._seeds(accept)))
            step = accept(tree, logits, active, drafter.text, drafter.text_len, depth + 1)  # one row
            m = depth + 1  # the walk's paths are as long as the row's: pad them to M
            pad = lambda t: torch.cat([t, t[:, -1:].expand(-1, m - t.shape[1], *t.shape[2:])], dim=1)
            run(append_paths, self.cache, drafter, rows, pad(step.paths), step.lengths.to(aux.device),
                pad(step.tokens), aux)
        step.lengths = step.lengths.cpu()
        return tree, step

    def resize(self, budget: int) -> None:
        """A fixed step's tree size for its next steps: one of its `sizes`, its draft depth with it."""
        if budget not in self.sizes:
            raise ValueError(f"tree size {budget} is not one of this fixed step's {self.sizes}")
        self.drafter.params = replace(self.drafter.params, node_budget=int(budget))
        self.depth = draft_depth(budget, self.max_length, self.drafter.head.config.num_predictions)

    def _compile_first(self, accept: StepAcceptance, active: list[int], timer: PhaseTimer) -> None:
        """Before the call's first decode step: where this process has not yet run a compiled step of this shape,
        run one on a twin (the same shapes, its own cache and buffers: the call's state is untouched), so that what
        the call runs is compiled before it decodes, and say how long it took (one log line). Later calls of the
        shape find the graphs made (the twin is not made again)."""
        make, self.twin = self.twin, None
        processors = [(type(p).__name__, sorted(vars(p).items())) for p in accept.device_processors]  # (no address)
        key = repr((id(self.target), sorted(self.compile_options.items()), self.cache_rows,
                    self.cache.layers[0].max_cache_len, self.sizes, accept.mode, accept.keep_scores,
                    accept.seeds is None, processors, timer.requested))
        with _COMPILE_LOCK:
            if key in _WARMED:
                return
            _WARMED.add(key)
        twin, layers = make(), self.cache.layers
        twin.cache.early_initialization(self.cache_rows, [layer.keys.shape[1] for layer in layers],
                                        [layer.keys.shape[3] for layer in layers], layers[0].keys.dtype,
                                        layers[0].keys.device)
        twin.compile_options, twin.seeds, twin.active = self.compile_options, self._seeds(accept), self.active
        graphs, began = counters["stats"]["unique_graphs"], time.perf_counter()
        for size in self.sizes:  # each size's step from a copy of the call's state after its prefill
            for mine, copy in zip(layers, twin.cache.layers):
                for name in ("keys", "values", "cumulative_length"):
                    getattr(copy, name).copy_(getattr(mine, name))
            for mine, copy in zip([*self.drafter.tensors(), *vars(self.rows).values()],
                                  [*twin.drafter.tensors(), *vars(twin.rows).values()]):
                copy.copy_(mine)
            twin.resize(size)
            twin._fixed_step(accept, active, PhaseTimer({}, self.drafter.device, timer.requested))
        if twin.compile_options is None:  # torch.compile refused (its recompile limit): the call runs uncompiled
            self.compile_options, self.reason = None, twin.reason
        made = counters["stats"]["unique_graphs"] - graphs
        if made:
            logger.warning(f"dart_hf: compiled the DART step for {self.cache_rows} row(s), tree sizes "
                           f"{list(self.sizes)} and {layers[0].max_cache_len} cache slots before decoding: {made} "
                           f"graph(s) in {time.perf_counter() - began:.1f} s (once per process and shape)")

    def retire(self, keep: list[int]) -> None:
        """After a step: only the rows `keep` (indices into the active rows) decode on. Over a `DynamicCache` finished
        rows leave the batch (they no longer cost verify work); a fixed step keeps its shapes and masks them."""
        if not keep or len(keep) == len(self.active):
            return
        if self.static:
            self.active = [self.active[i] for i in keep]
            alive = torch.zeros_like(self.rows.alive, device="cpu")
            alive[self.active] = 1
            self.rows.alive.copy_(alive)
            return
        index = torch.tensor(keep, device=self.rows.left.device)
        self.cache.batch_select_indices(index.to(self.cache.layers[0].keys.device))
        self.rows.select(index)
        self.lefts = [self.lefts[i] for i in keep]
        self.active = [self.active[i] for i in keep]
        self.drafter.select(keep)

    def _seeds(self, accept: StepAcceptance) -> torch.Tensor | None:
        """The sampling seeds of a fixed step's rows (the call's, then the first row's for the bucket's extra rows)."""
        if self.seeds is None and accept.seeds is not None:
            extra = self.cache_rows - accept.seeds.shape[0]
            self.seeds = torch.cat([accept.seeds, accept.seeds[:1].expand(extra)])
        return self.seeds

    def _host_result(self, lengths: torch.Tensor, tokens: torch.Tensor, ranks: torch.Tensor) -> BatchAccepted:
        """A fixed step's result for the active rows, on the host, read back in ONE copy: lengths, tokens, ranks."""
        host = torch.tensor(torch.cat([lengths.unsqueeze(1), tokens, ranks], dim=1).tolist())[self.active]
        m = tokens.shape[1]
        return BatchAccepted(paths=torch.zeros(len(self.active), 1, dtype=torch.long), lengths=host[:, 0],
                             tokens=host[:, 1 : m + 1], ranks=host[:, m + 1 :])

    def _run(self, fn, *args):
        """`fn` compiled (the call's options, this target and shape's own copy: `compiled`), or uncompiled once
        torch.compile refused to capture it again (dynamo keeps at most `recompile_limit` graphs per copy: calls whose
        guards differ, e.g. other sampling settings, each add one); the refusal comes before the graph runs, so the
        state is untouched and the step runs uncompiled for the rest of the call (`reason` says so in the stats)."""
        if self.compile_options is not None:
            try:
                shape = (id(self.target), self.cache_rows, self.cache.layers[0].max_cache_len, self.nodes, self.depth)
                return compiled(fn, self.compile_options, shape)(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                self.compile_options = None
                self.reason = (f"torch.compile refused another graph of {fn.__name__} in this process ({err}); "
                               "the static step ran uncompiled from there")
        return fn(*args)


def dynamic_step(target, drafter: DartDrafter, cache: DynamicCache, lefts: list[int], max_length: int,
                 aux_layer_ids: list[int]) -> DartStep:
    """The call's step over its `DynamicCache` (a `decode_cache`)."""
    return DartStep(target, drafter, cache, lefts, max_length, aux_layer_ids, len(lefts))


def fixed_step(model, head: DartHead, input_ids: torch.Tensor, attention_mask, generation_config: GenerationConfig,
               sizes: tuple[int, ...], prompt_lookup: bool, aux_layer_ids: list[int],
               vectorised: bool) -> tuple[DartStep | None, str | None]:
    """(the call's fixed-shape `DartStep`, None), or (None, why the fixed-shape step was refused: the call runs over a
    `DynamicCache`). Each step takes one of the tree `sizes` (a graph each: the buffers fit the largest); the step
    is compiled under transformers' own decision (`_valid_auto_compile_criteria`) with the call's
    `compile_config`."""
    tensor_parallel = tensor_parallel_group(model) is not None
    reason = static_refusal(model, input_ids, attention_mask, generation_config, tensor_parallel, vectorised)
    if reason is not None:
        return None, reason
    max_length = generation_config.max_length
    depth = draft_depth(max(sizes), max_length, head.config.num_predictions)
    call_rows = input_ids.shape[0]

    def make() -> DartStep:
        drafter = DartDrafter(head, model, max_length=max_length, node_budget=sizes[0], prompt_lookup=prompt_lookup,
                              eos_token_ids=generation_config._eos_token_tensor, rows=batch_bucket(call_rows),
                              pending=depth + 1, full=True)
        # every committed token plus one tree past the furthest row and a path of slack for a row that finishes past
        # max_length, sized by the one rounding rule (`drafter.bucket`), so that calls of nearby lengths share one
        # graph (generate's own cache of max_length slots would recompile for every prompt length)
        cache = static_cache(model.config, bucket(max_length) + max(sizes) + 1 + 2 * (depth + 1))
        step = DartStep(model, drafter, cache, [0] * call_rows, max_length, aux_layer_ids, call_rows)
        step.sizes = tuple(sizes)
        step.resize(sizes[0])
        return step

    step = make()
    if model._valid_auto_compile_criteria({"cache": step.cache}, generation_config):
        config = generation_config.compile_config or model._default_compile_config()
        step.compile_options, step.reason = compile_options(config.to_dict())
        step.twin = make
    return step, None
