"""The local SGLang-compatible server: real forwards, real dumps, SGLang's awkward behaviours."""

from __future__ import annotations

import random
import subprocess
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from infra.local_server import PrefixCache, Request, plan_step
from patches.dumps import DumpIncomplete, DumpReader, DumpWriteFailed, default_aux_layer_ids
from tests.ground_truth import final_norm_input, load_reference_model, reference_hidden_states
from tests.waiting import wait_for

CONTEXT_LENGTH = 512
TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_reference_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def careless(start_local_server, tiny_model_dir):
    """Radix cache on, small chunks, decode rows mixed into prefill steps, a hook that dumps every forward."""
    server = start_local_server(tiny_model_dir, "--chunked-prefill-size", "16", "--enable-mixed-chunk",
                                "--dump-every-forward", "--context-length", str(CONTEXT_LENGTH))
    yield server
    assert server.stop() == 0, server.log_tail()


@pytest.fixture(scope="module")
def careful(start_local_server, tiny_model_dir):
    """Radix cache off, prefix-filtered dumps, an API key."""
    server = start_local_server(tiny_model_dir, "--chunked-prefill-size", "32", "--disable-radix-cache",
                                api_key="sesame")
    yield server
    assert server.stop() == 0, server.log_tail()


def random_ids(rng: random.Random, n: int) -> list[int]:
    # Ids >= 4 keep clear of the special tokens, so no prompt shares the health check's [0].
    return [rng.randrange(4, 1024) for _ in range(n)]


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def server_instance(server) -> str:
    instance = requests.get(server.url + "/server_info", headers=server.headers(), timeout=10).json()["dump_instance"]
    assert len(instance) == 32
    return instance


def assert_dump_matches_model(server, model, rid: str, ids: list[int], instance: str | None = None) -> int:
    """The rid's assembled dump, written by this server launch, equals a direct forward; returns how
    many prefill pieces it had."""
    reader = DumpReader(server.dump_dir, instance=instance or server_instance(server))
    infos = reader.wait(rid, len(ids), timeout=30)
    dump = reader.assemble(rid, ids, infos)
    aux, final = reference_hidden_states(model, ids, dump.layer_ids)
    assert (dump.aux_hidden_states - aux).abs().max() <= TOL, rid
    assert (dump.final_hidden_states - final).abs().max() <= TOL, rid
    assert (dump.prenorm_hidden_states - final_norm_input(model, ids)).abs().max() <= TOL, rid
    return sum(1 for p in infos if p.forward_mode == "extend")


# --------------------------------------------------------------------------- the main property


def test_concurrent_chunked_dumps_equal_direct_forward(careless, model):
    rng = random.Random(1)
    prompts = [(f"eagle3-conc-{i}-{uuid.uuid4().hex[:6]}", random_ids(rng, rng.randint(20, 120)), i % 3 * 2)
               for i in range(12)]
    stop = threading.Event()
    health_codes: list[int] = []

    def poke_health():
        while not stop.is_set():
            for path in ("/health", "/health_generate"):
                health_codes.append(requests.get(careless.url + path, timeout=30).status_code)

    poker = threading.Thread(target=poke_health)
    poker.start()
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: careless.generate(
                rid=p[0], input_ids=p[1], extra_key=uuid.uuid4().hex,
                sampling_params={"max_new_tokens": p[2], "ignore_eos": True}), prompts))
    finally:
        stop.set()
        poker.join()
    assert set(health_codes) == {200}
    assert careless_peak_running(careless) >= 8
    for (rid, ids, max_new), answer in zip(prompts, answers):
        assert answer.status_code == 200, answer.text
        meta = answer.json()["meta_info"]
        assert meta["id"] == rid and meta["prompt_tokens"] == len(ids) and meta["cached_tokens"] == 0
        assert answer.json()["output_ids"] == greedy_reference(model, ids, max_new)
        assert assert_dump_matches_model(careless, model, rid, ids) >= 2  # 20+ tokens in 16-token steps
    # The careless hook also dumped the warmup, the health checks and decode steps.
    names = [p.name for p in careless.dump_dir.iterdir()]
    assert any(n.startswith("HEALTH_CHECK_") for n in names)
    assert any(not n.startswith(("HEALTH_CHECK_", "eagle3-")) for n in names)  # the warmup's uuid rid
    decode = [p for p in DumpReader(careless.dump_dir).pieces(prompts[1][0]) if p.forward_mode == "decode"]
    assert [p.chunk_start for p in decode] == [len(prompts[1][1])]  # 2 new tokens: one decode step


