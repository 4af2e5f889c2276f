"""A study's workers as a Slurm job array: WORKERS tasks of submission/hpo.sub, each a worker
of the study, checked with submission.slurm's own checks (the same checks and quoting rules
as ``python -m submission submit``).

Owns: the array's sbatch command and environment (the study directory; an RDB URL in
PRESTO_HPO_STORAGE, never on disk), the study's jobs.jsonl.
Never: builds an sbatch check of its own, or prints the URL's secrets.
"""
from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Optional

from submission import slurm
from submission.hpo.common import HPO_SUB, ROOT, STORAGE_ENV, HpoError
from submission.hpo.study import Study


def slurm_plan(study: Study, workers: int, *, partition: Optional[str], account: Optional[str],
               time_minutes: Optional[int], url: Optional[str],
               ask_slurm: bool = True) -> slurm.Plan:
    """The job array: WORKERS tasks of hpo.sub, each a worker of this study; checked with
    submission.slurm's checks (overrides, config, layout, data, walltime, partition)."""
    if partition is not None:
        slurm.check_token("--partition", partition)
    if account is not None:
        slurm.check_token("--account", account)
    slurm.check_token("--study", study.name)
    overrides = slurm.check_overrides(study.overrides)
    cfg = slurm.load_checked(study.config, overrides)
    slurm.check_layout(cfg)
    slurm.check_data(cfg)
    per_worker = math.ceil(study.trials / workers)
    minutes = slurm.check_walltime(cfg, per_worker, time_minutes, slurm.MARGIN_MINUTES)
    if re.search(r"[%\n\r]", study.dir):
        raise HpoError(f"--dir {study.dir!r}: '%' (a Slurm file pattern) and line breaks are "
                       "not allowed")
    notes: list[str] = []
    if ask_slurm:
        slurm.check_partition(cfg, partition, minutes, notes)
    argv = slurm.job_argv(cfg, minutes, partition, account, script=HPO_SUB, flags=[
        f"--job-name=presto_hpo_{study.name}", f"--array=0-{workers - 1}",
        "--open-mode=append", f"--output={study.dir}/slurm-%A_%a.out"])
    env = {"HPO_DIR": study.dir, "PRESTO_ROOT": str(ROOT)}
    if url:
        env[STORAGE_ENV] = url
    return slurm.Plan(study.config, overrides, workers, study.dir, minutes, argv, env, notes)


def slurm_submit(p: slurm.Plan) -> str:
    """sbatch the array (submit's runner); the job in the study's jobs.jsonl."""
    job = slurm.run_sbatch(p)
    with open(Path(p.logdir) / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job_id": job, "workers": p.nexp,
                            "submitted": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    return job
