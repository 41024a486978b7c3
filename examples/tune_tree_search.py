"""Offline accepted length of heads x tree searches x node budgets: how tree settings are chosen.

Prompts the benchmark does not use (HumanEval / ShareGPT prompts `--skip` .. `--skip + n`) get plain greedy
answers once (`--texts` caches them: they do not depend on the head); each head drafts from every position of
them, and every setting is replayed without the target (`dart_hf.tools.offline_acceptance`). Prints a Markdown
table of mean accepted length (tokens per step, bonus included).

    python examples/tune_tree_search.py --n 40 --texts runs/texts-40.pt                    # beam vs best-first
    python examples/tune_tree_search.py --texts runs/texts-40.pt --heads A B --lookup off  # compare two heads
    python examples/tune_tree_search.py --texts runs/texts-40.pt --budgets 60 --grid beam_width=10,20,40 top_k=25,50
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

import torch

import dart_hf  # noqa: F401  (registers the "dart" model type)
from dart_hf.core.modeling import DartHead
from dart_hf.core.target import prepare_head
from dart_hf.core.tree import TreeSearchParams
from dart_hf.tools.assets import load_target, shipped_head
from dart_hf.tools.datasets import eval_prompts
from dart_hf.tools.offline_acceptance import draft_rows, load_texts, mean_accepted_length, reference_texts, save_texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", nargs="+", default=[str(shipped_head())])
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--texts", default="runs/texts.pt", help="reference texts: read if present, else made and saved")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "sharegpt"], choices=["humaneval", "sharegpt"])
    ap.add_argument("--n", type=int, default=40, help="prompts per data set")
    ap.add_argument("--skip", type=int, default=5, help="prompts the benchmark uses (first --skip of each set)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--searches", nargs="+", default=["beam", "best_first"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[3, 7, 15, 30, 60])
    ap.add_argument("--lookup", nargs="+", default=["off", "on"], choices=["off", "on"])
    ap.add_argument("--ngram-weights", type=float, nargs="+", help="default: each head's own")
    ap.add_argument("--grid", nargs="+", default=[], metavar="FIELD=V1,V2",
                    help="more tree settings to sweep (TreeSearchParams fields: top_k, beam_width, level_decay, "
                    "logit_decay, lookup_logp); default: each head's own")
    args = ap.parse_args()
    grid = parse_grid(args.grid)

    target, tokenizer = load_target(args.target)
    if Path(args.texts).exists():
        texts = load_texts(args.texts)
    else:
        texts = {ds: reference_texts(target, eval_prompts(tokenizer, ds, args.skip + args.n)[args.skip :],
                                     args.max_new_tokens, desc=f"texts {ds}") for ds in args.datasets}
        save_texts(texts, args.texts)
    eos = torch.tensor([tokenizer.eos_token_id])
    print("| head | search | budget | prompt lookup | n-gram weight | " + "".join(f"{f} | " for f in grid)
          + " | ".join(texts) + " |")
    print("|---|---|---:|---|---:|" + "---:|" * (len(grid) + len(texts)))
    for head_path in args.heads:
        head = prepare_head(DartHead.from_pretrained(head_path), target)
        rows = {ds: draft_rows(target, head, items, desc=f"draft {ds}") for ds, items in texts.items()}
        weights = args.ngram_weights or [head.config.ngram_weight]
        for search, budget, lookup, weight, *values in itertools.product(
                args.searches, args.budgets, args.lookup, weights, *grid.values()):
            params = TreeSearchParams.from_config(head.config, node_budget=budget)
            params = dataclasses.replace(params, search=search, ngram_weight=weight, **dict(zip(grid, values)))
            means = [mean_accepted_length(head, texts[ds], rows[ds], params, lookup == "on", eos) for ds in texts]
            print(f"| {Path(head_path).name} | {search} | {budget} | {lookup} | {weight} | "
                  + "".join(f"{v} | " for v in values) + " | ".join(f"{m:.3f}" for m in means) + " |", flush=True)


def parse_grid(specs: list[str]) -> dict[str, list]:
    """`["top_k=25,50", ...]` -> {"top_k": [25, 50], ...}, each value cast to the field's type."""
    types = {f.name: type(f.default) for f in dataclasses.fields(TreeSearchParams)}
    own_flags = {"search": "--searches", "node_budget": "--budgets", "ngram_weight": "--ngram-weights"}
    grid = {}
    for spec in specs:
        name, _, values = spec.partition("=")
        if name in own_flags:
            raise SystemExit(f"--grid: sweep {name} with {own_flags[name]}")
        if name not in types or not values:
            raise SystemExit(f"--grid: expected FIELD=V1,V2 with FIELD one of {sorted(set(types) - set(own_flags))}, "
                             f"got {spec!r}")
        grid[name] = [types[name](v) for v in values.split(",")]
    return grid


if __name__ == "__main__":
    main()
