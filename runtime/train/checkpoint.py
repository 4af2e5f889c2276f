"""Checkpoints: everything a run needs to continue exactly where it stopped, on disk.

Owns (``CheckpointManager``, torchtitan's CheckpointManager over ``state_dict()``s, plus the
RNG states it omits):
  * the on-disk format below, and writing one checkpoint from the run's parts - the model, the
    optimizer (any backend: per-tensor state, the fused backend's flat buffers with their 0-dim
    step counts, apex's), the train loader's data position (every balancing mode's), named
    ``states`` (the trainer's counters, schedule step, loss scaler, eval position, bucket
    plan, resolved config: anything with ``state_dict``/``load_state_dict``) and each rank's
    RNG states (torch CPU, CUDA, numpy, Python ``random``: runtime.train.rng);
  * atomicity: files go into ``.step_<N>.tmp/`` in the checkpoint directory, each fsynced;
    rank 0 writes the manifest last, fsyncs it and renames the directory to ``step_<N>``
    (a rename is atomic), then fsyncs the parent. A directory without a manifest, or with a
    file whose size or SHA-256 differs from it, is not a checkpoint: ``latest`` skips it with
    a warning and takes the one before;
  * keeping the newest ``keep`` checkpoints (older ones go once a new one is complete); a
    damaged one the look-up skips is moved to ``<checkpoint_dir>/damaged/`` first (logged):
    keep-K never deletes the checkpoint a run resumed from to keep a damaged one;
  * reading back with ``torch.load(weights_only=True)`` (never unpickles code) and
    ``safetensors``, into the same parts (``restore``), including onto another world size:
    the data position is then mapped to the same fraction of the epoch (the sample order
    differs from the uninterrupted run, and ``restore`` says so).
Never: decides when to write (the trainer does, at logging points), reads the environment,
or runs a collective but two barriers per save and one broadcast per look-up; what the
optimizer's shard files are and the masters in the parameters' place are
runtime.train.checkpoint_optim's.

The format ``presto-checkpoint/1`` - one directory per checkpoint::

    <checkpoint_dir>/step_00000150/
        model.safetensors   the model as a Hugging Face BertForPreTraining state dict ('bert.*',
                            'cls.*', the tied decoder weight included): with config.json, a
                            directory HF's from_pretrained (or runtime.model.load_pretrained,
                            or ``model.init=<this directory>``) loads
        config.json         the model's HF BertConfig
        optimizer.pt        optimizer.state_dict(): per-parameter state by parameter index
                            (exp_avg, exp_avg_sq / momentum_buffer, step) and param_groups;
                            sharded (optim.shard): the step counts only, and under
                            'presto_shards' how the shard files fit together
        optimizer_shard_00000.pt ...  sharded: one per shard, written by its owner in the
                            first node group - that rank's window of every state buffer, and
                            the file's identity: its shard index, the shard count, the
                            fingerprint of the flat layout it was cut from (``presto_shards``
                            of optimizer.pt) and the step; a resume on the same shards loads
                            its own, any other (world size, optim.shard) reads them all and
                            re-shards - and every file read must be the one it is named (a
                            swapped, stale or foreign shard is refused, naming the file)
        train_state.pt      {name: state_dict()} of the run's other parts (the trainer's
                            'progress': step, samples, next eval, loss scaler, bucket plan,
                            resolved config ...)
        bucket_plan.json    the gradient sync's bucket plan in use (grad_sync buckets: after
                            the first-step re-cut in the measured order; runtime/grad_sync/
                            plan.py's format) - a resumed run re-installs it
        rank_00000.pt ...   one per rank: {'rank', 'world_size', 'rng': {torch, cuda, numpy,
                            python}, 'data': the loader's state_dict()}
        checkpoint.json     the manifest, written last: format, step, samples, world size,
                            time, and every file's size and SHA-256

Every rank must see the same checkpoint directory (on several nodes: a shared file system);
rank 0 checks that every rank's file arrived before it commits.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from runtime.model.hf import load_error_reason
from runtime.train.checkpoint_optim import (master_state, missing_shard, shard_file,
                                            shard_mismatch, shard_record)
from runtime.train.rng import rng_state, set_rng_state  # noqa: F401 (restore's, patchable)
from runtime.optim.optimizers import SHARD_KEY  # where a sharded optimizer's state dict says
#                                                 how its shard files fit together
from runtime.optim.optimizers import StateOfOtherParameters

FORMAT = "presto-checkpoint/1"
MANIFEST = "checkpoint.json"
MODEL_FILE = "model.safetensors"
OWNER_FILE = "run.json"   # in the checkpoint directory: the run directory it belongs to
DAMAGED_DIR = "damaged"   # in the checkpoint directory: damaged checkpoints, moved aside
HF_CONFIG_FILE = "config.json"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "train_state.pt"
_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be restored or used; the message names the file (bad input:
    exit 2)."""


