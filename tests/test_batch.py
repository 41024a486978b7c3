"""Batched DART (left-padded rows, one tree per row, one verify forward): greedy, the output of plain batched
`generate`, row by row, token for token, on tiny random targets; sampled, the same batch for a seed at every budget
(0 included) and backend, each row following the target's distribution."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import dart_hf
from conftest import SLIDING, make_head, make_target, prompts, sliding_target
from dart_hf import DartStats
from dart_hf.core.drafter import DartDrafter
from dart_hf.core.tree import DraftTrees
from test_sliding_window import chain_tree
from dart_hf.core import acceptance, step

PAD = 2


def ngram_from_target(target, texts: list[torch.Tensor], new_tokens: int = 64) -> dart_hf.NGramModel:
    """An n-gram of the target's own greedy text: with it the tree finds multi-token continuations even with a
    random head (the head only has to put the right first token among the beams)."""
    seqs = [target.generate(p, do_sample=False, max_new_tokens=new_tokens)[0].tolist() for p in texts]
    return dart_hf.NGramModel.build(seqs, order=3, vocab_size=target.config.vocab_size, progress=False)


def wide_head(target):
    """A random head whose depth-1 beams cover a third of the tiny vocab (add a target n-gram for long paths)."""
    return make_head(target, tree_top_k=96, beam_width=32, node_budget=96)


def left_pad(rows: list[torch.Tensor], pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of [1, L_i] prompts, left-padded as `padding_side="left"` pads them."""
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1] :] = r[0]
        mask[i, width - r.shape[1] :] = 1
    return ids, mask


def batch_prompts(n: int, seed: int) -> list[torch.Tensor]:
    """n prompts of different lengths, one of them a single token."""
    rows = prompts(n, seed=seed)
    rows[n // 2] = rows[n // 2][:, :1]
    return rows


def plain(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, do_sample=False, **kw)


def dart(target, head, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, assistant_model=head, do_sample=False, **kw)


@pytest.fixture(scope="module")
def llama_ngram():
    target = make_target("llama")
    head = wide_head(target)
    head.ngram = ngram_from_target(target, batch_prompts(8, seed=3))
    return target, head


# ---------------------------------------------------------------------------------------------- greedy, lossless
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("n_rows", [2, 3, 8])
def test_greedy_batch_equals_plain_batched_generate(arch, n_rows):
    target = make_target(arch)
    head = wide_head(target)
    rows = batch_prompts(n_rows, seed=n_rows)
    head.ngram = ngram_from_target(target, rows)
    ids, mask = left_pad(rows)
    free = plain(target, ids, mask, max_new_tokens=40)
    # an EOS the first row really reaches mid-text: rows end at different steps (and padding follows)
    gen = free[0, ids.shape[1] :].tolist()
    eos = [t for t in gen[4:] if t not in gen[:4] and t != PAD][:1] + [1]
    for kw in (dict(max_new_tokens=40), dict(max_new_tokens=40, eos_token_id=eos), dict(max_new_tokens=1)):
        ref = plain(target, ids, mask, **kw)
        out = dart(target, head, ids, mask, **kw)
        assert torch.equal(out, ref), f"{arch} B={n_rows} {kw}"
        if kw.get("eos_token_id") == eos:
            assert (ref[:, -1] == PAD).any(), "no row finished early: the test would not exercise finished rows"
        if kw["max_new_tokens"] == 40 and "eos_token_id" not in kw:
            # new tokens per verify forward over the batch: rows accept multi-token paths
            assert head.stats.mean_accepted_length > 1.2 * n_rows


def test_one_left_padded_row_and_an_unpadded_batch(llama_ngram):
    target, head = llama_ngram
    row = prompts(1, seed=5)[0]
    ids = torch.cat([torch.full((1, 3), PAD), row], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(row)], dim=1)
    assert torch.equal(dart(target, head, ids, mask, max_new_tokens=20), plain(target, ids, mask, max_new_tokens=20))
    same = torch.randint(3, 96, (3, 6), generator=torch.Generator().manual_seed(6))  # a batch with no padding
    assert torch.equal(dart(target, head, same, None, max_new_tokens=15), plain(target, same, None, max_new_tokens=15))


