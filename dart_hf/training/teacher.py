"""The target as teacher: its features (the head's inputs) and its next-token distribution, computed online per
batch, and the loss that compares the head with it.

One no-grad target forward per batch (`target_features`) gives the inputs of the `aux_layer_ids` layers and the
target's final states; its full next-token distribution is taken from those at the positions the head predicts
(`teacher_targets`). `FeatureCache` keeps both per sequence so that later epochs skip the forward.

Loss, weighted gamma^d over depths d (gamma = 0.6, docs/DART_SPEC.md §2):
  "kl": KL(target || head) of the target's full next-token distribution at every predicted depth.
  "ce": cross-entropy against the target's argmax token.
With a reduced draft vocabulary S the target distribution p is renormalised over S and each position's KL is
weighted by p(S). Why: the head can only ever propose tokens of S, and for any draft distribution q on S the
chance that sampling verification accepts is sum_S min(p, q) <= p(S), with equality at q = p / p(S); so the
renormalised target is exactly the best the head can do, greedy acceptance (argmax p in S) keeps its argmax,
and p(S) is how much acceptance is at stake at that position. The mass outside S gets no term of its own:
no draft over S can win it, and a separate "other" output would change the head's file format.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import PreTrainedModel

from ..core.target import aux_request, aux_states
from .corpus import Sequence

IGNORE = -100
"""The label of a row with nothing to learn (no target position, or a target token outside the draft vocabulary)."""
LOSSES = ("kl", "ce")


@torch.no_grad()
def target_features(target: PreTrainedModel, layer_ids: list[int], ids: torch.Tensor,
                    lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [B, T-1, 3H], final states [B, T-1, H]) of one no-grad target forward over ids[:, :-1]; the last
    token is never fed (nothing after it to predict)."""
    inputs = ids[:, :-1]
    mask = (torch.arange(inputs.shape[1], device=ids.device) < (lengths - 1).unsqueeze(1)).long()
    out = target.get_decoder()(input_ids=inputs, attention_mask=mask, use_cache=False, **aux_request(layer_ids))
    return aux_states(out, layer_ids), out.last_hidden_state


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


def target_over_draft(teacher_logits: torch.Tensor,
                      draft_to_target: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
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
    """gamma^d for the depths d of the last dimension: a deeper draft only counts if every one before it is accepted."""
    return gamma ** torch.arange(shape[-1], dtype=torch.float32, device=device)


def batch_loss(loss: str, head_logits: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor, gamma: float,
               teacher: TeacherTargets) -> tuple[torch.Tensor, torch.Tensor]:
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
