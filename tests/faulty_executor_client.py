"""An ExecutorClient that wraps a real one (usually the in-process client) and injects faults at the seam the
scheduler sees: no answer (UNAVAILABLE), a late answer, an error status for a step or for one item of it, a
slow GetInfo, a restart (new instance id, every cache gone). Scripted per call, so tests are deterministic.

It can also play the executor side of the issue-11 contract that the in-process executor does not have yet:
sessions with ids (calls naming an unknown one are NOT_FOUND), per-item statuses, max_adapters_on_device,
and sampling registered with the cache (an unset `sampling` on an existing cache = the one registered last).
Everything sent is recorded for the tests to inspect."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc

from scheduler.executor.client import ExecutorUnreachable
from tandem.errors import RemoteError
from tandem.executor.v1 import executor_pb2 as epb


@dataclass
class Fault:
    kind: str  # "unavailable" | "late" | "status" | "late-status" (the error status after delay_s)
    status: str = "INTERNAL"  # for "status": the gRPC status name the executor answers with
    delay_s: float = 0.0  # for "late"
    message: str = ""  # for "status": the error message (default: "injected <status>")


@dataclass
class Sent:
    """One UnifiedDecode as the scheduler sent it."""

    items: list[epb.UnifiedItem]
    session_id: str


@dataclass
class FaultyExecutorClient:
    inner: object  # an ExecutorClient (with *_now methods when used synchronously)
    address: str = "faulty"
    step_faults: dict[int, Fault] = field(default_factory=dict)  # UnifiedDecode call index (from 0) -> fault
    # (UnifiedDecode call index, item index) -> status name: that item fails alone (the new executor's rule)
    item_faults: dict[tuple[int, int], str] = field(default_factory=dict)
    info_faults: list[str] = field(default_factory=list)  # GetInfo answers these statuses first, one per call
    # UnifiedDecode call index -> an action run just before that call (e.g. restart, expire_sessions)
    before_step: dict[int, Callable[[], None]] = field(default_factory=dict)
    down: bool = False  # while True every call is unreachable (the executor is gone)
    steps: int = 0  # UnifiedDecode calls seen
    # the executor of the issue-11 contract, played here
    sessions: bool = False  # OpenSession works (else UNIMPLEMENTED) and calls must name a live session
    session_ttl_ms: int = 0
    registered_sampling: bool = False  # advertise and play "registered_sampling"
    max_adapters_on_device: int = 0
    max_batch_tokens: int = 0  # 0 = the inner executor's
    hidden_adapters: set[str] = field(default_factory=set)  # GetInfo leaves these out (as if not loaded)
    hidden_capabilities: set[str] = field(default_factory=set)  # GetInfo leaves these out (an older executor)
    instance_id: str = ""
    sent: list[Sent] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)  # every method called, in order
    live_sessions: dict[str, str] = field(default_factory=dict)  # session id -> client name
    _registered: dict[str, epb.UnifiedItem] = field(default_factory=dict)  # cache id -> its sampling holder
    _owner: dict[str, str] = field(default_factory=dict)  # cache id -> session id

    # ----------------------------------------------------------------- scripted events
    def restart(self) -> None:
        """The executor process restarts: a new instance id; every session and cache is gone."""
        self.instance_id = uuid.uuid4().hex
        self.live_sessions.clear()
        self._registered.clear()
        self.inner.release_now(list(self._owner))
        self._owner.clear()

    def expire_sessions(self) -> None:
        """Every lease runs out: the sessions and their caches are gone."""
        for sid in list(self.live_sessions):
            self._close(sid)

    # ----------------------------------------------------------------- the seam
    def _check_down(self) -> None:
        if self.down:
            raise ExecutorUnreachable(f"executor {self.address} is unreachable (UNAVAILABLE: injected)")

    def _check_session(self, session_id: str) -> None:
        if self.sessions and session_id and session_id not in self.live_sessions:
            raise RemoteError("NOT_FOUND", f"executor {self.address}: unknown or expired session")

    def _fault(self) -> Fault | None:
        self._check_down()
        action = self.before_step.get(self.steps)
        if action is not None:
            action()
        fault = self.step_faults.get(self.steps)
        self.steps += 1
        if fault is not None and fault.kind == "unavailable":
            self.down = True  # it stays gone until the test brings it back
            self._check_down()
        if fault is not None and fault.kind == "status":
            raise RemoteError(fault.status, f"executor {self.address}: {fault.message or 'injected ' + fault.status}")
        return fault

    def _info(self, info: epb.GetInfoResponse) -> epb.GetInfoResponse:
        out = epb.GetInfoResponse()
        out.CopyFrom(info)
        out.instance_id = self.instance_id
        out.max_adapters_on_device = self.max_adapters_on_device
        out.session_ttl_ms = self.session_ttl_ms
        out.max_batch_tokens = self.max_batch_tokens or out.max_batch_tokens
        kept = [a for a in out.adapters if a not in self.hidden_adapters]
        del out.adapters[:]
        out.adapters.extend(kept)
        # The capabilities of the contract this fake plays are its own, whatever the inner executor has.
        caps = [c for c in out.capabilities
                if c not in ("registered_sampling", "sessions", "prefix_caching", "create_cache", "kv_events",
                             "multi_step_decode", "release_with_step")  # (every step is a UnifiedDecode here: the faults are on it)
                and c not in self.hidden_capabilities]
        del out.capabilities[:]
        out.capabilities.extend(caps + (["registered_sampling"] if self.registered_sampling else []))
        return out

    def _unified(self, items: Sequence[epb.UnifiedItem], session_id: str) -> epb.UnifiedDecodeResponse:
        step = self.steps - 1
        self.sent.append(Sent([_copy(i) for i in items], session_id))
        self.calls.append("UnifiedDecode")
        self._check_session(session_id)
        adapters = {i.adapter for i in items if i.adapter}
        if self.max_adapters_on_device and len(adapters) > self.max_adapters_on_device:
            raise RemoteError("INVALID_ARGUMENT", f"executor {self.address}: {len(adapters)} adapters in one call")
        total = sum(len(i.token_ids) for i in items)
        if self.max_batch_tokens and total > self.max_batch_tokens:
            raise RemoteError("INVALID_ARGUMENT", f"executor {self.address}: {total} tokens in one call")
        failing = {n: name for (s, n), name in self.item_faults.items() if s == step}
        run = []
        for n, item in enumerate(items):
            if n in failing:
                continue
            item = _copy(item)
            if self.registered_sampling and item.cache_id and not item.HasField("sampling"):
                held = self._registered.get(item.cache_id)
                if held is not None:
                    item.sampling.CopyFrom(held.sampling)
            run.append((n, item))
        resp = self.inner.unified_decode_now([i for _, i in run]) if run else None
        results: list[epb.UnifiedResult | None] = [None] * len(items)
        for (n, item), res in zip(run, resp.results if resp else []):
            results[n] = res
            self._owner[res.cache.cache_id] = session_id
            if item.is_final_chunk and item.HasField("sampling"):
                self._registered[res.cache.cache_id] = item
        for n, name in failing.items():
            code = getattr(grpc.StatusCode, name).value[0]
            results[n] = epb.UnifiedResult(cache=epb.CacheRef(cache_id=items[n].cache_id, seq_len=items[n].pos_offset),
                                           status=epb.ItemStatus(code=code, message=f"injected {name}"))
        kv = resp.kv if resp else self.inner.info_now().kv
        return epb.UnifiedDecodeResponse(results=results, kv=kv)

    def _release(self, cache_ids: Sequence[str], session_id: str) -> epb.ReleaseCacheResponse:
        self.calls.append("ReleaseCache")
        self._check_session(session_id)
        for c in cache_ids:
            self._owner.pop(c, None)
            self._registered.pop(c, None)
        return self.inner.release_now(cache_ids)

    def _close(self, session_id: str) -> int:
        self.live_sessions.pop(session_id, None)
        mine = [c for c, s in self._owner.items() if s == session_id]
        for c in mine:
            self._owner.pop(c)
            self._registered.pop(c, None)
        if mine:
            self.inner.release_now(mine)
        return len(mine)

    # synchronous (policy tests)
    def info_now(self) -> epb.GetInfoResponse:
        self._check_down()
        return self._info(self.inner.info_now())

    def unified_decode_now(self, items: Sequence[epb.UnifiedItem], session_id: str = "") -> epb.UnifiedDecodeResponse:
        self._fault()
        return self._unified(items, session_id)

    def release_now(self, cache_ids: Sequence[str], session_id: str = "") -> epb.ReleaseCacheResponse:
        self._check_down()
        return self._release(cache_ids, session_id)

    # ExecutorClient
    async def info(self) -> epb.GetInfoResponse:
        self._check_down()
        self.calls.append("GetInfo")
        if self.info_faults:
            name = self.info_faults.pop(0)
            raise RemoteError(name, f"executor {self.address}: injected {name}")
        return self._info(await self.inner.info())

    async def unified_decode(self, items: Sequence[epb.UnifiedItem], session_id: str = "",
                             release: Sequence[str] = ()) -> epb.UnifiedDecodeResponse:
        # (this fake plays an executor without "release_with_step": releases must come as ReleaseCache calls)
        assert not release, "release_cache_ids sent to an executor that does not list release_with_step"
        fault = self._fault()
        # a network client yields to the event loop while the step runs; so does this one (once, at least)
        await asyncio.sleep(fault.delay_s if fault is not None and fault.kind in ("late", "late-status") else 0)
        if fault is not None and fault.kind == "late-status":  # the step fails after a while: nothing written
            raise RemoteError(fault.status, f"executor {self.address}: {fault.message or 'injected ' + fault.status}")
        return self._unified(items, session_id)

    async def release(self, cache_ids: Sequence[str], session_id: str = "") -> epb.ReleaseCacheResponse:
        self._check_down()
        return self._release(cache_ids, session_id)

    async def list_adapters(self) -> epb.ListAdaptersResponse:
        self._check_down()
        return await self.inner.list_adapters()

    async def open_session(self, client_name: str) -> epb.OpenSessionResponse:
        self._check_down()
        self.calls.append("OpenSession")
        if not self.sessions:
            raise RemoteError("UNIMPLEMENTED", f"executor {self.address}: Method not implemented!")
        sid = uuid.uuid4().hex
        self.live_sessions[sid] = client_name
        return epb.OpenSessionResponse(session_id=sid, lease_ttl_ms=self.session_ttl_ms, instance_id=self.instance_id)

    async def keep_alive(self, session_id: str) -> epb.KeepAliveResponse:
        self._check_down()
        self.calls.append("KeepAlive")
        if session_id not in self.live_sessions:
            raise RemoteError("NOT_FOUND", f"executor {self.address}: unknown or expired session")
        return epb.KeepAliveResponse(lease_ttl_ms=self.session_ttl_ms,
                                     caches=sum(1 for s in self._owner.values() if s == session_id))

    async def close_session(self, session_id: str) -> epb.CloseSessionResponse:
        self._check_down()
        self.calls.append("CloseSession")
        released = self._close(session_id)
        return epb.CloseSessionResponse(released=released, kv=self.inner.info_now().kv)

    async def healthy(self) -> bool:
        return not self.down

    async def close(self) -> None:
        pass


def _copy(item: epb.UnifiedItem) -> epb.UnifiedItem:
    out = epb.UnifiedItem()
    out.CopyFrom(item)
    return out
