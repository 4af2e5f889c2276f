"""The training loop: train BERT to a target masked-LM accuracy, evaluating on a fixed cadence.

Built in a fixed order (torchtitan's lesson): device & process group (given) → seeds →
model → optimizer & schedule → data → callbacks see INIT_STOP → timed run. ``fit()`` returns
the final RunState; ``close()`` runs on success and on error.

Owns: the step (forward, backward, gradient averaging, clipping folded into the optimizer
step, mixed precision), evaluation, the stopping rule and the events callbacks observe.
Never: reads the environment (runtime.env), writes MLPerf logs (submission's callback does),
knows shard files (loaders does), launches allreduces itself (runtime.buckets or DDP do).

Gradient averaging (train.grad_sync): 'buckets' (default) - the runtime's gradient buckets
(runtime.buckets) reduce bucket by bucket during backward and clip before the allreduce for
clip_mode local_before / bucket_before; 'ddp' - torch DDP with its default buckets.

Clipping (clip_mode 'global_after', the reference semantics): gradients are averaged across
ranks during backward, then ĝ = min(1, τ/‖ḡ‖)·ḡ is applied as the optimizer's
``grad_scale`` - no extra pass over the gradients, and the optimizer itself never clips, so
nothing is clipped twice. The before-allreduce modes clip inside the buckets and pass 1.0.
fp16 folds the loss-scale unscale into the same multiplier and skips the step when the norm
is not finite.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from loaders.balance import BalanceSpec
from loaders.dataset import TrainLoader, load_eval_batches
from runtime.balance import BalanceMeter
from runtime.config import Config
from runtime.buckets import GradientBuckets, SyncReport, build_gradient_buckets
from runtime.dist import DistContext, all_reduce_sum, broadcast_tensors
from runtime.events import CallbackList, Event, RunState, StepMetrics
from runtime.model import BertConfig, BertForPreTraining, load_pretrained, minilm_path
from runtime.optim import build_optimizer
from runtime.schedules import build_schedule, scaled_lr
from runtime.timeline import StepTimeline
from kernels.optim_reference import CLIP_EPS, global_grad_norm


def build_model(cfg: Config) -> BertForPreTraining:
    m = cfg.model
    bert_cfg = BertConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_hidden_layers,
        num_attention_heads=m.num_attention_heads, intermediate_size=m.intermediate_size,
        max_position_embeddings=m.max_position_embeddings, type_vocab_size=m.type_vocab_size,
        hidden_dropout_prob=m.hidden_dropout_prob,
        attention_probs_dropout_prob=m.attention_probs_dropout_prob,
        layer_norm_eps=m.layer_norm_eps, initializer_range=m.initializer_range)
    model = BertForPreTraining(bert_cfg, attention=m.attention,
                               packed=cfg.data.balance == "pack")
    if m.init == "minilm":
        load_pretrained(model, minilm_path())
    elif m.init != "scratch":
        load_pretrained(model, m.init)
    return model


def balance_spec(cfg: Config, ranks_per_node: int) -> BalanceSpec:
    """The loaders' balancing spec from the data.* keys (group_size 0 = ranks per node)."""
    d = cfg.data
    return BalanceSpec(mode=d.balance, bin_edges=tuple(d.bin_edges), num_bins=d.num_bins,
                       group_size=d.group_size or ranks_per_node,
                       pack_length=d.pack_length or d.max_seq_length)