def careless_peak_running(server) -> int:
    return requests.get(server.url + "/server_info", timeout=10).json()["scheduler"]["peak_running"]


# --------------------------------------------------------------------------- prefix cache


def test_repeat_hits_the_prefix_cache_and_its_dump_is_incomplete(careless, model):
    ids = random_ids(random.Random(2), 40)
    first = careless.generate(rid="eagle3-rep-1", input_ids=ids, sampling_params={"max_new_tokens": 1})
    again = careless.generate(rid="eagle3-rep-2", input_ids=ids, sampling_params={"max_new_tokens": 1})
    assert first.json()["meta_info"]["cached_tokens"] == 0
    assert again.json()["meta_info"]["cached_tokens"] == len(ids) - 1
    assert again.json()["output_ids"] == first.json()["output_ids"]
    assert_dump_matches_model(careless, model, "eagle3-rep-1", ids)
    reader = DumpReader(careless.dump_dir)
    with pytest.raises(DumpIncomplete, match="prefix-cache"):
        reader.assemble("eagle3-rep-2", ids, reader.wait("eagle3-rep-2", len(ids), timeout=30))

    shared = ids[:30] + [ids[30] % 1000 + 5] + random_ids(random.Random(3), 9)
    branch = careless.generate(rid="eagle3-rep-3", input_ids=shared, sampling_params={"max_new_tokens": 0})
    assert branch.json()["meta_info"]["cached_tokens"] == 30
    pieces = reader.wait("eagle3-rep-3", len(shared), timeout=30)
    assert min(p.chunk_start for p in pieces) == 30

    unique = careless.generate(rid="eagle3-rep-4", input_ids=ids, extra_key=uuid.uuid4().hex,
                               sampling_params={"max_new_tokens": 1})
    assert unique.json()["meta_info"]["cached_tokens"] == 0
    assert_dump_matches_model(careless, model, "eagle3-rep-4", ids)


def test_flush_cache_refused_while_busy_then_defeats_reuse(careless):
    ids = random_ids(random.Random(4), 20)
    assert careless.generate(rid="eagle3-flush-1", input_ids=ids, sampling_params={"max_new_tokens": 0}).ok
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(careless.generate, rid="eagle3-flush-long", input_ids=random_ids(random.Random(5), 20),
                           sampling_params={"max_new_tokens": 150, "ignore_eos": True})
        wait_until_running(careless)
        busy = requests.post(careless.url + "/flush_cache", timeout=10)
        dup = careless.generate(rid="eagle3-flush-long", input_ids=ids, sampling_params={"max_new_tokens": 1})
        assert long.result().status_code == 200
    assert busy.status_code == 400 and "pending requests" in busy.text
    assert dup.status_code == 400 and "Duplicate request ID detected" in dup.text
    # The rid is free again once its request has finished (SGLang allows reuse).
    assert careless.generate(rid="eagle3-flush-long", input_ids=ids, extra_key="k",
                             sampling_params={"max_new_tokens": 0}).status_code == 200
    assert requests.post(careless.url + "/flush_cache", timeout=10).status_code == 200
    again = careless.generate(rid="eagle3-flush-2", input_ids=ids, sampling_params={"max_new_tokens": 0})
    assert again.json()["meta_info"]["cached_tokens"] == 0


def wait_until_running(server, timeout: float = 10) -> None:
    wait_for(lambda: requests.get(server.url + "/server_info", timeout=10).json()["scheduler"]["running"], timeout,
             lambda: "the long request never started", poll_s=0.01)


