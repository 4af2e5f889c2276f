"""The parts of a training run, built from a config in one fixed order: the one builder that
the trainer, the bucket tuner's measurement, the length-cost command and the benchmarks use.

Owns: the order (torchtitan's lesson) - seeds → the numerics (runtime.numerics: resolved once,
handed to each part that reads them) → model (with its initial weights, then the model
converters in their declared order) → gradient sync → optimizer (on the sync's gradient
buffer) → schedule → loss scale → the batch cost → the training loader and the evaluation
batches -, the observers of the steps
(``build_observers``: balance meter, step log, step profiler), and turning the config's declared fields
into each part's arguments: the optimizer gets every ``[optim]`` field its registry entry
accepts (``runtime.optim.optimizer_hparam_names``), the schedule every ``[schedule]`` field
its builder accepts, so no part is special-cased by name here.
Never: trains, evaluates, decides when to log, checkpoint or stop (runtime.train), reads the
launcher's environment, or knows what the parts do inside.

    parts = build_parts(cfg, ctx)                    # what Trainer.setup uses
    parts = build_parts(cfg, ctx, communicate=False, eval_batches=False)   # the tuner
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from basis import model_shape
from loaders import length_cost
from loaders.balance_spec import PACKED_MODES
from loaders.dataset import TrainLoader, load_eval_batches
from loaders.shards import Limits
from kernels.fusions import CONVERTED
from runtime.config import Config
from runtime.grad_sync import GradSync, build_grad_sync
from runtime.launch.dist import DistContext
from runtime.model.arithmetic import attention_layout
from runtime.model.bert import BertForPreTraining
from runtime.model import converters, fp8
from runtime.model.hf import load_error_reason, load_hf_state_dict, minilm_path, read_state_dict
from runtime.model.precision import DTYPES, to_params_dtype
from runtime.numerics import Numerics
from runtime.observe.timeline import StepTimeline
from runtime.optim.grad_scale import DynamicLossScale
from runtime.optim.optimizers import build_optimizer, optimizer_hparam_names
from runtime.optim.schedules import build_schedule, schedule_param_names, scaled_lr


class InitCheckpointError(ValueError):
    """An initial checkpoint that cannot give this model its weights, or would poison training
    (model.init). Every rank reads the same file, so every rank raises it alike."""

    exit_code = 2
    raised_on_all_ranks = True


@dataclass
class Parts:
    """What a training step needs, built and wired together (see the module docstring)."""

    model: BertForPreTraining
    numerics: Numerics
    grad_sync: GradSync
    optimizer: torch.optim.Optimizer
    schedule: Callable[[int], float]
    base_lr: float
    loss_scale: DynamicLossScale
    batch_cost: length_cost.LengthCost
    limits: Limits
    train_loader: Any = None          # TrainLoader or its DALI twin
    eval_batches: list = dataclasses.field(default_factory=list)  # on the device
    timeline: Optional[StepTimeline] = None


def build_parts(cfg: Config, dist: DistContext, *, bucket_plan: Optional[Path] = None,
                communicate: bool = True, timeline: Optional[bool] = None,
                train_loader: bool = True, eval_batches: bool = True) -> Parts:
    """Every part of a run of ``cfg`` on this rank (see the module docstring).

    ``bucket_plan``: a plan file to lay the gradient buffer out by (a resumed run's, so its
    layout - and the fused optimizer's - is the uninterrupted run's); used by the bucket
    engine when the config names none. ``communicate=False``: the gradient sync averages
    nothing and launches nothing (a world of one's sync) - what the tuner measures, the
    compute alone, and bench.overlap's step without communication; the one off-switch (the
    engine has no knob of its own). ``timeline``: record each step's timeline (default: train.timeline)."""
    t = cfg.train
    numerics = cfg.numerics()   # how the numbers are kept: resolved here, read by every part
    limits = Limits(cfg.model.vocab_size, cfg.data.max_seq_length, cfg.model.type_vocab_size)
    torch.manual_seed(t.seed)  # the same initial weights on every rank
    model = build_model(cfg, dist.device).to(dist.device)
    # the training dtype before the gradient buffers are laid out in it; with master
    # weights, their exact fp32 values for the optimizer
    masters = to_params_dtype(model, numerics)
    tl = StepTimeline(dist.device) if (t.timeline if timeline is None else timeline) else None
    train_cfg = t
    if bucket_plan is not None and t.grad_sync == "buckets" and not t.bucket_plan:
        train_cfg = dataclasses.replace(t, bucket_plan=str(bucket_plan))
    grad_sync = build_grad_sync(
        model, train_cfg, world_size=dist.world_size if communicate else 1, device=dist.device,
        reduce_dtype=DTYPES[numerics.reduce], group=dist.group, timeline=tl,
        tokens_per_step=cfg.tokens_per_step(dist.world_size),
        shard=cfg.optim.shard, local_rank=dist.local_rank,
        local_world_size=dist.local_world_size)
    base_lr = learning_rate(cfg)
    optimizer = build_optimizer(cfg.optim.name, list(model.named_parameters()),
                                **optimizer_hparams(cfg, base_lr),
                                master_weights=numerics.master)
    if numerics.master:
        optimizer.seed_masters(masters)
    del masters
    grad_sync.on_layout(optimizer.share_gradients)  # one gradient buffer, the sync's
    parts = Parts(model=model, numerics=numerics, grad_sync=grad_sync, optimizer=optimizer,
                  schedule=schedule_of(cfg, base_lr), base_lr=base_lr,
                  loss_scale=DynamicLossScale(t.init_loss_scale, enabled=numerics.loss_scale,
                                              device=dist.device),
                  batch_cost=batch_cost(cfg, dist.device.type), limits=limits, timeline=tl)
    torch.manual_seed(t.seed * 1000 + dist.rank)  # dropout differs per rank
    if train_loader:
        parts.train_loader = build_train_loader(cfg, dist, parts.batch_cost, limits)
    if eval_batches:
        # On the device for the whole run: evaluation counts in time-to-train, and the same
        # few MB would otherwise cross PCIe at every evaluation.
        parts.eval_batches = [b.to(dist.device) for b in load_eval_batches(
            cfg.data.data_dir, dist.rank, dist.world_size, cfg.data.eval_batch_size,
            limits=limits)]
    return parts


