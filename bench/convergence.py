"""``python -m bench.convergence``: does a variant of the step reach the target in as many
samples as the reference? Samples to target per seed, loss and accuracy curves side by side.

For each seed, each variant (``--variant NAME=OVERRIDES``, the first the reference) trains
``SEED=s CONFIG=CFG ./run_and_time.sh -- OVERRIDES`` (bench.common.run_runtime), the order
rotated per seed so slow drift of the machine falls on every variant. Per run: status, samples
and seconds to target, the eval history and rank 0's loss per step (metrics.jsonl). Verdict
per variant: ``same`` when on every seed it reached the target within ``--tolerance-evals``
evaluations of the reference's samples (the issue's "the same number of samples, or within
one evaluation"), else ``missed`` with the per-seed differences. The plot (``--plot``) draws
every run's loss against samples (one colour per variant) and its eval accuracy.

    python -m bench.convergence --config submission/configs/config_CPU_1x2x32x1.toml \\
        --seeds 1,2,3 --variant fp32= --variant bf16_master=train.precision=bf16_master \\
        --out bench/results/convergence_bf16_master.json --plot docs/benchmarks/convergence_bf16_master.png

The samples are deterministic for a seed (they do not depend on the machine's load); the
seconds do, so only the samples make the verdict. A benchmark, not a test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from bench.common import REPO, finish, fmt, record as new_record, run_runtime

RESULTS = REPO / "bench" / "results" / "convergence.json"


def losses(run_dir: Path) -> list[list[float]]:
    """[samples, loss] of every step record of rank 0's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step" and rec.get("loss") is not None:
            out.append([rec["samples"], rec["loss"]])
    return out


def eval_every(config: Path, overrides: list[str]) -> int:
    """Samples between evaluations of the reference's config (the verdict's unit)."""
    from runtime.config import load_config
    cfg = load_config(str(config), overrides)
    return cfg.train.eval_cadence()[1]


def verdict(runs: dict[str, dict[int, dict]], reference: str, every: int,
            tolerance: int) -> dict:
    """Per variant: per seed, samples to target minus the reference's (in samples and in
    evaluations); ``same`` when every seed reached it within ``tolerance`` evaluations."""
    out = {}
    for name, by_seed in runs.items():
        if name == reference:
            continue
        rows, ok = {}, True
        for seed, rec in by_seed.items():
            ref = runs[reference][seed].get("samples_to_target")
            got = rec.get("samples_to_target")
            if ref is None or got is None:
                rows[seed] = {"reference": ref, "variant": got, "evals_apart": None}
                ok = False
                continue
            apart = (got - ref) / every
            rows[seed] = {"reference": ref, "variant": got, "evals_apart": apart}
            ok = ok and abs(apart) <= tolerance
        out[name] = {"verdict": "same" if ok else "missed", "per_seed": rows}
    return out


def plot(runs: dict[str, dict[int, dict]], target: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (name, by_seed) in enumerate(runs.items()):
        c = colours[k % len(colours)]
        for j, (seed, rec) in enumerate(sorted(by_seed.items())):
            label = name if j == 0 else None
            pts = rec.get("loss_curve") or []
            if pts:
                ax_loss.plot([p[0] for p in pts], [p[1] for p in pts], color=c, lw=0.8,
                             alpha=0.8, label=label)
            hist = rec.get("eval_history") or []
            if hist:
                ax_acc.plot([h[0] for h in hist], [h[1] for h in hist], color=c, marker="o",
                            ms=3, lw=0.8, alpha=0.8, label=label)
    ax_acc.axhline(target, color="grey", ls="--", lw=0.8, label=f"target {target}")
    ax_loss.set(xlabel="samples", ylabel="training loss (rank 0)", title="loss")
    ax_acc.set(xlabel="samples", ylabel="eval masked-LM accuracy", title="accuracy")
    ax_loss.legend()
    ax_acc.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.convergence",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path,
                    default=REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=OVERRIDES",
                    help="a variant: its name, '=', its overrides separated by spaces (the "
                         "first is the reference); default fp32= and bf16_master")
    ap.add_argument("--tolerance-evals", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=None)
    args = ap.parse_args(argv)
    variants = args.variant or ["fp32=", "bf16_master=train.precision=bf16_master"]
    parsed = []
    for v in variants:
        name, _, overrides = v.partition("=")
        if not name:
            ap.error(f"--variant {v!r}: NAME=OVERRIDES")
        parsed.append((name, shlex.split(overrides)))
    seeds = [int(s) for s in args.seeds.split(",") if s]
    work = args.workdir or REPO / "results" / \
        f"convergence_{datetime.datetime.now():%Y%m%d_%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    rec = new_record("convergence", sys.argv[1:] if argv is None else argv,
                     config=str(args.config), seeds=seeds,
                     variants={n: o for n, o in parsed}, tolerance_evals=args.tolerance_evals)
    every = eval_every(args.config, parsed[0][1])
    runs: dict[str, dict[int, dict]] = {n: {} for n, _ in parsed}
    for k, seed in enumerate(seeds):
        order = parsed[k % len(parsed):] + parsed[:k % len(parsed)]
        for name, overrides in order:
            r = run_runtime(args.config, seed, overrides, work, args.timeout, name=name)
            r["loss_curve"] = losses(Path(r["run_dir"]))
            runs[name][seed] = r
            print(f"seed {seed} {name:>12}: {r['status']:>8}, samples to target "
                  f"{fmt(r.get('samples_to_target'), 'd')}, "
                  f"{fmt(r.get('time_to_target_s'), '.0f')} s", flush=True)
    from runtime.config import load_config
    target = load_config(str(args.config), parsed[0][1]).train.target_mlm_accuracy
    rec.update(eval_every_samples=every, target=target,
               verdicts=verdict(runs, parsed[0][0], every, args.tolerance_evals),
               runs={n: {str(s): r for s, r in by.items()} for n, by in runs.items()})
    if args.plot:
        plot(runs, target, args.plot)
        rec["plot"] = str(args.plot)
    for name, v in rec["verdicts"].items():
        print(f"{name}: {v['verdict']} - " + ", ".join(
            f"seed {s}: {d['variant']} vs {d['reference']} samples"
            for s, d in v["per_seed"].items()))
    finish(rec, args.out, line={"benchmark": "convergence", "verdicts": {
        n: v["verdict"] for n, v in rec["verdicts"].items()}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
