"""KV events on ZMQ in vLLM's format from a real executor process (--kv-events-endpoint, with a replay ROUTER),
read by ZMQ subscribers whose decoder is vLLM v0.28.0's definitions (tests/vllm_kv_event_defs.py): every
batch decodes; sequence numbers go up by one; BlockStored carries the prompt's blocks' token ids and hashes
chained from their parents (and the gRPC stream carries the same token ids); eviction sends BlockRemoved; the
replay socket gives a late subscriber everything from sequence 0 (an AllBlocksCleared first); a subscriber
that never reads does not slow the model, ZMQ drops for it and replay recovers what it lost. Startup refuses
an off-loopback endpoint without --insecure and a malformed one, each with exit code 2 and a message naming
the flag. The publisher itself: a full queue drops (counted) and marks the spot with AllBlocksCleared, and
close() leaves no thread or socket behind."""
from __future__ import annotations

import random
import re
import threading
import urllib.request

import pytest
import zmq

from executor_service.kv.events.hub import BlocksRemoved, BlocksStored
from executor_service.kv.events.vllm_wire import hash_to_int
from executor_service.kv.events.zmq_publisher import ZmqKvPublisher
from tandem import server_process
from tandem.block_hash import chain_hashes, root_hash
from tandem.executor.v1 import executor_pb2 as pb
from tests.ports import free_port
from tests.grpc_harness import start_for
from tests.kv_event_reader import KvEventReader, stored
from tests.vllm_kv_event_defs import (AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, removed_hashes,
                                      replay, stored_events)

KV_BLOCKS = 48
BS = 16




def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.term()


@pytest.fixture(scope="module")
def server(request, model_dir):
    pub, rep = free_port(), free_port()
    s = start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS), "--kv-events-endpoint", f"tcp://*:{pub}",
                  "--kv-events-replay-endpoint", f"tcp://*:{rep}", "--metrics-port", "0")
    s.pub, s.rep = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}"
    return s


def run(stub, prompts: list[list[int]]) -> None:
    """Prefills each prompt in one call (its full blocks are stored), then releases the caches."""
    resp = stub.UnifiedDecode(pb.UnifiedDecodeRequest(
        items=[pb.UnifiedItem(token_ids=p, is_final_chunk=True) for p in prompts]), timeout=60)
    assert all(r.status.code == 0 for r in resp.results), resp
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[r.cache.cache_id for r in resp.results]))


_joins = iter(range(10_000, 1_000_000))


def joined(sub: Subscriber, stub) -> int:
    """ZMQ delivers to a SUB only once its subscription reached the PUB: store one-block prompts until a batch
    arrives (bounded), drain, and return the last sequence number seen."""
    for _ in range(100):
        run(stub, [prompt_of(BS + 1, next(_joins))])
        got = sub.drain()
        if got:
            return got[-1][1]
    raise AssertionError("the subscriber never received a batch")


def metrics(server) -> str:
    url = re.search(r"metrics on (http://\S+/metrics)", server.stderr()).group(1)
    return urllib.request.urlopen(url, timeout=10).read().decode()


def counter(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}(?:_total)? (\S+)$", text, re.M).group(1))


def test_prompt_blocks_arrive_with_token_ids_in_sequence(server, ctx):
    sub = Subscriber(ctx, server.pub)
    reader = KvEventReader(server.stub, summary_interval_ms=60_000)
    try:
        last = joined(sub, server.stub)
        prompt = prompt_of(3 * BS + 5, seed=1)
        run(server.stub, [prompt])
        batches = sub.until(lambda b: any(isinstance(e, BlockStored) and len(e.token_ids) == 3 * BS
                                          for e in b.events))
        assert [seq for _, seq, _ in batches] == list(range(last + 1, last + 1 + len(batches)))
        assert {t for t, _, _ in batches} == {""}  # vLLM's default topic: vllm-router matches it exactly
        ev = stored_events(batches)[-1]
        expect = [hash_to_int(h) for h in chain_hashes(root_hash(), prompt, BS)]
        assert ev.token_ids == prompt[:3 * BS] and ev.block_hashes == expect
        assert ev.parent_block_hash is None and ev.block_size == BS
        assert (ev.lora_id, ev.lora_name, ev.medium, ev.group_idx) == (None, None, "GPU", 0)
        assert (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window) == ("full_attention", None)
        assert all(b.data_parallel_rank == 0 and b.ts > 0 for _, _, b in batches)

        # A longer prompt with the same start: only its new block, chained from the last one above.
        run(server.stub, [prompt[:3 * BS] + prompt_of(BS + 1, seed=2)])
        (more,) = stored_events(sub.until(lambda b: bool(stored_events([("", 0, b)]))))
        assert more.parent_block_hash == expect[-1] and len(more.block_hashes) == 1 and len(more.token_ids) == BS

        # The gRPC stream carries the same token ids (BlocksStored.token_ids).
        grpc_stored = stored(reader.until(lambda m: any(len(s.token_ids) == 3 * BS for s in stored([m]))))
        assert list(grpc_stored[-1].token_ids) == prompt[:3 * BS]
    finally:
        reader.close()
        sub.close()


