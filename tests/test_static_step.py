"""The static-cache step (`cache_implementation="static"`, `dart_hf.core.static_step`): lossless (greedy token for
token as plain `generate`; seeded sampling the same text as the eager loop at budget 0, DART's own draws), fixed
shapes that `torch.compile` captures whole (fullgraph, no recompilation across steps and calls), one host sync per
step, and the calls it cannot take running the eager loop with the reason in the stats.

Capture tests use dynamo with the "eager" backend (the graph is captured and checked, not code-generated: seconds, not
minutes); one test runs inductor on a tiny target, and the SmolLM2 tests (slow) run inductor on the real target.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

import dart_hf
from conftest import compile_config, left_padded, make_head, make_target, prompts, sliding_target, step_host_reads
from dart_hf.core import step as static_step

STATIC = dict(cache_implementation="static", disable_compile=True)  # the fixed-shape step, run eagerly


def assert_compiled_equals_plain(target, head, ids, config, new_tokens: int, budget: int) -> dart_hf.DartStats:
    """Compiled DART greedy == plain eager == plain static-cache compiled `generate`, token for token."""
    ref = target.generate(ids, do_sample=False, max_new_tokens=new_tokens)
    compiled_plain = target.generate(ids, do_sample=False, max_new_tokens=new_tokens, cache_implementation="static",
                                     compile_config=config)
    stats = dart_hf.DartStats()
    out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=new_tokens,
                          dart_node_budget=budget, cache_implementation="static", compile_config=config,
                          dart_stats=stats)
    assert stats.compiled
    assert torch.equal(compiled_plain, ref) and torch.equal(out, ref), (out, ref)
    return stats


@pytest.fixture(scope="module")
def qwen3():
    target = make_target("qwen3")
    return target, make_head(target)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("budget", [1, 3, 12])
def test_static_step_greedy_equals_plain(arch, budget):
    target = make_target(arch)
    head = make_head(target)
    accepted = []
    for ids in prompts(4, seed=budget):
        ref = target.generate(ids, do_sample=False, max_new_tokens=30)
        ref_static = target.generate(ids, do_sample=False, max_new_tokens=30, **STATIC)
        assert torch.equal(ref, ref_static)
        stats = dart_hf.DartStats()
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=30, dart_node_budget=budget,
                              dart_stats=stats, **STATIC)
        assert torch.equal(out, ref)
        assert stats.static and not stats.compiled and stats.static_reason is None  # greedy: all of it captured
        assert set(stats.node_budgets) == {budget}
        accepted.append(stats.mean_accepted_length)
    assert max(accepted) > 1.0  # drafts were accepted: the tree and commit paths ran, not only the root


def test_static_step_drafts_what_the_eager_loop_drafts(llama, llama_head):
    """Same trees, step for step: the accepted lengths of the fixed-shape step equal the eager loop's (n-gram-free
    head with prompt lookup, so the lookup over the fixed-size text buffer is exercised too)."""
    for ids in prompts(4, seed=7):
        lengths = []
        for extra in ({}, STATIC):
            stats = dart_hf.DartStats()
            llama.generate(ids, assistant_model=llama_head, do_sample=False, max_new_tokens=40, dart_node_budget=6,
                           dart_prompt_lookup=True, dart_stats=stats, **extra)
            lengths.append(stats.accepted_lengths)
        assert lengths[0] == lengths[1]


def test_static_step_stops_scores_and_processors_as_plain(llama, llama_head):
    """EOS inside an accepted path, max_length, output_scores and a repetition penalty (the eager acceptance walk
    between the step's parts)."""
    for ids in prompts(3, seed=11):
        ref = llama.generate(ids, do_sample=False, max_new_tokens=25, eos_token_id=[5, 9, 17],
                             repetition_penalty=1.3, output_scores=True, return_dict_in_generate=True)
        out = llama.generate(ids, assistant_model=llama_head, do_sample=False, max_new_tokens=25,
                             eos_token_id=[5, 9, 17], repetition_penalty=1.3, output_scores=True,
                             return_dict_in_generate=True, dart_node_budget=5, **STATIC)
        assert torch.equal(out.sequences, ref.sequences)
        assert len(out.scores) == len(ref.scores)
        for a, b in zip(out.scores, ref.scores):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


class Bias(LogitsProcessor):
    """A custom processor (not one the device walk runs): the acceptance walks the tree per row, eagerly."""

    def __call__(self, input_ids, scores):
        return scores + (torch.arange(scores.shape[-1], device=scores.device) % 3 == 0) * 0.5


@pytest.mark.parametrize("processor", ["config", "custom"])
def test_static_step_seeded_sampling_gives_the_eager_budget_0_text(processor):
    """The same seed gives the eager loop's text at budget 0 (DART's draws: not plain `generate`'s), through the
    captured step with the generation config's processors (the device walk inside the step), eagerly and compiled,
    and with a custom processor (the eager walk between the captured draft / verify and commit)."""
    target = make_target("llama")
    with torch.no_grad():
        target.lm_head.weight.div_(4.0)  # a soft distribution: many outcomes
    head = make_head(target)
    kw = dict(do_sample=True, temperature=0.8, top_k=20, max_new_tokens=24)
    for seed, ids in enumerate(prompts(3, seed=5)):
        if processor == "custom":
            kw["logits_processor"] = LogitsProcessorList([Bias()])
        torch.manual_seed(seed)
        ref = target.generate(ids, assistant_model=head, dart_node_budget=0, **kw)
        backends = [STATIC] + ([dict(cache_implementation="static", compile_config=compile_config())] if seed == 0
                               else [])
        for backend in backends:
            torch.manual_seed(seed)
            stats = dart_hf.DartStats()
            out = target.generate(ids, assistant_model=head, dart_node_budget=6, dart_stats=stats, **kw, **backend)
            assert torch.equal(out, ref), (seed, backend)
            assert stats.static and stats.compiled == ("compile_config" in backend)
            if processor == "custom":
                assert stats.acceptance == "walk" and "acceptance walks the tree eagerly" in stats.static_reason
            else:
                assert stats.acceptance == "device" and stats.static_reason is None, stats.static_reason
        torch.manual_seed(seed + 100)
        assert not torch.equal(target.generate(ids, assistant_model=head, dart_node_budget=6, **kw, **STATIC), ref)


def test_calls_the_static_step_cannot_take_run_over_a_dynamic_cache_and_say_why(llama, llama_head):
    # a batch whose acceptance is not on the device: a custom processor (sampled or not), or returned scores (a
    # sampled batch with the generation config's processors takes the static step: tests/test_sampling_device.py)
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    for kw in (dict(do_sample=True, logits_processor=LogitsProcessorList([Bias()])),
               dict(do_sample=False, logits_processor=LogitsProcessorList([Bias()])),
               dict(do_sample=True, output_scores=True, return_dict_in_generate=True)):
        stats = dart_hf.DartStats()
        llama.generate(ids, assistant_model=llama_head, max_new_tokens=12, dart_stats=stats, **kw, **STATIC)
        assert not stats.static and "decodes a batch or padded rows with the acceptance on the device" in \
            stats.static_reason, (kw, stats.static_reason)
    stats = dart_hf.DartStats()
    llama.generate(ids, assistant_model=llama_head, do_sample=True, max_new_tokens=12, dart_stats=stats, **STATIC)
    assert stats.static and stats.acceptance == "device" and stats.static_reason is None, stats.static_reason
    # node budget 0 (plain decoding) and a text past the context
    stats = dart_hf.DartStats()
    llama.generate(ids, assistant_model=llama_head, max_new_tokens=5, dart_node_budget=0, dart_stats=stats, **STATIC)
    assert "node budget 0" in stats.static_reason
    llama.generate(ids, assistant_model=llama_head, max_length=300, dart_stats=stats, **STATIC)
    assert "past the target's context" in stats.static_reason


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text", "gpt_oss"])
def test_sliding_window_targets_take_the_static_step_and_equal_plain(model_type):
    """Every layer of the static cache is full and the masks apply the windows (one per layer type), as over a
    dynamic cache: a window of 4 cuts in every step."""
    target = sliding_target(model_type)
    head = make_head(target)
    for seed in (1, 2):
        ids = torch.randint(3, 64, (1, 9), generator=torch.Generator().manual_seed(seed))
        stats = dart_hf.DartStats()
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=20, dart_stats=stats,
                              eos_token_id=None, dart_node_budget=6, **STATIC)
        assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=20, eos_token_id=None))
        assert stats.static and stats.static_reason is None, stats.static_reason


