"""Per-request slicing of a flat extend batch: the one place that maps batch rows to requests.

A server's prefill (EXTEND) forward runs the new tokens of several requests as one
flat sequence of rows, in request order: request i owns ``extend_seq_lens[i]`` rows,
and its first row is token ``extend_prefix_lens[i]`` of its prompt (the tokens before
it were cached: an earlier chunk, or a prefix-cache hit). Rows after the last request
are padding (a CUDA-graph bucket, or data-parallel padding) and belong to nobody.
Under mixed chunking a decoding request rides along as a one-row extend; it is not
a prefill and is marked so.

Used by the local server and by the SGLang hook, so both slice the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class RequestRows:
    rid: str
    row_start: int      # first row of the request in the flat batch
    row_end: int        # one past its last row
    chunk_start: int    # position of its first row in the request's prompt
    is_prefill: bool    # False for a decode row riding in an extend batch

    @property
    def n(self) -> int:
        return self.row_end - self.row_start


class BatchLayoutError(ValueError):
    """The batch description does not add up (lengths, counts, rows)."""


def slice_extend_batch(
    rids: Sequence[str],
    extend_seq_lens: Sequence[int],
    extend_prefix_lens: Sequence[int],
    num_rows: int,
    is_prefill: Sequence[bool] | None = None,
) -> list[RequestRows]:
    """Return each request's rows; raise BatchLayoutError when the layout is inconsistent."""
    n_req = len(rids)
    if len(extend_seq_lens) != n_req or len(extend_prefix_lens) != n_req:
        raise BatchLayoutError(f"{n_req} rids but {len(extend_seq_lens)} extend lengths "
                               f"and {len(extend_prefix_lens)} prefix lengths")
    if is_prefill is not None and len(is_prefill) != n_req:
        raise BatchLayoutError(f"{n_req} rids but {len(is_prefill)} prefill flags")
    out, row = [], 0
    for i, rid in enumerate(rids):
        n, prefix = int(extend_seq_lens[i]), int(extend_prefix_lens[i])
        if n < 0 or prefix < 0:
            raise BatchLayoutError(f"request {rid!r}: negative extend length {n} or prefix {prefix}")
        out.append(RequestRows(rid, row, row + n, prefix, True if is_prefill is None else bool(is_prefill[i])))
        row += n
    if row > num_rows:
        raise BatchLayoutError(f"requests need {row} rows but the batch has {num_rows}")
    return out
