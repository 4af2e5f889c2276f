"""BERT for pre-training (masked LM + next-sentence prediction), Hugging Face-compatible.

Owns: the modules of ``BertForPreTraining`` (sized by ``runtime.model.config.BertConfig``)
with parameter names identical to Hugging Face's (post-LayerNorm, erf GELU, MLM decoder tied
to the word embeddings; fusion ``qkv``'s ``Wqkv`` stands for three) and HF-style
initialisation; reading and writing HF-format state dicts
(``load_hf_state_dict``, ``load_pretrained``, ``save_hf_state_dict``, ``minilm_path``) is
runtime.model.hf's. It exposes no hook slot for communication: distributed wrappers act from outside
(runtime.grad_sync swaps the MLM decoder for a tapped one when it splits the tied weight).

Never: distributed communication, optimizers, data loading, or device placement — the model is
written for one device of any kind (CPU, or CUDA under bf16 autocast); callers move it.

The choices that set the cost of a step:
- The MLM head (transform + 30k-wide decoder) runs only on the masked positions, gathered from
  the flattened [b·L, H] hidden states; running it on every position costs ~2.5× at MiniLM size.
- ``attention="padded"`` (default) runs on [b, L] batches padded to their longest row, through
  ``attention(q, k, v, mask, dropout_p)``; ``attention="unpadded"`` gathers the real tokens
  once (``TokenLayout``), runs every layer on [T, H] with T = Σ lengths, and attends within
  each sequence through ``kernels.attention.varlen_attention`` (cu_seqlens). Both give the
  same outputs on the real tokens (tests/unit/test_model.py holds them equal).
- Fusion ``qkv`` (made on the built model by runtime.model.converters.FuseQKV): each layer's
  Q, K and V projections are one [3H, H] GEMM with one bias add (``BertSelfAttention.Wqkv``)
  instead of three, holding the split layout's numbers; the state dicts runtime.model.hf
  writes and reads keep HF's three keys either way.
- Packed rows (several sequences per row, ``attention_mask`` = 1-based sequence index, see
  ``loaders.collate.Batch``): position ids restart per sequence and NSP reads each sequence's
  own [CLS], both derived from the mask (``TokenLayout``); the padded path masks attention
  block-diagonally (built with ``packed=True``), the unpadded path needs nothing more.
- ``token_multiple`` (16 under ``model.fp8``, set by runtime.model.fp8): the encoder's token
  rows - T unpadded, b·L padded or packed - are made a multiple of it (torch._scaled_mm's
  rule on CUDA: the weight gradient's GEMM has the token count as its inner dimension).
  Unpadded, up to 15 rows of zeros are one more sequence of their own; padded, the width
  grows by masked columns; either way the encoder's extra rows are dropped after it, so the
  real tokens' outputs and every gradient are those of the unpadded count (the rows' zeros
  only enter FP8's tensorwise amax, which a real row's value sets). A step whose count is a
  multiple already (static shapes) runs as without it.
- Host syncs: none in a training step. The batch's ``Layout`` (``loaders.collate``) says
  where the real tokens, sequences and masked labels are, computed on the host, so every shape
  is known without reading the GPU; a caller passing only HF's arguments gets them found on
  the device instead (``nonzero``, lengths read back: CPU-GPU sync points, marked below).

Example (HF-format weights: runtime.model.hf)::

    from runtime.model.hf import load_pretrained, minilm_path
    cfg = BertConfig.from_hf_json(minilm_path())
    model = BertForPreTraining(cfg)
    print(load_pretrained(model, minilm_path()))   # body loaded, heads initialised
    out = model(input_ids, token_type_ids, attention_mask, masked_lm_labels, next_sentence_labels)
    out.loss.backward()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, get_args

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused
from kernels.fusions import CONVERTED, check_fusions
from kernels.attention import Varlen, varlen_attention
from runtime.choices import AttentionMode
from runtime.model.config import BertConfig

ATTENTION_MODES = get_args(AttentionMode)
IGNORE_INDEX = -100
"""masked_lm_labels value of positions that are not predicted (HF / torch convention)."""
VOCAB_MULTIPLE = 64
"""pad_vocab: the decoder's rows a multiple of this (fusion ``pad_vocab``)."""
PAD_LOGIT = -1.0e4
"""The bias of the padding rows: exp(PAD_LOGIT - max) is 0 in every float type (fp16 holds
it), so those rows take no probability and get no gradient."""
_VOCAB_KEYS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight",
               "cls.predictions.bias", "cls.predictions.decoder.bias")


