"""The lossless contract in one place: greedy, `target.generate(**inputs, assistant_model=head)` returns exactly what
plain `generate` returns with the same arguments, token for token. Sampling, DART draws every token (the first
included) at a uniform hashed from a per-row seed (drawn from torch's generator once per call) and the
token's position (`dart_hf.core.acceptance`): the same seed gives the same text at every node budget, 0 (plain
decoding inside DART's loop) included, but not plain `generate`'s text (that draws one `torch.multinomial` per
token: the distribution is the same, not the draws; exact in distribution: test_sampling.py). So sampled cases
compare DART with DART at `dart_node_budget=0`, same seed and arguments.

Greedy cases compare DART with plain `generate` on one session target (conftest `tiny_target`); plain references are
computed once per session and shared by the cases that make the same call. Prompts are the random ones whose plain
text varies most (a random target's greedy text often repeats one token). The heads are random; in the cases marked
(oracle) their draft logits are replaced by noise plus a bump at the reference text's next tokens (`noisy_oracle`, the
head's forward still runs), so paths of many lengths are accepted and cut off, stops fall inside accepted paths, and
those of cases 1 to 3 assert that multi-token paths were accepted. "auto" budgets run the cost-aware policy on a fake
clock that only target forwards advance (`step_seconds` of their length): the rule times its own steps on it, no
curve given, so the budgets chosen never depend on the machine's speed.

Cases (pytest ids in brackets):

1. `test_greedy[arch-mode-budget-lookup]` (oracle): 7 architectures (llama, qwen2, qwen3: full attention; mistral,
   gemma2 (eager), gemma3_text, gpt_oss: sliding windows of 4 tokens, far shorter than prompt + output) x tree / chain
   mode x fixed (24 nodes) / auto budget x prompt lookup on / off = 56 cases, each 3 prompts with 32, 2 and 1 new
   tokens (2: one step with no room for drafts; 1: no step); n-gram rescoring on. Auto in tree mode: the policy chose
   every step's budget, among plain decoding and the ladder's sizes (`budget.LADDER`), plain decoding and its first
   tree (`budget.START`) among them.
2. `test_generation_settings[setting-mode-budget]` (oracle): a Llama with a word tokenizer, tree / chain x fixed /
   auto x 9 settings, 2 prompts x 30 tokens:
   - repetition_penalty=1.5; no_repeat_ngram_size=2; min_new_tokens=10 with an EOS id;
   - several EOS ids, one of them a token the text really produces: the text ends (asserted) inside a path;
   - a custom StoppingCriteria that stops after a token of the text (asserted to end it early);
   - stop_strings with a tokenizer (asserted to end the text early);
   - max_length instead of max_new_tokens;
   - return_dict_in_generate with output_scores and output_logits: sequences equal; scores and logits close (they
     come from a tree forward instead of a one-token forward);
   - SynthID watermarking (a processor that keeps state across calls).
   Chain mode refuses the custom criterion, stop strings and SynthID with a ValueError (CHAIN_REFUSES): transformers'
   assisted loop, which chain mode runs, checks stopping criteria once per step and would pass over a stop inside a
   chain, and runs processors on rejected drafts too.
   `test_processors_and_criteria_with_state_are_called_as_plain_generate_calls_them[do_sample-budget]` (oracle): a
   processor and a criterion that count their calls, greedy / sampled x fixed / auto: same text (greedy: as plain
   `generate`; sampled: as DART at budget 0 with the same seed), same criterion calls.
3. `test_seeded_sampling[setting-budget]` (oracle): tree mode, a soft target, 32 tokens: the same seed gives the
   tokens of DART at budget 0 (plain decoding in DART's loop), with temperature 1 / top_k 0 at fixed budgets 1, 3,
   12, 40 and auto (the text does not depend on the budget), with temperature 0.7 + top_k 20 + top_p 0.9 and
   temperature 0.9 + repetition penalty 1.3 at budget 12 and auto (these run the device walk), and SynthID
   watermarking at budget 12 (the per-row host walk); 4 prompts at budget 12, 2 otherwise; another seed gives another
   text, and the text is not plain `generate`'s for the same seed.
   `test_seeded_sampling_across_architectures[arch]`: temperature 0.8, 32 tokens, the random head's own drafts at 16
   nodes against budget 0, on the 7 architectures of case 1. (Chain mode samples with transformers' speculative
   sampling: exact in distribution, not seed for seed.)
   `test_a_sampled_call_draws_one_seed_per_row_from_torch`: whatever the text's length or stop, a sampled call
   advances torch's generator by exactly one `torch.randint(0, 2**31 - 1, (rows,))`.
4. `test_entry_points[entry]`: `pipeline(..., assistant_model=head)` at construction (the head or its folder) and at
   call time, `generate(custom_generate=dart_hf.dart_decode, dart_head=head)`, one head reused across calls and two
   targets.
5. `test_per_call_budget_and_lookup[override]` (oracle): 64 tokens with `dart_node_budget` 0 (plain decoding in the
   loop), 1, 5, "auto" on a fixed-budget head, and `dart_prompt_lookup` False / True overriding the head's config.
6. `test_a_lookup_that_is_always_wrong`: prompt lookup proposing confident garbage, tree and chain mode.
7. `test_plain_generate_is_the_same_before_and_after_dart_calls`.

Lossless checks that stay next to the mechanism they exercise: every decoder-only model type, tree and chain
(test_target_matrix.py); window-deep accepted paths with an oracle drafter (test_sliding_window.py); half precision,
bitsandbytes, device_map="auto" and image-text targets (test_targets.py); converted reference heads
(test_convert.py); the custom_generate folder without dart_hf (test_hub.py); the bench's methods (test_bench.py); the
model-type override, a head after refusing another target, output up to the context limit, an all-ones attention
mask, inputs_embeds in chain mode (test_errors.py); a bf16 head cast for an fp32 target (test_user_paths.py); sampling
against the exact distribution, chi-square (test_sampling.py, test_sliding_window.py); the real SmolLM2-135M (greedy,
seeded sampling) and Qwen2.5-Coder-0.5B targets with their shipped heads (test_smollm2.py, test_qwen_coder.py: marked
slow, in the default run).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    SynthIDTextWatermarkingConfig,
    pipeline,
)

import dart_hf
from conftest import SLIDING, make_head, make_target, prompts, stop_word_tokenizer, word_target
from dart_hf.core.budget import LADDER, START, BudgetState

ARCHS = ["llama", "qwen2", "qwen3", *SLIDING]
MODES = ["tree", "chain"]
BUDGETS = ["fixed", "auto"]
FIXED_BUDGET = 24
NEW_TOKENS = (32, 2, 1)  # the prompt whose text varies most gets the long output; 2: no room for drafts


def step_seconds(n_tokens: int) -> float:
    """The fake cost of a target forward over n tokens: CPU-like, growing from the first extra token."""
    return 0.010 + 0.0015 * n_tokens


class FakeClock:
    """Fake seconds that only target forwards advance (by `step_seconds` of their length)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.now += step_seconds(ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1])


