"""Arbitration by measurement: plans the model cannot tell apart are run side by side with the
trainer's real step, and the measured fastest is recommended - so the tuner never recommends
a plan that measures slower than one it was shown.

Owns: `ModelError` (what the tuner measured about its own error: the allreduce fit's mean
relative error, and how much the measured steps varied) and its tolerance for a row; `pick`
(which rows of the table are within that tolerance of the tuned plan: one per distinct plan,
only plans that train the same thing, at most `MAX_CONTENDERS`); `run_side_by_side` (each
contender's trainer - ``runtime.train.Trainer`` on the parts ``runtime.train.build`` makes
from the config with the contender's plan file, communication on, on the current world - one
real step each per round, interleaved, the order rotated every round so drift falls on all
alike - `order` - every step timed after a barrier to its device's end and reduced to the
slowest rank's time; a race: after each round a contender measurably slower than the leader
is out - `survivors` - and the race ends when one is left or after the rounds asked);
`decide` (the survivor with the lowest median, how each did against the tuned plan in the same
rounds, and whether the survivors could be told apart; every rank decides from the same
reduced times and checks that all agree).
Never: solves, predicts, prints or writes files (runtime.calibrate.tune.__main__ does), or
offers a plan that trains differently: with ``bucket_before`` the clip threshold τ/√K depends
on the bucket count, so only rows with the tuned plan's K are contenders.

The tolerance of a row r against the tuned plan t (seconds):

    fit · max(exposed_t, exposed_r) + noise · step_t

fit: the allreduce model's mean relative error over the sweep (every allreduce time, hence the
exposed communication, can be off by that much); noise: the measured steps' median absolute
deviation over their median (how much one step's figures move between steps - what the ready
times, spans and κ are medians of). A row predicted slower than the tuned plan by no more than
its tolerance is a contender: the model's numbers cannot rank them, a measurement can.

Measurably slower: steps on a shared machine vary by a few per cent from step to step, as
much as the plans the model cannot rank differ, so the median of three steps picks by chance
(a 12-layer bed recommended a plan 2.7 % slower than DDP's default that way). The rounds are
paired (every contender steps once per round, next to the others), so the race uses a sign
test: a contender faster than the leader (the lowest median so far) in so few rounds that a
fair coin would come up that rarely with probability below `ALPHA` is out. Survivors after
the last round could not be told apart: the lowest median among them is recommended, and the
decision says they were within measurement of each other.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from runtime.choices import clip_spec

MAX_CONTENDERS = 5   # the tuned plan and the four predicted closest: each keeps a trainer alive
STEP_SPANS = ("data_s", "forward_s", "backward_s", "optimizer_s", "tail_s")
ALPHA = 0.05         # the race's sign test: out when P(this few wins | a fair coin) < ALPHA


@dataclass(frozen=True)
class ModelError:
    """The model's error as the tuner measured it (relative)."""

    fit: float
    """mean |T(n) − t|/t of the allreduce fit over the sweep"""
    noise: float
    """median absolute deviation of the measured (communication-free) steps / their median"""
    extra: float = 0.0
    """a margin the user adds (``--arbitrate-within``), relative to the tuned step"""

    @classmethod
    def of(cls, comm, per_step: dict, extra: float = 0.0) -> "ModelError":
        """From the fitted ``CommModel`` and ``measure.StepMeasurement.per_step``."""
        spans = [per_step.get(k, []) for k in STEP_SPANS]
        steps = [sum(v) for v in zip(*[s for s in spans if s])]
        noise = 0.0
        if len(steps) >= 2:
            med = statistics.median(steps)
            noise = statistics.median(abs(x - med) for x in steps) / med if med > 0 else 0.0
        return cls(float(comm.mean_rel_err), float(noise), float(extra))

    def tolerance(self, tuned, row) -> float:
        """Seconds by which ``row``'s predicted step may exceed ``tuned``'s and still be within
        the model's error (both `runtime.calibrate.tune.simulate.Timeline`)."""
        return (self.fit * max(tuned.exposed_s, row.exposed_s)
                + (self.noise + self.extra) * tuned.step_s)

    def describe(self) -> str:
        text = (f"allreduce fit mean error {self.fit:.1%} (of the exposed communication), "
                f"measured steps vary ±{self.noise:.1%}")
        return text + (f", + {self.extra:.1%} asked (--arbitrate-within)" if self.extra else "")


