"""``python -m submission hpo`` without training: the search space's checks (exit 2 naming
the key, nothing written), the study directory's identity, the storage URL's password, the
typed overrides and the best config, and the worker's bookkeeping - the budget, a killed
worker's stale trial failed and retried once, a signalled worker's trial retried, a stale
journal lock broken - with ``run_trial`` replaced by a stand-in that answers at once (the real
runs are in tests/e2e/test_hpo_e2e.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optuna.distributions import FloatDistribution

from runtime.config import load_config
from submission import hpo
from submission.__main__ import main as submission_main
from tests.support.runs import CPU_CONFIG

ROOT = Path(__file__).resolve().parents[2]

SPACE = """
[params."optim.lr"]
low = 1e-4
high = 3e-2
log = true

[params."optim.name"]
choices = ["lamb", "adamw"]
"""


def _space(tmp_path: Path, text: str = SPACE) -> Path:
    path = tmp_path / "space.toml"
    path.write_text(text)
    return path


def _args(tmp_path, *extra, space=None, d=None):
    return ["hpo", "--config", str(CPU_CONFIG), "--space", str(space or _space(tmp_path)),
            "--trials", "4", "--dir", str(d or tmp_path / "study"), *extra]


@pytest.mark.parametrize("text, needle", [
    ('[params."optim.lrr"]\nlow = 1\nhigh = 2\n', "unknown config key optim.lrr"),
    ('[params."optim.lr"]\nlow = 0.01\nhigh = 0.001\n', "[0.01, 0.001] is empty"),
    ('[params."optim.lr"]\nlow = 0.0\nhigh = 0.1\nlog = true\n', "a log scale needs low > 0"),
    ('[params."optim.lr"]\nlow = 1e-4\nhigh = 1e-2\nscale = "log"\n', "unknown field(s) ['scale']"),
    ('[params."optim.name"]\nchoices = []\n', "choices is empty"),
    ('[params."optim.name"]\nchoices = ["lamb", "sgd"]\n', "'sgd' is not a value the config"),
    ('[params."optim.beta1"]\nlow = 0.5\nhigh = 1.5\n', "[params.\"optim.beta1\"]: 1.5"),
    ('[params."train.global_batch_size"]\nlow = 32\nhigh = 64\n', "is not searched here"),
    ('[params."schedule.warmup_steps"]\nlow = 0.5\nhigh = 10\n', "must be integers"),
    ('[params."optim.lr"]\nlow = 1e-4\n', "needs both low and high"),
    ('[search]\nx = 1\n', "unknown table(s) ['search']"),
])
def test_a_bad_search_space_is_refused_with_exit_2_naming_the_key(tmp_path, capsys, text,
                                                                  needle):
    code = submission_main(_args(tmp_path, space=_space(tmp_path, text)))
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "space.toml" in err, err
    assert not (tmp_path / "study").exists()   # nothing written


def test_a_directory_holding_another_study_or_something_else_is_refused(tmp_path, capsys):
    hpo.prepare(hpo_args(tmp_path))   # claims the directory
    held = json.loads((tmp_path / "study" / "study.json").read_text())
    other = tmp_path / "other_space.toml"
    other.write_text(SPACE.replace("3e-2", "2e-2"))
    code = submission_main(_args(tmp_path, space=other))
    err = capsys.readouterr().err
    assert code == 2 and "holds another study (space_sha256" in err, err
    assert json.loads((tmp_path / "study" / "study.json").read_text()) == held  # untouched
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine")
    code = submission_main(_args(tmp_path, d=tmp_path / "junk"))
    assert code == 2 and "is not a study directory" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "junk").iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("url,secret,shown", [
    ("postgresql://presto:s3cr3t-pw@127.0.0.1:9/hpo", "s3cr3t-pw", "presto:***@127.0.0.1:9/hpo"),
    ("postgresql://presto:SE?CR3T@127.0.0.1:9/hpo", "CR3T", "presto:***@127.0.0.1:9/hpo"),
    ("postgresql://presto:SE/CR3T@127.0.0.1:9/hpo", "CR3T", "presto:***@127.0.0.1:9/hpo"),
    ("postgresql://presto@127.0.0.1:9/hpo?sslmode=disable&password=SECR3T", "SECR3T",
     "&password=***"),
])
def test_a_storage_password_is_never_printed_or_written(tmp_path, capsys, url, secret, shown):
    """Every form of the table in tests/unit/test_hpo_redact.py goes through the same
    redaction; these through the command line, to the error that names the URL."""
    code = submission_main(_args(tmp_path, "--storage", url))
    out = capsys.readouterr()
    assert code == 2 and "cannot open it" in out.err, out
    assert secret not in out.out + out.err and shown in out.err, out.err
    assert not (tmp_path / "study").exists()    # refused before the directory is claimed


def test_values_reach_the_run_as_typed_overrides_and_the_best_config_loads(tmp_path):
    assert hpo.trial_overrides({"optim.lr": 3.93e-4, "optim.name": "adamw",
                                "schedule.warmup_steps": 82}) == \
        ["optim.lr=0.000393", 'optim.name="adamw"', "schedule.warmup_steps=82"]
    assert hpo.toml_literal('a "q" $(x)') == '"a \\"q\\" $(x)"'
    a = hpo_args(tmp_path, "--set", "train.max_steps=7")
    study, *_ = hpo.prepare(a)
    best = {"number": 3, "value": 1234.0, "censored": False,
            "params": {"optim.lr": 0.00123, "optim.name": "adamw"}}
    text = hpo.best_config_text(study, best, [best] * 4)
    path = tmp_path / "best.toml"
    path.write_text(text)
    cfg = load_config(path)
    assert (cfg.optim.lr, cfg.optim.name, cfg.train.max_steps) == (0.00123, "adamw", 7)
    assert text.startswith("# Searched by `python -m submission hpo`") and "trial 3" in text
    base = load_config(CPU_CONFIG)
    assert cfg.model.hidden_size == base.model.hidden_size and cfg.data == base.data
    assert "1,234 samples to target" in text and "NO TRIAL" not in text
    # No trial reached the target: the header says so before anything else, and what the
    # number is - a censored score, not samples to target.
    lost = dict(best, value=2001.3, censored=True)
    text = hpo.best_config_text(study, lost, [lost, dict(lost, number=1, value=2560.0)])
    head = text.split("\n[", 1)[0]
    assert head.splitlines()[1].startswith(
        f"# NO TRIAL REACHED THE TARGET (train.target_mlm_accuracy = "
        f"{base.train.target_mlm_accuracy})"), head
    assert "samples to target" not in head and "2,001.3" in head and "x (1 + its gap" in head
    (tmp_path / "lost.toml").write_text(text)
    assert load_config(tmp_path / "lost.toml").optim.lr == 0.00123   # and it still loads


def hpo_args(tmp_path, *extra):
    import argparse
    ap = argparse.ArgumentParser()
    hpo.add_arguments(ap)
    return ap.parse_args(_args(tmp_path, *extra)[1:])


class FakeRuns:
    """run_trial's stand-in: a value from the parameters at once; ``stop_on`` trial numbers
    behave as a worker signalled mid-run (exit 4)."""

    def __init__(self, stop_on=()):
        self.seen: list[tuple[int, dict]] = []
        self.stop_on = set(stop_on)

    def __call__(self, study, trial, target, stop, env_extra=None, on_stop=lambda: None,
                 warmup_samples=0, keep_out=()):
        self.seen.append((trial.number, dict(trial.params)))
        if trial.number in self.stop_on:
            stop.signum = 15
            on_stop()    # as run_trial does when the worker is signalled
            return hpo.Outcome("retry", attrs={"exit_code": 4}, message="stopped (exit 4)")
        trial.report(0.05, step=100)
        lr = trial.params["optim.lr"]
        return hpo.Outcome("complete", 1000 + abs(lr - 0.01) * 1e5,
                           {"samples_to_target": 1000})


def _states(study):
    ostudy = hpo.open_study(study)
    return [(t.number, t.state.name, t.user_attrs.get("retry_of")) for t in ostudy.trials]


def test_the_worker_spends_the_budget_baseline_first_and_writes_the_outputs(tmp_path,
                                                                              monkeypatch):
    fake = FakeRuns()
    monkeypatch.setattr(hpo, "run_trial", fake)
    lines = []
    code = hpo.run_command(hpo_args(tmp_path, "--enqueue", "optim.lr=0.02,optim.name=adamw"),
                           out=lines.append)
    assert code == 0, lines
    study = hpo.read_study(tmp_path / "study")
    assert [s for _, s, _ in _states(study)] == ["COMPLETE"] * 4
    assert fake.seen[0][1] == {"optim.lr": 0.01, "optim.name": "lamb"}   # the config's own
    assert fake.seen[1][1] == {"optim.lr": 0.02, "optim.name": "adamw"}  # --enqueue
    rows = json.loads((tmp_path / "study" / "trials.json").read_text())
    assert rows[0]["origin"] == "baseline" and rows[0]["value"] == 1000.0
    best = load_config(tmp_path / "study" / f"{CPU_CONFIG.stem}_hpo.toml")
    assert best.optim.lr == 0.01 and best.optim.name == "lamb"
    assert (tmp_path / "study" / "history.png").stat().st_size > 1000
    assert (tmp_path / "study" / "slices.png").stat().st_size > 1000
    assert any("best trial 0" in line for line in lines), lines
    # Rerunning the finished study's command runs nothing more and writes the same answer.
    code = hpo.run_command(hpo_args(tmp_path), out=lines.append)
    assert code == 0 and len(fake.seen) == 4


def test_a_killed_workers_trial_is_failed_and_retried_once(tmp_path, monkeypatch):
    a = hpo_args(tmp_path, "--trials", "2", "--heartbeat", "1", "--heartbeat-grace", "5")
    study, *_ = hpo.prepare(a)
    ostudy = hpo.open_study(study)
    orphan = ostudy.ask({"optim.lr": FloatDistribution(1e-4, 3e-2, log=True)})  # a worker ...
    hb = hpo.heartbeat_file(study, orphan.number)
    hb.write_text("gone\n")
    os.utime(hb, (time.time() - 60, time.time() - 60))                        # ... killed
    lr = orphan.params["optim.lr"]
    fresh = ostudy.ask()                    # another worker's live trial: not touched
    hpo.heartbeat_file(study, fresh.number).write_text("alive\n")
    with hpo.bookkeeping_lock(study):
        assert hpo.reap_stale(study, ostudy) == [orphan.number]
        assert hpo.reap_stale(study, ostudy, now=time.time()) == []          # once only
    ostudy.tell(fresh, 5000.0)
    fake = FakeRuns()
    monkeypatch.setattr(hpo, "run_trial", fake)
    assert hpo.work(study, out=lambda m: None) == 0
    states = _states(study)
    assert states[:2] == [(0, "FAIL", None), (1, "COMPLETE", None)]
    assert states[2] == (2, "COMPLETE", 0) and len(states) == 2 + 1
    assert fake.seen == [(2, {"optim.lr": lr, "optim.name": fake.seen[0][1]["optim.name"]})]


def test_a_signalled_worker_fails_its_trial_and_a_rerun_retries_it(tmp_path, monkeypatch):
    fake = FakeRuns(stop_on={1})
    monkeypatch.setattr(hpo, "run_trial", fake)
    code = hpo.run_command(hpo_args(tmp_path, "--trials", "3"), out=lambda m: None)
    assert code == 4
    study = hpo.read_study(tmp_path / "study")
    assert _states(study) == [(0, "COMPLETE", None), (1, "FAIL", None), (2, "WAITING", 1)]
    fake.stop_on.clear()
    assert hpo.run_command(hpo_args(tmp_path, "--trials", "3"), out=lambda m: None) == 0
    states = _states(study)
    assert [s for _, s, _ in states] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE"]
    assert fake.seen[2][1] == fake.seen[1][1]            # the retry: the same parameters
    done = [json.dumps(p, sort_keys=True) for n, p in fake.seen if n != 1]
    assert len(done) == len(set(done)) == 3              # nothing completed twice


def test_a_stale_journal_lock_does_not_hang_the_study(tmp_path, monkeypatch):
    monkeypatch.setattr(hpo, "run_trial", FakeRuns())
    a = hpo_args(tmp_path, "--trials", "1", "--lock-grace", "1")
    study, *_ = hpo.prepare(a)
    for name in ("journal.log.lock", "bookkeeping.lock"):   # left by a killed worker
        (tmp_path / "study" / name).write_text("")
    t0 = time.monotonic()
    assert hpo.run_command(a, out=lambda m: None) == 0
    assert time.monotonic() - t0 < 30
    assert [s for _, s, _ in _states(study)] == ["COMPLETE"]


def test_the_slurm_dry_run_prints_the_array_and_never_the_password(tmp_path, small_dataset,
                                                                   capsys):
    """--slurm --dry-run: the sbatch command of a W-task array through submit's checks, the
    study directory and storage in the environment (the URL's password as ***)."""
    url = "sqlite:///" + str(tmp_path / "hpo.db")
    code = submission_main(_args(tmp_path, "--workers", "3", "--slurm", "--dry-run",
                                 "--storage", url, "--set", f'data.data_dir="{small_dataset}"',
                                 "--set", "system.walltime_minutes=7"))
    out = capsys.readouterr().out
    assert code == 0, out
    line = next(x for x in out.splitlines() if "sbatch" in x)
    assert "--array=0-2" in line and "--ntasks-per-node=2" in line and "hpo.sub" in line
    assert f"--time={2 * 7 + 5}" in line            # ceil(4 trials / 3) x 7 min + margin
    assert f"HPO_DIR={tmp_path / 'study'}" in line and "PRESTO_HPO_STORAGE=" in line
    bad = submission_main(_args(tmp_path, "--workers", "2", "--slurm", "--dry-run",
                                "--storage", url, "--set", "train.seed=3"))
    assert bad == 2 and "the seed is the config's" in capsys.readouterr().err


def test_local_workers_need_the_cores(tmp_path):
    cfg = load_config(CPU_CONFIG)
    assert hpo.local_slots(cfg, 1) == [{}]
    cores = os.cpu_count() or 1
    with pytest.raises(hpo.HpoError, match=rf"--workers {cores + 1}: .* this machine has {cores}"):
        hpo.local_slots(cfg, cores + 1)


def test_no_trial_is_pruned_before_its_warm_up_share_of_the_budget(tmp_path, capsys):
    """The first evaluations of a large-batch run are the same plateau for every setting: a
    pruner is asked only after --prune-warmup of the trial's sample budget (the sample cap or
    max_steps × the batch, whichever is smaller)."""
    cfg = load_config(CPU_CONFIG, ["train.max_steps=100", "train.global_batch_size=64"])
    assert hpo.prune_warmup_samples(cfg, 0.25) == 1600
    capped = load_config(CPU_CONFIG, ["train.max_steps=100", "train.global_batch_size=64",
                                      "train.max_samples_termination=2000"])
    assert hpo.prune_warmup_samples(capped, 0.5) == 1000
    assert hpo.prune_warmup_samples(capped, 0.0) == 0
    d = tmp_path / "study"
    assert submission_main(_args(tmp_path, "--prune-warmup", "1.5", d=d)) == 2
    assert "--prune-warmup 1.5: a fraction" in capsys.readouterr().err and not d.exists()


@pytest.mark.parametrize("sets, needle", [
    (['train.checkpoint_dir="{tmp}/shared"'], "train.checkpoint_dir"),
    (['train.checkpoint_dir="{tmp}/shared"', "train.adopt_checkpoints=true"],
     "train.checkpoint_dir"),
    (["train.adopt_checkpoints=true"], "train.adopt_checkpoints"),
    (['train.output_dir="{tmp}/out"'], "train.output_dir"),
    (["train.seed=3"], "train.seed"),
])
def test_overrides_that_make_trials_share_state_are_refused_before_the_study(tmp_path, capsys,
                                                                           monkeypatch, sets,
                                                                           needle):
    """One checkpoint directory for every trial made each trial after the first resume the
    first one's final checkpoint, train 0 steps and score the same value (exit 0); each
    trial's checkpoints, run directory and seed are its own: exit 2 naming the key, nothing
    written."""
    monkeypatch.setattr(hpo, "run_trial", FakeRuns())   # were it not refused: no real runs
    args = [a for s in sets for a in ("--set", s.format(tmp=tmp_path))]
    code = submission_main(_args(tmp_path, *args))
    err = capsys.readouterr().err
    assert code == 2 and f"--set {sets[0].split('=')[0]}" in err and needle in err, err
    assert not (tmp_path / "study").exists() and not (tmp_path / "shared").exists()


def test_a_config_file_whose_checkpoint_dir_all_trials_would_share_is_refused(tmp_path,
                                                                              capsys,
                                                                              monkeypatch):
    monkeypatch.setattr(hpo, "run_trial", FakeRuns())
    text = CPU_CONFIG.read_text().replace("[train]", f'[train]\ncheckpoint_dir = '
                                                     f'"{tmp_path}/shared"', 1)
    config = tmp_path / "config_CPU_1x2x32x1.toml"
    config.write_text(text)
    assert load_config(config).train.checkpoint_dir == f"{tmp_path}/shared"
    args = _args(tmp_path)
    args[args.index("--config") + 1] = str(config)
    code = submission_main(args)
    err = capsys.readouterr().err
    assert code == 2 and str(config) in err and "train.checkpoint_dir" in err, err
    assert not (tmp_path / "study").exists()


STAND_IN = """#!/usr/bin/env bash
# run_and_time.sh's stand-in: what a run that resumed a finished checkpoint leaves - its
# MLPerf log says success, its summary that it trained nothing after the resume.
set -e
mkdir -p "$RUN_DIR"
cp "$PRESTO_TEST_LOG" "$RUN_DIR/mlperf_bert.log"
printf '{"status": "success", "steps": 10, "samples": 160, "resumed_from": {"step": %s}}' \\
    "$PRESTO_TEST_RESUMED_STEP" > "$RUN_DIR/summary.json"
: > "$RUN_DIR/metrics.jsonl"
exit 0
"""


@pytest.mark.parametrize("resumed_step", ["10", "4"])
def test_a_trial_that_continued_a_checkpoint_never_completes(tmp_path, monkeypatch,
                                                             resumed_step):
    """Defence in depth: a trial whose run resumed a checkpoint (0 steps trained, or some) is
    not its parameters' result - FAIL, so a study of such trials reports no success (exit 1,
    no config)."""
    from tests.support.mllog import simulate
    script = tmp_path / "run_and_time.sh"
    script.write_text(STAND_IN)
    monkeypatch.setattr(hpo, "RUN_AND_TIME", script)
    monkeypatch.setenv("PRESTO_TEST_LOG", str(simulate(tmp_path / "ok.log", [0.5, 0.721])))
    monkeypatch.setenv("PRESTO_TEST_RESUMED_STEP", resumed_step)
    lines = []
    code = hpo.run_command(hpo_args(tmp_path, "--trials", "2"), out=lines.append)
    assert code == 1, lines
    study = hpo.read_study(tmp_path / "study")
    assert [s for _, s, _ in _states(study)] == ["FAIL", "FAIL"]
    assert any("resumed a checkpoint" in line for line in lines), lines
    assert not (tmp_path / "study" / f"{CPU_CONFIG.stem}_hpo.toml").exists()


SECRET = "s3cr/t:p@ss-7"   # a password with '/', ':' and '@': userinfo takes any character
ENV_SECRET = "env-held-s3cret"


def _files_holding(root: Path, needles: list[str]) -> list[str]:
    """Every file under root (any depth) whose bytes hold one of needles."""
    found = []
    for path in root.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found += [f"{path}: {n!r}" for n in needles if n.encode() in data]
    return found


@pytest.mark.parametrize("url, shown", [
    ("postgresql://presto:s3cr/t:p@ss-7@127.0.0.1:9/hpo", "postgresql://presto:***@"),
    ("postgresql://presto:s3cr%2Ft@127.0.0.1:9/hpo", "postgresql://presto:***@"),
    # SQLAlchemy reads "presto@127.0.0.1" as the user here, and a password from the ':' to
    # the '@' inside the query value: all of it is hidden
    ("postgresql://presto@127.0.0.1:9/hpo?sslmode=disable&password=s3cr/t:p@ss-7",
     "postgresql://presto@127.0.0.1:***"),
    ("postgresql://presto:${PRESTO_TEST_PW}@127.0.0.1:9/hpo", "postgresql://presto:***@"),
    ("sqlite://presto:s3cr/t:p@ss-7@/{tmp}/hpo.db", "sqlite://presto:***@"),
])
def test_no_form_of_storage_url_shows_its_secret_in_any_stream_or_file(tmp_path, url, shown):
    """`python -m submission hpo --storage URL` as a user runs it, for each form a password
    takes (userinfo with '/', ':' and '@'; percent-encoded; ?password=; ${VAR} from the
    environment): the storage cannot be opened here (no server, no driver) - exit 2 - and
    neither stream nor any file written holds the password, raw or decoded."""
    url = url.replace("{tmp}", str(tmp_path))
    env = dict(os.environ, PRESTO_TEST_PW=ENV_SECRET)
    proc = subprocess.run([sys.executable, "-m", "submission",
                           *_args(tmp_path, "--storage", url)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    secrets = [SECRET, "s3cr/t", "s3cr%2Ft", "p@ss-7", ENV_SECRET]
    assert proc.returncode == 2 and "cannot open it" in proc.stderr, proc.stderr
    assert shown in proc.stderr, proc.stderr
    streams = proc.stdout + proc.stderr
    assert not [s for s in secrets if s in streams], streams
    assert not _files_holding(tmp_path, secrets)


def test_a_study_on_a_url_with_secrets_keeps_them_out_of_every_output(tmp_path, monkeypatch,
                                                                        capfd):
    """A real study on SQLite whose URL carries ?password= from an environment variable
    (${VAR}: the secret is never on the command line) and a literal secret query value: the
    trials' runs get neither the URL nor the variable (a stand-in run_and_time.sh writes its
    environment into its run directory), and no stream or file of the study holds them."""
    from tests.support.mllog import simulate
    script = tmp_path / "run_and_time.sh"
    script.write_text('#!/usr/bin/env bash\nset -e\nmkdir -p "$RUN_DIR"\n'
                      'cp "$PRESTO_TEST_LOG" "$RUN_DIR/mlperf_bert.log"\n'
                      'env > "$RUN_DIR/environment.txt"\n'
                      'printf \'{"status": "success", "steps": 10, "samples": 160}\' '
                      '> "$RUN_DIR/summary.json"\n: > "$RUN_DIR/metrics.jsonl"\n')
    monkeypatch.setattr(hpo, "RUN_AND_TIME", script)
    monkeypatch.setenv("PRESTO_TEST_LOG", str(simulate(tmp_path / "ok.log", [0.5, 0.721])))
    monkeypatch.setenv("PRESTO_TEST_PW", ENV_SECRET)
    db = tmp_path / "db"
    db.mkdir()
    monkeypatch.setenv("PRESTO_TEST_DB", str(db))
    url = "sqlite:///${PRESTO_TEST_DB}/hpo.db?password=${PRESTO_TEST_PW}&token=" + SECRET
    code = submission_main(_args(tmp_path, "--storage", url, "--trials", "2"))
    out, err = capfd.readouterr()
    assert code == 0, out + err
    assert (db / "hpo.db").stat().st_size > 0          # ${PRESTO_TEST_DB} was expanded
    assert "password=***&token=***" in out, out
    assert not [s for s in (SECRET, ENV_SECRET) if s in out + err], out + err
    runs = list((tmp_path / "study" / "trials").glob("trial_*/environment.txt"))
    assert len(runs) == 2 and "PRESTO_TEST_LOG" in runs[0].read_text()
    assert not any(hpo.STORAGE_ENV in r.read_text() or "PRESTO_TEST_PW" in r.read_text()
                   for r in runs)
    assert not _files_holding(tmp_path / "study", [SECRET, ENV_SECRET])
    held = json.loads((tmp_path / "study" / "study.json").read_text())["storage_kind"]
    assert held == "sqlite:///${PRESTO_TEST_DB}/hpo.db?password=***&token=***"


def test_an_unset_variable_in_the_storage_url_is_refused_naming_it(tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.delenv("PRESTO_TEST_UNSET", raising=False)
    code = submission_main(_args(tmp_path, "--storage",
                                 "postgresql://presto:${PRESTO_TEST_UNSET}@127.0.0.1:9/hpo"))
    err = capsys.readouterr().err
    assert code == 2 and "PRESTO_TEST_UNSET" in err and "not set" in err, err
    assert not (tmp_path / "study").exists()


def test_a_brace_in_the_storage_url_is_a_literal_brace(tmp_path):
    """Optuna fills {SCHEMA_VERSION} into the URL with str.format: a brace of a password or
    a path raised KeyError ('cannot open it')."""
    d = tmp_path / "a{b}"
    d.mkdir()
    study = hpo.Study(name="s", dir=str(tmp_path), config="", space="", storage_kind="rdb")
    hpo.open_storage(study, f"sqlite:///{d}/hpo.db")
    assert (d / "hpo.db").stat().st_size > 0


def test_a_config_and_space_with_a_utf8_bom_are_read(tmp_path, monkeypatch):
    config = tmp_path / CPU_CONFIG.name
    config.write_bytes(b"\xef\xbb\xbf" + CPU_CONFIG.read_bytes())
    space = tmp_path / "space.toml"
    space.write_bytes(b"\xef\xbb\xbf" + SPACE.encode())
    args = _args(tmp_path, space=space)
    args[args.index("--config") + 1] = str(config)
    monkeypatch.setattr(hpo, "run_trial", FakeRuns())
    assert submission_main([*args, "--trials", "1"]) == 0     # the best config written too
    assert load_config(tmp_path / "study" / f"{CPU_CONFIG.stem}_hpo.toml").optim.lr == 0.01
