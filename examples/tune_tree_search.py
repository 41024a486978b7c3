"""Offline accepted length of tree-search settings: how the prompt-lookup defaults were chosen.

Under greedy decoding the tokens a tree gets accepted depend only on the tree and on the text plain `generate`
produces, so settings can be compared without running the target again:

1. collect: for held-out prompts the benchmark does not use (HumanEval / ShareGPT prompts `--skip` .. `--skip + n`),
   generate 128 greedy tokens, read the target states of the whole text in one forward, and store the head's
   draft logits (top 64 per row) at every position;
2. simulate: walk each text as the decoding loop would (root = last accepted token, build the tree, accept the
   longest path that matches the text, jump past it) for each setting and node budget, and print the mean
   accepted length (tokens per step, bonus included).

    python examples/tune_tree_search.py --n 40 --out runs/treesim.pt            # collect (~10 min on 2 cores) + table
    python examples/tune_tree_search.py --data runs/treesim.pt --budgets 3 7    # table only
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from tqdm import tqdm

import dart_hf  # noqa: F401  (registers the "dart" model type and the assistant routing)
from dart_hf.tools.assets import eval_prompts, load_target
from dart_hf.core.modeling import DartHead
from dart_hf.core.prompt_lookup import lookup_continuation
from dart_hf.core.target import AuxHiddenCapture
from dart_hf.core.tree import TreeSearchParams, build_tree

HEAD = Path(__file__).resolve().parent.parent / "model_cards" / "smollm2-135m-instruct-dart"
KEEP = 64  # draft logits kept per row: build_tree reads the top tree_top_k (25) of them


@torch.no_grad()
def collect(target, tokenizer, head: DartHead, n: int, skip: int, max_new_tokens: int) -> dict:
    data = {}
    for dataset in ("humaneval", "sharegpt"):
        records = []
        for ids in tqdm(eval_prompts(tokenizer, dataset, skip + n)[skip:], desc=f"collect {dataset}", unit="prompt"):
            seq = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=max_new_tokens)
            p = ids.shape[1]
            with AuxHiddenCapture(target, head.config.aux_layer_ids) as capture:
                target(seq)
                aux = capture.take()
            cache = head.new_cache(capacity=seq.shape[1] + head.config.num_predictions)
            rows = [head.draft(aux[:, :p], seq[:, 1 : p + 1], cache)]  # root = first generated token (position p)
            rows += [head.draft(aux[:, j - 1 : j], seq[:, j : j + 1], cache) for j in range(p + 1, seq.shape[1])]
            top = torch.stack(rows).topk(KEEP, dim=-1)
            records.append({"seq": seq[0], "prompt_len": p, "values": top.values.half(), "ids": top.indices.int()})
        data[dataset] = records
    return data


def accepted_draft_tokens(tree, truth: list[int]) -> int:
    node, n = 0, 0
    children = {}
    for i, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        if i:
            children[(parent, token)] = i
    for token in truth:
        if (node, token) not in children:
            break
        node, n = children[(node, token)], n + 1
    return n


def simulate(records: list[dict], head: DartHead, params: TreeSearchParams, lookup: bool, eos: torch.Tensor) -> float:
    steps = tokens = 0
    vocab = head.config.draft_vocab_size or head.config.vocab_size
    cfg = head.config
    for rec in records:
        seq, j = rec["seq"], rec["prompt_len"]
        while j < len(seq) - 1:
            depth = min(params.node_budget, cfg.num_predictions)
            row = j - rec["prompt_len"]
            logits = torch.full((cfg.num_predictions, vocab), float("-inf"))
            logits.scatter_(1, rec["ids"][row].long(), rec["values"][row].float())
            found = None
            if lookup:
                found = lookup_continuation(seq[: j + 1], depth, cfg.lookup_min_ngram, cfg.lookup_max_ngram)
            tree = build_tree(logits[:depth], seq[j], seq[max(0, j - 7) : j + 1], params, ngram=head.ngram,
                              draft_to_target=head.draft_to_target, eos_token_ids=eos, max_depth=len(seq) - 1 - j,
                              lookup=found)
            n = accepted_draft_tokens(tree, seq[j + 1 :].tolist())
            steps, tokens, j = steps + 1, tokens + n + 1, j + n + 1
    return tokens / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--head", default=str(HEAD))
    ap.add_argument("--data", help="a file written by --out (skips collecting)")
    ap.add_argument("--out", default="runs/treesim.pt")
    ap.add_argument("--n", type=int, default=40, help="prompts per data set")
    ap.add_argument("--skip", type=int, default=5, help="prompts the benchmark uses (first --skip of each set)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", type=int, nargs="+", default=[2, 3, 4, 7, 15])
    ap.add_argument("--lookup-logp", type=float, nargs="+", default=[-0.1, -0.7, -1.5])
    args = ap.parse_args()

    head = DartHead.from_pretrained(args.head)
    target, tokenizer = load_target("smollm2-135m-instruct")
    if args.data:
        data = torch.load(args.data)
    else:
        head.bind_target(target)
        data = collect(target, tokenizer, head, args.n, args.skip, args.max_new_tokens)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, args.out)
    eos = torch.tensor([tokenizer.eos_token_id])
    print("| budget | prompt lookup | lookup_logp | " + " | ".join(data) + " |")
    print("|---:|---|---:|" + "---:|" * len(data))
    for budget in args.budgets:
        settings = [(False, head.config.lookup_logp)] + list(itertools.product([True], args.lookup_logp))
        for lookup, logp in settings:
            params = TreeSearchParams.from_config(head.config, node_budget=budget)
            params.lookup_logp = logp
            means = [simulate(records, head, params, lookup, eos) for records in data.values()]
            print(f"| {budget} | {'on' if lookup else 'off'} | {logp if lookup else '-'} | "
                  + " | ".join(f"{m:.3f}" for m in means) + " |", flush=True)


if __name__ == "__main__":
    main()
