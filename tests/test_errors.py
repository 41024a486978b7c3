"""Every unsupported or inconsistent input is refused with a clear ValueError / TypeError, never a wrong answer."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DynamicCache,
    StaticCache,
    SynthIDTextWatermarkingConfig,
    T5Config,
    T5ForConditionalGeneration,
)

import dart_hf
from conftest import TINY, make_head, make_target, prompts
from dart_hf_cli import build_parser
from dart_hf.tools import bench, demo
from dart_hf.training import pipeline

MODES = ["tree", "chain"]


def run(target, head, ids=None, mode: str = "tree", **kw):
    ids = prompts(1, seed=5)[0] if ids is None else ids
    kw.setdefault("max_new_tokens", 4)
    return target.generate(ids, assistant_model=head, do_sample=False, dart_mode=mode, **kw)


# ---------------------------------------------------------------------------------------------- wrong target
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "change, what",
    [
        (dict(hidden_size=32, intermediate_size=64), "hidden size"),
        (dict(vocab_size=80), "vocab size"),
        (dict(num_hidden_layers=8), "number of layers"),
    ],
)
def test_head_for_another_target_shape(llama, llama_head, mode, change, what):
    other = make_target("llama", **change)
    vocab = change.get("vocab_size", TINY["vocab_size"])  # a prompt the other target reads (else: its ids' error)
    with pytest.raises(ValueError, match=what):
        run(other, llama_head, prompts(1, vocab=vocab, seed=5)[0], mode=mode)
    # the head still works on its own target afterwards
    ids = prompts(1, seed=5)[0]
    assert torch.equal(run(llama, llama_head, ids, mode=mode), llama.generate(ids, do_sample=False, max_new_tokens=4))


@pytest.mark.parametrize("mode", MODES)
def test_head_for_another_model_type_and_override(llama, mode):
    head = make_head(llama)
    qwen = make_target("qwen2")  # same shapes as the tiny Llama, another architecture
    with pytest.raises(ValueError, match="model type 'llama'.*'qwen2'.*target_model_type = None"):
        run(qwen, head, mode=mode)
    head.config.target_model_type = None  # the documented override: skips the model-type check only
    ids = prompts(1, seed=5)[0]
    assert torch.equal(run(qwen, head, ids, mode=mode), qwen.generate(ids, do_sample=False, max_new_tokens=4))
    with pytest.raises(ValueError, match="hidden size"):  # the shape checks still apply
        run(make_target("qwen2", hidden_size=32, intermediate_size=64), head, mode=mode)


def test_aux_layer_ids_beyond_target_layers(llama):
    head = make_head(llama)
    head.config.aux_layer_ids = [2, 3, TINY["num_hidden_layers"]]  # assignment bypasses DartConfig validation
    with pytest.raises(ValueError, match=r"aux_layer_ids \[2, 3, 6\] do not exist in a target with 6 layers"):
        run(llama, head)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        head.bind_target(llama)


def test_encoder_decoder_config_rejected_by_from_target():
    t5 = T5ForConditionalGeneration(
        T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    )
    with pytest.raises(ValueError, match="decoder-only"):
        dart_hf.DartHead.from_target(t5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_encoder_decoder_target(llama_head, arch, mode):
    torch.manual_seed(0)
    if arch == "t5":
        cfg = T5Config(
            vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=6, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        target = T5ForConditionalGeneration(cfg).eval()
    else:
        cfg = BartConfig(
            vocab_size=96, d_model=64, encoder_layers=6, decoder_layers=6, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        )  # fmt: skip
        target = BartForConditionalGeneration(cfg).eval()
    with pytest.raises(ValueError, match="decoder-only"):
        run(target, llama_head, mode=mode)


# ---------------------------------------------------------------------------------------------- unsupported calls
def test_batch_size_above_one_in_chain_mode(llama, llama_head):
    ids = prompts(1, seed=5)[0]
    with pytest.raises(ValueError, match="chain.*batch size 1.*tree"):
        run(llama, llama_head, ids.repeat(2, 1), mode="chain")
    assert run(llama, llama_head, ids.repeat(2, 1)).shape == (2, ids.shape[1] + 4)  # tree mode decodes batches


def test_num_beams_above_one(llama, llama_head):
    with pytest.raises(ValueError, match="num_beams=1"):
        run(llama, llama_head, num_beams=2)


def test_other_cache_implementation_requested(llama, llama_head):
    with pytest.raises(ValueError, match="cache_implementation='offloaded' is not supported"):
        run(llama, llama_head, cache_implementation="offloaded")


def test_prefilled_static_cache_passed_in(llama, llama_head):
    ids = prompts(1, seed=5)[0]
    cache = StaticCache(config=llama.config, max_cache_len=64)
    with torch.no_grad():
        llama(ids[:, :-1], cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="empty StaticCache"):
        run(llama, llama_head, ids, cache=cache)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("kwarg", ["cache", "past_key_values"])  # the current name and the deprecated one
def test_prefilled_cache(llama, llama_head, kwarg):
    ids = prompts(1, seed=5)[0]
    cache = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(ids[:, :-1], cache=cache, use_cache=True)
    assert cache.get_seq_length() > 0
    with pytest.raises(ValueError, match="empty DynamicCache"):
        run(llama, llama_head, ids, **{kwarg: cache})


@pytest.mark.parametrize("mode", ["tree", "chain", "batch"])
def test_max_new_tokens_past_the_context_decodes_like_plain_generate(llama, llama_head, mode):
    """No refusal up front (plain `generate` has none): a huge max_new_tokens stops at an early EOS, and a max_length
    past the target's context runs on past it as plain `generate` does, the trees shrinking to the room left and the
    last tokens decoded plainly."""
    limit = TINY["max_position_embeddings"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, TINY["vocab_size"], (1, 12), generator=g)
    kwargs = dict(do_sample=False, dart_mode="chain" if mode == "chain" else "tree")
    if mode == "batch":
        ids = torch.cat([ids, torch.randint(3, TINY["vocab_size"], (1, 12), generator=g)])
        kwargs["attention_mask"] = torch.ones_like(ids)
    plain = llama.generate(ids, do_sample=False, max_new_tokens=12, attention_mask=kwargs.get("attention_mask"))
    eos = int(plain[0, -4])  # a token plain decoding emits early: the EOS of this call
    want = llama.generate(ids, do_sample=False, max_new_tokens=100_000, eos_token_id=eos, pad_token_id=2,
                          attention_mask=kwargs.get("attention_mask"))
    got = llama.generate(ids, assistant_model=llama_head, max_new_tokens=100_000, eos_token_id=eos, pad_token_id=2,
                         **kwargs)
    assert torch.equal(got, want) and got.shape[1] < ids.shape[1] + 12
    long = torch.randint(3, TINY["vocab_size"], (ids.shape[0], limit - 10), generator=g)
    kwargs.pop("attention_mask", None)
    mask = torch.ones_like(long) if mode == "batch" else None
    want = llama.generate(long, attention_mask=mask, do_sample=False, max_new_tokens=30, eos_token_id=None)
    got = llama.generate(long, attention_mask=mask, assistant_model=llama_head, max_new_tokens=30, eos_token_id=None,
                         **kwargs)
    assert want.shape[1] == limit + 20 and torch.equal(got, want)


@pytest.mark.parametrize("where", ["right", "middle"])
def test_padded_input_not_on_the_left(llama, llama_head, where):
    ids = prompts(1, seed=5)[0]
    mask = torch.ones_like(ids)
    mask[0, -1 if where == "right" else ids.shape[1] // 2] = 0
    with pytest.raises(ValueError, match="left padding only"):
        run(llama, llama_head, ids, attention_mask=mask)
    # an all-ones mask is fine
    ones = torch.ones_like(ids)
    assert torch.equal(run(llama, llama_head, ids, attention_mask=ones),
                       llama.generate(ids, attention_mask=ones, do_sample=False, max_new_tokens=4))


SYNTHID = dict(keys=[654, 400, 836, 123, 340, 443, 597, 160, 57, 29], ngram_len=3)


@pytest.mark.parametrize("call", ["tree", "chain", "batch", "custom_generate"])
def test_classifier_free_guidance(llama, llama_head, call):
    """guidance_scale's processor runs the target itself (its forward replaced the hidden states the head reads: a
    RuntimeError deep in the head); refused with the argument's name."""
    ids = prompts(1, seed=5)[0]
    kw = dict(do_sample=False, max_new_tokens=4, guidance_scale=1.5)
    with pytest.raises(ValueError, match="guidance_scale"):
        if call == "custom_generate":
            llama.generate(ids, custom_generate=dart_hf.dart_decode, dart_head=llama_head, **kw)
        else:
            llama.generate(ids.repeat(2, 1) if call == "batch" else ids, assistant_model=llama_head,
                           dart_mode="chain" if call == "chain" else "tree", **kw)