@pytest.fixture
def budget_for():
    """budget_for(target, head, budget): set the head up for "fixed" (FIXED_BUDGET nodes) or "auto" (the cost-aware
    policy timing its own steps on a FakeClock that the target's forwards advance)."""
    hooks = []

    def setup(target, head, budget: str):
        if budget == "fixed":
            head.config.node_budget = FIXED_BUDGET
            return head
        head.config.node_budget = None
        clock = FakeClock()
        hooks.append(target.register_forward_pre_hook(clock.forward, with_kwargs=True))
        head.budget_state = BudgetState(clock=clock)
        return head

    yield setup
    for hook in hooks:
        hook.remove()


@pytest.fixture(scope="session")
def plain(tiny_target):
    """plain(name, ids, key=None, seed=None, **kw): plain `generate` on tiny_target(name), once per session.
    `key` names the call where kw holds objects without a stable repr (stopping criteria, tokenizers)."""
    done = {}

    def run(name, ids, key=None, seed=None, **kw):
        k = (name, tuple(ids[0].tolist()), seed, key or repr(sorted(kw.items())))
        if k not in done:
            if seed is not None:
                torch.manual_seed(seed)
            done[k] = tiny_target(name).generate(ids, **kw)
        return done[k]

    return run


def varied_prompts(plain, name: str, n: int, vocab: int) -> list[torch.Tensor]:
    """The n of 6 random prompts whose first 16 greedy tokens hold the most distinct tokens (the greedy text of a
    random target often repeats one token, which makes stops and acceptance trivial)."""
    pool = prompts(6, vocab=vocab, seed=7)
    texts = [plain(name, ids, do_sample=False, max_new_tokens=16)[0, ids.shape[1]:] for ids in pool]
    distinct = [len(set(t.tolist())) for t in texts]
    return [pool[i] for i in sorted(range(len(pool)), key=lambda i: -distinct[i])[:n]]


