"""`dart-hf train`: target -> regenerated answers -> trained head -> n-gram -> evaluation.

Two data paths. With `--corpus DIR` (a token-id corpus grown by `dart-hf regenerate`), the target's features
and next-token distribution are computed online per batch and the loss is KL by default: the corpus can grow
without bound and be shared. Without it, answers are regenerated with their features captured into shards
(`<out>/features`, cross-entropy only): the small CPU recipe.

Every stage resumes: feature shards per batch, the trainer from `out/checkpoint/`, and stages whose output
exists are skipped, so the same command can be rerun after a kill. Runs on a CPU (the default sizes fit a
2-core machine in about an hour), unchanged on CUDA (`--device cuda`), and data-parallel under
`accelerate launch` (docs/TRAINING.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from accelerate import PartialState

from ..tools.assets import eval_prompts, load_target
from ..tools.evaluation import acceptance_report
from ..core.modeling import DartHead
from ..core.ngram import FILE_NAME as NGRAM_FILE
from ..core.ngram import NGramModel
from .data import sharegpt_training_prompts
from .features import collect_features
from .ngram_corpus import build_ngram
from .train import TrainConfig, anchor_positions, load_training_data, train_head


def run(args: argparse.Namespace) -> int:
    try:
        cfg = TrainConfig(
            draft_length=args.draft_length,
            draft_vocab_size=args.draft_vocab_size or None,
            epochs=args.epochs,
            lr=args.lr,
            anchors_per_sequence=args.anchors,
            loss=args.loss or ("kl" if args.corpus else "ce"),
            batch_size=args.train_batch_size,
            grad_accum=args.grad_accum,
            init_from=args.init,
            widen_draft_vocab=args.widen_draft_vocab,
            save_every=args.save_every,
            cache_features=args.cache_features,
            group_by_length=args.group_by_length,
            init_layer_from_target=args.init_layer_from_target,
            max_seconds=None if args.max_minutes is None else 60 * args.max_minutes,
            mixed_precision=args.mixed_precision,
        )
    except ValueError as err:  # settings that contradict each other: said before the target loads
        print(f"dart-hf train: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    features = Path(args.features or out / "features")
    try:
        target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    except (OSError, ValueError) as err:  # an unknown target name, or a folder that holds no model
        print(f"dart-hf train: error: {err}", file=sys.stderr)
        return 2
    processes = PartialState()  # several under `accelerate launch`: one trains each share, the main one does the rest
    if args.corpus:
        features = [Path(c) for c in args.corpus]  # token corpora: features online
    elif processes.num_processes > 1:
        print("dart-hf train: error: data-parallel training reads a token corpus: pass --corpus (dart-hf regenerate)",
              file=sys.stderr)
        return 2
    elif args.num_prompts > 0:
        prompts = sharegpt_training_prompts(args.num_prompts)
        collect_features(target, tokenizer, prompts, features, args.max_new_tokens, args.batch_size)
    trained = (out / "model.safetensors").exists() and not (out / "checkpoint").exists()
    try:
        too_few = None if trained else _too_few_for_one_step(features, cfg, processes.num_processes)
    except (OSError, ValueError) as err:  # no data where it was asked for
        too_few = str(err)
    if too_few:  # said before the n-gram is built (tens of seconds), not after
        print(f"dart-hf train: error: {too_few}", file=sys.stderr)
        return 2
    eos = target.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not (out / NGRAM_FILE).exists() and processes.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        _ngram(tokenizer, target.config.vocab_size, args, features).save(out / NGRAM_FILE)
    processes.wait_for_everyone()
    ngram = NGramModel.load(out / NGRAM_FILE)
    if args.device == "cpu":
        target = target.float()  # train online and evaluate as users run it on CPU (bf16 matmuls are slow there)
    if trained:
        head = DartHead.from_pretrained(out)
    else:
        head = train_head(target, features, out, cfg, eos_ids=eos_ids, device=args.device,
                          evaluate=_curve_evaluator(target, tokenizer, ngram, args), eval_every=args.eval_every)
    head.ngram = ngram
    if processes.is_main_process and not head.config.has_ngram:  # train_head saved the head before it had its n-gram
        head.config.has_ngram = True  # so the saved config says ngram.safetensors belongs to it (loaded with it)
        head.config.save_pretrained(out)
    if args.eval_n > 0 and processes.is_main_process:
        head = head.to(target.device, target.dtype).eval()
        report = {
            ds: acceptance_report(target, head, eval_prompts(tokenizer, ds, args.eval_n), args.eval_max_new_tokens,
                                  desc=f"eval {ds}")
            for ds in ("sharegpt", "humaneval")
        }
        (out / "eval.json").write_text(json.dumps(report, indent=1))
        for ds, r in report.items():
            print(f"{ds}: mean accepted length {r['mean_accepted_length']:.2f} (lossless: {r['lossless']})")
    return 0


def _too_few_for_one_step(data: Path | list[Path], cfg: TrainConfig, processes: int) -> str | None:
    """The error `train_head` would raise for data that does not fill one optimizer step, with the flags to change."""
    sequences = [e for e in load_training_data(data) if anchor_positions(e, 1, random.Random(0))]
    per_step = cfg.batch_size * processes * cfg.grad_accum
    if sequences and int(cfg.epochs * len(sequences)) < per_step:
        return (f"{len(sequences)} sequences x {cfg.epochs} epochs do not fill one optimizer step of {cfg.batch_size} "
                f"x {processes} processes x {cfg.grad_accum} accumulation: lower --train-batch-size (or "
                "--grad-accum), raise --epochs, or train on more data")
    return None


def _ngram(tokenizer, vocab_size: int, args: argparse.Namespace, data: Path | list[Path]) -> NGramModel:
    """The head's n-gram table: ShareGPT text plus the regenerated answers (shards or token corpus), the
    latter twice, as `build_ngram` weighs them."""
    if not args.corpus:
        return build_ngram(tokenizer, vocab_size, data, min_count=args.ngram_min_count)
    return build_ngram(tokenizer, vocab_size, min_count=args.ngram_min_count, corpora=data)


def _curve_evaluator(target, tokenizer, ngram: NGramModel, args: argparse.Namespace):
    """`head -> {data set: mean accepted length}` on the held-out prompts, for the training curve (None when
    `--eval-every` is 0). Skips the lossless re-check: the final evaluation does that."""
    if args.eval_every <= 0 or args.eval_n <= 0:
        return None
    prompts = {ds: eval_prompts(tokenizer, ds, args.eval_n) for ds in ("sharegpt", "humaneval")}

    def evaluate(head: DartHead) -> dict[str, float]:
        head.ngram = ngram
        try:
            return {ds: acceptance_report(target, head, p, args.eval_max_new_tokens, check_lossless=False,
                                          desc=f"curve {ds}")["mean_accepted_length"] for ds, p in prompts.items()}
        finally:
            head.ngram = None  # checkpoints stay weights-only; the table is saved once beside the head

    return evaluate


