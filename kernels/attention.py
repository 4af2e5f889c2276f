"""Attention over unpadded (concatenated) sequences: a plain-torch reference and faster paths.

Owns: ``Varlen`` (where each sequence's tokens sit in the concatenated layout: cu_seqlens and
friends, computed once per forward and shared by every layer) and the variable-length
attention functions, each taking q, k, v as [T, heads, d] (T = Σ sequence lengths) and
returning [T, heads, d], with attention confined to each sequence:

``per_sequence``   the reference: one SDPA call per sequence. Exact, no padding anywhere.
``repad``          scatter q/k/v into [n, heads, max_len, d] with a key mask, one SDPA call,
                   gather back. Pads *only attention* (to the longest sequence of the batch);
                   every token-parallel layer around it stays unpadded.
``block_diagonal`` one SDPA call over all T tokens with a [T, T] same-sequence mask:
                   computes T² scores to use Σ len² of them (kept as the measured
                   counter-example; see docs/BENCHMARKS.md).
``jagged``         nested (jagged) tensors into SDPA with the layout's min/max lengths, on
                   any device (CPU: torch's math path, one sequence at a time).
``flash_varlen``   CUDA, bf16/fp16: FlashAttention-2's varlen kernel called directly with
                   cu_seqlens (aten._flash_attention_forward, differentiable) - no nested
                   tensors, whose Python dispatch made the step host-bound on an H100.
``cuda_varlen``    ``flash_varlen`` where it fits, else (fp32, odd head sizes) ``repad`` for
                   a layout with zero-length sequence slots (static shapes) and ``jagged``
                   for any other (``cuda_varlen_kernel`` is the rule), with dropout and
                   backward. The plumbing is tested on CPU (a stand-in for the flash op,
                   ``jagged``, and the rule's choice on the simulated device of
                   runtime.observe.hostsync); the CUDA kernels by the cuda-marked tests.

``varlen_attention(..., kernel="auto")`` picks ``cuda_varlen`` on CUDA and ``repad`` on CPU
(the fastest CPU path measured by ``python -m bench.balance --attention``): the rule is
kernels.attention_rule's, with each kernel's cost layout beside it.
Never: model parameters, head split/merge, or deciding which tokens are real (the caller
passes cu_seqlens). Dropout draws differ between kernels, so they agree exactly only with
dropout_p = 0 (what the tests check).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from kernels.attention_rule import KERNELS, resolve  # the one rule: what 'auto' runs


@dataclass
class Varlen:
    """The concatenated layout of n sequences of T tokens in total.

    Built on the host by collation (``from_host``: no device-to-host read at all, the tensors
    arrive with the batch) or from a device tensor of lengths (``from_lengths``: reads the
    lengths back, a CPU-GPU sync - for tools and tests)."""

    cu_seqlens: torch.Tensor    # int32 [n+1] on the tokens' device: offsets, 0 … T
    max_len: int
    min_len: int
    num_tokens: int             # T
    token_in_seq: torch.Tensor  # int64 [T]: each token's position within its sequence
    seq_of_token: torch.Tensor  # int64 [T]: each token's sequence
    lengths: Optional[list[int]] = None  # host copy of the n lengths, where known
    _offsets: Optional[torch.Tensor] = field(default=None, repr=False)

    @classmethod
    def from_lengths(cls, lengths: torch.Tensor) -> "Varlen":
        """``lengths`` int [n] (any device): the layout of sequences laid end to end."""
        lengths = lengths.to(torch.int64)
        cu = F.pad(torch.cumsum(lengths, 0), (1, 0))
        host = lengths.tolist()  # a CPU-GPU sync: the sizes below come from it
        total = sum(host)
        seq = torch.repeat_interleave(torch.arange(len(host), device=lengths.device), lengths,
                                      output_size=total)
        token_in_seq = torch.arange(total, device=lengths.device) - cu[seq]
        return cls(cu.to(torch.int32), max(host, default=0), min(host, default=0), total,
                   token_in_seq, seq, host)

    @classmethod
    def from_host(cls, cu_seqlens: torch.Tensor, token_in_seq: torch.Tensor,
                  seq_of_token: torch.Tensor, max_len: int, min_len: int,
                  lengths: Optional[list[int]] = None) -> "Varlen":
        """A layout computed on the host (the tensors already where the tokens are)."""
        return cls(cu_seqlens, int(max_len), int(min_len), int(token_in_seq.shape[0]),
                   token_in_seq, seq_of_token, None if lengths is None else list(lengths))

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def offsets(self) -> torch.Tensor:
        """cu_seqlens as int64 (what nested jagged tensors take), made once per layout."""
        if self._offsets is None:
            self._offsets = self.cu_seqlens.to(torch.int64)
        return self._offsets

    def with_tail(self, n: int) -> "Varlen":
        """This layout and one more sequence of ``n`` tokens after its T (padding rows a
        caller computes and drops: the encoder's token count made a multiple of 16 for FP8
        GEMMs, runtime.model.bert); no host read, a few small kernels."""
        dev, t = self.cu_seqlens.device, self.num_tokens
        cu = torch.cat([self.cu_seqlens, torch.full((1,), t + n, dtype=self.cu_seqlens.dtype,
                                                    device=dev)])
        in_seq = torch.cat([self.token_in_seq, torch.arange(
            n, dtype=self.token_in_seq.dtype, device=dev)])
        of_token = torch.cat([self.seq_of_token, torch.full(
            (n,), self.num_seqs, dtype=self.seq_of_token.dtype, device=dev)])
        lengths = None if self.lengths is None else [*self.lengths, n]
        return Varlen(cu, max(self.max_len, n), min(self.min_len, n), t + n, in_seq, of_token,
                      lengths)

    def host_lengths(self) -> list[int]:
        """The n lengths on the host (a CPU-GPU sync when only the device has them)."""
        if self.lengths is None:
            self.lengths = torch.diff(self.offsets).tolist()
        return self.lengths

    def device_lengths(self) -> torch.Tensor:
        """int64 [n] lengths on the tokens' device (no sync)."""
        return torch.diff(self.offsets)