def drafting_head(target, texts: list[torch.Tensor], **overrides) -> dart_hf.DartHead:
    """A random head with an n-gram of the target's own `texts` (the n-gram rescoring runs)."""
    vocab = target.config.get_text_config().vocab_size
    head = make_head(target, **{"tree_top_k": 16, "beam_width": 8, "node_budget": FIXED_BUDGET, **overrides})
    head.ngram = dart_hf.NGramModel.build([t[0].tolist() for t in texts], order=3, vocab_size=vocab, progress=False)
    return head


@contextmanager
def noisy_oracle(head: dart_hf.DartHead, text: torch.Tensor | None, seed: int = 0):
    """While it lasts, the head's draft logits are noise plus a bump at the tokens `text` [1, n] continues with,
    in place of its random ones (its forward still runs): the tree search, verification and acceptance see good
    but imperfect drafts, so paths of many lengths are accepted and cut off. Its own generator: the random stream
    plain `generate` samples from is untouched."""
    if text is None:
        yield
        return
    original, text, g = head.draft_rows, text[0], torch.Generator().manual_seed(seed)

    def draft_rows(aux, next_tokens, real, cache_k, cache_v, lengths, depth, *args, **kwargs):
        assert aux.shape[0] == 1, "the oracle drafts one row"
        consumed = int(lengths[0] + real[0])  # row d predicts the token at consumed + 1 + d
        logits = original(aux, next_tokens, real, cache_k, cache_v, lengths, depth, *args, **kwargs)
        noisy = 2.0 * torch.randn(logits.shape[1:], generator=g).to(logits)
        truth = text[consumed + 1 : consumed + 1 + depth].to(logits.device)
        noisy[torch.arange(truth.numel()), truth] += 5.0
        return noisy.unsqueeze(0)

    head.draft_rows = draft_rows
    try:
        yield
    finally:
        del head.draft_rows


def dart(target, head, ids, mode: str = "tree", reference: torch.Tensor | None = None, **kw):
    """(DART's output, the accepted lengths of its steps), drafting with `noisy_oracle(head, reference)`."""
    with noisy_oracle(head, reference):
        out = target.generate(ids, assistant_model=head, dart_mode=mode, **kw)
    return out, list(head.stats["accepted_lengths"])


# ------------------------------------------------------------------------------------------------ 1. architectures
@pytest.mark.parametrize("lookup", ["lookup", "no_lookup"])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy(tiny_target, plain, budget_for, arch, mode, budget, lookup):
    target = tiny_target(arch)
    texts = varied_prompts(plain, arch, 3, target.config.get_text_config().vocab_size)
    refs = [plain(arch, ids, do_sample=False, max_new_tokens=n) for ids, n in zip(texts, NEW_TOKENS)]
    head = budget_for(target, drafting_head(target, refs), budget)
    head.config.prompt_lookup = lookup == "lookup"
    accepted, budgets = [], []
    for i, (ids, n, ref) in enumerate(zip(texts, NEW_TOKENS, refs)):
        out, lengths = dart(target, head, ids, mode, ref, do_sample=False, max_new_tokens=n)
        assert torch.equal(out, ref), f"prompt {i} ({n} new tokens): DART diverged from plain generate"
        accepted += lengths
        budgets += head.stats["node_budgets"]
    assert max(accepted) > 1, f"no draft token was accepted: the case did not exercise tree acceptance {budgets}"
    assert head.stats["budget_mode"] == budget
    if budget == "auto" and mode == "tree":  # the policy chose every step's budget: plain decoding or a ladder size
        assert set(budgets) <= {0, *LADDER} and {0, START} <= set(budgets), budgets  # plain timed first, then a tree


# ------------------------------------------------------------------------------------------------ 2. settings
class StopAfterToken(StoppingCriteria):
    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def first_new(free: list[int], skip: int) -> int:
    """A token of the free text at or after position `skip` that does not occur before it."""
    return next(t for t in free[skip:] if t not in free[:skip])


