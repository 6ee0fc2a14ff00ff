"""Shards, manifest, dataset metadata and the loader, on synthetic tensors (no server needed)."""

from __future__ import annotations

import json
import pickle
import random
import resource
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest
import torch
from safetensors.torch import load_file

from tasks.samples import TrainingSample
from tasks.shards import (InvalidSample, ShardCorrupt, ShardWriteFailed, ShardWriter, content_hash, list_shards,
                          read_shard_index, write_shard)
from tasks.consolidation import MissingSamples, SchemaMismatch, consolidate
from tasks.training_set import DatasetInfo, TrainingSetDataset, read_dataset_info

HIDDEN = 16
LAYERS = [2, 4, 5]
VOCAB = 1000  # make_sample's token ids are below it
REPO = Path(__file__).resolve().parent.parent


def make_sample(key: str, tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16,
                hidden: int = HIDDEN) -> TrainingSample:
    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(0, 2, (tokens,), generator=g)
    return TrainingSample(sample_key=key, source_id=f"conv-{key}",
                          input_ids=torch.randint(0, VOCAB, (tokens,), generator=g), loss_mask=mask,
                          aux_hidden_states=torch.randn(tokens, len(LAYERS) * hidden, generator=g).to(dtype),
                          final_hidden_states=torch.randn(tokens, hidden, generator=g).to(dtype),
                          prenorm_hidden_states=torch.randn(tokens, hidden, generator=g).to(dtype))


def make_info(dtype: str = "bfloat16", hidden: int = HIDDEN, store_dtype: str | None = None) -> DatasetInfo:
    return DatasetInfo(model="synthetic", layer_ids=LAYERS, layer_convention="hf_hidden_states_index",
                       final_states="post_norm+pre_norm", dtype=dtype, store_dtype=store_dtype or dtype, hidden_size=hidden,
                       num_layers=8, vocab_size=VOCAB,
                       template_hash="t" * 16, max_length=64, project_version="0.1.0", fingerprint="f" * 16)


def shard_path(version_dir: Path, name: str) -> Path:
    (version_dir / "shards").mkdir(parents=True, exist_ok=True)
    return version_dir / "shards" / f"{name}.safetensors"


def test_shard_round_trip_through_plain_safetensors_and_the_index(tmp_path):
    samples = [make_sample("a", 5, 1), make_sample("b", 3, 2), make_sample("c", 9, 3)]
    summary = write_shard(shard_path(tmp_path, "s0"), samples)

    assert (summary.samples, summary.tokens, summary.sample_keys) == (3, 17, ["a", "b", "c"])
    assert summary.bytes == Path(summary.path).stat().st_size
    # Any safetensors reader opens a shard: the tensors are the samples back to back.
    tensors = load_file(summary.path)
    assert tensors["offsets"].tolist() == [0, 5, 8, 17]
    assert torch.equal(tensors["aux_hidden_states"][5:8], samples[1].aux_hidden_states)
    assert torch.equal(tensors["final_hidden_states"][8:17], samples[2].final_hidden_states)
    assert torch.equal(tensors["prenorm_hidden_states"][:5], samples[0].prenorm_hidden_states)
    assert torch.equal(tensors["loss_mask"][:5], samples[0].loss_mask)

    index = read_shard_index(summary.path)
    assert [(r["sample_key"], r["source_id"], r["offset_start"], r["offset_end"], r["num_tokens"]) for r in index] == [
        ("a", "conv-a", 0, 5, 5), ("b", "conv-b", 5, 8, 3), ("c", "conv-c", 8, 17, 9)]
    for row, s in zip(index, samples):
        assert row["num_supervised"] == int(s.loss_mask.sum())
        assert row["content_hash"] == content_hash(s.input_ids, s.loss_mask, s.aux_hidden_states,
                                                   s.final_hidden_states, s.prenorm_hidden_states)
        assert row["shard"] == "s0.safetensors"


def test_content_hash_tells_apart_samples_that_differ_in_one_value():
    s = make_sample("a", 6, 1)
    changed = s.final_hidden_states.clone()
    changed[3, 7] += 1
    assert content_hash(s.input_ids, s.loss_mask, s.aux_hidden_states, s.final_hidden_states) != \
        content_hash(s.input_ids, s.loss_mask, s.aux_hidden_states, changed)