def test_a_dynamic_call_reports_no_static_step(llama, llama_head):
    stats = dart_hf.DartStats()
    llama.generate(torch.tensor([[5, 6, 7]]), assistant_model=llama_head, max_new_tokens=5, dart_stats=stats)
    assert not stats.static and not stats.compiled and stats.static_reason is None


# ------------------------------------------------------------------------------------------------ the captured step
def test_a_compiled_call_compiles_before_it_decodes_and_later_calls_of_its_shape_compile_nothing(caplog):
    """The first call of a shape makes its graphs on a twin of its state before its first decode step, says so in one
    log line (every graph of the call is made there), and decodes exactly; later calls of the shape make none."""
    import re

    target = make_target("llama", seed=11, num_hidden_layers=3)  # a shape no other test compiles
    head = make_head(target)
    kw = dict(assistant_model=head, do_sample=False, max_new_tokens=24, dart_node_budget=5,
              cache_implementation="static", compile_config=compile_config())
    for i, ids in enumerate(prompts(3, seed=71)):
        caplog.clear()
        graphs = counters["stats"]["unique_graphs"]
        with caplog.at_level("WARNING", logger="dart_hf.core.step"):
            out = target.generate(ids, **kw)
        made = counters["stats"]["unique_graphs"] - graphs
        lines = [r.getMessage() for r in caplog.records if "compiled the DART step" in r.getMessage()]
        assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=24))
        if i == 0:
            assert len(lines) == 1 and "before decoding" in lines[0], lines
            assert made >= 1 and int(re.search(r"(\d+) graph\(s\)", lines[0]).group(1)) == made, (lines, made)
        else:
            assert made == 0 and not lines, (made, lines)


