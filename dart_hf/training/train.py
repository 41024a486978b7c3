"""Training a DART head on captured target features (docs/DART_SPEC.md §2, sized for a CPU or one GPU).

Each step takes one sequence, picks `anchors_per_sequence` anchor positions in its response, and runs the
packed-anchor forward (`DartHead.forward`): every anchor's K MASK slots see only that anchor's prefix, so
one pass trains all anchors. Loss: cross-entropy of depth d's prediction against the target's greedy token
at that depth, weighted gamma^d (gamma = 0.6, the paper's best), averaged over labels in the draft vocab.

Warm start: the draft vocabulary is the most frequent response tokens (EOS always in), `lm_head` rows are
copied from the target's lm_head and `norm` from the target's final norm, so the head starts in the
target's own output space instead of learning it from a few hundred thousand tokens.

Resumable: `out/checkpoint/` holds the head, optimizer and history; rerunning the same command continues.

Progress in the unit that matters: with `evaluate` and `eval_every`, the head's mean accepted length on
held-out prompts is measured at the start, every `eval_every` optimizer steps and at the end, against the
number of response tokens trained on so far (the "how much more data would help" curve).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..core.modeling import DartHead
from .features import Example, iter_examples

IGNORE = -100


@dataclass
class TrainConfig:
    draft_length: int = 7
    draft_vocab_size: int | None = 8192  # None: tie to the target lm_head (full vocab)
    anchors_per_sequence: int = 48
    gamma: float = 0.6
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    epochs: float = 2.0
    grad_accum: int = 4
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 20
    save_every: int = 200
    

def choose_draft_vocab(examples: list[Example], size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent response tokens (plus `always`, e.g. EOS), as sorted target ids."""
    counts = torch.zeros(int(max(int(e.ids.max()) for e in examples)) + 1, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e.ids[e.prompt_length :], minlength=counts.numel())[: counts.numel()]
    counts[torch.tensor(always, dtype=torch.long)] = counts.max() + 1
    return counts.topk(min(size, int((counts > 0).sum()))).indices.sort().values


def new_head(target: PreTrainedModel, examples: list[Example], cfg: TrainConfig, eos_ids: list[int]) -> DartHead:
    """A head warm-started in the target's output space (see module docstring)."""
    vocab = None
    if cfg.draft_vocab_size is not None:
        vocab = choose_draft_vocab(examples, cfg.draft_vocab_size, eos_ids)
    head = DartHead.from_target(target, draft_length=cfg.draft_length, draft_vocab_size=None if vocab is None else vocab.numel())
    head = head.float()
    with torch.no_grad():
        head.norm.weight.copy_(target.get_decoder().norm.weight.float())
        if vocab is not None:
            head.set_draft_vocab(vocab)
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab].float())
    return head


