"""The orchestrator of ``python -m bench.gpu``: the command line, the plan (printed first, with
each stage's budget), each stage in its own child process and process group with its own
budget within the run's deadline, the record, the goals and summary.txt.

A stage writes each case as it finishes (bench.gpu.harness.Live) into ``--out``
(``stage_<name>.partial.json``, while it runs): a stage that runs past its budget is ended -
its whole process group, the test runs, tuner and trainings it started included (SIGTERM,
then SIGKILL) - and its record keeps every case it finished, status ``timeout``; one that
crashes keeps them too, status ``failed``. After every stage the record, the goals and
summary.txt are written again, so a call killed mid-stage (a lent machine's limit) leaves
every finished stage's verdicts and the running stage's finished cases in ``--out``; a
SIGTERM to the orchestrator ends the running stage's group and records it (status
``ended``) before it exits. ``--deadline`` counts from the command's start, the bundle's
install included: give the call's real limit, less a margin for the files' way back.

Owns: the run of the stages (their order, budgets and data needs), the child's record of its
stage, the files written to --out (their names and number), the goal verdicts, the exit
status.
Never: measures anything itself (the stages do, bench/gpu/stages/), or lets a stage's crash,
hang or out-of-memory end the run.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from bench import common
from bench.gpu.bundle import install_bundle, make_bundle
from bench.gpu.harness import partial_path
from bench.gpu.table import (BUDGET_S, NEEDS_DATA, PLAN, PLANS, STAGE, STAGE_NAMES, STAGES,
                             data_sets, help_text, plan_text)

ROOT = Path(__file__).resolve().parents[2]
SMOKE_BUDGET_S = 120
KILL_GRACE_S = 5.0
"""Seconds between the SIGTERM to a stage's process group at its budget and the SIGKILL."""


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=(
        "Check and measure the CUDA path on a GPU machine, a plan of stages per call (the open\n"
        "goals' verdicts first, in under 9 minutes on one GPU), recording every stage's\n"
        "result - and every case a stage finished - even when a later one fails (docs/GPU.md)."),
        epilog=help_text(SMOKE_BUDGET_S), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="folder for the record, summary and logs")
    ap.add_argument("--plan", default="verdicts", choices=[p.name for p in PLANS],
                    help="which stages, in which order, within which deadline (below)")
    ap.add_argument("--stages", default=None,
                    help=f"comma-separated subset of the plan's stages (of "
                         f"{','.join(STAGE_NAMES)})")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, every stage in this "
                    "process (CI: the harness itself is what is tested)")
    ap.add_argument("--isolate", action="store_true", help="with --smoke: each stage in a "
                    "process (and process group) of its own, as on a GPU")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from this command's start (the bundle's install included) "
                         "for all stages (default: the plan's): the call's real limit less a "
                         "margin - later stages are skipped, a stage's budget cut to what is "
                         "left")
    ap.add_argument("--work", type=Path, default=None, help="work folder (data sets, stage "
                    "files; default: a temporary one)")
    ap.add_argument("--bundle", type=Path, default=None, help="with --out: a bundle made here "
                    "before (its wheels are installed for the stages); alone: make one")
    ap.add_argument("--fail", default="", help=argparse.SUPPRESS)  # tests: stages to break
    ap.add_argument("--hang", default="", help=argparse.SUPPRESS)  # tests: stages that hang
    ap.add_argument("--stage-budget", type=float, default=None,
                    help=argparse.SUPPRESS)  # tests: every stage's budget
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # child: run one stage
    return ap.parse_args(argv)


# ------------------------------------------------------------------------------ the run