class ResumeRefused(CheckpointError):
    """A resume the checkpoint cannot take (runtime.train.resume_rules, or another run's
    checkpoint directory): decided alike on every rank, before anything is built."""

    raised_on_all_ranks = True


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (the disk is full): the message names the
    directory and the bytes needed; the previous checkpoint is kept (a runtime failure:
    exit 3)."""

    exit_code = 3


def _has_run_stop(log: Path) -> bool:
    """Whether an MLPerf log (another run's) holds run_stop: that run is finished."""
    try:
        return '"key": "run_stop"' in log.read_text(errors="replace")
    except OSError:
        return False


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


# ----------------------------------------------------------------------------- file helpers

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _to_cpu(obj: Any) -> Any:
    """Independent CPU copies of every tensor in ``obj`` (the fused backend's state tensors are
    views of flat buffers; a copy saves each one alone, in the parameter's own shape)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True).clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def hf_config_dict(bert_config: Any) -> dict:
    """An HF config.json for ``runtime.model.config.BertConfig``."""
    return {"architectures": ["BertForPreTraining"], "model_type": "bert", "hidden_act": "gelu",
            "position_embedding_type": "absolute", **asdict(bert_config)}


# ---------------------------------------------------------------------------------- reading

class Checkpoint:
    """One complete checkpoint directory (its manifest read and checked)."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self._train_state: Optional[dict] = None   # read once: the resume check and restore

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def samples(self) -> int:
        return int(self.manifest["samples"])

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    def _load(self, name: str) -> Any:
        path = self.path / name
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure names the file
            raise CheckpointError(f"{path}: not a readable torch file "
                                  f"({load_error_reason(e)}); the checkpoint is damaged - "
                                  f"delete {self.path} to resume from the one before") from None

    def model_state(self) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file
        path = self.path / MODEL_FILE
        try:
            return load_file(str(path))
        except Exception as e:  # noqa: BLE001 - safetensors' own errors name no file
            raise CheckpointError(f"{path}: not a readable safetensors file "
                                  f"({type(e).__name__}: {e}); the checkpoint is damaged - "
                                  f"delete {self.path} to resume from the one before") from e

    def optimizer_state(self) -> dict:
        return self._load(OPTIMIZER_FILE)

    def optimizer_shard(self, index: int, meta: Optional[dict] = None) -> dict:
        """Shard ``index`` of a sharded optimizer's state, checked to be that shard of this
        checkpoint (its index; where the file carries them, ``meta``'s shard count and layout
        and this step): CheckpointError naming the file when it is missing or another's."""
        path = self.path / shard_file(index)
        if not path.is_file():
            raise CheckpointError(missing_shard(path, self.path))
        data = self._load(shard_file(index))
        why = shard_mismatch(data, index, self.step, meta)
        if why:
            raise CheckpointError(f"{path}: {why}; its optimizer state is not this "
                                  f"checkpoint's - delete {self.path} to resume from the one "
                                  f"before")
        return data

    def train_state(self) -> dict:
        if self._train_state is None:
            self._train_state = self._load(STATE_FILE)
        return self._train_state

    def rank_state(self, rank: int) -> Optional[dict]:
        """Rank ``rank``'s file, or None when the checkpoint was written by fewer ranks."""
        if rank >= self.world_size:
            return None
        return self._load(rank_file(rank))

    @classmethod
    def open(cls, path: Path, verify: bool = True) -> "Checkpoint":
        """Read and check ``path``'s manifest (and, with ``verify``, every file's size and
        SHA-256); raises CheckpointError naming what is wrong."""
        path = Path(path)
        manifest_path = path / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: no {MANIFEST} (an incomplete checkpoint)") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{manifest_path}: unreadable ({e})") from e
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{manifest_path}: format {manifest.get('format')!r}, this "
                                  f"runtime reads {FORMAT!r}")
        if verify:
            for name, meta in manifest["files"].items():
                file = path / name
                if not file.is_file():
                    raise CheckpointError(f"{file}: missing from the checkpoint")
                if file.stat().st_size != meta["bytes"]:
                    raise CheckpointError(f"{file}: {file.stat().st_size} bytes, the manifest "
                                          f"says {meta['bytes']} (truncated or replaced)")
                if _sha256(file) != meta["sha256"]:
                    raise CheckpointError(f"{file}: SHA-256 differs from the manifest "
                                          "(corrupt)")
        return cls(path, manifest)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Directories named ``step_<N>`` under ``directory``, newest (largest N) first; complete
    or not (``Checkpoint.open`` tells)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if p.is_dir() and (m := _DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def find_latest(directory: str | Path, verify: bool = True,
                warn: Callable[[str], None] = lambda msg: warnings.warn(msg, stacklevel=2),
                damaged: Optional[Callable[[Path], None]] = None) -> Optional[Checkpoint]:
    """The newest complete checkpoint in ``directory`` (None when there is none); a damaged
    newer one is skipped with a warning naming it (and given to ``damaged``)."""
    for path in list_checkpoints(directory):
        try:
            return Checkpoint.open(path, verify=verify)
        except CheckpointError as e:
            warn(f"skipping checkpoint {path}: {e}")
            if damaged is not None:
                damaged(path)
    return None


# ---------------------------------------------------------------------------------- writing

class CheckpointManager:
    """Writes and restores the checkpoints of one run (see the module docstring).

    Built before the parts exist (``latest`` is asked first: a resumed run re-installs its
    bucket plan before the gradient sync is built); ``track`` names them: ``model`` the
    unwrapped ``BertForPreTraining``, ``optimizer`` a ``runtime.optim`` optimizer, ``loader``
    the train loader (``state_dict``/``load_state_dict``, ``plan``, ``steps_per_epoch``),
    ``states`` more named parts with ``state_dict``/``load_state_dict``, ``files`` extra
    files rank 0 writes as they are (name -> callable returning bytes, or None to skip).
    ``barrier``/``broadcast``: the process group's (runtime.launch.dist), identity for one rank.
    """

    def __init__(self, directory: str | Path, *, keep: int, rank: int, world_size: int,
                 barrier: Callable[[], None] = lambda: None,
                 broadcast: Callable[[Any], Any] = lambda x: x,
                 log: Callable[[str], None] = print):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep, self.rank, self.world_size = keep, rank, world_size
        self._barrier, self._broadcast, self._log = barrier, broadcast, log
        self.model = self.optimizer = self.loader = None
        self.states: dict[str, Any] = {}
        self.files: dict[str, Callable[[], Optional[bytes]]] = {}
        self.last_saved: Optional[Path] = None
        self.save_seconds: list[float] = []
        self._damaged: set[str] = set()   # damaged checkpoints that could not be moved aside

    def track(self, *, model: Any, optimizer: Any, loader: Any, states: dict[str, Any],
              files: Optional[dict[str, Callable[[], Optional[bytes]]]] = None) -> None:
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.states, self.files = dict(states), dict(files or {})

    def _model_state(self) -> Optional[dict]:
        """What model.safetensors holds when it is not the model's own state dict: with fp32
        master weights (train.precision '*_master') the masters in each parameter's place,
        so checkpoints and the HF files made from them hold fp32 as in every other precision
        (a collective when the masters are sharded: every rank calls it)."""
        if not getattr(self.optimizer, "keeps_masters", False):
            return None
        return master_state(self.model, self.optimizer)

    # -- finding ---------------------------------------------------------------------------
    def claim(self, run_dir: str | Path, adopt: bool) -> Optional[str]:
        """Make this run directory the owner of the checkpoint directory (``run.json``), once
        every rank agrees it may be: refused (CheckpointError, on every rank) when complete
        checkpoints there belong to another run directory - or to none recorded - unless
        ``adopt``; then returns that other run directory (the new log says so), else None."""
        decision = None
        if self.rank == 0:
            decision = self._claim(Path(run_dir).resolve(), adopt)
        decision = self._broadcast(decision)
        if decision and decision[0] == "refused":
            raise ResumeRefused(decision[1])
        return decision[1] if decision else None

    def _claim(self, run_dir: Path, adopt: bool) -> Optional[tuple[str, str]]:
        owner_file = self.directory / OWNER_FILE
        owner = None
        if owner_file.is_file():
            try:
                owner = json.loads(owner_file.read_text()).get("run_dir")
            except (OSError, ValueError, AttributeError):
                owner = "<unreadable run.json>"
        if owner is None and self.directory.resolve() == run_dir / "checkpoints":
            owner = str(run_dir)   # the default place, inside the run directory: its own
        has = find_latest(self.directory, verify=False, warn=lambda m: None) is not None
        adopted = None
        if has and owner != str(run_dir):
            other = owner or "a run that recorded no run directory"
            if not adopt:
                # The advice must be what a rerun can do: a finished run is not continued.
                finished = owner is not None and _has_run_stop(Path(owner) / "mlperf_bert.log")
                go_on = (f"{other} is a finished run (its MLPerf log has run_stop): it is not "
                         f"continued. For a new run, choose another train.checkpoint_dir, or "
                         f"start from its last weights with model.init="
                         f"{find_latest(self.directory, verify=False, warn=lambda m: None).path}"
                         if finished else
                         f"To continue that run, rerun it in its own directory (run_and_time.sh "
                         f"does so by itself when neither RUN_DIR nor -- train.output_dir is "
                         f"given); for a new run, choose another train.checkpoint_dir")
                return ("refused",
                        f"train.checkpoint_dir {self.directory} holds the checkpoints of "
                        f"{other}, not of this run ({run_dir}): continuing them here would "
                        f"make one run with two MLPerf logs. {go_on}; to continue these "
                        f"checkpoints in this new log, which then says where they came from, "
                        f"set train.adopt_checkpoints=true")
            adopted = other
        if owner != str(run_dir):
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = owner_file.with_name(OWNER_FILE + ".tmp")
            tmp.write_text(json.dumps({"run_dir": str(run_dir), "adopted_from": adopted,
                                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
                                      indent=1) + "\n")
            os.replace(tmp, owner_file)
        return ("adopted", adopted) if adopted else None

    def latest(self) -> Optional[Checkpoint]:
        """The newest complete checkpoint, the same on every rank (rank 0 checks the files and
        says which), or None."""
        found = None
        if self.rank == 0:
            ckpt = find_latest(self.directory, warn=lambda m: self._log(f"warning: {m}"),
                               damaged=self._set_aside)
            found = str(ckpt.path) if ckpt else None
        found = self._broadcast(found)
        return Checkpoint.open(Path(found), verify=False) if found else None

    def _set_aside(self, path: Path) -> None:
        """Move a damaged checkpoint to ``damaged/`` (rank 0, at the look-up): keep-K counted
        it, and deleted the good one the run resumed from. Kept for a look, not deleted; where
        it cannot be moved, keep-K leaves it out of its count instead."""
        target, n = self.directory / DAMAGED_DIR / path.name, 1
        while target.exists():
            n, target = n + 1, self.directory / DAMAGED_DIR / f"{path.name}.{n + 1}"
        try:
            target.parent.mkdir(exist_ok=True)
            os.replace(path, target)
        except OSError as e:
            self._damaged.add(path.name)
            self._log(f"warning: cannot move the damaged checkpoint {path} aside ({e.strerror}):"
                      f" it stays, and train.checkpoint_keep does not count it")
            return
        self._log(f"warning: moved the damaged checkpoint {path} to {target}: "
                  f"train.checkpoint_keep counts only checkpoints that can be resumed (delete "
                  f"it when you are done with it)")

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, samples: int) -> Path:
        """Write checkpoint ``step`` (a collective: every rank calls it at the same step)."""
        t0 = time.perf_counter()
        final = self.directory / step_dir_name(step)
        tmp = self.directory / f".{final.name}.tmp"
        try:
            if self.rank == 0:
                self.directory.mkdir(parents=True, exist_ok=True)
                for stale in self.directory.glob(".step_*.tmp"):
                    shutil.rmtree(stale, ignore_errors=True)  # a save that died half-way
                tmp.mkdir()
            self._barrier()  # the temporary directory exists, and empty
            _write_bytes(tmp / rank_file(self.rank), _torch_bytes(
                {"rank": self.rank, "world_size": self.world_size, "rng": rng_state(),
                 "data": self.loader.state_dict(),
                 "steps_per_epoch": self.loader.steps_per_epoch}))
            shard = getattr(self.optimizer, "shard", None)
            if shard is not None and shard.first_copy:  # one copy of each shard, saying whose
                meta = self.optimizer.state_dict()[SHARD_KEY]
                _write_bytes(tmp / shard_file(shard.index), _torch_bytes(shard_record(
                    _to_cpu(self.optimizer.shard_state_dict()), shard, meta, step)))
            model_state = self._model_state()
            if self.rank == 0:
                self._write_shared(tmp, model_state)
            del model_state
            self._barrier()  # every rank's file is on disk
            if self.rank == 0:
                self._commit(tmp, final, step, samples)
                self._prune()
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise self._no_space(tmp, step, e) from None
        self.last_saved = final
        self.save_seconds.append(time.perf_counter() - t0)
        return final

    def _no_space(self, tmp: Path, step: int, e: OSError) -> CheckpointWriteError:
        """The disk filled while writing checkpoint ``step``: drop the partial one (the last
        complete checkpoint stays) and say where, how much it needs and what to do. With
        several ranks the partial ``.step_<N>.tmp`` stays (it has no manifest: not a
        checkpoint), for the next save to remove: the other ranks may still be writing into it,
        and removing it under them turned their write into a FileNotFoundError that named the
        wrong cause."""
        if self.world_size == 1:
            shutil.rmtree(tmp, ignore_errors=True)
        last = find_latest(self.directory, verify=False, warn=lambda m: None)
        need = sum(f["bytes"] for f in last.manifest["files"].values()) if last else None
        try:
            free = shutil.disk_usage(self.directory).free
        except OSError:
            free = None
        return CheckpointWriteError(
            f"no space left in {self.directory} ({e.strerror}) while writing the checkpoint of "
            f"step {step}: it needs about "
            + (f"{need:,} bytes" if need else "as much as the model and optimizer state")
            + (f", {free:,} free" if free is not None else "") + "; "
            + (f"the previous checkpoint ({last.path.name}) is kept - free space there and "
               f"rerun the same command: it resumes from {last.path}" if last else
               "no earlier checkpoint exists - free space (or set train.checkpoint_dir on "
               "another disk) and run again: with no checkpoint this run cannot be continued, "
               "and the same command starts a new run in a new run directory (if you named "
               "this one with RUN_DIR or train.output_dir, name another)"))

    def _write_shared(self, tmp: Path, model_state: Optional[dict] = None) -> None:
        from safetensors.torch import save as safetensors_bytes

        from runtime.model.hf import save_hf_state_dict
        _write_bytes(tmp / MODEL_FILE, safetensors_bytes(save_hf_state_dict(self.model,
                                                                            model_state)))
        config = hf_config_dict(self.model.config)
        _write_bytes(tmp / HF_CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode())
        _write_bytes(tmp / OPTIMIZER_FILE, _torch_bytes(_to_cpu(self.optimizer.state_dict())))
        _write_bytes(tmp / STATE_FILE, _torch_bytes(
            {name: _to_cpu(part.state_dict()) for name, part in self.states.items()}))
        for name, make in self.files.items():
            data = make()
            if data is not None:
                _write_bytes(tmp / name, data)

    def _commit(self, tmp: Path, final: Path, step: int, samples: int) -> None:
        shard = getattr(self.optimizer, "shard", None)
        expected = [rank_file(r) for r in range(self.world_size)] + \
            ([shard_file(j) for j in range(shard.size)] if shard is not None else [])
        missing = [name for name in expected if not (tmp / name).is_file()]
        if missing:
            raise CheckpointError(
                f"{tmp}: rank file(s) {', '.join(missing[:8])} did not arrive: the checkpoint "
                f"directory must be one that every node sees (train.checkpoint_dir on a "
                f"shared file system)")
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.iterdir())}
        manifest = {"format": FORMAT, "step": step, "samples": samples,
                    "world_size": self.world_size,
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files}
        _write_bytes(tmp / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        _fsync_dir(tmp)
        if final.exists():  # the same step written again after a resume from an older one
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)

    def _prune(self) -> None:
        complete = [p for p in list_checkpoints(self.directory) if (p / MANIFEST).is_file()
                    and p.name not in self._damaged]
        for old in complete[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    # -- restoring -------------------------------------------------------------------------
    def restore(self, ckpt: Checkpoint) -> list[str]:
        """Load ``ckpt`` into the parts; returns notes on what differs from an exact resume
        (another world size). Raises CheckpointError naming the file on a mismatch."""
        from runtime.model.hf import load_hf_state_dict
        notes: list[str] = []
        try:
            load_hf_state_dict(self.model, ckpt.model_state())
        except (ValueError, OSError) as e:
            raise CheckpointError(f"{ckpt.path / MODEL_FILE}: does not fit this model ({e})") from e
        state = ckpt.optimizer_state()   # a file that cannot be read: CheckpointError, named
        try:
            self.optimizer.load_state_dict(state)
        except StateOfOtherParameters as e:  # another model layout: intact, not this run's
            raise CheckpointError(f"{ckpt.path / OPTIMIZER_FILE}: {e}; resume with the "
                                  f"config that wrote it, or start afresh from its weights "
                                  f"with model.init={ckpt.path}") from e
        except Exception as e:  # noqa: BLE001 - the name was checked (resume_rules): damaged
            raise CheckpointError(f"{ckpt.path / OPTIMIZER_FILE}: does not fit this "
                                  f"{type(self.optimizer).__name__} ({type(e).__name__}: {e}); "
                                  f"the file does not hold what its manifest says - delete "
                                  f"{ckpt.path} to resume from the one before") from e
        if SHARD_KEY in state:
            meta = state[SHARD_KEY]
            try:
                how = self.optimizer.load_shard_states(
                    meta, lambda j: ckpt.optimizer_shard(j, meta))
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - the same: the files do not fit
                raise CheckpointError(f"{ckpt.path}: the optimizer's shard files do not fit "
                                      f"this {type(self.optimizer).__name__} "
                                      f"({type(e).__name__}: {e}); delete {ckpt.path} to "
                                      f"resume from the one before") from e
            if not how.startswith("own shard"):
                notes.append(f"optimizer state {how}")
        saved = ckpt.train_state()
        for name, part in self.states.items():
            if name not in saved:
                raise CheckpointError(f"{ckpt.path / STATE_FILE}: has no '{name}' state")
            part.load_state_dict(saved[name])
        mine = ckpt.rank_state(self.rank)
        if mine is not None:
            set_rng_state(mine["rng"])
        else:
            notes.append(f"rank {self.rank} has no RNG state in the checkpoint (written by "
                         f"{ckpt.world_size} ranks): its dropout draws start from the seed")
        data = (mine or ckpt.rank_state(0))["data"]
        if ckpt.world_size == self.world_size:
            self.loader.load_state_dict(data)
        else:
            notes.append(self._remap_data(data, ckpt.rank_state(0)["steps_per_epoch"],
                                          ckpt.world_size))
        return notes

    def _remap_data(self, saved: dict, saved_steps: int, saved_world: int) -> str:
        """Continue a data position saved on ``saved_world`` ranks on this world size: the
        same epoch, the same fraction of it (whole shards are dealt per rank, so the order
        cannot be carried over)."""
        epoch, step = int(saved["epoch"]), int(saved["step_in_epoch"])
        mine = self.loader.state_dict()
        steps = self.loader.plan.steps_per_epoch(epoch, mine["local_batch_size"])
        new_step = min(steps - 1, (step * steps) // max(saved_steps, 1))
        self.loader.load_state_dict({**mine, "epoch": epoch, "step_in_epoch": new_step})
        return (f"world size {self.world_size} instead of the checkpoint's {saved_world}: the "
                f"data order differs from the uninterrupted run from here on (each rank reads "
                f"whole shards, dealt by world size) - continuing in epoch {epoch} at step "
                f"{new_step} of {steps}, the same fraction as step {step} of {saved_steps}; "
                f"samples near the cut may be read twice or skipped this epoch. Resume on "
                f"{saved_world} ranks for an exact continuation")
