"""A study's identity and storage: ``study.json`` in the study directory (which study it
holds; another study's command is refused), Optuna's storage (a journal file in that
directory by default, or an RDB URL whose secrets are never printed, written or passed on),
the sampler, and the first trials of a new study.

Owns: the Study record (everything a worker needs; its IDENTITY fields a later command must
repeat), claiming a directory, opening the storage and the Optuna study, the URL's
redaction and ``${VAR}`` expansion, the sampler rows.
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
from submission.hpo.objective import PRUNERS
from submission.hpo.space import Param, load_space

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Query arguments that carry a secret (libpq's password/sslpassword, MySQL's passwd, tokens).
_SECRET_ARG = re.compile(r"pass|pwd|secret|token|credential|auth", re.IGNORECASE)


def redact(url: Optional[str]) -> str:
    """A storage URL fit to print: the password of its userinfo and every secret query
    argument (``?password=``) replaced by ***. The userinfo runs to the last '@' before the
    query, so a password may hold any character ('/', ':', '@' included); ``${VAR}``
    references are shown as written (their values are never in the URL given)."""
    if not url:
        return "journal"
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL: not shown>"
    where, q, query = rest.partition("?")
    if "@" in where:
        userinfo, host = where.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        where = f"{user}:***@{host}" if colon else f"{userinfo}@{host}"
    if q:
        query = "&".join(f"{k}=***" if eq and _SECRET_ARG.search(k) else f"{k}{eq}{v}"
                         for k, eq, v in (arg.partition("=") for arg in query.split("&")))
    return f"{scheme}://{where}{q}{query}"


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
    """Every secret of a storage URL as it may appear in a message: the password (the URL's
    and the expanded one, raw and percent-decoded) and each secret query value; longest
    first, so a longer one is hidden whole."""
    from urllib.parse import unquote, unquote_plus
    found: set[str] = set()
    if not url:
        return []
    for form in (url, _ENV_REF.sub(lambda m: os.environ.get(m.group(1), ""), url)):
        if "://" not in form:
            continue
        rest = form.partition("://")[2]
        where, _, query = rest.partition("?")
        if "@" in where:
            found.add(where.rsplit("@", 1)[0].partition(":")[2])
        for arg in query.split("&") if query else ():
            k, eq, v = arg.partition("=")
            if eq and _SECRET_ARG.search(k):
                found.add(v)
    found |= {os.environ.get(n, "") for n in storage_env_names(url)}
    found |= {f(x) for x in list(found) for f in (unquote, unquote_plus)}
    return sorted((x for x in found if len(x) >= 3), key=len, reverse=True)


def scrub(text: str, url: Optional[str]) -> str:
    """``text`` (a driver's or server's message) with every secret of ``url`` as ***."""
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
