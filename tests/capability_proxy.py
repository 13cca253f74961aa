"""A gRPC proxy in front of a real executor that checks what a client sends against the capabilities it was
shown, and can play an older executor.

    with CapabilityProxy(executor.address, hide={caps.RELEASE_WITH_STEP}) as proxy:
        start a scheduler with --executor proxy.address ...
        assert proxy.violations == []

Every call of the executor's service (and grpc.health.v1) is forwarded as raw bytes, with its metadata and
deadline, and answered with the executor's answer or status. What it changes, to play an executor of a release
that lacked the `hide` capabilities: GetInfo answers without them, and the calls that are those capabilities
(CreateCache, SubscribeKvEvents, OpenSession ...) answer UNIMPLEMENTED, as a server without the method does.
What it records: for each request, the capabilities it relies on (`used`: a field or a call an executor without
the capability would ignore or not know); one the client was not shown is a violation, except the calls a
client may probe because their UNIMPLEMENTED has a fallback (`PROBES`). The table of what relies on what is
GATES below: a field added to the contract under a new capability belongs there.
"""
from __future__ import annotations

import threading
from collections import Counter
from concurrent import futures
from typing import Callable, Iterable, Iterator

import grpc
from grpc_health.v1 import health_pb2

from tandem import capabilities as caps
from tandem.executor.v1 import executor_pb2 as epb

_EXECUTOR = epb.DESCRIPTOR.services_by_name["ExecutorService"]
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)]

# Calls that are a capability (an executor without it has no such method, or does nothing useful with it).
CALLS = {"CreateCache": caps.CREATE_CACHE, "SubscribeKvEvents": caps.KV_EVENTS, "ImportKv": caps.KV_TRANSFER,
         "ExportKv": caps.KV_TRANSFER, "ForwardVerify": caps.FORWARD_VERIFY, "TruncateCache": caps.TRUNCATE_CACHE,
         "OpenSession": caps.SESSIONS, "KeepAlive": caps.SESSIONS, "CloseSession": caps.SESSIONS}
# Calls a client may send without the capability listed: their UNIMPLEMENTED is the answer it falls back on (the
# scheduler: no session -> the anonymous one; no KV events -> routing on what it routed itself).
PROBES = frozenset({"OpenSession", "SubscribeKvEvents"})


def _unified(req: epb.UnifiedDecodeRequest) -> Iterator[str]:
    if req.release_cache_ids:
        yield caps.RELEASE_WITH_STEP
    for item in req.items:
        if item.draft_token_ids:
            yield caps.SPECULATIVE_DRAFTS
        if item.allowed_tokens:
            yield caps.TOKEN_MASKS
        if item.HasField("prompt_logprobs"):
            yield caps.PROMPT_LOGPROBS
        if item.HasField("pooling"):
            yield caps.POOLING
        if item.cache_id and item.is_final_chunk and not item.HasField("sampling"):
            yield caps.REGISTERED_SAMPLING  # (unset on an existing cache: the registered parameters)


def _decode(req: epb.DecodeRequest) -> Iterator[str]:
    if req.release_cache_ids:
        yield caps.RELEASE_WITH_STEP
    if req.num_steps > 1:
        yield caps.MULTI_STEP_DECODE
    for item in req.items:
        if item.draft_token_ids:
            yield caps.SPECULATIVE_DRAFTS
        if item.HasField("ngram_drafts") or item.max_tokens:
            yield caps.MULTI_STEP_DRAFTS


def _create(req: epb.CreateCacheRequest) -> Iterator[str]:
    if any(item.HasField("prompt_logprobs") for item in req.items):
        yield caps.PROMPT_LOGPROBS


# rpc -> (request type, the capabilities a request's fields rely on)
GATES: dict[str, tuple[type, Callable[..., Iterable[str]]]] = {
    "UnifiedDecode": (epb.UnifiedDecodeRequest, _unified), "Decode": (epb.DecodeRequest, _decode),
    "CreateCache": (epb.CreateCacheRequest, _create)}


