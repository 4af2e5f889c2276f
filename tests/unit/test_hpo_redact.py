"""The storage URL's redaction (submission.hpo.study.redact): one function that every path
printing or writing a storage URL goes through (the banner, study.json, --slurm --dry-run,
the errors), held to a table of URL forms - a password with any character in it ('?', '/',
'@' raw or percent-encoded, ':', '#', '&'), secret query arguments however spelled, a
connection string inside a value - and to the secrets ``scrub`` hides in a driver's message.
Through the command line: tests/integration/test_hpo.py."""
from __future__ import annotations

import pytest

from submission.hpo.study import redact, scrub, storage_secrets

# (url, the secrets that must never show - the password as a driver reads it first -, what
# redact shows; None: only that no secret shows)
FORMS = [
    ("postgresql://presto:s3cr3t-pw@127.0.0.1:9/hpo", ["s3cr3t-pw"],
     "postgresql://presto:***@127.0.0.1:9/hpo"),
    ("postgresql://user:SE?CRET@127.0.0.1:1/db", ["SE?CRET", "CRET"],
     "postgresql://user:***@127.0.0.1:1/db"),
    ("postgresql://user:SE/CRET@127.0.0.1:1/db", ["SE/CRET", "CRET"],
     "postgresql://user:***@127.0.0.1:1/db"),
    ("mysql+pymysql://user:S%2FECRET@host/db", ["S%2FECRET", "ECRET"],
     "mysql+pymysql://user:***@host/db"),
    ("postgresql://user:SE%40CRET@host/db", ["SE%40CRET", "CRET"], "postgresql://user:***@host/db"),
    ("postgresql://user:SE@CRET@host/db", ["SE@CRET", "CRET"], "postgresql://user:***@host/db"),
    ("postgresql://user:SE:CR#ET@host:5432/db", ["SE:CR#ET", "CR#ET"],
     "postgresql://user:***@host:5432/db"),
    # read as a query after the first '?' too: more is hidden than the password, never less
    ("postgresql://user:SE?CR&password=ET@host/db", ["SE?CR&password=ET", "SE?CR", "ET@host"],
     None),
    ("postgresql://user:SECRET@[::1]:5432/db", ["SECRET"], "postgresql://user:***@[::1]:5432/db"),
    ("postgresql://user:${PGPASS}@host/db", ["${PGPASS}"], "postgresql://user:***@host/db"),
    ("postgresql://host/db?password=SECRET", ["SECRET"], "postgresql://host/db?password=***"),
    ("postgresql://host/db?sslmode=require&password=SECRET&connect_timeout=3", ["SECRET"],
     "postgresql://host/db?sslmode=require&password=***&connect_timeout=3"),
    ("postgresql://host/db?sslmode=require;password=SECRET", ["SECRET"],
     "postgresql://host/db?sslmode=require;password=***"),
    ("postgresql://host/db?PASSWORD=SECRET", ["SECRET"], "postgresql://host/db?PASSWORD=***"),
    ("postgresql://host/db?pass%77ord=SECRET", ["SECRET"], "postgresql://host/db?pass%77ord=***"),
    ("mysql://host/db?user=u&passwd=SECRET", ["SECRET"], "mysql://host/db?user=u&passwd=***"),
    ("postgresql://host/db?sslpassword=SECRET", ["SECRET"], "postgresql://host/db?sslpassword=***"),
    ("postgresql://host/db?api_key=SECRET1&access_token=SECRET2", ["SECRET1", "SECRET2"],
     "postgresql://host/db?api_key=***&access_token=***"),
    ("postgresql://user:PWSECRET1@host/db?password=PWSECRET2", ["PWSECRET1", "PWSECRET2"],
     "postgresql://user:***@host/db?password=***"),
    ("mssql+pyodbc:///?odbc_connect=DRIVER%3DX%3BSERVER%3Dh%3BPWD%3DSECRET", ["SECRET"],
     "mssql+pyodbc:///?odbc_connect=***"),
    ("postgresql://host/db?password=SE@CRET", ["SE@CRET", "SE", "CRET"], None),
    ("postgresql://us?er:SECRET@host/db", ["SECRET"], "postgresql://us?er:***@host/db"),
    # nothing secret: shown whole
    ("postgresql://user@host:5432/db?sslmode=require", [],
     "postgresql://user@host:5432/db?sslmode=require"),
    ("sqlite:////tmp/study.db", [], "sqlite:////tmp/study.db"),
]


@pytest.mark.parametrize("url,secrets,shown", FORMS, ids=[f[0] for f in FORMS])
def test_no_secret_of_any_url_form_is_shown(url, secrets, shown):
    out = redact(url)
    for secret in secrets:
        assert secret not in out, (url, out)
    if shown is not None:
        assert out == shown
    # a driver's message quoting the URL, or the password alone, is scrubbed alike
    message = f"could not connect to {url} (password {secrets[0] if secrets else ''!s})"
    for secret in secrets:
        if len(secret) >= 3:
            assert secret not in scrub(message, url), (url, scrub(message, url))


def test_the_table_has_a_dozen_forms_and_the_decoded_password_is_a_secret_too():
    assert len(FORMS) >= 12
    assert "S/ECRET" in storage_secrets("mysql+pymysql://user:S%2FECRET@host/db")
    assert redact(None) == "journal" and redact("user:pw@host") == "<not a URL: not shown>"


def test_a_password_from_the_environment_is_a_secret(monkeypatch):
    monkeypatch.setenv("PGPASS", "from-env-SECRET")
    url = "postgresql://user:${PGPASS}@host/db"
    assert "from-env-SECRET" in storage_secrets(url)
    assert scrub("auth failed for from-env-SECRET", url) == "auth failed for ***"
