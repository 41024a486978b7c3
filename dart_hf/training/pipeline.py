"""`dart-hf train`: target -> regenerated answers -> trained head -> n-gram -> evaluation.

One data path: token-id corpora. With `--corpus DIR ...` (grown by `dart-hf regenerate`) the head trains on those;
without it, the target's greedy answers to `--num-prompts` ShareGPT training prompts are regenerated into a corpus at
`<out>/corpus` first (`dart_hf.training.corpus.regenerate`). Either way the target's features and next-token
distribution are computed online per batch and the loss is KL by default (`--loss ce`: its argmax).

Every stage resumes: regeneration per batch (answered prompts are skipped), the trainer from `out/checkpoint/`, and
stages whose output exists are skipped, so the same command can be rerun after a kill. Runs on a CPU (the default
sizes regenerate in about 50 minutes on a 2-core machine; training then runs the target once per batch,
`--cache-features` only in the first epoch), unchanged on CUDA (`--device cuda`), and data-parallel under
`accelerate launch` on an existing corpus (docs/TRAINING.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch
from accelerate import PartialState

from ..tools.assets import load_target
from ..tools.datasets import eval_prompts
from ..tools.evaluation import acceptance_report
from ..core.modeling import DartHead
from ..core.ngram import FILE_NAME as NGRAM_FILE
from ..core.ngram import NGramModel
from .batches import anchor_positions
from .checkpoint import CHECKPOINT_DIR
from .corpus import regenerate
from .data import sharegpt_training_prompts
from .ngram_corpus import build_ngram
from .train import TrainConfig, load_training_data, train_head


def run(args: argparse.Namespace) -> int:
    try:
        cfg = TrainConfig(
            draft_length=args.draft_length,
            draft_vocab_size=args.draft_vocab_size or None,
            epochs=args.epochs,
            lr=args.lr,
            anchors_per_sequence=args.anchors,
            loss=args.loss,
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
    try:
        target, tokenizer = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    except (OSError, ValueError) as err:  # an unknown target name, or a folder that holds no model
        print(f"dart-hf train: error: {err}", file=sys.stderr)
        return 2
    processes = PartialState()  # several under `accelerate launch`: one trains each share, the main one does the rest
    corpora = [Path(c) for c in args.corpus] if args.corpus else [out / "corpus"]
    if not args.corpus and processes.num_processes > 1:  # every process would regenerate into the same corpus
        print("dart-hf train: error: data-parallel training reads an existing token corpus: grow it with "
              "`dart-hf regenerate`, then pass --corpus", file=sys.stderr)
        return 2
    if not args.corpus and args.num_prompts > 0:
        prompts = sharegpt_training_prompts(args.num_prompts)
        regenerate(target, tokenizer, prompts, corpora[0], args.max_new_tokens, args.batch_size)
    trained = (out / "model.safetensors").exists() and not (out / CHECKPOINT_DIR).exists()
    try:
        too_few = None if trained else _too_few_for_one_step(corpora, cfg, processes.num_processes)
    except (OSError, ValueError) as err:  # no data where it was asked for
        too_few = str(err)
    if too_few:  # said before the n-gram is built (tens of seconds), not after
        print(f"dart-hf train: error: {too_few}", file=sys.stderr)
        return 2
    eos = target.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not (out / NGRAM_FILE).exists() and processes.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        _ngram(tokenizer, target.config.vocab_size, args, corpora).save(out / NGRAM_FILE)
    processes.wait_for_everyone()
    ngram = NGramModel.load(out / NGRAM_FILE)
    if args.device == "cpu":
        target = target.float()  # train online and evaluate as users run it on CPU (bf16 matmuls are slow there)
    if trained:
        head = DartHead.from_pretrained(out)
    else:
        head = train_head(target, corpora, out, cfg, eos_ids=eos_ids, device=args.device,
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


def _too_few_for_one_step(corpora: list[Path], cfg: TrainConfig, processes: int) -> str | None:
    """The error `train_head` would raise for data that does not fill one optimizer step, with the flags to change."""
    sequences = [e for e in load_training_data(corpora) if anchor_positions(e, 1, random.Random(0))]
    per_step = cfg.batch_size * processes * cfg.grad_accum
    if sequences and int(cfg.epochs * len(sequences)) < per_step:
        return (f"{len(sequences)} sequences x {cfg.epochs} epochs do not fill one optimizer step of {cfg.batch_size} "
                f"x {processes} processes x {cfg.grad_accum} accumulation: lower --train-batch-size (or "
                "--grad-accum), raise --epochs, or train on more data")
    return None


def _ngram(tokenizer, vocab_size: int, args: argparse.Namespace, corpora: list[Path]) -> NGramModel:
    """The head's n-gram table: ShareGPT text plus the corpora's answers, the latter twice, as `build_ngram` weighs
    them."""
    return build_ngram(tokenizer, vocab_size, min_count=args.ngram_min_count, corpora=corpora)


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


