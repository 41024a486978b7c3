"""`dart-hf eval-head`: how well a head drafts on held-out text, depth by depth, without decoding.

Under greedy decoding the target's token after any prefix of a reference text is the text's next token, so one
target forward per text and one head draft per position (`offline_acceptance.draft_rows`) give, for every position:

- per-depth agreement: is the target's token at depth d among the head's top-1 / top-k (given the text before it);
- the chain accepted length: tokens per step when each step drafts the head's top-1 at every depth (a chain);
- the tree accepted length at chosen node budgets (`offline_acceptance.mean_accepted_length`: the loop's own tree
  search and acceptance), head only or with prompt-lookup candidates.

The held-out texts are plain greedy answers to HumanEval problems 5-24 and held-out ShareGPT prompts 5-24 (the
benchmark uses the first five of each; training never sees either: ShareGPT's held-out split is excluded from every
training set and the code corpora start at HumanEval problem 100). They are made once per target and cached.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

from ..core.modeling import DartHead
from ..core.tree import TreeSearchParams
from .assets import HUMANEVAL_FILE, SHAREGPT_FILE, announce_installs, cache_dir, load_target
from .datasets import eval_prompts
from .offline_acceptance import DraftRows, Text, draft_rows, load_texts, mean_accepted_length, reference_texts, save_texts

DATASETS = ("humaneval", "sharegpt")


def texts_path(target_name: str, n: int = 20, skip: int = 5, max_new_tokens: int = 128,
               path: str | Path | None = None) -> Path:
    """Where `held_out_texts` reads or saves its texts: `path`, else a file in the cache named after the target and
    sizes."""
    return Path(path) if path else cache_dir() / "eval_texts" / f"{target_name}-{skip}-{skip + n}-{max_new_tokens}.pt"


def held_out_texts(target, tokenizer, target_name: str, n: int = 20, skip: int = 5, max_new_tokens: int = 128,
                   path: str | Path | None = None) -> dict[str, list[Text]]:
    """Plain greedy answers to prompts `skip .. skip + n` of each data set, read from `path` (default: a file in the
    cache named after the target and sizes) or made and saved there."""
    path = texts_path(target_name, n, skip, max_new_tokens, path)
    if path.exists():
        return load_texts(path)
    texts = {ds: reference_texts(target, eval_prompts(tokenizer, ds, skip + n)[skip:], max_new_tokens,
                                 desc=f"texts {ds}") for ds in DATASETS}
    save_texts(texts, path)
    return texts


def depth_agreement(head: DartHead, texts: list[Text], rows: list[DraftRows], k: int = 5) -> dict[str, list[float]]:
    """Per depth: how often the target's token is the head's top-1 / among its top-`k`, over every position of
    every text that has a token at that depth; and `chain_top1`: top-1 right at this depth AND all earlier ones."""
    to_target = head.draft_to_target.cpu() if head.draft_to_target is not None else None
    depths = head.config.num_predictions
    hit1, hitk, chain, count = (torch.zeros(depths) for _ in range(4))
    for text, drafts in zip(texts, rows):
        ids = drafts.ids[..., :k].long()  # [roots, depths, k] draft ids
        if to_target is not None:
            ids = to_target[ids]
        roots = ids.shape[0]
        # root j sits at position prompt_length + j; depth d predicts the token at prompt_length + j + 1 + d
        index = text.prompt_length + torch.arange(roots).unsqueeze(1) + 1 + torch.arange(depths)
        present = index < text.ids.numel()
        truth = text.ids[index.clamp(max=text.ids.numel() - 1)]
        top1 = (ids[..., 0] == truth) & present
        hit1 += top1.sum(0)
        hitk += ((ids == truth.unsqueeze(-1)).any(-1) & present).sum(0)
        chain += (top1.long().cumprod(-1).bool() & present).sum(0)
        count += present.sum(0)
    count = count.clamp(min=1)
    return {"top1": (hit1 / count).tolist(), f"top{k}": (hitk / count).tolist(), "chain_top1": (chain / count).tolist()}


def chain_accepted_length(texts: list[Text], rows: list[DraftRows], head: DartHead) -> float:
    """Tokens per step (bonus included) when every step drafts the head's top-1 chain, walking each text as the
    loop walks it (the next step starts after the accepted tokens and the bonus)."""
    to_target = head.draft_to_target.cpu() if head.draft_to_target is not None else None
    steps = tokens = 0
    for text, drafts in zip(texts, rows):
        top1 = drafts.ids[..., 0].long()
        if to_target is not None:
            top1 = to_target[top1]
        j, end = text.prompt_length, text.ids.numel() - 1
        while j < end:
            truth = text.ids[j + 1 : j + 1 + top1.shape[1]]
            chain = top1[j - text.prompt_length, : truth.numel()] == truth
            drafted = int(chain.long().cumprod(0).sum())
            appended = min(drafted + 1, end - j)
            steps, tokens, j = steps + 1, tokens + appended, j + appended
    return tokens / max(steps, 1)


def evaluate_head(target, head: DartHead, texts: dict[str, list[Text]], budgets: list[int],
                  lookup: bool = False, eos_token_ids: torch.Tensor | None = None, desc: str = "") -> dict:
    """Every measure above for one head on each data set: {data set: {"top1": [...], "top5": [...],
    "chain_top1": [...], "chain": float, "tree": {str(budget): float}}} (string keys: the report is JSON)."""
    report = {}
    on_cpu = copy.deepcopy(head).cpu()  # the tree search replays on the CPU, where the kept rows are
    for ds, items in texts.items():
        rows = draft_rows(target, head, items, desc=f"draft {desc} {ds}".replace("  ", " "))
        entry = depth_agreement(on_cpu, items, rows)
        entry["chain"] = chain_accepted_length(items, rows, on_cpu)
        entry["tree"] = {}
        for budget in budgets:
            params = TreeSearchParams.from_config(head.config, node_budget=budget)
            entry["tree"][str(budget)] = mean_accepted_length(on_cpu, items, rows, params, lookup, eos_token_ids)
        report[ds] = entry
    return report


def format_table(reports: dict[str, dict], budgets: list[int], depths: int = 4) -> str:
    """One markdown table: a row per head, HumanEval / ShareGPT in each cell."""
    datasets = list(next(iter(reports.values())))
    cols = [f"top-1 d{d + 1}" for d in range(depths)] + ["chain AL"] + [f"tree AL @{b}" for b in budgets]
    lines = ["| head | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, report in reports.items():
        cells = [" / ".join(f"{report[ds]['top1'][d]:.3f}" for ds in datasets) for d in range(depths)]
        cells.append(" / ".join(f"{report[ds]['chain']:.2f}" for ds in datasets))
        cells += [" / ".join(f"{report[ds]['tree'][str(b)]:.2f}" for ds in datasets) for b in budgets]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\n(each cell: {' / '.join(datasets)}; AL = mean accepted length, bonus included)"


def plot_reports(reports: dict[str, dict], path: str | Path) -> None:
    """Per-depth top-1 agreement of each head, one panel per data set, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(next(iter(reports.values())))
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for name, report in reports.items():
            top1 = report[ds]["top1"]
            ax.plot(range(1, len(top1) + 1), top1, marker="o", label=name)
        ax.set(xlabel="draft depth", ylabel="top-1 agreement with the target", title=f"{ds} (held out)", ylim=(0, 1))
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """`dart-hf eval-head HEAD [HEAD ...]`: the table on stdout, report.json and depth_agreement.png in --out."""
    made = texts_path(Path(args.target).name, args.n, args.skip, args.max_new_tokens, args.texts).exists()
    announce_installs("dart-hf eval-head", args.target, () if made else (HUMANEVAL_FILE, SHAREGPT_FILE))
    target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    texts = held_out_texts(target, tokenizer, Path(args.target).name, args.n, args.skip, args.max_new_tokens,
                           args.texts)
    eos = target.generation_config.eos_token_id
    eos = torch.tensor([eos] if isinstance(eos, int) else list(eos or []))
    reports = {}
    for path in args.heads:
        try:
            head = DartHead.from_pretrained(path).to(target.device, target.dtype).eval()
        except (OSError, ValueError) as err:
            print(f"dart-hf eval-head: error: {err}", file=sys.stderr)
            return 2
        if args.no_ngram:
            head.ngram = None
        reports[str(path)] = evaluate_head(target, head, texts, args.budgets, args.lookup, eos, desc=Path(path).name)
    print(format_table(reports, args.budgets))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(reports, indent=1))
    plot_reports(reports, out / "depth_agreement.png")
    print(f"wrote {out / 'report.json'} and {out / 'depth_agreement.png'}", file=sys.stderr)
    return 0


__all__ = ["held_out_texts", "depth_agreement", "chain_accepted_length", "evaluate_head", "format_table", "plot_reports"]
