"""What a study leaves: the trial table (printed, trials.json, trials.md), the best trial as
a ready config file (checked by loading it), and the plots (history.png, slices.png).

Owns: every output file of the study directory but study.json and the runs.
Never: runs or changes a trial; writes the best config anywhere but in the study directory,
and only once it loads.
"""
from __future__ import annotations

import json
import math
import time
import tomllib
from pathlib import Path

from runtime.config import load_config, parse_override, read_toml_text
from submission.hpo.common import EXIT_NONE_COMPLETE, EXIT_OK
from submission.hpo.space import toml_literal, trial_overrides
from submission.hpo.study import Study
from submission.hpo.worker import retried_numbers


def trial_rows(ostudy) -> list[dict]:
    retried = retried_numbers(ostudy.get_trials(deepcopy=False))
    rows = []
    for t in ostudy.get_trials(deepcopy=False):
        rows.append({"number": t.number, "state": t.state.name,
                     "retried": t.number in retried,
                     "value": t.value if t.state.name == "COMPLETE" else None,
                     "censored": bool(t.user_attrs.get("censored")),
                     "samples_to_target": t.user_attrs.get("samples_to_target"),
                     "time_to_target_s": t.user_attrs.get("time_to_target_s"),
                     "pruned_at_samples": t.user_attrs.get("pruned_at_samples"),
                     "diverged": bool(t.user_attrs.get("diverged")),
                     "origin": t.user_attrs.get("origin", "sampled"),
                     "retry_of": t.user_attrs.get("retry_of"),
                     "fail_reason": t.user_attrs.get("fail_reason"),
                     "params": t.params, "run_dir": t.user_attrs.get("run_dir")})
    return rows


def format_table(rows: list[dict], keys: list[str]) -> str:
    head = ["trial", "state", "value", *keys, "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        note = ("censored (target not reached)" if r["censored"] else
                f"pruned at {r['pruned_at_samples']} samples" if r["pruned_at_samples"] else
                "diverged" if r["diverged"] else
                "retried" if r["retried"] else (r["fail_reason"] or "")[:60])
        if r["origin"] != "sampled":
            note = f"{r['origin']}; {note}" if note else r["origin"]
        if r["retry_of"] is not None:
            note = f"retry of {r['retry_of']}; {note}"
        vals = [f"{r['params'][k]:.4g}" if isinstance(r["params"].get(k), float)
                else str(r["params"].get(k, "-")) for k in keys]
        lines.append("| " + " | ".join([str(r["number"]), r["state"].lower(),
                                         "-" if r["value"] is None else f"{r['value']:,.1f}",
                                         *vals, note]) + " |")
    return "\n".join(lines)


def best_config_text(study: Study, best: dict, rows: list[dict]) -> str:
    """The config file of the best trial: the study's config with its --set overrides and the
    trial's parameters applied, and a header saying where it came from."""
    data = tomllib.loads(read_toml_text(study.config))
    for text in [*study.overrides, *trial_overrides(best["params"])]:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
    unit = "samples" if study.objective == "samples" else "s"
    if best["censored"]:   # a score, not a time to target: say so before anything else
        reached = sum(1 for r in rows if r["value"] is not None and not r["censored"])
        target = data.get("train", {}).get("target_mlm_accuracy", "its target")
        head = ([f"# NO TRIAL REACHED THE TARGET (train.target_mlm_accuracy = {target}): these",
                 f"# values are the least bad of {len(rows)} trials, not a tuned config. Trial "
                 f"{best['number']}'s score,",
                 f"# {best['value']:,.1f}, is the {unit} its budget used x (1 + its gap to the "
                 f"target / target);",
                 "# raise the budget or change the space and search again (docs/HPO.md)."]
                if not reached else
                [f"# trial {best['number']} of {len(rows)}: censored (did not reach the "
                 f"target), score {best['value']:,.1f}."])
    else:
        what = (f"{best['value']:,.0f} samples to target" if unit == "samples" else
                f"{best['value']:,.1f} s to target")
        head = [f"# trial {best['number']} of {len(rows)}, {what}."]
    header = [
        f"# Searched by `python -m submission hpo` (study {study.name!r}, {study.dir}):",
        *head,
        f"# From {study.config} with the search space {study.space}; "
        f"{time.strftime('%Y-%m-%d')}.",
        f"# Searched keys: {', '.join(sorted(best['params']))}.", ""]
    body = []
    for section, table in data.items():
        body.append(f"[{section}]")
        body += [f"{k} = {toml_literal(v)}" for k, v in table.items()]
        body.append("")
    return "\n".join(header + body)


