"""Trainer exports, read back by the trainers' own released reader code.

The readers come from the released wheels (pip download --no-deps, pinned below) unpacked
under build/trainer-readers/; the fixture downloads them when missing. SpecForge's offline
reader modules import with nothing but torch, so they are imported as a package. ModelOpt's
package __init__ pulls in omegaconf and much more, so its two modules that the offline
dataset needs (eagle/utils.py and utils/loss_mask.py, which import only torch and
transformers) are loaded from their files. speculators' ArrowDataset (with hs_connectors'
FileTransfer, a separate wheel) runs in a child process: importing speculators registers its
model classes with transformers, which the other tests' processes should not see; its
vocabulary-mapping function checks ours.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import textwrap
import zipfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks.consolidation import consolidate
from tasks.exports import EXPORT_INDEX_NAME
from tasks.shards import write_shard
from tasks.training_set import TrainingSetDataset, read_dataset_json, sample_bytes
from tasks.vocab_mapping import TOKEN_FREQ_NAME, VOCAB_MAPPING_NAME
from tests.test_training_set import LAYERS, REPO, VOCAB, make_info, make_sample, shard_path

READERS = REPO / "build" / "trainer-readers"
SPECFORGE = "specforge==0.2.0"
MODELOPT = "nvidia-modelopt==0.47.0"
SPECULATORS = "speculators==0.9.0"
HS_CONNECTORS = "hs-connectors==0.9.0"  # speculators' hidden-state file reader (FileTransfer)


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


_SPECULATORS_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path[:0] = sys.argv[3:]
    from speculators.train.data import ArrowDataset
    # on_missing="raise": a missing hs file must fail, not ask a vLLM server for the states
    dataset = ArrowDataset(max_len=1 << 20, datapath=sys.argv[1], on_missing="raise")
    torch.save({"items": [dataset[i] for i in range(len(dataset))], "lengths": dataset.approx_lengths}, sys.argv[2])
""")


