"""What a DART tree call checks before any work: every input it could not honour as plain `generate` does is refused
with the argument to blame (never a silent difference), the head is checked against the target and placed for it,
and the cache it decodes into is made (`step.decode_cache`). Chain mode shares `check_prompt` / `check_inputs`,
`check_node_budget`, `check_stats`, `check_processors` and `prepare_call`.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StaticCache
from transformers.generation.logits_process import (
    SynthIDTextWatermarkLogitsProcessor,
    UnbatchedClassifierFreeGuidanceLogitsProcessor,
)

from .modeling import DartHead
from .step import decode_cache
from .stats import DartStats
from .support import check_tree_target
from .target import prepare_head


def prepare_call(head: DartHead, model, stats: DartStats | None) -> tuple[DartHead, DartStats]:
    """What every DART `generate` call does once with its head, tree loop and chain mode alike, after every check
    (a refused call leaves the head, its stats and the target as they were): refuse stats of another type
    (`check_stats`; the tree loop's `_check` does not see them), get the head placed for `model` (`prepare_head`: the
    head itself, moved in place on its first call, or a placed copy; never moved while another call may draft with
    it), and make `stats` (default: a new `DartStats`) the call's, as `head.stats`. Returns (the head to draft with,
    the stats); the caller resets the stats once it knows the mode and node budget. The caller has run
    `check_head_matches_target` with its other checks."""
    check_stats(stats)
    stats = DartStats() if stats is None else stats
    placed = prepare_head(head, model)
    head.stats = stats
    return placed, stats


ID_DTYPES = (torch.long, torch.int)  # what the target's embedding looks up


def check_stats(stats) -> None:
    """`dart_stats`: None (a new `DartStats`) or a `DartStats` the call fills."""
    if stats is not None and not isinstance(stats, DartStats):
        raise TypeError(f"dart_stats must be a dart_hf.DartStats, got {type(stats).__name__}")


def prompt_ids(args: tuple, kwargs: dict):
    """The prompt of a `generate(*args, **kwargs)` call as the caller passed it (positional, `input_ids=` or
    `inputs=`), or None."""
    return args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))


def check_prompt(model, args: tuple, kwargs: dict, mode: str) -> None:
    """`check_inputs` on the prompt and mask of a `generate(*args, **kwargs)` call before transformers prepares them
    (it reads an empty batch's last column, and drops an all-ones mask: the tree loop sees neither)."""
    ids = prompt_ids(args, kwargs)
    if isinstance(ids, torch.Tensor):
        check_inputs(model, ids, kwargs.get("attention_mask"), mode)


def check_inputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, mode: str) -> None:
    """Refuse, naming the cause, prompts the target cannot read, which otherwise fail deep inside a forward (a
    reshape of 0 elements, an embedding index error) after the head was placed: empty input_ids, ids that are not
    integers or lie outside the target's vocabulary, an attention mask of another shape (a 2-D mask; transformers
    refuses others). Tree and chain mode alike, before the head is looked at: on the caller's tensors
    (`check_prompt`) and, for a call that reaches the tree loop another way (`custom_generate=dart_decode`), on what
    `generate` hands it."""
    where = f'DART dart_mode="{mode}"'
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty: {where} needs at least one prompt token (the head drafts from the "
                         f"text), got input_ids of shape {tuple(input_ids.shape)}; without input_ids generate starts "
                         f"from the target's bos_token_id")
    if input_ids.dtype not in ID_DTYPES:
        raise ValueError(f"input_ids must be integer token ids (torch.long or torch.int32), got {input_ids.dtype}")
    vocab = model.config.get_text_config().vocab_size  # the embedding's rows (every rank's, tensor-parallel too)
    low, high = torch.stack(list(input_ids.aminmax())).tolist()  # one read back
    if high >= vocab:
        raise ValueError(f"token id {high} is past the target's vocabulary ({vocab})")
    if low < 0:
        raise ValueError(f"token id {low} is negative: input_ids must be token ids in 0..{vocab - 1}")
    if attention_mask is not None and attention_mask.dim() == input_ids.dim() == 2:
        (rows, columns), (id_rows, id_columns) = attention_mask.shape, input_ids.shape
        if columns != id_columns:
            raise ValueError(f"attention_mask has {columns} columns but input_ids has {id_columns}")
        if rows != id_rows:
            raise ValueError(f"attention_mask has {rows} rows but input_ids has {id_rows}")


