"""Sessions and leases against real executor processes: caches freed on CloseSession, on lease
expiry (a client SIGKILLed, an idle anonymous user), kept by KeepAlive; another session's caches invisible;
ListCaches; instance ids; and control calls answered while a long model call runs and the bounded model
queue refuses the excess at once.

Leases run on real time here (`--session-ttl 1`): waits are polls with a deadline on GetInfo, never fixed
sleeps; the only sleeps pace KeepAlive calls, well inside the TTL."""
from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.executor.v1 import executor_pb2 as pb
from tandem.server_process import ROOT
from tests.grpc_harness import start_for

KV_BLOCKS = 64
ITEMS = 24  # caches of the long Decode (150 steps each: seconds of model work on the tiny model, native step too)
PROMPT = [5, 6, 7, 8, 9]
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def server(request, model_dir):
    return start_for(request, model_dir, "--kv-blocks", str(KV_BLOCKS), "--session-ttl", "1")


@pytest.fixture(scope="module")
def busy(request, model_dir):
    """A second executor whose model queue holds at most 2 calls."""
    return start_for(request, model_dir, "--kv-blocks", "512", "--max-queued-calls", "2")


def open_session(stub, name: str = "test") -> str:
    return stub.OpenSession(pb.OpenSessionRequest(client_name=name)).session_id


def prefill(stub, session: str = "", tokens: list[int] = PROMPT) -> pb.PrefillResponse:
    return stub.Prefill(pb.PrefillRequest(token_ids=tokens, session_id=session))


def free_blocks(stub) -> int:
    return stub.GetInfo(pb.GetInfoRequest()).kv.free_blocks


def wait_all_free(stub, total: int = KV_BLOCKS, timeout: float = 20.0) -> None:
    """Polls GetInfo until every block is free (a lease of 1 s is reaped within 1.25 s)."""
    end = time.monotonic() + timeout
    while (free := free_blocks(stub)) != total:
        assert time.monotonic() < end, f"{total - free} blocks still held {timeout:.0f}s later"
        time.sleep(0.05)


def code_and_message(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


# ------------------------------------------------------------------------------------------ GetInfo
def test_get_info_reports_lease_slots_and_instance(server, busy):
    info = server.stub.GetInfo(pb.GetInfoRequest())
    assert info.session_ttl_ms == 1000 and info.max_adapters_on_device == 8
    assert len(info.instance_id) == 32 and int(info.instance_id, 16) >= 0
    other = busy.stub.GetInfo(pb.GetInfoRequest())
    assert other.instance_id != info.instance_id and other.session_ttl_ms == 30000
    opened = server.stub.OpenSession(pb.OpenSessionRequest(client_name="x"))
    assert opened.instance_id == info.instance_id and opened.lease_ttl_ms == 1000 and len(opened.session_id) == 32
    server.stub.CloseSession(pb.CloseSessionRequest(session_id=opened.session_id))


# ------------------------------------------------------------------------------------- close and expiry
def test_close_session_frees_its_blocks(server):
    stub = server.stub
    sid = open_session(stub)
    ids = [prefill(stub, sid).cache.cache_id, prefill(stub, sid, PROMPT * 4).cache.cache_id]
    assert free_blocks(stub) == KV_BLOCKS - 3
    closed = stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert closed.released == 2 and closed.kv.free_blocks == KV_BLOCKS and closed.kv.active_caches == 0
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).released == 0  # idempotent
    code, msg = code_and_message(lambda: prefill(stub, sid))
    assert code == Code.NOT_FOUND and "unknown or expired; open a new one" in msg
    code, _ = code_and_message(lambda: stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=ids, session_id=sid)))
    assert code == Code.NOT_FOUND
    code, _ = code_and_message(lambda: stub.CloseSession(pb.CloseSessionRequest(session_id="")))
    assert code == Code.INVALID_ARGUMENT


def test_silent_session_expires(server):
    stub = server.stub
    sid = open_session(stub)
    prefill(stub, sid)
    wait_all_free(stub)
    for call in (lambda: stub.KeepAlive(pb.KeepAliveRequest(session_id=sid)),
                 lambda: stub.ListCaches(pb.ListCachesRequest(session_id=sid)), lambda: prefill(stub, sid)):
        assert code_and_message(call)[0] == Code.NOT_FOUND


