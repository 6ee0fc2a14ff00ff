"""Values verified end to end: what the reader accepts is what the forward produced.

The race the H200 found (a device-to-host copy reading memory that the next forward had
already overwritten) cannot be staged on a CPU, so these tests hand ``capture_pieces`` a
transfer that does what the racing copy did: it lets "the next forward" write into the
snapshot before the copy reads it. The reader must refuse every such piece.
"""

from __future__ import annotations

import pytest
import torch

from patches.capture import PieceRows, capture_pieces
from patches.dumps import (DumpCorrupt, DumpReader, checksum_prefix, fold_checksums, fold_from_prefix, piece_checksum,
                           prompt_hash, row_checksums)
from tests.dump_support import LAYERS, H, make_writer

IDS = list(range(300, 340))


def forward_rows(n: int, seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    aux = [torch.randn(n, H, generator=g).to(dtype) for _ in range(len(LAYERS))]
    return aux, torch.randn(n, H, generator=g).to(dtype), torch.randn(n, H, generator=g).to(dtype)


def next_forward_overwrites(target: int, rows: slice):
    """A transfer whose copy reads snapshot tensor ``target`` after a later forward wrote ``rows`` of it."""
    def transfer(tensors):
        overwritten = tensors[target].clone()
        overwritten[rows] = torch.randn(overwritten[rows].shape).to(overwritten.dtype)
        return [overwritten if i == target else t.clone() for i, t in enumerate(tensors)], None
    return transfer


def capture_two_requests(writer, transfer=None):
    """One forward with two requests, of 40 and 25 rows."""
    aux, final, prenorm = forward_rows(65, seed=1)
    ids = torch.tensor(IDS + IDS[:25])
    pieces = [PieceRows("eagle3-a", 0, 0, 40, 40, prompt_hash(IDS)),
              PieceRows("eagle3-b", 0, 40, 65, 25, prompt_hash(IDS[:25]))]
    kwargs = {} if transfer is None else {"transfer": transfer}
    assert capture_pieces(writer, pieces, ids, aux, final, prenorm, **kwargs) == ["eagle3-a", "eagle3-b"]
    return aux, final, prenorm


def test_pieces_of_one_forward_read_back_exactly(tmp_path):
    writer = make_writer(tmp_path)
    aux, final, prenorm = capture_two_requests(writer)
    writer.close()
    dump = DumpReader(tmp_path).assemble("eagle3-a", IDS)
    assert torch.equal(dump.aux_hidden_states, torch.cat([a[:40] for a in aux], dim=-1))
    assert torch.equal(dump.final_hidden_states, final[:40])
    assert torch.equal(dump.prenorm_hidden_states, prenorm[:40])


@pytest.mark.parametrize("target,rows,what", [
    (1, slice(3, 4), "aux tap 2, aux tap 4, aux tap 5"),  # one row of the first request's three taps
    (2, slice(45, 65), "final state"),  # the second request's final rows
    (3, slice(0, 1), "pre-norm final state"),  # the first request's first pre-norm row
    (0, slice(10, 11), "token ids"),    # a later batch's ids in the static input buffer
])
def test_a_copy_that_raced_the_next_forward_is_rejected(tmp_path, target, rows, what):
    writer = make_writer(tmp_path)
    capture_two_requests(writer, next_forward_overwrites(target, rows))
    writer.close()
    hit, spared = ("eagle3-a", "eagle3-b") if rows.start < 40 else ("eagle3-b", "eagle3-a")
    prompts = {"eagle3-a": IDS, "eagle3-b": IDS[:25]}
    reader = DumpReader(tmp_path)
    with pytest.raises(DumpCorrupt, match=f"differ from those the server checksummed at capture \\({what}\\)"):
        reader.assemble(hit, prompts[hit])
    reader.assemble(spared, prompts[spared])  # the other request of the forward is intact


def test_a_damaged_file_is_rejected(tmp_path):
    writer = make_writer(tmp_path)
    capture_two_requests(writer)
    writer.close()
    reader = DumpReader(tmp_path)
    path = reader.piece_paths("eagle3-a")[0]
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # one bit of the last pre-norm final-state value (the file's last tensor)
    path.write_bytes(bytes(data))
    with pytest.raises(DumpCorrupt, match=r"\(pre-norm final state\)"):
        reader.assemble("eagle3-a", IDS)


def test_checksum_sees_swapped_rows_and_agrees_across_summation_orders():
    aux, final, prenorm = forward_rows(40, seed=3)
    ids, packed = torch.tensor(IDS), torch.cat(aux, dim=-1)
    base = piece_checksum(ids, packed, final, prenorm, len(LAYERS))
    swapped = packed.clone()
    swapped[[4, 9]] = packed[[9, 4]]
    assert piece_checksum(ids, swapped, final, prenorm, len(LAYERS)) != base
    assert piece_checksum(ids, packed, prenorm, final, len(LAYERS)) != base, "the two final states swapped"
    # integer sums wrap modulo 2**64: any order of summation (a GPU's tree, a CPU's loop) gives the same
    rows = row_checksums(ids, packed, final, prenorm, len(LAYERS))
    weights = torch.arange(1, 41).unsqueeze(1)
    by_hand = [sum(int(v) for v in rows[:, c]) for c in range(rows.shape[1])]
    by_hand += [sum(int(v) * int(w) for v, w in zip(rows[:, c], weights[:, 0])) for c in range(rows.shape[1])]
    wrap = [((v + 2**63) % 2**64) - 2**63 for v in by_hand]
    assert fold_checksums(rows) == wrap == base


def test_a_pieces_checksum_from_the_forwards_running_sums_is_its_own_fold():
    """The writer takes each piece's checksum from two rows of the forward's running sums; it must be
    the fold the reader computes over the piece alone, wrapping included (values near 2**63)."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(-2**62, 2**62, (50, 7), generator=g, dtype=torch.int64) * 3
    prefix = checksum_prefix(rows)
    for start, end in ((0, 50), (0, 1), (13, 14), (7, 41), (49, 50)):
        assert fold_from_prefix(prefix[start].tolist(), prefix[end].tolist(), start) == fold_checksums(rows[start:end])
    assert fold_from_prefix(prefix[7].tolist(), prefix[41].tolist(), 7) != fold_checksums(rows[8:42])


def test_in_flight_bytes_wait_for_room_instead_of_overfilling_the_writer():
    import threading
    import time

    from tasks.retrieval import InFlightLimit

    limit, events = InFlightLimit(max_requests=8, max_bytes=100), []

    def request(name: str, nbytes: int, hold_s: float):
        with limit.hold(nbytes):
            events.append(("start", name))
            time.sleep(hold_s)
            events.append(("end", name))

    first = threading.Thread(target=request, args=("first", 60, 0.3))
    first.start()
    while ("start", "first") not in events:  # the first request holds its place before the others ask
        time.sleep(0.01)
    second = threading.Thread(target=request, args=("second", 60, 0))   # 120 > 100: waits
    huge = threading.Thread(target=request, args=("huge", 10_000, 0))   # larger than the budget: goes alone
    second.start()
    huge.start()
    for t in (first, second, huge):
        t.join(5)
    assert events[:2] == [("start", "first"), ("end", "first")]
    starts = [e for e in events if e[0] == "start"]
    assert len(starts) == 3


def test_a_place_goes_to_the_next_request_when_the_server_answers_but_the_bytes_stay_until_read():
    """The server always has its full number of prompts while earlier dumps are read; the bytes
    of dumps not yet read still hold the next requests back."""
    import threading

    from tasks.retrieval import InFlightLimit

    limit, events = InFlightLimit(max_requests=1, max_bytes=100), []
    sent = {name: threading.Event() for name in ("first", "second", "third", "whole budget")}
    read = {name: threading.Event() for name in ("first", "second")}

    def request(name: str, nbytes: int = 40):
        with limit.hold(nbytes) as place:
            events.append(f"{name} sent")
            sent[name].set()
            place.answered()
            if name in read:  # its dump is being read
                read[name].wait(5)
            events.append(f"{name} read")

    threads = [threading.Thread(target=request, args=("first",), daemon=True)]
    threads[0].start()
    assert sent["first"].wait(5)
    threads.append(threading.Thread(target=request, args=("second",), daemon=True))
    threads[1].start()
    assert sent["second"].wait(5), "one request place, but the first has its answer: the second goes"
    threads.append(threading.Thread(target=request, args=("third",), daemon=True))
    threads[2].start()
    assert not sent["third"].wait(0.3), "3 x 40 bytes > 100: the third waits for a dump to be read"
    assert events == ["first sent", "second sent"]
    read["first"].set()
    assert sent["third"].wait(5)
    threads[2].join(5)
    assert events[2:] == ["first read", "third sent", "third read"]
    read["second"].set()
    threads[1].join(5)
    # every place and byte came back: a request for the whole budget goes at once
    threads.append(threading.Thread(target=request, args=("whole budget", 100), daemon=True))
    threads[3].start()
    assert sent["whole budget"].wait(5)
    for t in threads:
        t.join(5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_readers_fast_path_gives_the_gpus_integers(dtype):
    """The GPU computes row sums with torch; the CPU reader through numpy, block by block, with
    its Inf/NaN test in the same pass: the same integers, and every non-finite value found."""
    from patches.dumps import _SCAN_BLOCK_ROWS, _int_row_sums

    rows = 3 * _SCAN_BLOCK_ROWS + 5  # a partial last block
    aux, _, _ = forward_rows(rows, seed=4, dtype=dtype)
    packed = torch.cat(aux, dim=-1).reshape(rows, len(LAYERS), H)
    view = {2: torch.int16, 4: torch.int32}[packed.element_size()]
    sums, finite = _int_row_sums(packed.view(view), dtype)
    assert torch.equal(sums, packed.view(view).sum(dim=-1, dtype=torch.int64))  # torch: the GPU's path
    assert finite
    for row in (0, _SCAN_BLOCK_ROWS, rows - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            broken = packed.clone()
            broken[row, 1, 3] = bad
            assert not _int_row_sums(broken.view(view), dtype)[1], (row, bad)


def test_in_flight_places_go_to_the_earlier_batch_first():
    """Batches finish one after another (one writes its shard while the next keeps the server busy)."""
    import threading
    import time

    from tasks.retrieval import InFlightLimit

    limit, order = InFlightLimit(max_requests=1, max_bytes=1 << 30), []
    gate = threading.Event()

    def request(batch: int, i: int):
        with limit.hold(1, priority=batch):
            order.append((batch, i))
            gate.wait(5)

    first = threading.Thread(target=request, args=(0, 0))
    first.start()
    while not order:  # batch 0 holds the only place before the others queue
        time.sleep(0.01)
    waiting = [threading.Thread(target=request, args=(b, i)) for b, i in [(2, 0), (1, 0), (2, 1), (1, 1)]]
    for t in waiting:
        t.start()
    while len(limit._waiting) < len(waiting):  # all four queue behind batch 0 before it lets go
        time.sleep(0.01)
    gate.set()
    for t in [first, *waiting]:
        t.join(5)
    assert order == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1)]
