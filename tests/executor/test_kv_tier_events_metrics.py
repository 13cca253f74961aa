"""KV tiers and transfers seen from outside a real executor process (docs/kv-transfer.md, docs/metrics.md):
blocks the pool evicts are announced as removed from "GPU" and stored in "CPU" (the host tier) and "DISK" (the
disk tier), on SubscribeKvEvents and on the ZMQ wire in vLLM v0.28.0's layout (decoded with its definitions);
what the small host tier drops is removed from "CPU"; a corrupt block file is removed from "DISK"; a restarted
executor announces its reopened disk blocks (a new subscriber's snapshot, and the ZMQ stream right after its
AllBlocksCleared). The Prometheus exposition, read with prometheus_client's parser, counts each tier's blocks,
hits, writes, evictions and corrupt files, and ExportKv/ImportKv transfers (seconds histogram, bytes,
finished and failed)."""
from __future__ import annotations

import random
import re
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from executor_service.kv.events.vllm_wire import hash_to_int
from tandem.block_hash import chain_hashes, root_hash
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as executor_grpc
from tests.ports import free_port
from tests.grpc_harness import start_executor
from tests.kv_event_reader import KvEventReader
from tests.vllm_kv_event_defs import AllBlocksCleared, BlockRemoved, BlockStored, replay

KV_BLOCKS = 12
BS = 16
BLOCK_BYTES = 2 * 2 * BS * 2 * 16 * 4  # the tiny llama: 2 layers x K,V x 16 slots x 2 KV heads x 16 dims x fp32
HOST_GB = 3.5 * BLOCK_BYTES / 2**30  # a host tier of 3 blocks: it drops some of what it takes




def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


def first_token(server, prompt: list[int]) -> int:
    """The tokens CreateCache found cached for prompt (the cache is prefilled, then released)."""
    made = server.stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=prompt)])).results[0]
    server.stub.Prefill(pb.PrefillRequest(token_ids=prompt[made.cached_tokens:], cache_id=made.cache.cache_id))
    server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[made.cache.cache_id]))
    return made.cached_tokens


