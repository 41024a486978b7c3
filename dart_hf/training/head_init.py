"""How a head starts: a fresh head warm-started in the target's output space, or an existing head whose draft
vocabulary is widened for new data; and the map from target ids to the head's draft ids.

Fine-tuning starts from an existing head (its draft vocabulary and weights) instead of a warm start, so a head grows
with each new slice of the corpus; `widen_draft_vocab` first takes in the new data's most frequent response tokens
it lacks, since a head never drafts a token outside its draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch
from transformers import PreTrainedModel

from ..core.modeling import DartHead
from .corpus import Sequence
from .teacher import IGNORE


def response_token_counts(examples: SequenceOf[Sequence], vocab_size: int) -> torch.Tensor:
    """How often each target id occurs in the examples' responses (prompts excluded: the head never drafts them)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for e in examples:
        counts += torch.bincount(e.ids[e.prompt_length :], minlength=vocab_size)[:vocab_size]
    return counts


def choose_draft_vocab(examples: SequenceOf[Sequence], size: int, always: list[int]) -> torch.Tensor:
    """The `size` most frequent response tokens (plus `always`, e.g. EOS), as sorted target ids."""
    counts = response_token_counts(examples, int(max(int(e.ids.max()) for e in examples)) + 1)
    counts[torch.tensor(always, dtype=torch.long)] = counts.max() + 1
    return counts.topk(min(size, int((counts > 0).sum()))).indices.sort().values


@torch.no_grad()
def widen_draft_vocab(head: DartHead, target: PreTrainedModel, examples: SequenceOf[Sequence], size: int) -> DartHead:
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


def new_head(target: PreTrainedModel, examples: SequenceOf[Sequence], eos_ids: list[int], *, draft_length: int,
             draft_vocab_size: int | None, init_layer_from_target: bool = False) -> DartHead:
    """A head warm-started in the target's output space: the draft vocabulary is the `draft_vocab_size` most frequent
    response tokens (EOS always in; None: the target's full vocabulary, tied lm_head), its `lm_head` rows are copied
    from the target's lm_head and `norm` from the target's final norm, so the head starts in the target's own output
    space instead of learning it from a few hundred thousand tokens. `init_layer_from_target`: `copy_target_layer`."""
    vocab = None
    if draft_vocab_size is not None:
        vocab = choose_draft_vocab(examples, draft_vocab_size, eos_ids)
    # node_budget None: the trained head's config asks for the cost-aware budget (a fixed 60 runs slower than plain
    # decoding where verifying 60 nodes costs much more than one token, as on a CPU)
    head = DartHead.from_target(target, draft_length=draft_length,
                                draft_vocab_size=None if vocab is None else vocab.numel(), node_budget=None)
    head = head.float()
    with torch.no_grad():
        head.norm.weight.copy_(target.get_decoder().norm.weight.float())
        if vocab is not None:
            head.set_draft_vocab(vocab)
            head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab].float())
    if init_layer_from_target:
        copy_target_layer(head, target)
    return head


def target_to_draft(head: DartHead) -> torch.Tensor | None:
    """[target vocab] -> draft id, IGNORE outside the draft vocab (None for a head on the full target vocab)."""
    if head.lm_head is None:
        return None
    to_draft = torch.full((head.config.vocab_size,), IGNORE, dtype=torch.long)
    to_draft[head.draft_to_target.cpu()] = torch.arange(head.config.draft_vocab_size)
    return to_draft
