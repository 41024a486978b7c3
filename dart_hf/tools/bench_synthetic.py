"""`dart-hf bench --synthetic`, on a CUDA GPU (`examples/gpu_check.sh` runs it): a random target of Qwen3-8B's shape
in bf16 (`synthetic_target`, no weights downloaded) and a random head of the reference layout; the verify cost by tree
size and the per-phase time of real DART steps by node budget (`run_synthetic`), and with `--compiled` the same on a
static cache with `torch.compile` against compiled plain decoding (`TokenClock` times plain's decoding steps without
its prefill), per batch size with `--batch-size` (a batch of B random prompts of one length: what DART's compiled step
costs per row token beside plain's as B grows). Writes synthetic.json and synthetic.md (`synthetic_markdown`), again
after each part (a run cut short by a timeout keeps what it finished). Apart from the real-model bench: no prompts,
no methods list, its own report; it shares only `compile_config`, the sampling settings, the step phases, the device
sync, the environment and the number format.
With `sampling` (`--temperature`, `--qwen3-sampling`, ...: `bench_methods.sampling_settings`) every `generate` call
here samples at those settings, seeded with the same seed right before it (`_generate`), so the compiled DART step is
timed against compiled plain decoding as a sampling user runs both; outputs are then not compared (None).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .bench_methods import compile_config, sampling_kwargs, sampling_text, seed_call
from .bench_report import NOT_COMPARED, fmt
from .bench_timing import PHASE_LABELS, PHASES, environment, sync_device

QWEN3_8B_SHAPE = dict(
    hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
    tie_word_embeddings=False, rms_norm_eps=1e-6,
)


def synthetic_target(shape: dict, device: str | torch.device, dtype: torch.dtype, attn_implementation: str = "sdpa"):
    """A random Qwen3 model of `shape`, built directly on `device` (no weights are loaded or downloaded)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**shape, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def run_synthetic(
    shape: dict = QWEN3_8B_SHAPE,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    attn_implementation: str = "sdpa",
    budgets: tuple[int, ...] = (7, 15, 31, 63, 95),
    prompt_len: int = 512,
    new_tokens: int = 48,
    draft_length: int = 7,
    draft_vocab_size: int | None = 32000,
    cost_sizes: tuple[int, ...] | None = None,
    repeats: int = 5,
    out_dir: str | Path | None = None,
    progress: bool = True,
    compiled: bool = False,
    compile_backend: str = "inductor",
    sampling: dict | None = None,
    batch_sizes: tuple[int, ...] = (1,),
) -> dict:
    """Verify cost by tree size, and the per-phase time of real DART steps (random head, random n-gram) by budget.

    The head has the reference Qwen3-8B head's layout (draft length 7, a 32000-token draft vocabulary, norm applied
    twice), with random weights: it accepts about nothing, so steps are timed at about one token each.

    Correct by construction: the cost curve is `verify_cost.measure_verify_cost` and the steps are the real tree
    loop (`generate(..., assistant_model=head, dart_timing=True)`); nothing here re-implements decoding.

    `compiled`: also plain and DART `generate` on a static cache with `torch.compile` (`compile_backend`), what a GPU
    user runs: `results["compiled"]` (`_synthetic_compiled`), for each of `batch_sizes` (smallest first) on a batch of
    that many random prompts of `prompt_len` tokens. Batch size 1's part stays where a one-row run has always put it
    (`results["compiled"]`'s own keys), the others go under `results["compiled"]["batches"]["<B>"]`; every part
    carries its `batch_size`. The eager parts above are one row: batch sizes other than 1 need `compiled`.

    `sampling`: None (greedy) or `bench_methods.sampling_settings`: every call samples at those settings from one
    seed (`_generate`); the "equal to plain" fields are then None (sampled texts differ by method).
    """
    from .verify_cost import DEFAULT_SIZES, measure_verify_cost
    from ..core.modeling import DartHead
    from ..core.ngram import NGramModel

    sizes = synthetic_batch_sizes(batch_sizes, compiled)
    device = torch.device(device)
    t0 = time.perf_counter()
    target = synthetic_target(shape, device, dtype, attn_implementation)
    build_s = time.perf_counter() - t0
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (1, prompt_len), generator=g).to(device)
    torch.manual_seed(0)
    dv = None if draft_vocab_size is None else min(draft_vocab_size, vocab)
    with torch.device(device):
        head = DartHead.from_target(target, draft_length=draft_length, draft_vocab_size=dv, final_norm_repeats=2)
    head.eval()
    if dv is not None:
        head.set_draft_vocab(torch.randperm(vocab, generator=g)[:dv])
    seqs = torch.randint(vocab, (64, 256), generator=g).tolist()
    head.ngram = NGramModel.build(seqs, order=3, vocab_size=vocab, progress=False)

    cost = measure_verify_cost(target, sizes=cost_sizes or DEFAULT_SIZES, past_len=prompt_len, repeats=repeats,
                               warmup=2)
    gen = dict(**sampling_kwargs(sampling), max_new_tokens=new_tokens, attention_mask=torch.ones_like(ids))
    _generate(target, ids, **{**gen, "max_new_tokens": 8})  # warm-up
    plain_out, plain_s = _timed_generate(target, ids, **gen)
    plain_ms = 1e3 * plain_s / (plain_out.shape[1] - ids.shape[1])

    rows = []
    for budget in tqdm(budgets, desc="synthetic budgets", disable=not progress):
        run = dict(assistant_model=head, dart_node_budget=budget, **gen)
        _generate(target, ids, **{**run, "max_new_tokens": 8})  # warm-up at this tree size
        out, wall = _timed_generate(target, ids, **run)  # untimed phases: the real wall time of a step
        steps_plain = head.stats["steps"]
        _generate(target, ids, dart_timing=True, **run)  # synchronised phases: where the time goes
        stats = head.stats
        phase_ms = {p: 1e3 * stats["time"].get(p, 0.0) / max(stats["steps"], 1) for p in PHASES}
        step_ms = sum(phase_ms.values())
        wall_step_ms = 1e3 * (wall - stats["time"].get("prefill", 0.0)) / max(steps_plain, 1)
        overhead = phase_ms["draft"] + phase_ms["tree"] + phase_ms["accept"]
        rows.append({
            "node_budget": budget,
            "tree_tokens": budget + 1,
            "step_ms_wall": wall_step_ms,
            "step_ms_timed": step_ms,
            "phase_ms": phase_ms,
            "overhead_share": overhead / step_ms if step_ms else float("nan"),
            "head_and_tree_share": (phase_ms["draft"] + phase_ms["tree"]) / step_ms if step_ms else float("nan"),
            # the accepted length (tokens per step) at which DART only matches plain decoding
            "break_even_accepted_length": wall_step_ms / plain_ms,
            "projected_speedup_at_3.7": 3.7 * plain_ms / wall_step_ms,
            "output_equal_to_plain": _equal(out, plain_out, gen),
        })
    results = {
        "meta": {**environment(target), "shape": shape, "build_seconds": build_s, "prompt_len": prompt_len,
                 "new_tokens": new_tokens, "draft_length": draft_length, "draft_vocab_size": dv,
                 **({"sampling": sampling} if sampling is not None else {})},
        "verify_cost_ms": {str(n): 1e3 * s for n, s in zip(cost.sizes, cost.seconds)},
        "plain_ms_per_token": plain_ms,
        "budgets": rows,
    }
    _write(results, out_dir)
    if compiled:
        results["compiled"] = {"backend": compile_backend, "batch_sizes": sizes}
        for batch in sizes:
            prompts, call = _batch_of(ids, batch, gen, vocab)
            eager = plain_out if batch == 1 else _generate(target, prompts, **call)  # what outputs are compared with
            part = _synthetic_compiled(target, head, prompts, call, budgets, eager, compile_backend, progress,
                                       split=len(sizes) == 1)
            if batch == 1:
                results["compiled"].update(part)
            else:
                results["compiled"].setdefault("batches", {})[str(batch)] = part
            _write(results, out_dir)
    return results


