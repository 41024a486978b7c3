"""`NGramModel`: back-off n-gram probabilities, stored as sorted key arrays and looked up in batches.

An n-gram (t_1..t_m) is packed into one int64 key `sum(t_i * V ** (m - i))` (V = vocab size), so a table is
a sorted key array plus a count array and a lookup is one `torch.searchsorted` over a whole batch of
(context, candidate) pairs, on whatever device the draft logits live. No Python loop over candidates.

P(x | context) follows the reference `TrieNgram::get_probability` (docs/DART_SPEC.md §3, §5) candidate by
candidate: the longest suffix s of the last `order - 1` context tokens (1 token at least) such that s was seen
AND s + x was seen gives count(s + x) / count(s), where count(s) is the n-gram's own occurrence count (the trie
node's freq, which also counts occurrences at the very end of a document). A candidate never seen after any
suffix gets 0: there is no unigram level. Two candidates of the same context may therefore back off to
different suffix lengths.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

FORMAT = "dart_hf.ngram"  # a file-format id written into every ngram.safetensors: never follows module renames
FILE_NAME = "ngram.safetensors"
_COMPACT_EVERY = 20_000_000  # pending keys before an intermediate np.unique (bounds memory on big corpora)


def _max_order(vocab_size: int) -> int:
    order = 1
    while vocab_size ** (order + 1) < 2**63:
        order += 1
    return order


class _CountTable:
    """Accumulates int64 keys and reduces them to (sorted unique keys, counts)."""

    def __init__(self) -> None:
        self.keys = np.zeros(0, np.int64)
        self.counts = np.zeros(0, np.int64)
        self.pending: list[np.ndarray] = []
        self.pending_size = 0

    def add(self, keys: np.ndarray) -> None:
        self.pending.append(keys)
        self.pending_size += keys.size
        if self.pending_size > _COMPACT_EVERY:
            self.compact()

    def compact(self) -> None:
        if not self.pending:
            return
        new_keys, new_counts = np.unique(np.concatenate(self.pending), return_counts=True)
        merged = np.concatenate([self.keys, new_keys])
        weights = np.concatenate([self.counts, new_counts])
        self.keys, inverse = np.unique(merged, return_inverse=True)
        self.counts = np.bincount(inverse, weights=weights, minlength=self.keys.size).astype(np.int64)
        self.pending, self.pending_size = [], 0


def _lookup(sorted_keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(found, values[key]) for each query key; value 0 where absent."""
    if sorted_keys.numel() == 0:
        return torch.zeros_like(query, dtype=torch.bool), torch.zeros_like(query)
    idx = torch.searchsorted(sorted_keys, query).clamp_(max=sorted_keys.numel() - 1)
    found = sorted_keys[idx] == query
    return found, torch.where(found, values[idx], torch.zeros_like(query))


