"""Trainer exports, read back by the trainers' own released reader code.

The readers come from the released wheels (pip download --no-deps, pinned below) unpacked
under build/trainer-readers/; the fixture downloads them when missing. SpecForge's offline
reader modules import with nothing but torch, so they are imported as a package. ModelOpt's
package __init__ pulls in omegaconf and much more, so its two modules that the offline
dataset needs (eagle/utils.py and utils/loss_mask.py, which import only torch and
transformers) are loaded from their files. speculators cannot take our data at all (see
tasks.exports); its released trainer source is checked for the fact that decision rests on.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from tasks.consolidation import consolidate
from tasks.exports import EXPORT_INDEX_NAME, ExportUnsupported, check_exports
from tasks.shards import write_shard
from tasks.training_set import TrainingSetDataset
from tests.test_training_set import LAYERS, make_info, make_sample, shard_path

REPO = Path(__file__).resolve().parent.parent
READERS = REPO / "build" / "trainer-readers"
SPECFORGE = "specforge==0.2.0"
MODELOPT = "nvidia-modelopt==0.47.0"
SPECULATORS = "speculators==0.9.0"


def released(requirement: str) -> Path:
    """The requirement's wheel, unpacked once under build/trainer-readers/{name}-{version}/."""
    name, version = requirement.split("==")
    folder = READERS / f"{name}-{version}"
    if not (folder / ".unpacked").exists():
        wheels = READERS / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", requirement,
                        "-d", str(wheels)], check=True, timeout=300)
        wheel = next(wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(folder)
        (folder / ".unpacked").touch()
    return folder


@pytest.fixture(scope="session")
def specforge():
    root = str(released(SPECFORGE))
    sys.path.insert(0, root)
    try:
        from specforge.algorithms.eagle3.data import normalize_offline_sample
        from specforge.runtime.data_plane.feature_store import LocalFeatureStore
        from specforge.runtime.data_plane.offline_reader import OfflineManifestReader
        yield OfflineManifestReader, LocalFeatureStore, normalize_offline_sample
    finally:
        sys.path.remove(root)


@pytest.fixture(scope="session")
def modelopt_dataset():
    root = released(MODELOPT) / "modelopt" / "torch"
    loss_mask = _load_module("modelopt.torch.utils.loss_mask", root / "utils" / "loss_mask.py")
    sys.modules["modelopt.torch.utils.loss_mask"] = loss_mask  # what eagle/utils.py imports by name
    try:
        yield _load_module("modelopt_eagle_utils", root / "speculative" / "eagle" / "utils.py").OfflineSupervisedDataset
    finally:
        del sys.modules["modelopt.torch.utils.loss_mask"]


def _load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def version_dir(tmp_path) -> Path:
    write_shard(shard_path(tmp_path, "shard-1"), [make_sample("k-b", 7, 1), make_sample("k-a", 5, 2)])
    write_shard(shard_path(tmp_path, "shard-2"), [make_sample("k-c", 9, 3)])
    return tmp_path


def export_index(version_dir: Path, name: str) -> dict:
    """The index log replayed by hand: its header, and each key's last line."""
    header, *records = (json.loads(line) for line in
                        (version_dir / "exports" / name / EXPORT_INDEX_NAME).read_text().splitlines())
    return {**header, "samples": {r["key"]: r for r in records}}


def read_with_specforge(specforge, export_dir: Path, max_len: int = 4096) -> dict[str, dict]:
    """SpecForge's offline path: reader -> file:// refs -> feature store -> EAGLE-3 normaliser."""
    reader_cls, store_cls, normalize = specforge
    store = store_cls()
    by_path = {}
    for ref in reader_cls(str(export_dir), max_len=max_len):
        raw, handle = store.get(ref)
        by_path[ref.feature_store_uri.removeprefix("file://")] = normalize(raw, max_len=max_len)
        store.release(handle)
    return by_path


def files_by_key(version_dir: Path, name: str) -> dict[str, Path]:
    entries = export_index(version_dir, name)["samples"]
    return {k: version_dir / "exports" / name / e["file"] for k, e in entries.items() if e["content_hash"]}


def test_specforge_reader_loads_the_export_unchanged(version_dir, specforge):
    summary = consolidate(version_dir, make_info(), exports=["specforge"])
    assert summary.exports["specforge"].written == 3

    read = read_with_specforge(specforge, version_dir / "exports" / "specforge")
    files = files_by_key(version_dir, "specforge")
    assert sorted(read) == sorted(str(p) for p in files.values())
    dataset = TrainingSetDataset(version_dir)
    for i, key in enumerate(dataset.manifest["sample_key"].to_list()):
        want, got = dataset[i], read[str(files[key])]
        assert got["hidden_state"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_state"], want["aux_hidden_states"].unsqueeze(0))
        assert torch.equal(got["target"], want["hidden_states"].unsqueeze(0))
        assert torch.equal(got["input_ids"], want["input_ids"].unsqueeze(0))
        mask = want["loss_mask"].clone()
        mask[-1] = 0  # SpecForge's normaliser never trains the last position
        assert torch.equal(got["loss_mask"], mask.unsqueeze(0))
    # The draft config's layer ids in SpecForge's "output of layer k" convention.
    assert export_index(version_dir, "specforge")["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in LAYERS]
    assert sorted(p.relative_to(version_dir / "exports" / "specforge").as_posix() for p in files.values()) == [
        "rows_0-2000/data_0.ckpt", "rows_0-2000/data_1.ckpt", "rows_0-2000/data_2.ckpt"]


def test_specforge_export_is_incremental_and_numbers_are_stable(version_dir, specforge):
    consolidate(version_dir, make_info(), exports=["specforge"])
    export_dir = version_dir / "exports" / "specforge"
    first = {k: (p, p.stat().st_mtime_ns, p.stat().st_ino) for k, p in files_by_key(version_dir, "specforge").items()}

    again = consolidate(version_dir, make_info(), exports=["specforge"]).exports["specforge"]
    assert (again.written, again.unchanged, again.removed) == (0, 3, 0)
    assert {k: (p, p.stat().st_mtime_ns, p.stat().st_ino) for k, (p, _, _) in first.items()} == first

    # A new sample that sorts first, one sample dropped, a stray file and a deleted file:
    # the others keep their numbers and files; the new one gets the next number.
    write_shard(shard_path(version_dir, "shard-3"), [make_sample("k-0", 4, 4)])
    (export_dir / "rows_0-2000" / "data_77.ckpt").write_bytes(b"stray")
    first["k-c"][0].unlink()
    summary = consolidate(version_dir, make_info(), keep_keys={"k-0", "k-a", "k-c"},
                          exports=["specforge"]).exports["specforge"]
    assert (summary.samples, summary.written, summary.unchanged, summary.removed) == (3, 2, 1, 2)
    files = files_by_key(version_dir, "specforge")
    assert files["k-a"] == first["k-a"][0] and files["k-a"].stat().st_mtime_ns == first["k-a"][1]
    assert files["k-c"] == first["k-c"][0] and files["k-c"].exists()
    assert files["k-0"].name == "data_3.ckpt"
    assert not first["k-b"][0].exists() and "k-b" not in files
    read = read_with_specforge(specforge, export_dir)
    assert sorted(read) == sorted(str(p) for p in files.values())

    # The dropped sample comes back under its old number.
    consolidate(version_dir, make_info(), exports=["specforge"])
    assert files_by_key(version_dir, "specforge")["k-b"] == first["k-b"][0]


def test_modelopt_offline_dataset_loads_the_export(version_dir, modelopt_dataset):
    summary = consolidate(version_dir, make_info(), exports=["modelopt"])
    assert summary.exports["modelopt"].written == 3
    export_dir = version_dir / "exports" / "modelopt"
    # ModelOpt's launcher collects every *.pt under the folder: ours must be exactly the samples.
    paths = sorted(export_dir.rglob("*.pt"))
    assert [p.name for p in paths] == ["k-a.pt", "k-b.pt", "k-c.pt"]
    reader = modelopt_dataset(paths, answer_only_loss=True)
    dataset = TrainingSetDataset(version_dir)
    for i, key in enumerate(dataset.manifest["sample_key"].to_list()):
        want, got = dataset[i], reader[paths.index(export_dir / f"{key}.pt")]
        assert torch.equal(got["base_model_hidden_states"], want["hidden_states"])
        assert torch.equal(got["aux_hidden_states"], want["aux_hidden_states"])
        assert torch.equal(got["input_ids"], want["input_ids"])
        assert torch.equal(got["loss_mask"], want["loss_mask"])
        assert got["base_hidden_prenorm"] is False  # our final states are post-norm
        raw = torch.load(export_dir / f"{key}.pt", weights_only=True)
        assert raw["conversation_id"] == f"conv-{key}"
    again = consolidate(version_dir, make_info(), exports=["modelopt"]).exports["modelopt"]
    assert (again.written, again.unchanged) == (0, 3)


def test_speculators_export_is_refused_before_anything_is_written(version_dir):
    source = released(SPECULATORS) / "speculators" / "models" / "eagle3" / "core.py"
    # The premise of the refusal: speculators' EAGLE-3 trainer applies the final norm itself.
    assert "self.verifier_norm(verifier_last_hidden_states)" in source.read_text()
    with pytest.raises(ExportUnsupported, match="speculators.*BEFORE the model's final norm"):
        check_exports(["speculators"], make_info())
    with pytest.raises(ExportUnsupported):
        consolidate(version_dir, make_info(), exports=["specforge", "speculators"])
    assert not (version_dir / "manifest.parquet").exists() and not (version_dir / "exports").exists()