@pytest.mark.parametrize("call", ["chain", "batch"])
def test_synthid_watermarking_where_its_call_order_cannot_be_kept(llama, llama_head, call):
    """SynthID's processor keeps a per-row state that assumes one call per token for the whole batch: batches and
    chain mode call it otherwise, and gave other text than plain `generate`; one row in tree mode is exact
    (test_lossless.py)."""
    ids = prompts(1, seed=5)[0]
    kw = dict(max_new_tokens=4, watermarking_config=SynthIDTextWatermarkingConfig(**SYNTHID))
    match = "SynthID.*(a batch|assisted decoding)"
    with pytest.raises(ValueError, match=match):
        run(llama, llama_head, ids.repeat(2, 1) if call == "batch" else ids, mode=call.replace("batch", "tree"), **kw)


def test_inputs_embeds(llama, llama_head):
    """Tree mode prefills from input_ids: inputs_embeds beside them used to be ignored (other text than plain
    `generate` with soft prompts). Chain mode passes them on, and needs the ids the head drafts from."""
    ids = prompts(1, seed=5)[0]
    soft = llama.get_input_embeddings()(ids) + 0.5 * torch.randn(1, ids.shape[1], TINY["hidden_size"],
                                                                  generator=torch.Generator().manual_seed(0))
    for kw in (dict(inputs_embeds=soft), dict(input_ids=ids, inputs_embeds=soft)):
        with pytest.raises(ValueError, match="inputs_embeds is not supported"):
            llama.generate(**kw, assistant_model=llama_head, do_sample=False, max_new_tokens=4)
    with pytest.raises(ValueError, match="chain.*needs input_ids"):
        llama.generate(inputs_embeds=soft, assistant_model=llama_head, dart_mode="chain", max_new_tokens=4)
    kw = dict(input_ids=ids, inputs_embeds=soft, do_sample=False, max_new_tokens=8)
    plain = llama.generate(**kw)
    assert not torch.equal(plain, llama.generate(ids, do_sample=False, max_new_tokens=8))  # the embeddings matter
    assert torch.equal(llama.generate(**kw, assistant_model=llama_head, dart_mode="chain"), plain)