def test_disabled_radix_cache_dumps_repeats_whole_and_only_prefixed_rids(careful, model):
    ids = random_ids(random.Random(6), 70)
    for rid in ("eagle3-norad-1", "eagle3-norad-2"):
        answer = careful.generate(rid=rid, input_ids=ids, sampling_params={"max_new_tokens": 2})
        assert answer.json()["meta_info"]["cached_tokens"] == 0
        assert assert_dump_matches_model(careful, model, rid, ids) == 3  # 70 tokens in 32-token steps
    assert careful.generate(rid="other-1", input_ids=ids, sampling_params={"max_new_tokens": 1}).ok
    requests.get(careful.url + "/health_generate", timeout=30)
    names = [p.name for p in careful.dump_dir.iterdir()]
    assert names and all(n.startswith("eagle3-norad-") for n in names)  # no warmup, health or decode pieces


# --------------------------------------------------------------------------- requests and answers


def test_max_new_tokens_zero_one_four(careless, model):
    ids = random_ids(random.Random(7), 25)
    for n in (0, 1, 4):
        answer = careless.generate(input_ids=ids, extra_key=uuid.uuid4().hex,
                                   sampling_params={"max_new_tokens": n, "ignore_eos": True})
        body = answer.json()
        assert body["output_ids"] == greedy_reference(model, ids, n)
        assert body["meta_info"]["completion_tokens"] == n
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": n}
        assert len(body["meta_info"]["id"]) == 32  # a uuid hex rid, as SGLang makes one


def test_text_prompts_are_tokenized_with_the_models_tokenizer(careless, tiny_model_dir):
    from transformers import AutoTokenizer

    answer = careless.generate(text="The quick brown fox", sampling_params={"max_new_tokens": 1})
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert answer.json()["meta_info"]["prompt_tokens"] == len(tokenizer("The quick brown fox").input_ids)


@pytest.mark.parametrize("body, message", [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "JSON object"),
    (b"{}", "Either text or input_ids"),
    (b'{"text": "hi", "input_ids": [5]}', "not both"),
    (b'{"input_ids": []}', "non-empty list of integers"),
    (b'{"input_ids": [5, "a"]}', "non-empty list of integers"),
    (b'{"input_ids": [5, 1.5]}', "non-empty list of integers"),
    (b'{"input_ids": [5, 1024]}', "outside the vocabulary"),
    (b'{"input_ids": [-1]}', "outside the vocabulary"),
    (b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": -1}}', "non-negative"),
    (b'{"input_ids": [%s]}' % b", ".join([b"5"] * CONTEXT_LENGTH), "context length"),
    (b'{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": %d}}' % CONTEXT_LENGTH, "context length"),
    (b'{"input_ids": [5, 6], "rid": 7}', "rid must be"),
])
def test_bad_request_gets_400_and_the_server_goes_on(careless, body, message):
    answer = requests.post(careless.url + "/generate", data=body, timeout=10)
    assert answer.status_code == 400 and message in answer.json()["error"]["message"]
    assert careless.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 1}).status_code == 200


def test_api_key_guards_everything_but_health(careful):
    assert requests.get(careful.url + "/health", timeout=30).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert requests.post(careful.url + "/generate", json={"input_ids": [5]}, headers=headers,
                             timeout=10).status_code == 401
        assert requests.get(careful.url + "/model_info", headers=headers, timeout=10).status_code == 401
    info = requests.get(careful.url + "/get_model_info", headers=careful.headers(), timeout=10).json()
    assert info["is_generation"] and info["num_hidden_layers"] == 8
    server_info = requests.get(careful.url + "/server_info", headers=careful.headers(), timeout=10).json()
    assert server_info["api_key"] == "***" and server_info["dump_aux_layer_ids"] == default_aux_layer_ids(8)
    # the key came in the environment: no command line on this machine holds it, nor the server's log
    assert "sesame" not in subprocess.run(["ps", "-eww", "-o", "args"], capture_output=True, text=True).stdout
    assert "sesame" not in careful.log_path.read_text()


