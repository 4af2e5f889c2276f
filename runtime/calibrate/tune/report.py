"""What the tuner shows: the comparison table (text and JSON) and the timeline picture.

Owns: `table` (predicted step time and exposed communication of each plan, with what the
measurement and the fit were), `plot_timelines` (a PNG: for each plan drawn, a compute lane -
data, forward, backward, sync, optimizer - and a communication lane with every allreduce from
start to end and the moment it was issued).
Never: measures, solves or decides anything.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

MIB = 2 ** 20


def table(rows: Sequence, title: str = "") -> str:
    """Markdown table of `runtime.calibrate.tune.solve.Row`s; the baseline for ratios is 'no bucketing'."""
    base = next((r.timeline.step_s for r in rows if r.name == "no bucketing"), None)
    lines = ([title, ""] if title else []) + [
        "| plan | buckets | tied sync | predicted step ms | exposed comm ms | vs no bucketing | note |",
        "|---|---|---|---|---|---|---|"]
    best = min(r.timeline.step_s for r in rows)
    tuned = next((r.timeline.step_s for r in rows if r.name == "tuned"), best)
    near = [r.name for r in rows if r.name != "tuned" and r.timeline.step_s <= tuned * 1.02]
    for r in rows:
        tl = r.timeline
        ratio = f"{base / tl.step_s:.2f}×" if base else "—"
        name = f"**{r.name}**" if r.name == "tuned" else r.name
        step = f"**{tl.step_s * 1e3:.1f}**" if tl.step_s == best else f"{tl.step_s * 1e3:.1f}"
        lines.append(f"| {name} | {tl.num_buckets} | {r.candidate.tied_sync} | {step} | "
                     f"{tl.exposed_s * 1e3:.1f} | {ratio} | {r.candidate.note} |")
    if near:
        lines.append(f"\nwithin 2 % of the tuned plan's prediction: {', '.join(near)} - closer "
                     f"than this model's error (docs/BENCHMARKS.md, 'Bucket tuner'): measure "
                     f"them side by side before preferring one")
    return "\n".join(lines)


def profile_summary(profile, comm, spec) -> str:
    p = profile
    gb = p.total_elements() * spec.reduce_bytes
    return (f"compute (slowest rank's medians): data {p.data_s * 1e3:.1f} ms, forward "
            f"{p.forward_s * 1e3:.1f} ms, backward {p.backward_s * 1e3:.1f} ms, optimizer "
            f"{p.optimizer_s * 1e3:.1f} ms, tail {p.tail_s * 1e3:.1f} ms; {len(p.grads)} "
            f"gradients, {gb / MIB:.1f} MiB in the reduce dtype; one allreduce of all of it "
            f"{comm.time(gb) * 1e3:.1f} ms ({comm.time(gb) / p.backward_s:.2f}× backward); "
            f"communication beside backward runs κ = {p.comm_slowdown:.2f}× slower\n"
            f"allreduce model: {comm.describe()}")


def plot_timelines(timelines: Sequence, png: str | Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(timelines)
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.2 + 1.5 * n), sharex=True, squeeze=False)
    colors = {"data": "tab:gray", "forward": "tab:blue", "backward": "tab:orange",
              "sync": "tab:red", "optimizer": "tab:green", "tail": "tab:brown"}
    ms = 1e3
    for ax, tl in zip(axes[:, 0], timelines):
        for name, (a, b) in tl.spans.items():
            if b > a:
                ax.barh(1, (b - a) * ms, left=a * ms, height=0.6, color=colors.get(name, "k"),
                        label=name)
        for i, b in enumerate(tl.buckets):
            color = "tab:purple" if b.lane.startswith("b") else "tab:olive"
            ax.barh(0, (b.end - b.start) * ms, left=b.start * ms, height=0.6, color=color,
                    alpha=0.55 + 0.35 * (i % 2), edgecolor="k", linewidth=0.3)
            ax.plot([b.ready * ms] * 2, [-0.38, 0.38], color="k", lw=0.6)
        ax.set_yticks([0, 1])
        ax.set_yticklabels(["allreduce", "compute"], fontsize=8)
        ax.set_title(f"{tl.name}: {tl.num_buckets} bucket(s), step {tl.step_s * ms:.1f} ms, "
                     f"exposed communication {tl.exposed_s * ms:.1f} ms", fontsize=9)
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=5)
    axes[-1, 0].set_xlabel("ms since step start (ticks: bucket issued; olive: decoder share, "
                           "row mask, touched rows)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png
