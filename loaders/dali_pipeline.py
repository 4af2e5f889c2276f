"""NVIDIA DALI input pipeline: the torch path's training batches, padded and prefetched by DALI.

Owns: ``DaliTrainLoader``, a drop-in for ``TrainLoader`` (same constructor arguments plus
``device_id``, same ``Batch``es, same ``state_dict``). Never: choosing samples or packing —
the pipeline is fed by the very same sampler through ``fn.external_source``: a
``TrainLoader`` (its plan, shard I/O and ``next_rows``, the unpadded rows of collate.py)
supplies each batch, so the two paths can differ only in padding, which the tests rule out.

The pipeline: ``external_source`` (one batch of rows per call, a variable number of rows
when packed) → ``fn.pad`` of each column to the batch's longest row (0; labels -100) →
``prefetch_queue_depth`` batches queued ahead by DALI's executor. What the model needs to
know about a batch without reading the GPU - token counts, sequence lengths, the NSP labels,
the ``Layout`` - is computed on the host from the same rows when the source hands them to
DALI, queued, and joined to the padded columns on delivery (in order: DALI delivers batches
in the order it asked for them).

* CPU (``device_id=None``, what the development machine and CI run): a CPU-only pipeline.
* CUDA (``device_id`` = local rank): the columns are copied to the GPU inside the pipeline
  (``.gpu()``), padded there, and handed to torch on the same device without a host round
  trip: copied out of DALI's buffer on a side stream whose event the compute stream waits
  for, and the next ``run()`` waits for that copy (DALI reuses its output buffers), so the
  host never waits for the compute stream. UNTESTED on a GPU: the GPU image has no DALI and
  ``python -m bench.gpu`` does not carry its 199 MB wheel, so its CUDA test skips there
  (docs/GPU.md, "DALI on a GPU").

Data position: DALI asks the source for batches ahead of use, so the position is counted
on *delivery*; ``load_state_dict`` rebuilds the pipeline at the saved position and drops
what was prefetched.
"""
from __future__ import annotations

from collections import deque

import numpy as np
import torch

from loaders.collate import IGNORE_INDEX, Batch, Rows, host_layout, row_sequence_lengths
from loaders.dataset import TrainLoader

COLUMNS = ("input_ids", "token_type_ids", "attention_mask", "masked_lm_labels")
FILL = (0, 0, 0, IGNORE_INDEX)


