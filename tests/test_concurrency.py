"""A DART call changes nothing outside itself: several threads calling `generate` on ONE target with ONE head (a web
server's thread pool), DART and plain calls side by side, get what each would get alone; a call that raises half-way
leaves the target and the head as they were. (No timing anywhere: every assertion is about tokens and logits.)"""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from conftest import make_head, make_target, prompts

NEW = 16


@pytest.fixture
def fast_switching():
    """Switch threads every 10 microseconds (default 5 ms), so the calls' steps interleave as finely as they can."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


def plain_logits(target, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    out = target.generate(ids, do_sample=False, max_new_tokens=NEW, return_dict_in_generate=True, output_logits=True,
                          **kwargs)
    return out.sequences, torch.stack(out.logits)


def run_together(jobs: list, rounds: int) -> list:
    """Run every job (a no-argument callable) `rounds` times, all jobs of a round at once, one thread each."""
    results = []
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for _ in range(rounds):
            barrier = threading.Barrier(len(jobs))
            results.append([f.result() for f in [pool.submit(lambda j=j: (barrier.wait(), j())[1]) for j in jobs]])
    return results


def test_dart_and_plain_calls_in_threads_on_one_target_give_what_each_gives_alone(fast_switching):
    """Tree mode, chain mode and a left-padded batch with one shared head, beside two plain calls, on one target:
    every DART output equals plain `generate`'s, and the plain calls' logits are bit-equal to a solo run."""
    target = make_target("qwen3")
    head = make_head(target, node_budget=6)
    singles = prompts(3, seed=81)
    batch = torch.nn.utils.rnn.pad_sequence([p[0].flip(0) for p in prompts(2, seed=82)], batch_first=True,
                                            padding_value=2).flip(1)
    mask = (batch != 2).long()
    solo = [target.generate(p, do_sample=False, max_new_tokens=NEW) for p in singles]
    solo_batch = target.generate(batch, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=2)
    solo_plain = [plain_logits(target, p) for p in singles[:2]]

    jobs = [
        lambda: target.generate(singles[0], assistant_model=head, do_sample=False, max_new_tokens=NEW),
        lambda: target.generate(singles[1], assistant_model=head, do_sample=False, max_new_tokens=NEW),
        lambda: target.generate(singles[2], assistant_model=head, do_sample=False, max_new_tokens=NEW,
                                dart_mode="chain"),
        lambda: target.generate(batch, attention_mask=mask, assistant_model=head, do_sample=False,
                                max_new_tokens=NEW, pad_token_id=2),
        lambda: plain_logits(target, singles[0]),
        lambda: plain_logits(target, singles[1]),
    ]
    for tree_a, tree_b, chain, batched, plain_a, plain_b in run_together(jobs, rounds=3):
        assert torch.equal(tree_a, solo[0]) and torch.equal(tree_b, solo[1]) and torch.equal(chain, solo[2])
        assert torch.equal(batched, solo_batch)
        for (seq, logits), (solo_seq, solo_logits) in zip((plain_a, plain_b), solo_plain):
            assert torch.equal(seq, solo_seq) and torch.equal(logits, solo_logits)  # bit for bit


def test_one_head_serves_an_fp32_and_a_bf16_target_from_two_threads(fast_switching):
    """The head is placed once for its first target; a call for a target of another dtype drafts with a copy placed
    for it, so neither call sees the head change under it."""
    fp32 = make_target("llama")
    bf16 = make_target("llama").to(torch.bfloat16)
    head = make_head(fp32, node_budget=4)
    ids = prompts(2, seed=83)
    want = [fp32.generate(ids[0], do_sample=False, max_new_tokens=NEW),
            bf16.generate(ids[1], do_sample=False, max_new_tokens=NEW)]
    jobs = [lambda: fp32.generate(ids[0], assistant_model=head, do_sample=False, max_new_tokens=NEW),
            lambda: bf16.generate(ids[1], assistant_model=head, do_sample=False, max_new_tokens=NEW)]
    jobs[0]()  # the head's first call: placed in place for the fp32 target
    for got in run_together(jobs, rounds=3):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert next(head.parameters()).dtype == torch.float32  # the user's head stays placed for its first target
    assert list(head._placed_copies) == [(torch.device("cpu"), torch.bfloat16)]


class RaiseAt(StoppingCriteria):
    def __init__(self, calls: int, error: BaseException):
        self.left, self.error = calls, error

    def __call__(self, input_ids, scores, **kwargs):
        self.left -= 1
        if self.left < 0:
            raise self.error
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class RaisingStreamer(BaseStreamer):
    def __init__(self, puts: int):
        self.left = puts

    def put(self, value):
        self.left -= 1
        if self.left < 0:
            raise RuntimeError("the client went away")

    def end(self):
        pass


def state(target, head) -> tuple:
    """Everything a call could leave changed on the target, the head or torch."""
    return (
        target.config._attn_implementation,
        sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in target.modules()),
        [n for n, m in target.named_modules() if "forward" in m.__dict__],
        {k: v for k, v in vars(target.config).items() if not k.startswith("_")},
        torch.get_num_threads(),
        next(head.parameters()).dtype,
        sorted(k for k in vars(head) if k not in ("stats", "_dart_placed")),
    )


@pytest.mark.parametrize("mode", ["tree", "chain", "batch"])
@pytest.mark.parametrize("failure", ["stopping criterion", "streamer", "KeyboardInterrupt"])
def test_a_call_that_raises_half_way_leaves_target_and_head_as_they_were(mode, failure):
    target = make_target("llama")
    head = make_head(target, node_budget=4)
    ids = prompts(1, seed=84)[0]
    if mode == "batch":
        ids = torch.cat([torch.full((1, 2), 2), ids], dim=1).repeat(2, 1)
        ids[1, 2:4] = 5
    mask = (ids != 2).long()
    target.generate(ids, attention_mask=mask, assistant_model=head, do_sample=False, max_new_tokens=4,
                    pad_token_id=2)  # the head's first call places it
    target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW, pad_token_id=2,
                    output_hidden_states=True)  # transformers' own output hooks, installed once by any such call
    before, want = state(target, head), plain_logits(target, ids, attention_mask=mask, pad_token_id=2)
    kwargs = dict(attention_mask=mask, assistant_model=head, do_sample=False, max_new_tokens=NEW, pad_token_id=2,
                  dart_mode="chain" if mode == "chain" else "tree")
    error = KeyboardInterrupt() if failure == "KeyboardInterrupt" else RuntimeError("the client went away")
    if failure == "streamer":
        kwargs["streamer"] = RaisingStreamer(puts=3)
    elif mode != "chain":  # (chain mode refuses custom stopping criteria: README Limits)
        kwargs["stopping_criteria"] = StoppingCriteriaList([RaiseAt(3, error)])
    else:
        kwargs["streamer"] = RaisingStreamer(puts=3) if failure != "KeyboardInterrupt" else _interrupting_streamer()
    with pytest.raises(type(error)):
        target.generate(ids, **kwargs)
    assert state(target, head) == before
    got = plain_logits(target, ids, attention_mask=mask, pad_token_id=2)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _interrupting_streamer() -> BaseStreamer:
    streamer = RaisingStreamer(puts=3)
    streamer.put = lambda value, s=streamer: (setattr(s, "left", s.left - 1), s.left < 0 and _raise())
    return streamer


def _raise():
    raise KeyboardInterrupt


@pytest.mark.slow
def test_threads_on_the_real_smollm2_target_give_plain_generates_text(fast_switching):
    """Four threads on one SmolLM2 target and the shipped head (the pattern that crashed before DART calls became
    call-local): tree mode twice, chain mode, and a plain call; every output is plain `generate`'s."""
    from dart_hf.tools.assets import load_target, shipped_head
    from dart_hf.tools.datasets import chat_input_ids

    import dart_hf  # noqa: F401
    from transformers import AutoModel

    target, tok = load_target("smollm2-135m-instruct")
    head = AutoModel.from_pretrained(shipped_head())
    ids = [chat_input_ids(tok, q) for q in ("Write a function that reverses a string.", "Name three rivers.",
                                             "What is a hash map?")]
    solo = [target.generate(i, do_sample=False, max_new_tokens=32) for i in ids]
    jobs = [lambda: target.generate(ids[0], assistant_model=head, do_sample=False, max_new_tokens=32),
            lambda: target.generate(ids[1], assistant_model=head, do_sample=False, max_new_tokens=32),
            lambda: target.generate(ids[2], assistant_model=head, do_sample=False, max_new_tokens=32,
                                    dart_mode="chain"),
            lambda: target.generate(ids[0], do_sample=False, max_new_tokens=32)]
    for got in run_together(jobs, rounds=2):
        assert all(torch.equal(g, s) for g, s in zip(got, [*solo, solo[0]]))


