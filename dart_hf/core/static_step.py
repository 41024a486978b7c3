"""The GPU-shaped DART step: a static KV cache, fixed shapes, and one function per step that `torch.compile` captures
whole (`generate(..., assistant_model=head, cache_implementation="static")`).

Why: on a GPU an eager decode loop is bound by kernel launches and host syncs, not by the model, and plain `generate`
with a static cache is compiled (transformers' auto-compile). The eager tree loop has a shape per step (tree size,
path length) and three host syncs, so it cannot be captured. Here every shape is fixed for the call:

- the target decodes into transformers' own `StaticCache`; a step's N tree nodes (a fixed node budget: N = budget + 1)
  are written into the N slots after the committed text (the layer's `cumulative_length`), and the accepted path is
  moved into place with one `index_copy_` per layer, its length set back on the device;
- the head keeps its keys/values in fixed buffers too (`StaticHeadState`): the positions verified last step are a
  fixed block of M = depth + 1 rows of which the first `n_pend` are real, so the head forward has one shape;
- the masks are tensors built from the device-side lengths (no Python int of a length anywhere in the step);
- head forward + tree search + verify + greedy acceptance + commit is `greedy_step`, captured with `fullgraph=True`;
  the accepted length and tokens come back to the host in ONE copy per step (`StaticStep.step`).

Sampling and logits processors keep the eager acceptance walk (one draw per emitted token, as plain `generate`, so the
same seed gives the same text) between the captured `draft_tree` + `verify` and `commit`.
What the static path cannot run (a batch, sliding windows, ...) runs on the eager loop, and `DartStats.static_reason`
says why (`static_refusal`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StaticCache

from .acceptance import BatchAccepted, accept_walk, greedy_paths
from .modeling import DartHead, TargetModules
from .distributed import tensor_parallel_group
from .ragged import backend_mask, decode_cache, layer_windows
from .prompt_lookup import lookup_continuations
from .tree import DraftTrees, TreeSearchParams, build_trees, last_tokens

SLOT_ROUNDING = 256  # cache lengths are rounded up to this, so calls of nearby lengths share one compiled graph


def static_requested(generation_config: GenerationConfig, model_kwargs: dict) -> bool:
    """Whether the call asks for a static cache (`cache_implementation="static"`, or a `StaticCache` passed in)."""
    cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    return generation_config.cache_implementation == "static" or isinstance(cache, StaticCache)


def static_refusal(model, input_ids: torch.Tensor, attention_mask, generation_config: GenerationConfig,
                   node_budget: int, tensor_parallel: bool) -> str | None:
    """Why this call cannot take the static step (it then runs the eager loop, exactly), or None."""
    text = model.config.get_text_config(decoder=True)
    context = getattr(text, "max_position_embeddings", None)
    if input_ids.shape[0] != 1 or (attention_mask is not None and not bool(attention_mask.all())):
        return "the static step decodes one unpadded row; batches run the eager loop"
    if any(w is not None for w in layer_windows(model.config)):
        return "sliding-window layers (the static step keeps one full-attention mask)"
    if context and generation_config.max_length > context:
        return f"max_length {generation_config.max_length} is past the target's context ({context})"
    if (model.config._attn_implementation or "eager") not in ("sdpa", "eager"):
        return f"attn_implementation={model.config._attn_implementation!r} (the static step builds sdpa / eager masks)"
    if node_budget < 1:
        return "node budget 0 is plain decoding"
    if tensor_parallel:
        return "a tensor-parallel target"
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "a target split over devices (device_map)"
    return None


def static_call(model, head: DartHead, input_ids: torch.Tensor, attention_mask, generation_config: GenerationConfig,
                model_kwargs: dict, policy, node_budget: int, prompt_lookup: bool):
    """(the call's `StaticStep` or None, the cache to decode into or None for the eager loop's own, why the static step
    was refused or None). The budget is fixed for the call: the cost-aware policy's current choice for "auto"."""
    if not static_requested(generation_config, model_kwargs):
        return None, None, None
    given = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    if isinstance(given, StaticCache) and given.get_seq_length() != 0:
        raise ValueError("DART decoding needs an empty StaticCache (a pre-filled cache is not supported)")
    budget = max(1, policy.choice) if policy is not None else node_budget
    reason = static_refusal(model, input_ids, attention_mask, generation_config, budget,
                            tensor_parallel_group(model) is not None)
    if reason is not None:
        return None, decode_cache(model.config), reason
    step = StaticStep(model, head, node_budget=budget, max_length=generation_config.max_length,
                      eos_token_ids=generation_config._eos_token_tensor, prompt_lookup=prompt_lookup)
    # always a cache of its own: its length is rounded (`static_cache_length`) so that calls of nearby lengths share
    # one compiled graph; generate's (max_length slots) would recompile for every prompt length
    step.cache = StaticCache(config=model.config, max_cache_len=static_cache_length(generation_config.max_length,
                                                                                    step.nodes))
    if model._valid_auto_compile_criteria({"cache": step.cache}, generation_config):
        config = generation_config.compile_config or model._default_compile_config()
        step.compile_options = config.to_dict()
    return step, step.cache, None


