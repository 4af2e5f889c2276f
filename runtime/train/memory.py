"""Will a run fit? An estimate of one rank's memory from the config, checked against what the
node has before any rank starts.

    python -m runtime.train.memory CONFIG [--set section.key=value ...]     (run_and_time.sh)

Owns: the estimate - the parameter count of the configured BERT (exact: the same count as the
built model's, tests/unit/test_memory.py checks it), the bytes per parameter kept on a rank
(weights, gradients and the gradient buckets in the parameters' dtype - fp32, or bf16/fp16
under a '*_master' train.precision: the run's runtime.numerics.Numerics, its bytes -, the
optimizer's state: 8 bytes for LAMB and AdamW's two moments, 4 for LARS's momentum, plus the
fp32 master weights' 4, divided by the shard count
under ``optim.shard`` -
the ranks of a node, or every rank: ``optimizer_shards``; the parameters that one host's sharded
CPU ranks share are still counted per rank), the activations of one micro-batch (Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models", 2022: s·b·h·(34 + 5·a·s/h)
bytes per layer with 16-bit activations - doubled in fp32 - plus the masked-LM logits, their
softmax and its gradient over the vocabulary; under ``data.shapes = 'static'`` of the rows every
static batch has, ``ActivationRows``: data.static_rows rows of the full width, or the
micro-batch, each row's sequence slots as attention segments padded to the width where the CPU's
repad kernel pads them, its masked-LM slots and its slot tables), and a fixed runtime overhead
per rank - and the check: on the CPU, every rank of a node against the node's available memory
(/proc/meminfo MemAvailable); on CUDA, one rank against ``system.device_memory_gb`` (0: not
checked). A run that cannot fit is refused (exit 2) with the estimate, the memory there is, the
largest micro-batch that would fit and the gradient accumulation that gives one (the same global
batch) - static rows: the most rows, and the most sequence slots, that fit - or what else to
change. The micro-batch is global / (ranks × accumulation):
tests/integration/test_memory_integration.py holds the estimate against the peak measured on a
CPU across accumulation values.
Never: builds the model, imports torch or allocates anything - an estimate, meant to catch the
config that cannot fit (BERT-base at a local batch of 224 on a 24 GiB node), not to cut close.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kernels.attention_rule import resolve
from basis import model_shape
from loaders.shapes import STATIC_SEQS_PER_ROW, masked_slots_per_row
from runtime.choices import shard_scope
from runtime.config import Config, ConfigError, load_config

GIB = 1024 ** 3
OVERHEAD_BYTES = 600 * 1024 ** 2   # torch, the process group, the data reader, per rank
HEADROOM = 0.9                     # of the memory there is: the OS and the page cache need some


def parameter_count(cfg: Config) -> int:
    """Parameters of BertForPreTraining with the tied decoder counted once (the model's
    arithmetic: basis.model_shape.parameter_count)."""
    return model_shape.parameter_count(cfg.model)


@dataclass(frozen=True)
class ActivationRows:
    """What one micro-batch's activations are computed on: ``count`` rows of ``width`` tokens
    (dynamic shapes: the micro-batch's sequences at the sequence length, an upper bound; static
    shapes: the rows every static batch has), ``segments`` attention segments per row, each
    padded to the width (1, or under static shapes with the repad kernel a row's sequence
    slots and its padding tail), ``masked`` masked-LM slots and ``slots`` sequence slots per
    row (static: the slot tables)."""

    count: int
    width: int
    segments: int = 1
    masked: int = 0
    slots: int = 1
    static: bool = False

    def describe(self) -> str:
        if not self.static:
            return f"a micro-batch of {self.count} x {self.width} tokens"
        return (f"{self.count} static rows of {self.width} tokens ({self.slots} sequence "
                f"slot(s), {self.segments} attention segment(s) of {self.width} and "
                f"{self.masked} masked-LM slots each)")


@dataclass(frozen=True)
class Estimate:
    """Bytes on one rank: ``static`` (parameters and what scales with them) and
    ``per_sample`` (activations of one row: a sequence of the micro-batch, or a static row),
    for ``rows.count`` rows."""

    params: int
    static: int
    per_sample: int
    micro_batch: int
    rows: Optional[ActivationRows] = None

    @property
    def row_count(self) -> int:
        return self.rows.count if self.rows is not None else self.micro_batch

    @property
    def total(self) -> int:
        return OVERHEAD_BYTES + self.static + self.per_sample * self.row_count

    def largest_micro_batch(self, budget: float) -> int:
        return max(0, int((budget - OVERHEAD_BYTES - self.static) // self.per_sample))


def optimizer_shards(cfg: Config, world_size: int) -> int:
    """Ranks that share one copy of the optimizer state (optim.shard's row in
    runtime.choices.SHARD_SCOPES: 1, the ranks of a node, or every rank)."""
    return shard_scope(cfg.optim.shard).ranks_per_update(world_size, cfg.system.ranks_per_node)


def estimate(cfg: Config, world_size: Optional[int] = None) -> Estimate:
    """One rank's memory for ``cfg`` on ``world_size`` ranks (default: the config's)."""
    s = cfg.system
    world = world_size or s.nodes * s.ranks_per_node
    micro = cfg.local_batch_size(world)   # global / (ranks x accumulation): one micro-batch
    p = parameter_count(cfg)
    n = cfg.numerics()
    state = ((4 if cfg.optim.name == "lars" else 8) + n.master_bytes) \
        / optimizer_shards(cfg, world)            # moments (and fp32 masters): per shard
    # weights, gradients and buckets in the parameters' dtype; the optimizer's state
    static = int(p * (3 * n.param_bytes + state))
    rows = activation_rows(cfg, micro)
    return Estimate(p, static, row_bytes(cfg, rows), micro, rows)


def activation_rows(cfg: Config, micro: int) -> ActivationRows:
    """The rows one micro-batch's activations are computed on (``ActivationRows``)."""
    d = cfg.data
    if d.shapes != "static":
        return ActivationRows(micro, d.max_seq_length, masked=d.max_predictions_per_seq)
    if d.balance == "offline_pack":   # data.static_rows, or (0) derived: ceil(b / mean) <= b
        width = d.pack_length or d.max_seq_length
        slots, count = d.max_seqs_per_row or STATIC_SEQS_PER_ROW, d.static_rows or micro
    else:                             # one sequence per row, a row per sample
        width, slots, count = d.max_seq_length, 1, micro
    device = "cuda" if _on_cuda(cfg) else "cpu"
    pads = cfg.model.attention == "unpadded" and resolve("auto", device) == "repad"
    return ActivationRows(count, width, segments=slots + 1 if pads else 1,
                          masked=masked_slots(cfg, width, slots), slots=slots, static=True)