def test_write_shard_refuses_bad_samples_naming_them(tmp_path):
    good = make_sample("good", 4, 1)
    bad_mask = replace(make_sample("bad-mask", 4, 2), loss_mask=torch.tensor([0, 1, 2, 1]))
    with pytest.raises(InvalidSample, match="bad-mask.*other than 0 and 1"):
        write_shard(shard_path(tmp_path, "s"), [good, bad_mask])
    other_dtype = make_sample("fp32", 4, 3, dtype=torch.float32)
    with pytest.raises(InvalidSample, match="fp32.*dtypes"):
        write_shard(shard_path(tmp_path, "s"), [good, other_dtype])
    with pytest.raises(InvalidSample, match="good.*twice"):
        write_shard(shard_path(tmp_path, "s"), [good, good])
    assert list_shards(tmp_path) == []


@pytest.mark.parametrize("store_dtype", [None, "float8_e4m3fn"])
def test_samples_streamed_into_a_shard_in_any_order_give_the_shard_written_whole(tmp_path, store_dtype):
    """A batch's samples go into its shard from many threads as they arrive; missing ones (they
    failed) are compacted away. The file is byte for byte the shard of the present samples in plan
    order, so neither arrival order nor failures change what a trainer reads."""
    plan = [make_sample(f"k{i}", 3 + 5 * i, i) for i in range(12)]
    failed = {"k0", "k5", "k11"}  # the first, a middle and the last sample
    arrivals = [s for s in plan if s.sample_key not in failed]
    random.Random(3).shuffle(arrivals)
    streamed = shard_path(tmp_path / "streamed", "batch-0007")
    with ShardWriter(streamed, plan, torch.bfloat16, HIDDEN, len(LAYERS), store_dtype) as shard:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(shard.add, arrivals))
        summary = shard.close()
    whole = write_shard(shard_path(tmp_path / "whole", "batch-0007"),
                        [s for s in plan if s.sample_key not in failed], store_dtype)
    assert streamed.read_bytes() == Path(whole.path).read_bytes()
    assert summary.sample_keys == [s.sample_key for s in plan if s.sample_key not in failed]
    assert (summary.samples, summary.tokens) == (9, sum(len(s.input_ids) for s in plan if s.sample_key not in failed))
    assert sorted(p.name for p in streamed.parent.iterdir()) == ["batch-0007.safetensors"]  # no temporary file left
    # every sample all present: no compaction, the same bytes as written whole too
    complete = shard_path(tmp_path / "complete", "batch-0007")
    with ShardWriter(complete, plan, torch.bfloat16, HIDDEN, len(LAYERS), store_dtype) as shard:
        for s in reversed(plan):
            shard.add(s)
        shard.close()
    assert complete.read_bytes() == Path(write_shard(shard_path(tmp_path / "all", "batch-0007"), plan,
                                                     store_dtype).path).read_bytes()


def test_a_streamed_shard_refuses_strangers_and_leaves_nothing_when_empty_or_failed(tmp_path):
    plan = [make_sample("a", 4, 1), make_sample("b", 6, 2)]
    path = shard_path(tmp_path, "s")
    with ShardWriter(path, plan, torch.bfloat16, HIDDEN, len(LAYERS)) as shard:
        with pytest.raises(InvalidSample, match="'stranger'.*not planned"):
            shard.add(make_sample("stranger", 4, 3))
        with pytest.raises(InvalidSample, match="'a'.*5 tokens, planned with 4"):
            shard.add(replace(make_sample("a", 5, 1)))
        shard.add(plan[0])
        with pytest.raises(InvalidSample, match="'a'.*added twice"):
            shard.add(plan[0])
        assert shard.close().sample_keys == ["a"]
    with ShardWriter(path.with_name("none.safetensors"), plan, torch.bfloat16, HIDDEN, len(LAYERS)) as shard:
        assert shard.close() is None  # every sample failed: no shard at all
    with pytest.raises(RuntimeError, match="the batch broke"):
        with ShardWriter(path.with_name("broken.safetensors"), plan, torch.bfloat16, HIDDEN, len(LAYERS)) as shard:
            shard.add(plan[1])
            raise RuntimeError("the batch broke")
    assert [p.name for p in path.parent.iterdir()] == ["s.safetensors"]


