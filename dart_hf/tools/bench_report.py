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
            vs = "".join(f" {_speedup_text(r, 'speedup_vs_baseline')} |" if r.get("baseline") == b else " |"
                         for b in baselines)
            lines.append(f"| {results['methods'][name]} | {fmt(r['tokens_per_s'], '.1f')} | "
                         f"{_speedup_text(r)} | {fmt(r['accepted_length'])} | {equal} |{vs}")
        lines += _phase_lines(results, rows)
        lines.append("")
    return "\n".join(lines + _profile_lines(results))


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
    held = [f"- {results['methods'][n]}: step ms per held size (rows x nodes; 0: plain decoding) after the warm-up, "
            "which its calls choose by: " + ", ".join(f"{k} {v:.1f}" for k, v in w["held_step_ms"].items())
            for n, w in warm.items() if w.get("held_step_ms")]
    return lines + ([""] + held if held else []) + [""]


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
                vs = f" {_speedup_text(r, 'speedup_vs_baseline') if 'baseline' in r else ''} |" if compiled else ""
                lines.append(f"| {b} | {results['methods'][name]} | {fmt(r['tokens_per_s'], '.1f')} | "
                             f"{_speedup_text(r)} |{vs} {_budget_text(r)} | {equal} |")
        lines.append("")
    return "\n".join(lines + _profile_lines(results))


def _speedup_text(r: dict, key: str = "speedup") -> str:
    """The speed-up over plain (or another `_ratios` key); over several runs, their median with the runs' min-max."""
    if len(r.get(f"{key}_runs", [])) > 1:
        lo, hi = r[f"{key}_spread"]
        return f"{fmt(r[f'{key}_median'])}x ({fmt(lo)}-{fmt(hi)})"
    return f"{fmt(r[key])}x"


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


__all__ = ["batch_markdown_report", "fmt", "markdown_report", "plot_batch_results", "plot_results", "write_reports"]