def static_cache_length(max_length: int, nodes: int) -> int:
    """Slots of the call's caches: every committed token plus one tree past the last of them, rounded up."""
    need = max_length + nodes
    return -(-need // SLOT_ROUNDING) * SLOT_ROUNDING


@dataclass
class StaticHeadState:
    """Everything the step reads and updates between steps, as fixed-shape device tensors (updated in place).

    head_k / head_v [1, kv heads, slots, head dim]: the head's keys/values of real positions (head_len of them);
    pend_aux [1, M, 3H] / pend_tok [1, M]: the positions verified by the last step that the head has not read (their
    target states and the token after each), the first n_pend real; pos: tokens committed in the target's cache;
    text [slots]: the text so far (prompt + new tokens, text_len of them; the n-gram context and prompt lookup
    read it, its last token is the tree's root); last_pos: the largest position a tree node takes (max_length - 1:
    nodes past it are never kept, and a dynamic RoPE must not see a longer text than plain decoding does)."""

    head_k: torch.Tensor
    head_v: torch.Tensor
    head_len: torch.Tensor
    pend_aux: torch.Tensor
    pend_tok: torch.Tensor
    n_pend: torch.Tensor
    pos: torch.Tensor
    text: torch.Tensor
    text_len: torch.Tensor
    last_pos: torch.Tensor


@dataclass(frozen=True)
class StepSpec:
    """The step's Python constants (a change recompiles): tree search settings, draft depth, layers the head reads,
    the attention backend, n-gram context length and the prompt-lookup n-gram range (None: no lookup)."""

    params: TreeSearchParams
    depth: int
    aux_ids: tuple[int, ...]
    attn: str
    context: int
    lookup: tuple[int, int] | None

    @property
    def path_slots(self) -> int:
        """M: the longest accepted path (root + one node per depth)."""
        return self.depth + 1


# ------------------------------------------------------------------------------------------------ the step's parts
def head_draft(head: DartHead, modules: TargetModules, s: StaticHeadState, depth: int) -> torch.Tensor:
    """`DartHead.draft_rows` on the call's fixed buffers: the M pending rows (n_pend real) + depth - 1 MASK rows,
    attending over every head-KV slot. Returns logits [depth, draft vocab]."""
    logits = head.draft_rows(s.pend_aux, s.pend_tok, s.n_pend.view(1), s.head_k, s.head_v, s.head_len.view(1), depth,
                             modules)
    s.head_len.add_(s.n_pend)
    return logits[0]


def draft_tree(head: DartHead, modules: TargetModules, s: StaticHeadState, spec: StepSpec, ngram,
               eos: torch.Tensor | None) -> DraftTrees:
    """Head forward + tree search: the step's one-row tree of exactly node budget + 1 nodes (`build_trees` with
    fixed_size), rooted at the text's last token, with prompt lookup over the fixed-size text buffer."""
    logits = head_draft(head, modules, s, spec.depth)
    context = last_tokens(s.text.unsqueeze(0), s.text_len.view(1), spec.context)
    lookup = None
    if spec.lookup is not None:
        lookup = lookup_continuations(s.text[None], spec.depth, *spec.lookup, used=s.text_len.view(1))
    return build_trees(logits[None], context[:, -1], context, spec.params, ngram=ngram,
                       draft_to_target=head.draft_to_target, eos_token_ids=eos, lookup=lookup, fixed_size=True)


def verify(target, cache: StaticCache, s: StaticHeadState, spec: StepSpec, tree: DraftTrees):
    """The target's forward over the tree written into cache slots pos..pos+N-1: node i sees the committed slots and
    its ancestors' slots. Returns (float logits [N, vocab], the head's layer inputs at every node [N, 3H])."""
    n, slots = tree.width, cache.layers[0].max_cache_len
    slot = torch.arange(slots, device=s.pos.device)
    rel = slot - s.pos
    in_tree = tree.ancestor_mask[0][:, rel.clamp(0, n - 1)] & ((rel >= 0) & (rel < n))
    visible = (slot < s.pos) | in_tree
    out = target(
        input_ids=tree.tokens,
        attention_mask=backend_mask(visible.unsqueeze(0), spec.attn, target.dtype),
        position_ids=torch.minimum(s.pos + tree.depths, s.last_pos),
        cache=cache, use_cache=True, output_hidden_states=list(spec.aux_ids), logits_to_keep=0,
    )
    aux = torch.cat([out.hidden_states[i][0] for i in spec.aux_ids], dim=-1)
    return out.logits[0].float(), aux


def commit(cache: StaticCache, s: StaticHeadState, path: torch.Tensor, length: torch.Tensor, tokens: torch.Tensor,
           aux: torch.Tensor) -> None:
    """Keep the accepted path: its cache entries move to slots pos..pos+M-1 (those past `length` are overwritten
    next step), the cache length becomes pos + length, its states and tokens are the head's next rows."""
    dst = s.pos + torch.arange(path.numel(), device=path.device)
    src = s.pos + path
    for layer in cache.layers:
        layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
        layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        layer.cumulative_length.copy_(s.pos + length)
    s.pend_aux.copy_(aux.index_select(0, path).unsqueeze(0))
    s.pend_tok.copy_(tokens.unsqueeze(0))
    s.n_pend.copy_(length)
    s.text.index_copy_(0, s.text_len + torch.arange(path.numel(), device=path.device), tokens)
    s.text_len.add_(length)
    s.pos.add_(length)


def accept_commit(cache: StaticCache, s: StaticHeadState, spec: StepSpec, tree: DraftTrees, logits: torch.Tensor,
                  aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance (`greedy_paths` with M fixed slots: no host sync) and `commit`. Returns (length 0-d, tokens
    [M]: the accepted draft tokens then the target's own, the first `length` real)."""
    predicted = logits.argmax(dim=-1)
    paths, lengths = greedy_paths(tree, predicted.unsqueeze(0), spec.path_slots)
    tokens = predicted[paths[0]]
    commit(cache, s, paths[0], lengths[0], tokens, aux)
    return lengths[0], tokens


def greedy_step(target, head: DartHead, modules: TargetModules, cache: StaticCache, s: StaticHeadState,
                spec: StepSpec, ngram, eos: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole greedy DART step, captured as one graph: `draft_tree`, `verify`, `accept_commit`."""
    tree = draft_tree(head, modules, s, spec, ngram, eos)
    logits, aux = verify(target, cache, s, spec, tree)
    return accept_commit(cache, s, spec, tree, logits, aux)


_COMPILED: dict = {}
_COMPILE_LOCK = threading.Lock()


def compiled(fn, compile_options: dict | None):
    """`fn` compiled with fullgraph=True and the call's compile options (transformers' `CompileConfig`), made once
    per process and options; None options: `fn` itself (the static step, eager)."""
    if compile_options is None:
        return fn
    options = {**compile_options, "fullgraph": True, "dynamic": False}
    key = (fn, tuple(sorted((k, repr(v)) for k, v in options.items())))
    with _COMPILE_LOCK:
        if key not in _COMPILED:
            _COMPILED[key] = torch.compile(fn, **options)
        return _COMPILED[key]


class StaticStep:
    """The static step of one call: its caches, state and the (compiled) step functions."""

    def __init__(self, target, head: DartHead, *, node_budget: int, max_length: int,
                 eos_token_ids: torch.Tensor | None, prompt_lookup: bool):
        self.target, self.head = target, head
        self.cache: StaticCache | None = None  # set by `static_call`
        self.compile_options: dict | None = None  # torch.compile options (None: the static step runs eagerly)
        self.fallback: str | None = None  # why the step stopped being compiled mid-call (`_run`)
        self.modules = TargetModules.of(target)
        config = head.config
        params = TreeSearchParams.from_config(config, node_budget=node_budget)
        depth = max(1, min(node_budget, config.num_predictions))
        attn = target.config._attn_implementation or "eager"
        self.ngram = head.ngram.to(head.device) if head.ngram is not None else None
        context = max(self.ngram.context_size if self.ngram is not None else 0, 1)
        lookup = (config.lookup_min_ngram, config.lookup_max_ngram) if prompt_lookup else None
        self.spec = StepSpec(params, depth, tuple(config.aux_layer_ids), attn, context, lookup)
        self.eos = eos_token_ids.to(head.device).view(-1) if eos_token_ids is not None else None
        dev, dtype, m = head.device, head.dtype, self.spec.path_slots
        slots = static_cache_length(max_length, m + depth)
        kv = (1, config.num_key_value_heads, slots, config.head_dim)
        long = lambda *shape: torch.zeros(shape, dtype=torch.long, device=dev)
        self.state = StaticHeadState(
            head_k=torch.zeros(kv, device=dev, dtype=dtype), head_v=torch.zeros(kv, device=dev, dtype=dtype),
            head_len=long(), pend_aux=torch.zeros(1, m, 3 * config.target_hidden_size, device=dev, dtype=dtype),
            pend_tok=long(1, m), n_pend=long(), pos=long(), text=long(slots), text_len=long(),
            last_pos=torch.tensor(max_length - 1, device=dev),
        )
        for t in vars(self.state).values():  # updated in place every step: fixed addresses for CUDA graphs
            torch._dynamo.mark_static_address(t)

    @property
    def nodes(self) -> int:
        return self.spec.params.node_budget + 1

    def start(self, input_ids: torch.Tensor, aux: torch.Tensor, first: torch.Tensor) -> None:
        """After the prefill (eager): the head reads the prompt's states (all but the last position written to its
        cache here; the last one is the first step's pending row), the text is the prompt + `first`."""
        s, head, dev = self.state, self.head, self.head.device
        tokens = torch.cat([input_ids[0, 1:], first.view(1)]).to(dev)
        aux = aux[0].to(dev, head.dtype)
        n = tokens.numel()
        if n > 1:  # their keys/values (the one prediction this computes is not needed)
            head.draft_rows(aux[None, : n - 1], tokens[None, : n - 1], torch.tensor([n - 1], device=dev), s.head_k,
                            s.head_v, s.head_len.view(1), 1, self.modules)
        s.head_len.fill_(n - 1)
        s.pend_aux[0, 0], s.pend_tok[0, 0] = aux[-1], tokens[-1]
        s.n_pend.fill_(1)
        s.pos.fill_(input_ids.shape[1])
        s.text[: n + 1] = torch.cat([input_ids[0].to(dev), first.view(1).to(dev)])
        s.text_len.fill_(n + 1)

    def step(self, context: torch.Tensor, logits_processor, do_sample: bool, greedy: bool, timer) -> BatchAccepted:
        """One step; returns its tokens on the host as a one-row `BatchAccepted`. Greedy without processors: the
        captured `greedy_step` and ONE device-to-host copy (length + tokens); with `dart_timing` its three parts are
        captured and timed one by one (phases draft = head + tree search, verify, accept). Sampling or processors:
        the captured draft and verify, the acceptance walk (`accept_walk`, eager: one draw per token as plain
        `generate`), the captured `commit`."""
        run, s, spec = self._run, self.state, self.spec
        if greedy and not timer.requested:
            with timer.phase("step"):
                length, tokens = run(greedy_step, self.target, self.head, self.modules, self.cache, s, spec,
                                     self.ngram, self.eos)
                return _host_result(length, tokens)  # the step's one host sync
        with timer.phase("draft"):
            tree = run(draft_tree, self.head, self.modules, s, spec, self.ngram, self.eos)
        with timer.phase("verify"):
            logits, aux = run(verify, self.target, self.cache, s, spec, tree)
        with timer.phase("accept"):
            if greedy:
                return _host_result(*run(accept_commit, self.cache, s, spec, tree, logits, aux))
            walk = accept_walk(tree.row(0, self.nodes), logits, context.unsqueeze(0), logits_processor, do_sample)
            m, n = spec.path_slots, walk.path.numel()
            pad = lambda t: torch.cat([t, t[-1:].expand(m - n, *t.shape[1:])])
            run(commit, self.cache, s, pad(walk.path), torch.tensor(n, device=walk.path.device), pad(walk.tokens),
                aux)
        return BatchAccepted(paths=walk.path.unsqueeze(0), lengths=torch.tensor([n]), tokens=walk.tokens.unsqueeze(0),
                             scores=walk.scores.unsqueeze(0), logits=walk.logits.unsqueeze(0))


    def _run(self, fn, *args):
        """`fn` compiled (the call's options), or uncompiled once torch.compile refused to capture it again: dynamo
        keeps at most `recompile_limit` graphs per function (8), and every (target, budget, cache size) is one; the
        refusal comes before the graph runs, so the state is untouched and the step runs uncompiled for the rest of the
        call (`fallback` says so in the stats)."""
        if self.compile_options is not None:
            try:
                return compiled(fn, self.compile_options)(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                self.compile_options = None
                self.fallback = (f"torch.compile refused another graph of {fn.__name__} in this process ({err}); "
                                 "the static step ran uncompiled from there")
        return fn(*args)


def _host_result(length: torch.Tensor, tokens: torch.Tensor) -> BatchAccepted:
    """The greedy step's result on the host, read back in one copy: length then tokens."""
    host = torch.cat([length.view(1), tokens]).tolist()
    return BatchAccepted(paths=torch.zeros(1, 1, dtype=torch.long), lengths=torch.tensor(host[:1]),
                         tokens=torch.tensor(host[1:], dtype=torch.long).unsqueeze(0))