def vocab_rows(cfg: BertConfig, fusions: tuple = ()) -> int:
    """Rows of the tied embedding and the decoder: the vocabulary, padded to a multiple of
    VOCAB_MULTIPLE with the ``pad_vocab`` fusion."""
    v = cfg.vocab_size
    return -(-v // VOCAB_MULTIPLE) * VOCAB_MULTIPLE if "pad_vocab" in fusions else v


def _vocab_rows_out(module, state_dict, prefix, local_metadata) -> None:
    """state_dict() of a pad_vocab model: the vocabulary's rows only (views)."""
    v = module.config.vocab_size
    for key in _VOCAB_KEYS:
        if prefix + key in state_dict:
            state_dict[prefix + key] = state_dict[prefix + key][:v]


# ----------------------------------------------------------------------------------- modules
# Class and attribute names mirror transformers.models.bert.modeling_bert so state-dict keys match.

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
              dropout_p: float) -> torch.Tensor:
    """Softmax attention over padded batches: q, k, v [b, heads, L, d]; key_mask [b, 1, 1, L]
    (or [b, 1, L, L] per query: packed rows), boolean (True where the key is visible) or
    additive (``additive_mask``).

    A padded *query* row still attends to real keys and stays finite (its output is never
    used). A NaN needs a query with no visible key at all, which [CLS] at position 0 of
    every sequence rules out.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, dropout_p=dropout_p)


def packed_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[b, L] sequence indices (0 = padding) → bool [b, 1, L, L]: a token sees the real
    tokens of its own sequence; a padding query sees every real key and itself (finite,
    unused - also in a row that is all padding, which static batches may have)."""
    q, k = attention_mask[:, :, None], attention_mask[:, None, :]
    width = attention_mask.shape[1]
    itself = torch.eye(width, dtype=torch.bool, device=attention_mask.device)
    return (((k > 0) & ((q == k) | (q == 0))) | itself)[:, None]


