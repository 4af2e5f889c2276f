"""The training loop: train BERT to a target masked-LM accuracy, evaluating on a fixed cadence.

``setup()`` finds a checkpoint to resume from, has runtime.train.build make the parts (model,
gradient sync, optimizer, schedule, loss scale, loaders) and restores them; ``fit()`` runs
callbacks' INIT_STOP → RUN_START → blocks of steps between evaluations → RUN_STOP and returns
the final RunState; ``close()`` runs on success and on error.

One step reads in one direction: ``train_step`` here (the step's batch counts and record)
-> its runner (runtime.train.runners: eager or replayed from CUDA graphs; the trainer never
asks which) -> the step body (runtime.train.step: forward, backward, gradient sync, optimizer)
-> the model or the graphs.

Owns: the set-up order (the runner's stream before the parts, the restore before the runner
is attached - each stage's result the next one's input), evaluation, the stopping rule
(target reached, budget spent), the logging cadence and the events callbacks observe, each
step's host record, and the run's progress (step, samples, epoch, the eval position;
runtime.train.progress keeps it in a checkpoint).
Never: builds parts (runtime.train.build), computes a step's device work (runtime.train.step),
decides about checkpoints, signals or divergence (runtime.train.run_control, asked at each
logging point), reads the environment (runtime.launch.env), writes MLPerf logs (submission's
callback does), knows shard files (loaders does), or reads a device value back on an
ordinary step (runtime.observe.step_log reduces the metrics every ``train.log_every_steps``
steps).
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
from runtime.config import Config
from runtime.events import CallbackList, Event, RunState
from runtime.launch import signals
from runtime.launch.dist import DistContext, all_reduce_sum, barrier, broadcast_object
from runtime.model.arithmetic import batch_flops, computed_tokens
from runtime.model.bert import run_batch
from runtime.observe.metrics import LogWriteError
from runtime.observe.step_log import StepRecord
from runtime.train import resume_rules
from runtime.train.build import (InitCheckpointError, Parts, build_model, build_observers,
                                 build_parts, describe)
from runtime.train.checkpoint import CheckpointManager
from runtime.train.progress import Progress
from runtime.train.run_control import RunControl, params_finite
from runtime.train.runners import Drive, runner_for, swapped
from runtime.train.step import DEVICE_KEYS, StepBody

__all__ = ["EvalResult", "InitCheckpointError", "Trainer", "build_model"]


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
                                  say=self._say, loss_scaled=lambda: self.loss_scale.enabled,
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
        d = cfg.data
        check_data_set(DataSetInfo.read(d.data_dir, d.max_seq_length, d.max_predictions_per_seq),
                       max_seq_length=d.max_seq_length,
                       max_predictions_per_seq=d.max_predictions_per_seq,
                       vocab_size=cfg.model.vocab_size)
        # Resume only where checkpoints are on: a run that writes none never picks one up;
        # and only from checkpoints of this run (or adopted explicitly: one run, one log).
        adopted = None
        if self.control.checkpointing:
            adopted = self.checkpoints.claim(cfg.train.output_dir, cfg.train.adopt_checkpoints)
            self.resume_from = self.control.resumed_from = self.checkpoints.latest()
        if self.resume_from is not None:
            ck = self.resume_from
            # a changed key that must match is refused before anything is built or trained
            self.config_changes = resume_rules.check(ck, self.cfg)
            self.state.resume = {"checkpoint": str(ck.path), "step": ck.step,
                                 "samples": ck.samples, "world_size": ck.world_size,
                                 "time": ck.manifest.get("time"), "adopted_from_run": adopted}
        self.callbacks.fire(Event.INIT_START, self.state)
        # how a step runs (train.cuda_graphs): the parts are built under the runner (on the
        # stream its mode runs on), which is attached to them once they are restored
        self.runner = runner_for(cfg.train.cuda_graphs, dist.device, dist.simulates_cuda)
        with self.runner.building():
            if parts is None:
                plan = self.resume_from.path / "bucket_plan.json" if self.resume_from else None
                parts = build_parts(cfg, dist,
                                    bucket_plan=plan if plan and plan.is_file() else None)
        self.model, self.grad_sync, self.optimizer = parts.model, parts.grad_sync, parts.optimizer
        self.schedule, self.base_lr = parts.schedule, parts.base_lr
        self.body = StepBody.of(parts, cfg, dist)
        self.batch_cost, self.timeline = parts.batch_cost, parts.timeline
        self.train_loader, self.eval_batches = parts.train_loader, parts.eval_batches
        t = cfg.train
        self.local_batch = cfg.local_batch_size(dist.world_size)
        self.control.base_lr = self.base_lr
        obs = build_observers(cfg, dist, self.model, self.batch_cost, self._say,
                              parts.numerics)
        self.balance_meter, self.step_log, self.profiler = obs.balance_meter, obs.step_log, \
            obs.profiler
        self.layout, self.peak, self.noise = obs.layout, obs.peak, self.step_log.noise
        self._run_t0: float | None = None  # this process's RUN_START, and the samples then
        self._run_samples0, self._run_first_step = self.state.samples, 1
        if self.train_loader is not None:
            self.state.train_samples = (self.train_loader.steps_per_epoch * self.local_batch
                                        * dist.world_size)  # samples one epoch trains
        self.state.eval_samples = int(all_reduce_sum(torch.tensor(
            [sum(b.num_sequences for b in self.eval_batches)], device=dist.device)).item())
        self.state.derived.update(describe(parts, cfg, dist))
        self.state.derived.update(attention_layout=self.layout, peak_tflops=self.peak.tflops,
                                  peak_source=self.peak.source,
                                  step_time_source=self.step_log.time_source)
        f8 = self.state.derived["fp8"]
        if f8["recipe"] != "none":  # said once, at set-up
            self._say(f"model.fp8='{f8['recipe']}': {f8['linears']} encoder Linears "
                      f"({', '.join(f8['roles'])}) in FP8"
                      + (f", emulated - {f8['why']}" if f8["emulated"] else f" - {f8['why']}"))
        if self.state.derived["optimizer_compiled"] is False:
            self._say(f"warning: the fused {cfg.optim.name} step runs eagerly (torch.compile "
                      f"failed: the rank log has why): same numbers, several times slower, "
                      f"with model-sized temporaries")
        self.next_eval = t.eval_cadence()[0]
        self.checkpoints.track(model=self.model, optimizer=self.optimizer,
                               loader=self.train_loader,
                               states={"progress": Progress(self), "loss_scale": self.loss_scale},
                               files={"bucket_plan.json": self._plan_file})
        start = self._resume() if self.resume_from is not None else 0  # (RNG states last)
        if self.profiler is not None:
            self._say(self.profiler.plan(start))
        self.runner.attach(Drive(self.body, self.balance_meter, self.schedule, t.max_steps,
                                 start_step=start))

    def _plan_file(self) -> bytes | None:
        plan = self.grad_sync.plan_json()
        return None if plan is None else (json.dumps(plan, indent=1) + "\n").encode()

    def _resume(self) -> int:
        """Restore the newest checkpoint; the step it was taken at."""
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
        return st.step

    # ---- one step -----------------------------------------------------------------------
    runner = None  # runtime.train.runners: how a step runs (train.cuda_graphs), from setup
    body: StepBody  # runtime.train.step: what a step computes, from setup

    @property
    def loss_scale(self):
        """The step's loss scale (runtime.optim.grad_scale; tests set one of their own)."""
        return self.body.loss_scale

    @loss_scale.setter
    def loss_scale(self, value) -> None:
        self.body.loss_scale = value

    def train_step(self, it) -> StepRecord:
        """One optimizer step, as its runner runs the step body (eager, or replayed from CUDA
        graphs: runtime.train.runners). No host read and no collective but the gradient
        allreduces: norms, the clip coefficient and the skip decision stay on the device."""
        t0, mark = time.perf_counter(), self.step_log.mark()
        if self.timeline:
            self.timeline.start_step()
        step, lr = self.state.step, self.schedule(self.state.step)
        batches: list = []  # this step's host batches (their token counts)
        values = self.runner.step(it, lr, batches)
        real = sum(b.num_real_tokens for b in batches)
        computed = sum(computed_tokens(self.layout, padded_tokens=b.num_padded_tokens,
                                       layout_tokens=b.layout.num_tokens if b.layout
                                       is not None else b.num_real_tokens) for b in batches)
        flops = sum(batch_flops(self.cfg.model, b) for b in batches)
        return self._record(step, lr, (t0, mark), real, computed, values, flops)

    def _record(self, step, lr, start, real, computed, values, flops=0.0) -> StepRecord:
        """The step's StepRecord, its device values unread; ``start``: (host time, device
        mark) when the step began (TFLOP/s and MFU divide by the device's time)."""
        t0, mark = start
        losses = values.pop("losses")
        device = {k: values.pop(k) for k in DEVICE_KEYS if k in values}
        extra = values
        self.state.step = step + 1
        self.state.samples += self.cfg.train.global_batch_size
        self.balance_meter.end_step(real, computed, flops)
        if self.timeline:
            extra.update(self.timeline.summary())
        now = time.perf_counter()
        elapsed = None if self._run_t0 is None else now - self._run_t0
        if elapsed:  # this process's samples over its time: a resume's earlier ones not counted
            extra["samples_per_s"] = (self.state.samples - self._run_samples0) / elapsed
        host = dict(step=step + 1, samples=self.state.samples, lr=lr, step_time_s=now - t0,
                    elapsed_s=elapsed,
                    real_tokens=real, computed_tokens=computed, model_flops=flops,
                    marks=(mark, self.step_log.mark()))
        return self.step_log.record(StepRecord(host, losses, device, extra))

    @contextlib.contextmanager
    def running_as(self, mode: str):
        """The steps inside the block run in ``mode`` (train.cuda_graphs), on the same parts
        and stream; the run's own runner after it (bench.gpu's graphs stage compares modes on
        one trainer)."""
        own = self.runner
        with swapped(own, mode, start_step=self.state.step) as other:
            self.runner = other
            try:
                yield other
            finally:
                self.runner = own

    # ---- evaluation ---------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> EvalResult:
        self.model.eval()
        counts = torch.zeros(2, dtype=torch.float64, device=self.dist.device)
        for batch in self.eval_batches:  # resident on the device since set-up
            with self.body.autocast():
                out = run_batch(self.model, batch, next_sentence=False)
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
        self._run_t0, self._run_samples0 = time.perf_counter(), st.samples
        self._run_first_step = st.step + 1
        if self.compiled_on_first_use:  # seconds to minutes with nothing else printed
            self._say(f"compiling {' and '.join(self.compiled_on_first_use)} on first use (the "
                      f"first step, and the first evaluation's graph): no progress until then")
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
                e.advise(self.control.after_a_failed_write())
            raise
        st.derived["throughput"] = self.step_log.run_figures()  # TFLOP/s, MFU of the run
        try:
            fire(Event.RUN_STOP, st)
        except LogWriteError as e:
            raise e.advise(self.control.after_a_failed_write()) from None
        return st

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
                        rec = self.train_step(it)
                    if st.step == self._run_first_step:
                        self._say_first_step(rec.host["step_time_s"])
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

    @property
    def compiled_on_first_use(self) -> list[str]:
        return self.cfg.compiles(on_first_use=True)

    def _say_first_step(self, seconds: float) -> None:
        every = self.cfg.train.log_every_steps
        self._say(f"step {self.state.step} done, the first of this process: {seconds:.1f} s"
                  + (", compiling included" if self.compiled_on_first_use else "")
                  + f"; a progress line every {every} step{'s' if every > 1 else ''}")

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
        return params_finite(self.model)

    def _eval_and_log(self) -> float:
        self.callbacks.fire(Event.EVAL_START, self.state)
        result = self.evaluate()
        self.state.eval_accuracy = result.accuracy
        self.callbacks.fire(Event.EVAL_STOP, self.state)
        return result.accuracy

    def _out_of_budget(self) -> bool:
        return self.cfg.train.out_of_budget(self.state.step, self.state.samples)

    def close(self) -> None:
        for part in ("balance_meter", "grad_sync", "train_loader", "runner"):  # runner last:
            obj = getattr(self, part, None)                 # the run's stream ends with it
            if obj is not None and hasattr(obj, "close"):
                obj.close()
