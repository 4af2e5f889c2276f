"""The tied word embedding's gradient, reduced in two shares (``train.tied_embedding_sync =
"split"``, clip_mode global_after | none).

Owns: the split of the tied weight's gradient into the MLM decoder's share and the lookup's
share, and their reduction across ranks:
  * the decoder's share. The MLM head's decoder is replaced, from outside, by `TappedDecoder`
    (same weight and bias Parameters, same state-dict names): its forward multiplies by the
    weight through `_DecoderGradTap`, whose backward hands the decoder's share of the gradient
    here instead of into ``.grad``. It is pre-divided by P and its allreduce launched at once,
    early in backward (its own timeline lane);
  * the lookup's share, which reaches ``.grad`` as usual and so sits in the bucket buffer, in a
    bucket of its own. When that bucket is ready each rank marks the rows it touched, an
    allreduce-max of the row mask gives the union, and only those rows are reduced (rows no
    rank touched are zero on every rank, so the result is exact);
  * at the end, the reduced decoder share is added to the reduced lookup share: the same
    averaged gradient as one dense allreduce (tests/ranks/test_buckets_ranks.py holds it to the formula);
  * the squared norm of this rank's whole tied gradient, lookup + decoder, as it goes to the
    averaging (``local_sq``, loss-scaled, on the device): the gradient noise scale's small batch
    (runtime.observe.noise_scale) must see the whole gradient, and the two shares leave apart.
    ‖d + l‖² = ‖d‖² + Σ_rows touched (‖l_r‖² + 2 l_r·d_r): ‖d‖² of the decoder's share before
    it is divided and sent; its rows at this step's token ids (a forward pre-hook on the
    lookup records them) gathered then, and met with the lookup's rows before those are
    reduced. Each token counts 1/(its id's count), so a row seen twice counts once - fixed
    sizes throughout (tokens × hidden, never a vocabulary-sized copy), no host read.
Never: holds a reference to the bucket engine or calls into it (the engine calls `begin_step`,
`launch_lookup` and `finish` on this object, passing the lookup's rows), picks buckets, clips,
or leaves the model changed after `close` (the original decoder module goes back).

Why split: used by the lookup (the first op of forward) and the decoder (tied), the weight's
gradient is final only at the very end of backward, so a dense allreduce of it can never
overlap - and it is 88% of the CPU benchmark model's bytes, 21% of BERT-base's.

Host syncs: none on CUDA. The touched rows are compacted with ``torch.nonzero_static`` to a
fixed capacity (``max_rows``: at most every token of every rank, capped at the vocabulary; the
padding repeats row 0, whose reduced value is then written more than once, identically); on
CPU there is no stream to stall, and ``nonzero`` sends exactly the touched rows.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

from kernels.optim_reference import norm_of_rows, row_norms


_HOST = torch.device("cpu")


class _DecoderGradTap(torch.autograd.Function):
    """Identity on the tied weight in forward; in backward the decoder's share of its gradient
    goes to ``sink`` instead of into the parameter's ``.grad``."""

    @staticmethod
    def forward(ctx, weight, sink):
        ctx.sink = sink
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None


class TappedDecoder(nn.Module):
    """The MLM decoder with its (tied) weight passed through the tap: same Parameters, same
    state-dict names (``weight``, ``bias``) and outputs as the ``nn.Linear`` it replaces."""

    def __init__(self, decoder: nn.Linear, sink):
        super().__init__()
        self.weight = decoder.weight
        self.bias = decoder.bias
        self._sink = sink

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, _DecoderGradTap.apply(self.weight, self._sink), self.bias)


