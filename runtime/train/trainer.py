"""The training loop: train BERT to a target masked-LM accuracy, evaluating on a fixed cadence.

``setup()`` finds a checkpoint to resume from, has runtime.train.build make the parts (model,
gradient sync, optimizer, schedule, loss scale, loaders) and restores them; ``fit()`` runs
callbacks' INIT_STOP → RUN_START → blocks of steps between evaluations → RUN_STOP and returns
the final RunState; ``close()`` runs on success and on error.

Owns: the step (forward, backward, one gradient sync, one optimizer update with the clip
coefficient and loss-scale unscale folded in, mixed precision), evaluation, the stopping rule
(target reached, budget spent), the logging cadence and the events callbacks observe, and the
run's progress (step, samples, epoch, the eval position; runtime.train.progress keeps it in a
checkpoint).
Never: builds parts (runtime.train.build), decides about checkpoints, signals or divergence
(runtime.train.run_control, asked at each logging point), reads the environment
(runtime.launch.env), writes MLPerf logs (submission's callback does), knows shard files
(loaders does), launches allreduces itself or asks which gradient sync it has
(runtime.grad_sync: one `GradSync` object), clips or scales gradients itself
(runtime.optim.grad_scale), or reads a device value back on an ordinary step
(runtime.observe.step_log reduces the metrics every ``train.log_every_steps`` steps).

Clipping (clip_mode 'global_after', the reference semantics): gradients are averaged across
ranks during backward, then ĝ = min(1, τ/‖ḡ‖)·ḡ is applied as the optimizer's ``grad_scale``
- no extra pass over the gradients, and the optimizer itself never clips, so nothing is
clipped twice. The before-allreduce modes clip inside the sync. A non-finite gradient norm
(fp16 overflow, or divergence in any precision) skips the update on the device
(``found_inf``); fp16's loss scale then halves.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as torch_dist

from loaders.dataset import DataSetInfo, check_data_set
from runtime.config import Config, ConfigError
from runtime.events import CallbackList, Event, RunState
from runtime.launch import signals
from runtime.launch.dist import DistContext, all_reduce_sum, barrier, broadcast_object
from runtime.observe import noise_scale
from loaders.collate import IGNORE_INDEX
from runtime.model.arithmetic import attention_layout, batch_work, computed_tokens, step_flops
from runtime.observe.balance_meter import BalanceMeter
from runtime.observe.clock import DeviceClock
from runtime.observe.hostsync import SIM_DEVICE
from runtime.observe.metrics import LogWriteError
from runtime.observe.mfu import peak_of
from runtime.observe.profiler import StepProfiler
from runtime.observe.step_log import StepLog, StepRecord
from runtime.optim.grad_scale import step_multiplier
from runtime.optim.optimizers import set_lr
from runtime.train.build import InitCheckpointError, Parts, build_model, build_parts, describe
from runtime.train.graphs import EncoderGraphs, FullStepGraph
from runtime.train import resume_rules
from runtime.train.checkpoint import CheckpointManager, ResumeRefused
from runtime.train.progress import Progress
from runtime.train.run_control import RunControl

__all__ = ["EvalResult", "InitCheckpointError", "Trainer", "build_model"]

LR_TABLE_MAX = 1 << 22
"""Steps whose learning rate a full-graph run keeps on the device (32 MiB of float64)."""
_DEVICE_KEYS = ("grad_norm", "clip_coef", "skipped", "loss_scale", "grad_sq_mean")
"""What ``_step`` returns for the step log's device fields; the rest goes to ``extra``."""


@dataclass
class EvalResult:
    accuracy: float
    correct: int
    count: int