def plot(rows: list[dict], keys: list[str], out_dir: Path, log_keys: set[str],
         ylabel: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in rows if r["value"] is not None]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for cens, marker, label in ((False, "o", "reached the target"),
                                (True, "x", "censored (not reached)")):
        pts = [(r["number"], r["value"]) for r in done if r["censored"] == cens]
        if pts:
            ax.plot(*zip(*pts), marker, ls="", label=label)
    best, line = math.inf, []
    for r in sorted(done, key=lambda r: r["number"]):
        best = min(best, r["value"])
        line.append((r["number"], best))
    if line:
        ax.step(*zip(*line), where="post", color="k", lw=1, label="best so far")
    for r in rows:
        if r["state"] == "PRUNED":
            ax.axvline(r["number"], color="tab:gray", lw=0.5, ls=":")
    ax.set_xlabel("trial (dotted: pruned)")
    ax.set_ylabel(ylabel)
    ax.set_title("optimisation history", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "history.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2), squeeze=False)
        for ax, k in zip(axes[0], keys):
            pts = [(r["params"][k], r["value"]) for r in done if k in r["params"]]
            if pts:
                xs, ys = zip(*pts)
                if all(isinstance(x, (int, float)) for x in xs):
                    ax.plot(xs, ys, "o", ms=4)
                else:
                    cats = sorted({str(x) for x in xs})
                    ax.plot([cats.index(str(x)) for x in xs], ys, "o", ms=4)
                    ax.set_xticks(range(len(cats)), cats)
            if k in log_keys:
                ax.set_xscale("log")
            ax.set_xlabel(k, fontsize=8)
        axes[0][0].set_ylabel(ylabel)
        fig.suptitle("value against each parameter", fontsize=9)
        fig.tight_layout()
        paths.append(out_dir / "slices.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def write_outputs(study: Study, ostudy, out=print) -> int:
    """The table (printed, trials.json), the best config (checked) and the plots; 0 when a
    trial completed, else 1."""
    params = study.params()
    keys = [p.key for p in params]
    rows = trial_rows(ostudy)
    (study.path / "trials.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    table = format_table(rows, keys)
    (study.path / "trials.md").write_text(table + "\n")
    out(table)
    complete = [r for r in rows if r["state"] == "COMPLETE" and r["value"] is not None]
    pngs = plot(rows, keys, study.path, {p.key for p in params if p.log},
                "samples to target" if study.objective == "samples" else "seconds to target")
    out("plots: " + ", ".join(str(p) for p in pngs))
    if not complete:
        out(f"hpo: no trial completed in study {study.name}: no config written")
        return EXIT_NONE_COMPLETE
    best = min(complete, key=lambda r: (r["value"], r["number"]))
    path = study.path / f"{Path(study.config).stem}_hpo.toml"
    text = best_config_text(study, best, rows)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    load_config(tmp)   # the config check: it must load as it will be used
    tmp.replace(path)
    beat = [r for r in complete if r["origin"] != "baseline"]
    base = next((r for r in complete if r["origin"] == "baseline"), None)
    if base is not None:
        first = next((r for r in sorted(beat, key=lambda r: r["number"])
                      if r["value"] < base["value"]), None)
        out(f"hpo: the config's own values (trial {base['number']}): {base['value']:,.1f}; "
            + (f"first beaten by trial {first['number']} ({first['value']:,.1f})" if first
               else "not beaten"))
    if best["censored"] and not any(not r["censored"] for r in complete):
        out(f"hpo: no trial reached the target: the least bad is trial {best['number']} "
            f"(censored score {best['value']:,.1f}); its config, headed so: {path}")
    else:
        out(f"hpo: best trial {best['number']}: {best['value']:,.1f}"
            + (" (censored)" if best["censored"] else "") + f"; its config: {path}")
    return EXIT_OK