def test_step_is_one_graph_with_no_recompilation_across_steps_and_calls(qwen3):
    """fullgraph=True (a graph break raises), and after the first capture, every further step of this call and of
    calls with other prompts runs the same graph (cache lengths are rounded: nearby lengths share it)."""
    target, head = qwen3
    config = compile_config()
    first = prompts(1, seed=20)[0]
    stats = dart_hf.DartStats()
    target.generate(first, assistant_model=head, do_sample=False, max_new_tokens=8, dart_node_budget=4,
                    cache_implementation="static", compile_config=config, dart_stats=stats)
    assert stats.compiled and stats.static
    graphs = counters["stats"]["unique_graphs"]
    steps = 0
    for ids in prompts(3, seed=21):
        ref = target.generate(ids, do_sample=False, max_new_tokens=40)
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=40, dart_node_budget=4,
                              cache_implementation="static", compile_config=config, dart_stats=stats)
        assert torch.equal(out, ref)
        steps += stats.steps
    assert steps >= 20
    assert counters["stats"]["unique_graphs"] == graphs, "a step was captured again (recompilation)"


def test_a_greedy_step_reads_back_once_and_hands_the_loop_host_tensors(qwen3, monkeypatch):
    target, head = qwen3
    reads, returned = step_host_reads(monkeypatch, static_step.DartStep)
    ids = prompts(1, seed=30)[0]
    target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=30, dart_node_budget=4,
                    cache_implementation="static", compile_config=compile_config())
    assert len(reads) >= 5
    assert all(r == ["tolist"] for r in reads), reads[:3]
    assert all(t.device.type == "cpu" for _, r in returned for t in (r.tokens, r.lengths))


