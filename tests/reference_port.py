"""A plain, literal Python port of the DART release's tree search, n-gram trie and rotary embeddings.

Written from the authors' sources (github.com/fvliang/DART: `dart/tree_search/cpplib/cpp_search/searcher.cpp`,
`cpp_ngram/trie_ngram.cpp`, `dart/tree_search/tree_search.py`, `tree_search_config.py`, `dart/model/llama3_dart.py`)
one step at a time, loops and all, so the tests can hold dart_hf's vectorised code against it. Arithmetic that the
C++ does in `float` is done in numpy float32 here. Where the C++ uses `std::sort` (unstable) the port uses Python's
stable sort: the reference leaves the order of equal scores unspecified, and the stable order is the one in which a
parent (equal score, earlier in the pool) precedes its children.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np
import torch

F32 = np.float32

# tree_search_config.py
TOPK = 25
BEAM_WIDTH = 20
NGRAM_WEIGHT = 0.5


def level_weight(level: int) -> float:
    return (level + 1) ** -0.7


def logit_weight(level: int) -> float:
    return 0.9**level


# ------------------------------------------------------------------------------------------------ TrieNgram
@dataclass
class TrieNode:
    token: int = 0
    parent: int = 0
    freq: int = 0
    children: dict[int, int] = field(default_factory=dict)


class TrieNgram:
    """`ngram::TrieNgram`: a trie of every window of up to `order` tokens; node freq = occurrences of its n-gram."""

    def __init__(self, order: int):
        self.order = order
        self.nodes = [TrieNode()]

    def add_sequence(self, tokens: list[int]) -> None:
        cursor = 0
        for token in tokens:
            self.nodes[cursor].freq += 1
            child = self.nodes[cursor].children.get(token)
            if child is None:
                child = len(self.nodes)
                self.nodes.append(TrieNode(token=token, parent=cursor))
                self.nodes[cursor].children[token] = child
            cursor = child
        self.nodes[cursor].freq += 1

    def add_conversation(self, conversation: list[int]) -> None:
        for start in range(len(conversation)):
            self.add_sequence(conversation[start : start + self.order])

    def get_probability(self, context: list[int], tokens: list[int]) -> tuple[list, list[int]]:
        """(probabilities, matched context lengths) per candidate: per-candidate back-off, no unigram level."""
        probabilities = [F32(0.0)] * len(tokens)
        matched = [0] * len(tokens)
        if not context or not tokens:
            return probabilities, matched
        for length in range(min(self.order - 1, len(context)), 0, -1):
            cursor, found = 0, True
            for token in context[len(context) - length :]:
                child = self.nodes[cursor].children.get(token)
                if child is None:
                    found = False
                    break
                cursor = child
            if not found:
                continue
            with np.errstate(divide="ignore"):
                inv_freq = F32(1.0) / F32(self.nodes[cursor].freq)
            for i, token in enumerate(tokens):
                if matched[i] > 0:
                    continue
                child = self.nodes[cursor].children.get(token)
                if child is not None:
                    probabilities[i] = F32(self.nodes[child].freq) * inv_freq
                    matched[i] = length
        return probabilities, matched

    def save(self, path) -> None:
        """The `.trie` binary layout (docs/DART_SPEC.md §5): u64 order, u64 node_count, then per node
        i32 token, u64 parent, i32 freq, u64 n_children, n_children x (i32 child_token, u64 child_id)."""
        with open(path, "wb") as f:
            f.write(struct.pack("<QQ", self.order, len(self.nodes)))
            for node in self.nodes:
                f.write(struct.pack("<iQiQ", node.token, node.parent, node.freq, len(node.children)))
                for token, child in node.children.items():
                    f.write(struct.pack("<iQ", token, child))


# ------------------------------------------------------------------------------------------------ Searcher
def search(
    draft_length: int,
    topk_tokens: list[list[int]],
    topk_probs: list[list[float]],
    ngram: TrieNgram,
    prompt_tokens: list[int],
    eos_token: int,
    remain_total: int,
    beam_width: int = BEAM_WIDTH,
    ngram_weight: float = NGRAM_WEIGHT,
) -> list[tuple[tuple[int, ...], np.float32]]:
    """`Searcher::search` (TrieNgram overload, built with NO_NGRAM_ON_FIRST_TOKEN): the kept (draft, score) pairs."""
    every: list[tuple[tuple[int, ...], np.float32]] = []
    candidates: list[tuple[tuple[int, ...], np.float32]] = [((), F32(0.0))]
    order = ngram.order
    w_ngram = F32(ngram_weight)
    for level in range(draft_length):
        tokens, scores = topk_tokens[level], topk_probs[level]
        w_level, w_logit = F32(level_weight(level)), F32(logit_weight(level))
        next_candidates = []
        for cand_seq, cand_score in candidates:
            if len(cand_seq) >= order - 1:
                context = list(cand_seq[len(cand_seq) - (order - 1) :])
            else:
                keep = min(order - 1 - len(cand_seq), len(prompt_tokens))
                context = list(prompt_tokens[len(prompt_tokens) - keep :]) + list(cand_seq)
            if level == 0:
                for token, p in zip(tokens, scores):
                    combined_logit = np.log(F32(p) + F32(1e-10)) * w_logit
                    next_candidates.append((cand_seq + (token,), F32(cand_score + w_level * combined_logit)))
                continue
            if ngram_weight > 0:
                ngram_scores, _ = ngram.get_probability(context, list(tokens))
            else:
                ngram_scores = [F32(0.0)] * len(tokens)
            for token, p, q in zip(tokens, scores, ngram_scores):
                combined_logit = np.log(F32(p) + F32(1e-10)) * w_logit
                combined_ngram = np.log(F32(q) + F32(1e-10)) * w_ngram
                total = F32(cand_score + w_level * F32(combined_logit + combined_ngram))
                next_candidates.append((cand_seq + (token,), total))
        every += next_candidates
        next_candidates.sort(key=lambda c: (c[0][-1] == eos_token, -c[1]))  # non-EOS first, then best score
        candidates = next_candidates[:beam_width]
    every.sort(key=lambda c: -c[1])
    return every[:remain_total]


def tree_search(
    logits: torch.Tensor, preceding_ids: list[int], d2t: torch.Tensor, ngram: TrieNgram, eos_token: int,
    remain_total: int,
) -> list[tuple[tuple[int, ...], np.float32]]:
    """`tree_search.py`: top-25 of each row, softmax over those 25, draft ids mapped by the d2t offsets."""
    values, indices = torch.topk(logits, TOPK, dim=1)
    indices = indices + d2t[indices]
    probs = torch.softmax(values, dim=1)
    return search(
        logits.shape[0], indices.tolist(), probs.tolist(), ngram, list(preceding_ids), eos_token, remain_total
    )


# ------------------------------------------------------------------------------------------------ rotary
def _default_inv_freq(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))


def _cos_sin(inv_freq: torch.Tensor, seq_len: int, positions: torch.Tensor, t_scale: float = 1.0, mscale=1.0):
    t = torch.arange(seq_len, dtype=inv_freq.dtype)
    if t_scale != 1.0:
        t = t / t_scale
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * mscale)[positions], (emb.sin() * mscale)[positions]


def reference_rotary(config: dict, head_dim: int, positions: torch.Tensor, seq_len: int | None = None):
    """cos, sin [len(positions), head_dim] of `DartLlamaAttention._init_rope` for a reference `config.json` dict.

    The reference caches max_position_embeddings + 20 positions at init and rebuilds the cache for a longer
    `seq_len` (q_len + past); only the dynamic type's values depend on that length. Note that the linear, dynamic
    and yarn branches do not pass `rope_theta`: their base is 10000.
    """
    mp = config.get("max_position_embeddings", 2048)
    cached = max(mp + 20, seq_len or 0)
    rope = config.get("rope_scaling")
    if rope is None:
        return _cos_sin(_default_inv_freq(head_dim, config.get("rope_theta", 10000)), cached, positions)
    kind = rope.get("rope_type", rope.get("type"))
    factor = rope.get("factor")
    if kind == "linear":
        return _cos_sin(_default_inv_freq(head_dim, 10000), cached, positions, t_scale=factor)
    if kind == "dynamic":
        base = 10000 * ((factor * cached / mp) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return _cos_sin(_default_inv_freq(head_dim, base), cached, positions)
    if kind == "llama3":
        inv_freq = _default_inv_freq(head_dim, config.get("rope_theta", 10000))
        low, high, orig = rope.get("low_freq_factor"), rope.get("high_freq_factor"), rope.get(
            "original_max_position_embeddings"
        )
        factor = factor if factor is not None else 1.0
        if None not in (low, high, orig):
            low_wavelen, high_wavelen = orig / low, orig / high
            wave_len = 2 * math.pi / inv_freq
            smooth = (orig / wave_len - low) / (high - low) if low != high else 0
            inv_freq = torch.where(
                wave_len < high_wavelen,
                inv_freq,
                torch.where(wave_len > low_wavelen, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq),
            )
        return _cos_sin(inv_freq, cached, positions)
    if kind == "yarn":
        base, dim = 10000, head_dim
        orig = rope.get("original_max_position_embeddings")
        freq_extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        freq_inter = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        corr = lambda rot: (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))
        low = max(math.floor(corr(rope.get("beta_fast"))), 0)
        high = min(math.ceil(corr(rope.get("beta_slow"))), dim - 1)
        hi = high + 0.001 if low == high else high
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (hi - low), 0, 1)
        mask = 1.0 - ramp
        inv_freq = freq_inter * (1 - mask) + freq_extra * mask
        get_mscale = lambda scale, m: 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        mscale = float(get_mscale(factor, rope.get("mscale")) / get_mscale(factor, rope.get("mscale_all_dim")))
        t = torch.arange(cached, dtype=torch.float32)
        emb = torch.cat((torch.outer(t, inv_freq),) * 2, dim=-1)
        return (emb.cos() * mscale)[positions], (emb.sin() * mscale)[positions]
    raise ValueError(f"Unknown RoPE scaling type {kind}")
