"""A pytest plugin that records a milestone run as it happens, for course.grading.grade.

Each event is one JSON line appended to the file named by $COURSE_GRADE_RECORD and flushed
at once, so everything up to the moment a learner's engine kills the interpreter (os._exit,
a segfault, the grader's own time limit) survives it; the grader reads which test was
running when the record stops. Without that variable the plugin does nothing.
"""
from __future__ import annotations

import json
import os

_RECORD = os.environ.get("COURSE_GRADE_RECORD")


def _write(event: dict) -> None:
    if not _RECORD:
        return
    with open(_RECORD, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(event) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def _message(report) -> str:
    """The one line that says why a test failed: the exception's own message."""
    if isinstance(report.longrepr, tuple):          # a skip: (file, line, reason)
        return str(report.longrepr[2])
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.strip()
    text = str(report.longrepr or "").strip()
    return text.splitlines()[-1] if text else ""


def pytest_collection_finish(session):
    _write({"event": "collected", "nodeids": [item.nodeid for item in session.items]})


def pytest_collectreport(report):
    if report.failed:
        _write({"event": "collect_error", "nodeid": report.nodeid, "message": _message(report)})


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "nodeid": nodeid})


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        _write({"event": "phase", "nodeid": report.nodeid, "when": report.when,
                "outcome": report.outcome, "duration": report.duration,
                "message": _message(report) if report.outcome != "passed" else ""})


def pytest_sessionfinish(session, exitstatus):
    _write({"event": "finished", "exitstatus": int(exitstatus)})
