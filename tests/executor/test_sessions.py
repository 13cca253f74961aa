"""Sessions and leases in process, on a fake clock: no sleeps. A session's caches go when it is
closed or its lease lapses (and the reaper runs); every call renews the lease, a call in flight holds it;
a session sees only its own caches; the anonymous session follows the same TTL rule. Plus the model lock's
priority for control operations and the bounded model-call queue."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from executor_service.config import ExecutorConfig
from executor_service.executor import Executor
from executor_service.model_thread import ModelThread
from executor_service.step.op_lock import OpLock
from executor_service.types import CacheRef, DecodeItem, UnifiedItem
from tandem.errors import CacheNotFound, InvalidRequest, QueueFull, SessionNotFound
from tandem.status_map import status_for
from tests.executor_driver import raising

TTL = 10.0
KV_BLOCKS = 32
PROMPT = [5, 6, 7, 8, 9]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
def ex(model_dir, clock) -> Executor:
    return Executor(ExecutorConfig(Path(model_dir), device="cpu", kv_blocks=KV_BLOCKS, progress=False,
                                   session_ttl_s=TTL), clock=clock)


def free(ex: Executor) -> int:
    return ex.kv_usage().free_blocks


def wait_until(predicate, what: str, timeout: float = 10.0) -> None:
    """Polls a condition another thread will make true (no fixed sleeps)."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


# ----------------------------------------------------------------------------------------- close / expiry
def test_close_session_releases_its_caches_only(ex):
    a = ex.open_session("a").session_id
    mine = [ex.prefill(PROMPT, session=a).cache.cache_id, ex.prefill(PROMPT * 4, session=a).cache.cache_id]
    anon = ex.prefill(PROMPT).cache.cache_id
    assert free(ex) == KV_BLOCKS - 1 - 2 - 1
    assert ex.close_session(a) == 2
    assert free(ex) == KV_BLOCKS - 1 and ex.kv_usage().active_caches == 1
    assert ex.close_session(a) == 0  # idempotent
    with pytest.raises(SessionNotFound, match="unknown or expired; open a new one"):
        ex.prefill(PROMPT, session=a)
    with pytest.raises(SessionNotFound):
        ex.release_cache(mine, session=a)
    assert status_for(SessionNotFound(a)).name == "NOT_FOUND"
    assert ex.cache_length(anon) == len(PROMPT)  # the anonymous cache is untouched
    assert ex.release_cache([anon]) == (1, [])
    assert free(ex) == KV_BLOCKS


def test_lapsed_session_is_reaped_with_its_caches(ex, clock):
    a = ex.open_session("a").session_id
    ex.prefill(PROMPT, session=a)
    ex.prefill(PROMPT, session=a)
    clock.advance(TTL - 0.01)
    assert ex.reap_lapsed() == 0 and free(ex) == KV_BLOCKS - 2
    clock.advance(0.02)
    assert ex.reap_lapsed() == 2
    assert free(ex) == KV_BLOCKS and ex.kv_usage().active_caches == 0
    with pytest.raises(SessionNotFound):
        ex.keep_alive(a)
    assert [s.session_id for s in ex.list_caches()] == []
    assert ex.reap_lapsed() == 0


def test_calls_and_keep_alive_renew_the_lease(ex, clock):
    a = ex.open_session("a").session_id
    res = ex.prefill(PROMPT, session=a)
    cid = res.cache.cache_id
    clock.advance(0.75 * TTL)
    assert ex.keep_alive(a) == (TTL, 1)
    clock.advance(0.75 * TTL)
    assert ex.reap_lapsed() == 0
    (d,) = ex.decode([DecodeItem(CacheRef(cid, len(PROMPT)), res.output.tokens[0].token_id)], session=a)
    clock.advance(0.75 * TTL)
    assert ex.reap_lapsed() == 0
    ex.list_caches(a)  # listing renews nothing
    clock.advance(0.3 * TTL)
    assert ex.reap_lapsed() == 1 and free(ex) == KV_BLOCKS


def test_anonymous_caches_expire_but_the_session_stays(ex, clock):
    old = ex.prefill(PROMPT).cache.cache_id
    clock.advance(TTL)
    assert ex.reap_lapsed() == 1 and free(ex) == KV_BLOCKS
    with pytest.raises(CacheNotFound):
        ex.prefill([3], cache_id=old)
    new = ex.prefill(PROMPT).cache.cache_id  # the anonymous session is never unknown
    clock.advance(TTL / 2)
    assert ex.reap_lapsed() == 0 and ex.cache_length(new) == len(PROMPT)
    ex.release_cache([new])


