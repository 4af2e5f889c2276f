"""run_and_time.sh: fail-fast checks, the launch command per launcher, the RESULT line, bad
input refused before anything launches.

Under stub launchers (tests/support/run_and_time.py: they record their argv; the launch values
really come from the config and the launch command from the launchers' table, whose rows
tests/unit/test_launchers.py checks one by one). Stop signals: test_run_and_time_signals.py;
run directories and their locks: test_run_and_time_dirs.py. The real end-to-end run is tested
elsewhere (it trains).
"""
from __future__ import annotations

import os

import pytest

from tests.support.run_and_time import (REPO, result_line, run, sandbox,  # noqa: F401
                                        train_args, write_config)

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow


def test_missing_config_fails_and_names_it(sandbox):
    root, _ = sandbox
    missing = root / "no such" / "config_X_1x1x1x1.toml"
    proc, calls = run(sandbox, missing)
    assert proc.returncode != 0
    assert str(missing) in proc.stderr and "CONFIG" in proc.stderr
    assert not calls and "RESULT" not in proc.stdout


def test_default_config_is_the_cpu_one(sandbox):
    default = REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
    proc, calls = run(sandbox, None)
    if not default.exists():
        assert proc.returncode != 0 and str(default) in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert any(str(default) in c["argv"] for c in calls)


def test_mpiexec_command_line(sandbox):
    root, stubs = sandbox
    cfg = write_config(root, "mpiexec", ranks=2)
    proc, calls = run(sandbox, cfg, SEED="123")
    assert proc.returncode == 0, proc.stderr
    assert [c["prog"] for c in calls] == ["mpiexec"]
    argv = calls[0]["argv"]
    assert argv[:3] == ["-n", "2", stubs["python"]]
    train_args(cfg, 123, argv)
    m = result_line(proc)
    assert m.group(1) == "123" and m.group(3) == "tester"
    assert "STARTING TIMING RUN AT" in proc.stdout and "ENDING TIMING RUN AT" in proc.stdout


def test_mpirun_command_line(sandbox):
    root, stubs = sandbox
    cfg = write_config(root, "mpirun", ranks=4)
    proc, calls = run(sandbox, cfg)
    assert proc.returncode == 0, proc.stderr
    argv = calls[0]["argv"]
    assert calls[0]["prog"] == "mpirun"
    assert argv[:3] == ["-n", "4", "--oversubscribe"]
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    assert argv[argv.index("-m") - 1] == stubs["python"]
    train_args(cfg, 7, argv)
    assert result_line(proc).group(1) == "7"


def test_torchrun_command_line(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "torchrun", ranks=2)
    proc, calls = run(sandbox, cfg)
    assert proc.returncode == 0, proc.stderr
    assert [c["prog"] for c in calls] == ["python"]
    argv = calls[0]["argv"]
    assert argv[:5] == ["-m", "submission.torchrun", "--nnodes=1", "--nproc_per_node=2",
                        "--standalone"]
    assert argv[5:7] == ["-m", "submission.train"]
    train_args(cfg, 7, argv)
    result_line(proc)


def test_torchrun_multinode_needs_master_addr(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "torchrun", nodes=2, ranks=2, name="config_TEST_2x2x4x1.toml")
    proc, calls = run(sandbox, cfg)
    assert proc.returncode == 2 and not calls   # bad input, with the launchers' table's words
    assert "run_and_time.sh: system.nodes=2 needs MASTER_ADDR (the rendezvous host) for " \
           "torchrun" in proc.stderr
    proc, calls = run(sandbox, cfg, MASTER_ADDR="node0", MASTER_PORT="1234")
    assert proc.returncode == 0, proc.stderr
    argv = calls[0]["argv"]
    assert "--nnodes=2" in argv and "--rdzv_endpoint=node0:1234" in argv
    assert "--standalone" not in argv


def test_srun_inside_a_job_step_runs_the_rank_directly(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "srun", ranks=2)
    proc, calls = run(sandbox, cfg, SLURM_PROCID="0", SLURM_JOB_ID="77", SLURM_STEP_ID="3")
    assert proc.returncode == 0, proc.stderr
    assert [c["prog"] for c in calls] == ["python"]
    argv = calls[0]["argv"]
    assert argv[:2] == ["-m", "submission.train"]
    train_args(cfg, 7, argv)
    out = next(a for a in argv if a.startswith("train.output_dir="))
    assert out.endswith("_job77.3")   # the same output dir on every task of the step
    result_line(proc)
    # Other tasks train but leave the RESULT line to task 0.
    proc, calls = run(sandbox, cfg, SLURM_PROCID="1", SLURM_JOB_ID="77", SLURM_STEP_ID="3")
    assert proc.returncode == 0 and calls and "RESULT," not in proc.stdout