def stop_string_at(plain, ids, free: list[int], tok) -> dict:
    """stop_strings=[a word of the text] that really ends it between 4 and 29 new tokens (a word can also match
    as the tail of a longer word, so candidates are tried in turn)."""
    for t in free[6:]:
        kw = dict(do_sample=False, max_new_tokens=30, stop_strings=[tok.convert_ids_to_tokens(t)], tokenizer=tok)
        if 4 <= plain("word_llama", ids, key=f"stop {t}", **kw).shape[1] - ids.shape[1] < 30:
            return kw
    raise AssertionError("no word of the text stops it mid-way")


SETTINGS = {
    "repetition_penalty": lambda free, **_: dict(repetition_penalty=1.5),
    "no_repeat_ngram": lambda free, **_: dict(no_repeat_ngram_size=2),
    "min_new_tokens": lambda free, **_: dict(min_new_tokens=10, eos_token_id=[1]),
    "several_eos": lambda free, **_: dict(eos_token_id=[first_new(free, 3), 11, 40, 57]),
    "stopping_criteria": lambda free, **_: dict(stopping_criteria=StoppingCriteriaList([StopAfterToken(
        first_new(free, 8))])),
    "stop_strings": lambda free, plain, ids, tok: stop_string_at(plain, ids, free, tok),
    "max_length": lambda free, ids, **_: dict(max_length=ids.shape[1] + 13, max_new_tokens=None),
    "return_dict": lambda free, **_: dict(return_dict_in_generate=True, output_scores=True, output_logits=True),
    "synthid_watermark": lambda free, **_: dict(watermarking_config=SYNTHID),
}
SYNTHID = SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123, 340, 443, 597, 160, 57, 29], ngram_len=3)
ENDS_EARLY = {"several_eos", "stopping_criteria", "stop_strings"}  # the reference must stop before 30 tokens
# chain mode is transformers' assisted decoding, which checks stopping criteria once per step on the sequence's end
# and would pass over a stop inside an accepted chain, and which runs processors on rejected drafts too (SynthID's
# state would take them in): those calls are refused (the case checks the refusal)
CHAIN_REFUSES = {"stopping_criteria", "stop_strings", "synthid_watermark"}


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_generation_settings(tiny_target, plain, budget_for, setting, mode, budget):
    target, tok = tiny_target("word_llama"), stop_word_tokenizer()
    texts = varied_prompts(plain, "word_llama", 2, len(tok))
    frees = [plain("word_llama", ids, do_sample=False, max_new_tokens=30) for ids in texts]
    head = budget_for(target, drafting_head(target, frees), budget)
    accepted = []
    for ids, free in zip(texts, frees):
        kw = dict(do_sample=False, max_new_tokens=30)
        kw.update(SETTINGS[setting](free[0, ids.shape[1]:].tolist(), plain=plain, ids=ids, tok=tok))
        ref = plain("word_llama", ids, key=f"{setting} {kw.get('stop_strings')}", **kw)
        if mode == "chain" and setting in CHAIN_REFUSES:
            with pytest.raises(ValueError, match="assisted decoding"):
                target.generate(ids, assistant_model=head, dart_mode="chain", **kw)
            return  # refused before any decoding
        out, lengths = dart(target, head, ids, mode, ref.sequences if setting == "return_dict" else ref, **kw)
        accepted += lengths
        if setting == "return_dict":
            assert torch.equal(out.sequences, ref.sequences)
            assert len(out.scores) == len(ref.scores) == len(out.logits) == 30
            for a, b in [*zip(out.scores, ref.scores), *zip(out.logits, ref.logits)]:
                torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
            continue
        assert torch.equal(out, ref), f"{setting}: DART diverged from plain generate"
        if setting in ENDS_EARLY:
            assert ref.shape[1] < ids.shape[1] + 30, f"{setting} did not end the text early: the case is vacuous"
    assert max(accepted) > 1, "no draft token was accepted: the case did not exercise tree acceptance"


class CountingBias(LogitsProcessor):
    """Raises a token chosen by how many times it was called: a processor with state, as SynthID's."""

    def __init__(self, vocab: int):
        self.vocab, self.calls = vocab, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        scores = scores.clone()
        scores[:, (7 * self.calls) % self.vocab] += 2.0
        return scores


