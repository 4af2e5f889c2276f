"""What a benchmark submitter touches: per-system configs, MLPerf logging, launch and scoring.

Layering: ``run_and_time.sh -> submission -> runtime -> {loaders, kernels}``. This package may
import ``runtime``; ``runtime`` never imports it. MLPerf logging lives here as a callback on the
trainer's events (:class:`submission.mllog_callback.MLPerfLogger`), so the training loop never
imports ``mlperf_logging``.

Contents:
    configs/config_<SYSTEM>_<nodes>x<ranks>x<batch>x<accum>.toml
                        one file per system and scale, read by ``runtime.config.load_config``
                        (the name must agree with the values inside; a test checks it)
    mllog_callback.py   ``MLPerfLogger``: runtime events -> ``:::MLLOG`` lines via mlperf-logging
    train.py            ``python -m submission.train --config FILE [--set section.key=value ...]``:
                        one rank of a run; its exit status: README.md, "Exit status"
    run.sub             the sbatch script: NEXP experiments per allocation, cache clear, srun
    __main__.py         ``python -m submission submit|status|report|package``
                        (docs/SLURM.md), over slurm.py (sbatch, squeue), report.py
                        (scoring, compliance, olympic mean, RCP), package.py (MLPerf layout and
                        its checkers) and sysinfo.py (the system description of a node)

The MLPerf entry point is ``run_and_time.sh`` at the repository root; docs/MLPERF_LOGGING.md
says what is logged where and how to run the compliance checker on a log.
"""