@pytest.mark.parametrize("batch_shell", [False, True])
def test_srun_outside_a_job_step_launches_tasks(sandbox, batch_shell):
    """From a login shell (srun asks Slurm for an allocation: the stub says it can), and from
    an sbatch script's own shell, which has SLURM_PROCID=0 but is no task."""
    root, stubs = sandbox
    cfg = write_config(root, "srun", nodes=2, ranks=4, name="config_TEST_2x4x2x1.toml")
    env = {"SLURM_PROCID": "0", "SLURM_JOB_ID": "77"} if batch_shell else {}
    proc, calls = run(sandbox, cfg, **env)
    assert proc.returncode == 0, proc.stderr
    if not batch_shell:   # first asked whether Slurm can give the launch an allocation
        asked = calls.pop(0)
        assert asked["prog"] == "srun" and asked["argv"] == [
            "--test-only", "--nodes=2", "--ntasks-per-node=4", "true"], asked
    assert [c["prog"] for c in calls] == ["srun"]
    argv = calls[0]["argv"]
    # --kill-on-bad-exit: a task that dies (even before the runtime's guard) ends the step
    assert argv[:4] == ["--nodes=2", "--ntasks-per-node=4", "--kill-on-bad-exit=1", stubs["python"]]
    train_args(cfg, 7, argv)
    result_line(proc)


LAUNCH_ROWS = {   # the launch and device rows of the README's exit table, each exit 2
    "srun without Slurm": (   # (srun as a machine without Slurm has it)
        "srun", {"SRUN": "{nosrun}"}, [], "run_and_time.sh: system.launcher='srun', outside a "
        "Slurm allocation (SLURM_JOB_ID is unset), and Slurm does not answer here ({nosrun} "
        "--test-only: \"srun: fatal: Could not establish a configuration source\"): run it "
        "inside an allocation (salloc, sbatch - python -m submission submit), or set "
        "system.launcher to mpiexec, mpirun or torchrun"),
    "mpiexec missing": ("mpiexec", {"MPIEXEC": "/no/mpiexec"}, [],
                        "run_and_time.sh: MPIEXEC '/no/mpiexec' not found (set MPIEXEC)"),
    "mpirun missing": ("mpirun", {"MPIRUN": "no-mpirun"}, [],
                       "run_and_time.sh: MPIRUN 'no-mpirun' not found (set MPIRUN)"),
    "torchrun missing": ("torchrun", {"TORCHRUN": "/no/torchrun"}, [],
                         "run_and_time.sh: TORCHRUN '/no/torchrun' not found (set TORCHRUN)"),
    "no CUDA here": ("mpiexec", {}, ["system.device=cuda"],
                     "run_and_time.sh: system.device='cuda', but torch "),
    "no usable Inductor cache": (
        "mpiexec", {"TORCHINDUCTOR_CACHE_DIR": "{file}/cache"}, [],
        "run_and_time.sh: TORCHINDUCTOR_CACHE_DIR={file}/cache: it cannot be created ("
        "{file} is not a directory), and this run compiles (optim.backend='auto', whose "
        "fused step is compiled): Inductor keeps the kernels it builds there - set "
        "TORCHINDUCTOR_CACHE_DIR to a writable directory"),
}


