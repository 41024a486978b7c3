"""What `dart-hf bench` writes (`write_reports`): results.md (`markdown_report`; the batched bench's
`batch_markdown_report`, and the `--profile` table), results.png (`plot_results`; `plot_batch_results`) and
results.json. Everything here reads the results dict `bench.run_bench` returns and nothing else: no model runs and
nothing is timed, so the layout of a report can change without touching what is measured.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .bench_methods import sampling_text
from .bench_timing import ALL_PHASES, PHASE_LABELS

NOT_COMPARED = "n/a (sampling)"  # the "equal to generate" cell of a sampled run: sampled texts differ by method


def fmt(x, spec: str = ".2f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _equal_text(r: dict, unit: str) -> str:
    """A row's "equal to generate" cell: yes, NO (how many prompts or batches), or not compared (sampling)."""
    if r["equal_to_plain"] is None:
        return NOT_COMPARED
    return "yes" if r["equal_to_plain"] else f"**NO ({r['mismatched_prompts']} {unit})**"


def _report_head(results: dict) -> list[str]:
    meta = results["meta"]
    sampling = meta.get("sampling")
    lines = [f"# dart-hf bench, sampling ({sampling_text(sampling)})" if sampling else "# dart-hf bench", ""]
    if results["all_equal"] is None:
        lines += [f"Sampling with {sampling_text(sampling or {})}: every method gets `do_sample=True` and these "
                  f"settings; seeds: {(sampling or {}).get('seeds', 'n/a')}. Outputs are not compared with plain "
                  "`generate` (each method consumes the random stream its own way, so the same seed gives different "
                  f"texts): \"equal to generate\" reads {NOT_COMPARED}.", ""]
    elif not results["all_equal"]:
        lines += ["**OUTPUT MISMATCH: some methods did not reproduce plain `generate` (greedy must be identical).**",
                  ""]
        lines += [f"- {m['method']} on {m['dataset']} "
                  + (f"batch size {m['batch_size']} batch {m['batch']} row {m['row']} (prompt {m['prompt']})"
                     if "batch_size" in m else f"prompt {m['prompt']}")
                  + f": first difference at new token {m['first_difference']} ({m['new_tokens']} vs "
                  f"{m['reference_new_tokens']} new tokens)"
                  for m in results["mismatches"]]
        lines.append("")
    else:
        lines += ["Every method's output equals plain `generate` on every prompt (greedy).", ""]
    lines += [
        f"Target `{meta.get('target')}` ({meta.get('dtype')}, {meta.get('attn_implementation')}) on "
        f"{meta.get('device')} ({meta.get('torch_threads')} threads); head `{meta.get('head', 'n/a')}`; "
        f"{meta.get('max_new_tokens')} new tokens max; prompts {meta.get('prompts')}; torch {meta.get('torch')}, "
        f"transformers {meta.get('transformers')}; {meta.get('date')}.",
        "",
    ]
    if meta.get("runs", 1) > 1:
        lines += [f"{meta['runs']} interleaved runs: speedup is the median of the runs' speedups (min-max of the "
                  "runs in parentheses); tokens/s is over all runs.", ""]
    if meta.get("competing_load"):
        lines += [f"Under a competing load of {meta['competing_load']} busy-loop process(es) for the whole bench.", ""]
    if meta.get("tensor_parallel"):
        lines += [f"Tensor-parallel target over {meta['tensor_parallel']} ranks (torchrun); rank 0's wall times.", ""]
    return lines


def markdown_report(results: dict) -> str:
    if "batches" in results:
        return batch_markdown_report(results)
    lines = _report_head(results) + _compile_lines(results)
    for ds, rows in results["datasets"].items():
        baselines = list(dict.fromkeys(r["baseline"] for r in rows.values() if "baseline" in r))
        extra = "".join(f" vs {results['methods'][b]} |" for b in baselines)
        lines += [f"## {ds}", "", "| method | tokens/s | speedup | accepted length | equal to generate |" + extra,
                  "|---|---:|---:|---:|---|" + "---:|" * len(baselines)]
        for name, r in rows.items():
            equal = _equal_text(r, "prompts")
            vs = "".join(f" {_figure_text(r, rows, 'speedup_vs_baseline')} |" if r.get("baseline") == b else " |"
                         for b in baselines)
            lines.append(f"| {results['methods'][name]} | {fmt(r['tokens_per_s'], '.1f')} | "
                         f"{_figure_text(r, rows)} | {fmt(r['accepted_length'])} | {equal} |{vs}")
        lines += _caveat_lines(results, rows, "calls")
        lines += _phase_lines(results, rows)
        lines.append("")
    return "\n".join(lines + hindsight_lines(results) + _profile_lines(results))


