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
import contextlib
import datetime
import json
import shlex
import sys
from pathlib import Path

from bench.common import REPO, fmt, run_runtime
from bench.harness import TIMEOUT, WORKDIR, Benchmark, Goal, option, out, run, seeds

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


def variant(text: str) -> tuple[str, list[str]]:
    """``NAME=OVERRIDES`` (argparse type of --variant): the name and its overrides."""
    name, _, overrides = text.partition("=")
    if not name:
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=OVERRIDES")
    return name, shlex.split(overrides)


DEFAULT_VARIANTS = ("fp32=", "bf16_master=train.precision=bf16_master")


def variants(a) -> list[tuple[str, list[str]]]:
    return a.variant or [variant(v) for v in DEFAULT_VARIANTS]


def cases(r):
    """Per seed, every variant, the order rotated per seed (drift falls on every variant)."""
    parsed = variants(r.args)
    for k, seed in enumerate(r.args.seeds):
        for name, overrides in parsed[k % len(parsed):] + parsed[:k % len(parsed)]:
            yield seed, name, overrides


def measure(r, case) -> dict:
    seed, name, overrides = case
    a = r.args
    run_ = run_runtime(a.config, seed, overrides, r.state, a.timeout, name=name)
    run_["loss_curve"] = losses(Path(run_["run_dir"]))
    return run_


@contextlib.contextmanager
def workdir(r):
    work = r.args.workdir or REPO / "results" / \
        f"convergence_{datetime.datetime.now():%Y%m%d_%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    yield work


def summary(r) -> dict:
    """The verdicts against the reference (the first variant), the runs by variant and seed,
    the plot."""
    from runtime.config import load_config
    a, parsed = r.args, variants(r.args)
    runs: dict[str, dict[int, dict]] = {n: {} for n, _ in parsed}
    for x in r.results:
        runs[x["system"]][x["seed"]] = x
    every = eval_every(a.config, parsed[0][1])
    target = load_config(str(a.config), parsed[0][1]).train.target_mlm_accuracy
    out = {"eval_every_samples": every, "target": target,
           "verdicts": verdict(runs, parsed[0][0], every, a.tolerance_evals),
           "runs": {n: {str(s): x for s, x in by.items()} for n, by in runs.items()}}
    if a.plot:
        plot(runs, target, a.plot)
        out["plot"] = str(a.plot)
    return out


def table(rec: dict) -> str:
    return "\n".join(f"{name}: {v['verdict']} - " + ", ".join(
        f"seed {s}: {d['variant']} vs {d['reference']} samples"
        for s, d in v["per_seed"].items()) for name, v in rec["verdicts"].items())


BENCHMARK = Benchmark(
    "convergence", __doc__, measure, cases,
    options=(option("--config", type=Path,
                    default=REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml"),
             seeds("1,2,3"),
             option("--variant", type=variant, action="append", default=[],
                    metavar="NAME=OVERRIDES",
                    help="a variant: its name, '=', its overrides separated by spaces (the "
                         "first is the reference); default fp32= and bf16_master"),
             option("--tolerance-evals", type=int, default=1), out(RESULTS),
             option("--plot", type=Path, default=None), WORKDIR, TIMEOUT),
    fields=lambda a: dict(config=str(a.config), seeds=a.seeds, variants=dict(variants(a)),
                          tolerance_evals=a.tolerance_evals),
    setup=workdir,
    progress=lambda r, case, x: f"seed {case[0]} {case[1]:>12}: {x['status']:>8}, samples to "
                                f"target {fmt(x.get('samples_to_target'), 'd')}, "
                                f"{fmt(x.get('time_to_target_s'), '.0f')} s",
    summary=summary, table=table,
    goals=(Goal("every_variant_same", "every variant reaches the target within "
                "--tolerance-evals evaluations of the reference on every seed",
                lambda rec: all(v["verdict"] == "same" for v in rec["verdicts"].values())),),
    line=lambda rec: {"benchmark": "convergence",
                      "verdicts": {n: v["verdict"] for n, v in rec["verdicts"].items()}})


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