# Starts a shard on a small disk, fills the disk, then writes the shard's second sample. In a
# child process: a store into an unreserved page of a full disk kills its process (SIGBUS).
_FILL_UP_CHILD = textwrap.dedent("""
    import sys
    from pathlib import Path
    import torch
    sys.path[:0] = [{repo!r}, {tests!r}]
    from test_training_set import LAYERS, make_sample
    from tasks.shards import ShardWriteFailed, ShardWriter
    disk = Path({disk!r})
    plan = [make_sample("a", 512, 1, hidden=64), make_sample("b", 512, 2, hidden=64)]
    try:
        with ShardWriter(disk / "s.safetensors", plan, torch.bfloat16, 64, len(LAYERS)) as shard:
            shard.add(plan[0])
            with (disk / "filler").open("wb") as filler:  # someone else takes the rest of the disk
                try:
                    while True:
                        filler.write(b"x" * 65536)
                        filler.flush()
                except OSError:
                    pass
            shard.add(plan[1])
    except ShardWriteFailed as exc:
        print("failed:", exc, flush=True)
""")


def test_a_disk_that_fills_up_while_a_shard_is_written_fails_that_write_naming_the_shard(tmp_path):
    # A real small filesystem. The shard's file is sized (sparse) when the batch starts and
    # each sample's rows are reserved as they are written, so a disk that fills up in
    # between must fail the write with ENOSPC, not kill the writer.
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.decode().strip()}")
    try:
        path = disk / "s.safetensors"
        child = subprocess.run([sys.executable, "-c", _FILL_UP_CHILD.format(repo=str(REPO), tests=str(REPO / "tests"),
                                                                            disk=str(disk))],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, f"the writer died ({child.returncode}): {child.stderr[-2000:]}"
        assert child.stdout.startswith(f"failed: [Errno 28] cannot write shard {path}: No space left on device "
                                       "(reserving"), child.stdout
        assert [p.name for p in disk.iterdir()] == ["filler"], "the shard's temporary file was left behind"

        (disk / "filler").unlink()
        (disk / "big").write_bytes(b"x" * (7 << 19))  # 3.5 of its 4 MiB: too full to start the shard at all
        plan = [make_sample("a", 512, 1, hidden=64), make_sample("b", 512, 2, hidden=64)]
        with pytest.raises(ShardWriteFailed, match=rf"cannot write shard {path}: No space left on device "
                                                   r"\(\d+ bytes needed, \d+ free\)"):
            ShardWriter(path, plan, torch.bfloat16, 64, len(LAYERS))
        assert [p.name for p in disk.iterdir()] == ["big"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# Writes an old shard, then a bigger one over it under a file-size limit: first with SIGXFSZ
# ignored (sizing the file fails with an OSError, like a full disk), then with its
# default action, which kills the process in the middle of the shard's write, like a crash.
_CRASH_CHILD = textwrap.dedent("""
    import resource, signal, sys
    from pathlib import Path
    sys.path[:0] = [{repo!r}, {tests!r}]
    from test_training_set import make_sample
    from tasks.shards import write_shard
    path = Path({path!r})
    write_shard(path, [make_sample("old", 4, 0)])
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    big = [make_sample(f"new{{i}}", 4096, i, hidden=64) for i in range(2)]  # ~4 MiB of hidden states
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        write_shard(path, big)
    except OSError as exc:
        print("failed:", exc.errno, exc, flush=True)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    write_shard(path, big)
    print("not killed", flush=True)
""")


def test_shard_write_is_atomic_on_error_and_on_crash(tmp_path):
    path = shard_path(tmp_path, "s0")
    child = subprocess.run([sys.executable, "-c", _CRASH_CHILD.format(repo=str(REPO), tests=str(REPO / "tests"),
                                                                      path=str(path))],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGXFSZ, child.stdout + child.stderr
    assert "failed: 27" in child.stdout  # EFBIG, raised and the temporary file removed
    assert f"cannot write shard {path}: File too large" in child.stdout  # the message names the shard
    # The old shard is whole and still the one under the name; the killed write left only
    # a dot-named temporary file, which no reader takes for a shard.
    # (The writer sizes the whole file first, so the crash comes before any sample is written.)
    assert [r["sample_key"] for r in read_shard_index(path)] == ["old"]
    leftovers = [p for p in path.parent.iterdir() if p != path]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".s0.safetensors.")
    assert leftovers[0].name.endswith(".tmp")
    assert list_shards(tmp_path) == [path]
    assert consolidate(tmp_path, make_info(), exports=()).samples == 1
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] == resource.RLIM_INFINITY  # the limit stayed in the child


def test_consolidate_keeps_wanted_samples_once_and_counts_them(tmp_path):
    a, b, c, d = (make_sample(k, n, seed) for k, n, seed in [("a", 5, 1), ("b", 3, 2), ("c", 7, 3), ("d", 4, 4)])
    c_again = make_sample("c", 6, 99)  # the same key written again by a later run, other tensors
    write_shard(shard_path(tmp_path, "shard-1"), [a, b, c])
    write_shard(shard_path(tmp_path, "shard-2"), [c_again, d])

    summary = consolidate(tmp_path, make_info(), keep_keys={"a", "c", "d"}, exports=())

    manifest = pl.read_parquet(tmp_path / "manifest.parquet")
    assert manifest["sample_key"].to_list() == ["a", "c", "d"]
    c_row = manifest.filter(pl.col("sample_key") == "c").row(0, named=True)
    assert (c_row["shard"], c_row["num_tokens"]) == ("shard-1.safetensors", 7)  # first shard by name wins
    assert (summary.samples, summary.tokens, summary.duplicates, summary.left_out, summary.shards) == (3, 16, 1, 1, 2)
    assert summary.supervised_tokens == sum(int(s.loss_mask.sum()) for s in (a, c, d))
    assert summary.bytes == 16 * (16 + 5 * HIDDEN * 2)  # ids, mask; 3 aux taps and 2 final states in bf16

    dataset = json.loads((tmp_path / "dataset.json").read_text())
    assert dataset["schema_version"] == 2 and dataset["final_states"] == "post_norm+pre_norm" and dataset["samples"] == 3 and dataset["tokens"] == 16
    assert dataset["shards"] == ["shard-1.safetensors", "shard-2.safetensors"]
    assert read_dataset_info(tmp_path) == make_info()

    everything = consolidate(tmp_path, make_info(), keep_keys=None, exports=())
    assert (everything.samples, everything.left_out) == (4, 0)


def test_consolidate_refuses_missing_samples_and_foreign_shards(tmp_path):
    write_shard(shard_path(tmp_path, "shard-1"), [make_sample("a", 5, 1)])
    with pytest.raises(MissingSamples, match="1 of the 2 samples.*'zz'"):
        consolidate(tmp_path, make_info(), keep_keys={"a", "zz"}, exports=())
    write_shard(shard_path(tmp_path, "shard-2"), [make_sample("b", 5, 2, hidden=32)])
    with pytest.raises(SchemaMismatch, match="shard-2.safetensors"):
        consolidate(tmp_path, make_info(), exports=())
    (tmp_path / "shards" / "shard-2.safetensors").write_bytes(b"\x08" + bytes(15))  # a truncated file
    with pytest.raises(ShardCorrupt, match="shard-2.safetensors"):
        consolidate(tmp_path, make_info(), exports=())


def test_loader_returns_exactly_the_written_tensors(tmp_path):
    samples = {s.sample_key: s for s in [make_sample("k1", 5, 1), make_sample("k2", 1, 2), make_sample("k3", 8, 3)]}
    write_shard(shard_path(tmp_path, "shard-1"), [samples["k2"], samples["k1"]])
    write_shard(shard_path(tmp_path, "shard-2"), [samples["k3"]])
    consolidate(tmp_path, make_info(), exports=())

    dataset = TrainingSetDataset(tmp_path)
    assert len(dataset) == 3 and not dataset._handles  # len() opens no shard
    # A DataLoader worker gets a pickled copy: it must work there too.
    for ds in (dataset, pickle.loads(pickle.dumps(dataset))):
        for i, key in enumerate(ds.manifest["sample_key"].to_list()):
            item, want = ds[i], samples[key]
            assert torch.equal(item["input_ids"], want.input_ids)
            assert torch.equal(item["loss_mask"], want.loss_mask)
            assert item["aux_hidden_states"].dtype == torch.bfloat16
            assert torch.equal(item["aux_hidden_states"], want.aux_hidden_states)
            assert torch.equal(item["hidden_states"], want.final_hidden_states)
            assert torch.equal(item["prenorm_hidden_states"], want.prenorm_hidden_states)
            for t in item.values():  # its own rows, not a view of the shard (torch.save would write all of it)
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    with pytest.raises(IndexError):
        dataset[3]
    batches = list(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1))
    assert [int(b["input_ids"].numel()) for b in batches] == [5, 1, 8]


