"""Can this run start here? run_and_time.sh's one check before anything is written or started:
after it has read the config, before it makes a run directory or starts a launcher.

    python -m submission.preflight CONFIG [--set section.key=value ...] [--mode train|tune]

Each check that fails prints one sentence, prefixed ``run_and_time.sh:`` as the script's own
errors, and the command exits 2 (bad input: the README's exit table) - the first that fails:
  * the launcher (system.launcher): its row's fail-fast checks in submission.launchers - the
    program found (MPIEXEC, MPIRUN, TORCHRUN, SRUN), HOSTFILE or MASTER_ADDR for several
    nodes - and, for srun outside an allocation (no SLURM_JOB_ID: a login shell, where srun
    asks Slurm for one itself), that Slurm answers: ``srun --test-only`` (no job is made);
    without Slurm srun failed after the launch, in its own words ("Could not establish a
    configuration source") and with exit 1, the exit table's "target not reached";
  * the memory (train mode): runtime.train.memory's estimate against this node;
  * where the launch runs ranks on this host (submission.launchers.ranks_run_here: not srun
    starting a step, whose tasks run on the allocation's nodes, nor a hostfile's hosts):
      - the device: system.device 'cuda' needs a torch built with CUDA and a CUDA device here;
        'auto', which falls back to the CPU, needs a config the CPU can run;
      - Inductor's cache, when the run compiles (``Config.compiles``): a directory Inductor
        can write (runtime.model.inductor_cache).
Never: writes anything (the cache check's probe file aside, removed at once), starts a rank
(``srun --test-only`` starts nothing), or imports torch - except to count the CUDA devices, for
a config that asks for CUDA on a torch built with it (torch's build is read from its
version.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

from runtime.config import ConfigError, load_config
from runtime.model import inductor_cache
from runtime.train import memory
from submission.launchers import (EXIT_BAD_INPUT, PROG, Launch, LauncherError, launch_items,
                                  ranks_run_here, spec_for)


def torch_build() -> tuple[str, Optional[str]]:
    """(the installed torch's version, its CUDA version or None), read from its version.py
    without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return "(not installed)", None
    try:
        text = Path(spec.origin).with_name("version.py").read_text()
    except OSError:
        return "(unknown)", None
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return (version[1] if version else "(unknown)"), (cuda[1] if cuda else None)


def cuda_devices(cuda: Optional[str]) -> int:
    """How many CUDA devices the ranks' torch sees here (0 for a build without CUDA)."""
    if cuda is None:
        return 0
    import torch
    return torch.cuda.device_count()


def device_problem(cfg, config: str, sets: Sequence[str]) -> Optional[str]:
    """Why system.device cannot be had on this host (None: it can)."""
    device = cfg.system.device
    if device == "cpu":
        return None
    version, cuda = torch_build()
    if device == "auto":
        try:   # the CPU is what 'auto' falls back to: only a config that needs CUDA asks
            load_config(config, [*sets, "system.device=cpu"])
            return None
        except ConfigError as e:
            need = str(e)
    count = cuda_devices(cuda)
    if count:
        return None
    why = (f"torch {version} ({sys.executable}) is built without CUDA" if cuda is None else
           f"torch {version} with CUDA {cuda} sees no CUDA device on {socket.gethostname()} "
           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if device == "auto":
        return (f"system.device='auto' is the CPU here - {why} - and on the CPU: {need}")
    return (f"system.device='{device}', but {why}: set system.device='cpu' (or 'auto'), or run "
            f"where a CUDA build of torch sees a GPU")


SLURM_ASK_S = 30   # how long srun --test-only may take to answer


def slurm_problem(launch: Launch, spec) -> Optional[str]:
    """Why srun cannot start this launch's ranks from here (None: it can, or needs no
    asking - inside an allocation, or a task that is itself a rank)."""
    if spec.name != "srun" or spec.self_rank(launch.env) is not None \
            or launch.env.get("SLURM_JOB_ID"):
        return None
    srun = launch.env.get("SRUN") or "srun"
    ask = [srun, "--test-only", f"--nodes={launch.nodes}",
           f"--ntasks-per-node={launch.ranks_per_node}", "true"]
    try:
        done = subprocess.run(ask, env=dict(launch.env), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=SLURM_ASK_S)
    except subprocess.TimeoutExpired:
        said = f"no answer in {SLURM_ASK_S} s"
    except OSError as e:
        said = e.strerror or str(e)
    else:
        if done.returncode == 0:
            return None
        lines = [x.strip() for x in (done.stderr + done.stdout).splitlines() if x.strip()]
        said = f'"{lines[-1]}"' if lines else f"exit status {done.returncode}"
    return (f"system.launcher='srun', outside a Slurm allocation (SLURM_JOB_ID is unset), and "
            f"Slurm does not answer here ({' '.join(ask[:2])}: {said}): run it inside an "
            f"allocation (salloc, sbatch - python -m submission submit), or set "
            f"system.launcher to mpiexec, mpirun or torchrun")


def problems(config: str, sets: Sequence[str], mode: str = "train",
             environ: Mapping[str, str] = os.environ,
             python: str = sys.executable) -> list[str]:
    """The checks in the module docstring's order; the sentences of those that fail (the
    caller says the first). ``python``: the ranks' interpreter (mpiexec is looked for beside
    it, as the launch will)."""
    cfg = load_config(config, list(sets))
    s = cfg.system
    spec = spec_for(s.launcher, config)
    launch = Launch(s.nodes, s.ranks_per_node, (python, "-m", "submission.train"),
                    environ, config)
    out = []
    try:
        launch_items(s.launcher, launch)
    except LauncherError as e:
        out.append(str(e))
    else:
        why = slurm_problem(launch, spec)
        if why:
            out.append(why)
    if mode == "train":
        why = memory.problem(cfg)
        if why:
            out.append(f"memory: {why}")
    if ranks_run_here(spec, launch):
        why = device_problem(cfg, config, sets)
        if why:
            out.append(why)
        compiles = cfg.compiles()
        why = inductor_cache.problem(environ, ", ".join(compiles)) if compiles else None
        if why:
            out.append(why)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m submission.preflight",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--mode", choices=("train", "tune"), default="train",
                    help="run_and_time.sh's MODE: the memory estimate is training's")
    ap.add_argument("--python", default=sys.executable,
                    help="the ranks' interpreter, run_and_time.sh's PYTHON (default this one)")
    a = ap.parse_args(argv)
    try:
        found = problems(a.config, a.set, a.mode, python=a.python)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if found:
        first = found[0]
        print(first if first.startswith("memory: ") else f"{PROG}: {first}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


if __name__ == "__main__":
    sys.exit(main())