def test_a_session_in_flight_never_lapses(ex, clock):
    """The servicer holds a call's session from its arrival: a call queued for longer than the TTL still
    finds its caches, and the lease counts from the call's end."""
    a = ex.open_session("a").session_id
    cid = ex.prefill(PROMPT, session=a).cache.cache_id
    with ex.hold_session(a):
        clock.advance(3 * TTL)
        assert ex.reap_lapsed() == 0
        assert ex.cache_length(cid, session=a) == len(PROMPT)
        (listed,) = ex.list_caches(a)
        assert listed.expires_in_s == TTL
    clock.advance(TTL - 0.01)
    assert ex.reap_lapsed() == 0
    clock.advance(0.02)
    assert ex.reap_lapsed() == 1


def test_a_call_waiting_while_its_session_closes_creates_nothing(ex):
    """A call holding its session (queued) while CloseSession runs first: it fails NOT_FOUND when it gets
    the model lock, and leaves no cache behind (a cache created then would belong to no session)."""
    a = ex.open_session("a").session_id
    errors: list[BaseException] = []

    def call() -> None:
        try:
            ex.prefill(PROMPT, session=a)
        except BaseException as exc:  # noqa: BLE001 (handed to the test thread)
            errors.append(exc)

    with ex._lock.hold():  # the model call in progress
        caller = threading.Thread(target=call)
        caller.start()
        wait_until(lambda: ex._lock.waiting() == (0, 1), "the call to wait for the model lock")
        closer = threading.Thread(target=ex.close_session, args=(a,))
        closer.start()
        wait_until(lambda: ex._lock.waiting() == (1, 1), "CloseSession to wait for the model lock")
    closer.join()
    caller.join()
    assert len(errors) == 1 and isinstance(errors[0], SessionNotFound)
    assert free(ex) == KV_BLOCKS and ex.kv_usage().active_caches == 0


# ----------------------------------------------------------------------------------------------- ownership
def test_another_sessions_cache_is_not_found(ex):
    a, b = ex.open_session("a").session_id, ex.open_session("b").session_id
    res = ex.prefill(PROMPT, session=a)
    cid, tok = res.cache.cache_id, res.output.tokens[0].token_id
    used = free(ex)
    for session in (b, ""):  # another named session, and the anonymous one
        with pytest.raises(CacheNotFound, match="never created or has been released"):
            raising(ex.decode([DecodeItem(CacheRef(cid, len(PROMPT)), tok)], session=session))
        with pytest.raises(CacheNotFound):
            ex.prefill([3], cache_id=cid, session=session)
        with pytest.raises(CacheNotFound):
            raising(ex.unified_decode([UnifiedItem((tok,), cid, len(PROMPT))], session=session))
        with pytest.raises(CacheNotFound):
            ex.forward_verify(CacheRef(cid, len(PROMPT)), [tok, 3], session=session)
        with pytest.raises(CacheNotFound):
            ex.truncate_cache(cid, 1, session=session)
        assert ex.release_cache([cid], session=session) == (0, [cid])  # reported unknown, not released
    assert free(ex) == used and ex.cache_length(cid, session=a) == len(PROMPT)
    (d,) = ex.decode([DecodeItem(CacheRef(cid, len(PROMPT)), tok)], session=a)  # its owner still can
    assert d.cache.seq_len == len(PROMPT) + 1
    assert ex.release_cache([cid], session=a) == (1, [])
    assert free(ex) == KV_BLOCKS


def test_unknown_session_changes_nothing(ex):
    for call in (lambda: ex.prefill(PROMPT, session="f" * 32),
                 lambda: ex.unified_decode([UnifiedItem(tuple(PROMPT))], session="nope"),
                 lambda: ex.keep_alive("nope"), lambda: ex.list_caches("nope")):
        with pytest.raises(SessionNotFound):
            call()
    assert free(ex) == KV_BLOCKS and ex.kv_usage().active_caches == 0
    assert ex.close_session("nope") == 0
    with pytest.raises(InvalidRequest, match="anonymous session is shared"):
        ex.close_session("")
    with pytest.raises(InvalidRequest, match="at most 128"):
        ex.open_session("x" * 129)