# --------------------------------------------------------------------------- failures and shutdown


def test_full_dump_folder_leaves_a_marker_and_the_server_answers(start_local_server, tiny_model_dir, model):
    # A 10-token piece is ~11 kB (aux 10x192 + final 10x64 float32); a 30-token one does not fit after it.
    server = start_local_server(tiny_model_dir, "--dump-max-bytes", "20000", "--skip-server-warmup")
    try:
        small = random_ids(random.Random(8), 10)
        assert server.generate(rid="eagle3-cap-small", input_ids=small, sampling_params={"max_new_tokens": 0}).ok
        assert_dump_matches_model(server, model, "eagle3-cap-small", small)
        big = random_ids(random.Random(9), 30)
        assert server.generate(rid="eagle3-cap-big", input_ids=big, sampling_params={"max_new_tokens": 0}).ok
        with pytest.raises(DumpWriteFailed, match="cap of 20000"):
            DumpReader(server.dump_dir).wait("eagle3-cap-big", len(big), timeout=30)
        assert server.generate(input_ids=big, sampling_params={"max_new_tokens": 1}).status_code == 200
        stats = requests.get(server.url + "/server_info", timeout=10).json()["dump_writer"]
        assert stats["refused"] == 1 and "eagle3-cap-big" in stats["last_error"]
    finally:
        assert server.stop() == 0, server.log_tail()


def test_a_piece_over_the_writers_budget_leaves_a_marker_and_the_server_answers(start_local_server, tiny_model_dir):
    # A 10-token piece is ~11 kB: over a 5000-byte budget of queued bytes.
    server = start_local_server(tiny_model_dir, "--dump-max-pending-bytes", "5000", "--skip-server-warmup")
    try:
        ids = random_ids(random.Random(11), 10)
        assert server.generate(rid="eagle3-budget", input_ids=ids, sampling_params={"max_new_tokens": 0}).ok
        with pytest.raises(DumpWriteFailed, match="over its budget of 5000 bytes"):
            DumpReader(server.dump_dir).wait("eagle3-budget", len(ids), timeout=30)
        stats = requests.get(server.url + "/server_info", timeout=10).json()["dump_writer"]
        assert stats["max_pending_bytes"] == 5000 and stats["refused"] == 1
    finally:
        assert server.stop() == 0, server.log_tail()


def test_sigterm_answers_in_flight_requests_and_drains_the_writer(start_local_server, tiny_model_dir, model):
    server = start_local_server(tiny_model_dir, "--chunked-prefill-size", "8", "--skip-server-warmup")
    rng = random.Random(10)
    prompts = [(f"eagle3-term-{i}", random_ids(rng, 48)) for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(server.generate, rid=rid, input_ids=ids,
                               sampling_params={"max_new_tokens": 6, "ignore_eos": True}) for rid, ids in prompts]
        wait_until_running(server)
        instance = server_instance(server)
        assert server.stop() == 0, server.log_tail()
        answers = [f.result() for f in futures]
    assert {a.status_code for a in answers} <= {200, 503}
    for (rid, ids), answer in zip(prompts, answers):
        if answer.status_code == 200:  # answered: its dump was drained to disk before the exit
            assert_dump_matches_model(server, model, rid, ids, instance)
    assert "server ready on http://127.0.0.1:" in server.log_path.read_text()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_server_dumps_match_the_cpu_reference(start_local_server, tiny_model_dir, model, dtype):
    server = start_local_server(tiny_model_dir, "--device", "cuda", "--dtype", dtype, "--chunked-prefill-size", "16")
    try:
        rng = random.Random(11)
        prompts = [(f"eagle3-cuda-{dtype}-{i}", random_ids(rng, rng.randint(20, 120))) for i in range(8)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: server.generate(rid=p[0], input_ids=p[1], extra_key=p[0],
                                                              sampling_params={"max_new_tokens": 2}), prompts))
        reader = DumpReader(server.dump_dir)
        for (rid, ids), answer in zip(prompts, answers):
            assert answer.status_code == 200, answer.text
            dump = reader.assemble(rid, ids, reader.wait(rid, len(ids), timeout=30))
            assert dump.dtype == dtype
            aux, final = reference_hidden_states(model, ids, dump.layer_ids)
            for got, want in ((dump.aux_hidden_states.float(), aux), (dump.final_hidden_states.float(), final),
                              (dump.prenorm_hidden_states.float(), final_norm_input(model, ids))):
                if dtype == "float32":
                    assert (got - want).abs().max() <= TOL, rid
                else:  # bfloat16 keeps ~3 significant digits; rounding compounds over 8 layers
                    assert (got - want).norm() / want.norm() < 0.03, rid
    finally:
        assert server.stop() == 0, server.log_tail()


