"""Accepted length without the target in the loop: how heads and tree settings are compared in seconds.

Under greedy decoding DART emits exactly plain `generate`'s text (lossless), so the tokens a tree gets accepted
depend only on that tree and that text. A comparison therefore needs the target only twice, never per setting:

1. `reference_texts`: plain greedy answers to held-out prompts. They do not depend on the head, so one file serves
   every head and every setting (`save_texts` / `load_texts`).
2. `draft_rows`: one target forward over each whole text reads the head's inputs; the head then drafts from every
   position as the decoding loop would from that root (its cache fed one verified position at a time), and the
   top `KEEP` logits of each row are kept.
3. `mean_accepted_length`: walk each text as the loop does (root = last accepted token, build the tree, accept the
   longest tree path the text follows, jump past it) for one tree setting; tokens per step, bonus included.

`dart_hf.tools.evaluation.acceptance_report` measures the same quantity by running DART for real; tests check the
two agree. Used by `examples/tune_tree_search.py` (tree settings) and for held-out comparisons of trained heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..core.configuration import check_config_matches_target
from ..core.modeling import DartHead, TargetModules
from ..core.acceptance import greedy_paths
from ..core.drafter import draft_depth
from ..core.prompt_lookup import lookup_for_tree
from ..core.target import aux_request, aux_states
from ..core.tree import DraftTrees, TreeSearchParams, build_tree

KEEP = 64
"""Draft logits kept per row: the tree reads the top `tree_top_k` of them (25 by default, at most KEEP); the
log-sum-exp of the whole row is kept too, for `best_first`'s full-softmax probabilities."""


@dataclass
class Text:
    """A prompt and plain greedy `generate`'s continuation: `ids` [T] (prompt then answer), `prompt_length`, and the
    `max_length` it was generated with (prompt + max_new_tokens; the answer is shorter when it ended with EOS)."""

    ids: torch.Tensor
    prompt_length: int
    max_length: int


@dataclass
class DraftRows:
    """The head's drafts from every root of one text: row j is drafted with the root at position
    prompt_length + j; `values` / `ids` [rows, K + 1, KEEP] (top logits and their draft-vocabulary ids),
    `log_norm` [rows, K + 1] the log-sum-exp over the whole draft vocabulary."""

    values: torch.Tensor
    ids: torch.Tensor
    log_norm: torch.Tensor


@torch.no_grad()
def reference_texts(
    target: PreTrainedModel, prompts: list[torch.Tensor], max_new_tokens: int, desc: str = "reference texts"
) -> list[Text]:
    """Plain greedy answers (no assistant): the texts every head and setting is measured on."""
    texts = []
    for ids in tqdm(prompts, desc=desc, unit="prompt"):
        ids = ids.to(target.device)
        out = target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens)
        texts.append(Text(out[0].cpu(), ids.shape[1], ids.shape[1] + max_new_tokens))
    return texts