def test_eviction_sends_block_removed_and_replay_returns_everything(server, ctx):
    sub = Subscriber(ctx, server.pub)
    try:
        joined(sub, server.stub)
        for call in range(4):  # 4 x 8 prompts x 2 blocks: more than the pool holds, so cached blocks are evicted
            run(server.stub, [prompt_of(2 * BS + 1, seed=100 * call + i) for i in range(8)])
        live = sub.drain()
        seqs = [seq for _, seq, _ in live]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        gone = removed_hashes(live)
        assert gone and set(gone) <= {h for _, _, b in replay(ctx, server.rep, 0)
                                      for e in stored_events([("", 0, b)]) for h in e.block_hashes}

        # A subscriber that joins late asks the replay socket from 0: every batch since start, the first an
        # AllBlocksCleared, each identical to what the live subscriber got.
        replayed = replay(ctx, server.rep, 0)
        assert [seq for _, seq, _ in replayed] == list(range(len(replayed)))
        assert replayed[0][2].events == [AllBlocksCleared()]
        by_seq = {seq: b for _, seq, b in replayed}
        assert all(by_seq[seq] == b for _, seq, b in live)
        assert [seq for _, seq, _ in replay(ctx, server.rep, seqs[-1])] == [seqs[-1]]
        assert replay(ctx, server.rep, seqs[-1] + 10_000) == []
    finally:
        sub.close()


def test_stalled_subscriber_never_slows_the_model_and_replay_recovers(server, ctx):
    stalled = Subscriber(ctx, server.pub, rcvhwm=1)  # ZMQ holds one batch for it; it never reads
    healthy = Subscriber(ctx, server.pub)
    try:
        joined(stalled, server.stub)
        first = joined(healthy, server.stub) + 1
        before = metrics(server)
        seen: list = []
        for call in range(30):  # every call completes (each with a deadline) while the stalled one reads nothing
            run(server.stub, [prompt_of(2 * BS + 1, seed=5000 + 10 * call + i) for i in range(4)])
            if call % 10 == 9:
                seen.extend(healthy.drain())
        seen.extend(healthy.drain())
        seqs = [seq for _, seq, _ in seen]
        assert seqs == list(range(first, first + len(seqs))), "the healthy subscriber lost batches"
        after = metrics(server)
        name = "tandem:executor_kv_events_zmq_batches"
        assert counter(after, name) - counter(before, name) >= len(seqs) >= 30
        assert counter(after, "tandem:executor_kv_events_zmq_dropped") == 0  # the publisher's queue never filled

        # What ZMQ did not keep for the stalled subscriber it gets from the replay socket.
        have = {seq for _, seq, _ in stalled.drain()}
        missing = sorted(set(seqs) - have)
        if missing:
            assert set(missing) <= {seq for _, seq, _ in replay(ctx, server.rep, missing[0])}
    finally:
        stalled.close()
        healthy.close()


@pytest.mark.parametrize("flags, message", [
    (["--kv-events-endpoint", "tcp://192.0.2.1:5557"], "not loopback"),
    (["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-replay-endpoint", "tcp://192.0.2.1:5558"],
     "--kv-events-replay-endpoint tcp://192.0.2.1:5558: not loopback"),
    (["--kv-events-endpoint", "localhost:5557"], "--kv-events-endpoint wants tcp://HOST:PORT"),
    (["--kv-events-endpoint", "tcp://*:70000"], "--kv-events-endpoint: port must be 1..65535"),
])
def test_startup_refuses_bad_or_exposed_endpoints(model_dir, flags, message):
    done = server_process.run_to_exit("executor_service", "--model", str(model_dir), "--port", "0", *flags,
                                      timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "READY" not in done.stdout
    if "loopback" in message:
        assert "--insecure" in done.stderr


def test_full_queue_drops_newest_counts_and_marks_the_loss(ctx):
    rep = free_port()
    pub = ZmqKvPublisher(f"tcp://127.0.0.1:{free_port()}", True, f"tcp://127.0.0.1:{rep}", "t", max_queued=4,
                         start=False)
    try:
        ev = [BlocksStored((bytes([i]) * 16,), b"", "", BS, tuple(range(BS))) for i in range(6)]
        for e in ev[:5]:  # the queue holds the start marker and 3 more: 2 are dropped
            pub.enqueue(e)
        assert (pub.stats().dropped_events, pub.stats().queued) == (2, 4)
        pub.start()
        (topic, seq, first), = replayed(ctx, rep, 1)
        assert topic == "t" and seq == 0 and isinstance(first.events[0], AllBlocksCleared) and len(first.events) == 4
        assert [e.token_ids for e in first.events[1:]] == [list(range(BS))] * 3
        pub.enqueue(BlocksRemoved((ev[0].hashes[0],)))  # the next event after the loss: the marker comes first
        second = replayed(ctx, rep, 2)[1][2]
        assert isinstance(second.events[0], AllBlocksCleared) and isinstance(second.events[1], BlockRemoved)
        assert second.events[1].block_hashes == [hash_to_int(ev[0].hashes[0])]
        assert (pub.stats().published_batches, pub.stats().dropped_events) == (2, 2)
    finally:
        pub.close()
    assert not any(t.name == "kv-events-zmq" for t in threading.enumerate())
    assert pub._ctx.closed


def replayed(ctx, port: int, n: int, attempts: int = 500) -> list:
    """The replay socket's batches once it holds n (each ask waits on the socket, not on a clock)."""
    for _ in range(attempts):
        got = replay(ctx, f"tcp://127.0.0.1:{port}", 0)
        if len(got) >= n:
            return got
    raise AssertionError(f"the publisher never held {n} batches")
