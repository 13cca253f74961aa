"""Following one executor's KV events (SubscribeKvEvents) into the router's PrefixIndex for it.

The stream opens with a snapshot of every cached block, then reports blocks stored and removed as they
happen. Whenever the stream ends (the executor lost or restarted, or this subscriber dropped for falling
behind) what the executor holds is unknown again: the index is cleared, and the subscription is retried
after a pause (the snapshot of the next one fills it again).

An executor with KV tiers (--kv-host-gb / --kv-disk-dir) reports each storage on its own (the event's
medium): a block evicted from the pool is removed from "GPU" and stored in "CPU" or "DISK", and a tier may
drop a block the pool holds again. A prompt hits the block wherever it is (CreateCache loads it back from a
tier), so the index holds a hash while any medium does.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, Sequence

import grpc

from scheduler.fleet.router import PrefixIndex

log = logging.getLogger("tandem.scheduler")

RETRY_S = 1.0
POOL = "GPU"  # vLLM's name for the KV pool whatever the device; an older executor sends no medium


class MediumIndex:
    """Which media hold each block, feeding index the hashes that some medium holds."""

    def __init__(self, index: PrefixIndex) -> None:
        self._index = index
        self._media: dict[bytes, set[str]] = {}

    def clear(self) -> None:
        self._media.clear()
        self._index.clear()

    def store(self, hashes: Sequence[bytes], medium: str) -> None:
        for h in hashes:
            self._media.setdefault(h, set()).add(medium or POOL)
        self._index.store(hashes)

    def remove(self, hashes: Sequence[bytes], medium: str) -> None:
        gone: list[bytes] = []
        for h in hashes:
            media = self._media.get(h)
            if media is not None:
                media.discard(medium or POOL)
                if media:
                    continue
                del self._media[h]
            gone.append(h)
        self._index.remove(gone)


async def follow_kv_events(client, index: PrefixIndex, closed: Callable[[], bool], retry_s: float = RETRY_S) -> None:
    """Runs until closed() is true. client: a GrpcExecutorClient (its kv_events())."""
    media = MediumIndex(index)
    while not closed():
        call = client.kv_events()
        try:
            async for msg in call:
                if msg.seq == 1:  # a new subscription: its snapshot replaces what was known
                    media.clear()
                for ev in msg.events:
                    which = ev.WhichOneof("event")
                    if which == "stored":
                        media.store(ev.stored.block_hashes, ev.stored.medium)
                    elif which == "removed":
                        media.remove(ev.removed.block_hashes, ev.removed.medium)
                if closed():
                    break
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("executor %s has no KV events: routing there uses only what this scheduler routed",
                         client.address)
                return
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED:  # they show every session's blocks: admin only
                log.warning("executor %s sends KV events only to an admin token (--executor-token-file has a user "
                            "one): routing there uses only what this scheduler routed", client.address)
                return
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                log.warning("KV events of executor %s: %s; subscribing again", client.address, exc.details())
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            call.cancel()
        media.clear()
        await asyncio.sleep(retry_s)
