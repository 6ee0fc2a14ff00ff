"""patches.dumps under failure: killed writers, bad pieces, refused writes, rids that look alike.

tests/test_dump_protocol.py covers the ordinary cases (assembly, prefix-cache hit,
duplicate, foreign, size cap, swept temp files); these are the edges around them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import save_file

from patches.capture import PieceRows, capture_pieces
from patches.dumps import (DumpCorrupt, DumpDuplicate, DumpIncomplete, DumpMissing, DumpOverlap, DumpReader,
                           DumpWriteFailed, prompt_hash, safe_rid)
from tests.dump_support import H, make_writer, submit

IDS = list(range(100, 137))


# --------------------------------------------------------------------------- a writer killed mid-write

KILLED_WRITER = textwrap.dedent("""
    import sys, torch
    from patches.capture import PieceRows, capture_pieces
    from patches.dumps import DumpSettings, DumpWriter, prompt_hash
    writer = DumpWriter(DumpSettings(sys.argv[1], "eagle3-", "tiny", (2, 4, 5)))
    T, H = 2048, 1024
    for i in range(1000):
        ids = torch.arange(T) + i
        piece = PieceRows(f"eagle3-kill-{i}", 0, 0, T, T, prompt_hash(ids.tolist()))
        capture_pieces(writer, [piece], ids, [torch.full((T, H), float(i))] * 3, torch.full((T, H), float(i)),
                       torch.full((T, H), float(i)))
    writer.close()
""")


def run_and_kill_mid_write(folder) -> bool:
    """Start a writer of ~33 MB pieces, SIGKILL it as soon as a temporary file shows; True if one was left."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(folder)])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            names = os.listdir(folder) if folder.exists() else []
            if any(n.endswith(".tmp") for n in names) and any(n.endswith(".dump.safetensors") for n in names
                                                               if not n.startswith(".")):
                proc.send_signal(signal.SIGKILL)
                break
        else:
            raise AssertionError("the writer subprocess never wrote a piece")
    finally:
        proc.kill()
        proc.wait()
    return any(n.startswith(".") and n.endswith(".tmp") for n in os.listdir(folder))


def test_killed_writer_leaves_only_whole_pieces(tmp_path):
    for attempt in range(5):  # the kill may land just after a rename; try again until it lands mid-write
        folder = tmp_path / f"run{attempt}"
        if run_and_kill_mid_write(folder):
            break
    else:
        pytest.fail("five SIGKILLs never landed during a write")
    reader = DumpReader(folder)
    pieces = [n for n in os.listdir(folder) if not n.startswith(".")]
    assert pieces and all(n.endswith(".dump.safetensors") for n in pieces)
    for name in pieces:  # every visible piece is whole: parses, right shapes, right values
        i = int(name.split("-")[2])  # eagle3-kill-{i}-{hash}.{chunk}.{nonce}.dump.safetensors
        rid, T = f"eagle3-kill-{i}", 2048
        dump = reader.assemble(rid, (torch.arange(T) + i).tolist())
        assert dump.aux_hidden_states.shape == (T, 3 * 1024) and bool((dump.final_hidden_states == i).all())
    temps = [n for n in os.listdir(folder) if n.startswith(".")]
    assert all(n.endswith(".tmp") for n in temps)
    assert reader.remove_stale(ttl_s=0, now=time.time() + 10) == len(pieces) + len(temps)
    assert os.listdir(folder) == []


# --------------------------------------------------------------------------- pieces that do not add up


def test_overlap_is_told_from_duplicate(tmp_path):
    writer = make_writer(tmp_path)
    submit(writer, "eagle3-ovl", IDS, 0, 20)
    submit(writer, "eagle3-ovl", IDS, 10, 37)
    submit(writer, "eagle3-dup", IDS, 0, 37)
    submit(writer, "eagle3-dup", IDS, 0, 37)  # a retried write of the same chunk: a second file, not an overwrite
    writer.close()
    reader = DumpReader(tmp_path)
    with pytest.raises(DumpOverlap) as info:
        reader.assemble("eagle3-ovl", IDS)
    assert not isinstance(info.value, DumpDuplicate)
    with pytest.raises(DumpDuplicate):
        reader.assemble("eagle3-dup", IDS)


def test_gap_and_missing_tail_are_incomplete(tmp_path):
    writer = make_writer(tmp_path)
    submit(writer, "eagle3-gap", IDS, 0, 10)
    submit(writer, "eagle3-gap", IDS, 20, 37)
    submit(writer, "eagle3-tail", IDS, 0, 10)
    submit(writer, "eagle3-tail", IDS, 10, 20)
    writer.close()
    reader = DumpReader(tmp_path)
    with pytest.raises(DumpIncomplete, match=r"tokens \[10,20\) of 37"):
        reader.assemble("eagle3-gap", IDS)
    with pytest.raises(DumpMissing, match=r"pieces seen: \[0,10\), \[10,20\)"):
        reader.wait("eagle3-tail", len(IDS), timeout=0.1)
    with pytest.raises(DumpIncomplete, match=r"cover \[0,20\) of 37"):
        reader.assemble("eagle3-tail", IDS)