def masked_slots(cfg: Config, width: int, slots: int) -> int:
    """A static row's masked-LM slots: loaders.shapes.masked_slots_per_row's bound with the
    masking probability p the data set records (slots x max_pred where it records none)."""
    try:
        stats = json.loads((Path(cfg.data.data_dir) / "stats.json").read_text())
        prob = float(stats["parameters"]["masked_lm_prob"])
    except (OSError, ValueError, KeyError, TypeError):
        prob = None
    return masked_slots_per_row(width, slots, cfg.data.max_predictions_per_seq, prob)


def row_bytes(cfg: Config, rows: ActivationRows) -> int:
    """Activation bytes of one row (Korthikanti et al.'s s·h·(34 + 5·a·s/h) per layer, 16-bit,
    doubled in fp32): the attention's scores for each of its segments padded to the width,
    the padded q/k/v/output copies when there are several, the masked-LM logits of its slots
    with their softmax and gradient, the embeddings; static rows add their slot tables."""
    m, w, n = cfg.model, rows.width, rows.segments
    per_layer = w * m.hidden_size * 34 + 5 * m.num_attention_heads * w * w * n
    if n > 1:   # repad: q, k, v and the output, each [segments x width, hidden]
        per_layer += 8 * m.hidden_size * w * n
    logits = rows.masked * m.vocab_size * 4 * 3
    tables = 0
    if rows.static:   # token index, position, segment (int64 per token); CLS and NSP per
        #               slot; masked positions twice; cu_seqlens; the repad key mask
        tables = 8 * (3 * w + 2 * rows.slots + 2 * rows.masked) + 4 * n + n * w
    # the formula's bytes are 16-bit activations': scaled by the GEMMs' dtype (fp32 doubles)
    return int(m.num_hidden_layers * per_layer * cfg.numerics().activation_bytes // 2 + logits
               + w * m.hidden_size * 4 * 4 + tables)   # embeddings and their gradient


def available_host_bytes(meminfo: Path = Path("/proc/meminfo")) -> Optional[int]:
    """MemAvailable (else MemTotal) of this node, or None where there is no /proc/meminfo."""
    try:
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines()
                      if ":" in line)
    except OSError:
        return None
    for key in ("MemAvailable", "MemTotal"):
        if key in fields:
            return int(fields[key].split()[0]) * 1024
    return None


def _on_cuda(cfg: Config) -> bool:
    if cfg.system.device == "cuda":
        return True
    return cfg.system.device == "auto" and Path("/dev/nvidia0").exists()


