"""kernels.attention: every varlen attention kernel equals the per-sequence reference, forward
and backward; the reference itself equals padded SDPA with a key mask."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels.attention as attention
from kernels.attention import (KERNELS, Varlen, block_diagonal, cuda_varlen, flash_varlen,
                               flash_varlen_fits, jagged, per_sequence, repad, varlen_attention)

LENGTHS = [7, 1, 12, 5, 12]


def varlen_inputs(lengths=LENGTHS, heads=3, d=8, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    qkv = [torch.randn(total, heads, d, generator=g, dtype=torch.float64).to(device)
           .requires_grad_() for _ in range(3)]
    return qkv, Varlen.from_lengths(torch.tensor(lengths, device=device))


def test_varlen_layout():
    v = Varlen.from_lengths(torch.tensor([3, 1, 2]))
    assert v.cu_seqlens.tolist() == [0, 3, 4, 6] and v.cu_seqlens.dtype == torch.int32
    assert v.lengths == [3, 1, 2] and v.max_len == 3 and v.min_len == 1 and v.num_tokens == 6
    assert v.token_in_seq.tolist() == [0, 1, 2, 0, 0, 1]
    assert v.seq_of_token.tolist() == [0, 0, 0, 1, 2, 2]
    assert v.offsets.dtype == torch.int64 and v.offsets is v.offsets  # converted once
    assert v.device_lengths().tolist() == [3, 1, 2] and v.num_seqs == 3
    # The same layout handed over from the host: nothing is read back, lengths come lazily.
    h = Varlen.from_host(v.cu_seqlens, v.token_in_seq, v.seq_of_token, 3, 1)
    assert (h.num_tokens, h.max_len, h.min_len, h.lengths) == (6, 3, 1, None)
    assert h.host_lengths() == [3, 1, 2]


def test_reference_equals_padded_sdpa():
    (q, k, v), layout = varlen_inputs()
    out = per_sequence(q, k, v, layout)
    start = 0
    for n in LENGTHS:
        pad = 12 - n
        padded = [F.pad(t[start:start + n], (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None]
                  for t in (q, k, v)]
        mask = (torch.arange(12) < n)[None, None, None, :]
        want = F.scaled_dot_product_attention(*padded, attn_mask=mask)[0].transpose(0, 1)[:n]
        torch.testing.assert_close(out[start:start + n], want)
        start += n


@pytest.mark.parametrize("kernel", [repad, block_diagonal, jagged])
def test_kernel_equals_reference_forward_and_backward(kernel):
    # jagged is cuda_varlen's body: on CPU torch runs it through its math path, so the
    # conversions to and from nested tensors (offsets, min/max lengths, transposes) are
    # checked here without a GPU.
    (q, k, v), layout = varlen_inputs()
    (q2, k2, v2), _ = varlen_inputs()
    want, got = per_sequence(q, k, v, layout), kernel(q2, k2, v2, layout)
    torch.testing.assert_close(got, want)
    g = torch.randn_like(want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(b.grad, a.grad)


def test_dispatch_by_name_and_auto():
    (q, k, v), layout = varlen_inputs()
    ref = per_sequence(q, k, v, layout)
    for name in ("auto", "per_sequence", "repad", "block_diagonal", "jagged"):
        torch.testing.assert_close(varlen_attention(q, k, v, layout, kernel=name), ref)
    with pytest.raises(ValueError, match="unknown varlen attention kernel 'flash'"):
        varlen_attention(q, k, v, layout, kernel="flash")
    assert set(KERNELS) >= {"auto", "cuda_varlen"}


def test_cuda_varlen_refuses_cpu_tensors():
    (q, k, v), layout = varlen_inputs()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        varlen_attention(q, k, v, layout, kernel="cuda_varlen")


class _FlashStandIn:
    """aten._flash_attention_forward's calling convention on CPU: the tokens, cu_seqlens for
    queries and keys, the longest sequence as host ints, dropout, causal, debug mask; returns
    (output, logsumexp, rng_state, unused, debug mask). Computes the reference."""

    def __init__(self):
        self.calls = []

    def _flash_attention_forward(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p,
                                 is_causal, debug):
        self.calls.append((cu_q, cu_k, max_q, max_k, dropout_p, is_causal, debug))
        assert isinstance(max_q, int) and isinstance(max_k, int)  # host ints: no device read
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        out = per_sequence(q, k, v, Varlen.from_lengths(torch.tensor(lengths)), dropout_p)
        return out, None, None, None, None


def test_flash_varlen_hands_the_layout_to_the_kernel(monkeypatch):
    """The direct flash call (what training runs on CUDA in bf16) gets the layout's own
    cu_seqlens and host-known longest length, and its output is the kernel's first result."""
    stand_in = _FlashStandIn()
    monkeypatch.setattr(attention, "_FLASH_OPS", stand_in)
    (q, k, v), layout = varlen_inputs()
    host = Varlen.from_host(layout.cu_seqlens, layout.token_in_seq, layout.seq_of_token,
                            layout.max_len, layout.min_len)
    got = flash_varlen(q, k, v, host, dropout_p=0.0)
    torch.testing.assert_close(got, per_sequence(q, k, v, layout))
    (cu_q, cu_k, max_q, max_k, p, causal, debug), = stand_in.calls
    assert cu_q is host.cu_seqlens and cu_k is host.cu_seqlens and cu_q.dtype == torch.int32
    assert (max_q, max_k, p, causal, debug) == (12, 12, 0.0, False, False)
    got.sum().backward()  # gradients flow through whatever the op returns
    assert q.grad is not None


