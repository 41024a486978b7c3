"""The GPU-shaped step backend: a static KV cache, fixed shapes, and one function per step that `torch.compile`
captures whole (`generate(..., assistant_model=head, cache_implementation="static")`).

Why: on a GPU an eager decode loop is bound by kernel launches and host syncs, not by the model, and plain `generate`
with a static cache is compiled (transformers' auto-compile). The eager step has a shape per step (tree size, path
length) and host reads, so it cannot be captured. Here every shape is fixed for the call:

- the target decodes into transformers' own `StaticCache`; a step's N tree nodes (a fixed node budget: N = budget + 1)
  are written into the N slots after the committed text (the layer's `cumulative_length`), and the accepted path is
  moved into place with one `index_copy_` per layer, its length set back on the device;
- the drafter (`DartDrafter`, the eager step's own) is made with every buffer at its final size and one path of
  pending slots (M = depth + 1, the first `n_pend` real), so its head forward and tree search have one shape;
- the masks are tensors built from the device-side lengths (no Python int of a length anywhere in the step);
- head forward + tree search + verify (`target.target_forward`) + greedy acceptance + commit is `greedy_step`, captured
  with `fullgraph=True`; the accepted length and tokens come back to the host in ONE copy per step.

Sampling and logits processors keep the call's acceptance walk (one draw per emitted token, as plain `generate`, so
the same seed gives the same text) between the captured `draft_tree` + `verify` and `commit`.
What the static step cannot run (a batch, sliding windows, ...) runs on the eager step, and `DartStats.static_reason`
says why (`static_refusal`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StaticCache

from .acceptance import BatchAccepted, StepAcceptance, greedy_paths
from .distributed import tensor_parallel_group
from .drafter import DartDrafter, bucket, draft_depth
from .modeling import DartHead
from .ragged import backend_mask, layer_windows
from .target import target_forward
from .tree import DraftTrees


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


def static_step(model, head: DartHead, input_ids: torch.Tensor, attention_mask, generation_config: GenerationConfig,
                node_budget: int, prompt_lookup: bool, aux_layer_ids: list[int]) -> tuple["StaticStep | None", str | None]:
    """(the call's `StaticStep`, None), or (None, why the static step was refused: the call runs the eager step). The
    budget is fixed for the call; the step is compiled under transformers' own decision
    (`_valid_auto_compile_criteria`) with the call's `compile_config`."""
    reason = static_refusal(model, input_ids, attention_mask, generation_config, node_budget,
                            tensor_parallel_group(model) is not None)
    if reason is not None:
        return None, reason
    max_length = generation_config.max_length
    depth = draft_depth(node_budget, max_length, head.config.num_predictions)
    drafter = DartDrafter(head, model, max_length=max_length, node_budget=node_budget, prompt_lookup=prompt_lookup,
                          eos_token_ids=generation_config._eos_token_tensor, pending=depth + 1, full=True)
    step = StaticStep(model, drafter, depth=depth, max_length=max_length, aux_layer_ids=aux_layer_ids)
    if model._valid_auto_compile_criteria({"cache": step.cache}, generation_config):
        config = generation_config.compile_config or model._default_compile_config()
        step.compile_options = config.to_dict()
    return step, None


@dataclass(frozen=True)
class StepSpec:
    """The step's Python constants besides the drafter's search settings (a change recompiles): draft depth, the
    layers the head reads and the attention backend."""

    depth: int
    aux_ids: tuple[int, ...]
    attn: str

    @property
    def path_slots(self) -> int:
        """M: the longest accepted path (root + one node per depth)."""
        return self.depth + 1


# ------------------------------------------------------------------------------------------------ the step's parts
def draft_tree(drafter: DartDrafter, depth: int) -> DraftTrees:
    """Head forward + tree search on the drafter's fixed buffers: the step's one-row tree of exactly node budget + 1
    nodes (`build_trees` with fixed_size)."""
    return drafter.search(drafter.forward(depth), fixed_size=True)


def verify(target, cache: StaticCache, drafter: DartDrafter, spec: StepSpec, tree: DraftTrees,
           last_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward (`target_forward`) over the tree written into cache slots pos..pos+N-1, pos the tokens
    committed (the text but its last token, the root): node i sees the committed slots and its ancestors' slots, at
    positions no later than `last_pos` (max_length - 1: nodes past it are never kept, and a dynamic RoPE must not
    see a longer text than plain decoding does). Returns (float logits [N, vocab], the layer states [N, 3H])."""
    n, slots = tree.width, cache.layers[0].max_cache_len
    pos = drafter.text_len[0] - 1
    slot = torch.arange(slots, device=pos.device)
    rel = slot - pos
    in_tree = tree.ancestor_mask[0][:, rel.clamp(0, n - 1)] & ((rel >= 0) & (rel < n))
    visible = (slot < pos) | in_tree
    logits, aux = target_forward(target, tree.tokens, backend_mask(visible.unsqueeze(0), spec.attn, target.dtype),
                                 torch.minimum(pos + tree.depths, last_pos), cache, list(spec.aux_ids))
    return logits[0], aux[0]


def commit(cache: StaticCache, drafter: DartDrafter, path: torch.Tensor, length: torch.Tensor, tokens: torch.Tensor,
           aux: torch.Tensor) -> None:
    """Keep the accepted path: its cache entries move to slots pos..pos+M-1 (those past `length` are overwritten
    next step), the cache length becomes pos + length, its states and tokens go to the drafter (`append`)."""
    pos = drafter.text_len[0] - 1
    dst = pos + torch.arange(path.numel(), device=path.device)
    src = pos + path
    for layer in cache.layers:
        layer.keys.index_copy_(2, dst, layer.keys.index_select(2, src))
        layer.values.index_copy_(2, dst, layer.values.index_select(2, src))
        layer.cumulative_length.copy_(pos + length)
    drafter.append(aux.index_select(0, path).unsqueeze(0), tokens.unsqueeze(0), length.view(1))


def accept_commit(cache: StaticCache, drafter: DartDrafter, spec: StepSpec, tree: DraftTrees, logits: torch.Tensor,
                  aux: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance (`greedy_paths` with M fixed slots: no host sync) and `commit`. Returns (length 0-d, tokens
    [M]: the accepted draft tokens then the target's own, the first `length` real)."""
    predicted = logits.argmax(dim=-1)
    paths, lengths = greedy_paths(tree, predicted.unsqueeze(0), spec.path_slots)
    tokens = predicted[paths[0]]
    commit(cache, drafter, paths[0], lengths[0], tokens, aux)
    return lengths[0], tokens


def greedy_step(target, cache: StaticCache, drafter: DartDrafter, spec: StepSpec,
                last_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole greedy DART step, captured as one graph: `draft_tree`, `verify`, `accept_commit`."""
    tree = draft_tree(drafter, spec.depth)
    logits, aux = verify(target, cache, drafter, spec, tree, last_pos)
    return accept_commit(cache, drafter, spec, tree, logits, aux)


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
    """The static step backend of one call: its `StaticCache`, its drafter on fixed buffers and the (compiled) step
    functions. Same methods as `eager_step.EagerStep`."""

    static = True

    def __init__(self, target, drafter: DartDrafter, *, depth: int, max_length: int, aux_layer_ids: list[int]):
        self.target, self.drafter = target, drafter
        self.spec = StepSpec(depth, tuple(aux_layer_ids), target.config._attn_implementation or "eager")
        # the target's cache: every committed token plus one tree past them, sized by the one rounding rule
        # (`drafter.bucket`), so that calls of nearby lengths share one compiled graph (generate's own cache of
        # max_length slots would recompile for every prompt length)
        self.cache = StaticCache(config=target.config, max_cache_len=bucket(max_length) + self.nodes)
        self.last_pos = torch.tensor(max_length - 1, device=drafter.device)
        self.compile_options: dict | None = None  # torch.compile options (None: the static step runs eagerly)
        self.reason: str | None = None  # what of the step runs outside the captured graph, or why it stopped being
        for t in [*drafter.tensors(), self.last_pos]:  # updated in place every step: fixed addresses (CUDA graphs)
            torch._dynamo.mark_static_address(t)

    @property
    def nodes(self) -> int:
        return self.drafter.params.node_budget + 1

    @property
    def compiled(self) -> bool:
        return self.compile_options is not None

    @property
    def returned_cache(self) -> StaticCache:
        return self.cache

    def start(self, input_ids: torch.Tensor, lefts: list[int], aux: torch.Tensor, first: torch.Tensor) -> None:
        """After the prefill (eager): the prompt's states and first token to the drafter."""
        self.drafter.start(input_ids, lefts, aux, first)

    def step(self, budget: int, max_new: list[int], accept: StepAcceptance, active: list[int],
             timer) -> tuple[DraftTrees | None, BatchAccepted]:
        """One step (the call's one budget; `max_new` is the positions' bound `last_pos`), its tokens on the host.
        Greedy without processors: the captured `greedy_step` and ONE device-to-host copy (length + tokens); with
        `dart_timing` its three parts are captured and timed one by one (phases draft = head + tree search, verify,
        accept). Sampling or processors: the captured draft and verify, the call's acceptance walk (eager), the
        captured `commit`."""
        run, drafter, spec = self._run, self.drafter, self.spec
        if accept.greedy and not timer.requested:
            with timer.phase("step"):
                return None, _host_result(*run(greedy_step, self.target, self.cache, drafter, spec, self.last_pos))
        with timer.phase("draft"):
            tree = run(draft_tree, drafter, spec.depth)
        with timer.phase("verify"):
            logits, aux = run(verify, self.target, self.cache, drafter, spec, tree, self.last_pos)
        with timer.phase("accept"):
            if accept.greedy:
                return tree, _host_result(*run(accept_commit, self.cache, drafter, spec, tree, logits, aux))
            step = accept(tree, logits.unsqueeze(0), active)
            m, n = spec.path_slots, int(step.lengths[0])
            pad = lambda t: torch.cat([t, t[-1:].expand(m - n, *t.shape[1:])])
            run(commit, self.cache, drafter, pad(step.paths[0]), torch.tensor(n, device=step.paths.device),
                pad(step.tokens[0]), aux)
        step.lengths = step.lengths.cpu()
        return tree, step

    def retire(self, keep: list[int]) -> None:
        """One row: when it is done, the call is."""

    def _run(self, fn, *args):
        """`fn` compiled (the call's options), or uncompiled once torch.compile refused to capture it again: dynamo
        keeps at most `recompile_limit` graphs per function (8), and every (target, budget, cache size) is one; the
        refusal comes before the graph runs, so the state is untouched and the step runs uncompiled for the rest of the
        call (`reason` says so in the stats)."""
        if self.compile_options is not None:
            try:
                return compiled(fn, self.compile_options)(*args)
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                self.compile_options = None
                self.reason = (f"torch.compile refused another graph of {fn.__name__} in this process ({err}); "
                               "the static step ran uncompiled from there")
        return fn(*args)


def _host_result(length: torch.Tensor, tokens: torch.Tensor) -> BatchAccepted:
    """The greedy step's result on the host, read back in one copy: length then tokens."""
    host = torch.cat([length.view(1), tokens]).tolist()
    return BatchAccepted(paths=torch.zeros(1, 1, dtype=torch.long), lengths=torch.tensor(host[:1]),
                         tokens=torch.tensor(host[1:], dtype=torch.long).unsqueeze(0))
