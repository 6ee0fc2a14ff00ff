"""The Prefect UI as a person sees it: headless Chromium (Debian's `chromium`, driven by Playwright)
on a real `prefect server start`, after a deployment run with a sample that fails every attempt.

Screenshots go to $EAGLE3_SCREENSHOTS when set, else to this test's pytest tmp folder
(`screenshots/`); the test prints where.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import Page, expect, sync_playwright
from prefect import get_client
from prefect.deployments import run_deployment

from tests.test_deployments import cli, deployed  # noqa: F401  (deployed: the real server, as a fixture)
from tests.test_flow import conversations, write_jsonl

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FAILED_RED = (222, 5, 41)  # the graph's colour of a Failed task run
expect.set_options(timeout=30_000)  # the UI fetches logs and artifacts after it draws the page


def settle(page: Page) -> None:
    """Wait out the UI's page transition: until it ends, the page being left is still there (and matches)."""
    page.wait_for_load_state("networkidle")
    page.wait_for_function("document.getAnimations().every(a => a.playState !== 'running' "
                           "|| a.effect.getTiming().iterations === Infinity)")


def failed_node_centre(page: Page, timeout_s: float = 60) -> tuple[float, float]:
    """Where the flow-run graph draws its one failed node (the graph is a canvas: no text to find)."""
    canvas = page.locator("canvas").first
    deadline = time.monotonic() + timeout_s
    while True:
        pixels = np.asarray(Image.open(io.BytesIO(canvas.screenshot())).convert("RGB"), dtype=np.int16)
        ys, xs = (np.abs(pixels - FAILED_RED) <= 24).all(axis=2).nonzero()
        if len(xs) > 100:
            box = canvas.bounding_box()
            return box["x"] + xs.mean(), box["y"] + ys.mean()
        assert time.monotonic() < deadline, "the flow-run graph drew no failed node"
        page.wait_for_timeout(500)


def open_artifact(page: Page, run_url: str, key: str) -> None:
    page.goto(run_url)
    page.get_by_role("link", name="Artifacts").or_(page.get_by_text("Artifacts", exact=True)).first.click()
    page.get_by_text(key, exact=True).click()
    page.wait_for_url("**/artifacts/artifact/**")
    settle(page)
    expect(page.get_by_text(key, exact=True).first).to_be_visible()


def first_row(page: Page) -> list[str]:
    return [cell.strip() for cell in page.get_by_role("row").nth(1).get_by_role("cell").all_inner_texts()]


def test_the_ui_shows_a_failed_sample_its_retries_and_the_run_artifacts(deployed, tiny_model_dir, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    shots = Path(os.environ.get("EAGLE3_SCREENSHOTS") or tmp_path / "screenshots")
    shots.mkdir(parents=True, exist_ok=True)
    print(f"screenshots in {shots}")

    # The server's dump folder cap (1 MB) is below this sample's dump (~2.6 MB) and above the others':
    # every attempt fails, in its batch and then in its own sample task (tests/test_flow.py does the same).
    rows = conversations(6)
    rows[3] = {"id": "dump-too-big", "messages": [
        {"role": "user", "content": "tell me a story " * 400}, {"role": "assistant", "content": "no."}]}
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    params = {"prompts": str(prompts), "model_path": str(tiny_model_dir), "out": str(tmp_path / "out"),
              "max_length": 4000, "batch_size": 2, "max_in_flight": 1, "concurrent_batches": 1, "attempts": 2,
              "sample_retries": 2, "backoff_s": 0.05, "max_failed_fraction": 0.5,
              "server": {"extra_args": ["--dump-max-bytes", "1000000"]}}
    flow_run = run_deployment("extract-eagle3/extract", parameters={"params": params}, timeout=0)
    worker = tmp_path / "worker"
    worker.mkdir()
    cli(deployed, "worker", "start", "--pool", "local", "--run-once", cwd=worker, timeout=400)
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run.id).state.is_completed()  # one failure is within the budget
    ui = deployed["PREFECT_API_URL"].removesuffix("/api")
    run_url = f"{ui}/runs/flow-run/{flow_run.id}"

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1600, "height": 1200})
        try:
            page.goto(run_url)
            expect(page.get_by_text(flow_run.name, exact=True).first).to_be_visible()
            x, y = failed_node_centre(page)
            settle(page)
            page.screenshot(path=shots / "1-flow-run.png")

            # The red node in the graph is the sample's own task run: clicking it names it.
            page.mouse.click(x, y)
            panel = page.get_by_role("link", name="sample-dump-too-big")
            expect(panel).to_be_visible()
            expect(page.get_by_text("Failed", exact=True).first).to_be_visible()
            page.screenshot(path=shots / "2-failed-sample-in-the-graph.png")

            # Its page: the retries and the reason, as its logs show them.
            panel.click()
            page.wait_for_url("**/runs/task-run/**")
            settle(page)
            for text in ("Retry 1/2 will start", "Retry 2/2 will start", "Retries are exhausted"):
                expect(page.get_by_text(text).first).to_be_visible()
            expect(page.get_by_text("more would pass its cap of 1000000").first).to_be_visible()
            page.screenshot(path=shots / "3-sample-task-run.png")

            page.goto(run_url)
            page.get_by_text("Task Runs", exact=True).first.click()
            expect(page.get_by_text("(5 Completed, 1 Failed)")).to_be_visible()
            for name in ("batch-0000", "batch-0001", "batch-0002", "sample-dump-too-big"):
                expect(page.get_by_text(name, exact=True).first).to_be_visible()
            settle(page)
            page.screenshot(path=shots / "4-task-runs.png")

            page.get_by_text("Artifacts", exact=True).first.click()
            for key in ("extraction-progress", "extraction-summary", "failed-samples", "run-report"):
                expect(page.get_by_text(key, exact=True)).to_be_visible()
            expect(page.get_by_text("3 of 3 batches finished (6 of 6 samples)")).to_be_visible()
            settle(page)
            page.screenshot(path=shots / "5-artifacts.png")

            open_artifact(page, run_url, "run-report")
            for text in ("5 samples written this run (1 failed, 0 already present, 0 duplicates, 0 rejected)",
                         "Sample lengths (tokens, this run)", "Where the time went", "waiting for the node",
                         "consolidation and exports"):
                expect(page.get_by_text(text).first).to_be_visible()
            page.screenshot(path=shots / "6-run-report.png", full_page=True)

            open_artifact(page, run_url, "failed-samples")
            for text in ("dump-too-big", "DumpUnusable", "more would pass its cap of 1000000"):
                expect(page.get_by_text(text).first).to_be_visible()
            # What a person reads without scrolling the table sideways: the sample, the error, the attempts.
            for column in ("source_id", "error", "attempts", "reason"):
                expect(page.get_by_role("columnheader", name=column, exact=True)).to_be_in_viewport()
            assert first_row(page)[:3] == ["dump-too-big", "DumpUnusable", "5"]  # 2 in its batch + 3
            page.screenshot(path=shots / "7-failed-samples.png")

            open_artifact(page, run_url, "extraction-summary")
            for column in ("rows_in", "written", "written_this_run", "failed"):
                expect(page.get_by_role("columnheader", name=column, exact=True)).to_be_in_viewport()
            assert first_row(page)[:7] == ["6", "5", "5", "0", "0", "0", "1"]  # rows, written, this run, ..., failed
            page.screenshot(path=shots / "8-summary.png")
        except Exception:
            page.screenshot(path=shots / "failure.png", full_page=True)
            raise
        finally:
            browser.close()
