"""The draft head on its own: sizing from a target, persistence, KV cache, training forward == inference."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

import dart_hf
from conftest import TINY, make_head, make_target, prompts
from dart_hf.core.modeling import packed_anchor_mask
from dart_hf.core.target import aux_request, aux_states

K = 4  # draft_length of the heads below


def scramble(head: dart_hf.DartHead, seed: int = 0) -> dart_hf.DartHead:
    """Weights of a visible size (the default init leaves norms at 1 and projections near 0, so a wrong mask or a
    wrong position would barely move the logits). Norm weights move away from 1 so they matter too."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif name.endswith("mask_rep"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
    return head


def target_states(target, ids: torch.Tensor, layer_ids) -> torch.Tensor:
    """aux [B, S, 3H]: the inputs of the target layers `layer_ids`, from one real target forward over ids."""
    with torch.no_grad():
        return aux_states(target(ids, **aux_request(layer_ids)), layer_ids)


def head_inputs(target, head, length: int = 12, batch: int = 1, seed: int = 0):
    """(aux, next_tokens) for `length` positions: position t pairs h_t with token t+1 (the last one a 'bonus')."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY["vocab_size"], (batch, length + 1), generator=g)
    aux = target_states(target, ids[:, :length], head.config.aux_layer_ids)
    return aux, ids[:, 1:]


def fresh_draft(head, aux, next_tokens) -> torch.Tensor:
    return head.draft(aux, next_tokens, head.new_cache())


def reduced_head(target, ids: torch.Tensor | None = None, seed: int = 1) -> dart_hf.DartHead:
    head = make_head(target, seed=seed, draft_length=K, draft_vocab_size=40)
    if ids is None:
        ids = torch.randperm(TINY["vocab_size"], generator=torch.Generator().manual_seed(seed))[:40]
    head.set_draft_vocab(ids)
    return head


# ---------------------------------------------------------------------------------------------- from_target
@pytest.mark.parametrize("arch, theta", [("llama", 5000.0), ("qwen2", 20000.0), ("qwen3", 1234.0)])
def test_from_target_copies_target_shapes(arch, theta):
    n_layers = 8
    rope = {"rope_type": "default", "rope_theta": theta}
    target = make_target(arch, num_hidden_layers=n_layers, num_key_value_heads=1, rope_parameters=rope)
    tc = target.config
    head = dart_hf.DartHead.from_target(target, draft_length=5)
    hc = head.config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    if arch == "qwen3":
        assert head_dim != tc.hidden_size // tc.num_attention_heads  # Qwen3's explicit head_dim is exercised
    assert (hc.hidden_size, hc.target_hidden_size) == (tc.hidden_size, tc.hidden_size)
    assert (hc.num_attention_heads, hc.num_key_value_heads, hc.head_dim) == (tc.num_attention_heads, 1, head_dim)
    assert hc.rope_parameters["rope_theta"] == theta
    assert hc.vocab_size == tc.vocab_size and hc.draft_vocab_size is None
    assert hc.target_num_layers == n_layers and hc.target_model_type == arch
    assert hc.aux_layer_ids == [2, n_layers // 2, n_layers - 3] == [2, 4, 5]
    assert hc.draft_length == 5 and hc.num_predictions == 6
    # the modules really have those shapes, and the head's RoPE is the target's
    attn = head.midlayer.self_attn
    assert head.fc.weight.shape == (tc.hidden_size, 3 * tc.hidden_size)
    assert attn.q_proj.weight.shape == (tc.num_attention_heads * head_dim, 2 * tc.hidden_size)
    assert attn.k_proj.weight.shape == attn.v_proj.weight.shape == (head_dim, 2 * tc.hidden_size)
    assert attn.o_proj.weight.shape == (tc.hidden_size, tc.num_attention_heads * head_dim)
    torch.testing.assert_close(head.rotary_emb.inv_freq, target.model.rotary_emb.inv_freq)
    assert head.lm_head is None
    head.bind_target(target)  # the head it builds passes its own checks


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_from_target_follows_target_dtype_and_device(dtype):
    target = make_target("llama").to(dtype)
    for head in (dart_hf.DartHead.from_target(target), dart_hf.DartHead.from_target(target, draft_vocab_size=40)):
        assert head.dtype == dtype and head.device == target.device
        assert all(p.dtype == dtype for p in head.parameters())
        assert all(p.device == target.device for p in head.parameters())
        assert head.new_cache().k.dtype == dtype
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool  # index buffers keep their types


def test_from_target_on_meta_device():
    target = make_target("llama").to("meta")
    head = dart_hf.DartHead.from_target(target)
    assert head.device.type == "meta" and all(p.is_meta for p in head.parameters())


# ---------------------------------------------------------------------------------------------- persistence
@pytest.mark.parametrize("variant", ["tied", "ngram", "draft_vocab"])
def test_save_and_auto_load_round_trip(llama, tmp_path, variant):
    if variant == "draft_vocab":
        ids = torch.randperm(TINY["vocab_size"], generator=torch.Generator().manual_seed(3))[:40]
        head = reduced_head(llama, ids)
    else:
        head = make_head(llama, draft_length=K)
    scramble(head)
    if variant == "ngram":
        texts = [p[0].tolist() for p in prompts(8)]
        head.ngram = dart_hf.NGramModel.build(texts, order=3, vocab_size=TINY["vocab_size"], progress=False)
    head.save_pretrained(tmp_path)

    assert (tmp_path / "ngram.safetensors").is_file() == (variant == "ngram")
    saved = load_file(tmp_path / "model.safetensors")
    assert not [k for k in saved if "embed" in k], "the target's embedding must not be saved"
    assert ("lm_head.weight" in saved) == (variant == "draft_vocab")
    for key in ("fc.weight", "midlayer.mask_rep", "midlayer.self_attn.q_proj.weight", "norm.weight"):
        assert key in saved

    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is dart_hf.DartHead
    same = lambda cfg: {k: v for k, v in cfg.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    assert same(loaded.config) == same(head.config)
    ref_state, new_state = head.state_dict(), loaded.state_dict()
    assert ref_state.keys() == new_state.keys()
    for name, value in ref_state.items():
        assert torch.equal(value, new_state[name]), name

    if variant == "draft_vocab":
        assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
        assert torch.equal(loaded.draft_to_target, ids.sort().values)
        assert torch.equal(loaded.t2d.nonzero().view(-1), ids.sort().values)
    else:
        assert loaded.draft_to_target is None
    if variant == "ngram":
        assert loaded.ngram is not None and loaded.ngram.order == 3
        for name, table in head.ngram.tables.items():
            assert torch.equal(loaded.ngram.tables[name], table), name
        ctx, cand = torch.tensor([[5, 9], [-1, 7]]), torch.arange(96).expand(2, 96)
        torch.testing.assert_close(loaded.ngram.prob(ctx, cand), head.ngram.prob(ctx, cand))
    else:
        assert loaded.ngram is None

    head.bind_target(llama)
    loaded.bind_target(llama)
    aux, nxt = head_inputs(llama, head, length=7)
    ref = fresh_draft(head, aux, nxt)
    assert ref.shape == (K + 1, 40 if variant == "draft_vocab" else TINY["vocab_size"])
    assert torch.equal(fresh_draft(loaded, aux, nxt), ref)


def test_draft_vocab_maps_back_to_target_ids(llama):
    ids = torch.tensor([95, 3, 50, 7, 0] + list(range(10, 45)))  # unsorted, includes both ends of the vocab
    head = reduced_head(llama, ids)
    assert torch.equal(head.draft_to_target, ids.sort().values)
    assert int(head.t2d.sum()) == 40 and bool(head.t2d[ids].all())
    with pytest.raises(ValueError, match="40 distinct"):
        head.set_draft_vocab(torch.tensor([1] * 40))
    with pytest.raises(ValueError, match="40 distinct"):
        head.set_draft_vocab(torch.arange(39))


# ---------------------------------------------------------------------------------------------- KV cache
@pytest.mark.parametrize(
    "arch, chunks", [("llama", [5, 1, 3]), ("llama", [1] * 9), ("llama", [2, 7]), ("qwen3", [5, 1, 3])]
)
def test_draft_in_chunks_equals_one_call(arch, chunks):
    target = make_target(arch)
    head = scramble(make_head(target, draft_length=K))
    head.bind_target(target)
    aux, nxt = head_inputs(target, head, length=sum(chunks))
    cache = head.new_cache(capacity=2)  # small: the chunks also make the cache grow
    end = 0
    for size in chunks:
        start, end = end, end + size
        stepped = head.draft(aux[:, start:end], nxt[:, start:end], cache)
        assert cache.length == end, "only real positions may stay in the cache (MASK keys are dropped)"
        assert stepped.shape == (K + 1, TINY["vocab_size"])
        torch.testing.assert_close(stepped, fresh_draft(head, aux[:, :end], nxt[:, :end]), atol=1e-4, rtol=1e-4)


def test_a_shallower_draft_is_the_top_rows_of_the_full_one():
    target = make_target("llama")
    head = scramble(make_head(target, draft_length=K))
    head.bind_target(target)
    aux, nxt = head_inputs(target, head, length=9)
    full_cache, cache = head.new_cache(), head.new_cache()
    full = head.draft(aux[:, :6], nxt[:, :6], full_cache)
    for depth, (start, end) in zip((1, 3), ((0, 6), (6, 9))):
        if start:
            full = head.draft(aux[:, start:end], nxt[:, start:end], full_cache)
        short = head.draft(aux[:, start:end], nxt[:, start:end], cache, depth=depth)
        assert short.shape == (depth, TINY["vocab_size"]) and cache.length == full_cache.length == end
        torch.testing.assert_close(short, full[:depth], atol=1e-5, rtol=1e-5)
    for bad in (0, K + 2):
        with pytest.raises(ValueError, match="draft depth"):
            head.draft(aux[:, :1], nxt[:, :1], head.new_cache(), depth=bad)


# ---------------------------------------------------------------------------------------------- training forward
@pytest.mark.parametrize("arch, vocab", [("llama", "tied"), ("qwen3", "tied"), ("llama", "draft_vocab")])
def test_training_forward_equals_draft_per_anchor(arch, vocab):
    target = make_target(arch)
    if vocab == "draft_vocab":
        head = reduced_head(target)
    else:
        head = make_head(target, draft_length=K)
    scramble(head)
    head.bind_target(target)
    length = 11
    aux, nxt = head_inputs(target, head, length=length, batch=2)
    anchors = torch.tensor([[0, 4, 10, 6], [3, 3, 9, 1]])  # unsorted, repeated, first and last positions
    with torch.no_grad():
        packed = head(aux, nxt, anchors)
    vocab_size = 40 if vocab == "draft_vocab" else TINY["vocab_size"]
    assert packed.shape == (2, 4, K + 1, vocab_size)
    for b in range(2):
        for i, a in enumerate(anchors[b].tolist()):
            ref = fresh_draft(head, aux[b : b + 1, : a + 1], nxt[b : b + 1, : a + 1])
            torch.testing.assert_close(packed[b, i].float(), ref, atol=1e-4, rtol=1e-4, msg=f"row {b} anchor {a}")


def test_packed_anchor_mask_small_case():
    # T = 3 real positions, K = 2 slots; row 0 anchors (0, 2), row 1 anchors (1, 1)
    mask = packed_anchor_mask(3, torch.tensor([[0, 2], [1, 1]]), 2)
    expected_row0 = [
        # r0 r1 r2 | a0s0 a0s1 | a1s0 a1s1
        [1, 0, 0, 0, 0, 0, 0],  # real 0
        [1, 1, 0, 0, 0, 0, 0],  # real 1
        [1, 1, 1, 0, 0, 0, 0],  # real 2
        [1, 0, 0, 1, 0, 0, 0],  # anchor 0, slot 0: prefix 0..0, itself
        [1, 0, 0, 1, 1, 0, 0],  # anchor 0, slot 1
        [1, 1, 1, 0, 0, 1, 0],  # anchor 2, slot 0: prefix 0..2, itself
        [1, 1, 1, 0, 0, 1, 1],  # anchor 2, slot 1
    ]
    expected_row1 = [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],  # anchor 1, slot 0
        [1, 1, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 0],  # the second anchor 1 has its own block and cannot see the first one's
        [1, 1, 0, 0, 0, 1, 1],
    ]
    assert mask.dtype == torch.bool and mask.shape == (2, 7, 7)
    assert torch.equal(mask, torch.tensor([expected_row0, expected_row1], dtype=torch.bool))


# ---------------------------------------------------------------------------------------------- bf16
@pytest.mark.parametrize("vocab", ["tied", "draft_vocab"])
def test_bf16_head_drafts_close_to_fp32(llama, vocab):
    head = reduced_head(llama) if vocab == "draft_vocab" else make_head(llama, draft_length=K)
    scramble(head)
    half = copy.deepcopy(head).to(torch.bfloat16)
    head.bind_target(llama)
    half.bind_target(llama)  # fp32 target, bf16 head kept (binding never moves the head): embeddings are cast
    assert half.dtype == torch.bfloat16
    aux, nxt = head_inputs(llama, head, length=9)
    ref = fresh_draft(head, aux, nxt)
    cache = half.new_cache()
    out = half.draft(aux[:, :6], nxt[:, :6], cache)
    out = half.draft(aux[:, 6:], nxt[:, 6:], cache)
    assert out.dtype == torch.float32 and bool(out.isfinite().all())
    scale = ref.abs().max()
    assert (out - ref).abs().max() < 0.03 * scale  # measured ~0.008; another head differs by > 1.0
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.6


def test_generate_places_the_head_once_and_leaves_nothing_on_it(llama):
    head = make_head(llama).to(torch.bfloat16)
    ids = prompts(1, seed=3)[0]
    llama.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=4)
    assert head.dtype == llama.dtype and head.device == llama.device  # the first call placed it like the target
    assert head._bound is None, "generate must pass the target's modules to the head, not store them on it"
    storage = [p.data_ptr() for p in head.parameters()]
    llama.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=4)
    assert [p.data_ptr() for p in head.parameters()] == storage  # later calls find it in place


def test_bind_target_borrows_modules_without_moving_the_head(llama):
    head = make_head(llama).to(torch.bfloat16)
    head.bind_target(llama)
    assert head.dtype == torch.bfloat16
