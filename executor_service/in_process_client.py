"""An ExecutorClient (scheduler/executor/client.py) over an in-process Executor: no network, for tests and
benchmarks. It speaks the same messages as the gRPC server, through the same codec, and reports errors as a
remote executor would (RemoteError with the status name the gRPC edge would choose), so a scheduler cannot
tell it from the real thing except by speed.

Calls run the model on the caller's thread: inside an event loop each call blocks the loop for its
duration (fine for tests and benchmarks; a server uses the gRPC client). The *_now methods are the same
calls without asyncio, for the synchronous scheduling-policy tests.

Sessions are the Executor's own (leases are reaped only where something calls Executor.reap_lapsed: the
gRPC server's reaper thread; in process nothing expires unless a test does).
"""
from __future__ import annotations

from typing import Callable, Sequence, TypeVar

from executor_service.rpc import codec
from executor_service.executor import Executor
from tandem.errors import RemoteError, TandemError
from tandem.executor.v1 import executor_pb2 as epb
from tandem.status_map import status_for

T = TypeVar("T")


class InProcessExecutorClient:
    def __init__(self, executor: Executor, address: str = "in-process") -> None:
        self.executor = executor
        self.address = address

    # ----------------------------------------------------------------- synchronous
    def info_now(self) -> epb.GetInfoResponse:
        return self._relay(lambda: codec.info_to_pb(self.executor.info()))

    def unified_decode_now(self, items: Sequence[epb.UnifiedItem], session_id: str = "", *,
                           release: Sequence[str] = ()) -> epb.UnifiedDecodeResponse:
        """release: the request's release_cache_ids (freed before the items run; the response's `released`)."""
        def run() -> epb.UnifiedDecodeResponse:  # per-item statuses, exactly as the gRPC servicer builds them
            ex, ids = self.executor, codec.release_ids_from_pb(release)
            results, dtypes = codec.run_unified(
                items, lambda decoded: ex.unified_decode(decoded, session_id, ids),
                lambda cache_id: ex.cache_ref(cache_id, session_id),
                lambda: ex.release_cache(ids, session_id)[0] if ids else 0)
            return codec.unified_response_to_pb(results, dtypes, ex.kv_usage())
        return self._relay(run)

    def decode_now(self, items: Sequence[epb.DecodeItem], num_steps: int, session_id: str = "", *,
                   release: Sequence[str] = ()) -> epb.DecodeResponse:
        """release: as unified_decode_now's."""
        def run() -> epb.DecodeResponse:
            ex, ids = self.executor, codec.release_ids_from_pb(release)
            results, dtypes = codec.run_decode(
                items, lambda decoded: ex.decode(decoded, num_steps, session_id, ids),
                lambda cache_id: ex.cache_ref(cache_id, session_id),
                lambda: ex.release_cache(ids, session_id)[0] if ids else 0)
            return codec.decode_response_to_pb(results, dtypes, ex.kv_usage())
        return self._relay(run)

    def release_now(self, cache_ids: Sequence[str], session_id: str = "") -> epb.ReleaseCacheResponse:
        def run() -> epb.ReleaseCacheResponse:
            released, unknown = self.executor.release_cache(list(cache_ids), session_id)
            return codec.release_response_to_pb(released, unknown, self.executor.kv_usage())
        return self._relay(run)

    def create_caches_now(self, items: Sequence[epb.CreateCacheItem], session_id: str = "") -> epb.CreateCacheResponse:
        ex = self.executor
        return self._relay(lambda: codec.create_cache_response_to_pb(
            ex.create_caches(codec.create_cache_items_from_pb(items), session_id), ex.kv_usage()))

    def list_adapters_now(self) -> epb.ListAdaptersResponse:
        return self._relay(lambda: epb.ListAdaptersResponse(
            adapters=[codec.adapter_to_pb(a) for a in self.executor.list_adapters()]))

    # ----------------------------------------------------------------- ExecutorClient
    async def info(self) -> epb.GetInfoResponse:
        return self.info_now()

    async def unified_decode(self, items: Sequence[epb.UnifiedItem], session_id: str = "", *,
                             release: Sequence[str] = ()) -> epb.UnifiedDecodeResponse:
        return self.unified_decode_now(items, session_id, release=release)

    async def decode(self, items: Sequence[epb.DecodeItem], num_steps: int, session_id: str = "", *,
                     release: Sequence[str] = ()) -> epb.DecodeResponse:
        return self.decode_now(items, num_steps, session_id, release=release)

    async def release(self, cache_ids: Sequence[str], session_id: str = "") -> epb.ReleaseCacheResponse:
        return self.release_now(cache_ids, session_id)

    async def list_adapters(self) -> epb.ListAdaptersResponse:
        return self.list_adapters_now()

    async def create_caches(self, items: Sequence[epb.CreateCacheItem],
                            session_id: str = "") -> epb.CreateCacheResponse:
        return self.create_caches_now(items, session_id)

    async def open_session(self, client_name: str) -> epb.OpenSessionResponse:
        return self._relay(lambda: codec.session_lease_to_pb(self.executor.open_session(client_name)))

    async def keep_alive(self, session_id: str) -> epb.KeepAliveResponse:
        return self._relay(lambda: codec.keep_alive_to_pb(*self.executor.keep_alive(session_id)))

    async def close_session(self, session_id: str) -> epb.CloseSessionResponse:
        ex = self.executor
        return self._relay(lambda: codec.close_session_to_pb(ex.close_session(session_id), ex.kv_usage()))

    async def healthy(self) -> bool:
        return True  # constructed only around a loaded executor

    async def close(self) -> None:
        pass

    @staticmethod
    def _relay(call: Callable[[], T]) -> T:
        try:
            return call()
        except TandemError as exc:
            raise RemoteError(status_for(exc).name, str(exc)) from exc
