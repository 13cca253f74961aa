"""ExecutorService over gRPC: each RPC is proto -> domain -> one Executor call -> proto.

Errors are raised as domain exceptions and turned into status codes by the interceptor
(executor_service/rpc/interceptor.py); nothing here chooses a status code.
"""
from __future__ import annotations

import functools
from typing import Callable

from executor_service.rpc import codec
from executor_service.executor import Executor
from executor_service.metrics.op_stats import RpcMetrics
from executor_service.rpc.kv_event_stream import DEFAULT_SUMMARY_MS, MIN_SUMMARY_MS, kv_event_stream
from executor_service.kv.transfer.rpc import KvTransferRpc
from executor_service.model_thread import ModelThread
from executor_service.rpc.reply_size import check_reply_size
from executor_service.types import CacheRef
from tandem.errors import DeadlineExceeded, InvalidRequest, Unavailable
from tandem.executor.v1 import executor_pb2 as pb
from tandem.executor.v1 import executor_pb2_grpc as pb_grpc


def _on_model_thread(handler: Callable) -> Callable:
    """Runs the whole handler (proto conversion included: logits encoding touches torch) on the model
    thread; see executor_service/model_thread.py for why. Only RPCs that run the model use it: info,
    metrics, listings, sessions, truncate and release do no tensor math and must not queue behind a long
    Decode. The call's session (if the request names one) is held from arrival: it cannot lapse while the
    call waits in the queue (and an unknown session is NOT_FOUND before queueing).

    Once the call reaches the model thread, and before it runs, it is refused when its reply could not
    reach the caller: the caller's deadline has passed (while it queued), or the reply would be over the
    message size limit. A refused call changes nothing."""
    @functools.wraps(handler)
    def wrapper(self: "ExecutorServicer", request, context):
        def guarded(request, context):
            self._check_reply_possible(handler.__name__, request, context)
            return handler(self, request, context)
        session_id = getattr(request, "session_id", None)  # LoadAdapter has none
        if session_id is None:
            return self._thread.call(guarded, request, context)
        with self.ex.hold_session(session_id):
            return self._thread.call(guarded, request, context)
    return wrapper


