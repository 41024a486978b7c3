"""Training a DART head (docs/DART_SPEC.md §2), on one CPU or GPU or data-parallel under `accelerate launch`.

Data: one path, token-id corpora (`dart_hf.training.corpus`: prompts and the target's own answers, or chats as
text, grown by `dart-hf regenerate`). The target's features are computed online (`dart_hf.training.teacher`): one
no-grad target forward per batch gives the inputs of the `aux_layer_ids` layers (the head's inputs) and the target's
final states, from which its full next-token distribution is taken at the positions the head predicts. Ids instead
of stored features is what lets a corpus grow without bound, be shared, and carry the distribution for the KL loss.

Each micro-batch holds `batch_size` sequences with `anchors_per_sequence` anchors each (`dart_hf.training.batches`),
and the packed-anchor forward (`DartHead.forward`) trains them all in one pass: every anchor's K MASK slots see only
that anchor's prefix. The loss is KL to the target's distribution renormalised over the draft vocabulary, or
cross-entropy on its argmax, weighted gamma^d over depths d (`dart_hf.training.teacher`).

Data parallel: the loop runs through `accelerate.Accelerator` (prepared head, optimizer and data loader),
so `accelerate launch --num_processes N -m ...` trains on N devices unchanged: each process takes its own
`batch_size` sequences, gradients are averaged, and the loss is normalised by the weight summed over all
processes, so N processes match one process on the same global batch.

Start: a fresh head is warm-started in the target's output space (`dart_hf.training.head_init.new_head`);
`init_from` starts from an existing head instead (fine-tuning on a new slice of the corpus; the learning-rate
schedule starts over), with `TrainConfig.widen_draft_vocab` growing its draft vocabulary first.

Throughput: batches are grouped by length, so a batch pads to its own longest sequence; and with `cache_features`
each sequence's target features are kept in memory after their first forward, so epochs after the first skip the
target forward, the largest part of a step when the target is much larger than the head.

Resumable: `out/checkpoint/` holds the head, optimizer and progress (`dart_hf.training.checkpoint`); rerunning the
same command continues.

Progress in the unit that matters: with `evaluate` and `eval_every`, the head's mean accepted length on
held-out prompts is measured at the start, every `eval_every` optimizer steps and at the end, against the
number of response tokens trained on so far (the "how much more data would help" curve).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable, Sequence as SequenceOf
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..core.modeling import DartHead
from .batches import AnchorCollator, anchor_positions, label_validity, training_order
from .checkpoint import CHECKPOINT_DIR, Progress, load_checkpoint, save_checkpoint, save_result
from .corpus import META_FILE, Sequence, load_corpus
from .head_init import new_head, target_to_draft, widen_draft_vocab
from .teacher import IGNORE, LOSSES, FeatureCache, batch_loss, target_features, teacher_targets


@dataclass
class TrainConfig:
    draft_length: int = 7
    draft_vocab_size: int | None = 8192  # None: tie to the target lm_head (full vocab)
    anchors_per_sequence: int = 48  # 0: every position with a label
    gamma: float = 0.6
    loss: str = "kl"  # "kl" (the target's distribution) or "ce" (its argmax)
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    epochs: float = 2.0
    batch_size: int = 8  # sequences per forward and process
    grad_accum: int = 1  # forwards per optimizer step
    max_grad_norm: float = 1.0
    seed: int = 0
    init_from: str | None = None  # a head folder to start from (fine-tuning an existing head on more data)
    widen_draft_vocab: int | None = None  # with init_from: grow its draft vocabulary to this size first
    group_by_length: bool = True  # batches of similar lengths (less padding); False: plain shuffles
    cache_features: bool = False  # keep target features in memory after their first forward
    log_every: int = 20
    save_every: int = 200
    max_seconds: float | None = None  # a time budget: the schedule runs on elapsed time and training stops there
    init_layer_from_target: bool = False  # a fresh head's layer starts as a copy of the target's last decoder layer
    mixed_precision: str = "no"  # "bf16": the head's forward under bf16 autocast (accelerate); losses stay fp32

    def __post_init__(self) -> None:
        if self.widen_draft_vocab is not None and self.init_from is None:
            raise ValueError("widen_draft_vocab grows the draft vocabulary of the init_from head: set init_from "
                             "(pass --init)")


def load_training_data(folders: str | Path | SequenceOf[str | Path]) -> list[Sequence]:
    """Token corpora (`corpus.jsonl`), joined in the order given. Why several: a corpus grows per domain or per
    engine (chat answers, code answers, a llama.cpp run), and a fine-tune or a full retrain reads them together
    without copying."""
    folders = [Path(folders)] if isinstance(folders, (str, Path)) else [Path(f) for f in folders]
    if not folders:
        raise ValueError("no training data folder given")
    data, vocab_sizes = [], {}
    for folder in folders:
        data += load_corpus(folder)  # a folder without a corpus: FileNotFoundError naming it
        vocab_sizes[folder] = json.loads((folder / META_FILE).read_text()).get("vocab_size")
    if len(set(vocab_sizes.values())) > 1:
        raise ValueError(f"these corpora come from different tokenizers (vocab sizes {vocab_sizes}): train on one "
                         "target's corpora at a time")
    return data


def _lr_at(step: int, total: int, cfg: TrainConfig, seconds: float = 0.0) -> float:
    """Linear warm-up, then a cosine decay over the steps, or over `max_seconds` when that ends first."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1)
    if cfg.max_seconds:
        progress = max(progress, seconds / cfg.max_seconds)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_head(
    target: PreTrainedModel,
    data_dir: str | Path | SequenceOf[str | Path],
    out_dir: str | Path,
    cfg: TrainConfig | None = None,
    eos_ids: list[int] | None = None,
    device: str | torch.device | None = None,
    evaluate: Callable[[DartHead], dict[str, float]] | None = None,
    eval_every: int = 0,
) -> DartHead:
    """Train (or resume training) a head on the token corpora `data_dir`; saves it to `out_dir`.

    `device="cpu"` forces the CPU; otherwise accelerate picks this process's device. `evaluate(head) ->
    {data set: mean accepted length}` runs on the main process with the head in eval mode under no_grad at
    step 0, every `eval_every` steps and at the end (see module docstring)."""
    cfg = cfg or TrainConfig()
    if cfg.loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {cfg.loss!r}")
    accelerator = Accelerator(cpu=str(device) == "cpu", gradient_accumulation_steps=cfg.grad_accum,
                              mixed_precision=cfg.mixed_precision)
    out, ckpt = Path(out_dir), Path(out_dir) / CHECKPOINT_DIR
    data = [e for e in load_training_data(data_dir) if anchor_positions(e, 1, random.Random(0))]
    if not data:
        raise ValueError(f"{data_dir}: no sequence has a response long enough to train on (3 tokens or more)")
    top_id, vocab_size = max(int(e.ids.max()) for e in data), target.config.get_text_config().vocab_size
    if top_id >= vocab_size:
        raise ValueError(f"{data_dir}: token id {top_id} is outside this target's vocabulary ({vocab_size}): the "
                         "data was made with another tokenizer")
    optimizer_state, progress = None, Progress()
    if ckpt.exists():
        head, optimizer_state, progress = load_checkpoint(ckpt)
    elif cfg.init_from is not None:
        head = DartHead.from_pretrained(cfg.init_from).float()
        if cfg.widen_draft_vocab is not None:
            head = widen_draft_vocab(head, target, data, cfg.widen_draft_vocab)
    else:
        torch.manual_seed(cfg.seed)  # the same config trains the same head
        head = new_head(target, data, eos_ids or [], draft_length=cfg.draft_length,
                        draft_vocab_size=cfg.draft_vocab_size, init_layer_from_target=cfg.init_layer_from_target)
    target.requires_grad_(False)  # the head borrows its embedding (and lm_head when tied): never trained
    target.to(accelerator.device)
    head.to(accelerator.device).train()
    head.bind_target(target)
    layer_ids = list(head.config.aux_layer_ids)
    draft_ids = None if head.lm_head is None else head.draft_to_target.to(accelerator.device)
    to_draft = None if head.lm_head is None else target_to_draft(head).to(accelerator.device)
    params = [p for p in head.parameters() if p.requires_grad]
    cache = None
    if cfg.cache_features:
        cache = FeatureCache(data, len(layer_ids), head.config.target_hidden_size, target.dtype)
        if accelerator.is_main_process:
            tqdm.write(f"caching target features in memory: up to {cache.nbytes / 2**30:.2f} GiB per process")
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    global_batch = cfg.batch_size * accelerator.num_processes
    order = training_order([e.ids.numel() for e in data], cfg.epochs, global_batch, cfg.grad_accum, cfg.seed,
                           cfg.group_by_length)
    total_steps = len(order) // (global_batch * cfg.grad_accum)
    if total_steps == 0:
        raise ValueError(f"{len(data)} sequences x {cfg.epochs} epochs do not fill one optimizer step of "
                         f"{cfg.batch_size} x {accelerator.num_processes} processes x {cfg.grad_accum} accumulation")
    if optimizer_state is not None:
        optim.load_state_dict(optimizer_state)
    loader = DataLoader(range(len(order)), batch_size=cfg.batch_size, shuffle=False,
                        collate_fn=AnchorCollator(data, order, cfg.anchors_per_sequence, cfg.seed))
    model, optim, loader = accelerator.prepare(head, optim, loader)
    if progress.step:
        loader = accelerator.skip_first_batches(loader, progress.step * cfg.grad_accum)
    main = accelerator.is_main_process

    def maybe_evaluate() -> None:
        step, evaluations = progress.step, progress.evaluations
        if evaluate is None or (evaluations and evaluations[-1]["step"] == step):
            return
        if step not in (0, total_steps) and (eval_every <= 0 or step % eval_every):
            return
        if main:
            head.eval()
            with torch.no_grad():
                evaluations.append({"step": step, "tokens": progress.tokens, "accepted_length": evaluate(head)})
            head.train()
            tqdm.write(f"step {step}, {progress.tokens} tokens: accepted length {evaluations[-1]['accepted_length']}")
        accelerator.wait_for_everyone()

    k1 = head.config.num_predictions
    depth = torch.arange(k1, device=accelerator.device)
    zeros = lambda: torch.zeros(k1, device=accelerator.device)
    acc_correct, acc_count, acc_loss, acc_n = zeros(), zeros(), zeros()[0], 0
    started = time.perf_counter() - progress.seconds  # wall time of this run and the ones it resumes
    elapsed = lambda: time.perf_counter() - started
    seen = torch.tensor(progress.tokens, device=accelerator.device)  # response tokens trained on, all processes
    with tqdm(total=total_steps, initial=progress.step, desc="train head", unit="step", disable=not main) as bar:
        maybe_evaluate()
        for batch in loader:
            if progress.step >= total_steps or (cfg.max_seconds and elapsed() >= cfg.max_seconds):
                break
            ids, lengths, anchors = batch["ids"], batch["lengths"], batch["anchors"]
            # anchor a, depth d predicts token a+2+d: the target's distribution at position a+1+d (< T-1)
            position = anchors.unsqueeze(-1) + 1 + depth
            valid = (position < (lengths - 1).view(-1, 1, 1)) & batch["anchor_valid"].unsqueeze(-1)
            cached = None if cache is None else cache.get(batch["index"], ids.device)
            aux, final = cached or target_features(target, layer_ids, ids, lengths)
            if cache is not None and cached is None:
                cache.put(batch["index"], lengths, aux, final)
            teacher = teacher_targets(target, final, position, draft_ids)
            valid = label_validity(valid, position, ids, batch["label_mask"], teacher.argmax)
            labels = torch.where(valid, teacher.argmax, IGNORE)
            if to_draft is not None:  # targets outside the draft vocab have no label (their KL is renormalised)
                labels = torch.where(labels >= 0, to_draft[labels.clamp(min=0)], IGNORE)
            with accelerator.accumulate(model):
                logits = model(aux.float(), ids[:, 1:], anchors)
                loss_sum, weight = batch_loss(cfg.loss, logits, valid, labels, cfg.gamma, teacher)
                # normalised by the weight of all processes: N processes then average to one global-batch loss
                total_weight = accelerator.reduce(weight.detach(), "sum").clamp(min=1e-6)
                loss = loss_sum * accelerator.num_processes / total_weight
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    for g in optim.param_groups:
                        g["lr"] = _lr_at(progress.step, total_steps, cfg, elapsed())
                    accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
                optim.step()
                optim.zero_grad(set_to_none=True)
            labelled = labels != IGNORE
            acc_correct += accelerator.reduce(((logits.argmax(-1) == labels) & labelled).sum(dim=(0, 1)), "sum")
            acc_count += accelerator.reduce(labelled.sum(dim=(0, 1)), "sum")
            acc_loss += accelerator.reduce(loss_sum.detach(), "sum") / total_weight
            acc_n += 1
            seen += accelerator.reduce(batch["response_tokens"], "sum")
            if not accelerator.sync_gradients:
                continue
            progress.step += 1
            bar.update(1)
            progress.tokens = int(seen)  # once per optimizer step, not per micro-batch
            step = progress.step
            last = step == total_steps or bool(cfg.max_seconds and elapsed() >= cfg.max_seconds)
            if step % cfg.log_every == 0 or last:
                accuracy = (acc_correct / acc_count.clamp(min=1)).tolist()
                progress.history.append({"step": step, "sequences": step * cfg.grad_accum * global_batch,
                                         "tokens": progress.tokens, "loss": float(acc_loss) / max(acc_n, 1),
                                         "accuracy": accuracy, "seconds": elapsed()})
                bar.set_postfix(loss=f"{progress.history[-1]['loss']:.3f}", acc0=f"{accuracy[0]:.2f}",
                                acc1=f"{accuracy[1]:.2f}")
                acc_correct, acc_count, acc_loss, acc_n = zeros(), zeros(), zeros()[0], 0
            maybe_evaluate()
            if step % cfg.save_every == 0 or last:
                accelerator.wait_for_everyone()
                if main:
                    progress.seconds = elapsed()
                    save_checkpoint(ckpt, head, optim, progress)
                accelerator.wait_for_everyone()
    if cfg.max_seconds and progress.step < total_steps:  # stopped by the time budget: the evaluation below is the last
        total_steps = progress.step
    maybe_evaluate()
    head.eval()
    if main:
        save_result(out, head, asdict(cfg), progress)
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    return head