def synthetic_batch_sizes(batch_sizes, compiled: bool) -> list[int]:
    """The batch sizes a synthetic run takes, smallest first; a ValueError for a size below 1, or past 1 without the
    compiled part (the eager parts time one row)."""
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batch_sizes)}")
    if sizes != [1] and not compiled:
        raise ValueError(f"batch sizes {sizes}: only the compiled part decodes batches (--compiled, compiled=True)")
    return sizes


def _write(results: dict, out_dir: str | Path | None) -> None:
    """synthetic.json and synthetic.md of what is done so far (written after each part: a timeout keeps them)."""
    if out_dir is None:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "synthetic.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "synthetic.md").write_text(synthetic_markdown(results))


def _batch_of(ids: torch.Tensor, batch: int, gen: dict, vocab: int) -> tuple[torch.Tensor, dict]:
    """(prompts, `generate` arguments) for a batch: the one-row prompt for 1, else `batch` random prompts of its
    length (seeded by the batch size; one length, so no padding), the attention mask sized to them."""
    if batch == 1:
        return ids, gen
    rows = torch.randint(vocab, (batch, ids.shape[1]), generator=torch.Generator().manual_seed(batch))
    rows = rows.to(ids.device)
    return rows, {**gen, "attention_mask": torch.ones_like(rows)}


