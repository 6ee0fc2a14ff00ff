"""One extraction at a time per GPU node: a Prefect global concurrency limit named after the node.

    prefect gcl create eagle3-node:gpu-node --limit 1

A flow run takes one slot of ``eagle3-node:<host>`` for as long as its servers live (``<host>``
as given in ``--node ssh://USER@HOST`` or the node block; this machine's host name for a local
server), so a second run on the same node waits for the first instead of starting a second
server on the same GPU. Without that limit the runs are not limited, and the run log says so.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from prefect import get_client, get_run_logger
from prefect.client.schemas.objects import ConcurrencyLeaseHolder
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run as current_flow_run

LIMIT_PREFIX = "eagle3-node:"
#: Prefect's shortest lease
MIN_LEASE_S = 60.0


def node_limit_name(host: str) -> str:
    return LIMIT_PREFIX + host


@contextmanager
def node_slot(host: str, lease_s: float) -> Iterator[float]:
    """Hold a slot of ``host``'s limit inside the block; yields the seconds spent waiting for it.

    The slot's lease outlives a killed flow run by ``lease_s`` (at least Prefect's minimum of
    60 s): pass the server's own lease, so the node is free again only once that server has
    stopped itself too.
    """
    name = node_limit_name(host)
    log = get_run_logger()
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            limit = None
    if limit is None or not limit.active:
        log.info("runs on %s are not limited: no active global concurrency limit %s "
                 "(`prefect gcl create %s --limit 1` makes them take turns)", host, name, name)
        yield 0.0
        return
    log.info("taking a slot of %s (%d of %d in use)", name, limit.active_slots, limit.limit)
    started = time.monotonic()
    # A Prefect server that cannot be reached for a moment must not kill an extraction of hours:
    # the slot is then lost (Prefect logs it) but the run goes on.
    with concurrency(name, occupy=1, lease_duration=max(MIN_LEASE_S, lease_s), strict=True,
                     holder=ConcurrencyLeaseHolder(type="flow_run", id=current_flow_run.id),
                     raise_on_lease_renewal_failure=False):
        waited = time.monotonic() - started
        log.info("holding a slot of %s (waited %.1f s)", name, waited)
        yield waited
    log.info("released the slot of %s", name)
