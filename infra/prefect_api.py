"""Prefect's temporary API server, started so that it neither dies of a terminal's Ctrl-C nor outlives the flow.

With no ``PREFECT_API_URL`` configured, Prefect 3 starts a temporary API server as a child
process (``prefect.server.api.server.SubprocessASGIServer``) in the flow's process group:
a terminal's Ctrl-C kills it too, and the flow then spends minutes retrying calls to it;
after SIGKILL or SIGTERM of the flow it keeps running. :func:`start_temporary_prefect_api` starts
that same server first, in its own session and with a parent-death signal
(``infra.hosts.dependent_child``), and registers it where Prefect looks for it (the
instance Prefect's ``SubprocessASGIServer()`` returns, as ``prefect_test_harness`` does).
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import prefect.server.api.server as prefect_server
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

from infra.hosts import dependent_child


class DependentApiServer(SubprocessASGIServer):
    """Prefect's own uvicorn command, spawned as a dependent child of this process."""

    def _run_uvicorn_command(self) -> subprocess.Popen:
        # Prefect builds the command (so it stays Prefect's); only its Popen gains our spawn options.
        real = prefect_server.subprocess
        prefect_server.subprocess = SimpleNamespace(
            Popen=lambda *args, **kwargs: real.Popen(*args, **kwargs, **dependent_child()))
        try:
            return super()._run_uvicorn_command()
        finally:
            prefect_server.subprocess = real


def api_configured() -> bool:
    return bool(get_current_settings().api.url)


def start_temporary_prefect_api() -> str | None:
    """Start Prefect's temporary API server as ours and return its URL; None (nothing started) when an API URL
    is configured or this process already has one (a test harness). Prefect stops it at exit (its own atexit
    hook, after its log and event workers have flushed to it); a killed process takes it along."""
    if api_configured() or None in SubprocessASGIServer._instances:
        return None
    server = DependentApiServer()  # registers itself as the instance Prefect's SubprocessASGIServer() returns
    server.start()
    return server.api_url