def test_inductor_compiled_step_equals_plain_and_plain_compiled(qwen3):
    """The real compiler (inductor, C++ on this CPU): greedy output equals plain eager and plain static+compiled."""
    target, head = qwen3
    config = compile_config("inductor")
    for ids in prompts(2, seed=40):
        assert_compiled_equals_plain(target, head, ids, config, new_tokens=24, budget=6)


def test_static_call_leaves_the_generation_config_alone(llama, llama_head):
    config = GenerationConfig(max_new_tokens=6, do_sample=False, cache_implementation="static", disable_compile=True)
    before = config.to_dict()
    llama.generate(torch.tensor([[4, 5, 6]]), assistant_model=llama_head, generation_config=config)
    assert config.to_dict() == before


def test_dart_timing_captures_the_parts_and_times_them(qwen3):
    """dart_timing=True: draft (head + tree search), verify and accept captured one by one and timed; same text."""
    target, head = qwen3
    ids = prompts(1, seed=50)[0]
    stats = dart_hf.DartStats()
    out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=20, dart_node_budget=4,
                          cache_implementation="static", compile_config=compile_config(), dart_timing=True,
                          dart_stats=stats)
    assert torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=20))
    assert stats.compiled and {"draft", "verify", "accept"} <= set(stats.time) and "step" not in stats.time


# ------------------------------------------------------------------------------------------------ the real target
@pytest.mark.slow
def test_batched_compiled_step_on_smollm2_equals_plain_batched_generate():
    """SmolLM2-135M with the shipped head, a left-padded batch of 4 chat prompts (code and chat), inductor: every row
    equals plain batched `generate`, eager and static-cache compiled, drafting and at budget 0 (plain decoding)."""
    from dart_hf.tools.assets import load_target, shipped_head
    from dart_hf.tools.datasets import eval_prompts
    from dart_hf.tools.bench_timing import left_pad

    target, tok = load_target("smollm2-135m-instruct")
    head = dart_hf.DartHead.from_pretrained(shipped_head()).eval()
    ids, mask = left_pad(eval_prompts(tok, "humaneval", 2) + eval_prompts(tok, "sharegpt", 2), tok.pad_token_id)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=40)
    ref = target.generate(ids, **kw)
    config = compile_config("inductor")
    assert torch.equal(target.generate(ids, cache_implementation="static", compile_config=config, **kw), ref)
    stats = dart_hf.DartStats()
    out = target.generate(ids, assistant_model=head, dart_node_budget=4, cache_implementation="static",
                          compile_config=config, dart_stats=stats, **kw)
    assert stats.compiled and stats.static and torch.equal(out, ref)
    assert stats.steps < 0.8 * (out.shape[1] - ids.shape[1])  # fewer steps than plain batched decoding: drafts accepted
    plain = dart_hf.DartStats()  # budget 0 on a static cache: the whole call is plain decoding (transformers' loop)
    out = target.generate(ids, assistant_model=head, dart_node_budget=0, cache_implementation="static",
                          compile_config=config, dart_stats=plain, **kw)
    assert plain.node_budget == 0 and plain.compiled and torch.equal(out, ref)


@pytest.mark.slow
def test_compiled_step_on_smollm2_equals_plain_eager_and_compiled():
    """SmolLM2-135M with the shipped head, inductor: greedy token for token as plain eager `generate` and plain
    static-cache compiled `generate`; seeded sampling through the captured step (the device walk) gives the eager
    loop's text at budget 0."""
    from dart_hf.tools.assets import load_target, shipped_head
    from dart_hf.tools.datasets import eval_prompts

    target, tok = load_target("smollm2-135m-instruct")
    head = dart_hf.DartHead.from_pretrained(shipped_head()).eval()
    config = compile_config("inductor")
    accepted = []
    for dataset in ("humaneval", "sharegpt"):
        ids = eval_prompts(tok, dataset, 1)[0]
        stats = assert_compiled_equals_plain(target, head, ids, config, new_tokens=48, budget=4)
        accepted.append(stats.mean_accepted_length)
    assert min(accepted) > 1.3  # the head's drafts are accepted through the captured step
    kw = dict(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=24)
    torch.manual_seed(0)
    ref = target.generate(ids, assistant_model=head, dart_node_budget=0, **kw)
    torch.manual_seed(0)
    stats = dart_hf.DartStats()
    out = target.generate(ids, assistant_model=head, dart_node_budget=4, cache_implementation="static",
                          compile_config=config, dart_stats=stats, **kw)
    assert stats.compiled and stats.acceptance == "device"
    assert torch.equal(out, ref), (tok.decode(out[0, ids.shape[1]:]), tok.decode(ref[0, ids.shape[1]:]))