def target_to_draft(head: DartHead) -> torch.Tensor | None:
    """[target vocab] -> draft id, IGNORE outside the draft vocab (None for a head on the full target vocab)."""
    if head.lm_head is None:
        return None
    to_draft = torch.full((head.config.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[head.draft_to_target.cpu()] = torch.arange(head.config.draft_vocab_size)
    return to_draft


def anchor_batch(
    example: Example, head: DartHead, n_anchors: int, rng: random.Random, to_draft: torch.Tensor | None = None
):
    """(aux [1,T-1,3H], next_tokens [1,T-1], anchors [1,A], draft labels [1,A,K+1]) for one sequence, or None.
    `to_draft` is `target_to_draft(head)`, built once per run (labels stay target ids when it is None).

    Anchor a pairs state h_a with token a+1 and its depth-d row predicts token a+2+d; anchors start where the
    response labels start (a + 2 >= prompt length) and end where depth 0 still has a label.
    """
    ids, t = example.ids, example.ids.numel()
    first, last = max(example.prompt_length - 2, 0), t - 3
    if last < first:
        return None
    positions = list(range(first, last + 1))
    anchors = torch.tensor(sorted(rng.sample(positions, min(n_anchors, len(positions)))))
    depth = torch.arange(head.config.num_predictions)
    label_pos = anchors.unsqueeze(1) + 2 + depth
    labels = torch.where(label_pos < t, ids[label_pos.clamp(max=t - 1)], IGNORE)
    if to_draft is not None:  # tokens outside the draft vocab are ignored
        labels = torch.where(labels >= 0, to_draft[labels.clamp(min=0)], IGNORE)
    return example.aux.unsqueeze(0), ids[1:].unsqueeze(0), anchors.unsqueeze(0), labels.unsqueeze(0)


def depth_weighted_loss(logits: torch.Tensor, labels: torch.Tensor, gamma: float):
    """(loss, per-depth correct counts, per-depth label counts)."""
    k1 = logits.shape[-2]
    weights = gamma ** torch.arange(k1, dtype=torch.float32, device=logits.device)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE,
                         reduction="none").view(labels.shape)
    valid = labels != IGNORE
    w = weights * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    correct = ((logits.argmax(-1) == labels) & valid).sum(dim=(0, 1))
    return loss, correct, valid.sum(dim=(0, 1))


def _lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def train_head(
    target: PreTrainedModel,
    feature_dir: str | Path,
    out_dir: str | Path,
    cfg: TrainConfig | None = None,
    eos_ids: list[int] | None = None,
    device: str | torch.device = "cpu",
    evaluate: Callable[[DartHead], dict[str, float]] | None = None,
    eval_every: int = 0,
) -> DartHead:
    """Train (or resume training) a head on the shards in `feature_dir`; saves the head to `out_dir`.

    `evaluate(head) -> {data set: mean accepted length}` is called with the head in eval mode under no_grad
    at step 0, every `eval_every` steps and at the end (see module docstring)."""
    cfg = cfg or TrainConfig()
    out, ckpt = Path(out_dir), Path(out_dir) / "checkpoint"
    examples = list(iter_examples(feature_dir))
    if ckpt.exists():
        head = DartHead.from_pretrained(ckpt).float()
        state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    else:
        head, state = new_head(target, examples, cfg, eos_ids or []), None
    head.to(device).train()
    head.bind_target(target, place=False)
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    total_steps = int(cfg.epochs * len(examples) / cfg.grad_accum)
    step, history, evaluations, tokens = 0, [], [], 0
    if state is not None:
        optim.load_state_dict(state["optimizer"])
        step, history = state["step"], json.loads(state["history"])
        evaluations, tokens = json.loads(state.get("evaluations", "[]")), int(state.get("tokens", 0))

    def maybe_evaluate() -> None:
        if evaluate is None or (evaluations and evaluations[-1]["step"] == step):
            return
        if step not in (0, total_steps) and (eval_every <= 0 or step % eval_every):
            return
        head.eval()
        with torch.no_grad():
            evaluations.append({"step": step, "tokens": tokens, "accepted_length": evaluate(head)})
        head.train()
        tqdm.write(f"step {step}, {tokens} tokens: accepted length {evaluations[-1]['accepted_length']}")

    rng = random.Random(cfg.seed + step)
    order = [i for _ in range(math.ceil(cfg.epochs) + 1) for i in rng.sample(range(len(examples)), len(examples))]
    cursor = step * cfg.grad_accum
    k1 = head.config.num_predictions
    to_draft = target_to_draft(head)
    acc_correct, acc_count, acc_loss, acc_n, started = torch.zeros(k1), torch.zeros(k1), 0.0, 0, time.perf_counter()
    with tqdm(total=total_steps, initial=step, desc="train head", unit="step") as bar:
        maybe_evaluate()
        while step < total_steps:
            for group in range(cfg.grad_accum):
                example = examples[order[cursor]]
                batch = anchor_batch(example, head, cfg.anchors_per_sequence, rng, to_draft)
                cursor += 1
                tokens += example.ids.numel() - example.prompt_length
                if batch is None:
                    continue
                aux, nxt, anchors, labels = (t.to(device) for t in batch)
                logits = head(aux.float(), nxt, anchors)
                loss, correct, count = depth_weighted_loss(logits, labels, cfg.gamma)
                (loss / cfg.grad_accum).backward()
                acc_correct += correct.cpu()
                acc_count += count.cpu()
                acc_loss, acc_n = acc_loss + float(loss), acc_n + 1
            for g in optim.param_groups:
                g["lr"] = _lr_at(step, total_steps, cfg)
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            if step % cfg.log_every == 0 or step == total_steps:
                accuracy = (acc_correct / acc_count.clamp(min=1)).tolist()
                history.append({"step": step, "sequences": cursor, "loss": acc_loss / max(acc_n, 1),
                                "accuracy": accuracy, "seconds": time.perf_counter() - started})
                bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", acc0=f"{accuracy[0]:.2f}", acc1=f"{accuracy[1]:.2f}")
                acc_correct, acc_count, acc_loss, acc_n = torch.zeros(k1), torch.zeros(k1), 0.0, 0
            maybe_evaluate()
            if step % cfg.save_every == 0 or step == total_steps:
                _save_checkpoint(head, optim, step, history, ckpt, evaluations, tokens)
    head.eval()
    head.save_pretrained(out)
    (out / "training_history.json").write_text(
        json.dumps({"config": asdict(cfg), "history": history, "evaluations": evaluations}, indent=1))
    plot_history(history, out / "training_curves.png", evaluations)
    return head


def plot_history(history: list[dict], path: Path, evaluations: list[dict] | None = None) -> None:
    """Loss and per-depth top-1 accuracy against training sequences, and (when measured) mean accepted
    length on held-out prompts against response tokens trained on, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        return
    seqs = [h["sequences"] for h in history]
    panels = 3 if evaluations else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4))
    ax_loss, ax_acc = axes[0], axes[1]
    ax_loss.plot(seqs, [h["loss"] for h in history])
    ax_loss.set(xlabel="training sequences", ylabel="depth-weighted CE", title="loss")
    for d in range(len(history[0]["accuracy"])):
        ax_acc.plot(seqs, [h["accuracy"][d] for h in history], label=f"depth {d}")
    ax_acc.set(xlabel="training sequences", ylabel="top-1 accuracy vs target", title="per-depth accuracy")
    ax_acc.legend(fontsize=7, ncol=2)
    if evaluations:
        ax_len = axes[2]
        for name in evaluations[0]["accepted_length"]:
            ax_len.plot([e["tokens"] for e in evaluations], [e["accepted_length"][name] for e in evaluations],
                        marker="o", label=name)
        ax_len.set(xlabel="response tokens trained on", ylabel="mean accepted length (greedy)",
                   title="held-out accepted length")
        ax_len.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _save_checkpoint(head: DartHead, optim, step: int, history: list, ckpt: Path, evaluations: list, tokens: int) -> None:
    tmp = ckpt.with_name("checkpoint.tmp")
    head.save_pretrained(tmp)
    torch.save({"optimizer": optim.state_dict(), "step": step, "history": json.dumps(history),
                "evaluations": json.dumps(evaluations), "tokens": tokens}, tmp / "trainer_state.pt")
    if ckpt.exists():
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    tmp.rename(ckpt)
