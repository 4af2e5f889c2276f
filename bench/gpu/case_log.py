"""A pytest plugin of ``python -m bench.gpu``'s ``cuda_tests`` stage: each test's outcome
appended, as it finishes, to the JSON-lines file named by ``PRESTO_CASE_LOG`` (one line: the
test's id, its outcome and the first line of its message), so a test run the stage's budget
ends keeps every outcome before it (``-p bench.gpu.case_log``).

Owns: the line per test. Never: changes a test's outcome or the run.
"""
from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("PRESTO_CASE_LOG")
    if not path:
        return
    failed_setup = report.when == "setup" and not report.passed
    if report.when != "call" and not failed_setup:
        return
    outcome = "passed" if report.passed else "skipped" if report.skipped else (
        "failed" if report.when == "call" else "error")
    message = ""
    if not report.passed:
        text = report.longreprtext.strip().splitlines() if report.longrepr else []
        errors = [line for line in text if line.startswith("E ")]
        message = (errors[0] if errors else text[-1] if text else "")[:300]
    with open(path, "a") as f:
        f.write(json.dumps({"test": report.nodeid, "outcome": outcome, "message": message}) + "\n")
