"""Bucket plans: which elements of which parameter's gradient go into which bucket, and where
each gradient lives in the flat buffer (docs/REFERENCES.md §6).

Owns:
  * ``Piece`` and ``BucketPlan``: a plan is a list of buckets in launch order, a bucket a list of
    pieces "name" (a whole parameter) or "name[a:b]" (elements a..b-1 of the flattened
    parameter). Cut from a size cap (``BucketPlan.from_cap``: ``train.bucket_cap_mb``) or read
    from a plan file (``BucketPlan.read``: ``train.bucket_plan``, what ``python -m runtime.calibrate.tune``
    writes), validated (``validate``), written back (``to_json`` / ``write``) and compared
    across ranks by ``digest``;
  * ``GradLayout``: the flat gradient buffer a plan implies - parameters in plan order, each
    starting on a multiple of ``align`` elements and zero-padded to it (the fused optimizer's
    rows: with ``align = kernels.optim_flat.ROW`` the bucket buffer *is* the fused optimizer's
    gradient buffer), and each bucket's contiguous element range.
Never: imports torch, allocates memory or talks to other ranks - the engine
(``runtime.grad_sync.buckets``) and the tuner (``runtime.calibrate.tune``) do that with what this gives.

The plan file::

    {"format": "presto-bucket-plan/1",
     "buckets": [["cls.predictions.bias", "cls.predictions.transform.dense.weight", ...],
                 ["bert.embeddings.word_embeddings.weight[0:2000000]"],
                 ["bert.embeddings.word_embeddings.weight[2000000:]", ...]]}

Every element of every parameter that takes a gradient must be in exactly one bucket, and the
pieces of a split parameter must follow each other in element order (so its ``.grad`` stays
one view of the buffer); anything else is a `PlanError` naming the parameter and elements.
Optional keys (``"meta"``: what the tuner measured and predicted) are kept by ``read`` and
ignored by the engine.

Split parameters. A size-cap plan cuts a parameter larger than the cap (the tied word
embedding: 89% of the CPU benchmark model) into cap-sized pieces, each in its own bucket
except the last, which the following parameters join. A parameter's gradient is produced
whole (its hook fires once), so every bucket holding a piece of it becomes ready at once.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

PLAN_FORMAT = "presto-bucket-plan/1"
MB = 2 ** 20  # bucket_cap_mb counts MiB, as DDP's bucket_cap_mb does

_PIECE = re.compile(r"^(?P<name>[^\[\]]+?)(?:\[(?P<start>\d*):(?P<stop>\d*)\])?$")


class PlanError(ValueError):
    """A bucket plan that misses, repeats or mangles a parameter; the message says which."""


# ---------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened parameter ``name``."""

    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def text(self, param_numel: int) -> str:
        whole = self.start == 0 and self.stop == param_numel
        return self.name if whole else f"{self.name}[{self.start}:{self.stop}]"


