"""Training a DART head (docs/DART_SPEC.md §2), on one CPU or GPU or data-parallel under `accelerate launch`.

Data: a token-id corpus (`dart_hf.training.corpus`, the scalable path) or feature shards captured during
regeneration (`dart_hf.training.features`, the older path: features on disk, cross-entropy only). For a
token corpus the target's features are computed online: one no-grad target forward per batch gives the
inputs of the `aux_layer_ids` layers (the head's inputs) and the target's final states, from which its
full next-token distribution is taken at the positions the head predicts.

Each micro-batch holds `batch_size` sequences (right-padded; every attention involved is causal, so the
padding never reaches a real row). In each sequence `anchors_per_sequence` anchor positions of the response
are drawn, and the packed-anchor forward (`DartHead.forward`) trains them all in one pass: every anchor's
K MASK slots see only that anchor's prefix. Anchors are drawn from a seed of the sequence's place in the
shuffled order, so they do not depend on how batches are spread over processes.

Loss, weighted gamma^d over depths d (gamma = 0.6, docs/DART_SPEC.md §2):
  "kl": KL(target || head) of the target's full next-token distribution at every predicted depth.
  "ce": cross-entropy against the target's argmax token (the stored response token for feature shards).
With a reduced draft vocabulary S the target distribution p is renormalised over S and each position's KL is
weighted by p(S). Why: the head can only ever propose tokens of S, and for any draft distribution q on S the
chance that sampling verification accepts is sum_S min(p, q) <= p(S), with equality at q = p / p(S); so the
renormalised target is exactly the best the head can do, greedy acceptance (argmax p in S) keeps its argmax,
and p(S) is how much acceptance is at stake at that position. The mass outside S gets no term of its own:
no draft over S can win it, and a separate "other" output would change the head's file format.

Data parallel: the loop runs through `accelerate.Accelerator` (prepared head, optimizer and data loader),
so `accelerate launch --num_processes N -m ...` trains on N devices unchanged: each process takes its own
`batch_size` sequences, gradients are averaged, and the loss is normalised by the weight summed over all
processes, so N processes match one process on the same global batch.

Warm start: the draft vocabulary is the most frequent response tokens (EOS always in), `lm_head` rows are
copied from the target's lm_head and `norm` from the target's final norm, so the head starts in the
target's own output space instead of learning it from a few hundred thousand tokens.

Fine-tuning: `init_from` starts from an existing head (its draft vocabulary and weights) instead of a warm start,
so a head grows with each new slice of the corpus; the learning-rate schedule starts over. With
`TrainConfig.widen_draft_vocab` the head's draft vocabulary first takes in the new data's most frequent response
tokens it lacks (`widen_draft_vocab`), since a head never drafts a token outside it.

Throughput: batches are grouped by length (transformers' `get_length_grouped_indices`: shuffled, then sorted
within mega-batches), so a batch pads to its own longest sequence rather than to a random long one; and with
`cache_features` each sequence's target features are kept in memory after their first forward, so epochs after
the first skip the target forward, the largest part of a step when the target is much larger than the head.

Resumable: `out/checkpoint/` holds the head, optimizer and history; rerunning the same command continues.

Progress in the unit that matters: with `evaluate` and `eval_every`, the head's mean accepted length on
held-out prompts is measured at the start, every `eval_every` optimizer steps and at the end, against the
number of response tokens trained on so far (the "how much more data would help" curve).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence as SequenceOf
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PreTrainedModel
from transformers.trainer_pt_utils import get_length_grouped_indices

from ..core.modeling import DartHead
from ..core.target import AuxHiddenCapture
from .corpus import CORPUS_FILE, META_FILE, Sequence, load_corpus
from .features import SHARD_GLOB, Example, iter_examples

IGNORE = -100
LOSSES = ("kl", "ce")


@dataclass
class TrainConfig:
    draft_length: int = 7
    draft_vocab_size: int | None = 8192  # None: tie to the target lm_head (full vocab)
    anchors_per_sequence: int = 48  # 0: every position with a label
    gamma: float = 0.6
    loss: str = "kl"  # "kl" (target distribution, token corpus only) or "ce" (target argmax)
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
    cache_features: bool = False  # keep target features in memory after their first forward (token corpora)
    log_every: int = 20
    save_every: int = 200
    max_seconds: float | None = None  # a time budget: the schedule runs on elapsed time and training stops there
    init_layer_from_target: bool = False  # a fresh head's layer starts as a copy of the target's last decoder layer
    mixed_precision: str = "no"  # "bf16": the head's forward under bf16 autocast (accelerate); losses stay fp32

    def __post_init__(self) -> None:
        if self.widen_draft_vocab is not None and self.init_from is None:
            raise ValueError("widen_draft_vocab grows the draft vocabulary of the init_from head: set init_from "
                             "(pass --init)")


def load_training_data(folders: str | Path | SequenceOf[str | Path]) -> list[Sequence | Example]:
    """Token corpora (`corpus.jsonl`: features computed online), joined in the order given, or one folder of
    feature shards (features stored). Why several corpora: a corpus grows per domain or per engine (chat answers,
    code answers, a llama.cpp run), and a fine-tune or a full retrain reads them together without copying."""
    folders = [Path(folders)] if isinstance(folders, (str, Path)) else [Path(f) for f in folders]
    if not folders:
        raise ValueError("no training data folder given")
    if len(folders) == 1 and not (folders[0] / CORPUS_FILE).exists() and any(folders[0].glob(SHARD_GLOB)):
        return list(iter_examples(folders[0]))
    data, vocab_sizes = [], {}
    for folder in folders:
        if not (folder / CORPUS_FILE).exists():
            shards = " (feature shards train alone, not beside other folders)" if any(folder.glob(SHARD_GLOB)) else ""
            raise FileNotFoundError(f"{folder} holds neither a token corpus ({CORPUS_FILE}, `dart-hf regenerate`) "
                                    f"nor feature shards ({SHARD_GLOB}){shards}")
        vocab_sizes[folder] = json.loads((folder / META_FILE).read_text()).get("vocab_size")
        data += load_corpus(folder)
    if len(set(vocab_sizes.values())) > 1:
        raise ValueError(f"these corpora come from different tokenizers (vocab sizes {vocab_sizes}): train on one "
                         "target's corpora at a time")
    return data


def response_token_counts(examples: SequenceOf[Sequence | Example], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in the examples' responses (prompts excluded: the head never drafts them)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e.ids[e.prompt_length :], minlength=vocab_size)[:vocab_size]
    return counts


def choose_draft_vocab(examples: SequenceOf[Sequence | Example], size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent response tokens (plus `always`, e.g. EOS), as sorted target ids."""
    counts = response_token_counts(examples, int(max(int(e.ids.max()) for e in examples)) + 1)
    counts[torch.tensor(always, dtype=torch.long)] = counts.max() + 1
    return counts.topk(min(size, int((counts > 0).sum()))).indices.sort().values