@pytest.mark.parametrize("budget", [0, 1, 7, "auto"])
def test_fixed_budgets_including_plain_steps(llama_ngram, budget):
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(4, seed=11))
    ref = plain(target, ids, mask, max_new_tokens=25)
    assert torch.equal(dart(target, head, ids, mask, max_new_tokens=25, dart_node_budget=budget), ref)


def test_plain_steps_have_the_head_read_waiting_states_in_blocks(llama_ngram):
    """Through a long run of plain steps (budget 0) no row keeps more than `PENDING_LIMIT` target states waiting (their
    memory, and the catch-up of the next tree's head forward, stay bounded), and the next tree is the one the head
    drafts when it reads them all at once."""
    from dart_hf.core.drafter import PENDING_LIMIT
    from dart_hf.core.stats import PhaseTimer

    target, head = llama_ngram
    rows, steps = 2, 2 * PENDING_LIMIT + 5
    gen = torch.Generator().manual_seed(0)
    aux = torch.randn(rows, steps, 3 * target.config.hidden_size, generator=gen)
    tokens = torch.randint(3, target.config.vocab_size, (rows, steps + 1), generator=gen)
    timer = PhaseTimer({}, head.device)

    def next_tree(plain_steps: bool):
        drafter = DartDrafter(head, target, max_length=1024, node_budget=3, prompt_lookup=False, eos_token_ids=None,
                              rows=rows)
        drafter.start(tokens[:, :1], [0] * rows, aux[:, :1], tokens[:, 1])
        for t in range(1, steps):
            drafter.advance(aux[:, t : t + 1], tokens[:, t + 1 : t + 2])
            if plain_steps:
                assert drafter.propose([64] * rows, timer, 0).width == 1
                assert max(drafter.pending) < PENDING_LIMIT
        return drafter.propose([64] * rows, timer, 3)

    waited, read_in_blocks = next_tree(False), next_tree(True)
    assert torch.equal(read_in_blocks.tokens, waited.tokens) and torch.equal(read_in_blocks.parents, waited.parents)
    torch.testing.assert_close(read_in_blocks.scores, waited.scores)


CUDA = torch.cuda.is_available()
NO_CPU_FLEX = "torch 2.13's CPU flex kernel fails to compile batched masks (plain batched generate fails the same way)"
ATTNS = ["sdpa", "eager", pytest.param("flex_attention", marks=pytest.mark.skipif(not CUDA, reason=NO_CPU_FLEX))]


@torch.no_grad()
@pytest.mark.parametrize("attn", ATTNS)
def test_batched_verify_logits_equal_per_path_forwards(attn):
    """Each row's tree sees exactly its own committed tokens: left padding and the slots a row has not reached (rows
    accept different lengths) are masked."""
    from test_verify import random_tree

    from dart_hf.core.acceptance import accept_nodes
    from dart_hf.core.target import cache_kwargs
    from transformers import DynamicCache

    device = "cuda" if CUDA else "cpu"
    target = make_target("qwen3", attn=attn).to(device)
    rows = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)).to(device) for n in (9, 1, 4)]
    ids, mask = (t.to(device) for t in left_pad(rows))
    cache = DynamicCache(config=target.config)
    target(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True,
           **cache_kwargs(target, cache))
    lefts = (mask == 0).sum(dim=1).tolist()
    slots, spec = step.RowSlots.of(lefts, 1 << 30, device), step.StepSpec.of(target, [0])
    end = torch.full((3,), ids.shape[1], device=device)
    texts = [r[0] for r in rows]
    for k in range(2):
        trees = DraftTrees.stack([random_tree(96, seed=10 * k + i, budget=4 + 5 * i).to(device) for i in range(3)])
        start = cache.get_seq_length()
        logits = step.verify(target, cache, spec, trees, slots, end)[0]
        for r, tree in enumerate(trees.trees):
            for i in range(tree.size):
                path = tree.ancestor_mask[i].nonzero().squeeze(1)
                seq = torch.cat([texts[r], tree.tokens[path]]).unsqueeze(0)
                torch.testing.assert_close(logits[r, i], target(input_ids=seq).logits[0, -1], atol=1e-4, rtol=1e-4)
        acc = accept_nodes(trees, logits)
        step.commit(cache, slots, end, start, acc.paths, acc.lengths, int((end + acc.lengths).max()))
        end = end + acc.lengths  # rows accept different lengths: a row's unreached slots lie before the next tree
        texts = [torch.cat([texts[r], trees.tokens[r, acc.paths[r, : int(acc.lengths[r])]]]) for r in range(3)]


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("attn", ["sdpa", "flex_attention"])
def test_greedy_batch_on_the_gpu(attn):
    target = make_target("llama", attn=attn).cuda()
    head = wide_head(target)
    rows = batch_prompts(8, seed=53)
    head.ngram = ngram_from_target(target, [r.cuda() for r in rows])
    ids, mask = (t.cuda() for t in left_pad(rows))
    for kw in (dict(max_new_tokens=40), dict(max_new_tokens=30, eos_token_id=[5, 9, 1])):
        ref = plain(target, ids, mask, **kw)
        assert torch.equal(dart(target, head, ids, mask, **kw), ref), f"{attn} {kw}"