@dataclass(frozen=True)
class BucketPlan:
    """Buckets of parameter pieces, in launch (= flat buffer) order."""

    buckets: tuple[tuple[Piece, ...], ...]
    source: str = "cap"

    @classmethod
    def from_cap(cls, order: Iterable[tuple[str, int]], cap_elements: int,
                 source: str = "cap", alone: Optional[str] = None) -> "BucketPlan":
        """Fill buckets up to ``cap_elements`` in ``order`` ((name, numel) pairs); a parameter
        larger than the cap is cut into cap-sized pieces (see the module docstring). The
        parameter ``alone`` (tied_embedding_sync split) gets one whole bucket of its own."""
        if cap_elements <= 0:
            raise PlanError(f"bucket cap must be > 0 elements, got {cap_elements}")
        buckets: list[tuple[Piece, ...]] = []
        current: list[Piece] = []
        used = 0
        for name, numel in order:
            start = 0
            if name == alone:
                if current:
                    buckets.append(tuple(current))
                buckets.append((Piece(name, 0, numel),))
                current, used = [], 0
                continue
            if numel > cap_elements or used + numel > cap_elements:
                if current:
                    buckets.append(tuple(current))
                current, used = [], 0
            while numel - start > cap_elements:
                buckets.append((Piece(name, start, start + cap_elements),))
                start += cap_elements
            current.append(Piece(name, start, numel))
            used += numel - start
        if current:
            buckets.append(tuple(current))
        return cls(tuple(buckets), source)

    @classmethod
    def from_json(cls, data: Any, sizes: dict[str, int], source: str = "plan") -> "BucketPlan":
        """Parse a plan file's content (see the module docstring) and validate it."""
        if not isinstance(data, dict) or not isinstance(data.get("buckets"), list):
            raise PlanError(f"{source}: a bucket plan is a JSON object with \"buckets\": a list "
                            f"of buckets, each a list of \"name\" or \"name[start:stop]\"")
        if data.get("format", PLAN_FORMAT) != PLAN_FORMAT:
            raise PlanError(f"{source}: format {data.get('format')!r} is not {PLAN_FORMAT!r}")
        buckets = []
        for b, bucket in enumerate(data["buckets"]):
            if not isinstance(bucket, list) or not all(isinstance(x, str) for x in bucket):
                raise PlanError(f"{source}: bucket {b} must be a list of strings, got {bucket!r}")
            buckets.append(tuple(_parse_piece(text, sizes, f"{source}: bucket {b}")
                                 for text in bucket))
        plan = cls(tuple(buckets), source)
        plan.validate(sizes)
        return plan

    @classmethod
    def read(cls, path: str | Path, sizes: dict[str, int]) -> "BucketPlan":
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"train.bucket_plan: {path} does not exist (write one with the bucket "
                            f"tuner, or leave train.bucket_plan empty to cut by bucket_cap_mb)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"train.bucket_plan: {path} is not valid JSON ({e})") from e
        return cls.from_json(data, sizes, str(path))

    def to_json(self, sizes: dict[str, int], meta: Optional[dict] = None) -> dict:
        out: dict[str, Any] = {"format": PLAN_FORMAT,
                               "buckets": [[p.text(sizes[p.name]) for p in bucket]
                                           for bucket in self.buckets]}
        if meta:
            out["meta"] = meta
        return out

    def write(self, path: str | Path, sizes: dict[str, int], meta: Optional[dict] = None) -> None:
        """Write the plan file atomically (a temporary file in the same directory, renamed):
        a reader never sees half a plan, and an existing plan is replaced only when complete."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(sizes, meta), f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def digest(self) -> str:
        text = json.dumps([[[p.name, p.start, p.stop] for p in b] for b in self.buckets])
        return hashlib.sha256(text.encode()).hexdigest()

    def order(self) -> list[str]:
        """Parameter names in flat-buffer order (each once)."""
        return list(dict.fromkeys(p.name for bucket in self.buckets for p in bucket))

    def split_parameters(self) -> list[str]:
        counts: dict[str, int] = {}
        for bucket in self.buckets:
            for p in bucket:
                counts[p.name] = counts.get(p.name, 0) + 1
        return [n for n, c in counts.items() if c > 1]

    def validate(self, sizes: dict[str, int]) -> None:
        """Every element of every parameter in ``sizes`` in exactly one bucket, the pieces of
        a parameter consecutive and in element order; else `PlanError`."""
        where: dict[str, list[tuple[int, int, Piece]]] = {}  # name -> (position, bucket, piece)
        position = 0
        for b, bucket in enumerate(self.buckets):
            if not bucket:
                raise PlanError(f"{self.source}: bucket {b} is empty; remove it")
            for piece in bucket:
                if piece.name not in sizes:
                    raise PlanError(_unknown(piece.name, sizes, f"{self.source}: bucket {b}"))
                numel = sizes[piece.name]
                if not 0 <= piece.start < piece.stop <= numel:
                    raise PlanError(f"{self.source}: bucket {b}: {piece.name}[{piece.start}:"
                                    f"{piece.stop}] is not a non-empty range of its {numel} "
                                    f"elements")
                where.setdefault(piece.name, []).append((position, b, piece))
                position += 1
        missing = [n for n in sizes if n not in where]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise PlanError(f"{self.source}: parameter(s) in no bucket: {', '.join(missing[:5])}"
                            f"{more}; every parameter that takes a gradient must be in the plan "
                            f"(regenerate the plan for this model)")
        for name, entries in where.items():
            _check_pieces(name, sizes[name], entries, self.source)


def _parse_piece(text: str, sizes: dict[str, int], where: str) -> Piece:
    m = _PIECE.match(text.strip())
    if not m:
        raise PlanError(f"{where}: {text!r} is not \"name\" or \"name[start:stop]\"")
    name = m["name"]
    if name not in sizes:
        raise PlanError(_unknown(name, sizes, where))
    start = int(m["start"]) if m["start"] else 0
    stop = int(m["stop"]) if m["stop"] else sizes[name]
    return Piece(name, start, stop)


def _unknown(name: str, sizes: dict[str, int], where: str) -> str:
    near = difflib.get_close_matches(name, list(sizes), 1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return (f"{where}: unknown parameter {name!r}{hint} (plans name each trainable parameter "
            f"once, by its first name in model.named_parameters(); tied aliases are not names)")


def _check_pieces(name: str, numel: int, entries: list, source: str) -> None:
    by_start = sorted(entries, key=lambda e: (e[2].start, e[0]))
    covered, last_bucket = 0, None
    for _, b, piece in by_start:
        if piece.start < covered:
            raise PlanError(f"{source}: parameter {name}: elements [{piece.start}:"
                            f"{min(piece.stop, covered)}] are in two buckets ({last_bucket} and "
                            f"{b}); each element must be in exactly one")
        if piece.start > covered:
            raise PlanError(f"{source}: parameter {name}: elements [{covered}:{piece.start}] are "
                            f"in no bucket")
        covered, last_bucket = piece.stop, b
    if covered < numel:
        raise PlanError(f"{source}: parameter {name}: elements [{covered}:{numel}] are in no "
                        f"bucket")
    positions = [e[0] for e in by_start]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        buckets = sorted({e[1] for e in entries})
        raise PlanError(f"{source}: the pieces of split parameter {name} (buckets {buckets}) "
                        f"must follow each other in element order with nothing between, so its "
                        f"gradient stays one view of the flat buffer")


def alone_bucket(plan: BucketPlan, name: str, numel: int) -> int:
    """Index of the bucket that holds all of ``name`` and nothing else; else `PlanError`."""
    for k, bucket in enumerate(plan.buckets):
        if len(bucket) == 1 and bucket[0] == Piece(name, 0, numel):
            return k
    raise PlanError(f"{plan.source}: train.tied_embedding_sync='split' needs {name} whole and "
                    f"alone in one bucket (its lookup gradient is reduced row-sparsely); put "
                    f"[\"{name}\"] as a bucket of its own in the plan")



def reverse_registration_order(named: Iterable) -> list[str]:
    """DDP's guess of gradient-production order before anything was measured: the reverse of
    ``model.named_parameters()`` (pairs or bare names)."""
    names = [item[0] if isinstance(item, tuple) else item for item in named]
    return names[::-1]


def production_order(ready_s: dict[str, float], arrival: Iterable[str]) -> list[str]:
    """The production order: parameters sorted by their measured ready time (``ready_s``:
    seconds, the slowest rank's - a bucket's allreduce starts when its last rank issues it),
    ties and parameters never seen (missing or infinite) in ``arrival`` order (the order one
    rank's hooks fired in), which must name every parameter of ``ready_s``.

    One rule for the engine's first-step re-cut (one step's times) and the tuner (medians over
    its measured steps), so a bucket's last gradient is its latest one in both: out of order,
    "ready time of the bucket's last gradient" would underestimate when a bucket can start."""
    rank = {n: i for i, n in enumerate(dict.fromkeys(arrival))}
    missing = [n for n in ready_s if n not in rank]
    if missing:
        raise ValueError(f"production_order: {', '.join(missing[:5])} not in the arrival order")
    inf = float("inf")

    def key(n: str) -> tuple[float, int]:
        t = ready_s.get(n)
        return (inf if t is None or t != t else float(t), rank[n])  # NaN: never seen
    return sorted(ready_s, key=key)


@dataclass(frozen=True)
class GradLayout:
    """Where a plan puts each gradient in the flat buffer.

    ``offsets[name]``: the parameter's first element (a multiple of ``align``); its gradient
    is ``flat[offset:offset + numel]``, followed by zeros up to the next multiple of ``align``.
    ``bounds[k]``: bucket k's element range [lo, hi) - contiguous, in plan order, covering the
    buffer exactly; a bucket that ends a parameter owns that parameter's padding.
    ``order``: parameter names in buffer order.
    """

    offsets: dict
    bounds: tuple
    order: tuple
    sizes: dict
    total: int
    align: int

    @classmethod
    def of(cls, plan: "BucketPlan", sizes: dict[str, int], align: int = 1) -> "GradLayout":
        if align < 1:
            raise ValueError(f"align must be >= 1 element, got {align}")
        offsets: dict[str, int] = {}
        offset = 0
        for name in plan.order():
            offsets[name] = offset
            offset += _padded(sizes[name], align)
        bounds, lo = [], 0
        for bucket in plan.buckets:
            last = bucket[-1]
            end = offsets[last.name] + last.stop
            if last.stop == sizes[last.name]:
                end = offsets[last.name] + _padded(sizes[last.name], align)
            bounds.append((lo, end))
            lo = end
        return cls(offsets, tuple(bounds), tuple(plan.order()),
                   {n: sizes[n] for n in plan.order()}, offset, align)

    def segments(self) -> list[tuple[str, int, int]]:
        """(name, offset, numel) in buffer order."""
        return [(n, self.offsets[n], self.sizes[n]) for n in self.order]

    def bucket_elements(self) -> list[int]:
        return [hi - lo for lo, hi in self.bounds]


def _padded(numel: int, align: int) -> int:
    return -(-numel // align) * align


def plan_sizes(plan: BucketPlan) -> dict[str, int]:
    """Element count of each parameter, as far as the plan shows it (the last piece's stop)."""
    sizes: dict[str, int] = {}
    for bucket in plan.buckets:
        for p in bucket:
            sizes[p.name] = max(sizes.get(p.name, 0), p.stop)
    return sizes


def resolve_tied_sync(asked: str, clip_mode: str, world_size: int, *,
                      rows: Optional[int] = None, tokens_per_step: Optional[int] = None,
                      device_type: str = "cpu", cuda_graphs: str = "none",
                      pays: Optional[bool] = None, plan: Optional[BucketPlan] = None,
                      tied: Optional[tuple[str, int]] = None) -> tuple[str, str]:
    """``train.tied_embedding_sync`` resolved, and why: the one decision the gradient sync,
    the tuner and the projection take. 'auto' is split where it applies - several ranks, a
    clip after the allreduce, no CUDA graphs, a tied embedding (``rows``: its rows, None
    where the model has none) - and pays (``pays``, where the caller measured it; else
    `split_pays` of ``rows``, ``tokens_per_step`` - at most the tokens one rank feeds one
    step, ``Config.tokens_per_step`` - and ``device_type``), and where the bucket plan keeps
    the embedding whole and alone (``plan``, a plan file's or a candidate's, with ``tied``:
    the embedding's name and elements; without them the caller cuts the plan around it);
    dense otherwise. Split needs the tied embedding whole and alone in one bucket
    (`alone_bucket`)."""
    if asked != "auto":
        return asked, f"asked (train.tied_embedding_sync = {asked})"
    if cuda_graphs != "none":
        return "dense", ("auto: dense under train.cuda_graphs (the split's decoder tap would "
                         "fire inside a graphed backward)")
    if world_size <= 1:
        return "dense", "auto: dense on one rank (nothing to average)"
    from runtime.choices import clip_spec
    if clip_spec(clip_mode).before_allreduce:
        return "dense", (f"auto: dense with clip_mode {clip_mode} (it clips each rank's "
                         f"whole buckets before the allreduce)")
    if rows is None:
        return "dense", "auto: dense (no tied embedding and decoder found)"
    if pays is None and not split_pays(rows, tokens_per_step, world_size, device_type):
        return "dense", (f"auto: dense - on CUDA the split sends min(tokens of every rank, "
                         f"vocabulary) rows: {tokens_per_step} x {world_size} tokens a step "
                         f"reach the {rows} rows, so it would send all of them and more")
    if pays is False:
        return "dense", ("auto: dense - the split would not pay on this device "
                         "(runtime.grad_sync.plan.split_pays)")
    if plan is not None and tied is not None and not _is_alone(plan, *tied):
        return "dense", "auto: dense - the bucket plan cuts the tied embedding"
    return "split", "auto: split (several ranks, a clip after the allreduce, and it pays)"


def _is_alone(plan: BucketPlan, name: str, numel: int) -> bool:
    try:
        alone_bucket(plan, name, numel)
    except PlanError:
        return False
    return True


def split_pays(vocab_rows: int, tokens_per_step: Optional[int], world_size: int,
               device_type: str) -> bool:
    """Whether splitting the tied embedding can pay. On CUDA the touched rows travel in a
    fixed-size buffer of min(tokens of every rank, vocabulary) rows (no host read of the
    count): when every rank's tokens together reach the vocabulary - 56 × 512 × 8 tokens
    against BERT's 30,522 rows on one DGX A100 - that buffer is the whole vocabulary, the
    lookup's allreduce is as big as a dense one, and the split only adds the decoder share's
    allreduce and the mask's. On CPU the touched rows are counted exactly: it can always pay."""
    if device_type != "cuda" or tokens_per_step is None:
        return True
    return tokens_per_step * world_size < vocab_rows