def test_static_and_compiled_dart_calls_in_threads_beside_plain_calls(fast_switching):
    """The static step (eager and captured) keeps its state in the call: threads running it on one target beside a
    dynamic DART call and plain calls get what each gets alone."""
    from transformers.generation.configuration_utils import CompileConfig

    target = make_target("llama")
    head = make_head(target, node_budget=5)
    compiled = CompileConfig(backend="eager", mode=None)
    compiled._compile_all_devices = True
    singles = prompts(4, seed=91)
    solo = [target.generate(p, do_sample=False, max_new_tokens=NEW) for p in singles]
    solo_plain = plain_logits(target, singles[3])
    static = dict(assistant_model=head, do_sample=False, max_new_tokens=NEW, cache_implementation="static")
    target.generate(singles[1], **static, compile_config=compiled)  # captured once before the threads start
    jobs = [
        lambda: target.generate(singles[0], **static, disable_compile=True),
        lambda: target.generate(singles[1], **static, compile_config=compiled),
        lambda: target.generate(singles[2], assistant_model=head, do_sample=False, max_new_tokens=NEW),
        lambda: plain_logits(target, singles[3]),
    ]
    for eager_static, compiled_static, dynamic, (seq, logits) in run_together(jobs, rounds=3):
        assert torch.equal(eager_static, solo[0]) and torch.equal(compiled_static, solo[1])
        assert torch.equal(dynamic, solo[2])
        assert torch.equal(seq, solo_plain[0]) and torch.equal(logits, solo_plain[1])