def additive_mask(key_mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask as the additive one SDPA applies (0 where visible, the
    dtype's lowest value where not), made once per forward in the dtype the attention will
    run in (autocast's, else ``like``'s) - a boolean mask is converted in every layer, which
    for packed rows' [b, 1, L, L] masks is a mask-sized pass per layer."""
    kind = like.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else like.dtype
    return torch.zeros(key_mask.shape, dtype=dtype, device=key_mask.device).masked_fill_(
        ~key_mask, torch.finfo(dtype).min)


@dataclass
class TokenLayout:
    """Where the real tokens of a padded [b, L] batch are and which sequence each belongs
    to (a sequence = a run of one nonzero ``attention_mask`` value in one row)."""

    index: torch.Tensor  # int64 [T]: flat (row·L + column) positions of the real tokens
    varlen: Varlen
    cls_tokens: Optional[torch.Tensor] = None  # int64 [sequences]: each [CLS] among the T
    #   tokens (None: the starts of cu_seqlens); static batches give one per sequence slot

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> "TokenLayout":
        """Found on the device: nonzero, unique_consecutive and reading the lengths back are
        CPU-GPU sync points. Training passes the host-built layout instead (``from_host``)."""
        b, width = attention_mask.shape
        flat = attention_mask.reshape(-1)
        index = (flat > 0).nonzero().squeeze(1)  # a CPU-GPU sync point
        row_and_seq = (index // width) * (width + 1) + flat[index]
        _, lengths = torch.unique_consecutive(row_and_seq, return_counts=True)
        return cls(index, Varlen.from_lengths(lengths))

    @classmethod
    def from_host(cls, layout) -> "TokenLayout":
        """From a layout collation computed on the host (``loaders.collate.Layout``, its
        tensors already on the model's device): no device-to-host read."""
        return cls(layout.token_index, Varlen.from_host(
            layout.cu_seqlens, layout.token_in_seq, layout.seq_of_token, layout.max_len,
            layout.min_len, layout.lengths), getattr(layout, "cls_tokens", None))

    @property
    def cls_tokens_or_starts(self) -> torch.Tensor:
        """Each sequence's [CLS] among the T tokens, in ``next_sentence_labels``' order."""
        return self.varlen.offsets[:-1] if self.cls_tokens is None else self.cls_tokens

    @property
    def cls_index(self) -> torch.Tensor:
        """Flat positions of each sequence's first token, its [CLS], in row-major order."""
        return self.index[self.cls_tokens_or_starts]

    def position_ids(self, shape) -> torch.Tensor:
        """[b, L] positions restarting at 0 for every sequence (0 on padding)."""
        out = torch.zeros(shape[0] * shape[1], dtype=torch.long, device=self.index.device)
        return out.index_put((self.index,), self.varlen.token_in_seq).view(shape)


@dataclass
class Unpadded:
    """The attention argument of the unpadded path: the layout plus the kernel name."""

    varlen: Varlen
    kernel: str = "auto"


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig, vocab_rows: int = 0):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                            padding_idx=cfg.pad_token_id)
        if vocab_rows > cfg.vocab_size:  # pad_vocab: rows appended after the constructor's
            w = self.word_embeddings.weight  # draws, so every other init stays the same
            self.word_embeddings.weight = nn.Parameter(torch.cat(
                [w.detach(), w.new_zeros(vocab_rows - cfg.vocab_size, cfg.hidden_size)]))
            self.word_embeddings.num_embeddings = vocab_rows
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        # Positions from arange unless given (packed rows, unpadded tokens), not a stored
        # position_ids buffer: nothing to save or load.
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
             + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """The Q, K and V projections and the attention over them. Built split (HF's layout):
    three Linears ``query``, ``key``, ``value``, three GEMMs and three bias adds. Fused
    (``fused_qkv``: fusion ``qkv``, made on the built model by
    runtime.model.converters.FuseQKV): one Linear ``Wqkv`` whose [3H, H] weight holds Q's,
    K's and V's rows in that order (and its [3H] bias likewise) - one GEMM with its bias, Q,
    K and V then views of its output. Both layouts hold the same numbers: runtime.model.hf
    reads and writes HF's three keys for either."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.fused_qkv = False
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout_p = cfg.attention_probs_dropout_prob

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, hidden = x.shape
        return x.view(b, length, self.num_heads, hidden // self.num_heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, key_mask) -> torch.Tensor:
        """x [b, L, H] with a padded mask, or [T, H] with an ``Unpadded`` layout."""
        dropout_p = self.dropout_p if self.training else 0.0
        if self.fused_qkv:
            return self._forward_fused(x, key_mask, dropout_p)
        if isinstance(key_mask, Unpadded):
            heads = (proj(x).view(x.shape[0], self.num_heads, -1)
                     for proj in (self.query, self.key, self.value))
            context = varlen_attention(*heads, key_mask.varlen, dropout_p, key_mask.kernel)
            return context.reshape(x.shape)
        q, k, v = (self._split_heads(proj(x)) for proj in (self.query, self.key, self.value))
        context = attention(q, k, v, key_mask, dropout_p)
        return context.transpose(1, 2).reshape(x.shape)

    def _forward_fused(self, x: torch.Tensor, key_mask, dropout_p: float) -> torch.Tensor:
        # Q, K, V are strided views of the one [.., 3H] output, no copy: SDPA and the flash
        # varlen kernel take them so (kernels.attention.jagged copies them)
        qkv = self.Wqkv(x)
        if isinstance(key_mask, Unpadded):  # [T, 3H] -> 3 x [T, heads, d]
            q, k, v = qkv.view(x.shape[0], 3, self.num_heads, -1).unbind(1)
            context = varlen_attention(q, k, v, key_mask.varlen, dropout_p, key_mask.kernel)
            return context.reshape(x.shape)
        b, length, _ = x.shape  # [b, L, 3H] -> 3 x [b, heads, L, d]
        q, k, v = qkv.view(b, length, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        context = attention(q, k, v, key_mask, dropout_p)
        return context.transpose(1, 2).reshape(x.shape)


class _DenseDropoutAddNorm(nn.Module):
    """LayerNorm(dropout(dense(x)) + residual): the attention output's and the layer output's
    tail; ``fused``: the bias, dropout, residual add and LayerNorm in one pass after a GEMM
    without bias (kernels.fused, ``model.fusions`` dropout_add_norm)."""

    def __init__(self, cfg: BertConfig, width_in: int, fused: bool = False):
        super().__init__()
        self.dense = nn.Linear(width_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)
        self.fused = fused

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused.bias_dropout_add_layer_norm(
                F.linear(x, self.dense.weight), self.dense.bias, residual,
                self.LayerNorm.weight, self.LayerNorm.bias, self.dropout.p, self.training,
                self.LayerNorm.eps)
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertSelfOutput(_DenseDropoutAddNorm):
    def __init__(self, cfg: BertConfig, fused: bool = False):
        super().__init__(cfg, cfg.hidden_size, fused)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig, fusions: tuple = ()):
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, "dropout_add_norm" in fusions)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, key_mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig, fused: bool = False):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fused = fused  # kernels.fused.bias_gelu after a GEMM without bias (bias_gelu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return fused.bias_gelu(F.linear(x, self.dense.weight), self.dense.bias)
        return F.gelu(self.dense(x))  # erf form: HF's "gelu"


class BertOutput(_DenseDropoutAddNorm):
    def __init__(self, cfg: BertConfig, fused: bool = False):
        super().__init__(cfg, cfg.intermediate_size, fused)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig, fusions: tuple = ()):
        super().__init__()
        self.attention = BertAttention(cfg, fusions)
        self.intermediate = BertIntermediate(cfg, "bias_gelu" in fusions)
        self.output = BertOutput(cfg, "dropout_add_norm" in fusions)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, key_mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig, fusions: tuple = ()):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, fusions) for _ in range(cfg.num_hidden_layers))

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, key_mask)
        return x


class BertPooler(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """cls_rows [sequences, H]: the hidden state of each sequence's [CLS] token."""
        return torch.tanh(self.dense(cls_rows))


@dataclass
class Encoded:
    """What ``BertModel.encode`` returns."""

    rows: torch.Tensor             # [N, H]: hidden states of [b·L] positions, or of T real tokens
    pooled: torch.Tensor           # [sequences, H]: pooled [CLS] outputs, row-major order
    token_index: Optional[torch.Tensor]  # [T] flat positions of ``rows`` (unpadded), or None


class BertModel(nn.Module):
    """``attention``: 'padded' | 'unpadded' (see the module docstring); ``packed``: rows may
    hold several sequences (only the padded path needs to know); ``kernel``: the
    varlen attention kernel of the unpadded path (kernels.attention.KERNELS)."""

    def __init__(self, cfg: BertConfig, attention: str = "padded", packed: bool = False,
                 kernel: str = "auto", fusions: tuple = ()):
        super().__init__()
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention={attention!r}: choose one of {ATTENTION_MODES}")
        self.attention_mode, self.packed, self.kernel = attention, packed, kernel
        self.token_multiple = 1  # the encoder's token rows a multiple of this (docstring)
        self.embeddings = BertEmbeddings(cfg, vocab_rows(cfg, fusions))
        self.encoder = BertEncoder(cfg, fusions)
        self.pooler = BertPooler(cfg)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor, layout=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (hidden states [b, L, H] — zero on padding in the unpadded path —,
        pooled [CLS] outputs [sequences, H])."""
        enc = self.encode(input_ids, token_type_ids, attention_mask, layout)
        if enc.token_index is None:
            return enc.rows.view(*input_ids.shape, -1), enc.pooled
        hidden = enc.rows.new_zeros(input_ids.numel(), enc.rows.shape[-1])
        return hidden.index_copy(0, enc.token_index, enc.rows).view(*input_ids.shape, -1), \
            enc.pooled

    def encode(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
               attention_mask: torch.Tensor, layout=None) -> Encoded:
        """``layout``: the batch's host-built ``loaders.collate.Layout`` (on this device), or
        None to find the real tokens from ``attention_mask`` on the device (host syncs)."""
        if self.attention_mode == "unpadded" or self.packed:
            tokens = TokenLayout.of(attention_mask) if layout is None \
                else TokenLayout.from_host(layout)
            if self.attention_mode == "unpadded":
                return self._encode_unpadded(input_ids, token_type_ids, tokens)
            return self._encode_packed(input_ids, token_type_ids, attention_mask, tokens)
        x = self.embeddings(input_ids, token_type_ids)
        hidden = self._encode_rows(x, attention_mask, lambda m: additive_mask(
            m.bool()[:, None, None, :], x))
        return Encoded(hidden.reshape(-1, hidden.shape[-1]), self.pooler(hidden[:, 0]), None)

    def _encode_packed(self, input_ids, token_type_ids, attention_mask,
                       layout: TokenLayout) -> Encoded:
        x = self.embeddings(input_ids, token_type_ids, layout.position_ids(input_ids.shape))
        hidden = self._encode_rows(x, attention_mask, lambda m: additive_mask(
            packed_attention_mask(m), x))
        rows = hidden.reshape(-1, hidden.shape[-1])
        return Encoded(rows, self.pooler(rows.index_select(0, layout.cls_index)), None)

    def _encode_rows(self, x: torch.Tensor, attention_mask: torch.Tensor, mask_of):
        """The encoder on [b, L, H] rows, the width grown by masked padding columns (dropped
        after) where b·L is not a multiple of ``token_multiple``."""
        b, width = attention_mask.shape
        grow = next(p for p in range(self.token_multiple)
                    if b * (width + p) % self.token_multiple == 0)
        if not grow:
            return self.encoder(x, mask_of(attention_mask))
        hidden = self.encoder(F.pad(x, (0, 0, 0, grow)), mask_of(F.pad(attention_mask,
                                                                        (0, grow))))
        return hidden[:, :width]

    def _encode_unpadded(self, input_ids, token_type_ids, layout: TokenLayout) -> Encoded:
        index = layout.index
        x = self.embeddings(input_ids.reshape(-1).index_select(0, index),
                            token_type_ids.reshape(-1).index_select(0, index),
                            layout.varlen.token_in_seq)
        tokens = layout.varlen.num_tokens
        tail = -tokens % self.token_multiple  # rows of a sequence of their own, dropped after
        if tail:
            rows = self.encoder(F.pad(x, (0, 0, 0, tail)),
                                Unpadded(layout.varlen.with_tail(tail), self.kernel))[:tokens]
        else:
            rows = self.encoder(x, Unpadded(layout.varlen, self.kernel))
        cls_rows = rows.index_select(0, layout.cls_tokens_or_starts)
        return Encoded(rows, self.pooler(cls_rows), index)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, cfg: BertConfig, vocab_rows: int = 0):
        super().__init__()
        rows = vocab_rows or cfg.vocab_size
        self.transform = BertPredictionHeadTransform(cfg)
        # (its weight becomes the tied word embedding; built at the vocabulary's size so the
        # constructor draws what it draws without pad_vocab)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # As in HF: one Parameter under two names, cls.predictions.bias and .decoder.bias.
        # Rows beyond the vocabulary (pad_vocab) hold PAD_LOGIT: their softmax is exactly 0.
        self.bias = nn.Parameter(torch.zeros(rows))
        self.decoder.bias = self.bias

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(rows))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, cfg: BertConfig, vocab_rows: int = 0):
        super().__init__()
        self.predictions = BertLMPredictionHead(cfg, vocab_rows)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)


@dataclass
class PreTrainingOutput:
    """What one forward pass returns. Losses are None when their labels were not given; the
    MLM fields are None without masked_lm_labels (the MLM head runs only on labelled rows)."""

    nsp_logits: torch.Tensor
    """[b, 2] next-sentence logits"""
    mlm_logits: Optional[torch.Tensor] = None
    """[n_masked, vocab] logits of the masked positions, in row-major (batch, position) order"""
    mlm_loss: Optional[torch.Tensor] = None
    """mean cross-entropy over masked positions (0 when there are none)"""
    nsp_loss: Optional[torch.Tensor] = None
    """mean next-sentence cross-entropy"""
    loss: Optional[torch.Tensor] = None
    """sum of the losses whose labels were given"""
    mlm_correct: Optional[torch.Tensor] = None
    """0-dim long: masked positions whose argmax equals the label (for eval accuracy)"""
    mlm_count: Optional[torch.Tensor] = None
    """0-dim long: number of masked positions; accuracy = sum(correct) / sum(count) over ranks"""


class BertForPreTraining(nn.Module):
    """HF ``BertForPreTraining``: ``bert`` (embeddings, encoder, pooler) + ``cls`` heads.
    ``attention``, ``packed``, ``kernel``: how it computes (see ``BertModel``); the
    parameters and outputs are the same for every choice."""

    def __init__(self, cfg: BertConfig, attention: str = "padded", packed: bool = False,
                 kernel: str = "auto", fusions: tuple = ()):
        super().__init__()
        check_fusions(fusions)
        made_later = [f for f in fusions if f in CONVERTED]
        if made_later:
            raise ValueError(f"fusion(s) {', '.join(map(repr, made_later))} are made on the "
                             f"built model: build it without, then runtime.model.converters "
                             f"(build_model applies them for model.fusions)")
        self.config = cfg
        # pad_vocab: the tied embedding and the decoder GEMM on a vocabulary padded to a
        # multiple of VOCAB_MULTIPLE (MosaicBERT pads 30,522 to 30,528: a tensor-core-friendly
        # GEMM width). The padding rows are zero, their logits PAD_LOGIT: no token ever looks
        # them up and their softmax is 0, so their gradients are exactly 0 and they stay as
        # they are - state dicts (HF files, checkpoints) hold the vocabulary alone.
        v, self.vocab_rows = cfg.vocab_size, vocab_rows(cfg, fusions)
        self.bert = BertModel(cfg, attention, packed, kernel, fusions)
        self.cls = BertPreTrainingHeads(cfg, self.vocab_rows)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
        self.init_weights()
        if self.vocab_rows != v:
            self._register_state_dict_hook(_vocab_rows_out)
            self._register_load_state_dict_pre_hook(self._vocab_rows_in)

    def _vocab_rows_in(self, state_dict, prefix, *args) -> None:
        """Loading a state dict of the vocabulary alone: the padding rows as they are here."""
        for key in _VOCAB_KEYS:
            t = state_dict.get(prefix + key)
            if t is not None and t.shape[0] == self.config.vocab_size:
                mine = dict(self.named_parameters(remove_duplicate=False))[key]
                state_dict[prefix + key] = torch.cat([t.to(mine.dtype).to(mine.device),
                                                      mine.detach()[t.shape[0]:]])

    @torch.no_grad()
    def init_weights(self) -> None:
        """HF initialisation: weights ~ N(0, initializer_range), biases 0, LayerNorm 1/0,
        the [PAD] word-embedding row 0. Seed torch beforehand for a reproducible init."""
        std, v = self.config.initializer_range, self.config.vocab_size
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) and module is not self.cls.predictions.decoder:
                # the decoder weight is the word embedding; only the vocabulary's rows are
                # drawn, so a padded vocabulary (pad_vocab) leaves every weight as without it
                rows = module.weight[:v] if module is self.bert.embeddings.word_embeddings \
                    else module.weight
                rows.normal_(0.0, std)
            if isinstance(module, (nn.Linear, nn.LayerNorm)) and module.bias is not None:
                module.bias.zero_()
            if isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
        self.bert.embeddings.word_embeddings.weight[self.config.pad_token_id].zero_()
        self.bert.embeddings.word_embeddings.weight[v:].zero_()   # pad_vocab's rows
        self.cls.predictions.bias[v:].fill_(PAD_LOGIT)

    def forward(self, input_ids: torch.Tensor, token_type_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                masked_lm_labels: Optional[torch.Tensor] = None,
                next_sentence_labels: Optional[torch.Tensor] = None,
                layout=None) -> PreTrainingOutput:
        """input_ids, token_type_ids, attention_mask (1 real, 0 pad; packed rows: the
        1-based sequence index): [b, L] long; missing token types are 0 and a missing mask
        means no padding. masked_lm_labels [b, L] with IGNORE_INDEX where not predicted;
        next_sentence_labels [sequences] (1 = random next). ``layout``: the batch's
        host-built ``loaders.collate.Layout`` on this device (what training passes: then no
        step of the forward reads a device value back), or None (found on the device)."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        enc = self.bert.encode(input_ids, token_type_ids, attention_mask, layout)
        out = PreTrainingOutput(nsp_logits=self.cls.seq_relationship(enc.pooled))
        if masked_lm_labels is not None:
            labels = masked_lm_labels.reshape(-1)
            if layout is not None:  # static shapes: the masked positions came with the batch
                rows = layout.masked_tokens if enc.token_index is not None \
                    else layout.masked_positions
                self._masked_lm(out, enc.rows.index_select(0, rows),
                                labels.index_select(0, layout.masked_positions))
            else:
                if enc.token_index is not None:
                    labels = labels.index_select(0, enc.token_index)
                # nonzero() is a CPU-GPU sync point: the number of masked rows sets the shapes
                picked = (labels != IGNORE_INDEX).nonzero().squeeze(1)
                self._masked_lm(out, enc.rows.index_select(0, picked),
                                labels.index_select(0, picked))
        if next_sentence_labels is not None:
            out.nsp_loss = F.cross_entropy(out.nsp_logits.float(), next_sentence_labels.view(-1))
        losses = [x for x in (out.mlm_loss, out.nsp_loss) if x is not None]
        out.loss = sum(losses) if losses else None
        return out

    def _masked_lm(self, out: PreTrainingOutput, hidden: torch.Tensor,
                   targets: torch.Tensor) -> None:
        """hidden [M, H]: the masked positions' hidden states; targets [M]: their labels
        (IGNORE_INDEX entries, if any, count for nothing). No host read."""
        logits = self.cls.predictions(hidden)
        total = F.cross_entropy(logits.float(), targets, reduction="sum",
                                ignore_index=IGNORE_INDEX)
        out.mlm_logits = logits
        out.mlm_count = (targets != IGNORE_INDEX).sum()  # on the device: no host→device copy
        out.mlm_loss = total / out.mlm_count.clamp(min=1)  # mean; 0 (not NaN) with no masks
        out.mlm_correct = (logits.argmax(-1) == targets).sum()


def run_batch(net: nn.Module, batch, next_sentence: bool = True) -> "PreTrainingOutput":
    """``net`` (a BertForPreTraining, or a wrapper of one: DDP's) on a collated batch
    (loaders.collate.Batch): the one place a batch's fields meet forward's arguments - the
    training step (eager and graphed) and evaluation (``next_sentence=False``: no NSP loss)."""
    return net(batch.input_ids, batch.token_type_ids, batch.attention_mask,
               masked_lm_labels=batch.masked_lm_labels,
               next_sentence_labels=batch.next_sentence_labels if next_sentence else None,
               layout=batch.layout)