def _phase_lines(results: dict, rows: dict) -> list[str]:
    """The DART rows' step breakdown ("captured step": the compiled static step, one phase)."""
    tree_rows = {n: r for n, r in rows.items() if "phase_share" in r}
    if not tree_rows:
        return []
    phases = [p for p in ALL_PHASES if any(p in r["phase_share"] for r in tree_rows.values())]
    lines = ["", "Where a DART tree step's time goes (share of the average step; prefill excluded):", "",
             "| method | step (ms) | " + " | ".join(PHASE_LABELS[p] for p in phases) + " | node budget |",
             "|---|---:|" + "---:|" * len(phases) + "---|"]
    for name, r in tree_rows.items():
        shares = " | ".join(f"{100 * r['phase_share'].get(p, 0.0):.0f}% ({r['phase_ms'].get(p, 0.0):.1f} ms)"
                            for p in phases)
        lines.append(f"| {results['methods'][name]} | {r['step_ms']:.1f} | {shares} | {_budget_text(r) or 'n/a'} |")
    notes = [f"- {results['methods'][name]}: {calls} call(s) ran uncompiled: {why}"
             for name, r in tree_rows.items() for why, calls in r.get("not_compiled", {}).items()]
    return lines + ([""] + notes if notes else [])


def _compile_lines(results: dict) -> list[str]:
    """The compiled methods' warm-up (compile) seconds, which the timed tokens/s leave out."""
    warm = results.get("compile_warmup") or {}
    if not warm:
        return []
    lines = ["Compiled methods (static cache + `torch.compile`) were first called once on every prompt, untimed, "
             "longest first: that compiles every graph the timed calls run. Those warm-up seconds are not in any "
             "tokens/s:", "", "| method | warm-up s (all calls) | first call s | calls |", "|---|---:|---:|---:|"]
    lines += [f"| {results['methods'][n]} | {w['seconds']:.1f} | {w['first_call_seconds']:.1f} | {w['calls']} |"
              for n, w in warm.items()]
    return lines + [""]


def batch_markdown_report(results: dict) -> str:
    """The batched bench's report: per data set, one row per (batch size, method)."""
    meta = results["meta"]
    lines = _report_head(results) + _compile_lines(results)
    sizes_text = ", ".join(map(str, meta["batch_sizes"]))
    lines += [f"Batches: the prompts of each data set in left-padded batches of {sizes_text} rows; every batch runs "
              "every method before the next batch, the batch sizes take turns. tokens/s: new "
              "tokens (each row's up to its first EOS) over the wall time of the batch's `generate` calls; vs plain: "
              "over plain batched `generate` at the same batch size; tree: the mean node budget per row over the "
              "DART steps (0: a plain decoding step).", ""]
    for name, why in meta.get("skipped_for_batches", {}).items():
        lines.append(f"- {results['methods'][name]} runs at batch size 1 only: {why}.")
    if meta.get("skipped_for_batches"):
        lines.append("")
    for ds, sizes in results["batches"].items():
        compiled = any("baseline" in r for rows in sizes.values() for r in rows.values())
        lines += [f"## {ds}", "",
                  "| batch size | method | tokens/s | vs plain |" + (" vs compiled plain |" if compiled else "")
                  + " tree (nodes per row) | equal to generate |",
                  "|---:|---|---:|---:|" + ("---:|" if compiled else "") + "---|---|"]
        for b, rows in sizes.items():
            for name, r in rows.items():
                equal = _equal_text(r, "batches")
                vs = f" {_figure_text(r, rows, 'speedup_vs_baseline') if 'baseline' in r else ''} |" if compiled else ""
                lines.append(f"| {b} | {results['methods'][name]} | {fmt(r['tokens_per_s'], '.1f')} | "
                             f"{_figure_text(r, rows)} |{vs} {_budget_text(r)} | {equal} |")
        lines += [line for b, rows in sizes.items()
                  for line in _caveat_lines(results, rows, f"calls at batch size {b}")]
        lines.append("")
    return "\n".join(lines + hindsight_lines(results) + _profile_lines(results))


