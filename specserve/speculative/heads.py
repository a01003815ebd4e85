"""Draft heads: strategy objects behind one interface. The worker never asks which head it has.

A head differs from another only in (a) which target hidden states it takes (``aux_layers``,
``first_hidden``) and (b) the module run per draft step (``run_module``, ``draft_ids``); the draft loop
(``propose``) is shared by EAGLE-3 and MTP-Eagle, and vanilla MTP overrides it.

Head input convention (all heads): at position ``i`` the head sees the target's hidden state at ``i``
and the embedding of the token at ``i + 1``; its output predicts the token at ``i + 2``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.kernels.argmax import argmax_lastdim
from specserve.kernels.gemv import gemv_enabled, quantize_rows
from specserve.kernels.norm import embed_norm_cat
from specserve.kernels.qkv_rope import EMBED_CAT
from specserve.models.attention import AttentionMetadata
from specserve.models.layers import RMSNorm, RotaryEmbedding, SwiGLU, linear, normed_argmax, normed_logits
from specserve.models.llama import Attention, DecoderLayer, at_rows


@dataclass
class DraftInputs:
    """Device tensors the draft loop reads after the target verified a step (B rows, T flat tokens)."""

    ids_ext: torch.Tensor  # [B, W] int64: token at position row_first_pos + i (verify tokens, lookahead, bonus)
    row_of_token: torch.Tensor  # [T] int64: row of each flat token
    col_of_token: torch.Tensor  # [T] int64: index of each flat token within its row
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata  # the step's attention layout; the head writes its KV at the same slots
    hidden: torch.Tensor  # [T, H] target final hidden states (after the final norm)
    aux: list[torch.Tensor]  # [T, H] each: target aux hidden states (the head's aux_layers)
    last_idx: torch.Tensor  # [B] int64: flat index of each row's last accepted token
    last_col: torch.Tensor  # [B] int64: its index within the row
    last_pos: torch.Tensor  # [B] int64: its position
    block_tables: torch.Tensor  # [B, M] int64: covers each drafting row's positions up to last_pos + D - 1
    draft_ok: torch.Tensor  # [B] bool: rows whose drafts are used (others write head KV to the pad slot)
    block_size: int
    draft_len: int  # D: drafts per row
    step0_ids: torch.Tensor  # [T] int64: ids_ext[row_of_token, col_of_token + 1], the head input of each token
    chain: tuple[torch.Tensor, torch.Tensor]  # [K, B] each: positions, cache slots of chain steps 1..D-1
    host_rows: list[Any] = field(default_factory=list)  # scheduled rows; for test heads only, never device heads


class DraftHead(nn.Module):
    """Base class. Subclasses set ``aux_layers``, ``num_kv_layers`` and implement the per-step pieces."""

    aux_layers: tuple[int, ...] = ()
    num_kv_layers: int = 1
    tree_drafts = True  # one module drafts any node from its parent's output (``speculative/tree.py``)
    # drafts read their output layer as int8 rows with the final norm's weight folded in (``int8_output``): one
    # table per (weight, norm) pair; a head whose steps share one weight under several norms keeps one table
    fold_draft_norm: bool = True

    def __init__(self) -> None:
        super().__init__()
        self._target: list[nn.Module] = []  # the bound target, kept out of this module's state_dict

    def bind(self, target: nn.Module) -> "DraftHead":
        """Share the target's embedding / lm_head / RoPE table."""
        self._target[:] = [target]
        return self

    @property
    def target(self):
        return self._target[0]

    def embed_input(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [N] -> (ids', table) whose rows table[ids'] are the embeddings the head reads its input tokens
        through: (ids, its own embedding or the target's [V, H]); where the target's is split by vocabulary rows
        (tensor parallelism), (arange(N), those rows gathered [N, H]), which the kernels read alike."""
        own = getattr(self, "embed_tokens", None)
        if own is not None or not self.target.tp.active:
            return ids, (own if own is not None else self.target.embed_tokens).weight
        return _arange(ids.shape[0], ids.device), self.target.embed_tokens(ids)

    def _vocab_parallel(self, weight: torch.Tensor) -> bool:
        """Whether an output layer is the target's, split by vocabulary rows (its logits are then gathered)."""
        target = self._target[0] if self._target else None
        return target is not None and target.tp.active and weight is target.lm_weight()

    # --- per-step pieces ---------------------------------------------------------------------
    def first_hidden(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """Target hidden states -> the head's step-0 hidden input [T, H]."""
        raise NotImplementedError

    def run_module(self, step: int, ids, positions, hidden, meta: AttentionMetadata, kv, rows=None) -> torch.Tensor:
        """One module pass for draft step ``step`` over ids [N] -> its pre-norm output [N, H]; with ``rows`` =
        (index [B], layout), every token writes its KV and the output is at those flat tokens only [B, H]
        (``Attention.normed``)."""
        raise NotImplementedError

    def logits(self, step: int, out: torch.Tensor) -> torch.Tensor:
        """out [..., H] -> logits over the head's vocabulary [..., V'] (float32)."""
        return self.raw_logits(step, out).float()

    def output_layer(self, step: int) -> tuple[RMSNorm, torch.Tensor]:
        """The final norm and output projection [V', H] of draft step ``step``."""
        raise NotImplementedError

    def step_modules(self, step: int) -> list[nn.Module]:
        """The modules draft step ``step`` runs besides its output layer (its embedding reads one row per token)."""
        raise NotImplementedError

    def draft_read_bytes(self, draft_len: int, rows: int = 1) -> int:
        """Weight bytes a draft loop of ``draft_len`` steps over ``rows`` rows reads: each step's modules and
        output layer (own, the target's or its rows; as the int8 copy where one row reads that), embeddings
        not counted (one row each per token). A roofline's bytes."""
        total = 0
        for step in range(draft_len):
            norm, w = self.output_layer(step)
            params = {id(p): p for m in (*self.step_modules(step), norm) for p in m.parameters()}
            params.pop(id(w), None)
            total += sum(p.numel() * p.element_size() for p in params.values()) + self._output_bytes(w, rows)
        return total

    def _output_bytes(self, w: torch.Tensor, rows: int) -> int:
        """Bytes one draft step reads of its output layer ``w`` [V', H] (``normed_logits`` / ``normed_argmax``)."""
        with torch.inference_mode():
            one_row = rows == 1 and gemv_enabled(w.new_empty(1, w.shape[1]), w.shape[1])
        if one_row:
            return w.numel() + 4 * w.shape[0]  # int8 rows and a float32 scale each
        return w.numel() * w.element_size()

    def raw_logits(self, step: int, out: torch.Tensor) -> torch.Tensor:
        """out [..., H] -> logits over the head's vocabulary [..., V'] in the compute dtype (argmax needs no
        float32 copy: converting is exact, so the argmax is the same)."""
        norm, w = self.output_layer(step)
        if self._vocab_parallel(w):  # the target's logits over the whole vocabulary, then the head's entries
            logits = self.target.lm_logits(norm(out))  # [..., V]
            ids = self.target_ids()
            return logits if ids is None else logits[..., ids]
        return normed_logits(norm, out, w, self.int8_output(w))

    def vocab_ids(self) -> torch.Tensor | None:
        """Target id of each entry of the head's vocabulary; None when it is the target's vocabulary."""
        return None

    def target_ids(self) -> torch.Tensor | None:
        """``vocab_ids()`` as a device table made once (``derived``), for the draft argmax's lookup."""
        return None

    def derived(self, name: str, sources: tuple, make):
        """A table made by ``make()`` from the tensors ``sources``, once per their storage and version (so a
        reload or an edit in place remakes it). It is first made on an eager step or a graph's warm-up run,
        outside any capture, and as a plain tensor even in inference mode, so that training can use it too."""
        key = (name,) + tuple(_tensor_key(t) for t in sources)
        cache = self.__dict__.setdefault("_derived", {})
        if key not in cache:
            if len(cache) >= 16:  # stale versions
                cache.clear()
            with torch.inference_mode(False), torch.no_grad():
                cache[key] = make()
        return cache[key]

    def int8_output(self, weight: torch.Tensor, norm: RMSNorm | None = None):
        """A callable giving ``weight`` [V', H] quantized to int8 rows (``derived``: made on the first one-row
        draft step). Only the argmax of a draft's logits matters, and it reads half the bytes of bfloat16. With
        ``norm`` (the RMSNorm before the layer): the rows times its weight, for ``normed_argmax``, which then skips
        the norm."""
        if norm is None:
            return lambda: self.derived("int8", (weight,), lambda: quantize_rows(weight))
        return lambda: self.derived("int8_folded", (weight, norm.weight),
                                    lambda: quantize_rows(weight.float() * norm.weight.float()))

    def draft_ids(self, step: int, out: torch.Tensor, dest: torch.Tensor | None = None) -> torch.Tensor:
        """out [B, H] -> most likely next token, as target vocabulary ids [B] (one row on the GPU: the argmax's
        first stage inside the output layer, ``normed_argmax``, whose second writes them into ``dest`` [B] when
        given; a result that is not ``dest`` is for the caller to place)."""
        norm, w = self.output_layer(step)
        if self._vocab_parallel(w):
            return argmax_lastdim(self.raw_logits(step, out), self.target_ids())
        folded = self.int8_output(w, norm) if self.fold_draft_norm else None
        return normed_argmax(norm, out, w, self.int8_output(w), self.target_ids(), dest, int8_folded=folded)

    def kv_layer(self, step: int) -> int:
        return 0

    # --- the draft loop (chain: step 0 over every verified token, then one-token steps) ----------
    def step0(self, x: DraftInputs, kv: list) -> torch.Tensor:
        """Draft step 0 over every token of the step -> the module's output at each row's last accepted token
        [B, H]. Every token writes its head KV; attention, the o projection and the MLP run for the B last
        tokens only (their outputs are the only ones read)."""
        ids = x.step0_ids  # [T]
        h = self.first_hidden(x.hidden, x.aux)  # [T, H]
        kv0 = kv[self.kv_layer(0)]
        # nothing writes through this layout: step 0's KV is written over all T tokens
        layout = _one_query_layout(x, x.last_pos, x.meta.slot_mapping[:0])
        return self.run_module(0, ids, x.positions, h, x.meta, kv0, rows=(x.last_idx, layout))

    def chain_layout(self, x: DraftInputs) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
        """Positions, cache slots and attention layout of chain steps 1..D-1 (the worker computes the positions
        and slots of all steps at once, ``kernels.draft_inputs``): step k writes at last_pos + k."""
        pos_t, slot_t = x.chain  # [K, B]: one contiguous row per step
        return [(pos_t[k], slot_t[k], _one_query_layout(x, pos_t[k], slot_t[k])) for k in range(x.draft_len - 1)]

    def propose(self, x: DraftInputs, kv: list, out: torch.Tensor | None = None) -> torch.Tensor:
        """Returns drafts [B, D] (target ids) in ``out`` [B, D] (the step's result columns), or in a new tensor:
        on the GPU each draft step's argmax writes its column (no stacking kernel), elsewhere it is copied in."""
        last = self.step0(x, kv)  # [B, H]
        if out is None:  # [B, D] with contiguous columns, as the step's result has them
            out = torch.empty(x.draft_len, last.shape[0], dtype=torch.int64, device=last.device).t()
        steps = self.chain_layout(x)
        for k in range(x.draft_len):
            if k:
                pos, slot, meta = steps[k - 1]
                last = self.run_module(k, tok, pos, last, meta, kv[self.kv_layer(k)])
            tok = self.draft_ids(k, last, out[:, k])
            place(out[:, k], tok)
        return out


# ---------------------------------------------------------------------------------------------
# EAGLE-3


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over ``cat(input_layernorm(embed), hidden_norm(hidden))``."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, in_features=2 * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = SwiGLU(h, cfg.intermediate_size, cfg.mlp_bias)

    def forward(self, ids, table, hidden, positions, meta, k_cache, v_cache, rows=None):
        """ids [N] (training: [B, S]); table [V, H]: the embedding; hidden [N, H] -> output stream [N, H]
        (pre final norm); with ``rows`` (``Attention.normed``) at those tokens only [B, H]."""
        # the input [N, 2H], cat(input_layernorm(embed), hidden_norm(hidden)), built inside the qkv projection
        # where its kernel applies
        post = self.post_attention_layernorm
        stream = at_rows(hidden, rows)  # the stream at the output's rows
        fold = post if self.mlp.norm_folds(stream) else None  # a step of many rows: see SwiGLU.norm_folds
        x, _ = self.self_attn.normed(hidden, positions, meta, k_cache, v_cache, EMBED_CAT, None, self.hidden_norm,
                                     (ids, table, self.input_layernorm), fold=fold, stream=stream, rows=rows)
        if fold is not None:
            return self.mlp.from_stream(post, *x, add_stream=True)
        return self.mlp.after_norm_sum(post, x, stream)


class Eagle3Head(DraftHead):
    """EAGLE-3. Its output layer is one of three: the target's lm_head (no draft vocabulary), an own lm_head over
    a draft vocabulary (``lm_head`` [V', H] and ``d2t``, EAGLE-3's layout), or ``shared_lm_head``: the draft
    vocabulary's rows of the target's lm_head (``d2t`` only; a small file, and a draft step reads V'/V of the
    target's output layer)."""

    def __init__(self, cfg: ModelConfig, aux_layers: tuple[int, int, int], draft_vocab_size: int | None,
                 own_embedding: bool = False, shared_lm_head: bool = False) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.aux_layers = tuple(aux_layers)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg, _rope(cfg))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        own = draft_vocab_size and not shared_lm_head
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False) if own else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        # draft id -> target id offset (target_id = draft_id + d2t[draft_id]); empty without a draft vocabulary
        self.register_buffer("d2t", torch.zeros(draft_vocab_size or 0, dtype=torch.int64))

    def first_hidden(self, hidden, aux):
        return linear(self.fc, torch.cat(aux, dim=-1))

    def run_module(self, step, ids, positions, hidden, meta, kv, rows=None):
        return self.midlayer(*self.embed_input(ids), hidden, positions, meta, *kv, rows=rows)

    def output_layer(self, step):
        return self.norm, self.lm_weight()

    def step_modules(self, step):
        return [self.fc, self.midlayer] if step == 0 else [self.midlayer]

    def lm_weight(self) -> torch.Tensor:
        """The output layer [V', H]: own, the target's, or the target's rows of the draft vocabulary (``derived``
        from the target's weight and d2t)."""
        if self.lm_head is not None:
            return self.lm_head.weight
        full = self.target.lm_weight()  # [V, H]
        if len(self.d2t) == 0 or self.target.tp.active:  # split by vocabulary: raw_logits picks the entries
            return full
        return self.derived("rows", (full, self.d2t), lambda: full[self.vocab_ids().to(full.device)].contiguous())

    def vocab_ids(self):
        if len(self.d2t) == 0:
            return None
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def target_ids(self):
        return None if len(self.d2t) == 0 else self.derived("target_ids", (self.d2t,), self.vocab_ids)


# ---------------------------------------------------------------------------------------------
# MTP (DeepSeek-style modules)


class MTPModule(nn.Module):
    """``eh_proj(cat(enorm(embed), hnorm(hidden)))`` -> one decoder block -> ``shared_head``."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding, own_head: bool) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DecoderLayer(cfg, rope)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.shared_head_head = nn.Linear(h, cfg.vocab_size, bias=False) if own_head else None

    def forward(self, ids, table, hidden, positions, meta, k_cache, v_cache, rows=None):
        x = linear(self.eh_proj, embed_norm_cat(ids, table, self.enorm.weight, hidden, self.hnorm.weight,
                                                self.enorm.eps))
        out, residual = self.block(x, None, positions, meta, k_cache, v_cache, rows)
        return out + residual


class MTPHead(DraftHead):
    """MTP-Eagle (``eagle=True``): module 0 run D times as a chain, like EAGLE-3."""

    def __init__(self, cfg: ModelConfig, num_modules: int, own_head: bool, eagle: bool,
                 own_embedding: bool = False) -> None:
        super().__init__()
        self.config = cfg
        rope = _rope(cfg)
        self.modules_ = nn.ModuleList(MTPModule(cfg, rope, own_head) for _ in range(num_modules))
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embedding else None
        self.eagle = eagle
        self.num_kv_layers = 1 if eagle else num_modules

    @property
    def tree_drafts(self) -> bool:
        """Vanilla MTP's module k drafts position k only: no trees."""
        return self.eagle

    @property
    def fold_draft_norm(self) -> bool:
        """Vanilla MTP's modules each have their own norm before a shared output layer: folding would make one
        vocabulary-sized int8 table per module, so they keep one table and run the norm in the kernel."""
        return self.eagle or len(self.modules_) == 1

    def module(self, step: int) -> MTPModule:
        return self.modules_[0 if self.eagle else step]

    def kv_layer(self, step: int) -> int:
        return 0 if self.eagle else step

    def first_hidden(self, hidden, aux):
        return hidden

    def run_module(self, step, ids, positions, hidden, meta, kv, rows=None):
        return self.module(step)(*self.embed_input(ids), hidden, positions, meta, *kv, rows=rows)

    def step_modules(self, step):
        return [self.module(step)]

    def output_layer(self, step):
        mod = self.module(step)
        head = mod.shared_head_head
        return mod.shared_head_norm, self.target.lm_weight() if head is None else head.weight

    def propose(self, x: DraftInputs, kv: list, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.eagle:
            return super().propose(x, kv, out)
        return self._propose_vanilla(x, kv)

    def _propose_vanilla(self, x: DraftInputs, kv: list) -> torch.Tensor:
        """Vanilla MTP: module k runs over the whole verified window with tokens shifted by k + 1 and the
        previous module's outputs as hidden states; its prediction at the last accepted token is draft k.
        Draft k - 1 is written into the shifted tokens before module k runs."""
        ext = x.ids_ext.clone()  # [B, W]
        rows = torch.arange(ext.shape[0], device=ext.device)
        h = x.hidden
        drafts = []
        for k in range(x.draft_len):
            ids = ext[x.row_of_token, x.col_of_token + k + 1]
            out = self.run_module(k, ids, x.positions, h, x.meta, kv[k])  # [T, H]
            tok = self.draft_ids(k, out[x.last_idx])
            drafts.append(tok)
            # the token at last_pos + k + 2; a non-final prompt chunk keeps the known prompt token there
            col = x.last_col + k + 2
            ext[rows, col] = torch.where(x.draft_ok, tok, ext[rows, col])
            h = out
        return torch.stack(drafts, dim=1)


def place(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Copy src into dest unless a kernel already wrote it there (src is that view of the same memory)."""
    if not (src.data_ptr() == dest.data_ptr() and src.shape == dest.shape and src.stride() == dest.stride()):
        dest.copy_(src)


def _one_query_layout(x: DraftInputs, pos: torch.Tensor, slots: torch.Tensor) -> AttentionMetadata:
    """The attention layout of a draft step with one query per row: row b's query at pos [B], written at slots."""
    rows = _arange(pos.shape[0], pos.device)
    return AttentionMetadata(slot_mapping=slots, block_tables=x.block_tables, query_index=rows[:, None],
                             query_pos=pos[:, None], flat_index=rows, sliding_window=x.meta.sliding_window,
                             backend=x.meta.backend)


_ARANGE: dict = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """torch.arange(n) on ``device``, made once (a graph step then reads it instead of running a kernel)."""
    key = (n, str(device))
    if key not in _ARANGE:
        with torch.inference_mode(False):
            _ARANGE[key] = torch.arange(n, device=device)
    return _ARANGE[key]


def _tensor_key(t: torch.Tensor) -> tuple:
    """What a table derived from ``t`` depends on: its storage, dtype, device and in-place edits (an inference
    tensor keeps no version counter; none is edited in place)."""
    try:
        version = t._version
    except RuntimeError:
        version = -1
    return t.data_ptr(), t.dtype, t.device, version


def _rope(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
