"""ExportKv / ImportKv between two real executor processes (docs/kv-transfer.md): a cache moved to another
executor continues token for token as it would have where it was made; the refusals (fingerprint, checksum,
unreachable source, full pool) keep nothing; a source killed mid-transfer and an importer killed mid-import
leave no block taken on the side that survives."""
from __future__ import annotations

import random
import signal
import time

import grpc
import pytest

from executor_service.kv.block_bytes import crc32c
from executor_service.kv.fingerprint import differences
from tandem.executor.v1 import executor_pb2 as pb
from tests.grpc_harness import start_executor, start_for
from tests.tcp_relay import TcpRelay

KV_BLOCKS = 64
BS = 16


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 400) for _ in range(length)]


@pytest.fixture(scope="module")
def src(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS), "--role", "prefill")


@pytest.fixture(scope="module")
def dst(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS), "--role", "decode")


def free_blocks(server) -> int:
    return server.stub.GetInfo(pb.GetInfoRequest()).kv.free_blocks


def decode(server, cache_id: str, seq_len: int, token: int, steps: int) -> list[int]:
    res = server.stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=pb.CacheRef(cache_id=cache_id, seq_len=seq_len),
                                                                   token_id=token)], num_steps=steps))
    return [t.token_id for t in res.results[0].output.tokens]


def test_info_reports_role_fingerprint_and_capability(src, dst):
    a, b = src.stub.GetInfo(pb.GetInfoRequest()), dst.stub.GetInfo(pb.GetInfoRequest())
    assert (a.role, b.role) == ("prefill", "decode")
    assert a.kv_fingerprint == b.kv_fingerprint and "block_size=16" in a.kv_fingerprint
    assert "kv_transfer" in a.capabilities


@pytest.mark.parametrize("length", [40, 48])  # a partial last block, and whole blocks only
def test_imported_cache_continues_token_for_token(src, dst, length):
    prompt = prompt_of(length, seed=length)
    pre = src.stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    cache, first = pre.cache.cache_id, pre.output.tokens[0].token_id
    before = free_blocks(dst)
    res = dst.stub.ImportKv(pb.ImportKvRequest(source_address=src.address, create_cache=True,
                                               export=pb.ExportKvRequest(cache_id=cache, max_chunk_bytes=1)))
    assert (res.num_tokens, res.blocks_imported) == (length, -(-length // BS))
    assert res.bytes > 0 and free_blocks(dst) == before - res.blocks_imported
    here = decode(dst, res.cache_id, length, first, 12)
    there = decode(src, cache, length, first, 12)
    assert here == there and len(here) == 12
    src.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cache]))
    dst.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[res.cache_id]))
    assert free_blocks(dst) == before and free_blocks(src) == KV_BLOCKS


def test_prefix_import_then_create_cache_hits(src, dst):
    prompt = prompt_of(64, seed=7)
    pre = src.stub.Prefill(pb.PrefillRequest(token_ids=prompt))
    src.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[pre.cache.cache_id]))
    # the hashes, as a router would have them: the source's own cache of the prompt tells them
    probe = src.stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=prompt)]))
    assert probe.results[0].cached_tokens == 63
    src.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[probe.results[0].cache.cache_id]))
    from tandem.block_hash import chain_hashes, root_hash
    hashes = chain_hashes(root_hash(), prompt, BS)
    res = dst.stub.ImportKv(pb.ImportKvRequest(source_address=src.address,
                                               export=pb.ExportKvRequest(block_hashes=hashes)))
    assert (res.cache_id, res.num_tokens, res.blocks_imported) == ("", 64, 4)
    got = dst.stub.CreateCache(pb.CreateCacheRequest(items=[pb.CreateCacheItem(token_ids=prompt)]))
    assert got.results[0].cached_tokens == 63  # every block came from the import
    dst.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[got.results[0].cache.cache_id]))
    assert free_blocks(dst) == KV_BLOCKS


