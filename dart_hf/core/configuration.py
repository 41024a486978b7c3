"""`DartConfig`: the shape of a DART draft head and the defaults of its tree search.

A DART head is ONE decoder layer that reads hidden states captured at three layers of the *target* model
and predicts ``draft_length + 1`` future tokens in one forward (the last real position plus
``draft_length`` MASK slots). The target-facing fields (``target_*``, ``vocab_size``, ``aux_layer_ids``)
are what a head is checked against before it may draft for a target, so a head trained for one model can
never silently run on another.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig


TREE_SEARCHES = ("beam", "best_first")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """Inputs of target layers 2, L // 2 and L - 3 (EAGLE-3 / DART), clamped into range for very shallow targets."""
    return [min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0)]


@strict
class DartConfig(PreTrainedConfig):
    r"""
    draft_length (`int`, defaults to 7):
        Number of MASK slots appended after the last real position. One forward yields
        `draft_length + 1` predictions: the last real row (the token after the bonus token) plus one per
        MASK slot. The paper's "draft length 8" is `draft_length=7` here.
    draft_vocab_size (`int`, *optional*):
        Size of the reduced draft vocabulary of `lm_head`; `d2t[i]` maps draft id `i` to target id
        `i + d2t[i]` (EAGLE-3 convention). `None` ties the head to the target's own `lm_head` (full vocab,
        no extra weights saved).
    target_hidden_size / target_num_layers / target_model_type / vocab_size:
        The target the head was built for; checked when the head is bound to a target.
    aux_layer_ids (`list[int]`, *optional*):
        Target decoder layers whose INPUTS are captured (default `[2, L // 2, L - 3]`, as EAGLE-3).
    final_norm_repeats (`int`, defaults to 1):
        How many times `norm` is applied before `lm_head`. Reference checkpoints were trained with 2.
    tree_search (`str`, defaults to `"beam"`):
        `"beam"`: the reference beam search (docs/DART_SPEC.md §3), what a converted reference head keeps.
        `"best_first"`: the node budget filled by the highest path scores over all drafts (as DDTree / CAST): each
        depth adds the log of the head's full-softmax probability plus the weighted n-gram term, with no depth
        decays, and as many beams as nodes, so no draft that would make the budget is pruned early
        (`dart_hf.core.tree`). Which accepts more is measured per head with `examples/tune_tree_search.py`.
    tree_top_k / beam_width / node_budget / level_decay / logit_decay / ngram_weight:
        Tree search settings (docs/DART_SPEC.md §3); the defaults are the reference release's values and this class
        is the one place they are stated (`dart_hf.core.tree.TreeSearchParams` and the converter read them here):
        per-depth top-k, beam width, number of draft nodes verified per step (root excluded),
        `level_w(d) = (d + 1) ** -level_decay`, `logit_w(d) = logit_decay ** d`, weight (>= 0) of the n-gram
        log-probability. `node_budget=None` lets the decoder pick the budget step by step from its own step times and
        the calibrated verify-cost curve, plain decoding included (see `dart_hf.core.budget`).
    has_ngram (`bool`, defaults to False):
        Set by `save_pretrained`: the head was saved with `ngram.safetensors` beside it, so loading refuses a copy
        of the folder without that file (rather than silently drafting without n-gram rescoring).
    prompt_lookup / lookup_min_ngram / lookup_max_ngram / lookup_logp:
        Offer the continuation of the latest earlier occurrence of the text's last n-gram (n from
        `lookup_max_ngram` down to `lookup_min_ngram`) as one more beam-search candidate per depth, scored as if the
        head gave it log-probability `lookup_logp` (see `dart_hf.core.prompt_lookup`; beyond the reference, so a
        converted reference head has `prompt_lookup=False`).
    rope_parameters (`dict`, *optional*):
        transformers' RoPE parameters. `"dynamic"` follows the reference head rather than transformers: the
        frequencies are those of a sequence of max(max_position_embeddings + 20, positions seen) tokens, i.e. scaled
        from the first token on (see `dart_hf.core.modeling.DartRotaryEmbedding`).
    """

    model_type = "dart"
    default_theta = 10000.0

    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    initializer_range: float = 0.02

    vocab_size: int = 49152
    draft_vocab_size: int | None = None
    draft_length: int = 7
    target_hidden_size: int = 576
    target_num_layers: int = 30
    target_model_type: str | None = None
    aux_layer_ids: list[int] | None = None
    final_norm_repeats: int = 1

    tree_search: str = "beam"
    tree_top_k: int = 25
    beam_width: int = 20
    node_budget: int | None = 60
    level_decay: float = 0.7
    logit_decay: float = 0.9
    ngram_weight: float = 0.5
    has_ngram: bool = False
    prompt_lookup: bool = True
    lookup_min_ngram: int = 2
    lookup_max_ngram: int = 4
    lookup_logp: float = -0.1

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.aux_layer_ids is None:
            self.aux_layer_ids = default_aux_layer_ids(self.target_num_layers)
        super().__post_init__(**kwargs)
        self.validate_dart_fields()

    def validate_dart_fields(self) -> None:
        """Reject configs that cannot describe a working head (a corrupt or foreign config.json). Types first, by
        each field's annotation: a hand-edited `"node_budget": "x"` (or 2.5, or true) is named here, as a ValueError
        that says which field and what it takes, instead of a bare TypeError from the first comparison below or a
        float budget deep inside the tree search."""
        def is_int(value) -> bool:  # JSON ints, numpy / torch integer scalars; never bool (a JSON true is no count)
            return hasattr(type(value), "__index__") and not isinstance(value, bool)

        def is_number(value) -> bool:
            return is_int(value) or isinstance(value, float)

        takes = {  # annotation (as written in the class body) -> (check, what it takes)
            "int": (is_int, "an integer"),
            "int | None": (lambda v: v is None or is_int(v), "an integer or null"),
            "float": (is_number, "a number"),
            "bool": (lambda v: isinstance(v, bool), "true or false"),
            "str": (lambda v: isinstance(v, str), "a string"),
            "str | None": (lambda v: v is None or isinstance(v, str), "a string or null"),
            "list[int] | None": (lambda v: isinstance(v, (list, tuple)) and all(map(is_int, v)), "a list of integers"),
            "dict | None": (lambda v: v is None or isinstance(v, dict), "an object or null"),
        }
        for name, annotation in type(self).__annotations__.items():
            check, what = takes.get(str(annotation), (None, None))
            value = getattr(self, name, None)
            if check is not None and not check(value):
                raise ValueError(f"DartConfig field {name} must be {what}, got {value!r} ({type(value).__name__})")
        if self.draft_length < 1:
            raise ValueError(f"draft_length must be >= 1, got {self.draft_length}")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"aux_layer_ids must name 3 target layers, got {self.aux_layer_ids}")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < self.target_num_layers]
        if bad:
            raise ValueError(
                f"aux_layer_ids {self.aux_layer_ids} out of range for a target with {self.target_num_layers} layers"
            )
        if self.draft_vocab_size is not None and not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in (0, vocab_size={self.vocab_size}]")
        if self.node_budget is not None and self.node_budget < 1:
            raise ValueError(f"node_budget must be >= 1 or None (cost-aware), got {self.node_budget}")
        if self.tree_search not in TREE_SEARCHES:
            raise ValueError(f"tree_search must be one of {TREE_SEARCHES}, got {self.tree_search!r}")
        if self.tree_top_k < 1 or self.beam_width < 1:
            raise ValueError("tree_top_k and beam_width must be >= 1")
        if self.ngram_weight < 0:
            raise ValueError(f"ngram_weight must be >= 0 (0 turns the n-gram term off), got {self.ngram_weight}")
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError(
                f"need 1 <= lookup_min_ngram <= lookup_max_ngram, got {self.lookup_min_ngram}, {self.lookup_max_ngram}"
            )
        if self.lookup_logp > 0:
            raise ValueError(f"lookup_logp is a log-probability (<= 0), got {self.lookup_logp}")

    @property
    def uses_target_lm_head(self) -> bool:
        """True when the head has no lm_head of its own and projects with the target's (full vocab)."""
        return self.draft_vocab_size is None

    @property
    def num_predictions(self) -> int:
        """Rows predicted per forward: the last real position plus one per MASK slot."""
        return self.draft_length + 1