def test_decode_pieces_of_a_careless_hook_are_ignored(tmp_path):
    aux, final = torch.randn(37, 3 * H), torch.randn(37, H)
    writer = make_writer(tmp_path)
    submit(writer, "eagle3-dec", IDS, 0, 37, aux=aux, final=final)
    seq = IDS + [7, 8]
    for pos in (37, 38):  # decode steps feed one generated token each, past the prompt
        submit(writer, "eagle3-dec", seq, pos, pos + 1, mode="decode", prompt=IDS)
    writer.close()
    reader = DumpReader(tmp_path)
    infos = reader.wait("eagle3-dec", 37, timeout=10)
    dump = reader.assemble("eagle3-dec", IDS, infos)
    assert len(infos) == 3 and torch.equal(dump.aux_hidden_states, aux) and torch.equal(dump.final_hidden_states, final)


def test_unreadable_wrong_version_and_nan_pieces_are_corrupt(tmp_path):
    reader = DumpReader(tmp_path)
    (tmp_path / f"{safe_rid('eagle3-junk')}.000000000.aaaaaaaa.dump.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DumpCorrupt, match="cannot read piece"):
        reader.pieces("eagle3-junk")

    meta = {"format": "eagle3-dump", "version": "99", "rid": "eagle3-v2", "chunk_start": "0", "chunk_len": "37",
            "prompt_len": "37", "prompt_hash": prompt_hash(IDS), "forward_mode": "extend"}
    save_file({"input_ids": torch.tensor(IDS)}, str(tmp_path / f"{safe_rid('eagle3-v2')}.000000000.bbbbbbbb.dump.safetensors"),
              metadata=meta)
    with pytest.raises(DumpCorrupt, match="version '99'"):
        reader.pieces("eagle3-v2")

    writer = make_writer(tmp_path)
    aux = torch.randn(37, 3 * H)
    aux[5, 3] = float("nan")
    submit(writer, "eagle3-nan", IDS, 0, 37, aux=aux)
    writer.close()
    with pytest.raises(DumpCorrupt, match="NaN"):
        reader.assemble("eagle3-nan", IDS)


# --------------------------------------------------------------------------- refused writes


def test_queue_budget_refuses_without_blocking_and_leaves_a_marker(tmp_path):
    writer = make_writer(tmp_path, max_pending_bytes=100)
    assert submit(writer, "eagle3-huge", IDS, 0, 37) is False
    writer.close()
    with pytest.raises(DumpWriteFailed, match="over its budget of 100 bytes"):
        DumpReader(tmp_path).wait("eagle3-huge", len(IDS), timeout=10)
    assert writer.stats()["refused"] == 1


def test_server_reported_failure_is_a_marker(tmp_path):
    writer = make_writer(tmp_path)
    writer.fail("eagle3-nohidden", "no hidden states on the CUDA-graph path")
    writer.close()
    with pytest.raises(DumpWriteFailed, match="CUDA-graph path"):
        DumpReader(tmp_path).wait("eagle3-nohidden", len(IDS), timeout=10)


def test_vanished_folder_is_logged_and_counted_not_raised(tmp_path):
    folder = tmp_path / "dumps"
    writer = make_writer(folder)
    shutil.rmtree(folder)
    assert submit(writer, "eagle3-gone", IDS, 0, 37) is True  # submit never touches the disk
    writer.close()
    stats = writer.stats()
    assert stats["refused"] == 1 and stats["written"] == 0 and "eagle3-gone" in stats["last_error"]


def test_a_piece_that_lands_late_is_logged_with_where_its_time_went(tmp_path, caplog):
    class SlowCopy:  # stands in for the CUDA event of a device-to-host copy that completes late
        def synchronize(self):
            time.sleep(0.3)

    writer = make_writer(tmp_path)
    writer.slow_piece_s = 0.2
    ids = torch.tensor(IDS)
    piece = PieceRows("eagle3-late", 0, 0, len(IDS), len(IDS), prompt_hash(IDS))
    with caplog.at_level("WARNING", logger="patches.dumps"):
        submit(writer, "eagle3-prompt", IDS, 0, 37)  # lands at once: not logged
        capture_pieces(writer, [piece], ids, list(torch.randn(len(IDS), 3 * H).split(H, -1)), torch.randn(len(IDS), H),
                       torch.randn(len(IDS), H), transfer=lambda tensors: (list(tensors), SlowCopy()))
        writer.close()
    late = [r.getMessage() for r in caplog.records if "landed" in r.getMessage()]
    assert len(late) == 1 and "eagle3-late" in late[0], late
    waited = float(late[0].split(" s waiting for its copy")[0].rsplit(", ", 1)[1])
    assert waited >= 0.3
    assert DumpReader(tmp_path).assemble("eagle3-late", IDS).rid == "eagle3-late"  # late, and still whole


# --------------------------------------------------------------------------- rids that look alike


def test_rids_that_look_alike_never_share_pieces(tmp_path):
    rids = ["eagle3-1", "eagle3-10", "eagle3-a/b", "eagle3-a_b", "eagle3-a b", "eagle3-é"]
    assert len({safe_rid(r) for r in rids}) == len(rids)
    writer = make_writer(tmp_path)
    finals = {rid: torch.randn(37, H) for rid in rids}
    for rid in rids:
        submit(writer, rid, IDS, 0, 37, final=finals[rid])
    writer.close()
    reader = DumpReader(tmp_path)
    for rid in rids:
        dump = reader.assemble(rid, IDS)
        assert dump.rid == rid and torch.equal(dump.final_hidden_states, finals[rid])