class CapabilityProxy:
    """.address: where to point the client; .used: Counter of capabilities the client's requests relied on;
    .violations: what it sent that the capabilities it was shown do not allow; .probed: probes answered
    UNIMPLEMENTED; .calls: Counter of rpc names."""

    def __init__(self, upstream: str, hide: Iterable[str] = ()) -> None:
        self.upstream, self.hide = upstream, frozenset(hide)
        self.used: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.probed: Counter[str] = Counter()
        self.violations: list[str] = []
        self.shown: frozenset[str] | None = None  # the capabilities the last GetInfo answer listed
        self._lock = threading.Lock()
        self._channel = grpc.insecure_channel(upstream, options=_OPTIONS)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="proxy"),
                                   handlers=[_Handler(self)], options=_OPTIONS)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def close(self) -> None:
        self._server.stop(grace=None)
        self._channel.close()

    def __enter__(self) -> "CapabilityProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def inspect(self, rpc: str, request: bytes) -> bool:
        """Records what the request relies on; False: answer UNIMPLEMENTED (a call this executor plays without)."""
        needed = {CALLS[rpc]} if rpc in CALLS else set()
        if rpc in GATES:
            message_type, gates = GATES[rpc]
            needed.update(gates(message_type.FromString(request)))
        with self._lock:
            self.calls[rpc] += 1
            self.used.update(needed)
            shown = self.shown if self.shown is not None else frozenset()
            missing = sorted(needed - shown)
            if missing and not (rpc in PROBES and set(missing) == {CALLS[rpc]}):
                self.violations.append(f"{rpc} relied on {missing}, which GetInfo did not list")
            if rpc in CALLS and CALLS[rpc] in self.hide:
                self.probed[rpc] += rpc in PROBES
                return False
        return True

    def shown_info(self, answer: bytes) -> bytes:
        info = epb.GetInfoResponse.FromString(answer)
        kept = [c for c in info.capabilities if c not in self.hide]
        del info.capabilities[:]
        info.capabilities.extend(kept)
        with self._lock:
            self.shown = frozenset(kept)
        return info.SerializeToString()


def _timeout(context: grpc.ServicerContext) -> float | None:
    """The call's time left (a call without a deadline reads as 0 here: then none)."""
    left = context.time_remaining()
    return left if 0 < left < 1e7 else None


def _forwarded_metadata(context: grpc.ServicerContext) -> list[tuple[str, str | bytes]]:
    return [(k, v) for k, v in context.invocation_metadata() if k != "user-agent" and not k.startswith(":")]


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, proxy: CapabilityProxy) -> None:
        self.proxy = proxy
        self.methods = {f"/{service.full_name}/{m.name}": (m.name, m.server_streaming)
                        for service in (_EXECUTOR, _HEALTH) for m in service.methods if not m.client_streaming}

    def service(self, details: grpc.HandlerCallDetails):
        if details.method not in self.methods:
            return None  # UNIMPLEMENTED
        rpc, streaming = self.methods[details.method]
        proxy, method = self.proxy, details.method

        def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
            if not proxy.inspect(rpc, request):
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
            try:
                answer = proxy._channel.unary_unary(method)(request, timeout=_timeout(context),
                                                            metadata=_forwarded_metadata(context))
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")
            return proxy.shown_info(answer) if rpc == "GetInfo" else answer

        def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            if not proxy.inspect(rpc, request):
                context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {method}")
            call = proxy._channel.unary_stream(method)(request, timeout=_timeout(context),
                                                       metadata=_forwarded_metadata(context))
            context.add_callback(call.cancel)
            try:
                yield from call
            except grpc.RpcError as exc:
                if context.is_active():
                    context.abort(exc.code(), exc.details() or "")

        if streaming:
            return grpc.unary_stream_rpc_method_handler(stream)
        return grpc.unary_unary_rpc_method_handler(unary)