@torch.no_grad()
def widen_draft_vocab(head: DartHead, target: PreTrainedModel, examples: SequenceOf[Sequence | Example],
                      size: int) -> DartHead:
    """`head` with its draft vocabulary grown to `size` by the most frequent response tokens it lacks.

    Why: a head can never draft a token outside its draft vocabulary, and a vocabulary chosen on one corpus misses
    the frequent tokens of the next (a vocabulary chosen on chat text lacks code tokens such as " str" and " bool").
    Trained rows are kept. A new row is the target's lm_head row mapped into the space the head's rows have moved
    to: the least-squares linear map from the target's rows to the trained rows over the old vocabulary, applied to
    the new tokens' target rows. So the widened head drafts as well as before, before any training; target rows
    merely rescaled to the trained rows' norm outbid the trained ones, and fine-tuning is slow to undo that.
    Fewer new tokens than asked when the data holds fewer unseen ones."""
    if head.lm_head is None:
        raise ValueError("this head drafts over the full target vocabulary (tied lm_head): there is nothing to widen")
    old_size = head.config.draft_vocab_size
    if size < old_size:
        raise ValueError(f"the head's draft vocabulary has {old_size} tokens; it can be widened, not cut to {size}")
    old_ids = head.draft_to_target.cpu()
    counts = response_token_counts(examples, head.config.vocab_size)
    counts[old_ids] = 0
    extra = counts.topk(min(size - old_size, int((counts > 0).sum()))).indices
    if extra.numel() == 0:
        return head
    target_rows = target.get_output_embeddings().weight.detach().float().cpu()
    trained_rows = head.lm_head.weight.detach().float().cpu()
    to_head_space = torch.linalg.lstsq(target_rows[old_ids], trained_rows).solution  # [hidden, hidden]
    ids = torch.cat([old_ids, extra])
    rows = torch.cat([trained_rows, target_rows[extra] @ to_head_space])
    order = ids.argsort()  # set_draft_vocab keeps draft ids in target-id order
    config = head.config.__class__.from_dict({**head.config.to_dict(), "draft_vocab_size": ids.numel()})
    wide = DartHead(config).to(device=head.lm_head.weight.device, dtype=head.lm_head.weight.dtype)
    kept = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight", "d2t", "t2d")}
    loaded = wide.load_state_dict(kept, strict=False)
    if loaded.unexpected_keys or set(loaded.missing_keys) - {"lm_head.weight", "d2t", "t2d"}:
        raise RuntimeError(f"widening lost weights: missing {loaded.missing_keys}, unexpected {loaded.unexpected_keys}")
    wide.set_draft_vocab(ids)
    wide.lm_head.weight.copy_(rows[order].to(wide.lm_head.weight))
    wide.ngram = head.ngram
    return wide


