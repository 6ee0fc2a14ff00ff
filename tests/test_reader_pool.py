"""Dumps read by reader processes: the shard they write is byte for byte the one the request
threads write, a damaged dump's error crosses the process boundary with its reason, and a
reader that dies costs one retryable attempt, not the run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch
from safetensors import safe_open

from patches.dumps import DumpReader
from patches.safetensors_stream import read_header
from tasks.readers import ReaderPool
from tasks.retrieval import DumpUnusable, ExpectedDump, ReaderDied, StageTimes, into_shard
from tasks.samples import PreparedSample
from tasks.shards import ShardWriter
from tests.dump_support import LAYERS, H, make_writer, submit

#: tokens of each sample, and where its prefill was chunked
SAMPLES = [(23, [(0, 23)]), (41, [(0, 16), (16, 32), (32, 41)]), (9, [(0, 9)]), (30, [(0, 30)])]
DAMAGED = 2  # this sample's dump has one flipped byte in an aux tap


def write_dumps(folder, mode: str) -> tuple[list[PreparedSample], dict[str, tuple]]:
    """The samples, their dumps (rid ``eagle3-<i>-<mode>``) and the states written for each."""
    g = torch.Generator().manual_seed(7)
    writer = make_writer(folder)
    samples, states = [], {}
    for i, (tokens, chunks) in enumerate(SAMPLES):
        ids = torch.randint(0, 1000, (tokens,), generator=g).tolist()
        aux, final, prenorm = (torch.randn(tokens, w, generator=g) for w in (3 * H, H, H))
        rid = f"eagle3-{i}-{mode}"
        for start, end in chunks:
            assert submit(writer, rid, ids, start, end, aux=aux[start:end], final=final[start:end],
                          prenorm=prenorm[start:end])
        mask = [0] * (tokens // 3) + [1] * (tokens - tokens // 3)
        samples.append(PreparedSample(f"key{i:03d}", f"src-{i}", i + 1, ids, mask, False))
        states[rid] = (aux, final, prenorm)
    writer.close()
    reader = DumpReader(folder)
    (piece,) = reader.piece_paths(f"eagle3-{DAMAGED}-{mode}")
    fd = os.open(piece, os.O_RDWR)
    try:
        where = read_header(fd)[1]["aux_hidden_states"].start + 1  # the first row's first tap
        os.pwrite(fd, bytes([os.pread(fd, 1, where)[0] ^ 0x40]), where)
    finally:
        os.close(fd)
    return samples, states


def test_reader_processes_write_the_shard_the_threads_write_and_refuse_a_damaged_dump(tmp_path):
    expected = ExpectedDump(LAYERS, H, "float32", model="tiny")
    shards = {}
    for mode, readers in (("threads", None), ("processes", ReaderPool(2))):
        samples, states = write_dumps(tmp_path / mode, mode)
        reader, times = DumpReader(tmp_path / mode), StageTimes()
        with ShardWriter(tmp_path / f"{mode}.safetensors", samples, torch.float32, H, len(LAYERS)) as shard:
            consume = into_shard(expected, reader, shard, readers)
            for i, sample in enumerate(samples):
                rid = f"eagle3-{i}-{mode}"
                infos = reader.wait(rid, len(sample.input_ids), timeout=10)
                if i == DAMAGED:
                    with pytest.raises(DumpUnusable, match=r"src-2.*differ from those the server checksummed at "
                                                           r"capture \(aux tap 2\)") as caught:
                        consume(sample, rid, infos, times)
                    assert caught.value.sample_key == sample.sample_key and caught.value.retryable
                else:
                    consume(sample, rid, infos, times)
            summary = shard.close()
        if readers is not None:
            readers.close()
        assert summary.sample_keys == ["key000", "key001", "key003"]
        assert times.seconds["read and verify"] > 0 and times.seconds["shard write"] > 0
        with safe_open(str(summary.path), framework="pt") as f:
            offsets = f.get_tensor("offsets").tolist()
            for n, i in enumerate((0, 1, 3)):
                rows = slice(offsets[n], offsets[n + 1])
                aux, final, prenorm = states[f"eagle3-{i}-{mode}"]
                assert f.get_tensor("input_ids")[rows].tolist() == samples[i].input_ids
                assert f.get_tensor("loss_mask")[rows].tolist() == samples[i].loss_mask
                assert torch.equal(f.get_tensor("aux_hidden_states")[rows], aux)
                assert torch.equal(f.get_tensor("final_hidden_states")[rows], final)
                assert torch.equal(f.get_tensor("prenorm_hidden_states")[rows], prenorm)
        shards[mode] = (tmp_path / f"{mode}.safetensors").read_bytes()
    assert shards["threads"] == shards["processes"]


def test_a_reader_killed_for_memory_fails_its_sample_retryably_and_is_replaced(tmp_path):
    samples, _ = write_dumps(tmp_path / "dumps", "kill")
    reader = DumpReader(tmp_path / "dumps")
    expected = ExpectedDump(LAYERS, H, "float32", model="tiny")
    with ReaderPool(1) as readers:
        readers.warm_up()
        (pid,) = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "tasks.readers"], capture_output=True,
                                text=True).stdout.split()
        os.kill(int(pid), signal.SIGKILL)  # what the kernel's OOM killer does
        read = into_shard(expected, reader, None, readers)
        rid = "eagle3-0-kill"
        infos = reader.wait(rid, len(samples[0].input_ids), timeout=10)
        failed: list[BaseException] = []

        def a_batch_thread() -> None:  # an extraction thread; it ends with its batch
            with pytest.raises(ReaderDied) as caught:
                read(samples[0], rid, infos, StageTimes())
            failed.append(caught.value)

        thread = threading.Thread(target=a_batch_thread)
        thread.start()
        thread.join()
        (died,) = failed
        assert died.retryable and re.search(rf"src-0.*reader process {pid} ended \(exit code -9\) while reading "
                                            rf"rid {rid}", str(died)), died
        time.sleep(0.5)  # the replacement must outlive the thread that happened to start it
        read(samples[0], rid, infos, StageTimes())
