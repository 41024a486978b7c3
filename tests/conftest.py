"""Tiny random targets and heads for fast CPU tests.

`make_target` / `sliding_target` build a fresh target (for tests that change it); the session fixture `tiny_target`
hands out one shared target per name (built on first use; tests must not change it): "llama", "qwen2", "qwen3" (the
TINY shape below), the sliding-window "mistral", "gemma2", "gemma3_text", "gpt_oss", "soft_llama" (a softer
distribution, for sampling) and "word_llama" (over `stop_word_tokenizer`'s vocabulary, for stop strings and
pipelines)."""

from __future__ import annotations

import os

# Under pytest-xdist (pyproject's addopts: a worker per core) each worker gets its share of the CPU threads: torch's
# default of a thread per core in every worker oversubscribes the CPU and the suite ran several times slower. The
# environment variables reach the tests' subprocesses too.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
WORKER_THREADS = max(1, (os.cpu_count() or 1) // WORKERS) if WORKERS else None
if WORKER_THREADS:
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(WORKER_THREADS)

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.overrides import TorchFunctionMode
from transformers import (AutoModelForCausalLM, DynamicCache, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen3Config)

import dart_hf
from dart_hf.core.step import RowSlots, commit, decode_cache
from dart_hf.core.target import cache_kwargs
from transformers.generation.configuration_utils import CompileConfig

if WORKER_THREADS:
    torch.set_num_threads(WORKER_THREADS)

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}


def scripted_budgets(target, head, script: list[int], prompt_lookup: bool | None = None):
    """A `BudgetState` whose policy for (`target`, `head`'s prompt lookup) returns the step budgets of `script` in turn
    (one row or a batch alike) and records every step it observes (`.observed`: (rows, budget)): the cost-aware call's
    budgets without timing, through the public `dart_budget_state` argument."""
    from dart_hf.core.budget import BudgetPolicy, BudgetState

    class Scripted(BudgetPolicy):
        def __init__(self):
            super().__init__()
            self.turn, self.observed = 0, []

        def next_budget(self, rows: int = 1, call=None) -> int:
            self.turn += 1
            return script[(self.turn - 1) % len(script)]

        def observe(self, rows, budget, *rest, **kw) -> None:
            self.observed.append((rows, budget))
            super().observe(rows, budget, *rest, **kw)

    state = BudgetState()
    lookup = head.config.prompt_lookup if prompt_lookup is None else prompt_lookup
    scripted = Scripted()
    for sampled in (False, True):  # the keys a greedy and a sampled call look up
        state.policy(target, lookup, sampled)
    for key in state.policies:
        state.policies[key] = scripted
    return state, scripted


def word_llama():
    """A tiny Llama over `make_word_tokenizer`'s vocabulary."""
    return make_target("llama", vocab_size=len(make_word_tokenizer()))


@pytest.fixture()
def target_folder(tmp_path):
    """A tiny Llama over the word tokenizer's vocabulary, saved with the tokenizer (chat template included): a target
    folder the CLI commands take."""
    folder = tmp_path / "tiny-target"
    word_llama().save_pretrained(folder)
    make_word_tokenizer().save_pretrained(folder)
    return folder


def make_target(arch: str = "llama", seed: int = 0, attn: str = "sdpa", **overrides):
    torch.manual_seed(seed)
    cfg = CONFIGS[arch](**{**TINY, **overrides})
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    # a sharper random target: greedy continuations are less uniform, closer to a real LM
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@torch.no_grad()
def prefilled(target, prefix: torch.Tensor) -> DynamicCache:
    """A cache holding `prefix`, from one target forward (the state a verify step starts from: every layer full,
    as a DART call keeps it, `step.decode_cache`)."""
    cache = decode_cache(target.config)
    target(input_ids=prefix, use_cache=True, **cache_kwargs(target, cache))
    return cache


def compact_cache(target, cache: DynamicCache, past_len: int, path: torch.Tensor) -> None:
    """Keep the accepted `path` (tree node indices, root first) of the tree verified after `past_len` committed
    tokens, as a DART step commits it (`step.commit` on one row)."""
    end = torch.tensor([past_len])
    commit(cache, RowSlots.of([0], 1 << 30, "cpu"), end, past_len, path.view(1, -1), torch.tensor([path.numel()]),
           past_len + path.numel())


def check_closed(tree) -> None:
    """Every node's parent is in the tree and comes before it; depths agree with parents."""
    idx = torch.arange(tree.size)
    assert bool((tree.parents[1:] < idx[1:]).all()), "a parent must precede its child"
    assert bool((tree.depths[1:] == tree.depths[tree.parents[1:]] + 1).all()), "depth must be parent depth + 1"


def accept_greedy(tree, logits: torch.Tensor):
    """Greedy acceptance of one tree (`accept_nodes` on a batch of one): (path, new tokens)."""
    from dart_hf.core.acceptance import accept_nodes
    from dart_hf.core.tree import DraftTrees

    step = accept_nodes(DraftTrees.stack([tree]), logits.unsqueeze(0))
    n = int(step.lengths[0])
    return step.paths[0, :n], step.tokens[0, :n]


def make_head(target, seed: int = 1, draft_length: int = 4, **overrides) -> dart_hf.DartHead:
    torch.manual_seed(seed)
    return dart_hf.DartHead.from_target(target, draft_length=draft_length, **overrides).eval()


def prompts(n: int, vocab: int = TINY["vocab_size"], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (1, int(torch.randint(1, 24, (1,), generator=g))), generator=g) for _ in range(n)]


SLIDING = ["mistral", "gemma2", "gemma3_text", "gpt_oss"]  # all layers sliding (Mistral), or sliding and full
SLIDING_WINDOW = 4  # much shorter than prompt + output: the window cuts in every step


