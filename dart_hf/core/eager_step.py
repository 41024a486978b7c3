"""The eager step backend: transformers' `DynamicCache` with ragged rows (`RaggedCache`), any node budget per step,
any batch of left-padded rows. One step: the drafter's trees (`DartDrafter.propose`: one head forward and one tree
search for all rows) -> one target forward over every tree (`verify_batch`) -> the call's acceptance -> each row's
path into the cache (`RaggedCache.commit`) and its target states to the drafter (`DartDrafter.advance`). The static
backend (`static_step.StaticStep`) has the same three methods; the loop (`loop.dart_decode`) cannot tell them apart.

Rows accept different numbers of tokens per step, but a `DynamicCache` keeps one length for the whole batch. The
scheme (no model code copied, the cache stays transformers' own):

- Every step appends the same number of slots to every row: the LONGEST accepted path of the step. Row r's path
  goes into the first len_r of those slots; the slots behind it are HOLES. Left padding of the prompt is holes too.
  One unpadded row never has a hole: its cache is exactly plain decoding's.
- `valid` [rows, T] says which slots hold a committed token; the verify mask of a row (`verify_mask`) is its `valid`
  row (every committed token, never a hole) followed by its own tree mask. A hole is never attended to, so its
  content does not matter.
- Positions are per row: row r's next token sits at position `next_pos[r]` = its committed tokens so far, as plain
  `generate` counts positions of a left-padded row (cumsum of the attention mask - 1). Keys are stored already
  rotated, so moving an entry to another slot does not change what it means.
- Sliding-window layers keep every slot too (`decode_cache` makes every layer a full `DynamicLayer`): the window is
  applied by the mask, from the slots' positions (a token sees itself and the w - 1 positions before it), so holes and
  tree entries never shift it. A target whose layers differ (full and sliding: Gemma 2/3, gpt-oss, ...) gets one mask
  per layer type, keyed by its config's `layer_types`, which is how those models take prepared masks.
- When every row has at least `max(min_holes, T / 4)` holes, `compact` moves each row's committed entries to the
  right end of the row (one gather per layer) and cuts the shared holes off the front.
- A finished row leaves the batch (`select`): it no longer costs verify work.

The verify forward: node i of row r sits at position next_pos[r] + depth[i] and attends to the row's committed tokens
plus its own ancestors (within the window, in a sliding-window layer). The mask (`RaggedCache.verify_mask`) goes in as
the forward's own `attention_mask` (a 4D mask, a BlockMask for FlexAttention, or one per layer type), which
transformers passes to the attention layers unchanged; the forward itself is `target.target_forward`, the static
step's too. Nothing in transformers or in the target is changed.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from .acceptance import BatchAccepted, StepAcceptance
from .drafter import DartDrafter
from .rows import Rows
from .stats import PhaseTimer
from .target import backend_mask, layer_windows, target_forward
from .tree import DraftTree, DraftTrees


def decode_cache(config, cache: DynamicCache | None = None) -> DynamicCache:
    """The (empty) cache a DART call decodes into: `cache` (the caller's) or a new one, with every sliding-window layer
    replaced by a full `DynamicLayer` (in place: the caller's object is the one that gets filled, as in `generate`)."""
    if cache is None:
        cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
    return cache


class RaggedCache:
    """A `DynamicCache` over the call's active rows, with per-row slot validity and next positions."""

    def __init__(self, cache: DynamicCache, valid: torch.Tensor, config, min_holes: int = 16):
        self.cache = cache
        self.valid = valid.bool()  # [rows, T]
        # one row without padding has no hole and never will (each step keeps its whole path): plain decoding's cache
        self.solid = self.valid.shape[0] == 1 and bool(self.valid.all())
        self.next_pos = self.valid.sum(dim=1)  # [rows]
        self.min_holes = min_holes
        self.windows = layer_windows(config)
        text = config.get_text_config(decoder=True)
        self.layer_types = getattr(text, "layer_types", None)
        self.model_type = text.model_type

    @property
    def length(self) -> int:
        """T: slots per row."""
        return self.valid.shape[1]

    # ------------------------------------------------------------------------------------------ the verify forward
    def positions(self, trees: DraftTrees) -> torch.Tensor:
        """[rows, N]: node i of row r sits at next_pos[r] + depth (padding nodes: at next_pos[r])."""
        return self.next_pos.unsqueeze(1) + trees.depths

    def verify_mask(self, trees: DraftTrees, attn_implementation: str, dtype: torch.dtype):
        """The `attention_mask` of the verify forward: one 4D mask [rows, 1, N, T + N] (row r's committed slots, then
        its tree's ancestor mask; in a sliding-window layer only those within the window of the node's position), or
        {layer type: mask} when the layers' windows differ; in the form the attention backend takes (bool for SDPA,
        0 / -inf for eager, a BlockMask for FlexAttention). A plain step (each tree its root alone) of a solid cache
        passes None, as plain `generate` does for an unpadded row: the same attention through the target's own causal
        path, plain decoding's forward (a 4D mask made that step ~3% slower on a 2-core CPU)."""
        if self.solid and trees.width == 1:
            return None
        masks = {w: self._mask(trees, w, attn_implementation, dtype) for w in dict.fromkeys(self.windows)}
        if len(masks) == 1:
            return next(iter(masks.values()))
        if self.layer_types is None or len(self.layer_types) != len(self.windows):
            raise NotImplementedError(
                f"{self.model_type} mixes layers of windows {sorted(set(self.windows), key=str)} without "
                '`layer_types` in its config; DART tree verification cannot tell which mask each layer takes; use '
                'dart_mode="chain"')
        by_type: dict[str, int | None] = {}
        for kind, w in zip(self.layer_types, self.windows):
            if by_type.setdefault(kind, w) != w:
                raise NotImplementedError(f"{self.model_type} has {kind!r} layers of different windows; DART tree "
                                          'verification passes one mask per layer type; use dart_mode="chain"')
        return {kind: masks[w] for kind, w in by_type.items()}

    def _mask(self, trees: DraftTrees, window: int | None, attn_implementation: str, dtype: torch.dtype):
        rows, n = trees.tokens.shape
        committed = self.valid.unsqueeze(1).expand(rows, n, self.length)
        in_tree = trees.ancestor_mask
        if window is not None:  # positions: a committed slot's is its rank among the row's committed slots
            slot_pos = self.valid.cumsum(dim=1) - 1  # [rows, T]
            node_pos = self.positions(trees)  # [rows, N]
            committed = committed & (node_pos.unsqueeze(2) - slot_pos.unsqueeze(1) < window)
            in_tree = in_tree & (trees.depths.unsqueeze(2) - trees.depths.unsqueeze(1) < window)
        return backend_mask(torch.cat([committed, in_tree], dim=2), attn_implementation, dtype)

    # ------------------------------------------------------------------------------------------ after acceptance
    def commit(self, paths: torch.Tensor, lengths: torch.Tensor) -> None:
        """Keep each row's accepted path and drop every other tree entry.

        paths [rows, M]: tree node indices, root first, the first lengths[r] of row r real (the rest: any index);
        M = the longest path. The tree's entries are the last N slots of every layer; the paths are gathered into the
        first M of them and the rest is cut. Slots past a row's own path become holes."""
        t, m = self.length, paths.shape[1]
        move = m > 1  # when every path is the root alone, node 0 is already in place
        index = (t + paths)[:, None, :, None]
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                if move:
                    idx = index.to(tensor.device).expand(-1, tensor.shape[1], -1, tensor.shape[3])
                    gathered = tensor.gather(2, idx)
                    tensor[:, :, t : t + m] = gathered
                if tensor.shape[2] > t + m:  # (a plain step's one node is its path: nothing to cut)
                    setattr(layer, name, tensor[:, :, : t + m])
        new = torch.arange(m, device=self.valid.device).unsqueeze(0) < lengths.to(self.valid.device).unsqueeze(1)
        self.valid = torch.cat([self.valid, new], dim=1)
        self.next_pos = self.next_pos + lengths.to(self.next_pos.device)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (indices into the current rows, in order): finished rows leave the batch."""
        self.cache.batch_select_indices(rows.to(self.cache.layers[0].keys.device))
        self.valid, self.next_pos = self.valid[rows], self.next_pos[rows]

    def compact(self) -> bool:
        """Drop the holes every row has, when they are at least max(min_holes, T / 4) slots: each row's committed
        entries move, in order, to the right end of its row. Returns whether it compacted."""
        shared = int((~self.valid).sum(dim=1).min())
        if shared < max(self.min_holes, self.length // 4):
            return False
        # per row: holes first, then the committed slots in their order (a stable sort of the validity)
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, shared:]
        index = order[:, None, :, None]
        for layer in self.cache.layers:
            if not layer.is_initialized:
                continue
            for name in ("keys", "values"):
                tensor = getattr(layer, name)
                idx = index.to(tensor.device).expand(-1, tensor.shape[1], -1, tensor.shape[3])
                setattr(layer, name, tensor.gather(2, idx))
        self.valid = self.valid.gather(1, order)
        return True


# ---------------------------------------------------------------------------------------------- the verify forward
@torch.no_grad()
def verify_batch(target: PreTrainedModel, trees: DraftTrees, ragged: RaggedCache,
                 aux_layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target once over every row's tree; returns (float logits [rows, N, vocab], node i predicting its next
    token; the inputs of the layers `aux_layer_ids` at every node [rows, N, 3 * hidden]). The tree entries stay in
    the cache until `RaggedCache.commit`."""
    mask = ragged.verify_mask(trees, target.config._attn_implementation or "eager", target.dtype)
    return target_forward(target, trees.tokens, mask, ragged.positions(trees), ragged.cache, aux_layer_ids)


def verify_tree(target: PreTrainedModel, tree: DraftTree, cache: DynamicCache, past_len: int) -> torch.Tensor:
    """The float logits [N, vocab] of one row's tree after `past_len` committed tokens in `cache` (a
    `decode_cache`); what `dart-hf calibrate` times (with the embeddings as the layer states asked for: the verify
    forward of a step asks for some). The tree's entries stay in the cache (crop them off)."""
    valid = torch.ones(1, past_len, dtype=torch.bool, device=tree.tokens.device)
    return verify_batch(target, DraftTrees.stack([tree]), RaggedCache(cache, valid, target.config), [0])[0][0]


# ---------------------------------------------------------------------------------------------- the backend
class EagerStep:
    """One call's eager steps: its cache, its drafter."""

    static = compiled = False
    reason: str | None = None

    def __init__(self, target, drafter: DartDrafter, cache, rows: Rows, aux_layer_ids: list[int]):
        self.target, self.drafter, self.cache, self.aux_ids = target, drafter, cache, aux_layer_ids
        self.ragged = RaggedCache(cache, rows.mask.bool(), target.config)

    @property
    def cache_rows(self) -> int:
        """Rows the prefill writes: the call's."""
        return self.ragged.valid.shape[0]

    @property
    def returned_cache(self):
        """The cache `generate` returns: the call's for one unpadded row (plain decoding's entries), else None
        (ragged, and it has lost its finished rows)."""
        return self.cache if self.ragged.solid else None

    def start(self, input_ids: torch.Tensor, lefts: list[int], aux: torch.Tensor, first: torch.Tensor) -> None:
        """After the prefill: the prompts' states and first tokens to the drafter."""
        self.drafter.start(input_ids, lefts, aux, first)

    def step(self, budget: int, max_new: list[int], accept: StepAcceptance, active: list[int],
             timer: PhaseTimer) -> tuple[DraftTrees, BatchAccepted]:
        """Draft, verify, accept and commit one step of every active row. The accepted lengths come back to the host
        here, once (the step's device work is done then), and the paths are cut to the longest; the result holds the
        lengths on the host."""
        trees = self.drafter.propose(max_new, timer, budget).to(self.target.device)
        with timer.phase("verify"):
            logits, aux = verify_batch(self.target, trees, self.ragged, self.aux_ids)
        with timer.phase("accept"):
            drafter = self.drafter
            step = accept(trees, logits, active, drafter.text, drafter.text_len, trees.depth + 1)
            lengths = step.lengths.tolist()  # the step's one host read
            step = step.trimmed(max(lengths))  # as wide as the longest path: the cache keeps no slot past it
            self.ragged.commit(step.paths, step.lengths)
            paths = step.paths.to(aux.device)
            drafter.advance(aux.gather(1, paths.unsqueeze(2).expand(-1, -1, aux.shape[2])), step.tokens, lengths)
            step.lengths = torch.tensor(lengths)
        return trees, step

    def retire(self, keep: list[int]) -> None:
        """After a step: only the rows `keep` (indices into the active rows) decode on; holes every row has go."""
        if not keep:
            return
        if len(keep) < self.drafter.kv.lengths.shape[0]:
            self.ragged.select(torch.tensor(keep, device=self.ragged.valid.device))
            self.drafter.select(keep)
        if not self.ragged.solid:
            self.ragged.compact()
