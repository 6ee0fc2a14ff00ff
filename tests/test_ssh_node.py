"""The flow on a GPU node over SSH, against a real OpenSSH server on loopback (tests/sshd.py):
the transformers engine started on the "node" by the flow, host keys verified, commands quoted,
leases, dropped connections."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest
from transformers import AutoTokenizer

from flows.extract import ExtractParameters, NodeOptions, ServerOptions, extract
from infra.ssh import SshNode, SshSettings
from tasks.training_set import TrainingSetDataset
from tests.ground_truth import load_reference_model, reference_hidden_states
from tests.test_flow import conversations, independent_loss_mask, write_jsonl


def node_options(sshd, workdir: Path, **kw) -> NodeOptions:
    return NodeOptions(node=sshd.url, ssh_key=str(sshd.user_key), known_hosts=str(sshd.known_hosts),
                       python=sys.executable, workdir=str(workdir), **kw)


def settings(sshd, workdir: Path, **kw) -> SshSettings:
    return node_options(sshd, workdir).ssh_settings().__class__(**{**node_options(sshd, workdir).ssh_settings().__dict__,
                                                                   **kw})


def check_against_ground_truth(vdir: Path, rows: list[dict], model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_reference_model(str(model_dir))
    manifest = pl.read_parquet(vdir / "manifest.parquet")
    layer_ids = json.loads((vdir / "dataset.json").read_text())["layer_ids"]
    by_id = {r["id"]: r for r in rows}
    dataset = TrainingSetDataset(vdir)
    assert len(dataset) == len(rows) and manifest["sample_key"].n_unique() == len(rows)
    for i in range(len(dataset)):
        sample, source_id = dataset[i], manifest["source_id"][i]
        ids = sample["input_ids"].tolist()
        assert ids == tokenizer.apply_chat_template(by_id[source_id]["messages"], tokenize=True, return_dict=False)
        aux, final = reference_hidden_states(model, ids, layer_ids)
        assert (sample["aux_hidden_states"] - aux).abs().max() <= 1e-4, source_id
        assert (sample["hidden_states"] - final).abs().max() <= 1e-4, source_id
        assert sample["loss_mask"].tolist() == independent_loss_mask(tokenizer, by_id[source_id]["messages"], ids)


def test_flow_extracts_on_the_node_and_fetches_verified_shards(prefect_api, sshd, tiny_model_dir, tmp_path):
    rows = conversations(12)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", rows)
    workdir = tmp_path / "node"
    params = ExtractParameters(prompts=str(prompts), model_path=str(tiny_model_dir), out=str(tmp_path / "out"),
                               batch_size=5, server=ServerOptions(chunked_prefill_size=24),
                               node=node_options(sshd, workdir))
    summary = extract(params)
    assert (summary["written"], summary["failed"], summary["rows_in"]) == (12, 0, 12)
    vdir = Path(summary["version_dir"])
    node_vdir = workdir / "versions" / vdir.name
    assert len(list((node_vdir / "shards").glob("*.safetensors"))) == 3, "the shards were not written on the node"
    assert not list((vdir / "shards").glob("*.safetensors")), "shards came home without --fetch"
    assert pl.read_parquet(vdir / "manifest.parquet").height == 12
    server_log = next((vdir / "runs").glob("*-server.log")).read_text()
    assert server_log.rstrip().endswith("node_agent: server exited with code 0"), server_log[-2000:]

    fetched = extract(params.model_copy(update={"node": node_options(sshd, workdir, fetch=True)}))
    assert (fetched["written_this_run"], fetched["already_present"], fetched["written"]) == (0, 12, 12)
    check_against_ground_truth(vdir, rows, tiny_model_dir)
    assert len(list((vdir / "exports" / "specforge").rglob("*.ckpt"))) == 12