def run_stage_child(name: str, work: Path, smoke: bool, fail: set, plan: str = "verdicts",
                    hang: set = frozenset(), stages: tuple = (), out: Optional[Path] = None) -> int:
    """In the child: run one stage, write WORK/stage_NAME.json (its cases as they finish:
    OUT/stage_NAME.partial.json, WORK/ without ``out``)."""
    from bench.gpu.harness import Run
    t0 = time.perf_counter()
    run = Run(work=work, smoke=smoke, plan=plan, stage=name,
              data_sets=data_sets(tuple(stages) or PLAN[plan].stages), out=out)
    try:
        if name in fail:
            raise RuntimeError(f"injected failure in stage {name} (--fail)")
        if name in hang:
            _hang(run)
        result, status = STAGE[name].run(run), "ok"
        if isinstance(result, dict) and "skipped" in result and len(result) == 1:
            status = "skipped"
        elif part_errors(result):
            status = "partial"
    except CallEnded:  # (in the orchestrator's process, --smoke): the call's end, not the stage's
        raise
    except BaseException as e:  # noqa: BLE001 - the record says what broke
        traceback.print_exc()
        result, status = {"error": f"{type(e).__name__}: {e}"[:2000]}, "failed"
    rec = {"status": status, "seconds": round(time.perf_counter() - t0, 1), "result": result}
    if status == "partial":
        rec["why"] = "these parts failed: " + ", ".join(part_errors(result))
    (work / f"stage_{name}.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0 if status != "failed" else 1


def _hang(run) -> None:
    """--hang (tests): finish one case, start a child that sleeps (its pid in the work
    folder), then hang - what a stage stuck in a collective or a test run looks like."""
    out = run.result({"before_the_hang": "finished"})
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (run.work / f"hang_{run.stage}.pid").write_text(str(child.pid))
    out["child"] = child.pid
    time.sleep(600)


def part_errors(result: Any) -> list[str]:
    """The parts of a stage's result that failed (a sub-record holding ``error``): a stage
    whose combinations are caught one by one still ran, but it did not fully succeed."""
    if not isinstance(result, dict):
        return []
    return [k for k, v in result.items() if isinstance(v, dict) and isinstance(v.get("error"), str)]


class CallEnded(BaseException):
    """The orchestrator got SIGTERM (the call's limit): the running stage is ended and
    recorded, nothing after it runs."""


def _on_sigterm(signum, frame):
    raise CallEnded(f"signal {signum}")


def run_all(args, stages: list[str]) -> int:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    start = getattr(args, "t0", None) or time.monotonic()  # the command's start (main)
    work = args.work or Path(tempfile.mkdtemp(prefix="presto_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    plan = PLAN[args.plan]
    deadline = args.deadline or plan.deadline_s
    print(plan_text(plan, stages, SMOKE_BUDGET_S if args.smoke else None, args.deadline),
          flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    record: dict[str, Any] = common.record("gpu", args.argv, smoke=args.smoke, plan=plan.name,
                                           deadline_s=deadline, stages={})
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    log = open(out / "stages.log", "w")
    try:
        if args.bundle:
            extra = install_bundle(args.bundle, work)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), extra,
                                                            env.get("PYTHONPATH", "")) if p)
        else:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", ""))
                                                if p)
        record["bundle_install_s"] = round(time.monotonic() - start, 1)
        for name in stages:
            left = deadline - (time.monotonic() - start)
            budget = min(args.stage_budget or (SMOKE_BUDGET_S if args.smoke else BUDGET_S[name]),
                         left)
            if budget < 5:
                record["stages"][name] = {"status": "skipped", "why": "out of time (--deadline)"}
                continue
            if name in NEEDS_DATA and "data" not in stages and not (work / "data").is_dir():
                record["stages"][name] = {"status": "skipped",
                                          "why": "no data sets: run the data stage first, or "
                                                 "pass --work with a folder that has them"}
                continue
            t0 = time.monotonic()
            try:
                if args.smoke and not args.isolate:
                    rec = _here(name, work, args, log)
                else:
                    rec = _child(name, work, args, _stage_env(env, name), budget, log)
            except CallEnded as e:  # its group is gone: what it finished, then the end
                record["stages"][name] = _stage_record(
                    name, work, out, None, round(time.monotonic() - t0, 1), budget, ended=str(e))
                raise
            record["stages"][name] = rec
            _write_all(record, out, start)
            print(f"bench.gpu: {name:16s} {record['stages'][name]['status']:8s} "
                  f"{record['stages'][name].get('seconds', 0):6.1f} s", flush=True)
    except CallEnded as e:
        for name in stages[len(record["stages"]):]:
            record["stages"][name] = {"status": "skipped", "why": f"the call was ended ({e})"}
    finally:
        signal.signal(signal.SIGTERM, previous)
        log.close()
        xml = work / "cuda_tests.xml"
        if xml.is_file():
            shutil.copy(xml, out / "cuda_tests.xml")
    summary = _write_all(record, out, start)
    print(summary, flush=True)
    common.finish(record, _path(record, out), line={
        **{k: record[k] for k in ("benchmark", "commit", "date", "smoke", "wall_s")},
        "stages": {n: s["status"] for n, s in record["stages"].items()},
        "goals": {n: g["met"] for n, g in record["goals"].items()}})
    failed = [n for n, s in record["stages"].items()
              if s["status"] in ("failed", "timeout", "partial", "ended")]
    return 1 if failed else 0