class DaliTrainLoader:
    """``TrainLoader``'s batches through a DALI pipeline (see the module docstring)."""

    def __init__(self, data_dir, rank: int, world_size: int, local_batch_size: int, seed: int,
                 *, device_id: int | None = None, prefetch_queue_depth: int = 2,
                 num_threads: int = 1, **loader_kwargs):
        self._source = TrainLoader(data_dir, rank, world_size, local_batch_size, seed,
                                   **loader_kwargs)
        self.device_id = device_id
        self._depth, self._threads = prefetch_queue_depth, num_threads
        self._epoch, self._step = self._source.epoch, self._source.step_in_epoch
        self._pipe = None
        self._host: deque = deque()   # per batch handed to DALI: what is known on the host
        self._copied = None           # CUDA: the last copy out of DALI's buffers (an event)
        self._stream = None

    # -- the TrainLoader interface ---------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        return self._source.steps_in(self._epoch)

    @property
    def info(self):
        return self._source.info

    @property
    def plan(self):
        return self._source.plan

    def state_dict(self) -> dict:
        source = self._source.state_dict()
        return {**source, "epoch": self._epoch, "step_in_epoch": self._step}

    def load_state_dict(self, state: dict) -> None:
        self._close_pipe()
        self._source.load_state_dict(state)
        self._epoch, self._step = self._source.epoch, self._source.step_in_epoch

    def __iter__(self) -> "DaliTrainLoader":
        return self

    def __next__(self) -> Batch:
        if self._pipe is None:
            self._pipe = self._build()
        if self._copied is not None:
            self._copied.synchronize()  # DALI may reuse the buffers we last copied from
        columns = [self._to_torch(out) for out in self._pipe.run()]
        if self.device_id is not None:
            self._copied = torch.cuda.Event()
            self._copied.record(self._stream)
            torch.cuda.current_stream(self.device_id).wait_event(self._copied)
        self._advance()
        return _batch(*columns, self._host.popleft())

    def close(self) -> None:
        self._close_pipe()
        self._source.close()

    def __enter__(self) -> "DaliTrainLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _advance(self) -> None:
        self._step += 1
        if self._step == self._source.steps_in(self._epoch):
            self._epoch, self._step = self._epoch + 1, 0

    def _next_columns(self):
        """external_source callback: the next batch's rows, one list per column; what the
        host knows of the batch is queued for its delivery."""
        rows: Rows = self._source.next_rows()
        self._host.append(_host_side(rows, pin=self.device_id is not None))
        return tuple(getattr(rows, name) for name in COLUMNS)

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        gpu = self.device_id is not None

        @pipeline_def(batch_size=self._source.local_batch_size, num_threads=self._threads,
                      device_id=self.device_id, prefetch_queue_depth=self._depth)
        def pipeline():
            columns = fn.external_source(source=self._next_columns, num_outputs=len(COLUMNS),
                                         batch=True, dtype=types.INT64, ndim=1)
            return tuple(fn.pad(c.gpu() if gpu else c, fill_value=fill)
                         for c, fill in zip(columns, FILL))

        pipe = pipeline()
        pipe.build()
        return pipe

    def _to_torch(self, tensor_list) -> torch.Tensor:
        if self.device_id is None:
            return torch.from_numpy(np.array(tensor_list.as_tensor()))
        from nvidia.dali.plugin.pytorch import feed_ndarray  # CUDA only; untested here
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device_id)
        dense = tensor_list.as_tensor()
        out = torch.empty(dense.shape(), dtype=torch.int64, device=f"cuda:{self.device_id}")
        out.record_stream(self._stream)  # allocated on the compute stream, written on ours
        feed_ndarray(dense, out, cuda_stream=self._stream)
        return out

    def _close_pipe(self) -> None:
        if self._pipe is not None:
            del self._pipe
            self._pipe = None
            self._host.clear()
            self._copied = None
            # The source ran ahead to fill DALI's queue: put it back at the delivered position.
            self._source.load_state_dict(self.state_dict())


def _host_side(rows: Rows, pin: bool) -> dict:
    """What collation knows of a batch without its padded columns (``Batch``'s other
    fields), from the rows on the host: nothing the step needs is read back from the GPU."""
    lengths = np.fromiter((len(r) for r in rows.input_ids), dtype=np.int64, count=len(rows))
    width = int(lengths.max())
    nsp = torch.from_numpy(np.concatenate(rows.next_sentence_labels))
    layout = host_layout(lengths, width, rows.attention_mask, rows.masked_lm_labels)
    if pin:
        nsp, layout = nsp.pin_memory(), layout.pin_memory()
    return dict(next_sentence_labels=nsp, num_real_tokens=int(lengths.sum()),
                num_padded_tokens=len(rows) * width, sequence_lengths=row_sequence_lengths(rows),
                layout=layout)


def _batch(input_ids, token_type_ids, attention_mask, masked_lm_labels, host: dict) -> Batch:
    if input_ids.shape[0] * input_ids.shape[1] != host["num_padded_tokens"]:
        raise RuntimeError(f"DALI delivered a batch of shape {tuple(input_ids.shape)} where "
                           f"the host expected {host['num_padded_tokens']} padded tokens: "
                           f"batches out of order")
    return Batch(input_ids=input_ids, token_type_ids=token_type_ids,
                 attention_mask=attention_mask, masked_lm_labels=masked_lm_labels, **host)
