"""The config's sections about the machine and the submission: ``[system]`` (where and how the
ranks run: run_and_time.sh, Slurm) and ``[submission]`` (the MLPerf log's labels), each a
dataclass with its keys, their rules and the checks that read it alone.

Owns: the keys of those two sections (types, defaults, docstrings, their section-wide resume
rule) and what reaches Slurm or a file name from them (no shell characters). The training
sections are runtime.config.sections'.
Never: checks one section against another (runtime.config.checks), reads files or the
launcher's environment (runtime.launch.env), or imports torch.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from runtime.choices import (RECORD, CacheClear, ConfigError, DeviceKind, Division, Launcher,
                             SrunMpi, is_number, key_field, one_of)

# Values that reach Slurm or file names (system.*): no whitespace, quotes or shell characters.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_SAFE_IMAGE = re.compile(r"[A-Za-z0-9_.:/#@+-]+")
_SAFE_MOUNTS = re.compile(r"[A-Za-z0-9_.:/,+-]+")



_doc = key_field   # a key: its docstring (--help-keys) and its resume rule, on the field


@dataclass
class SystemConfig:
    """The machine the config is for: used by run_and_time.sh and slurm submission."""

    RESUME: ClassVar[tuple[str, str]] = (RECORD, "where and how the ranks run")
    """Every key's resume rule (a section rule: no key here declares its own)."""

    name: str = _doc("system name, as in config_<SYSTEM>_...", "CPU")
    nodes: int = _doc("nodes", 1)
    ranks_per_node: int = _doc("ranks per node (GPUs per node; CPU slots on CPU nodes)", 2)
    device: DeviceKind = _doc(one_of(DeviceKind, {"auto": "CUDA when present"}), "auto")
    launcher: Launcher = _doc(f"how run_and_time.sh starts ranks: {one_of(Launcher)} (one row "
                              "each in submission/launchers.py; ./run_and_time.sh --help lists "
                              "them)", "mpiexec")
    walltime_minutes: int = _doc("walltime for one experiment (slurm)", 30)
    dist_timeout_s: float = _doc("collective timeout: a dead rank stops the others after this", 60.0)
    threads_per_rank: int = _doc("torch intra-op threads per rank (0 = cores / ranks)", 0)
    peak_tflops: float = _doc("the device's dense peak TFLOP/s in the run's precision, for the "
                              "MFU the logs report (runtime/observe/mfu.py); 0 = the "
                              "datasheet's, by GPU name (none on a CPU or an unknown GPU: "
                              "TFLOP/s only)", 0.0)
    device_memory_gb: float = _doc("memory of one GPU in GiB: run_and_time.sh refuses a CUDA "
                                   "run whose estimated memory per rank exceeds it "
                                   "(runtime/train/memory.py); 0 = not checked. CPU runs are "
                                   "checked against the node's available memory", 0.0)
    cache_clear: CacheClear = _doc(
        "page-cache drop before each experiment of submission/run.sub: " + one_of(CacheClear, {
            "auto": "every node, where permitted; else skipped with a note and logged "
                    "cache_clear=false",
            "required": "an experiment whose nodes cannot drop caches is not run"}), "auto")
    srun_mpi: SrunMpi = _doc(
        "srun --mpi plugin when system.launcher='srun': " + one_of(SrunMpi, {
            "pmi2": "only for an MPI library that must join the step", "pmix": "likewise",
            "none": "default: ranks and rendezvous from srun's own variables, no MPI wire-up - "
                    "the runtime needs none, NCCL/gloo carry the traffic"}) + ". "
        "Not pmi2 by default: Slurm's pmi2 plugin reads a PMI-1 request with one 1024-byte "
        "read() (src/plugins/mpi/pmi2/pmi1.c, handle_pmi1_cmd), so MPICH's multi-KB UCX "
        "address allgather at MPI_Init is now and then split and refused ('value not "
        "properly terminated in client request') and the step dies at start", "none")
    container_image: str = _doc("pyxis/enroot image for srun --container-image (launcher srun; "
                                "'' = no container); it must hold the requirements", "")
    container_mounts: str = _doc("extra srun --container-mounts, 'SRC:DST[,SRC:DST]'; the "
                                 "repository, data.data_dir and LOGDIR are always mounted at "
                                 "their own paths", "")

    def validate(self) -> None:
        # system.name names files and Slurm jobs: keep it to characters no shell or Slurm reads.
        if not _SAFE_NAME.fullmatch(self.name):
            raise ConfigError(f"system.name = {self.name!r}: use letters, digits, '_', '-', '.' "
                              "(it names the Slurm job and the submission's files)")
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise ConfigError("system.nodes and system.ranks_per_node must be >= 1")
        if self.walltime_minutes < 1:
            raise ConfigError(f"system.walltime_minutes must be >= 1, got {self.walltime_minutes}")
        if not (is_number(self.dist_timeout_s) and self.dist_timeout_s > 0):
            raise ConfigError(f"system.dist_timeout_s must be a finite number of seconds > 0, "
                              f"got {self.dist_timeout_s}")
        if self.threads_per_rank < 0:
            raise ConfigError("system.threads_per_rank must be >= 0 (0 = cores / ranks)")
        if not (is_number(self.peak_tflops) and self.peak_tflops >= 0):
            raise ConfigError(f"system.peak_tflops must be a finite number >= 0 (0 = from the "
                              f"GPU's name), got {self.peak_tflops}")
        if self.container_image and not _SAFE_IMAGE.fullmatch(self.container_image):
            raise ConfigError(f"system.container_image = {self.container_image!r}: an image name "
                              "or path without spaces, quotes or shell characters "
                              "(e.g. nvcr.io#nvidia/pytorch:24.04-py3 or /images/presto.sqsh)")
        if self.container_mounts and not _SAFE_MOUNTS.fullmatch(self.container_mounts):
            raise ConfigError(f"system.container_mounts = {self.container_mounts!r}: use "
                              "'SRC:DST[:ro]' items separated by commas, paths without spaces, "
                              "quotes or shell characters")


@dataclass
class SubmissionConfig:
    """MLPerf submission metadata written into the log."""

    RESUME: ClassVar[tuple[str, str]] = (RECORD, "the MLPerf log's labels")
    """Every key's resume rule (a section rule: no key here declares its own)."""

    org: str = _doc("submission_org", "Presto")
    platform: str = _doc("submission_platform", "CPU-2core")
    division: Division = _doc(one_of(Division, {"closed": "needs train.target_mlm_accuracy "
                                                           ">= 0.720"}), "open")
    status: str = _doc("submission_status: onprem | cloud | preview | research", "research")
    benchmark: str = _doc("submission_benchmark", "bert")
