"""Reference checkpoint + .trie -> dart_hf head folder.

Nothing can be downloaded, so the reference files are synthesised here from the spec's layout (random weights in
the reference key names, a .trie written by an independent serializer), and the converted head is checked against
a forward pass written from the spec text in plain torch, independent of DartHead.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import dart_hf
from conftest import TINY, prompts
from dart_hf.tools.convert import QWEN3_TARGETS, convert_reference, read_trie
from dart_hf_cli import main as cli

VOCAB = TINY["vocab_size"]


# ---------------------------------------------------------------------------------------------------- reference files
def reference_config(**overrides) -> dict:
    """A reference-style (Llama) config for a head drafting for the tiny targets of conftest."""
    cfg = {
        "architectures": ["LlamaForCausalLMDart"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "draft_vocab_size": 48,
        "draft_length": 4,
        "target_hidden_size": TINY["hidden_size"],
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def reference_state_dict(cfg: dict, seed: int = 0, with_embed: bool = False) -> dict[str, torch.Tensor]:
    """Random tensors with the shapes of docs/DART_SPEC.md §1 (written from the spec, not from DartHead)."""
    g = torch.Generator().manual_seed(seed)
    h, i, th = cfg["hidden_size"], cfg["intermediate_size"], cfg["target_hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    vd, v = cfg["draft_vocab_size"], cfg["vocab_size"]

    def w(*shape):
        return torch.randn(*shape, generator=g) / math.sqrt(shape[-1])

    def norm():
        return 1.0 + 0.1 * torch.randn(h, generator=g)

    draft_ids = torch.randperm(v, generator=g)[:vd].sort().values
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[draft_ids] = True
    sd = {
        "fc.weight": w(h, 3 * th),
        "midlayer.mask_rep": torch.randn(2 * h, generator=g),
        "midlayer.self_attn.q_proj.weight": w(nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, nh * hd),
        "midlayer.mlp.gate_proj.weight": w(i, h),
        "midlayer.mlp.up_proj.weight": w(i, h),
        "midlayer.mlp.down_proj.weight": w(h, i),
        "midlayer.hidden_norm.weight": norm(),
        "midlayer.input_layernorm.weight": norm(),
        "midlayer.post_attention_layernorm.weight": norm(),
        "norm.weight": norm(),
        "lm_head.weight": 4.0 * w(vd, h),
        "d2t": draft_ids - torch.arange(vd),
        "t2d": t2d,
    }
    if with_embed:
        sd["embed_tokens.weight"] = torch.randn(v, h, generator=g)
    return sd


def write_reference(folder: Path, cfg: dict, sd: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(folder / "model.safetensors"))
    return folder


def write_target_config(target, folder: Path) -> Path:
    target.config.save_pretrained(folder)
    return folder / "config.json"


# ---------------------------------------------------------------------------------------------------- reference trie
def trie_nodes(sequences: list[list[int]], order: int) -> list[dict]:
    """Nodes of the reference trie: every window of up to `order` tokens increments each node on its path."""
    nodes = [{"token": 0, "parent": 0, "freq": 0, "children": {}}]
    for seq in sequences:
        for start in range(len(seq)):
            node = 0
            nodes[0]["freq"] += 1
            for tok in seq[start : start + order]:
                if tok not in nodes[node]["children"]:
                    nodes.append({"token": tok, "parent": node, "freq": 0, "children": {}})
                    nodes[node]["children"][tok] = len(nodes) - 1
                node = nodes[node]["children"][tok]
                nodes[node]["freq"] += 1
    return nodes


def serialize_trie(nodes: list[dict], order: int, permute_seed: int | None = None) -> bytes:
    """Spec section 5, little-endian. `permute_seed` renumbers the non-root nodes (children may precede parents)."""
    ids = list(range(len(nodes)))
    if permute_seed is not None:
        perm = torch.randperm(len(nodes) - 1, generator=torch.Generator().manual_seed(permute_seed)) + 1
        ids = [0, *perm.tolist()]  # old id -> new id
    records = [b""] * len(nodes)
    for old, node in enumerate(nodes):
        rec = struct.pack("<iQiQ", node["token"], ids[node["parent"]], node["freq"], len(node["children"]))
        for tok, child in sorted(node["children"].items()):
            rec += struct.pack("<iQ", tok, ids[child])
        records[ids[old]] = rec
    return struct.pack("<QQ", order, len(nodes)) + b"".join(records)


def write_trie(path: Path, sequences: list[list[int]], order: int = 3, permute_seed: int | None = None) -> Path:
    path.write_bytes(serialize_trie(trie_nodes(sequences, order), order, permute_seed))
    return path


def corpus(n: int = 60, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for length in lengths]


# ---------------------------------------------------------------------------------------------------- reference forward
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [S, heads, d]; rotate-half RoPE with inv_freq = theta^(-2i/d)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def reference_draft_logits(sd: dict, cfg: dict, embed: torch.Tensor, aux: torch.Tensor, tokens: torch.Tensor):
    """Spec section 1 without any cache: all T real rows + K MASK rows, causal, positions 0..T+K-1.

    aux [T, 3 * target_hidden], tokens [T] (token t+1 beside state t). Returns logits [K + 1, draft vocab] of the
    last real row and the K MASK rows, after `norm` applied twice (the reference trains with it twice).
    """
    h, eps, k_slots = cfg["hidden_size"], cfg["rms_norm_eps"], cfg["draft_length"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    t = aux.shape[0]
    fc = aux @ sd["fc.weight"].T
    real = torch.cat([_rms(embed[tokens], sd["midlayer.input_layernorm.weight"], eps),
                      _rms(fc, sd["midlayer.hidden_norm.weight"], eps)], -1)
    mask_rep = sd["midlayer.mask_rep"]
    x = torch.cat([real, mask_rep.expand(k_slots, 2 * h)])
    residual = torch.cat([fc, mask_rep[:h].expand(k_slots, h)])
    s = t + k_slots
    pos = torch.arange(s)
    q = _rope((x @ sd["midlayer.self_attn.q_proj.weight"].T).view(s, nh, hd), pos, cfg["rope_theta"])
    k = _rope((x @ sd["midlayer.self_attn.k_proj.weight"].T).view(s, nkv, hd), pos, cfg["rope_theta"])
    v = (x @ sd["midlayer.self_attn.v_proj.weight"].T).view(s, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(s, nh * hd)
    hidden = (residual + attn @ sd["midlayer.self_attn.o_proj.weight"].T)[t - 1 :]
    normed = _rms(hidden, sd["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = normed @ sd["midlayer.mlp.gate_proj.weight"].T, normed @ sd["midlayer.mlp.up_proj.weight"].T
    mlp = torch.nn.functional.silu(gate) * up
    hidden = hidden + mlp @ sd["midlayer.mlp.down_proj.weight"].T
    out = _rms(_rms(hidden, sd["norm.weight"], eps), sd["norm.weight"], eps)
    return out @ sd["lm_head.weight"].T


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def qwen3(tiny_target):
    return tiny_target("qwen3")


@pytest.fixture(scope="module")
def target_cfg(qwen3, tmp_path_factory) -> Path:
    return write_target_config(qwen3, tmp_path_factory.mktemp("target"))


def convert(tmp_path: Path, target_cfg: Path, cfg: dict | None = None, sd: dict | None = None, **kw):
    cfg = cfg or reference_config()
    sd = sd if sd is not None else reference_state_dict(cfg)
    src = write_reference(tmp_path / "ref", cfg, sd)
    head = convert_reference(src, tmp_path / "out", target_config=target_cfg, progress=False, **kw)
    return head.eval(), cfg, sd


# ---------------------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("head_dim", [None, 32])
def test_converted_draft_equals_reference_forward(tmp_path, qwen3, target_cfg, head_dim):
    cfg = reference_config(**({"head_dim": head_dim} if head_dim else {}))
    head, cfg, sd = convert(tmp_path, target_cfg, cfg)
    head.bind_target(qwen3)
    embed = qwen3.get_input_embeddings().weight.detach()
    g = torch.Generator().manual_seed(3)
    aux = torch.randn(1, 9, 3 * TINY["hidden_size"], generator=g)
    tokens = torch.randint(0, VOCAB, (1, 9), generator=g)
    cache = head.new_cache()
    # two steps through the head's KV cache (5 then 4 new real rows) == one cache-free pass over all rows
    for end in (5, 9):
        start = cache.length
        got = head.draft(aux[:, start:end], tokens[:, start:end], cache)
        want = reference_draft_logits(sd, cfg, embed, aux[0, :end], tokens[0, :end])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(head.draft_to_target, sd["d2t"] + torch.arange(cfg["draft_vocab_size"]))


def test_config_mapping(tmp_path, target_cfg):
    head, cfg, _ = convert(tmp_path, target_cfg, reference_config(draft_length=6))
    c = head.config
    assert c.model_type == "dart" and c.draft_length == 6 and c.num_predictions == 7
    assert c.final_norm_repeats == 2
    assert c.aux_layer_ids == [2, 3, 3]  # [2, L // 2, L - 3] for the 6-layer tiny target
    assert (c.target_num_layers, c.target_model_type, c.vocab_size) == (6, "qwen3", VOCAB)
    assert c.head_dim == 16 and c.rope_parameters["rope_theta"] == 1_000_000.0
    assert c.prompt_lookup is False  # the reference tree has no lookup candidates
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["config.json", "custom_generate", "model.safetensors"]


def test_embed_tokens_in_reference_is_dropped(tmp_path, target_cfg):
    cfg = reference_config()
    head, _, _ = convert(tmp_path, target_cfg, cfg, reference_state_dict(cfg, with_embed=True))
    assert not any("embed" in k for k in head.state_dict())


def test_builtin_qwen3_targets_resolve_without_target_config(tmp_path):
    for target in QWEN3_TARGETS.values():
        cfg = reference_config(
            target_hidden_size=target.hidden_size, vocab_size=151936, intermediate_size=target.intermediate_size
        )
        src = tmp_path / target.name
        src.mkdir(parents=True)
        (src / "config.json").write_text(json.dumps(cfg))
        ref = dart_hf.tools.convert.read_reference_config(src)
        resolved = dart_hf.tools.convert.resolve_target(None, ref)
        assert resolved == target
        config = dart_hf.tools.convert.dart_config_from_reference(ref, resolved)
        n = target.num_hidden_layers
        assert config.aux_layer_ids == [2, n // 2, n - 3] and config.target_model_type == "qwen3"


# ---------------------------------------------------------------------------------------------------- trie
@pytest.mark.parametrize("permute", [None, 5])
def test_read_trie_matches_ngram_build(tmp_path, permute):
    seqs = corpus(80, seed=1)
    path = write_trie(tmp_path / "c.trie", seqs, order=3, permute_seed=permute)
    got = read_trie(path, vocab_size=VOCAB, progress=False)
    want = dart_hf.NGramModel.build(seqs, order=3, vocab_size=VOCAB, progress=False)
    assert got.order == 3 and got.vocab_size == VOCAB
    for name, table in want.tables.items():
        assert torch.equal(got.tables[name], table), name
    g = torch.Generator().manual_seed(2)
    seen = torch.tensor([s[i : i + 2] for s in seqs for i in range(len(s) - 1)][:200])
    context = torch.cat([seen, torch.randint(-1, VOCAB, (200, 2), generator=g)])
    candidates = torch.randint(0, VOCAB, (400, 30), generator=g)
    probs = got.prob(context, candidates)
    assert torch.equal(probs, want.prob(context, candidates)) and (probs > 0).any()


def test_read_trie_order_and_default_vocab(tmp_path):
    seqs = [[5, 6, 7, 8, 5, 6, 9]]
    got = read_trie(write_trie(tmp_path / "c.trie", seqs, order=2), progress=False)
    assert (got.order, got.vocab_size) == (2, 10)
    p = got.prob(torch.tensor([[5]]), torch.tensor([[6, 7]]))
    assert torch.equal(p, torch.tensor([[1.0, 0.0]]))


def _corrupt(data: bytes, offset: int, fmt: str, value) -> bytes:
    return data[:offset] + struct.pack(fmt, value) + data[offset + struct.calcsize(fmt) :]


def test_corrupt_tries_raise_clear_errors(tmp_path):
    seqs = corpus(10, seed=4)
    nodes = trie_nodes(seqs, 3)
    good = serialize_trie(nodes, 3)
    first_child = 16 + 24  # the root's first child entry (root record header is 24 bytes)
    cases = {
        "truncated": (good[:-5], "truncated|bytes left|claims"),
        "trailing bytes": (good + b"\0" * 12, "bytes left after"),
        "not a trie": (b"\x89PNG" + b"\0" * 200, "not a .trie file"),
        "node count": (_corrupt(good, 8, "<Q", len(nodes) + 3), "truncated|bytes left|claims|not a .trie"),
        "child token": (_corrupt(good, first_child, "<i", good[first_child] + 1), "disagrees"),
        "child id": (_corrupt(good, first_child + 4, "<Q", 10**9), "outside the trie"),
        "tiny file": (b"\0" * 10, "too small"),
    }
    for name, (data, pattern) in cases.items():
        path = tmp_path / f"{name}.trie"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=pattern) as err:
            read_trie(path, vocab_size=VOCAB, progress=False)
        assert path.name in str(err.value), name
    with pytest.raises(ValueError, match="does not fit the target vocabulary"):
        read_trie(write_trie(tmp_path / "v.trie", seqs), vocab_size=50, progress=False)


# ---------------------------------------------------------------------------------------------------- losslessness
def test_converted_head_with_trie_generates_losslessly(tmp_path, qwen3, target_cfg):
    inputs = prompts(3, seed=11)
    plain = [qwen3.generate(ids, do_sample=False, max_new_tokens=24) for ids in inputs]
    trie = write_trie(tmp_path / "own.trie", [p[0].tolist() for p in plain], order=3)
    cfg = reference_config(draft_vocab_size=VOCAB)  # a draft vocab over every token, so any draft can land
    head, _, _ = convert(tmp_path, target_cfg, cfg, ngram_trie=trie)
    head.config.tree_top_k, head.config.beam_width, head.config.node_budget = VOCAB, 16, 32
    assert head.ngram is not None and (tmp_path / "out" / "ngram.safetensors").is_file()
    lengths = []
    for ids, want in zip(inputs, plain):
        assert torch.equal(qwen3.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=24), want)
        lengths += head.stats["accepted_lengths"]
    # the trie of the target's own text makes drafts land, so the multi-token acceptance path is exercised
    assert sum(n > 1 for n in lengths) >= 3, lengths


# ---------------------------------------------------------------------------------------------------- bad inputs
def _expect_error(tmp_path, target_cfg, pattern, cfg=None, sd=None, mutate=None, target=None, exc=ValueError):
    cfg = cfg or reference_config()
    src = write_reference(tmp_path / "ref", cfg, sd if sd is not None else reference_state_dict(cfg))
    if mutate:
        mutate(src)
    with pytest.raises(exc, match=pattern):
        convert_reference(src, tmp_path / "out", target_config=target or target_cfg, progress=False)
    assert not (tmp_path / "out").exists(), "nothing may be written when the input is rejected"


def test_missing_key_names_file_and_key(tmp_path, target_cfg):
    sd = reference_state_dict(reference_config())
    del sd["midlayer.mask_rep"]
    _expect_error(tmp_path, target_cfg, r"model\.safetensors.*missing keys \['midlayer\.mask_rep'\]", sd=sd)


def test_unexpected_key(tmp_path, target_cfg):
    sd = reference_state_dict(reference_config())
    sd["midlayer.extra.weight"] = torch.zeros(3)
    _expect_error(tmp_path, target_cfg, r"unexpected \['midlayer\.extra\.weight'\]", sd=sd)


def test_wrong_shape_names_key(tmp_path, target_cfg):
    sd = reference_state_dict(reference_config())
    sd["midlayer.self_attn.k_proj.weight"] = torch.zeros(7, 128)
    pattern = r"model\.safetensors: key 'midlayer\.self_attn\.k_proj\.weight' has shape \(7, 128\)"
    _expect_error(tmp_path, target_cfg, pattern, sd=sd)


def test_truncated_weights(tmp_path, target_cfg):
    def cut(src):
        p = src / "model.safetensors"
        p.write_bytes(p.read_bytes()[:1000])

    _expect_error(tmp_path, target_cfg, r"model\.safetensors is not a readable safetensors file", mutate=cut)


def test_pickle_only_checkpoint_is_refused(tmp_path, target_cfg):
    def to_pickle(src):
        torch.save({"fc.weight": torch.zeros(1)}, src / "pytorch_model.bin")
        (src / "model.safetensors").unlink()

    pattern = r"model\.safetensors not found.*pytorch_model\.bin.*pickle"
    _expect_error(tmp_path, target_cfg, pattern, mutate=to_pickle, exc=FileNotFoundError)


def test_foreign_and_dart_configs(tmp_path, qwen3, target_cfg):
    sd = reference_state_dict(reference_config())
    _expect_error(tmp_path, target_cfg, "not a reference DART config.*draft_length", cfg=qwen3.config.to_dict(), sd=sd)
    _expect_error(tmp_path, target_cfg, "already a dart_hf head", cfg=reference_config(model_type="dart"))
    mrope = reference_config(rope_scaling={"rope_type": "mrope", "mrope_section": [2, 3, 3]})
    _expect_error(tmp_path, target_cfg, "rope_scaling type 'mrope' is not supported", cfg=mrope)


def test_inconsistent_vocab_map(tmp_path, target_cfg):
    sd = reference_state_dict(reference_config())
    sd["t2d"] = torch.zeros_like(sd["t2d"])
    _expect_error(tmp_path, target_cfg, "'d2t' and 't2d' disagree", sd=sd)


def test_target_mismatch(tmp_path, target_cfg):
    _expect_error(tmp_path, target_cfg, "hidden size 80", cfg=reference_config(target_hidden_size=80))
    _expect_error(tmp_path, target_cfg, "vocabulary of 100", cfg=reference_config(vocab_size=100))


def test_unknown_target_without_config(tmp_path):
    cfg = reference_config()
    src = write_reference(tmp_path / "ref", cfg, reference_state_dict(cfg))
    with pytest.raises(ValueError, match="cannot tell the target.*--target-config"):
        convert_reference(src, tmp_path / "out", progress=False)


# ---------------------------------------------------------------------------------------------------- CLI
def test_cli(tmp_path, target_cfg, capsys):
    cfg = reference_config()
    src = write_reference(tmp_path / "ref", cfg, reference_state_dict(cfg))
    trie = write_trie(tmp_path / "c.trie", corpus(5))
    argv = ["convert", str(src), "--ngram", str(trie), "--target-config", str(target_cfg), "--out", str(tmp_path / "a")]
    assert cli(argv) == 0
    assert (tmp_path / "a" / "ngram.safetensors").is_file()
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    assert saved["has_ngram"] is True and saved["prompt_lookup"] is False
    assert cli(["convert", str(src), "--target-config", str(target_cfg), "--out", str(tmp_path / "b")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert cli(["convert", str(src), "--out", str(tmp_path / "c")]) == 1
    assert "cannot tell the target" in capsys.readouterr().err