def _write_all(record: dict, out: Path, start: float) -> str:
    """The record, its goals and summary.txt as they stand (after every stage: a call killed
    later keeps them); returns the summary."""
    record["wall_s"] = round(time.monotonic() - start, 1)
    record["goals"] = goals(record)
    summary = render_summary(record)
    (out / "summary.txt").write_text(summary)
    _save(record, out)
    return summary


def _stage_env(env: dict, name: str) -> dict:
    """A stage's environment: the allocator settings training would take for what the stage
    runs (runtime.choices.GraphMode.allocator: growable segments for eager steps, the default for a
    stage that captures graphs); a value the user set wins."""
    from runtime.choices import GRAPH_MODES
    conf = GRAPH_MODES["full" if STAGE[name].captures else "none"].allocator
    if conf is None or "PYTORCH_CUDA_ALLOC_CONF" in env or "PYTORCH_ALLOC_CONF" in env:
        return env
    return {**env, "PYTORCH_CUDA_ALLOC_CONF": conf}


def _end_group(proc: subprocess.Popen, grace: float = KILL_GRACE_S) -> None:
    """End the stage's whole process group (the stage and whatever it started: a pytest run,
    the tuner, a training): SIGTERM, then SIGKILL to what is left after ``grace`` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGTERM:
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            if not _group_alive(proc.pid):
                return


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _child(name: str, work: Path, args, env: dict, budget: float, log) -> dict:
    cmd = [sys.executable, "-m", "bench.gpu", "--stage", name, "--work", str(work),
           "--out", str(args.out), "--plan", args.plan, "--stages", ",".join(args.run_stages)]
    if args.smoke:
        cmd.append("--smoke")
    if args.fail:
        cmd += ["--fail", args.fail]
    if args.hang:
        cmd += ["--hang", args.hang]
    log.write(f"===== {name} (budget {budget:.0f} s): {' '.join(cmd)}\n")
    log.flush()
    partial = partial_path(args.out, name)
    partial.unlink(missing_ok=True)
    t0 = time.monotonic()
    # Its own session and process group: at its budget the group goes, children included.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        rc = None
    except CallEnded:  # the call's end: the stage's group first (run_all records it)
        _end_group(proc)
        raise
    _end_group(proc)  # at its budget; after a normal end, whatever it left running
    return _stage_record(name, work, args.out, rc, round(time.monotonic() - t0, 1), budget)


def _here(name: str, work: Path, args, log) -> dict:
    """--smoke: the stage in this process (no torch import and set-up per stage; a stage's
    failure is caught and recorded as in a child), its prints into stages.log."""
    import contextlib
    log.write(f"===== {name} (in this process)\n")
    log.flush()
    partial_path(args.out, name).unlink(missing_ok=True)
    fail = {s for s in args.fail.split(",") if s}
    t0 = time.monotonic()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        rc = run_stage_child(name, work, args.smoke, fail, args.plan, frozenset(),
                             tuple(args.run_stages), args.out)
    return _stage_record(name, work, args.out, rc, round(time.monotonic() - t0, 1), None)


def _stage_record(name: str, work: Path, out: Path, rc: Optional[int], seconds: float,
                  budget: Optional[float], ended: Optional[str] = None) -> dict:
    """The stage's record from its files (rc None: it ran past ``budget``, or the call was
    ``ended``): its own when it ended, else the cases it finished (OUT's partial file)."""
    partial = partial_path(out, name)
    path = work / f"stage_{name}.json"
    cases = json.loads(partial.read_text()) if partial.is_file() else None
    partial.unlink(missing_ok=True)
    if ended is not None:
        rec = {"status": "ended", "seconds": seconds,
               "why": f"the call was ended ({ended}) while it ran: its process group was "
                      f"ended, the cases it finished kept"}
        if cases is not None:
            rec["result"] = cases
        return rec
    if rc is None or not path.is_file():
        rec = {"status": "timeout" if rc is None else "failed", "seconds": seconds,
               "why": f"ran past its budget of {budget:.0f} s (its process group was ended)"
               if rc is None else f"the stage's process exited {rc} without a record (crash "
                                  f"or signal): stages.log has its output"}
        if cases is not None:
            rec["result"] = cases  # every case it finished
        return rec
    rec = json.loads(path.read_text())
    path.unlink()
    rec["seconds"] = seconds
    return rec


def _device_name(record: dict) -> str:
    env = record["stages"].get("env", {}).get("result", {})
    name = env.get("gpu") or ("cpu-smoke" if record["smoke"] else "unknown")
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def _path(record: dict, out: Path) -> Path:
    """OUT/gpu_<device>_<day>.json; the name can change once env has run, so any other
    gpu_*.json there goes: one record in the folder."""
    path = out / f"gpu_{_device_name(record)}_{record['date'][:10]}.json"
    for old in out.glob("gpu_*.json"):
        if old != path:
            old.unlink()
    return path


def _save(record: dict, out: Path) -> Path:
    return common.write(record, _path(record, out))


# ------------------------------------------------------------------------------ goals

def _result(record: dict, stage: str) -> dict:
    """A stage's recorded result - also the cases a stage that ran out of time (or whose
    call was ended) finished."""
    s = record["stages"].get(stage, {})
    return s.get("result", {}) if s.get("status") in ("ok", "partial", "timeout",
                                                       "ended") else {}


def goals(record: dict) -> dict:
    """Each goal of the stages' rows (docs/GPU.md), in the order the stages run: met
    (True/False) or None when its stage did not run."""
    out: dict[str, Any] = {}
    for stage in STAGES:
        for goal in stage.goals:
            entry = goal.entry(lambda name: _result(record, name))
            if entry is not None:
                out[goal.name] = entry
    return out


def render_summary(record: dict) -> str:
    lines = [f"bench.gpu {record['date'][:10]} commit {record['commit']} "
             f"({'smoke, CPU' if record['smoke'] else _device_name(record)}), plan "
             f"{record.get('plan', '?')}, {record.get('wall_s', 0):.0f} s of the "
             f"{record.get('deadline_s', 0):.0f} s deadline", ""]
    for name, s in record["stages"].items():
        why = s.get("why") or s.get("result", {}).get("error", "") if isinstance(
            s.get("result"), dict) else s.get("why", "")
        lines.append(f"  {name:16s} {s['status']:8s} {s.get('seconds', 0):6.1f} s"
                     + (f"  {str(why)[:100]}" if why and s["status"] != "ok" else ""))
    lines.append("")
    mark = {True: "met", False: "MISSED", None: "not measured"}
    for name, g in record.get("goals", {}).items():
        detail = {k: v for k, v in g.items() if k != "met"}
        lines.append(f"  goal {name:44s} {mark[g['met']]:13s} {json.dumps(detail, default=_num)}")
    lines += _graph_table(record)
    thr = {**_result(record, "throughput"), **_result(record, "fusions"),
           **_result(record, "throughput_paths")}
    plain = _result(record, "plain")
    rows = [(f"presto {k}", v) for k, v in thr.items() if isinstance(v, dict)] + \
           [(f"plain {k}", v) for k, v in plain.items() if isinstance(v, dict)]
    if rows:
        lines += ["", f"  {'run':32s} {'batch':>6s} {'seq/s':>9s} {'tokens/s':>10s} "
                      f"{'peak GiB':>9s}"]
        for name, v in rows:
            if "sequences_per_s" in v:
                lines.append(f"  {name:32s} {v['local_batch']:6d} {v['sequences_per_s']:9.1f} "
                             f"{v['tokens_per_s']:10.0f} {v['peak_memory_GiB']:9.2f}"
                             + _fallback_note(v))
            elif "error" in v:
                lines.append(f"  {name:32s} error: {v['error'][:80]}")
    return "\n".join(lines) + "\n"


GRAPH_TABLE_STAGES = ("graphs_compiled", "graphs", "graphs_baseline", "graph_batches")
"""The stages whose cases summary.txt tables mode by mode."""


def _graph_table(record: dict) -> list[str]:
    """summary.txt's table of the graph stages: each case and graph mode measured, one line -
    step, busy and host time a step, kernels, step over busy, host syncs of a replay."""
    lines = []
    for stage in GRAPH_TABLE_STAGES:
        for case, rec in _result(record, stage).items():
            if not isinstance(rec, dict):
                continue
            if "error" in rec:
                lines.append(f"  {case:32s} {'':8s} error: {str(rec['error'])[:80]}")
            for mode in ("full", "encoder", "eager"):
                m = rec.get(mode)
                if not isinstance(m, dict) or "skipped" in m:
                    continue
                if "step_s" not in m:
                    lines.append(f"  {case:32s} {mode:8s} error: {str(m.get('error'))[:80]}")
                    continue
                syncs = m.get("syncs_per_step")
                lines.append(
                    f"  {case:32s} {mode:8s} {m['step_s'] * 1e3:8.2f} {m['busy_s'] * 1e3:8.2f} "
                    f"{m['host_s'] * 1e3:8.2f} {m['kernels']:8.0f} "
                    f"{_num(m.get('step_over_busy')) if m.get('step_over_busy') else '-':>9} "
                    f"{'-' if syncs is None else f'{syncs:g}':>6}" + _fallback_note(rec))
    if not lines:
        return []
    return ["", f"  {'graph case':32s} {'mode':8s} {'step ms':>8s} {'busy ms':>8s} "
                f"{'host ms':>8s} {'kernels':>8s} {'step/busy':>9s} {'syncs':>6s}", *lines]


def _fallback_note(case: dict) -> str:
    got = case.get("fusion_fallbacks")
    return f"  FALLBACK to the reference: {', '.join(got)}" if got else ""


def _num(x):
    return round(x, 4) if isinstance(x, float) else str(x)


def main(argv: Optional[list[str]] = None) -> int:
    t0 = time.monotonic()  # --deadline counts from here
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.argv, args.t0 = argv, t0
    fail = {s for s in args.fail.split(",") if s}
    if args.stage:
        if args.stage not in STAGE_NAMES or args.work is None:
            print(f"bench.gpu: --stage takes one of {', '.join(STAGE_NAMES)} and --work",
                  file=sys.stderr)
            return 2
        return run_stage_child(args.stage, args.work, args.smoke, fail, args.plan,
                               {s for s in args.hang.split(",") if s},
                               tuple(s for s in (args.stages or "").split(",") if s), args.out)
    if args.bundle and args.out is None:
        return make_bundle(args.bundle)
    if args.out is None:
        print("bench.gpu: give --out DIR (or --bundle DIR to make a bundle)", file=sys.stderr)
        return 2
    plan = PLAN[args.plan]
    stages = list(plan.stages) if args.stages is None else \
        [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGE_NAMES]
    if unknown:
        print(f"bench.gpu: unknown stage(s) {', '.join(unknown)}; the stages are "
              f"{', '.join(STAGE_NAMES)}", file=sys.stderr)
        return 2
    args.run_stages = stages
    missing = None if args.smoke else no_gpu_here()
    if missing:
        print(f"bench.gpu: {missing}: the plan's stages measure a CUDA GPU and would only run "
              f"out their budgets here. On a CPU, --smoke runs every stage at tiny shapes (what "
              f"CI checks); on a GPU machine see docs/GPU_QUICKSTART.md", file=sys.stderr)
        return 2
    return run_all(args, stages)


NVIDIA_DRIVER = Path("/proc/driver/nvidia")
"""Present wherever NVIDIA's kernel driver is loaded: such a machine is never refused."""


def no_gpu_here() -> Optional[str]:
    """Why this machine has no CUDA GPU for the stages, or None. Refused only when both say
    so: NVIDIA's driver is not loaded and torch (in a child, as the stages import it) sees no
    CUDA device - a lent GPU machine, whatever its torch, always gets its run."""
    if NVIDIA_DRIVER.exists():
        return None
    proc = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, "
                           "torch.cuda.is_available())"], capture_output=True, text=True,
                          timeout=300)
    words = proc.stdout.split()
    if proc.returncode == 0 and words[-1:] == ["False"]:
        return f"no CUDA GPU here (no {NVIDIA_DRIVER}; torch {words[0]} sees no CUDA device)"
    return None
