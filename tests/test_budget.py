"""Cost-aware node budget: counterfactual acceptance, the chooser, the cost cache (checked on measurement, on load and
in-run), `dart-hf calibrate`, the visible budget state, and lossless auto decoding."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch
from transformers import DynamicCache, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

import dart_hf
from conftest import make_head, make_target, prompts
from dart_hf_cli import main as cli
from dart_hf.core import budget as cost_model
from dart_hf.core.acceptance import accept_greedy
from dart_hf.core.budget import BudgetController, VerifyCost, accepted_for_budgets, path_ranks
from dart_hf.core.drafter import default_node_budget
from dart_hf.core.loop import _first_stop
from dart_hf.core.tree import TreeSearchParams, build_tree
from dart_hf.core.verify import compact_cache, verify_tree


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_HF_CACHE", str(tmp_path / "cache"))


def plain(target, ids, n):
    return target.generate(ids, do_sample=False, max_new_tokens=n)


def head_with_ngram(target, seed_prompts, **overrides):
    """A random head with wide beams plus an n-gram of the target's own text: multi-token acceptance happens,
    so the counterfactual is not trivially zero."""
    head = make_head(target, **{"tree_top_k": 96, "beam_width": 32, **overrides})
    seqs = [plain(target, p, 64)[0].tolist() for p in seed_prompts]
    head.ngram = dart_hf.NGramModel.build(seqs, order=3, vocab_size=target.config.vocab_size, progress=False)
    return head


# ---------------------------------------------------------------------------------------------------- counterfactual
def test_counterfactual_acceptance_equals_rebuilding_smaller_trees():
    """For every budget B' <= B, #{accepted path ranks < B'} equals the accepted length of the tree really rebuilt
    with budget B', verified by the target and accepted on (greedy). Draft logits: a noisy oracle of the target's
    own continuation, so accepted paths of many lengths (and cut-offs at every depth) occur."""
    target = make_target("llama")
    texts = prompts(3, seed=7)
    head = head_with_ngram(target, texts, tree_top_k=16, beam_width=6, draft_length=5)
    params = lambda b: TreeSearchParams.from_config(head.config, node_budget=b)
    budget, lengths, cut = 48, [], 0
    g = torch.Generator().manual_seed(0)
    for ids in texts:
        full = plain(target, ids, 80)[0]
        cache = DynamicCache(config=target.config)
        out = target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        seq = torch.cat([ids, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        for _ in range(6):
            past, n = cache.get_seq_length(), seq.shape[1]
            draft = 2.0 * torch.randn(head.config.num_predictions, target.config.vocab_size, generator=g)
            depth = torch.arange(head.config.num_predictions)
            draft[depth, full[n + depth]] += 3.0  # row d predicts the token d + 1 places after the root
            kw = dict(root_token=seq[0, -1], context=seq[0, -8:], ngram=head.ngram)
            actual = []
            for b in range(1, budget + 1):  # each smaller tree really rebuilt, verified, accepted on
                small = build_tree(draft, params=params(b), **kw)
                small.check_closed()
                actual.append(accept_greedy(small, verify_tree(target, small, cache, past)).path.numel() - 1)
                cache.crop(past - cache.get_seq_length())
            tree = build_tree(draft, params=params(budget), **kw)
            acc = accept_greedy(tree, verify_tree(target, tree, cache, past))
            predicted = accepted_for_budgets(path_ranks(tree, acc.path).tolist(), range(1, budget + 1))
            assert predicted.tolist() == actual
            assert actual[-1] == acc.path.numel() - 1
            lengths.append(actual[-1])
            cut += actual[0] < actual[-1]
            compact_cache(cache, past, acc.path)
            seq = torch.cat([seq, acc.tokens.view(1, -1)], dim=1)
        assert torch.equal(seq[0], full[: seq.shape[1]])  # the steps decoded the target's own greedy text
    assert len(set(lengths)) >= 3 and max(lengths) >= 3 and cut >= 3, (lengths, cut)


# ---------------------------------------------------------------------------------------------------- chooser
def feed(controller: BudgetController, increments: np.ndarray, cost, overhead: float, steps: int = 200):
    """Deterministic (stratified) observations at the largest budget: rank r is on the path in a fraction
    increments[r] of the steps, so E[accepted | B] = sum(increments[:B])."""
    b = controller.max_budget
    for i in range(steps):
        ranks = np.nonzero((i + 0.5) / steps < increments[:b])[0]
        controller.observe(ranks, b, step_seconds=overhead + float(cost(b + 1)))


def analytic_best(candidates, increments, cost, overhead):
    tps = [(1 + increments[:b].sum()) / (overhead + float(cost(b + 1))) for b in candidates]
    return candidates[int(np.argmax(tps))]


@pytest.mark.parametrize(
    "name, seconds, expect",
    [
        # CPU-like (SmolLM2-135M fp32 measured curve): verify grows fast, small trees pay
        ("cpu", [0.086, 0.095, 0.115, 0.135, 0.162, 0.185, 0.211, 0.245, 0.281, 0.36], "small"),
        # GPU-like: flat until ~64 tokens, then a knee
        ("gpu", [0.020, 0.020, 0.020, 0.0201, 0.0202, 0.0203, 0.0205, 0.021, 0.0215, 0.032], "large"),
    ],
)
def test_chooser_picks_the_best_budget_on_synthetic_curves(name, seconds, expect):
    cost = VerifyCost(sizes=[1, 2, 4, 8, 16, 24, 32, 48, 64, 96], seconds=seconds)
    increments = 0.75 * 0.93 ** np.arange(95)  # E[accepted | B] saturating around 10.7
    controller = BudgetController(cost, half_life=1e12)  # no discounting: the stratified feed is exact
    assert controller.candidates.tolist() == [1, 3, 7, 15, 23, 31, 47, 63, 95]
    feed(controller, increments, cost, overhead=0.004)
    expected = analytic_best(controller.candidates.tolist(), increments, cost, 0.004)
    assert controller.best() == expected
    assert np.allclose(controller.expected_accepted(), [increments[:b].sum() for b in controller.candidates], atol=0.02)
    assert controller.overhead == pytest.approx(0.004, rel=1e-6)
    assert (expected <= 31) if expect == "small" else (expected >= 47)


def run_controller(controller: BudgetController, cost: VerifyCost, steps: int) -> list[int]:
    """Budgets chosen over `steps` steps when only the best node is ever accepted."""
    chosen = []
    for _ in range(steps):
        b = controller.next_budget()
        chosen.append(b)
        controller.observe([0], b, step_seconds=0.01 + float(cost(b + 1)))
    return chosen


def test_controller_explores_then_exploits_and_revisits_twice_its_choice():
    flat = VerifyCost(sizes=[1, 8, 64], seconds=[0.1, 0.1, 0.1])  # GPU-like: a larger tree costs no more
    controller = BudgetController(flat, candidates=[4, 16, 40, 63], explore_steps=3, revisit_every=8)
    chosen = run_controller(controller, flat, 60)
    assert chosen[:3] == [63, 63, 63]
    assert controller.best() == 4
    rest = chosen[3:]
    assert rest.count(4) > 40 and 63 not in rest and 40 not in rest  # revisits 16 = smallest >= 2 * 4 + 1
    gaps = np.diff([i for i, b in enumerate(chosen) if b > 4])
    assert gaps.max() <= 8 and 16 in rest


def test_revisits_are_paced_by_their_extra_verify_time():
    """CPU-like: verifying 17 tokens costs 0.0375 s more than 5; at 2% of a 0.121 s step that is one revisit per 16
    steps instead of every 8."""
    cost = VerifyCost(sizes=[1, 8, 64], seconds=[0.1, 0.12, 0.3])
    controller = BudgetController(cost, candidates=[4, 16, 40, 63], explore_steps=3, revisit_every=8)
    chosen = run_controller(controller, cost, 80)
    assert controller.best() == 4
    period = controller.revisit_period(4, 16)
    extra, step = float(cost(17) - cost(5)), controller.overhead + float(cost(5))
    assert period == math.ceil(extra / (0.02 * step)) == 16
    gaps = np.diff([i for i, b in enumerate(chosen) if b == 16])
    assert len(gaps) >= 3 and set(gaps.tolist()) == {period}
    unpaced = BudgetController(cost, candidates=[4, 16, 40, 63], explore_steps=3, revisit_every=8, explore_share=0)
    assert set(np.diff([i for i, b in enumerate(run_controller(unpaced, cost, 80)) if b == 16]).tolist()) == {8}


def test_overhead_is_counted_per_budget():
    """A deeper tree costs more head and search time. E[accepted | 3] = 2.5, E[accepted | 7] = 3.5; with one shared
    overhead (~13 ms) budget 7 looks faster (4.5 / 75 ms > 3.5 / 63 ms), with each budget's own overhead (10 and
    16 ms) budget 3 is (3.5 / 60 ms > 4.5 / 78 ms)."""
    cost = VerifyCost(sizes=[1, 4, 8], seconds=[0.05, 0.05, 0.062])
    controller = BudgetController(cost, candidates=[3, 7], explore_steps=0, half_life=1e12)
    overhead = {3: 0.010, 7: 0.016}
    for i in range(40):
        b = 3 if i % 2 else 7
        ranks = [0, 1] if i % 4 < 2 else [0, 1, 2, 3, 4]
        controller.observe([r for r in ranks if r < b], b, step_seconds=overhead[b] + float(cost(b + 1)),
                           verify_seconds=float(cost(b + 1)))
    assert np.allclose(controller.expected_accepted(), [2.5, 3.5])
    assert np.allclose(controller.overhead_seconds(), [0.010, 0.016])
    assert controller.best() == 3
    shared = (1 + controller.expected_accepted()) / (controller.overhead + controller.verify_seconds())
    assert controller.candidates[int(np.argmax(shared))] == 7


def test_the_choice_sticks_while_the_best_is_within_the_switch_margin():
    cost = VerifyCost(sizes=[1, 8], seconds=[0.1, 0.1])
    controller = BudgetController(cost, candidates=[3, 7], explore_steps=0, revisit_every=10**6, half_life=1e12)
    controller.observe([0], 7, step_seconds=0.11)
    assert controller.next_budget() == 3  # equal estimates: the first candidate
    controller.observe([0, 3], 7, step_seconds=0.11)  # rank 3: budget 7 now accepts more, by 1 / 2 of a step
    assert controller.best() == 7 and controller.next_budget() == 7  # (1 + 1.5) / (1 + 1) = 1.25x: switches
    controller.current = 3
    controller.switch_margin = 0.3
    assert controller.next_budget() == 3  # 1.25x is within a 30% margin: stays


def test_a_stale_curve_sends_steps_only_to_untried_budgets_near_the_choice():
    """Each untried budget up to twice the choice's verify size is tried once; the far, dear ones (a 64-node verify
    costs several small steps on a CPU) are not."""
    cost = VerifyCost(sizes=[1, 2, 4, 8, 16, 32, 64], seconds=[0.05, 0.05, 0.05, 0.07, 0.1, 0.16, 0.3])
    controller = BudgetController(cost, explore_steps=1, revisit_every=10**6)
    assert controller.candidates.tolist() == [1, 3, 7, 15, 31, 63]
    chosen = []
    for _ in range(30):
        b = controller.next_budget()
        chosen.append(b)
        controller.stale = controller.stale or {"reason": "test"}  # as _check_curve sets it
        controller.observe([0], b, step_seconds=0.01 + float(cost(b + 1)), verify_seconds=float(cost(b + 1)))
    assert chosen[0] == 63 and controller.best() == 1
    assert set(chosen[1:]) == {1, 3}  # 3 = the only untried budget within twice the verify size of 1's (2 tokens)


def test_statistics_from_mixed_budgets_stay_monotone():
    cost = VerifyCost(sizes=[1, 32, 96], seconds=[0.01, 0.011, 0.02])
    controller = BudgetController(cost, candidates=[8, 31, 95])
    controller.observe([0, 9, 40], 95)
    controller.observe([0, 3], 8)
    controller.observe([], 31)
    e = controller.expected_accepted()
    assert np.all(np.diff(e) >= 0)
    # rank 0: 2 of the 3 steps; rank 3: 1 of the 3 steps that saw budget >= 4; rank 9: 1 of the 2 steps that saw
    # budget >= 10; rank 40: 1 of 1 (up to the discount of older steps)
    assert e == pytest.approx([2 / 3 + 1 / 3, 2 / 3 + 1 / 3 + 1 / 2, 2 / 3 + 1 / 3 + 1 / 2 + 1], rel=1e-2)


# ---------------------------------------------------------------------------------------------------- cost cache
@pytest.fixture
def no_curve_checks(monkeypatch):
    """Real tiny-model timings on a shared test machine fail the measurement checks at random; tests that are not
    about those checks (they are tested deterministically) switch them off."""
    monkeypatch.setattr(cost_model, "check_curve", lambda *args, **kwargs: [])


def counting_measure(monkeypatch) -> list:
    """Count real measurements (each returns the real measure_verify_cost's result)."""
    calls = []
    real = cost_model.measure_verify_cost

    def counting(*args, **kwargs):
        calls.append(kwargs.get("sizes"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cost_model, "measure_verify_cost", counting)
    return calls


def test_cost_cache_is_written_once_and_reused(tmp_path, monkeypatch, no_curve_checks):
    target = make_target("llama")
    calls = counting_measure(monkeypatch)
    first = cost_model.verify_cost(target, sizes=(1, 4, 8), repeats=1, verbose=False)
    files = list((tmp_path / "cache" / "cost").glob("*.json"))
    assert len(calls) == 1 and len(files) == 1 and first.path == str(files[0])
    data = json.loads(files[0].read_text())
    assert data["sizes"] == [1, 4, 8] and len(data["seconds"]) == 3 and all(s > 0 for s in data["seconds"])
    assert data["key"]["device"] == "cpu" and data["key"]["dtype"] == "float32"
    assert data["key"]["attn_implementation"] == "sdpa" and data["key"]["hidden_size"] == 64
    assert data["key"]["torch"] == torch.__version__  # a torch upgrade changes kernels: measured again
    # how and when it was measured, and that it passed its checks (or why not: it is then re-measured soon)
    assert data["past_len"] == 256 and data["repeats"] == 1 and abs(data["measured_at"] - time.time()) < 600
    assert set(data["sanity"]) == {"ok", "problems"} and data["attempts"] >= 1
    assert data["probe"]["size"] == 1 and len(data["probe"]["start"]) == len(data["probe"]["end"]) == 3

    mtime = files[0].stat().st_mtime_ns
    again = cost_model.verify_cost(target, verbose=False)  # any sizes: the cached ones
    assert len(calls) == 1 and again.seconds == first.seconds and files[0].stat().st_mtime_ns == mtime
    assert cost_model.verify_cost(make_target("llama", seed=3), verbose=False).seconds == first.seconds
    # other sizes asked for explicitly: measured again, same file (one curve per device configuration)
    cost_model.verify_cost(target, sizes=(1, 2), repeats=1, verbose=False)
    assert len(calls) == 2 and len(list((tmp_path / "cache" / "cost").glob("*.json"))) == 1

    # another attention implementation is another device configuration: measured and cached separately
    cost_model.verify_cost(make_target("llama", attn="eager"), sizes=(1, 4, 8), repeats=1, verbose=False)
    assert len(calls) == 3 and len(list((tmp_path / "cache" / "cost").glob("*.json"))) == 2


def fake_measure(monkeypatch, curves: list[tuple[list[float], tuple[float, float]]]) -> list:
    """measure_verify_cost returning the given (seconds per size, (probe start, probe end)) in turn."""
    calls = []

    def fake(target, sizes=cost_model.DEFAULT_SIZES, past_len=256, **kwargs):
        seconds, (start, end) = curves[min(len(calls), len(curves) - 1)]
        calls.append(list(sizes))
        record = {"measured_at": time.time(), "measured_past_len": past_len, "repeats": 5,
                  "probe": {"size": sorted(sizes)[0], "start": [start] * 3, "end": [end] * 3}}
        return VerifyCost(sorted(sizes), list(seconds), record=record)

    monkeypatch.setattr(cost_model, "measure_verify_cost", fake)
    return calls


def test_a_measurement_made_while_the_load_changed_is_measured_again(monkeypatch):
    target = make_target("llama")
    sizes = (1, 2, 4)
    busy = ([0.05, 0.06, 0.07], (0.01, 0.05))  # the 1-token probe took 5x longer at the end than at the start
    quiet = ([0.010, 0.011, 0.012], (0.010, 0.0105))
    calls = fake_measure(monkeypatch, [busy, quiet])
    cost = cost_model.verify_cost(target, sizes=sizes, verbose=False)
    assert len(calls) == 2 and cost.seconds == quiet[0]
    assert cost.record["attempts"] == 2 and cost.record["sanity"] == {"ok": True, "problems": []}

    # every attempt busy: the fastest reading per size, marked suspect, used for an hour at most
    jumpy = ([0.08, 0.011, 0.012], (0.010, 0.0101))  # 1 token 7x dearer than 2: measured during a busy spell
    calls = fake_measure(monkeypatch, [busy, jumpy, busy])
    cost = cost_model.verify_cost(target, sizes=sizes, refresh=True, verbose=False)
    assert len(calls) == 3 and cost.seconds == [0.05, 0.011, 0.012]
    assert not cost.record["sanity"]["ok"] and len(cost.record["sanity"]["problems"]) >= 1
    data = json.loads(open(cost.path).read())
    assert cost_model.cached_cost_problem(data) is not None  # its 1-token point still fails the shape check
    calls = fake_measure(monkeypatch, [quiet])
    data["seconds"] = [0.010, 0.011, 0.012]
    open(cost.path, "w").write(json.dumps(data))
    assert cost_model.verify_cost(target, verbose=False).seconds == [0.010, 0.011, 0.012] and not calls
    data["measured_at"] -= 2 * 3600  # a suspect curve two hours old: measured again
    open(cost.path, "w").write(json.dumps(data))
    assert cost_model.verify_cost(target, verbose=False).record["sanity"]["ok"] and len(calls) == 1


def test_a_cached_curve_with_one_absurd_point_is_measured_again(monkeypatch):
    """The curve of issue 10: 530 ms for 1 token (a busy first run), 62-86 ms otherwise. Not trusted on load."""
    target = make_target("llama")
    calls = counting_measure(monkeypatch)
    cost = cost_model.verify_cost(target, sizes=(1, 2, 4, 8), repeats=1, verbose=False)
    data = json.loads(open(cost.path).read())
    data.update(seconds=[0.530, 0.062, 0.070, 0.086], sanity={"ok": True, "problems": []})
    open(cost.path, "w").write(json.dumps(data))
    assert "1 tokens cost 530.0 ms" in cost_model.cached_cost_problem(data)
    again = cost_model.verify_cost(target, verbose=False)
    assert len(calls) >= 2 and again.seconds[0] < 0.5
    assert json.loads(open(cost.path).read())["seconds"] == again.seconds


def test_cached_curves_expire(monkeypatch):
    target = make_target("llama")
    calls = fake_measure(monkeypatch, [([0.010, 0.011], (0.010, 0.010))])
    cost = cost_model.verify_cost(target, sizes=(1, 2), verbose=False)
    data = json.loads(open(cost.path).read())
    data["measured_at"] -= cost_model.MAX_AGE_S - 60
    open(cost.path, "w").write(json.dumps(data))
    cost_model.verify_cost(target, verbose=False)
    assert len(calls) == 1
    data["measured_at"] -= 120
    open(cost.path, "w").write(json.dumps(data))
    cost_model.verify_cost(target, verbose=False)
    assert len(calls) == 2


def test_controller_corrects_a_wrong_curve_from_in_run_verify_times_and_marks_the_cache_stale(monkeypatch):
    """Deterministic: the cached curve says 100x what the verifies really take and favours large trees; the
    controller switches to this run's verify times, picks the budget the true times favour, and marks the file."""
    target = make_target("llama")
    true = VerifyCost(sizes=[1, 2, 4, 8, 16, 32, 64], seconds=[0.010, 0.011, 0.013, 0.02, 0.04, 0.08, 0.16])
    bad = [100 * s for s in [0.010, 0.0100, 0.0100, 0.0101, 0.0102, 0.0103, 0.0104]]  # flat: a GPU-like curve
    fake_measure(monkeypatch, [(bad, (1.0, 1.0))])
    cost = cost_model.verify_cost(target, sizes=true.sizes, verbose=False)
    controller = BudgetController(cost, explore_steps=2, revisit_every=4, half_life=1e12)
    increments = 0.8 * 0.9 ** np.arange(64)  # E[accepted | B] = sum(increments[:B])
    for i in range(80):
        b = controller.next_budget()
        ranks = np.nonzero((i % 10 + 0.5) / 10 < increments[:b])[0]
        controller.observe(ranks, b, step_seconds=0.002 + true(b + 1), verify_seconds=true(b + 1))
        if i == cost_model.STALE_MIN_STEPS - 2:
            assert controller.stale is None  # one window is not enough to decide
    assert controller.stale is not None and controller.stale["ratio"] < 0.2 and controller.stale["marked"]
    assert json.loads(open(cost.path).read())["stale"]["ratio"] == controller.stale["ratio"]
    assert controller.overhead == pytest.approx(0.002, rel=1e-6)
    tps = [(1 + increments[:b].sum()) / (0.002 + true(b + 1)) for b in controller.candidates]
    assert controller.best() == controller.candidates[int(np.argmax(tps))] <= 7
    # every budget it tried (the wrong curve's shape sends it to each in turn) is valued at its own verify time
    seen = [i for i, b in enumerate(controller.candidates) if len(controller.observed.get(int(b), ())) >= 3]
    assert len(seen) >= 3
    assert np.allclose(controller.verify_seconds()[seen], true(controller.candidates[seen] + 1), rtol=1e-9)


def test_poisoned_cache_is_detected_in_run_corrected_and_not_used_by_the_next_run(monkeypatch, no_curve_checks):
    """A real tiny target decoding with the auto budget on a cache file that says 100x the real verify times."""
    target = make_target("llama")
    texts = prompts(2, seed=7)
    head = head_with_ngram(target, texts, node_budget=None)
    calls = counting_measure(monkeypatch)
    real = cost_model.verify_cost(target, verbose=False)
    data = json.loads(open(real.path).read())
    poisoned = 100 * np.maximum.accumulate(data["seconds"])  # nondecreasing: passes the shape check on load
    data.update(seconds=poisoned.tolist(), sanity={"ok": True, "problems": []},
                measured_at=time.time())
    open(real.path, "w").write(json.dumps(data))
    for ids in texts:
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=60)
        assert torch.equal(out, plain(target, ids, 60))
    controller = cost_model.budget_controller(head, target)
    assert controller.cost.seconds == data["seconds"] and controller.steps >= cost_model.STALE_MIN_STEPS
    assert controller.stale is not None and controller.stale["ratio"] < 0.5 and controller.stale["marked"]
    assert np.all(controller.verify_seconds() < 0.5 * controller.verify_at)  # this run uses its own times
    assert json.loads(open(real.path).read())["stale"]["ratio"] == controller.stale["ratio"]
    # the next run (a fresh state, as a new process has) measures again instead of using the poisoned curve
    head.budget_state.reset()
    n_measured = len(calls)
    fresh = cost_model.budget_controller(head, target)
    assert len(calls) == n_measured + 1 and fresh.stale is None
    assert np.all(np.asarray(fresh.cost.seconds) < 0.5 * np.asarray(data["seconds"]))
    record = json.loads(open(real.path).read())
    assert "stale" not in record and record["replaced"]["stale"]["ratio"] == controller.stale["ratio"]
    assert record["confirmed"] is False


def test_a_curve_confirmed_by_remeasurement_is_not_marked_stale_again(monkeypatch):
    """A run whose verifies are all dearer (say a long context) marks the curve stale once; the re-measurement agrees
    with it, so later runs correct themselves in memory without sending every next run to measure again."""
    target = make_target("llama")
    curve = ([0.010, 0.011, 0.013], (0.01, 0.01))
    calls = fake_measure(monkeypatch, [curve])
    cost = cost_model.verify_cost(target, sizes=(1, 2, 4), verbose=False)
    for attempt in range(2):
        controller = BudgetController(cost, candidates=[1, 3])
        for _ in range(cost_model.STALE_MIN_STEPS):
            controller.observe([0], 3, verify_seconds=2.0 * cost(4))
        assert controller.stale is not None and controller.stale["marked"] == (attempt == 0)
        assert controller.verify_seconds()[1] == pytest.approx(2.0 * cost(4))
        cost = cost_model.verify_cost(target, verbose=False)
        assert len(calls) == 2 and cost.record["confirmed"] is True


# ---------------------------------------------------------------------------------------------------- state, calibrate
def test_budget_state_is_visible_persists_across_calls_and_resets():
    for hidden in ("_CONTROLLERS", "_MEMO", "reset_budget_stats"):  # no module-level state, no test-only reset
        assert not hasattr(cost_model, hidden)
    target = make_target("llama")
    texts = prompts(3, seed=7)
    head = head_with_ngram(target, texts, node_budget=None)
    gen = dict(assistant_model=head, do_sample=False, max_new_tokens=30)
    target.generate(texts[0], **gen)
    state = head.budget_state
    assert isinstance(state, cost_model.BudgetState) and len(state) == 1
    controller = cost_model.budget_controller(head, target)
    steps = controller.steps
    assert head.stats["node_budgets"][:4] == [controller.max_budget] * 4  # a cold start explores
    target.generate(texts[1], **gen)
    assert head.budget_state is state and cost_model.budget_controller(head, target) is controller
    assert controller.steps == steps + head.stats["steps"]  # the second call continued the same statistics
    target.generate(texts[1], dart_prompt_lookup=False, **gen)  # other trees: their own statistics
    assert len(state) == 2 and cost_model.budget_controller(head, target, prompt_lookup=False) is not controller

    other = cost_model.BudgetState()  # a state of one's own: separate statistics, the head's untouched
    mine = cost_model.budget_controller(head, target, state=other)
    assert mine is not controller and mine.steps == 0 and len(other) == 1 and len(state) == 2
    before = controller.steps
    target.generate(texts[2], dart_budget_state=other, **gen)  # generate(..., dart_budget_state=...) uses it
    assert mine.steps == head.stats["steps"] > 0 and controller.steps == before
    with pytest.raises(TypeError, match="BudgetState"):
        cost_model.budget_controller(head, target, state={})

    state.reset()
    assert len(state) == 0
    target.generate(texts[2], **gen)
    fresh = cost_model.budget_controller(head, target)
    assert fresh is not controller and fresh.steps == head.stats["steps"]
    assert head.stats["node_budgets"][:4] == [fresh.max_budget] * 4  # exploring again


def test_calibrate_writes_the_curve_that_a_later_run_uses(tmp_path, monkeypatch, capsys, no_curve_checks):
    from conftest import make_word_tokenizer
    from dart_hf.tools.assets import load_target

    folder = tmp_path / "tiny-target"
    make_target("llama").save_pretrained(folder)
    make_word_tokenizer().save_pretrained(folder)
    calls = counting_measure(monkeypatch)
    assert cli(["calibrate", str(folder), "--sizes", "1,2,4,8", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    files = list((tmp_path / "cache" / "cost").glob("*.json"))
    assert len(calls) == 1 and len(files) == 1 and str(files[0]) in out and "measured now" in out
    stored = json.loads(files[0].read_text())
    assert stored["sizes"] == [1, 2, 4, 8] and all(f"{1e3 * s:.2f}" in out for s in stored["seconds"])

    assert cli(["calibrate", str(folder)]) == 0  # cached: shown, not measured again
    assert len(calls) == 1 and "cached, measured" in capsys.readouterr().out

    target, _ = load_target(str(folder))  # a later run
    head = make_head(target, node_budget=None)
    ids = prompts(1)[0]
    assert torch.equal(target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=12),
                       plain(target, ids, 12))
    controller = cost_model.budget_controller(head, target)
    assert len(calls) == 1 and controller.cost.path == str(files[0])
    assert controller.cost.seconds == stored["seconds"] and controller.candidates.tolist() == [1, 3, 7]

    assert cli(["calibrate", str(folder), "--force", "--repeats", "1"]) == 0
    assert len(calls) == 2 and json.loads(files[0].read_text())["sizes"] == stored["sizes"]
    with pytest.raises(SystemExit):
        cli(["calibrate", str(folder), "--sizes", "0,x"])


def test_cost_curve_interpolates_and_extrapolates():
    cost = VerifyCost(sizes=[1, 4, 16], seconds=[1.0, 1.3, 2.5])
    assert cost(1) == 1.0 and cost(2) == pytest.approx(1.1) and cost(10) == pytest.approx(1.9)
    assert cost(28) == pytest.approx(3.7)  # last segment's slope (0.1 per token)
    assert np.allclose(cost(np.array([4, 16])), [1.3, 2.5])


# ---------------------------------------------------------------------------------------------------- decoding
def test_auto_budget_decoding_is_lossless_and_reports_budgets():
    target = make_target("llama")
    texts = prompts(4, seed=7)
    head = head_with_ngram(target, texts, node_budget=None)
    chosen = []
    for i, ids in enumerate(texts):
        n = [40, 25, 60, 9][i]
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=n)
        assert torch.equal(out, plain(target, ids, n)), f"prompt {i}: auto budget changed the output"
        stats = head.stats
        assert stats["budget_mode"] == "auto" and len(stats["node_budgets"]) == stats["steps"]
        chosen += stats["node_budgets"]
    controller = cost_model.budget_controller(head, target)
    assert chosen[:4] == [controller.max_budget] * 4  # exploration first
    assert set(chosen) <= set(controller.candidates.tolist()) and len(set(chosen)) > 1
    assert head.stats["node_budget"] == controller.best() == default_node_budget(head, target)
    # "auto" on a head with a fixed budget, and the fixed budget still reported as before
    fixed = make_head(target, node_budget=12)
    ids = texts[0]
    assert torch.equal(target.generate(ids, assistant_model=fixed, do_sample=False, max_new_tokens=20,
                                       dart_node_budget="auto"), plain(target, ids, 20))
    assert fixed.stats["budget_mode"] == "auto"
    target.generate(ids, assistant_model=fixed, do_sample=False, max_new_tokens=5)
    assert fixed.stats["node_budget"] == 12 and fixed.stats["node_budgets"] == [12] * fixed.stats["steps"]
    with pytest.raises(ValueError, match="auto"):
        target.generate(ids, assistant_model=fixed, do_sample=False, max_new_tokens=5, dart_node_budget="big")


def test_auto_budget_chain_mode_and_sampling_are_lossless():
    target = make_target("qwen3")
    head = make_head(target, node_budget=None)
    ids = prompts(1, seed=2)[0]
    out = target.generate(ids, assistant_model=head, dart_mode="chain", do_sample=False, max_new_tokens=20)
    assert torch.equal(out, plain(target, ids, 20))
    torch.manual_seed(0)
    ref = target.generate(ids, do_sample=True, max_new_tokens=1)  # sampling runs; exactness is test_sampling's job
    out = target.generate(ids, assistant_model=head, do_sample=True, max_new_tokens=30)
    assert out.shape[1] <= ids.shape[1] + 30 and ref.shape[1] == ids.shape[1] + 1


# ---------------------------------------------------------------------------------------------------- hot path
@pytest.mark.parametrize("max_length", [9, 11, 14, 40])
def test_first_stop_fast_path_matches_token_by_token_check(max_length):
    g = torch.Generator().manual_seed(max_length)
    for _ in range(30):
        ids = torch.randint(0, 12, (1, 10), generator=g)
        criteria = StoppingCriteriaList([MaxLengthCriteria(max_length), EosTokenCriteria([3, 7])])
        n_new = int(torch.randint(1, 6, (1,), generator=g))
        slow = next((j for j in range(n_new) if criteria(ids[:, : 10 - n_new + j + 1], None).any()), None)
        assert _first_stop(ids, n_new, criteria, None) == slow