# ---------------------------------------------------------------------------------------------- per-row features
@pytest.mark.parametrize(
    "processors",
    [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2), dict(min_new_tokens=10, eos_token_id=[1])],
)
def test_logits_processors_per_row(llama_ngram, processors):
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(3, seed=17))
    ref = plain(target, ids, mask, max_new_tokens=30, **processors)
    assert torch.equal(dart(target, head, ids, mask, max_new_tokens=30, **processors), ref)


def test_processors_that_know_the_batch_index(llama_ngram):
    """`prefix_allowed_tokens_fn` takes the row's index; repetition penalty holds each row's left padding."""
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(3, seed=47))
    allowed = lambda batch_id, sent: list(range(3 + batch_id, 96, 2 + batch_id))
    kw = dict(max_new_tokens=20, prefix_allowed_tokens_fn=allowed, repetition_penalty=1.2)
    ref = plain(target, ids, mask, **kw)
    assert torch.equal(dart(target, head, ids, mask, **kw), ref)


class StopAfterTokens(StoppingCriteria):
    def __init__(self, tokens: list[int]):
        self.tokens = torch.tensor(tokens)

    def __call__(self, input_ids, scores, **kwargs):
        return torch.isin(input_ids[:, -1], self.tokens)


@pytest.mark.parametrize("eos", [True, False])
def test_custom_stopping_criteria_per_row(llama_ngram, eos):
    """With EOS configured `generate` pads a stopped row; without, it keeps decoding it until every row stopped."""
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(3, seed=19))
    free = plain(target, ids, mask, max_new_tokens=40, eos_token_id=None)[:, ids.shape[1] :]
    crit = StoppingCriteriaList([StopAfterTokens([int(free[r, 3 + 6 * r]) for r in range(3)])])
    kw = dict(max_new_tokens=40, stopping_criteria=crit, eos_token_id=1 if eos else None)
    ref = plain(target, ids, mask, **kw)
    assert ref.shape[1] < ids.shape[1] + 40, "every row must stop for this test to mean much"
    assert torch.equal(dart(target, head, ids, mask, **kw), ref)


@pytest.mark.parametrize("eos", [True, False])
def test_return_dict_scores_and_logits_in_plain_layout(llama_ngram, eos):
    """With EOS a finished row's entries after its stop are the target fed pad tokens; without, its own text's."""
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(3, seed=23))
    free = plain(target, ids, mask, max_new_tokens=20, eos_token_id=None)[:, ids.shape[1] :]
    crit = StoppingCriteriaList([StopAfterTokens([int(free[r, 3 + 4 * r]) for r in range(3)])])
    kw = dict(max_new_tokens=20, stopping_criteria=crit, eos_token_id=1 if eos else None, return_dict_in_generate=True,
              output_scores=True, output_logits=True, repetition_penalty=1.3)
    ref = plain(target, ids, mask, **kw)
    out = dart(target, head, ids, mask, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    assert ref.sequences.shape[1] < ids.shape[1] + 20 and (ref.sequences[0, -1] == PAD) == eos
    assert len(out.scores) == len(ref.scores) and len(out.logits) == len(ref.logits)
    for a, b in zip(out.scores + out.logits, ref.scores + ref.logits):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


@pytest.mark.parametrize("eos", [True, False])
def test_streamer_gets_the_columns_plain_generate_gives(llama_ngram, eos):
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(3, seed=29))
    free = plain(target, ids, mask, max_new_tokens=20, eos_token_id=None)[:, ids.shape[1] :]
    crit = StoppingCriteriaList([StopAfterTokens([int(free[r, 2 + 5 * r]) for r in range(3)])])
    kw = dict(max_new_tokens=20, stopping_criteria=crit, eos_token_id=1 if eos else None)
    ref_stream, out_stream = Collect(), Collect()
    ref = plain(target, ids, mask, streamer=ref_stream, **kw)
    assert ref.shape[1] < ids.shape[1] + 20
    dart(target, head, ids, mask, streamer=out_stream, **kw)
    assert out_stream.ended and out_stream.chunks == ref_stream.chunks