def test_custom_position_ids(llama, llama_head):
    """Plain `generate` feeds the target the caller's position_ids, the tree loop derives its own from the mask:
    only the ones `generate` would derive itself pass (a left-padded batch's included)."""
    ids = prompts(1, seed=5)[0]
    plain = llama.generate(ids, do_sample=False, max_new_tokens=4, return_dict_in_generate=True, output_logits=True)
    spread = torch.arange(ids.shape[1]).unsqueeze(0) * 3
    moved = llama.generate(ids, position_ids=spread, do_sample=False, max_new_tokens=4, return_dict_in_generate=True,
                           output_logits=True)
    assert not torch.allclose(plain.logits[0], moved.logits[0])  # plain generate uses them
    with pytest.raises(ValueError, match="custom position_ids"):
        run(llama, llama_head, ids, position_ids=spread)
    assert torch.equal(run(llama, llama_head, ids, position_ids=torch.arange(ids.shape[1]).unsqueeze(0)),
                       plain.sequences)
    rows = torch.cat([torch.full((1, 3), 2), ids[:, 3:]], dim=1).repeat(2, 1)
    mask = torch.ones_like(rows)
    mask[0, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    assert torch.equal(run(llama, llama_head, rows, attention_mask=mask, position_ids=positions),
                       llama.generate(rows, attention_mask=mask, do_sample=False, max_new_tokens=4))


@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
def test_per_token_attentions_or_hidden_states(llama, llama_head, flag):
    """A tree forward's attentions and hidden states are over draft nodes: refused in the output, not returned as
    None where plain `generate` returns them; without return_dict_in_generate the flag changes nothing."""
    with pytest.raises(ValueError, match="attentions or hidden states"):
        run(llama, llama_head, return_dict_in_generate=True, **{flag: True})
    assert torch.equal(run(llama, llama_head, **{flag: True}), run(llama, llama_head))


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_a_head_on_the_meta_device(llama, mode):
    """A head built or loaded without weights (`init_empty_weights`, device_map="meta") gets dart_hf's message, not
    torch's "Cannot copy out of meta tensor"."""
    head = make_head(llama).to("meta")
    with pytest.raises(ValueError, match="meta device"):
        run(llama, head, mode=mode)


@pytest.mark.parametrize("flag", ["output_hidden_states"])
def test_hidden_states_in_chain_mode(llama, llama_head, flag):
    """Chain mode asks the target for the layer inputs its head reads; returning hidden states too is refused."""
    with pytest.raises(ValueError, match="output_hidden_states"):
        run(llama, llama_head, mode="chain", return_dict_in_generate=True, **{flag: True})


def test_unknown_dart_mode(llama, llama_head):
    with pytest.raises(ValueError, match="dart_mode.*'bogus'"):
        run(llama, llama_head, mode="bogus")


def test_custom_generate_with_dart_head(llama, llama_head):
    with pytest.raises(ValueError, match="custom_generate"):
        run(llama, llama_head, custom_generate=dart_hf.dart_decode)


def test_dart_decode_without_head(llama):
    with pytest.raises(TypeError, match="dart_head"):
        llama.generate(prompts(1)[0], custom_generate=dart_hf.dart_decode, max_new_tokens=3)


# ---------------------------------------------------------------------------------------------- checkpoint folders
@pytest.fixture
def saved_head(llama, llama_head, tmp_path):
    path = tmp_path / "head"
    llama_head.save_pretrained(path)
    return path


def test_llama_folder_is_not_a_dart_head(llama, tmp_path):
    llama.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a DART head.*'llama'"):
        dart_hf.DartHead.from_pretrained(tmp_path)


@pytest.mark.parametrize("keep", [4, 60, -200])
def test_truncated_safetensors(saved_head, keep):
    file = saved_head / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:keep])
    with pytest.raises(ValueError, match="could not load a DART head"):
        dart_hf.DartHead.from_pretrained(saved_head)


