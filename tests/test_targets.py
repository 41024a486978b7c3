"""Targets as people load them: half precision, bitsandbytes 4-bit / 8-bit, `device_map="auto"`, and an image-text
model.

Each test loads the head the way a user would (`AutoModel.from_pretrained(head_dir, ...)`), readies it for the target
with `prepare_head`, and checks that DART's greedy output equals plain `generate` on the same target.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    BitsAndBytesConfig,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

import dart_hf
from conftest import make_head, make_target, prompts
from dart_hf.core.target import head_placement, module_device, prepare_head
from dart_hf.core.target import decoder_layers

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """A saved tiny Qwen3 target and a saved float32 head (wide tree, so drafts do get accepted)."""
    root = tmp_path_factory.mktemp("targets")
    target = make_target("qwen3")
    head = make_head(target, tree_top_k=48, beam_width=16, node_budget=32)
    target.save_pretrained(root / "target")
    head.save_pretrained(root / "head")
    return root / "target", root / "head"


def assert_lossless(target, head, n_prompts: int = 2) -> None:
    """DART == plain greedy on `n_prompts` prompts. The head drafts with an n-gram of the target's own greedy text,
    so the accepted-draft path (tree verify + cache compaction in this dtype / quantisation) really runs."""
    device = module_device(decoder_layers(target)[0])
    inputs = [ids.to(device) for ids in prompts(n_prompts, seed=21)]
    plain = [target.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS) for ids in inputs]
    vocab = target.config.vocab_size
    head.ngram = dart_hf.NGramModel.build([p[0].tolist() for p in plain], order=3, vocab_size=vocab, progress=False)
    accepted = []
    for ids, want in zip(inputs, plain):
        dart = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=NEW_TOKENS)
        assert torch.equal(dart, want), f"DART diverged from plain generate on a {target.dtype} target"
        accepted += head.stats["accepted_lengths"]
    assert max(accepted) > 1, "no draft was ever accepted: the test did not exercise tree acceptance"


# ---------------------------------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_target_and_head(folders, dtype):
    target_dir, head_dir = folders
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    head = AutoModel.from_pretrained(head_dir, dtype=dtype).eval()
    assert isinstance(head, dart_hf.DartHead) and head.dtype == dtype
    assert_lossless(target, head)


def test_prepare_head_casts_a_float32_head_to_the_target(folders):
    target_dir, head_dir = folders
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    head = prepare_head(AutoModel.from_pretrained(head_dir).eval(), target)
    assert head.dtype == torch.bfloat16 and head.device == target.device
    assert_lossless(target, head, n_prompts=1)


# ---------------------------------------------------------------------------------------------------- bitsandbytes
def _quantized_target(target_dir: Path, config: BitsAndBytesConfig):
    """Load the target quantised and run one forward; skip with the measured reason when bitsandbytes cannot."""
    try:
        import bitsandbytes  # noqa: F401

        target = AutoModelForCausalLM.from_pretrained(target_dir, quantization_config=config, device_map="cpu").eval()
        with torch.no_grad():
            target(torch.tensor([[3, 4, 5]]))
    except Exception as err:  # bitsandbytes reports a missing backend in many ways
        pytest.skip(f"bitsandbytes cannot run on this machine: {type(err).__name__}: {err}")
    return target


@pytest.mark.parametrize(
    "name, config",
    [
        ("nf4", BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)),
        ("int8", BitsAndBytesConfig(load_in_8bit=True)),
    ],
)
def test_bitsandbytes_target(folders, name, config):
    target_dir, head_dir = folders
    target = _quantized_target(target_dir, config)
    linear = decoder_layers(target)[0].mlp.up_proj
    assert type(linear).__module__.startswith("bitsandbytes"), f"{name}: the target was not quantised"
    head = prepare_head(AutoModel.from_pretrained(head_dir).eval(), target)
    assert head.dtype == target.get_input_embeddings().weight.dtype
    assert_lossless(target, head)


# ---------------------------------------------------------------------------------------------------- placement
def test_device_map_auto_target(folders):
    target_dir, head_dir = folders
    target = AutoModelForCausalLM.from_pretrained(target_dir, device_map="auto").eval()
    # CPU-only: accelerate puts everything on the CPU (no split to test here; see the next test for that logic)
    assert {p.device.type for p in target.parameters()} == {"cpu"}
    head = prepare_head(AutoModel.from_pretrained(head_dir).eval(), target)
    assert head.device == module_device(decoder_layers(target)[-1])
    assert_lossless(target, head)


def test_head_goes_beside_the_last_decoder_layer():
    """On a split target the head follows the last layer's execution device (accelerate hook), not target.device."""
    target = make_target("qwen3")
    layers = decoder_layers(target)
    layers[-1]._hf_hook = SimpleNamespace(execution_device=1)  # what accelerate sets for a layer placed on GPU 1
    assert head_placement(target) == (torch.device("cuda", 1), torch.float32)
    layers[-1]._hf_hook = SimpleNamespace(execution_device=torch.device("cpu"))
    assert module_device(layers[-1]) == torch.device("cpu")
    del layers[-1]._hf_hook
    assert module_device(nn.Linear(2, 2).to(torch.device("meta"))) == torch.device("meta")