def test_refusals_keep_nothing(src, dst):
    with pytest.raises(grpc.RpcError) as err:  # unknown cache at the source: its NOT_FOUND, relayed
        dst.stub.ImportKv(pb.ImportKvRequest(source_address=src.address, create_cache=True,
                                             export=pb.ExportKvRequest(cache_id="0" * 32)))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:  # nobody listens there
        dst.stub.ImportKv(pb.ImportKvRequest(source_address="127.0.0.1:9", create_cache=True,
                                             export=pb.ExportKvRequest(cache_id="0" * 32)), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:  # off loopback without TLS or --insecure
        dst.stub.ImportKv(pb.ImportKvRequest(source_address="10.1.2.3:50051",
                                             export=pb.ExportKvRequest(cache_id="0" * 32)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        dst.stub.ImportKv(pb.ImportKvRequest(source_address=src.address, export=pb.ExportKvRequest()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    pre = src.stub.Prefill(pb.PrefillRequest(token_ids=prompt_of(40)))
    with pytest.raises(grpc.RpcError) as err:  # a pool too small for the export: nothing taken
        for _ in range(KV_BLOCKS):
            dst.stub.ImportKv(pb.ImportKvRequest(source_address=src.address, create_cache=True,
                                                 export=pb.ExportKvRequest(cache_id=pre.cache.cache_id)))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert free_blocks(dst) < 3  # the imports that fitted hold the pool; the one that did not took nothing
    for s in dst.stub.ListCaches(pb.ListCachesRequest()).sessions:
        dst.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[c.cache_id for c in s.caches]))
    src.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[pre.cache.cache_id]))
    assert free_blocks(dst) == KV_BLOCKS and free_blocks(src) == KV_BLOCKS


def test_fingerprint_mismatch_names_what_differs(request, model_dir, src):
    other = start_for(request, model_dir, "--kv-blocks", "16", "--block-size", "32")
    pre = src.stub.Prefill(pb.PrefillRequest(token_ids=prompt_of(20)))
    with pytest.raises(grpc.RpcError) as err:
        other.stub.ImportKv(pb.ImportKvRequest(source_address=src.address, create_cache=True,
                                               export=pb.ExportKvRequest(cache_id=pre.cache.cache_id)))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "block_size: 32 here, 16 at the source" in err.value.details()
    assert other.stub.GetInfo(pb.GetInfoRequest()).kv.free_blocks == 16
    src.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[pre.cache.cache_id]))


def test_fingerprint_differences_text():
    a = "weights=aa;kv_dtype=float32;block_size=16"
    assert differences(a, a) == ""
    assert differences(a, a.replace("aa", "bb")) == "weights: aa here, bb at the source"


class _FakeSource:
    """An ExportKv server that sends a corrupted block, or stalls mid-stream (to be killed)."""


def test_checksum_corruption_is_data_loss(src, dst):
    """The importer checks every block's CRC-32C: a source whose blocks do not match them is refused
    DATA_LOSS. The corrupting source is a real gRPC server relaying the real source's stream with one byte
    flipped."""
    from concurrent import futures

    from tandem.executor.v1 import executor_pb2_grpc as pb_grpc

    class Flipper(pb_grpc.ExecutorServiceServicer):
        def ExportKv(self, request, context):
            for i, chunk in enumerate(src.stub.ExportKv(request)):
                if i == 1:
                    data = bytearray(chunk.blocks[0].data)
                    data[7] ^= 0x40
                    chunk.blocks[0].data = bytes(data)
                yield chunk

    server = grpc.server(futures.ThreadPoolExecutor(2))
    pb_grpc.add_ExecutorServiceServicer_to_server(Flipper(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        pre = src.stub.Prefill(pb.PrefillRequest(token_ids=prompt_of(50)))
        with pytest.raises(grpc.RpcError) as err:
            dst.stub.ImportKv(pb.ImportKvRequest(source_address=f"127.0.0.1:{port}", create_cache=True,
                                                 export=pb.ExportKvRequest(cache_id=pre.cache.cache_id,
                                                                           max_chunk_bytes=1)))
        assert err.value.code() == grpc.StatusCode.DATA_LOSS and "CRC-32C" in err.value.details()
        assert free_blocks(dst) == KV_BLOCKS
        assert not any(s.caches for s in dst.stub.ListCaches(pb.ListCachesRequest()).sessions)
        src.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[pre.cache.cache_id]))
    finally:
        server.stop(0)
    assert crc32c(b"123456789") == 0xE3069283  # the Castagnoli check value: not plain CRC-32


