"""Waiting in tests: one bounded poll instead of a deadline loop per test."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout_s: float, failure: Callable[[], str], *,
             alive: Callable[[], bool] = lambda: True, poll_s: float = 0.1) -> T:
    """``condition()``'s first truthy value, polled every ``poll_s``. Fails with ``failure()`` (the
    message, built only then: a log tail, say) once ``timeout_s`` pass or ``alive()`` turns false (a
    process waited on has exited: waiting longer would only hide why)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if not alive():
            raise AssertionError(f"gone before the wait was over: {failure()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {failure()}")
        time.sleep(poll_s)