@pytest.mark.parametrize("row", LAUNCH_ROWS)
def test_what_cannot_launch_here_is_refused_before_anything_starts(sandbox, tmp_path, row):
    """README's exit table, 2 "bad input (... launch ...)": a launcher missing or unusable
    here, a device torch does not see, an Inductor cache a compiling run cannot write - one
    sentence and exit 2 before anything is made or started, not a launcher's or a rank's
    failure later (srun outside an allocation exited 1, "target not reached"; a CUDA config
    on a CPU-only torch, and a read-only cache, exit 3 with tracebacks)."""
    launcher, env, args, said = LAUNCH_ROWS[row]
    root, _ = sandbox
    cfg = write_config(root, launcher)
    if row == "no CUDA here":
        import torch
        if torch.cuda.is_available():
            pytest.skip("torch sees a CUDA device here")
    afile = tmp_path / "not_a_directory"   # (no blank in its path: another refusal)
    afile.write_text("")
    nosrun = tmp_path / "srun"
    nosrun.write_text('#!/bin/sh\necho "srun: error: _establish_config_source: failed to fetch '
                      'config" >&2\necho "srun: fatal: Could not establish a configuration '
                      'source" >&2\nexit 1\n')
    nosrun.chmod(0o755)
    env = {k: v.format(file=afile, nosrun=nosrun) for k, v in env.items()}
    proc, calls = run(sandbox, cfg, *(["--", *args] if args else []), **env)
    assert proc.returncode == 2 and not calls, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(said.format(file=afile, nosrun=nosrun)), \
        proc.stderr
    assert "Traceback" not in proc.stderr and "RESULT" not in proc.stdout
    assert not (root / "log dir").exists() or not list((root / "log dir").iterdir())


def test_launcher_failure_exits_nonzero_without_result(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, rc=1)
    assert proc.returncode == 1
    assert calls and "RESULT" not in proc.stdout
    assert "FAILED" in proc.stderr and "status 1" in proc.stderr


def test_a_run_its_ranks_refuse_leaves_no_run_directory_behind(sandbox, tmp_path):
    """Exit 2 from the launch (the ranks refused the run: bad input): the fresh run directory
    run_and_time.sh made holds only its own files (launcher.log, the lock) and goes; one the
    user named and that existed stays, as does anything the ranks wrote."""
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, rc=2)
    assert proc.returncode == 2 and calls, proc.stderr
    assert not list((root / "log dir").iterdir()), proc.stderr
    assert "removed " in proc.stderr and "the refused run left nothing in it" in proc.stderr
    mine = tmp_path / "mine"
    mine.mkdir()
    proc, calls = run(sandbox, cfg, rc=2, RUN_DIR=str(mine))
    assert proc.returncode == 2 and mine.is_dir()


def test_extra_overrides_are_passed_and_validated(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, "--", "optim.lr=0.001", "train.log_every_steps=5")
    assert proc.returncode == 0, proc.stderr
    argv = calls[0]["argv"]
    assert argv[-4:] == ["--set", "optim.lr=0.001", "--set", "train.log_every_steps=5"]
    # An override can change the launch itself: it is applied before the values are read.
    proc, calls = run(sandbox, cfg, "--", "system.launcher=mpirun")
    assert proc.returncode == 0 and calls[0]["prog"] == "mpirun"
    # A misspelt key stops before anything launches, with runtime.config's message.
    proc, calls = run(sandbox, cfg, "--", "optim.lrr=1")
    assert proc.returncode != 0 and not calls and "optim.lrr" in proc.stderr
    # Not an override at all.
    proc, calls = run(sandbox, cfg, "--", "lr")
    assert proc.returncode != 0 and not calls and "'lr'" in proc.stderr


