"""What a patched server's first phase pays for pinned memory: first use against the allocator's cache.

    python -m bench.pinned_first_use [--tokens 4096] [--hidden 4096] [--forwards 24]   (a CUDA GPU)

The capture's transfer (:class:`patches.capture.SideStreamTransfer`) takes each forward's host
buffers from torch's caching host allocator on the scheduler's thread. Memory it has never
pinned costs a ``cudaHostAlloc`` there; a freed block is kept and handed out again. So a server's
first phase pays for the pinned pool it grows to, once per start, and later phases do not. This
times a phase's worth of forwards' host copies (each the forward's rows of three aux taps, the
final and the pre-norm state in bf16), three times over the same allocator. H100 80 GB,
2026-12-07: 24 forwards of 4096 tokens (168 MB each), 2.350 s on first use, 0.073 s from the cache.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="rows a forward (the chunked-prefill size)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--forwards", type=int, default=24, help="forwards' buffers held at once")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.pinned_first_use needs a CUDA GPU")
    rows = torch.empty(args.tokens, 5 * args.hidden, dtype=torch.bfloat16, device="cuda")
    megabytes = rows.numel() * rows.element_size() / 1e6
    print("| pass | forwards x MB | seconds |\n|---|---|---|")
    for label in ("first use", "from the cache", "from the cache"):
        start = time.perf_counter()
        held = []
        for _ in range(args.forwards):
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            host.copy_(rows, non_blocking=True)
            held.append(host)
        torch.cuda.synchronize()
        print(f"| {label} | {args.forwards} x {megabytes:.0f} | {time.perf_counter() - start:.3f} |")
        del held


if __name__ == "__main__":
    main()