def test_float8_storage_is_half_the_bytes_and_reconstructs_each_token(tmp_path):
    from tasks.exports import run_export

    samples = [make_sample("a", 300, 1, hidden=256), make_sample("b", 200, 2, hidden=256)]
    # One token of a very different magnitude: per-token scales keep the others precise.
    samples[0].aux_hidden_states[7] *= 1000
    bf16 = write_shard(shard_path(tmp_path / "bf16", "s"), samples)
    fp8 = write_shard(shard_path(tmp_path / "fp8", "s"), samples, store_dtype="float8_e4m3fn")
    tokens = 500
    hidden_bytes = tokens * 5 * 256  # aux and both final states, one byte per value
    assert fp8.bytes - bf16.bytes / 2 < 0.01 * hidden_bytes + tokens * 5 * 4  # + float32 scales, 5 per token
    assert fp8.bytes < 0.52 * bf16.bytes

    with pytest.raises(SchemaMismatch, match="store_dtype"):
        consolidate(tmp_path / "fp8", make_info(hidden=256), exports=())
    info = make_info(hidden=256, store_dtype="float8_e4m3fn")
    consolidate(tmp_path / "fp8", info, exports=())
    dataset = TrainingSetDataset(tmp_path / "fp8")
    for i, s in enumerate(sorted(samples, key=lambda s: s.sample_key)):
        item = dataset[i]
        assert torch.equal(item["input_ids"], s.input_ids) and torch.equal(item["loss_mask"], s.loss_mask)
        for got, want in ((item["aux_hidden_states"], s.aux_hidden_states),
                          (item["hidden_states"], s.final_hidden_states),
                          (item["prenorm_hidden_states"], s.prenorm_hidden_states)):
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            # Independently: e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4), subnormals below
            # scale * 2^-6 round to a multiple of scale * 2^-9, and the bf16 output rounds again (2^-8).
            rows = want.float().reshape(want.shape[0], -1, 256)
            scale = rows.abs().amax(-1, keepdim=True) / 448
            err = (got.float().reshape(rows.shape) - rows).abs()
            assert bool((err <= rows.abs() * (2 ** -4 + 2 ** -8) + scale * 2 ** -10 + 1e-30).all())
            cosine = torch.nn.functional.cosine_similarity(got.float().reshape(rows.shape), rows, dim=-1)
            assert float(cosine.min()) > 0.998
    # Exports get the extracted dtype back: SpecForge and ModelOpt read bf16.
    run_export("modelopt", tmp_path / "fp8")
    raw = torch.load(tmp_path / "fp8" / "exports" / "modelopt" / "a.pt", weights_only=True)
    assert raw["aux_hidden_states"].dtype == torch.bfloat16
    assert torch.equal(raw["aux_hidden_states"], dataset[0]["aux_hidden_states"])


def test_store_dtype_is_part_of_the_dataset_version():
    from tasks.chat_template import TemplateVariables
    from tasks.dataset_version import ModelFacts, extraction_config

    model = ModelFacts("m", num_layers=8, hidden_size=16, vocab_size=VOCAB, identity="i" * 32)
    variables = TemplateVariables().record()
    plain = extraction_config(model, None, "bfloat16", "t" * 16, 64, "truncate", template_variables=variables)
    fp8 = extraction_config(model, None, "bfloat16", "t" * 16, 64, "truncate", store_dtype="float8_e4m3fn",
                            template_variables=variables)
    assert (plain.store_dtype, fp8.store_dtype) == ("bfloat16", "float8_e4m3fn")
    assert plain.fingerprint() != fp8.fingerprint()