def _generate(target, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """`target.generate(ids, **kwargs)`, seeded first when it samples (one seed for every call: plain and DART
    decode from the same random state, as the real-model bench's methods do on a prompt)."""
    seed_call(kwargs, "synthetic")
    return target.generate(ids, **kwargs)


def _equal(out: torch.Tensor, ref: torch.Tensor, gen: dict) -> bool | None:
    """Whether two greedy outputs are equal; None when sampling (sampled texts differ by method)."""
    return None if gen.get("do_sample") else bool(torch.equal(out, ref))


def _timed_generate(target, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, float]:
    """(output, wall seconds) of one `generate` call (`_generate`: seeded when sampling, outside the timed part),
    with device syncs around it."""
    seed_call(kwargs, "synthetic")
    sync_device(ids.device)
    start = time.perf_counter()
    out = target.generate(ids, **kwargs)
    sync_device(ids.device)
    return out, time.perf_counter() - start


class TokenClock:
    """A `generate` streamer that notes when each put reached the host (the prompt, then the new tokens one step at a
    time: a [batch] column each, whatever the batch size): the decoding steps' time without the prefill."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None

    def decode_seconds(self) -> float:
        """Seconds from the prefill's token reaching the host to the last new token: the decoding steps."""
        return self.times[-1] - self.times[1]

    def step_seconds(self) -> float:
        """Mean seconds per decoding step of plain `generate` (a put per step; DART puts a column per token)."""
        return self.decode_seconds() / max(len(self.times) - 2, 1)


def _synthetic_compiled(target, head, ids: torch.Tensor, gen: dict, budgets, plain_out: torch.Tensor, backend: str,
                        progress: bool, split: bool) -> dict:
    """Plain `generate` and DART per budget on a static cache with `torch.compile` (`compile_config`), on the batch
    `ids` (`plain_out`: plain eager `generate`'s output for it). Every compiled call is first made once untimed (it
    compiles; its seconds are reported). The plain step is timed between the first and the last new token reaching
    the host (`TokenClock`): its decoding steps without the (eager) prefill, as DART's step leaves the prefill out.
    Per row token: the decoding time over the rows' new tokens after the prefill's (plain: a step's time over the batch
    size). `split`: the largest budget also with `dart_timing=True` (`_synthetic_compiled_row`)."""
    batch = ids.shape[0]
    static = {**gen, "cache_implementation": "static", "compile_config": compile_config(ids.device, backend)}
    _, plain_compile_s = _timed_generate(target, ids, **static)
    clock = TokenClock()
    out, seconds = _timed_generate(target, ids, streamer=clock, **static)
    plain_step_ms = 1e3 * clock.step_seconds()
    rows = [_synthetic_compiled_row(target, head, ids, {**static, "assistant_model": head, "dart_node_budget": b},
                                    plain_step_ms, plain_out, split=split and b == max(budgets))
            for b in tqdm(budgets, desc=f"synthetic compiled budgets, batch of {batch}", disable=not progress)]
    return {"batch_size": batch, "plain_step_ms": plain_step_ms,
            "plain_ms_per_row_token": plain_step_ms / batch,
            "plain_ms_per_token": 1e3 * seconds / (out.shape[1] - ids.shape[1]),
            "plain_first_call_seconds": plain_compile_s, "plain_equal_to_eager": _equal(out, plain_out, gen),
            "budgets": rows}


def _synthetic_compiled_row(target, head, ids: torch.Tensor, run: dict, plain_step_ms: float,
                            plain_out: torch.Tensor, split: bool) -> dict:
    """One budget's compiled DART step on the batch `ids`: its wall time (the captured step, greedy or sampled), then,
    with `split` (the largest budget of a run of one batch size only: three more graphs to compile, minutes each on a
    large target), with `dart_timing=True` (its parts captured and timed one by one: draft = head forward + tree
    search, verify, accept). Each variant's first call compiles, untimed. The decoding time is taken as plain's is
    (`TokenClock`, the same streamer: from the prefill's token to the last new token reaching the host), so the
    prefill stays out on a GPU too, where the untimed phases are launch times only; the streamer's column per new
    token (a host read per row and token) is counted in DART's time."""
    batch = ids.shape[0]
    _, first_s = _timed_generate(target, ids, **run)
    clock = TokenClock()
    out, _ = _timed_generate(target, ids, streamer=clock, **run)
    stats = head.stats
    decode_ms = 1e3 * clock.decode_seconds()
    step_ms = decode_ms / max(stats.steps, 1)
    row_token_ms = decode_ms / (batch * max(out.shape[1] - ids.shape[1] - 1, 1))  # after the prefill's token
    phase_ms, timing_first_s = {p: float("nan") for p in ("draft", "verify", "accept")}, float("nan")
    if split:
        _, timing_first_s = _timed_generate(target, ids, dart_timing=True, **run)
        _timed_generate(target, ids, dart_timing=True, **run)
        timed = head.stats
        phase_ms = {p: 1e3 * timed.time.get(p, 0.0) / max(timed.steps, 1) for p in ("draft", "verify", "accept")}
    total = sum(phase_ms.values())
    return {
        "node_budget": run["dart_node_budget"],
        "compiled": stats.compiled,
        "static_reason": stats.static_reason,
        "step_ms": step_ms,
        "step_over_plain_compiled_step": step_ms / plain_step_ms,
        "ms_per_row_token": row_token_ms,
        "row_token_over_plain_compiled": row_token_ms / (plain_step_ms / batch),
        "phase_ms": phase_ms,
        "head_and_tree_share": phase_ms["draft"] / total if total else float("nan"),
        "first_call_seconds": first_s,
        "timing_first_call_seconds": timing_first_s,
        "output_equal_to_plain": _equal(out, plain_out, run),
    }


def _yes_no(equal: bool | None) -> str:
    """An "equal to plain" cell: yes, no, or not compared (None: a sampled run)."""
    return NOT_COMPARED if equal is None else "yes" if equal else "no"


def synthetic_markdown(results: dict) -> str:
    meta = results["meta"]
    sampling = meta.get("sampling")
    lines = [
        f"# dart-hf bench --synthetic, sampling ({sampling_text(sampling)})" if sampling
        else "# dart-hf bench --synthetic", "",
        *([f"Every `generate` call samples ({sampling_text(sampling)}), seeded with one torch seed right before it; "
           "outputs are not compared with plain's (sampled texts differ by method).", ""] if sampling else []),
        f"Random target of shape {meta['shape']} in {meta['dtype']} ({meta['attn_implementation']}) on "
        f"{meta['device']}; prompt {meta['prompt_len']} tokens; {meta['new_tokens']} new tokens; torch "
        f"{meta['torch']}, transformers {meta['transformers']}. Plain decoding: "
        f"{results['plain_ms_per_token']:.2f} ms per token.", "",
        "## Verify cost by tree size", "", "| tree tokens | ms | x one token |", "|---:|---:|---:|",
    ]
    one = results["verify_cost_ms"].get("1")
    for n, ms in results["verify_cost_ms"].items():
        lines.append(f"| {n} | {ms:.2f} | {fmt(ms / one if one else None)} |")
    lines += ["", "## DART step by node budget (random head: about one token accepted per step)", "",
              "| budget | step ms (wall) | " + " | ".join(PHASE_LABELS[p] + " ms" for p in PHASES)
              + " | head + tree share | overhead share | break-even accepted length | speedup at 3.7 |",
              "|---:|---:|" + "---:|" * len(PHASES) + "---:|---:|---:|---:|"]
    for r in results["budgets"]:
        phases = " | ".join(f"{r['phase_ms'][p]:.2f}" for p in PHASES)
        lines.append(f"| {r['node_budget']} | {r['step_ms_wall']:.2f} | {phases} | "
                     f"{100 * r['head_and_tree_share']:.0f}% | {100 * r['overhead_share']:.0f}% | "
                     f"{r['break_even_accepted_length']:.2f} | {r['projected_speedup_at_3.7']:.2f}x |")
    equals = [r["output_equal_to_plain"] for r in results["budgets"]]
    equal = None if None in equals else all(equals)
    why = "" if equal is None else (" (random bf16 weights give near-tied logits; batched and one-token kernels may "
                                    "round differently)")
    lines += ["", f"Outputs equal to plain generate at every budget: {_yes_no(equal)}{why}.", ""]
    return "\n".join(lines + _synthetic_compiled_lines(results.get("compiled")))


def _compiled_parts(c: dict) -> list[dict]:
    """The compiled section's part per batch size, smallest first: batch size 1's in the section's own keys, the
    others under "batches" (`run_synthetic`)."""
    return ([c] if "budgets" in c else []) + [c["batches"][b] for b in sorted(c.get("batches", {}), key=int)]


def _synthetic_compiled_lines(c: dict | None) -> list[str]:
    """The static cache + torch.compile section of the synthetic report: plain, then DART, a row per batch size (and
    budget)."""
    parts = _compiled_parts(c) if c is not None else []
    if not parts:
        return []
    lines = [f"## Static cache + torch.compile ({c['backend']})", "",
             "| batch | plain step ms | ms per row token | ms per step with the prefill | first call s | "
             "equal to plain eager |", "|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {p['batch_size']} | {p['plain_step_ms']:.2f} | {p['plain_ms_per_row_token']:.3f} | "
              f"{p['plain_ms_per_token']:.2f} | {p['plain_first_call_seconds']:.1f} | "
              f"{_yes_no(p['plain_equal_to_eager'])} |" for p in parts]
    first = parts[0]
    by_budget = {r["node_budget"]: r for r in first["budgets"]}
    headline = by_budget.get(60) or by_budget[max(by_budget)]
    batch = "" if first["batch_size"] == 1 else f", batches of {first['batch_size']}"
    lines += ["", f"**{headline['node_budget']}-node DART compiled step / plain compiled step{batch}: "
              f"{headline['step_over_plain_compiled_step']:.2f}** (the accepted length at which compiled DART only "
              "matches compiled plain decoding).", "",
              "| batch | budget | step ms | / plain compiled step | ms per row token | / plain per row token | "
              "draft (head + tree) ms | verify ms | accept ms | head + tree share | first call s | equal to plain |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for p in parts:
        for r in p["budgets"]:
            ph = r["phase_ms"]
            note = "" if r["compiled"] else f" (not compiled: {r['static_reason']})"
            lines.append(f"| {p['batch_size']} | {r['node_budget']}{note} | {r['step_ms']:.2f} | "
                         f"{r['step_over_plain_compiled_step']:.2f} | {r['ms_per_row_token']:.3f} | "
                         f"{r['row_token_over_plain_compiled']:.2f} | {fmt(ph['draft'])} | {fmt(ph['verify'])} | "
                         f"{fmt(ph['accept'])} | {fmt(r['head_and_tree_share'], '.0%')} | "
                         f"{r['first_call_seconds']:.1f} | {_yes_no(r['output_equal_to_plain'])} |")
    return lines + ["", "Decoding time: from the prefill's token to the last new token reaching the host (a "
                    "streamer: the prefill left out). Step ms: that time per step of the batch; ms per row token: that "
                    "time over every row's new tokens after the prefill's (plain decodes one per row and step, the "
                    "random head's DART about one). Equal to plain: every row equal to plain eager `generate`'s on "
                    "the same batch. The split comes from a second run with `dart_timing=True` at the largest budget, "
                    "in a run of one batch size only (the step's parts captured and timed one by one: three graphs, "
                    "so their sum differs from the one-graph step). First call s: the untimed call that compiles.", ""]


__all__ = ["QWEN3_8B_SHAPE", "TokenClock", "run_synthetic", "synthetic_batch_sizes", "synthetic_markdown",
           "synthetic_target"]
