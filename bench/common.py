"""What every ``python -m bench.X`` shares: one record schema, the runtime runner, a formatter.

Every record starts with the same header, in this order::

    {"benchmark": NAME, "command": "python -m bench.X ARGS", "commit": "abc1234[+dirty]",
     "machine": {"cpus", "cpu_model", "python", "torch", "platform", "load_avg_1m_at_end"},
     "date": "YYYY-MM-DDTHH:MM:SS+ZZ:ZZ", ...the benchmark's own fields}

``record(...)`` makes it when the benchmark starts; ``finish(record, out)`` stamps the load
average, writes the JSON to ``out`` atomically (a reader never sees half a record) and prints
it (or a compact ``line``) as the run's final JSON line. Records in bench/results/ written
before this schema carry older headers ("bench" instead of "benchmark", other machine keys).
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git_commit(tree: Path = REPO) -> str:
    """Short commit of ``tree``, ``+dirty`` when a tracked file differs; "unknown" without git."""
    try:
        sha = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown"
    return sha + ("+dirty" if dirty.strip() else "") if sha else "unknown"


def machine() -> dict:
    """The one machine shape of every record."""
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "torch": torch, "platform": platform.platform()}


def record(benchmark: str, argv: list[str], module: str | None = None, **fields) -> dict:
    """The header (``module`` names the command when it is not ``bench.<benchmark>``), then
    ``fields``."""
    command = f"python -m {module or 'bench.' + benchmark} {shlex.join(argv)}".rstrip()
    return {"benchmark": benchmark, "command": command, "commit": git_commit(),
            "machine": machine(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            **fields}


def write(rec: dict, path: Path) -> Path:
    """``rec`` as indented JSON at ``path``, replaced in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def finish(rec: dict, out: Path | None, line: dict | None = None) -> None:
    """Stamp the load average, write ``rec`` to ``out`` (when given), print the final JSON
    line: ``line`` if given (a compact view), else the whole record."""
    rec.setdefault("machine", machine())["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    if out is not None:
        print(f"record: {write(rec, out)}")
    print(json.dumps(rec if line is None else line, default=str), flush=True)


def fmt(v, spec: str) -> str:
    """``format(v, spec)``, "-" for None: table cells of figures that may be missing."""
    return "-" if v is None else format(v, spec)


# ------------------------------------------------------------- the runtime, run as a user would

MLLOG_PREFIX = ":::MLLOG "


def parse_mllog(path: str | Path) -> dict:
    """Time to target from an MLPerf log: run_stop − run_start (ms → s), status from
    run_stop's metadata, samples from the last eval_accuracy's epoch_num.

    A log without run_stop (the run crashed) gives status 'failed'. time_to_target_s and
    samples_to_target are None unless the status is 'success'."""
    start = stop = None
    status = None
    evals: list[list] = []
    for line in Path(path).read_text().splitlines():
        i = line.find(MLLOG_PREFIX)
        if i < 0:
            continue
        rec = json.loads(line[i + len(MLLOG_PREFIX):])
        key, ms, meta = rec.get("key"), rec.get("time_ms"), rec.get("metadata") or {}
        if key == "run_start":
            start = ms
        elif key == "run_stop":
            stop, status = ms, meta.get("status")
        elif key == "eval_accuracy":
            evals.append([int(meta.get("epoch_num", 0)), float(rec["value"]), ms])
    if start is None:
        return failed_run(f"{path}: no run_start")
    history = [[s, a, (ms - start) / 1000.0] for s, a, ms in evals]
    status = status if stop is not None else "failed"
    run_time = (stop - start) / 1000.0 if stop is not None else None
    samples = evals[-1][0] if evals else 0
    ok = status == "success"
    return {"status": status, "time_to_target_s": run_time if ok else None,
            "run_time_s": run_time, "samples_to_target": samples if ok else None,
            "samples": samples, "eval_accuracy": evals[-1][1] if evals else None,
            "eval_history": history}


def failed_run(error: str) -> dict:
    return {"status": "failed", "time_to_target_s": None, "run_time_s": None,
            "samples_to_target": None, "samples": None, "eval_accuracy": None,
            "eval_history": [], "error": error}


def parse_metrics(path: str | Path) -> dict:
    """Throughput (samples per second of training steps, evals excluded) and padding
    efficiency (real / computed tokens, rank 0's batches) from a runtime metrics.jsonl."""
    samples = 0
    step_s = real = computed = 0.0
    path = Path(path)
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") != "step":
                continue
            samples = rec["samples"]
            step_s += rec["step_time_s"]
            real += rec["real_tokens"]
            computed += rec["computed_tokens"]
    return {"train_time_s": step_s or None,
            "throughput_samples_per_s": samples / step_s if step_s else None,
            "padding_efficiency": real / computed if computed else None}


def launch(cmd: list[str], env: dict, log: Path, timeout: float | None) -> tuple[int, float]:
    """Run ``cmd`` in the repository, its output (after the command line) into ``log``;
    returns (exit status, 124 on timeout; wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "w") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        try:
            rc = subprocess.run(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, time.perf_counter() - t0


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_runtime(config: Path, seed: int, overrides: list[str], workdir: Path,
                timeout: float | None = None, name: str = "runtime") -> dict:
    """``SEED=seed CONFIG=config RUN_DIR=workdir/NAME_seedS ./run_and_time.sh -- OVERRIDES``:
    the run's time, samples and status from its MLPerf log, throughput and padding from
    rank 0's metrics.jsonl, the console in ``workdir/NAME_seedS.out``."""
    run_dir = workdir / f"{name}_seed{seed}"
    log = workdir / f"{name}_seed{seed}.out"
    env = dict(os.environ, SEED=str(seed), CONFIG=str(config), RUN_DIR=str(run_dir),
               LOGDIR=str(workdir), PYTHON=sys.executable)
    cmd = [str(REPO / "run_and_time.sh"), "--", *overrides]
    mllog = run_dir / "mlperf_bert.log"
    stamp = lambda st: (st.st_ino, st.st_size, st.st_mtime_ns)
    before = stamp(mllog.stat()) if mllog.is_file() else None
    rc, wall = launch(cmd, env, log, timeout)
    if not mllog.is_file():
        rec = failed_run(f"no {mllog}")
    elif stamp(mllog.stat()) == before:   # refused (exit 2) before it logged: not its log
        rec = failed_run(f"{mllog} is an earlier run's: this launch (exit {rc}) did not write it")
    else:
        rec = parse_mllog(mllog)
    rec.update(parse_metrics(run_dir / "metrics.jsonl"))
    summary = run_dir / "summary.json"
    if summary.is_file():
        rec["steps"] = json.loads(summary.read_text()).get("steps")
    if rec["status"] == "failed":
        rec["error"] = (rec.get("error", "") + "\n" + tail(log)).strip()
    rec.update(system=name, seed=seed, rc=rc, wall_s=wall, run_dir=str(run_dir),
               console=str(log), command=shlex.join(
                   [f"SEED={seed}", f"CONFIG={config}", f"RUN_DIR={run_dir}", *cmd]))
    return rec