def _rewrite(folder, edit):
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_key_is_named(saved_head):
    _rewrite(saved_head, lambda t: t.pop("midlayer.mask_rep"))
    with pytest.raises(ValueError, match="missing_keys.*midlayer.mask_rep"):
        dart_hf.DartHead.from_pretrained(saved_head)


def test_wrong_shape_key_is_named(saved_head):
    def shrink(tensors):
        tensors["fc.weight"] = tensors["fc.weight"][:, :100].contiguous()

    _rewrite(saved_head, shrink)
    with pytest.raises(ValueError, match="mismatched_keys.*fc.weight"):
        dart_hf.DartHead.from_pretrained(saved_head)


def test_unexpected_key_is_named(saved_head):
    _rewrite(saved_head, lambda t: t.update({"embed_tokens.weight": torch.zeros(96, 64)}))
    with pytest.raises(ValueError, match="unexpected_keys.*embed_tokens.weight"):
        dart_hf.DartHead.from_pretrained(saved_head)


def test_pickle_only_folder_is_refused(saved_head, monkeypatch):
    file = saved_head / "model.safetensors"
    torch.save(load_file(file), saved_head / "pytorch_model.bin")
    file.unlink()

    def no_pickle(*a, **k):
        raise AssertionError("torch.load must not be called on a DART checkpoint")

    monkeypatch.setattr(torch, "load", no_pickle)
    with pytest.raises(ValueError, match="model.safetensors"):
        dart_hf.DartHead.from_pretrained(saved_head)


def test_bad_config_json_is_refused(saved_head):
    cfg_file = saved_head / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["draft_length"] = 0
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="draft_length"):
        dart_hf.DartHead.from_pretrained(saved_head)


def test_missing_ngram_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="ngram.safetensors"):
        dart_hf.NGramModel.load(tmp_path / "ngram.safetensors")
    with pytest.raises(FileNotFoundError):
        dart_hf.NGramModel.load(tmp_path)  # a folder without the file


