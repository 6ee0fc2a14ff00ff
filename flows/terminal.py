"""What a run from the command line shows: one line per event on the terminal, everything in a log file.

Prefect's console handler prints each error with its traceback, and its engine repeats a
failure for the task, the flow and the state it ends in; a dead server once gave 31k
lines. On the terminal each record is cut to its first line, the engine's repeats of an
exception and the per-attempt warnings of samples (``tasks.retrieval``) are left out; the
log file gets every record whole, tracebacks included.
"""

from __future__ import annotations

import copy
import logging
import os
from datetime import datetime, timezone
from pathlib import Path

#: the Prefect engine's loggers: their records with a traceback repeat an exception the run reports itself
ENGINE_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class FirstLine(logging.Formatter):
    """Another formatter's output, cut to the record's first line, without the traceback."""

    def __init__(self, inner: logging.Formatter, log_path: Path):
        super().__init__()
        self.inner, self.log_path = inner, log_path

    def format(self, record: logging.LogRecord) -> str:
        shown = copy.copy(record)
        shown.exc_info, shown.exc_text, shown.stack_info = None, None, None
        message = record.getMessage()
        first = message.split("\n", 1)[0]
        shown.msg, shown.args = (first if first == message else f"{first} [more in {self.log_path}]"), None
        return self.inner.format(shown)


def for_the_terminal(record: logging.LogRecord) -> bool:
    if hasattr(record, "sample_error"):  # one warning per failed attempt: the failures are summed up at the end
        return False
    if record.name in ENGINE_LOGGERS and (record.exc_info or record.getMessage().startswith(
            ("Finished in state Failed", "Finished in state Crashed", "Crash detected!"))):
        return False
    return True


def log_to_file(folder: Path) -> Path:
    """Send every record to a new file under ``folder`` (returned) and keep the terminal to first lines."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"extract-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setFormatter(FirstLine(handler.formatter or logging.Formatter(), path))
        handler.addFilter(for_the_terminal)
    to_file = logging.FileHandler(path, encoding="utf-8")
    to_file.setFormatter(logging.Formatter(FORMAT))
    root.addHandler(to_file)
    FILE_ONLY.handlers[:] = [to_file]
    return path


#: records for the log file alone (a traceback the terminal has summed up in a line)
FILE_ONLY = logging.getLogger("flows.terminal.file")
FILE_ONLY.propagate = False
