"""What the tuner shows: the comparison table (text and JSON) and the timeline picture.

Owns: `table` (predicted step time and exposed communication of each plan, the measured step
of those run side by side, which is recommended), `arbitration_note` (the model's measured
error, the plans within it, what decided), `profile_summary` (what was measured and the
fit), `plot_timelines` (a PNG: for each plan drawn, a compute lane -
data, forward, backward, sync, optimizer - and a communication lane with every allreduce from
start to end and the moment it was issued).
Never: measures, solves or decides anything.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

MIB = 2 ** 20


def table(rows: Sequence, title: str = "", measured: Optional[dict] = None,
          recommended: str = "tuned") -> str:
    """Markdown table of `runtime.calibrate.tune.solve.Row`s; the baseline for ratios is 'no
    bucketing'. ``measured``: {row name: measured step seconds} of the rows run side by side
    (a column, shown when any was); ``recommended``: the row whose plan is recommended."""
    base = next((r.timeline.step_s for r in rows if r.name == "no bucketing"), None)
    measured = measured or {}
    mcol = bool(measured)
    lines = ([title, ""] if title else []) + [
        "| plan | buckets | tied sync | predicted step ms | " + ("measured step ms | " if mcol
                                                              else "")
        + "exposed comm ms | vs no bucketing | note |",
        "|---|---|---|---|---|---|---|" + ("---|" if mcol else "")]
    best = min(r.timeline.step_s for r in rows)
    fastest = min(measured.values()) if measured else None
    for r in rows:
        tl = r.timeline
        ratio = f"{base / tl.step_s:.2f}×" if base else "—"
        name = f"**{r.name}**" if r.name == "tuned" else r.name
        if r.name == recommended:
            name += " ← recommended"
        step = f"**{tl.step_s * 1e3:.1f}**" if tl.step_s == best else f"{tl.step_s * 1e3:.1f}"
        cells = [name, str(tl.num_buckets), r.candidate.tied_sync, step]
        if mcol:
            m = measured.get(r.name)
            cells.append("—" if m is None else f"**{m * 1e3:.1f}**" if m == fastest
                         else f"{m * 1e3:.1f}")
        cells += [f"{tl.exposed_s * 1e3:.1f}", ratio, r.candidate.note]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def arbitration_note(error: str, within: Sequence[str], left_out: Sequence[str],
                     decided_by: str, reason: str, no_arbitrate: bool = False) -> str:
    """The lines under the table: the model's measured error, the rows predicted within it of
    the tuned plan, and what decided the recommendation."""
    lines = [f"model error: {error}"]
    if within:
        lines.append(f"predicted within it of the tuned plan: {', '.join(within)}"
                     + (f" (not measured, {len(left_out)} more: {', '.join(left_out)})"
                        if left_out else ""))
    if decided_by == "measurement":
        lines.append(f"decided by measurement: {reason}")
    elif no_arbitrate and within:
        lines.append("decided by prediction (--no-arbitrate): the model cannot rank the plans "
                     "above; measure them side by side before preferring one")
    else:
        lines.append(f"decided by prediction: {reason}")
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