def _speedup_text(r: dict, key: str = "speedup") -> str:
    """The speed-up over plain (or another `_ratios` key); over several runs, their median with the runs' min-max."""
    if len(r.get(f"{key}_runs", [])) > 1:
        lo, hi = r[f"{key}_spread"]
        return f"{fmt(r[f'{key}_median'])}x ({fmt(lo)}-{fmt(hi)})"
    return f"{fmt(r[key])}x"


PLAIN_DECODING = "none: plain decoding throughout"  # a DART method's speed-up cell when it drafted no tree


def _figure_text(r: dict, rows: dict, key: str = "speedup") -> str:
    """A speed-up cell, with beside it what keeps the ratio from being a speed-up: a DART method that decoded plainly
    in every call did plain `generate`'s decoding (its ratio, in results.json and the note beneath, is overhead and
    timing noise, so the cell shows none); a method or its reference timed while other processes kept the machine
    busy (`_caveat_lines` says how busy)."""
    if r.get("plain_decoding"):
        return PLAIN_DECODING
    reference = rows.get("plain" if key == "speedup" else r.get("baseline"), {})
    busy = r.get("busy") or reference.get("busy")
    return _speedup_text(r, key) + (" (busy machine)" if busy else "")


def _caveat_lines(results: dict, rows: dict, unit: str) -> list[str]:
    """Beneath a table: each method timed on a busy machine (how busy, `bench_timing._machine_use`), and each DART
    method whose calls decoded plainly throughout (node budget 0 in every step), all of them or some."""
    lines = []
    for name, r in rows.items():
        label = results["methods"][name]
        if r.get("busy"):
            lines.append(f"- {label}: timed on a busy machine, {r['busy']}: its tokens/s and every ratio to it "
                         "measure contention for the CPU as much as decoding; rerun on an idle machine")
        if r.get("plain_decoding"):
            lines.append(f"- {label}: all {r['calls']} of its {unit} decoded plainly (node budget 0 in every step): "
                         f"the same decoding as plain `generate`, so its measured ratio ({_speedup_text(r)}) is "
                         "overhead and timing noise, not a speed-up")
        elif r.get("plain_calls"):
            lines.append(f"- {label}: {r['plain_calls']} of its {r['calls']} {unit} decoded plainly (node budget 0 in "
                         "every step)")
    return [""] + lines if lines else []


def _budget_text(r: dict) -> str:
    """The mean node budget per step, with the steps per budget where there were several ("" for no DART steps)."""
    if "node_budget_mean" not in r:
        return ""
    text = fmt(r["node_budget_mean"], ".1f")
    counts = r.get("node_budget_counts") or {}
    if len(counts) > 1:
        text += " (" + ", ".join(f"{b}: {c}" for b, c in counts.items()) + ")"
    return text