class StopAfterCalls(StoppingCriteria):
    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.full((input_ids.shape[0],), self.calls >= self.n, dtype=torch.bool)


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("do_sample", [False, True])
def test_processors_and_criteria_with_state_are_called_as_plain_generate_calls_them(tiny_target, plain, budget_for,
                                                                                     do_sample, budget):
    """Tree mode on one row calls the processors once per new token in order (the last step may also process the
    tokens after the stop, which it drops) and the stopping criteria once per new token until the stop, as plain
    `generate` does: the same number of criterion calls, and the same text (greedy: plain `generate`'s; sampled:
    DART's at budget 0 with the same seed, which is plain decoding with DART's draws)."""
    target = tiny_target("llama")
    vocab = target.config.vocab_size
    texts = varied_prompts(plain, "llama", 2, vocab)
    frees = [plain("llama", ids, do_sample=False, max_new_tokens=30) for ids in texts]
    head = budget_for(target, drafting_head(target, frees), budget)

    def counted(ids, seed: int, reference=None, **extra):
        """(output, accepted lengths, (processor calls, criterion calls)): plain `generate` without a reference,
        DART drafting towards it with one."""
        processor, criterion = CountingBias(vocab), StopAfterCalls(21)
        kw = dict(do_sample=do_sample, max_new_tokens=30, logits_processor=LogitsProcessorList([processor]),
                  stopping_criteria=StoppingCriteriaList([criterion]), eos_token_id=None, **extra)  # no EOS: 21 tokens
        torch.manual_seed(seed)
        if reference is None:
            out, lengths = target.generate(ids, **kw), []
        else:
            out, lengths = dart(target, head, ids, reference=reference, **kw)
        return out, lengths, (processor.calls, criterion.calls)

    accepted = []
    for seed, ids in enumerate(texts):
        ref, _, plain_calls = counted(ids, seed)
        if do_sample:  # DART's own draws: the reference is DART at budget 0, same seed (its calls are plain's)
            ref, _, zero_calls = counted(ids, seed, reference=ref, dart_node_budget=0)
            assert zero_calls == plain_calls, (plain_calls, zero_calls)
        out, lengths, dart_calls = counted(ids, seed, reference=ref)
        accepted += lengths
        assert ref.shape[1] == ids.shape[1] + 21, "the criterion must end the text"
        assert torch.equal(out, ref), f"prompt {seed}: DART diverged from its reference"
        assert dart_calls[1] == plain_calls[1] and dart_calls[0] >= plain_calls[0], (plain_calls, dart_calls)
    assert max(accepted) > 1, "no draft token was accepted: the case did not exercise tree acceptance"


# ------------------------------------------------------------------------------------------------ 3. sampling
SAMPLING = {
    "temperature_1": dict(temperature=1.0, top_k=0),
    "top_k_top_p": dict(temperature=0.7, top_k=20, top_p=0.9),
    "repetition_penalty": dict(temperature=0.9, top_k=0, repetition_penalty=1.3),
    "synthid_watermark": dict(temperature=1.0, top_k=0, watermarking_config=SYNTHID),
}


SAMPLING_CASES = [("temperature_1", b) for b in (1, 3, 12, 40, "auto")] + [
    (setting, b) for setting in ("top_k_top_p", "repetition_penalty") for b in (12, "auto")] + [
    ("synthid_watermark", 12)]