def test_sigkilled_client_leaves_no_blocks(server):
    """A client process that opened a session, prefilled and kept it alive is SIGKILLed: its caches go
    after the lease."""
    stub = server.stub
    script = ("import sys, time, grpc\n"
              "from tandem.executor.v1 import executor_pb2 as pb, executor_pb2_grpc as g\n"
              "stub = g.ExecutorServiceStub(grpc.insecure_channel(sys.argv[1]))\n"
              "sid = stub.OpenSession(pb.OpenSessionRequest(client_name='doomed'), timeout=30).session_id\n"
              "for n in (5, 20, 40):\n"
              "    stub.Prefill(pb.PrefillRequest(token_ids=[7] * n, session_id=sid), timeout=30)\n"
              "print(sid, flush=True)\n"
              "while True:\n"
              "    stub.KeepAlive(pb.KeepAliveRequest(session_id=sid), timeout=30)\n"
              "    time.sleep(0.1)\n")
    client = subprocess.Popen([sys.executable, "-c", script, server.address], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        sid = client.stdout.readline().strip()
        assert len(sid) == 32, f"the client failed (exit {client.poll()})"
        (listed,) = stub.ListCaches(pb.ListCachesRequest(session_id=sid)).sessions
        assert listed.client_name == "doomed" and [c.seq_len for c in listed.caches] == [5, 20, 40]
        assert free_blocks(stub) == KV_BLOCKS - 1 - 2 - 3
    finally:
        client.kill()
        client.wait(timeout=10)
    wait_all_free(stub)
    assert stub.GetInfo(pb.GetInfoRequest()).kv.active_caches == 0
    assert code_and_message(lambda: stub.ListCaches(pb.ListCachesRequest(session_id=sid)))[0] == Code.NOT_FOUND


def test_keep_alive_keeps_caches_past_the_ttl(server):
    stub = server.stub
    sid = open_session(stub)
    res = prefill(stub, sid)
    end = time.monotonic() + 3.0  # three leases
    while time.monotonic() < end:
        alive = stub.KeepAlive(pb.KeepAliveRequest(session_id=sid))
        assert (alive.lease_ttl_ms, alive.caches) == (1000, 1)
        time.sleep(0.1)  # pacing, 10x inside the lease
    d = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=res.cache, token_id=res.output.tokens[0].token_id)],
                                     session_id=sid))
    assert d.results[0].cache.seq_len == len(PROMPT) + 1
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).released == 1
    assert free_blocks(stub) == KV_BLOCKS


def test_anonymous_caches_expire(server):
    stub = server.stub
    res = prefill(stub)  # no session: the anonymous one
    assert free_blocks(stub) == KV_BLOCKS - 1
    wait_all_free(stub)
    (gone,) = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=res.cache, token_id=3)])).results
    assert gone.status.code == Code.NOT_FOUND.value[0]  # the item fails alone
    assert prefill(stub).cache.seq_len == len(PROMPT)  # the anonymous session itself still works
    wait_all_free(stub)


# ------------------------------------------------------------------------------------------- ownership
def test_another_sessions_cache_is_unknown(server):
    stub = server.stub
    a, b = open_session(stub, "a"), open_session(stub, "b")
    res = prefill(stub, a)
    cid = res.cache.cache_id
    for other in (b, ""):
        (item,) = stub.Decode(pb.DecodeRequest(items=[pb.DecodeItem(cache=res.cache, token_id=3)],
                                               session_id=other)).results
        assert item.status.code == Code.NOT_FOUND.value[0] and f"unknown cache id {cid!r}" in item.status.message
        code, _ = code_and_message(lambda: stub.TruncateCache(pb.TruncateCacheRequest(
            cache_id=cid, new_len=1, session_id=other)))
        assert code == Code.NOT_FOUND
        rel = stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cid], session_id=other))
        assert rel.released == 0 and list(rel.unknown_cache_ids) == [cid] and rel.kv.free_blocks == KV_BLOCKS - 1
    rel = stub.ReleaseCache(pb.ReleaseCacheRequest(cache_ids=[cid], session_id=a))
    assert rel.released == 1 and rel.kv.free_blocks == KV_BLOCKS
    for sid in (a, b):
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