class TiedEmbeddingSplit:
    """Reduces the tied word embedding's gradient in two shares (see the module docstring).

    ``head``: the module holding ``decoder`` (an ``nn.Linear`` whose weight is ``param``);
    ``lookup``: the ``nn.Embedding`` whose weight is ``param`` (its input ids give the rows the
    lookup touches); ``lane``: the timeline lane of the decoder's allreduce; ``lookup_lane``:
    the lookup bucket's lane. Per step the engine calls ``begin_step`` → (backward;
    ``launch_lookup`` when the lookup bucket is ready) → ``finish`` after every other bucket
    was launched.
    """

    def __init__(self, param: nn.Parameter, head: nn.Module, lookup: nn.Module, *,
                 world_size: int, group: Any, reduce_dtype: torch.dtype, max_rows: int,
                 timeline: Any = None, lane: int = 0, lookup_lane: int = 0):
        self.param = param
        self.world_size = world_size
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.max_rows = max(1, min(int(max_rows), param.shape[0]))
        self.timeline = timeline
        self.lane, self.lookup_lane = lane, lookup_lane
        self.sync = True                 # False under the engine's no_sync(): accumulate only
        self._dec: Optional[torch.Tensor] = None  # the decoder's share, as autograd produced it
        self._armed = False
        self._head, self._original = head, head.decoder
        head.decoder = TappedDecoder(head.decoder, self._on_decoder_grad)
        self._ids_hook = lookup.register_forward_pre_hook(self._on_lookup)
        self.begin_step()
        self._armed = False

    @property
    def nbytes(self) -> int:
        """Bytes of the decoder share's allreduce."""
        return self.param.numel() * self.reduce_dtype.itemsize

    # ---- one step ---------------------------------------------------------------------------
    def begin_step(self) -> None:
        self._fresh = True    # the decoder's share not produced yet in this step
        self._work: Any = None
        self._comm: Optional[torch.Tensor] = None
        self._mask: Optional[torch.Tensor] = None
        self._mask_work: Any = None
        self._ids: list[torch.Tensor] = []   # the lookup's input ids, every micro-step
        self._dec_sq: Optional[torch.Tensor] = None    # ‖decoder share‖², before sending
        self._dec_rows: Optional[torch.Tensor] = None  # its rows at the ids, before sending
        self.local_sq: Optional[torch.Tensor] = None   # ‖whole local tied gradient‖² (finish)
        self._armed = True

    def _on_lookup(self, _module, args) -> None:
        if self._armed and torch.is_grad_enabled() and self.world_size > 1:
            self._ids.append(args[0].detach().reshape(-1))

    def _on_decoder_grad(self, grad: torch.Tensor) -> None:
        if not self._armed:  # a backward outside a training step: plain autograd semantics
            if self.param.grad is None:
                self.param.grad = grad.clone()
            else:
                self.param.grad.add_(grad)
            return
        if self._fresh:  # keep autograd's tensor (ours alone: the tap returns no gradient)
            self._dec = grad if grad.is_contiguous() else grad.contiguous()
            self._fresh = False
        else:
            self._dec.add_(grad)  # gradient accumulation: micro-steps add up
        if not self.sync:
            return
        now = self.timeline.now() if self.timeline is not None else None
        if self.timeline is not None:
            self.timeline.bucket_ready(self.lane, now)
        if self.world_size > 1:
            self._note_decoder()
            self._dec.mul_(1.0 / self.world_size)
        if self.world_size == 1:
            self._stamp(self.lane, now, done=True)
            return
        comm = self._dec if self.reduce_dtype == self._dec.dtype else self._dec.to(self.reduce_dtype)
        self._work = torch_dist.all_reduce(comm, op=torch_dist.ReduceOp.SUM, group=self.group,
                                           async_op=True)
        self._comm = comm
        self._stamp(self.lane, now, work=self._work)

    def launch_lookup(self, rows: torch.Tensor) -> None:
        """The lookup bucket is ready (``rows``: the tied gradient as [vocab, hidden], a view
        of the bucket buffer): launch the allreduce-max of the touched-row mask."""
        now = self.timeline.now() if self.timeline is not None else None
        if self.world_size == 1:
            self._stamp(self.lookup_lane, now, done=True)
            return
        if self.timeline is not None:
            self.timeline.bucket_launched(self.lookup_lane, now)
        self._mask = (rows != 0).any(dim=1).to(torch.uint8)
        self._mask_work = torch_dist.all_reduce(self._mask, op=torch_dist.ReduceOp.MAX,
                                                group=self.group, async_op=True)

    def _ids_now(self) -> torch.Tensor:
        if not self._ids:
            return torch.zeros(0, dtype=torch.long, device=self.param.device)
        return self._ids[0] if len(self._ids) == 1 else torch.cat(self._ids)

    def _note_decoder(self) -> None:
        """The decoder's local share, before it is divided and sent: its squared norm and its
        rows at this step's ids (every forward of the step has run by now)."""
        dec = self._dec
        self._dec_sq = norm_of_rows(row_norms(dec)).double().square()
        self._dec_rows = dec.index_select(0, self._ids_now()).float()

    def _note_local(self, rows: torch.Tensor) -> None:
        """``local_sq`` = ‖decoder share + lookup share‖² of this rank (see the module
        docstring), from the lookup's rows while they are still this rank's own."""
        ids = self._ids_now()
        count = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
        count.index_add_(0, ids, torch.ones(ids.shape[0], dtype=torch.float32,
                                            device=rows.device))
        weight = count.index_select(0, ids).reciprocal()  # every touched row counted once
        look = rows.index_select(0, ids).float()
        per_token = look.square().sum(1)
        if self._dec_rows is not None:
            per_token = per_token + 2 * (look * self._dec_rows).sum(1)
        total = (weight * per_token).double().sum()
        self.local_sq = total if self._dec_sq is None else total + self._dec_sq
        self._dec_rows = None

    def finish(self, rows: torch.Tensor) -> None:
        """After every bucket was launched: reduce the touched rows of ``rows`` in place, then
        add the decoder's reduced share. Every rank issues these collectives at this point.
        Before that (several ranks): ``local_sq``, this rank's whole tied gradient's squared
        norm (loss-scaled, fp64, on the device)."""
        if self.world_size > 1:
            self._note_local(rows)
        if self._mask is not None:
            self._mask_work.wait()
            idx = self._touched(self._mask)
            part = rows.index_select(0, idx).to(self.reduce_dtype)
            part.mul_(1.0 / self.world_size)
            torch_dist.all_reduce(part, op=torch_dist.ReduceOp.SUM, group=self.group)
            rows.index_copy_(0, idx, part.to(rows.dtype))
            if self.timeline is not None:
                self.timeline.bytes[self.lookup_lane] = part.numel() * part.element_size()
                self.timeline.bucket_done(self.lookup_lane)
        if self._work is not None:
            self._work.wait()
            if self.timeline is not None:
                self.timeline.waited(self.lane)
            if self._comm is not self._dec:
                self._dec.copy_(self._comm)
        if not self._fresh:  # the decoder ran in this step
            rows.add_(self._dec.view_as(rows))
        self._dec = self._comm = None  # autograd's tensor is freed until the next step
        self._ids = []
        self._armed = False

    def _touched(self, mask: torch.Tensor) -> torch.Tensor:
        if mask.device != _HOST:  # fixed size: no device-to-host read of the count (CUDA, and
            # runtime.observe.hostsync's simulated device, which stands in for it on CPU)
            return torch.nonzero_static(mask, size=self.max_rows, fill_value=0).squeeze(1)
        return mask.nonzero().squeeze(1)

    def _stamp(self, lane: int, now: float, work: Any = None, done: bool = False) -> None:
        tl = self.timeline
        if tl is None:
            return
        tl.bucket_launched(lane, now, work=None if done else work)
        if done:
            tl.bucket_done(lane, now)

    def close(self) -> None:
        """Put the model's own decoder back, and leave the lookup unhooked."""
        if self._head is not None:
            self._head.decoder = self._original
            self._head = None
            self._ids_hook.remove()


def find_tied_head(model: nn.Module, named: list,
                   required: bool = True) -> Optional[tuple[nn.Module, str, nn.Module]]:
    """The module whose ``decoder`` (an ``nn.Linear``) has its weight tied to a trainable
    parameter, that parameter's name and the ``nn.Embedding`` looking rows of it up; None (or,
    when required, an error) if there is none."""
    for module in model.modules():
        decoder = getattr(module, "decoder", None)
        if not isinstance(decoder, nn.Linear):
            continue
        for name, param in named:
            if param is not decoder.weight:
                continue
            lookup = next((m for m in model.modules()
                           if isinstance(m, nn.Embedding) and m.weight is param), None)
            if lookup is not None:
                return module, name, lookup
    if not required:
        return None
    raise ValueError("train.tied_embedding_sync='split' needs a model whose MLM head has a "
                     "decoder (nn.Linear) tied to a trainable parameter that an nn.Embedding "
                     "looks up, such as runtime.model.BertForPreTraining; use "
                     "tied_embedding_sync='dense'")
