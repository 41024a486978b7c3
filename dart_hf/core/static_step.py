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
- head forward + tree search + verify (`target.target_forward`) + acceptance (greedy, or the call's sampling and
  processors on the device: `StepAcceptance.on_device`) + commit is `decode_step`, captured with `fullgraph=True`;
  the accepted length, tokens and paths' score ranks (what the cost-aware budget learns from) come back to the host
  in ONE copy per step.

Processors the device walk cannot run, and returned scores, keep the call's eager acceptance walk between the
captured `draft_tree` + `verify` and `commit` (one row). What the static step cannot run (such a walk on a batch,
sliding windows, ...) runs on the eager step, and `DartStats.static_reason` says why (`static_refusal`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, StaticCache

from .acceptance import BatchAccepted, StepAcceptance
from .distributed import tensor_parallel_group
from .drafter import DartDrafter, batch_bucket, bucket, draft_depth
from .modeling import DartHead
from .target import backend_mask, layer_windows, target_forward
from .tree import DraftTrees

CUDA_GRAPHS = os.environ.get("DART_HF_CUDA_GRAPHS") == "1"  # opt in to CUDA graphs for the DART step (untested)


def static_requested(generation_config: GenerationConfig, model_kwargs: dict) -> bool:
    """Whether the call asks for a static cache (`cache_implementation="static"`, or a `StaticCache` passed in)."""
    cache = model_kwargs.get("cache") or model_kwargs.get("past_key_values")
    return generation_config.cache_implementation == "static" or isinstance(cache, StaticCache)


def static_refusal(model, input_ids: torch.Tensor, attention_mask, generation_config: GenerationConfig,
                   tensor_parallel: bool, vectorised: bool) -> str | None:
    """Why this call cannot take the static step (it then runs the eager loop, exactly), or None."""
    text = model.config.get_text_config(decoder=True)
    context = getattr(text, "max_position_embeddings", None)
    batch = input_ids.shape[0] != 1 or (attention_mask is not None and not bool(attention_mask.all()))
    if batch and not vectorised:
        return ("the static step decodes a batch or padded rows with the acceptance on the device (greedy, or "
                "sampling with the generation config's processors) and no returned scores")
    if any(w is not None for w in layer_windows(model.config)):
        return "sliding-window layers (the static step keeps one full-attention mask)"
    if context and generation_config.max_length > context:
        return f"max_length {generation_config.max_length} is past the target's context ({context})"
    if (model.config._attn_implementation or "eager") not in ("sdpa", "eager"):
        return f"attn_implementation={model.config._attn_implementation!r} (the static step builds sdpa / eager masks)"
    if tensor_parallel:
        return "a tensor-parallel target"
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "a target split over devices (device_map)"
    return None


def static_step(model, head: DartHead, input_ids: torch.Tensor, attention_mask, generation_config: GenerationConfig,
                node_budget: int, prompt_lookup: bool, aux_layer_ids: list[int],
                vectorised: bool) -> tuple["StaticStep | None", str | None]:
    """(the call's `StaticStep`, None), or (None, why the static step was refused: the call runs the eager step). The
    budget is fixed for the call; the step is compiled under transformers' own decision
    (`_valid_auto_compile_criteria`) with the call's `compile_config`."""
    tensor_parallel = tensor_parallel_group(model) is not None
    reason = static_refusal(model, input_ids, attention_mask, generation_config, tensor_parallel, vectorised)
    if reason is not None:
        return None, reason
    max_length = generation_config.max_length
    depth = draft_depth(node_budget, max_length, head.config.num_predictions)
    drafter = DartDrafter(head, model, max_length=max_length, node_budget=node_budget, prompt_lookup=prompt_lookup,
                          eos_token_ids=generation_config._eos_token_tensor, rows=batch_bucket(input_ids.shape[0]),
                          pending=depth + 1, full=True)
    step = StaticStep(model, drafter, depth=depth, max_length=max_length, aux_layer_ids=aux_layer_ids,
                      call_rows=input_ids.shape[0])
    if model._valid_auto_compile_criteria({"cache": step.cache}, generation_config):
        config = generation_config.compile_config or model._default_compile_config()
        step.compile_options, step.reason = compile_options(config.to_dict())
    return step, None


def compile_options(options: dict) -> tuple[dict, str | None]:
    """The call's torch.compile options for the DART step, and what was changed in them. CUDA graphs (mode
    "reduce-overhead", transformers' default on CUDA) have not yet run the DART step on a GPU, whose in-place state
    updates they would replay: until a GPU run validates them (`examples/gpu_check.sh` part 5) the step compiles
    without them unless `DART_HF_CUDA_GRAPHS=1` is set; plain `generate` keeps its own."""
    if options.get("mode") != "reduce-overhead" or CUDA_GRAPHS:
        return options, None
    return {**options, "mode": None}, ("CUDA graphs (compile mode 'reduce-overhead') are off for the DART step until a "
                                       "GPU run validates them (DART_HF_CUDA_GRAPHS=1 turns them on)")


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


@dataclass
class Rows:
    """The rows' fixed-shape bookkeeping on the device: left padding, the last position a node may take
    (max_length - 1 - left: nodes past it are never kept, and a dynamic RoPE must not see a longer text than plain
    decoding does), and which rows still decode (a finished row is masked: it accepts nothing more)."""

    left: torch.Tensor
    last_pos: torch.Tensor
    alive: torch.Tensor

    def committed(self, drafter: DartDrafter) -> torch.Tensor:
        """[rows]: each row's committed cache slots end here (its text but the last token, the root, after its
        padding)."""
        return self.left + drafter.text_len - 1


def verify(target, cache: StaticCache, drafter: DartDrafter, spec: StepSpec, tree: DraftTrees,
           rows: Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward (`target_forward`) over every row's tree, written into the cache slots P..P+N-1 after the
    furthest row's text (P: the cache's length): node i of row r sees the row's committed slots (after its padding,
    before its own end) and its ancestors' slots, at its row's position + depth (at most the row's `last_pos`).
    Returns (float logits [rows, N, vocab], the layer states [rows, N, 3H])."""
    n, slots = tree.width, cache.layers[0].max_cache_len
    end = rows.committed(drafter)
    slot = torch.arange(slots, device=end.device)
    rel = slot - cache.layers[0].cumulative_length
    in_tree = tree.ancestor_mask[:, :, rel.clamp(0, n - 1)] & ((rel >= 0) & (rel < n))
    committed = (slot >= rows.left.unsqueeze(1)) & (slot < end.unsqueeze(1))
    positions = torch.minimum((end - rows.left).unsqueeze(1) + tree.depths, rows.last_pos.unsqueeze(1))
    return target_forward(target, tree.tokens, backend_mask(committed.unsqueeze(1) | in_tree, spec.attn, target.dtype),
                          positions, cache, list(spec.aux_ids))


def commit(cache: StaticCache, drafter: DartDrafter, rows: Rows, paths: torch.Tensor, lengths: torch.Tensor,
           tokens: torch.Tensor, aux: torch.Tensor) -> None:
    """Keep each live row's accepted path: its cache entries move from the tree's slots to the row's own end (those
    past its length are overwritten next step), the cache's length becomes the furthest live row's end, the paths'
    states and tokens go to the drafter (`append`). paths / tokens [rows, M], lengths [rows]."""
    lengths = lengths * rows.alive
    end = rows.committed(drafter)
    tree_start = cache.layers[0].cumulative_length - aux.shape[1]  # the verify appended the N tree nodes there
    src = (tree_start + paths)[:, None, :, None]
    dst = (end.unsqueeze(1) + torch.arange(paths.shape[1], device=paths.device))[:, None, :, None]
    furthest = torch.where(rows.alive > 0, end + lengths, 0).max()
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            t.scatter_(2, dst.expand(-1, t.shape[1], -1, t.shape[3]),
                       t.gather(2, src.expand(-1, t.shape[1], -1, t.shape[3])))
        layer.cumulative_length.copy_(furthest)
    drafter.append(aux.gather(1, paths.unsqueeze(2).expand(-1, -1, aux.shape[2])), tokens, lengths)


def accept_commit(cache: StaticCache, drafter: DartDrafter, rows: Rows, spec: StepSpec, tree: DraftTrees,
                  logits: torch.Tensor, aux: torch.Tensor, accept: StepAcceptance,
                  seeds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The call's acceptance on the device in M fixed path slots (`StepAcceptance.on_device` with the step's rows'
    `seeds`: no host sync) and `commit`. Returns (lengths [rows], tokens [rows, M]: the accepted draft tokens then the
    target's own, the first lengths[r] real; the paths' score ranks [rows, M - 1], for the cost-aware budget)."""
    step = accept.on_device(tree, logits, drafter.text, drafter.text_len, spec.path_slots, seeds)
    commit(cache, drafter, rows, step.paths, step.lengths, step.tokens, aux)
    return step.lengths, step.tokens, tree.ranks(step.paths)