# ---------------------------------------------------------------------------------------------- DartConfig
@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(draft_length=0), "draft_length"),
        (dict(draft_length=-3), "draft_length"),
        (dict(aux_layer_ids=[1, 2]), "3 target layers"),
        (dict(aux_layer_ids=[1, 2, 3, 4]), "3 target layers"),
        (dict(aux_layer_ids=[2, 3, 6]), "out of range"),
        (dict(aux_layer_ids=[-1, 2, 3]), "out of range"),
        (dict(draft_vocab_size=97), "draft_vocab_size 97"),
        (dict(draft_vocab_size=0), "draft_vocab_size 0"),
    ],
)
def test_dart_config_validation(fields, message):
    base = dict(vocab_size=96, target_num_layers=6)
    dart_hf.DartConfig(**base)  # the base itself is valid
    with pytest.raises(ValueError, match=message):
        dart_hf.DartConfig(**{**base, **fields})


def test_dart_config_boundaries_are_valid():
    cfg = dart_hf.DartConfig(vocab_size=96, target_num_layers=6, draft_length=1, aux_layer_ids=[0, 3, 5],
                             draft_vocab_size=96)  # fmt: skip
    assert cfg.num_predictions == 2 and cfg.draft_vocab_size == 96


# ---------------------------------------------------------------------------------------------- unsupported targets
def test_from_target_on_a_gpt2_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, bos_token_id=0, eos_token_id=1))
    with pytest.raises(ValueError, match="'gpt2' target: its config has no intermediate_size.*Llama"):
        dart_hf.DartHead.from_target(gpt2)


# ---------------------------------------------------------------------------------------------- missing folders
@pytest.mark.parametrize("relative", ["./no_head", "tests_like/no_head", "a/b/c"])
def test_missing_local_folder_is_named_without_a_hub_lookup(tmp_path, monkeypatch, relative):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tests_like").mkdir()  # `tests_like/no_head` can only be a folder here: its first part exists

    def no_hub(*args, **kwargs):
        raise AssertionError("a path that can only be a local folder must not be looked up on the Hub")

    monkeypatch.setattr("transformers.utils.hub.hf_hub_download", no_hub)
    for path in (relative, str(tmp_path / "absent")):
        with pytest.raises(FileNotFoundError, match=f"no such folder: {path}"):
            dart_hf.DartHead.from_pretrained(path)


def test_missing_ngram_file_of_a_head_saved_with_one(llama, tmp_path):
    head = make_head(llama)
    head.ngram = dart_hf.NGramModel.build([prompts(1)[0][0].tolist()], order=2, vocab_size=96, progress=False)
    head.save_pretrained(tmp_path / "h")
    assert json.loads((tmp_path / "h" / "config.json").read_text())["has_ngram"] is True
    assert dart_hf.DartHead.from_pretrained(tmp_path / "h").ngram is not None
    (tmp_path / "h" / "ngram.safetensors").unlink()
    with pytest.raises(ValueError, match="no ngram.safetensors.*has_ngram: true"):
        dart_hf.DartHead.from_pretrained(tmp_path / "h")
    make_head(llama).save_pretrained(tmp_path / "plain")  # a head saved without one loads without one
    assert dart_hf.DartHead.from_pretrained(tmp_path / "plain").ngram is None


# ---------------------------------------------------------------------------------------------- command line
def _demo_args(**kw):
    return argparse.Namespace(**{"target": "smollm2-135m-instruct", "head": None, "prompt": None,
                                 "max_new_tokens": 4, "dtype": "float32", **kw})


@pytest.mark.parametrize(
    "run_cli, message",
    [
        (lambda: demo.run(_demo_args(head="/nonexistent")), "dart-hf demo: error: no such folder: /nonexistent"),
        (lambda: demo.run(_demo_args(target="no-such-target")), "'no-such-target' is neither a known target"),
        (lambda: demo.run(_demo_args(target="/")), "/ is not a model folder: it has no config.json"),
        (lambda: demo.run(_demo_args(max_new_tokens=0)), "dart-hf demo: error: --max-new-tokens must be at least 1"),
        (lambda: bench.main(build_parser().parse_args(["bench", "--n", "0"])), "--n must be at least 1"),
        (lambda: pipeline.run(build_parser().parse_args(["train", "--target", "no-such-target", "--out", "unused",
                                                         "--dtype", "float32"])), "dart-hf train: error: "),
    ],
    ids=["demo_head", "demo_target", "demo_not_a_model", "demo_zero_tokens", "bench_n0", "train_target"],
)
def test_cli_bad_input_is_an_error_message_not_a_traceback(capsys, run_cli, message):
    assert run_cli() == 2
    assert message in capsys.readouterr().err