def check_call(model, head, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict):
    """Refuse, with the argument to blame, every call the loop cannot run exactly (the head: `prepare_call`)."""
    if not isinstance(head, DartHead):
        raise TypeError(f"dart_decode needs dart_head=<DartHead>, got {type(head).__name__}")
    if model_kwargs.get("synced_gpus"):
        raise ValueError("DART decoding does not support synced_gpus")
    # beams / return sequences first: generate() has already expanded input_ids by them, and a "batch of 2"
    # error would blame the wrong argument
    if generation_config.num_beams != 1 or generation_config.num_return_sequences != 1:
        raise ValueError("DART decoding supports num_beams=1 and num_return_sequences=1")
    if generation_config.cache_implementation not in (None, "dynamic", "static"):
        raise ValueError(
            f"DART decoding runs a DynamicCache (tree entries are compacted in place) or a StaticCache (the compiled "
            f"step); cache_implementation={generation_config.cache_implementation!r} is not supported"
        )
    check_tree_target(model)


# What `generate` hands the decoding method besides input_ids that this loop honours (position ids: the ones
# `generate` derives itself, `_default_positions`; the output flags: `check_model_inputs`)
MODEL_INPUTS = frozenset({"attention_mask", "cache", "past_key_values", "use_cache", "logits_to_keep",
                          "position_ids", "output_attentions", "output_hidden_states"})


def _unset(value) -> bool:
    """None, False (a flag turned off) or empty (multimodal models get an empty `mm_encoder_outputs` when the call
    has no media)."""
    return value is None or value is False or (isinstance(value, (dict, list, tuple)) and not value)


def _default_positions(model, input_ids: torch.Tensor, attention_mask, positions: torch.Tensor) -> bool:
    """Whether `positions` are the ones `generate` derives when the caller passes none (the model's own rule: image-text
    models add their multimodal axes), which the loop's positions follow."""
    derived = model._prepare_position_ids_for_generation(input_ids, {"attention_mask": attention_mask})
    try:  # (without a mask `generate` derives one row of positions for the whole batch)
        derived = derived.to(positions.device).expand_as(positions)
    except RuntimeError:
        return False
    return torch.equal(derived, positions)


def check_embeds(model_kwargs: dict) -> None:
    """Refuse inputs_embeds, which the tree loop would not feed the target; before `check_inputs`, since with
    inputs_embeds alone `generate` hands the loop empty input_ids."""
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("DART tree decoding reads the prompt as input_ids; inputs_embeds is not supported "
                         "(dart_mode=\"chain\" takes it beside input_ids)")


def check_model_inputs(model, input_ids: torch.Tensor, model_kwargs: dict, generation_config: GenerationConfig):
    """Refuse model inputs the tree loop would not feed the target (it prefills and verifies from input_ids and the
    attention mask alone), so they cannot silently change the text: images and other modalities,
    position ids other than the ones `generate` derives from the mask; and per-step attentions / hidden states,
    which a tree forward computes over draft nodes, not the emitted tokens (inputs_embeds: `check_embeds`)."""
    given = {k for k, v in model_kwargs.items() if not _unset(v)}
    extra = sorted(given - MODEL_INPUTS)
    if extra:
        raise ValueError(f"DART tree decoding feeds the target input_ids and attention_mask only, not {extra} "
                         f"(images, other modalities); dart_mode=\"chain\" (transformers' assisted decoding) passes "
                         f"them to the target")
    positions = model_kwargs.get("position_ids")
    mask = model_kwargs.get("attention_mask")
    _check_position_shape(input_ids, positions)
    if positions is not None and not _default_positions(model, input_ids, mask, positions):
        raise ValueError("DART tree decoding places tokens by the attention mask (as plain generate does when no "
                         "position_ids are passed); custom position_ids are not supported")
    if generation_config.return_dict_in_generate and any(
            model_kwargs.get(f) or getattr(generation_config, f, False)
            for f in ("output_attentions", "output_hidden_states")):
        raise ValueError("DART tree decoding does not return per-token attentions or hidden states (its target "
                         "forwards run over draft trees); output_scores and output_logits are supported")