def test_list_caches(server):
    stub = server.stub
    a, b = open_session(stub, "scheduler@host"), open_session(stub, "idle")
    short, long = prefill(stub, a).cache.cache_id, prefill(stub, a, list(range(3, 23))).cache.cache_id
    listed = stub.ListCaches(pb.ListCachesRequest())
    mine = [s for s in listed.sessions if s.session_id in (a, b)]
    assert [(s.session_id, s.client_name) for s in mine] == [(a, "scheduler@host"), (b, "idle")]  # oldest first
    assert [(c.cache_id, c.seq_len, c.blocks, c.adapter) for c in mine[0].caches] == [
        (short, len(PROMPT), 1, ""), (long, 20, 2, "")]
    assert mine[0].caches[0].age_ms >= mine[0].caches[1].age_ms and 0 < mine[0].expires_in_ms <= 1000
    assert listed.kv.free_blocks == KV_BLOCKS - 3 and listed.kv.active_caches == 2
    (only,) = stub.ListCaches(pb.ListCachesRequest(session_id=b)).sessions
    assert only.session_id == b and list(only.caches) == []
    for sid in (a, b):
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert free_blocks(stub) == KV_BLOCKS


# ------------------------------------------------------------------------- control calls and the queue
def test_control_calls_answer_during_a_long_call_and_the_queue_is_bounded(busy):
    stub = busy.stub
    total = stub.GetInfo(pb.GetInfoRequest()).kv.total_blocks
    sid = open_session(stub, "flood")
    items = []
    for i in range(ITEMS):
        r = prefill(stub, sid, [5 + i, 6, 7, 8])
        items.append(pb.DecodeItem(cache=r.cache, token_id=r.output.tokens[0].token_id))
    long = stub.Decode.future(pb.DecodeRequest(items=items, num_steps=150, session_id=sid))
    end = time.monotonic() + 60
    while not any(c.seq_len > 4 for c in stub.ListCaches(pb.ListCachesRequest(session_id=sid)).sessions[0].caches):
        assert time.monotonic() < end and not long.done(), "the long Decode did not start"
        time.sleep(0.01)
    # The long call runs; 2 more wait; the rest of a flood is refused at once, nothing done.
    flood = [stub.Prefill.future(pb.PrefillRequest(token_ids=PROMPT, session_id=sid)) for _ in range(6)]
    while sum(f.done() for f in flood) < 4:
        assert time.monotonic() < end, "the excess calls were not refused at once"
        time.sleep(0.005)
    refused = [f for f in flood if f.done()]
    for f in refused:
        assert f.code() == Code.RESOURCE_EXHAUSTED
        assert "model calls queued (--max-queued-calls 2); retry later" in f.details()
    # Control calls answer while the long call still runs (and the 2 queued calls wait).
    health = health_pb2_grpc.HealthStub(busy.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    info = stub.GetInfo(pb.GetInfoRequest())
    listed = stub.ListCaches(pb.ListCachesRequest())
    assert stub.KeepAlive(pb.KeepAliveRequest(session_id=sid)).caches == ITEMS
    other = open_session(stub, "other")
    stub.GetMetrics(pb.GetMetricsRequest())
    stub.ListAdapters(pb.ListAdaptersRequest())
    waiting = sum(not f.done() for f in flood)
    assert not long.done(), "the long Decode ended before the control calls were answered"
    assert info.kv.active_caches == ITEMS and sum(len(s.caches) for s in listed.sessions) == ITEMS
    assert waiting == 2

    assert all(r.cache.seq_len > 4 for r in long.result(timeout=300).results)
    queued = [f.result(timeout=60) for f in flood if f not in refused]
    assert len(queued) == 2
    listed = stub.ListCaches(pb.ListCachesRequest(session_id=sid)).sessions[0]
    assert len(listed.caches) == ITEMS + 2  # the refused prefills created nothing
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=sid)).released == ITEMS + 2
    assert stub.CloseSession(pb.CloseSessionRequest(session_id=other)).released == 0
    kv = stub.GetInfo(pb.GetInfoRequest()).kv
    assert (kv.free_blocks, kv.active_caches) == (total, 0)
