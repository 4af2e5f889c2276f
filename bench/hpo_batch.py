"""``python -m bench.hpo_batch``: does a searched optimizer beat the scaled default at a large
batch, and does searched ADAM need fewer samples than LAMB (as Samsung found at 16K)?

On the batch-scaling study's proxy (bench.batch_scaling: the 2-layer hidden-64 BERT on the
seq-64 Wikipedia set, target masked-LM accuracy 0.10, 2 ranks, larger batches by gradient
accumulation) at ``--batch`` (default 1024, the study's largest, 32× its base batch):

1. search: ``python -m submission hpo`` once per optimizer (AdamW, LAMB), the same space and
   the same trial budget (``--trials``), as a user runs it: its first trial is the √-rule +
   LEGW default (the study's base learning rate scaled from batch 32), so the hpo table says
   how many trials the search needed to beat it; the median pruner stops hopeless trials;
2. confirm: for each optimizer, the searched best and the two scaled defaults (linear and √
   + LEGW, bench.batch_scaling.run_plan) trained with ``--seeds`` (default 1,2,3 - not the
   search's seed, so the winner is not chosen on the seed it is scored with): samples to
   target for each, read between evaluations as bench.batch_scaling reads them.

Every run has the study's budget (6× the optimizer's samples to target at the base batch); a
run short of the target by then counts as not reaching it. Writes the record (both searches'
trial tables, the confirmation runs, the answers) and prints a table.

    python -m bench.hpo_batch --out bench/results/hpo_batch.json [--trials 12] [--batch 1024]
        [--reuse-study bench/results/batch_scaling.json]

A benchmark: samples and steps do not depend on the machine's load; run it when nothing else
does if its wall times matter. Several hours on 2 cores with the defaults.
"""
from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from bench.batch_scaling import (BASE_LR, CONFIG, DATA, PROXY, crossing, ensure_data,
                                 reusable, run_plan, set_aside)
from bench.common import REPO, run_runtime, tail
from bench.harness import Benchmark, Column, listed, markdown, option, out, run

SPACE = """# bench.hpo_batch's search space: everything Samsung re-tuned for ADAM at 16K
[params."optim.lr"]
low = {lr_low}
high = {lr_high}
log = true

[params."optim.beta1"]
low = 0.8
high = 0.95

[params."optim.beta2"]
low = 0.8
high = 0.999

[params."optim.eps"]
choices = [1e-9, 1e-6]

[params."optim.weight_decay"]
low = 1e-3
high = 1e-1
log = true

[params."schedule.warmup_steps"]
low = 0
high = 40

[params."schedule.start_warmup_step"]
low = -20
high = 0
"""
EXPECTED = {"lamb": 9800.0, "adamw": 13100.0}   # samples to target at batch 32 (the study's)
BASE = {"lamb": 0.01, "adamw": 0.002}            # the study's base learning rates at batch 32
CAP = 6.0                                        # the study's budget: 6x the base samples


def plan(optimizer: str, rule: str, batch: int, target: float) -> list[str]:
    """The run's overrides: the batch-scaling study's plan for this optimizer and rule."""
    e_guess = EXPECTED[optimizer] * (1 + batch / 512)
    return run_plan(optimizer, rule, batch, 32, BASE[optimizer], e_guess, target, 400_000,
                    cap=CAP * EXPECTED[optimizer])


def space_text(optimizer: str) -> str:
    """The space, the learning rate from the base lr to 64x it (the √ rule gives 5.7x and
    the linear rule 32x at batch 1024)."""
    return SPACE.format(lr_low=BASE[optimizer], lr_high=BASE[optimizer] * 64)


def first_beating(rows: list[dict]) -> Optional[int]:
    """The number of the first trial whose value is below the baseline trial's (None if the
    baseline is missing or never beaten)."""
    base = next((r for r in rows if r.get("origin") == "baseline" and r["value"] is not None),
                None)
    if base is None:
        return None
    for r in sorted(rows, key=lambda r: r["number"]):
        if r["value"] is not None and r["origin"] != "baseline" and r["value"] < base["value"]:
            return r["number"]
    return None