def build_model(cfg: Config, device: Optional[torch.device] = None) -> BertForPreTraining:
    """The model ``cfg.model`` describes (a ``BertConfig`` with the run's choices), with its
    initial weights (``model.init``), then changed by the model converters the run asks for,
    in their declared order (runtime.model.converters.CONVERTERS: fusion qkv's one Wqkv, the
    FP8 Linears - real or emulated by the ``device`` it will run on, default the config's
    system.device, 'auto' being CUDA where present -, the compiled layers)."""
    m = cfg.model
    model = BertForPreTraining(m.bert_config(), attention=m.attention,
                               packed=cfg.data.balance in PACKED_MODES,
                               fusions=tuple(f for f in m.fusions if f not in CONVERTED))
    if m.init != "scratch":
        path = minilm_path() if m.init == "minilm" else m.init
        where = f"model.init = {m.init!r}" + (f" ({path})" if str(path) != m.init else "")
        try:
            state = read_state_dict(path)
        except FileNotFoundError as e:
            raise InitCheckpointError(f"{where}: {e} - name a weight file (.safetensors, .bin, "
                                      f".pt), a directory holding model.safetensors, a "
                                      f"checkpoint directory, or 'scratch'") from None
        except Exception as e:  # noqa: BLE001 - torch.load/safetensors name no file
            raise InitCheckpointError(
                f"{where}: not a readable weight file ({load_error_reason(e)}) - is it "
                f"truncated, or another kind of file? Name a .safetensors or a torch state "
                f"dict of tensors") from None
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise InitCheckpointError(f"{where}: holds no state dict of tensors")
        check_finite(state, where)
        try:
            load_hf_state_dict(model, state)
        except (ValueError, KeyError, RuntimeError) as e:
            raise InitCheckpointError(f"{where}: does not fit this model ({e}) - set the "
                                      f"[model] keys to the checkpoint's shape") from None
    converters.convert(model, cfg, device)   # after the weights are set
    return model


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


def learning_rate(cfg: Config) -> float:
    """The base learning rate: optim.lr, scaled by optim.lr_scaling from the batch it was
    tuned at to this run's global batch."""
    o = cfg.optim
    if o.lr_scaling == "none":
        return o.lr
    return scaled_lr(o.lr_scaling, o.lr, o.base_global_batch_size, cfg.train.global_batch_size)


def optimizer_hparams(cfg: Config, base_lr: Optional[float] = None) -> dict:
    """``build_optimizer``'s keyword arguments: every ``[optim]`` field the optimizer's
    registry entry accepts, lr the scaled base learning rate."""
    o = cfg.optim
    out = {k: getattr(o, k) for k in optimizer_hparam_names(o.name) if hasattr(o, k)}
    out["lr"] = learning_rate(cfg) if base_lr is None else base_lr
    return out


def schedule_of(cfg: Config, base_lr: float) -> Callable[[int], float]:
    """``schedule(step) -> lr``: every ``[schedule]`` field the schedule's builder accepts."""
    s = cfg.schedule
    kw = {k: getattr(s, k) for k in schedule_param_names(s.name) if hasattr(s, k)}
    return build_schedule(s.name, base_lr=base_lr, **kw)


