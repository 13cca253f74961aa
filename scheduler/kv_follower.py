"""Following one executor's KV events (SubscribeKvEvents) into the router's PrefixIndex for it.

The stream opens with a snapshot of every cached block, then reports blocks stored and removed as they
happen. Whenever the stream ends (the executor lost or restarted, or this subscriber dropped for falling
behind) what the executor holds is unknown again: the index is cleared, and the subscription is retried
after a pause (the snapshot of the next one fills it again).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from scheduler.router import PrefixIndex

log = logging.getLogger("tandem.scheduler")

RETRY_S = 1.0


async def follow_kv_events(client, index: PrefixIndex, closed: Callable[[], bool], retry_s: float = RETRY_S) -> None:
    """Runs until closed() is true. client: a GrpcExecutorClient (its kv_events())."""
    while not closed():
        call = client.kv_events()
        try:
            async for msg in call:
                if msg.seq == 1:  # a new subscription: its snapshot replaces what was known
                    index.clear()
                for ev in msg.events:
                    which = ev.WhichOneof("event")
                    if which == "stored":
                        index.store(ev.stored.block_hashes)
                    elif which == "removed":
                        index.remove(ev.removed.block_hashes)
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
        index.clear()
        await asyncio.sleep(retry_s)