@pytest.mark.parametrize("setting, budget", SAMPLING_CASES)
def test_seeded_sampling(tiny_target, plain, budget_for, setting, budget):
    """The same seed gives the same text at budget `budget` as at budget 0 (plain decoding in DART's loop, the same
    draws): each token is drawn from the target's processed distribution at a uniform given by the seed and its
    position, whatever tree the step verified. Not plain `generate`'s text (its draws are others)."""
    target = tiny_target("soft_llama")
    head = budget_for(target, make_head(target, tree_top_k=16, beam_width=8), "auto" if budget == "auto" else "fixed")
    kw = dict(do_sample=True, max_new_tokens=32, **SAMPLING[setting])
    if budget != "auto":
        kw["dart_node_budget"] = budget
    accepted, plain_texts = [], []
    for seed, ids in enumerate(prompts(4 if budget == 12 else 2, seed=43)):
        torch.manual_seed(seed)
        stats = dart_hf.DartStats()
        ref = dart(target, head, ids, **{**kw, "dart_node_budget": 0}, dart_stats=stats)[0]
        assert stats.acceptance == ("walk" if setting == "synthid_watermark" else "device"), stats.acceptance
        torch.manual_seed(seed)
        out, lengths = dart(target, head, ids, reference=ref, **kw)
        assert torch.equal(out, ref), f"seed {seed}: DART at budget {budget} sampled another text than at budget 0"
        accepted += lengths
        plain_texts.append(plain("soft_llama", ids, seed=seed, **{k: v for k, v in kw.items() if k[:5] != "dart_"}))
    assert max(accepted) > 1, (accepted, head.stats["node_budgets"])
    torch.manual_seed(99)
    assert not torch.equal(dart(target, head, ids, **kw)[0], ref)  # the seed matters
    # the same distribution as plain `generate`, not its draws (a 32-token soft text equal by chance: never)
    assert not torch.equal(ref, plain_texts[-1]), "DART sampled plain generate's text: the draws are not DART's"


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_across_architectures(tiny_target, arch):
    """Temperature 0.8, same seed, on every architecture of case 1 (sliding windows included), with the random
    head's own drafts at 16 nodes: the text of budget 0."""
    target = tiny_target(arch)
    head = make_head(target, tree_top_k=16, beam_width=8, node_budget=16)
    vocab = target.config.get_text_config().vocab_size
    kw = dict(do_sample=True, temperature=0.8, top_k=0, max_new_tokens=32)
    for seed, ids in enumerate(prompts(1, vocab=vocab, seed=11)):
        torch.manual_seed(seed)
        ref = dart(target, head, ids, dart_node_budget=0, **kw)[0]
        torch.manual_seed(seed)
        assert torch.equal(dart(target, head, ids, **kw)[0], ref), f"seed {seed}"


@pytest.mark.parametrize("stop", ["eos_mid_path", "max_new_tokens"])
def test_a_sampled_call_draws_one_seed_per_row_from_torch(tiny_target, stop):
    """torch's generator after a sampled DART call: one `torch.randint(0, 2**31 - 1, (rows,))` past the seed, whether
    the call ran to max_new_tokens or stopped on an EOS inside an accepted path (drafting towards the free text)."""
    target = tiny_target("soft_llama")
    head = make_head(target, tree_top_k=16, beam_width=8, node_budget=12)
    ids = prompts(1, seed=43)[0]
    kw = dict(do_sample=True, temperature=1.0, top_k=0, max_new_tokens=32, eos_token_id=None)
    torch.manual_seed(7)
    free = dart(target, head, ids, **kw)[0]
    torch.manual_seed(7)
    _, steps = dart(target, head, ids, reference=free, **kw)  # the tokens each step appends, towards the free text
    if stop == "eos_mid_path":
        new = free[0, ids.shape[1]:].tolist()
        inside, end = [], 1  # new tokens inside a step's path, not its last, the first of their kind
        for n in steps:
            inside += [i for i in range(end, end + n - 1) if new[i] not in new[:i]]
            end += n
        at = inside[-1]
        kw.update(eos_token_id=new[at], pad_token_id=2)
    torch.manual_seed(7)
    out, lengths = dart(target, head, ids, reference=free, **kw)
    after = torch.get_rng_state()
    torch.manual_seed(7)
    torch.randint(0, 2**31 - 1, (1,))
    assert torch.equal(after, torch.get_rng_state()), "the call drew from torch's generator more than its seeds"
    if stop == "eos_mid_path":
        assert torch.equal(out, free[:, : ids.shape[1] + at + 1]), "the EOS did not end the text there"
        assert lengths[:-1] == steps[: len(lengths) - 1] and lengths[-1] < steps[len(lengths) - 1], (lengths, steps)
    else:
        assert torch.equal(out, free) and max(lengths) > 1


# ------------------------------------------------------------------------------------------------ 4. entry points
@pytest.mark.parametrize("entry", ["pipeline_built_with_head", "pipeline_built_with_head_folder",
                                   "pipeline_call_with_head", "custom_generate", "head_across_targets",
                                   "generate_with_head_folder"])