# --------------------------------------------------------------------------- scheduling, without a server


def test_step_plan_shares_the_prefill_budget_in_request_order():
    def req(prompt_len, computed, rid):
        r = Request(rid=rid, input_ids=list(range(prompt_len)), max_new_tokens=4)
        r.computed = computed
        return r

    a, b, c, d = req(10, 0, "a"), req(30, 5, "b"), req(4, 4, "c"), req(7, 0, "d")  # c decodes
    assert [(r.rid, n) for r, n in plan_step([a, b, c, d], 16, mixed=False)] == [("a", 10), ("b", 6)]
    assert [(r.rid, n) for r, n in plan_step([a, b, c, d], 16, mixed=True)] == [("a", 10), ("b", 6), ("c", 1)]
    assert [(r.rid, n) for r, n in plan_step([a, b, c, d], None, mixed=False)] == [("a", 10), ("b", 25), ("d", 7)]
    assert [(r.rid, n) for r, n in plan_step([c], 16, mixed=False)] == [("c", 1)]


def test_prefix_cache_reuses_the_longest_prefix_within_a_namespace(model):
    ids = list(range(5, 25))
    with torch.no_grad():
        kv = model(torch.tensor([ids]), use_cache=True).past_key_values
    cache = PrefixCache()
    cache.insert("", ids, kv)
    n, hit = cache.match("", ids, limit=len(ids) - 1)
    assert n == 19 and hit.get_seq_length() == 19 and kv.get_seq_length() == 20
    assert cache.match("", ids[:8] + [1000], limit=8)[0] == 8
    assert cache.match("other-key", ids, limit=19) == (0, None)


def test_a_server_already_on_the_port_is_refused_not_used(start_local_server, tiny_model_dir, tmp_path):
    """Another server (same API, its own dump folder and launch) holds the port: nothing is started
    or sent there. If the port is taken between that check and the bind, the identity check after
    /health sees the other launch's nonce and refuses it."""
    import dataclasses
    from urllib.parse import urlsplit

    from infra.hosts import HostError
    from infra.server import ForeignServer, ServerConfig, check_identity, start_server

    other = start_local_server(tiny_model_dir, "--skip-server-warmup")
    try:
        port = urlsplit(other.url).port
        config = ServerConfig(model_path=tiny_model_dir, dump_dir=tmp_path / "dumps", rid_prefix="eagle3-", port=port)
        with pytest.raises(HostError, match=f"port {port} on 127.0.0.1 is already in use"):
            start_server(config, tmp_path / "server.log", ready_timeout_s=60)

        ours = start_server(dataclasses.replace(config, port=0), tmp_path / "ours.log", ready_timeout_s=120)
        try:
            check_identity(ours)  # our own launch passes
            with pytest.raises(ForeignServer, match=f"reports dump instance '{server_instance(other)}'"):
                check_identity(dataclasses.replace(ours, url=other.url, port=port))
        finally:
            assert ours.stop() == 0
        assert requests.get(other.url + "/server_info", timeout=10).json()["dump_writer"]["written"] == 0
    finally:
        other.stop()