@dataclass
class Contender:
    """A distinct plan to measure: the first row that has it, and the other rows with it."""

    name: str
    plan: dict                  # the plan file's content (BucketPlan.to_json)
    tied_sync: str
    predicted_s: float
    tolerance_s: float = 0.0
    same_as: list = field(default_factory=list)


def pick(rows: Sequence, error: ModelError, sizes: dict, clip_mode: str,
         limit: int = MAX_CONTENDERS) -> tuple[list[Contender], list[str]]:
    """The contenders (the tuned plan first, then the others within their tolerance, closest
    prediction first, at most ``limit``) and the names of rows left out only by ``limit``.
    ``rows``: `runtime.calibrate.tune.solve.Row`s, one named "tuned"."""
    tuned = next(r for r in rows if r.name == "tuned")
    per_bucket = clip_spec(clip_mode).per_bucket
    key = (lambda r: (r.candidate.plan.digest(), r.candidate.tied_sync))
    chosen: dict = {key(tuned): Contender("tuned", tuned.candidate.plan.to_json(sizes),
                                          tuned.candidate.tied_sync, tuned.timeline.step_s)}
    within = []
    for r in rows:
        if r is tuned:
            continue
        if per_bucket and r.timeline.num_buckets != tuned.timeline.num_buckets:
            continue   # another K: another clip threshold, another training
        tol = error.tolerance(tuned.timeline, r.timeline)
        if r.timeline.step_s - tuned.timeline.step_s <= tol:
            within.append((r.timeline.step_s, r, tol))
    left_out = []
    for _, r, tol in sorted(within, key=lambda x: x[0]):
        k = key(r)
        if k in chosen:
            chosen[k].same_as.append(r.name)
        elif len(chosen) < limit:
            chosen[k] = Contender(r.name, r.candidate.plan.to_json(sizes), r.candidate.tied_sync,
                                  r.timeline.step_s, tol)
        else:
            left_out.append(r.name)
    return list(chosen.values()), left_out


def order(n: int, r: int) -> list[int]:
    """The order contenders 0..n−1 step in at round ``r``: rotated by one each round, so each
    goes first (after the others' steps, the link and caches in another state) equally often."""
    return [(r + j) % n for j in range(n)]


def rounds(n: int, count: int) -> list[list[int]]:
    """`order` for rounds 0..count−1."""
    return [order(n, r) for r in range(count)]


def sign_p(wins: int, n: int) -> float:
    """P(at most ``wins`` heads in ``n`` tosses of a fair coin): how likely a contender as fast
    as the leader wins this rarely in ``n`` paired rounds."""
    return sum(math.comb(n, k) for k in range(wins + 1)) / 2 ** n


def survivors(times: dict[str, list[float]], alive: Sequence[str]) -> list[str]:
    """The contenders of ``alive`` (in their order) not measurably slower than the leader, the
    one with the lowest median (ties: the earlier). ``times``: the paired rounds, the same
    count for every contender of ``alive``."""
    leader = min(alive, key=lambda n: (statistics.median(times[n]), list(alive).index(n)))
    keep = []
    for n in alive:
        wins = sum(a < b for a, b in zip(times[n], times[leader]))
        if n == leader or sign_p(wins, len(times[leader])) >= ALPHA:
            keep.append(n)
    return keep