@pytest.mark.parametrize("static", [False, True])
def test_stop_strings_per_row(static):
    """Stop strings end each row where plain batched generate ends it, on the eager and on the static step."""
    from conftest import stop_word_tokenizer

    tok = stop_word_tokenizer()
    target = make_target("llama", vocab_size=len(tok), eos_token_id=1, pad_token_id=0, bos_token_id=None)
    head = make_head(target)
    tok.padding_side = "left"
    enc = tok(["w3 w14 w15 w92 w65 w35", "w7", "w1 w2 w3"], return_tensors="pt", padding=True)
    free = target.generate(**enc, do_sample=False, max_new_tokens=30)[:, enc.input_ids.shape[1] :]
    stops = [tok.convert_ids_to_tokens(int(free[0, 8])), tok.convert_ids_to_tokens(int(free[2, 3]))]
    kw = dict(do_sample=False, max_new_tokens=30, stop_strings=stops, tokenizer=tok)
    ref = target.generate(**enc, **kw)
    stats = DartStats()
    extra = dict(cache_implementation="static", disable_compile=True) if static else {}
    assert torch.equal(target.generate(**enc, assistant_model=head, dart_stats=stats, **kw, **extra), ref)
    assert stats.static == static


# ---------------------------------------------------------------------------------------------- sampling
def test_sampling_same_seed_same_batch(llama_ngram):
    """The same seed gives the same batch, the batch of budget 0 (plain decoding in DART's loop, DART's draws);
    another seed another batch."""
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(4, seed=31))
    kw = dict(attention_mask=mask, assistant_model=head, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=30)
    runs = []
    for seed, extra in ((5, {}), (5, {}), (6, {}), (5, dict(dart_node_budget=0))):
        torch.manual_seed(seed)
        runs.append(target.generate(ids, **kw, **extra))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[3])
    assert not torch.equal(runs[0], runs[2])


def test_sampled_batch_text_does_not_depend_on_the_trees(llama_ngram):
    """Each row of a sampled batch draws with its own seed, by token position: the same seed gives the same text
    whatever budgets the cost-aware rule picks (they depend on measured times), here two scripted budget sequences,
    as at budget 0 and on the static step (a sampled batch with the generation config's processors takes it)."""
    from conftest import scripted_budgets

    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(4, seed=31))
    kw = dict(attention_mask=mask, assistant_model=head, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=30)
    outs = []
    for script in ([3, 0, 3, 3], [0, 3, 0, 0]):
        state, _ = scripted_budgets(target, head, script)
        torch.manual_seed(5)
        stats = DartStats()
        outs.append(target.generate(ids, dart_stats=stats, dart_budget_state=state, dart_node_budget="auto", **kw))
        assert set(stats.node_budgets) == {0, 3}
    for extra in (dict(dart_node_budget=0), dict(dart_node_budget=3, cache_implementation="static",
                                                 disable_compile=True)):
        torch.manual_seed(5)
        stats = DartStats()
        outs.append(target.generate(ids, dart_stats=stats, **kw, **extra))
        assert stats.acceptance == "device" and stats.static == ("cache_implementation" in extra), stats.static_reason
    for out in outs[1:]:
        assert torch.equal(outs[0], out)


_accept_depthwise = acceptance.accept_depthwise


