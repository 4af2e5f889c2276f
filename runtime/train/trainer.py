"""The training loop: train BERT to a target masked-LM accuracy, evaluating on a fixed cadence.

Built in a fixed order (torchtitan's lesson): device & process group (given) → seeds →
model → gradient sync → optimizer & schedule → data → callbacks see INIT_STOP → timed run.
``fit()`` returns the final RunState; ``close()`` runs on success and on error.

Owns: the step (forward, backward, one gradient sync, one optimizer update with the clip
coefficient and loss-scale unscale folded in, mixed precision), evaluation, the stopping rule,
the logging cadence and the events callbacks observe; and, at logging points only, the three
run-level decisions every rank must take at the same step: write a checkpoint
(``train.checkpoint_every_samples``, through runtime.train.checkpoint), stop on a signal
(runtime.launch.signals: a stop request rides as a flag in the logging point's existing all-reduce)
and stop on divergence (``train.max_nonfinite_steps``). A resumed run (a complete checkpoint
in ``train.checkpoint_dir``) restores every part at the end of ``setup`` and re-installs the
bucket plan the run was using before the sync is built.
Never: reads the environment (runtime.launch.env), writes MLPerf logs (submission's callback does),
knows shard files (loaders does), launches allreduces itself or asks which gradient sync it
has (runtime.grad_sync: one `GradSync` object), clips or scales gradients itself
(runtime.optim.grad_scale), or reads a device value back on an ordinary step (runtime.observe.step_log
reduces the metrics every ``train.log_every_steps`` steps).

Clipping (clip_mode 'global_after', the reference semantics): gradients are averaged across
ranks during backward, then ĝ = min(1, τ/‖ḡ‖)·ḡ is applied as the optimizer's ``grad_scale``
- no extra pass over the gradients, and the optimizer itself never clips, so nothing is
clipped twice. The before-allreduce modes clip inside the sync. A non-finite gradient norm
(fp16 overflow, or divergence in any precision) skips the update on the device
(``found_inf``); fp16's loss scale then halves.

Detection latency of the stop decisions: a signal or a run of non-finite steps is acted on at
the next logging point - at most ``train.log_every_steps`` steps later (or at the end of the
block, before an evaluation). A checkpoint is written at the step that reaches each multiple
of ``train.checkpoint_every_samples`` (that step is made a logging point), never from a
window with a non-finite step in it (the next logging point tries again), so the checkpoints
kept are from before a divergence.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist

from loaders import length_cost
from loaders.balance import PACKED_MODES
from loaders.dataset import DataSetInfo, TrainLoader, check_data_set, load_eval_batches
from loaders.shards import Limits
from runtime.observe.balance_meter import BalanceMeter
from runtime.launch import signals
from runtime.train.checkpoint import CheckpointManager
from runtime.config import Config
from runtime.launch.dist import DistContext, all_reduce_sum, barrier, broadcast_object
from runtime.events import CallbackList, Event, RunState
from runtime.optim.grad_scale import DynamicLossScale, step_multiplier
from runtime.grad_sync import build_grad_sync
from runtime.model.bert import BertForPreTraining
from runtime.model.hf import load_hf_state_dict, minilm_path, read_state_dict
from runtime.optim.optimizers import build_optimizer, set_lr
from runtime.optim.schedules import build_schedule, scaled_lr
from runtime.observe.step_log import StepLog, StepRecord
from runtime.observe.timeline import StepTimeline


def build_model(cfg: Config) -> BertForPreTraining:
    """The model ``cfg.model`` describes (a ``BertConfig`` with the run's choices), with its
    initial weights (``model.init``)."""
    m = cfg.model
    model = BertForPreTraining(m.bert_config(), attention=m.attention,
                               packed=cfg.data.balance in PACKED_MODES)
    if m.init != "scratch":
        path = minilm_path() if m.init == "minilm" else m.init
        state = read_state_dict(path)
        check_finite(state, f"model.init = {m.init!r} ({path})")
        load_hf_state_dict(model, state)
    return model


class InitCheckpointError(ValueError):
    """An initial checkpoint that would poison training (model.init)."""

    exit_code = 2


def check_finite(state: dict, where: str) -> None:
    """Refuse a state dict holding NaN or ±inf, naming the tensors (a model trained from one
    produces NaN from its first step, which the divergence guard would only stop later)."""
    bad = [f"{k} ({int((~torch.isfinite(v)).sum())} of {v.numel()} values)"
           for k, v in state.items()
           if torch.is_tensor(v) and v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise InitCheckpointError(
            f"{where}: {len(bad)} tensor(s) hold NaN or inf: {', '.join(bad[:10])}"
            + (" ..." if len(bad) > 10 else "") + "; it comes from a diverged run or a damaged "
            "file - use an earlier checkpoint")


def batch_cost(cfg: Config, device_type: str) -> length_cost.LengthCost:
    """What one rank's batch costs on this model and device (``data.length_cost``)."""
    layout = length_cost.layout_for(cfg.model.attention, device_type)
    return length_cost.resolve(cfg.data.length_cost, length_cost.shape_of(cfg.model), layout)


@dataclass
class EvalResult:
    accuracy: float
    correct: int
    count: int


class Progress:
    """The trainer's own counters as one checkpoint part: step, samples, epoch, the eval and
    checkpoint positions, the divergence guard's counts, the bucket plan in use and the
    resolved config (for the record: a resume says which values changed)."""

    def __init__(self, trainer: "Trainer"):
        self.t = trainer

    def state_dict(self) -> dict:
        t, st = self.t, self.t.state
        plan = getattr(t.grad_sync, "plan", None)
        return {"step": st.step, "samples": st.samples, "epoch": st.epoch,
                "eval_accuracy": st.eval_accuracy, "next_eval": t.next_eval,
                "next_checkpoint": t.next_checkpoint, "guard": dict(t.guard),
                "world_size": t.dist.world_size,
                "bucket_plan": None if plan is None else json.dumps(
                    plan.to_json(t.grad_sync.sizes)),
                "config": json.dumps(t.cfg.to_dict(), sort_keys=True)}

    def load_state_dict(self, state: dict) -> None:
        t, st = self.t, self.t.state
        st.step, st.samples, st.epoch = int(state["step"]), int(state["samples"]), int(state["epoch"])
        st.eval_accuracy = state["eval_accuracy"]
        t.next_eval, t.next_checkpoint = int(state["next_eval"]), int(state["next_checkpoint"])
        t.guard.update(state["guard"])
        saved = json.loads(state["config"])
        t.config_changes = sorted(
            f"{section}.{key}: {value!r} -> {getattr(getattr(t.cfg, section), key)!r}"
            for section, table in saved.items() if hasattr(t.cfg, section)
            for key, value in table.items()
            if hasattr(getattr(t.cfg, section), key)
            and json.loads(json.dumps(getattr(getattr(t.cfg, section), key))) != value)


class Trainer:
    def __init__(self, cfg: Config, dist: DistContext, callbacks: CallbackList | None = None,
                 log=None):
        self.cfg = cfg
        self.dist = dist
        self.callbacks = callbacks or CallbackList()
        self.state = RunState(config=cfg, rank=dist.rank, world_size=dist.world_size)
        self.train_loader: TrainLoader | None = None
        self._say = log or (lambda msg: print(msg, flush=True) if dist.rank == 0 else None)
        self.grad_sync = None
        self.next_eval: int = 0
        self.next_checkpoint: int = 0
        self.guard = {"run": 0, "nonfinite_steps": 0, "overflow_skips": 0, "first_bad_step": 0,
                      "scale_before": float(cfg.train.init_loss_scale)}
        self.stop: str | None = None       # why the loop stops early: "signal SIGx", "diverged"
        self.config_changes: list[str] = []
        t = cfg.train
        self.checkpoints = CheckpointManager(
            t.checkpoint_path(), keep=t.checkpoint_keep, rank=dist.rank,
            world_size=dist.world_size, barrier=barrier, broadcast=broadcast_object,
            log=self._say)
        self.resume_from = None

    # ---- set-up -------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        # The data set against the config first: a wrong directory or max_pred fails in
        # milliseconds, before a model is built.
        check_data_set(DataSetInfo.read(cfg.data.data_dir), max_seq_length=cfg.data.max_seq_length,
                       max_predictions_per_seq=cfg.data.max_predictions_per_seq,
                       vocab_size=cfg.model.vocab_size)
        self.limits = Limits(cfg.model.vocab_size, cfg.data.max_seq_length,
                             cfg.model.type_vocab_size)
        # Resume only where checkpoints are on: a run that writes none never picks one up.
        if cfg.train.checkpoint_every_samples > 0:
            self.resume_from = self.checkpoints.latest()
        if self.resume_from is not None:
            ck = self.resume_from
            self.state.resume = {"checkpoint": str(ck.path), "step": ck.step,
                                 "samples": ck.samples, "world_size": ck.world_size,
                                 "time": ck.manifest.get("time")}
        self.callbacks.fire(Event.INIT_START, self.state)
        self.local_batch = cfg.local_batch_size(dist.world_size)
        self.accum = cfg.train.gradient_accumulation_steps
        torch.manual_seed(cfg.train.seed)  # same init on every rank
        model = build_model(cfg).to(dist.device)
        self.model = model
        t = cfg.train
        self.timeline = StepTimeline(dist.device) if t.timeline else None
        self.grad_sync = build_grad_sync(
            model, self._sync_config(t), world_size=dist.world_size, device=dist.device,
            group=dist.group,
            timeline=self.timeline,
            tokens_per_step=self.local_batch * self.accum * cfg.data.max_seq_length)
        self.net = self.grad_sync.module  # what forward is called on (DDP's wrapper or model)
        self.base_lr = scaled_lr(cfg.optim.lr_scaling, cfg.optim.lr,
                                 cfg.optim.base_global_batch_size, t.global_batch_size) \
            if cfg.optim.lr_scaling != "none" else cfg.optim.lr
        self.optimizer = build_optimizer(cfg.optim.name, list(model.named_parameters()),
                                         **self._optim_hparams())
        self.grad_sync.on_layout(self.optimizer.share_gradients)  # one gradient buffer
        s = cfg.schedule
        self.schedule = build_schedule(s.name, base_lr=self.base_lr, warmup_steps=s.warmup_steps,
                                       start_warmup_step=s.start_warmup_step,
                                       total_steps=s.total_steps, power=s.power) \
            if s.name == "poly" else build_schedule(s.name, base_lr=self.base_lr)
        self.loss_scale = DynamicLossScale(t.init_loss_scale, enabled=t.precision == "fp16",
                                           device=dist.device)
        self.clip_after = t.clip_mode == "global_after" and t.max_grad_norm > 0
        torch.manual_seed(t.seed * 1000 + dist.rank)  # dropout differs per rank
        self.batch_cost = batch_cost(cfg, dist.device.type)
        self.train_loader = self._build_train_loader()
        self.balance_meter = BalanceMeter(model, dist.device, dist.world_size,
                                          cost=self.batch_cost)
        self.step_log = StepLog(dist.world_size, self.balance_meter)
        self._run_t0: float | None = None
        # The eval batches stay on the device: evaluation counts in time-to-train, and the
        # same few MB would otherwise cross PCIe at every evaluation.
        self.eval_batches = [b.to(dist.device) for b in load_eval_batches(
            cfg.data.data_dir, dist.rank, dist.world_size, cfg.data.eval_batch_size,
            limits=self.limits)]
        self.state.train_samples = (self.train_loader.steps_per_epoch * self.local_batch
                                    * dist.world_size)  # samples one epoch trains
        self.state.eval_samples = int(all_reduce_sum(torch.tensor(
            [sum(b.num_sequences for b in self.eval_batches)], device=dist.device)).item())
        self.state.derived.update(self._derived())
        if self.state.derived["optimizer_compiled"] is False:
            self._say(f"warning: the fused {cfg.optim.name} step runs eagerly (torch.compile "
                      f"failed: the rank log has why): same numbers, several times slower, "
                      f"with model-sized temporaries")
        self.next_eval = t.eval_cadence()[0]
        self.next_checkpoint = t.checkpoint_every_samples
        self.checkpoints.track(model=self.model, optimizer=self.optimizer,
                               loader=self.train_loader,
                               states={"progress": Progress(self), "loss_scale": self.loss_scale},
                               files={"bucket_plan.json": self._plan_file})
        if self.resume_from is not None:  # last: the RNG states are restored here
            self._resume()

    def _sync_config(self, t):
        """The train config the gradient sync is built from: a resumed run gets the bucket
        plan it was using (the first-step re-cut already happened, in the measured order),
        so its buffer layout - and the fused optimizer's - is the uninterrupted run's."""
        ck = self.resume_from
        if ck is None or t.grad_sync != "buckets" or t.bucket_plan:
            return t
        plan = ck.path / "bucket_plan.json"
        return dataclasses.replace(t, bucket_plan=str(plan)) if plan.is_file() else t

    def _plan_file(self) -> bytes | None:
        plan = getattr(self.grad_sync, "plan", None)
        if plan is None:
            return None
        return (json.dumps(plan.to_json(self.grad_sync.sizes), indent=1) + "\n").encode()

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

    def _build_train_loader(self):
        """``TrainLoader`` (data.loader 'torch') or its DALI twin, balanced by data.balance;
        a bad bin / group / pack specification fails here, before anything trains."""
        cfg, dist = self.cfg, self.dist
        spec = cfg.data.balance_spec(dist.local_world_size, cost=self.batch_cost)
        kwargs = dict(verify=cfg.data.verify_checksums, prefetch=cfg.data.prefetch,
                      balance=spec, limits=self.limits)
        args = (cfg.data.data_dir, dist.rank, dist.world_size, self.local_batch, cfg.train.seed)
        if cfg.data.loader == "dali":
            from loaders.dali_pipeline import DaliTrainLoader  # DALI is imported only when used
            device_id = dist.device.index if dist.device.type == "cuda" else None
            return DaliTrainLoader(*args, device_id=device_id, **kwargs)
        return TrainLoader(*args, **kwargs)

    def _optim_hparams(self) -> dict:
        o = self.cfg.optim
        common = dict(lr=self.base_lr, weight_decay=o.weight_decay, backend=o.backend)
        if o.name == "lars":
            return dict(common, momentum=o.momentum, trust_coefficient=o.trust_coefficient)
        common.update(beta1=o.beta1, beta2=o.beta2, eps=o.eps, bias_correction=o.bias_correction)
        if o.name == "lamb":
            common.update(use_nvlamb=o.use_nvlamb, trust_clamp=o.trust_clamp)
        return common

    def _derived(self) -> dict:
        s = self.cfg.schedule
        start, every = self.cfg.train.eval_cadence()
        opt = self.optimizer
        binding = getattr(opt, "flat_binding", None)
        return dict(local_batch_size=self.local_batch, gradient_accumulation_steps=self.accum,
                    world_size=self.dist.world_size, lr=self.base_lr,
                    warmup_steps=s.warmup_steps, start_warmup_step=s.start_warmup_step,
                    total_steps=s.total_steps, eval_iter_start_samples=start,
                    eval_iter_samples=every,
                    parameters=sum(p.numel() for p in self.model.parameters()),
                    optimizer_backend=opt.backend,
                    optimizer_compiled=None if binding is None else binding.compiled,
                    optimizer_compile_s=round(opt.compile_seconds, 3))

    # ---- one step -----------------------------------------------------------------------
    def _autocast(self):
        p = self.cfg.train.precision
        if p == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if p == "bf16" else torch.float16
        return torch.autocast(self.dist.device.type, dtype=dtype)

    def _micro_batches(self, it):
        for _ in range(self.accum):
            yield self._to_device(next(it))

    def _to_device(self, batch):
        """The batch on the device, copied without making the host wait. From pageable
        memory a CUDA copy synchronises the stream first (non_blocking or not), so on CUDA
        the batch goes through pinned memory (the caching host allocator keeps each block
        until its copy is done). With no other host sync in the step, the host collates the
        next batch while the GPU still runs this one."""
        if self.dist.device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(self.dist.device, non_blocking=True)

    @property
    def unpadded(self) -> bool:
        return self.cfg.model.attention == "unpadded"

    def _span(self, name: str):
        """A timeline span (train.timeline), else nothing."""
        return self.timeline.span(name) if self.timeline else contextlib.nullcontext()

    def train_step(self, it) -> StepRecord:
        """One optimizer step. No host read and no collective but the gradient allreduces:
        norms, the clip coefficient and the skip decision stay on the device."""
        t0 = time.perf_counter()
        if self.timeline:
            self.timeline.start_step()
        step, sync, scale = self.state.step, self.grad_sync, self.loss_scale
        lr = self.schedule(step)
        set_lr(self.optimizer, lr)
        self.net.train()
        sync.begin_step(scale.scale)
        losses = torch.zeros(3, device=self.dist.device)
        real = computed = 0
        for i, batch in enumerate(self._micro_batches(it)):
            with sync.no_sync() if i < self.accum - 1 else contextlib.nullcontext():
                with self._span("forward"), self._autocast():
                    out = self.net(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                                   masked_lm_labels=batch.masked_lm_labels,
                                   next_sentence_labels=batch.next_sentence_labels,
                                   layout=batch.layout)
                with self._span("backward"):
                    (out.loss * scale.loss_multiplier(self.accum)).backward()
            losses += torch.stack([out.loss.detach(), out.mlm_loss.detach(),
                                   out.nsp_loss.detach()]).float() / self.accum
            real += batch.num_real_tokens
            computed += batch.num_real_tokens if self.unpadded else batch.num_padded_tokens
        with self._span("sync"):  # the last launches and the wait for every allreduce
            report = sync.finish()
        with self._span("optimizer"):
            grad_scale, found_inf, coef, norm = step_multiplier(
                sync.grad_norm(), scale.scale, max_norm=self.cfg.train.max_grad_norm,
                clip=self.clip_after)
            self.optimizer.step(grad_scale=grad_scale, found_inf=found_inf)
            scale.update(~found_inf)
            sync.zero_grad()
        return self._record(step, lr, t0, losses, real, computed, dict(
            grad_norm=norm, clip_coef=coef * report.clip_coef, skipped=found_inf,
            loss_scale=scale.scale), report.metrics())

    def _record(self, step, lr, t0, losses, real, computed, device, extra) -> StepRecord:
        self.state.step = step + 1
        self.state.samples += self.cfg.train.global_batch_size
        self.balance_meter.end_step(real, computed)
        if self.timeline:
            extra.update(self.timeline.summary())
        now = time.perf_counter()
        host = dict(step=step + 1, samples=self.state.samples, lr=lr, step_time_s=now - t0,
                    elapsed_s=None if self._run_t0 is None else now - self._run_t0,
                    real_tokens=real, computed_tokens=computed)
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
        except BaseException:
            # The log still closes, then we re-raise: with run_stop aborted when nothing can
            # continue this run, else as interrupted (the resumed attempt closes it).
            st.stop_reason = "error"
            st.status = "interrupted" if self._resumable() else "aborted"
            fire(Event.RUN_STOP, st)
            raise
        fire(Event.RUN_STOP, st)
        return st

    def _resumable(self) -> bool:
        """A checkpoint of this run exists: it can continue from there."""
        return self.checkpoints.last_saved is not None or self.resume_from is not None

    def _train_to_target(self) -> None:
        t, st, fire = self.cfg.train, self.state, self.callbacks.fire
        _, every = t.eval_cadence()
        it = self.balance_meter.wrap(iter(self.train_loader))
        self._agree_on_stop()  # a signal during set-up: stop before the first step
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
                    self.train_step(it)
                    st.epoch = self.train_loader.epoch
                    fire(Event.STEP, st)
                    if st.step % t.log_every_steps == 0 or self._checkpoint_step():
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
                st.status = "interrupted" if self._resumable() else "aborted"

    def _checkpoint_step(self) -> bool:
        """This step reached a multiple of train.checkpoint_every_samples."""
        every, samples = self.cfg.train.checkpoint_every_samples, self.state.samples
        return every > 0 and samples >= self.next_checkpoint > samples - \
            self.cfg.train.global_batch_size

    def _log(self) -> None:
        """A logging point (every rank, same step): reduce the steps since the last one -
        with this rank's stop request in the same all-reduce - then the run-level decisions:
        divergence, a signal, a checkpoint."""
        logged = self.step_log.flush(flags=[1.0 if signals.requested() else 0.0])
        if not logged:
            return
        self.state.logged_steps, self.state.last_step = logged, logged[-1]
        self.callbacks.fire(Event.LOG, self.state)
        finite = self._guard(logged)
        if self.stop == "diverged":
            return
        if self.step_log.flags[0] > 0:
            self._stop_on_signal(finite)
        elif self.cfg.train.checkpoint_every_samples > 0 and finite \
                and self.state.samples >= self.next_checkpoint:
            self._save()

    def _guard(self, logged) -> bool:
        """Count non-finite steps (identical on every rank: the losses are all-reduced, the
        skip flag comes from the averaged gradient); returns whether the window was finite."""
        g, fp16 = self.guard, self.loss_scale.enabled
        window_finite = True
        for m in logged:
            loss_bad = not math.isfinite(m.loss)
            if fp16:
                overflow = m.skipped and not loss_bad
                g["overflow_skips"] += int(overflow)
                bad = loss_bad or (overflow and g["scale_before"] <= 1.0)
                g["scale_before"] = float(m.loss_scale)
            else:
                bad = loss_bad or m.skipped
            window_finite = window_finite and not (loss_bad or m.skipped)
            if bad:
                g["first_bad_step"] = g["first_bad_step"] if g["run"] else m.step
                g["run"] += 1
                g["nonfinite_steps"] += 1
            else:
                g["run"] = 0
        limit = self.cfg.train.max_nonfinite_steps
        if g["run"] > limit:
            self.stop = "diverged"
            last = self._last_checkpoint()
            kept = (f"the last checkpoint, {last} (never written from a non-finite step), "
                    f"is kept: start a new run from its weights with model.init={last}"
                    if last else "there is no checkpoint of this run")
            self._say(f"divergence: {g['run']} consecutive steps from step "
                      f"{g['first_bad_step']} to {logged[-1].step} had a non-finite loss or "
                      f"gradient (train.max_nonfinite_steps = {limit}; loss now "
                      f"{logged[-1].loss}, lr {logged[-1].lr:.3g}); stopping the run with "
                      f"status aborted. Lower optim.lr (base {self.base_lr:.3g}) or check "
                      f"the data; {kept}")
        return window_finite

    def _stop_on_signal(self, finite: bool) -> None:
        """Every rank, at the same logging point: checkpoint (when enabled) and stop."""
        mine = signals.requested()
        self.stop = f"signal {signals.name(mine)}" if mine else "signal (on another rank)"
        st, every = self.state, self.cfg.train.checkpoint_every_samples
        last = self._last_checkpoint()
        if every <= 0:
            where = "no checkpoint (train.checkpoint_every_samples = 0): a rerun starts over"
        elif self.resume_from is not None and st.step == self.resume_from.step \
                and self.checkpoints.last_saved is None:
            where = f"nothing trained since {last}, which a rerun resumes from"
        elif not finite:
            where = f"no new checkpoint (the last steps were not finite); the last one is {last}"
        else:
            saved = self._save()
            where = (f"checkpoint {saved} - rerun the same command to resume" if saved else
                     f"no new checkpoint (the model is not finite); the last one is {last}")
        self._say(f"stopping on {self.stop} at step {st.step} ({st.samples} samples): {where}")

    def _last_checkpoint(self):
        return self.checkpoints.last_saved or (
            self.resume_from.path if self.resume_from is not None else None)

    def _agree_on_stop(self) -> None:
        """One all-reduce before the first step: did any rank get a stop signal during
        set-up? (Steps after this agree at logging points.)"""
        flag = torch.tensor([1.0 if signals.requested() else 0.0], device=self.dist.device)
        if all_reduce_sum(flag).item() > 0:
            self._stop_on_signal(finite=True)

    def _params_finite(self) -> bool:
        """Whether every parameter is finite: an update from finite gradients can still
        overflow (lr 1e4). The same answer on every rank (the replicas are identical), so no
        collective; one pass and one host read, at checkpoint time only."""
        with torch.no_grad():
            bad = [p for p in self.model.parameters() if not torch.isfinite(p).all()]
        return not bad

    def _save(self) -> Path | None:
        st, every = self.state, self.cfg.train.checkpoint_every_samples
        if every > 0:
            self.next_checkpoint = (st.samples // every + 1) * every
        if not self._params_finite():
            self._say(f"checkpoint: not written at step {st.step}: the model holds non-finite "
                      f"values (the last update diverged); the last good one is "
                      f"{self._last_checkpoint()}")
            return None
        path = self.checkpoints.save(st.step, st.samples)
        self._say(f"checkpoint: {path} (step {st.step}, {st.samples} samples, "
                  f"{self.checkpoints.save_seconds[-1]:.2f} s)")
        return path

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
        for part in ("balance_meter", "grad_sync", "train_loader"):
            obj = getattr(self, part, None)
            if obj is not None and hasattr(obj, "close"):
                obj.close()
