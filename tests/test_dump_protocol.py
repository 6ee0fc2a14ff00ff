"""The dump protocol: a client must be able to tell a whole, own dump from anything else."""

from __future__ import annotations

import os
import time

import pytest
import torch

from patches.dumps import DumpDuplicate, DumpForeign, DumpIncomplete, DumpMissing, DumpReader, DumpWriteFailed
from tests.dump_support import LAYERS, H, make_writer, submit


def write_chunks(writer, rid, ids, bounds, aux, final, prenorm=None):
    for start, end in bounds:
        assert submit(writer, rid, ids, start, end, aux=aux[start:end], final=final[start:end],
                      prenorm=None if prenorm is None else prenorm[start:end])


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (37,), generator=g).tolist()
    return ids, torch.randn(37, 3 * H, generator=g), torch.randn(37, H, generator=g)


def test_chunked_pieces_assemble_to_the_whole_prompt(tmp_path, tensors):
    ids, aux, final = tensors
    prenorm = final * 3 + 1
    writer = make_writer(tmp_path)
    write_chunks(writer, "eagle3-a", ids, [(0, 10), (10, 30), (30, 37)], aux, final, prenorm)
    reader = DumpReader(tmp_path)
    dump = reader.assemble("eagle3-a", ids, reader.wait("eagle3-a", len(ids), timeout=10))
    writer.close()
    assert torch.equal(dump.aux_hidden_states, aux) and torch.equal(dump.final_hidden_states, final)
    assert torch.equal(dump.prenorm_hidden_states, prenorm)
    assert dump.layer_ids == list(LAYERS) and dump.final_states == "post_norm+pre_norm"
    assert reader.delete("eagle3-a") == 3 and reader.piece_paths("eagle3-a") == []


def test_prefix_cache_hit_is_incomplete(tmp_path, tensors):
    ids, aux, final = tensors
    writer = make_writer(tmp_path)
    write_chunks(writer, "eagle3-rep", ids, [(36, 37)], aux, final)  # a repeat prefills only its last token
    writer.close()
    with pytest.raises(DumpIncomplete, match="prefix-cache"):
        DumpReader(tmp_path).assemble("eagle3-rep", ids)


def test_duplicate_foreign_and_missing_are_told_apart(tmp_path, tensors):
    ids, aux, final = tensors
    writer = make_writer(tmp_path)
    write_chunks(writer, "eagle3-dup", ids, [(0, 20), (0, 20), (20, 37)], aux, final)
    other = ids[:5] + [ids[5] + 1] + ids[6:]
    write_chunks(writer, "eagle3-foreign", other, [(0, 37)], aux, final)
    writer.close()
    reader = DumpReader(tmp_path)
    with pytest.raises(DumpDuplicate):
        reader.assemble("eagle3-dup", ids)
    with pytest.raises(DumpForeign, match="eagle3-foreign"):
        reader.assemble("eagle3-foreign", ids)
    with pytest.raises(DumpMissing):
        reader.wait("eagle3-never-sent", len(ids), timeout=0.2)


def test_size_cap_leaves_a_marker_the_client_reads(tmp_path, tensors):
    ids, aux, final = tensors
    writer = make_writer(tmp_path, max_dir_bytes=1000)
    write_chunks(writer, "eagle3-big", ids, [(0, 37)], aux, final)
    reader = DumpReader(tmp_path)
    with pytest.raises(DumpWriteFailed, match="cap of 1000"):
        reader.wait("eagle3-big", len(ids), timeout=10)
    writer.close()
    assert writer.stats()["refused"] == 1


def test_pieces_after_a_failure_are_dropped_not_left_for_nobody(tmp_path, tensors):
    # The client gives up on the marker and deletes the rid's files while the server still
    # has chunks of that request to dump: none of them may land after the delete.
    ids, aux, final = tensors
    writer = make_writer(tmp_path, max_dir_bytes=3000)
    reader = DumpReader(tmp_path)
    assert submit(writer, "eagle3-late", ids, 0, 30, aux=aux[:30], final=final[:30])  # over the cap
    with pytest.raises(DumpWriteFailed, match="cap of 3000"):
        reader.wait("eagle3-late", len(ids), timeout=10)
    reader.delete("eagle3-late")
    assert not submit(writer, "eagle3-late", ids, 30, 37, aux=aux[30:], final=final[30:])  # would fit
    assert submit(writer, "eagle3-other", ids, 30, 37, aux=aux[30:], final=final[30:])
    writer.close()
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in reader.piece_paths("eagle3-other")]
    assert writer.stats()["refused"] == 2


def test_temporary_files_are_invisible_and_swept(tmp_path, tensors):
    ids, aux, final = tensors
    # What a writer killed mid-write leaves: a dot-prefixed partial file, never the final name.
    (tmp_path / ".eagle3-x.000000000.abcd.dump.safetensors.1234.tmp").write_bytes(b"partial")
    reader = DumpReader(tmp_path)
    assert reader.piece_paths("eagle3-x") == []
    old = time.time() - 7200
    for p in tmp_path.iterdir():
        os.utime(p, (old, old))
    assert reader.remove_stale(ttl_s=3600) == 1 and list(tmp_path.iterdir()) == []


def test_a_piece_of_another_server_instance_is_foreign(tmp_path):
    """Two servers share a dump folder (or one took over the port): only this run's server's pieces count."""
    ids = list(range(40, 60))
    ours = make_writer(tmp_path, instance="ours")
    theirs = make_writer(tmp_path, instance="theirs")
    assert submit(theirs, "eagle3-shared", ids, 0, 20)
    theirs.close()
    ours.close()
    with pytest.raises(DumpForeign, match="server instance 'theirs', not by this run's server 'ours'"):
        DumpReader(tmp_path, instance="ours").assemble("eagle3-shared", ids)
    assert DumpReader(tmp_path, instance="theirs").assemble("eagle3-shared", ids).instance == "theirs"