def per_sequence(q, k, v, varlen: Varlen, dropout_p: float = 0.0) -> torch.Tensor:
    """Reference: SDPA on each sequence alone."""
    out, start = [], 0
    for n in varlen.host_lengths():
        piece = [t[start:start + n].transpose(0, 1) for t in (q, k, v)]  # [heads, n, d]
        out.append(F.scaled_dot_product_attention(*piece, dropout_p=dropout_p).transpose(0, 1))
        start += n
    return torch.cat(out)


def repad(q, k, v, varlen: Varlen, dropout_p: float = 0.0) -> torch.Tensor:
    """One SDPA call over [n, heads, max_len, d], keys masked beyond each length."""
    n, width = varlen.num_seqs, varlen.max_len
    where = (varlen.seq_of_token, varlen.token_in_seq)

    def pad(t):
        out = t.new_zeros(n, width, *t.shape[1:])
        return out.index_put(where, t).transpose(1, 2)  # [n, heads, max_len, d]

    # A zero-length sequence slot (a static layout's unused slots) keeps one key: a row of
    # only masked keys is NaN in some SDPA backends, and no token reads that row's output.
    key_mask = (torch.arange(width, device=q.device)[None, :]
                < varlen.device_lengths().clamp(min=1)[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=key_mask,
                                         dropout_p=dropout_p)
    return out.transpose(1, 2)[where]


def block_diagonal(q, k, v, varlen: Varlen, dropout_p: float = 0.0) -> torch.Tensor:
    """One SDPA call over all T tokens, a token attending only to its own sequence."""
    seq = varlen.seq_of_token
    mask = (seq[:, None] == seq[None, :])[None]  # [1, T, T]
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)),
                                         attn_mask=mask, dropout_p=dropout_p)
    return out.transpose(0, 1)


def jagged(q, k, v, varlen: Varlen, dropout_p: float = 0.0) -> torch.Tensor:
    """Jagged nested tensors into SDPA, on any device: the body of ``cuda_varlen`` (on CPU
    torch runs its math path per sequence - correct, slow - which is how the tests hold the
    layout conversions to the reference without a GPU).

    The nested tensors get the layout's min/max sequence length: without them jagged SDPA
    reads both back from the offsets (``.item()``) for each of q, k and v in every layer."""
    def jag(t):  # [T, heads, d] → nested [n, j, heads, d] → [n, heads, j, d]
        # nested SDPA takes contiguous values only: a fused QKV projection's strided views
        # are copied here (the flash kernel takes them as they are)
        return torch.nested.nested_tensor_from_jagged(
            t.contiguous(), varlen.offsets, min_seqlen=varlen.min_len,
            max_seqlen=varlen.max_len).transpose(1, 2)

    out = F.scaled_dot_product_attention(jag(q), jag(k), jag(v), dropout_p=dropout_p)
    return out.transpose(1, 2).values()


# FlashAttention-2's variable-length kernel as torch ships it (differentiable: its backward is
# aten._flash_attention_backward). Looked up at call time, so CPU tests can stand in for it.
_FLASH_OPS = torch.ops.aten