# ----------------------------------------------------------------------------------- a DartConfig for a target
# Duck-typed on the target (only its config and its output embedding are read), so the head module can use them
# without importing anything about targets.
def _rope_parameters(cfg) -> dict:
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if "full_attention" in rope or "sliding_attention" in rope:  # per-layer-type RoPE (Gemma 3): the head attends
        # globally, so it takes the full-attention layers' RoPE, or the first layer type's where those have none
        per_type = [rope.get("full_attention"), *rope.values()]
        rope = dict(next((r for r in per_type if isinstance(r, dict)), {}))
    if "rope_theta" not in rope:
        rope["rope_theta"] = float(getattr(cfg, "rope_theta", 10000.0))
    rope.setdefault("rope_type", "default")
    return rope


def _intermediate_size(cfg) -> int:
    """The head's MLP width: the target's dense MLP width (its last layer's where it varies per layer), or, for a
    target made only of MoE layers, one expert's."""
    size = getattr(cfg, "intermediate_size", None) or getattr(cfg, "moe_intermediate_size", None)
    return int(size[-1] if isinstance(size, (list, tuple)) else size)


def _last_layer_field(cfg, name: str):
    """cfg.<name>, or the last decoder layer's where it differs per layer (Gemma 3n / Gemma 4 head dims: the head's
    own attention layer is sized like the target's last, global-attention layer)."""
    try:
        return getattr(cfg, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError: a per-layer field
        return getattr(cfg.per_layer_config[-1], name, None)


# what dart_config_for_target reads from a target's config (GPT-2 style configs have no intermediate_size)
_TARGET_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def dart_config_for_target(target, draft_length: int = 7, draft_vocab_size: int | None = None, **overrides) -> DartConfig:
    """A DartConfig whose layer has the target's width, heads and RoPE (EAGLE-3 / DART sizing)."""
    if target.config.is_encoder_decoder:
        raise ValueError("DART drafts for decoder-only targets; got an encoder-decoder model")
    cfg = target.config.get_text_config()
    missing = [f for f in _TARGET_FIELDS if getattr(cfg, f, None) is None and not (
        f == "intermediate_size" and getattr(cfg, "moe_intermediate_size", None))]
    if missing:
        raise ValueError(
            f"cannot size a DART head for a {cfg.model_type!r} target: its config has no {', '.join(missing)}. "
            "DART supports decoder-only causal LMs laid out like Llama / Qwen / Mistral / Gemma"
        )
    streams = getattr(cfg, "hc_mult", None) or getattr(cfg, "altup_num_inputs", None)
    if streams:
        raise ValueError(
            f"cannot run DART on a {cfg.model_type!r} target: its decoder layers carry {streams} hidden-state streams "
            "(hyper-connections / AltUp), and a DART head reads one hidden state per layer"
        )
    n_layers = cfg.num_hidden_layers
    fields = dict(
        hidden_size=cfg.hidden_size,
        intermediate_size=_intermediate_size(cfg),
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=_last_layer_field(cfg, "num_key_value_heads") or cfg.num_attention_heads,
        head_dim=_last_layer_field(cfg, "head_dim") or cfg.hidden_size // cfg.num_attention_heads,
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_eps", None) or 1e-6),
        rope_parameters=_rope_parameters(cfg),
        max_position_embeddings=getattr(cfg, "max_position_embeddings", 8192),
        vocab_size=cfg.vocab_size,
        draft_vocab_size=draft_vocab_size,
        draft_length=draft_length,
        target_hidden_size=cfg.hidden_size,
        target_num_layers=n_layers,
        target_model_type=cfg.model_type,
        aux_layer_ids=default_aux_layer_ids(n_layers),
    )
    fields.update(overrides)
    return DartConfig(**fields)


def check_config_matches_target(config: DartConfig, target) -> None:
    """Raise a ValueError naming the first field where a head's config and the target disagree."""
    if target.config.is_encoder_decoder:
        raise ValueError("DART drafts for decoder-only targets; got an encoder-decoder model")
    tc = target.config.get_text_config()
    checks = [
        ("hidden size", config.target_hidden_size, tc.hidden_size),
        ("vocab size", config.vocab_size, tc.vocab_size),
        ("number of layers", config.target_num_layers, tc.num_hidden_layers),
    ]
    if config.target_model_type is not None:
        checks.append(("model type", config.target_model_type, tc.model_type))
    for what, built_for, got in checks:
        if built_for != got:
            override = " (set head.config.target_model_type = None to override)" if what == "model type" else ""
            raise ValueError(
                f"DART head was built for a target with {what} {built_for!r}, but this target has {got!r}{override}"
            )
    n_layers = tc.num_hidden_layers
    if any(not 0 <= i < n_layers for i in config.aux_layer_ids):
        raise ValueError(f"aux_layer_ids {config.aux_layer_ids} do not exist in a target with {n_layers} layers")
    if config.uses_target_lm_head:
        out = target.get_output_embeddings()
        if out is None or out.weight.shape[0] != config.vocab_size:
            raise ValueError("a head tied to the target lm_head needs a target lm_head over the full vocab")


__all__ = ["DartConfig", "check_config_matches_target", "dart_config_for_target", "default_aux_layer_ids"]
