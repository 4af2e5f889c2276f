"""The training loop: train BERT to a target masked-LM accuracy, evaluating on a fixed cadence.

Built in a fixed order (torchtitan's lesson): device & process group (given) → seeds →
model → gradient sync → optimizer & schedule → data → callbacks see INIT_STOP → timed run.
``fit()`` returns the final RunState; ``close()`` runs on success and on error.

Owns: the step (forward, backward, one gradient sync, one optimizer update with the clip
coefficient and loss-scale unscale folded in, mixed precision), evaluation, the stopping rule,
the logging cadence and the events callbacks observe.
Never: reads the environment (runtime.env), writes MLPerf logs (submission's callback does),
knows shard files (loaders does), launches allreduces itself or asks which gradient sync it
has (runtime.grad_sync: one `GradSync` object), clips or scales gradients itself
(runtime.grad_scale), or reads a device value back on an ordinary step (runtime.step_log
reduces the metrics every ``train.log_every_steps`` steps).

Clipping (clip_mode 'global_after', the reference semantics): gradients are averaged across
ranks during backward, then ĝ = min(1, τ/‖ḡ‖)·ḡ is applied as the optimizer's ``grad_scale``
- no extra pass over the gradients, and the optimizer itself never clips, so nothing is
clipped twice. The before-allreduce modes clip inside the sync. A non-finite gradient norm
(fp16 overflow, or divergence in any precision) skips the update on the device
(``found_inf``); fp16's loss scale then halves.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from loaders import length_cost
from loaders.balance import PACKED_MODES
from loaders.dataset import TrainLoader, load_eval_batches
from runtime.balance_meter import BalanceMeter
from runtime.config import Config
from runtime.dist import DistContext, all_reduce_sum
from runtime.events import CallbackList, Event, RunState
from runtime.grad_scale import DynamicLossScale, step_multiplier
from runtime.grad_sync import build_grad_sync
from runtime.model import BertForPreTraining, load_pretrained, minilm_path
from runtime.optim import build_optimizer, set_lr
from runtime.schedules import build_schedule, scaled_lr
from runtime.step_log import StepLog, StepRecord
from runtime.timeline import StepTimeline


def build_model(cfg: Config) -> BertForPreTraining:
    """The model ``cfg.model`` describes (a ``BertConfig`` with the run's choices), with its
    initial weights (``model.init``)."""
    m = cfg.model
    model = BertForPreTraining(m.bert_config(), attention=m.attention,
                               packed=cfg.data.balance in PACKED_MODES)
    if m.init == "minilm":
        load_pretrained(model, minilm_path())
    elif m.init != "scratch":
        load_pretrained(model, m.init)
    return model


def batch_cost(cfg: Config, device_type: str) -> length_cost.LengthCost:
    """What one rank's batch costs on this model and device (``data.length_cost``)."""
    layout = length_cost.layout_for(cfg.model.attention, device_type)
    return length_cost.resolve(cfg.data.length_cost, length_cost.shape_of(cfg.model), layout)


@dataclass
class EvalResult:
    accuracy: float
    correct: int
    count: int


class Trainer:
    def __init__(self, cfg: Config, dist: DistContext, callbacks: CallbackList | None = None):
        self.cfg = cfg
        self.dist = dist
        self.callbacks = callbacks or CallbackList()
        self.state = RunState(config=cfg, rank=dist.rank, world_size=dist.world_size)
        self.train_loader: TrainLoader | None = None

    # ---- set-up -------------------------------------------------------------------------
    def setup(self) -> None:
        cfg, dist = self.cfg, self.dist
        self.callbacks.fire(Event.INIT_START, self.state)
        self.local_batch = cfg.local_batch_size(dist.world_size)
        self.accum = cfg.train.gradient_accumulation_steps
        torch.manual_seed(cfg.train.seed)  # same init on every rank
        model = build_model(cfg).to(dist.device)
        self.model = model
        t = cfg.train
        self.timeline = StepTimeline() if t.timeline else None
        self.grad_sync = build_grad_sync(
            model, t, world_size=dist.world_size, device=dist.device, group=dist.group,
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
        self.eval_batches = load_eval_batches(cfg.data.data_dir, dist.rank, dist.world_size,
                                              cfg.data.eval_batch_size)
        self.state.train_samples = (self.train_loader.steps_per_epoch * self.local_batch
                                    * dist.world_size)  # samples one epoch trains
        self.state.eval_samples = int(all_reduce_sum(torch.tensor(
            sum(len(b.next_sentence_labels) for b in self.eval_batches))).item())
        self.state.derived.update(self._derived())

    def _build_train_loader(self):
        """``TrainLoader`` (data.loader 'torch') or its DALI twin, balanced by data.balance;
        a bad bin / group / pack specification fails here, before anything trains."""
        cfg, dist = self.cfg, self.dist
        spec = cfg.data.balance_spec(dist.local_world_size, cost=self.batch_cost)
        kwargs = dict(verify=cfg.data.verify_checksums, prefetch=cfg.data.prefetch,
                      balance=spec)
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
        return dict(local_batch_size=self.local_batch, gradient_accumulation_steps=self.accum,
                    world_size=self.dist.world_size, lr=self.base_lr,
                    warmup_steps=s.warmup_steps, start_warmup_step=s.start_warmup_step,
                    total_steps=s.total_steps, eval_iter_start_samples=start,
                    eval_iter_samples=every,
                    parameters=sum(p.numel() for p in self.model.parameters()))

    # ---- one step -----------------------------------------------------------------------
    def _autocast(self):
        p = self.cfg.train.precision
        if p == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if p == "bf16" else torch.float16
        return torch.autocast(self.dist.device.type, dtype=dtype)

    def _micro_batches(self, it):
        for _ in range(self.accum):
            yield next(it).to(self.dist.device, non_blocking=True)

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
            self.timeline.start_step(t0)
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
                                   next_sentence_labels=batch.next_sentence_labels)
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
        for batch in self.eval_batches:
            batch = batch.to(self.dist.device, non_blocking=True)
            with self._autocast():
                out = self.model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                                 masked_lm_labels=batch.masked_lm_labels)
            counts += torch.stack([out.mlm_correct.double(), torch.as_tensor(
                out.mlm_count, dtype=torch.float64, device=counts.device)])
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
        if t.eval_before_training:
            self._eval_and_log()
        try:
            self._train_to_target()
        except BaseException:
            st.status = "aborted"  # the log still closes with run_stop, then we re-raise
            fire(Event.RUN_STOP, st)
            raise
        fire(Event.RUN_STOP, st)
        return st

    def _train_to_target(self) -> None:
        t, st, fire = self.cfg.train, self.state, self.callbacks.fire
        first, every = t.eval_cadence()
        next_eval = first
        it = self.balance_meter.wrap(iter(self.train_loader))
        while st.status is None:
            st.block_start_samples = st.samples
            st.block_samples = max(next_eval - st.samples, 0)
            fire(Event.BLOCK_START, st)
            while st.samples < next_eval and not self._out_of_budget():
                self.train_step(it)
                st.epoch = self.train_loader.epoch
                fire(Event.STEP, st)
                if st.step % t.log_every_steps == 0:
                    self._log()
            self._log()
            fire(Event.BLOCK_STOP, st)
            acc = self._eval_and_log()
            next_eval += every
            if acc >= t.target_mlm_accuracy:
                st.status = "success"
            elif self._out_of_budget():
                st.status = "aborted"

    def _log(self) -> None:
        """A logging point (every rank, same step): reduce the steps since the last one."""
        logged = self.step_log.flush()
        if logged:
            self.state.logged_steps, self.state.last_step = logged, logged[-1]
            self.callbacks.fire(Event.LOG, self.state)

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
