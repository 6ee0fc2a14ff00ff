"""Property tests of the batch -> request row mapping shared by the local server and the SGLang hook."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patches.batch_slicing import BatchLayoutError, slice_extend_batch

# One request of an extend batch: (new rows, cached prefix, decode row riding along?)
request_st = st.one_of(
    st.tuples(st.integers(0, 40), st.integers(0, 5000), st.just(False)),   # a prefill chunk (0 rows: empty slot)
    st.tuples(st.just(1), st.integers(1, 5000), st.just(True)),            # a decode step inside a MIXED batch
)
layout_st = st.tuples(st.lists(request_st, max_size=12), st.integers(0, 64))  # requests, padding rows


@settings(max_examples=300, deadline=None)
@given(layout_st)
def test_rows_partition_the_batch_and_no_request_gets_anothers_rows(layout):
    reqs, padding = layout
    rids = [f"eagle3-{i}" for i in range(len(reqs))]
    lens = [n for n, _, _ in reqs]
    prefixes = [p for _, p, _ in reqs]
    num_rows = sum(lens) + padding
    # Row r of the flat batch is "token position q of request i": what the forward computed for it.
    owner = [(i, prefixes[i] + k) for i, n in enumerate(lens) for k in range(n)] + [None] * padding
    out = slice_extend_batch(rids, lens, prefixes, num_rows, [not d for _, _, d in reqs])

    assert [r.rid for r in out] == rids
    cursor = 0
    for i, r in enumerate(out):
        assert r.row_start == cursor and r.n == lens[i] and r.chunk_start == prefixes[i]
        assert r.is_prefill == (not reqs[i][2])
        assert owner[r.row_start:r.row_end] == [(i, r.chunk_start + k) for k in range(r.n)]
        cursor = r.row_end
    assert all(o is None for o in owner[cursor:]), "padding rows must belong to nobody"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=6), st.integers(1, 50))
def test_a_chunked_prefill_is_covered_once_in_order(prompt_lens, budget):
    """Chunks of a per-batch token budget, as a chunked-prefill scheduler makes them, cover each prompt once."""
    done = [0] * len(prompt_lens)
    covered: dict[int, list[int]] = {i: [] for i in range(len(prompt_lens))}
    while any(d < n for d, n in zip(done, prompt_lens)):
        left, batch = budget, []
        for i, n in enumerate(prompt_lens):
            if done[i] < n and left > 0:
                take = min(n - done[i], left)
                batch.append((i, take, done[i]))
                left -= take
        out = slice_extend_batch([f"r{i}" for i, _, _ in batch], [t for _, t, _ in batch],
                                 [p for _, _, p in batch], sum(t for _, t, _ in batch))
        for (i, take, prefix), rows in zip(batch, out):
            covered[i].extend(range(rows.chunk_start, rows.chunk_start + rows.n))
            done[i] += take
    assert all(covered[i] == list(range(n)) for i, n in enumerate(prompt_lens))


@pytest.mark.parametrize("lens, prefixes, rows, flags", [
    ([3, 4], [0, 0], 6, None),     # fewer rows than the requests need
    ([3], [0, 0], 10, None),       # lengths disagree with rids
    ([3, -1], [0, 0], 10, None),   # negative length
    ([3, 1], [0, 0], 10, [True]),  # prefill flags disagree with rids
])
def test_inconsistent_layouts_are_refused(lens, prefixes, rows, flags):
    with pytest.raises(BatchLayoutError):
        slice_extend_batch(["a", "b"], lens, prefixes, rows, flags)