# A model whose KV is fat enough that an export (16 MiB) is more than the socket buffers and HTTP/2 windows on the
# way hold (256 KiB a block: 32 layers x K,V x 16 slots x 4 KV heads x 16 dims x 4 bytes), with long prompts.
FAT = dict(num_layers=32, config_overrides={"max_position_embeddings": 1024, "num_key_value_heads": 4})
FAT_BLOCK_BYTES = 32 * 2 * BS * 4 * 16 * 4


def test_source_killed_mid_transfer(tiny_checkpoint):
    """SIGKILL of the source while its export streams: the importer has received the header and the first
    blocks (it took every block the import needs), the source has not sent the rest; the import ends
    UNAVAILABLE and the importer gives back every block it took. The source's stream reaches the importer
    through a TCP relay that passes its first bytes and then stops reading (TCP holds the source back): the point
    of the kill is known."""
    fat = tiny_checkpoint("llama", **FAT)
    source = start_executor(fat, "--kv-blocks", "80")
    importer = start_executor(fat, "--kv-blocks", "80")
    relay = None
    try:
        length = 1000
        blocks = -(-length // BS)
        pre = source.stub.Prefill(pb.PrefillRequest(token_ids=prompt_of(length, seed=3)), timeout=120)
        host, port = source.address.rsplit(":", 1)
        relay = TcpRelay((host, int(port)), hold_after=4 * FAT_BLOCK_BYTES)
        before = free_blocks(importer)
        fut = importer.stub.ImportKv.future(pb.ImportKvRequest(
            source_address=relay.address, create_cache=True,
            export=pb.ExportKvRequest(cache_id=pre.cache.cache_id, max_chunk_bytes=1)), timeout=120)
        deadline = time.monotonic() + 60
        while (free_blocks(importer) != before - blocks or not relay.holding.is_set()) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert free_blocks(importer) == before - blocks  # the header arrived: the import holds its blocks
        assert relay.passed == relay.hold_after  # and the first chunks, not the rest
        time.sleep(0.5)  # the source fills what the buffers on the way hold, and blocks
        source.proc.kill()
        source.proc.wait()
        relay.resume()  # read what the buffers held, then the end of the dead source's connection
        assert relay.server_closed.wait(30)
        assert relay.from_server < blocks * FAT_BLOCK_BYTES / 2, relay.from_server  # the source was mid-stream
        with pytest.raises(grpc.RpcError) as err:
            fut.result(timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "went away mid-transfer" in err.value.details() and relay.server_closed.is_set()
        assert free_blocks(importer) == before  # no block leaked
        assert not any(s.caches for s in importer.stub.ListCaches(pb.ListCachesRequest()).sessions)
    finally:
        for server in (source, importer):
            server.proc.kill()
            server.proc.wait()
            server._closed = True
            server.channel.close()
        if relay is not None:
            relay.cut()


def test_importer_killed_mid_import(model_dir, src):
    """SIGKILL of the importer while it pulls: the source's export ends and its pins go."""
    importer = start_executor(model_dir, "--kv-blocks", str(KV_BLOCKS))
    try:
        pre = src.stub.Prefill(pb.PrefillRequest(token_ids=prompt_of(200, seed=4)))
        fut = importer.stub.ImportKv.future(pb.ImportKvRequest(
            source_address=src.address, create_cache=True,
            export=pb.ExportKvRequest(cache_id=pre.cache.cache_id, max_chunk_bytes=1)), timeout=60)
        importer.proc.send_signal(signal.SIGSTOP)  # stops reading mid-stream: the source's export stays open
        time.sleep(0.5)
        importer.proc.kill()
        importer.proc.wait()
        with pytest.raises(grpc.RpcError):
            fut.result()
        src.stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[pre.cache.cache_id]))
        deadline = time.monotonic() + 30
        while free_blocks(src) != KV_BLOCKS and time.monotonic() < deadline:
            time.sleep(0.1)
        assert free_blocks(src) == KV_BLOCKS  # the export's pins were given back
    finally:
        importer.proc.kill()
        importer.proc.wait()
        importer._closed = True
        importer.channel.close()
