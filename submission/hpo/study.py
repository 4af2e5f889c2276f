"""A study's identity and storage: ``study.json`` in the study directory (which study it
holds; another study's command is refused), Optuna's storage (a journal file in that
directory by default, or an RDB URL whose secrets are never printed, written or passed on),
the sampler, and the first trials of a new study.

Owns: the Study record (everything a worker needs; its IDENTITY fields a later command must
repeat), claiming a directory, opening the storage and the Optuna study, the URL's
redaction and ``${VAR}`` expansion, the sampler and pruner rows.
Never: runs a trial, counts the budget (worker.py) or touches Optuna's private names
(optuna_api.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from submission.hpo.common import STORAGE_ENV, STUDY_FILE, HpoError
from submission.hpo.space import Param, load_space

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Query arguments that carry a secret: libpq's password/sslpassword, MySQL's passwd, tokens,
# keys, signatures (a key is percent-decoded before it is matched).
_SECRET_ARG = re.compile(r"pass|pwd|secret|token|credential|auth|key|^sig$|signature|session",
                         re.IGNORECASE)
# A value that itself holds secret arguments (an ODBC connection string: odbc_connect=...PWD=x).
_NESTED_SECRET = re.compile(r"(pass|pwd|secret|token)\w*\s*=", re.IGNORECASE)
_NOT_A_NAME = re.compile(r"[/?#&=;@]")   # a user name holds none of these


def _secret_spans(url: str) -> list[tuple[int, int]]:
    """Where ``url`` may hold a secret, as (start, end) spans, by every reading a driver may
    make of it - whichever is right, the secret is inside a span:
      * a password with any character in it ('?', '/', ':', '@', '#'): when a plain user
        name and a ':' come before the first '@' (``user:password@``), what follows that
        ':' up to the *last* '@';
      * SQLAlchemy's reading (Optuna's RDB storage parses with it): a user name of anything
        but ':' and '/', then a password from the ':' to the *first* '@' after it;
      * every query argument whose key looks secret, or whose value holds secret arguments,
        after the first '?' and after the first '?' past the last '@'.
    A span may hide more than the secret (an '@' in a query value): never less."""
    from urllib.parse import unquote_plus
    head = url.find("://")
    if head < 0:
        return [(0, len(url))]
    start = head + 3
    rest = url[start:]
    spans = []
    first_at, last_at, colon = rest.find("@"), rest.rfind("@"), rest.find(":")
    if 0 <= colon < first_at and not _NOT_A_NAME.search(rest[:colon]):
        spans.append((start + colon + 1, start + last_at))
    m = re.match(r"[^:/]*:([^@]*)@", rest)
    if m:
        spans.append((start + m.start(1), start + m.end(1)))
    for q in {rest.find("?"), rest.find("?", last_at + 1) if last_at >= 0 else -1}:
        if q < 0:
            continue
        base = start + q + 1
        for arg in re.finditer(r"([^&;=]*)(=?)([^&;]*)", url[base:]):
            key, eq, value = arg.groups()
            if eq and (_SECRET_ARG.search(unquote_plus(key))
                       or _NESTED_SECRET.search(unquote_plus(value))):
                spans.append((base + arg.start(3), base + arg.end(3)))
    return [(a, b) for a, b in spans if b > a]


def redact(url: Optional[str]) -> str:
    """A storage URL fit to print or write: every place that may hold a secret
    (``_secret_spans``: the userinfo's password, with any character in it, and every secret
    query argument) replaced by ***. Everything that prints or writes a storage URL - the
    banner, study.json, --slurm --dry-run, every error - shows it through this function."""
    if not url:
        return "journal"
    if "://" not in url:
        return "<not a URL: not shown>"
    merged: list[list[int]] = []
    for a, b in sorted(_secret_spans(url)):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out, pos = [], 0
    for a, b in merged:
        out += [url[pos:a], "***"]
        pos = b
    return "".join(out) + url[pos:]


def storage_env_names(url: Optional[str]) -> list[str]:
    """The environment variables a storage URL refers to (``${NAME}``)."""
    return _ENV_REF.findall(url or "")


def expand_storage(url: str) -> str:
    """``${NAME}`` references replaced by the environment's values (exit 2 naming an unset
    one): a password kept in a variable never reaches a command line, ps, a job script or
    study.json."""
    missing = [n for n in storage_env_names(url) if n not in os.environ]
    if missing:
        raise HpoError(f"--storage {redact(url)}: ${{{missing[0]}}} names an environment "
                       f"variable that is not set here: export it (Slurm workers get this "
                       f"environment too) or write the value into the URL")
    return _ENV_REF.sub(lambda m: os.environ[m.group(1)], url)


def storage_secrets(url: Optional[str]) -> list[str]:
    """Every secret of a storage URL as it may appear in a message: what ``redact`` hides
    (of the URL as given and as expanded), the values of the variables it names, each raw
    and percent-decoded; longest first, so a longer one is hidden whole."""
    from urllib.parse import unquote, unquote_plus
    found: set[str] = set()
    if not url:
        return []
    for form in (url, _ENV_REF.sub(lambda m: os.environ.get(m.group(1), ""), url)):
        if "://" in form:
            found |= {form[a:b] for a, b in _secret_spans(form)}
    found |= {os.environ.get(n, "") for n in storage_env_names(url)}
    found |= {f(x) for x in list(found) for f in (unquote, unquote_plus)}
    found |= {part for x in list(found) for part in x.split("@")}   # a raw '@' in it
    found |= {m.group(2) for x in list(found)   # PWD=... inside a connection string
              for m in re.finditer(_NESTED_SECRET.pattern + r"\s*([^;&]*)", x, re.IGNORECASE)}
    return sorted((x for x in found if len(x) >= 3), key=len, reverse=True)


def scrub(text: str, url: Optional[str]) -> str:
    """``text`` (a driver's or server's message) with ``url`` (as given or expanded) shown
    redacted and every secret of it as ***."""
    if url and "://" in url:
        full = _ENV_REF.sub(lambda m: os.environ.get(m.group(1), ""), url)
        text = text.replace(full, redact(url)).replace(url, redact(url))
    for secret in storage_secrets(url):
        text = text.replace(secret, "***")
    return text


@dataclass
class Study:
    """Everything a worker needs, from the command line; ``study.json`` in ``dir`` keeps the
    identity fields, which a later command must repeat."""

    name: str
    dir: str
    config: str
    space: str
    objective: str = "samples"
    overrides: list[str] = field(default_factory=list)
    trials: int = 10
    pruner: str = "median"
    prune_after: int = 3
    prune_warmup: float = 0.25
    sampler: str = "tpe"
    seed: int = 0
    storage_kind: str = "journal"        # "journal" | the redacted RDB URL
    heartbeat_s: float = 10.0
    heartbeat_grace_s: float = 120.0
    lock_grace_s: int = 30
    space_sha256: str = ""
    config_sha256: str = ""

    IDENTITY = ("name", "config", "config_sha256", "space_sha256", "objective", "overrides",
                "storage_kind")

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def params(self) -> list[Param]:
        return load_space(self.space, self.config, self.overrides)


def sha256_of(path: str) -> str:
    """The file's SHA-256: the config and the space are part of a study's identity."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def claim_dir(study: Study) -> None:
    """Write ``study.json`` into a new or empty directory, or check that the directory holds
    this very study (a rerun resumes it); another study's directory is refused."""
    d = study.path
    f = d / STUDY_FILE
    if f.is_file():
        try:
            held = json.loads(f.read_text())
        except ValueError as e:
            raise HpoError(f"{f} is not readable JSON ({e}): this directory's study record is "
                           f"damaged; choose another --dir") from None
        for key in Study.IDENTITY:
            if held.get(key) != getattr(study, key):
                raise HpoError(
                    f"--dir {d} holds another study ({key}: {held.get(key)!r} there, "
                    f"{getattr(study, key)!r} here): rerun that study's own command to resume "
                    f"it, or choose another --dir (or --study name)")
    elif d.exists() and any(d.iterdir()):
        raise HpoError(f"--dir {d} exists, is not empty and holds no {STUDY_FILE}: it is not a "
                       f"study directory; choose another --dir")
    try:
        d.mkdir(parents=True, exist_ok=True)
        for sub in ("trials", "heartbeats"):
            (d / sub).mkdir(exist_ok=True)
        tmp = f.with_name(f.name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(study), indent=2) + "\n")
        tmp.replace(f)
    except OSError as e:
        raise HpoError(f"--dir {d}: cannot write the study record ({e.strerror or e})") from None