def flash_varlen(q, k, v, varlen: Varlen, dropout_p: float = 0.0) -> torch.Tensor:
    """CUDA, fp16/bf16, head size a multiple of 8 up to 256: the flash varlen kernel called
    directly on the concatenated tokens with the layout's cu_seqlens and host-known longest
    sequence - one kernel per layer forward and one backward, no Python per op.

    Why not ``jagged`` on CUDA: nested tensors dispatch every op through Python
    (``__torch_function__``/``__torch_dispatch__``, schema checks, 576 nested-tensor
    constructions a step for BERT-large); on an H100 that host work was ~350 ms a step at
    any local batch (bench.gpu, 2026-11-24), far above the device's time for the step
    at the small local batches of a 1,024-GPU run.

    Strided q, k, v go in as they are: the kernel takes each tensor's row and head strides
    and needs only the head dimension contiguous (PyTorch's flash_api.cpp: ``set_params_fprop``
    reads ``stride(-3)`` and ``stride(-2)``, ``mha_varlen_fwd`` checks ``stride(-1) == 1``),
    so the fused QKV projection's Q, K, V - views of one [T, 3H] output - cost no copy."""
    out = _FLASH_OPS._flash_attention_forward(
        _head_contiguous(q), _head_contiguous(k), _head_contiguous(v), varlen.cu_seqlens,
        varlen.cu_seqlens, varlen.max_len, varlen.max_len, dropout_p, False, False)
    return out[0]


def _head_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_varlen_fits(q: torch.Tensor) -> bool:
    """Whether ``flash_varlen`` takes these tokens: CUDA, half precision, head size 8k ≤ 256."""
    return q.is_cuda and _flash_takes(q.dtype, q.shape[-1])


def _flash_takes(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256


def cuda_varlen_kernel(dtype: torch.dtype, head_dim: int, min_len: int,
                       compiling: bool = False) -> str:
    """The kernel ``cuda_varlen`` runs for CUDA tokens of ``dtype`` in heads of ``head_dim``
    over a layout whose shortest sequence has ``min_len`` tokens - host values only, so the
    choice never reads the device:

    * ``flash_varlen`` in half precision (head size 8k ≤ 256): zero-length slots are fine
      (NVIDIA's MLPerf recipe pads cu_seqlens with them);
    * ``repad`` otherwise (fp32) when the layout has zero-length slots - a static batch
      (data.shapes = 'static') always has them: nested-tensor SDPA refuses its fused kernels
      for a zero-length sequence and takes its math path, which splits the tokens per sequence
      with a host read each - a stall per segment, and no CUDA-graph capture ("operation not
      permitted when stream is capturing"); repad's shapes are the layout's (segments x
      width), read from no device value;
    * ``jagged`` otherwise (fp32 dynamic batches: SDPA's memory-efficient kernel) - except
      inside a compiled layer (``compiling``: model.compile = 'layers'), where ``repad``
      runs: Dynamo cannot trace nested tensors into SDPA (on CPU: "unsupported operator
      aten._nested_tensor_from_tensor_list"), and padding only attention costs little there."""
    if _flash_takes(dtype, head_dim):
        return "flash_varlen"
    return "repad" if compiling or min_len == 0 else "jagged"


def cuda_varlen(q, k, v, varlen: Varlen, dropout_p: float = 0.0) -> torch.Tensor:
    """CUDA: the kernel ``cuda_varlen_kernel`` picks (flash varlen in training's bf16/fp16).
    Which kernel ran is a named check of ``python -m bench.gpu``; ``per_sequence`` is the
    reference."""
    if not q.is_cuda:
        raise RuntimeError("cuda_varlen needs CUDA tensors; use kernel='repad' on CPU")
    return cuda_dispatch(q, k, v, varlen, dropout_p)


def cuda_dispatch(q, k, v, varlen: Varlen, dropout_p: float = 0.0) -> torch.Tensor:
    """``cuda_varlen`` without its device check: the CPU tests run the CUDA rule's choice on
    the simulated device (runtime.observe.hostsync) through it."""
    kernel = cuda_varlen_kernel(q.dtype, q.shape[-1], varlen.min_len,
                                torch.compiler.is_compiling())
    return _BY_NAME[kernel](q, k, v, varlen, dropout_p)


_BY_NAME = {"per_sequence": per_sequence, "repad": repad, "block_diagonal": block_diagonal,
            "jagged": jagged, "flash_varlen": flash_varlen, "cuda_varlen": cuda_varlen}


def varlen_attention(q, k, v, varlen: Varlen, dropout_p: float = 0.0,
                     kernel: str = "auto") -> torch.Tensor:
    """Attention of q, k, v [T, heads, d] within each sequence of ``varlen``."""
    if kernel == "auto":
        kernel = resolve(kernel, q.device.type, cuda_varlen_available())
    try:
        fn = _BY_NAME[kernel]
    except KeyError:
        raise ValueError(f"unknown varlen attention kernel {kernel!r}; choose one of "
                         f"{', '.join(KERNELS)}") from None
    return fn(q, k, v, varlen, dropout_p)


def cuda_varlen_available() -> bool:
    return torch.cuda.is_available() and hasattr(torch.nested, "nested_tensor_from_jagged")
