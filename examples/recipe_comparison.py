"""Head recipes compared at equal data and equal device time, then measured on held-out text (and for speed).

Each recipe (a `TrainConfig` and a list of corpora, `RECIPES`) trains in its own process, all at once on one device,
for the same wall time (`--seconds`, the learning-rate schedule runs on that clock); then each head is measured with
`dart_hf.tools.eval_head` on the held-out reference texts. Written for one GPU (the recipes share it; each
process gets its share of the CPU threads); a CPU runs it too, slowly:

    dart-hf regenerate --target smollm2-135m-instruct --conversations --out runs/sharegpt-text    # chats as text
    python examples/recipe_comparison.py --target smollm2-135m-instruct --texts runs/recipes/texts.pt \\
        --corpora corpora/smollm2-* --text-corpus runs/sharegpt-text --seconds 240 --mixed-precision bf16 \\
        --device cuda --speed 3 --out runs/recipes

Writes `<out>/<recipe>/` (head, training_history.json, report.json), `<out>/recipes.md` (one table) and
`<out>/depth_agreement.png`; with `--speed N`, `<out>/speed.json`: plain `generate` vs DART with the best head on the
first N prompts of each data set (wall time with device syncs, outputs compared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from dart_hf.tools.assets import load_target
from dart_hf.tools.datasets import eval_prompts
from dart_hf.tools.eval_head import evaluate_head, format_table, plot_reports
from dart_hf.tools.offline_acceptance import load_texts, reference_texts, save_texts
from dart_hf.training.train import TrainConfig, train_head

BASE = TrainConfig(draft_vocab_size=16384, anchors_per_sequence=48, lr=1e-3, warmup_steps=50, epochs=50.0,
                   log_every=20, save_every=100_000)
RECIPES = {
    # today's recipe: regenerated answers only, 48 random anchors per sequence
    "base": (BASE, False),
    # + the layer started from the target's last decoder layer
    "base_layer": (replace(BASE, init_layer_from_target=True), False),
    # today's recipe at a lower / higher peak learning rate (the schedule runs on the same clock)
    "base_lr3e-4": (replace(BASE, lr=3e-4), False),
    "base_lr3e-3": (replace(BASE, lr=3e-3), False),
    # + the ShareGPT chats as text (agreement-masked labels) and every position of every sequence
    "text_all": (replace(BASE, anchors_per_sequence=0), True),
    # text, every position, the layer from the target's
    "text_all_layer": (replace(BASE, anchors_per_sequence=0, init_layer_from_target=True), True),
    # text, every position, no draft vocabulary of its own: the target's full, frozen lm_head (EAGLE-1's choice)
    "text_all_tied": (replace(BASE, anchors_per_sequence=0, draft_vocab_size=None), True),
}


def train_one(args: argparse.Namespace) -> None:
    """One recipe: train for `--seconds`, save, measure on the held-out texts (report.json beside the head)."""
    # the recipes share the machine's cores: one torch thread pool each, sized to its share (16 threads per process
    # on 16 cores made every small CPU op of 5 processes wait on the others; the first H200 run never left setup)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (len(args.recipes) + 1)))
    cfg, with_text = RECIPES[args.recipe]
    batch = args.batch_size if cfg.anchors_per_sequence == 0 else args.batch_size * 4  # 48 anchors: ~1/4 the rows
    cfg = replace(cfg, max_seconds=args.seconds, batch_size=batch, mixed_precision=args.mixed_precision)
    torch.backends.cuda.matmul.allow_tf32 = True  # the target's features: fp32 weights, TF32 products
    target, _ = load_target(args.target, device=args.device)
    corpora = list(args.corpora) + ([args.text_corpus] if with_text and args.text_corpus else [])
    out = Path(args.out) / args.recipe
    eos = target.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    started = time.perf_counter()
    head = train_head(target, corpora, out, cfg, eos_ids=eos_ids, device=args.device)
    trained = time.perf_counter() - started
    head = head.to(target.device).eval()
    texts = load_texts(args.texts)
    report = evaluate_head(target, head, texts, args.budgets, lookup=False, eos_token_ids=torch.tensor(eos_ids),
                           desc=args.recipe)
    history = json.loads((out / "training_history.json").read_text())["history"]
    report["_train"] = {"seconds": trained, "tokens": history[-1]["tokens"] if history else 0,
                        "steps": history[-1]["step"] if history else 0, "config": asdict(cfg), "corpora": corpora}
    (out / "report.json").write_text(json.dumps(report, indent=1))


def make_texts(args: argparse.Namespace) -> None:
    """The held-out reference texts from `--prompts` (a torch file {data set: [ids [1, T]]}, made where the data
    sets are installed), written atomically to `--texts`."""
    target, tokenizer = load_target(args.target, device=args.device)
    if args.prompts:  # a machine without the data sets: their prompt ids, saved where they are installed
        prompts = torch.load(args.prompts)
    else:
        prompts = {ds: eval_prompts(tokenizer, ds, 25)[5:] for ds in ("humaneval", "sharegpt")}
    texts = {ds: reference_texts(target, items, args.max_new_tokens, desc=f"texts {ds}") for ds, items in prompts.items()}
    save_texts(texts, str(args.texts) + ".tmp")
    os.replace(str(args.texts) + ".tmp", args.texts)


def speed(args: argparse.Namespace, head_dir: Path) -> dict:
    """Plain `generate` vs DART (auto and fixed node budgets) vs prompt lookup on the texts' prompts, greedy."""
    import dart_hf  # noqa: F401  (routes assistant_model=DartHead)
    from dart_hf.core.modeling import DartHead

    target, _ = load_target(args.target, device=args.device)
    head = DartHead.from_pretrained(head_dir).to(target.device).eval()
    texts = load_texts(args.texts)
    sync = torch.cuda.synchronize if target.device.type == "cuda" else (lambda: None)
    methods = {"plain": {}, "prompt_lookup": {"prompt_lookup_num_tokens": 10},
               **{f"dart_{b}": {"assistant_model": head, "dart_node_budget": b} for b in args.speed_budgets}}
    results = {}
    for ds, items in texts.items():
        prompts = [t.ids[: t.prompt_length].unsqueeze(0).to(target.device) for t in items[: args.speed]]
        target.generate(prompts[0], max_new_tokens=8, do_sample=False)  # warm-up
        for name, kwargs in methods.items():
            target.generate(prompts[0], max_new_tokens=16, do_sample=False, **kwargs)
        seconds = {name: 0.0 for name in methods}
        equal, tokens = {name: True for name in methods}, 0
        for ids in prompts:
            ref = None
            for name, kwargs in methods.items():
                sync()
                t0 = time.perf_counter()
                out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
                sync()
                seconds[name] += time.perf_counter() - t0
                if ref is None:
                    ref, tokens = out, tokens + out.shape[1] - ids.shape[1]
                equal[name] &= bool(torch.equal(out, ref))
        results[ds] = {"tokens": tokens, "tokens_per_s": {n: tokens / s for n, s in seconds.items()},
                       "speedup": {n: seconds["plain"] / s for n, s in seconds.items()}, "equal": equal}
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--texts", required=True, help="held-out reference texts (dart_hf.tools.eval_head.held_out_texts)")
    ap.add_argument("--corpora", nargs="*", default=[], help="regenerated token corpora (every recipe)")
    ap.add_argument("--text-corpus", default=None, help="chats as text (`dart-hf regenerate --conversations`)")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--prompts", default=None, help="held-out prompt ids ({data set: [ids]}, torch.save) to make --texts "
                    "from when it is missing (default: HumanEval / held-out ShareGPT prompts 5-24, if installed)")
    ap.add_argument("--recipe", default=None, help=argparse.SUPPRESS)  # one recipe, in a child process
    ap.add_argument("--seconds", type=float, default=240.0, help="training wall time of every recipe")
    ap.add_argument("--batch-size", type=int, default=2, help="sequences per step (x4 for the 48-anchor recipe)")
    ap.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1, 3, 60])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--speed", type=int, default=0, help="prompts per data set for the speed comparison (0: none)")
    ap.add_argument("--speed-budgets", type=int, nargs="+", default=[3, 8, 16, 32, 60])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="runs/recipes")
    args = ap.parse_args()
    if args.recipe:
        train_one(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    children = {}
    if not Path(args.texts).exists():  # made first, alone: beside the training processes it took ~6x longer
        make_texts(args)
    for name in args.recipes:
        argv = [sys.executable, __file__, *sys.argv[1:], "--recipe", name]
        log = open(out / f"{name}.log", "w")
        children[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT), log)
    for name, (child, log) in children.items():
        code = child.wait()
        log.close()
        print(f"{name}: exit {code}", flush=True)
    reports = {n: json.loads((out / n / "report.json").read_text()) for n in args.recipes
               if (out / n / "report.json").exists()}
    if not reports:
        raise SystemExit("no recipe finished: see the logs in " + str(out))
    table = format_table({n: {k: v for k, v in r.items() if not k.startswith("_")} for n, r in reports.items()},
                         args.budgets)
    trained = "\n".join(f"- {n}: {r['_train']['steps']} steps, {r['_train']['tokens']:,} labelled tokens in "
                        f"{r['_train']['seconds']:.0f} s" for n, r in reports.items())
    (out / "recipes.md").write_text(table + "\n\n" + trained + "\n")
    plot_reports({n: {k: v for k, v in r.items() if not k.startswith("_")} for n, r in reports.items()},
                 out / "depth_agreement.png")
    print(table + "\n\n" + trained, flush=True)
    if args.speed:
        top = str(max(args.budgets))  # the best head: largest tree accepted length, summed over the data sets
        best = max(reports, key=lambda n: sum(r["tree"][top] for k, r in reports[n].items() if not k.startswith("_")))
        result = {"head": best, **speed(args, out / best)}
        (out / "speed.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