class DynamicLossScale:
    """fp16 dynamic loss scaling: halve on inf/nan (the step is skipped), double after
    ``growth_interval`` good steps. Unscaling is folded into the optimizer's grad_scale."""

    def __init__(self, init_scale: float, growth_interval: int = 2000, enabled: bool = True):
        self.scale = init_scale if enabled else 1.0
        self.enabled = enabled
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if not finite:
            self.scale = max(self.scale / 2.0, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0


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
        self.net = self._wrap(model)
        self.base_lr = scaled_lr(cfg.optim.lr_scaling, cfg.optim.lr,
                                 cfg.optim.base_global_batch_size, cfg.train.global_batch_size) \
            if cfg.optim.lr_scaling != "none" else cfg.optim.lr
        self.optimizer = build_optimizer(cfg.optim.name, list(model.named_parameters()),
                                         **self._optim_hparams())
        s = cfg.schedule
        self.schedule = build_schedule(s.name, base_lr=self.base_lr, warmup_steps=s.warmup_steps,
                                       start_warmup_step=s.start_warmup_step,
                                       total_steps=s.total_steps, power=s.power) \
            if s.name == "poly" else build_schedule(s.name, base_lr=self.base_lr)
        self.loss_scale = DynamicLossScale(cfg.train.init_loss_scale,
                                           enabled=cfg.train.precision == "fp16")
        torch.manual_seed(cfg.train.seed * 1000 + dist.rank)  # dropout differs per rank
        self.train_loader = self._build_train_loader()
        self.balance_meter = BalanceMeter(model, dist.device, dist.world_size,
                                          unpadded=cfg.model.attention == "unpadded")
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
        kwargs = dict(verify=cfg.data.verify_checksums, prefetch=cfg.data.prefetch,
                      balance=balance_spec(cfg, dist.local_world_size))
        args = (cfg.data.data_dir, dist.rank, dist.world_size, self.local_batch, cfg.train.seed)
        if cfg.data.loader == "dali":
            from loaders.dali_pipeline import DaliTrainLoader  # DALI is imported only when used
            device_id = dist.device.index if dist.device.type == "cuda" else None
            return DaliTrainLoader(*args, device_id=device_id, **kwargs)
        return TrainLoader(*args, **kwargs)

    def _wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the step calls: DDP (grad_sync 'ddp', several ranks) or the model itself,
        its gradients then averaged by the runtime's buckets (``self.buckets``)."""
        t = self.cfg.train
        self.timeline = StepTimeline() if t.timeline else None
        self.buckets: GradientBuckets | None = None
        if t.grad_sync == "ddp":
            if self.dist.world_size == 1:
                return model
            ids = [self.dist.device.index] if self.dist.device.type == "cuda" else None
            return DistributedDataParallel(model, device_ids=ids)
        broadcast_tensors(list(model.parameters()) + list(model.buffers()))  # as DDP does
        self.buckets = build_gradient_buckets(model, t, self.dist.world_size, self.dist.group,
                                              self.timeline)
        return model

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

    def _span(self, name: str):
        """A timeline span (train.timeline), else nothing."""
        return self.timeline.span(name) if self.timeline else contextlib.nullcontext()

    def _no_sync(self):
        """Accumulate without averaging: every micro-step but the last."""
        if self.buckets is not None:
            return self.buckets.no_sync()
        return self.net.no_sync() if self.net is not self.model else contextlib.nullcontext()

    def train_step(self, it) -> StepMetrics:
        t0 = time.perf_counter()
        if self.timeline:
            self.timeline.start_step(t0)
        self.net.train()
        step = self.state.step
        lr = self.schedule(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.buckets is not None:
            self.buckets.begin_step(self.loss_scale.scale)
        loss_sum = torch.zeros(3, device=self.dist.device)
        real = computed = 0
        for i, batch in enumerate(self._micro_batches(it)):
            last = i == self.accum - 1
            with contextlib.nullcontext() if last else self._no_sync():
                with self._span("forward"), self._autocast():
                    out = self.net(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                                   masked_lm_labels=batch.masked_lm_labels,
                                   next_sentence_labels=batch.next_sentence_labels)
                with self._span("backward"):
                    (out.loss * (self.loss_scale.scale / self.accum)).backward()
            loss_sum += torch.stack([out.loss.detach(), out.mlm_loss.detach(),
                                     out.nsp_loss.detach()]).float() / self.accum
            real += batch.num_real_tokens
            computed += batch.num_padded_tokens
        with self._span("sync"):  # the buckets' last launches and the wait for every allreduce
            report = self.buckets.finish() if self.buckets is not None else None
        return self._optimizer_step(step, lr, loss_sum, real, computed, t0, report)

    def _grad_norm(self) -> float:
        """Global L2 norm of the averaged (for the before modes: already clipped) gradient."""
        if self.buckets is not None:
            return float(self.buckets.grad_norm())  # one pass over the buffer
        if hasattr(self.optimizer, "grad_norm"):  # fused backend: one pass over its flat buffer
            return float(self.optimizer.grad_norm())
        return float(global_grad_norm([p.grad for p in self.model.parameters()
                                       if p.grad is not None]))

    def _optimizer_step(self, step, lr, loss_sum, real, computed, t0,
                        report: SyncReport | None = None) -> StepMetrics:
        t = self.cfg.train
        with self._span("optimizer"):
            norm = self._grad_norm() / self.loss_scale.scale
            finite = math.isfinite(norm)
            coef = 1.0
            if t.clip_mode == "global_after" and t.max_grad_norm > 0 and finite:
                coef = min(1.0, t.max_grad_norm / (norm + CLIP_EPS))
            if finite:
                self.optimizer.step(grad_scale=coef / self.loss_scale.scale)
            self.loss_scale.update(finite)
            if self.buckets is not None:
                self.buckets.zero_grad()  # gradients stay views of the bucket buffer
            else:
                self.optimizer.zero_grad(set_to_none=True)
        extra = report.metrics() if report is not None else {}
        if self.timeline:
            extra.update(self.timeline.summary())
        losses = (all_reduce_sum(loss_sum) / self.dist.world_size).tolist()
        self.state.step = step + 1
        self.state.samples += t.global_batch_size
        return StepMetrics(step=step + 1, samples=self.state.samples, loss=losses[0],
                           mlm_loss=losses[1], nsp_loss=losses[2], lr=lr, grad_norm=norm,
                           clip_coef=coef * (report.clip_coef if report is not None else 1.0),
                           step_time_s=time.perf_counter() - t0,
                           real_tokens=real, computed_tokens=computed, skipped=not finite,
                           loss_scale=self.loss_scale.scale, extra=extra)

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
                st.last_step = self.train_step(it)
                self._measure_balance(st.last_step)
                st.epoch = self.train_loader.epoch
                fire(Event.STEP, st)
            fire(Event.BLOCK_STOP, st)
            acc = self._eval_and_log()
            next_eval += every
            if acc >= t.target_mlm_accuracy:
                st.status = "success"
            elif self._out_of_budget():
                st.status = "aborted"

    def _measure_balance(self, m: StepMetrics) -> None:
        """Padding efficiency and imbalance across ranks (runtime.balance) into ``m.extra``;
        ``computed_tokens`` becomes what the model computed (the real tokens when unpadded)."""
        m.extra.update(self.balance_meter.reduce())
        m.computed_tokens = int(self.balance_meter.last_local["computed"])

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
        if getattr(self, "balance_meter", None) is not None:
            self.balance_meter.close()
        if getattr(self, "buckets", None) is not None:
            self.buckets.close()
        if self.train_loader is not None and hasattr(self.train_loader, "close"):
            self.train_loader.close()