def test_each_shape_keeps_its_graph_and_past_dynamos_limit_a_step_runs_uncompiled_and_says_so(qwen3):
    """Every shape (tree size, rows, cache slots) compiles its own copy of the step, so shapes never share dynamo's
    limit of graphs per function; a copy re-captured past the limit (here: other sampling settings, a guard of the
    same shape) raises before running, and the call goes on with the static step uncompiled, exactly."""
    import torch._dynamo

    target, head = qwen3
    ids = prompts(1, seed=60)[0]
    ref = target.generate(ids, do_sample=False, max_new_tokens=12)
    torch._dynamo.reset()  # this test's graphs only
    kw = dict(assistant_model=head, max_new_tokens=12, cache_implementation="static", compile_config=compile_config())
    with torch._dynamo.config.patch(recompile_limit=1):
        for budget in (2, 3, 5):  # three shapes: a graph each
            stats = dart_hf.DartStats()
            out = target.generate(ids, do_sample=False, dart_node_budget=budget, dart_stats=stats, **kw)
            assert torch.equal(out, ref) and stats.compiled, stats.static_reason
        texts = []
        for temperature in (0.7, 0.9):  # budget 2 again, sampled: a new graph; then another guard of that shape
            torch.manual_seed(1)
            texts.append(target.generate(ids, do_sample=True, temperature=temperature, dart_node_budget=2,
                                         dart_stats=stats, **kw))
            torch.manual_seed(1)
            assert torch.equal(texts[-1], target.generate(ids, assistant_model=head, do_sample=True,
                                                          temperature=temperature, max_new_tokens=12,
                                                          dart_node_budget=0))
    assert stats.static and not stats.compiled and "refused another graph of decode_step" in stats.static_reason


def test_cuda_graphs_stay_off_for_the_dart_step_until_a_gpu_run_validates_them(monkeypatch):
    """transformers' default compile mode on CUDA is "reduce-overhead" (CUDA graphs), never run on the DART step:
    the step compiles without them and says so; DART_HF_CUDA_GRAPHS=1 opts in; other modes pass unchanged."""
    options, reason = static_step.compile_options({"fullgraph": True, "mode": "reduce-overhead"})
    assert options == {"fullgraph": True, "mode": None} and "CUDA graphs" in reason
    assert static_step.compile_options({"mode": None}) == ({"mode": None}, None)
    monkeypatch.setattr(static_step, "CUDA_GRAPHS", True)
    assert static_step.compile_options({"mode": "reduce-overhead"}) == ({"mode": "reduce-overhead"}, None)


