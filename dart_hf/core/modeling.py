"""`DartHead`: one decoder layer that drafts `draft_length + 1` tokens in ONE forward.

Data flow of a decoding step (docs/DART_SPEC.md §1):

    aux = cat(target layer inputs at aux_layer_ids)          [r, 3 * target_hidden]   (new real positions)
    fc_out = fc(aux)                                          residual stream of real rows
    real_in = cat(input_layernorm(embed(next_token)), hidden_norm(fc_out))
    mask_in = mask_rep  (K copies)                            residual of MASK rows is mask_rep[:hidden]
    attention over [cached real | new real | K MASK] with RoPE at past_len + arange(r + K), causal
    keep rows [last real, MASK_1..MASK_K] -> MLP -> norm -> lm_head      = K + 1 draft distributions

Only the real rows' keys/values enter the head's KV cache, so MASK slots never leak into later steps.
The target's input embedding (and, for a tied head, its lm_head) are passed to each call (`TargetModules`), never
stored by generation and never saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, rotate_half

from .configuration import DartConfig, check_config_matches_target, dart_config_for_target
from .ngram import FILE_NAME as NGRAM_FILE
from .ngram import NGramModel


class DartRotaryEmbedding(LlamaRotaryEmbedding):
    """transformers' rotary embedding (default, linear, llama3, yarn, ... from `config.rope_parameters`), except
    `"dynamic"`, which follows the reference head (`LlamaDynamicNTKScalingRotaryEmbedding` of the DART release).

    The reference builds its cos/sin cache at init for max_position_embeddings + 20 positions and rebuilds it for
    a longer sequence, with the dynamic-NTK base of that cache length L: base * (factor * L / max_pos -
    (factor - 1)) ** (dim / (dim - 2)). So its frequencies are scaled from the first token on, whereas
    transformers scales only past max_position_embeddings. Here L = max(max_pos + 20, largest position + 1),
    computed on the device (no host sync); the reference also keeps a longer L across later, shorter calls.
    The other types agree with the reference (tests/test_reference_fidelity.py compares them).
    """

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        if self.rope_type != "dynamic":
            return super().forward(x, position_ids)
        params, max_pos = self.config.rope_parameters, self.config.max_position_embeddings
        factor, dim = float(params["factor"]), 2 * self.inv_freq.numel()
        length = (position_ids.max() + 1).clamp(min=max_pos + 20).double()
        base = params["rope_theta"] * ((factor * length / max_pos) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim
        inv_freq = 1.0 / base.float() ** exponents
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class DartAttention(nn.Module):
    """GQA attention whose q/k/v read the 2*hidden concatenation of token embedding and fused target state."""

    def __init__(self, config: DartConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        in_dim = 2 * config.hidden_size
        self.q_proj = nn.Linear(in_dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(in_dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE'd queries [B, heads, S, head_dim]: computed only for rows that predict something."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        return q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """RoPE'd keys and values [B, kv_heads, S, head_dim]: every row is attended to."""
        b, s, _ = x.shape
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k * cos.unsqueeze(1) + rotate_half(k) * sin.unsqueeze(1), v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
        """SDPA with a dense boolean mask, or FlexAttention when `mask` is a BlockMask (training on GPU)."""
        if mask is not None and not isinstance(mask, torch.Tensor):
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(q, k, v, block_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=self.num_kv_heads != self.num_heads
            )
        b, _, s, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class DartMLP(nn.Module):
    def __init__(self, config: DartConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DartMidLayer(nn.Module):
    """The single decoder layer, with the learned MASK vector (`mask_rep`) as in the reference layout."""

    def __init__(self, config: DartConfig):
        super().__init__()
        h = config.hidden_size
        self.mask_rep = nn.Parameter(torch.zeros(2 * h))
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.self_attn = DartAttention(config)
        self.mlp = DartMLP(config)


@dataclass
class HeadKVCache:
    """Keys/values of the head's REAL positions for one or more rows, preallocated (gpt-fast style) and grown by
    doubling: k / v [rows, kv heads, capacity, head dim]; row r holds `lengths[r]` positions. Zero-filled: a row
    shorter than the batch's longest attends over slots it never wrote, masked, and 0 x NaN garbage would be NaN.
    `head.draft` steps one; a call's drafter (`dart_hf.core.drafter.DartDrafter`) holds one for all its rows."""

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, config: DartConfig, device, dtype, capacity: int = 256, rows: int = 1) -> "HeadKVCache":
        shape = (rows, config.num_key_value_heads, capacity, config.head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(rows, dtype=torch.long, device=device))

    @property
    def length(self) -> int:
        """Positions of a one-row cache (a host read)."""
        return int(self.lengths[0])

    def reserve(self, slots: int, limit: int | None = None) -> None:
        """Make room for `slots` slots per row (doubling, at most `limit`), keeping what is cached."""
        have = self.k.shape[2]
        if slots > have:
            cap = max(2 * have, slots) if limit is None else min(max(2 * have, slots), limit)
            grow = lambda t: torch.cat([t, t.new_zeros(*t.shape[:2], cap - have, t.shape[3])], dim=2)
            self.k, self.v = grow(self.k), grow(self.v)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (finished rows leave a batch)."""
        self.k, self.v, self.lengths = self.k[rows], self.v[rows], self.lengths[rows]


class TargetModules(NamedTuple):
    """The target modules a head computes with: its input embedding and, for a tied head, its lm_head.

    Passed to every draft call rather than stored on the head, so one head can serve several targets (or several
    calls) without carrying any of them."""

    embed: nn.Module
    lm_head: nn.Module | None = None

    @classmethod
    def of(cls, target: PreTrainedModel) -> "TargetModules":
        return cls(target.get_input_embeddings(), target.get_output_embeddings())


class DartPreTrainedModel(PreTrainedModel):
    config_class = DartConfig
    base_model_prefix = "dart"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DartMidLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear, RMSNorm and the rotary buffers
        if isinstance(module, DartMidLayer):
            nn.init.normal_(module.mask_rep, mean=0.0, std=self.config.initializer_range)


def _refuse_missing_local_folder(path) -> None:
    """FileNotFoundError for a head path that can only mean a local folder and is not one. transformers would
    treat it as a Hub repo id: an unrelated repo-id error, or (for `a/b`) half a minute of retried downloads."""
    text = os.fspath(path)
    if os.path.isdir(text):
        return
    first = text.replace(os.sep, "/").split("/", 1)[0]
    looks_local = os.path.isabs(text) or text.startswith(("./", "../", ".\\", "..\\")) or text.count("/") > 1
    if looks_local or (first not in ("", ".", "..") and os.path.exists(first)):
        raise FileNotFoundError(f"no such folder: {text} (looked in {os.path.abspath(text)})")


class DartHead(DartPreTrainedModel):
    """DART draft head. Build one with `DartHead.from_target(target)`, load one with `from_pretrained`.

    Use it as `target.generate(..., assistant_model=head)`; `import dart_hf` routes that call to the
    tree decoding loop (see `dart_hf.integrations.transformers`). After a call, `head.stats` holds what happened.
    """

    def __init__(self, config: DartConfig):
        super().__init__(config)
        h = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, h, bias=False)
        self.midlayer = DartMidLayer(config)
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = DartRotaryEmbedding(config)
        if config.uses_target_lm_head:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.ngram = None  # an NGramModel, loaded from ngram.safetensors beside the weights when present
        # what generate calls leave on the head, besides placing it (`target.prepare_head` moves and casts it in
        # place); the per-call drafting state is the drafter's (`drafter.DartDrafter`), never the head's:
        self.stats = None  # the latest call's DartStats (`dart_hf.core.stats`), set by `loop.prepare_call`
        # the cost-aware budget's statistics across calls (`dart_hf.core.budget.BudgetState`), created on first use
        # by `budget.budget_policy(head, target)`; `generate(..., dart_budget_state=...)` passes another instead
        self.budget_state = None
        # placement (`dart_hf.core.target.prepare_head`): whether a call has placed the head (it is moved in place only
        # before its first call), and the copies placed for targets on other devices / dtypes
        self._dart_placed = False
        self._placed_copies: dict = {}
        self._bound: TargetModules | None = None  # bind_target's modules, for training and offline use only
        self.post_init()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_target(cls, target: PreTrainedModel, draft_length: int = 7, **overrides) -> "DartHead":
        """A fresh (untrained) head sized for `target`: hidden size, heads, RoPE and vocab are copied from it."""
        head = cls(dart_config_for_target(target, draft_length=draft_length, **overrides))
        return head.to(device=target.device, dtype=target.dtype)

    def set_draft_vocab(self, draft_to_target: torch.Tensor) -> None:
        """Install a reduced draft vocabulary: `draft_to_target[i]` is the target id of draft id `i`."""
        if self.lm_head is None:
            raise ValueError("this head is tied to the target lm_head; build it with draft_vocab_size set")
        ids = draft_to_target.to(self.d2t.device, torch.long)
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"need {self.config.draft_vocab_size} distinct target ids, got {ids.numel()}")
        ids = ids.sort().values
        self.d2t.copy_(ids - torch.arange(ids.numel(), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    @property
    def draft_to_target(self) -> torch.Tensor | None:
        """Target id of each draft-vocab row (None when the head projects to the full target vocab)."""
        if self.lm_head is None:
            return None
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    # ------------------------------------------------------------------ persistence
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs) -> "DartHead":
        """`PreTrainedModel.from_pretrained`, made strict: safetensors only, a config of model_type "dart",
        and every checkpoint key present with the right shape (a missing key is an error, not a random init).
        Loads `ngram.safetensors` from the same folder / repo, and refuses a head whose config says it has one
        (`has_ngram`) when the file is missing. A path that can only be a folder (absolute, `./`, `../`, `~`, or a
        relative path whose first part exists here) and does not exist is a FileNotFoundError, never a Hub lookup."""
        from transformers.utils import cached_file

        path = pretrained_model_name_or_path
        if os.fspath(path).startswith("~"):
            path = os.path.expanduser(path)
        _refuse_missing_local_folder(path)
        hub_kwargs = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in kwargs}
        if "config" not in kwargs:
            try:
                config_dict, _ = DartConfig.get_config_dict(path, **hub_kwargs)
            except OSError as err:
                where = "" if os.path.isdir(path) else f"neither a folder here ({os.path.abspath(path)}) nor "
                raise FileNotFoundError(f"{path} is {where}a loadable DART head: {err}") from err
            if config_dict.get("model_type") != "dart":
                raise ValueError(
                    f"{path} is not a DART head: its config.json has model_type={config_dict.get('model_type')!r}"
                    " (convert reference checkpoints with `dart-hf convert`)"
                )
        want_info = kwargs.pop("output_loading_info", False)
        kwargs["use_safetensors"] = True
        # let a wrong-shape key finish loading so the check below can name it (transformers' own error does not)
        kwargs["ignore_mismatched_sizes"] = True
        try:
            model, info = super().from_pretrained(path, *model_args, output_loading_info=True, **kwargs)
        except (OSError, RuntimeError, SafetensorError) as err:  # SafetensorError: truncated / damaged file
            raise ValueError(f"could not load a DART head from {path}: {err}") from err
        problems = {k: info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)}
        if problems:
            raise ValueError(f"{path}/model.safetensors does not match DartConfig: {problems}")
        ngram_file = cached_file(path, NGRAM_FILE, _raise_exceptions_for_missing_entries=False, **hub_kwargs)
        if ngram_file is not None:
            model.ngram = NGramModel.load(ngram_file)
        elif model.config.has_ngram:
            raise ValueError(
                f"{path} has no {NGRAM_FILE}, but its config.json says the head was saved with one (has_ngram: true): "
                f"copy {NGRAM_FILE} beside the weights, or set has_ngram to false to draft without n-gram rescoring"
            )
        return (model, info) if want_info else model

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """Weights + config, plus `ngram.safetensors` when the head carries an n-gram model. The config records
        whether it does (`has_ngram`), so a copy of the folder that lost the file is refused when loaded."""
        self.config.has_ngram = self.ngram is not None
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.ngram is not None and kwargs.get("is_main_process", True):
            self.ngram.save(os.path.join(save_directory, NGRAM_FILE))

    # ------------------------------------------------------------------ target modules
    def bind_target(self, target: PreTrainedModel) -> None:
        """Check the head was built for `target`, then keep its modules for calls that pass none (the training
        forward, offline drafting). `generate` never binds: it passes the modules to each draft call. Placement
        (device, dtype) is separate: `dart_hf.core.target.prepare_head`."""
        check_config_matches_target(self.config, target)
        self._bound = TargetModules.of(target)

    def _target_modules(self, given: TargetModules | None) -> TargetModules:
        modules = given if given is not None else self._bound
        if modules is None:
            raise RuntimeError("no target modules: pass target_modules=TargetModules.of(target) or bind_target first")
        return modules

    def _embed(self, token_ids: torch.Tensor, modules: TargetModules) -> torch.Tensor:
        embed = modules.embed
        return embed(token_ids.to(embed.weight.device)).to(device=self.fc.weight.device, dtype=self.fc.weight.dtype)

    def _project(self, h: torch.Tensor, modules: TargetModules) -> torch.Tensor:
        for _ in range(self.config.final_norm_repeats):
            h = self.norm(h)
        if self.lm_head is not None:
            return self.lm_head(h)
        return modules.lm_head(h.to(modules.lm_head.weight.dtype))

    # ------------------------------------------------------------------ the layer
    def _layer_inputs(self, aux_hidden: torch.Tensor, next_tokens: torch.Tensor, modules: TargetModules):
        """(attention input, residual) of real rows: embedding of token t+1 next to the fused state h_t."""
        layer = self.midlayer
        fc_out = self.fc(aux_hidden.to(self.fc.weight.dtype))
        embedded = self._embed(next_tokens, modules)
        x = torch.cat([layer.input_layernorm(embedded), layer.hidden_norm(fc_out)], dim=-1)
        return x, fc_out

    def _mask_inputs(self, last_real: torch.Tensor, count: int):
        """(attention input, residual) of `count` MASK slots after each row of `last_real` [B, R, 2H] (the real
        row each block of slots follows): [B, R * count, ...], every slot the same learned `mask_rep`."""
        b, r, width = last_real.shape
        x = self.midlayer.mask_rep.to(last_real.dtype).expand(b, r * count, width)
        return x, x[..., : self.config.hidden_size]

    def _mlp_out(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = residual + attn_out
        layer = self.midlayer
        return h + layer.mlp(layer.post_attention_layernorm(h))

    # ------------------------------------------------------------------ inference step
    def new_cache(self, capacity: int = 256, rows: int = 1) -> HeadKVCache:
        return HeadKVCache.empty(self.config, self.fc.weight.device, self.fc.weight.dtype, capacity, rows)

    @torch.no_grad()
    def draft(
        self,
        aux_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        cache: HeadKVCache,
        depth: int | None = None,
        target_modules: TargetModules | None = None,
    ) -> torch.Tensor:
        """One drafting forward for one row (`draft_rows` for several). Returns logits [depth, draft vocab] for the
        `depth` tokens after the bonus token (default and at most K + 1).

        `aux_hidden` [1, r, 3 * target_hidden] are the target states of the r positions the head has not seen,
        `next_tokens` [1, r] the token that follows each of them (the last one is the bonus token).
        A smaller `depth` drops the trailing MASK slots: row i attends only to rows <= i, so the rows kept are the
        same, and a tree of B nodes never reaches past depth B (on a CPU picking 3-4 nodes, 3 of 8 rows).
        `target_modules`: the target's embedding / lm_head (default: those of `bind_target`).
        """
        r = aux_hidden.shape[1]
        real = torch.full((1,), r, dtype=torch.long, device=cache.lengths.device)
        depth = self.config.num_predictions if depth is None else depth
        kv_len = cache.length + r + depth - 1  # (one host read of the cache's length)
        cache.reserve(kv_len)
        logits = self.draft_rows(aux_hidden, next_tokens, real, cache.k, cache.v, cache.lengths, depth,
                                 target_modules, kv_len=kv_len)
        cache.lengths += real
        return logits[0]

    @torch.no_grad()
    def draft_rows(
        self,
        aux_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        real: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        lengths: torch.Tensor,
        depth: int,
        target_modules: TargetModules | None = None,
        kv_len: int | None = None,
    ) -> torch.Tensor:
        """One drafting forward over several rows, on fixed shapes. Returns float logits [rows, depth, draft vocab].

        aux_hidden [B, R, 3 * target_hidden] / next_tokens [B, R]: each row's new positions, its first real[b] real
        (the rest: any value). cache_k / cache_v [B, kv heads, slots, head dim] hold lengths[b] positions of row b;
        its real positions' keys/values are written after them (slot lengths[b] + i), its K = depth - 1 MASK rows'
        at lengths[b] + R + j, where the next call overwrites them; the caller adds `real` to `lengths`. A query sees
        its row's real slots (up to lengths[b] + real[b]) and, for MASK row j, MASK slots 0..j; RoPE places real row
        i at lengths[b] + i and MASK row j at lengths[b] + real[b] + j, as one forward over the real rows followed by
        the MASK rows would. No host sync: the compiled step (`step.decode_step`) runs it on fixed-size caches.
        kv_len: attend to the first kv_len slots only (a Python int >= max(lengths) + R + K; default: all)."""
        full = self.config.num_predictions
        if not 1 <= depth <= full:
            raise ValueError(f"draft depth must be in 1..{full} (the head predicts K + 1 = {full} tokens), got {depth}")
        modules = self._target_modules(target_modules)
        b, r = next_tokens.shape
        k_slots, dev = depth - 1, next_tokens.device
        real_x, real_res = self._layer_inputs(aux_hidden, next_tokens, modules)
        last = (real - 1).view(b, 1, 1)
        last_x = real_x.gather(1, last.expand(-1, 1, real_x.shape[2]))
        mask_x, mask_res = self._mask_inputs(last_x, k_slots)
        x = torch.cat([real_x, mask_x], dim=1)
        row = torch.arange(r + k_slots, device=dev)
        positions = lengths.view(b, 1) + torch.where(row < r, row, real.view(b, 1) + row - r)
        cos, sin = self.rotary_emb(x, positions)
        attn = self.midlayer.self_attn
        queries = torch.cat([last.view(b, 1), torch.arange(r, r + k_slots, device=dev).expand(b, k_slots)], dim=1)
        pick = lambda t: t.gather(1, queries.unsqueeze(2).expand(-1, -1, t.shape[2]))
        q = attn.queries(pick(x), pick(cos), pick(sin))
        keys, values = attn.keys_values(x, cos, sin)
        slots = (lengths.view(b, 1) + row).view(b, 1, r + k_slots, 1).expand_as(keys)
        cache_k.scatter_(2, slots, keys)
        cache_v.scatter_(2, slots, values)
        kv_k, kv_v = (cache_k, cache_v) if kv_len is None else (cache_k[:, :, :kv_len], cache_v[:, :, :kv_len])
        slot = torch.arange(kv_k.shape[2], device=dev).view(1, 1, -1)
        seen = slot < (lengths + real).view(b, 1, 1)
        start = (lengths + r).view(b, 1, 1)
        own = (slot >= start) & (slot <= start + torch.arange(k_slots, device=dev).view(1, k_slots, 1))
        mask = torch.cat([seen, seen | own], dim=1).unsqueeze(1)  # [B, 1, 1 + K, slots]
        out = attn.attend(q, kv_k, kv_v, mask)
        residual = torch.cat([real_res.gather(1, last.expand(-1, 1, real_res.shape[2])), mask_res], dim=1)
        return self._project(self._mlp_out(residual, out), modules).float()

    # ------------------------------------------------------------------ training forward
    def forward(
        self,
        aux_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        anchors: torch.Tensor,
        attention_mask=None,
        target_modules: TargetModules | None = None,
    ) -> torch.Tensor:
        """Training forward over packed anchors (docs/DART_SPEC.md §2).

        `aux_hidden` [B, T, 3H] and `next_tokens` [B, T] cover a whole sequence; `anchors` [B, A] are real
        positions, each followed by its own block of K MASK slots appended after the T real rows. Every
        anchor's block sees only its own prefix (positions <= anchor) and itself, so one pass trains all of
        them. Returns logits [B, A, K + 1, draft vocab]: depth 0 from the anchor's real row, depth j from
        MASK slot j. Only predicting rows (anchors, then MASK slots) are queried; `attention_mask` may be a
        prebuilt mask over (predicting rows x all rows), e.g. a FlexAttention BlockMask; default: dense.
        """
        modules = self._target_modules(target_modules)
        b, t = next_tokens.shape
        a, k_slots = anchors.shape[1], self.config.draft_length
        real_x, real_res = self._layer_inputs(aux_hidden, next_tokens, modules)
        last_real = torch.gather(real_x, 1, anchors.unsqueeze(-1).expand(-1, -1, real_x.shape[-1]))
        mask_x, mask_res = self._mask_inputs(last_real, k_slots)
        x = torch.cat([real_x, mask_x], dim=1)
        slot = torch.arange(k_slots, device=x.device)
        mask_pos = (anchors.unsqueeze(-1) + 1 + slot).reshape(b, a * k_slots)
        positions = torch.cat([torch.arange(t, device=x.device).expand(b, t), mask_pos], dim=1)
        cos, sin = self.rotary_emb(x, positions)
        attn = self.midlayer.self_attn
        # predicting rows: each anchor's real row (depth 0), then every MASK row; all rows are keys/values
        rows = torch.cat([anchors, torch.arange(t, t + a * k_slots, device=x.device).expand(b, -1)], dim=1)
        gather = lambda tensor: torch.gather(tensor, 1, rows.unsqueeze(-1).expand(-1, -1, tensor.shape[-1]))
        q = attn.queries(gather(x), gather(cos), gather(sin))
        k, v = attn.keys_values(x, cos, sin)
        if attention_mask is None:
            full = packed_anchor_mask(t, anchors, k_slots)
            attention_mask = torch.gather(full, 1, rows.unsqueeze(-1).expand(-1, -1, full.shape[-1])).unsqueeze(1)
        out = attn.attend(q, k, v, attention_mask)
        residual = gather(torch.cat([real_res, mask_res], dim=1))
        h = self._mlp_out(residual, out)
        depth0, blocks = h[:, :a], h[:, a:].reshape(b, a, k_slots, h.shape[-1])
        return self._project(torch.cat([depth0.unsqueeze(2), blocks], dim=2), modules)


def packed_anchor_mask(seq_len: int, anchors: torch.Tensor, draft_length: int) -> torch.Tensor:
    """Dense [B, T + A*K, T + A*K] boolean mask of the "prefix-isolated" packing used in training.

    Real rows are causal over real rows. MASK slot j of anchor a sees real positions <= a and slots 0..j of
    its own block. Built by broadcasting, so it is the same function FlexAttention's mask_mod evaluates.
    """
    b, a = anchors.shape
    n = seq_len + a * draft_length
    idx = torch.arange(n, device=anchors.device)
    is_real = idx < seq_len
    block = (idx - seq_len).clamp(min=0) // draft_length
    slot = (idx - seq_len).clamp(min=0) % draft_length
    anchor_of = torch.gather(anchors, 1, block.clamp(max=a - 1).expand(b, n))  # [B, n], meaningful for MASK rows
    q_real, k_real = is_real.view(1, n, 1), is_real.view(1, 1, n)
    real_real = q_real & k_real & (idx.view(1, 1, n) <= idx.view(1, n, 1))
    mask_sees_prefix = ~q_real & k_real & (idx.view(1, 1, n) <= anchor_of.view(b, n, 1))
    same_block = (block.view(1, n, 1) == block.view(1, 1, n)) & (slot.view(1, 1, n) <= slot.view(1, n, 1))
    mask_sees_block = ~q_real & ~k_real & same_block
    return real_real | mask_sees_prefix | mask_sees_block


__all__ = ["DartHead", "DartPreTrainedModel", "HeadKVCache", "TargetModules", "packed_anchor_mask"]
