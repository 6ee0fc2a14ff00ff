"""Dataset versions as a user meets them: ``{out}/latest`` and retrying a version's failed samples.

``latest`` is moved in one rename, only once a run has consolidated its version and completed: a run
killed outright (SIGKILL) during its consolidation leaves it on the previous complete version, which
still loads, and the next run repairs the version and moves it. (The retry through a deployment:
tests/test_deployments.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest

from flows.batches import RunFailed
from flows.extract import CannotRetry, extract
from flows.parameters import REPO, ExtractParameters, ServerOptions
from tasks.training_set import TrainingSetDataset
from tests.test_flow import conversations, write_jsonl

EXPORTS = ["specforge", "modelopt", "speculators"]


def kill_during_consolidation(argv: list[str], out: Path, moment: str, log_path: Path) -> Path:
    """Run ``python -m flows.extract argv`` (a new version) and SIGKILL it the moment a file matching
    ``moment`` appears in a version folder that had no manifest before. Consolidation writes the
    manifest first, then the vocabulary mapping and dataset.json, then each export: ``manifest.parquet``
    kills it before dataset.json, ``exports/*/*`` in the middle of the exports. Returns the version's folder."""
    consolidated = {p.parent for p in out.glob("versions/*/manifest.parquet")}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "flows.extract", *argv], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while True:
        hits = [p for p in out.glob(f"versions/*/{moment}") if p.parents[len(Path(moment).parts) - 1] not in consolidated]
        if hits:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return hits[0].parents[len(Path(moment).parts) - 1]
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no new version was consolidated (exit {proc.wait()}):\n{log_path.read_text()[-3000:]}")
        time.sleep(0.002)


def test_a_run_killed_during_consolidation_leaves_latest_on_the_previous_version(prefect_api, tiny_model_dir,
                                                                                   tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(12))
    out, latest = tmp_path / "out", tmp_path / "out" / "latest"
    base = dict(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out), batch_size=6)
    first = extract(ExtractParameters(**base))
    assert os.readlink(latest) == f"versions/{first['version']}"  # relative: the folder can move whole

    # Other aux layers: new versions, whose consolidations are killed early and late.
    argv = ["--prompts", str(prompts), "--model-path", str(tiny_model_dir), "--out", str(out), "--batch-size", "6",
            "--exports", *EXPORTS]
    killed = {moment: kill_during_consolidation([*argv, "--aux-layers", *layers], out, moment,
                                                tmp_path / f"killed-{len(layers)}.log")
              for moment, layers in (("manifest.parquet", ["1", "3", "6"]), ("exports/*/*", ["1", "2", "3"]))}
    new = killed["manifest.parquet"]
    for vdir in killed.values():
        # The kill landed inside the consolidation: the run never recorded itself, not every export was listed.
        assert not list((vdir / "runs").glob("*.json")), "the run finished before the kill"
        listed = json.loads((vdir / "dataset.json").read_text())["exports"] if (vdir / "dataset.json").exists() else []
        assert set(listed) != set(EXPORTS), "the consolidation finished before the kill"
        assert pl.read_parquet(vdir / "manifest.parquet").height == 12  # what was written is whole

    assert os.readlink(latest) == f"versions/{first['version']}"
    assert not [p for p in out.iterdir() if p.name.startswith(".latest")], "a temporary link was left"
    dataset = TrainingSetDataset(latest)
    assert dataset.version_dir == (out / "versions" / first["version"]).resolve()
    assert len(dataset) == 12
    assert sum(len(dataset[i]["input_ids"]) for i in range(len(dataset))) == first["dataset_tokens"]
    assert dataset[0]["aux_hidden_states"].shape[1] == 3 * dataset.info.hidden_size

    # The same command again repairs the version (every shard was kept) and moves the link.
    repaired = extract(ExtractParameters(**base, aux_layers=[1, 3, 6], exports=EXPORTS))
    assert (repaired["version"], repaired["written_this_run"], repaired["written"]) == (new.name, 0, 12)
    assert os.readlink(latest) == f"versions/{new.name}"
    assert sorted(json.loads((latest / "dataset.json").read_text())["exports"]) == sorted(EXPORTS)
    assert TrainingSetDataset(latest).info.layer_ids == [1, 3, 6]
    # A reader that opened the old version keeps reading it after the link moved.
    assert len(dataset) == 12 and dataset.info.layer_ids != [1, 3, 6] and dataset[11]["input_ids"].numel() > 0