def _profile_lines(results: dict) -> list[str]:
    """The profile table (`bench_profile.profile_methods`), when the bench ran with `profile`."""
    profile = results.get("profile")
    if not profile:
        return []
    lines = ["## Profile: aten ops and host syncs per step", "",
             "One call per method on the first prompt of each data set, after the warm-up and the timed runs, "
             f"untimed. {profile['how']} {profile['syncs'][0].upper()}{profile['syncs'][1:]}.", "",
             "| data set | method | steps | new tokens | aten ops / step | aten ops / token | host syncs / step | "
             "host syncs / token |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for ds, rows in profile["datasets"].items():
        for name, r in rows.items():
            lines.append(f"| {ds} | {results['methods'][name]} | {r['steps']} | {r['new_tokens']} | "
                         f"{r['aten_ops_per_step']:.1f} | {r['aten_ops_per_token']:.1f} | "
                         f"{r['host_syncs_per_step']:.2f} | {r['host_syncs_per_token']:.2f} |")
    return lines + [""]


def _plot_note(results: dict, mark: str) -> str:
    """What a plot's title says about outputs: how a mismatch is marked, or that a sampled run compared none."""
    sampling = results["meta"].get("sampling")
    return f"sampling, {sampling_text(sampling)}: outputs not compared" if sampling else \
        f"{mark}: output differs from generate"


def plot_batch_results(results: dict, path: str | Path) -> None:
    """tokens/s against batch size, one line per method, one panel per data set (red x: output differs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(results["batches"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 4.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        sizes = results["batches"][ds]
        for name, label in results["methods"].items():
            points = [(int(b), rows[name]) for b, rows in sizes.items() if name in rows]
            if not points:
                continue
            xs = [b for b, _ in points]
            ax.plot(xs, [r["tokens_per_s"] for _, r in points], marker="o", label=label)
            bad = [(b, r["tokens_per_s"]) for b, r in points if r["equal_to_plain"] is False]
            if bad:
                ax.scatter(*zip(*bad), marker="x", color="red", s=80, zorder=5)
        ax.set_xscale("log", base=2)
        ax.set_xticks([int(b) for b in sizes], [str(b) for b in sizes])
        ax.set_xlabel("batch size (rows)")
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{ds} ({_plot_note(results, 'red x')})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_results(results: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(results["datasets"])
    names = list(results["methods"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    width = 0.8 / max(len(names), 1)
    for j, name in enumerate(names):
        values = [results["datasets"][ds][name]["tokens_per_s"] for ds in datasets]
        bars = ax1.bar([i + j * width for i in range(len(datasets))], values, width, label=results["methods"][name])
        for bar, ds in zip(bars, datasets):
            if results["datasets"][ds][name]["equal_to_plain"] is False:
                bar.set_hatch("xx")
                bar.set_edgecolor("red")
    ax1.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(datasets))], datasets)
    ax1.set_ylabel("tokens / s")
    ax1.set_title(f"Throughput ({_plot_note(results, 'hatched red')})")
    ax1.legend(fontsize=8)
    labels, bottoms = [], []
    tree = [(ds, n) for ds in datasets for n in names if "phase_ms" in results["datasets"][ds][n]]
    for ds, n in tree:
        labels.append(f"{ds}\n{n.replace('dart_tree_', 'tree ').replace('dart_compiled_', 'compiled ')}")
    bottoms = [0.0] * len(tree)
    for p in [p for p in ALL_PHASES if any(p in results["datasets"][ds][n]["phase_ms"] for ds, n in tree)]:
        values = [results["datasets"][ds][n]["phase_ms"].get(p, 0.0) for ds, n in tree]
        ax2.bar(range(len(tree)), values, bottom=bottoms, label=PHASE_LABELS[p])
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax2.set_xticks(range(len(tree)), labels, fontsize=8)
    ax2.set_ylabel("ms per DART step")
    ax2.set_title("DART tree step breakdown")
    if tree:
        ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(results: dict, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "results.png"}
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    paths["md"].write_text(markdown_report(results))
    (plot_batch_results if "batches" in results else plot_results)(results, paths["png"])
    return paths


def hindsight_lines(results: dict) -> list[str]:
    """`results["hindsight"]` (`bench.hindsight`) as a table: one row per data set, batch size and eager /
    compiled."""
    rows = results.get("hindsight") or []
    if not rows:
        return []
    sizes = sorted({b for r in rows for b in r["fixed"]})
    lines = ["## The default against the best fixed choice in hindsight", "",
             "Speed-ups over plain `generate` (compiled rows: over compiled plain), medians over runs; best: the "
             "fastest of plain decoding and every fixed tree size.", "",
             "| data set | rows | mode | default | " + " | ".join(f"fixed {b}" for b in sizes)
             + " | best | default / best |", "|---|---:|---|---:|" + "---:|" * len(sizes) + "---|---:|"]
    for r in rows:
        best = "plain" if r["best_budget"] == 0 else f"fixed {r['best_budget']}"
        lines.append(f"| {r['dataset']} | {r['rows']} | {'compiled' if r['compiled'] else 'eager'} | "
                     f"{r['default']:.2f}x | " + " | ".join(f"{r['fixed'][b]:.2f}x" if b in r["fixed"] else ""
                                                         for b in sizes)
                     + f" | {best}: {r['best']:.2f}x | **{r['default_over_best']:.2f}** |")
    return lines + [""]


__all__ = ["batch_markdown_report", "fmt", "hindsight_lines", "markdown_report", "plot_batch_results", "plot_results",
           "write_reports"]