# ---------------------------------------------------------------------------------------------------- image-text
IMAGE_TEXT = ["llava", "qwen2_vl", "qwen3_vl", "mllama", "gemma3", "paligemma", "idefics3"]
TINY_VISION = dict(hidden_size=32, embed_dim=32, intermediate_size=64, num_hidden_layers=1, depth=1,
                   num_attention_heads=2, num_heads=2, out_hidden_size=64, projection_dim=32)


def tiny_image_text_target(model_type: str):
    """A tiny random `AutoModelForImageTextToText` of `model_type`: the text model as the target matrix sizes it
    (4 layers, windows of 8), a one-layer vision tower."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from dart_hf.tools.targets import TINY, TINY_FIXES

    config = AutoConfig.for_model(model_type)
    text = config.get_text_config(decoder=True)
    layer_types = getattr(text, "layer_types", None)
    text_sizes = {**TINY, "vocab_size": 256, "num_hidden_layers": 4, **TINY_FIXES.get(text.model_type, {})}
    for sub, values in ((text, text_sizes), (getattr(config, "vision_config", None), TINY_VISION)):
        for name, value in values.items():
            if sub is not None and hasattr(sub, name):
                setattr(sub, name, value)
    if layer_types:
        text.layer_types = (list(layer_types) * 4)[: text.num_hidden_layers]
    if getattr(text, "sliding_window", None):
        text.sliding_window = 8
    if model_type == "qwen2_vl":  # multimodal RoPE: sections of the (tiny) rotary half
        text.rope_parameters = {**text.rope_parameters, "mrope_section": [2, 3, 3]}
    torch.manual_seed(0)
    target = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():  # a sharper random target: fewer near-ties between the two best logits
        target.get_output_embeddings().weight.mul_(4.0)
    target.generation_config.eos_token_id = None
    return target


@pytest.mark.parametrize("model_type", IMAGE_TEXT)
def test_image_text_targets_on_text_prompts(model_type):
    """Text-only prompts through the composite model's own forward (multimodal RoPE, cross-attention layers, prefix
    masks), tree and chain mode, with the target's own text as n-gram so that tree mode accepts multi-token paths."""
    target = tiny_image_text_target(model_type)
    ids = torch.randint(3, 200, (1, 16), generator=torch.Generator().manual_seed(1))
    kw = dict(do_sample=False, max_new_tokens=12)
    plain = target.generate(ids, **kw)
    head = dart_hf.DartHead.from_target(target, draft_length=4, tree_top_k=64, beam_width=16, node_budget=32,
                                        ngram_weight=8.0).eval()
    head.ngram = dart_hf.NGramModel.build([plain[0].tolist()], order=3, vocab_size=head.config.vocab_size,
                                          progress=False)
    assert torch.equal(target.generate(ids, assistant_model=head, **kw), plain)
    assert max(head.stats["accepted_lengths"]) > 1, "no multi-token path was accepted: tree compaction did not run"
    assert torch.equal(target.generate(ids, assistant_model=head, dart_mode="chain", **kw), plain)


def test_image_text_target():
    """A Llava target: text-only prompts decode in tree mode; with an image, tree mode (which feeds the target
    input_ids alone) refuses, naming the input, where it used to give other text; chain mode passes the image on."""
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0,
                       eos_token_id=1, pad_token_id=2)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14, projection_dim=32)
    target = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_id=120,
                                                       vision_feature_layer=-1)).eval()
    head = dart_hf.DartHead.from_target(target, draft_length=4).eval()
    g = torch.Generator().manual_seed(1)
    words = torch.randint(3, 100, (1, 12), generator=g)
    kw = dict(do_sample=False, max_new_tokens=10)
    assert torch.equal(target.generate(words, assistant_model=head, **kw), target.generate(words, **kw))
    ids = torch.cat([torch.tensor([[0]]), torch.full((1, 4), 120), words], dim=1)  # 4 image tokens: 2 x 2 patches
    image, other = torch.randn(2, 1, 3, 28, 28, generator=g)
    plain = target.generate(ids, pixel_values=image, **kw)
    assert not torch.equal(plain, target.generate(ids, pixel_values=other, **kw))  # the image matters
    with pytest.raises(ValueError, match="input_ids and attention_mask only.*images"):
        target.generate(ids, pixel_values=image, assistant_model=head, **kw)
    assert torch.equal(target.generate(ids, pixel_values=image, assistant_model=head, dart_mode="chain", **kw), plain)