def test_multinode_mpi_needs_hostfile(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec", nodes=2, ranks=2, name="config_TEST_2x2x4x1.toml")
    proc, calls = run(sandbox, cfg)
    assert proc.returncode == 2 and "HOSTFILE" in proc.stderr and not calls
    hosts = root / "hosts file"
    hosts.write_text("a\nb\n")
    proc, calls = run(sandbox, cfg, HOSTFILE=str(hosts))
    assert proc.returncode == 0, proc.stderr
    assert calls[0]["argv"][:4] == ["-n", "4", "-f", str(hosts)]
    # Relative to the directory run_and_time.sh is called from (run() calls it from root).
    proc, calls = run(sandbox, cfg, HOSTFILE="hosts file")
    assert proc.returncode == 0, proc.stderr
    assert calls[0]["argv"][:4] == ["-n", "4", "-f", str(hosts)]


def test_unknown_launcher_is_refused(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "ssh")
    proc, calls = run(sandbox, cfg)
    assert proc.returncode != 0 and not calls and "system.launcher='ssh'" in proc.stderr


def test_a_run_that_cannot_fit_in_memory_is_refused_before_launch(sandbox):
    """BERT-base at a local batch of 224 (what an almost empty config once meant): exit 2
    with the estimate and the largest micro-batch that fits; no launcher started."""
    root, _ = sandbox
    config = write_config(root, "mpiexec")
    big = ["model.hidden_size=768", "model.num_hidden_layers=12",
           "model.num_attention_heads=12", "model.intermediate_size=3072",
           "train.global_batch_size=448"]
    proc, calls = run(sandbox, config, "--", *big)
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "this run cannot fit in memory: each rank needs about" in proc.stderr, proc.stderr
    assert "largest micro-batch that fits is about" in proc.stderr


def test_the_headline_of_a_refused_config_says_whether_the_file_or_an_override_is_bad(sandbox):
    """Every refusal was headlined "cannot read '<config>'", a bad override too, whose file
    had been read and was valid: the headline names the input that was refused."""
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, "--", "train.no_such_key=1")
    assert proc.returncode == 2 and not calls, proc.stderr
    assert "unknown key train.no_such_key" in proc.stderr, proc.stderr
    assert f"an override after -- was refused (the config error above names it); CONFIG " \
           f"'{cfg}' alone is valid" in proc.stderr and "cannot read" not in proc.stderr
    bad = root / "my configs" / "config_BAD_1x2x8x1.toml"
    bad.write_text(cfg.read_text().replace("seed = 7", 'seed = "seven"'))
    for args in ((), ("--", "train.max_steps=3")):   # the file is refused, overrides or not
        proc, calls = run(sandbox, bad, *args)
        assert proc.returncode == 2 and not calls, proc.stderr
        assert f"CONFIG '{bad}' was refused (the config error is above)" in proc.stderr, \
            proc.stderr
        assert "override after --" not in proc.stderr


# ------------------------------------------------------------------ bad input, nothing left

@pytest.mark.parametrize("seed", ["-1", "abc", "1.5", "4294967296", "99999999999999999999"])
def test_a_seed_that_is_not_a_whole_number_in_range_is_refused_naming_seed(sandbox, seed):
    """SEED=-1 reached numpy in every rank: exit 3 with a traceback."""
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, SEED=seed)
    assert proc.returncode == 2 and f"SEED='{seed}'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not calls
    assert not (root / "log dir").exists()
    proc, calls = run(sandbox, cfg, SEED="4294967295")   # the largest numpy takes
    assert proc.returncode == 0 and calls, proc.stderr


def test_an_override_holding_a_line_break_is_refused_naming_it(sandbox):
    """`-- $'train.log_every_steps=5\\ntrain.max_steps=2'` is one argument: TOML read it as
    two lines and the second key was silently dropped."""
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, "--", "train.log_every_steps=5\ntrain.max_steps=2")
    assert proc.returncode == 2 and not calls, proc.stderr
    assert "train.max_steps" in proc.stderr and "line break" in proc.stderr, proc.stderr
    assert not (root / "log dir").exists()
    proc, calls = run(sandbox, cfg, "--", 'train.output_dir="a\nb"')
    assert proc.returncode == 2 and not calls and "line break" in proc.stderr, proc.stderr


def test_a_refused_run_leaves_no_empty_run_directory(sandbox):
    """A run refused after run_and_time.sh made its directory - by the launchers' checks or
    by the ranks (exit 2: another run's checkpoints, a bad data set) - leaves no empty run
    directory behind; a directory that held something before is kept as it was."""
    root, _ = sandbox
    logdir = root / "log dir"
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, rc=2)          # the ranks refused their input
    assert proc.returncode == 2 and calls, proc.stderr
    assert list(logdir.iterdir()) == [], proc.stderr
    assert "the refused run left nothing in it" in proc.stderr, proc.stderr
    wide = write_config(root, "mpiexec", nodes=2, ranks=2, name="config_TEST_2x2x4x1.toml")
    proc, calls = run(sandbox, wide)               # refused by the launcher's row: no HOSTFILE
    assert proc.returncode == 2 and not calls and "HOSTFILE" in proc.stderr
    assert list(logdir.iterdir()) == [], proc.stderr
    mine = root / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    proc, calls = run(sandbox, cfg, rc=2, RUN_DIR=str(mine))
    assert proc.returncode == 2 and (mine / "notes.txt").read_text() == "mine"
    proc, calls = run(sandbox, cfg, rc=3)          # a failed run's directory is evidence
    assert proc.returncode == 3 and len(list(logdir.iterdir())) == 1