def test_a_failed_run_does_not_move_latest(prefect_api, tiny_model_dir, tmp_path):
    rows = conversations(6)
    out, latest = tmp_path / "out", tmp_path / "out" / "latest"
    base = dict(model_path=str(tiny_model_dir), out=str(out), max_length=4000)
    good = extract(ExtractParameters(**base, prompts=str(write_jsonl(tmp_path / "good.jsonl", rows))))
    assert os.readlink(latest) == f"versions/{good['version']}"

    # Another version whose run fails: one sample of six is too long for the server, over a budget of none.
    rows[2] = {"id": "too-long", "messages": [{"role": "user", "content": "tell me a story " * 400},
                                              {"role": "assistant", "content": "no."}]}
    with pytest.raises(RunFailed, match="over the failure budget"):
        extract(ExtractParameters(**base, prompts=str(write_jsonl(tmp_path / "bad.jsonl", rows)),
                                  template_date="2025-01-01", max_failed_fraction=0,
                                  server=ServerOptions(extra_args=["--context-length", "512"])))
    (failed_version,) = [p for p in (out / "versions").iterdir() if p.name != good["version"]]
    assert pl.read_parquet(failed_version / "manifest.parquet").height == 5  # consolidated, yet the run failed
    assert os.readlink(latest) == f"versions/{good['version']}"


def test_a_retry_of_failed_samples_is_refused_for_a_version_these_parameters_do_not_give(prefect_api, tiny_model_dir,
                                                                                        tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(3))
    base = dict(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"))
    done = extract(ExtractParameters(**base))
    with pytest.raises(CannotRetry, match=f"these parameters give dataset version {done['version']}"):
        extract(ExtractParameters(**base, retry_failed_of="0123456789abcdef"))
    # Its own version, nothing failed: nothing to extract, nothing new either.
    rows = conversations(3) + conversations(2, tag="new")
    again = extract(ExtractParameters(**{**base, "prompts": str(write_jsonl(tmp_path / "more.jsonl", rows))},
                                      retry_failed_of=done["version"]))
    assert (again["written_this_run"], again["left_for_later"], again["written"]) == (0, 2, 3)
    assert (tmp_path / "out" / "versions").is_dir() and len(list((tmp_path / "out" / "versions").iterdir())) == 1


def test_a_consolidation_that_stops_after_the_manifest_lists_no_export_of_the_old_one(prefect_api, tiny_model_dir,
                                                                                     tmp_path):
    out = tmp_path / "out"
    base = dict(model_path=str(tiny_model_dir), out=str(out), exports=["specforge"])
    first = extract(ExtractParameters(**base, prompts=str(write_jsonl(tmp_path / "a.jsonl", conversations(3)))))
    vdir = Path(first["version_dir"])
    assert json.loads((vdir / "dataset.json").read_text())["exports"] == ["specforge"]
    # The next consolidation fails right after the manifest (the vocabulary mapping cannot replace a folder).
    (vdir / "vocab_mapping.pt").unlink()
    (vdir / "vocab_mapping.pt").mkdir()
    with pytest.raises(OSError):
        extract(ExtractParameters(**base, prompts=str(write_jsonl(tmp_path / "b.jsonl", conversations(5)))))
    assert pl.read_parquet(vdir / "manifest.parquet").height == 5  # the new manifest, whole
    # The specforge export holds 3 samples of the 5: dataset.json must not list it as in line.
    assert json.loads((vdir / "dataset.json").read_text())["exports"] == []
    assert os.readlink(out / "latest") == f"versions/{first['version']}"  # same version, still loads
    assert len(TrainingSetDataset(out / "latest")) == 5