def read_with_speculators(export_dir: Path, tmp_path: Path) -> tuple[list[dict], list[int]]:
    """speculators' ArrowDataset over ``export_dir`` (its --data-path): each row's item, and the rows' lengths."""
    out = tmp_path / "speculators-items.pt"
    child = subprocess.run([sys.executable, "-c", _SPECULATORS_CHILD, str(export_dir), str(out),
                            str(released(SPECULATORS)), str(released(HS_CONNECTORS))],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    read = torch.load(out, weights_only=True)
    return read["items"], read["lengths"]


def speculators_rows(version_dir: Path) -> list[str]:
    """Sample keys in the order of the speculators export's rows (its files' numbers)."""
    entries = export_index(version_dir, "speculators")["samples"]
    live = sorted((e["idx"], k) for k, e in entries.items() if e["content_hash"])
    assert [idx for idx, _ in live] == list(range(len(live))), "row i must be hs_i"
    return [k for _, k in live]


def test_speculators_reader_loads_the_export_unchanged(version_dir, tmp_path):
    # speculators' EAGLE-3 trainer applies the final norm itself: it must get the state before it.
    core = released(SPECULATORS) / "speculators" / "models" / "eagle3" / "core.py"
    assert "self.verifier_norm(verifier_last_hidden_states)" in core.read_text()
    summary = consolidate(version_dir, make_info(), exports=["speculators"], draft_vocab_size=64)
    assert summary.exports["speculators"].written == 3
    export_dir = version_dir / "exports" / "speculators"

    def check() -> None:
        items, lengths = read_with_speculators(export_dir, tmp_path)
        dataset = TrainingSetDataset(version_dir)
        position = {k: i for i, k in enumerate(dataset.manifest["sample_key"].to_list())}
        keys = speculators_rows(version_dir)
        assert sorted(keys) == sorted(position) and len(items) == len(keys)
        for got, key in zip(items, keys):
            want = dataset[position[key]]
            assert got["hidden_states"].dtype == torch.bfloat16
            assert torch.equal(got["hidden_states"], want["aux_hidden_states"])
            assert torch.equal(got["verifier_last_hidden_states"], want["prenorm_hidden_states"])
            assert not torch.equal(got["verifier_last_hidden_states"], want["hidden_states"])
            assert torch.equal(got["input_ids"], want["input_ids"])
            assert torch.equal(got["loss_mask"], want["loss_mask"])
        assert lengths == [int(dataset[position[k]]["input_ids"].numel()) for k in keys]
        assert torch.load(export_dir / TOKEN_FREQ_NAME, weights_only=True) == \
            torch.load(version_dir / TOKEN_FREQ_NAME, weights_only=True)

    check()
    again = consolidate(version_dir, make_info(), exports=["speculators"]).exports["speculators"]
    assert (again.written, again.unchanged) == (0, 3)

    # A sample leaves and one arrives: the reader pairs row i with hs_i, so the numbers close up.
    write_shard(shard_path(version_dir, "shard-3"), [make_sample("k-0", 4, 4)])
    consolidate(version_dir, make_info(), keep_keys={"k-0", "k-b", "k-c"}, exports=["speculators"])
    assert sorted(p.name for p in (export_dir / "hidden_states").iterdir()) == [
        "hs_0.safetensors", "hs_1.safetensors", "hs_2.safetensors"]
    check()
    consolidate(version_dir, make_info(), exports=["speculators"])  # and k-a comes back
    check()


@pytest.mark.parametrize("name", ["specforge", "modelopt", "speculators"])
def test_each_export_file_holds_only_its_sample(tmp_path, name):
    # Shards of several samples: a file saved from a view of its shard would carry the whole shard.
    samples = [make_sample(f"k{i}", n, i, hidden=256) for i, n in enumerate([139, 300, 57, 200])]
    write_shard(shard_path(tmp_path, "shard-1"), samples[:3])
    write_shard(shard_path(tmp_path, "shard-2"), samples[3:])
    info = make_info(hidden=256)
    consolidate(tmp_path, info, exports=[name])
    files = files_by_key(tmp_path, name)
    assert sorted(files) == ["k0", "k1", "k2", "k3"]
    for sample in samples:
        path = files[sample.sample_key]
        # ids and mask (speculators: ids only, the mask is in its row table), aux and one final state
        n = sample.input_ids.numel()
        own = sample_bytes(n, info) - n * 256 * 2 - (n * 8 if name == "speculators" else 0)
        raw = load_file(path) if name == "speculators" else torch.load(path, weights_only=True)
        assert sum(t.numel() * t.element_size() for t in raw.values() if isinstance(t, torch.Tensor)) == own
        assert own <= path.stat().st_size <= own * 1.03, (sample.sample_key, path.stat().st_size, own)


# Consolidates with a SpecForge export under a file-size limit that one sample's file exceeds
# (SIGXFSZ ignored: the write fails with EFBIG, like a full disk).
_DISK_FULL_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    sys.path[:0] = [{repo!r}, {tests!r}]
    from test_training_set import make_info
    from tasks.consolidation import consolidate
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    consolidate(Path({version_dir!r}), make_info(hidden=256), exports=["specforge"])
""")


def test_metadata_never_claims_export_files_a_failed_write_left_out(tmp_path, specforge):
    # k-c's file (~1.2 MB) is over the limit; k-a and k-b, before it in manifest order, fit.
    write_shard(shard_path(tmp_path, "shard-1"), [make_sample("k-a", 100, 1, hidden=256),
                                                  make_sample("k-c", 600, 3, hidden=256)])
    write_shard(shard_path(tmp_path, "shard-2"), [make_sample("k-b", 120, 2, hidden=256),
                                                  make_sample("k-d", 80, 4, hidden=256)])
    child = subprocess.run([sys.executable, "-c", _DISK_FULL_CHILD.format(
        repo=str(REPO), tests=str(REPO / "tests"), version_dir=str(tmp_path))],
        capture_output=True, text=True, timeout=120)
    assert child.returncode == 1, child.stdout + child.stderr
    assert "ExportError" in child.stderr and "'k-c'" in child.stderr, child.stderr

    export_dir = tmp_path / "exports" / "specforge"
    assert read_dataset_json(tmp_path)["exports"] == []  # the export is not complete: not listed
    claimed = files_by_key(tmp_path, "specforge")
    assert sorted(claimed) == ["k-a", "k-b"]
    entries = export_index(tmp_path, "specforge")["samples"]
    for key, path in claimed.items():
        assert path.stat().st_size == entries[key]["bytes"]
    assert sorted(export_dir.rglob("*.ckpt")) == sorted(claimed.values())
    assert not list(export_dir.rglob("*.tmp"))  # the failed write's temporary file is gone

    summary = consolidate(tmp_path, make_info(hidden=256), exports=["specforge"]).exports["specforge"]
    assert (summary.written, summary.unchanged) == (2, 2)
    assert read_dataset_json(tmp_path)["exports"] == ["specforge"]
    assert len(read_with_specforge(specforge, export_dir)) == 4


def test_export_index_is_appended_to_and_survives_a_torn_line(version_dir):
    consolidate(version_dir, make_info(), exports=["specforge"])
    path = version_dir / "exports" / "specforge" / EXPORT_INDEX_NAME
    before, inode = path.read_bytes(), path.stat().st_ino
    write_shard(shard_path(version_dir, "shard-3"), [make_sample("k-d", 4, 4)])
    assert consolidate(version_dir, make_info(), exports=["specforge"]).exports["specforge"].written == 1
    after = path.read_bytes()
    assert path.stat().st_ino == inode and after.startswith(before)  # the same file, appended to
    assert json.loads(after[len(before):]) == {**export_index(version_dir, "specforge")["samples"]["k-d"],
                                               "key": "k-d", "idx": 3, "file": "rows_0-2000/data_3.ckpt"}

    # A crash in the middle of k-d's line: the line is dropped, k-d's file rewritten under its number.
    path.write_bytes(after[:-10])
    summary = consolidate(version_dir, make_info(), exports=["specforge"]).exports["specforge"]
    assert (summary.written, summary.unchanged, summary.removed) == (1, 3, 0)
    assert files_by_key(version_dir, "specforge")["k-d"].name == "data_3.ckpt"
    assert path.read_bytes().endswith(b"\n")


def test_exports_on_demand_from_the_shards(version_dir, specforge):
    consolidate(version_dir, make_info())  # by default no export: the shards are the one copy
    assert not (version_dir / "exports").exists() and read_dataset_json(version_dir)["exports"] == []
    run = subprocess.run([sys.executable, "-m", "tasks.exports", str(version_dir), "specforge"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)[0]["written"] == 3
    assert read_dataset_json(version_dir)["exports"] == ["specforge"]
    assert len(read_with_specforge(specforge, version_dir / "exports" / "specforge")) == 3


def released_function(requirement: str, module_path: str, name: str):
    """One function taken alone from a released module whose imports cannot all be met here."""
    path = released(requirement) / module_path
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = {"torch": torch}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return namespace[name]


def test_vocab_mapping_against_an_independent_count_and_the_trainers_code(tmp_path, specforge):
    # speculators' train/vocab_mapping.py imports the whole speculators package: its function alone.
    speculators_mapping = released_function(SPECULATORS, "speculators/train/vocab_mapping.py",
                                            "build_vocab_mappings_from_distribution")
    sys.path.insert(0, str(released(SPECFORGE)))
    try:
        from specforge.core.compact_teacher import validate_vocab_mapping_consistency
        from specforge.training.vocab_mapping import count_effective_feature_tokens
    finally:
        sys.path.remove(str(released(SPECFORGE)))

    samples = [make_sample(f"k{i}", 150, i) for i in range(6)]
    write_shard(shard_path(tmp_path, "shard-1"), samples[:4])
    write_shard(shard_path(tmp_path, "shard-2"), samples[4:])
    summary = consolidate(tmp_path, make_info(), exports=["specforge"], draft_vocab_size=64)

    def check(samples: list, draft: int) -> dict[int, int]:
        counted = Counter()
        for s in samples:
            counted.update(s.input_ids[s.loss_mask.bool()].tolist())
        freq = torch.load(tmp_path / TOKEN_FREQ_NAME, weights_only=True)
        assert freq == dict(counted)  # speculators' token_freq.pt: {id: count} of supervised tokens
        # SpecForge counts the same from its own export files.
        assert dict(count_effective_feature_tokens(str(tmp_path / "exports" / "specforge"))) == dict(counted)
        mapping = torch.load(tmp_path / VOCAB_MAPPING_NAME, weights_only=True)
        d2t, t2d = mapping["d2t"], mapping["t2d"]
        assert (d2t.dtype, tuple(d2t.shape), t2d.dtype, tuple(t2d.shape)) == (torch.int64, (draft,), torch.bool,
                                                                               (VOCAB,))
        validate_vocab_mapping_consistency(t2d, d2t)  # nonzero(t2d) == d2t + arange
        want_d2t, want_t2d = speculators_mapping(dict(counted), draft, VOCAB)
        assert torch.equal(d2t, want_d2t) and torch.equal(t2d, want_t2d)
        kept = sorted(counted, key=lambda t: (-counted[t], t))[:draft]  # by count, ties to the lower id
        kept += [t for t in range(VOCAB) if t not in counted][:draft - len(kept)]  # then the lowest unused
        assert torch.nonzero(t2d).flatten().tolist() == sorted(kept)
        return counted

    counted = check(samples, 64)
    assert summary.vocab_mapping.supervised_tokens == sum(counted.values()) == summary.supervised_tokens
    assert read_dataset_json(tmp_path)["vocab_mapping"]["draft_vocab_size"] == 64

    # The version grows by a sample that supervises one rare id 200 times: recounted, now kept.
    rare = min(set(range(VOCAB)) - set(counted))
    heavy = replace(make_sample("k9", 200, 9), input_ids=torch.full((200,), rare), loss_mask=torch.ones(200,
                                                                                                        dtype=torch.int64))
    write_shard(shard_path(tmp_path, "shard-3"), [heavy])
    consolidate(tmp_path, make_info(), exports=["specforge"], draft_vocab_size=64)
    counted = check([*samples, heavy], 64)
    assert counted[rare] == 200 and bool(torch.load(tmp_path / VOCAB_MAPPING_NAME)["t2d"][rare])

    # More draft ids than supervised ones: padded with the lowest unused ids, as the trainers do.
    consolidate(tmp_path, make_info(), exports=["specforge"], draft_vocab_size=VOCAB - 1)
    check([*samples, heavy], VOCAB - 1)


def test_export_index_is_rewritten_only_when_superseded_lines_outnumber_live_ones(tmp_path):
    from tasks.exports.writer import ExportIndex

    info = make_info()
    with ExportIndex.load(tmp_path, "specforge", info) as index:
        for n in range(1500):  # one sample's file rewritten 1500 times: 1500 lines, one live
            index.record("k-a", 0, "rows_0-2000/data_0.ckpt", f"hash-{n}", n)
    assert len((tmp_path / EXPORT_INDEX_NAME).read_text().splitlines()) == 1501
    reloaded = ExportIndex.load(tmp_path, "specforge", info)
    assert reloaded.entries == {"k-a": {"idx": 0, "file": "rows_0-2000/data_0.ckpt", "content_hash": "hash-1499",
                                        "bytes": 1499}}
    assert len((tmp_path / EXPORT_INDEX_NAME).read_text().splitlines()) == 2  # header and the live line
