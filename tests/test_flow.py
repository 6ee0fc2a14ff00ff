"""The extraction flow on the local server: resume by content, versions by configuration."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from flows.extract import ExtractParameters, extract
from tasks.exports import ExportUnsupported


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def conversations(n: int, tag: str = "c") -> list[dict]:
    rows = []
    for i in range(n):
        msgs = []
        if i % 3 == 0:
            msgs.append({"role": "system", "content": f"You are assistant number {i}."})
        for turn in range(1 + i % 3):
            msgs.append({"role": "user", "content": f"Question {turn} of {tag}{i}: " + "why is the sky blue? " * (1 + i % 5)})
            msgs.append({"role": "assistant", "content": f"Answer {turn}: " + "because light scatters. " * (1 + (i * 7) % 6)})
        rows.append({"id": f"{tag}{i}", "messages": msgs})
    return rows


def test_rerun_writes_nothing_new_and_new_layers_make_a_new_version(prefect_api, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(10))
    base = dict(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"), batch_size=4)
    first = extract(ExtractParameters(**base))
    assert first["written_this_run"] == 10
    shards = sorted((Path(first["version_dir"]) / "shards").iterdir())

    again = extract(ExtractParameters(**base))
    assert (again["written_this_run"], again["already_present"], again["written"]) == (0, 10, 10)
    assert sorted((Path(again["version_dir"]) / "shards").iterdir()) == shards

    grown = write_jsonl(tmp_path / "prompts.jsonl", conversations(10) + conversations(3, tag="new"))
    more = extract(ExtractParameters(**{**base, "prompts": str(grown)}))
    assert (more["written_this_run"], more["written"]) == (3, 13)

    other = extract(ExtractParameters(**base, aux_layers=[1, 3, 6]))
    assert other["version"] != first["version"] and other["written_this_run"] == 13
    assert json.loads((Path(other["version_dir"]) / "dataset.json").read_text())["layer_ids"] == [1, 3, 6]
    assert pl.read_parquet(Path(first["version_dir"]) / "manifest.parquet").height == 13


def test_an_export_that_cannot_be_made_fails_before_the_server_starts(prefect_api, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", conversations(2))
    out = tmp_path / "out"
    with pytest.raises(ExportUnsupported, match="speculators"):
        extract(ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(out),
                                  exports=["specforge", "speculators"]))
    assert not (out / "dumps").exists() and not list(out.glob("versions/*/runs/*-server.log"))