def search(optimizer: str, args, workdir: Path) -> dict:
    d = workdir / f"study_{optimizer}"
    space = workdir / f"space_{optimizer}.toml"
    space.write_text(space_text(optimizer))
    over = [f"data.data_dir={args.data}", *PROXY, *plan(optimizer, "sqrt", args.batch,
                                                        args.target)]
    cmd = [sys.executable, "-m", "submission", "hpo", "--config", str(CONFIG), "--space",
           str(space), "--trials", str(args.trials), "--dir", str(d), "--study",
           f"hpo_batch_{optimizer}_{args.batch}", "--seed", str(args.search_seed),
           *[a for o in over for a in ("--set", o)]]
    t0 = time.perf_counter()
    with open(workdir / f"search_{optimizer}.out", "a") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    rows = json.loads((d / "trials.json").read_text()) if (d / "trials.json").is_file() else []
    best_cfg = d / f"{CONFIG.stem}_hpo.toml"
    done = [r for r in rows if r["state"] == "COMPLETE" and r["value"] is not None]
    best = min(done, key=lambda r: r["value"]) if done else None
    print(f"  search {optimizer}: exit {rc}, {len(rows)} trials, best "
          f"{best and best['value']:,.0f} (trial {best and best['number']}), first beating "
          f"the default: {first_beating(rows)}", flush=True)
    return {"optimizer": optimizer, "exit_code": rc, "command": " ".join(cmd),
            "wall_s": round(time.perf_counter() - t0, 1), "trials": rows,
            "best": best, "best_config": str(best_cfg) if best_cfg.is_file() else None,
            "first_beating_default": first_beating(rows),
            "error": tail(workdir / f"search_{optimizer}.out") if rc not in (0, 1) else None}


def study_runs(path: Optional[Path], batch: int, target: float) -> list[dict]:
    """The batch-scaling study's runs at ``batch`` (``--reuse-study``): its scaled defaults
    are this benchmark's, run with the same overrides and seeds, so they need not run twice."""
    if path is None:
        return []
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--reuse-study {path}: cannot read the record ({e}); name the JSON "
                         "record bench.batch_scaling wrote")
    if old.get("target") != target or old.get("proxy") != PROXY or old.get("base_batch") != 32:
        raise SystemExit(f"--reuse-study {path}: its target, proxy or base batch differ from "
                         "this benchmark's; its runs do not answer for it")
    return [r for r in old.get("runs") or [] if r["batch"] == batch]


def confirm(optimizer: str, setting: str, over: list[str], args, workdir: Path,
            earlier: list[dict] = ()) -> list[dict]:
    """Each seed's run of one setting: samples to target. A scaled default the study ran with
    the same overrides and seed is taken from ``earlier``; a run that did not train to its end
    (exit not 0 or 1) is no data point (status 'failed')."""
    out = []
    for seed in args.seeds:
        name = f"confirm_{optimizer}_{setting}_b{args.batch}"
        old = next((r for r in earlier if r["optimizer"] == optimizer and r["rule"] == setting
                    and r["seed"] == seed and reusable(r, over)), None)
        if old is not None:
            out.append({"seed": seed, "status": old["status"], "wall_s": old["wall_s"],
                        "samples_to_target": old["samples_to_target"],
                        "steps_to_target": old["steps_to_target"], "run_dir": None,
                        "error": None, "reused_from_study": True})
            print(f"  {name} seed {seed}: the study's run, {old['status']}", flush=True)
            continue
        set_aside(workdir / f"{name}_seed{seed}")
        r = run_runtime(CONFIG, seed, [f"data.data_dir={args.data}", *PROXY, *over], workdir,
                        timeout=args.run_timeout, name=name)
        if r.get("rc") not in (0, 1):
            r = {**r, "status": "failed", "eval_history": None}
        hit = crossing(r.get("eval_history") or [], args.target, args.batch)
        out.append({"seed": seed, "status": r["status"], "wall_s": round(r["wall_s"], 1),
                    "samples_to_target": hit and hit["samples"],
                    "steps_to_target": hit and hit["steps"], "run_dir": r["run_dir"],
                    "error": r.get("error")})
        print(f"  {name} seed {seed}: {r['status']}, "
              f"{'-' if not hit else format(hit['samples'], ',.0f')} samples", flush=True)
    return out


def summary_row(optimizer: str, setting: str, runs: list[dict]) -> dict:
    ok = [r["samples_to_target"] for r in runs if r["samples_to_target"] is not None]
    counted = [r for r in runs if r["status"] != "failed"]
    return {"optimizer": optimizer, "setting": setting, "runs": len(counted), "reached": len(ok),
            "mean_samples": statistics.mean(ok) if ok else None,
            "stdev_samples": statistics.stdev(ok) if len(ok) > 1 else None}


