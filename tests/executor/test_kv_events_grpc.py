"""SubscribeKvEvents limits on a real executor started with --max-kv-subscribers 1 --kv-events-buffer 2: a
second stream is refused RESOURCE_EXHAUSTED, and a subscriber that does not read while many events happen is
dropped with RESOURCE_EXHAUSTED while the model calls meanwhile complete; its slot is then free again."""
from __future__ import annotations

import random
import time

import grpc
import pytest

from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_for
from tests.kv_event_reader import KvEventReader

KV_BLOCKS = 64


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.fixture(scope="module")
def server(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS), "--max-kv-subscribers", "1",
                     "--kv-events-buffer", "2")


def subscribe_when_free(stub, timeout_s: float = 10.0) -> tuple[KvEventReader, pb.SubscribeKvEventsResponse]:
    """A subscription and its first message, once the server has let the previous one go."""
    end = time.monotonic() + timeout_s
    while True:
        reader = KvEventReader(stub, summary_interval_ms=60_000)
        try:
            return reader, reader.next()
        except grpc.RpcError as exc:
            reader.close()
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > end:
                raise
            time.sleep(0.05)  # poll interval while the server closes the old stream


def test_slow_subscriber_is_dropped_and_never_slows_the_model(stub):
    slow = stub.SubscribeKvEvents(pb.SubscribeKvEventsRequest(summary_interval_ms=60_000), timeout=60)
    first = next(slow)  # subscribed (the summary after an empty snapshot); from here on it reads nothing
    assert first.HasField("summary") and not first.snapshot

    # One subscriber at most (--max-kv-subscribers 1).
    extra = KvEventReader(stub)
    try:
        with pytest.raises(grpc.RpcError) as err:
            extra.next()
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-kv-subscribers" in err.value.details()
    finally:
        extra.close()

    # Each call stores 8 prompts' blocks (8 events at once) and, once the pool is full, evicts: far more
    # than the 2 events the subscriber may leave unread. Every call completes.
    for call in range(6):
        items = [pb.UnifiedItem(token_ids=prompt_of(20, seed=100 * call + i), is_final_chunk=True) for i in range(8)]
        resp = stub.UnifiedDecode(pb.UnifiedDecodeRequest(items=items))
        assert all(r.status.code == 0 for r in resp.results)
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[r.cache.cache_id for r in resp.results]))
    assert stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache.stored_blocks >= 48

    with pytest.raises(grpc.RpcError) as err:
        for _ in slow:  # what was sent before the drop, then the stream's end
            pass
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "fell more than 2 events behind" in err.value.details() and "subscribe again" in err.value.details()

    # Its slot is free again: a new subscriber starts with a snapshot of every indexed block.
    reader, first = subscribe_when_free(stub)
    try:
        messages = [first] + (reader.until(lambda m: not m.snapshot, what="the snapshot's end") if first.snapshot
                              else [])
        snapshot = [h for m in messages if m.snapshot for e in m.events for h in e.stored.block_hashes]
        assert len(set(snapshot)) == len(snapshot) == stub.GetMetrics(pb.GetMetricsRequest()).prefix_cache.indexed_blocks > 0
    finally:
        reader.close()