# ------------------------------------------------------------------------------------------------ batches
@pytest.mark.parametrize("case", ["eos", "no eos", "max_length", "stopping criteria"])
def test_a_left_padded_batch_takes_the_static_step_and_equals_plain_batched_generate(llama, llama_head, case):
    """Every row of a greedy left-padded batch on the static step equals plain batched generate's: rows of different
    padding finishing at different steps (EOS ids inside accepted paths, no EOS: rows decode to the longest stop,
    max_length, custom stopping criteria per row; stop strings: tests/test_batch.py)."""
    kw = {"eos": dict(eos_token_id=[5, 9, 17], max_new_tokens=30), "no eos": dict(eos_token_id=None, max_new_tokens=30),
          "max_length": dict(max_length=33), "stopping criteria": dict(max_new_tokens=30)}[case]
    for seed in range(2):
        ids, mask = left_padded((9, 3, 14, 6), seed=seed + 10)
        if case == "stopping criteria":
            stop = StoppingCriteriaList([StopAfter(5, ids.shape[1] + 4), StopAfter(11, ids.shape[1] + 2)])
            kw = dict(max_new_tokens=30, stopping_criteria=stop)
        ref = llama.generate(ids, attention_mask=mask, do_sample=False, **kw)
        stats = dart_hf.DartStats()
        out = llama.generate(ids, attention_mask=mask, assistant_model=llama_head, do_sample=False, dart_node_budget=6,
                             dart_stats=stats, **kw, **STATIC)
        assert stats.static and stats.static_reason is None
        assert torch.equal(out, ref), (out, ref)
        assert stats.mean_accepted_length > 1.0


class StopAfter(StoppingCriteria):
    """Stops a row once it holds `token` past position `start` (a criterion off the fast path, per row)."""

    def __init__(self, token: int, start: int):
        self.token, self.start = token, start

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids[:, self.start :] == self.token).any(dim=1)


def test_the_batched_static_step_is_captured_whole_reads_back_once_and_is_not_recaptured(qwen3, monkeypatch):
    """A left-padded batch of 4 compiles with fullgraph=True, reads the device once per step, and over 20+ steps of
    calls of nearby lengths (one bucket) captures no new graph."""
    target, head = qwen3
    config = compile_config()
    ids, mask = left_padded((7, 3, 12, 5), seed=50)
    kw = dict(attention_mask=mask, do_sample=False, dart_node_budget=4, cache_implementation="static",
              compile_config=config)
    stats = dart_hf.DartStats()
    target.generate(ids, assistant_model=head, max_new_tokens=8, dart_stats=stats, **kw)
    assert stats.compiled and stats.static
    graphs, steps = counters["stats"]["unique_graphs"], 0
    for seed, new in ((51, 30), (52, 36)):
        ids, mask = left_padded((7, 3, 12, 5), seed=seed)
        ref = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new)
        out = target.generate(ids, assistant_model=head, max_new_tokens=new, dart_stats=stats,
                              **{**kw, "attention_mask": mask})
        assert torch.equal(out, ref)
        steps += stats.steps
    assert steps >= 20
    assert counters["stats"]["unique_graphs"] == graphs, "a step was captured again (recompilation)"
    # counted after the capture: a torch function mode is another graph context
    reads, _ = step_host_reads(monkeypatch, static_step.DartStep)
    target.generate(ids, assistant_model=head, max_new_tokens=20, **{**kw, "attention_mask": mask})
    assert len(reads) >= 3 and all(r == ["tolist"] for r in reads), reads[:3]


def test_one_rounding_rule_sizes_every_buffer_of_a_step():
    """Every fixed buffer (head keys/values, text, the target's cache) is sized from one bucket of max_length, so
    max_lengths that share a bucket get the same shapes (one graph), and none falls between two roundings."""
    from dart_hf.core.drafter import bucket

    target = make_target("llama", max_position_embeddings=1024)
    head = make_head(target)
    ids = prompts(1, seed=3)[0]
    shapes = {}
    for max_length in (230, 240, 247, 256, 257):
        config = GenerationConfig(max_length=max_length, do_sample=False, eos_token_id=None)
        config._eos_token_tensor = None
        step, reason = static_step.fixed_step(target, head, ids, None, config, (8,), True, [0, 3, 5], True)
        assert reason is None
        shapes[max_length] = (step.cache.layers[0].max_cache_len, tuple(step.drafter.kv.k.shape), tuple(step.drafter.text.shape))
    assert bucket(240) == bucket(247) == bucket(256) == 256 and bucket(257) == 512
    assert shapes[230] == shapes[240] == shapes[247] == shapes[256] != shapes[257]