def read_study(d: Path) -> Study:
    f = Path(d) / STUDY_FILE
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise HpoError(f"{f} does not exist: --dir must be a study directory that "
                       f"`python -m submission hpo` created") from None
    except ValueError as e:
        raise HpoError(f"{f} is not readable JSON ({e})") from None
    known = {x.name for x in dataclasses.fields(Study)}
    return Study(**{k: v for k, v in data.items() if k in known})


def open_storage(study: Study, url: Optional[str]):
    """The study's Optuna storage: its journal file, or the RDB at ``url`` (its ``${VAR}``s
    expanded here); exit 2 with the URL redacted when it cannot be opened."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
    if study.storage_kind == "journal":
        path = str(study.path / "journal.log")
        return JournalStorage(JournalFileBackend(
            path, lock_obj=JournalFileOpenLock(path, grace_period=study.lock_grace_s)))
    if not url:
        raise HpoError(f"study {study.name} keeps its trials in {study.storage_kind}: give the "
                       f"URL again (--storage, or {STORAGE_ENV} for a worker)")
    full = expand_storage(url)
    try:
        # Optuna fills {SCHEMA_VERSION} into the URL with str.format: a brace of a password
        # (or of a value from the environment) is a literal brace.
        return optuna.storages.RDBStorage(full.replace("{", "{{").replace("}", "}}"))
    except Exception as e:  # a driver's or server's error: say it without the secrets
        msg = scrub(str(e).replace(full, redact(url)).replace(url, redact(url)), url)
        raise HpoError(f"--storage {redact(url)}: cannot open it ({type(e).__name__}: "
                       f"{msg.splitlines()[0] if msg else ''})") from None


# The samplers --sampler names: how a worker draws the next point, from the seed open_study
# gives it.
def _tpe(study: Study, seed: int):
    import optuna
    return optuna.samplers.TPESampler(seed=seed, constant_liar=True,
                                      n_startup_trials=max(study.prune_after, 3))


def _random(study: Study, seed: int):
    import optuna
    return optuna.samplers.RandomSampler(seed=seed)


SAMPLERS = {"tpe": _tpe, "random": _random}


# The pruners --pruner names. median: a trial worse than the median of earlier trials at the
# same samples, after --prune-after complete trials; halving: successive halving (ASHA).
def _median(study: Study):
    import optuna
    return optuna.pruners.MedianPruner(n_startup_trials=study.prune_after, n_warmup_steps=0)


def _halving(study: Study):
    import optuna
    return optuna.pruners.SuccessiveHalvingPruner()


def _none(study: Study):
    import optuna
    return optuna.pruners.NopPruner()


PRUNERS = {"median": _median, "halving": _halving, "none": _none}


def open_study(study: Study, url: Optional[str] = None, worker: int = 0):
    """The Optuna study (created on first use) with the study's sampler and pruner, for
    worker ``worker``."""
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(study, url)
    # Workers of one study, and a resumed worker, must not draw the same points: the seed
    # moves with the worker's index and with the trials the study already holds.
    done = 0
    with contextlib.suppress(KeyError):
        done = len(storage.get_all_trials(storage.get_study_id_from_name(study.name),
                                          deepcopy=False))
    seed = study.seed + 100_003 * worker + done
    return optuna.create_study(study_name=study.name, storage=storage,
                               direction="minimize", sampler=SAMPLERS[study.sampler](study, seed),
                               pruner=PRUNERS[study.pruner](study), load_if_exists=True)


def enqueue_first(study: Study, ostudy, params: list[Param], cfg, baseline: bool,
                  enqueued: list[dict]) -> None:
    """On a new study: the config's own values first (the default to beat), then --enqueue."""
    if ostudy.get_trials(deepcopy=False):
        return
    if baseline:
        own = {p.key: getattr(getattr(cfg, p.key.split(".")[0]), p.key.split(".")[1])
               for p in params}
        own = {k: v for k, v in own.items() if next(p for p in params if p.key == k).contains(v)}
        ostudy.enqueue_trial(own, user_attrs={"origin": "baseline"})
    for values in enqueued:
        ostudy.enqueue_trial(values, user_attrs={"origin": "enqueued"})
