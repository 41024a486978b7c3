"""dart_hf against a literal port of the DART release (tests/reference_port.py): n-gram lookup, tree search,
converted config and rotary embeddings must be the reference's, not an approximation of it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import check_closed
from reference_port import TrieNgram, reference_rotary, tree_search
from dart_hf.core.configuration import DartConfig
from dart_hf.core.modeling import DartRotaryEmbedding
from dart_hf.core.tree import TreeSearchParams, build_tree
from dart_hf.tools.convert import dart_config_from_reference, read_trie, reference_rope_parameters

VOCAB, DRAFT_VOCAB, EOS = 60, 48, 7


def corpus(seed: int, n: int = 40) -> list[list[int]]:
    """Skewed token sequences (a Zipf-like draw) ending in EOS, as the reference builder appends it."""
    g = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, VOCAB + 1)
    seqs = []
    for _ in range(n):
        s = g.choice(VOCAB, size=int(g.integers(2, 60)), p=weights / weights.sum()).tolist()
        seqs.append(s + [EOS])
    return seqs


@pytest.fixture(scope="module")
def tries(tmp_path_factory):
    """(port trie, dart_hf NGramModel read from the port's .trie file by the converter's reader), order 3."""
    trie = TrieNgram(3)
    for s in corpus(0):
        trie.add_conversation(s)
    path = tmp_path_factory.mktemp("trie") / "ref.trie"
    trie.save(path)
    return trie, read_trie(path, vocab_size=VOCAB, progress=False)


def test_ngram_probabilities_equal_the_reference_trie(tries):
    trie, ngram = tries
    g = torch.Generator().manual_seed(0)
    seen = [s[i : i + 2] for s in corpus(0) for i in range(len(s) - 1)][:300]
    contexts = torch.cat([
        torch.tensor(seen),                                   # contexts of the corpus: mostly 2-token hits
        torch.randint(0, VOCAB, (300, 2), generator=g),       # mostly unseen pairs: back off to 1 token
        torch.stack([torch.full((100,), -1), torch.randint(0, VOCAB, (100,), generator=g)], 1),  # text of 1 token
        torch.full((2, 2), -1),                               # no context at all: 0
    ])
    candidates = torch.arange(VOCAB).expand(contexts.shape[0], VOCAB)
    got = ngram.prob(contexts, candidates)
    want = torch.tensor(
        [trie.get_probability([t for t in row if t >= 0], list(range(VOCAB)))[0] for row in contexts.tolist()],
        dtype=torch.float32,
    )
    assert torch.equal(got, want)
    # the cases that make per-candidate back-off differ from per-context back-off are there
    two = torch.tensor([trie.get_probability(row, list(range(VOCAB)))[1] for row in seen])
    assert ((two == 2).any(1) & (two == 1).any(1)).any()
    assert ngram.context_size == 2


def random_case(seed: int):
    """Draft logits of every kind the search meets: flat, peaked (softmax of exactly 1.0 and 0.0), EOS-heavy."""
    g = torch.Generator().manual_seed(seed)
    depth = int(torch.randint(3, 9, (1,), generator=g))
    scale = [0.5, 2.0, 6.0, 40.0][seed % 4]  # 40: a confident head, many ties at log(1e-10)
    logits = torch.randn(depth, DRAFT_VOCAB, generator=g) * scale
    d2t = (torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values - torch.arange(DRAFT_VOCAB))
    draft_to_target = d2t + torch.arange(DRAFT_VOCAB)
    eos_draft = (draft_to_target == EOS).nonzero()
    if seed % 3 == 0 and eos_draft.numel():  # EOS among the head's favourites
        logits[:, eos_draft[0, 0]] = logits.max() + 1.0
    text = corpus(seed + 100, n=1)[0][: int(torch.randint(1, 12, (1,), generator=g))]
    budget = [60, 60, 10, 3, 25][seed % 5]
    return logits, d2t, draft_to_target, text, budget


def paths_of(tree) -> dict[tuple, float]:
    out = {}
    for i in range(1, tree.size):
        nodes = tree.ancestor_mask[i].nonzero().squeeze(1).tolist()
        out[tuple(tree.tokens[nodes[1:]].tolist())] = float(tree.scores[i])
    return out


@pytest.mark.parametrize("seed", range(32))
def test_tree_equals_the_reference_search(tries, seed):
    trie, ngram = tries
    logits, d2t, draft_to_target, text, budget = random_case(seed)
    want = {seq: float(score) for seq, score in tree_search(logits, text, d2t, trie, EOS, budget)}
    params = TreeSearchParams(node_budget=budget)
    tree = build_tree(logits, torch.tensor(text[-1]), torch.tensor(text), params, ngram=ngram,
                      draft_to_target=draft_to_target, eos_token_ids=torch.tensor([EOS]))
    check_closed(tree)
    got = paths_of(tree)
    assert got.keys() == want.keys()
    # the reference's float32 scores, up to the last bits of log() (libm's logf vs torch's vectorised log)
    assert all(got[path] == pytest.approx(want[path], rel=1e-6, abs=1e-5) for path in got)
    assert tree.tokens[0] == text[-1] and tree.size == len(want) + 1


def test_reference_defaults_live_in_dart_config():
    p, c = TreeSearchParams(), DartConfig()
    assert (p.top_k, p.beam_width, p.node_budget, p.level_decay, p.logit_decay, p.ngram_weight) == (
        c.tree_top_k, c.beam_width, c.node_budget, c.level_decay, c.logit_decay, c.ngram_weight
    ) == (25, 20, 60, 0.7, 0.9, 0.5)


REFERENCE = {
    "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB, "draft_length": 7, "target_hidden_size": 128,
    "rope_theta": 500000.0, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
}
ROPE_SCALINGS = {
    "none": None,
    "linear": {"type": "linear", "factor": 3.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.5},
}


def converted_config(rope_scaling) -> DartConfig:
    from dart_hf.tools.convert import TargetShape

    target = TargetShape("t", "qwen3", hidden_size=128, num_hidden_layers=8, vocab_size=VOCAB)
    return dart_config_from_reference({**REFERENCE, "rope_scaling": rope_scaling}, target)


def test_converted_config_turns_prompt_lookup_off():
    config = converted_config(None)
    assert config.prompt_lookup is False
    assert json.loads(config.to_json_string())["prompt_lookup"] is False
    assert (config.tree_top_k, config.beam_width, config.node_budget) == (25, 20, 60)


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scaling_matches_the_reference_rotary(kind):
    config = converted_config(ROPE_SCALINGS[kind])
    rotary = DartRotaryEmbedding(config)
    head_dim = config.head_dim
    x = torch.zeros(1, 1, head_dim)
    for length in (40, 700):  # inside, then beyond max_position_embeddings (the dynamic cache grows)
        positions = torch.arange(length).unsqueeze(0)
        cos, sin = rotary(x, positions)
        want_cos, want_sin = reference_rotary({**REFERENCE, "rope_scaling": ROPE_SCALINGS[kind]}, head_dim,
                                              positions[0], seq_len=length)
        # linear divides positions, not frequencies, by the factor: the angles differ by float rounding only
        tol = dict(rtol=0, atol=5e-4) if kind == "linear" else dict(rtol=0, atol=2e-6)
        torch.testing.assert_close(cos[0], want_cos, **tol)
        torch.testing.assert_close(sin[0], want_sin, **tol)


def test_unsupported_rope_scaling_is_a_clear_error():
    with pytest.raises(ValueError, match="'mrope' is not supported"):
        reference_rope_parameters({"rope_scaling": {"type": "mrope", "mrope_section": [1]}})
    with pytest.raises(ValueError, match="needs 'factor'"):
        reference_rope_parameters({"rope_scaling": {"type": "linear"}})
    with pytest.raises(ValueError, match="yarn rope_scaling without"):
        reference_rope_parameters({"rope_scaling": {"type": "yarn", "factor": 2.0}})