def evict_everything(server, base: int) -> None:
    for seed in range(base, base + 4):  # 4 x 3 blocks of other prompts: every block of the pool rewritten
        first_token(server, prompt_of(48, seed))


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of the executor's /metrics: (name, sorted labels) -> value."""
    url = re.search(r"metrics on (http://\S+/metrics)", server.stderr()).group(1)
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def wait_metric(server, key, at_least: float, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(server)
        if m.get(key, 0) >= at_least or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def events_of(messages) -> list[tuple[str, str, list[bytes]]]:
    """(kind, medium, hashes) of every event in SubscribeKvEvents messages."""
    out = []
    for m in messages:
        for e in m.events:
            kind = e.WhichOneof("event")
            ev = getattr(e, kind)
            out.append((kind, ev.medium, list(ev.block_hashes)))
    return out


def mediums(events, kind: str, h: bytes) -> list[str]:
    return [m for k, m, hs in events if k == kind and h in hs]


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def start(model_dir: Path, disk: Path, pub: int, rep: int):
    return start_executor(model_dir, "--kv-blocks", str(KV_BLOCKS), "--kv-host-gb", f"{HOST_GB:.12f}",
                          "--kv-disk-dir", str(disk), "--kv-disk-gb", "1", "--metrics-port", "0",
                          "--kv-events-endpoint", f"tcp://*:{pub}", "--kv-events-replay-endpoint", f"tcp://*:{rep}")


def collect(reader: KvEventReader, done, what: str, timeout_s: float = 30.0) -> list[tuple[str, str, list[bytes]]]:
    """Events read until done(all events so far) holds."""
    events: list[tuple[str, str, list[bytes]]] = []
    end = time.monotonic() + timeout_s
    while not done(events):
        left = end - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {what}")
        events += events_of([reader.next(left)])
    return events


def test_tier_moves_are_events_and_metrics_and_survive_a_restart(model_dir, ctx, tmp_path):
    disk = tmp_path / "tier"
    pub, rep = free_port(), free_port()
    prompt = prompt_of(64, seed=1)
    hashes = chain_hashes(root_hash(), prompt, BS)  # its 4 blocks
    with start(model_dir, disk, pub, rep) as server:
        reader = KvEventReader(server.stub, summary_interval_ms=60_000)
        try:
            assert first_token(server, prompt) == 0
            evict_everything(server, 100)
            evict_everything(server, 104)  # 24 blocks through a pool of 12: every block of the prompt evicted
            cpu, dsk = (("medium", "CPU"),), (("medium", "DISK"),)
            m = scrape(server)
            spilled = m[("tandem:executor_kv_tier_written_blocks_total", cpu)]
            assert spilled >= 4 + 3
            m = wait_metric(server, ("tandem:executor_kv_tier_written_blocks_total", dsk), spilled)
            ev = collect(reader, lambda e: all("DISK" in mediums(e, "stored", h) for h in hashes)
                         and len([h for k, med, hs in e if k == "stored" and med == "DISK" for h in hs]) == spilled,
                         "every spilled block stored on DISK")
            for h in hashes:  # left the pool, then taken by both tiers
                assert mediums(ev, "removed", h)[0] == "GPU" and mediums(ev, "stored", h)[-2:] in (["CPU", "DISK"],
                                                                                                 ["DISK", "CPU"]), h
            host_taken = [h for k, med, hs in ev if k == "stored" and med == "CPU" for h in hs]
            host_dropped = [h for k, med, hs in ev if k == "removed" and med == "CPU" for h in hs]
            assert len(host_taken) == spilled and len(host_dropped) == spilled - 3  # the host tier holds 3
            # the exposition agrees
            assert m[("tandem:executor_kv_tier_blocks", cpu)] == 3
            assert m[("tandem:executor_kv_tier_evicted_blocks_total", cpu)] == spilled - 3
            assert m[("tandem:executor_kv_tier_blocks", dsk)] == m[("tandem:executor_kv_tier_written_blocks_total", dsk)]
            assert m[("tandem:executor_kv_tier_bytes", dsk)] > spilled * BLOCK_BYTES  # data and each file's head
            assert m[("tandem:executor_kv_tier_corrupt_files_total", ())] == 0
            assert m[("tandem:executor_kv_tier_dropped_spills_total", ())] == 0

            # the prompt again: its blocks come back from disk (host memory kept only the last prompt's)
            assert first_token(server, prompt) == 63
            m = scrape(server)
            assert m[("tandem:executor_kv_tier_hits_total", dsk)] == 4
            assert m[("tandem:executor_kv_tier_hits_total", cpu)] == 0
            back = collect(reader, lambda e: bool(mediums(e, "stored", hashes[0])), "the reloaded blocks")
            assert mediums(back, "stored", hashes[0]) == ["GPU"]

            # a corrupt block file: never served, counted, announced as gone from DISK
            bad = chain_hashes(root_hash(), prompt_of(48, 100), BS)[0]  # on disk only by now
            (victim,) = disk.rglob(f"{bad.hex()}.kvb")
            raw = bytearray(victim.read_bytes())
            raw[-3] ^= 0xFF
            victim.write_bytes(bytes(raw))
            assert first_token(server, prompt_of(48, 100)) == 0
            gone = collect(reader, lambda e: bool(mediums(e, "removed", bad)), "the corrupt block's removal")
            assert mediums(gone, "removed", bad) == ["DISK"] and not victim.exists()
            assert scrape(server)[("tandem:executor_kv_tier_corrupt_files_total", ())] == 1
        finally:
            reader.close()
        # the ZMQ wire, in vLLM's layout: the same mediums
        batches = replay(ctx, f"tcp://127.0.0.1:{rep}", 0)
        events = [e for _, _, b in batches for e in b.events]
        first = hash_to_int(hashes[0])
        wire = [(type(e).__name__, e.medium) for e in events
                if isinstance(e, (BlockStored, BlockRemoved)) and first in e.block_hashes]
        assert wire[:3] == [("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU")]
        assert ("BlockStored", "DISK") in wire
    # a restart: the reopened disk blocks are announced, to a new subscriber and on ZMQ after AllBlocksCleared
    with start(model_dir, disk, pub, rep) as server:
        reader = KvEventReader(server.stub, summary_interval_ms=60_000)
        try:
            snap = events_of(reader.until(lambda x: not x.snapshot, what="the end of the snapshot"))
            assert all(mediums(snap, "stored", h) == ["DISK"] for h in hashes)
        finally:
            reader.close()
        want = {hash_to_int(h) for h in hashes}
        deadline = time.monotonic() + 10
        while True:  # (the publisher thread sends what was queued at start within milliseconds)
            batches = replay(ctx, f"tcp://127.0.0.1:{rep}", 0)
            announced = {h for _, _, b in batches for e in b.events if isinstance(e, BlockStored)
                         and e.medium == "DISK" for h in e.block_hashes}
            if want <= announced or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert isinstance(batches[0][2].events[0], AllBlocksCleared) and want <= announced
        assert scrape(server)[("tandem:executor_kv_tier_blocks", (("medium", "DISK"),))] >= 4


def test_transfer_metrics(model_dir):
    with start_executor(model_dir, "--kv-blocks", str(KV_BLOCKS), "--metrics-port", "0") as server:
        pre = server.stub.Prefill(pb.PrefillRequest(token_ids=prompt_of(40, seed=5)))
        got = server.stub.ImportKv(pb.ImportKvRequest(  # from itself: one export and one import, both finished
            source_address=server.address, create_cache=True,
            export=pb.ExportKvRequest(cache_id=pre.cache.cache_id, max_chunk_bytes=1)))
        with pytest.raises(grpc.RpcError) as err:  # nobody listens there: a failed import
            server.stub.ImportKv(pb.ImportKvRequest(source_address="127.0.0.1:9", create_cache=True,
                                                    export=pb.ExportKvRequest(cache_id=pre.cache.cache_id)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # the first of 3 chunks, then the reader goes away: a failed export. A receive window smaller than a
        # chunk (and no window growth) keeps the executor from having sent all 3 before the cancel arrives.
        with grpc.insecure_channel(server.address, options=[("grpc.http2.lookahead_bytes", 1024),
                                                            ("grpc.http2.bdp_probe", 0)]) as slow:
            stream = executor_grpc.ExecutorServiceStub(slow).ExportKv(
                pb.ExportKvRequest(cache_id=pre.cache.cache_id, max_chunk_bytes=1))
            next(stream)
            stream.cancel()
        m = wait_metric(server, ("tandem:executor_kv_transfer_failures_total", (("direction", "export"),)), 1)
        exp, imp = (("direction", "export"),), (("direction", "import"),)
        assert m[("tandem:executor_kv_transfers_total", exp)] == 1 and m[("tandem:executor_kv_transfers_total", imp)] == 1
        assert m[("tandem:executor_kv_transfer_failures_total", imp)] == 1
        assert m[("tandem:executor_kv_transfer_failures_total", exp)] == 1
        assert m[("tandem:executor_kv_transfer_bytes_total", imp)] == got.bytes == 3 * BLOCK_BYTES
        assert m[("tandem:executor_kv_transfer_bytes_total", exp)] >= 4 * BLOCK_BYTES  # 3, and 1+ of the cut one
        assert m[("tandem:executor_kv_transfer_duration_seconds_count", imp)] == 1
        assert 0 < m[("tandem:executor_kv_transfer_duration_seconds_sum", imp)] < 30
        assert m[("tandem:executor_kv_transfer_duration_seconds_bucket", (("direction", "import"), ("le", "+Inf")))] == 1
        assert m[("tandem:executor_kv_transfers_active", exp)] == 0
        assert ("tandem:executor_kv_tier_blocks", (("medium", "DISK"),)) not in m  # no tiers: no tier series
        server.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[pre.cache.cache_id, got.cache_id]))