def run_side_by_side(cfg, ctx, contenders: Sequence[Contender], steps: int, warmup: int = 1,
                     log: Callable[[str], None] = lambda msg: None) -> dict[str, list[float]]:
    """Seconds of each measured step per contender, the slowest rank's: ``warmup`` rounds then
    at most ``steps`` rounds, one real training step of every contender still in per round,
    interleaved, the order rotated each round; after each round the contenders measurably
    slower than the leader are out (`survivors`), and the race ends when one is left. A
    contender's list stops at the round it went out. A collective: every rank calls it with
    the same contenders and, from the same reduced times, drops the same ones."""
    import torch

    from runtime.launch.dist import all_reduce_max, barrier
    from runtime.observe.clock import DeviceClock
    from runtime.train.build import build_parts
    from runtime.train.trainer import Trainer

    clock = DeviceClock(ctx.device)
    runs = []
    with tempfile.TemporaryDirectory(prefix="presto_arbitrate_") as tmp:
        try:
            for i, c in enumerate(contenders):
                path = Path(tmp) / f"plan{i}.json"   # on every rank: no shared file system needed
                path.write_text(json.dumps(c.plan))
                cfg_i = dataclasses.replace(cfg, train=dataclasses.replace(
                    cfg.train, grad_sync="buckets", bucket_plan=str(path),
                    checkpoint_every_samples=0))
                parts = build_parts(cfg_i, ctx, eval_batches=False)
                trainer = Trainer(cfg_i, ctx, log=lambda msg: None)
                trainer.setup(parts)
                engine_tied = "split" if getattr(trainer.grad_sync, "tied", None) else "dense"
                if engine_tied != c.tied_sync:
                    log(f"warning: {c.name} runs with tied_embedding_sync {engine_tied}, "
                        f"predicted with {c.tied_sync}")
                runs.append((trainer, iter(trainer.train_loader)))
            names = [c.name for c in contenders]
            times: dict[str, list[float]] = {n: [] for n in names}
            alive = list(range(len(runs)))
            for r in range(warmup + steps):
                step_s = {}
                for j in order(len(alive), r):
                    i = alive[j]
                    trainer, it = runs[i]
                    barrier()          # every rank starts the step together
                    clock.synchronize()
                    t = time.perf_counter()
                    trainer.train_step(it)
                    clock.synchronize()  # on a GPU the work, not its launch
                    step_s[i] = time.perf_counter() - t
                    trainer.step_log.flush()  # the logging point, outside the timed step
                if r < warmup:
                    continue
                slowest = all_reduce_max(torch.tensor([step_s[i] for i in alive],
                                                      dtype=torch.float64, device=ctx.device))
                for i, dt in zip(alive, slowest.tolist()):
                    times[names[i]].append(dt)
                keep = survivors(times, [names[i] for i in alive])
                out = [names[i] for i in alive if names[i] not in keep]
                if out:
                    leader = min(keep, key=lambda n: statistics.median(times[n]))
                    log(f"arbitration: after {r - warmup + 1} rounds {', '.join(out)} out, "
                        f"measurably slower than {leader} (sign test p < {ALPHA})")
                    for i in [i for i in alive if names[i] in out]:
                        runs[i][0].close()   # its memory back for the others
                        runs[i] = None
                alive = [i for i in alive if names[i] in keep]
                if len(alive) == 1:
                    break
        finally:
            for run in runs:
                if run is not None:
                    run[0].close()
    return times


@dataclass
class Decision:
    """What was recommended and why."""

    recommended: str
    decided_by: str            # "measurement" | "prediction"
    reason: str
    measured: dict = field(default_factory=dict)   # name -> {median_s, steps_s, vs_tuned...}

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def decide(contenders: Sequence[Contender], times: Optional[dict[str, list[float]]],
           why_not: str = "") -> Decision:
    """Of the contenders still in at the race's end (the most rounds), the one with the lowest
    median step (ties: the earlier contender, the tuned plan first); without measurements the
    tuned plan, with ``why_not`` as the reason."""
    if not times:
        return Decision("tuned", "prediction", why_not or "nothing measured")
    n = max(len(t) for t in times.values())
    final = [c.name for c in contenders if len(times[c.name]) == n]
    tuned = times["tuned"]
    measured = {}
    for c in contenders:
        t = times[c.name]
        ratios = [a / b for a, b in zip(t, tuned)]
        measured[c.name] = {"median_s": statistics.median(t), "steps_s": t,
                            "predicted_s": c.predicted_s, "same_as": c.same_as,
                            "vs_tuned_median": statistics.median(ratios),
                            "faster_than_tuned_rounds": sum(x < 1 for x in ratios),
                            "rounds": len(ratios),
                            "out_after_round": None if c.name in final else len(t)}
    best = min(final, key=lambda name: (measured[name]["median_s"], final.index(name)))
    out = len(contenders) - len(final)
    if len(final) == 1:
        reason = (f"{best} measured fastest of {len(contenders)} plans within the model's "
                  f"error: the others measurably slower (paired rounds, sign test p < {ALPHA})"
                  f" within {n} rounds of real steps, interleaved, order rotated")
    else:
        reason = (f"{best} has the lowest median of {len(final)} plans that {n} rounds of real "
                  f"steps could not tell apart ({', '.join(x for x in final if x != best)}: "
                  "within measurement of it)"
                  + (f"; {out} more measurably slower" if out else ""))
    if best != "tuned":
        m = measured[best]
        reason += (f"; {m['median_s'] * 1e3:.1f} ms against the tuned plan's "
                   f"{measured['tuned']['median_s'] * 1e3:.1f} ms, faster in "
                   f"{m['faster_than_tuned_rounds']} of {m['rounds']} rounds")
    return Decision(best, "measurement", reason, measured)