def decode_step(target, cache: StaticCache, drafter: DartDrafter, rows: Rows, spec: StepSpec,
                accept: StepAcceptance, seeds: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """One whole DART step of every row, captured as one graph: `draft_tree`, `verify`, `accept_commit`."""
    tree = draft_tree(drafter, spec.depth)
    logits, aux = verify(target, cache, drafter, spec, tree, rows)
    return accept_commit(cache, drafter, rows, spec, tree, logits, aux, accept, seeds)


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

    def __init__(self, target, drafter: DartDrafter, *, depth: int, max_length: int, aux_layer_ids: list[int],
                 call_rows: int):
        self.target, self.drafter = target, drafter
        self.spec = StepSpec(depth, tuple(aux_layer_ids), target.config._attn_implementation or "eager")
        # the target's cache: every committed token plus one tree past the furthest row and a path of slack for a
        # row that finishes past max_length, sized by the one rounding rule (`drafter.bucket`), so that calls of
        # nearby lengths share one compiled graph (generate's own cache of max_length slots would recompile for
        # every prompt length)
        self.cache = StaticCache(config=target.config, max_cache_len=bucket(max_length) + self.nodes
                                 + 2 * self.spec.path_slots)
        left = torch.zeros_like(drafter.text_len)  # each row's left padding: set by `start`
        self.rows = Rows(left, max_length - 1 - left, torch.ones_like(left))
        self.rows.alive[call_rows:] = 0  # the batch bucket's extra rows (`batch_bucket`) never decode
        self.active = list(range(call_rows))  # the caller's active rows, as indices into this step's rows
        self.seeds: torch.Tensor | None = None  # the rows' sampling seeds, the extra rows' copied from the first
        self.compile_options: dict | None = None  # torch.compile options (None: the static step runs eagerly)
        self.reason: str | None = None  # what of the step runs outside the captured graph, or why it stopped being
        for t in [*drafter.tensors(), *vars(self.rows).values()]:  # updated in place: fixed addresses (CUDA graphs)
            torch._dynamo.mark_static_address(t)

    @property
    def cache_rows(self) -> int:
        """Rows the cache and the drafter hold: the call's, then copies of its first up to the batch bucket."""
        return self.drafter.kv.lengths.shape[0]

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
        """After the prefill (eager): the prompt's states and first token to the drafter, each row's left padding to
        the step's rows."""
        self.drafter.start(input_ids, lefts, aux, first)
        left = torch.tensor(lefts, device=self.rows.left.device)
        self.rows.last_pos.sub_(left)
        self.rows.left.copy_(left)

    def step(self, budget: int, max_new: list[int], accept: StepAcceptance, active: list[int],
             timer) -> tuple[DraftTrees | None, BatchAccepted]:
        """One step (the call's one budget; `max_new` is the positions' bound `last_pos`), its tokens on the host.
        The acceptance on the device: the captured `decode_step` and ONE device-to-host copy (length + tokens); with
        `dart_timing` its three parts are captured and timed one by one (phases draft = head + tree search, verify,
        accept). Processors off the device, or returned scores: the captured draft and verify, the call's acceptance
        walk (eager), the captured `commit`."""
        run, drafter, spec, rows = self._run, self.drafter, self.spec, self.rows
        if accept.vectorised and not timer.requested:
            with timer.phase("step"):
                return None, self._host_result(*run(decode_step, self.target, self.cache, drafter, rows, spec,
                                                    accept, self._seeds(accept)))
        with timer.phase("draft"):
            tree = run(draft_tree, drafter, spec.depth)
        with timer.phase("verify"):
            logits, aux = run(verify, self.target, self.cache, drafter, spec, tree, rows)
        with timer.phase("accept"):
            if accept.vectorised:
                return tree, self._host_result(*run(accept_commit, self.cache, drafter, rows, spec, tree, logits,
                                                    aux, accept, self._seeds(accept)))
            step = accept(tree, logits, active, drafter.text, drafter.text_len, spec.path_slots)  # one row
            m = spec.path_slots  # the walk's paths are as long as the row's: pad them to M
            pad = lambda t: torch.cat([t, t[:, -1:].expand(-1, m - t.shape[1], *t.shape[2:])], dim=1)
            run(commit, self.cache, drafter, rows, pad(step.paths), step.lengths.to(aux.device), pad(step.tokens),
                aux)
        step.lengths = step.lengths.cpu()
        return tree, step

    def retire(self, keep: list[int]) -> None:
        """Rows that finished stay in the step's fixed shapes, masked: they accept nothing more."""
        if len(keep) == len(self.active):
            return
        self.active = [self.active[i] for i in keep]
        alive = torch.zeros_like(self.rows.alive, device="cpu")
        alive[self.active] = 1
        self.rows.alive.copy_(alive)

    def _seeds(self, accept: StepAcceptance) -> torch.Tensor | None:
        """The sampling seeds of the step's rows (the call's, then the first row's for the bucket's extra rows)."""
        if self.seeds is None and accept.seeds is not None:
            extra = self.cache_rows - accept.seeds.shape[0]
            self.seeds = torch.cat([accept.seeds, accept.seeds[:1].expand(extra)])
        return self.seeds

    def _host_result(self, lengths: torch.Tensor, tokens: torch.Tensor, ranks: torch.Tensor) -> BatchAccepted:
        """The step's result for the active rows, on the host, read back in ONE copy: lengths, tokens, ranks."""
        host = torch.tensor(torch.cat([lengths.unsqueeze(1), tokens, ranks], dim=1).tolist())[self.active]
        m = tokens.shape[1]
        return BatchAccepted(paths=torch.zeros(len(self.active), 1, dtype=torch.long), lengths=host[:, 0],
                             tokens=host[:, 1 : m + 1], ranks=host[:, m + 1 :])

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