def _check_position_shape(input_ids: torch.Tensor, positions: torch.Tensor | None) -> None:
    """The shape of the mask where `generate` dropped it (all ones), in the positions it derived from it first, or of
    the caller's position ids (`check_inputs` checks a mask the loop sees); without a mask `generate` derives one row
    of positions for the whole batch."""
    if positions is None:
        return
    if positions.shape[-1] != input_ids.shape[-1]:
        raise ValueError(f"attention_mask (or position_ids) has {positions.shape[-1]} columns but input_ids has "
                         f"{input_ids.shape[-1]}")
    if positions.dim() == 2 and positions.shape[0] not in (1, input_ids.shape[0]):
        raise ValueError(f"attention_mask (or position_ids) has {positions.shape[0]} rows but input_ids has "
                         f"{input_ids.shape[0]}")


def check_processors(logits_processor: LogitsProcessorList | None, other_layout: str | None) -> None:
    """Refuse the processors `generate` builds that hold state across calls, which DART cannot feed as plain
    `generate` does. The tree loop on one row calls processors once per new token, in order, with the row as plain
    `generate` shows it, so stateful ones stay exact there; `other_layout` names a call that does not ("a batch":
    each row is processed on its own, at its own pace; chain mode: transformers' assisted loop processes every
    drafted position, rejected ones included). Custom processors are not inspected: the README asks that those
    depend only on their arguments."""
    for processor in logits_processor or ():
        if isinstance(processor, UnbatchedClassifierFreeGuidanceLogitsProcessor):
            raise ValueError(
                "guidance_scale (classifier-free guidance) runs the target inside a logits processor, with its own "
                "cache, once per token; DART decoding does not support it (use plain generate)"
            )
        if isinstance(processor, SynthIDTextWatermarkLogitsProcessor) and other_layout:
            raise ValueError(
                f"SynthID watermarking keeps a state that assumes one processor call per token for the whole "
                f"batch; DART cannot keep that order in {other_layout} (it is exact in the default tree mode, "
                f"one row per call)"
            )


def check_cache(model_kwargs: dict) -> None:
    """Refuse a cache the call cannot decode into: a pre-filled one, or one that is neither a `DynamicCache` nor a
    `StaticCache`."""
    cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    if cache is not None and (not isinstance(cache, (DynamicCache, StaticCache)) or cache.get_seq_length() != 0):
        raise ValueError("DART decoding needs an empty DynamicCache, or an empty StaticCache for the static step (a "
                         "pre-filled cache is not supported)")


def eager_cache(model, model_kwargs: dict) -> DynamicCache:
    """The cache the step decodes into by default: the caller's `DynamicCache` or a new one, its sliding-window layers
    made full (`step.decode_cache`: the verify masks apply the windows)."""
    cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    return decode_cache(model.config, cache if isinstance(cache, DynamicCache) else None)


def check_node_budget(requested) -> None:
    """`dart_node_budget`: None, "auto" or a whole number >= 0 (a bool or 2.5 is refused, never rounded)."""
    whole = isinstance(requested, int) and not isinstance(requested, bool)
    if not (requested is None or requested == "auto" or (whole and requested >= 0)):
        raise ValueError(f'dart_node_budget must be a whole number >= 0 or "auto", got {requested!r}')


def is_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether the call has more than one row, or padding (then custom processors see other calls than in plain
    `generate`: `check_processors`)."""
    return input_ids.shape[0] > 1 or (attention_mask is not None and not bool((attention_mask == 1).all()))


def check_padding(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
    """Refuse, before any work, padding the loop cannot run exactly: only left padding, no empty row."""
    if attention_mask is None:
        return
    mask = attention_mask.bool()  # (its shape: `check_inputs`)
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError(
            "DART decoding of padded inputs supports left padding only (padding_side='left', as plain generate "
            "needs for decoder-only models); the attention_mask has zeros after ones (right or middle padding)"
        )
    if not bool(mask[:, -1].all()):
        raise ValueError("DART decoding got a row whose attention_mask is all zeros (an empty prompt)")
