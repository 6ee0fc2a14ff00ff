"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from infra.tiny_model import build_tiny_model

# No network here or in CI: keep Prefect from phoning home.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny deterministic Llama (8 layers, hidden 64), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def prefect_api():
    """A real Prefect API (temporary SQLite) for flow tests; its URL is exported for subprocess flows."""
    from prefect.settings import get_current_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        url = str(get_current_settings().api.url)
        old = os.environ.get("PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = url
        try:
            yield url
        finally:
            if old is None:
                os.environ.pop("PREFECT_API_URL")
            else:
                os.environ["PREFECT_API_URL"] = old