def _strided_views(lengths=LENGTHS, heads=3, d=8, device="cpu", dtype=torch.float64):
    """q, k, v as a fused QKV projection hands them over: views of one [T, 3·heads·d]."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(sum(lengths), 3 * heads * d, generator=g, dtype=torch.float64)
    qkv = qkv.to(device, dtype).requires_grad_()
    return qkv, qkv.view(sum(lengths), 3, heads, d).unbind(1)


def test_flash_varlen_hands_strided_views_to_the_kernel_uncopied(monkeypatch):
    """The kernel reads row and head strides (only the head dimension must be contiguous):
    the fused projection's Q, K, V reach it as the views they are."""
    seen = []

    class Spy(_FlashStandIn):
        def _flash_attention_forward(self, q, k, v, *rest):
            seen.append((q, k, v))
            return super()._flash_attention_forward(q, k, v, *rest)
    monkeypatch.setattr(attention, "_FLASH_OPS", Spy())
    qkv, (q, k, v) = _strided_views()
    layout = Varlen.from_lengths(torch.tensor(LENGTHS))
    got = flash_varlen(q, k, v, layout)
    (a, b, c), = seen
    assert (a.data_ptr(), b.data_ptr(), c.data_ptr()) == (q.data_ptr(), k.data_ptr(),
                                                          v.data_ptr())
    assert a.stride() == (72, 8, 1)
    torch.testing.assert_close(got, per_sequence(*(t.contiguous() for t in (q, k, v)), layout))


@pytest.mark.parametrize("kernel", ["per_sequence", "repad", "block_diagonal", "jagged"])
def test_every_cpu_kernel_takes_strided_views(kernel):
    qkv, views = _strided_views()
    layout = Varlen.from_lengths(torch.tensor(LENGTHS))
    got = varlen_attention(*views, layout, kernel=kernel)
    want = per_sequence(*(t.detach().contiguous() for t in views), layout)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    assert qkv.grad is not None and qkv.grad.shape == qkv.shape


def test_flash_varlen_takes_half_precision_cuda_tokens_only():
    assert not flash_varlen_fits(torch.zeros(4, 2, 64, dtype=torch.bfloat16))  # CPU
    meta = torch.zeros(4, 2, 64, dtype=torch.bfloat16, device="meta")
    assert not flash_varlen_fits(meta)  # not CUDA either


# ---- CUDA: what training runs (bf16, dropout, backward); skipped without a GPU --------------

@pytest.mark.cuda
def test_cuda_varlen_equals_reference():
    (q, k, v), layout = varlen_inputs(device="cuda")
    qkv = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = per_sequence(*[t.detach().float() for t in (q, k, v)], layout)
    torch.testing.assert_close(varlen_attention(*qkv, layout, kernel="cuda_varlen"), ref,
                               atol=2e-3, rtol=2e-3)


def _bf16_inputs(lengths=(7, 1, 12, 5, 12, 64), heads=4, d=64):
    """BERT-like head size (64) in bf16, as autocast hands SDPA its inputs in training."""
    (q, k, v), _ = varlen_inputs(list(lengths), heads=heads, d=d)
    layout = Varlen.from_lengths(torch.tensor(lengths, device="cuda"))
    return [t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in (q, k, v)], layout