def copy_target_layer(head: DartHead, target: PreTrainedModel) -> None:
    """Start the head's layer from the target's last decoder layer: MLP, o_proj and norms as they are, and q/k/v
    on the feature half of the head's 2*hidden input (the half that carries the fused target state; the embedding
    half keeps its fresh init). Why: that layer already maps states of this residual stream to the next token's
    state, so the head starts from the target's own last step instead of from noise."""
    theirs, mine, h = target.get_decoder().layers[-1], head.midlayer, head.config.hidden_size
    try:
        pairs = [(mine.mlp.gate_proj, theirs.mlp.gate_proj), (mine.mlp.up_proj, theirs.mlp.up_proj),
                 (mine.mlp.down_proj, theirs.mlp.down_proj), (mine.self_attn.o_proj, theirs.self_attn.o_proj),
                 (mine.hidden_norm, theirs.input_layernorm),
                 (mine.post_attention_layernorm, theirs.post_attention_layernorm)]
        inputs = [(getattr(mine.self_attn, n), getattr(theirs.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj")]
    except AttributeError as err:
        raise ValueError(f"init_layer_from_target needs a Llama-style last layer (q/k/v/o_proj, gate/up/down_proj, "
                         f"input/post_attention_layernorm); {type(theirs).__name__} has no {err.name}") from None
    shapes = [(m.weight.shape, t.weight.shape) for m, t in pairs]
    shapes += [((m.weight.shape[0], m.weight.shape[1] - h), t.weight.shape) for m, t in inputs]
    if any(tuple(a) != tuple(b) for a, b in shapes):
        raise ValueError(f"init_layer_from_target: the head's layer and the target's last layer differ in shape "
                         f"(head, target): {[s for s in shapes if tuple(s[0]) != tuple(s[1])]}")
    with torch.no_grad():
        for m, t in pairs:
            m.weight.copy_(t.weight)
        for m, t in inputs:
            m.weight[:, h:].copy_(t.weight)
            if m.bias is not None and t.bias is not None:
                m.bias.copy_(t.bias)


def new_head(target: PreTrainedModel, examples: SequenceOf[Sequence | Example], cfg: TrainConfig,
             eos_ids: list[int]) -> DartHead:
    """A head warm-started in the target's output space (see module docstring)."""
    vocab = None
    if cfg.draft_vocab_size is not None:
        vocab = choose_draft_vocab(examples, cfg.draft_vocab_size, eos_ids)
    # node_budget None: the trained head's config asks for the cost-aware budget (a fixed 60 runs slower than plain
    # decoding where verifying 60 nodes costs much more than one token, as on a CPU)
    head = DartHead.from_target(target, draft_length=cfg.draft_length, draft_vocab_size=None if vocab is None else vocab.numel(), node_budget=None)
    head = head.float()
    with torch.no_grad():
        head.norm.weight.copy_(target.get_decoder().norm.weight.float())
        if vocab is not None:
            head.set_draft_vocab(vocab)
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab].float())
    if cfg.init_layer_from_target:
        copy_target_layer(head, target)
    return head


def target_to_draft(head: DartHead) -> torch.Tensor | None:
    """[target vocab] -> draft id, IGNORE outside the draft vocab (None for a head on the full target vocab)."""
    if head.lm_head is None:
        return None
    to_draft = torch.full((head.config.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[head.draft_to_target.cpu()] = torch.arange(head.config.draft_vocab_size)
    return to_draft


def anchor_positions(example: Sequence | Example, n_anchors: int, rng: random.Random) -> list[int]:
    """Sorted anchors of one sequence: anchor a pairs state h_a with token a+1 and its depth-d row predicts
    token a+2+d, so anchors start where the response labels start (a + 2 >= prompt length) and end where
    depth 0 still has a label; with a label mask, only anchors whose depth-0 token is labelled. `n_anchors` <= 0:
    all of them. Empty when the response is too short."""
    first, last = max(example.prompt_length - 2, 0), example.ids.numel() - 3
    if last < first:
        return []
    candidates = range(first, last + 1)
    mask = getattr(example, "label_mask", None)
    if mask is not None:
        candidates = (torch.nonzero(mask[first + 2 : last + 3]).flatten() + first).tolist()
    if n_anchors <= 0 or n_anchors >= len(candidates):
        return list(candidates)
    return sorted(rng.sample(candidates, n_anchors))


def labelled_tokens(example: Sequence | Example) -> int:
    """Tokens the head learns to predict in one sequence (its response, or its label mask)."""
    mask = getattr(example, "label_mask", None)
    return int(mask.sum()) if mask is not None else example.ids.numel() - example.prompt_length


def label_validity(valid: torch.Tensor, position: torch.Tensor, ids: torch.Tensor, label_mask: torch.Tensor,
                   argmax: torch.Tensor) -> torch.Tensor:
    """`valid` [B, A, K+1] narrowed to rows whose token is labelled and whose context agrees with the target.

    Row (a, d) predicts token a+2+d from the target's distribution at `position` = a+1+d, computed over the TEXT
    prefix. At decoding time depth d is only reached along the target's own greedy tokens a+2..a+1+d, so a label
    is kept only where the text's tokens before it are the target's argmax (for a corpus of the target's own
    greedy answers, everywhere). Depth 0 needs no agreement: its context is the text the target has seen."""
    token = ids.gather(1, (position + 1).clamp(max=ids.shape[1] - 1).flatten(1)).view(position.shape)
    labelled = label_mask.gather(1, (position + 1).clamp(max=label_mask.shape[1] - 1).flatten(1)).view(position.shape)
    agree = (argmax == token).long().cumprod(-1)
    prefix_agrees = torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1]], dim=-1).bool()
    return valid & labelled & prefix_agrees