class Trainer:
    def __init__(self, cfg: Config, dist: DistContext, callbacks: CallbackList | None = None,
                 log=None):
        self.cfg = cfg
        self.dist = dist
        self.callbacks = callbacks or CallbackList()
        self.state = RunState(config=cfg, rank=dist.rank, world_size=dist.world_size)
        self.train_loader = None
        self._say = log or (lambda msg: print(msg, flush=True) if dist.rank == 0 else None)
        self.grad_sync = None
        self.next_eval: int = 0
        self.config_changes: list[str] = []
        t = cfg.train
        self.checkpoints = CheckpointManager(
            t.checkpoint_path(), keep=t.checkpoint_keep, rank=dist.rank,
            world_size=dist.world_size, barrier=barrier, broadcast=broadcast_object,
            log=self._say)
        self.control = RunControl(t, self.checkpoints, params_finite=self._params_finite,
                                  say=self._say, fp16=lambda: self.loss_scale.enabled,
                                  device=dist.device)
        self.resume_from = None

    # ---- set-up -------------------------------------------------------------------------
    def setup(self, parts: Optional[Parts] = None) -> None:
        """Check the data set, find a checkpoint to resume from, build the parts (or take
        ``parts``, built by runtime.train.build for another purpose: the tuner's) and restore
        them."""
        cfg, dist = self.cfg, self.dist
        # The data set against the config first: a wrong directory or max_pred fails in
        # milliseconds, before a model is built.
        check_data_set(DataSetInfo.read(cfg.data.data_dir), max_seq_length=cfg.data.max_seq_length,
                       max_predictions_per_seq=cfg.data.max_predictions_per_seq,
                       vocab_size=cfg.model.vocab_size)
        # Resume only where checkpoints are on: a run that writes none never picks one up;
        # and only from checkpoints of this run (or adopted explicitly: one run, one log).
        adopted = None
        if self.control.checkpointing:
            adopted = self.checkpoints.claim(cfg.train.output_dir, cfg.train.adopt_checkpoints)
            self.resume_from = self.control.resumed_from = self.checkpoints.latest()
        if self.resume_from is not None:
            ck = self.resume_from
            self._check_resume(ck)   # before anything is built, logged or trained
            self.state.resume = {"checkpoint": str(ck.path), "step": ck.step,
                                 "samples": ck.samples, "world_size": ck.world_size,
                                 "time": ck.manifest.get("time"), "adopted_from_run": adopted}
        self.callbacks.fire(Event.INIT_START, self.state)
        self._graph_stream()  # before the parts: autograd's nodes are made on this stream
        if parts is None:
            plan = self.resume_from.path / "bucket_plan.json" if self.resume_from else None
            parts = build_parts(cfg, dist, bucket_plan=plan if plan and plan.is_file() else None)
        self.parts = parts
        self.model, self.grad_sync, self.optimizer = parts.model, parts.grad_sync, parts.optimizer
        self.net = self.grad_sync.module  # what forward is called on (DDP's wrapper or model)
        self.schedule, self.base_lr, self.loss_scale = parts.schedule, parts.base_lr, parts.loss_scale
        self.batch_cost, self.limits, self.timeline = parts.batch_cost, parts.limits, parts.timeline
        self.train_loader, self.eval_batches = parts.train_loader, parts.eval_batches
        t = cfg.train
        self.local_batch = cfg.local_batch_size(dist.world_size)
        self.accum = t.gradient_accumulation_steps
        self.control.base_lr = self.base_lr
        self.balance_meter = BalanceMeter(self.model, dist.device, dist.world_size,
                                          cost=self.batch_cost)
        self.noise = noise_scale.for_run(self.local_batch, self.accum, dist.world_size,
                                         t.noise_scale_horizon_samples)
        self.layout = attention_layout(cfg.model.attention, dist.device.type)
        device_name = torch.cuda.get_device_name(dist.device) \
            if dist.device.type == "cuda" else None
        self.peak = peak_of(device_name, t.precision, cfg.system.peak_tflops)
        self.step_log = StepLog(dist.world_size, self.balance_meter, self.noise, self.peak,
                                DeviceClock(dist.device))
        self.profiler = StepProfiler(t.profile_steps, t.output_dir, dist.rank, dist.device,
                                     self._say) if t.profile_steps else None
        self._run_t0: float | None = None
        if self.train_loader is not None:
            self.state.train_samples = (self.train_loader.steps_per_epoch * self.local_batch
                                        * dist.world_size)  # samples one epoch trains
        self.state.eval_samples = int(all_reduce_sum(torch.tensor(
            [sum(b.num_sequences for b in self.eval_batches)], device=dist.device)).item())
        self.state.derived.update(describe(parts, cfg, dist))
        self.state.derived.update(attention_layout=self.layout, peak_tflops=self.peak.tflops,
                                  peak_source=self.peak.source,
                                  step_time_source=self.step_log.time_source)
        if self.state.derived["optimizer_compiled"] is False:
            self._say(f"warning: the fused {cfg.optim.name} step runs eagerly (torch.compile "
                      f"failed: the rank log has why): same numbers, several times slower, "
                      f"with model-sized temporaries")
        self.next_eval = t.eval_cadence()[0]
        self.checkpoints.track(model=self.model, optimizer=self.optimizer,
                               loader=self.train_loader,
                               states={"progress": Progress(self), "loss_scale": self.loss_scale},
                               files={"bucket_plan.json": self._plan_file})
        if self.resume_from is not None:  # last: the RNG states are restored here
            self._resume()
        self._build_graphs()  # after a resume: a resumed run captures anew

    # ---- CUDA graphs (runtime.train.graphs) ------------------------------------------------
    full_graph = encoder_graphs = lr_table = device_step = None

    def _graph_stream(self) -> None:
        """train.cuda_graphs: refused off CUDA (a config error, exit 2, before anything is
        built); on CUDA the run's work goes to a stream of its own - a graph cannot be
        captured on the default stream, and autograd's nodes, the eager steps, the capture
        and the replays must share one stream."""
        mode = self.cfg.train.cuda_graphs
        if mode == "none" or self.dist.device == SIM_DEVICE:  # (tests: the eager warm-up of
            return                                             # the captured step, simulated)
        if self.dist.device.type != "cuda":
            raise ConfigError(f"train.cuda_graphs='{mode}' needs a CUDA device; this rank runs "
                              f"on {self.dist.device} - set train.cuda_graphs='none'")
        self._stream_before = torch.cuda.current_stream(self.dist.device)
        torch.cuda.set_stream(torch.cuda.Stream(self.dist.device))

    def _build_graphs(self) -> None:
        mode, device = self.cfg.train.cuda_graphs, self.dist.device
        pause = self.balance_meter.paused
        if mode == "none":
            return
        self.balance_meter.hooked = False  # graphs run no module hooks: spans are explicit
        if mode == "encoder":
            self.encoder_graphs = EncoderGraphs(self.net, device, self._autocast, pause=pause,
                                                micro_batches=self.accum)
            return
        steps = self.cfg.train.max_steps + 1
        if steps > LR_TABLE_MAX:
            raise ConfigError(f"train.cuda_graphs='full' keeps the learning rate of every step "
                              f"on the device: train.max_steps={steps - 1} exceeds "
                              f"{LR_TABLE_MAX - 1}; lower it or use train.cuda_graphs='encoder'")
        # The schedule is a pure function of the step: its values, the host's exact floats,
        # as a device table the graph indexes with its own step counter.
        self.lr_table = torch.tensor([self.schedule(t) for t in range(steps)],
                                     dtype=torch.float64).to(device)
        self.device_step = torch.zeros((), dtype=torch.int64, device=device)
        self.device_step.fill_(self.state.step)
        self.full_graph = FullStepGraph(self._step, device, pause=pause)

    def _check_resume(self, ck) -> None:
        """Refuse a resume that changes a key that must match (runtime.train.resume_rules);
        keep the changes that may happen, for the record (console, MLPerf log, metrics)."""
        saved = ck.train_state().get("progress", {}).get("config")
        if saved is None:
            return
        refused, recorded = resume_rules.compare(json.loads(saved), self.cfg.to_dict())
        if refused:
            raise ResumeRefused(resume_rules.refusal(str(ck.path), refused,
                                                     self.cfg.train.output_dir))
        self.config_changes = [d.text() for d in recorded]

    def _plan_file(self) -> bytes | None:
        plan = self.grad_sync.plan_json()
        return None if plan is None else (json.dumps(plan, indent=1) + "\n").encode()

    def _resume(self) -> None:
        ck = self.resume_from
        notes = self.checkpoints.restore(ck)
        st = self.state
        st.resume.update(notes=notes, config_changes=self.config_changes,
                         world_size_now=self.dist.world_size)
        self._say(f"resuming from {ck.path} (step {st.step}, {st.samples} samples, written by "
                  f"{ck.world_size} rank(s) at {ck.manifest.get('time')})")
        for note in notes:
            self._say(f"resume: {note}")
        if self.config_changes:
            self._say("resume: the config differs from the checkpoint's: "
                      + "; ".join(self.config_changes))

    # ---- one step -----------------------------------------------------------------------
    def _autocast(self):
        p = self.cfg.train.precision
        if p == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if p == "bf16" else torch.float16
        # Under CUDA graphs without the cast cache: a graph would replay the casts of the
        # weights it captured once (and make_graphed_callables refuses the cache).
        return torch.autocast(self.dist.device.type, dtype=dtype,
                              cache_enabled=self.cfg.train.cuda_graphs == "none")

    def _micro_batches(self, it, seen: list):
        """This step's micro-batches on the device (the encoder graphs copy host batches into
        their own buffers); each host batch is also appended to ``seen``."""
        for _ in range(self.accum):
            batch = next(it)
            seen.append(batch)
            yield batch if self.encoder_graphs is not None else self._to_device(batch)

    def _to_device(self, batch):
        """The batch on the device, copied without making the host wait. From pageable
        memory a CUDA copy synchronises the stream first (non_blocking or not), so on CUDA
        the batch goes through pinned memory (the caching host allocator keeps each block
        until its copy is done). With no other host sync in the step, the host collates the
        next batch while the GPU still runs this one."""
        if self.dist.device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(self.dist.device, non_blocking=True)

    def _span(self, name: str):
        """A timeline span (train.timeline), else nothing."""
        return self.timeline.span(name) if self.timeline else contextlib.nullcontext()

    def train_step(self, it) -> StepRecord:
        """One optimizer step: its device work (``_step``) run eagerly, or replayed from the
        whole-step CUDA graph (train.cuda_graphs = 'full'). No host read and no collective
        but the gradient allreduces: norms, the clip coefficient and the skip decision stay
        on the device."""
        t0, mark = time.perf_counter(), self.step_log.mark()
        if self.timeline:
            self.timeline.start_step()
        step, lr = self.state.step, self.schedule(self.state.step)
        batches: list = []  # this step's host batches (their token counts)
        if self.full_graph is not None:  # the learning rate: the graph's own, from the table
            batches = [next(it) for _ in range(self.accum)]
            with self.balance_meter.span():
                values = self.full_graph.step(batches)
        else:
            set_lr(self.optimizer, lr)
            values = self._step(self._micro_batches(it, batches))
        real = sum(b.num_real_tokens for b in batches)
        computed = sum(computed_tokens(self.layout, padded_tokens=b.num_padded_tokens,
                                       layout_tokens=b.layout.num_tokens if b.layout
                                       is not None else b.num_real_tokens) for b in batches)
        flops = sum(self._model_flops(b) for b in batches)
        return self._record(step, lr, (t0, mark), real, computed, values, flops)

    def _model_flops(self, batch) -> float:
        """The model FLOPs of one host micro-batch (runtime.model.arithmetic: its real
        tokens, Σ n², masked positions and sequences)."""
        lengths = batch.sequence_lengths  # host numbers collation recorded
        if lengths is None:  # a pipeline that did not record them: read from the mask
            lengths = [[int(c) for c in torch.bincount(row)[1:].tolist() if c]
                       for row in batch.attention_mask]
        masked = batch.num_masked_labels
        if masked is None:  # (a host tensor: no device read, but a read all the same)
            masked = int((batch.masked_lm_labels != IGNORE_INDEX).sum())
        return step_flops(self.cfg.model, masked=masked, **batch_work(lengths))

    def _step(self, batches) -> dict:
        """The device work of one step on device ``batches``: forward, backward, gradient
        sync, optimizer update. What the whole-step graph captures (runtime.train.graphs):
        every state it changes it changes in place, and nothing in it reads the host."""
        sync, scale = self.grad_sync, self.loss_scale
        if self.lr_table is not None:  # train.cuda_graphs full: lr from the device's counter
            at = self.device_step.clamp(max=self.lr_table.shape[0] - 1).reshape(1)
            set_lr(self.optimizer, self.lr_table.index_select(0, at).reshape(()))
            self.device_step.add_(1)
        self.net.train()
        sync.begin_step(scale.scale)
        losses = torch.zeros(4, device=self.dist.device)
        for i, batch in enumerate(batches):
            with sync.no_sync() if i < self.accum - 1 else contextlib.nullcontext():
                with self._span("forward"):
                    loss, mlm_loss, nsp_loss = self._forward(batch)
                with self._span("backward"):
                    (loss * scale.loss_multiplier(self.accum)).backward()
            losses[:3] += torch.stack([loss.detach(), mlm_loss.detach(),
                                       nsp_loss.detach()]).float() / self.accum
        with self._span("sync"):  # the last launches and the wait for every allreduce
            report = sync.finish()
        with self._span("optimizer"):
            grad_scale, found_inf, coef, norm = step_multiplier(
                sync.grad_norm(), scale.scale, max_norm=self.cfg.train.max_grad_norm,
                clip=sync.fold_clip)
            self.optimizer.step(grad_scale=grad_scale, found_inf=found_inf)
            scale.update(~found_inf)
            sync.zero_grad()
        values = dict(losses=losses, grad_norm=norm, clip_coef=coef * report.clip_coef,
                      skipped=found_inf, loss_scale=scale.value())
        if report.local_sq_norm is not None:  # the gradient noise scale's two batch sizes
            losses[3] = report.local_sq_norm  # averaged over ranks at the logging point
            values["grad_sq_mean"] = norm.square()  # the whole averaged gradient's
        return {**values, **report.metrics()}

    def _forward(self, batch):
        """(loss, mlm_loss, nsp_loss) of one micro-batch: replayed from the encoder graphs
        (train.cuda_graphs = 'encoder'; they take the host batch), else the model's forward."""
        if self.encoder_graphs is not None:
            with self.balance_meter.span():
                return self.encoder_graphs.forward(batch)
        with self._autocast():
            out = self.net(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                           masked_lm_labels=batch.masked_lm_labels,
                           next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
        return out.loss, out.mlm_loss, out.nsp_loss

    def _record(self, step, lr, start, real, computed, values, flops=0.0) -> StepRecord:
        """The step's StepRecord, its device values unread; ``start``: (host time, device
        mark) when the step began (TFLOP/s and MFU divide by the device's time)."""
        t0, mark = start
        losses = values.pop("losses")
        device = {k: values.pop(k) for k in _DEVICE_KEYS if k in values}
        extra = values
        self.state.step = step + 1
        self.state.samples += self.cfg.train.global_batch_size
        self.balance_meter.end_step(real, computed, flops)
        if self.timeline:
            extra.update(self.timeline.summary())
        now = time.perf_counter()
        host = dict(step=step + 1, samples=self.state.samples, lr=lr, step_time_s=now - t0,
                    elapsed_s=None if self._run_t0 is None else now - self._run_t0,
                    real_tokens=real, computed_tokens=computed, model_flops=flops,
                    marks=(mark, self.step_log.mark()))
        return self.step_log.record(StepRecord(host, losses, device, extra))

    # ---- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        self.model.eval()
        counts = torch.zeros(2, dtype=torch.float64, device=self.dist.device)
        for batch in self.eval_batches:  # resident on the device since set-up
            with self._autocast():
                out = self.model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                                 masked_lm_labels=batch.masked_lm_labels, layout=batch.layout)
            counts += torch.stack([out.mlm_correct.double(), out.mlm_count.double()])
        correct, count = all_reduce_sum(counts).tolist()
        return EvalResult(accuracy=correct / max(count, 1.0), correct=int(correct), count=int(count))

    # ---- the run ------------------------------------------------------------------------
    def fit(self) -> RunState:
        if self.train_loader is None:
            self.setup()
        t, st, fire = self.cfg.train, self.state, self.callbacks.fire
        fire(Event.INIT_STOP, st)
        if self.dist.world_size > 1:
            torch_dist.barrier()  # run_start on every rank together
        fire(Event.RUN_START, st)
        self._run_t0 = time.perf_counter()
        try:
            if t.eval_before_training and self.resume_from is None:
                self._eval_and_log()
            self._train_to_target()
        except BaseException as e:
            # The log still closes, then we re-raise: with run_stop aborted when nothing can
            # continue this run, else as interrupted (the resumed attempt closes it).
            st.stop_reason = "error"
            st.status = "interrupted" if self.control.resumable() else "aborted"
            st.derived["throughput"] = self.step_log.run_figures()
            try:
                fire(Event.RUN_STOP, st)
            except LogWriteError as again:   # the log's disk is still full: the first error
                if not isinstance(e, LogWriteError):   # is the one to report
                    print(f"also: {again}", file=sys.stderr, flush=True)
            if isinstance(e, LogWriteError):
                e.advise(self._after_a_failed_write())
            raise
        st.derived["throughput"] = self.step_log.run_figures()  # TFLOP/s, MFU of the run
        try:
            fire(Event.RUN_STOP, st)
        except LogWriteError as e:
            raise e.advise(self._after_a_failed_write()) from None
        return st

    def _after_a_failed_write(self) -> str:
        """What to do after a log write failed, as a rerun of the same command will do it."""
        c = self.control
        if c.resumable():
            return (f"free space and rerun the same command: it resumes from "
                    f"{c.last_checkpoint()} and continues this run's log (a line the full disk "
                    f"cut short is dropped)")
        why = ("this run writes no checkpoints (train.checkpoint_every_samples = 0)"
               if not c.checkpointing else "it wrote no checkpoint before the write failed")
        return (f"free space and run again: {why}, so it cannot be continued - the same "
                f"command starts a new run in a new run directory (run_and_time.sh makes one; "
                f"if you named this one with RUN_DIR or train.output_dir, name another)")

    @property
    def stop(self) -> Optional[str]:
        """Why the loop stops early ("diverged", "signal SIGx"), as run control decided."""
        return self.control.stop

    def _train_to_target(self) -> None:
        t, st, fire = self.cfg.train, self.state, self.callbacks.fire
        _, every = t.eval_cadence()
        it = self.balance_meter.wrap(iter(self.train_loader))
        self.control.agree_before_start(st)  # a signal during set-up: stop before step 1
        # A run resumed from a checkpoint taken right before an evaluation has no block left.
        skip_block = self.resume_from is not None and (
            st.samples >= self.next_eval or self._out_of_budget())
        while st.status is None and self.stop is None:
            if not skip_block:
                st.block_start_samples = st.samples
                st.block_samples = max(self.next_eval - st.samples, 0)
                fire(Event.BLOCK_START, st)
                while st.samples < self.next_eval and not self._out_of_budget() \
                        and self.stop is None:
                    with self._profiled(st.step + 1):
                        self.train_step(it)
                    st.epoch = self.train_loader.epoch
                    fire(Event.STEP, st)
                    if st.step % t.log_every_steps == 0 or \
                            self.control.is_checkpoint_step(st.samples):
                        self._log()
                self._log()
                fire(Event.BLOCK_STOP, st)
                if self.stop is not None:
                    break
            skip_block = False
            acc = self._eval_and_log()
            self.next_eval += every
            if acc >= t.target_mlm_accuracy:
                st.status, st.stop_reason = "success", "target"
            elif self._out_of_budget():
                st.status, st.stop_reason = "aborted", "budget"
        if self.stop is not None:
            st.stop_reason = self.stop
            if self.stop == "diverged":
                st.status = "aborted"
            else:  # a signal: the run continues when restarted, if there is a checkpoint
                st.status = "interrupted" if self.control.resumable() else "aborted"

    def _profiled(self, step: int):
        """train.profile_steps: this step under the profiler, when named (else nothing)."""
        return self.profiler.around(step) if self.profiler else contextlib.nullcontext()

    def _log(self) -> None:
        """A logging point (every rank, same step): reduce the steps since the last one -
        with this rank's stop request in the same all-reduce - then run control decides."""
        logged = self.step_log.flush(flags=[1.0 if signals.requested() else 0.0])
        if not logged:
            return
        self.state.logged_steps, self.state.last_step = logged, logged[-1]
        self.callbacks.fire(Event.LOG, self.state)
        self.control.at_log_point(logged, self.step_log.flags, self.state)

    def _params_finite(self) -> bool:
        """Whether every parameter is finite: an update from finite gradients can still
        overflow (lr 1e4). The same answer on every rank (the replicas are identical), so no
        collective; one pass and one host read, at checkpoint time only."""
        with torch.no_grad():
            return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def _eval_and_log(self) -> float:
        self.callbacks.fire(Event.EVAL_START, self.state)
        result = self.evaluate()
        self.state.eval_accuracy = result.accuracy
        self.callbacks.fire(Event.EVAL_STOP, self.state)
        return result.accuracy

    def _out_of_budget(self) -> bool:
        t = self.cfg.train
        if self.state.step >= t.max_steps:
            return True
        return t.max_samples_termination > 0 and self.state.samples >= t.max_samples_termination

    def close(self) -> None:
        for part in ("full_graph", "encoder_graphs", "balance_meter", "grad_sync",
                     "train_loader"):
            obj = getattr(self, part, None)
            if obj is not None and hasattr(obj, "close"):
                obj.close()
        before = getattr(self, "_stream_before", None)
        if before is not None:  # the run's own stream (train.cuda_graphs) ends with it
            torch.cuda.current_stream(self.dist.device).synchronize()
            torch.cuda.set_stream(before)
            self._stream_before = None