class ExecutorServicer(pb_grpc.ExecutorServiceServicer):
    def __init__(self, rpc_metrics: RpcMetrics, thread: ModelThread, max_reply_bytes: int | None = None) -> None:
        self._executor: Executor | None = None
        self._draining = False
        self._rpc_metrics = rpc_metrics
        self._thread = thread
        self._max_reply_bytes = max_reply_bytes  # the server's send limit (--max-message-mb); None: no check
        self._transfer: KvTransferRpc | None = None

    def attach(self, executor: Executor) -> None:
        """Called once the model is loaded and warmed up; until then every RPC is UNAVAILABLE."""
        self._transfer = KvTransferRpc(executor, self._max_reply_bytes or 64 << 20)
        self._executor = executor

    def drain(self) -> None:
        self._draining = True

    @property
    def ex(self) -> Executor:
        if self._draining:
            raise Unavailable("the executor is shutting down; retry on another executor")
        if self._executor is None:
            raise Unavailable("the executor is still loading its model; wait for health SERVING")
        return self._executor

    def _check_reply_possible(self, method: str, request, context) -> None:
        remaining = context.time_remaining()  # None: the caller set no deadline
        if remaining is not None and remaining <= 0:
            raise DeadlineExceeded(f"the caller's deadline passed while this {method} waited for the model "
                                   "(other model calls ran first); it was not run: retry with a longer deadline")
        if self._max_reply_bytes is not None:
            check_reply_size(method, request, self.ex.model_config.vocab_size, self._max_reply_bytes)

    def GetInfo(self, request, context):
        return codec.info_to_pb(self.ex.info())

    @_on_model_thread
    def Prefill(self, request, context):
        ex = self.ex  # once per RPC: a drain that starts mid-call must not fail the work already done
        output, dtype = codec.output_from_pb(request.output)
        res = ex.prefill(list(request.token_ids), request.cache_id or None,
                         codec.sampling_from_pb(request.sampling), output, request.adapter, request.session_id)
        return pb.PrefillResponse(cache=codec.cache_to_pb(res.cache),
                                  output=codec.sequence_output_to_pb(res.output, dtype),
                                  cached_tokens=res.cached_tokens, kv=codec.kv_usage_to_pb(ex.kv_usage()))

    @_on_model_thread
    def Decode(self, request, context):
        ex = self.ex
        session, release = request.session_id, codec.release_ids_from_pb(request.release_cache_ids)
        results, dtypes = codec.run_decode(
            request.items, lambda items: ex.decode(items, request.num_steps, session, release),
            lambda cache_id: ex.cache_ref(cache_id, session),
            lambda: ex.release_cache(release, session)[0] if release else 0)
        return codec.decode_response_to_pb(results, dtypes, ex.kv_usage())

    @_on_model_thread
    def UnifiedDecode(self, request, context):
        ex = self.ex
        session, release = request.session_id, codec.release_ids_from_pb(request.release_cache_ids)
        results, dtypes = codec.run_unified(
            request.items, lambda items: ex.unified_decode(items, session, release),
            lambda cache_id: ex.cache_ref(cache_id, session),
            lambda: ex.release_cache(release, session)[0] if release else 0)
        return codec.unified_response_to_pb(results, dtypes, ex.kv_usage())

    @_on_model_thread
    def ForwardVerify(self, request, context):
        if not request.cache.cache_id:
            raise InvalidRequest("ForwardVerify needs {field} (run Prefill first)", "cache.cache_id")
        ex = self.ex
        output, dtype = codec.output_from_pb(request.output)
        res = ex.forward_verify(CacheRef(request.cache.cache_id, request.cache.seq_len),
                                list(request.token_ids), output, request.adapter, request.session_id)
        return pb.ForwardVerifyResponse(cache=codec.cache_to_pb(res.cache),
                                        positions=[codec.sequence_output_to_pb(p, dtype) for p in res.positions],
                                        kv=codec.kv_usage_to_pb(ex.kv_usage()))

    def TruncateCache(self, request, context):
        ex = self.ex
        ref = ex.truncate_cache(request.cache_id, request.new_len, request.session_id)
        return pb.TruncateCacheResponse(cache=codec.cache_to_pb(ref), kv=codec.kv_usage_to_pb(ex.kv_usage()))

    def ReleaseCache(self, request, context):
        ex = self.ex
        released, unknown = ex.release_cache(list(request.cache_ids), request.session_id)
        return codec.release_response_to_pb(released, unknown, ex.kv_usage())

    def GetMetrics(self, request, context):
        ex = self.ex
        return codec.metrics_to_pb(ex.metrics_snapshot(), ex.kv_usage(), self._rpc_metrics.snapshot(),
                                   ex.list_adapters(), ex.expert_load(), ex.prefix_stats(), ex.vision_stats())

    def CreateCache(self, request, context):  # no tensor math: hashing and block accounting only
        ex = self.ex
        results = ex.create_caches(codec.create_cache_items_from_pb(request.items), request.session_id)
        return codec.create_cache_response_to_pb(results, ex.kv_usage())

    def SubscribeKvEvents(self, request, context):
        interval_ms = request.summary_interval_ms or DEFAULT_SUMMARY_MS
        if interval_ms < MIN_SUMMARY_MS:
            raise InvalidRequest(f"{{field}} must be >= {MIN_SUMMARY_MS}, got {interval_ms}", "summary_interval_ms")
        ex = self.ex
        sub = ex.subscribe_kv_events()
        try:
            yield from kv_event_stream(sub, ex, interval_ms / 1000, lambda: context.is_active() and not self._draining)
        finally:
            sub.close()

    def ExportKv(self, request, context):  # copies under the model lock, chunk by chunk: not the model thread
        self.ex  # UNAVAILABLE while loading or draining
        yield from self._transfer.export(request, context)

    def ImportKv(self, request, context):  # waits on the network: never on the model thread
        self.ex
        return self._transfer.import_(request, context)

    @_on_model_thread  # moves weights to the device
    def LoadAdapter(self, request, context):
        return pb.LoadAdapterResponse(adapter=codec.adapter_to_pb(self.ex.load_adapter(request.name, request.path)))

    def UnloadAdapter(self, request, context):
        self.ex.unload_adapter(request.name)
        return pb.UnloadAdapterResponse()

    def ListAdapters(self, request, context):
        return pb.ListAdaptersResponse(adapters=[codec.adapter_to_pb(a) for a in self.ex.list_adapters()])

    def OpenSession(self, request, context):
        return codec.session_lease_to_pb(self.ex.open_session(request.client_name))

    def KeepAlive(self, request, context):
        return codec.keep_alive_to_pb(*self.ex.keep_alive(request.session_id))

    def CloseSession(self, request, context):
        ex = self.ex
        return codec.close_session_to_pb(ex.close_session(request.session_id), ex.kv_usage())

    def ListCaches(self, request, context):
        ex = self.ex
        return codec.list_caches_to_pb(ex.list_caches(request.session_id or None), ex.kv_usage())