def batch_cost(cfg: Config, device_type: str) -> length_cost.LengthCost:
    """What one rank's batch costs on this model and device (``data.length_cost``), in the
    layout of the attention path that will run (runtime.model.arithmetic: one rule)."""
    layout = attention_layout(cfg.model.attention, device_type)
    return length_cost.resolve(cfg.data.length_cost, model_shape.shape_of(cfg.model), layout)


def build_train_loader(cfg: Config, dist: DistContext, cost: length_cost.LengthCost,
                       limits: Limits):
    """``TrainLoader`` (data.loader 'torch') or its DALI twin, balanced by data.balance; a bad
    bin / group / pack specification fails here, before anything trains."""
    spec = cfg.data.balance_spec(dist.local_world_size, cost=cost)
    kwargs = dict(verify=cfg.data.verify_checksums, prefetch=cfg.data.prefetch, balance=spec,
                  limits=limits)
    if cfg.data.shapes != "dynamic":  # (the config refuses other shapes with DALI)
        kwargs.update(shapes=cfg.data.shapes, shape_bucket=cfg.data.shape_bucket,
                      max_predictions_per_seq=cfg.data.max_predictions_per_seq)
    args = (cfg.data.data_dir, dist.rank, dist.world_size,
            cfg.local_batch_size(dist.world_size), cfg.train.seed)
    if cfg.data.loader == "dali":
        from loaders.dali_pipeline import DaliTrainLoader  # DALI is imported only when used
        device_id = dist.device.index if dist.device.type == "cuda" else None
        return DaliTrainLoader(*args, device_id=device_id, **kwargs)
    return TrainLoader(*args, **kwargs)


def _shard_facts(parts: Parts, cfg: Config) -> dict:
    """optim.shard as it runs: the shards, their padding, the collectives used."""
    shard = getattr(parts.grad_sync, "shard", None)
    if shard is None:
        return {"mode": cfg.optim.shard}
    return {"mode": cfg.optim.shard, **shard.describe()}


def describe(parts: Parts, cfg: Config, dist: DistContext) -> dict:
    """What the run derived from its config and parts (RunState.derived: the MLPerf log's
    hyperparameters, the summary's optimizer facts)."""
    s, opt = cfg.schedule, parts.optimizer
    start, every = cfg.train.eval_cadence()
    binding = getattr(opt, "flat_binding", None)
    return dict(numerics=parts.numerics.describe(),
                fp8=fp8.facts(parts.model, cfg.model.fp8, cfg.model.fp8_emulate, dist.device),
                local_batch_size=cfg.local_batch_size(dist.world_size),
                gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
                world_size=dist.world_size, lr=parts.base_lr,
                warmup_steps=s.warmup_steps, start_warmup_step=s.start_warmup_step,
                total_steps=s.total_steps, eval_iter_start_samples=start,
                eval_iter_samples=every,
                parameters=sum(p.numel() for p in parts.model.parameters()),
                optimizer_backend=opt.backend,
                optimizer_shard=_shard_facts(parts, cfg),
                optimizer_compiled=None if binding is None else binding.compiled,
                optimizer_compile_s=round(opt.compile_seconds, 3),
                **({"tied_embedding_sync": parts.grad_sync.tied_sync[0],
                    "tied_embedding_sync_why": parts.grad_sync.tied_sync[1]}
                   if hasattr(parts.grad_sync, "tied_sync") else {}))


@dataclass
class Observers:
    """What watches the steps of a run: the balance meter (hooks on the model), the step log
    (with the noise scale, the device clock and the peak for MFU), the step profiler
    (train.profile_steps; None when off), the attention layout the computed tokens follow."""

    balance_meter: Any
    step_log: Any
    profiler: Any
    layout: str
    peak: Any


def build_observers(cfg: Config, dist: DistContext, model, cost, say,
                    numerics: Numerics) -> Observers:
    """The observers of a run of ``model`` (runtime.observe) with ``numerics`` (the peak
    of each of its GEMM dtypes, for MFU), for the trainer."""
    from runtime.observe import noise_scale
    from runtime.observe.balance_meter import BalanceMeter
    from runtime.observe.clock import DeviceClock
    from runtime.observe.mfu import peak_of
    from runtime.observe.profiler import StepProfiler
    from runtime.observe.step_log import StepLog
    t = cfg.train
    meter = BalanceMeter(model, dist.device, dist.world_size, cost=cost)
    noise = noise_scale.for_run(cfg.local_batch_size(dist.world_size),
                                t.gradient_accumulation_steps, dist.world_size,
                                t.noise_scale_horizon_samples)
    name = torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else None
    peak = peak_of(name, numerics.peak_dtypes, cfg.system.peak_tflops)
    profiler = StepProfiler(t.profile_steps, t.output_dir, dist.rank, dist.device, say) \
        if t.profile_steps else None
    return Observers(meter, StepLog(dist.world_size, meter, noise, peak,
                                    DeviceClock(dist.device)),
                     profiler, attention_layout(cfg.model.attention, dist.device.type), peak)