def biased_depthwise(trees, logits, m, processors, context, seeds, positions, keep_scores=False):
    """The device walk, except that a row whose root has a drafted child accepts the first one whatever the target
    draws there (then takes the target's greedy token after it): NOT exact sampling."""
    step = _accept_depthwise(trees, logits, m, processors, context, seeds, positions, keep_scores)
    rows, n = trees.tokens.shape
    children = trees.real & (trees.parents == 0) & (torch.arange(n, device=logits.device) > 0)
    has = children.any(dim=1)
    child = children.long().argmax(dim=1)
    bonus = logits[torch.arange(rows), child].argmax(dim=-1)
    forced_paths = torch.stack([torch.zeros_like(child)] + [child] * (m - 1), dim=1)
    forced_tokens = torch.stack([trees.tokens.gather(1, child.unsqueeze(1)).squeeze(1)] + [bonus] * (m - 1), dim=1)
    return acceptance.BatchAccepted(torch.where(has.unsqueeze(1), forced_paths, step.paths),
                                    torch.where(has, 2, step.lengths),
                                    torch.where(has.unsqueeze(1), forced_tokens, step.tokens), step.scores, step.logits)


def second_token_counts(target, head, ids, mask, n: int) -> torch.Tensor:
    """Counts [rows, vocab] of each row's second new token: the first drawn by the acceptance walk, on a tree with
    children (three new tokens: the first step's tree may hold a child)."""
    counts = torch.zeros(ids.shape[0], target.config.vocab_size)
    torch.manual_seed(0)
    stats = DartStats()
    for _ in range(n):
        out = target.generate(ids, attention_mask=mask, assistant_model=head, do_sample=True, temperature=0.9,
                              top_k=0, max_new_tokens=3, dart_stats=stats)
        assert stats.acceptance == "device"  # the walk `biased_depthwise` replaces
        counts[torch.arange(ids.shape[0]), out[:, ids.shape[1] + 1]] += 1
    return counts


def test_sampling_distribution_per_row(monkeypatch):
    from test_sampling import CHI2_999, chi2, exact_two_token_marginals

    target = make_target("llama", vocab_size=8, bos_token_id=0, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        target.lm_head.weight.div_(4.0)
    head = make_head(target, tree_top_k=8, beam_width=4, node_budget=12)
    rows = [torch.tensor([[3, 5, 7, 1]]), torch.tensor([[6, 2]])]
    ids, mask = left_pad(rows, pad=0)
    exact = [exact_two_token_marginals(target, r, temperature=0.9)[1] for r in rows]
    counts = second_token_counts(target, head, ids, mask, 400)
    for r in range(2):
        assert chi2(counts[r], exact[r]) < CHI2_999[7], f"row {r}"
    monkeypatch.setattr(acceptance, "accept_depthwise", biased_depthwise)
    counts = second_token_counts(target, head, ids, mask, 400)
    assert max(chi2(counts[r], exact[r]) for r in range(2)) > CHI2_999[7], "the test cannot see a biased walk"


def test_batch_budget_shrinks_as_the_batch_grows():
    """The size rule per batch bucket, on a fake clock: each step costs a fixed part, a part per verified token
    (rows * (n + 1)) and a drafting part per row, so a tree's extra tokens cost more the more rows a step holds;
    each row accepts a geometric number of drafts (P(> r) = 0.8^(r + 1)). The size the rule settles on (the most
    frequent of a bucket's last 100 steps) shrinks as the batch grows, down to plain decoding (0) at 64 rows, where
    every tree loses (best sizes by this model: 8, 5, 3, 0)."""
    import collections

    import numpy as np

    from dart_hf.core.budget import LADDER, BudgetPolicy

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    def step_seconds(rows: int, n: int) -> float:
        return 0.010 + 0.0004 * rows * (n + 1) + (0.0005 * rows if n else 0.0)

    clock, rng = Clock(), np.random.default_rng(0)
    policy = BudgetPolicy(clock=clock)
    settled, chosen = [], {}
    for rows in (1, 4, 16, 64):
        chosen[rows] = []
        for _ in range(250):
            n = policy.next_budget(rows)
            assert n in (0, *LADDER)
            start = clock()
            clock.now += step_seconds(rows, n)
            accepted = rng.geometric(0.2, size=rows) - 1
            policy.observe(rows, n, [list(range(min(int(a), n))) for a in accepted], clock() - start)
            chosen[rows].append(n)
        settled.append(collections.Counter(chosen[rows][-100:]).most_common(1)[0][0])
    assert settled == sorted(settled, reverse=True) and settled[0] >= 5 and settled[2] > 0, settled
    assert settled[-1] == 0 and chosen[64][-100:].count(0) >= 90, chosen[64][-100:]  # probes: a few steps
    assert chosen[1][0] == 0 and chosen[4][0] == 0  # each bucket times plain decoding first


# ---------------------------------------------------------------------------------------------- refused
def test_right_padding_is_refused(llama_ngram):
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(2, seed=37))
    with pytest.raises(ValueError, match="left padding only"):
        dart(target, head, ids, mask.flip(1), max_new_tokens=4)