def save_texts(texts: dict[str, list[Text]], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    torch.save({name: [(t.ids, t.prompt_length, t.max_length) for t in items] for name, items in texts.items()}, path)


def load_texts(path: str | Path) -> dict[str, list[Text]]:
    return {name: [Text(*item) for item in items] for name, items in torch.load(path).items()}


@torch.no_grad()
def draft_rows(target: PreTrainedModel, head: DartHead, texts: list[Text], desc: str = "draft") -> list[DraftRows]:
    """The head's drafts from every root of every text (the loop's per-step drafting, replayed position by
    position: the head's cache receives one verified position per call, as after a step that accepted nothing,
    which gives the same rows as any other chunking because the head is causal)."""
    check_config_matches_target(head.config, target)
    modules = TargetModules.of(target)
    head_device = head.fc.weight.device
    out = []
    for text in tqdm(texts, desc=desc, unit="text"):
        seq, p = text.ids.to(target.device).unsqueeze(0), text.prompt_length
        layer_ids = head.config.aux_layer_ids
        aux = aux_states(target(seq, **aux_request(layer_ids)), layer_ids, head_device)
        seq = seq.to(head_device)
        cache = head.new_cache(capacity=seq.shape[1] + head.config.num_predictions)
        rows = [head.draft(aux[:, :p], seq[:, 1 : p + 1], cache, target_modules=modules)]  # root: position p
        rows += [head.draft(aux[:, j - 1 : j], seq[:, j : j + 1], cache, target_modules=modules)
                 for j in range(p + 1, seq.shape[1])]
        logits = torch.stack(rows).float().cpu()
        top = logits.topk(min(KEEP, logits.shape[-1]), dim=-1)
        out.append(DraftRows(top.values, top.indices, logits.logsumexp(dim=-1)))
    return out


def _row_logits(rows: DraftRows, row: int, depth: int, vocab: int) -> torch.Tensor:
    """Dense [depth, vocab] logits of one root: the kept top logits, and the rest of the mass spread evenly over the
    other ids. A full softmax then gives the kept ids their exact probabilities (`best_first`), and no spread entry
    outranks a kept one (their mean is at most the smallest kept value), so a top-k that stays inside the kept ids
    (the reference beam search) sees exactly the original logits."""
    values, ids = rows.values[row, :depth], rows.ids[row, :depth].long()
    tail = vocab - values.shape[1]
    if tail == 0:
        return torch.empty(depth, vocab).scatter_(1, ids, values)
    kept, total = values.logsumexp(dim=-1), rows.log_norm[row, :depth]
    spread = total + torch.log1p(-torch.exp(kept - total).clamp(max=1.0)) - torch.log(torch.tensor(float(tail)))
    return spread.unsqueeze(1).expand(depth, vocab).clone().scatter_(1, ids, values)


def mean_accepted_length(
    head: DartHead,
    texts: list[Text],
    rows: list[DraftRows],
    params: TreeSearchParams,
    prompt_lookup: bool,
    eos_token_ids: torch.Tensor | None,
) -> float:
    """Tokens per step (bonus included) the decoding loop would get on `texts` with these tree settings."""
    if params.top_k > rows[0].values.shape[-1]:
        raise ValueError(f"tree_top_k {params.top_k} exceeds the {rows[0].values.shape[-1]} logits kept per row")
    cfg = head.config
    vocab = cfg.draft_vocab_size or cfg.vocab_size
    context_size = max(head.ngram.context_size if head.ngram is not None else 0, 1)
    steps = tokens = 0
    for text, drafts in zip(texts, rows):
        seq, j = text.ids, text.prompt_length
        while j < seq.numel() - 1:
            # as the loop: the tree may reach one token short of max_length (the last place is the bonus token's);
            # the step appends its accepted drafts and the bonus, cut after EOS (where the text ends)
            max_new = text.max_length - (j + 1) - 1
            depth = draft_depth(params.node_budget, max_new, cfg.num_predictions)
            lookup = lookup_for_tree(seq[: j + 1], depth, cfg, seq.device) if prompt_lookup else None
            tree = build_tree(_row_logits(drafts, j - text.prompt_length, depth, vocab), seq[j],
                              seq[max(0, j + 1 - context_size) : j + 1], params, ngram=head.ngram,
                              draft_to_target=head.draft_to_target, eos_token_ids=eos_token_ids, max_depth=max_new,
                              lookup=lookup)
            # the target's greedy token after each node is the text's token one depth further (-1 past its end)
            after = torch.cat([seq[j + 1 :], seq.new_full((tree.size,), -1)])
            drafted = int(greedy_paths(DraftTrees.stack([tree]), after[tree.depths][None])[1][0]) - 1
            appended = min(drafted + 1, seq.numel() - 1 - j)
            steps, tokens, j = steps + 1, tokens + appended, j + appended
    return tokens / max(steps, 1)


__all__ = ["Text", "DraftRows", "reference_texts", "save_texts", "load_texts", "draft_rows", "mean_accepted_length"]