def answer(table: list[dict]) -> str:
    """Searched ADAM against searched LAMB, in words, from the confirmation table."""
    get = {(r["optimizer"], r["setting"]): r for r in table}
    a, b = get.get(("adamw", "searched")), get.get(("lamb", "searched"))
    if not a and not b:
        return "no answer: neither search found a setting that reaches the target"
    if not a or not b:
        found = "AdamW" if a else "LAMB"
        return (f"only the {found} search found a setting that reaches the target: "
                f"{'yes' if a else 'no'} for this batch and trial budget")
    if a["reached"] < a["runs"] and b["reached"] < b["runs"]:
        return "neither searched optimizer reached the target on every seed"
    if a["reached"] == a["runs"] and (b["reached"] < b["runs"]
                                      or a["mean_samples"] < b["mean_samples"]):
        return "yes: searched AdamW needs fewer samples than searched LAMB"
    return "no: searched LAMB needs no more samples than searched AdamW"


def settings(o: str, args, best: Optional[dict]) -> dict[str, list[str]]:
    """The settings to confirm for optimizer ``o``: the two scaled defaults, and the searched
    best when a trial reached the target (on the √ default's overrides)."""
    out = {"linear": plan(o, "linear", args.batch, args.target),
           "sqrt": plan(o, "sqrt", args.batch, args.target)}
    if best and best.get("censored"):   # nothing reached: no setting to confirm
        print(f"  {o}: no trial of the search reached the target; nothing to confirm",
              flush=True)
    elif best:
        out["searched"] = [*out["sqrt"]] + [
            f"{k}={json.dumps(v) if isinstance(v, str) else repr(v)}"
            for k, v in sorted(best["params"].items())]
    return out


def cases(r):
    """Each optimizer's search, then each setting's confirmation (the searched one is known
    once its search ran)."""
    for o in r.args.optimizers:
        yield ("search", o, None, None)
    for o in r.args.optimizers:
        for s, over in settings(o, r.args, r.record["searches"][o]["best"]).items():
            yield ("confirm", o, s, over)


def measure(r, case) -> dict:
    """A search, or one setting's confirmation runs; the record takes it in place (it is
    written after every case: an interrupted run keeps its data)."""
    phase, o, setting, over = case
    if phase == "search":
        r.record["searches"][o] = search(o, r.args, r.args.workdir)
        return r.record["searches"][o]
    runs = confirm(o, setting, over, r.args, r.args.workdir, r.state)
    r.record["confirmation"][f"{o}/{setting}"] = runs
    r.record["table"].append(summary_row(o, setting, runs))
    return r.record["table"][-1]


@contextlib.contextmanager
def study(r):
    """The batch-scaling study's runs to reuse (``--reuse-study``), the data, the folder."""
    ensure_data(r.args.data)
    r.args.workdir.mkdir(parents=True, exist_ok=True)
    r.record.update(complete=False, searches={}, confirmation={}, table=[])
    yield study_runs(r.args.reuse_study, r.args.batch, r.args.target)


def table(rec: dict) -> str:
    lines = ["", markdown((Column("optimizer", "optimizer"), Column("setting", "setting"),
                           Column("reached", lambda x: f"{x['reached']}/{x['runs']}"),
                           Column("mean samples to target", "mean_samples", ",.0f"),
                           Column("stdev", "stdev_samples", ",.0f")), rec["table"])]
    lines += [f"{o}: the search first beat the √-rule default at trial "
              f"{s['first_beating_default']}" for o, s in rec["searches"].items()]
    return "\n".join(lines + [f"answer: {rec['answer']}"])


BENCHMARK = Benchmark(
    "hpo_batch", __doc__, measure, cases,
    options=(option("--batch", type=int, default=1024),
             option("--trials", type=int, default=12, help="trials per optimizer's search"),
             option("--seeds", type=listed(kind=int, what="seed"), default="1,2,3",
                    help="seeds of the confirmation runs"),
             option("--search-seed", type=int, default=0, help="the sampler's seed"),
             option("--optimizers", type=listed(BASE, what="optimizer"), default="adamw,lamb",
                    help="of the study's base lrs: " + ", ".join(BASE)),
             option("--target", type=float, default=0.10),
             option("--data", type=Path, default=DATA),
             option("--run-timeout", type=float, default=1800),
             option("--workdir", type=Path, default=REPO / "results" / "hpo_batch"),
             out(REPO / "bench" / "results" / "hpo_batch.json"),
             option("--reuse-study", type=Path, default=None, metavar="RECORD",
                    help="bench.batch_scaling's record: its runs of the scaled defaults at "
                         "--batch (same overrides, same seed) are taken, not rerun")),
    fields=lambda a: dict(batch=a.batch, trials=a.trials, seeds=a.seeds, target=a.target,
                          proxy=PROXY, base_lr=BASE, expected=EXPECTED, cap_factor=CAP,
                          data=str(a.data), default_base_lr=BASE_LR),
    setup=study, partial=True,
    summary=lambda r: {"answer": answer(r.record["table"]), "complete": True},
    table=table, line=("answer", "wall_s"))


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