class AnchorCollator:
    """Data loader items are places in the shuffled order; a batch is the padded sequences at those places.

    Returns ids [B, T] (right-padded with 0), lengths [B], anchors [B, A] and anchor_valid [B, A] (rows with
    fewer than A anchors repeat their first one, marked invalid), plus aux [B, T-1, 3H] for stored features."""

    def __init__(self, data: SequenceOf[Sequence | Example], order: list[int], n_anchors: int, seed: int):
        self.data, self.order, self.n_anchors, self.seed = data, order, n_anchors, seed

    def __call__(self, places: list[int]) -> dict[str, torch.Tensor]:
        index = [self.order[p] for p in places]
        seqs = [self.data[i] for i in index]
        anchors = [anchor_positions(s, self.n_anchors, random.Random(self.seed * 1_000_003 + p))
                   for s, p in zip(seqs, places)]
        a = max(len(x) for x in anchors)
        batch = {
            "ids": pad_sequence([s.ids for s in seqs], batch_first=True),
            "lengths": torch.tensor([s.ids.numel() for s in seqs]),
            "anchors": torch.tensor([x + [x[0]] * (a - len(x)) for x in anchors]),
            "anchor_valid": torch.tensor([[True] * len(x) + [False] * (a - len(x)) for x in anchors]),
            "response_tokens": torch.tensor(sum(labelled_tokens(s) for s in seqs)),
            "index": torch.tensor(index),
        }
        if isinstance(seqs[0], Example):
            batch["aux"] = pad_sequence([s.aux for s in seqs], batch_first=True)  # aux rows: T - 1 per sequence
        else:
            masks = [s.label_mask if s.label_mask is not None else torch.arange(s.ids.numel()) >= s.prompt_length
                     for s in seqs]
            batch["label_mask"] = pad_sequence(masks, batch_first=True)
        return batch