def test_entry_points(tiny_target, plain, entry, tmp_path):
    if entry.startswith("pipeline"):
        target, tok = word_target(), stop_word_tokenizer()  # its own: a pipeline may change the generation config
        head = make_head(target)
        kw, text = dict(do_sample=False, max_new_tokens=12), "w3 w14 w15 w92"
        ref = pipeline("text-generation", model=target, tokenizer=tok)(text, **kw)
        if entry == "pipeline_built_with_head":
            out = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=head)(text, **kw)
        elif entry == "pipeline_built_with_head_folder":  # a folder or Hub id, as pipelines take assistants
            head.save_pretrained(tmp_path / "head")
            generator = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=tmp_path / "head")
            out, head = generator(text, **kw), generator.assistant_model
            assert isinstance(head, dart_hf.DartHead)
        else:
            out = pipeline("text-generation", model=target, tokenizer=tok)(text, assistant_model=head, **kw)
        assert out == ref
        assert head.stats is not None and head.stats.steps > 0, "the pipeline did not decode with DART"
        return
    llama = tiny_target("llama")
    head = make_head(llama)
    ids = prompts(1, seed=29)[0]
    ref = plain("llama", ids, do_sample=False, max_new_tokens=20)
    if entry == "custom_generate":
        out = llama.generate(ids, custom_generate=dart_hf.dart_decode, dart_head=head, max_new_tokens=20)
        assert torch.equal(out, ref) and head.stats.steps > 0
        return
    if entry == "generate_with_head_folder":  # as pipelines take it: a folder (str or Path) or a Hub id
        head.save_pretrained(tmp_path / "head")
        for folder in (str(tmp_path / "head"), tmp_path / "head"):
            stats = dart_hf.DartStats()
            out = llama.generate(ids, assistant_model=folder, do_sample=False, max_new_tokens=20, dart_stats=stats)
            assert torch.equal(out, ref) and stats.steps > 0
        return
    other = make_target("llama", seed=5)
    for target in (llama, other, llama):
        want = ref if target is llama else other.generate(ids, do_sample=False, max_new_tokens=20)
        assert torch.equal(dart(target, head, ids, do_sample=False, max_new_tokens=20)[0], want)


# ------------------------------------------------------------------------------------------------ 5. per call
OVERRIDES = {"budget_0": dict(dart_node_budget=0), "budget_1": dict(dart_node_budget=1),
             "budget_5": dict(dart_node_budget=5), "budget_auto": dict(dart_node_budget="auto"),
             "lookup_off": dict(dart_prompt_lookup=False), "lookup_on": dict(dart_prompt_lookup=True)}


@pytest.mark.parametrize("override", list(OVERRIDES))
def test_per_call_budget_and_lookup(tiny_target, plain, budget_for, override):
    target = tiny_target("qwen3")
    texts = varied_prompts(plain, "qwen3", 1, 96)
    refs = [plain("qwen3", ids, do_sample=False, max_new_tokens=64) for ids in texts]
    head = budget_for(target, drafting_head(target, refs), "auto" if override == "budget_auto" else "fixed")
    head.config.node_budget = 12
    head.config.prompt_lookup = override != "lookup_on"  # the call's setting is the opposite of the config's
    for ids, ref in zip(texts, refs):
        out, _ = dart(target, head, ids, reference=ref, do_sample=False, max_new_tokens=64, **OVERRIDES[override])
        assert torch.equal(out, ref)


# ------------------------------------------------------------------------------------------------ 6. adversarial
def test_a_lookup_that_is_always_wrong(tiny_target, plain, monkeypatch):
    target = tiny_target("llama")
    head = make_head(target)
    head.config.lookup_logp = 0.0  # the garbage outranks every drafted token
    garbage = lambda texts, length, *a, **k: (torch.full((len(texts), length), 5),
                                              torch.ones(len(texts), length, dtype=torch.bool))
    monkeypatch.setattr("dart_hf.core.drafter.lookup_continuations", garbage)
    for mode in MODES:
        for ids in prompts(2, seed=4):
            assert torch.equal(dart(target, head, ids, mode, do_sample=False, max_new_tokens=16)[0],
                               plain("llama", ids, do_sample=False, max_new_tokens=16))


# ------------------------------------------------------------------------------------------------ 7. plain untouched
def test_plain_generate_is_the_same_before_and_after_dart_calls():
    target = make_target("llama", seed=3)
    ids = prompts(1, seed=37)[0]
    before = target.generate(ids, do_sample=False, max_new_tokens=12)
    head = make_head(target)
    for mode in MODES:
        dart(target, head, ids, mode, do_sample=False, max_new_tokens=12)
    assert torch.equal(target.generate(ids, do_sample=False, max_new_tokens=12), before)