# ------------------------------------------------------------------------------------------------ listing
def test_list_caches(ex, clock):
    anon = ex.prefill(PROMPT).cache.cache_id
    clock.advance(1)
    a = ex.open_session("scheduler@host").session_id
    short = ex.prefill(PROMPT, session=a).cache.cache_id
    clock.advance(1)
    long = ex.prefill(list(range(3, 23)), session=a).cache.cache_id  # 20 tokens: 2 blocks
    clock.advance(1)
    b = ex.open_session("idle").session_id
    clock.advance(0.5)

    listing = ex.list_caches()
    assert [(s.session_id, s.client_name) for s in listing] == [("", ""), (a, "scheduler@host"), (b, "idle")]
    assert [(c.cache_id, c.seq_len, c.blocks, c.adapter, c.age_s) for c in listing[0].caches] == [
        (anon, len(PROMPT), 1, "", 3.5)]
    assert [(c.cache_id, c.seq_len, c.blocks, c.age_s) for c in listing[1].caches] == [
        (short, len(PROMPT), 1, 2.5), (long, 20, 2, 1.5)]
    assert listing[1].expires_in_s == TTL - 1.5 and listing[2].caches == [] and listing[2].expires_in_s == TTL - 0.5
    (only_a,) = ex.list_caches(a)
    assert only_a == listing[1]
    ex.release_cache([anon])
    assert [s.session_id for s in ex.list_caches()] == [a, b]  # the anonymous session only when it holds caches
    assert ex.list_caches("")[0].caches == []


def test_info_reports_instance_lease_and_adapter_slots(ex, model_dir):
    info = ex.info()
    assert len(info.instance_id) == 32 and int(info.instance_id, 16) >= 0
    assert info.session_ttl_s == TTL and info.max_adapters_on_device == 8
    other = Executor(ExecutorConfig(Path(model_dir), device="cpu", kv_blocks=4, progress=False))
    assert other.info().instance_id != info.instance_id and other.info().session_ttl_s == 30.0
    lease = ex.open_session()
    assert (lease.ttl_s, lease.instance_id) == (TTL, info.instance_id)


def test_session_ttl_is_validated(model_dir):
    for bad in (0.0, -1.0, 1e9):
        with pytest.raises(ValueError, match="--session-ttl"):
            Executor(ExecutorConfig(Path(model_dir), device="cpu", kv_blocks=4, progress=False, session_ttl_s=bad))


# ------------------------------------------------------------------------------- the lock and the queue
def test_control_operations_go_before_queued_model_calls():
    lock, order = OpLock(), []

    def take(name: str, control: bool) -> None:
        with lock.hold(control):
            order.append(name)

    with lock.hold():  # the model call in progress
        model = threading.Thread(target=take, args=("model", False))
        model.start()
        wait_until(lambda: lock.waiting() == (0, 1), "the model call to wait")
        control = threading.Thread(target=take, args=("release", True))
        control.start()
        wait_until(lambda: lock.waiting() == (1, 1), "the control call to wait")
    model.join()
    control.join()
    assert order == ["release", "model"]


def test_model_queue_is_bounded():
    thread = ModelThread(max_queued=1)
    running, go = threading.Event(), threading.Event()
    results: list[object] = []

    # The calls note themselves as the model thread runs them: the order they ran in (the callers' threads
    # return in an order the OS picks).
    def slow() -> None:
        running.set()
        go.wait(10)
        results.append("first")

    first = threading.Thread(target=lambda: thread.call(slow))
    first.start()
    assert running.wait(10)
    second = threading.Thread(target=lambda: thread.call(lambda: results.append("second")))
    second.start()
    wait_until(lambda: thread.queued() == 1, "the second call to queue")
    with pytest.raises(QueueFull, match=r"1 model calls queued \(--max-queued-calls 1\); retry later"):
        thread.call(lambda: "third")
    assert status_for(QueueFull("x")).name == "RESOURCE_EXHAUSTED"
    go.set()
    first.join()
    second.join()
    assert results == ["first", "second"] and thread.queued() == 0
    assert thread.call(lambda: "after") == "after"
    thread.shutdown()


@pytest.mark.parametrize("flags, match", [(["--session-ttl", "0"], "--session-ttl"),
                                          (["--max-queued-calls", "0"], "--max-queued-calls")])
def test_bad_flags_exit_2_before_listening(model_dir, capsys, flags, match):
    from executor_service.__main__ import main
    assert main(["--model", str(model_dir), "--port", "0", *flags]) == 2
    assert match in capsys.readouterr().err
