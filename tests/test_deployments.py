"""Deployments are data: every deployment in prefect.yaml must start the flow it names."""

import importlib
from pathlib import Path

import pytest
import yaml

from flows.extract import ExtractParameters

REPO = Path(__file__).resolve().parent.parent
DEPLOYMENTS = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]


@pytest.mark.parametrize("deployment", DEPLOYMENTS, ids=[d["name"] for d in DEPLOYMENTS])
def test_deployment_parameters_fit_the_flow(deployment):
    module, func = deployment["entrypoint"].split(":")
    flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), func)
    assert flow.name == "extract-eagle3"
    for params in [deployment.get("parameters") or {}] + [s.get("parameters") or {} for s in deployment.get("schedules", [])]:
        assert set(params) <= {"params"}, f"{deployment['name']}: unknown parameters {set(params) - {'params'}}"
        parsed = ExtractParameters.model_validate(params.get("params", {}))
        prompts = Path(parsed.prompts)
        assert (prompts if prompts.is_absolute() else REPO / prompts).is_file(), f"{deployment['name']}: {prompts} missing"


def test_nightly_runs_never_overlap():
    nightly = next(d for d in DEPLOYMENTS if d["name"] == "nightly")
    assert nightly["concurrency_limit"] == {"limit": 1, "collision_strategy": "CANCEL_NEW"}
    assert nightly["schedules"][0]["cron"] == "0 2 * * *"