def test_chain_mode_and_beams_refuse_batches(llama_ngram):
    target, head = llama_ngram
    ids, mask = left_pad(batch_prompts(2, seed=41))
    with pytest.raises(ValueError, match="batch size 1"):
        dart(target, head, ids, mask, max_new_tokens=4, dart_mode="chain")
    with pytest.raises(ValueError, match="num_beams=1"):
        dart(target, head, ids, mask, max_new_tokens=4, num_beams=2)


@pytest.mark.parametrize("model_type", ["qwen2", *SLIDING])
def test_sliding_window_batches_equal_plain_batched_generate(model_type, monkeypatch):
    """Left-padded batches on sliding-window targets (all layers sliding, or sliding and full): the window is applied
    by each row's mask from its own positions, holes and padding included. A noisy oracle head drafts the plain
    continuation, so paths deeper than the window are accepted."""
    if model_type == "qwen2":
        target = make_target("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
        vocab = target.config.vocab_size
    else:
        target, vocab = sliding_target(model_type), 64
    head = dart_hf.DartHead.from_target(target, draft_length=3, node_budget=8).eval()
    g = torch.Generator().manual_seed(45)
    rows = [torch.randint(3, vocab, (1, n), generator=g) for n in (9, 3, 14)]
    ids, mask = left_pad(rows)
    want = target.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=24, pad_token_id=PAD)
    oracle_rows = {tuple(r[0].tolist()): want[i, ids.shape[1]:] for i, r in enumerate(rows)}
    original = DartDrafter.propose
    depths, proposed = iter(list(range(1, 9)) * 40), []

    def propose(self, max_new, timer, node_budget=None):
        texts = [self.texts(b) for b in range(len(max_new))]
        original(self, max_new, timer, node_budget)  # the drafter's own state machine runs as it is
        trees = DraftTrees.stack([row_tree(text, limit) for text, limit in zip(texts, max_new)])
        proposed.append([row.size // 2 for row in trees.trees])  # each row's true chain's length
        return trees

    def row_tree(text, limit):
        for prompt, cont in oracle_rows.items():
            if tuple(text[: len(prompt)].tolist()) == prompt:
                done = text.numel() - len(prompt)
                truth = cont[done : done + min(next(depths), limit)].tolist()
                wrong = [(t + 1 + i) % vocab for i, t in enumerate(truth)]
                return chain_tree(int(text[-1]), truth, wrong)
        raise AssertionError("unknown row")

    monkeypatch.setattr(DartDrafter, "propose", propose)
    stats = dart_hf.DartStats()
    out = target.generate(ids, attention_mask=mask, assistant_model=head, do_sample=False, max_new_tokens=24,
                          pad_token_id=PAD, dart_stats=stats)
    assert torch.equal(out, want)
    # a step where every row accepted its whole true chain (+ the target's token), one of them deeper than the window
    whole = [p for p, got in zip(proposed, stats.accepted_lengths) if got == sum(n + 1 for n in p)]
    assert any(max(p) > 4 for p in whole), (proposed, stats.accepted_lengths)


# ---------------------------------------------------------------------------------------------- pipelines
def test_pipeline_with_batch_size_equals_plain_pipeline():
    from transformers import pipeline

    from conftest import make_word_tokenizer

    tok = make_word_tokenizer()
    target = make_target("llama", vocab_size=len(tok), eos_token_id=1, pad_token_id=0, bos_token_id=None)
    head = make_head(target)
    chats = [[{"role": "user", "content": " ".join(f"w{(7 * i + j) % 100}" for j in range(1 + 3 * i))}]
             for i in range(6)]
    kw = dict(do_sample=False, max_new_tokens=12, batch_size=4)
    ref = pipeline("text-generation", model=target, tokenizer=tok)(chats, **kw)
    head.stats = None
    out = pipeline("text-generation", model=target, tokenizer=tok, assistant_model=head)(chats, **kw)
    assert out == ref
    assert head.stats is not None and head.stats.steps > 0, "the pipeline did not decode with DART"