def problem(cfg: Config, host_bytes: Optional[int] = None) -> Optional[str]:
    """Why ``cfg`` cannot fit (None: it fits, or there is nothing to check against)."""
    est = estimate(cfg)
    s = cfg.system
    if _on_cuda(cfg):
        if s.device_memory_gb <= 0:
            return None
        budget, where = s.device_memory_gb * GIB * HEADROOM, \
            f"one GPU's {s.device_memory_gb:g} GiB (system.device_memory_gb)"
        need = est.total
        per = "each rank (one GPU)"
    else:
        have = available_host_bytes() if host_bytes is None else host_bytes
        if have is None:
            return None
        budget = have * HEADROOM / s.ranks_per_node
        where = f"this node's {have / GIB:.1f} GiB available, shared by {s.ranks_per_node} ranks"
        need = est.total
        per = "each rank"
    if need <= budget:
        return None
    fit = est.largest_micro_batch(budget)
    rows = est.rows or activation_rows(cfg, est.micro_batch)
    advice = _static_advice(cfg, est, budget) if rows.static and \
        cfg.data.balance == "offline_pack" else _advice(cfg, fit)
    return (f"{cfg.source}: this run cannot fit in memory: {per} needs about "
            f"{need / GIB:.1f} GiB ({est.params / 1e6:.1f} M parameters with their gradients "
            f"and optimizer state {est.static / GIB:.1f} GiB, activations of "
            f"{rows.describe()} {est.per_sample * est.row_count / GIB:.1f} GiB), against "
            f"{where} (at most {HEADROOM:.0%} used). " + advice)


def _static_advice(cfg: Config, est: Estimate, budget: float) -> str:
    """Static offline_pack rows that fit: the most rows at this many sequence slots, and the
    most slots at this many rows."""
    rows = est.rows
    fit_rows = est.largest_micro_batch(budget)
    room = budget - OVERHEAD_BYTES - est.static
    fit_slots = next((k for k in range(rows.slots - 1, 0, -1) if rows.count * row_bytes(
        cfg, activation_rows(_with_slots(cfg, k), est.micro_batch)) <= room), 0)
    options = []
    if fit_rows >= 1:
        options.append(f"data.static_rows = {fit_rows} (the most rows that fit at "
                       f"data.max_seqs_per_row = {rows.slots})")
    if fit_slots >= 1:
        options.append(f"data.max_seqs_per_row = {fit_slots} (the most sequence slots that "
                       f"fit at {rows.count} rows)")
    if not options:
        return "Not even one static row fits: use a smaller [model] or more memory"
    return "Set " + ", or ".join(options) + " - or use a smaller [model] or more memory"


def _with_slots(cfg: Config, slots: int) -> Config:
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_seqs_per_row=slots))


def _advice(cfg: Config, fit: int) -> str:
    """What would fit: the smallest gradient accumulation whose micro-batch (global / ranks /
    accumulation, a whole number) is at most ``fit`` sequences - the global batch, and so the
    run's hyperparameters, unchanged - else what else to change."""
    t, s = cfg.train, cfg.system
    world = s.nodes * s.ranks_per_node
    if fit < 1:
        return ("Not even a micro-batch of one sequence fits: use a smaller [model] or more "
                "memory")
    per_rank = t.global_batch_size // world
    accum = next((a for a in range(t.gradient_accumulation_steps + 1, per_rank + 1)
                  if t.global_batch_size % (world * a) == 0 and per_rank // a <= fit), None)
    if accum is None:
        return (f"The largest micro-batch that fits is about {fit} sequences, and no "
                f"gradient accumulation divides train.global_batch_size = "
                f"{t.global_batch_size} over {world} ranks into micro-batches that small: lower "
                f"train.global_batch_size, or use a smaller [model] or more memory")
    return (f"The largest micro-batch that fits is about {fit} sequences: set "
            f"train.gradient_accumulation_steps = {accum} (a micro-batch of {per_rank // accum}) "
            f"instead of {t.gradient_accumulation_steps} (a micro-batch of "
            f"{per_rank // t.gradient_accumulation_steps}) - the global batch stays "
            f"{t.global_batch_size} - or use a smaller [model] or more memory")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.train.memory",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--print", action="store_true", help="print the estimate even when it fits")
    a = ap.parse_args(argv)
    try:
        cfg = load_config(a.config, a.set)
        why = problem(cfg)   # the batch's split over the ranks is checked here too
        est = estimate(cfg) if a.print else None
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if est is not None:
        shape = f"; {est.rows.describe()}" if est.rows is not None and est.rows.static else ""
        print(f"{est.params / 1e6:.1f} M parameters; each rank about {est.total / GIB:.2f} GiB "
              f"(micro-batch {est.micro_batch}{shape})")
    if why:
        print(f"memory: {why}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