@torch.no_grad()
def target_features(target: PreTrainedModel, layer_ids: list[int], ids: torch.Tensor, lengths: torch.Tensor):
    """(aux [B, T-1, 3H], final states [B, T-1, H]) of one no-grad target forward over ids[:, :-1]; the last
    token is never fed (nothing after it to predict)."""
    inputs = ids[:, :-1]
    mask = (torch.arange(inputs.shape[1], device=ids.device) < (lengths - 1).unsqueeze(1)).long()
    with AuxHiddenCapture(target, layer_ids) as capture:
        final = target.get_decoder()(input_ids=inputs, attention_mask=mask, use_cache=False).last_hidden_state
        aux = capture.take()
    return aux, final


class FeatureCache:
    """Target features (aux inputs and final states, unpadded, on the CPU) per corpus sequence, kept from the
    first batch that computed them: later epochs assemble a batch from here instead of running the target.

    Rows are stored as the batch forward produced them, so a cached batch differs from a fresh one only by the
    float noise of a different padding width."""

    def __init__(self, data: SequenceOf[Sequence], n_aux: int, hidden: int, dtype: torch.dtype):
        self.rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.nbytes = sum(s.ids.numel() - 1 for s in data) * (n_aux + 1) * hidden * dtype.itemsize
        available = _available_memory()
        if available is not None and self.nbytes > 0.8 * available:
            raise MemoryError(f"cache_features needs {self.nbytes / 2**30:.1f} GiB for this corpus but "
                              f"{available / 2**30:.1f} GiB of memory is available: train without it (the target "
                              "then runs on every batch)")

    def get(self, index: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(aux [B, T-1, 3H], final [B, T-1, H]) zero-padded to the batch's T like `target_features`, or None if a
        row is missing."""
        keys = index.tolist()
        if not all(k in self.rows for k in keys):
            return None
        aux, final = (pad_sequence([self.rows[k][part] for k in keys], batch_first=True) for part in (0, 1))
        return aux.to(device, non_blocking=True), final.to(device, non_blocking=True)

    def put(self, index: torch.Tensor, lengths: torch.Tensor, aux: torch.Tensor, final: torch.Tensor) -> None:
        for row, (k, n) in enumerate(zip(index.tolist(), (lengths - 1).tolist())):
            self.rows.setdefault(k, (aux[row, :n].cpu().clone(), final[row, :n].cpu().clone()))


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: no check
        return None


def target_logits(target: PreTrainedModel, states: torch.Tensor) -> torch.Tensor:
    """The target's next-token logits from its final states (with Gemma-style final soft-capping)."""
    logits = target.get_output_embeddings()(states).float()
    cap = getattr(target.config.get_text_config(), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def target_over_draft(teacher_logits: torch.Tensor, draft_to_target: torch.Tensor | None):
    """(log p_S [..., |S|], p(S) [...]): the target distribution p (teacher logits over the target vocab)
    renormalised over the draft vocab S (`draft_to_target`; None: S is the whole vocab), and its mass on S."""
    log_p = teacher_logits.float().log_softmax(-1)
    if draft_to_target is not None:
        log_p = log_p[..., draft_to_target]
    log_mass = log_p.logsumexp(-1, keepdim=True)
    return log_p - log_mass, log_mass.squeeze(-1).exp()


def kl_terms(head_logits: torch.Tensor, log_p_s: torch.Tensor) -> torch.Tensor:
    """KL(p_S || q) per row; q is the head's distribution over S."""
    return F.kl_div(head_logits.float().log_softmax(-1), log_p_s, reduction="none", log_target=True).sum(-1)


@dataclass
class TeacherTargets:
    """What the loss needs of the target at every (sequence, anchor, depth) row [B, A, K+1]."""

    log_p_s: torch.Tensor  # [B, A, K+1, |S|] target log-probs renormalised over the draft vocab
    mass: torch.Tensor  # [B, A, K+1] p(S)
    argmax: torch.Tensor  # [B, A, K+1] the target's greedy token (target ids)


def teacher_targets(target: PreTrainedModel, final: torch.Tensor, position: torch.Tensor,
                    draft_to_target: torch.Tensor | None) -> TeacherTargets:
    """The target's next-token distribution at `position` [B, A, K+1] (rows of its final states [B, T-1, H]).

    Anchors overlap (anchor a at depth d and anchor a+1 at depth d-1 read the same row), so the logits over the
    full target vocab are computed once per distinct (sequence, row) and only the |S|-wide result is gathered
    per anchor and depth: with 48 anchors x 8 depths per sequence that is about half the rows and a sixth of the
    width of computing them per anchor."""
    b, rows = final.shape[:2]
    flat = (torch.arange(b, device=final.device).view(-1, 1, 1) * rows + position.clamp(max=rows - 1)).flatten()
    distinct, inverse = torch.unique(flat, return_inverse=True)
    logits = target_logits(target, final.flatten(0, 1)[distinct])
    log_p_s, mass = target_over_draft(logits, draft_to_target)
    return TeacherTargets(log_p_s[inverse].view(*position.shape, -1), mass[inverse].view(position.shape),
                          logits.argmax(-1)[inverse].view(position.shape))


def depth_weights(shape: torch.Size, gamma: float, device) -> torch.Tensor:
    return gamma ** torch.arange(shape[-1], dtype=torch.float32, device=device)


def batch_loss(
    loss: str, head_logits: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor, gamma: float,
    teacher: TeacherTargets | None = None,
):
    """(weighted loss sum, weight sum) over rows [B, A, K+1]; the loss is their ratio (summed over processes).

    `valid`: rows with a target position; `labels`: the target's argmax in draft ids (IGNORE outside S)."""
    w = depth_weights(valid.shape, gamma, head_logits.device)
    if loss == "kl":
        weight = w * valid
        return (kl_terms(head_logits, teacher.log_p_s) * teacher.mass * weight).sum(), weight.sum()
    labelled = labels != IGNORE
    ce = F.cross_entropy(head_logits.reshape(-1, head_logits.shape[-1]).float(), labels.reshape(-1),
                         ignore_index=IGNORE, reduction="none").view(labels.shape)
    weight = w * labelled
    return (ce * weight).sum(), weight.sum()


def _lr_at(step: int, total: int, cfg: TrainConfig, seconds: float = 0.0) -> float:
    """Linear warm-up, then a cosine decay over the steps, or over `max_seconds` when that ends first."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(total - cfg.warmup_steps, 1)
    if cfg.max_seconds:
        progress = max(progress, seconds / cfg.max_seconds)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def _training_order(lengths: list[int], cfg: TrainConfig, global_batch: int) -> list[int]:
    """Sequence indices for every epoch (a fresh shuffle each, length-grouped by global batch so that each
    process's share pads alike), cut to whole optimizer steps."""
    n, epochs = len(lengths), range(math.ceil(cfg.epochs))
    if cfg.group_by_length:
        order = [i for e in epochs for i in get_length_grouped_indices(
            lengths, global_batch, generator=torch.Generator().manual_seed(cfg.seed * 1_000 + e))]
    else:
        rng = random.Random(cfg.seed)
        order = [i for _ in epochs for i in rng.sample(range(n), n)]
    per_step = global_batch * cfg.grad_accum
    return order[: int(cfg.epochs * n) // per_step * per_step]


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
    """Train (or resume training) a head on `data_dir` (token corpora or one folder of feature shards); saves it
    to `out_dir`.

    `device="cpu"` forces the CPU; otherwise accelerate picks this process's device. `evaluate(head) ->
    {data set: mean accepted length}` runs on the main process with the head in eval mode under no_grad at
    step 0, every `eval_every` steps and at the end (see module docstring)."""
    cfg = cfg or TrainConfig()
    if cfg.loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {cfg.loss!r}")
    accelerator = Accelerator(cpu=str(device) == "cpu", gradient_accumulation_steps=cfg.grad_accum,
                              mixed_precision=cfg.mixed_precision)
    out, ckpt = Path(out_dir), Path(out_dir) / "checkpoint"
    data = [e for e in load_training_data(data_dir) if anchor_positions(e, 1, random.Random(0))]
    stored = isinstance(data[0], Example) if data else False
    if not data:
        raise ValueError(f"{data_dir}: no sequence has a response long enough to train on (3 tokens or more)")
    if stored and cfg.loss == "kl":
        raise ValueError(f"{data_dir} holds stored feature shards, which keep no target distribution: use "
                         "loss='ce', or a token corpus (`dart-hf regenerate`) for loss='kl'")
    if cfg.cache_features and stored:
        raise ValueError(f"{data_dir} holds stored feature shards: cache_features is for token corpora")
    top_id, vocab_size = max(int(e.ids.max()) for e in data), target.config.get_text_config().vocab_size
    if top_id >= vocab_size:
        raise ValueError(f"{data_dir}: token id {top_id} is outside this target's vocabulary ({vocab_size}): the "
                         "data was made with another tokenizer")
    if ckpt.exists():
        head = DartHead.from_pretrained(ckpt).float()
        state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
    elif cfg.init_from is not None:
        head, state = DartHead.from_pretrained(cfg.init_from).float(), None
        if cfg.widen_draft_vocab is not None:
            head = widen_draft_vocab(head, target, data, cfg.widen_draft_vocab)
    else:
        torch.manual_seed(cfg.seed)  # the same config trains the same head
        head, state = new_head(target, data, cfg, eos_ids or []), None
    target.requires_grad_(False)  # the head borrows its embedding (and lm_head when tied): never trained
    if not stored:
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
    order = _training_order([e.ids.numel() for e in data], cfg, cfg.batch_size * accelerator.num_processes)
    total_steps = len(order) // (cfg.batch_size * accelerator.num_processes * cfg.grad_accum)
    if total_steps == 0:
        raise ValueError(f"{len(data)} sequences x {cfg.epochs} epochs do not fill one optimizer step of "
                         f"{cfg.batch_size} x {accelerator.num_processes} processes x {cfg.grad_accum} accumulation")
    step, history, evaluations, tokens, spent = 0, [], [], 0, 0.0
    if state is not None:
        optim.load_state_dict(state["optimizer"])
        step, history = state["step"], json.loads(state["history"])
        evaluations, tokens = json.loads(state.get("evaluations", "[]")), int(state.get("tokens", 0))
        spent = float(state.get("seconds", 0.0))
    loader = DataLoader(range(len(order)), batch_size=cfg.batch_size, shuffle=False,
                        collate_fn=AnchorCollator(data, order, cfg.anchors_per_sequence, cfg.seed))
    model, optim, loader = accelerator.prepare(head, optim, loader)
    if step:
        loader = accelerator.skip_first_batches(loader, step * cfg.grad_accum)
    main = accelerator.is_main_process

    def maybe_evaluate() -> None:
        if evaluate is None or (evaluations and evaluations[-1]["step"] == step):
            return
        if step not in (0, total_steps) and (eval_every <= 0 or step % eval_every):
            return
        if main:
            head.eval()
            with torch.no_grad():
                evaluations.append({"step": step, "tokens": tokens, "accepted_length": evaluate(head)})
            head.train()
            tqdm.write(f"step {step}, {tokens} tokens: accepted length {evaluations[-1]['accepted_length']}")
        accelerator.wait_for_everyone()

    k1 = head.config.num_predictions
    depth = torch.arange(k1, device=accelerator.device)
    zeros = lambda: torch.zeros(k1, device=accelerator.device)
    acc_correct, acc_count, acc_loss, acc_n = zeros(), zeros(), zeros()[0], 0
    started = time.perf_counter() - spent  # wall time of this run and the ones it resumes
    elapsed = lambda: time.perf_counter() - started
    seen = torch.tensor(tokens, device=accelerator.device)  # response tokens trained on, summed over processes
    with tqdm(total=total_steps, initial=step, desc="train head", unit="step", disable=not main) as bar:
        maybe_evaluate()
        for batch in loader:
            if step >= total_steps or (cfg.max_seconds and elapsed() >= cfg.max_seconds):
                break
            ids, lengths, anchors = batch["ids"], batch["lengths"], batch["anchors"]
            # anchor a, depth d predicts token a+2+d: the target's distribution at position a+1+d (< T-1)
            position = anchors.unsqueeze(-1) + 1 + depth
            valid = (position < (lengths - 1).view(-1, 1, 1)) & batch["anchor_valid"].unsqueeze(-1)
            teacher = None
            if stored:
                aux = batch["aux"]
                token = ids.gather(1, (position + 1).clamp(max=ids.shape[1] - 1).flatten(1)).view(position.shape)
            else:
                cached = None if cache is None else cache.get(batch["index"], ids.device)
                aux, final = cached or target_features(target, layer_ids, ids, lengths)
                if cache is not None and cached is None:
                    cache.put(batch["index"], lengths, aux, final)
                teacher = teacher_targets(target, final, position, draft_ids)
                token = teacher.argmax
                valid = label_validity(valid, position, ids, batch["label_mask"], token)
            labels = torch.where(valid, token, IGNORE)
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
                        g["lr"] = _lr_at(step, total_steps, cfg, elapsed())
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
            step += 1
            bar.update(1)
            tokens = int(seen)  # once per optimizer step, not per micro-batch
            last = step == total_steps or bool(cfg.max_seconds and elapsed() >= cfg.max_seconds)
            if step % cfg.log_every == 0 or last:
                accuracy = (acc_correct / acc_count.clamp(min=1)).tolist()
                history.append({"step": step, "sequences": step * cfg.grad_accum * cfg.batch_size
                                * accelerator.num_processes, "tokens": tokens, "loss": float(acc_loss) / max(acc_n, 1),
                                "accuracy": accuracy, "seconds": elapsed()})
                bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", acc0=f"{accuracy[0]:.2f}", acc1=f"{accuracy[1]:.2f}")
                acc_correct, acc_count, acc_loss, acc_n = zeros(), zeros(), zeros()[0], 0
            maybe_evaluate()
            if step % cfg.save_every == 0 or last:
                accelerator.wait_for_everyone()
                if main:
                    _save_checkpoint(head, optim, step, history, ckpt, evaluations, tokens, elapsed())
                accelerator.wait_for_everyone()
    if cfg.max_seconds and step < total_steps:  # stopped by the time budget: the evaluation below is the last one
        total_steps = step
    maybe_evaluate()
    head.eval()
    if main:
        head.save_pretrained(out)
        (out / "training_history.json").write_text(
            json.dumps({"config": asdict(cfg), "history": history, "evaluations": evaluations}, indent=1))
        plot_history(history, out / "training_curves.png", evaluations)
    accelerator.wait_for_everyone()
    accelerator.free_memory()
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
    ax_loss.set(xlabel="training sequences", ylabel="depth-weighted loss (KL or CE)", title="loss")
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


def _save_checkpoint(head: DartHead, optim, step: int, history: list, ckpt: Path, evaluations: list, tokens: int,
                     seconds: float) -> None:
    tmp = ckpt.with_name("checkpoint.tmp")
    head.save_pretrained(tmp)
    state = {"optimizer": optim.state_dict(), "step": step, "history": json.dumps(history),
             "evaluations": json.dumps(evaluations), "tokens": tokens, "seconds": seconds}
    torch.save(state, tmp / "trainer_state.pt")
    if ckpt.exists():
        for f in ckpt.iterdir():
            f.unlink()
        ckpt.rmdir()
    tmp.rename(ckpt)