def sliding_target(model_type: str, attn: str | None = None, window: int = SLIDING_WINDOW, vocab: int = 64,
                   layers: int = 4, **overrides):
    """A tiny sliding-window target (`dart_hf.tools.targets.tiny_config`), SDPA where the type has it."""
    from dart_hf.tools.targets import tiny_config

    torch.manual_seed(0)
    config = tiny_config(model_type, sliding_window=window, vocab_size=vocab, num_hidden_layers=layers, **overrides)
    cls = type(AutoModelForCausalLM.from_config(config))  # (tiny: cheap) its class says which attention it has
    if attn is None:
        attn = "sdpa" if cls._supports_sdpa else "eager"
    elif not {"sdpa": cls._supports_sdpa, "flex_attention": cls._supports_flex_attn}.get(attn, True):
        pytest.skip(f"{model_type} has no {attn} attention")
    target = AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(4.0)
    kinds = {type(layer).__name__ for layer in DynamicCache(config=target.config).layers}
    assert "DynamicSlidingWindowLayer" in kinds, f"{model_type}: no sliding layer in the tiny target"
    return target


def soft_target(arch: str = "llama"):
    """A softer distribution than `make_target`'s: sampling has many outcomes and long trees still accept tokens."""
    target = make_target(arch)
    with torch.no_grad():
        target.lm_head.weight.div_(4.0)
    return target


def word_target():
    """A tiny Llama over `stop_word_tokenizer`'s vocabulary (EOS 1, padding 0)."""
    return make_target("llama", vocab_size=len(stop_word_tokenizer()), eos_token_id=1, pad_token_id=0,
                       bos_token_id=None)


def _build_tiny(name: str):
    if name in CONFIGS:
        return make_target(name)
    if name in SLIDING:
        target = sliding_target(name)
        target.generation_config.eos_token_id = None  # random greedy text often starts with EOS
        return target
    if name == "soft_llama":
        return soft_target("llama")
    if name == "word_llama":
        return word_target()
    raise KeyError(name)


@pytest.fixture(scope="session")
def tiny_target():
    """tiny_target(name) -> the session's one target of that name (see the module docstring); never change it."""
    built = {}

    def get(name: str):
        if name not in built:
            built[name] = _build_tiny(name)
        return built[name]

    return get


@pytest.fixture(scope="session")
def llama(tiny_target):
    return tiny_target("llama")


@pytest.fixture(scope="session")
def llama_head(llama):
    return make_head(llama)


WORDS = [f"w{i}" for i in range(100)]


def make_word_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer over 105 whole-word tokens with a chat template (ids 0-4 are special)."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", "<user>", "<assistant>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tok.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tok


def stop_word_tokenizer() -> PreTrainedTokenizerFast:
    """Whole-word tokens, plus "abcdef": the probe `StopStringCriteria` tokenizes to learn how tokens print."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *WORDS, "abcdef"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(autouse=True, scope="module")
def fresh_compiler():
    """Each test module starts with dynamo's caches empty, so its graphs count alone against dynamo's limit of 8 per
    function and process (`decode_step`'s graphs of earlier modules in the same xdist worker would push it over)."""
    torch._dynamo.reset()


@pytest.fixture()
def fresh_compiler_per_test():
    """Dynamo's caches emptied before the test, for modules whose cost-aware compiled calls compile the sizes their
    policy times: how many depends on the machine's load, so graphs an earlier test of the module left could push a
    later one past dynamo's limit of 8 per function (a CI flake on a busy machine). Such modules use it for every
    test (`pytestmark = pytest.mark.usefixtures("fresh_compiler_per_test")`)."""
    torch._dynamo.reset()


@pytest.fixture()
def private_cache(tmp_path, monkeypatch):
    """The test's own dart_hf cache (verify-cost curves, head downloads): nothing read from or left in the user's."""
    monkeypatch.setenv("DART_HF_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def bench_tiny():
    """A tiny llama target and its head with a 16-node budget, for the bench's end-to-end tests."""
    target = make_target("llama")
    return target, make_head(target, node_budget=16)


def compile_config(backend: str = "eager") -> CompileConfig:
    """What a CPU user passes to compile (transformers compiles on CUDA only unless told otherwise)."""
    config = CompileConfig(backend=backend, mode=None)
    config._compile_all_devices = True
    return config


def left_padded(lengths, seed: int, vocab: int = 96) -> tuple[torch.Tensor, torch.Tensor]:
    from dart_hf.tools.bench_timing import left_pad

    g = torch.Generator().manual_seed(seed)
    return left_pad([torch.randint(3, vocab, (1, n), generator=g) for n in lengths], pad_id=2)


class HostSyncs(TorchFunctionMode):
    """Counts the tensor operations that read a value back to the host (on a GPU: a sync each): value reads, and
    copies from a non-CPU device to the CPU (none can happen on this machine's CPU tensors)."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        copy = name in ("to", "cpu") and isinstance(args[0], torch.Tensor) and args[0].device.type != "cpu"
        if name in self.READS or copy:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def step_host_reads(monkeypatch, backend) -> tuple[list[list[str]], list]:
    """Record, per call of `DartStep.step` from now on, the host reads it makes
    (`HostSyncs`) and what it returns: (reads, results), lists the steps fill."""
    reads, results, step = [], [], backend.step

    def counted(self, *args, **kwargs):
        with HostSyncs() as mode:
            result = step(self, *args, **kwargs)
        reads.append(mode.reads)
        results.append(result)
        return result

    monkeypatch.setattr(backend, "step", counted)
    return reads, results