class NGramModel:
    """Counts of every 1..order-gram of a corpus, with batched back-off lookup."""

    def __init__(self, order: int, vocab_size: int, tables: dict[str, torch.Tensor]):
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        if order > _max_order(vocab_size):
            raise ValueError(f"order {order} does not fit int64 keys for vocab {vocab_size}")
        self.order, self.vocab_size = order, vocab_size
        self.tables = tables
        self.total = int(tables["counts_1"].sum()) if tables["counts_1"].numel() else 0

    # ------------------------------------------------------------------ building
    @classmethod
    def build(
        cls,
        sequences: Iterable[list[int]],
        order: int = 3,
        vocab_size: int | None = None,
        eos_token_id: int | None = None,
        progress: bool = True,
        min_count: int = 1,
    ) -> "NGramModel":
        """Count every window of 1..order tokens of each sequence (EOS appended when given).

        `vocab_size` defaults to max id + 1; pass the target's vocab size so keys match the head's tokens.
        `min_count` drops 2..order-grams seen fewer times (most of a big table, little of its signal), which
        keeps the file small enough to ship next to a head; contexts then back off to shorter n-grams. The kept
        counts are unchanged (a reference trie built from the same sequences has the same node freqs), and every
        prefix of a kept n-gram is kept, since it is at least as frequent: a context's own count is always there.
        """
        seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
        if eos_token_id is not None:
            seqs = [np.append(s, eos_token_id) for s in seqs]
        if vocab_size is None:
            vocab_size = int(max((int(s.max()) for s in seqs if s.size), default=0)) + 1
        if any(s.size and (s.min() < 0 or s.max() >= vocab_size) for s in seqs):
            raise ValueError(f"token ids must lie in [0, {vocab_size})")
        counters = {m: _CountTable() for m in range(1, order + 1)}
        for s in tqdm(seqs, desc="n-gram counts", unit="seq", disable=not progress):
            key = np.zeros(s.size, np.int64)
            for m in range(1, min(order, s.size) + 1):
                key = key[: s.size - m + 1] * vocab_size + s[m - 1 :]
                counters[m].add(key)
        tables = {}
        for m, counter in counters.items():
            counter.compact()
            keep = counter.counts >= (min_count if m > 1 else 1)
            tables[f"keys_{m}"] = torch.from_numpy(counter.keys[keep])
            tables[f"counts_{m}"] = torch.from_numpy(counter.counts[keep])
        return cls.from_counts(order, vocab_size, tables)

    @classmethod
    def from_counts(cls, order: int, vocab_size: int, grams: dict[str, torch.Tensor]) -> "NGramModel":
        """From `keys_m` / `counts_m` tables (m = 1..order): each m-gram's own occurrence count.

        The context count of an m-gram is the (m-1)-gram's own entry, so every prefix of a listed n-gram must be
        listed too (true of a trie and of `build`, whose pruning keeps prefixes: a prefix is at least as frequent).
        """
        tables = {}
        for m in range(1, order + 1):
            keys, counts = grams[f"keys_{m}"].long(), grams[f"counts_{m}"].long()
            if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
                order_idx = torch.argsort(keys)
                keys, counts = keys[order_idx], counts[order_idx]
            tables[f"keys_{m}"], tables[f"counts_{m}"] = keys, counts
        return cls(order, vocab_size, tables)

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        save_file(
            {k: v.contiguous().cpu() for k, v in self.tables.items()},
            str(path),
            metadata={"format": FORMAT, "order": str(self.order), "vocab_size": str(self.vocab_size)},
        )

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu") -> "NGramModel":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, FILE_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"n-gram file not found: {path}")
        try:
            with safe_open(path, framework="pt", device=str(device)) as f:
                meta = f.metadata() or {}
                tables = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as err:  # safetensors raises several types for a damaged header
            raise ValueError(f"{path} is not a readable safetensors n-gram file: {err}") from err
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path} is not a dart_hf n-gram file (metadata format={meta.get('format')!r})")
        order, vocab = int(meta["order"]), int(meta["vocab_size"])
        needed = [f"{p}_{m}" for m in range(1, order + 1) for p in ("keys", "counts")]
        missing = [k for k in needed if k not in tables]
        if missing:
            raise ValueError(f"{path} is missing n-gram tables {missing}")
        # files written before the reference back-off also hold ctx_keys_m / ctx_totals_m (sums of continuations):
        # the counts are the same, the context count is now the (m-1)-gram's own entry, so those are dropped
        return cls(order, vocab, {k: tables[k] for k in needed})

    def to(self, device: str | torch.device) -> "NGramModel":
        if all(t.device == torch.device(device) for t in self.tables.values()):
            return self
        return NGramModel(self.order, self.vocab_size, {k: v.to(device) for k, v in self.tables.items()})

    @property
    def device(self) -> torch.device:
        return self.tables["keys_1"].device

    # ------------------------------------------------------------------ lookup
    @property
    def context_size(self) -> int:
        """How many trailing tokens a lookup reads (order - 1): pass at least that many as `context`."""
        return self.order - 1

    def prob(self, context: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """P(candidate | context), batched, backed off per (row, candidate) as the reference does.

        `context` [N, c] holds the last c tokens before the candidates (-1 marks "no token", e.g. before the
        start of the text); only the last `context_size` are used. `candidates` [N, C]. Returns float32 [N, C],
        computed as the reference does in float32: count(s + x) * (1 / count(s)).
        """
        n, c = context.shape
        need = self.context_size
        probs = torch.zeros(candidates.shape, dtype=torch.float32, device=candidates.device)
        if need == 0:
            return probs  # a unigram table has no context to condition on; the reference gives 0
        if c < need:
            context = torch.cat([context.new_full((n, need - c), -1), context], dim=1)
        context = context[:, context.shape[1] - need :].long()
        v = self.vocab_size
        matched = torch.zeros(candidates.shape, dtype=torch.bool, device=candidates.device)
        for m in range(need, 0, -1):  # suffix length, longest first: `order - 1` iterations, not per token
            ctx = context[:, need - m :]
            ctx_key = torch.zeros(n, dtype=torch.long, device=ctx.device)
            for i in range(m):
                ctx_key = ctx_key * v + ctx[:, i].clamp(min=0)
            ctx_found, ctx_count = _lookup(self.tables[f"keys_{m}"], self.tables[f"counts_{m}"], ctx_key)
            ctx_found &= (ctx >= 0).all(dim=1)
            found, counts = _lookup(self.tables[f"keys_{m + 1}"], self.tables[f"counts_{m + 1}"],
                                    ctx_key.unsqueeze(1) * v + candidates)
            use = found & ctx_found.unsqueeze(1) & ~matched
            inv = torch.where(ctx_count > 0, 1.0 / ctx_count.clamp(min=1).float(), 0.0)  # a 0-count context: 0
            probs = torch.where(use, counts.float() * inv.unsqueeze(1), probs)
            matched |= use
        return probs

    def __repr__(self) -> str:
        sizes = ", ".join(f"{m}-grams={self.tables[f'keys_{m}'].numel()}" for m in range(1, self.order + 1))
        return f"NGramModel(order={self.order}, vocab_size={self.vocab_size}, {sizes})"