@pytest.mark.cuda
def test_cuda_varlen_bf16_forward_and_backward_equal_the_reference():
    qkv, layout = _bf16_inputs()
    ref_in = [t.detach().float().requires_grad_() for t in qkv]
    got = cuda_varlen(*qkv, layout)
    want = per_sequence(*ref_in, layout)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(want)
    (got.float() * g).sum().backward()
    (want * g).sum().backward()
    for a, b in zip(ref_in, qkv):
        torch.testing.assert_close(b.grad.float(), a.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_cuda_varlen_runs_on_flash_with_dropout_and_no_host_sync():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qkv, layout = _bf16_inputs()
    host = Varlen.from_host(layout.cu_seqlens, layout.token_in_seq, layout.seq_of_token,
                            layout.max_len, layout.min_len)  # as training hands it over
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        # Flash only: if torch cannot use it (shape, dtype, dropout) this raises instead of
        # falling back to the slow math path that splits the nested tensor per sequence.
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.cuda.set_sync_debug_mode("error")
            try:
                out = cuda_varlen(*qkv, host, dropout_p=0.1)
                out.float().square().sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        outs.append(out.detach())
        assert all(torch.isfinite(t.grad).all() for t in qkv)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # same seed, same masks


@pytest.mark.cuda
def test_flash_varlen_on_strided_views_equals_it_on_copies():
    """The fused QKV projection's views, uncopied, in the real kernel: forward and the
    gradient of the one [T, 3H] tensor equal those of contiguous copies."""
    qkv, views = _strided_views(lengths=(7, 1, 12, 5, 12, 64), heads=4, d=64, device="cuda",
                                dtype=torch.bfloat16)
    layout = Varlen.from_lengths(torch.tensor((7, 1, 12, 5, 12, 64), device="cuda"))
    copy = qkv.detach().clone().requires_grad_()
    copies = [t.contiguous() for t in copy.view(qkv.shape[0], 3, 4, 64).unbind(1)]
    got, want = flash_varlen(*views, layout), flash_varlen(*copies, layout)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    g = torch.randn_like(got)
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(qkv.grad, copy.grad, rtol=0, atol=0)


@pytest.mark.cuda
def test_flash_varlen_fits_training_shapes_only():
    def t(dtype, d=64):
        return torch.zeros(4, 2, d, dtype=dtype, device="cuda")
    assert flash_varlen_fits(t(torch.bfloat16)) and flash_varlen_fits(t(torch.float16))
    assert not flash_varlen_fits(t(torch.float32))  # fp32: jagged SDPA, or repad (static)
    assert not flash_varlen_fits(t(torch.bfloat16, d=60)) and not flash_varlen_fits(
        t(torch.bfloat16, d=320))


# ---- the CUDA rule on static layouts (zero-length slots), on the simulated device ----------

def test_the_cuda_rule_never_sends_zero_length_slots_to_jagged():
    """Nested-tensor SDPA refuses its fused kernels for a zero-length sequence and takes its
    math path, which splits the tokens with a host read per sequence (no CUDA-graph capture):
    a static layout (min_len 0) in fp32 goes to repad; flash takes zero-length slots."""
    rule = attention.cuda_varlen_kernel
    assert rule(torch.float32, 64, min_len=0) == "repad"
    assert rule(torch.float32, 64, min_len=3) == "jagged"
    for half in (torch.bfloat16, torch.float16):
        assert rule(half, 64, min_len=0) == rule(half, 64, min_len=3) == "flash_varlen"
    assert rule(torch.bfloat16, 60, min_len=0) == "repad"  # flash takes no odd head size
    # inside a compiled layer (model.compile='layers') nested tensors cannot be traced
    assert rule(torch.float32, 64, min_len=3, compiling=True) == "repad"
    assert rule(torch.bfloat16, 64, min_len=3, compiling=True) == "flash_varlen"


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_static_batch_attends_without_host_syncs_in_every_precision(small_dataset,
                                                                      monkeypatch, precision):
    """The unpadded model's forward and backward on a static batch (zero-length sequence
    slots, the padding tail as a segment) with the kernel the CUDA rule picks in each
    precision, on the simulated device: no host read, data-dependent shape, host copy or
    host tensor - what makes a static step capturable (flash: its CPU stand-in)."""
    from runtime.model.bert import BertForPreTraining
    from runtime.model.config import BertConfig
    from runtime.observe.hostsync import SIM_DEVICE, HostSyncs
    from tests.support.loaders import OFFLINE, static_loader
    monkeypatch.setattr(attention, "_FLASH_OPS", _FlashStandIn())
    monkeypatch.setitem(attention._BY_NAME, "cuda_varlen", attention.cuda_dispatch)
    with static_loader(small_dataset, **OFFLINE) as loader:
        batch = next(loader)
    assert batch.layout.min_len == 0 and 0 in batch.layout.lengths
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=128, max_position_embeddings=128,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    stand_in = f"{__name__.replace('.', '/')}.py"  # the flash stand-in's own host reads
    with HostSyncs(SIM_DEVICE, allow=[stand_in]) as syncs:
        model = BertForPreTraining(cfg, attention="unpadded", packed=True,
                                   kernel="cuda_varlen").to(SIM_DEVICE)
        b = batch.to(SIM_DEVICE, non_blocking=True)  # (pinned on CUDA)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            out = model(b.input_ids, b.token_type_ids, b.attention_mask,
                        masked_lm_labels=b.masked_lm_labels,
                        next_sentence_labels=b.next_sentence_labels, layout=b.layout)
        out.loss.backward()
    assert syncs.events == [], syncs.report()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all()
                                            for p in model.parameters() if p.grad is not None)
    assert bool(attention._FLASH_OPS.calls) == (dtype is not None)
